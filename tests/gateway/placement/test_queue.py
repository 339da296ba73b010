"""The gateway-held queue: order (priority, deadline guard, tenant fairness, FIFO/EDF), bounds,
the 429-or-503 rule, and lazy deletion."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from pdgate.config import QueueOrder
from pdgate.gateway.placement.queue import Admission, Waiter, WaiterState, WaitQueue
from pdgate.policies.base import RequestInfo

INFO = RequestInfo(model="m", group=None, prompt="p", prompt_chars=4, max_tokens=1)


def waiter(deadline: float, name: str, **info: object) -> Waiter:
    return Waiter(
        info=replace(INFO, **info),  # type: ignore[arg-type]
        body={},
        request_id=name,
        deadline=deadline,
        future=asyncio.get_running_loop().create_future(),
    )


def drain(q: WaitQueue) -> list[str]:
    out = []
    while (w := q.pop()) is not None:
        out.append(w.request_id)
    return out


async def test_fifo_keeps_arrival_order_and_requeue_keeps_the_turn() -> None:
    q = WaitQueue(10, QueueOrder.FIFO)
    a, b, c = waiter(3, "a"), waiter(1, "b"), waiter(2, "c")
    for w in (a, b, c):
        assert q.push(w) is Admission.OK
    first = q.pop()
    assert first is a
    q.requeue(a)  # rejected by a prefill: back in front of b and c
    assert drain(q) == ["a", "b", "c"]


async def test_edf_serves_earliest_deadline_first() -> None:
    q = WaitQueue(10, QueueOrder.EDF)
    for w in (waiter(3, "a"), waiter(1, "b"), waiter(2, "c")):
        q.push(w)
    assert drain(q) == ["b", "c", "a"]


async def test_bound_refuses_when_full_and_removed_entries_free_room() -> None:
    q = WaitQueue(2, QueueOrder.FIFO)
    a, b, c = waiter(1, "a"), waiter(1, "b"), waiter(1, "c")
    assert q.push(a) is Admission.OK
    assert q.push(b) is Admission.OK
    assert q.push(c) is Admission.FULL
    q.remove(a)
    assert a.state is WaiterState.DONE
    assert q.push(c) is Admission.OK
    assert len(q) == 2
    assert drain(q) == ["b", "c"]


async def test_removed_waiters_do_not_accumulate() -> None:
    q = WaitQueue(100_000, QueueOrder.FIFO)
    keep = waiter(1, "keep")
    q.push(keep)
    for i in range(10_000):
        w = waiter(1, str(i))
        q.push(w)
        q.remove(w)
    assert len(q) == 1
    assert len(q._deadlines.entries) < 200  # lazy deletion compacts
    assert q.peek() is keep


async def test_a_higher_priority_class_always_goes_first() -> None:
    q = WaitQueue(10, QueueOrder.EDF)
    q.push(waiter(1, "low", priority=2))
    q.push(waiter(5, "normal", priority=1))
    q.push(waiter(9, "high", priority=0))
    assert drain(q) == ["high", "normal", "low"]


async def test_tenants_share_by_token_cost_not_by_request_count() -> None:
    q = WaitQueue(100, QueueOrder.FIFO)
    # The heavy tenant queued first, many large requests; the light one a few small ones.
    for i in range(6):
        q.push(waiter(1, f"heavy{i}", tenant="heavy", prompt_chars=4000, max_tokens=200))
    for i in range(3):
        q.push(waiter(1, f"light{i}", tenant="light", prompt_chars=40, max_tokens=20))
    order = drain(q)
    # One heavy request costs as much as many light ones: the light tenant is not stuck
    # behind the heavy tenant's backlog.
    assert order.index("light2") < order.index("heavy1")


async def test_an_idle_tenant_earns_no_credit() -> None:
    q = WaitQueue(100, QueueOrder.FIFO)
    for i in range(5):
        q.push(waiter(1, f"a{i}", tenant="a"))
    drain(q)  # "a" was charged for 5 requests while "b" was idle
    q.push(waiter(1, "a-late", tenant="a"))
    for i in range(3):
        q.push(waiter(1, f"b{i}", tenant="b"))
    order = drain(q)
    # "b" starts at "a"'s level: it gets no run of 5 requests ahead of "a".
    assert order.index("a-late") <= 1


async def test_the_guard_lets_a_long_deadline_request_start_in_time() -> None:
    q = WaitQueue(100, QueueOrder.EDF, guard_s=0.25)
    now = time.monotonic()
    doc = waiter(now + 4.0, "document")
    doc.latest_start = now + 0.1  # a long prefill: it must start within 0.1 s
    q.push(doc)
    for i in range(5):
        q.push(waiter(now + 1.0 + i * 0.1, f"chat{i}"))  # earlier deadlines, short prefills
    assert q.pop() is doc
    # Off (the default), the queue is plain EDF.
    off = WaitQueue(100, QueueOrder.EDF)
    doc = waiter(now + 4.0, "document")
    doc.latest_start = now + 0.1
    off.push(doc)
    off.push(waiter(now + 1.0, "chat"))
    assert off.pop() is not doc


async def test_the_guard_leaves_a_request_past_its_latest_start_to_edf() -> None:
    """Late requests first (least slack first) is the overload domino: a request that can no
    longer start in time by the guard's estimate gets no precedence."""
    q = WaitQueue(100, QueueOrder.EDF, guard_s=0.25)
    now = time.monotonic()
    late = waiter(now + 3.0, "late-document")
    late.latest_start = now - 0.05
    q.push(late)
    chats = [waiter(now + 1.0 + i * 0.1, f"chat{i}") for i in range(3)]
    for w in chats:
        q.push(w)
    assert [q.pop() for _ in range(3)] == chats
    assert q.pop() is late


