"""A real ``pdgate gateway`` in front of stock vLLM 0.32 servers running NixlConnector,
NixlPushConnector and MooncakeConnector, each a fake (`_vllm_connectors`) that checks every
leg it is sent field by field against vLLM's source and its proxies (the rules and the files
they come from are in its docstring), holds a prefill's blocks as the connector does, and
counts how they were freed. No machine here runs NIXL or Mooncake: these fakes are what
stands in for them (docs/vllm.md says what ran).

Each test ends with nothing held: the gateway's counts (``/health``, ``/admin/instances``)
back to zero and no prefill blocks left at the fakes, and no leg that broke a rule.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from tests._cluster import Subprocess, counts_released, gateway_url, get_instances, start, wait_for
from tests.gateway.placement._vllm_connectors import ConnectorServer
from tests.registry._stock_server import FAST_PROBES, completion_text

CONNECTORS = ["nixl", "nixl_push", "mooncake"]


@pytest.fixture
def model() -> str:
    return f"stock-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fakes() -> Iterator[list[ConnectorServer]]:
    started: list[ConnectorServer] = []
    yield started
    for server in started:
        server.kill()


@dataclass
class Fleet:
    """A gateway and the fake servers behind it."""

    url: str
    prefills: list[ConnectorServer]
    decodes: list[ConnectorServer]

    @property
    def servers(self) -> list[ConnectorServer]:
        return [*self.prefills, *self.decodes]

    def settled(self) -> None:
        """Nothing held anywhere, and every leg was as vLLM's source wants it."""
        wait_for(lambda: counts_released(self.url), 10, "the gateway's counts back to 0")
        health = httpx.get(self.url + "/health", timeout=5).json()
        assert (health["open_streams"], health["inflight"], health["queued"]) == (0, 0, 0)
        assert health["decode_waiting"] == 0
        for server in self.prefills:
            wait_for(lambda s=server: s.stats()["held"] == 0, 10, "the prefill's blocks freed")
        for server in self.servers:
            stats = server.stats()
            assert stats["violations"] == [], stats["violations"]
            assert stats["now"].get("decode", 0) == 0 and stats["now"].get("prefill", 0) == 0


def _spec(server: ConnectorServer, capacity: int) -> str:
    spec = f"{server.url} connector={server.connector} capacity={capacity}"
    if server.connector == "mooncake" and server.role == "prefill":
        spec += f" bootstrap={server.side}"
    return spec


def _fleet(
    procs: list[Subprocess],
    fakes: list[ConnectorServer],
    connector: str,
    model: str,
    *,
    prefills: int = 1,
    decodes: int = 1,
    prefill_capacity: int = 2,
    decode_capacity: int = 4,
    ttft_s: float = 10.0,
    **options: Any,
) -> Fleet:
    ps = [ConnectorServer(connector, "prefill", model, **options).start() for _ in range(prefills)]
    ds = [ConnectorServer(connector, "decode", model, **options).start() for _ in range(decodes)]
    fakes += [*ps, *ds]
    args = ["gateway", "--port", "0"]
    for p in ps:
        args += ["--prefill", _spec(p, prefill_capacity)]
    for d in ds:
        args += ["--decode", _spec(d, decode_capacity)]
    env = {**FAST_PROBES, "PDGATE_GATEWAY_TTFT_TIMEOUT_S": str(ttft_s)}
    url = gateway_url(start(procs, args, env))
    wait_for(lambda: len(get_instances(url)) == prefills + decodes, 10, "all listed")
    return Fleet(url, ps, ds)


def _complete(
    url: str, body: dict[str, Any], *, chat: bool = False, timeout: float = 30
) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        return httpx.post(url + path, json=body, timeout=timeout)
    with httpx.stream("POST", url + path, json=body, timeout=timeout) as resp:
        resp.read()
        return resp


