"""fp16/bf16 through the pipelined ring (``_HalfPrecision._reduce_ring``) and through the
node-wide shared-memory window (``_HalfPrecision._reduce_window``) on real MPI ranks.

The cases below run on every rank (this file is also the case module of
``run_cases``); the tests check, at P = 2, 3, 4 and for both transports
(``HVDC_SHARED_WINDOW=off``: the ring; ``on``: the window, which these
single-node runs can always take):

* the ring's sum equals the chain the ring computes by construction -- block j
  (``block_counts(n, P)`` words) folded as round16(...round16(q_{j+1} + q_{j+2})
  ... + q_j) over ranks j+1, ..., j+P (mod P), one 16-bit rounding per addition --
  rebuilt in the test from NumPy alone (its float16 cast; bfloat16 by rounding the
  float32 bits), not from the library's kernels, and the library's encoding of each
  rank's message matches that oracle bit for bit;
* at P = 2 it is bit-identical to MPI's allreduce with the custom operator (the
  path it replaces: one addition, commutative);
* every rank holds the same bits, byte counts match ``expected_bytes`` and the
  old path's, and ``local`` (feedback that reads it) is the widened own message;
* word counts that do not split evenly (odd n, n < P words per segment) keep
  every 16-bit word whole (``ring_reduce_once_items``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

CASES = Path(__file__)
ALL = ["case_ring_matches_chain", "case_nonfinite_policies"]


def _np_encode(x: np.ndarray, kind: str, scale: float) -> np.ndarray:
    """The oracle's 16-bit patterns of ``float32(x) * float32(scale)``, from NumPy alone: its
    float16 cast (round to nearest even), or bfloat16 as the top half of the float32 bits
    rounded to nearest even (finite inputs)."""
    y = x.astype(np.float32) * np.float32(scale)
    if kind == "fp16":
        return y.astype(np.float16).view(np.uint16)
    b = y.view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _np_decode(words: np.ndarray, kind: str) -> np.ndarray:
    """The oracle's float32 values of 16-bit patterns (both widenings are exact)."""
    if kind == "fp16":
        return words.view(np.float16).astype(np.float32)
    return (words.astype(np.uint32) << 16).view(np.float32)


def _chain(words: np.ndarray, kind: str) -> np.ndarray:
    """The ring's sum from every rank's words (P, n), in NumPy alone: block j (``np.array_split``'s
    blocks: the first n % P one word longer) folded over ranks j+1, ..., j+P (mod P), each
    addition widened to float32 and rounded back to 16 bits once."""
    p, n = words.shape
    out = np.empty(n, np.uint16)
    for j, block in enumerate(np.array_split(np.arange(n), p)):
        lo, hi = (int(block[0]), int(block[-1]) + 1) if block.size else (0, 0)
        acc = words[(j + 1) % p, lo:hi]
        for s in range(2, p + 1):
            total = _np_decode(words[(j + s) % p, lo:hi], kind) + _np_decode(acc, kind)
            acc = _np_encode(total, kind, 1.0)
        out[lo:hi] = acc
    return out


TRANSPORTS = ("off", "on")   # HVDC_SHARED_WINDOW: the ring, the shared-memory window


def _transport(value: str) -> None:
    """Select the ring or the window for the calls that follow (every rank sets the same)."""
    os.environ["HVDC_SHARED_WINDOW"] = value


def _window_of(comm: Any, key: str, nbytes: int) -> bool:
    """Whether the last call on tensor ``key`` went through a shared window of ``nbytes``."""
    from horovod_compress.mpi_collectives import shared_window
    win = shared_window._WINDOWS.get((id(comm.comm), key))
    return win is not None and win.nbytes == nbytes


def case_ring_matches_chain(comm: Any) -> dict[str, Any]:
    from horovod_compress.compressors.registry import create
    from horovod_compress.kernels.halfprec import decode16, encode16

    results: dict[str, Any] = {}
    rng = np.random.default_rng(100 + comm.rank)
    for transport, kind, n in ((t, k, n) for t in TRANSPORTS for k in ("fp16", "bf16")
                               for n in (1, 7, 4097, 100_003, 1_000_000)):
            _transport(transport)
            x = (rng.standard_normal(n) * rng.choice([1e-6, 1.0, 300.0], size=n)).astype(np.float32)
            m = create(kind)
            m.ring_min_bytes = 0                     # the ring even for tiny payloads
            assert m._use_ring(comm, x) == (comm.size > 1)
            comm.reset_stats()
            avg = m.allreduce(x, "g", comm)
            ring_bytes = float(comm.stats()["by_op"].get("allreduce", {}).get("sent", 0.0))
            old = create(kind)
            old.ring_min_bytes = 1 << 62             # MPI's allreduce with the custom operator
            comm.reset_stats()
            ref_mpi = old.allreduce(x, "g", comm)
            old_bytes = float(comm.stats()["by_op"].get("allreduce", {}).get("sent", 0.0))
            words = encode16(x, kind, scale=1.0 / comm.size)
            assert np.array_equal(words, _np_encode(x, kind, 1.0 / comm.size)), (kind, n)
            every = comm.allgather(words).reshape(comm.size, n)
            chain = _np_decode(_chain(every, kind), kind)
            all_avg = comm.allgather(avg).reshape(comm.size, n)
            # feedback that reads ``local``: the widened own message
            from horovod_compress.feedback import make_feedback
            fb = create(kind)      # fp16/bf16 take no feedback argument; a subclass could
            fb.feedback = make_feedback(kind, "residual")
            fb.ring_min_bytes = 0
            fb.allreduce(x, "h", comm)
            resid = fb.state["h"]["fb_residual"]
            local_ok = bool(np.array_equal(resid, x - decode16(words, kind, scale=comm.size)))
            results[f"{transport}/{kind}/{n}"] = {
                "window": _window_of(comm, f"{kind}:g", 2 * n),
                "chain": bool(np.array_equal(avg.view(np.uint32), chain.view(np.uint32))),
                "same_on_ranks": bool((all_avg.view(np.uint32) == avg.view(np.uint32)).all()),
                "mpi_equal": bool(np.array_equal(avg.view(np.uint32), ref_mpi.view(np.uint32))),
                "bytes": ring_bytes, "old_bytes": old_bytes,
                "expected": m.expected_bytes((n,), comm.size),
                "local": local_ok,
            }
    return results


