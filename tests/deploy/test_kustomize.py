"""The Python kustomize subset (`_kustomize.py`) renders deploy/ exactly as kustomize does.

The reference is `kubectl kustomize` (kustomize v5 built into kubectl): every machine image
this project runs on has kubectl; without it the comparison is skipped on a developer's
machine and fails under CI=true. The other tests pin the subset's semantics on small inputs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

from tests._tools import require_binary
from tests.deploy._checks import DEPLOY, kustomizations
from tests.deploy._k8s import Obj
from tests.deploy._kustomize import Unsupported, build, kind_schema, strategic_merge


def _ident(obj: Obj) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])


def _assert_kubectl_agrees(directory: Path) -> None:
    kubectl = require_binary("kubectl", "`kubectl kustomize` is the reference renderer")
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    theirs = {_ident(o): o for o in yaml.safe_load_all(out) if o}
    ours = {_ident(o): o for o in build(directory)}
    assert ours.keys() == theirs.keys()
    for ident, obj in ours.items():
        assert obj == theirs[ident], ident  # list order included (env order matters)


@pytest.mark.parametrize("name", kustomizations())
def test_renders_deploy_as_kubectl_kustomize_does(name: str) -> None:
    _assert_kubectl_agrees(DEPLOY / name)


def _write(directory: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return directory


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: app}
spec:
  selector: {matchLabels: {app: a}}
  template:
    metadata: {labels: {app: a}}
    spec:
      tolerations: [{key: a, operator: Exists}]
      containers:
        - name: main
          image: registry.example:5000/team/app:1.0
          args: [serve, --port, "80"]
          env: [{name: A, value: "1"}, {name: B, value: "2"}]
          volumeMounts: [{name: v, mountPath: /v}]
        - name: side
          image: team/side@sha256:0000
      volumes: [{name: v, emptyDir: {}}]
"""


PATCH = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: app}
spec:
  template:
    spec:
      tolerations: [{key: b, operator: Exists}]
      containers:
        - name: main
          args: [serve]
          env: [{name: B, value: "3"}, {name: C, value: "4"}, {name: A, $patch: delete}]
          volumeMounts: [{name: w, mountPath: /w}]
      volumes: [{name: w, emptyDir: {medium: Memory}}]
"""

# Small kustomizations using each implemented feature, rendered by both.
FIXTURES = {
    "patch": {
        "app.yaml": DEPLOYMENT,
        "p.yaml": PATCH,
        "kustomization.yaml": "resources: [app.yaml]\npatches: [{path: p.yaml}]\n",
    },
    "transformers": {
        "base/app.yaml": DEPLOYMENT,
        "base/kustomization.yaml": "resources: [app.yaml]\n",
        "overlay/kustomization.yaml": """
namespace: prod
resources: [../base, ns.yaml]
replicas: [{name: app, count: 3}]
images:
  - {name: registry.example:5000/team/app, newName: mirror.example/app, newTag: "2.0"}
  - {name: team/side, digest: "sha256:1111"}
""",
        "overlay/ns.yaml": "apiVersion: v1\nkind: Namespace\nmetadata: {name: prod}\n",
    },
}


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
def test_renders_the_fixtures_as_kubectl_kustomize_does(tmp_path: Path, fixture: str) -> None:
    root = _write(tmp_path, FIXTURES[fixture])
    _assert_kubectl_agrees(root / "overlay" if (root / "overlay").is_dir() else root)


def test_strategic_merge_follows_the_schemas_merge_keys() -> None:
    original = yaml.safe_load(DEPLOYMENT)
    patch = yaml.safe_load(PATCH)
    merged = strategic_merge(original, patch, kind_schema("apps/v1", "Deployment"))
    spec = merged["spec"]["template"]["spec"]
    main = spec["containers"][0]
    # Lists with a merge key merge by it, the patch's items first; the rest are replaced.
    assert [c["name"] for c in spec["containers"]] == ["main", "side"]
    assert main["env"] == [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}]
    assert [m["mountPath"] for m in main["volumeMounts"]] == ["/w", "/v"]
    assert [v["name"] for v in spec["volumes"]] == ["w", "v"]
    assert main["args"] == ["serve"]
    assert spec["tolerations"] == [{"key": "b", "operator": "Exists"}]
    assert main["image"] == "registry.example:5000/team/app:1.0"
    assert original["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "serve",
        "--port",
        "80",
    ]


def test_null_deletes_and_unknown_kinds_replace_lists() -> None:
    merged = strategic_merge(
        {"a": {"b": 1, "c": 2}, "l": [{"name": "x"}]},
        {"a": {"b": None}, "l": [{"name": "y"}]},
        None,
    )
    assert merged == {"a": {"c": 2}, "l": [{"name": "y"}]}


def test_transformers(tmp_path: Path) -> None:
    root = _write(tmp_path, FIXTURES["transformers"])
    deployment, namespace = build(root / "overlay")
    assert deployment["metadata"]["namespace"] == "prod"
    assert "namespace" not in namespace["metadata"]
    assert deployment["spec"]["replicas"] == 3
    images = [c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]]
    assert images == ["mirror.example/app:2.0", "team/side@sha256:1111"]


@pytest.mark.parametrize(
    "kustomization",
    [
        "resources: [app.yaml]\nnamePrefix: x-\n",
        "resources: [app.yaml]\ncommonLabels: {a: b}\n",
        "resources: [app.yaml]\nconfigMapGenerator: [{name: c, literals: [a=b]}]\n",
        "resources: [app.yaml]\npatches: [{target: {kind: Deployment}, patch: '[]'}]\n",
        "resources: [app.yaml]\npatches: [{path: p.yaml}]\n",
    ],
)
def test_what_is_not_implemented_is_refused(tmp_path: Path, kustomization: str) -> None:
    _write(
        tmp_path,
        {
            "app.yaml": DEPLOYMENT,
            "kustomization.yaml": kustomization,
            "p.yaml": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\n"
            "spec: {template: {spec: {$retainKeys: [containers]}}}\n",
        },
    )
    with pytest.raises(Unsupported):
        build(tmp_path)


def test_a_patch_must_find_its_target(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "app.yaml": DEPLOYMENT,
            "kustomization.yaml": "resources: [app.yaml]\npatches: [{path: p.yaml}]\n",
            "p.yaml": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: ap}\nspec: {}\n",
        },
    )
    with pytest.raises(ValueError, match="matches 0 resources"):
        build(tmp_path)
