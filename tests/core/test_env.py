"""Every VIGIL_* variable the product names is declared once, in vigil/env.py, with its reason."""

from __future__ import annotations

import re
from pathlib import Path

from vigil import env

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["vigil", "agent", "collector", "analyzer", "recovery", "trainer", "kernels"]
NAME = re.compile(r"VIGIL_[A-Z][A-Z0-9_]*")
# A quoted variable name, i.e. one spelled out in code instead of through `EnvVar`.
LITERAL = re.compile(r"""["']VIGIL_[A-Z][A-Z0-9_]*["']""")


def _sources() -> list[Path]:
    return [p for part in PRODUCT for p in sorted((ROOT / part).rglob("*.py"))]


def test_every_variable_the_product_names_is_declared() -> None:
    declared = {v.value for v in env.EnvVar}
    named = {
        (p.relative_to(ROOT).as_posix(), n) for p in _sources() for n in NAME.findall(p.read_text())
    }
    assert sorted((path, n) for path, n in named if n not in declared) == []


def test_code_reads_variables_through_envvar_not_literals() -> None:
    env_py = ROOT / "vigil" / "env.py"
    literals = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in _sources()
        if p != env_py
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if LITERAL.search(line)
    ]
    assert literals == []


def test_each_declared_variable_says_why_it_exists() -> None:
    lines = (ROOT / "vigil" / "env.py").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s+[A-Z_]+ = \"VIGIL_", line):
            assert lines[i - 1].strip().startswith("#"), f"{line.strip()} has no comment above it"
