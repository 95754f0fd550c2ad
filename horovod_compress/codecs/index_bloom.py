"""``bloom`` index codec: the support in a Bloom filter, with the paper's four policies.

Sizing ("DeepReduce: A Sparse-tensor Communication Framework for Distributed Deep Learning" (Kostopoulou et al., NeurIPS 2021),
Section 2 and Remark 2 of the appendix): for a
false-positive rate eps and r = |S| indices,

    h = ceil(log2(1 / eps)) hash functions,   m = h * r / ln 2 bits

(rounded up to whole bytes, at least one), which is the optimum
m = -r ln(eps) / (ln 2)^2 with h rounded up. The receiver queries every index
in [0, n) and gets the positives P (ascending), a superset of S with about
eps * (n - r) false positives (Lemma 5: |P| <= r + eps (n - r) in expectation).
What the values are attached to depends on the policy (Section 4):

* ``naive`` -- the sender sends the r values of S; the receiver gives them to
  the first r positives in ascending order. A false positive shifts every
  later value to the wrong index: kept only as the paper's negative example.
* ``p0`` -- the sender runs the receiver's query itself and sends a value for
  every positive (false ones too): |P| values, no error at all. The value of a
  false positive is taken from the sparsifier's input (GRACE's choice in the
  paper) or is 0 (then the sparse input is reconstructed exactly).
* ``p1`` -- r positives drawn uniformly at random (shared random seed): exactly
  r values, some on false positives, some true indices dropped.
* ``p2`` -- r positives drawn through conflict sets (Algorithm 1): initial
  singleton sets are certain true positives and smaller sets are drawn from
  first, so fewer false positives are chosen than by ``p1``.

Hashing, querying and both selection policies run in Numba
(:mod:`horovod_compress.kernels.bloom`). Payload::

    u8 policy | u8 h | varint m | ceil(m / 8) bytes of filter
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..params import check_choice, check_float
from ..kernels import bloom as kb
from ..kernels import dispatch
from .registry import IndexCodec, IndexEncoding
from .wire import ByteReader, ByteWriter, ContainerError

POLICIES = ("naive", "p0", "p1", "p2")
MAX_HASHES = 64


def bloom_size(r: int, fpr: float) -> tuple[int, int]:
    """``(m bits, h hashes)`` for ``r`` items at false-positive rate ``fpr``."""
    h = max(1, math.ceil(math.log2(1.0 / fpr) - 1e-12))
    m_bytes = max(1, math.ceil(h * r / math.log(2) / 8))
    return 8 * m_bytes, h


def selection_seed(seed: int) -> np.uint64:
    """The seed of P1/P2's random draws, derived from the container's seed."""
    return np.uint64((int(seed) * 0x9E3779B97F4A7C15 + 0xD1B54A32D192ED03) % 2**64)


def select_slots(policy: str, positives: np.ndarray, bits_m: int, h: int, seed: int,
                 r: int) -> np.ndarray:
    """The positions that receive values under ``policy`` (sender and receiver alike)."""
    if policy == "p0":
        return positives
    if policy == "naive":
        return positives[:r]
    if policy == "p1":
        return kb.random_subset(positives, r, selection_seed(seed))
    return kb.conflict_set_select(positives, bits_m, h, np.uint64(seed), r, selection_seed(seed))


class BloomIndex(IndexCodec, name="bloom", codec_id=5):
    """Bloom filter of the support, sized from ``fpr``, with policy naive/p0/p1/p2."""

    lossless = False

    def __init__(self, fpr: float = 0.001, policy: str = "p2") -> None:
        self.fpr = check_float("deepreduce", "fpr", fpr, 0.0, 1.0, low_open=True, high_open=True)
        if math.ceil(math.log2(1.0 / self.fpr)) > MAX_HASHES:
            raise ValueError(f"deepreduce: fpr must be >= 2**-{MAX_HASHES}, got {fpr!r}")
        self.policy = check_choice("deepreduce", "policy", policy, POLICIES)

    def params(self) -> dict[str, Any]:
        return {"fpr": self.fpr, "policy": self.policy}

    def encode(self, indices: np.ndarray, n: int, seed: int) -> IndexEncoding:
        idx = np.ascontiguousarray(indices, dtype=np.int64)
        r = idx.size
        m, h = bloom_size(r, self.fpr)
        bits = kb.bloom_insert(idx, m, h, np.uint64(seed))
        positives = dispatch.call("bloom_query_range", bits, m, h, np.uint64(seed), n)  # parallel for large n
        slots = select_slots(self.policy, positives, m, h, seed, r)
        sources = idx if self.policy == "naive" else slots
        payload = (ByteWriter().u8(POLICIES.index(self.policy)).u8(h).varint(m)
                   .raw(bits).getvalue())
        return IndexEncoding(payload, slots, sources)

    @classmethod
    def decode(cls, payload: bytes, n: int, n_slots: int, seed: int) -> np.ndarray:
        rd = ByteReader(payload, "bloom index section")
        code = rd.u8("policy")
        if code >= len(POLICIES):
            raise rd.fail(f"unknown policy code {code}")
        policy = POLICIES[code]
        h = rd.u8("hash count")
        if not 1 <= h <= MAX_HASHES:
            raise rd.fail(f"hash count {h} outside [1, {MAX_HASHES}]")
        m = rd.varint("filter bits", limit=8 * rd.remaining)
        if m < 1 or (m + 7) // 8 != rd.remaining:
            raise rd.fail(f"filter of {m} bits does not match the {rd.remaining} bytes that follow")
        bits = np.frombuffer(rd.rest(), np.uint8)
        if m % 8 and bits[-1] >> (m % 8):
            raise ContainerError("bloom index section: bits set past the end of the filter")
        positives = dispatch.call("bloom_query_range", bits, m, h, np.uint64(seed), n)  # parallel for large n
        if policy == "p0":
            if positives.size != n_slots:
                raise ContainerError(f"bloom index section: {positives.size} positives, "
                                     f"header says {n_slots} values")
            return positives
        if positives.size < n_slots:
            raise ContainerError(f"bloom index section: {positives.size} positives cannot hold "
                                 f"{n_slots} values")
        return select_slots(policy, positives, m, h, seed, n_slots)
