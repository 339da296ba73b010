"""Cross-object invariants of a rendered deploy/ overlay, each a function from the rendered
objects to a list of problems (empty: it holds). Where an invariant is about what pdgate
does (ports it listens on, its drain timeout, the settings it reads), it asks pdgate itself:
containers' environment and arguments go through pdgate's own CLI parser and settings
models, exactly as the process in the pod would read them."""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import re
import shlex
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

from pdgate.config.cli import _parser as pdgate_parser
from pdgate.config.server import is_loopback, make_server
from pdgate.config.settings import GatewaySettings, RegistrySettings, ShimSettings
from pdgate.gateway.admission.auth import check_exposure, parse_keys
from pdgate.gateway.workers import Supervisor
from tests.deploy._k8s import (
    NotModelled,
    Obj,
    Pod,
    admits,
    containers,
    expand,
    expand_env,
    pod_templates,
    quantity,
    secret_values,
    selects,
)
from tests.deploy._kustomize import build

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
IMAGE_REPOSITORY = "ghcr.io/pdgate/"
PLAIN_IMAGE = IMAGE_REPOSITORY + "pdgate"
VLLM_IMAGE = IMAGE_REPOSITORY + "pdgate-vllm"
# What the downward API would give a pod in these checks.
POD_IP = "10.244.1.7"
# Seconds a process needs after its own waits end (closing the engine, the registry).
SHUTDOWN_MARGIN_S = 10
PLACEHOLDER = "REPLACE-ME"

# Secrets an overlay that ships none expects the operator to have created (deploy/README.md
# shows the commands; test_manifests.py checks that the docs name exactly these), with
# example values in the right format.
OPERATOR_SECRETS: dict[str, dict[str, str]] = {
    "pdgate-registry": {"url": "rediss://:example-password@redis.example.internal:6380/0"},
    "pdgate-cluster-token": {"token": "0123456789abcdef" * 4},
    "pdgate-admin-token": {"token": "fedcba9876543210" * 4},
    "pdgate-api-keys": {"keys": "sha256:" + "ab" * 32 + " name=example\n"},
}

# Who may open a connection to whom: (client component, server component). A gateway takes
# connections from anyone; nothing else is reachable except as listed.
ALLOWED = {
    ("gateway", "prefill"),
    ("gateway", "decode"),
    ("decode", "prefill"),
    ("gateway", "redis"),
    ("prefill", "redis"),
    ("decode", "redis"),
}
OPEN_TO_ALL = {"gateway"}
COMPONENT = "app.kubernetes.io/component"


def kustomizations() -> list[str]:
    """Every kustomization under deploy/, as a path relative to it."""
    return sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.rglob("kustomization.yaml"))


# The overlays one deploys, with the Secrets each expects to exist beforehand.
DEPLOYABLE: dict[str, dict[str, dict[str, str]]] = {
    "overlays/dev": {},
    "overlays/gpu": OPERATOR_SECRETS,
}


