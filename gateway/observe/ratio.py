"""P/D ratio advice: eq. 1 of P/D-Serve (section 3.3), from what the gateway measures.

The fleet's throughput is set by its bottleneck; prefill and decode are balanced when

    n_p · b_p / T_p  ≈  n_d · b_d / T_d                                    (eq. 1)

with n the instance counts, b the batch sizes (the instances' declared slots), T_p the time of
one prefill batch (TTFT at that batch size, prefix-cache hits included: the paper's
TTFT_bs · r_pre) and T_d = ξ + G · TPOT_bs the time a decode spends on a request (ξ the KV
transfer, G the tokens generated, TPOT the time per output token at its batch size). Each side
serves ``n · b / T`` requests per second; against the input traffic I_t (requests/s) the
gateway advises, per scenario group:

* the ratio n_p / n_d = (T_p / b_p) / (T_d / b_d) that balances eq. 1;
* which side is the bottleneck now;
* how many instances of each role the current traffic needs at `target_utilization`.

Measured per group over a sliding window: arrivals, prefill call durations (T_p), and per
decoded request ξ (decode accepted to first event), tokens (G) and mean inter-token gap
(TPOT). The instance counts and slots come from the registry. All windows are bounded.

Several gateways each see part of the traffic: the desired counts a gateway exports are its
share (fractional), and summing them over the gateways gives the fleet's need (the deploy
layout's autoscaler does exactly that).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdgate.config.wire import Role
from pdgate.gateway.observe.window import TimeWindow
from pdgate.registry.base import InstanceRecord, InstanceState

__all__ = ["Advice", "RatioAdvisor"]

_MAX_GROUPS = 256
_MAX_HARDWARE = 16


@dataclass
class _Group:
    arrivals: TimeWindow
    prefills: TimeWindow  # (seconds,)
    decodes: TimeWindow  # (xi seconds, tokens, mean inter-token seconds)
    # The same samples by the serving instance's declared hardware (records' `hardware`).
    prefills_by: dict[str, TimeWindow] = field(default_factory=dict)
    decodes_by: dict[str, TimeWindow] = field(default_factory=dict)


def _decode_s(count: int, sums: list[float]) -> float:
    """T_d = xi + G x TPOT from a decode window's sample count and sums."""
    xi, tokens, tpot = (total / count for total in sums)
    return xi + tokens * tpot


@dataclass(frozen=True)
class Advice:
    group: str
    demand_rps: float
    prefills: int
    decodes: int
    prefill_slots: float  # b_p (mean declared slots)
    decode_slots: float  # b_d
    t_prefill_s: float | None  # T_p
    t_decode_s: float | None  # T_d = xi + G * TPOT
    xi_s: float | None
    tokens: float | None  # G
    tpot_s: float | None
    prefill_capacity_rps: float | None  # n_p b_p / T_p
    decode_capacity_rps: float | None  # n_d b_d / T_d
    ratio: float | None  # advised n_p / n_d
    desired_prefills: float | None  # this gateway's share, fractional
    desired_decodes: float | None
    bottleneck: str  # prefill | decode | balanced | insufficient_data
    samples: int
    # Where instances declare their hardware: per role and type, its instances, slots, time
    # per request and requests/s per instance; and eq. 1's ratio for each pair of types.
    by_hardware: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["current_ratio"] = self.prefills / self.decodes if self.decodes else None
        return out


