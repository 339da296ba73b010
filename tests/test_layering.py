"""The package layering, checked on the source: who may import whom.

config       the neutral base: settings, wire protocol, asyncio helpers; imports nothing
             else of pdgate's (its CLI loads commands by module name, never by import)
policies     pure ranking: config only
registry     membership: config only
gateway      config, policies, registry; never the shim package (it fronts stock vLLM too)
engine_shim  config, registry; never the gateway
loadtest     anything (benchmarks and the embedded cluster run whole clusters)

Inside gateway/, the stages of a request, lowest first (gateway/__init__.py): a module
imports only modules of its own stage or of a lower one, and the module graph has no cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "config": {"config"},
    "policies": {"config", "policies"},
    "registry": {"config", "registry"},
    "gateway": {"config", "policies", "registry", "gateway"},
    "engine_shim": {"config", "registry", "engine_shim"},
    "loadtest": {"config", "policies", "registry", "gateway", "engine_shim", "loadtest"},
}


def _imported(path: Path) -> Iterator[str]:
    """Every dotted name a module imports, at any depth (lazily, under TYPE_CHECKING): a
    module, and for ``from m import a`` both ``m`` and ``m.a`` (``a`` may be a module)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def _imports(path: Path) -> set[str]:
    """The pdgate packages a module imports."""
    return {
        parts[1]
        for parts in (name.split(".") for name in _imported(path))
        if parts[0] == "pdgate" and len(parts) > 1
    }


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        extra = _imports(path) - ALLOWED[package]
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"layering broken: {bad}"


def test_the_wire_modules_import_nothing_of_pdgate_but_each_other() -> None:
    for name in ("wire.py", "openai_api.py", "aio.py"):
        imported = {
            node.module
            for node in ast.walk(ast.parse((ROOT / "config" / name).read_text()))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdgate")
        }
        assert imported <= {"pdgate.config.wire"}, (name, imported)


# gateway/'s stages, lowest first; the top-level modules (app, cli, keys, workers) come last.
STAGES = [
    "errors",
    "observe",
    "upstream",
    "instances",
    "admission",
    "placement",
    "stream",
    "translate",
    "api",
]
TOP = {"app", "cli", "keys", "workers", "__init__"}


def _gateway_modules() -> dict[str, Path]:
    """Dotted name under pdgate.gateway (``placement.dispatch``) -> source file."""
    out = {}
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        rel = path.relative_to(ROOT / "gateway").with_suffix("")
        out[".".join(rel.parts)] = path
    return out


def _gateway_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The gateway modules `path` imports."""
    found: set[str] = set()
    for name in _imported(path):
        if name.startswith("pdgate.gateway."):
            short = name.removeprefix("pdgate.gateway.")
            while short and short not in modules:
                short = short.rpartition(".")[0]
            if short:
                found.add(short)
    return found


def _stage(module: str) -> int:
    head = module.split(".")[0]
    return STAGES.index(head) if head in STAGES else len(STAGES)


def test_gateway_stages_import_only_lower_stages() -> None:
    modules = _gateway_modules()
    bad = {}
    for name, path in modules.items():
        if name.split(".")[0] in TOP:
            continue
        assert name.split(".")[0] in STAGES, f"gateway/{name}: not in a stage of STAGES"
        upward = {
            m
            for m in _gateway_imports(path, modules)
            if _stage(m) > _stage(name) and m.split(".")[0] not in ("__init__",)
        }
        if upward:
            bad[name] = sorted(upward)
    assert not bad, f"a gateway stage imports a later one: {bad}"


def test_the_gateway_module_graph_has_no_cycle() -> None:
    modules = _gateway_modules()
    graph = {name: _gateway_imports(path, modules) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_gateway_keeps_few_modules_at_its_top_level() -> None:
    top = sorted(p.name for p in (ROOT / "gateway").glob("*.py"))
    assert len(top) <= 12, top


def test_each_gateway_stage_says_what_it_may_import() -> None:
    for stage in STAGES[1:]:
        doc = ast.get_docstring(ast.parse((ROOT / "gateway" / stage / "__init__.py").read_text()))
        assert doc and ("May import" in doc or "Imports nothing" in doc), stage
