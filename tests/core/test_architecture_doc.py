"""docs/architecture.md names every module of every package in that package's module tables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each code folder and the heading of its section in docs/architecture.md.
SECTIONS = {
    "vigil": "The core",
    "agent": "The SDK and the node agent",
    "collector": "The collector",
    "analyzer": "The analyzer",
    "recovery": "Recovery",
    "trainer": "The trainer",
    "kernels": "Diagnostic kernels",
    "integrations": "Integrations",
}


def _table_rows(heading: str) -> str:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    (section,) = [s for s in re.split(r"^## ", doc, flags=re.M) if s.startswith(heading)]
    return "\n".join(line for line in section.splitlines() if line.startswith("| `"))


@pytest.mark.parametrize("folder", sorted(SECTIONS))
def test_every_module_has_a_row(folder: str) -> None:
    rows = _table_rows(SECTIONS[folder])
    modules = sorted(p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"`{m}`" not in rows] == []


@pytest.mark.parametrize("folder", sorted(SECTIONS))
def test_every_row_names_a_module_that_exists(folder: str) -> None:
    named = re.findall(r"`([a-z_0-9]+\.py)`", _table_rows(SECTIONS[folder]))
    assert [m for m in named if not (ROOT / folder / m).is_file()] == []
