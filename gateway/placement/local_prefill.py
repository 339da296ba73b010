"""Conditional disaggregation: a request with few uncached prompt characters skips the prefill.

A prefill leg costs a queue wait, a prefill call and a KV transfer before the decode starts.
For a short prompt, or one whose prefix a decode already holds, a decode that computes the
rest itself (chunked prefill in its running batch) answers sooner, at the price of slower
steps for the sequences decoding there while it does. Dynamo's disaggregated router and
llm-d's P/D profile handler make the same call from the same estimate: prompt length minus
the decode's prefix-cache hit, against a threshold.

Per request, when ``local_prefill_max_uncached_chars`` is set:

* The uncached part on each decode that declares ``EXT_LOCAL_PREFILL`` is the prompt's
  characters minus those of its leading blocks the decode recently served (an index of
  decode placements, `PrefixIndex`, bounded like the prefill one; both legs' decodes are
  recorded, since a decode keeps the prompt's KV blocks it received). Without
  ``local_prefill_prefix_aware`` the whole prompt counts.
* Declaring decodes with room (not busy after a 429, not ejected, fewer requests in flight
  than slots) whose uncached part is at most the threshold are ranked by the decode policy
  and tried in order, at most ``decode_candidates`` of them, with the request's deadline. The
  first to accept gets the client's body as is (no ``kv_transfer_params``) and streams it.
* A 429 or a failure moves to the next; when none accepts, the caller takes the usual
  prefill + decode path with the time left. Nothing was computed anywhere, so falling back
  is always safe (a 4xx too: the prefill then answers for the request itself).

The placement holds what a disaggregated one holds on its decode (open stream, slot), and
the local prompt's token work on it until the first byte, when the prompt is computed.
Stock decodes never get plain requests: they do not declare the extension.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import replace
from typing import Any

from prometheus_client import Counter

from pdgate.config.settings import GatewaySettings
from pdgate.config.tracing import Span
from pdgate.config.wire import EXT_LOCAL_PREFILL, Role
from pdgate.gateway.errors import UpstreamError
from pdgate.gateway.instances.affinity import PrefixIndex, PromptBlocks
from pdgate.gateway.instances.health import Ejector
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.placement.decode_attempt import PREFILL_PATH, DecodeAttempts
from pdgate.gateway.placement.placed import Placement, as_stream, whole
from pdgate.policies.base import InstanceLoad, Ranker, RequestInfo

__all__ = ["LocalPlan", "LocalPrefill"]


class LocalPrefill:
    def __init__(
        self,
        settings: GatewaySettings,
        tracker: InstanceTracker,
        decodes: DecodeAttempts,
        policy: Ranker,
        metrics: GatewayMetrics,
        ejector: Ejector,
    ) -> None:
        self.max_uncached_chars = settings.local_prefill_max_uncached_chars
        self._candidates = settings.decode_candidates
        self._tracker = tracker
        self._decodes = decodes
        self._policy = policy
        self._ejector = ejector
        self.index: PrefixIndex | None = None
        if self.max_uncached_chars > 0 and settings.local_prefill_prefix_aware:
            self.index = PrefixIndex(
                block_chars=settings.affinity_block_chars,
                max_blocks=settings.affinity_max_blocks,
                max_bytes=settings.affinity_max_bytes,
            )
        self._requests = Counter(
            "pdgate_local_prefill",
            "Requests by prefill path under conditional disaggregation: local (a decode "
            "prefilled it), fallback (eligible, no decode accepted: prefill + decode), skipped "
            "(too many uncached characters or no declaring decode with room: prefill + decode)",
            ["outcome"],
            registry=metrics.registry,
        )

    def plan(self, info: RequestInfo, avoid: Collection[str] = ()) -> LocalPlan | None:
        """The request's decision, hashed once for both paths (None: the feature is off);
        decodes in `avoid` (one that just broke this request's stream) are not asked."""
        if self.max_uncached_chars <= 0:
            return None
        blocks = self.index.blocks(info) if self.index is not None else PromptBlocks([])
        return LocalPlan(self, info, blocks, avoid)

    def eligible(
        self, info: RequestInfo, blocks: PromptBlocks, avoid: Collection[str] = ()
    ) -> list[tuple[InstanceLoad, int]]:
        """Declaring decodes with room whose uncached part of the prompt is at most the
        threshold, in the decode policy's order, each with that part (characters)."""
        records = self._tracker.records()
        loads = [
            c
            for c in self._tracker.loads(Role.DECODE, info.model, info.group)
            if not (c.busy or c.ejected or c.id in avoid)
            and c.inflight < c.capacity
            and (record := records.get(c.id)) is not None
            and EXT_LOCAL_PREFILL in record.extensions
        ]
        if not loads:
            return []
        held: dict[str, int] = {}
        if self.index is not None and blocks.chars:
            held = self.index.match(blocks)
        uncached = {c.id: max(0, info.prompt_chars - held.get(c.id, 0)) for c in loads}
        fit = [c for c in loads if uncached[c.id] <= self.max_uncached_chars]
        if not fit:
            return []
        ranked = self._policy.rank(replace(info, cached_chars=held), fit)
        return [(c, uncached[c.id]) for c in ranked[: self._candidates]]

    def record(self, blocks: PromptBlocks, decode_id: str) -> None:
        """`decode_id` now holds the prompt's KV blocks (it computed or received them)."""
        if self.index is None or not blocks.chars:
            return
        record = self._tracker.records().get(decode_id)
        # Only a declaring decode is ever asked to prefill: others would only fill the index.
        if record is not None and EXT_LOCAL_PREFILL in record.extensions:
            self.index.record(blocks, decode_id)

    async def attempt(
        self,
        inst: InstanceLoad,
        uncached_chars: int,
        body: dict[str, Any],
        *,
        request_id: str,
        deadline: float,
        parent: Span | None,
        path: str,
    ) -> Placement | None:
        """One try at `inst`: its placement, or None after a 429 or a failure (counted)."""
        if time.monotonic() >= deadline:
            return None
        try:
            response, stream, inflight = await self._decodes.open(
                inst,
                body,
                path,
                request_id=request_id,
                deadline=deadline,
                parent=parent,
                local=True,
            )
        except UpstreamError:
            # Even a 4xx: the prefill + decode path then answers for the request.
            return None
        # The prompt's work on the decode, until the first byte says it is computed.
        work = self._tracker.work(inst.id, uncached_chars // 4 + 1)
        return whole(
            response,
            inst,
            stream,
            inflight,
            work,
            on_first_byte=lambda: self._ejector.success(inst.id),
        )

    def count(self, outcome: str) -> None:
        self._requests.labels(outcome).inc()


class LocalPlan:
    """One request's way through the hook: `place` before the prefill leg, `served_by`
    after a disaggregated placement."""

    __slots__ = ("_avoid", "_blocks", "_hook", "_info")

    def __init__(
        self, hook: LocalPrefill, info: RequestInfo, blocks: PromptBlocks, avoid: Collection[str]
    ) -> None:
        self._hook = hook
        self._info = info
        self._blocks = blocks
        self._avoid = avoid

    async def place(
        self,
        forward: dict[str, Any],
        *,
        request_id: str,
        deadline: float,
        span: Span | None,
        path: str,
    ) -> Placement | None:
        """A decode that took the whole request, or None: go through a prefill."""
        hook = self._hook
        candidates = hook.eligible(self._info, self._blocks, self._avoid)
        body = as_stream(forward)  # as the decode leg of a disaggregated request
        for inst, uncached in candidates:
            placement = await hook.attempt(
                inst,
                uncached,
                body,
                request_id=request_id,
                deadline=deadline,
                parent=span,
                path=path,
            )
            if placement is not None:
                hook.record(self._blocks, inst.id)
                hook.count("local")
                _mark(span, "local")
                return placement
        hook.count("fallback" if candidates else "skipped")
        _mark(span, "disaggregated")
        return None

    def served_by(self, decode_id: str) -> None:
        """A disaggregated placement: its decode received the prompt's KV."""
        self._hook.record(self._blocks, decode_id)


def _mark(span: Span | None, path: str) -> None:
    if span is not None and span.is_recording():
        span.set_attribute(PREFILL_PATH, path)