def case_nonfinite_policies(comm: Any) -> dict[str, Any]:
    """NaN/Inf on one rank: the ring's deferred agreement (finiteness from the rounding pass)
    against the up-front test, under every policy; also x finite but x / P beyond float16."""
    from horovod_compress.compressors import base
    from horovod_compress.compressors.registry import create

    res: dict[str, Any] = {}
    for transport, kind in ((t, k) for t in TRANSPORTS for k in ("fp16", "bf16")):
        _transport(transport)
        for policy in ("skip", "propagate", "raise"):
            runs = []
            for defer in (True, False):
                m = create(kind)
                m.set_nonfinite(policy)
                m.ring_min_bytes = 0
                if not defer:
                    m._defers_finite_check = lambda x, name, c: False
                rng = np.random.default_rng(3 + comm.rank)
                outs = []
                for step in range(5):
                    g = rng.standard_normal(50_001).astype(np.float32)
                    if (step, comm.rank) in ((1, 1), (3, 0)):
                        g[77] = np.nan if step == 1 else np.inf
                    if step == 4:
                        g[5] = 1e6          # finite; rounds to inf in float16
                    try:
                        outs.append(m.allreduce(g, "w", comm).view(np.uint32).copy())
                    except base.NonFiniteGradientError as exc:
                        outs.append(str(exc))
                runs.append((outs, m.skipped_steps))
            (a, sa), (b, sb) = runs
            res[f"{transport}/{kind}/{policy}"] = {
                "same": all((isinstance(u, str) and u == v) or
                            (not isinstance(u, str) and not isinstance(v, str) and np.array_equal(u, v))
                            for u, v in zip(a, b)),
                "skipped": (sa, sb),
                "errors": sum(isinstance(u, str) for u in a),
            }
    return res


pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda p: f"P{p}")
def world(request):
    from horovod_compress.tools.testing import run_cases
    return request.param, run_cases(request.param, CASES, ALL, timeout=600)


def test_ring_sum_is_the_chain_on_every_rank(world):
    p, res = world
    for rank, per_rank in res["case_ring_matches_chain"].items():
        for key, r in per_rank.items():
            assert r["chain"], (p, rank, key)
            assert r["same_on_ranks"], (p, rank, key)
            assert r["local"], (p, rank, key)
            # the window ran exactly where asked for (a 1-word payload opens a window too)
            assert r["window"] == (p > 1 and key.startswith("on/")), (p, rank, key)
            if p == 2:   # one addition: MPI's operator made the same one
                assert r["mpi_equal"], (p, rank, key)


def test_ring_bytes_match_the_allreduce(world):
    p, res = world
    for rank, per_rank in res["case_ring_matches_chain"].items():
        for key, r in per_rank.items():
            # whole bytes of this rank's chunks: within two 16-bit words of 2N(P-1)/P
            assert r["bytes"] == pytest.approx(r["expected"], abs=2 * 2), (p, rank, key, r)
            assert r["bytes"] == r["old_bytes"], (p, rank, key, r)      # the same chunks as MPI's


def test_hardware_conversions_match_the_software_rule():
    """F16C kernels against the bit-twiddling ones on random float32 patterns, every 16-bit
    pattern and random pairs (skipped where the CPU lacks F16C: the software kernels run)."""
    from horovod_compress.kernels import halfprec as H
    if not H.HW_F16:
        pytest.skip("no F16C on this CPU: the software kernels are the only ones")
    rng = np.random.default_rng(5)
    x = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    for scale in (1.0, 0.5, 1 / 3):
        sw = np.empty(x.size, np.uint16)
        H._encode_flat(x, np.float32(scale), H.FP16, sw)
        assert np.array_equal(sw, H.encode16(x, "fp16", scale))
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    for scale in (1.0, 2.0, 0.25):
        sw = np.empty(65536, np.float32)
        H._decode_fp16(every, H._FP16_TO_F32, np.float32(scale), sw)
        assert np.array_equal(sw.view(np.uint32), H.decode16(every, "fp16", scale).view(np.uint32))
    a = rng.integers(0, 65536, size=1 << 22).astype(np.uint16)
    b = rng.integers(0, 65536, size=1 << 22).astype(np.uint16)
    for kind, k in (("fp16", H.FP16), ("bf16", H.BF16)):
        ref = b.copy()
        H._add_into(a, ref, k, H._FP16_TO_F32)
        got = b.copy()
        H.add16_into(a, got, kind)
        assert np.array_equal(ref, got), kind


def test_ring_nonfinite_policies_as_upfront(world):
    p, res = world
    for rank, per_rank in res["case_nonfinite_policies"].items():
        for key, r in per_rank.items():
            assert r["same"], (p, rank, key, r)
            assert r["skipped"][0] == r["skipped"][1], (p, rank, key, r)
            if key.endswith("/raise"):
                assert r["errors"] == 2, (p, rank, key, r)
            if key.endswith("/skip"):
                assert r["skipped"][0] == 2, (p, rank, key, r)
