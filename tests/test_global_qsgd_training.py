"""Global-QSGD (exponential, 8-bit) trains the digits MLP at 4 ranks as well as dense.

Paper: "Quantize Once, Train Fast: Allreduce-Compatible Compression with
Provable Guarantees" (Global-QSGD), Algorithm 1 with exponential dithering,
here through the PyTorch DistributedOptimizer (one ``case_train_digits`` launch).
"""
from __future__ import annotations

import pytest

import horovod_compress as hvdc
from horovod_compress.tools.testing import run_cases

TRAIN_EPOCHS = 40


def case_train_digits(comm):
    """The digits MLP through the PyTorch DistributedOptimizer: dense vs Global-QSGD exp 8-bit."""
    from horovod_compress.tools.bench.digits import train_digits
    out = {}
    for label, method in {"none": hvdc.Compression.none(),
                          "exp8": hvdc.Compression.global_qsgd()}.items():
        r = train_digits(method, comm, epochs=TRAIN_EPOCHS, seed=0)
        digests = comm.allgather_object(r["params_digest"])
        assert len(set(digests)) == 1, f"{label}: ranks ended with different parameters"
        out[label] = {k: r[k] for k in ("test_accuracy", "bytes_sent_per_step",
                                       "dense_bytes_per_step", "num_params", "steps")}
    return out


@pytest.mark.mpi
@pytest.mark.slow
def test_digits_exp8_within_two_points_of_dense():
    p = 4
    res = run_cases(p, __file__, [case_train_digits], timeout=900)[case_train_digits][0]
    dense, gq = res["none"], res["exp8"]
    assert dense["test_accuracy"] > 0.9, dense
    assert gq["test_accuracy"] >= dense["test_accuracy"] - 0.02, (gq, dense)
    # 1 byte per element instead of 4 (plus one float64 norm per fused bucket)
    n = gq["num_params"]
    payload = 2.0 * n * (p - 1) / p
    assert dense["bytes_sent_per_step"] == pytest.approx(2.0 * 4 * n * (p - 1) / p, abs=2 * 4)
    assert payload < gq["bytes_sent_per_step"] <= payload + 2.0 * 8 * (p - 1) / p * 16
