"""Fused CPU kernels (Numba) of Ok-Topk's hot path: one pass per O(n) step, merges for O(k) steps.

"Near-Optimal Sparse Allreduce for Distributed Deep Learning" (Ok-Topk,
Li & Hoefler, PPoPP'22) makes a step that reuses its thresholds cost "n
comparisons" for the local selection (Section 3.1.3) and O(k) for the rest
(Algorithm 1, lines 8-14). The kernels here keep it so on the CPU:

* :func:`add_select_at_least` -- Algorithm 2, line 4 (``acc = e + g``) fused
  with Algorithm 1, line 4 on a reused threshold (``{acc_j : |acc_j| >= th,
  acc_j != 0}`` as COO): one read of ``g`` and ``e``, one write of ``acc``,
  the hits written in ascending index order into caller-owned buffers.
  :func:`select_at_least` is the same without the addition.
* :func:`compact_at_least` -- the local guard's re-selection (ours) in place
  over the candidates a stale threshold selected.
* :func:`merge_sum` -- the reduction of split-and-reduce (Algorithm 1, line
  8): the sorted runs (this rank's region and each received message) merged,
  equal indices summed in float64 in run order -- bit for bit what
  :func:`~horovod_compress.kernels.selection.coo_sum` gives on their
  concatenation, without its O(m log m) sort.
* :func:`filter_at_least` -- the reused global threshold (Algorithm 1, line
  13) on the reduced region, with the largest key for the count exchange.
* :func:`intersect_sorted` -- line 14's ``idx_i ∩ indices(u)`` by one merge
  of two ascending lists (no sort, unlike ``np.intersect1d``).
* :func:`densify` -- the dense ``u / P`` the optimizer receives (Algorithm
  2, line 7): calloc'd zeros and one compiled scatter of the quotients.
* :func:`cancel_at` -- EF14's residual update ``e = acc - local`` (Algorithm
  2, line 6) where ``local`` is ``acc`` on the involved indices: O(k).

Every kernel is a pure function of its arguments (no state, no
communication; the selection kernels write into caller-owned buffers, the
others return fresh arrays) and takes float32 or float64 values and int32 or
int64 indices.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros


# ------------------------------------------------------- threshold selection
@njit(cache=True, inline="always")
def _hit_mask64(acc: np.ndarray, i: np.uint64, th: float, z: float) -> np.uint64:
    """Bit j set where ``|acc[i + j]| >= th`` and ``acc[i + j] != 0`` (j < 64; branch-free, vectorises)."""
    m = np.uint64(0)
    for j in range(64):
        v = acc[i + np.uint64(j)]
        m |= np.uint64((abs(v) >= th) & (v != z)) << np.uint64(j)
    return m


@njit(cache=True, inline="always")
def _emit_if_hit(v: float, i: np.uint64, th: float, z: float, out_idx: np.ndarray,
                 out_val: np.ndarray, w: int) -> int:
    """Append (i, v) if ``|v| >= th`` and ``v != 0`` (counting past the buffers' end); the new count."""
    if abs(v) >= th and v != z:
        if w < out_idx.size:
            out_idx[w] = i
            out_val[w] = v
        w += 1
    return w


@njit(cache=True, inline="always")
def _emit_hits(m: np.uint64, base: np.uint64, acc: np.ndarray, out_idx: np.ndarray,
               out_val: np.ndarray, w: int) -> int:
    """Append the hits of the 64-bit mask ``m`` (bit j: element base + j) to the COO buffers,
    counting past their end (the caller grows them and selects again); returns the new count."""
    cap = out_idx.size
    while m != np.uint64(0):
        p = base + trailing_zeros(m)
        if w < cap:
            out_idx[w] = p
            out_val[w] = acc[p]
        w += 1
        m &= m - np.uint64(1)
    return w


@njit(cache=True)
def _add_select(x, e, acc, th, out_idx, out_val, xb, expmask, finite):
    """``acc = x + e``; hits ``|acc| >= th, acc != 0`` to ``out_*`` while they fit; returns the count.

    Blocks of 64: the sums are written (vectorised), their compare builds a
    64-bit hit mask (vectorised, branch-free), then only the set bits are
    visited. Unsigned indices: no wraparound checks to block vectorisation.
    ``finite[0]`` is set to whether every ``x`` is finite: the smallest
    ``~bits(x) & expmask`` (``xb`` the unsigned view of ``x``, ``expmask`` its
    exponent field) is 0 exactly when an exponent field is all ones (Inf or
    NaN) -- a vector min on data already in registers, not a second read.
    """
    n = np.uint64(x.size)
    w = 0
    i = np.uint64(0)
    z = acc.dtype.type(0)
    low = expmask
    while i + np.uint64(64) <= n:
        for j in range(64):
            acc[i + np.uint64(j)] = x[i + np.uint64(j)] + e[i + np.uint64(j)]
        for j in range(64):
            low = min(low, (~xb[i + np.uint64(j)]) & expmask)
        w = _emit_hits(_hit_mask64(acc, i, th, z), i, acc, out_idx, out_val, w)
        i += np.uint64(64)
    while i < n:
        v = x[i] + e[i]
        acc[i] = v
        low = min(low, (~xb[i]) & expmask)
        w = _emit_if_hit(v, i, th, z, out_idx, out_val, w)
        i += np.uint64(1)
    finite[0] = low != 0
    return w


@njit(cache=True)
def _select(acc, th, out_idx, out_val):
    """:func:`_add_select` without the addition (``acc`` only read)."""
    n = np.uint64(acc.size)
    w = 0
    i = np.uint64(0)
    z = acc.dtype.type(0)
    while i + np.uint64(64) <= n:
        w = _emit_hits(_hit_mask64(acc, i, th, z), i, acc, out_idx, out_val, w)
        i += np.uint64(64)
    while i < n:
        w = _emit_if_hit(acc[i], i, th, z, out_idx, out_val, w)
        i += np.uint64(1)
    return w


def add_select_at_least(x: np.ndarray, e: np.ndarray, acc: np.ndarray, threshold: float,
                        out_idx: np.ndarray, out_val: np.ndarray,
                        report: dict | None = None) -> int:
    """``acc = x + e`` and the COO of ``{j : |acc_j| >= threshold, acc_j != 0}``, in one pass.

    EF14's accumulation (Ok-Topk, Algorithm 2, line 4) fused with the
    selection by a reused threshold (Algorithm 1, line 4; Section 3.1.3). All
    of ``x``, ``e``, ``acc`` flat and of one float dtype; ``threshold`` is
    rounded to that dtype first (as :func:`~horovod_compress.kernels.selection.select_by_threshold`
    does). The hits are written in ascending index order to ``out_idx`` /
    ``out_val`` as long as they fit; the return value is the number of hits,
    which may exceed ``out_idx.size`` (then only the first ``out_idx.size``
    were written, and ``acc`` is complete all the same). ``report`` (a dict,
    optional) receives ``report["finite"]``: whether every entry of ``x`` is
    finite, found in the same pass (what the NaN/Inf check of
    :meth:`~horovod_compress.compressors.base.Method.allreduce` needs, without
    reading ``x`` again).
    """
    if x.dtype == np.float64:
        xb, expmask = x.view(np.uint64), np.uint64(0x7FF0000000000000)
    else:
        xb, expmask = x.view(np.uint32), np.uint32(0x7F800000)
    finite = np.ones(1, np.bool_)
    count = int(_add_select(x, e, acc, acc.dtype.type(threshold), out_idx, out_val, xb,
                            expmask, finite))
    if report is not None:
        report["finite"] = bool(finite[0])
    return count


def select_at_least(acc: np.ndarray, threshold: float, out_idx: np.ndarray,
                    out_val: np.ndarray) -> int:
    """:func:`add_select_at_least` on an accumulator that is already formed (read only)."""
    return int(_select(acc, acc.dtype.type(threshold), out_idx, out_val))


@njit(cache=True)
def _compact(idx, val, count, th):
    # branch-free: every entry is written at w, w advances when it is kept (a kept/dropped
    # pattern of random candidates would mispredict a branch about every other entry)
    w = 0
    for j in range(count):
        v = val[j]
        c = idx[j]
        idx[w] = c
        val[w] = v
        w += (abs(v) >= th) & (v != 0)
    return w


def compact_at_least(idx: np.ndarray, val: np.ndarray, count: int, threshold: float) -> int:
    """Keep, in place and in order, the first ``count`` entries with ``|val| >= threshold`` (nonzero).

    ``threshold`` is rounded to ``val``'s dtype. Returns how many were kept
    (they now fill ``idx[:kept]``, ``val[:kept]``).
    """
    return int(_compact(idx, val, int(count), val.dtype.type(threshold)))


# ------------------------------------------------------------ sparse reduce
@njit(cache=True)
def _merge_sum(a_idx, a_val, b_idx, b_val, starts, out_idx, out_val):
    """Merge run ``a`` and runs ``b[starts[r]:starts[r+1]]`` (all ascending); float64 sums in run order."""
    nr = starts.size - 1
    pos = np.empty(nr, np.int64)
    for r in range(nr):
        pos[r] = starts[r]
    pa = 0
    na = a_idx.size
    big = np.int64(0x7FFFFFFFFFFFFFFF)
    w = 0
    while True:
        cur = big
        if pa < na:
            cur = np.int64(a_idx[pa])
        for r in range(nr):
            if pos[r] < starts[r + 1]:
                c = np.int64(b_idx[pos[r]])
                if c < cur:
                    cur = c
        if cur == big:
            break
        s = 0.0
        first = True
        if pa < na and np.int64(a_idx[pa]) == cur:
            s = np.float64(a_val[pa])
            first = False
            pa += 1
        for r in range(nr):
            q = pos[r]
            if q < starts[r + 1] and np.int64(b_idx[q]) == cur:
                if first:
                    s = np.float64(b_val[q])
                    first = False
                else:
                    s += np.float64(b_val[q])
                pos[r] = q + 1
        out_idx[w] = cur
        out_val[w] = s
        w += 1
    return w


def merge_sum(a_idx: np.ndarray, a_val: np.ndarray, b_idx: np.ndarray, b_val: np.ndarray,
              starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum of sorted COO runs: run ``a`` first, then ``b[starts[r]:starts[r+1]]`` for r = 0, 1, ...

    Every run holds strictly ascending indices (as every region of a local
    top-k and every split-and-reduce message does, Ok-Topk Algorithm 1, line
    8). Returns ``(unique ascending int64 indices, float64 sums)`` where each
    sum adds the entries of equal index in run order, starting from the first
    -- exactly what :func:`~horovod_compress.kernels.selection.coo_sum` returns
    for the concatenation ``a, b`` (it adds duplicates in input order), in one
    linear merge: O(m R) for R runs instead of a sort.
    """
    m = a_idx.size + b_idx.size
    out_idx = np.empty(m, np.int64)
    out_val = np.empty(m, np.float64)
    w = int(_merge_sum(a_idx, a_val, b_idx, b_val, np.asarray(starts, np.int64), out_idx, out_val))
    return out_idx[:w], out_val[:w]


@njit(cache=True)
def _filter(idx, val, th, out_idx, out_val):
    w = 0
    top = np.float64(0.0)
    for j in range(val.size):
        v = val[j]
        if abs(v) >= th and v != 0:
            out_idx[w] = idx[j]
            out_val[w] = v
            w += 1
            if abs(v) > top:
                top = abs(v)
    return w, top


def filter_at_least(idx: np.ndarray, val: np.ndarray, threshold: float
                    ) -> tuple[np.ndarray, np.ndarray, float]:
    """``(idx[keep], val[keep], max |val[keep]|)`` for ``keep = |val| >= threshold, val != 0``.

    ``threshold`` rounded to ``val``'s dtype (Ok-Topk, Algorithm 1, line 13:
    a reduced region filtered by the reused global threshold); the largest
    magnitude is 0.0 when nothing is kept.
    """
    out_idx = np.empty(idx.size, np.int64)
    out_val = np.empty(val.size, val.dtype)
    w, top = _filter(idx, val, val.dtype.type(threshold), out_idx, out_val)
    return out_idx[:w], out_val[:w], float(top)


# ----------------------------------------------------- line 14 and the output
@njit(cache=True)
def _intersect(a, b, out):
    i = 0
    j = 0
    w = 0
    na = a.size
    nb = b.size
    while i < na and j < nb:        # branch-free steps: out[w] is kept only on a match
        x = np.int64(a[i])
        y = np.int64(b[j])
        out[w] = x
        w += x == y
        i += x <= y
        j += y <= x
    return w


def intersect_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.intersect1d(a, b, assume_unique=True)`` for strictly ascending ``a``, ``b``: one merge, int64."""
    out = np.empty(min(a.size, b.size), np.int64)
    return out[:int(_intersect(a, b, out))]


@njit(cache=True)
def _cancel(acc, idx):
    for j in range(idx.size):
        i = idx[j]
        acc[i] = acc[i] - acc[i]


def cancel_at(acc: np.ndarray, idx: np.ndarray) -> None:
    """``acc[i] = acc[i] - acc[i]`` at the (distinct) indices ``idx``: EF14's ``e = acc - local``.

    Ok-Topk's ``local`` is ``acc`` itself on the involved indices (Algorithm
    2, line 6), so the residual update is this: the bits of building the
    dense ``local`` and subtracting it (+0 for a finite entry), in one
    read-modify-write per index and without the dense ``local``.
    """
    _cancel(acc, idx)


@njit(cache=True)
def _scatter_div(out, idx, val, p):
    for j in range(idx.size):
        out[idx[j]] = val[j] / p


def densify(n: int, idx: np.ndarray, val: np.ndarray, divisor: int, dtype: np.dtype) -> np.ndarray:
    """A fresh dense vector: ``val / divisor`` at ``idx``, zeros elsewhere (Ok-Topk, Algorithm 2, line 7).

    ``val`` is cast to ``dtype`` and divided by ``dtype(divisor)`` in ``dtype``
    (NumPy's rounding of ``val / dtype.type(divisor)``; a later duplicate
    index overwrites an earlier one, as NumPy's assignment does). The zeros
    come from ``np.zeros`` (calloc: fresh pages are zero already, reused
    memory is cleared by libc's ``memset``), then one compiled scatter -- no
    temporary for the quotients.
    """
    dtype = np.dtype(dtype)
    out = np.zeros(n, dtype)
    _scatter_div(out, idx, np.asarray(val, dtype=dtype), dtype.type(divisor))
    return out


__all__ = ["add_select_at_least", "cancel_at", "compact_at_least", "densify", "filter_at_least",
           "intersect_sorted", "merge_sum", "select_at_least"]
