"""The Kubernetes controller's journal keeps its scratch folder (hang stack dumps) in a fresh
temporary folder when it is given none; in these tests that folder is each test's own, so a run
leaves nothing behind in the machine's temporary folder (controllers run in a subprocess
inherit it through TMPDIR)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _temporary_folder_per_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again at the next use
