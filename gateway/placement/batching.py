"""Batch forming: which queued requests one run sends to one prefill.

A prefill computes a run as one batch: every member waits for the others' prompts. So a run
takes a prefill's share of the backlog (`batch_size`), in queue order, and stops before a
member whose deadline the run would miss (`RunBudget`) or, with several gateways, before a
member due later than the most urgent request queued at another gateway.

With a policy that holds (``affinity_hold``, policies/completion.py), a request may wait for
the busy prefill holding its prefix when that is expected to finish sooner than computing it
on a free one; the requests behind it may take the free prefill (`BatchForming.pick`).

The forwarder (placement/forwarder.py) asks, and its calls (placement/prefill_call.py) send
and settle; this module only chooses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from pdgate.gateway.instances.affinity import PrefixLookup, PromptBlocks
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.placement.prefill_time import PrefillTimes, TokenRatio
from pdgate.gateway.placement.queue import Waiter, WaitQueue
from pdgate.policies.base import Holder, InstanceLoad, Option, Ranker, RequestInfo

__all__ = ["BatchForming", "RunBudget", "batch_size"]

# Deadlines this close count as equal in the fleet's order (as the fleet's own priority
# window does): a run does not stop for a request at another gateway due as soon.
_ORDER_TOLERANCE_S = 0.01


class RunBudget:
    """The requests one run may take, as long as every member's first token is expected
    before its deadline.

    A run ends when its last prompt is computed: each member waits for the others' prompts
    too. The expected time is the sum of the members' expected prefill times (recent calls,
    by uncached characters): what a compute-bound prefill takes, an upper bound where the
    engine batches short prompts for less. A member's first token comes `handover_s` after
    that (its KV's hand-over to the decode and the decode's first step, as early drop counts
    it). Without estimates yet, nothing is refused."""

    __slots__ = ("_deadline", "_end", "_known")

    def __init__(self, now: float, handover_s: float) -> None:
        self._end = now + handover_s
        self._deadline = float("inf")
        self._known = True

    def add(self, deadline: float, prefill_s: float | None, *, first: bool) -> bool:
        """Add a request due by `deadline` that takes `prefill_s` alone, if the run is then
        still expected to end before every member's deadline (the `first` always goes: it
        is the request the prefill was picked for)."""
        if prefill_s is None:
            self._known = False
        end = self._end + (prefill_s or 0.0)
        due = min(self._deadline, deadline)
        if self._known and end > due and not first:
            return False
        self._end, self._deadline = end, due
        return True


def batch_size(queued: int, ranked: Sequence[InstanceLoad]) -> int:
    """How many queued requests batch forwarding sends the best prefill in one go: its share
    of the backlog spread over every prefill that can take requests now, at most its room.

    Prefill is compute bound: a batch of k prompts takes about as long as the k one after
    another (only the pass over the weights is shared), and each of them waits for the
    whole batch. So a batch pays only for what the other prefills cannot take now; filling
    one prefill while another idles made every request in the batch wait for the others'
    prompts (docs/scheduling.md, "Batch forwarding")."""
    best = ranked[0]
    share = -(-queued // len(ranked))  # ceil
    return max(1, min(share, best.capacity - best.inflight))


class BatchForming:
    """Chooses, for one queue, the request to place next and the members of each run.

    `compute_times` and `token_ratio` are the queue's measurements (its calls record them as
    answers come), `handover_s()` the time from a prefill's answer to its decode's first
    event. `hopeless(waiter)` is the queue's early drop (admission.py): it answers a
    request that cannot make its deadline (and takes it out of the queue) and says so, so it
    is skipped here."""

    def __init__(
        self,
        queue: WaitQueue,
        policy: Ranker,
        tracker: InstanceTracker,
        index: PrefixLookup | None,
        compute_times: PrefillTimes,
        token_ratio: TokenRatio,
        hopeless: Callable[[Waiter], bool],
        handover_s: Callable[[], float],
    ) -> None:
        self._queue = queue
        self._policy = policy
        self._tracker = tracker
        self._index = index
        self._hopeless = hopeless
        # A holder weighs prefix caches: without the index there is nothing to weigh.
        self._hold: Holder | None = policy.hold if index is not None else None
        self._blocks: dict[int, PromptBlocks] = {}  # id(waiter) -> its prompt, cut in blocks
        # The forwarder's measurements, read here: prefill times by the characters computed,
        # and tokens per character.
        self._compute_times = compute_times
        self._token_ratio = token_ratio
        self._handover_s = handover_s

    # -- the queue's requests --------------------------------------------------------------

    def remember(self, waiter: Waiter) -> None:
        """Queued: its prompt cut in blocks, for affinity (kept until `forget`)."""
        if self._index is not None:
            self._blocks[id(waiter)] = self._index.blocks(waiter.info)

    def forget(self, waiter: Waiter) -> None:
        self._blocks.pop(id(waiter), None)

    def blocks(self, waiter: Waiter) -> PromptBlocks | None:
        return self._blocks.get(id(waiter))

    # -- choosing --------------------------------------------------------------------------

    def pick(
        self, head: Waiter, loads: list[InstanceLoad]
    ) -> tuple[Waiter, list[InstanceLoad]] | None:
        """The request to place next and the prefills ranked for it: the head, unless the
        policy's holder keeps it for a busy prefill's cache; then the first of the next
        requests that would go to a free prefill now. None: all of those are held."""
        info = self.with_affinity(head)
        ranked = self._policy.rank(info, loads)
        ahead: dict[str, float] = {}
        if not ranked or self._hold is None:
            return head, ranked
        if self._goes(head, info, ranked[0], ranked, loads, ahead):
            return head, ranked
        for waiter in self._queue.ordered(self._hold.scan + 1):
            if waiter is head or self._hopeless(waiter):
                continue
            info = self.with_affinity(waiter)
            ranked = self._policy.rank(info, loads)
            if ranked and self._goes(waiter, info, ranked[0], ranked, loads, ahead):
                return waiter, ranked
        return None

    def members(
        self,
        target: InstanceLoad,
        loads: list[InstanceLoad],
        room: int,
        others_due: float | None,
    ) -> Iterator[tuple[Waiter, int, float | None]]:
        """The run for `target` (`room` slots there are ours), one member at a time: the
        request, the characters `target` would compute of it and its expected prefill time.
        The caller takes each out of the queue before asking for the next."""
        budget = RunBudget(time.monotonic(), self._handover_s())
        first = True
        while room > 0:
            # The queue may have changed while the caller asked the fleet.
            nxt = self._next_for(target, loads)
            if nxt is None:
                return
            if (
                not first
                and others_due is not None
                and (nxt.deadline > others_due + _ORDER_TOLERANCE_S)
            ):
                return  # a more urgent request waits at another gateway: it goes first
            uncached = self.uncached_chars(self.with_affinity(nxt), target.id)
            took = self._compute_times.estimate_s(
                max(1, uncached), hardware=self._tracker.hardware(target.id)
            )
            if not budget.add(nxt.deadline, took, first=first):
                return
            yield nxt, uncached, took
            first = False
            room -= 1

    def uncached_chars(self, info: RequestInfo, instance_id: str) -> int:
        """Characters of the prompt `instance_id` would compute: the leading ones the prefix
        index says it holds are skipped."""
        return max(0, info.prompt_chars - info.cached_chars.get(instance_id, 0))

    def with_affinity(self, waiter: Waiter) -> RequestInfo:
        blocks = self._blocks.get(id(waiter))
        if self._index is None or blocks is None:
            return waiter.info
        return replace(waiter.info, cached_chars=self._index.match(blocks))

    # -- hold or go (policies/completion.py) -------------------------------------------------

    def _next_for(self, target: InstanceLoad, loads: list[InstanceLoad]) -> Waiter | None:
        """The next queued request to send to `target` (a slot there is ours): in queue order,
        skipping those the holder keeps for another prefill's cache."""
        if self._hold is None:
            while (waiter := self._queue.peek()) is not None:
                if not self._hopeless(waiter):
                    return waiter
            return None
        ahead: dict[str, float] = {}
        for waiter in self._queue.ordered(self._hold.scan + 1):
            if self._hopeless(waiter):
                continue
            if self._goes(waiter, self.with_affinity(waiter), target, [target], loads, ahead):
                return waiter
        return None

    def _goes(
        self,
        waiter: Waiter,
        info: RequestInfo,
        free: InstanceLoad,
        ranked: list[InstanceLoad],
        loads: list[InstanceLoad],
        ahead: dict[str, float],
    ) -> bool:
        """Whether `waiter` should go to the free prefill `free` now rather than wait for a
        busy one that holds more of its prefix (by expected completion time). `ahead`: per
        prefill, the work of the requests before it in this round already held for that
        prefill, per slot: they will be served there first (updated here)."""
        hold = self._hold
        held = info.cached_chars
        if hold is None or not held:
            return True
        here = held.get(free.id, 0)
        free_ids = {c.id for c in ranked}
        better = [
            c for c in loads if held.get(c.id, 0) > here and c.id not in free_ids and not c.ejected
        ]
        if not better:
            return True
        now_option = self._option(info, free, 0.0)
        if now_option is None:
            return True  # no estimates yet: the old rule (take the free slot)
        busy = []
        for c in better:
            option = self._option(info, c, self._expected_wait_s(c) + ahead.get(c.id, 0.0))
            if option is not None:
                busy.append(option)
        now = time.monotonic()
        held_s = 0.0 if waiter.held_since is None else now - waiter.held_since
        choice = hold.choose(now_option, busy, remaining_s=waiter.deadline - now, held_s=held_s)
        if choice is now_option:
            return True
        if waiter.held_since is None:
            waiter.held_since = now
        held_for = choice.instance
        ahead[held_for.id] = ahead.get(held_for.id, 0.0) + choice.prefill_s / max(
            held_for.capacity, 1
        )
        return False

    def _option(self, info: RequestInfo, inst: InstanceLoad, wait_s: float) -> Option | None:
        prefill_s = self._compute_times.estimate_s(
            max(1, self.uncached_chars(info, inst.id)), hardware=self._tracker.hardware(inst.id)
        )
        return None if prefill_s is None else Option(inst, wait_s, prefill_s)

    def _expected_wait_s(self, inst: InstanceLoad) -> float:
        """Until a busy prefill can take a request: the first of our calls there is expected
        to end; else, when only other gateways' calls compute there, all of their work (its
        start is unknown: an over-estimate, which only makes holding rarer); else soon (its
        slots hold KV a decode is about to take). A recent 429 keeps it out longer."""
        wait = self._tracker.soonest_end_s(inst.id)
        if wait is None:
            wait = 0.0
            rate = self._compute_times.rate_s(hardware=self._tracker.hardware(inst.id))
            if inst.inflight_tokens > 0 and rate is not None:
                wait = inst.inflight_tokens / self._token_ratio.ratio * rate
        return max(wait, self._tracker.busy_for_s(inst.id))
