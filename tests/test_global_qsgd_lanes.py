"""Global-QSGD's pipelined-ring reduce kernel (Algorithm 2 on 8 byte lanes per word) and the
tree schedule of the 4-bit reduce, on one process.

* ``exp_reduce8_swar`` equals ``exp_reduce_pair`` (itself checked exhaustively against the
  exact expectation and the paper's Algorithm 2 in test_global_qsgd_kernels.py) on every
  pair of 8-bit codes and every 7-bit random lane R, for both extreme completions of the
  word's low 57 bits, and asks for a redo exactly where R = 0 and the exponents differ by 8
  or more (the only lanes where 7 bits do not decide);
* ``exp_reduce8_lanes_range`` equals the pure kernel ``exp_reduce_codes`` fed with the
  documented words (``lane_word``), codes and saturation count, on any byte range
  (unaligned heads and tails, redo lanes included);
* ``tree_round`` builds, for every P up to 12, binomial trees of height <= ceil(log2 P)
  in which every rank sends each block but its own exactly once;
* (``mpirun -np 2``) the method's pipelined ring gives the same bits with 60 KiB, 1 MiB
  and odd-sized pieces: every byte's random word depends only on its position.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from numba import njit

from horovod_compress.kernels.exp_reduce import (
    LANE_FINE,
    exp_reduce8_lanes_range,
    exp_reduce8_swar,
    exp_reduce_codes_into,
    exp_reduce_pair,
)
from horovod_compress.kernels.quantize import random_words
from horovod_compress.mpi_collectives.reduce_ops import tree_round, tree_rounds

_REP = np.uint64(0x0101010101010101)


@njit(cache=False)
def _swar_against_pair() -> tuple[int, int, int, int]:
    """(mismatching codes, wrong redo flags, wrong saturation counts, redo lanes) over all
    256 x 256 code pairs and 128 random lanes (each pair in all 8 lanes of a word)."""
    bad = 0
    bad_redo = 0
    bad_sat = 0
    redo_lanes = 0
    for c1 in range(256):
        for c2 in range(256):
            d = abs((c1 & 127) - (c2 & 127))
            for r7 in range(128):
                o, rd, st = exp_reduce8_swar(np.uint64(c1) * _REP, np.uint64(c2) * _REP,
                                             np.uint64(r7) * _REP)
                lane = np.int64(o & np.uint64(0xFF))
                if o != np.uint64(lane) * _REP:
                    bad += 1
                want_redo = r7 == 0 and d >= 8
                if (rd == _REP * np.uint64(0x80)) != want_redo or (rd != 0) != want_redo:
                    bad_redo += 1
                if want_redo:
                    redo_lanes += 1
                    continue
                for low in (np.uint64(0), np.uint64((1 << 57) - 1)):
                    c, s = exp_reduce_pair(c1, c2, (np.uint64(r7) << np.uint64(57)) | low, 7)
                    bad += c != lane
                    bad_sat += np.int64(st) != 8 * s
    return bad, bad_redo, bad_sat, redo_lanes


def test_swar_lanes_equal_the_pair_kernel_exhaustively():
    bad, bad_redo, bad_sat, redo_lanes = _swar_against_pair()
    assert (bad, bad_redo, bad_sat) == (0, 0, 0)
    # R = 0 with |e1 - e2| >= 8: 2 * (120 + 119 + ... + 1) exponent pairs times 4 sign pairs
    assert redo_lanes == 4 * 2 * sum(range(1, 121))


def _documented_words(key: np.uint64, n: int) -> np.ndarray:
    """lane_word(key, i) for i < n, from ``random_words``: R_i 2^57 + fine_i >> 7."""
    i = np.arange(n, dtype=np.uint64)
    coarse = random_words(key, np.uint64(0), (n + 7) // 8)
    r7 = (coarse[i >> np.uint64(3)] >> (np.uint64(8) * (i & np.uint64(7)))) & np.uint64(0x7F)
    return (r7 << np.uint64(57)) | (random_words(key, LANE_FINE, n) >> np.uint64(7))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 1000, 100_003])
def test_lanes_range_equals_pure_kernel_with_documented_words(n):
    rng = np.random.default_rng(n)
    e1 = rng.integers(0, 128, n)
    e2 = np.clip(e1 + rng.integers(-20, 21, n), 0, 127)   # small and >= 8 gaps: redo lanes occur
    a = (e1 | (rng.integers(0, 2, n) << 7)).astype(np.uint8)
    b = (e2 | (rng.integers(0, 2, n) << 7)).astype(np.uint8)
    a[: min(n, 5)] = 1                                        # 1/2 + 1/2: saturation
    b[: min(n, 5)] = 1
    key = np.uint64(rng.integers(0, 2**63))
    words = _documented_words(key, n)
    for lo, hi in ((0, n), (min(3, n), n), (0, max(0, n - 5)), (n // 3, 2 * n // 3 + 1)):
        expect = np.empty(hi - lo, np.uint8)
        sat = exp_reduce_codes_into(a[lo:hi], b[lo:hi], words[lo:hi], 7, expect)
        out = np.full(n, 0xAA, np.uint8)
        got_sat = exp_reduce8_lanes_range(a, b, out, key, lo, hi)
        assert np.array_equal(out[lo:hi], expect), (lo, hi)
        assert got_sat == sat, (lo, hi)
        assert (out[:lo] == 0xAA).all() and (out[hi:] == 0xAA).all()
    if n >= 100_000:
        r7 = words >> np.uint64(57)
        assert ((r7 == 0) & (np.abs(e1 - e2) >= 8)).sum() > 100   # the redo path ran


@pytest.mark.parametrize("p", list(range(1, 13)))
def test_tree_schedule_is_a_binomial_tree_of_height_ceil_log2_p(p):
    """Simulate tree_round's messages: block j ends on rank j holding every rank's leaf once,
    at height <= ceil(log2 P); every rank sends each other block exactly once."""
    val = {(r, j): (frozenset([r]), 0) for r in range(p) for j in range(p)}
    sent = {}
    for t in range(tree_rounds(p)):
        msgs = []
        for r in range(p):
            _, send = tree_round(p, r, t)
            for j in send:
                msgs.append(((r - (1 << t)) % p, j, val[(r, j)]))
                sent[(r, j)] = sent.get((r, j), 0) + 1
        for r in range(p):
            recv, _ = tree_round(p, r, t)
            incoming = [(j, v) for dst, j, v in msgs if dst == r]
            assert sorted(j for j, _ in incoming) == recv, (r, t)
            for j, (leaves, h) in incoming:
                mine, hm = val[(r, j)]
                assert not leaves & mine
                val[(r, j)] = (leaves | mine, max(h, hm) + 1)
    for j in range(p):
        leaves, h = val[(j, j)]
        assert leaves == frozenset(range(p))
        assert h <= math.ceil(math.log2(p)) if p > 1 else h == 0
    assert all(sent.get((r, j), 0) == int(r != j) for r in range(p) for j in range(p))


def case_ring_segmentation(comm):
    """The pipelined ring at its default threshold with the between-hosts pieces (60 KiB
    segments, 64 KiB slices, many per block) and the one-node pieces (1 MiB / 256 KiB):
    the same bits, since every byte's random word depends only on its position."""
    import hashlib

    import horovod_compress as hvdc

    x = np.random.default_rng(comm.rank).standard_normal(2_100_001).astype(np.float32)
    digests = {}
    for label, sizes in (("tcp", (61440, 1 << 16)), ("shm", (1 << 20, 1 << 18)),
                         ("odd", (12345, 54321))):
        m = hvdc.Compression.global_qsgd(seed=9)
        m.shm_ring_sizes = sizes
        comm.reset_stats()
        r = m.allreduce(x, "big", comm)
        digests[label] = hashlib.sha256(r.tobytes()).hexdigest()
        digests[label + "_payload"] = comm.stats()["by_phase"]["global_qsgd.payload"]["sent"]
    return digests


@pytest.mark.mpi
def test_ring_result_does_not_depend_on_its_pieces():
    from pathlib import Path

    from horovod_compress.tools.testing import run_cases

    res = run_cases(2, Path(__file__), ["case_ring_segmentation"], timeout=600)
    per_rank = res["case_ring_segmentation"]
    for rank, d in per_rank.items():
        assert d["tcp"] == d["shm"] == d["odd"] == per_rank[0]["tcp"], (rank, d)
        assert d["tcp_payload"] == d["shm_payload"] == d["odd_payload"] == 2_100_001, d
