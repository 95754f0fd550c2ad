"""One mpirun launch per world size for the low-rank tests that import torch.

Importing torch (and scikit-learn) on 4 oversubscribed ranks costs tens of
seconds, so the torch comparison (tests/test_powersgd.py) and the digits
training (tests/test_greedylore_digits.py) share a launch per world size; the
results are cached for the pytest session.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from horovod_compress.testing import run_cases

CASES = Path(__file__).parent / "lowrank_cases.py"
TORCH_CASES = ["case_powersgd_matches_torch", "case_checkpoint_torch_rng"]


@functools.lru_cache(maxsize=None)
def torch_launch(nprocs: int) -> dict[str, dict[int, Any]]:
    """The torch cases on ``nprocs`` ranks, plus the digits training on 4 ranks."""
    cases = TORCH_CASES + (["case_digits_convergence"] if nprocs == 4 else [])
    return run_cases(nprocs, CASES, cases, timeout=900)
