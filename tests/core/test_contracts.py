"""The import contracts in pyproject.toml cover every core module and hold."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts: list[dict[str, object]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def test_core_contract_lists_every_core_module() -> None:
    core = next(c for c in _contracts() if c["name"] == "core imports none of the subsystems")
    modules = {f"vigil.{p.stem}" for p in (ROOT / "vigil").glob("*.py") if p.stem != "__init__"}
    assert modules == set(core["source_modules"])  # type: ignore[arg-type]


@pytest.mark.integration
def test_import_contracts_hold() -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "lint_imports.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "broken" in done.stdout and "0 broken" in done.stdout
