"""deploy/, rendered offline and validated: every object against the Kubernetes schemas that
kubernetes-validate bundles (strict: unknown fields fail) at the oldest and newest Kubernetes
versions we support, KEDA's ScaledObjects against a strict schema written from KEDA's
documentation, and the cross-object invariants of `_checks.py` on every deployable overlay.
Each invariant is also shown to fail: a mutation of the rendered objects that breaks it must
be reported.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from referencing import Registry, Resource

from pdgate.config.settings import ShimSettings
from tests.deploy import _checks
from tests.deploy._checks import (
    DEPLOY,
    DEPLOYABLE,
    OPERATOR_SECRETS,
    ROOT,
    Rendered,
    kustomizations,
    rendered,
)
from tests.deploy._k8s import Obj, containers, pod_templates, secret_values
from tests.deploy._kustomize import SCHEMA_VERSION

# The oldest Kubernetes release deploy/ supports (unhealthyPodEvictionPolicy is GA from
# 1.31, on by default since 1.27) and the newest whose schemas kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.30.0", SCHEMA_VERSION)
KUSTOMIZATIONS = kustomizations()
KEDA_SCHEMA = Path(__file__).with_name("keda-scaledobject.schema.json")


@cache
def _keda_validator() -> Any:
    defs_path = (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema"
        / f"v{SCHEMA_VERSION}-local-strict"
        / "_definitions.json"
    )
    definitions = Resource.from_contents(json.loads(defs_path.read_text()))
    registry: Registry[Any] = definitions @ Registry()
    schema = json.loads(KEDA_SCHEMA.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, registry=registry)


def schema_problems(obj: Obj, version: str) -> list[str]:
    where = f"{obj['kind']}/{obj['metadata'].get('name')}"
    if obj["apiVersion"].startswith("keda.sh/"):
        errors = sorted(_keda_validator().iter_errors(obj), key=lambda e: list(e.path))
        return [f"{where}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{where}: {exc.message}"]
    return []


def test_kustomizations_and_overlays_are_all_found() -> None:
    assert {"base", "overlays/dev", "overlays/gpu"} <= set(KUSTOMIZATIONS)
    overlays = {f"overlays/{p.name}" for p in (DEPLOY / "overlays").iterdir() if p.is_dir()}
    assert overlays == set(DEPLOYABLE), "a new overlay needs its entry in DEPLOYABLE"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_matches_its_schema(name: str, version: str) -> None:
    objects = rendered(name).objects
    assert objects
    problems = [p for obj in objects for p in schema_problems(obj, version)]
    assert not problems, "\n".join(problems)


def test_validation_is_strict() -> None:
    """An unknown field, a wrong type, a misspelt ScaledObject field and an unquoted KEDA
    threshold are all refused: the validation above can fail."""
    objects = rendered("overlays/gpu").objects
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["htttpGet"] = {}
    assert "htttpGet" in " ".join(schema_problems(deployment, SCHEMA_VERSION))
    service = next(o for o in objects if o["kind"] == "Service")
    service["spec"]["ports"][0]["port"] = "eighty"
    assert schema_problems(service, SCHEMA_VERSION)
    scaled = [o for o in objects if o["kind"] == "ScaledObject"]
    assert len(scaled) == 2
    scaled[0]["spec"]["minReplicas"] = 1
    assert "minReplicas" in " ".join(schema_problems(scaled[0], SCHEMA_VERSION))
    scaled[1]["spec"]["triggers"][0]["metadata"]["threshold"] = 1
    assert "threshold" in " ".join(schema_problems(scaled[1], SCHEMA_VERSION))


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_names_and_labels_are_valid(name: str) -> None:
    """What the schemas leave to the API server's own validation: object names (DNS labels
    here, at most 63 characters, as Service and container names must be) and label values."""
    problems = []
    for obj in rendered(name).objects:
        names = [obj["metadata"]["name"]]
        labels = dict(obj["metadata"].get("labels", {}))
        if obj["kind"] in ("Deployment", "StatefulSet"):
            labels |= obj["spec"]["template"]["metadata"].get("labels", {})
            names += [c["name"] for c in containers(obj["spec"]["template"]["spec"])]
        problems += [n for n in names if len(n) > 63 or not _DNS_LABEL.match(n)]
        problems += [v for v in labels.values() if len(v) > 63 or not _LABEL_VALUE.match(v)]
    assert not problems


@pytest.mark.parametrize("check", _checks.CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", sorted(DEPLOYABLE))
def test_invariant_holds(name: str, check: Callable[[Rendered], list[str]]) -> None:
    problems = check(rendered(name))
    assert not problems, "\n".join(problems)


def test_the_checks_see_the_fleet() -> None:
    """The invariants are about something: each overlay runs gateways, prefills and decodes
    that the checks parse into settings (an overlay they could not read would pass empty)."""
    for name in DEPLOYABLE:
        commands = sorted(
            f"shim {proc.settings.role.value}"
            if isinstance(proc.settings, ShimSettings)
            else proc.command
            for _, _, proc in _checks.processes(rendered(name))
        )
        assert commands == ["gateway", "shim decode", "shim prefill"], name


# --- mutations: each invariant must catch its breakage -------------------------------------


def _workload(r: Rendered, name: str) -> Obj:
    found = r.find("Deployment", name)
    assert found is not None, name
    return found


def _container(r: Rendered, name: str) -> Obj:
    spec = _workload(r, name)["spec"]["template"]["spec"]
    container: Obj = spec["containers"][0]
    return container


def _env(r: Rendered, name: str, var: str, value: str) -> None:
    env = _container(r, name)["env"]
    for item in env:
        if item["name"] == var:
            item.clear()
            item.update(name=var, value=value)
            return
    env.append({"name": var, "value": value})


def _wrong_probe_port(r: Rendered) -> None:
    _container(r, "pdgate-gateway")["readinessProbe"]["httpGet"]["port"] = 8001


def _wrong_probe_path(r: Rendered) -> None:
    _container(r, "pdgate-prefill")["livenessProbe"]["httpGet"]["path"] = "/healthz"


def _shim_port_moved(r: Rendered) -> None:
    _env(r, "pdgate-decode", "PDGATE_SHIM_PORT", "8200")


def _selector_typo(r: Rendered) -> None:
    service = r.find("Service", "pdgate-gateway")
    assert service is not None
    service["spec"]["selector"]["app.kubernetes.io/component"] = "gateways"


def _target_port_typo(r: Rendered) -> None:
    service = r.find("Service", "pdgate-gateway")
    assert service is not None
    service["spec"]["ports"][0]["targetPort"] = "https"


def _secret_missing(r: Rendered) -> None:
    r.objects = [o for o in r.objects if o["metadata"]["name"] != "pdgate-admin-token"]


def _secret_key_typo(r: Rendered) -> None:
    env = _container(r, "pdgate-prefill")["env"]
    ref = next(e for e in env if e["name"] == "PDGATE_REGISTRY_CLUSTER_TOKEN")
    ref["valueFrom"]["secretKeyRef"]["key"] = "tokn"


def _prefill_open_to_all(r: Rendered) -> None:
    policy = r.find("NetworkPolicy", "pdgate-prefill")
    assert policy is not None
    del policy["spec"]["ingress"][0]["from"]


def _decode_reaches_decode(r: Rendered) -> None:
    policy = r.find("NetworkPolicy", "pdgate-decode")
    assert policy is not None
    peer = {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}}}
    policy["spec"]["ingress"][0]["from"].append(peer)


def _no_default_deny(r: Rendered) -> None:
    r.objects = [o for o in r.objects if o["metadata"]["name"] != "pdgate-default-deny"]


def _redis_closed(r: Rendered) -> None:
    r.objects = [
        o
        for o in r.objects
        if o["kind"] != "NetworkPolicy" or o["metadata"]["name"] != "pdgate-redis"
    ]


def _drain_outlasts_grace(r: Rendered) -> None:
    _env(r, "pdgate-decode", "PDGATE_SHIM_DRAIN_TIMEOUT_S", "600")


def _long_prestop(r: Rendered) -> None:
    _container(r, "pdgate-gateway")["lifecycle"]["preStop"]["exec"]["command"] = ["sleep", "60"]


def _no_limits(r: Rendered) -> None:
    del _container(r, "pdgate-gateway")["resources"]["limits"]


def _request_above_limit(r: Rendered) -> None:
    _container(r, "pdgate-decode")["resources"]["requests"]["memory"] = "100Gi"


def _unknown_setting(r: Rendered) -> None:
    _env(r, "pdgate-prefill", "PDGATE_SHIM_DRAIN_TIMEOUT", "30")


def _bad_setting_value(r: Rendered) -> None:
    _env(r, "pdgate-prefill", "PDGATE_SHIM_CAPACITY", "eight")


def _pod_ip_used_before_defined(r: Rendered) -> None:
    env = _container(r, "pdgate-prefill")["env"]
    pod_ip = next(e for e in env if e["name"] == "POD_IP")
    env.remove(pod_ip)
    env.append(pod_ip)


def _bad_flag(r: Rendered) -> None:
    _container(r, "pdgate-decode")["args"].append("--drain-timeout-s=30")


def _loopback_shim(r: Rendered) -> None:
    _env(r, "pdgate-decode", "PDGATE_SHIM_HOST", "127.0.0.1")


def _gateway_without_keys(r: Rendered) -> None:
    env = _container(r, "pdgate-gateway")["env"]
    env[:] = [e for e in env if e["name"] != "PDGATE_GATEWAY_API_KEYS_FILE"]


def _group_mismatch(r: Rendered) -> None:
    _env(r, "pdgate-prefill", "PDGATE_SHIM_GROUP", "chat")


def _query_wrong_role(r: Rendered) -> None:
    scaled = r.find("ScaledObject", "pdgate-decode-default")
    assert scaled is not None
    meta = scaled["spec"]["triggers"][0]["metadata"]
    meta["query"] = meta["query"].replace('role="decode"', 'role="prefill"')


def _replicas_fight_autoscaler(r: Rendered) -> None:
    _workload(r, "pdgate-prefill")["spec"]["replicas"] = 2


def _wrong_image(r: Rendered) -> None:
    _container(r, "pdgate-prefill")["image"] = "ghcr.io/pdgate/pdgate:0.1.0"


def _redis_password_mismatch(r: Rendered) -> None:
    secret = r.find("Secret", "pdgate-registry")
    assert secret is not None
    secret["stringData"]["password"] = "another-REPLACE-ME"


def _real_looking_secret(r: Rendered) -> None:
    secret = r.find("Secret", "pdgate-admin-token")
    assert secret is not None
    secret["stringData"]["token"] = "s3cr3t"


def _bad_keys_file(r: Rendered) -> None:
    secret = r.find("Secret", "pdgate-api-keys")
    assert secret is not None
    secret["stringData"]["keys"] = "sk-dev-REPLACE-ME owner=dev\n"


def _runs_as_root(r: Rendered) -> None:
    _workload(r, "pdgate-decode")["spec"]["template"]["spec"]["securityContext"]["runAsUser"] = 0


def _writable_root(r: Rendered) -> None:
    del _container(r, "pdgate-redis")["securityContext"]["readOnlyRootFilesystem"]


def _no_budget(r: Rendered) -> None:
    r.objects = [
        o
        for o in r.objects
        if o["kind"] != "PodDisruptionBudget" or o["metadata"]["name"] != "pdgate-decode"
    ]


def _remove_before_add(r: Rendered) -> None:
    rolling = _workload(r, "pdgate-prefill")["spec"]["strategy"]["rollingUpdate"]
    rolling.update(maxUnavailable=1, maxSurge=0)


MUTATIONS: list[tuple[str, Callable[[Rendered], None], Callable[[Rendered], list[str]], str]] = [
    ("overlays/dev", _wrong_probe_port, _checks.check_probes, "port 8001 is not declared"),
    ("overlays/gpu", _wrong_probe_path, _checks.check_probes, "is not GET /health"),
    ("overlays/dev", _shim_port_moved, _checks.check_probes, "pdgate listens on 8200"),
    ("overlays/dev", _selector_typo, _checks.check_services, "selects no pods"),
    ("overlays/gpu", _target_port_typo, _checks.check_services, "declares no port https"),
    ("overlays/dev", _secret_missing, _checks.check_references, "pdgate-admin-token does not"),
    ("overlays/gpu", _secret_key_typo, _checks.check_references, "has no key tokn"),
    (
        "overlays/dev",
        _prefill_open_to_all,
        _checks.check_network,
        "stranger in the namespace -> prefill:8100 is admitted",
    ),
    (
        "overlays/gpu",
        _decode_reaches_decode,
        _checks.check_network,
        "decode -> decode:8100 is admitted",
    ),
    (
        "overlays/gpu",
        _no_default_deny,
        _checks.check_network,
        "-> a new pdgate pod:8080 is admitted",
    ),
    ("overlays/dev", _redis_closed, _checks.check_network, "gateway -> redis:6379 is denied"),
    ("overlays/dev", _drain_outlasts_grace, _checks.check_termination, "drain_timeout_s 600"),
    ("overlays/gpu", _long_prestop, _checks.check_termination, "preStop 60"),
    ("overlays/dev", _no_limits, _checks.check_resources, "no cpu request and limit"),
    ("overlays/gpu", _request_above_limit, _checks.check_resources, "memory request above"),
    ("overlays/dev", _unknown_setting, _checks.check_settings, "PDGATE_SHIM_DRAIN_TIMEOUT"),
    ("overlays/gpu", _bad_setting_value, _checks.check_settings, "capacity"),
    ("overlays/dev", _pod_ip_used_before_defined, _checks.check_settings, "$(POD_IP) names no"),
    ("overlays/gpu", _bad_flag, _checks.check_settings, "refused by pdgate's parser"),
    ("overlays/dev", _loopback_shim, _checks.check_settings, "unreachable from other pods"),
    ("overlays/gpu", _gateway_without_keys, _checks.check_settings, "without client API keys"),
    ("overlays/gpu", _group_mismatch, _checks.check_autoscaling, "'group': 'chat'"),
    ("overlays/gpu", _query_wrong_role, _checks.check_autoscaling, "'role': 'decode'"),
    ("overlays/gpu", _replicas_fight_autoscaler, _checks.check_disruption, "although autoscaled"),
    ("overlays/gpu", _wrong_image, _checks.check_images, "expected ghcr.io/pdgate/pdgate-vllm"),
    ("overlays/dev", _redis_password_mismatch, _checks.check_api_keys, "password is not Redis's"),
    ("overlays/dev", _real_looking_secret, _checks.check_placeholders, "token is no placeholder"),
    ("overlays/dev", _bad_keys_file, _checks.check_api_keys, "unknown option 'owner'"),
    ("overlays/gpu", _runs_as_root, _checks.check_security, "may run as root"),
    ("overlays/dev", _writable_root, _checks.check_security, "writable root filesystem"),
    ("overlays/dev", _no_budget, _checks.check_disruption, "0 PodDisruptionBudgets"),
    ("overlays/gpu", _remove_before_add, _checks.check_disruption, "remove before it adds"),
]


@pytest.mark.parametrize(
    ("name", "mutate", "check", "expected"),
    MUTATIONS,
    ids=[m[1].__name__.lstrip("_") for m in MUTATIONS],
)
def test_a_broken_invariant_is_reported(
    name: str,
    mutate: Callable[[Rendered], None],
    check: Callable[[Rendered], list[str]],
    expected: str,
) -> None:
    r = rendered(name)
    assert not check(r)
    mutate(r)
    problems = check(r)
    assert any(expected in p for p in problems), problems


def test_every_check_is_exercised_by_a_mutation() -> None:
    assert {m[2] for m in MUTATIONS} == set(_checks.CHECKS)


# --- the documentation and the Secrets it tells the operator to create ---------------------


def _section(title: str, page: str = "docs/operations.md") -> str:
    text = (ROOT / page).read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match is not None, f"{page} has no '## {title}' section"
    return match.group(1)


def _kubernetes() -> str:
    """deploy/README.md, the Kubernetes guide, whole."""
    return (ROOT / "deploy" / "README.md").read_text()


def test_docs_create_exactly_the_secrets_the_gpu_overlay_expects() -> None:
    """The Secrets the gpu overlay references but does not ship are exactly OPERATOR_SECRETS
    (names and keys), and docs/operations.md creates each with those keys."""
    r = rendered("overlays/gpu")
    referenced: dict[str, set[str]] = {}
    for _, template in pod_templates(r.objects):
        spec = template["spec"]
        for container in containers(spec):
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    referenced.setdefault(ref["name"], set()).add(ref["key"])
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                referenced.setdefault(volume["secret"]["secretName"], set())
    shipped = {s["metadata"]["name"] for s in r.of_kind("Secret")}
    external = {k: v for k, v in referenced.items() if k not in shipped}
    assert external.keys() == OPERATOR_SECRETS.keys()
    for name, keys in external.items():
        assert keys <= OPERATOR_SECRETS[name].keys(), name
    # The api-keys Secret is mounted whole: its key is the file name the gateway reads.
    assert set(OPERATOR_SECRETS["pdgate-api-keys"]) == {"keys"}

    created: dict[str, set[str]] = {}
    section = _section("The gpu overlay", "deploy/README.md")
    for match in re.finditer(r"create secret generic (\S+)((?:\\\n|[^\n])*)", section):
        flags = re.findall(r"--from-(?:literal|file)=([A-Za-z0-9_.-]+)=", match.group(2))
        created[match.group(1)] = set(flags)
    assert created == {k: set(v) for k, v in OPERATOR_SECRETS.items()}


def test_docs_have_the_operations_sections() -> None:
    kubernetes = _kubernetes()
    for overlay in DEPLOYABLE:
        assert f"kubectl apply -k deploy/{overlay}" in kubernetes
    assert "pdgate_ratio_desired_instances" in kubernetes
    assert "maxUnavailable" in _section("Rolling upgrades")


def test_dev_secrets_are_the_placeholders_the_docs_mention() -> None:
    section = _section("The dev overlay", "deploy/README.md")
    for secret in rendered("overlays/dev").of_kind("Secret"):
        assert secret["metadata"]["name"] in section
        assert all(_checks.PLACEHOLDER in v for v in secret_values(secret).values())