async def test_a_tenant_over_its_share_is_told_429_not_503() -> None:
    q = WaitQueue(8, QueueOrder.FIFO)
    for i in range(3):
        assert q.push(waiter(1, f"light{i}", tenant="light")) is Admission.OK
    admissions = [q.push(waiter(1, f"heavy{i}", tenant="heavy")) for i in range(5)]
    assert admissions == [Admission.OK] * 4 + [Admission.OVER_SHARE]
    assert q.push(waiter(1, "light3", tenant="light")) is Admission.OK
    assert q.push(waiter(1, "new", tenant="new")) is Admission.FULL


async def test_wait_nonempty_wakes_on_push() -> None:
    q = WaitQueue(10, QueueOrder.FIFO)
    waiting = asyncio.create_task(q.wait_nonempty())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    q.push(waiter(1, "a"))
    await asyncio.wait_for(waiting, 1)


async def test_a_tenant_under_its_share_displaces_the_newest_of_one_over_it() -> None:
    q = WaitQueue(4, QueueOrder.FIFO)
    heavy = [waiter(1, f"heavy{i}", tenant="heavy") for i in range(4)]
    # Alone, a tenant may fill the queue; then there is no room for anyone: 503.
    assert [q.push(w) for w in heavy] == [Admission.OK] * 4
    more = waiter(1, "heavy4", tenant="heavy")
    assert q.push(more) is Admission.FULL
    assert q.displace_for(more) is None
    # A light tenant is under its share (2 of 4): it takes the heavy tenant's newest place.
    light = waiter(1, "light0", tenant="light")
    assert q.push(light) is Admission.FULL
    assert q.displace_for(light) is heavy[3]
    assert heavy[3].state is WaiterState.DONE
    assert q.push(light) is Admission.OK
    # The heavy tenant now holds more than its share: 429, not 503.
    assert q.push(waiter(1, "heavy5", tenant="heavy")) is Admission.OVER_SHARE
    light1 = waiter(1, "light1", tenant="light")
    assert q.push(light1) is Admission.FULL
    assert q.displace_for(light1) is heavy[2]
    assert q.push(light1) is Admission.OK
    # Both at their share now: the light tenant's next is over it, like anyone's.
    assert q.push(waiter(1, "light2", tenant="light")) is Admission.OVER_SHARE
    newcomer = waiter(1, "third", tenant="third")
    assert q.push(newcomer) is Admission.FULL
    # A third tenant's share is 4/3: the others hold 2 each, one over: it yields a place.
    assert q.displace_for(newcomer) in (heavy[1], light1)
    assert q.push(newcomer) is Admission.OK
    assert len(q) == 4


async def test_shares_follow_the_tenants_weights() -> None:
    q = WaitQueue(8, QueueOrder.FIFO)
    for i in range(4):
        assert q.push(waiter(1, f"small{i}", tenant="small")) is Admission.OK
    # Weight 3 against 1: a share of 6 of the 8 places.
    big = [q.push(waiter(1, f"big{i}", tenant="big", weight=3.0)) for i in range(4)]
    assert big == [Admission.OK] * 4
    # The small tenant holds 4, twice its share of 2: its next is over share.
    assert q.push(waiter(1, "small4", tenant="small")) is Admission.OVER_SHARE
    # The big one is under its share of 6 in a full queue: it displaces a small request.
    late = waiter(1, "big4", tenant="big", weight=3.0)
    assert q.push(late) is Admission.FULL
    victim = q.displace_for(late)
    assert victim is not None and victim.request_id == "small3"


async def test_displacement_takes_the_least_urgent_class_first() -> None:
    q = WaitQueue(3, QueueOrder.FIFO)
    q.push(waiter(1, "h-low", tenant="h", priority=2))
    q.push(waiter(1, "h-high", tenant="h", priority=0))
    q.push(waiter(1, "h-normal", tenant="h", priority=1))
    light = waiter(1, "light", tenant="light")
    assert q.push(light) is Admission.FULL
    victim = q.displace_for(light)
    assert victim is not None and victim.request_id == "h-low"


async def test_ordered_lists_the_queue_in_the_order_pops_would_take_it() -> None:
    q = WaitQueue(100, QueueOrder.FIFO)
    for i in range(4):
        q.push(waiter(1, f"a{i}", tenant="a", prompt_chars=400))
    for i in range(3):
        q.push(waiter(1, f"b{i}", tenant="b", prompt_chars=40))
    q.push(waiter(1, "urgent", priority=0))
    listed = [w.request_id for w in q.ordered(5)]
    assert len(q) == 8  # nothing taken
    assert listed == drain(q)[:5]


async def test_take_lets_a_later_waiter_pass_the_head() -> None:
    q = WaitQueue(10, QueueOrder.FIFO)
    a, b, c = waiter(1, "a"), waiter(1, "b"), waiter(1, "c")
    for w in (a, b, c):
        q.push(w)
    q.take(b)
    assert b.state is WaiterState.IN_FLIGHT and len(q) == 2
    assert drain(q) == ["a", "c"]


async def test_wait_arrival_wakes_on_each_queued_waiter() -> None:
    q = WaitQueue(10, QueueOrder.FIFO)
    q.push(waiter(1, "a"))
    waiting = asyncio.create_task(q.wait_arrival())  # not woken by what came before
    await asyncio.sleep(0.01)
    assert not waiting.done()
    q.push(waiter(1, "b"))
    await asyncio.wait_for(waiting, 1)
