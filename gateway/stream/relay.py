"""Relaying the decode's answer to the client, across the legs of one request.

`Relay` owns a request from its placement to its last byte. Nothing goes to the client until
a stream really started (its first data event, or the prefill's first token with
``first_token_early``), so a decode that fails before that is invisible:

* it was never reached: the dispatcher gives the next decode the same KV
  (gateway/placement/decode_leg.py);
* it answered an error status, or sent its headers and then broke (connection lost, in-band
  error, no ``[DONE]``) before its first event: its KV may be gone, so the request is placed
  again, prefill included, within its deadline (a *failover*).

A decode that breaks after events were relayed is *migrated* (up to ``max_migrations`` per
request): the stream is continued as a new P/D request from the prompt's token ids plus the
ids of the tokens the client was sent (gateway/stream/continuation.py), with a new deadline of the
group's TTFT timeout, and the client's stream goes on where it stopped. Failovers count
against the retry budget; when the request cannot be placed again the failure is a real
status before anything was sent and an in-band error after.

Streaming clients get the decode's SSE as it arrives, never buffered whole. With migration
off (and no first token early) the relay passes bytes through without parsing events (the
only inspection: the first event, and the stream's tail so that a client always sees
``[DONE]``). Otherwise each event is read for its token ids, which are stripped from what
the client gets unless it asked for them: a stream's usual token event by its bytes (its
shape checked, gateway/stream/continuation.py), any other event parsed; an unchanged event keeps its
bytes.
Non-streaming clients get the stream assembled into one JSON answer (bounded in size); a
failure before the end is then still a real HTTP status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import Send

from pdgate.config.openai_api import Api, ApiRequest, ChatCompletionRequest
from pdgate.config.tracing import Span, Tracing
from pdgate.config.wire import EXT_CONTINUATION, SSE_DONE
from pdgate.gateway import errors
from pdgate.gateway.observe.metrics import ANY_GROUP, GatewayMetrics
from pdgate.gateway.placement.dispatch import Dispatcher
from pdgate.gateway.placement.placed import DecodeLeg, Placement, PrefillGrant
from pdgate.gateway.stream.assemble import StreamError, one_event, parse_event, sse_events
from pdgate.gateway.stream.continuation import JoinedStop, Progress, not_continuable
from pdgate.gateway.stream.ids import StreamIds
from pdgate.gateway.stream.out import ClientOut, Item, StreamOut, WholeOut
from pdgate.policies.base import RequestInfo

__all__ = ["Relay", "RelayOptions", "RelayRequest"]

log = logging.getLogger("pdgate.relay")

# What may follow a decode's [DONE] before its connection is closed instead of reused.
_DRAIN_S = 0.5
_DRAIN_BYTES = 4096
_TAIL = len(SSE_DONE) + 2


@dataclass(frozen=True, slots=True)
class RelayOptions:
    chunk_bytes: int = 64 * 1024
    max_response_bytes: int = 16 * 1024 * 1024
    max_migrations: int = 0
    first_token_early: bool = False
    ttft_timeout_s: float = 10.0  # a continuation's deadline, from the failure


@dataclass(frozen=True, slots=True)
class RelayRequest:
    """What the endpoint knows of the request."""

    info: RequestInfo
    req: ApiRequest
    forward: dict[str, Any]  # the client's body as it goes upstream
    api: Api
    request_id: str
    deadline: float
    arrived: float
    group: str = ANY_GROUP
    span: Span | None = None


async def _drain(placement: Placement, chunk_bytes: int) -> None:
    """Read what follows ``[DONE]`` (the chunked encoding's last chunk, already on its way) so
    the decode's connection goes back to the pool: closing it unread costs a new connection
    per request on both sides, a visible share of the gateway's CPU under load. A decode that
    keeps sending after [DONE] is cut off."""
    extra = 0
    with contextlib.suppress(errors.UpstreamError, TimeoutError):
        async with asyncio.timeout(_DRAIN_S):
            while chunk := await placement.stream.read(chunk_bytes):
                extra += len(chunk)
                if extra > _DRAIN_BYTES:
                    return


@dataclass(frozen=True, slots=True)
class _Broken:
    """How a leg failed: ``lost``, ``error``, ``truncated`` (metrics' reasons), ``status``."""

    reason: str
    message: str
    events: int  # events the leg had relayed
    final: errors.GatewayError | None = None  # not placed again: the client gets this error
    silent: bool = False  # its decode stopped answering every stream: it is ejected


def _lost(exc: errors.UpstreamError, events: int) -> _Broken:
    reason = "truncated" if "without [DONE]" in str(exc) else "lost"
    return _Broken(reason, str(exc), events, silent=isinstance(exc, errors.DecodeSilent))


class Relay:
    """One request's legs, from the first placement to the last byte. `first` is the first
    leg's placement (the endpoint's records); every later leg is closed here, exactly once."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        send: Send,
        request: RelayRequest,
        options: RelayOptions,
        metrics: GatewayMetrics,
        tracing: Tracing | None = None,
        out: ClientOut | None = None,
    ) -> None:
        """`out`: the client's response in another API than the request's (its events all
        parsed: gateway/translate/); by default the request's own."""
        self._dispatcher = dispatcher
        self._request = request
        self._options = options
        self._metrics = metrics
        self._tracing = tracing or Tracing.off()
        req = request.req
        self._stream = req.stream
        client_ids = bool(req.return_token_ids)
        if out is None:
            out = (
                StreamOut(send, request.request_id)
                if req.stream
                else WholeOut(send, request.request_id, client_ids)
            )
        self._out = out
        top = req.top_logprobs or 0 if isinstance(req, ChatCompletionRequest) else 0
        self._progress = Progress(
            request.api,
            request_id=request.request_id,
            max_tokens=req.max_tokens or 1,
            stops=req.stop_sequences,
            client_ids=client_ids,
            include_usage=req.include_usage or not req.stream,
            top_logprobs=top,
        )
        self._early = (
            options.first_token_early
            and req.stream
            and (req.max_tokens or 1) > 1
            and not_continuable(request.forward) is None
            and dispatcher.decodes_declare(request.info, EXT_CONTINUATION)
        )
        # Token ids are what a continuation is made of: asked of every leg when one may come.
        self._forward = request.forward
        if options.max_migrations > 0 or self._early:
            self._forward = {**request.forward, "return_token_ids": True}
        self._parse = options.max_migrations > 0 or self._early or out.parsed
        self.first: Placement | None = None
        self._current: Placement | None = None
        self.migrations = 0
        self._last_emit = 0.0  # when the client was last sent events (0: never)
        self._received = 0  # bytes of every leg's answer (a whole answer is bounded)
        self._relay_span: Span | None = None

    @property
    def out(self) -> ClientOut:
        return self._out

    @property
    def started(self) -> bool:
        """Whether the response's status went out (failures are then reported in-band)."""
        return self._out.started

    async def run(self) -> str:
        """Serve the request; the outcome label for metrics. Raises `GatewayError` only
        before the response started."""
        try:
            outcome = await self._run()
            if not self._stream:
                request = self._request
                self._metrics.ttft.labels(request.group).observe(time.monotonic() - request.arrived)
            return outcome
        finally:
            if self._current is not None:
                self._current.close()
                self._current = None
            if self._relay_span is not None:
                if self._relay_span.is_recording():
                    self._relay_span.set_attribute("pdgate.migrations", self.migrations)
                self._relay_span.end()

    async def _run(self) -> str:
        request, progress, options = self._request, self._progress, self._options
        deadline = request.deadline
        avoid: set[str] = set()
        migration: Span | None = None
        tries = 0
        while True:
            continuing = progress.events > 0  # the client saw output: go on from its ids
            broken_at: Placement | None = None
            try:
                placement = await self._place(continuing, deadline, avoid, retry=tries > 0)
            except errors.DecodeLost as exc:
                broken = _Broken("status", str(exc), 0)
            except errors.GatewayError as exc:
                _end(migration, "failed")
                if not self.started:
                    raise
                await self._out.error(exc)
                return "upstream_error"
            else:
                _end(migration, "placed")
                migration = None
                self._placed(placement)
                leg = await self._leg(placement, continuing=progress.events > 0)
                if leg is None:
                    return "ok"
                broken, broken_at = leg, placement
                placement.close()
                self._current = None
                avoid.add(placement.decode_id)
                log.warning("decode %s broke: %s", placement.decode_id, broken.message)
                if broken.silent:
                    # Every stream on it is moving: no new one should go there meanwhile.
                    self._dispatcher.ejector.dead(placement.decode_id, "decode")
            tries += 1
            self._early = False  # the first token went out (or will not) with the first leg
            if progress.finish is not None or (progress.events and progress.remaining <= 0):
                # The answer was whole: only its tail went missing.
                await self._out.events([(e, None) for e in progress.ending()])
                await self._out.done()
                return "ok"
            error = self._refused(broken, broken_at)
            if error is not None:
                if not self.started:
                    raise error
                await self._out.error(error)
                return "upstream_error"
            migration = self._tracing.start("pdgate.migration", parent=request.span)
            if migration.is_recording():
                migration.set_attribute("pdgate.kind", "migration" if broken.events else "failover")
                migration.set_attribute("pdgate.reason", broken.reason)
                migration.set_attribute("pdgate.tokens_sent", len(progress.ids))
                if broken_at is not None:
                    migration.set_attribute("pdgate.from_decode", broken_at.decode_id)
            if broken.events:
                self.migrations += 1
                self._metrics.migrations.labels(broken.reason).inc()
            else:
                self._metrics.decode_failovers.labels(broken.reason).inc()
            if progress.events:
                deadline = time.monotonic() + options.ttft_timeout_s

    def _refused(self, broken: _Broken, placement: Placement | None) -> errors.GatewayError | None:
        """Why the broken leg is not placed again, as the client's error (None: it is)."""
        if broken.final is not None:
            return broken.final
        progress = self._progress
        why: str | None = None
        if broken.events and self.migrations >= self._options.max_migrations:
            why = "migration is off" if not self._options.max_migrations else "too many migrations"
        elif progress.events:
            extensions = self._dispatcher.extensions(placement.decode_id) if placement else ()
            why = progress.why_not(self._request.forward, extensions)
        # Failovers are budgeted like prefill ones. A migration is not: `max_migrations`
        # already bounds what one request can add, and a decode that dies takes every stream
        # it served at once, more than any budget's burst would let through.
        if why is None and not broken.events and not self._dispatcher.budget.withdraw():
            self._metrics.retry_budget_exhausted.inc()
            why = "the retry budget is spent"
        if why is None:
            return None
        log.warning("request %s not continued: %s", self._request.request_id, why)
        if broken.events or progress.events:
            return errors.BadGateway("the decode instance failed mid-stream")
        return errors.BadGateway("the decode instance failed before answering")

    def _leg_info(self) -> RequestInfo:
        info = self._request.info
        generated = len(self._progress.ids)
        # About four characters per token, as the forwarder's token-work estimate.
        return dataclasses.replace(
            info,
            prompt_chars=info.prompt_chars + 4 * generated,
            max_tokens=max(self._progress.remaining, 1),
        )

    def _placed(self, placement: Placement) -> None:
        self._current = placement
        if self._out.prefill_id is None:
            self._out.prefill_id = placement.prefill_id
        if self._out.decode_id is None:
            self._out.decode_id = placement.decode_id
        if self.first is not None:
            return
        self.first = placement
        request = self._request
        self._metrics.placement.observe(time.monotonic() - request.arrived)
        span = request.span
        if span is not None and span.is_recording():
            span.set_attribute("pdgate.prefill", placement.prefill_id)
            span.set_attribute("pdgate.decode", placement.decode_id)
            span.set_attribute("pdgate.prefill_attempts", placement.prefill_attempts)
            span.set_attribute("pdgate.prefill_rejections", placement.prefill_rejections)
        self._relay_span = self._tracing.start("pdgate.relay", parent=span)

    async def _place(
        self, continuing: bool, deadline: float, avoid: set[str], *, retry: bool
    ) -> Placement:
        """Both legs of the next try: the prefill, the first token early if it goes out now,
        then the decode (continuing from what the client already has)."""
        request, dispatcher = self._request, self._dispatcher
        api = Api.COMPLETIONS if continuing else request.api
        body = self._progress.body(self._forward) if continuing else self._forward
        prefilled = await dispatcher.prefill(
            self._leg_info() if continuing else request.info,
            body,
            request_id=request.request_id,
            deadline=deadline,
            span=request.span,
            api=api,
            avoid=avoid,
            retry=retry,
            token_ids=self._early,
        )
        leg = DecodeLeg(body, api)
        if self._early and prefilled.grant is not None:
            try:
                leg = await self._first_token(prefilled.grant) or leg
            except BaseException:
                prefilled.close()  # the client left while its first token went out
                raise
        return await dispatcher.decode(prefilled, leg)

    async def _first_token(self, grant: PrefillGrant) -> DecodeLeg | None:
        """First token early: the prefill's token goes to the client now, and the decode leg
        continues from prompt + that token (decodes that declare the continuation only)."""
        events = self._progress.early(grant.reply)
        if events is None:
            return None
        self._out.prefill_id = grant.instance.id
        await self._emit([(e, None) for e in events])
        return DecodeLeg(self._progress.body(self._forward), Api.COMPLETIONS, EXT_CONTINUATION)

    async def _emit(self, items: Sequence[Item], placement: Placement | None = None) -> None:
        self._emitted(len(items), placement)
        await self._out.events(items)

    def _emitted(self, events: int, placement: Placement | None) -> None:
        """Timing and counts of `events` token events going out now (every relay path)."""
        now = time.monotonic()
        if self._last_emit:
            gap = now - self._last_emit
            self._metrics.itl.observe(gap)
            if placement is not None:
                placement.gaps_s += gap
        elif self._stream:
            self._metrics.ttft.labels(self._request.group).observe(now - self._request.arrived)
        self._last_emit = now
        if placement is not None:
            placement.tokens += events
            if placement.first_token_at is None:
                placement.first_token_at = now

    # -- one leg ---------------------------------------------------------------------------

    async def _leg(self, placement: Placement, *, continuing: bool) -> _Broken | None:
        if continuing:
            self._progress.begin_leg()
        if self._parse:
            return await self._parsed(placement, continuing)
        return await self._bytes(placement)

    async def _parsed(self, placement: Placement, continuing: bool) -> _Broken | None:
        """Every event read for its token ids: a stream's usual event as bytes
        (`Progress.passthrough_bytes`), the others parsed; ids recorded (and stripped unless
        asked for), a continuation leg's events reshaped as the client's stream."""
        progress = self._progress
        stop = JoinedStop(progress.stops, progress.tail) if continuing else None
        # A stream's usual events as bytes, unless the client's answer is shaped from them.
        unparsed = self._stream and not continuing and not self._out.parsed
        send = self._out.send
        buffer = bytearray()
        events = 0
        limit = self._options.max_response_bytes
        try:
            stream, size = placement.stream, self._options.chunk_bytes
            while chunk := await stream.read(size):
                self._received += len(chunk)
                whole_too_big = not self._stream and self._received > limit
                if whole_too_big or len(buffer) + len(chunk) > limit:
                    error = errors.BadGateway(f"the decode's answer is larger than {limit} bytes")
                    return _Broken("error", str(error), events, final=error)
                one = one_event(chunk) if not buffer else None
                if unparsed and one is not None:
                    raw = progress.passthrough_bytes(one)
                    if raw is not None:
                        # The usual chunk, one token's event, of a stream whose first event was
                        # parsed (the response has started): out at once, without the lists.
                        events += 1
                        self._emitted(1, placement)
                        body = b"data: " + raw + b"\n\n"
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        continue
                if one is None:
                    buffer += chunk
                out: list[Item] = []
                done = False
                for data in [one] if one is not None else sse_events(buffer):
                    if data[:1] == b"[" and data.strip() == b"[DONE]":
                        done = True
                        break
                    # (A one-event chunk was offered to the bytes path above already.)
                    if (
                        unparsed
                        and one is None
                        and (raw := progress.passthrough_bytes(data)) is not None
                    ):
                        if not events:
                            placement.first_byte()
                        events += 1
                        out.append((None, raw))
                        continue
                    event = parse_event(data)
                    if "error" in event:
                        return _in_band(event, events)
                    if not events:
                        placement.first_byte()  # the decode holds the KV: the prefill's slot frees
                    events += 1
                    if continuing:
                        out.extend((e, None) for e in progress.continued(event, stop))
                        if stop is not None and stop.stopped:
                            # A stop string across the boundary: the stream ends here.
                            out.extend((e, None) for e in progress.ending())
                            done = True
                            break
                    elif progress.passthrough(event):
                        out.append((event, None))
                    else:
                        out.append((event, data))
                if done:
                    # Drained before the client's response ends: once it has, the endpoint
                    # takes the client as gone and cancels this task. Usually the body's end
                    # came with [DONE]: nothing to wait for, and the last events go out
                    # with [DONE] in the response's last send.
                    if not placement.stream.at_eof():
                        if out:
                            await self._emit(out, placement)
                            out = []
                        await _drain(placement, self._options.chunk_bytes)
                    if out:
                        self._emitted(len(out), placement)
                    await self._out.done(out)
                    return None
                if out:
                    self._emitted(len(out), placement)
                    await self._out.events(out)
            raise errors.UpstreamError(placement.stream.url, "stream ended without [DONE]")
        except StreamError as exc:
            return _Broken("error", str(exc), events)
        except errors.UpstreamError as exc:
            return _lost(exc, events)

    async def _bytes(self, placement: Placement) -> _Broken | None:
        """Migration off: bytes as they arrive, parsed only until the first event."""
        out = self._out
        assert isinstance(out, StreamOut)
        ids = StreamIds(self._request.request_id)
        pending = bytearray()  # what arrived before the first event was whole
        started = False
        handed_over = False
        tail = b""
        send = out.send
        try:
            stream, size = placement.stream, self._options.chunk_bytes
            while raw := await stream.read(size):
                if not started:
                    pending += raw
                    head = sse_events(bytearray(pending))
                    if not head:
                        if len(pending) > self._options.max_response_bytes:
                            return _Broken("error", "the decode's first event is too large", 0)
                        continue
                    if head[0].strip() != b"[DONE]" and "error" in (first := parse_event(head[0])):
                        return _in_band(first, 0)
                    started = True
                    raw = bytes(pending)
                chunk = ids.feed(raw)
                if not chunk:
                    continue
                # A keep-alive comment is not an event: only data says the KV has arrived.
                if b"data:" in chunk:
                    if not handed_over:
                        handed_over = True
                        placement.first_byte()  # the decode holds the KV: the prefill's slot frees
                    # Tokens: the data events but the stream's closing [DONE].
                    if tokens := chunk.count(b"data:") - chunk.endswith(SSE_DONE):
                        self._emitted(tokens, placement)
                if out.started:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                else:
                    await out.raw(chunk)
                # Enough of the stream's end to find its [DONE] in, without copying the chunk.
                tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
            if rest := ids.flush():
                await out.raw(rest)
                tail = (tail + rest)[-_TAIL:]
            if SSE_DONE not in tail:
                raise errors.UpstreamError(placement.stream.url, "stream ended without [DONE]")
        except StreamError as exc:
            return _Broken("error", str(exc), int(started))
        except errors.UpstreamError as exc:
            return _lost(exc, int(started))
        await out.end()
        return None


def _in_band(event: dict[str, Any], events: int) -> _Broken:
    """The decode's in-band error: the request's own fault (4xx: not retried, the client is
    told) or the decode's."""
    err = event.get("error")
    err = err if isinstance(err, dict) else {}
    message = str(err.get("message") or "the decode failed")
    code = err.get("code")
    if err.get("type") == "invalid_request_error" or (type(code) is int and 400 <= code < 500):
        return _Broken("error", message, events, final=errors.BadRequest(message[:1024]))
    return _Broken("error", message, events)


def _end(span: Span | None, outcome: str) -> None:
    if span is not None:
        if span.is_recording():
            span.set_attribute("pdgate.outcome", outcome)
        span.end()
