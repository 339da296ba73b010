"""deploy/Dockerfile without Docker: what it copies is what the wheel needs (a wheel is built
from exactly that, as its build stage does), and the image's user, entrypoint and ports are
the ones the manifests rely on."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

from tests.deploy._checks import DEPLOY, DEPLOYABLE, ROOT, processes, rendered
from tests.deploy._k8s import pod_templates

DOCKERFILE = DEPLOY / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def _copied() -> list[str]:
    """The sources the build stage copies from the build context."""
    sources = []
    for word, rest in _instructions():
        if word == "COPY" and "--from" not in rest:
            sources += [s.rstrip("/") for s in rest.split()[:-1]]
    return sources


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_image_is_python_3_11_slim_with_pdgate_as_entrypoint() -> None:
    instructions = _instructions()
    bases = [rest.split()[0] for word, rest in instructions if word == "FROM"]
    assert bases == ["python:3.11-slim", "python:3.11-slim"]
    assert ("ENTRYPOINT", '["pdgate"]') in instructions
    assert "pdgate" in _pyproject()["project"]["scripts"]


def test_it_copies_what_the_wheel_is_built_from() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    needed = {"pyproject.toml", _pyproject()["project"]["readme"]}
    needed |= set(setuptools["package-dir"].values())
    assert set(_copied()) == needed
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert kept == needed, "Dockerfile.dockerignore must let exactly the copied paths in"


def test_a_wheel_builds_from_the_copied_files_alone(tmp_path: Path) -> None:
    context = tmp_path / "src"
    context.mkdir()
    for source in _copied():
        path = ROOT / source
        if path.is_dir():
            shutil.copytree(path, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, context / source)
    out = subprocess.run(
        [
            # With build isolation, as the Dockerfile's build stage (setuptools from pyproject).
            *(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"),
            *("--wheel-dir", str(tmp_path / "wheels"), str(context)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "wheels").glob("pdgate-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for module in ("config/cli.py", "gateway/cli.py", "engine_shim/cli.py", "registry/__init__.py"):
        assert f"pdgate/{module}" in names
    assert "pdgate = pdgate.config.cli:main" in entry_points


def test_user_and_ports_match_the_manifests() -> None:
    users = {rest for word, rest in _instructions() if word == "USER"}
    assert users == {"10001:10001"}, "a numeric user lets Kubernetes check runAsNonRoot"
    exposed = {int(p) for word, rest in _instructions() if word == "EXPOSE" for p in rest.split()}
    for name in DEPLOYABLE:
        r = rendered(name)
        for workload, template in pod_templates(r.objects):
            if not any(
                c["image"].startswith("ghcr.io/pdgate/") for c in template["spec"]["containers"]
            ):
                continue
            sc = template["spec"]["securityContext"]
            user = (sc["runAsUser"], sc["runAsGroup"])
            assert user == (10001, 10001), workload["metadata"]["name"]
        assert {proc.settings.port for _, _, proc in processes(r)} == exposed
