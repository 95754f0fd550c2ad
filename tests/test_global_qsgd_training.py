"""Global-QSGD (exponential, 8-bit) trains the digits MLP at 4 ranks as well as dense."""
from __future__ import annotations

from pathlib import Path

import pytest

from horovod_compress.testing import run_cases

CASES = Path(__file__).parent / "cases" / "global_qsgd_cases.py"


@pytest.mark.mpi
@pytest.mark.slow
def test_digits_exp8_within_two_points_of_dense():
    p = 4
    res = run_cases(p, CASES, ["case_train_digits"], timeout=900)["case_train_digits"][0]
    dense, gq = res["none"], res["exp8"]
    assert dense["test_accuracy"] > 0.9, dense
    assert gq["test_accuracy"] >= dense["test_accuracy"] - 0.02, (gq, dense)
    # 1 byte per element instead of 4 (plus one float64 norm per fused bucket)
    n = gq["num_params"]
    payload = 2.0 * n * (p - 1) / p
    assert dense["bytes_sent_per_step"] == 2.0 * 4 * n * (p - 1) / p
    assert payload < gq["bytes_sent_per_step"] <= payload + 2.0 * 8 * (p - 1) / p * 16
