"""``Method.reduce_scatter`` and the communicators' reduce-scatters on real MPI ranks.

What FSDP2's compressed reduce-scatter (``horovod_compress.torch.fsdp``) stands
on, checked on the mpi4py communicator (the torch.distributed one is checked
under ``torchrun`` by tests/test_fsdp.py), at P = 2 and 4:

* ``Communicator.reduce_scatter`` (sum, avg) is block r of the allreduce, and
  ``reduce_scatter_custom`` (16-bit sums) block r of ``allreduce_custom``:
  bit for bit at P = 2, within the rounding of another summation order at
  P = 4; N(P-1)/P bytes each way;
* ``Method.reduce_scatter`` over four steps (state, feedback and shared
  randomness included) equals block r of the method's own ``allreduce`` on
  the same inputs, for the methods that reduce-scatter for real (none, fp16,
  bf16, Rand-K, 8-bit Global-QSGD, TopkDSA) and for one that falls back (Top-k); the
  real ones send what the reduce-scatter formula says, less than their
  allreduce;
* a size that is not a multiple of P is refused.

This file is also the case module of ``run_cases``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

CASES = Path(__file__)
ALL = ["case_communicator_reduce_scatter", "case_method_reduce_scatter"]
N = 4 * 3 * 1000          # a multiple of 2, 3 and 4 ranks
STEPS = 4
METHODS = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "randk": ("randk", {"density": 0.1}),
    "randk_unbiased": ("randk", {"density": 0.1, "unbiased": True}),
    "global_qsgd": ("global_qsgd", {}),
    "global_qsgd_lin8": ("global_qsgd", {"dithering": "linear", "bits": 8}),
    "topk_dsa": ("topk_dsa", {"density": 0.05}),
    "topk": ("topk", {"density": 0.05}),
}
# Bytes each rank sends for one vector of n float32 under a real reduce-scatter
FORMULAS = {
    "none": lambda n, p: 4 * n * (p - 1) / p,
    "fp16": lambda n, p: 2 * n * (p - 1) / p,
    "bf16": lambda n, p: 2 * n * (p - 1) / p,
    "global_qsgd": lambda n, p: (2 * 8 + n) * (p - 1) / p,
    "global_qsgd_lin8": lambda n, p: (2 * 8 + n) * (p - 1) / p,
}


def _grad(rank, step, n=N):
    rng = np.random.default_rng([rank, step])
    return (rng.standard_normal(n) * np.linspace(0.1, 2.0, n)).astype(np.float32)


def _diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)


def case_communicator_reduce_scatter(comm):
    from horovod_compress.kernels.halfprec import decode16, encode16
    p, r = comm.size, comm.rank
    x = _grad(r, 0)
    blk = N // p
    out = {}
    for op in ("sum", "avg"):
        comm.reset_stats()
        mine = comm.reduce_scatter(x, op=op)
        sent = comm.bytes_sent
        full = comm.allreduce(x, op=op)[r * blk:(r + 1) * blk]
        out[op] = {"diff": _diff(mine, full), "equal": bool(np.array_equal(mine, full)),
                   "sent": sent, "expected": 4 * N * (p - 1) / p}
    words = encode16(x, "fp16", scale=1.0 / p)
    comm.reset_stats()
    mine = comm.reduce_scatter_custom(words, "fp16_sum")
    sent = comm.bytes_sent
    full = comm.allreduce_custom(words, "fp16_sum")[r * blk:(r + 1) * blk]
    out["fp16_sum"] = {"equal": bool(np.array_equal(mine, full)), "sent": sent,
                       "expected": 2 * N * (p - 1) / p,
                       "diff": _diff(decode16(mine, "fp16"), decode16(full, "fp16"))}
    try:
        comm.reduce_scatter(x[:N - 1], op="sum")
        out["refused"] = False
    except ValueError as exc:
        out["refused"] = "multiple" in str(exc)
    return out


def case_method_reduce_scatter(comm):
    import horovod_compress as hvdc
    p, r = comm.size, comm.rank
    blk = N // p
    out = {}
    for label, (name, params) in METHODS.items():
        scattered = getattr(hvdc.Compression, name)(**params)
        whole = getattr(hvdc.Compression, name)(**params)
        diffs, equal, sent, whole_sent = [], True, 0.0, 0.0
        for step in range(STEPS):
            x = _grad(r, step)
            s0 = comm.bytes_sent
            mine = scattered.reduce_scatter(x, "t", comm)
            s1 = comm.bytes_sent
            full = whole.allreduce(x, "t", comm).reshape(-1)[r * blk:(r + 1) * blk]
            whole_sent += comm.bytes_sent - s1
            sent += s1 - s0
            diffs.append(_diff(mine, full))
            equal = equal and bool(np.array_equal(mine, full))
        try:
            scattered.reduce_scatter(_grad(r, 9, N - 1), "odd", comm)
            refused = False
        except ValueError as exc:
            refused = "multiple" in str(exc)
        formula = FORMULAS[label](N, p) if label in FORMULAS else None
        out[label] = {"equal": equal, "diff": max(diffs), "sent": sent / STEPS,
                      "whole_sent": whole_sent / STEPS, "formula": formula, "refused": refused,
                      "scatters": bool(scattered.scatters)}
    return out


pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def world(request):
    from horovod_compress.tools.testing import run_cases
    return request.param, run_cases(request.param, CASES, ALL, timeout=300)


def test_communicator_reduce_scatter_is_the_allreduce_block(world):
    """Block r of the allreduce (and of the 16-bit custom allreduce), N(P-1)/P bytes."""
    p, res = world
    for rank, r in res["case_communicator_reduce_scatter"].items():
        for op in ("sum", "avg", "fp16_sum"):
            assert r[op]["sent"] == pytest.approx(r[op]["expected"]), (p, rank, op, r[op])
            if p == 2:          # one addition per element: the same in any order
                assert r[op]["equal"], (p, rank, op, r[op])
        if p > 2:   # MPI's reduce-scatter and allreduce may fold the ranks in other orders
            assert r["sum"]["diff"] < 1e-6 and r["avg"]["diff"] < 1e-6, (p, rank, r)
            # one 16-bit rounding per addition (of the largest value)
            assert r["fp16_sum"]["diff"] <= (p - 1) * 2.0 ** -10, (p, rank, r)
        assert r["refused"], (p, rank)


def test_method_reduce_scatter_is_the_block_of_its_allreduce(world):
    """Four steps of each method: its shard = block r of its allreduce on the same inputs;
    the real reduce-scatters send their formula, less than the allreduce."""
    p, res = world
    for rank, per in res["case_method_reduce_scatter"].items():
        for label, r in per.items():
            assert r["refused"], (p, rank, label)
            if p == 2:
                assert r["equal"], (p, rank, label, r)
            elif label in ("global_qsgd",):
                # the stochastic exponential reduce draws its random words per partial sum:
                # MPI's reduce-scatter and allreduce meet other partial sums beyond 2 ranks
                assert r["diff"] < 0.5, (p, rank, label, r)
            elif label.startswith(("fp16", "bf16")):
                assert r["diff"] <= (p - 1) * 2.0 ** -7, (p, rank, label, r)
            else:
                assert r["diff"] < 1e-5, (p, rank, label, r)
            if r["formula"] is not None:
                # a ring allreduce counts this rank's whole chunks: within two elements a call
                assert r["sent"] == pytest.approx(r["formula"], abs=4 * 16), (p, rank, label, r)
            if r["scatters"]:
                assert r["sent"] < r["whole_sent"], (p, rank, label, r)
            else:
                assert r["sent"] == pytest.approx(r["whole_sent"]), (p, rank, label, r)
