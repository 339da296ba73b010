"""The release of a KV id (``DELETE /v1/kv/{id}``) says what the prefill did with the call
that named it (``x-pdgate-admission``: admitted, rejected or unseen), and each call is
counted once: a gateway that cut a call off unanswered counts it as the prefill did. A
release that comes before its call withdraws the id: the call is refused, in neither
count. Real prefill shims on real sockets; the gateway's upstream clients read the header."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from pdgate.config import Role
from pdgate.config.wire import ADMISSION_HEADER, KV_ID_HEADER, kv_release_url
from pdgate.engine_shim._kv_store import HeldKv, KvStore, RecentAdmissions
from pdgate.engine_shim.backend import EngineBusy, PrefillOutput, Sampling
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.prefill_call import release_unanswered
from pdgate.gateway.upstream.http import HttpUpstream
from tests.engine_shim.conftest import Shim, StartShim, assert_openai_error, prefill_body, wait_load
from tests.gateway._fakes import tracker_for
from tests.gateway.upstream._server import Client, both_clients, connect

LONG = "long " * 4000  # computes for a while (~0.5 s in the sim)


async def _post(shim: Shim, prompt: str, kv_id: str) -> tuple[int, dict[str, Any]]:
    async with shim.http.post(
        shim.url + "/v1/completions",
        data=orjson.dumps(prefill_body(prompt)),
        headers={KV_ID_HEADER: kv_id},
    ) as resp:
        return resp.status, orjson.loads(await resp.read())


async def _release(shim: Shim, kv_id: str) -> tuple[int, str | None]:
    async with shim.http.delete(kv_release_url(shim.url, kv_id)) as resp:
        await resp.read()
        return resp.status, resp.headers.get(ADMISSION_HEADER)


def _counts(load: dict[str, Any]) -> tuple[int, int, int]:
    return load["admitted"], load["rejected"], load["withdrawn"]


async def test_the_release_of_an_admitted_call_says_admitted_then_and_later(
    start_shim: StartShim,
) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1)
    status, body = await _post(shim, "held", "a" * 16)
    assert status == 200, body
    assert await _release(shim, "a" * 16) == (204, "admitted")
    # Its KV is gone; what became of the call is still known.
    assert await _release(shim, "a" * 16) == (404, "admitted")
    assert _counts(await shim.load()) == (1, 0, 0)


async def test_the_release_of_a_rejected_call_says_rejected(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1)
    assert (await _post(shim, "holder", "h" * 16))[0] == 200
    status, body = await _post(shim, "no room", "r" * 16)
    assert status == 429, body
    assert await _release(shim, "r" * 16) == (404, "rejected")
    assert _counts(await shim.load()) == (1, 1, 0)


async def test_a_call_released_before_it_arrives_is_refused_and_counted_neither(
    start_shim: StartShim,
) -> None:
    shim = await start_shim(Role.PREFILL, capacity=2)
    assert await _release(shim, "u" * 16) == (404, "unseen")
    status, body = await _post(shim, "late", "u" * 16)
    assert status == 409, body
    assert assert_openai_error(body)["code"] == "kv_released"
    load = await shim.load()
    assert _counts(load) == (0, 0, 1)
    assert (load["used"], load["running"]) == (0, 0)  # nothing computed for it
    # Still "unseen": the releaser counted it so, and so it stays.
    assert await _release(shim, "u" * 16) == (404, "unseen")


async def test_a_withdrawn_call_is_not_counted_rejected_when_there_is_no_room(
    start_shim: StartShim,
) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1)
    assert (await _post(shim, "holder", "h" * 16))[0] == 200
    assert await _release(shim, "w" * 16) == (404, "unseen")
    assert (await _post(shim, "late", "w" * 16))[0] == 409
    assert _counts(await shim.load()) == (1, 0, 1)


async def test_a_call_released_while_it_computes_is_admitted_and_its_kv_dropped(
    start_shim: StartShim,
) -> None:
    shim = await start_shim(Role.PREFILL, capacity=2)
    call = asyncio.create_task(_post(shim, LONG, "c" * 16))
    await wait_load(shim, "running", 1)
    assert await _release(shim, "c" * 16) == (404, "admitted")
    status, body = await call
    assert status == 200, body
    load = await shim.load()
    assert (load["kv_dropped_on_arrival"], load["kv_held"], load["used"]) == (1, 0, 0)
    assert _counts(load) == (1, 0, 0)


async def test_a_queued_call_released_before_its_slot_is_withdrawn(start_shim: StartShim) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1, admission="queue", local_queue_size=2)
    assert (await _post(shim, "holder", "h" * 16))[0] == 200
    queued = asyncio.create_task(_post(shim, "queued", "q" * 16))
    await wait_load(shim, "queued", 1)
    assert await _release(shim, "q" * 16) == (404, "unseen")
    assert await _release(shim, "h" * 16) == (204, "admitted")  # its slot goes to the queued
    status, body = await queued
    assert status == 409, body
    load = await shim.load()
    assert _counts(load) == (1, 0, 1)
    assert load["used"] == 0  # the slot it was given is back


class _BusyEngine:
    """The engine's ``prefill`` refusing a prompt the shim admitted, once `gate` opens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls = 0

    async def prefill(
        self, tokens: Sequence[int], sampling: Sampling | None = None, *, adapter: str | None = None
    ) -> PrefillOutput:
        self.calls += 1
        await self.gate.wait()
        raise EngineBusy("prefill batch is full")


