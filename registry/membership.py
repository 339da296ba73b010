"""Gateway side of membership: a local, always-available view of the registry.

Two tasks feed one view. Polling `snapshot()` is the source of truth (it alone sees records
expire after a kill -9); `events()` makes joins and leaves visible at once instead of up to
a poll later. Events are best effort, so whenever the stream is (re)opened a poll follows.
When the registry is unreachable the last view is kept: routing to slightly stale
instances beats routing to none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from types import MappingProxyType

from pdgate.config.aio import Backoff, ExponentialBackoff, cancel_and_wait
from pdgate.registry.base import (
    EventKind,
    EventStream,
    InstanceRecord,
    Registry,
    RegistryAuthError,
    RegistryEvent,
    RegistryUnavailable,
)

logger = logging.getLogger(__name__)

Listener = Callable[[Mapping[str, InstanceRecord], set[str]], None]


class Membership:
    def __init__(
        self,
        registry: Registry,
        *,
        poll_interval_s: float,
        max_instances: int = 4096,
        backoff: Backoff | None = None,
        hold_s: float = 0.0,
    ) -> None:
        """`hold_s`: how long instances the registry lost with its state (`generation`
        changed) stay in the view, unless they leave or come back first; the registry's
        record TTL: a live instance writes its record again within that."""
        if poll_interval_s <= 0 or max_instances <= 0 or hold_s < 0:
            raise ValueError("poll_interval_s and max_instances must be positive, hold_s >= 0")
        self._registry = registry
        self._poll_interval_s = poll_interval_s
        self._max_instances = max_instances
        self._backoff = backoff or ExponentialBackoff(0.1, 2.0)
        # Copy-on-write: a published view is never mutated, so readers and listeners may
        # keep it as a consistent snapshot.
        self._view: Mapping[str, InstanceRecord] = MappingProxyType({})
        self._version = 0
        self._changed = asyncio.Event()
        self._listeners: list[Listener] = []
        self._poll_ok: bool | None = None  # None until the first poll
        self._events_failed = False
        self._healthy: bool | None = None
        self._poll_failures = 0
        self._poll_now = asyncio.Event()
        # Events seen while a snapshot is in flight; replayed on top of it, since the
        # snapshot may predate them.
        self._during_poll: list[RegistryEvent] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._over_limit_logged = False
        self._hold_s = hold_s
        self._generation: str | None = None
        # What the registry lost with its state, kept until `_held_until` (loop time).
        self._held: dict[str, InstanceRecord] = {}
        self._held_until = 0.0

    # --- public API -------------------------------------------------------------------

    def instances(self) -> Mapping[str, InstanceRecord]:
        """The current view (read-only; a later change publishes a new mapping)."""
        return self._view

    @property
    def healthy(self) -> bool:
        """Whether the registry answered the last poll and the event stream is up."""
        return bool(self._healthy)

    @property
    def version(self) -> int:
        """Bumped on every change of the view."""
        return self._version

    def add_listener(self, callback: Listener) -> None:
        """Call ``callback(view, departed_ids)`` synchronously after every change."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    async def wait_changed(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - simpler for callers than a scope
        *,
        since: int | None = None,
    ) -> bool:
        """Wait for the view to change; False on timeout.

        With ``since`` (a `version` read earlier) a change that already happened counts,
        which avoids the race between reading state and starting to wait.
        """
        if since is not None and since != self._version:
            return True
        changed = self._changed
        try:
            async with asyncio.timeout(timeout):
                await changed.wait()
        except TimeoutError:
            return False
        return True

    async def start(self) -> None:
        """Subscribe, then load the initial view, then follow both in the background.

        In that order, nothing published around start-up is missed. Registry failures only
        leave the view empty and `healthy` False; the background tasks keep trying.
        """
        if self._tasks:
            raise RuntimeError("membership already started")
        stream = await self._subscribe()
        failure = await self._poll_once()
        if isinstance(failure, RegistryAuthError):
            await _aclose(stream)
            raise failure  # bad credentials will not heal: fail start-up, loudly
        self._tasks = [
            asyncio.create_task(self._poll_loop(), name="membership:poll"),
            asyncio.create_task(self._events_loop(stream), name="membership:events"),
        ]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)

    # --- polling ----------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            wait = self._poll_interval_s
            if self._poll_failures:
                # Retry a failed poll sooner, so recovery does not wait a whole interval.
                wait = min(wait, self._backoff.delay(self._poll_failures - 1))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._poll_now.wait()
            await self._poll_once()

    async def _poll_once(self) -> Exception | None:
        self._poll_now.clear()
        self._during_poll = []
        try:
            records = await self._registry.snapshot()
        except RegistryUnavailable as exc:
            self._poll_failures += 1
            self._set_health(poll_ok=False, reason=exc)
            return exc
        except Exception as exc:  # keep the last view whatever went wrong
            self._poll_failures += 1
            if self._poll_failures == 1:  # a bug, probably: one traceback, not one per poll
                logger.exception("registry snapshot failed")
            self._set_health(poll_ok=False, reason=exc)
            return exc
        finally:
            replay, self._during_poll = self._during_poll, None
        recovered = self._poll_failures > 0
        self._poll_failures = 0
        self._note_generation(self._registry.generation(), recovered=recovered)
        view = self._bounded(records)
        for event in replay:
            self._apply(view, event)
        self._keep_held(view)
        self._commit(view)
        self._set_health(poll_ok=True)
        return None

    def _note_generation(self, generation: str | None, *, recovered: bool) -> None:
        """A registry that lost its state is not every instance leaving: what it forgot stays
        in the view for `hold_s`, while the instances write their records again (a gateway
        that read it as departures answered 503 until their next heartbeats). Nor is an
        outage (`recovered`: the polls before this one failed): records that expired while
        Redis could not be reached (a Sentinel failover longer than the TTL) could not be
        written again, and their instances do so within a heartbeat of the reconnect."""
        lost = self._generation is not None and generation not in (None, self._generation)
        self._generation = generation
        if (lost or recovered) and self._hold_s > 0 and self._view:
            self._held = dict(self._view)
            self._held_until = asyncio.get_running_loop().time() + self._hold_s
            logger.warning(
                "the registry %s; keeping %d instances for %.1f s while they register again",
                "lost its state" if lost else "is back after an outage",
                len(self._held),
                self._hold_s,
            )

    def _keep_held(self, view: dict[str, InstanceRecord]) -> None:
        if not self._held:
            return
        if asyncio.get_running_loop().time() >= self._held_until:
            self._held = {}  # whoever has not registered again by now is gone
            return
        for instance_id, record in self._held.items():
            if instance_id not in view and len(view) < self._max_instances:
                view[instance_id] = record

    def _bounded(self, records: Iterable[InstanceRecord]) -> dict[str, InstanceRecord]:
        view: dict[str, InstanceRecord] = {}
        for record in records:
            if len(view) >= self._max_instances:
                if not self._over_limit_logged:
                    self._over_limit_logged = True
                    logger.warning(
                        "membership over max_instances=%d; ignoring the rest", self._max_instances
                    )
                break
            view[record.id] = record
        return view

    # --- events -----------------------------------------------------------------------

    async def _events_loop(self, stream: AsyncIterator[RegistryEvent] | None) -> None:
        attempt = 0 if stream is not None else 1
        while True:
            if stream is None:
                await asyncio.sleep(self._backoff.delay(attempt - 1))
                stream = await self._subscribe()
                if stream is None:
                    attempt += 1
                    continue
                self._poll_now.set()  # anything published while unsubscribed was missed
            try:
                async for event in stream:
                    attempt = 0  # a delivering stream resets the back-off
                    self._on_event(event)
                attempt += 1  # ended cleanly (the subscriber fell behind): re-subscribe
            except RegistryUnavailable as exc:
                attempt += 1
                self._set_health(events_failed=True, reason=exc)
            except Exception as exc:  # the follower must survive anything
                attempt += 1
                if attempt == 1:
                    logger.exception("registry event stream failed")
                self._set_health(events_failed=True, reason=exc)
            finally:
                await _aclose(stream)
                stream = None

    async def _subscribe(self) -> AsyncIterator[RegistryEvent] | None:
        """A live subscription, or None (health updated) when the registry refuses one."""
        stream = self._registry.events()
        try:
            # A plain async iterator subscribes on its first step, so for one of those the
            # re-poll that follows may race a publish; the periodic poll covers that.
            if isinstance(stream, EventStream):
                await stream.wait_subscribed()
        except RegistryUnavailable as exc:
            await _aclose(stream)
            self._set_health(events_failed=True, reason=exc)
            return None
        except Exception as exc:
            await _aclose(stream)
            logger.exception("registry event subscription failed")
            self._set_health(events_failed=True, reason=exc)
            return None
        except BaseException:  # cancelled: do not leak the subscription
            await _aclose(stream)
            raise
        self._set_health(events_failed=False)
        return stream

    def _on_event(self, event: RegistryEvent) -> None:
        if self._during_poll is not None:
            if len(self._during_poll) < self._max_instances:
                self._during_poll.append(event)
            else:
                self._poll_now.set()  # too many to replay: just poll again
        view = dict(self._view)
        self._apply(view, event)
        self._commit(view)

    def _apply(self, view: dict[str, InstanceRecord], event: RegistryEvent) -> None:
        if event.kind is EventKind.LEAVE:
            view.pop(event.instance_id, None)
            self._held.pop(event.instance_id, None)  # it left: no longer only forgotten
        elif event.record is not None and (
            event.instance_id in view or len(view) < self._max_instances
        ):
            view[event.instance_id] = event.record

    # --- state ------------------------------------------------------------------------

    def _commit(self, view: dict[str, InstanceRecord]) -> None:
        old = self._view
        if view == old:
            return  # steady-state polls change nothing
        departed = old.keys() - view.keys()
        self._view = MappingProxyType(view)
        self._version += 1
        # Wake current waiters; later ones wait for the next change.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for listener in list(self._listeners):
            try:
                listener(self._view, set(departed))
            except Exception:
                logger.exception("membership listener %r failed", listener)

    def _set_health(
        self,
        *,
        poll_ok: bool | None = None,
        events_failed: bool | None = None,
        reason: BaseException | None = None,
    ) -> None:
        if poll_ok is not None:
            self._poll_ok = poll_ok
        if events_failed is not None:
            self._events_failed = events_failed
        if self._events_failed:
            healthy = False
        elif self._poll_ok is None:
            return  # subscribed, but no poll yet: nothing known
        else:
            healthy = self._poll_ok
        if not healthy and self._healthy is not False:
            # Once per outage; the view is kept as it was.
            logger.warning(
                "registry unreachable, keeping the last view of %d instances: %s",
                len(self._view),
                reason,
            )
        elif healthy and self._healthy is False:
            logger.info("registry reachable again (%d instances)", len(self._view))
        self._healthy = healthy


async def _aclose(stream: object) -> None:
    close = getattr(stream, "aclose", None)
    if close is None:
        return
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await close()
