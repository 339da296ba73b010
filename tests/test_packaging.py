"""The installed import names: everything under `pdgate.*`, nothing at the top level.

The source keeps the agreed flat layout (gateway/, policies/, ...); pyproject.toml maps each
folder under `pdgate.`. These tests keep that map in step with the tree and check, from a
directory outside the checkout, that only `pdgate` is importable.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("config", "engine_shim", "gateway", "loadtest", "policies", "registry")


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_source_package_is_installed_under_pdgate() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]  # type: ignore[index]
    on_disk = {
        "pdgate." + str(init.parent.relative_to(ROOT)).replace("/", ".")
        for top in TOP
        for init in (ROOT / top).rglob("__init__.py")
    }
    declared = set(setuptools["packages"])
    assert declared == on_disk, "pyproject.toml [tool.setuptools] packages is out of date"
    assert setuptools["package-dir"] == {f"pdgate.{t}": t for t in TOP}


def test_only_pdgate_is_importable_outside_the_checkout(tmp_path: Path) -> None:
    probe = (
        "import importlib.util as u, sys\n"
        "import pdgate.gateway.app, pdgate.engine_shim.app, pdgate.config\n"
        f"bare = [n for n in {TOP!r} if u.find_spec(n) is not None]\n"
        "print(','.join(bare))\n"
    )
    # -P: no script directory on sys.path, so only what is installed is found.
    out = subprocess.run(
        [sys.executable, "-P", "-c", probe], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"bare top-level names importable: {out.stdout}"
