"""The shared-memory window transport (``mpi_collectives.shared_window``) on real MPI ranks.

Single-node runs, P = 2, 3, 4, both transports selected per call with
``HVDC_SHARED_WINDOW`` (``off``: the pipelined ring; ``on``: the window):

* Global-QSGD's 8-bit exponential path gives the ring's bits through the
  window -- the same chain of Algorithm 2 reductions with the same ranks'
  random words -- with ``local`` (EF14) and without, at odd sizes;
* back-to-back calls with fresh data every step, on one tensor and
  interleaved tensors, give every step's chain (a missing or misplaced
  synchronisation would mix two steps' messages);
* the accounting is one allreduce of the payload, as the ring's;
* windows are reused per tensor and reallocated on a new size;
* the policy variable is parsed strictly, and ``auto`` takes the window only
  while every rank has a core of its own.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

CASES = Path(__file__)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8)).hexdigest()


def case_global_qsgd_window_equals_ring(comm: Any) -> dict[str, Any]:
    import horovod_compress as hvdc
    from horovod_compress.mpi_collectives import shared_window

    out: dict[str, Any] = {}
    for n in (9, 65_537, 1_000_003):
        for feedback in ("none", "residual"):
            per: dict[str, Any] = {}
            for transport in ("off", "on"):
                os.environ["HVDC_SHARED_WINDOW"] = transport
                m = hvdc.Compression.global_qsgd(seed=11, feedback=feedback)
                m.ring_min_bytes = 0
                rng = np.random.default_rng(40 + comm.rank)
                digests, errs = [], []
                for step in range(3):
                    x = rng.standard_normal(n).astype(np.float32)
                    comm.reset_stats()
                    avg = m.allreduce(x, "w", comm)
                    digests.append(_digest(avg))
                    errs.append(m.state["w"].get("fb_residual", np.zeros(0)).copy())
                payload = comm.stats()["by_phase"]["global_qsgd.payload"]["sent"]
                win = shared_window._WINDOWS.get((id(comm.comm), "global_qsgd:w"))
                per[transport] = {"digests": digests, "residual": _digest(np.concatenate(errs)),
                                  "payload": payload,
                                  "window": win is not None and win.nbytes == n}
                if win is not None:          # the next n must not find this one by accident
                    shared_window._WINDOWS.pop((id(comm.comm), "global_qsgd:w")).free()
            ranks = comm.allgather_object(per["on"]["digests"])
            per["same_on_ranks"] = all(r == ranks[0] for r in ranks)
            per["expected_payload"] = 2.0 * n * (comm.size - 1) / comm.size
            out[f"{n}/{feedback}"] = per
    return out


def case_back_to_back_steps(comm: Any) -> dict[str, Any]:
    """30 calls, fresh data each, two tensors interleaved with a third of another size:
    each result against the chain computed from every rank's words (allgathered)."""
    from horovod_compress.compressors.registry import create
    from horovod_compress.kernels.halfprec import add16_into, decode16, encode16
    from horovod_compress.mpi_collectives.reduce_ops import block_counts

    os.environ["HVDC_SHARED_WINDOW"] = "on"
    m = create("fp16")
    m.ring_min_bytes = 0
    rng = np.random.default_rng(7 + comm.rank)
    sizes = {"a": 200_001, "b": 200_001, "c": 33}
    bad = []
    for step in range(30):
        for name in ("a", "c", "b") if step % 2 else ("b", "a", "c"):
            n = sizes[name]
            x = rng.standard_normal(n).astype(np.float32) * (step + 1)
            avg = m.allreduce(x, name, comm)
            words = comm.allgather(encode16(x, "fp16", scale=1.0 / comm.size)).reshape(comm.size, n)
            counts = block_counts(n, comm.size)
            starts = np.concatenate([[0], np.cumsum(counts)])
            total = np.empty(n, np.uint16)
            for j in range(comm.size):
                lo, hi = int(starts[j]), int(starts[j + 1])
                acc = words[(j + 1) % comm.size, lo:hi].copy()
                for s in range(2, comm.size + 1):
                    add16_into(words[(j + s) % comm.size, lo:hi].copy(), acc, "fp16")
                total[lo:hi] = acc
            if not np.array_equal(avg.view(np.uint32), decode16(total, "fp16").view(np.uint32)):
                bad.append((step, name))
    return {"bad": bad}


