"""Side endpoints of the instances: which ready ones answer a path for a model, and one call
to the first of them that answers.

An instance declares the side endpoints it serves in its registry record (``endpoints``:
pdgate's shims declare ``/tokenize`` and ``/detokenize``; a stock server's come from its
``GET /openapi.json``, registry/static.py). ``/tokenize`` and ``/detokenize`` are answered by
an engine's API server, not by its batch, so they take no slot: `serving` ranks every ready
instance of the model that declares the path, of any role, least loaded first, and
`call_first` tries them in that order, moving on when one cannot be reached or fails (5xx).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdgate.config.wire import Role
from pdgate.gateway.errors import UpstreamError
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.upstream.base import Upstream
from pdgate.policies.base import InstanceLoad

__all__ = ["Answer", "call_first", "serving"]


def serving(
    tracker: InstanceTracker,
    model: str,
    path: str,
    roles: Iterable[Role] = tuple(Role),
    group: str | None = None,
) -> list[InstanceLoad]:
    """The ready instances of `roles` serving `model` (a model or an adapter) in `group`
    (None: any) whose record declares `path`, least loaded first (the share of their slots
    in use, then open streams), ejected ones last."""
    records = tracker.records()
    found = [
        load
        for role in roles
        for load in tracker.loads(role, model, group)
        if (rec := records.get(load.id)) is not None and path in rec.endpoints
    ]
    found.sort(key=lambda c: (c.ejected, c.inflight / max(c.capacity, 1), c.open_streams))
    return found


@dataclass(frozen=True, slots=True)
class Answer:
    """What an instance answered: its status and body, whatever the status."""

    instance: InstanceLoad
    status: int
    body: bytes


async def call_first(
    upstream: Upstream,
    candidates: Sequence[InstanceLoad],
    path: str,
    body: dict[str, Any],
    *,
    request_id: str,
    deadline: float,
    tries: int,
    failed: list[str],
    headers: Mapping[str, str] | None = None,
    tracker: InstanceTracker | None = None,
) -> Answer | None:
    """POST `body` to `path` on the first of `candidates` that answers below 500, trying at
    most `tries` of them until `deadline` (``time.monotonic()``); None when none did (each
    failure is appended to `failed`, and counted on the instance with `tracker`)."""
    for inst in candidates[:tries]:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            status, raw = await upstream.post(
                inst.url, path, body, request_id=request_id, timeout_s=left, headers=headers
            )
        except UpstreamError as exc:
            failed.append(str(exc))
        else:
            if status < 500:
                return Answer(inst, status, raw)
            failed.append(f"{inst.url}{path}: answered HTTP {status}")
        if tracker is not None:
            tracker.failed(inst.id)
    return None
