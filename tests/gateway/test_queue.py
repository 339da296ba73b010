from __future__ import annotations

import asyncio

from config import QueueOrder
from gateway.queue import Waiter, WaiterState, WaitQueue
from policies.base import RequestInfo

INFO = RequestInfo(model="m", group=None, prompt="p", prompt_chars=1, max_tokens=1)


def waiter(deadline: float, name: str) -> Waiter:
    return Waiter(
        info=INFO,
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
        assert q.push(w)
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
    assert q.push(a)
    assert q.push(b)
    assert not q.push(c)
    q.remove(a)
    assert a.state is WaiterState.DONE
    assert q.push(c)
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
    assert len(q._heap) < 200  # lazy deletion compacts
    assert q.peek() is keep


async def test_wait_nonempty_wakes_on_push() -> None:
    q = WaitQueue(10, QueueOrder.FIFO)
    waiting = asyncio.create_task(q.wait_nonempty())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    q.push(waiter(1, "a"))
    await asyncio.wait_for(waiting, 1)
