"""ARC-Top-K + EF21M on real data: the digits MLP at 4 ranks, ratio 0.2 (issue 5).

One mpirun launch trains five models (about 30 s on 2 idle cores): dense, and
ARC-Top-K + EF21M and Rand-K rows + EF21M at two learning rates with identical
settings (tests/cases/arc_cases.py::case_digits).
"""
from __future__ import annotations

from pathlib import Path

from horovod_compress.testing import run_cases

CASES = Path(__file__).parent / "cases" / "arc_cases.py"


def test_arc_topk_ef21m_matches_dense_and_beats_randk_on_digits():
    res = run_cases(4, CASES, ["case_digits"], timeout=600)["case_digits"]
    out = res[0]
    assert all(v == out for v in res.values())
    dense, arc = out["dense"], out["arc/0.5"]
    assert arc["test_accuracy"] >= dense["test_accuracy"] - 0.01, out    # within 1 point
    for lr in (0.5, 0.2):                                                 # same settings
        assert out[f"arc/{lr}"]["test_accuracy"] >= out[f"randk_rows/{lr}"]["test_accuracy"], out
    # ~ (2Kn + 2mr)(P-1)/P for the weights, dense biases: well under a third of dense
    assert arc["bytes_sent_per_step"] < dense["dense_bytes_per_step"] / 3