@dataclass
class Rendered:
    """One kustomization's output, and the Secrets it expects to exist already."""

    name: str
    objects: list[Obj]
    external_secrets: dict[str, dict[str, str]] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def find(self, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        for obj in self.of_kind(kind):
            meta = obj["metadata"]
            if meta["name"] == name and (namespace is None or meta.get("namespace") == namespace):
                return obj
        return None


@cache
def _render(name: str) -> list[Obj]:
    return build(DEPLOY / name)


def rendered(name: str) -> Rendered:
    """A kustomization under deploy/, rendered; a fresh copy each call (tests mutate it)."""
    return Rendered(name, copy.deepcopy(_render(name)), DEPLOYABLE.get(name, OPERATOR_SECRETS))


class MissingReference(ValueError):
    pass


@dataclass
class Process:
    """What a pdgate container would run: its subcommand and the settings it would load."""

    command: str
    settings: GatewaySettings | ShimSettings
    registry: RegistrySettings
    env: dict[str, str]


def _known_env_names() -> set[str]:
    names = set()
    for model in (GatewaySettings, ShimSettings, RegistrySettings):
        prefix = str(model.model_config.get("env_prefix", ""))
        names |= {(prefix + name).upper() for name in model.model_fields}
    return names


def _secret(r: Rendered, namespace: str, name: str) -> dict[str, str]:
    obj = r.find("Secret", name, namespace)
    if obj is not None:
        return secret_values(obj)
    if name in r.external_secrets:
        return r.external_secrets[name]
    raise MissingReference(f"Secret {name} does not exist")


def _config_map(r: Rendered, namespace: str, name: str) -> dict[str, str]:
    obj = r.find("ConfigMap", name, namespace)
    if obj is None:
        raise MissingReference(f"ConfigMap {name} does not exist")
    return {k: str(v) for k, v in obj.get("data", {}).items()}


def environment(
    r: Rendered, workload: Obj, container: Obj, unresolved: list[str]
) -> dict[str, str]:
    """The container's environment, with Secret and ConfigMap values from the rendering."""
    namespace = workload["metadata"].get("namespace", "")
    fields = {
        "metadata.name": workload["metadata"]["name"] + "-7d9f8b6c5d-x2x4q",
        "metadata.namespace": namespace,
        "status.podIP": POD_IP,
        "status.hostIP": "192.168.0.10",
        "spec.nodeName": "node-1",
    }

    def value_from(source: Obj) -> Any:
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path not in fields:
                raise NotModelled(f"fieldRef {path}")
            return fields[path]
        for kind, lookup in (("secret", _secret), ("configMap", _config_map)):
            if f"{kind}KeyRef" in source:
                ref = source[f"{kind}KeyRef"]
                try:
                    values = lookup(r, namespace, ref["name"])
                    if ref["key"] not in values:
                        raise MissingReference(f"{kind} {ref['name']} has no key {ref['key']}")
                except MissingReference:
                    if ref.get("optional"):
                        return ""
                    raise
                return values[ref["key"]]
            if f"{kind}Ref" in source:
                return lookup(r, namespace, source[f"{kind}Ref"]["name"])
        raise NotModelled(f"environment source {source}")

    return expand_env(container, value_from, unresolved)


def process(r: Rendered, workload: Obj, container: Obj) -> Process | None:
    """The settings a pdgate container would start with (None for other images); raises
    ValueError when it would not start or reads something it does not know."""
    if not container["image"].startswith(IMAGE_REPOSITORY):
        return None
    if "command" in container:
        raise ValueError("overrides the image's entrypoint (pdgate)")
    unresolved: list[str] = []
    env = environment(r, workload, container, unresolved)
    argv = [expand(str(a), env, unresolved) for a in container.get("args", [])]
    if unresolved:
        raise ValueError(f"$({unresolved[0]}) names no variable defined before it")
    unknown = {n for n in env if n.startswith("PDGATE_")} - _known_env_names()
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)} (pydantic would ignore them)")
    try:
        args = pdgate_parser(argv).parse_args(argv)
    except SystemExit as exc:
        raise ValueError(f"`pdgate {shlex.join(argv)}` is refused by pdgate's parser") from exc
    if args.config is not None:
        raise ValueError("--config: a TOML file these checks cannot see")
    pdgate_env = {k: v for k, v in env.items() if k.startswith("PDGATE_")}
    with mock.patch.dict(os.environ, pdgate_env, clear=True):
        model: type[GatewaySettings | ShimSettings]
        model = {"gateway": GatewaySettings, "shim": ShimSettings}.get(args.command)  # type: ignore[assignment]
        if model is None:
            raise ValueError(f"runs `pdgate {args.command}`, not a server")
        flags = {k: v for k, v in vars(args).items() if k in model.model_fields and v is not None}
        settings = model.load(None, **flags)
        url = {"url": args.registry_url} if args.registry_url else {}
        registry = RegistrySettings.load(None, **url)
    return Process(args.command, settings, registry, env)