class RatioAdvisor:
    def __init__(
        self,
        *,
        window_s: float = 120.0,
        min_samples: int = 20,
        target_utilization: float = 0.8,
    ) -> None:
        if window_s <= 0 or min_samples < 1 or not 0 < target_utilization <= 1:
            raise ValueError("window_s > 0, min_samples >= 1, 0 < target_utilization <= 1")
        self._window_s = window_s
        self._min_samples = min_samples
        self._target = target_utilization
        self._groups: dict[str, _Group] = {}

    def _group(self, name: str) -> _Group | None:
        g = self._groups.get(name)
        if g is None:
            if len(self._groups) >= _MAX_GROUPS:
                return None  # bounded: groups come from the registry, this is a backstop
            w = self._window_s
            g = self._groups[name] = _Group(TimeWindow(w, 0), TimeWindow(w, 1), TimeWindow(w, 3))
        return g

    def arrival(self, group: str) -> None:
        if (g := self._group(group)) is not None:
            g.arrivals.add()

    def _typed(self, by: dict[str, TimeWindow], hardware: str, width: int) -> TimeWindow | None:
        """The window of one hardware type (None: none declared, or too many types)."""
        w = by.get(hardware)
        if w is None and hardware and len(by) < _MAX_HARDWARE:  # bounded, as groups are
            w = by[hardware] = TimeWindow(self._window_s, width)
        return w

    def prefill(self, group: str, seconds: float, hardware: str = "") -> None:
        if (g := self._group(group)) is not None:
            g.prefills.add(seconds)
            if (w := self._typed(g.prefills_by, hardware, 1)) is not None:
                w.add(seconds)

    def decode(
        self, group: str, xi_s: float, tokens: int, tpot_s: float, hardware: str = ""
    ) -> None:
        if tokens > 0 and (g := self._group(group)) is not None:
            g.decodes.add(xi_s, float(tokens), tpot_s)
            if (w := self._typed(g.decodes_by, hardware, 3)) is not None:
                w.add(xi_s, float(tokens), tpot_s)

    def forget(self, groups: set[str]) -> None:
        for name in [n for n in self._groups if n not in groups]:
            del self._groups[name]

    def advise(self, records: Mapping[str, InstanceRecord]) -> Iterator[Advice]:
        by_group: dict[str, dict[Role, list[InstanceRecord]]] = {}
        for r in records.values():
            # The ratio is of a disaggregated group's two roles: aggregated instances do both.
            if r.state is InstanceState.READY and r.role is not Role.AGGREGATED:
                by_group.setdefault(r.group, {Role.PREFILL: [], Role.DECODE: []})[r.role].append(r)
        for name in sorted(set(by_group) | set(self._groups)):
            yield self._advise(name, by_group.get(name, {Role.PREFILL: [], Role.DECODE: []}))

    def _advise(self, name: str, roles: Mapping[Role, list[InstanceRecord]]) -> Advice:
        g = self._groups.get(name)
        pre, dec = roles[Role.PREFILL], roles[Role.DECODE]
        n_p, n_d = len(pre), len(dec)
        b_p = sum(r.capacity for r in pre) / n_p if n_p else 0.0
        b_d = sum(r.capacity for r in dec) / n_d if n_d else 0.0
        arrivals, _ = g.arrivals.totals() if g else (0, [])
        prefills, (p_sum,) = g.prefills.totals() if g else (0, [0.0])
        decodes, d_sums = g.decodes.totals() if g else (0, [0.0] * 3)
        demand = arrivals / self._window_s
        t_p = p_sum / prefills if prefills >= self._min_samples else None
        xi = tokens = tpot = t_d = None
        if decodes >= self._min_samples:
            xi, tokens, tpot = (total / decodes for total in d_sums)
            t_d = _decode_s(decodes, d_sums)
        per_p = b_p / t_p if t_p and b_p else None  # requests/s one prefill serves
        per_d = b_d / t_d if t_d and b_d else None
        cap_p = n_p * per_p if per_p is not None else None
        cap_d = n_d * per_d if per_d is not None else None
        ratio = per_d / per_p if per_p and per_d else None
        want_p = demand / per_p / self._target if per_p else None
        want_d = demand / per_d / self._target if per_d else None
        if cap_p is None or cap_d is None:
            bottleneck = "insufficient_data"
        elif math.isclose(cap_p, cap_d, rel_tol=0.1):
            bottleneck = "balanced"
        else:
            bottleneck = "prefill" if cap_p < cap_d else "decode"
        return Advice(
            group=name,
            demand_rps=demand,
            prefills=n_p,
            decodes=n_d,
            prefill_slots=b_p,
            decode_slots=b_d,
            t_prefill_s=t_p,
            t_decode_s=t_d,
            xi_s=xi,
            tokens=tokens,
            tpot_s=tpot,
            prefill_capacity_rps=cap_p,
            decode_capacity_rps=cap_d,
            ratio=ratio,
            desired_prefills=want_p,
            desired_decodes=want_d,
            bottleneck=bottleneck,
            samples=min(prefills, decodes),
            by_hardware=self._by_hardware(g, pre, dec),
        )

    def _by_hardware(
        self, g: _Group | None, pre: list[InstanceRecord], dec: list[InstanceRecord]
    ) -> dict[str, Any] | None:
        """Eq. 1 per hardware type of each role, from the samples of that type's instances."""
        if not any(r.hardware for r in (*pre, *dec)):
            return None
        out: dict[str, Any] = {"prefill": {}, "decode": {}, "ratio": {}}
        for role, records, windows in (
            ("prefill", pre, g.prefills_by if g else {}),
            ("decode", dec, g.decodes_by if g else {}),
        ):
            types: dict[str, list[InstanceRecord]] = {}
            for r in records:
                types.setdefault(r.hardware or "unknown", []).append(r)
            for hw, rs in sorted(types.items()):
                slots = sum(r.capacity for r in rs) / len(rs)
                seconds = None
                if (w := windows.get(hw)) is not None:
                    n, sums = w.totals()
                    if n >= self._min_samples:
                        seconds = sums[0] / n if role == "prefill" else _decode_s(n, sums)
                out[role][hw] = {
                    "instances": len(rs),
                    "slots": slots,
                    "seconds_per_request": seconds,
                    "per_instance_rps": slots / seconds if seconds else None,
                }
        for hp, p in out["prefill"].items():
            for hd, d in out["decode"].items():
                if p["per_instance_rps"] and d["per_instance_rps"]:
                    out["ratio"][f"{hp}:{hd}"] = d["per_instance_rps"] / p["per_instance_rps"]
        return out