async def _engine_busy_shim(start_shim: StartShim, monkeypatch: pytest.MonkeyPatch) -> Any:
    shim = await start_shim(Role.PREFILL, capacity=2)
    engine = _BusyEngine()
    monkeypatch.setattr(shim.app.state.shim.backend, "prefill", engine.prefill)
    return shim, engine


async def test_an_engine_refusal_after_admission_counts_once_as_rejected(
    start_shim: StartShim, monkeypatch: pytest.MonkeyPatch
) -> None:
    shim, engine = await _engine_busy_shim(start_shim, monkeypatch)
    engine.gate.set()
    status, body = await _post(shim, "refused", "e" * 16)
    assert status == 429, body
    load = await shim.load()
    assert _counts(load) == (0, 1, 0)
    assert load["used"] == 0
    assert await _release(shim, "e" * 16) == (404, "rejected")


async def test_an_engine_refusal_after_the_release_said_admitted_stays_admitted(
    start_shim: StartShim, monkeypatch: pytest.MonkeyPatch
) -> None:
    shim, engine = await _engine_busy_shim(start_shim, monkeypatch)
    call = asyncio.create_task(_post(shim, "refused late", "f" * 16))
    await wait_load(shim, "admitted", 1)
    assert await _release(shim, "f" * 16) == (404, "admitted")
    engine.gate.set()
    assert (await call)[0] == 429  # nobody reads it: its gateway left, counting it admitted
    assert _counts(await shim.load()) == (1, 0, 0)
    assert await _release(shim, "f" * 16) == (404, "admitted")


@both_clients
async def test_the_gateway_s_release_returns_what_the_prefill_said(
    start_shim: StartShim, client: Client
) -> None:
    shim = await start_shim(Role.PREFILL, capacity=1)
    assert (await _post(shim, "held", "g" * 16))[0] == 200
    assert (await _post(shim, "no room", "n" * 16))[0] == 429
    upstream = connect(client)
    try:
        assert await upstream.release_kv_id(shim.url, "g" * 16, request_id="r1") == "admitted"
        assert await upstream.release_kv_id(shim.url, "n" * 16, request_id="r2") == "rejected"
        assert await upstream.release_kv_id(shim.url, "z" * 16, request_id="r3") == "unseen"
        # A server that does not say (a stock one: no such route) is None, not an error.
        stock = shim.url + "/nowhere"
        assert await upstream.release_kv_id(stock, "g" * 16, request_id="r4") is None
    finally:
        await upstream.aclose()
    assert (await shim.load())["kv_released"] == 1


