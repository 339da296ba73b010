"""The subset of kustomize that deploy/ uses, in Python, so the manifests render offline.

Supported, with kustomize's semantics: ``resources`` (files and directories), ``namespace``,
``patches`` given by ``path`` holding a strategic merge patch, ``images`` and ``replicas``.
Strategic merge follows the Kubernetes schemas bundled with kubernetes-validate: a list whose
schema says ``x-kubernetes-patch-strategy: merge`` is merged by its
``x-kubernetes-patch-merge-key`` (patch items first, in the patch's order, then the
original's other items: kustomize's order), any other list is replaced, ``null`` deletes a
key, and a list item ``{$patch: delete, <key>: ...}`` removes that item. Everything else
(generators, name prefixes, labels, JSON 6902 patches, other ``$`` directives) raises
`Unsupported` instead of rendering something kustomize would not: a manifest that starts
using a feature needs it implemented here first. ``test_kustomize.py`` checks the output
against ``kubectl kustomize`` itself.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

__all__ = ["SCHEMA_VERSION", "Unsupported", "build", "kind_schema", "strategic_merge"]

# The Kubernetes version whose schemas give the patch merge keys (kubernetes-validate's).
SCHEMA_VERSION = "1.37.0"

Obj = dict[str, Any]

_KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "images", "replicas"}
# Kinds without a namespace (those deploy/ could plausibly contain).
_CLUSTER_SCOPED = {
    "Namespace",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "ClusterTriggerAuthentication",
}
# Kinds whose other fields kustomize's namespace transformer rewrites too: not implemented.
_NAMESPACE_REFERENCES = {
    "RoleBinding",
    "ClusterRoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "APIService",
}
_REPLICATED = {"Deployment", "ReplicaSet", "StatefulSet", "ReplicationController"}


class Unsupported(ValueError):
    """The kustomization uses something this subset does not implement."""


def build(directory: Path) -> list[Obj]:
    """The objects `kubectl kustomize directory` would print (in kustomize's input order)."""
    directory = directory.resolve()
    spec = _kustomization(directory)
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        objects += build(path) if path.is_dir() else _load_all(path)
    _check_unique(objects, directory)
    # kustomize's order of built-in transformers: patches, namespace, replicas, images.
    for patch in spec.get("patches", []):
        _apply_patch(objects, directory, patch)
    if "namespace" in spec:
        _set_namespace(objects, spec["namespace"])
    for replicas in spec.get("replicas", []):
        _set_replicas(objects, replicas)
    for image in spec.get("images", []):
        _set_image(objects, image)
    return objects


def _kustomization(directory: Path) -> Obj:
    for name in _KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            spec = yaml.safe_load(path.read_text())
            break
    else:
        raise FileNotFoundError(f"no kustomization file in {directory}")
    if not isinstance(spec, dict):
        raise Unsupported(f"{path}: not a mapping")
    unknown = set(spec) - _KEYS
    if unknown:
        raise Unsupported(f"{path}: fields {sorted(unknown)} are not implemented here")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise Unsupported(f"{path}: kind {spec['kind']} (only Kustomization)")
    return spec


def _load_all(path: Path) -> list[Obj]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
            raise ValueError(f"{path}: every document needs apiVersion, kind and metadata")
    return docs


def _ident(obj: Obj) -> tuple[str, str, str, str]:
    group = obj["apiVersion"].rpartition("/")[0]
    meta = obj["metadata"]
    return (group, obj["kind"], meta.get("namespace", ""), meta["name"])


def _check_unique(objects: list[Obj], where: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        ident = _ident(obj)
        if ident in seen:
            raise ValueError(f"{where}: {ident} is defined twice")
        seen.add(ident)


def _apply_patch(objects: list[Obj], directory: Path, entry: Obj) -> None:
    if set(entry) != {"path"}:
        raise Unsupported(f"{directory}: patch {entry} (only `path:` to a strategic merge patch)")
    path = directory / entry["path"]
    docs = _load_all(path)
    if len(docs) != 1:
        raise Unsupported(f"{path}: one patch per file")
    patch = docs[0]
    group, kind, namespace, name = _ident(patch)
    targets = [
        o
        for o in objects
        if _ident(o)[:2] == (group, kind)
        and o["metadata"]["name"] == name
        and (not namespace or o["metadata"].get("namespace", "") == namespace)
    ]
    if len(targets) != 1:
        raise ValueError(f"{path}: matches {len(targets)} resources, expected 1")
    target = targets[0]
    merged = strategic_merge(target, patch, kind_schema(patch["apiVersion"], kind))
    target.clear()
    target.update(merged)


def _set_namespace(objects: list[Obj], namespace: str) -> None:
    for obj in objects:
        if obj["kind"] in _NAMESPACE_REFERENCES:
            raise Unsupported(f"namespace transformer for {obj['kind']}")
        if obj["kind"] not in _CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace


def _set_replicas(objects: list[Obj], entry: Obj) -> None:
    if set(entry) != {"name", "count"}:
        raise Unsupported(f"replicas entry {entry}")
    matched = [
        o for o in objects if o["kind"] in _REPLICATED and o["metadata"]["name"] == entry["name"]
    ]
    if not matched:
        raise ValueError(f"replicas: nothing named {entry['name']}")
    for obj in matched:
        obj["spec"]["replicas"] = entry["count"]


def _split_image(image: str) -> tuple[str, str]:
    """(name, suffix): the suffix is ":tag", "@digest" or ":tag@digest" (or "")."""
    at = image.find("@")
    base, digest = (image[:at], image[at:]) if at >= 0 else (image, "")
    colon = base.rfind(":")
    if colon > base.rfind("/"):
        return base[:colon], base[colon:] + digest
    return base, digest


def _set_image(objects: list[Obj], entry: Obj) -> None:
    if not set(entry) <= {"name", "newName", "newTag", "digest"} or "name" not in entry:
        raise Unsupported(f"images entry {entry}")

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    for container in value:
                        _retag(container, entry)
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    for obj in objects:
        visit(obj)


def _retag(container: Obj, entry: Obj) -> None:
    image = container.get("image")
    if not isinstance(image, str):
        return
    name, suffix = _split_image(image)
    if name != entry["name"]:
        return
    name = entry.get("newName", name)
    if "digest" in entry:
        suffix = "@" + entry["digest"]
    elif "newTag" in entry:
        suffix = ":" + str(entry["newTag"])
    container["image"] = name + suffix


# --- strategic merge patch, driven by the bundled OpenAPI-derived JSON schemas -------------


def _schema_dir() -> Any:
    return (
        importlib.resources.files("kubernetes_validate")
        / "kubernetes-json-schema"
        / f"v{SCHEMA_VERSION}-local-strict"
    )


@cache
def _definitions() -> dict[str, Any]:
    defs: dict[str, Any] = json.loads((_schema_dir() / "_definitions.json").read_text())["$defs"]
    return defs


@cache
def _kind_schema_text(filename: str) -> str | None:
    path = _schema_dir() / filename
    return path.read_text() if path.is_file() else None


def kind_schema(api_version: str, kind: str) -> Obj | None:
    """The bundled schema of a kind (None for kinds it lacks, e.g. custom resources), found by
    kubernetes-validate's own file naming: ``deployment-apps-v1.json``."""
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    text = _kind_schema_text(f"{kind.lower()}-{api}.json")
    return None if text is None else dict(json.loads(text))


def _resolve(schema: Obj | None) -> Obj | None:
    while schema is not None and "$ref" in schema:
        name = schema["$ref"].rpartition("/")[2]
        schema = _definitions().get(name)
    return schema


def _child(schema: Obj | None, key: str) -> Obj | None:
    schema = _resolve(schema)
    if schema is None:
        return None
    props = schema.get("properties", {})
    if key in props:
        return dict(props[key])
    extra = schema.get("additionalProperties")
    return dict(extra) if isinstance(extra, dict) else None


def strategic_merge(original: Obj, patch: Obj, schema: Obj | None) -> Obj:
    """`patch` applied to a copy of `original` as a strategic merge patch."""
    result = copy.deepcopy(original)
    for key, value in patch.items():
        if key.startswith("$"):
            raise Unsupported(f"patch directive {key}")
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = strategic_merge(result[key], value, _child(schema, key))
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_list(result[key], value, _child(schema, key))
        else:
            result[key] = _strip_directives(value)
    return result


def _strip_directives(value: Any) -> Any:
    """A new value from a patch; directives inside it mean nothing to merge with: refuse."""
    if isinstance(value, dict):
        if any(k.startswith("$") for k in value):
            raise Unsupported(f"patch directive in new value {value}")
        return {k: _strip_directives(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def _merge_list(original: list[Any], patch: list[Any], schema: Obj | None) -> list[Any]:
    schema = _resolve(schema)
    strategy = str((schema or {}).get("x-kubernetes-patch-strategy", "")).split(",")
    key = (schema or {}).get("x-kubernetes-patch-merge-key")
    if "merge" not in strategy:
        return [_strip_directives(v) for v in patch]
    if key is None or not all(isinstance(v, dict) for v in original + patch):
        raise Unsupported(f"merging a list of scalars ({patch})")
    item_schema = (schema or {}).get("items")
    by_key = {item.get(key): item for item in original}
    merged: list[Any] = []
    taken: set[Any] = set()
    for item in patch:
        if key not in item:
            raise ValueError(f"patch list item {item} lacks its merge key {key}")
        directive = item.get("$patch")
        if directive not in (None, "delete"):
            raise Unsupported(f"$patch: {directive}")
        taken.add(item[key])
        if directive == "delete":
            continue
        if item[key] in by_key:
            merged.append(strategic_merge(by_key[item[key]], item, item_schema))
        else:
            merged.append(_strip_directives(item))
    merged += [copy.deepcopy(item) for item in original if item.get(key) not in taken]
    return merged
