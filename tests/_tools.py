"""Outside programs the tests drive (Prometheus, Chromium, ...): found on PATH, or the test
is skipped on a developer's machine and fails under CI (``CI=true``), so a pipeline missing
one cannot go green by skipping."""

from __future__ import annotations

import os
import shutil
import socket

import pytest


def require_binary(name: str, why: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is required ({why}); `make test` installs it"
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
