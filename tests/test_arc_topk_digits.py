"""ARC-Top-K + EF21M on real data: the digits MLP at 4 ranks, ratio 0.2 (issue 5).

Paper: "An All-Reduce Compatible Top-K Compressor for Communication-Efficient
Distributed Learning" (ARC-Top-K), Algorithm 1 with EF21M, equations (11a)-(11c).

One mpirun launch of ``case_digits`` trains five models (about 30 s on 2 idle
cores): dense, and ARC-Top-K + EF21M and Rand-K rows + EF21M at two learning
rates with identical settings.
"""
from __future__ import annotations

import pytest

import horovod_compress as hvdc
from horovod_compress.tools.testing import run_cases


def case_digits(comm):
    """Digits MLP at P ranks, ratio 0.2: dense vs ARC-Top-K + EF21M vs Rand-K rows + EF21M.

    Dense uses train_digits' defaults (SGD, lr 0.05, heavy-ball momentum 0.9).
    The EF21M runs put the momentum in the feedback (eta = 0.1 = 1 - 0.9, eq. 11a)
    and step plain SGD on G (eq. 11c) with lr 0.05 / (1 - 0.9) = 0.5, the same
    effective step. ARC-Top-K and Rand-K rows are compared at identical settings,
    at that lr and at 0.2 (where Rand-K rows, less stable, trains better).
    """
    from horovod_compress.tools.bench.digits import train_digits

    keys = ("test_accuracy", "bytes_sent_per_step", "dense_bytes_per_step")
    out = {"dense": train_digits(hvdc.Compression.none(), comm, epochs=30)}
    for lr in (0.5, 0.2):
        common = dict(epochs=30, lr=lr, momentum=0.0)
        out[f"arc/{lr}"] = train_digits(
            hvdc.Compression.arc_topk(ratio=0.2, rank=4, eta=0.1), comm, **common)
        out[f"randk_rows/{lr}"] = train_digits(
            hvdc.Compression.randk_rows(ratio=0.2, eta=0.1), comm, **common)
    digests = comm.allgather_object(out["arc/0.5"]["params_digest"])
    assert len(set(digests)) == 1, digests            # identical parameters on every rank
    return {label: {k: r[k] for k in keys} for label, r in out.items()}


def test_arc_topk_ef21m_matches_dense_and_beats_randk_on_digits():
    res = run_cases(4, __file__, [case_digits], timeout=600)[case_digits]
    out = res[0]
    for v in res.values():          # every rank trained the same model on the same bytes
        for label, r in v.items():
            assert r["test_accuracy"] == out[label]["test_accuracy"], (label, r, out[label])
            assert r["dense_bytes_per_step"] == out[label]["dense_bytes_per_step"]
            # each rank counts its own whole chunks of the ring: equal within its rounding
            assert r["bytes_sent_per_step"] == pytest.approx(out[label]["bytes_sent_per_step"],
                                                             rel=1e-3), (label, r, out[label])
    dense, arc = out["dense"], out["arc/0.5"]
    assert arc["test_accuracy"] >= dense["test_accuracy"] - 0.01, out    # within 1 point
    for lr in (0.5, 0.2):                                                 # same settings
        assert out[f"arc/{lr}"]["test_accuracy"] >= out[f"randk_rows/{lr}"]["test_accuracy"], out
    # ~ (2Kn + 2mr)(P-1)/P for the weights, dense biases: well under a third of dense
    assert arc["bytes_sent_per_step"] < dense["dense_bytes_per_step"] / 3
