"""Shared fixtures for the analyzer tests: recorded data folders and real Kineto traces."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def kineto_dir() -> Path:
    """Real Kineto traces (HolisticTraceAnalysis' test data, MIT), kept in the repository."""
    return DATA / "kineto"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA
