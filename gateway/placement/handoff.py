"""How a prompt's KV goes from a prefill to a decode, by the prefill's KV connector (its
record's, config/wire.py `KvConnector`): what each leg carries, and what frees the
prefill's blocks when no decode takes them.

pdgate's shims (``pdgate``) keep pdgate's wire: the gateway names the KV handle
(``x-pdgate-kv-id``), tells the prefill the decode's ``max_tokens``
(``x-pdgate-decode-max-tokens``), may batch prefill legs, and releases KV nobody fetches with
``DELETE /v1/kv/{id}``. None of that goes to a stock vLLM server: there `stock_leg` gives
each prefill attempt a `StockLeg`, whose legs are what vLLM 0.32's own proxies send its
connectors:

* **pull** (``nixl``, ``example``, none named; ``tests/v1/kv_connector/nixl_integration/
  toy_proxy_server.py``): the prefill leg is the client's body with ``max_tokens`` 1,
  ``stream`` false, no ``stream_options``, ``min_tokens`` left out (vLLM refuses it above
  ``max_tokens``) and the six ``kv_transfer_params`` of `prefill_kv_request`; the decode
  leg is the client's body with the prefill's answered params unchanged (none when it
  answered none: ExampleConnector's decode reads its storage by the prompt). Both legs
  carry the same ``X-Request-Id``, the request's.
* **nixl_push** (``NixlPushConnector``; ``toy_push_proxy_server.py``): the same prefill
  leg; the decode leg's params are ``do_remote_prefill``, the prefill's engine id, side
  channel and ``tp_size``, and no block ids: the decode registers its blocks with the
  prefill, which writes into them (push_scheduler.py). The prefill matches the
  registration to its request by vLLM's base request id (push_worker.py), so both legs
  carry one leg id, new for every prefill attempt: a registration left over from an
  abandoned attempt must never match a later one (the prefill would write into freed
  blocks). The decode is chosen before the prefill leg (gateway/placement/push.py).
* **mooncake** (``MooncakeConnector``; ``examples/disaggregated/mooncake_connector/
  mooncake_connector_proxy.py``): the prefill leg's params are ``do_remote_decode`` and a
  ``transfer_id`` (``xfer-`` + the leg id, new per attempt: the prefill keys its blocks by
  it), with ``X-data-parallel-rank``; the prefill answers no params
  (MooncakeConnectorScheduler.request_finished returns None); the decode leg's are
  ``do_remote_prefill``, the bootstrap server, the rank's engine id (the record's,
  read from ``GET {bootstrap}/query``) and the transfer id.

Freeing the prefill's blocks: a stock prefill that is abandoned mid-call (deadline, client
gone) is aborted by vLLM when the connection closes, and frees its blocks at once. One that
answered and whose decode leg never goes out holds them until its connector's lease ends
(NIXL's ``kv_lease_duration``, 30 s by default; Mooncake's
``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``, 480 s): vLLM has no call that frees them, but a
decode that refuses a request carrying their params before its engine runs tells the
prefill to free them (``_with_kv_transfer_rejection_cleanup``, then the connector's
``request_finished``). So the gateway sends such a decode, of the same connector, a
*release leg* it refuses at once: the params with ``stream`` and ``use_beam_search``
(OpenAIServingCompletion._create_completion's first refusal, a 400). NixlPushConnector's
prefill is freed only by its lease: its refused decode registers nothing.
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdgate.config.wire import COMPLETIONS_PATH, KvConnector, Role, prefill_kv_request
from pdgate.gateway.upstream.base import Upstream
from pdgate.policies.base import InstanceLoad
from pdgate.registry.base import InstanceRecord

__all__ = ["Handoffs", "OnSend", "StockLeg", "leg_connector"]

log = logging.getLogger("pdgate.handoff")

PUSH = KvConnector.NIXL_PUSH.value
MOONCAKE = KvConnector.MOONCAKE.value
PDGATE = KvConnector.PDGATE.value
# vLLM's sampling params refuse min_tokens above max_tokens: the NIXL proxies pop these.
_NOT_FOR_STOCK_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
# The decode-leg params of NixlPushConnector a prefill's answer gives
# (toy_push_proxy_server.py), besides do_remote_prefill/do_remote_decode.
_PUSH_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")
# Of those, what names the prefill itself (the same for each of its requests).
_PUSH_PEER = ("remote_engine_id", "remote_host", "remote_port", "tp_size")
_MAX_PEERS = 4096
_RELEASE_TIMEOUT_S = 5.0
_DP_RANK_HEADER = "X-data-parallel-rank"


def leg_connector(record: InstanceRecord | None) -> str:
    """The connector a prefill's legs follow (a record gone: pdgate's, as before)."""
    return PDGATE if record is None else record.kv_connector


@dataclass(frozen=True, slots=True)
class StockLeg:
    """One prefill attempt at a stock vLLM server, as its connector wants it sent."""

    connector: str
    leg_id: str  # the X-Request-Id of both legs
    prefill: InstanceRecord
    rank: int = 0  # Mooncake: the data-parallel rank asked (X-data-parallel-rank)

    @property
    def transfer_id(self) -> str:
        """Mooncake's: the proxy's ``xfer-`` + the request id."""
        return f"xfer-{self.leg_id}"

    def prefill_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The prefill leg: `body` (the dispatcher's, max_tokens 1) as the proxy sends it."""
        out = {k: v for k, v in body.items() if k not in _NOT_FOR_STOCK_PREFILL}
        if self.connector == MOONCAKE:
            out["kv_transfer_params"] = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": self.transfer_id,
            }
        else:
            out["kv_transfer_params"] = prefill_kv_request()
        return out

    def prefill_headers(self) -> dict[str, str]:
        return {_DP_RANK_HEADER: str(self.rank)} if self.connector == MOONCAKE else {}

    def decode_params(self, answered: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The decode leg's ``kv_transfer_params`` after the prefill answered `answered`
        (None: the leg goes without)."""
        if self.connector == MOONCAKE:
            return self.mooncake_params()
        if self.connector == PUSH:
            if not answered:
                return None
            return {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                **{k: answered.get(k) for k in _PUSH_FIELDS},
            }
        return dict(answered) if answered else None

    def mooncake_params(self) -> dict[str, Any]:
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": self.prefill.kv_bootstrap,
            "remote_engine_id": self.prefill.kv_engines[self.rank],
            "transfer_id": self.transfer_id,
        }

    def release_params(self, answered: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """What a release leg carries to free the prefill's blocks (None: nothing frees them
        but their lease, or nothing is held)."""
        if self.connector == PUSH:
            return None
        if self.connector == MOONCAKE:
            return self.mooncake_params()
        if answered and answered.get("do_remote_prefill"):
            return dict(answered)
        return None


# Called as a prefill leg goes to a stock server (the prefill, its legs); returns what to
# call when that attempt ends (True: the prefill answered 200). Push: push.py.
OnSend = Callable[[InstanceLoad, StockLeg], Callable[[bool], None]]


class Handoffs:
    """Which prefill attempts are stock legs, what NixlPushConnector prefills answered of
    themselves (their engine and side channel, for decode legs sent with the prefill leg),
    and the release legs. One per gateway."""

    def __init__(self, records: Any, loads: Any, upstream: Upstream) -> None:
        """`records`: the registry view (`InstanceTracker.records`); `loads`: the ready
        instances of a role, model and group (`InstanceTracker.loads`)."""
        self._records = records
        self._loads = loads
        self._upstream = upstream
        # Push prefill id -> (its record's start, what its answers say of it).
        self._peers: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    def stock_leg(self, instance_id: str, request_id: str) -> StockLeg | None:
        """The legs of one prefill attempt at `instance_id`; None for pdgate's shims (their
        own wire)."""
        record: InstanceRecord | None = self._records().get(instance_id)
        connector = leg_connector(record)
        if connector == PDGATE or record is None:
            return None
        if connector in (PUSH, MOONCAKE):
            rank = 0
            if connector == MOONCAKE and len(record.kv_engines) > 1:
                rank = secrets.randbelow(len(record.kv_engines))
            return StockLeg(connector, f"{request_id}-{secrets.token_hex(6)}", record, rank)
        return StockLeg(connector, request_id, record)

    def decodes(self, connector: str, candidates: list[InstanceLoad]) -> list[InstanceLoad]:
        """The `candidates` that take a stock prefill's KV: decodes of its connector."""
        records = self._records()
        return [c for c in candidates if leg_connector(records.get(c.id)) == connector]

    # -- NixlPushConnector: the prefill's own coordinates ------------------------------------

    def learn(self, leg: StockLeg, answered: Mapping[str, Any]) -> None:
        """A push prefill answered: what it says of itself is what a decode sent with a later
        prefill leg there is told (a restart changes its engine id: the next answer says)."""
        if leg.connector != PUSH or any(answered.get(k) is None for k in _PUSH_PEER):
            return
        peer = {k: answered[k] for k in _PUSH_PEER}
        self._peers[leg.prefill.id] = (leg.prefill.started_at, peer)
        self._peers.move_to_end(leg.prefill.id)
        while len(self._peers) > _MAX_PEERS:
            self._peers.popitem(last=False)

    def push_params(self, leg: StockLeg) -> dict[str, Any] | None:
        """The decode leg's params for a push prefill not yet answered (None: it never
        answered this gateway since it started; the decode leg then waits for its answer,
        as vLLM's push proxy does)."""
        known = self._peers.get(leg.prefill.id)
        if known is None or known[0] != leg.prefill.started_at:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, **known[1]}

    # -- release --------------------------------------------------------------------------

    async def release(self, leg: StockLeg, answered: Mapping[str, Any] | None) -> None:
        """Free a stock prefill's blocks that no decode leg will take: a release leg to a
        decode of its connector (see the module docstring). Best effort, never raises:
        their lease frees them otherwise."""
        params = leg.release_params(answered)
        if params is None:
            return
        prefill = leg.prefill
        ready = self._loads(Role.DECODE, prefill.model, prefill.group)
        decodes = self.decodes(leg.connector, ready)
        decode = next((d for d in decodes if not d.ejected), None)
        if decode is None:
            return
        body = {
            "model": prefill.model,
            "prompt": "release",
            "max_tokens": 1,
            "stream": True,
            "use_beam_search": True,
            "kv_transfer_params": params,
        }
        try:
            status, _ = await self._upstream.post(
                decode.url,
                COMPLETIONS_PATH,
                body,
                request_id=leg.leg_id,
                timeout_s=_RELEASE_TIMEOUT_S,
            )
        except Exception as exc:  # best effort: the lease is the backstop
            log.info("release leg to %s failed (%s); the prefill's lease frees it", decode.id, exc)
            return
        if status != 400:
            log.info("release leg to %s answered %d, not vLLM's refusal", decode.id, status)
