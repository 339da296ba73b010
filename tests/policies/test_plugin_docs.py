"""The configuration examples of docs/plugins/ load as written, and every built-in plugin
has its row there: a page that drifts from the code fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from pdgate.policies import FILTERS, HOLDERS, PICKERS, SCORERS, load_policy

PAGES = Path(__file__).resolve().parents[2] / "docs" / "plugins"
KINDS = {"filters": FILTERS, "scorers": SCORERS, "pickers": PICKERS, "holders": HOLDERS}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_page_of_each_plugin_kind_loads_its_example_and_names_every_builtin(kind: str) -> None:
    text = (PAGES / f"{kind}.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, re.S)
    assert blocks, f"{kind}.md has no configuration example"
    for block in blocks:
        gateway = tomllib.loads(block)["gateway"]
        for leg in ("prefill", "decode"):
            if f"{leg}_policy" in gateway:
                load_policy(gateway[f"{leg}_policy"], gateway.get(f"{leg}_policy_options"))
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.M))
    assert rows == set(KINDS[kind]), (kind, rows)
