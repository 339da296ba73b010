"""Fixtures of the API tests."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests._cluster import ThreadedCluster, openai_client
from tests.gateway.api._fronts import Stack, front_stack


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A prefill, a decode and two gateways, each its own process, for one test module."""
    with front_stack(redis_url, tmp_path_factory.mktemp(request.module.__name__)) as s:
        yield s


@pytest.fixture
def client(cluster: ThreadedCluster) -> openai.OpenAI:
    """The official client against the test module's own `cluster` fixture."""
    return openai_client(cluster.url)
