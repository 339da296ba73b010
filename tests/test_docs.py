"""The docs stay a reference: every repository path they name exists, every relative link
resolves, and README.md and the concept pages stay within their size budgets.

Paths in prose are checked in README.md and docs/ outside docs/results/ (result narratives
keep the module names of the commit they measured); relative links are checked everywhere.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"

README_MAX_BYTES = 12 * 1024
# The hand-written pages. docs/configuration.md's settings table is generated from
# config/settings.py (`make docs`; tests/config keeps it current), so it grows with the
# settings, not with prose: it is left out of the budget, which is the tighter for it.
CONCEPT_DOCS_MAX_BYTES = 140 * 1024
GENERATED = DOCS / "configuration.md"

TOP_FOLDERS = (
    "gateway",
    "policies",
    "registry",
    "engine_shim",
    "config",
    "tests",
    "loadtest",
    "docs",
    "deploy",
    ".ci",
)
TOP_FILES = ("README.md", "Makefile", "pyproject.toml")

# A repository path: one of the top-level folders followed by path characters, or one of
# the top-level files, starting a token (not inside a URL, a longer path or a dotted name).
_FOLDERS = "|".join(re.escape(f) for f in TOP_FOLDERS)
_FILES = "|".join(re.escape(f) for f in TOP_FILES)
PATH = re.compile(
    rf"(?<![\w./$-])(?:(?:{_FOLDERS})/[\w./*-]*|(?:{_FILES})(?![\w-]))",
)
# [text](target) and ![alt](target); the target up to whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def named_paths(text: str) -> set[str]:
    """The repository paths a page names in its prose, code and tables."""
    found = set()
    for match in PATH.finditer(text):
        path = match.group(0).split("::")[0].rstrip(".,;:")
        found.add(path)
    return found


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    missing = []
    for path in sorted(named_paths(text)):
        if "*" in path:
            if not list(root.glob(path)):
                missing.append(path)
        elif not (root / path).exists():
            missing.append(path)
    return missing


def broken_links(page: Path, text: str) -> list[str]:
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if target.startswith("#") or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # an anchor on the same page, or a URL (https:, mailto:)
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _concept_pages() -> list[Path]:
    return [p for p in sorted(DOCS.rglob("*.md")) if RESULTS not in p.parents]


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [ROOT / "README.md", *_concept_pages()], ids=lambda p: _rel(p))
def test_every_path_named_exists(page: Path) -> None:
    missing = missing_paths(page.read_text())
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: _rel(p))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = broken_links(page, page.read_text())
    assert not broken, f"{_rel(page)} links to files that do not exist: {broken}"


def test_readme_is_within_its_budget() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, budget {README_MAX_BYTES}"


def test_concept_pages_are_within_their_budget() -> None:
    sizes = {_rel(p): p.stat().st_size for p in _concept_pages() if p != GENERATED}
    total = sum(sizes.values())
    assert total <= CONCEPT_DOCS_MAX_BYTES, (
        f"hand-written docs/ markdown outside docs/results/ is {total} bytes, budget "
        f"{CONCEPT_DOCS_MAX_BYTES}: {sorted(sizes.items(), key=lambda kv: -kv[1])}"
    )


def test_the_readme_layout_lists_every_folder_and_gateway_subpackage() -> None:
    """README's Layout table names every top-level folder the repository tracks and every
    subpackage of gateway/."""
    try:
        tracked = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    folders = {f.split("/")[0] + "/" for f in tracked if "/" in f}
    subpackages = {f"gateway/{p.parent.name}/" for p in (ROOT / "gateway").glob("*/__init__.py")}
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    listed = set(re.findall(r"^\| `([^`]+/)` \|", layout, re.M))
    assert folders | subpackages <= listed, sorted((folders | subpackages) - listed)


def test_the_checks_catch_a_missing_path_and_a_broken_link(tmp_path: Path) -> None:
    text = (
        "See `gateway/placement/dispatch.py` and gateway/no_such_module.py, "
        "`loadtest/scheduling/`, docs/results/fleet/, `deploy/overlays/gpu/patches/*.yaml`, "
        "`tests/gateway/stream/test_migration.py::test_x`, pdgate.gateway.api (a module name), "
        "https://example.com/docs/nothing.md and [ok](README.md) [gone](nowhere.md#x)."
    )
    assert named_paths(text) >= {
        "gateway/placement/dispatch.py",
        "gateway/no_such_module.py",
        "loadtest/scheduling/",
        "docs/results/fleet/",
        "tests/gateway/stream/test_migration.py",
    }
    assert "docs/nothing.md" not in named_paths(text)
    assert missing_paths(text) == ["gateway/no_such_module.py"]
    assert broken_links(ROOT / "README.md", text) == ["nowhere.md#x"]
