"""What every queue of one gateway shares: built once by the composition root
(gateway/app.py, `build_dispatcher`) and handed to the dispatcher, which hands it to each
queue's forwarder (forwarder.py), admission (admission.py) and calls (prefill_call.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdgate.config.aio import Background, Backoff
from pdgate.config.tracing import Tracing
from pdgate.gateway.errors import GatewayError, UpstreamStatus
from pdgate.gateway.instances.affinity import PrefixLookup
from pdgate.gateway.instances.health import Ejector, RetryBudget
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.observe.metrics import GatewayMetrics
from pdgate.gateway.observe.ratio import RatioAdvisor
from pdgate.gateway.placement.admission import AdmissionOptions
from pdgate.gateway.placement.drain import DecodeCapacity, DecodeWaits
from pdgate.gateway.placement.handoff import Handoffs
from pdgate.gateway.placement.leases import Fleet
from pdgate.gateway.upstream.base import Upstream

__all__ = ["ForwardingOptions", "Shared"]


@dataclass
class ForwardingOptions:
    batch_forwarding: bool = True
    batch_endpoint: bool = False  # one batch call per run (pdgate shims only)
    # Send only to a prefill computing nothing, fleet-wide (``prefill_admit = idle``): the
    # slot lease checks it in the same atomic step that takes the slots.
    admit_idle: bool = False
    # Longest one prefill call may take before the request moves on (a prefill that accepted
    # the connection and hangs); None: adaptive, from recent prefill times.
    try_timeout_s: float | None = None
    client_error: Callable[[UpstreamStatus], GatewayError] = field(
        default=lambda exc: GatewayError(str(exc))
    )


@dataclass(frozen=True)
class Shared:
    """What every forwarder of one gateway shares (built once, in the dispatcher)."""

    tracker: InstanceTracker
    upstream: Upstream
    backoff: Backoff
    metrics: GatewayMetrics
    index: PrefixLookup | None
    options: ForwardingOptions
    background: Background
    fleet: Fleet
    ejector: Ejector
    budget: RetryBudget
    # Prefilled requests waiting for a decode (their queues hold with `decode_backpressure`).
    decode_waits: DecodeWaits
    tracing: Tracing = field(default_factory=Tracing.off)
    advisor: RatioAdvisor = field(default_factory=RatioAdvisor)
    # What the decodes can take, bounding drain admission's pace (None: no bound).
    decode_capacity: DecodeCapacity | None = None
    # What each queue takes, refuses and sheds (admission.py).
    admission: AdmissionOptions = field(default_factory=AdmissionOptions)
    # Stock servers' legs by their KV connector (handoff.py; None: shims' wire only).
    handoffs: Handoffs | None = None