def case_window_reuse(comm: Any) -> dict[str, Any]:
    """One window per tensor, kept across calls; a new size reallocates it."""
    from horovod_compress.compressors.registry import create
    from horovod_compress.mpi_collectives import shared_window

    os.environ["HVDC_SHARED_WINDOW"] = "on"
    m = create("bf16")
    m.ring_min_bytes = 0
    key = (id(comm.comm), "bf16:r")
    m.allreduce(np.ones(1000, np.float32), "r", comm)
    first = shared_window._WINDOWS[key]
    m.allreduce(np.ones(1000, np.float32), "r", comm)
    kept = shared_window._WINDOWS[key] is first
    out = m.allreduce(np.full(3000, 2.0, np.float32), "r", comm)
    grown = shared_window._WINDOWS[key]
    return {"kept": kept, "new": grown is not first, "nbytes": grown.nbytes,
            "value": float(out[0]), "all_equal": bool((out == out[0]).all())}


def case_float_sum(comm: Any) -> dict[str, Any]:
    """``window_allreduce_sum`` against the ring's chain of additions (computed here from
    every rank's array), float32 and float64, odd sizes; a bad dtype is refused."""
    from horovod_compress.mpi_collectives.reduce_ops import block_counts
    from horovod_compress.mpi_collectives.shared_window import window_allreduce_sum

    out: dict[str, Any] = {}
    p = comm.size
    for dtype in (np.float32, np.float64):
        for n in (1, 5, 100_003):
            x = np.random.default_rng(comm.rank + 9).standard_normal(n).astype(dtype) * 1e3
            comm.reset_stats()
            got = window_allreduce_sum(comm, "sum", x)
            sent = comm.stats()["by_op"]["allreduce"]["sent"]
            every = comm.allgather(x).reshape(p, n)
            starts = np.concatenate([[0], np.cumsum(block_counts(n, p))])
            want = np.empty(n, dtype)
            for j in range(p):
                lo, hi = int(starts[j]), int(starts[j + 1])
                acc = every[(j + 1) % p, lo:hi].copy()
                for s in range(2, p + 1):
                    acc = acc + every[(j + s) % p, lo:hi]
                want[lo:hi] = acc
            mpi = comm.allreduce(x)
            out[f"{np.dtype(dtype).name}/{n}"] = {
                "chain": bool(np.array_equal(got, want)),
                "mpi_equal": bool(np.array_equal(got, mpi)),
                "bytes": sent, "expected": 2.0 * x.nbytes * (p - 1) / p}
    # the message written in place into the window (no copy in), the sum read in place
    from horovod_compress.mpi_collectives import shared_window
    msg = shared_window.window_message(comm, "inplace", (3, 1001), np.float32)
    msg[...] = np.arange(3 * 1001, dtype=np.float32).reshape(3, 1001) * (comm.rank + 1)
    total = window_allreduce_sum(comm, "inplace", msg)
    win = shared_window._WINDOWS[(id(comm.comm), "inplace")]
    out["inplace"] = {"chain": bool(np.array_equal(total, np.arange(3 * 1001, dtype=np.float32)
                                                   .reshape(3, 1001) * (p * (p + 1) // 2))),
                      "mpi_equal": True, "bytes": 2.0 * msg.nbytes * (p - 1) / p,
                      "expected": 2.0 * msg.nbytes * (p - 1) / p,
                      "contiguous": win.result is not None
                      and np.shares_memory(total, win.result)}
    try:
        window_allreduce_sum(comm, "bad", np.arange(10))
        out["refused"] = False
    except TypeError:
        out["refused"] = True
    return out


def case_arc_rows_through_the_window(comm: Any) -> dict[str, Any]:
    """ARC-Top-K (EF21M, the default) with its K-row sum through the window and through MPI:
    the same rows on every step, the same result bits at P = 2, within float32 rounding of
    the other order of additions at P > 2."""
    import horovod_compress as hvdc
    from horovod_compress.mpi_collectives import shared_window

    res = {}
    used = {}
    for transport in ("off", "on"):
        os.environ["HVDC_SHARED_WINDOW"] = transport
        m = hvdc.Compression.arc_topk(seed=3)
        m.window_min_bytes = 0
        rng = np.random.default_rng(comm.rank)
        outs, rows = [], []
        for _ in range(3):
            g = rng.standard_normal((60, 50)).astype(np.float32)
            outs.append(m.allreduce(g, "W", comm).copy())
            rows.append(m.state["W"]["rows"].copy())
        res[transport] = (outs, rows)
        used[transport] = (id(comm.comm), "arc_rows:W") in shared_window._WINDOWS
    (a, ra), (b, rb) = res["off"], res["on"]
    return {"window": used == {"off": False, "on": True},"rows_equal": all(np.array_equal(u, v) for u, v in zip(ra, rb)),
            "bits_equal": all(np.array_equal(u, v) for u, v in zip(a, b)),
            "max_rel": max(float(np.abs(u - v).max() / np.abs(u).max()) for u, v in zip(a, b)),
            "same_on_ranks": comm.allgather_object([hashlib.sha256(v.tobytes()).hexdigest()
                                                    for v in b]) == [[hashlib.sha256(v.tobytes()).hexdigest()
                                                                      for v in b]] * comm.size}


def case_no_room_falls_back_to_the_ring(comm: Any) -> dict[str, Any]:
    """A shared-memory file system without room for a window (rank 0's free space, faked):
    every rank takes the ring or MPI alike, with a warning once per tensor, same results."""
    import warnings

    import horovod_compress as hvdc
    from horovod_compress.mpi_collectives import shared_window
    from horovod_compress.mpi_collectives.shared_window import window_allreduce_sum

    x = np.random.default_rng(comm.rank).standard_normal(70_001).astype(np.float32)
    want = {}
    os.environ["HVDC_SHARED_WINDOW"] = "off"
    for label in ("fp16", "global_qsgd"):
        m = getattr(hvdc.Compression, label)(seed=2)
        m.ring_min_bytes = 0
        want[label] = [m.allreduce(x, "tight", comm) for _ in range(2)]   # the ring
    os.environ["HVDC_SHARED_WINDOW"] = "on"
    real = shared_window._shm_free_bytes
    shared_window._shm_free_bytes = lambda: 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = {}
            for label in ("fp16", "global_qsgd"):
                m = getattr(hvdc.Compression, label)(seed=2)
                m.ring_min_bytes = 0
                got[label] = [m.allreduce(x, "tight", comm) for _ in range(2)]
            total = window_allreduce_sum(comm, "tight-sum", x)
    finally:
        shared_window._shm_free_bytes = real
    return {"same": all(np.array_equal(u, v) for k in want for u, v in zip(want[k], got[k])),
            "no_window": not any(k[1].endswith("tight") or k[1] == "tight-sum"
                                 for k in shared_window._WINDOWS),
            "warnings": sum("no room" in str(w.message) for w in caught),
            "sum": bool(np.array_equal(total, comm.allreduce(x)))}


pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda p: f"P{p}")
def world(request):
    from horovod_compress.tools.testing import run_cases
    return request.param, run_cases(request.param, CASES, timeout=600)


def test_global_qsgd_window_gives_the_rings_bits(world):
    p, res = world
    for rank, out in res["case_global_qsgd_window_equals_ring"].items():
        for key, per in out.items():
            assert per["on"]["window"] and not per["off"]["window"], (p, rank, key)
            assert per["on"]["digests"] == per["off"]["digests"], (p, rank, key)
            assert per["on"]["residual"] == per["off"]["residual"], (p, rank, key)
            assert per["same_on_ranks"], (p, rank, key)
            for t in ("on", "off"):      # this rank's whole bytes: within two of 2N(P-1)/P
                assert per[t]["payload"] == pytest.approx(per["expected_payload"], abs=2), \
                    (p, rank, key, t)
            assert per["on"]["payload"] == per["off"]["payload"], (p, rank, key)   # the same chunks


def test_back_to_back_calls_never_mix_steps(world):
    p, res = world
    for rank, out in res["case_back_to_back_steps"].items():
        assert out["bad"] == [], (p, rank, out)


def test_windows_are_reused_and_resized(world):
    p, res = world
    for rank, out in res["case_window_reuse"].items():
        assert out["kept"] and out["new"], (p, rank, out)
        assert out["nbytes"] == 2 * 3000 and out["all_equal"] and out["value"] == 2.0, (p, rank, out)


def test_policy_is_parsed_strictly(monkeypatch):
    from horovod_compress.mpi_collectives.shared_window import shared_window_policy
    for raw, want in (("", "auto"), ("AUTO", "auto"), (" on ", "on"), ("off", "off")):
        monkeypatch.setenv("HVDC_SHARED_WINDOW", raw)
        assert shared_window_policy() == want
    monkeypatch.delenv("HVDC_SHARED_WINDOW")
    assert shared_window_policy() == "auto"
    monkeypatch.setenv("HVDC_SHARED_WINDOW", "yes")
    with pytest.raises(ValueError, match="HVDC_SHARED_WINDOW"):
        shared_window_policy()


def test_auto_needs_a_core_per_rank(monkeypatch):
    """``auto`` declines when the ranks outnumber the cores, ``on`` does not; neither takes
    a communicator that is not the mpi4py one, nor one rank."""
    from horovod_compress.mpi_collectives import shared_window
    from horovod_compress.mpi_collectives.communicator import Communicator

    class Proxy(Communicator):
        """A subclass (as a lockstep proxy or a wrapper would be): not the mpi4py one."""
    comm = Communicator()
    monkeypatch.setattr(shared_window, "all_ranks_on_one_node", lambda c: True)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for size, policy, want in ((2, "auto", True), (3, "auto", False), (3, "on", True),
                               (2, "off", False), (1, "on", False)):
        monkeypatch.setenv("HVDC_SHARED_WINDOW", policy)
        comm.size = size
        assert shared_window.use_shared_window(comm) is want, (size, policy)
    fake = Proxy()
    fake.size = 2
    monkeypatch.setenv("HVDC_SHARED_WINDOW", "on")
    assert not shared_window.use_shared_window(fake)   # a subclass: a proxy, not the one


def test_float_sum_is_the_chain(world):
    p, res = world
    for rank, out in res["case_float_sum"].items():
        assert out.pop("refused"), (p, rank)
        assert out["inplace"].pop("contiguous"), (p, rank)   # Open MPI: blocks back to back
        for key, r in out.items():
            assert r["chain"], (p, rank, key)
            if p == 2:      # one addition, commutative: MPI's bits
                assert r["mpi_equal"], (p, rank, key)
            # whole bytes of this rank's chunks: within two float32 of 2N(P-1)/P
            assert r["bytes"] == pytest.approx(r["expected"], abs=2 * 4), (p, rank, key, r)


def test_arc_rows_through_the_window(world):
    p, res = world
    for rank, out in res["case_arc_rows_through_the_window"].items():
        assert out["window"] and out["rows_equal"] and out["same_on_ranks"], (p, rank, out)
        if p == 2:
            assert out["bits_equal"], (p, rank, out)
        assert out["max_rel"] < 1e-5, (p, rank, out)


def test_no_room_for_a_window_takes_the_ring(world):
    p, res = world
    for rank, out in res["case_no_room_falls_back_to_the_ring"].items():
        assert out["same"] and out["no_window"] and out["sum"], (p, rank, out)
        assert out["warnings"] == 3, (p, rank, out)    # once per tensor: fp16, GQ, the sum
