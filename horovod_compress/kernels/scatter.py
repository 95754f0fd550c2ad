"""Exact top-k packing and COO scatter kernels (Numba, CPU) for the allgather sparsifiers.

TopkA and its relatives (Ok-Topk paper, Table 1; SparCML, Renggli et al.
SC'19, Section 4) send each rank's exact local top-k of ``|x|`` as k
``(index, value)`` pairs and sum what every rank sent. The hot loops are:

* :func:`topk_coo` -- the exact top-k as COO in one pass over ``x`` once the
  k-th largest magnitude ``t`` is known (:func:`kernels.selection.kth_largest_abs`,
  a 2-pass radix select): every entry with ``|x_j| > t`` is kept, then the
  first (lowest-index) entries with ``|x_j| == t`` until exactly k are held.
  Zeros are never selected; when ``x`` has fewer than k nonzeros the message
  is padded with ``(index 0, value 0.0)`` pairs, so every rank sends the same
  2k words (an allgather needs equal sizes) and the padding adds nothing.
* :func:`scatter_add` -- ``out[idx_j] += scale * val_j`` in the values' dtype
  (no float64 ``bincount`` and no dense temporary).
* :func:`scatter_set` / :func:`scatter_clear` -- write and later erase the k
  selected entries of a reused dense buffer, so the per-step dense ``local``
  vector costs O(k) instead of an allocation plus n page faults.

The CuPy path of the compressors keeps using ``xp`` array expressions; these
kernels are for NumPy arrays only.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .arrays import get_array_module


@njit(cache=True)
def _topk_coo(x, thr, k, out_idx, out_val):
    """Fill ``out_idx[:k]``/``out_val[:k]``; return how many entries are real (the rest is padding).

    Entries above ``thr`` are written from the front in index order; ties
    (``|x_j| == thr``, ``x_j != 0``) from the back. A new above-threshold
    entry that finds no free slot evicts the most recent tie, so the ties
    kept are the first ones in index order. Since ``thr`` is the exact k-th
    largest magnitude, above-threshold entries number fewer than k.
    """
    w = 0            # next front slot
    t = k - 1        # next back slot (ties)
    for j in range(x.size):
        v = x[j]
        a = abs(v)
        if a >= thr and v != 0:
            if a > thr:
                if w > t:
                    t += 1          # evict the latest tie
                out_idx[w] = j
                out_val[w] = v
                w += 1
            elif w <= t:
                out_idx[t] = j
                out_val[t] = v
                t -= 1
    # move the ties (slots t+1 .. k-1, in reverse index order) right after the front, in index order
    nt = k - 1 - t
    lo = t + 1
    hi = k - 1
    while lo < hi:                      # reverse the ties in place: index order
        out_idx[lo], out_idx[hi] = out_idx[hi], out_idx[lo]
        out_val[lo], out_val[hi] = out_val[hi], out_val[lo]
        lo += 1
        hi -= 1
    if w < t + 1:                       # shift them down (destination below source: ascending copy is safe)
        for q in range(nt):
            out_idx[w + q] = out_idx[t + 1 + q]
            out_val[w + q] = out_val[t + 1 + q]
    real = w + nt
    for q in range(real, k):
        out_idx[q] = 0
        out_val[q] = 0
    return real


def topk_coo(x: np.ndarray, thr: float, k: int, out_idx: np.ndarray,
             out_val: np.ndarray) -> int:
    """Exact top-k of ``|x|`` given its k-th largest magnitude ``thr``, as COO, in one pass.

    ``x`` is a flat float32/float64 NumPy vector, ``thr = kth_largest_abs(x, k)``,
    ``out_idx`` (int32 or int64) and ``out_val`` (``x``'s dtype) hold at least
    ``k`` slots. Writes the selected ``(index, value)`` pairs to the first
    ``real`` slots -- all entries with ``|x_j| > thr`` in ascending index
    order, then the lowest-index entries with ``|x_j| == thr`` -- and pads
    ``k - real`` slots with ``(0, 0.0)``. Returns ``real = min(k, nnz(x))``.
    """
    if k <= 0:
        return 0
    return int(_topk_coo(x, x.dtype.type(thr), int(k), out_idx, out_val))


@njit(cache=True)
def _topk_coo_radix32(x, bits, k, out_idx, out_val):
    """Exact top-k of float32 ``x`` (``bits`` its uint32 view) in two passes; returns ``real``.

    The radix select of :func:`kernels.selection.kth_largest_abs` fused with
    the packing: pass 1 histograms the top 16 bits of the keys
    ``bits & 0x7FFFFFFF`` (which order like ``|x|``) and finds the digit d1
    holding the k-th largest key. Pass 2 writes every entry whose top digit
    is above d1 straight to the output (all of them are in the top k) and
    collects the entries with top digit d1 -- the only candidates left, in
    index order -- while histogramming their low 16 bits; the low digit d2
    then gives the exact k-th largest key T = d1 << 16 | d2, and the
    candidates above T plus the first ``k - written`` candidates equal to T
    complete the selection (the same set as :func:`topk_coo`: above the
    k-th largest magnitude, then the lowest-index ties). Zeros are never
    selected; missing entries are padded with ``(0, 0.0)``.
    """
    n = x.size
    hist = np.zeros(65536, np.int64)
    for i in range(n):
        hist[(bits[i] & np.uint32(0x7FFFFFFF)) >> np.uint32(16)] += 1
    remaining = k
    d1 = 65535
    while d1 > 0 and hist[d1] < remaining:
        remaining -= hist[d1]
        d1 -= 1
    ncand = hist[d1]
    cand = np.empty(ncand, np.int64)
    hist[:] = 0
    w = 0
    c = 0
    hi1 = np.uint32(d1)
    for i in range(n):
        key = bits[i] & np.uint32(0x7FFFFFFF)
        hi = key >> np.uint32(16)
        if hi > hi1:
            out_idx[w] = i
            out_val[w] = x[i]
            w += 1
        elif hi == hi1:
            cand[c] = i
            c += 1
            hist[key & np.uint32(0xFFFF)] += 1
    d2 = 65535
    while d2 > 0 and hist[d2] < remaining:
        remaining -= hist[d2]
        d2 -= 1
    t = (np.uint32(d1) << np.uint32(16)) | np.uint32(d2)
    ties = remaining if t != np.uint32(0) else 0      # a zero key is never selected
    for j in range(c):
        i = cand[j]
        key = bits[i] & np.uint32(0x7FFFFFFF)
        if key > t or (key == t and ties > 0):
            if key == t:
                ties -= 1
            out_idx[w] = i
            out_val[w] = x[i]
            w += 1
    for q in range(w, k):
        out_idx[q] = 0
        out_val[q] = 0
    return w


def topk_coo_float32(x: np.ndarray, k: int, out_idx: np.ndarray, out_val: np.ndarray) -> int:
    """Exact top-k of a flat float32 vector as COO in two passes (see :func:`_topk_coo_radix32`).

    Same contract as :func:`topk_coo` without a precomputed threshold:
    ``k`` slots of ``out_idx``/``out_val`` written, the first ``real =
    min(k, nnz)`` real entries (above the k-th largest ``|x|`` in index
    order, then the lowest-index ties), the rest ``(0, 0.0)``. Returns ``real``.
    """
    if k <= 0:
        return 0
    if k > x.size:
        raise ValueError(f"k = {k} exceeds the {x.size} entries")
    return int(_topk_coo_radix32(x, x.view(np.uint32), int(k), out_idx, out_val))


@njit(cache=True)
def _scatter_add(out, idx, val, scale):
    for j in range(idx.size):
        out[idx[j]] += val[j] * scale


@njit(cache=True)
def _scatter_add_noscale(out, idx, val):
    for j in range(idx.size):
        out[idx[j]] += val[j]


def scatter_add(out: np.ndarray, idx: np.ndarray, val: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """``out[idx_j] += scale * val_j`` for every j, in order (duplicates add), in ``out``'s dtype.

    With ``scale = 1/P`` for P a power of two the scaling is exact, so the
    result equals ``(sum_j val_j) / P`` bit for bit (the sum of a COO
    allgather, Ok-Topk paper Table 1, "TopkA"). Returns ``out``.
    """
    val = np.ascontiguousarray(val, dtype=out.dtype)
    if scale == 1.0:
        _scatter_add_noscale(out, idx, val)
    else:
        _scatter_add(out, idx, val, out.dtype.type(scale))
    return out


@njit(cache=True)
def _scatter_set(out, idx, src, count):
    for j in range(count):
        i = idx[j]
        out[i] = src[i]


def scatter_set(out: np.ndarray, idx: np.ndarray, src: np.ndarray, count: int | None = None) -> np.ndarray:
    """``out[idx_j] = src[idx_j]`` for the first ``count`` indices (default all). Returns ``out``."""
    _scatter_set(out, idx, src, idx.size if count is None else int(count))
    return out


@njit(cache=True)
def _scatter_clear(out, idx, count):
    for j in range(count):
        out[idx[j]] = 0


def scatter_clear(out: np.ndarray, idx: np.ndarray, count: int | None = None) -> np.ndarray:
    """``out[idx_j] = 0`` for the first ``count`` indices (default all). Returns ``out``."""
    _scatter_clear(out, idx, idx.size if count is None else int(count))
    return out


@njit(cache=True)
def _subtract_at(acc, local, idx, count):
    diff = np.empty(count, acc.dtype)
    for j in range(count):       # all differences first: a repeated index subtracts once,
        i = idx[j]               # as NumPy's ``acc[idx] -= local[idx]`` does
        diff[j] = acc[i] - local[i]
    for j in range(count):
        acc[idx[j]] = diff[j]


def subtract_at(acc: np.ndarray, local: np.ndarray, idx: np.ndarray, count: int | None = None) -> np.ndarray:
    """``acc[i] -= local[i]`` at the first ``count`` indices ``i`` of ``idx`` (default all), flat
    arrays of one dtype; a repeated index subtracts once (EF14's ``e = acc - local`` where ``local`` is zero
    elsewhere, without NumPy's two gathers and a scatter). Returns ``acc``."""
    _subtract_at(acc, local, idx, idx.size if count is None else int(count))
    return acc


@njit(cache=True)
def _cancel_at(acc, idx, count):
    for j in range(count):
        i = idx[j]
        acc[i] = acc[i] - acc[i]


def cancel_at(acc: np.ndarray, idx: np.ndarray, count: int | None = None) -> np.ndarray:
    """``acc[i] = acc[i] - acc[i]`` at the first ``count`` (distinct) indices of ``idx``.

    EF14's residual update ``e = acc - local`` for a sparsifier whose ``local``
    is ``acc`` itself on its support (TopkA sends its entries unchanged): the
    same bits as building ``local`` and subtracting (+0 for a finite entry,
    NaN for an infinite one), in one read-modify-write per index and without
    the dense ``local``. Returns ``acc``.
    """
    _cancel_at(acc, idx, idx.size if count is None else int(count))
    return acc


@njit(cache=True)
def _scatter_add_rows(out, idx, block, scale):
    n = out.shape[1]
    for j in range(idx.size):
        r = idx[j]
        for c in range(n):
            out[r, c] += block[j, c] * scale


def scatter_add_rows(out: np.ndarray, idx: np.ndarray, block: np.ndarray,
                     scale: float = 1.0) -> np.ndarray:
    """``out[idx_j, :] += scale * block[j, :]`` for every j in order (row-sparse COO sum).

    The row analogue of :func:`scatter_add` for the Top-K-rows baseline of
    ARC-Top-K (an allgather of (row indices, rows), summed). Returns ``out``.
    """
    block = np.ascontiguousarray(block, dtype=out.dtype).reshape(idx.size, out.shape[1])
    _scatter_add_rows(out, idx, block, out.dtype.type(scale))
    return out


class SparseScratch:
    """A reused dense vector that is all zeros except at the indices last written.

    :meth:`fill` erases the previous call's entries (O(k)) and writes
    ``out[idx] = src[idx]``: the dense ``local`` part of the sparsifiers'
    ``_reduce`` without allocating and faulting in n zeros each step. The
    returned array is only valid until the next :meth:`fill`; error feedback
    consumes ``local`` within the call (``e = acc - local`` or ``g += c``).
    """

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self.idx: np.ndarray = np.empty(0, np.int64)
        self.count = 0

    def fill(self, n: int, dtype: np.dtype, idx: np.ndarray, src: np.ndarray,
             count: int | None = None) -> np.ndarray:
        """The reused n-element buffer holding ``src[:count]`` at ``idx[:count]`` and zeros elsewhere.

        Only the entries the previous call set are cleared, so a call costs O(count), not O(n).
        """
        dtype = np.dtype(dtype)
        if self.buf is None or self.buf.size != n or self.buf.dtype != dtype:
            self.buf = np.zeros(n, dtype)
        else:
            _scatter_clear(self.buf, self.idx, self.count)
        count = idx.size if count is None else int(count)
        _scatter_set(self.buf, idx, src, count)
        self.idx = idx.copy() if count == idx.size else idx[:count].copy()
        self.count = count
        return self.buf

    def support_of(self, array: np.ndarray) -> np.ndarray | None:
        """The indices written by the last :meth:`fill` if ``array`` is its buffer (any C-order shape).

        Outside them the buffer is zero, so ``acc - array`` changes ``acc``
        only there: error feedback subtracts in O(k) instead of O(n).
        ``None`` when ``array`` is not this buffer.
        """
        buf = self.buf
        if (buf is None or not isinstance(array, np.ndarray) or array.size != buf.size
                or not array.flags.c_contiguous
                or array.__array_interface__["data"][0] != buf.__array_interface__["data"][0]):
            return None
        return self.idx


class RowScratch:
    """A reused m x n matrix that is zero except in the rows last written (row-sparse ``local``).

    :meth:`fill` zeroes the previous call's K rows and copies ``block`` into
    ``rows``: ARC-Top-K's and the row baselines' ``[U]_{I,:}`` (ARC-Top-K
    paper, eq. 5) in O(K n) instead of a fresh m x n allocation. Valid until
    the next :meth:`fill` (feedback consumes ``local`` within the call).
    """

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self.rows: np.ndarray = np.empty(0, np.int64)

    def fill(self, block: np.ndarray, rows: np.ndarray, m: int) -> np.ndarray:
        """The reused m x n matrix holding ``block`` at ``rows`` and zeros elsewhere (O(K n) per call)."""
        n = block.shape[1]
        if self.buf is None or self.buf.shape != (m, n) or self.buf.dtype != block.dtype:
            self.buf = np.zeros((m, n), dtype=block.dtype)
        else:
            self.buf[self.rows] = 0
        self.buf[rows] = block
        self.rows = np.array(rows, dtype=np.int64, copy=True)
        return self.buf


def row_local(method: object, name: str, block: np.ndarray, rows: np.ndarray, m: int) -> np.ndarray:
    """``[block]_{rows,:}`` as an m x n NumPy matrix in a per-(method, tensor) :class:`RowScratch`."""
    scratch = method.scratch.rows.setdefault(name, RowScratch())
    return scratch.fill(block, rows, m)


def is_power_of_two(p: int) -> bool:
    """Whether scaling by ``1/p`` is exact in binary floating point."""
    return p > 0 and (p & (p - 1)) == 0


def scatter_sum(n: int, indices: np.ndarray, values: np.ndarray, dtype: np.dtype,
                scale: float = 1.0) -> np.ndarray:
    """Dense length-n vector ``scale * sum`` of ``values`` at ``indices`` (duplicates add).

    NumPy: a compiled scatter-add in ``dtype`` into fresh zeros
    (:func:`scatter_add`); ``scale`` is
    applied per value when it is a power of two's reciprocal (exact, so equal
    to scaling the sum) and to the sum otherwise. float64 ``values`` for a
    narrower ``dtype`` (a caller asking for a float64 sum, e.g. DeepReduce)
    and CuPy arrays: ``bincount`` in float64, then the cast and the scale.
    """
    xp = get_array_module(values)
    if xp is np and not (values.dtype == np.float64 and np.dtype(dtype) != np.float64):
        out = np.zeros(n, dtype=dtype)
        exact = scale == 1.0 or (1.0 / scale).is_integer() and is_power_of_two(int(1.0 / scale))
        scatter_add(out, indices, values, scale if exact else 1.0)
        if not exact:
            out *= out.dtype.type(scale)
        return out
    if indices.size == 0:
        out = xp.zeros(n, dtype=dtype)
    else:
        out = xp.bincount(indices, weights=values, minlength=n).astype(dtype, copy=False)
    return out if scale == 1.0 else out * out.dtype.type(scale)


__all__ = ["RowScratch", "SparseScratch", "row_local", "is_power_of_two", "scatter_add", "scatter_add_rows", "scatter_clear",
           "scatter_set", "scatter_sum", "subtract_at", "cancel_at", "topk_coo", "topk_coo_float32"]
