"""The decode's SSE stream, on sse-starlette.

sse-starlette brings what a long-lived event stream needs beyond Starlette's
`StreamingResponse`: keep-alive pings (``: ping`` comments, which SSE clients ignore and which
keep idle-timeout proxies and the gateway's read timeout from cutting a stream that waits for
its KV), a watch on the client's disconnect that stops the stream at once, and a send timeout
that drops a client that stopped reading instead of holding its decode slot for ever.

The events themselves are pdgate's pre-encoded ``data: {...}\\n\\n`` bytes (vLLM's wire format),
passed through as they are.

Shutdown is pdgate's, not sse-starlette's: the shim drains (refuses new work and waits for
its streams) and then uvicorn's graceful timeout ends what is left, as for any response.
sse-starlette's own hook (a process-wide flag set from uvicorn's signal handler, watched by a
polling task) is not used: pdgate's runner owns the signals, and one process may host many
servers (``pdgate up``) that must not stop each other's streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import SendTimeoutError
from starlette.types import Message, Receive, Scope, Send

from pdgate.engine_shim._http import close_body

__all__ = ["EventStream"]

log = logging.getLogger("pdgate.shim.decode")
# sse-starlette logs every event it sends at DEBUG: generated text, which pdgate never logs.
logging.getLogger("sse_starlette.sse").setLevel(logging.INFO)


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep="\n")


class EventStream(EventSourceResponse):
    """An SSE response that calls `on_close` once after it ends, however it ends."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        on_close: Callable[[], None],
        ping_s: float,
        send_timeout_s: float | None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # The send timeout is ours (`_send_with_timeout`, `_watch_sends`).
        super().__init__(
            events,
            headers=headers,
            ping=ping_s,
            sep="\n",
            ping_message_factory=_ping,
            data_sender_callable=self._watch_sends if send_timeout_s else None,
        )
        self._on_close = on_close
        self._send_timeout_s = send_timeout_s
        self._send_started: float | None = None  # monotonic time of the send in progress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            # The client stopped reading (its socket buffers are full): give its slot back.
            log.warning("SSE client not reading for %s s; stream dropped", self._send_timeout_s)
        finally:
            await close_body(self.body_iterator, self._on_close)

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        # Replaces sse-starlette's, which opens an anyio cancel scope around every event
        # (even without a timeout): that alone cost a third of the decode's SSE events/s.
        self._send_started = time.monotonic()
        await send(message)
        self._send_started = None

    async def _watch_sends(self) -> None:
        """End the stream (`SendTimeoutError`) once one send has waited `send_timeout_s`.

        One timer per stream instead of one per event; a stalled send is noticed within a
        quarter of the timeout after it expires."""
        assert self._send_timeout_s
        while True:
            await asyncio.sleep(self._send_timeout_s / 4)
            started = self._send_started
            if started is not None and time.monotonic() - started >= self._send_timeout_s:
                raise SendTimeoutError

    async def _listen_for_exit_signal(self) -> None:  # type: ignore[override]
        # See the module docstring: never the process-wide shutdown flag.
        await anyio.sleep_forever()
