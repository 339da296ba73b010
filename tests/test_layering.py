"""The package layering, checked on the source: who may import whom.

config       the neutral base: settings, wire protocol, asyncio helpers; imports nothing
             else of pdgate's (its CLI loads commands by module name, never by import)
policies     pure ranking: config only
registry     membership: config only
gateway      config, policies, registry; never the shim package (it fronts stock vLLM too)
engine_shim  config, registry; never the gateway
loadtest     anything (benchmarks and the embedded cluster run whole clusters)
"""

from __future__ import annotations

import ast
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


def _imports(path: Path) -> set[str]:
    """The pdgate packages a module imports (at any depth, lazily or not)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "pdgate" and len(parts) > 1:
                found.add(parts[1])
    return found


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
