"""The in-cluster Redis of deploy/redis, run as its container would run it: the same shell
script and the same password from the dev Secret, with only its paths and port moved to a
private directory and a free loopback port. It must start, refuse clients without the
password, accept the registry URL that gateways and shims are given, and keep no state."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError
from redis.retry import Retry

from tests._redis import ping
from tests._tools import free_port, require_binary
from tests.deploy._checks import environment, rendered
from tests.deploy._k8s import secret_values


def _moved(script: str, tmp_path: Path, port: int) -> str:
    """The script with the container's paths and port replaced (each must be there)."""
    for old, new in (
        ("/run/redis", str(tmp_path / "run")),
        ("/data", str(tmp_path / "data")),
        ("port 6379", f"port {port}"),
        ("bind * -::*", "bind 127.0.0.1"),
    ):
        assert old in script, f"the Redis script no longer has {old!r}"
        script = script.replace(old, new)
    return script


def test_the_dev_redis_starts_with_its_password_and_no_persistence(tmp_path: Path) -> None:
    server = require_binary("redis-server", "the in-cluster Redis's command is run for real")
    r = rendered("overlays/dev")
    deployment = r.find("Deployment", "pdgate-redis")
    assert deployment is not None
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["sh", "-c"]
    port = free_port()
    (tmp_path / "run").mkdir()
    (tmp_path / "data").mkdir()
    env = environment(r, deployment, container, [])
    password = env["REDIS_PASSWORD"]
    env["PATH"] = f"{Path(server).parent}:{os.environ['PATH']}"
    proc = subprocess.Popen(
        ["sh", "-c", _moved(container["args"][0], tmp_path, port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    secret = r.find("Secret", "pdgate-registry")
    assert secret is not None
    url = secret_values(secret)["url"].replace("pdgate-redis:6379", f"127.0.0.1:{port}")
    # No retries: a refused AUTH is an answer, not something to retry for seconds.
    once = Retry(NoBackoff(), 0)
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, retry=once)
    anonymous = redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2, retry=once
    )
    try:
        deadline = time.monotonic() + 10
        while not ping(url):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "Redis did not answer"
            time.sleep(0.05)
        with pytest.raises(AuthenticationError):
            anonymous.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        conf = tmp_path / "run" / "redis.conf"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600, "the password file is private"
        assert password in conf.read_text()
    finally:
        client.close()
        anonymous.close()
        proc.terminate()
        proc.wait(timeout=10)
    assert not any((tmp_path / "data").iterdir()), "Redis wrote state to /data"