def _text(resp: httpx.Response, *, chat: bool = False) -> str:
    assert resp.status_code == 200, resp.text
    if not resp.text.startswith("data:"):
        choice = resp.json()["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"])
    lines = [line for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines
    parts = []
    for line in lines[:-1]:
        event = orjson.loads(line.removeprefix("data: "))
        assert "error" not in event, event
        for choice in event["choices"]:
            parts.append(choice["delta"].get("content") or "" if chat else choice["text"])
    return "".join(parts)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_each_leg_is_what_the_connector_takes_and_nothing_stays_held(
    procs: list[Subprocess], fakes: list[ConnectorServer], model: str, connector: str
) -> None:
    fleet = _fleet(procs, fakes, connector, model, prefill_s=0.3)
    for i, stream in enumerate((True, False, True)):
        prompt = f"hello {connector} {i}"
        body = {"model": model, "prompt": prompt, "max_tokens": 5, "stream": stream}
        if i == 2:
            body["min_tokens"] = 2  # not for the prefill leg (max_tokens 1): the decode's
        assert _text(_complete(fleet.url, body)) == completion_text(prompt, 5)
    messages = [{"role": "user", "content": f"chat {connector}"}]
    chat = {"model": model, "messages": messages, "max_tokens": 4}
    assert _text(_complete(fleet.url, chat, chat=True), chat=True) == completion_text(
        f"chat {connector}", 4
    )
    fleet.settled()
    (prefill,), (decode,) = fleet.prefills, fleet.decodes
    pstats, dstats = prefill.stats(), decode.stats()
    assert pstats["counts"]["prefill_legs"] == 4
    freed = {"nixl": "read", "nixl_push": "push", "mooncake": "pull"}[connector]
    assert pstats["freed"] == {freed: 4}  # each request's blocks taken by its decode
    assert dstats["counts"]["decode_done"] == 4
    bodies = dstats["decode_bodies"]
    assert [b["max_tokens"] for b in bodies] == [5, 5, 5, 4]  # the client's, not the prefill's
    assert bodies[2]["min_tokens"] == 2 and all(b["stream"] is True for b in bodies)
    if connector == "nixl_push":
        # The first request to the prefill taught the gateway its engine and side channel:
        # the later ones' decode legs went with their prefill legs, and the decodes
        # registered with the prefill while it computed (0.3 s here).
        assert pstats["counts"].get("registered_while_prefilling", 0) >= 3


@pytest.mark.parametrize("connector", CONNECTORS)
def test_the_queue_keeps_a_stock_prefill_to_its_slots_and_sheds_at_the_deadline(
    procs: list[Subprocess], fakes: list[ConnectorServer], model: str, connector: str
) -> None:
    """Capacity 1: never two prefill legs inside the prefill at once (it would queue them);
    a prefill slower than the TTFT deadline is abandoned, vLLM aborts it (blocks freed at
    once), and the client gets a 503, nothing held."""
    fleet = _fleet(procs, fakes, connector, model, prefill_capacity=1, ttft_s=3.0, prefill_s=0.2)
    prompts = [f"burst {i}" for i in range(4)]
    results: dict[str, str] = {}

    def one(prompt: str) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": 3, "stream": True}
        results[prompt] = _text(_complete(fleet.url, body))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {p: completion_text(p, 3) for p in prompts}
    prefill = fleet.prefills[0]
    assert prefill.stats()["peak"]["prefill"] == 1

    prefill.set_prefill_s(5.0)
    body = {"model": model, "prompt": "too slow", "max_tokens": 3}
    resp = _complete(fleet.url, body)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"]
    wait_for(lambda: prefill.stats()["counts"].get("prefill_aborted", 0) == 1, 10, "aborted")
    fleet.settled()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_client_gone_mid_stream_or_mid_prefill_leaves_nothing_held(
    procs: list[Subprocess], fakes: list[ConnectorServer], model: str, connector: str
) -> None:
    fleet = _fleet(procs, fakes, connector, model, lease_s=2.0)
    (prefill,), (decode,) = fleet.prefills, fleet.decodes
    decode.set_token_s(0.5)
    body = {"model": model, "prompt": "leave me", "max_tokens": 20, "stream": True}
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # one event, then the client goes
    wait_for(lambda: decode.stats()["now"].get("decode", 0) == 0, 10, "the decode's abort")
    decode.set_token_s(0.005)
    prefill.set_prefill_s(3.0)

    def leave() -> None:
        with pytest.raises(httpx.ReadTimeout):
            _complete(fleet.url, {**body, "prompt": "leave early"}, timeout=0.5)

    leave()
    wait_for(lambda: prefill.stats()["counts"].get("prefill_aborted", 0) == 1, 10, "aborted")
    prefill.set_prefill_s(0.05)
    fleet.settled()


@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
def test_an_answered_prefill_no_decode_takes_is_freed_by_a_release_leg(
    procs: list[Subprocess], fakes: list[ConnectorServer], model: str, connector: str
) -> None:
    """The decode's only slot is taken: the next request's prefill answers, its decode leg
    never goes out before the deadline (503). A decode of the connector refuses the release
    leg before its engine, which frees the prefill's blocks then, not at their lease's end
    (vLLM's _with_kv_transfer_rejection_cleanup)."""
    fleet = _fleet(procs, fakes, connector, model, decode_capacity=1, ttft_s=2.0, lease_s=60)
    (prefill,), (decode,) = fleet.prefills, fleet.decodes
    holder = _hold(fleet, decode, model)
    resp = _complete(fleet.url, {"model": model, "prompt": "no room", "max_tokens": 3})
    assert resp.status_code == 503, resp.text
    wait_for(lambda: prefill.stats()["freed"].get("rejected", 0) == 1, 10, "released")
    assert decode.stats()["counts"]["refused_legs"] == 1
    holder.join(30)
    decode.set_token_s(0.005)
    fleet.settled()
    assert prefill.stats()["freed"].get("lease", 0) == 0


def test_a_push_request_waits_for_a_decode_before_its_prefill_leg(
    procs: list[Subprocess], fakes: list[ConnectorServer], model: str
) -> None:
    """The decode is chosen first: with its only slot taken, a push request never reaches
    the prefill, and gets a 503 at its deadline."""
    fleet = _fleet(procs, fakes, "nixl_push", model, decode_capacity=1, ttft_s=2.0)
    (prefill,), (decode,) = fleet.prefills, fleet.decodes
    holder = _hold(fleet, decode, model)
    legs = prefill.stats()["counts"]["prefill_legs"]
    resp = _complete(fleet.url, {"model": model, "prompt": "no room", "max_tokens": 3})
    assert resp.status_code == 503, resp.text
    assert prefill.stats()["counts"]["prefill_legs"] == legs
    holder.join(30)
    decode.set_token_s(0.005)
    fleet.settled()


def test_a_refused_push_prefill_frees_the_decodes_slot(
    procs: list[Subprocess], fakes: list[ConnectorServer], model: str
) -> None:
    """Every try of the prefill is refused (429) until the deadline: the decode legs sent
    with them are dropped, and the decode's slot, held from the start, is free again for
    the next request."""
    fleet = _fleet(procs, fakes, "nixl_push", model, decode_capacity=1, ttft_s=1.5)
    (prefill,) = fleet.prefills
    prompt = "learn the prefill"
    body = {"model": model, "prompt": prompt, "max_tokens": 3}
    assert _text(_complete(fleet.url, body)) == completion_text(prompt, 3)
    prefill.refuse(1000)
    resp = _complete(fleet.url, {**body, "prompt": "refused"})
    assert resp.status_code == 503, resp.text
    assert prefill.stats()["counts"]["prefill_refused"] >= 1
    prefill.refuse(0)
    fleet.settled()
    assert _text(_complete(fleet.url, body)) == completion_text(prompt, 3)
    fleet.settled()


@pytest.mark.parametrize("decodes", [1, 2])
def test_a_push_decode_lost_before_the_push_ends_in_a_clean_error_or_a_retry(
    procs: list[Subprocess], fakes: list[ConnectorServer], model: str, decodes: int
) -> None:
    """The decode took the leg and registered with the prefill, then died before the
    prefill pushed: with another decode the request is placed again, prefill included,
    and completes; with none, the client gets a JSON error. The prefill's unpushed blocks
    go with their lease."""
    fleet = _fleet(procs, fakes, "nixl_push", model, decodes=decodes, ttft_s=4.0, lease_s=1.0)
    (prefill,) = fleet.prefills
    warm = {"model": model, "prompt": "learn the prefill", "max_tokens": 2}
    assert _complete(fleet.url, warm).status_code == 200
    prefill.set_prefill_s(1.0)
    body = {"model": model, "prompt": "the decode dies", "max_tokens": 3, "stream": True}
    resp = _kill_the_decode_on_the_leg(fleet, body, then=lambda: prefill.set_prefill_s(0.05))
    if decodes == 2:
        assert _text(resp) == completion_text("the decode dies", 3)
    else:
        assert resp.status_code in (502, 503), resp.text
        assert resp.json()["error"]["message"]
    fleet.settled()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_decode_lost_before_its_first_token_is_replaced(
    procs: list[Subprocess], fakes: list[ConnectorServer], model: str, connector: str
) -> None:
    """Two decodes: the one that took the leg dies before its first token; the gateway
    places the request again (a failover: a stock decode takes no continuation) and the
    client gets the whole answer."""
    fleet = _fleet(procs, fakes, connector, model, decodes=2, ttft_s=6.0, lease_s=1.0)
    for d in fleet.decodes:
        d.set_token_s(2.0)
    body = {"model": model, "prompt": "fail over", "max_tokens": 2, "stream": True}
    resp = _kill_the_decode_on_the_leg(
        fleet, body, then=lambda: fleet.decodes[0].set_token_s(0.005)
    )
    assert _text(resp) == completion_text("fail over", 2)
    fleet.settled()


def _hold(fleet: Fleet, decode: ConnectorServer, model: str) -> threading.Thread:
    """A slow stream through the gateway that holds `decode`'s only slot (join it)."""
    decode.set_token_s(0.3)
    long = {"model": model, "prompt": "hold the decode", "max_tokens": 15, "stream": True}
    holder = threading.Thread(target=_complete, args=(fleet.url, long))
    holder.start()
    wait_for(lambda: decode.stats()["now"].get("decode", 0) == 1, 10, "the decode busy")
    return holder


def _kill_the_decode_on_the_leg(
    fleet: Fleet, body: dict[str, Any], *, then: Callable[[], None]
) -> httpx.Response:
    """Send `body`, kill the decode that takes its leg (before its first token), run
    `then`; the client's answer."""
    result: dict[str, httpx.Response] = {}
    client = threading.Thread(target=lambda: result.update(r=_complete(fleet.url, body)))
    client.start()

    def busy() -> ConnectorServer | None:
        return next((d for d in fleet.decodes if d.stats()["now"].get("decode", 0)), None)

    wait_for(lambda: busy() is not None, 10, "a decode took the leg")
    lost = busy()
    assert lost is not None
    lost.kill()
    fleet.decodes.remove(lost)
    then()
    client.join(30)
    return result["r"]
