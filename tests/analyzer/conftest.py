"""Shared fixtures for the analyzer tests: recorded data folders and the shared Kineto traces."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[2]


def _shared_testdata() -> Path:
    # CI clones the repo beside shared/; a git worktree may sit deeper, so look upwards too.
    for base in (ROOT.parent, *ROOT.parents):
        candidate = base / "shared" / "testdata"
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"shared/testdata not found beside or above {ROOT}")


@pytest.fixture(scope="session")
def kineto_dir() -> Path:
    return _shared_testdata() / "kineto"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA
