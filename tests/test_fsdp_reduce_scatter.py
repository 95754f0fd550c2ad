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
* a size that is not a multiple of P is refused;
* Ok-Topk's reduce-scatter variant (split-and-reduce over the P equal blocks,
  no allgatherv) over six steps -- exact and reused local thresholds, its
  residual carried from step to step -- equals, bit for bit, a NumPy
  reference of the same protocol written here from the paper (Algorithm 1,
  lines 2-4 and 8; every rank's gradients recomputed from their seeds), and
  sends exactly 8 bytes (int32 index, float32 value) per selected entry
  outside its own block.

This file is also the case module of ``run_cases``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

CASES = Path(__file__)
ALL = ["case_communicator_reduce_scatter", "case_method_reduce_scatter",
       "case_oktopk_reduce_scatter", "case_warmup_reduce_scatter"]
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


# Ok-Topk's reduce-scatter check: thresholds exact at steps 1 and 4 (tau_prime = 3), reused
# (and nudged) at the others; no warm-up, so every step is sparse
OKTOPK = {"density": 0.05, "tau_prime": 3, "warmup_steps": 0}
OKTOPK_STEPS = 6


def oktopk_rs_reference(grads, p, k, tau_prime, guard=2.0, low=0.75, high=1.25, scale=1.012):
    """Ok-Topk's reduce-scatter variant in NumPy: ``grads[s][i]`` is rank i's gradient at step s.

    Per rank (Ok-Topk, PPoPP 2022, Algorithm 2, line 4; Algorithm 1, lines 2-4):
    ``acc = g + e``; the local threshold is the exact k-th largest |acc| at every
    ``tau_prime``-th step, else the previous one (re-evaluated when it selects more than
    ``guard * k``), nudged by ``scale`` when the count leaves [low k, high k]; the selection is
    ``|acc| >= th`` (in float32), nonzero. Line 8 over the P equal blocks: block j sums rank j's
    entries first, then ranks j-1, j-2, ... (the rotation), in float64, rounded to float32 and
    divided by P. The residual forgets every selected entry. Returns, per step, each rank's
    block of the average and the bytes each rank sends (8 per entry outside its block).
    """
    n = grads[0][0].size
    blk = n // p
    e = [np.zeros(n, np.float32) for _ in range(p)]
    th = [None] * p
    out = []
    for s, gs in enumerate(grads, start=1):
        sels, sent = [], []
        for i in range(p):
            acc = gs[i] + e[i]
            mag = np.abs(acc)
            exact = (s - 1) % tau_prime == 0 or th[i] is None or th[i] <= 0
            if not exact:
                sel = (mag >= np.float32(th[i])) & (acc != 0)
                if sel.sum() > guard * k:
                    exact = True
            if exact:
                th[i] = float(np.sort(mag)[-k])
                sel = (mag >= np.float32(th[i])) & (acc != 0)
            else:
                count = int(sel.sum())
                th[i] = th[i] / scale if count < low * k else (
                    th[i] * scale if count > high * k else th[i])
            mine = np.zeros(n, np.bool_)
            mine[i * blk:(i + 1) * blk] = True
            sent.append(8 * int((sel & ~mine).sum()))
            sels.append(np.where(sel, acc, np.float32(0)))
            e[i] = np.where(sel, np.float32(0), acc)
        blocks = []
        for j in range(p):
            lo, hi = j * blk, (j + 1) * blk
            total = np.zeros(blk, np.float64)
            for src in [j] + [(j - d) % p for d in range(1, p)]:
                total += sels[src][lo:hi]
            blocks.append(total.astype(np.float32) / np.float32(p))
        out.append((blocks, sent))
    return out


def case_oktopk_reduce_scatter(comm):
    import horovod_compress as hvdc
    p, r = comm.size, comm.rank
    method = hvdc.Compression.oktopk(**OKTOPK)
    k = method.k_for(N)
    ref = oktopk_rs_reference([[_grad(i, s) for i in range(p)] for s in range(OKTOPK_STEPS)],
                              p, k, OKTOPK["tau_prime"])
    steps = []
    for s in range(OKTOPK_STEPS):
        s0 = comm.bytes_sent
        mine = method.reduce_scatter(_grad(r, s), "t", comm)
        want, sent = ref[s][0][r], ref[s][1][r]
        steps.append({"equal": bool(np.array_equal(mine, want)), "diff": _diff(mine, want),
                      "sent": comm.bytes_sent - s0, "expected": sent,
                      "nonzero": int(np.count_nonzero(want))})
    return {"k": k, "steps": steps}


# dense warm-up steps under reduce_scatter: a dense reduce-scatter, unless the feedback keeps
# the whole average (EF21's tracker G): then the allreduce
WARMUP = {
    "topk": ("topk", {"density": 0.05, "warmup_steps": 2}),
    "oktopk": ("oktopk", {"density": 0.05, "warmup_steps": 2}),
    "topk_ef21": ("topk", {"density": 0.05, "warmup_steps": 2, "feedback": "ef21"}),
}


def case_warmup_reduce_scatter(comm):
    import horovod_compress as hvdc
    p, r = comm.size, comm.rank
    blk = N // p
    out = {}
    for label, (name, params) in WARMUP.items():
        method = getattr(hvdc.Compression, name)(**params)
        steps = []
        for step in range(2):
            x = _grad(r, step)
            s0 = comm.bytes_sent
            mine = method.reduce_scatter(x, "t", comm)
            sent = comm.bytes_sent - s0
            want = comm.allreduce(x, op="avg")[r * blk:(r + 1) * blk]
            steps.append({"sent": sent, "equal": bool(np.array_equal(mine, want)),
                          "diff": _diff(mine, want)})
        out[label] = steps
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


def test_oktopk_reduce_scatter_matches_its_numpy_reference(world):
    """Ok-Topk's reduce-scatter variant = the NumPy reference of the same protocol, bit for bit,
    six steps (exact and reused thresholds, residuals carried); bytes = 8 per selected entry
    outside the own block (no counts, no allgatherv)."""
    p, res = world
    per_rank = res["case_oktopk_reduce_scatter"]
    k = per_rank[0]["k"]
    for rank, r in per_rank.items():
        for s, step in enumerate(r["steps"]):
            assert step["equal"], (p, rank, s, step)
            assert step["sent"] == step["expected"], (p, rank, s, step)
            assert 0 < step["sent"] <= 8 * 2 * k, (p, rank, s, step)   # the local guard
    for s in range(len(per_rank[0]["steps"])):
        # the blocks together hold the union of the ranks' selections (each about k entries,
        # at most 2k): no global re-selection cuts it back to k
        union = sum(per_rank[rank]["steps"][s]["nonzero"] for rank in per_rank)
        assert k <= union <= 2 * k * p, (p, s, union)


def test_warmup_steps_reduce_scatter_densely(world):
    """A method's dense warm-up steps under reduce_scatter are the dense average's block, sent
    as a reduce-scatter (4N(P-1)/P, half the allreduce), unless the feedback keeps the whole
    average (EF21: the allreduce, 8N(P-1)/P); the 1-byte step agreement aside."""
    p, res = world
    rs, ar = 4 * N * (p - 1) / p, 8 * N * (p - 1) / p
    for rank, per in res["case_warmup_reduce_scatter"].items():
        for label, steps in per.items():
            for s, step in enumerate(steps):
                if p == 2:
                    assert step["equal"], (p, rank, label, s, step)
                assert step["diff"] < 1e-6, (p, rank, label, s, step)
                want = ar if label.endswith("ef21") else rs
                assert want <= step["sent"] <= want + 8 * p, (p, rank, label, s, step)
