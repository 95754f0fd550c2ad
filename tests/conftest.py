"""Shared pytest setup: where the per-rank MPI case files live."""
from pathlib import Path

import pytest

CASES = Path(__file__).parent / "cases"


@pytest.fixture
def cases_dir() -> Path:
    return CASES