def processes(r: Rendered) -> Iterator[tuple[Obj, Obj, Process]]:
    """(workload, container, process) for every pdgate container that would start."""
    for workload, template in pod_templates(r.objects):
        for container in containers(template["spec"]):
            with contextlib.suppress(ValueError):
                proc = process(r, workload, container)
                if proc is not None:
                    yield workload, container, proc


def _where(workload: Obj, container: Obj | None = None) -> str:
    name = f"{workload['kind']}/{workload['metadata']['name']}"
    return f"{name} container {container['name']}" if container is not None else name


def _modelled(
    r: Rendered, problems: list[str], *, init: bool = True
) -> Iterator[tuple[str, Obj, Process | None]]:
    """(where, container, the pdgate process it runs or None) for every container (`init`:
    init containers too); one whose process cannot be modelled goes to `problems` instead."""
    for workload, template in pod_templates(r.objects):
        spec = template["spec"]
        for container in containers(spec) if init else spec["containers"]:
            where = _where(workload, container)
            try:
                proc = process(r, workload, container)
            except (ValueError, NotModelled) as exc:
                problems.append(f"{where}: {exc}")
                continue
            yield where, container, proc


# --- the checks ---------------------------------------------------------------------------


def check_settings(r: Rendered) -> list[str]:
    """Every pdgate container starts: known settings with valid values, a CLI pdgate
    accepts, $(VAR)s defined before use, a shared Redis registry and cluster token,
    listening where others can reach it (and a shim advertising its own pod IP and port)."""
    problems: list[str] = []
    for where, _, proc in _modelled(r, problems):
        if proc is None:
            continue
        s, reg = proc.settings, proc.registry
        if reg.url is None or not reg.url.startswith(("redis://", "rediss://")):
            problems.append(f"{where}: no Redis registry (each process would be alone)")
        if reg.cluster_token is None:
            problems.append(f"{where}: no cluster token")
        if is_loopback(s.host):
            problems.append(f"{where}: listens on {s.host}, unreachable from other pods")
        if isinstance(s, GatewaySettings):
            try:
                check_exposure(
                    s.host,
                    keys=bool(s.api_keys or s.api_keys_file),
                    allow_unauthenticated=s.allow_unauthenticated,
                )
            except ValueError as exc:
                problems.append(f"{where}: {exc}")
            if s.admin_token is None:
                problems.append(f"{where}: no admin token (/admin and /dashboard open)")
        else:
            want = f"http://{POD_IP}:{s.port}"
            if s.advertise_url != want:
                problems.append(f"{where}: advertises {s.advertise_url}, not {want}")
    return problems


def _declared_ports(container: Obj) -> dict[str | int, int]:
    ports: dict[str | int, int] = {}
    for port in container.get("ports", []):
        ports[port["containerPort"]] = port["containerPort"]
        if "name" in port:
            ports[port["name"]] = port["containerPort"]
    return ports


def check_probes(r: Rendered) -> list[str]:
    """Readiness and liveness (and, for pdgate, startup) probes on a port the container
    declares; pdgate's are GET /health on the port the process listens on (a draining shim
    answers 503 there, so it goes unready)."""
    problems: list[str] = []
    for where, container, proc in _modelled(r, problems, init=False):
        kinds = ["readinessProbe", "livenessProbe"]
        kinds += ["startupProbe"] if proc is not None else []
        declared = _declared_ports(container)
        for kind in kinds:
            probe = container.get(kind)
            if probe is None:
                problems.append(f"{where}: no {kind}")
                continue
            handler = probe.get("httpGet") or probe.get("tcpSocket")
            if handler is None:
                problems.append(f"{where}: {kind} is neither httpGet nor tcpSocket")
                continue
            port = declared.get(handler["port"])
            if port is None:
                problems.append(f"{where}: {kind} port {handler['port']} is not declared")
                continue
            if proc is None:
                continue
            if probe.get("httpGet", {}).get("path") != "/health":
                problems.append(f"{where}: {kind} is not GET /health")
            if port != proc.settings.port:
                problems.append(
                    f"{where}: {kind} probes port {port}; pdgate listens on {proc.settings.port}"
                )
    return problems