@pytest.mark.parametrize("said", ["admitted", "rejected", "unseen"])
async def test_a_call_the_gateway_cut_off_is_counted_as_its_prefill_said(
    start_shim: StartShim, said: str
) -> None:
    """The gateway's release of an unanswered call (`release_unanswered`) counts it by the
    prefill's answer, before the call's counts go back: once they are, the gateway's and
    the prefill's counts agree."""
    shim = await start_shim(Role.PREFILL, capacity=1)
    assert (await _post(shim, "held", "a" * 16))[0] == 200
    assert (await _post(shim, "no room", "r" * 16))[0] == 429
    kv_id = {"admitted": "a" * 16, "rejected": "r" * 16, "unseen": "u" * 16}[said]
    tracker = tracker_for([1])
    metrics = GatewayMetrics(tracker.totals, lambda: 0)

    def counted() -> float | None:
        labels = {"result": "abandoned", "outcome": said}
        return metrics.registry.get_sample_value("pdgate_prefill_abandoned_outcomes_total", labels)

    at_give_back: list[float | None] = []
    leases = (
        tracker.open_stream("p0"),
        tracker.begin("p0", also=lambda: at_give_back.append(counted())),
    )
    upstream = connect(HttpUpstream)
    try:
        pending = release_unanswered(
            upstream, metrics, "abandoned", leases, url=shim.url, kv_id=kv_id, request_id="r1"
        )
        assert pending is not None
        await pending
    finally:
        await upstream.aclose()
    assert at_give_back == [1]  # counted already when the slot went back, and once
    assert tracker.totals() == (0, 0)
    assert _counts(await shim.load())[:2] == (1, 1)


def test_recent_admissions_forget_by_age_and_by_count() -> None:
    now = [0.0]
    recent = RecentAdmissions(max_ids=2, ttl_s=10.0, clock=lambda: now[0])
    recent.remember("a", "admitted")
    now[0] = 5.0
    recent.remember("b", "rejected")
    assert (recent.get("a"), recent.get("b")) == ("admitted", "rejected")
    now[0] = 10.0
    assert (recent.get("a"), recent.get("b")) == (None, "rejected")  # "a" is 10 s old
    recent.remember("c", "admitted")
    recent.remember("d", "admitted")
    assert (recent.get("b"), recent.get("c"), recent.get("d")) == (None, "admitted", "admitted")
    assert len(recent) == 2


class _Freed:
    """A KV's blocks or a slot that says whether it was freed."""

    nbytes = 0

    def __init__(self) -> None:
        self.freed = False

    def release(self) -> None:
        self.freed = True


async def test_an_id_released_early_is_forgotten_by_the_first_that_asks() -> None:
    """The store remembers an id released before it was held (a tombstone), and forgets it
    once: the late KV is dropped on arrival or the late call withdrawn, and a later use of
    the id is as any other."""
    store = KvStore(hold_timeout_s=120)
    assert not store.withdrawn("a")  # never released
    store.release_unknown("a")
    assert store.released_early("a")
    assert store.withdrawn("a")
    assert not store.withdrawn("a") and not store.released_early("a")  # forgotten
    store.release_unknown("b")
    kv, slot = _Freed(), _Freed()
    assert not store.put(HeldKv("b", kv, slot))  # type: ignore[arg-type]
    assert (kv.freed, slot.freed, store.dropped_on_arrival) == (True, True, 1)
    assert not store.released_early("b")
    assert store.put(HeldKv("b", _Freed(), _Freed()))  # type: ignore[arg-type]
    assert "b" in store and store.dropped_on_arrival == 1
    store.close()
