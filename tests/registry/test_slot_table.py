"""The node's shared prefill slot table (``--workers`` without Redis): workers lease whole
slots, any worker may use any free slot, the sum never exceeds the capacity even with worker
processes racing, a dead worker's slots are zeroed, and the table is bounded."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

from pdgate.registry.fleet import Candidate, LocalFleet, SlotTable


@pytest.fixture
def table() -> Iterator[SlotTable]:
    t = SlotTable.create(workers=2)
    yield t
    t.close()


def _worker(table: SlotTable, index: int) -> SlotTable:
    return SlotTable(table.fd, index)


def test_an_instance_with_fewer_slots_than_workers_serves_every_worker(table: SlotTable) -> None:
    w0, w1 = _worker(table, 0), _worker(table, 1)
    assert w0.acquire([("p", 1)], 1) == (0, 1)
    assert w1.acquire([("p", 1)], 1) == (-1, 0)  # full, whoever holds it
    w0.release("p")
    assert w1.acquire([("p", 1)], 1) == (0, 1)  # worker 1 gets the one slot too


def test_one_worker_may_take_every_slot_and_falls_through_to_the_next(table: SlotTable) -> None:
    w0, w1 = _worker(table, 0), _worker(table, 1)
    assert w0.acquire([("p", 4)], 8) == (0, 4)  # not held to half of the capacity
    assert w1.acquire([("p", 4), ("q", 2)], 3) == (1, 2)
    assert (table.used("p"), table.used("q")) == (4, 2)


def test_a_dead_workers_slots_are_zeroed_and_frees_are_announced(table: SlotTable) -> None:
    w0, w1 = _worker(table, 0), _worker(table, 1)
    w0.acquire([("p", 2)], 2)
    before = table.generation()
    table.clear_worker(0)  # what the supervisor does when worker 0 exits
    assert table.generation() != before
    assert w1.acquire([("p", 2)], 2) == (0, 2)
    again = table.generation()
    w1.release("p", 2)
    assert table.generation() != again and table.used("p") == 0
    # A restarted worker starts with an empty column.
    w1.acquire([("p", 2)], 1)
    _worker(table, 1)
    assert table.used("p") == 0


def test_the_table_is_bounded_and_reuses_idle_rows() -> None:
    t = SlotTable.create(workers=1, rows=4)
    w = _worker(t, 0)
    for i in range(50):  # many instances over time, few at once
        assert w.acquire([(f"p{i}", 1)], 1) == (0, 1)
        w.release(f"p{i}")
    held = [f"h{i}" for i in range(4)]
    for name in held:
        assert w.acquire([(name, 1)], 1) == (0, 1)
    assert w.acquire([("one-more", 1)], 1) == (-1, 0)  # every row holds slots
    assert all(t.used(name) == 1 for name in held)
    t.close()


def _hammer(fd: int, index: int, rounds: int, capacity: int, seen: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    t = SlotTable(fd, index)
    most = 0
    for _ in range(rounds):
        _, granted = t.acquire([("p", capacity)], 1)
        if granted:
            most = max(most, t.used("p"))
            t.release("p")
    seen.put(most)


def test_racing_worker_processes_never_exceed_the_capacity_and_lose_no_update() -> None:
    ctx = multiprocessing.get_context("fork")
    table = SlotTable.create(workers=4)
    seen = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(table.fd, i, 3000, 2, seen)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert max(seen.get(timeout=5) for _ in procs) <= 2
    assert table.used("p") == 0  # every acquire matched by its release, none lost
    table.close()


async def test_local_fleet_on_a_table_leases_and_gives_back(table: SlotTable) -> None:
    a = LocalFleet("a", _worker(table, 0))
    b = LocalFleet("b", _worker(table, 1))
    one = [Candidate("p", 3)]
    g = await a.acquire("q", one, 2, head_in_ms=None, next_head_in_ms=None)
    assert len(g.lease_ids) == 2
    h = await b.acquire("q", one, 5, head_in_ms=None, next_head_in_ms=None)
    assert len(h.lease_ids) == 1
    assert (await b.acquire("q", one, 1, head_in_ms=None, next_head_in_ms=None)).instance_id is None
    await a.release([("p", g.lease_ids[0]), ("p", g.lease_ids[0])])  # once only
    assert table.used("p") == 2
    await b.aclose()  # a worker that stops gives back what it held
    assert table.used("p") == 1