def check_services(r: Rendered) -> list[str]:
    """Every Service selects pods of some workload, and its target ports are ports those
    pods declare (for pdgate, the port the process listens on)."""
    problems = []
    for svc in r.of_kind("Service"):
        where = f"Service/{svc['metadata']['name']}"
        selector = svc["spec"].get("selector")
        if not selector:
            problems.append(f"{where}: no selector")
            continue
        matched = [
            (w, t)
            for w, t in pod_templates(r.objects)
            if w["metadata"].get("namespace") == svc["metadata"].get("namespace")
            and selects({"matchLabels": selector}, t["metadata"].get("labels", {}))
        ]
        if not matched:
            problems.append(f"{where}: selects no pods")
        for workload, template in matched:
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                found = [
                    (c, _declared_ports(c)[target])
                    for c in template["spec"]["containers"]
                    if target in _declared_ports(c)
                ]
                if not found:
                    problems.append(f"{where}: {_where(workload)} declares no port {target}")
                for container, number in found:
                    proc = process(r, workload, container)
                    if proc is not None and proc.settings.port != number:
                        problems.append(
                            f"{where}: targets port {number}; pdgate listens on "
                            f"{proc.settings.port}"
                        )
    return problems


def check_references(r: Rendered) -> list[str]:
    """Every Secret (and key), ConfigMap, PersistentVolumeClaim, ServiceAccount and volume a
    pod names exists; ScaledObjects and PodDisruptionBudgets point at something."""
    problems = []
    for workload, template in pod_templates(r.objects):
        spec = template["spec"]
        ns = workload["metadata"].get("namespace", "")
        where = _where(workload)
        account = spec.get("serviceAccountName", "default")
        if r.find("ServiceAccount", account, ns) is None:
            problems.append(f"{where}: ServiceAccount {account} does not exist")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            try:
                if "secret" in volume:
                    values = _secret(r, ns, volume["secret"]["secretName"])
                    for item in volume["secret"].get("items", []):
                        if item["key"] not in values:
                            raise MissingReference(f"Secret has no key {item['key']}")
                if "configMap" in volume:
                    _config_map(r, ns, volume["configMap"]["name"])
            except MissingReference as exc:
                problems.append(f"{where}: volume {volume['name']}: {exc}")
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim is not None and r.find("PersistentVolumeClaim", claim, ns) is None:
                problems.append(f"{where}: PersistentVolumeClaim {claim} does not exist")
        for container in containers(spec):
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.append(f"{where}: mounts undefined volume {mount['name']}")
            try:
                environment(r, workload, container, [])
            except (MissingReference, NotModelled) as exc:
                problems.append(f"{_where(workload, container)}: {exc}")
    for obj in r.of_kind("ScaledObject"):
        ref = obj["spec"]["scaleTargetRef"]
        kind = ref.get("kind", "Deployment")
        if r.find(kind, ref["name"], obj["metadata"].get("namespace")) is None:
            problems.append(f"ScaledObject/{obj['metadata']['name']}: no {kind} {ref['name']}")
    for pdb in r.of_kind("PodDisruptionBudget"):
        selector = pdb["spec"].get("selector")
        if not any(
            selects(selector, t["metadata"].get("labels", {})) for _, t in pod_templates(r.objects)
        ):
            problems.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: selects no pods")
    return problems


