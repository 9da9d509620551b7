"""`vigil.recovery` re-exports its public API without importing its modules up front."""

from __future__ import annotations

import subprocess
import sys

import pytest

import vigil.recovery


@pytest.mark.parametrize("name", vigil.recovery.__all__)
def test_every_exported_name_resolves_to_its_module(name: str) -> None:
    value = getattr(vigil.recovery, name)
    assert value.__module__.startswith("vigil.recovery."), (name, value.__module__)


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = vigil.recovery.Nope  # type: ignore[attr-defined]


def test_importing_policy_loads_no_executor_agent_or_torch() -> None:
    code = (
        "import sys\n"
        "from vigil.recovery import policy\n"
        "loaded = {'torch', 'psutil', 'vigil.agent', 'vigil.recovery.local'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
