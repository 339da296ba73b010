"""Fixtures shared by every test package: real Redis servers.

Without Redis (or the ``redis-server`` binary) the tests that need one are skipped on a
developer machine and fail under CI (``CI=true``), so a misconfigured pipeline cannot go
green by skipping its Redis tests.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterator
from typing import NoReturn

import pytest
from redis.exceptions import RedisError

from tests._cluster import Processes, Subprocess, registry_env
from tests._redis import (
    RedisServer,
    RedisServerError,
    SentinelGroup,
    delete_prefix,
    find_shared_redis,
)


def _redis_unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(f"Redis is required under CI=true: {reason}", pytrace=False)
    pytest.skip(f"no Redis: {reason}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a Redis shared by the session; pair it with `registry_prefix`."""
    try:
        url, server = find_shared_redis()
    except RedisServerError as exc:
        _redis_unavailable(str(exc))
    try:
        yield url
    finally:
        if server is not None:
            server.close()


@pytest.fixture
def registry_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test (or concurrent CI job) uses; its keys are deleted after."""
    prefix = f"pdgate-test:{uuid.uuid4().hex}"
    yield prefix
    try:
        delete_prefix(redis_url, prefix)
    except (RedisError, OSError) as exc:
        warnings.warn(f"could not clean up Redis keys {prefix}:*: {exc}", stacklevel=1)


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server owned by this test: it may `stop()` and `start()` it (same port)."""
    server = RedisServer()
    try:
        server.start()
    except RedisServerError as exc:
        server.close()
        _redis_unavailable(str(exc))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    """A primary, a replica and three sentinels of this test's own (`SentinelGroup`)."""
    group = SentinelGroup()
    try:
        group.start()
    except RedisServerError as exc:
        group.close()
        _redis_unavailable(str(exc))
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def procs() -> Iterator[list[Subprocess]]:
    """`pdgate` child processes a test started; killed afterwards whatever happened."""
    started: list[Subprocess] = []
    yield started
    for p in started:
        p.kill()


@pytest.fixture
def processes(redis_url: str, registry_prefix: str, procs: list[Subprocess]) -> Processes:
    """`pdgate` shims and gateways that register in a real Redis, under a key prefix of
    their own."""
    return Processes(procs, registry_env(redis_url, registry_prefix))
