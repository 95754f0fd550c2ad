"""Top-k selection kernels (Numba, CPU): thresholds, threshold selection, COO sums.

The sparsifying methods (Ok-Topk and its baselines, Ok-Topk paper Section
3.1.3) need four hot loops, each written here as a pure function (NumPy arrays
in, NumPy arrays or scalars out, no state, no communication) so a GPU backend
can provide the same functions with the same contracts:

* :func:`kth_largest_abs` -- the *exact* k-th largest ``|x|`` without sorting:
  a radix select on the IEEE-754 bit patterns of ``|x|`` (which order like the
  magnitudes), 16 bits per pass: two passes over ``x`` for float32, four for
  float64, O(n) time and a 65536-bin histogram of memory. This is Ok-Topk's
  ``th_re_evaluate`` (Algorithm 1, lines 3 and 11).
* :func:`select_by_threshold` -- the entries with ``|x| >= threshold`` (and
  ``x != 0``) as COO ``(indices, values)`` in ascending index order, in one
  compare pass. With a reused threshold this *is* Ok-Topk's top-k selection
  (Section 3.1.3: "Top-k selection according to a threshold only requires n
  comparisons").
* :func:`gaussian_threshold` -- the *estimated* k-th largest ``|x|`` of
  Gaussiank (Shi et al. 2019; Ok-Topk paper Section 2): the percent-point
  function of a normal distribution with the mean and standard deviation of
  ``x``, one pass for the moments, no selection at all.
* :func:`coo_sum` -- a sparse reduction: sum the values of equal indices of a
  COO list (duplicates added in input order, in float64), returning the
  result sorted by index. This is the reduction of split-and-reduce, TopkDSA's
  reduce-scatter and gTopk's tree.

Zero entries are never selected: a zero carries no information, and this keeps
all-zero gradients (and thresholds of 0) from turning into dense messages.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros


# ----------------------------------------------------------------- exact k-th
@njit(cache=True)
def _radix_kth_largest_key(bits, k, nbits, absmask):
    """Key (bit pattern of |x|) of the k-th largest |x|; ``1 <= k <= bits.size``.

    Keys of non-negative IEEE floats order like the floats, so the k-th
    largest key is found 16 bits at a time: histogram the next digit of the
    keys that share the prefix found so far, walk the histogram from the top
    until the count reaches the rank still wanted, extend the prefix.
    """
    n = bits.size
    hist = np.zeros(65536, np.int64)
    prefix = np.uint64(0)
    remaining = k
    npass = nbits // 16
    sixteen = np.uint64(16)
    for p in range(npass):
        shift = np.uint64(nbits - 16 * (p + 1))
        hist[:] = 0
        if p == 0:
            for i in range(n):
                key = np.uint64(bits[i]) & absmask
                hist[np.int64((key >> shift) & np.uint64(0xFFFF))] += 1
        else:
            for i in range(n):
                key = np.uint64(bits[i]) & absmask
                if (key >> (shift + sixteen)) == prefix:
                    hist[np.int64((key >> shift) & np.uint64(0xFFFF))] += 1
        d = 65535
        while d > 0 and hist[d] < remaining:
            remaining -= hist[d]
            d -= 1
        prefix = (prefix << sixteen) | np.uint64(d)
    return prefix


def kth_largest_abs(x: np.ndarray, k: int) -> float:
    """The exact k-th largest ``|x|`` (ties counted), without a sort.

    ``k <= 0`` gives ``inf`` (selects nothing), ``k > x.size`` gives ``0.0``
    (selects every nonzero entry). float16/bfloat16-like inputs are widened to
    float32; float64 stays float64. NaNs are not expected (they rank above
    ``inf``).
    """
    x = np.ascontiguousarray(x).reshape(-1)
    k = int(k)
    if k <= 0:
        return math.inf
    if k > x.size:
        return 0.0
    if x.dtype == np.float64:
        key = _radix_kth_largest_key(x.view(np.uint64), k, 64, np.uint64(0x7FFFFFFFFFFFFFFF))
        return float(np.array([key], dtype=np.uint64).view(np.float64)[0])
    x32 = x if x.dtype == np.float32 else x.astype(np.float32)
    key = _radix_kth_largest_key(x32.view(np.uint32), k, 32, np.uint64(0x7FFFFFFF))
    return float(np.array([key], dtype=np.uint32).view(np.float32)[0])


# ------------------------------------------- exact top-k by a sampled bound
#: Sampling parameters of :func:`topk_candidates`: runs of ``_RUN`` consecutive
#: entries, one per block of ``n / _RUNS`` entries, and the safety margin of the
#: sampled bound in standard deviations of the sample count.
_RUNS = 2048
_RUN = 16
_MARGIN_SIGMAS = 4.0
#: Below this many entries the sampled bound does not pay: a plain radix select.
SAMPLED_MIN_SIZE = 1 << 16


@njit(cache=True)
def _sample_keys(bits, absmask, runs, run):
    """Keys of ``runs`` runs of ``run`` consecutive entries, one run per equal block of ``bits``.

    The run's offset inside its block is a fixed hash of the block number
    (deterministic, so every call on equal data samples the same entries, and
    periodic structure of the data does not line up with the sample).
    """
    out = np.empty(runs * run, bits.dtype)
    for b in range(runs):
        start = _run_start(b, bits.size, runs, run)
        for j in range(run):
            out[b * run + j] = bits[start + j] & absmask
    return out


@njit(cache=True, inline="always")
def _run_start(b, n, runs, run):
    """First entry of the sampled run in block ``b`` of ``runs`` equal blocks of ``n`` entries.

    A fixed hash of the block number (Fibonacci hashing) picks the offset, so
    every call on equal data samples the same entries and periodic structure
    in the data does not line up with the sample.
    """
    lo = (b * n) // runs
    hi = ((b + 1) * n) // runs
    room = hi - lo - run + 1
    h = (np.uint64(b) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(29)
    return lo + np.int64(h % np.uint64(room))


@njit(cache=True, inline="always")
def _hit_mask(bits, i, absmask, lo_key):
    """Bit j set where the key of ``bits[i + j]`` is ``>= lo_key``, for j < 64 (branch-free, vectorised)."""
    m = np.uint64(0)
    for j in range(64):
        m |= np.uint64((bits[i + np.uint64(j)] & absmask) >= lo_key) << np.uint64(j)
    return m


@njit(cache=True, inline="always")
def _visit_hits(m, i, bits, cand, cbits, w):
    """Append the entries ``i + j`` of the set bits j of ``m`` (and their bit patterns); the new count."""
    while m != np.uint64(0):
        p = i + trailing_zeros(m)
        cand[w] = p
        cbits[w] = bits[p]
        w += 1
        m &= m - np.uint64(1)
    return w


@njit(cache=True)
def _collect_at_least(bits, absmask, lo_key, cand, cbits, cap):
    """Entries whose key is ``>= lo_key`` (``lo_key >= 1``: zeros never): indices to ``cand``, bits to ``cbits``.

    In ascending index order. Returns their count, or -1 once they exceed
    ``cap`` (the caller falls back to a full radix select). Blocks of 64
    keys: a branch-free compare builds the block's hit mask (vectorised),
    then only the set bits are visited (as :func:`scan_hits`); the bit
    pattern of each hit is copied while its cache line is at hand, so later
    steps never touch ``bits`` again. Unsigned indices: no wraparound checks.
    """
    n = np.uint64(bits.size)
    w = 0
    i = np.uint64(0)
    while i + np.uint64(64) <= n:
        m = _hit_mask(bits, i, absmask, lo_key)
        if m != np.uint64(0):
            if w + 64 > cap:
                return -1
            w = _visit_hits(m, i, bits, cand, cbits, w)
        i += np.uint64(64)
    while i < n:
        if (bits[i] & absmask) >= lo_key:
            if w >= cap:
                return -1
            cand[w] = i
            cbits[w] = bits[i]
            w += 1
        i += np.uint64(1)
    return w


@njit(cache=True)
def _emit_topk(cand, cbits, cvals, absmask, c, k, t, all_ties, out_idx, out_val):
    """Write the candidates of key ``> t``, then ties ``== t``, in ascending index order.

    ``cand[:c]``/``cbits[:c]``/``cvals[:c]``: the candidates' indices, bit
    patterns and values (``cvals`` a float view of ``cbits``); ``t`` is the
    key of the exact k-th largest ``|x|`` (``t >= 1``). With ``all_ties``
    every tie is written (Ok-Topk's ``|x| >= threshold``); otherwise only the
    first ``k - #above`` ties, so exactly k entries. Returns how many were
    written.
    """
    above = 0
    for j in range(c):
        above += (cbits[j] & absmask) > t
    ties = c if all_ties else k - above
    w = 0
    for j in range(c):
        key = cbits[j] & absmask
        if key > t or (key == t and ties > 0):
            if key == t:
                ties -= 1
            out_idx[w] = cand[j]
            out_val[w] = cvals[j]
            w += 1
    return w


def _key_view(x: np.ndarray) -> tuple[np.ndarray, Any, int]:
    """``(bit patterns, mask of |.|, bits per key)`` of a flat float32/float64 vector."""
    if x.dtype == np.float64:
        return x.view(np.uint64), np.uint64(0x7FFFFFFFFFFFFFFF), 64
    return x.view(np.uint32), np.uint32(0x7FFFFFFF), 32


def _absmask(x: np.ndarray) -> int:
    return 0x7FFFFFFFFFFFFFFF if x.dtype == np.float64 else 0x7FFFFFFF


def sampled_bound_key(bits: np.ndarray, absmask: Any, nbits: int, k: int) -> int:
    """A key ``lo`` with, very likely, a little more than k keys ``>= lo``; 0 when sampling cannot tell.

    From a stratified sample of S keys (:func:`_sample_keys`), the
    ``r``-th largest sampled key for ``r = qS + 4 sqrt(qS) + 8``, ``q = k/n``:
    the sample's count above the true k-th largest has mean qS and standard
    deviation below sqrt(qS), so ``lo`` undercuts the k-th largest key unless
    the sample is off by 4 deviations, and the keys ``>= lo`` number about
    ``k r / (qS)`` (1.2k at n = 4M, k = 1%). The result is never trusted:
    :func:`topk_candidates` checks the count it gets.
    """
    runs = _sample_runs(bits.size)
    if runs == 0:
        return 0
    return _bound_from_sample(_sample_keys(bits, absmask, runs, _RUN), bits.size, k, nbits, absmask)


def _sample_runs(n: int) -> int:
    """How many runs of ``_RUN`` entries to sample from n entries; 0 when too few to tell."""
    runs = min(_RUNS, n // (4 * _RUN))
    return runs if runs >= 16 else 0


def _bound_from_sample(sample: np.ndarray, n: int, k: int, nbits: int, absmask: Any) -> int:
    """The ``r``-th largest sampled key, ``r = qS + 4 sqrt(qS) + 8`` (see :func:`sampled_bound_key`); 0 if r is too large."""
    qs = k / n * sample.size
    r = int(math.ceil(qs + _MARGIN_SIGMAS * math.sqrt(qs) + 8.0))
    if r >= sample.size // 2:
        return 0
    return int(_radix_kth_largest_key(sample, r, nbits, np.uint64(absmask)))


def _candidate_buffers(scratch: dict | None, k: int, dtype: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """``(cand, cbits, cap)``: room for ``cap = max(2k, k + 4096)`` candidates, kept in ``scratch``."""
    cap = max(2 * k, k + 4096)
    store = {} if scratch is None else scratch
    cand, cbits = store.get("cand"), store.get("cbits")
    if cand is None or cand.size < cap or cbits.dtype != dtype:
        cand = store["cand"] = np.empty(cap, np.int64)
        cbits = store["cbits"] = np.empty(cap, dtype)
    return cand, cbits, cap


def topk_candidates(x: np.ndarray, k: int, scratch: dict | None = None
                    ) -> tuple[np.ndarray, int, int] | None:
    """The indices of ``|x| >= |x|_(k)`` plus a few more, and the key of the exact k-th largest.

    Returns ``(cand, cbits, c, t)``: ``cand[:c]`` ascending indices of every entry
    whose key (bit pattern of ``|x|``) is at least a sampled bound ``lo``
    (:func:`sampled_bound_key`), ``cbits[:c]`` their bit patterns, ``c >= k``, and ``t`` the key of the exact
    k-th largest ``|x|`` (a radix select over the c candidates only). Since
    ``c >= k`` entries have keys ``>= lo``, the k-th largest key is ``>= lo``:
    every entry of the top k, and every tie at ``t``, is a candidate -- the
    selection made from them is the one a full pass would make. One
    vectorised read of ``x`` plus O(c) work, against the two full passes of
    the radix select. ``None`` when the sample gives no usable bound or the
    bound misses (fewer than k, or more than ``max(2k, k + 4096)``
    candidates; callers then select over all of ``x``). ``scratch`` (a dict)
    keeps the candidate buffer between calls.
    """
    n = x.size
    if n < SAMPLED_MIN_SIZE or not 1 <= k < n:
        return None
    bits, absmask, nbits = _key_view(x)
    lo = sampled_bound_key(bits, absmask, nbits, k)
    if lo == 0:
        return None
    cand, cbits, cap = _candidate_buffers(scratch, k, bits.dtype)
    c = int(_collect_at_least(bits, absmask, bits.dtype.type(lo), cand, cbits, cap))
    if c < k:
        return None
    t = int(_radix_kth_largest_key(cbits[:c], k, nbits, np.uint64(absmask)))
    return cand, cbits, c, t


def topk_by_candidates(x: np.ndarray, k: int, out_idx: np.ndarray, out_val: np.ndarray,
                       all_ties: bool = False, scratch: dict | None = None) -> int | None:
    """Exact top-k of a flat float32/float64 vector in one read, written in ascending index order.

    The entries with ``|x_j| > t`` (``t`` the exact k-th largest ``|x|``)
    and then -- all of them with ``all_ties``, else the lowest-index ones
    until k are held -- those with ``|x_j| == t``, as ``(index, value)`` in
    ``out_idx``/``out_val`` (room for k, or for every candidate with
    ``all_ties``). Returns how many were written, or ``None`` when
    :func:`topk_candidates` gives up (the caller selects over all of ``x``).
    """
    found = topk_candidates(x, k, scratch)
    if found is None:
        return None
    cand, cbits, c, t = found
    if all_ties and out_idx.size < c:
        raise ValueError(f"out_idx holds {out_idx.size} < {c} candidates")
    return int(_emit_topk(cand, cbits, cbits.view(x.dtype), cbits.dtype.type(_absmask(x)), c, k,
                          cbits.dtype.type(t), all_ties, out_idx, out_val))


@njit(cache=True)
def _sample_sum_keys(x, e, absmask, runs, run):
    """:func:`_sample_keys` of ``x + e`` (float32 sums at the sampled entries only)."""
    out = np.empty(runs * run, np.uint32)
    tmp = np.empty(1, x.dtype)
    tb = tmp.view(np.uint32)
    for b in range(runs):
        start = _run_start(b, x.size, runs, run)
        for j in range(run):
            tmp[0] = x[start + j] + e[start + j]
            out[b * run + j] = tb[0] & absmask
    return out


@njit(cache=True, inline="always")
def _block_min_exp_gap(xb, i, expmask):
    """min over j < 64 of ``~xb[i + j] & expmask``: 0 iff an exponent field is all ones (vectorised)."""
    m = expmask
    for j in range(64):
        m = min(m, np.uint32(np.uint32(~xb[i + np.uint64(j)]) & expmask))
    return m


@njit(cache=True)
def _add_collect_at_least(x, e, acc, absmask, lo_key, cand, cbits, cap, finite):
    """``acc = x + e`` (float32) and, in the same pass, :func:`_collect_at_least` of ``acc``.

    ``acc`` is always written whole; the count of entries whose key is
    ``>= lo_key`` is returned, or -1 once they exceed ``cap`` (the caller
    then selects over ``acc``). Blocks of 64: the sums are written, their
    keys compared into a bit mask (vectorised), the hits visited.
    ``finite[0]`` is set to whether every ``x`` is finite: the smallest
    ``~bits(x) & 0x7F800000`` over the pass is 0 exactly when some exponent
    field is all ones (NaN or Inf) -- one vector min per element, on data
    already in registers, instead of a second read of ``x``.
    """
    n = np.uint64(x.size)
    bits = acc.view(np.uint32)
    xb = x.view(np.uint32)
    expmask = np.uint32(0x7F800000)
    low = expmask
    w = 0
    full = False
    i = np.uint64(0)
    while i + np.uint64(64) <= n:
        for j in range(64):
            acc[i + np.uint64(j)] = x[i + np.uint64(j)] + e[i + np.uint64(j)]
        low = min(low, _block_min_exp_gap(xb, i, expmask))
        if not full:
            m = _hit_mask(bits, i, absmask, lo_key)
            if m != np.uint64(0):
                if w + 64 > cap:
                    full = True
                else:
                    w = _visit_hits(m, i, bits, cand, cbits, w)
        i += np.uint64(64)
    while i < n:
        acc[i] = x[i] + e[i]
        low = min(low, np.uint32(np.uint32(~xb[i]) & expmask))
        if not full and (bits[i] & absmask) >= lo_key:
            if w >= cap:
                full = True
            else:
                cand[w] = i
                cbits[w] = bits[i]
                w += 1
        i += np.uint64(1)
    finite[0] = low != np.uint32(0)
    return -1 if full else w


def add_topk(x: np.ndarray, e: np.ndarray, acc: np.ndarray, k: int, out_idx: np.ndarray,
             out_val: np.ndarray, scratch: dict | None = None,
             report: dict | None = None) -> int | None:
    """``acc = x + e`` and the exact top-k of ``acc``, in one read of ``x`` and ``e`` (float32).

    EF14's accumulation (``acc_i = x_i + e_i``, Seide et al. 2014; Ok-Topk's
    Algorithm 2, line 3) fused with :func:`topk_by_candidates`: the sampled
    bound is taken from ``x + e`` at the sampled entries, and the pass that
    writes ``acc`` collects the candidates above it. Writes the top k of
    ``acc`` (above the k-th largest magnitude, then the lowest-index ties) in
    ascending index order; returns k. ``None`` when the bound gives no usable
    candidate set -- ``acc`` is written all the same, and the caller selects
    over it. ``report`` (a dict, optional) receives ``report["finite"]``:
    whether every entry of ``x`` is finite, when the fused pass ran (it reads
    every ``x`` anyway, see :func:`_add_collect_at_least`); absent when it did
    not (small vectors, no sampled bound), and the caller checks ``x`` itself.
    """
    n = x.size
    if x.dtype != np.float32 or e.dtype != np.float32 or acc.dtype != np.float32:
        raise ValueError("add_topk takes float32 vectors")
    if not (x.ndim == e.ndim == acc.ndim == 1 and x.size == e.size == acc.size):
        raise ValueError(f"add_topk takes flat vectors of one size, got {x.shape}, {e.shape}, {acc.shape}")
    if n < SAMPLED_MIN_SIZE or not 1 <= k < n:
        np.add(x, e, out=acc)
        return None
    absmask = np.uint32(0x7FFFFFFF)
    runs = _sample_runs(n)
    lo = _bound_from_sample(_sample_sum_keys(x, e, absmask, runs, _RUN), n, k, 32, absmask) \
        if runs else 0
    if lo == 0:
        np.add(x, e, out=acc)
        return None
    cand, cbits, cap = _candidate_buffers(scratch, k, np.dtype(np.uint32))
    finite = np.ones(1, np.bool_)
    c = int(_add_collect_at_least(x, e, acc, absmask, np.uint32(lo), cand, cbits, cap, finite))
    if report is not None:
        report["finite"] = bool(finite[0])
    if c < k:
        return None
    t = int(_radix_kth_largest_key(cbits[:c], k, 32, np.uint64(absmask)))
    return int(_emit_topk(cand, cbits, cbits.view(np.float32), absmask, c, k, np.uint32(t), False,
                          out_idx, out_val))


def select_topk(x: np.ndarray, k: int, scratch: dict | None = None
                ) -> tuple[np.ndarray, np.ndarray, float]:
    """Ok-Topk's exact local selection: every nonzero entry with ``|x| >= |x|_(k)``, and that threshold.

    Returns ``(indices ascending int64, values, threshold)``, the same as
    ``th = kth_largest_abs(x, k); select_by_threshold(x, th)`` (ties at the
    threshold all selected, so possibly more than k entries), in one read of
    ``x`` when the sampled bound holds (:func:`topk_candidates`), else by the
    two-pass radix select and a compare pass.
    """
    x = _as_float_vector(x)
    k = int(k)
    found = topk_candidates(x, k, scratch) if 1 <= k < x.size else None
    if found is None:
        th = kth_largest_abs(x, k)
        idx, val = _select_by_threshold(x, x.dtype.type(th))
        return idx, val, th
    cand, cbits, c, t = found
    out_idx = np.empty(c, np.int64)
    out_val = np.empty(c, x.dtype)
    w = int(_emit_topk(cand, cbits, cbits.view(x.dtype), cbits.dtype.type(_absmask(x)), c, k,
                       cbits.dtype.type(t), True, out_idx, out_val))
    th = float(np.array([t], dtype=cbits.dtype).view(x.dtype)[0])
    return out_idx[:w], out_val[:w], th


# ------------------------------------------------------ threshold selection
@njit(cache=True, inline="always")
def scan_hits(x, threshold, lo, hi, idx, w):
    """Write the indices i in [lo, hi) with |x[i]| >= threshold, x[i] != 0 to idx[w:]; return the new w.

    Blocks of 64 elements: a branch-free (vectorised) pass builds the block's
    64-bit hit mask, then only the set bits are visited (trailing-zero
    count), so the cost is one vector compare per element plus a few
    instructions per hit -- no mispredicted branch per element and no
    scalar loop over the misses. Indices are unsigned so that Numba emits no
    negative-index wraparound, which would block vectorisation.
    """
    i = np.uint64(lo)
    end = np.uint64(hi)
    while i + np.uint64(64) <= end:
        m = np.uint64(0)
        for j in range(64):
            v = x[i + np.uint64(j)]
            m |= np.uint64((abs(v) >= threshold) & (v != 0)) << np.uint64(j)
        while m != np.uint64(0):
            idx[w] = np.int64(i) + np.int64(trailing_zeros(m))
            w += 1
            m &= m - np.uint64(1)
        i += np.uint64(64)
    for k in range(i, end):
        v = x[k]
        if abs(v) >= threshold and v != 0:
            idx[w] = np.int64(k)
            w += 1
    return w


@njit(cache=True)
def _select_by_threshold(x, threshold):
    n = x.size
    idx = np.empty(n, np.int64)  # lazily committed: only the selected pages are touched
    count = scan_hits(x, threshold, 0, n, idx, 0)
    out_idx = idx[:count].copy()
    out_val = np.empty(count, x.dtype)
    for j in range(count):
        out_val[j] = x[out_idx[j]]
    return out_idx, out_val


def select_by_threshold(x: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """COO of the entries with ``|x| >= threshold`` and ``x != 0``, in one pass.

    Returns ``(indices, values)``: int64 indices in ascending order and the
    values in ``x``'s dtype (float32 or float64; other floats are widened to
    float32).
    """
    x = _as_float_vector(x)
    return _select_by_threshold(x, x.dtype.type(threshold))


@njit(cache=True)
def _count_at_least(x, threshold):
    count = 0
    for i in range(x.size):
        v = x[i]
        if abs(v) >= threshold and v != 0:
            count += 1
    return count


def count_at_least(x: np.ndarray, threshold: float) -> int:
    """How many entries :func:`select_by_threshold` would select (no output arrays)."""
    x = _as_float_vector(x)
    return int(_count_at_least(x, x.dtype.type(threshold)))


# -------------------------------------------------- Gaussian estimate (Gaussiank)
@njit(cache=True, fastmath={"reassoc", "contract"})
def _mean_std(x):
    """Mean and unbiased std of ``x`` in float64, two passes.

    ``reassoc`` lets LLVM split each float64 sum over SIMD lanes (a pairwise-
    like order, no less accurate than the sequential one); the result differs
    from the sequential sums only in the last bits of float64.
    """
    n = x.size
    s = 0.0
    for i in range(n):
        s += x[i]
    mean = s / n
    ss = 0.0
    for i in range(n):
        d = x[i] - mean
        ss += d * d
    std = math.sqrt(ss / (n - 1)) if n > 1 else 0.0
    return mean, std


def gaussian_threshold(x: np.ndarray, density: float) -> float:
    """Gaussiank's estimate of the k-th largest ``|x|`` for ``k = density * n``.

    Fits N(mu, sigma^2) with the sample mean and (unbiased) standard deviation
    of ``x`` and returns the right end of its central ``1 - density``
    interval, ``|mu| + sigma * Phi^-1(1 - density / 2)`` (Shi et al. 2019, as
    used in the Ok-Topk paper's Figure 4; ``|mu|`` instead of ``mu`` keeps the
    threshold positive when the mean is negative, which changes nothing for
    the near-zero means of gradients). Two passes over ``x``, no selection.
    """
    x = _as_float_vector(x)
    if x.size == 0:
        return math.inf
    check_density(density)
    mean, std = _mean_std(x)
    return threshold_from_moments(float(mean), float(std), density)


def check_density(density: float) -> None:
    """ValueError unless ``0 < density <= 1``."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")