def check_api_keys(r: Rendered) -> list[str]:
    """The gateways' api_keys_file lies in a mounted Secret that has that key, and parses
    with the gateway's own parser; the in-cluster Redis's password is the one in the
    registry URL every process uses, and the URL names its Service."""
    problems = []
    for workload, container, proc in processes(r):
        s = proc.settings
        if not isinstance(s, GatewaySettings) or s.api_keys_file is None:
            continue
        where = _where(workload, container)
        path = s.api_keys_file
        mounts = [
            m for m in container.get("volumeMounts", []) if Path(m["mountPath"]) == path.parent
        ]
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        secrets = [
            volumes[m["name"]]["secret"] for m in mounts if "secret" in volumes.get(m["name"], {})
        ]
        if not secrets:
            problems.append(f"{where}: {path} is not in a mounted Secret")
            continue
        try:
            values = _secret(r, workload["metadata"]["namespace"], secrets[0]["secretName"])
        except MissingReference as exc:
            problems.append(f"{where}: {exc}")
            continue
        if path.name not in values:
            problems.append(f"{where}: the Secret has no key {path.name}")
            continue
        try:
            if not parse_keys(values[path.name].splitlines(), source=str(path)):
                problems.append(f"{where}: {path} holds no key: every client would be refused")
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
    for redis in r.of_kind("Deployment"):
        if redis["metadata"]["name"] != "pdgate-redis":
            continue
        container = redis["spec"]["template"]["spec"]["containers"][0]
        password = environment(r, redis, container, []).get("REDIS_PASSWORD")
        service = r.find("Service", "pdgate-redis", redis["metadata"]["namespace"])
        if service is None or not password:
            problems.append("pdgate-redis: no Service, or no password")
            continue
        hosts = {"pdgate-redis", f"pdgate-redis.{redis['metadata']['namespace']}.svc"}
        for workload, container, proc in processes(r):
            url = urlsplit(proc.registry.url or "")
            where = _where(workload, container)
            if url.password != password:
                problems.append(f"{where}: the registry URL's password is not Redis's")
            if url.hostname not in hosts or url.port != service["spec"]["ports"][0]["port"]:
                problems.append(f"{where}: the registry URL does not name the Redis Service")
    return problems


def check_placeholders(r: Rendered) -> list[str]:
    """Secrets shipped in deploy/ are placeholders that say so, never real values."""
    problems = []
    for secret in r.of_kind("Secret"):
        for key, value in secret_values(secret).items():
            if PLACEHOLDER not in value:
                problems.append(f"Secret/{secret['metadata']['name']}: {key} is no placeholder")
    return problems


def check_network(r: Rendered) -> list[str]:
    """The NetworkPolicies admit exactly ALLOWED (plus anyone to a gateway), on declared
    ports only: probed with every pair of components, a stranger in the namespace, an
    impostor carrying a gateway's labels in another namespace, and a pdgate pod no policy
    names yet (the default deny must close it)."""
    policies = r.of_kind("NetworkPolicy")
    namespaces = {
        n["metadata"]["name"]: n["metadata"].get("labels", {}) for n in r.of_kind("Namespace")
    }
    pods: dict[str, Pod] = {}
    for workload, template in pod_templates(r.objects):
        labels = template["metadata"].get("labels", {})
        ns = workload["metadata"].get("namespace", "")
        ports = {
            p.get("name", str(p["containerPort"])): p["containerPort"]
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
        }
        pods[labels.get(COMPONENT, workload["metadata"]["name"])] = Pod(
            ns, labels, namespaces.get(ns, {}), ports
        )
    if not pods:
        return []
    some = next(iter(pods.values()))
    sources = dict(pods)
    sources["a stranger in the namespace"] = Pod(
        some.namespace, {"app": "other"}, some.namespace_labels
    )
    if "gateway" in pods:
        sources["a pod with a gateway's labels in another namespace"] = Pod(
            "elsewhere", pods["gateway"].labels
        )
    # Any pdgate pod added later is closed until a policy opens it (the default deny).
    targets = dict(pods)
    targets["a new pdgate pod"] = Pod(
        some.namespace, {"app.kubernetes.io/part-of": "pdgate"}, some.namespace_labels, {"x": 8080}
    )
    problems = []
    for dst_name, dst in targets.items():
        for port in [*dst.ports.values(), 9]:
            for src_name, src in sources.items():
                want = port in dst.ports.values() and (
                    dst_name in OPEN_TO_ALL or (src_name, dst_name) in ALLOWED
                )
                try:
                    got = admits(policies, src, dst, port)
                except NotModelled as exc:
                    return [f"NetworkPolicy: {exc}"]
                if got != want:
                    verdict = "admitted" if got else "denied"
                    problems.append(f"{src_name} -> {dst_name}:{port} is {verdict}")
    return problems


