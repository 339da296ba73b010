"""Client API keys (hashed), per-key groups and rate limits, the admin token, and refusing an
exposed gateway without keys: through real sockets and the official openai client."""

from __future__ import annotations

import base64
import math
from pathlib import Path

import httpx
import openai
import pytest

from pdgate.gateway.admission.auth import (
    ADMIN_CHALLENGE,
    AdminUnauthorized,
    Forbidden,
    KeyRing,
    basic_password,
    digest,
    parse_keys,
)
from tests._cluster import ThreadedCluster, keyed_cluster, refused

MODEL = "sim-llama-3.1-8b"


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_keys_gate_every_client_endpoint(tmp_path: Path) -> None:
    keys = (
        f"# team keys, stored as digests\nsha256:{digest('sk-team').hex()} name=team\n"
        f"sha256:{digest('sk-slow').hex()} name=slow rpm=2\n"
    )
    with keyed_cluster(tmp_path, keys, api_keys=["sk-env"], admin_token="adm-1") as c:
        for key in ("sk-env", "sk-team"):
            out = _client(c.url, key).completions.create(model=MODEL, prompt="hi", max_tokens=3)
            assert out.choices[0].text
            assert [m.id for m in _client(c.url, key).models.list()] == [MODEL]
        with pytest.raises(openai.AuthenticationError) as info:
            _client(c.url, "sk-wrong").completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        missing = httpx.post(c.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(c.url + "/v1/models").status_code == 401

        # Per-key rate limit: 429 with Retry-After, others unaffected.
        slow = _client(c.url, "sk-slow")
        for _ in range(2):
            slow.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as limited:
            slow.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert limited.value.code == "rate_limit_exceeded"
        # Until the bucket of 2 a minute holds a token again: some 30 s, not a fixed second;
        # in the headers OpenAI's clients read and in the body.
        headers = limited.value.response.headers
        told = limited.value.response.json()["error"]["retry_after"]
        assert 25 < told <= 30 and headers["retry-after"] == str(math.ceil(told))
        assert headers["retry-after-ms"] == str(round(told * 1000))
        assert headers["x-ratelimit-limit-requests"] == "2"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"] == f"{told:g}s"
        _client(c.url, "sk-team").completions.create(model=MODEL, prompt="hi", max_tokens=1)

        # Admin endpoints need the admin token, not a client key.
        admin = c.url + "/admin/instances"
        assert httpx.get(admin, headers={"authorization": "Bearer sk-team"}).status_code == 401
        assert httpx.get(admin, headers={"authorization": "Bearer adm-1"}).status_code == 200
        assert httpx.get(c.url + "/health").status_code == 200  # probes need no key
        assert httpx.get(c.url + "/metrics").status_code == 200  # unless metrics_auth


def test_group_binding_from_a_keys_file(tmp_path: Path) -> None:
    with keyed_cluster(tmp_path, "sk-chat name=chat group=default\n") as c:
        auth = {"authorization": "Bearer sk-chat"}
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        assert httpx.post(c.url + "/v1/completions", json=body, headers=auth).status_code == 200
        other = httpx.post(
            c.url + "/v1/completions", json=body, headers={**auth, "x-pdgate-group": "batch"}
        )
        assert other.status_code == 403 and other.json()["error"]["code"] == "forbidden"


def test_metrics_can_require_the_admin_token() -> None:
    gateway = {"admin_token": "adm", "metrics_auth": True}
    with ThreadedCluster(prefills=1, decodes=1, gateway=gateway) as c:
        assert httpx.get(c.url + "/metrics").status_code == 401
        ok = httpx.get(c.url + "/metrics", headers={"authorization": "Bearer adm"})
        assert ok.status_code == 200 and "pdgate_requests_total" in ok.text


def _basic(credentials: bytes) -> str:
    return "Basic " + base64.b64encode(credentials).decode()


def test_the_admin_token_as_basic_credentials() -> None:
    """Browsers cannot send a Bearer header when they navigate to /dashboard: the admin token
    also works as the password of Basic credentials, under any user name."""
    ring = KeyRing([], admin_token="adm:1")
    for accepted in (
        "Bearer adm:1",
        _basic(b"ops:adm:1"),  # a password may hold colons: only the first one splits
        _basic(b":adm:1"),
        "basic  " + base64.b64encode(b"x:adm:1").decode() + " ",
    ):
        ring.admin(accepted)
    for wrong in (
        None,
        "",
        "Basic",
        "Basic !!!",  # not base64
        _basic(b"adm:1"),  # no user part: "adm" is taken as the user name
        _basic(b"adm:1:"),
        _basic(b"ops:adm:2"),
        _basic(b"ops:\xffadm:1"),  # not UTF-8
        "Digest adm:1",
        "Bearer " + _basic(b"ops:adm:1"),
    ):
        with pytest.raises(AdminUnauthorized) as info:
            ring.admin(wrong)
        assert info.value.response().status_code == 401
        assert info.value.response().headers["www-authenticate"] == ADMIN_CHALLENGE
    assert basic_password(_basic(b"u:p:q")) == "p:q"
    assert basic_password(_basic(b"u:")) is None

    KeyRing([]).admin(_basic(b"ops:anything"))  # no token, no keys: open
    with pytest.raises(Forbidden):  # a client key never opens the admin endpoints
        KeyRing(parse_keys(["sk-a"])).admin(_basic(b"ops:sk-a"))


def test_keys_file_errors_name_the_line() -> None:
    with pytest.raises(ValueError, match="keys:2: rpm must be a positive integer"):
        parse_keys(["sk-a", "sk-b rpm=0"])
    with pytest.raises(ValueError, match="unknown option 'team'"):
        parse_keys(["sk-a team=x"])
    assert parse_keys([f"sha256:{digest('k').hex()} name=n"])[0].digest == digest("k")


def test_an_exposed_gateway_without_keys_refuses_to_start() -> None:
    refused(
        ["gateway", "--host", "0.0.0.0", "--port", "0"],
        "refusing to listen on 0.0.0.0 without client API keys",
    )