def threshold_from_moments(mean: float, std: float, density: float) -> float:
    """Gaussiank's threshold ``|mu| + sigma * Phi^-1(1 - density / 2)`` from the moments
    (shared by the CPU and GPU kernels)."""
    from scipy.special import ndtri
    return abs(mean) + std * float(ndtri(1.0 - density / 2.0))


# ------------------------------------------------------------- COO reduction
@njit(cache=True)
def _coo_sum_sorted(indices, values, order):
    """Sum runs of equal ``indices[order]`` (``order`` a stable argsort of ``indices``)."""
    m = indices.size
    out_idx = np.empty(m, np.int64)
    out_val = np.empty(m, np.float64)
    if m == 0:
        return out_idx, out_val
    u = -1
    last = np.int64(-1)
    for j in range(m):
        p = order[j]
        i = indices[p]
        if u < 0 or i != last:
            u += 1
            out_idx[u] = i
            out_val[u] = values[p]
            last = i
        else:
            out_val[u] += values[p]
    return out_idx[:u + 1].copy(), out_val[:u + 1].copy()


def coo_sum(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum a COO list by index: returns ``(unique sorted int64 indices, float64 sums)``.

    Values of equal indices are added in their input order in float64, so the
    result is deterministic and, for a handful of float32 addends, the
    float32 rounding of the sum is the correctly rounded sum.
    """
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    val = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    if idx.size != val.size:
        raise ValueError(f"indices and values differ in length ({idx.size} != {val.size})")
    # NumPy's stable sort (timsort/radix) exploits the P pre-sorted runs a
    # reduction concatenates; Numba's mergesort does not (3.7x slower at 25M).
    order = np.argsort(idx, kind="stable")
    return _coo_sum_sorted(idx, val, order)


def topk_of_coo(indices: np.ndarray, values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The (at most) k entries of largest ``|value|`` of a COO list, zeros dropped, in input order.

    Exactly ``min(k, nonzeros)`` entries (ties broken by introselect), so a
    reduction tree that re-selects with it keeps k entries per level (gTopk).
    """
    nz = values != 0
    indices, values = indices[nz], values[nz]
    if k <= 0:
        return indices[:0], values[:0]
    if values.size > k:
        keep = np.argpartition(np.abs(values), values.size - k)[values.size - k:]
        keep.sort()
        indices, values = indices[keep], values[keep]
    return indices, values


def _as_float_vector(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)
    return x


__all__ = ["add_topk", "coo_sum", "count_at_least", "gaussian_threshold", "kth_largest_abs",
           "select_by_threshold", "select_topk", "topk_by_candidates", "topk_candidates",
           "topk_of_coo"]
