"""Redis with a password (``requirepass``) and with TLS (``rediss://``), real servers: the
fleet works with the credentials and fails loudly at start-up without them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests._cluster import Subprocess, gateway_url, get_instances, refused, start, wait_for
from tests._redis import RedisServer
from tests._tools import require_binary

MODEL = "sim-llama-3.1-8b"


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    openssl = require_binary("openssl", "it makes the TLS test's certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(params=["requirepass", "requirepass+tls"])
def secured(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    require_binary("redis-server", "a private Redis with a password")
    tls = request.getfixturevalue("tls_files") if "tls" in request.param else None
    server = RedisServer(password="s3cret-pw", tls=tls)
    try:
        server.start()
    except Exception:
        server.close()
        raise
    yield server
    server.close()


def _env(url: str) -> dict[str, str]:
    return {
        "PDGATE_REGISTRY_URL": url,
        "PDGATE_REGISTRY_TTL_S": "1.0",
        "PDGATE_REGISTRY_HEARTBEAT_INTERVAL_S": "0.25",
        "PDGATE_REGISTRY_POLL_INTERVAL_S": "0.25",
    }


def test_the_fleet_works_with_credentials(secured: RedisServer, procs: list[Subprocess]) -> None:
    env = _env(secured.url)
    shim = ["shim", "--host", "127.0.0.1", "--port", "0"]
    start(procs, [*shim, "--role", "prefill"], env)
    start(procs, [*shim, "--role", "decode"], env)
    url = gateway_url(start(procs, ["gateway", "--host", "127.0.0.1", "--port", "0"], env))
    wait_for(lambda: len(get_instances(url)) == 2, what="instances registered")
    resp = httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
    )
    assert resp.status_code == 200
    health = httpx.get(url + "/health").json()
    assert health["registry"] == "ok" and health["fleet"]["degraded"] is False


@pytest.mark.parametrize("command", ["shim", "gateway"])
def test_without_the_password_start_up_fails_loudly(secured: RedisServer, command: str) -> None:
    wrong = secured.url.replace(":s3cret-pw@", ":wrong@")
    for url in (wrong, wrong.replace(":wrong@", "")):
        out = refused(
            [command, "--port", "0"],
            "Redis refused the credentials",
            env={**_env(url), "PATH": "/usr/bin:/bin"},
        )
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "s3cret-pw" not in out.stderr + out.stdout  # the password is never logged
