"""Kubernetes semantics the manifest checks need, written out from the API reference: label
selectors, resource quantities, environment variable expansion and NetworkPolicy admission.
Each raises `NotModelled` for the parts of the API it does not cover, so a check never
passes by ignoring a field it cannot judge."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

Obj = dict[str, Any]

__all__ = [
    "NotModelled",
    "Pod",
    "admits",
    "containers",
    "expand",
    "expand_env",
    "pod_templates",
    "quantity",
    "secret_values",
    "selects",
]

# Kinds whose pods come from a template at spec.template (CronJob: not used by deploy/).
_WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class NotModelled(ValueError):
    """A manifest uses an API feature these helpers do not model."""


def pod_templates(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, its pod template) for every workload."""
    for obj in objects:
        if obj["kind"] in _WORKLOADS:
            yield obj, obj["spec"]["template"]
        elif obj["kind"] in ("CronJob", "Pod"):
            raise NotModelled(f"pods of a {obj['kind']}")


def containers(pod_spec: Obj) -> list[Obj]:
    """Init containers and containers (ephemeral ones are not declared in manifests)."""
    return list(pod_spec.get("initContainers", [])) + list(pod_spec["containers"])


def selects(selector: Obj | None, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector matches `labels` (an empty selector matches everything)."""
    selector = selector or {}
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise NotModelled(f"selector fields {unknown}")
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise NotModelled(f"selector operator {op}")
    return True


# Kubernetes' quantity suffixes: decimal k to E are powers of 1000, binary Ki to Ei of 1024.
_SUFFIXES = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    **{s: Decimal(1000**i) for i, s in enumerate("kMGTPE", start=1)},
    **{s + "i": Decimal(1024**i) for i, s in enumerate("KMGTPE", start=1)},
}
_QUANTITY = re.compile(r"^([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)([eE][+-]?[0-9]+|[a-zA-Z]*)$")


def quantity(value: object) -> Decimal:
    """A resource.Quantity ("500m", "2Gi", 1, "1e3") as a number; ValueError if malformed."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{value!r} is not a quantity")
    match = _QUANTITY.match(str(value))
    if match is None:
        raise ValueError(f"{value!r} is not a quantity")
    number, suffix = match.groups()
    if suffix[:1] in ("e", "E"):
        return Decimal(number) * Decimal(10) ** int(suffix[1:])
    if suffix not in _SUFFIXES:
        raise ValueError(f"{value!r}: unknown suffix {suffix!r}")
    return Decimal(number) * _SUFFIXES[suffix]


def secret_values(secret: Obj) -> dict[str, str]:
    """A Secret's keys and values (stringData wins over data, as the API server merges)."""
    values = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    values.update(secret.get("stringData", {}))
    return values


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(text: str, defined: Mapping[str, str], unresolved: list[str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, `$$` escapes, anything else
    stays as written (and is recorded in `unresolved`)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        if name in defined:
            return defined[name]
        unresolved.append(name)
        return match.group(0)

    return _REFERENCE.sub(one, text)


def expand_env(
    container: Obj, value_from: Any, unresolved: list[str] | None = None
) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env in
    order, each value expanded against the variables before it. `value_from(source)`
    answers a valueFrom/envFrom source (a dict) with a value (or a dict for envFrom)."""
    unresolved = [] if unresolved is None else unresolved
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        values = value_from(source)
        prefix = source.get("prefix", "")
        env.update({prefix + k: v for k, v in values.items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env, unresolved)
        elif "valueFrom" in var:
            env[var["name"]] = str(value_from(var["valueFrom"]))
        else:
            env[var["name"]] = ""
    return env


@dataclass(frozen=True)
class Pod:
    """A pod as NetworkPolicy sees it: namespace (and that namespace's labels), its labels
    and its containers' named ports."""

    namespace: str
    labels: Mapping[str, str]
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)


def _peer_admits(peer: Obj, policy_ns: str, src: Pod) -> bool:
    if "ipBlock" in peer:
        raise NotModelled("ipBlock peers")
    if "namespaceSelector" in peer:
        ns_labels = {**src.namespace_labels, "kubernetes.io/metadata.name": src.namespace}
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif src.namespace != policy_ns:
        return False  # a bare podSelector means pods of the policy's own namespace
    return "podSelector" not in peer or selects(peer["podSelector"], src.labels)


def _port_admits(rule_port: Obj, dst: Pod, port: int, protocol: str) -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    if "port" not in rule_port:
        return True
    wanted = rule_port["port"]
    if isinstance(wanted, str):
        return dst.ports.get(wanted) == port
    low = int(wanted)
    return low <= port <= int(rule_port.get("endPort", low))


def admits(policies: list[Obj], src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
    """Whether the NetworkPolicies let `src` open a connection to `dst` on `port` (ingress
    side: egress is not restricted by deploy/ and not modelled here)."""
    applying = []
    for policy in policies:
        spec = policy["spec"]
        if policy["metadata"].get("namespace", "") != dst.namespace:
            continue
        types = spec.get("policyTypes") or (
            ["Ingress", "Egress"] if "egress" in spec else ["Ingress"]
        )
        if "Egress" in types:
            raise NotModelled("egress policies")
        if "Ingress" in types and selects(spec["podSelector"], dst.labels):
            applying.append(policy)
    if not applying:
        return True
    for policy in applying:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from") or []
            ports = rule.get("ports") or []
            ns = policy["metadata"].get("namespace", "")
            if peers and not any(_peer_admits(p, ns, src) for p in peers):
                continue
            if ports and not any(_port_admits(p, dst, port, protocol) for p in ports):
                continue
            return True
    return False