def _prestop_seconds(container: Obj) -> float:
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    if len(command) == 2 and command[0] == "sleep":
        return float(command[1])
    raise ValueError(f"preStop {hook}: cannot tell how long it takes")


def _default(func: Callable[..., Any], name: str) -> float:
    return float(inspect.signature(func).parameters[name].default)


def check_termination(r: Rendered) -> list[str]:
    """The grace period covers what a pdgate process does after SIGTERM: a shim's drain
    (PDGATE_SHIM_DRAIN_TIMEOUT_S, as the shim reads it), a gateway's close of its open
    connections (uvicorn's graceful timeout, the --workers supervisor's wait), each after
    its preStop hook, plus SHUTDOWN_MARGIN_S."""
    problems = []
    uvicorn_s = _default(make_server, "graceful_s")
    supervisor_s = _default(Supervisor, "grace_s")
    for workload, container, proc in processes(r):
        where = _where(workload, container)
        grace = workload["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        try:
            prestop = _prestop_seconds(container)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        s = proc.settings
        if isinstance(s, ShimSettings):
            need = prestop + s.drain_timeout_s + SHUTDOWN_MARGIN_S
            what = f"drain_timeout_s {s.drain_timeout_s:g}"
        else:
            close = max(uvicorn_s, supervisor_s if s.workers > 1 else 0.0)
            need = prestop + close + SHUTDOWN_MARGIN_S
            what = f"closing connections ({close:g} s)"
        if grace < need:
            problems.append(
                f"{where}: terminationGracePeriodSeconds {grace} < preStop {prestop:g} + "
                f"{what} + {SHUTDOWN_MARGIN_S}"
            )
    return problems


def check_resources(r: Rendered) -> list[str]:
    """Every container requests and limits CPU and memory (valid quantities, requests not
    above limits); extended resources (GPUs) request what they limit; memory-backed
    volumes have a size that fits the pod's memory limits."""
    problems = []
    for workload, template in pod_templates(r.objects):
        memory_limit = Decimal(0)
        for container in containers(template["spec"]):
            where = _where(workload, container)
            res = container.get("resources", {})
            requests, limits = res.get("requests", {}), res.get("limits", {})
            for name in ("cpu", "memory"):
                if name not in requests or name not in limits:
                    problems.append(f"{where}: no {name} request and limit")
            try:
                for name in set(requests) | set(limits):
                    low = quantity(requests.get(name, limits.get(name)))
                    high = quantity(limits[name]) if name in limits else None
                    if "/" in name and (high is None or low != high):
                        problems.append(f"{where}: {name} requests must equal its limit")
                    elif high is not None and low > high:
                        problems.append(f"{where}: {name} request above its limit")
                memory_limit += quantity(limits.get("memory", 0))
            except ValueError as exc:
                problems.append(f"{where}: {exc}")
        in_memory = Decimal(0)
        for volume in template["spec"].get("volumes", []):
            empty = volume.get("emptyDir")
            if empty is not None and empty.get("medium") == "Memory":
                if "sizeLimit" not in empty:
                    problems.append(f"{_where(workload)}: memory volume {volume['name']} unbounded")
                else:
                    in_memory += quantity(empty["sizeLimit"])
        if in_memory > memory_limit:
            problems.append(f"{_where(workload)}: memory volumes exceed the memory limits")
    return problems


def check_security(r: Rendered) -> list[str]:
    """The "restricted" Pod Security Standard and then some: non-root, no privilege
    escalation, no capabilities, RuntimeDefault seccomp, read-only root filesystems, no host
    namespaces or paths, no service account token; every pod labelled part-of pdgate (so the
    default-deny NetworkPolicy covers it)."""
    problems = []
    for ns in r.of_kind("Namespace"):
        if (
            ns["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce")
            != "restricted"
        ):
            problems.append(f"Namespace/{ns['metadata']['name']}: does not enforce restricted")
    for account in r.of_kind("ServiceAccount"):
        if account.get("automountServiceAccountToken") is not False:
            problems.append(f"ServiceAccount/{account['metadata']['name']}: mounts its token")
    for workload, template in pod_templates(r.objects):
        spec = template["spec"]
        where = _where(workload)
        if template["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") != "pdgate":
            problems.append(f"{where}: pods not labelled app.kubernetes.io/part-of=pdgate")
        if spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{where}: mounts a service account token")
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(host):
                problems.append(f"{where}: {host}")
        if any("hostPath" in v for v in spec.get("volumes", [])):
            problems.append(f"{where}: hostPath volume")
        pod_sc = spec.get("securityContext", {})
        for container in containers(spec):
            sc = {**pod_sc, **container.get("securityContext", {})}
            cwhere = _where(workload, container)
            if sc.get("runAsNonRoot") is not True or sc.get("runAsUser", 1) == 0:
                problems.append(f"{cwhere}: may run as root")
            if sc.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
                problems.append(f"{cwhere}: no seccomp profile")
            if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
                problems.append(f"{cwhere}: privilege escalation allowed")
            caps = sc.get("capabilities", {})
            if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
                problems.append(f"{cwhere}: capabilities not all dropped")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{cwhere}: writable root filesystem")
    return problems


def _autoscaled(r: Rendered) -> set[tuple[str, str]]:
    return {
        (o["metadata"].get("namespace", ""), o["spec"]["scaleTargetRef"]["name"])
        for o in r.of_kind("ScaledObject")
    }


def check_disruption(r: Rendered) -> list[str]:
    """Each Deployment of more than one pod (or autoscaled) has exactly one budget, which
    lets one pod go at a time; rolling updates add before they remove (maxUnavailable 0), and
    a new shim is ready long enough for every gateway to have seen it join."""
    problems = []
    budgets = r.of_kind("PodDisruptionBudget")
    autoscaled = _autoscaled(r)
    for workload, template in pod_templates(r.objects):
        if workload["kind"] != "Deployment":
            continue
        where = _where(workload)
        ns, name = workload["metadata"].get("namespace", ""), workload["metadata"]["name"]
        scaled = (ns, name) in autoscaled
        if scaled and "replicas" in workload["spec"]:
            problems.append(f"{where}: sets replicas although autoscaled (apply resets it)")
        many = scaled or workload["spec"].get("replicas", 1) > 1
        labels = template["metadata"].get("labels", {})
        mine = [b for b in budgets if selects(b["spec"]["selector"], labels)]
        if many and len(mine) != 1:
            problems.append(f"{where}: {len(mine)} PodDisruptionBudgets, expected 1")
        for budget in mine:
            spec = budget["spec"]
            if "maxUnavailable" not in spec or str(spec["maxUnavailable"]) in ("0", "0%"):
                problems.append(f"{where}: its budget never lets a pod go (use maxUnavailable)")
        if not many:
            continue
        rolling = workload["spec"].get("strategy", {}).get("rollingUpdate", {})
        if str(rolling.get("maxUnavailable")) != "0" or str(rolling.get("maxSurge", "0")) in (
            "0",
            "0%",
        ):
            problems.append(f"{where}: a rolling update may remove before it adds")
        for container in template["spec"]["containers"]:
            with contextlib.suppress(ValueError, NotModelled):
                proc = process(r, workload, container)
                if proc is not None and proc.command == "shim":
                    ready_s = workload["spec"].get("minReadySeconds", 0)
                    if ready_s < 2 * proc.registry.poll_interval_s:
                        problems.append(f"{where}: minReadySeconds below 2 registry polls")
    return problems


_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"\s*,?')
DESIRED = "pdgate_ratio_desired_instances"
CURRENT = "pdgate_ratio_current_instances"


def check_autoscaling(r: Rendered) -> list[str]:
    """Each ScaledObject follows the ratio advice for its target's own group and role (as
    the shim reads them), in its own namespace: AverageValue with threshold 1 makes the
    replica count the advised count; fallback (which needs AverageValue) never shrinks."""
    problems = []
    for obj in r.of_kind("ScaledObject"):
        spec, ns = obj["spec"], obj["metadata"].get("namespace", "")
        where = f"ScaledObject/{obj['metadata']['name']}"
        target = r.find("Deployment", spec["scaleTargetRef"]["name"], ns)
        if target is None:
            problems.append(f"{where}: no target Deployment")
            continue
        shims = [
            proc.settings
            for w, _, proc in processes(r)
            if w is target and isinstance(proc.settings, ShimSettings)
        ]
        if len(shims) != 1:
            problems.append(f"{where}: its target runs {len(shims)} shims, expected 1")
            continue
        want = {"namespace": ns, "group": shims[0].group, "role": shims[0].role.value}
        if not spec.get("minReplicaCount", 0) >= 1:
            problems.append(f"{where}: may scale to zero {want['role']}s")
        if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
            problems.append(f"{where}: minReplicaCount above maxReplicaCount")
        for trigger in spec["triggers"]:
            meta = trigger["metadata"]
            if trigger["type"] != "prometheus":
                problems.append(f"{where}: trigger {trigger['type']} is not the ratio advice")
                continue
            if (
                trigger.get("metricType", "AverageValue") != "AverageValue"
                or meta["threshold"] != "1"
            ):
                problems.append(f"{where}: replicas would not equal the advised count")
            found = _SELECTOR.findall(meta["query"])
            metrics = {metric for metric, _ in found}
            if DESIRED not in metrics or metrics - {DESIRED, CURRENT}:
                problems.append(f"{where}: the query reads {sorted(metrics)}")
            if f"sum({DESIRED}" not in meta["query"].replace(" ", ""):
                # Each gateway exports its share of the need: only the sum is the fleet's.
                problems.append(f"{where}: the desired counts must be summed over gateways")
            for metric, matchers in found:
                labels = dict(_MATCHER.findall(matchers))
                if labels != want:
                    problems.append(f"{where}: {metric} selects {labels}, expected {want}")
        fallback = spec.get("fallback")
        if fallback is not None and fallback.get("behavior") != "currentReplicasIfHigher":
            problems.append(f"{where}: a monitoring outage could shrink the fleet")
    return problems


def project_version() -> str:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return str(project["version"])


def check_images(r: Rendered) -> list[str]:
    """pdgate containers run this version's image: the vLLM variant exactly where the
    engine is vllm. Other images are pinned to a tag."""
    problems = []
    version = project_version()
    for workload, template in pod_templates(r.objects):
        for container in containers(template["spec"]):
            where = _where(workload, container)
            image = container["image"]
            if not image.startswith(IMAGE_REPOSITORY):
                tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
                if tag in ("", "latest"):
                    problems.append(f"{where}: {image} is not pinned")
                continue
            try:
                proc = process(r, workload, container)
            except (ValueError, NotModelled) as exc:
                problems.append(f"{where}: {exc}")
                continue
            assert proc is not None
            vllm = isinstance(proc.settings, ShimSettings) and proc.settings.engine == "vllm"
            want = f"{VLLM_IMAGE if vllm else PLAIN_IMAGE}:{version}"
            if image != want:
                problems.append(f"{where}: runs {image}, expected {want}")
    return problems


CHECKS: list[Callable[[Rendered], list[str]]] = [
    check_settings,
    check_probes,
    check_services,
    check_references,
    check_api_keys,
    check_placeholders,
    check_network,
    check_termination,
    check_resources,
    check_security,
    check_disruption,
    check_autoscaling,
    check_images,
]
