"""Top-k + DeepReduce on real data: the digits MLP at 4 ranks (issue 7).

Paper: "DeepReduce: A Sparse-tensor Communication Framework for Distributed
Deep Learning" (NeurIPS 2021), Bloom filter policy P2 and polynomial-fit values
(Sections 4-5), on top of Top-k.

One mpirun launch of ``case_digits_convergence`` trains two models for 30
epochs with identical settings: Top-k 1 % alone and Top-k 1 % +
DeepReduce(Bloom P2 at fpr 0.001, polyfit).
"""
from __future__ import annotations

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.tools.testing import run_cases


def case_digits_convergence(comm):
    """Digits MLP at P ranks, 30 epochs: Top-k + DeepReduce(Bloom P2, polyfit) vs Top-k alone."""
    from horovod_compress.tools.bench.digits import train_digits
    epochs = 30
    base = train_digits(hvdc.Compression.topk(density=0.01), comm, epochs=epochs, seed=0)
    dr = train_digits(hvdc.Compression.deepreduce(density=0.01, index="bloom", policy="p2",
                                                  value="polyfit", fpr=0.001),
                      comm, epochs=epochs, seed=0)
    assert base["params_digest"] == comm.allgather_object(base["params_digest"])[0]
    assert dr["params_digest"] == comm.allgather_object(dr["params_digest"])[0]
    return {"topk": base["test_accuracy"], "deepreduce": dr["test_accuracy"],
            "topk_last3": float(np.mean([h["test_accuracy"] for h in base["history"][-3:]])),
            "deepreduce_last3": float(np.mean([h["test_accuracy"] for h in dr["history"][-3:]])),
            "topk_bytes": base["bytes_sent_per_step"], "deepreduce_bytes": dr["bytes_sent_per_step"]}


@pytest.mark.mpi
@pytest.mark.slow
def test_digits_mlp_topk_plus_deepreduce_matches_topk() -> None:
    """4 ranks, 30 epochs: Top-k + DeepReduce(Bloom P2, polyfit) within 2 points of Top-k.

    Measured (seeds 0/1 of data and DeepReduce): Top-k 0.955-0.969, DeepReduce
    0.972-0.975 final test accuracy; DeepReduce sends ~0.53 of Top-k's bytes.
    """
    res = run_cases(4, __file__, [case_digits_convergence], timeout=900)[case_digits_convergence]
    acc = res[0]
    print("digits, 4 ranks:", acc)
    for r in range(4):                                    # every rank holds the same model
        assert (res[r]["topk"], res[r]["deepreduce"]) == (acc["topk"], acc["deepreduce"])
    assert acc["topk"] > 0.9
    assert acc["deepreduce"] >= acc["topk"] - 0.02, acc
    assert acc["deepreduce_last3"] >= acc["topk_last3"] - 0.02, acc
    assert acc["deepreduce_bytes"] < 0.65 * acc["topk_bytes"], acc
