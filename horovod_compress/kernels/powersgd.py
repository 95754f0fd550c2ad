"""The three ``m x n`` passes of PowerSGD's step (Numba, CPU, one thread).

PowerSGD (Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization", NeurIPS 2019, Algorithm 1 with the error
feedback of Algorithm 2) touches the ``m x n`` matrix of a step three times;
everything else is ``(m + n) x r``:

1. :func:`add_and_project` -- ``M = g + e`` (EF14's accumulator, written once)
   and this rank's ``P_i = M Q``, four rows at a time: the four rows just
   written are still in L1 when they are multiplied by ``Q`` (no second read
   of ``M``, no separate pass for the addition). :func:`project` is the same
   without the addition (``M = g``: no feedback, or the first step).
2. :func:`project_t` -- ``M^T P`` after the allreduce of ``P``: four rows of
   ``M`` at a time, each read once, accumulated into the ``r x n`` result
   (L2-resident) by fused multiply-adds.
3. :func:`low_rank_product` -- the estimate ``P Q^T`` every rank receives
   and, with feedback, the new error ``e = M - P Q^T`` in the same pass: four
   output rows at a time, up to four rank terms per sweep, so the innermost
   loop runs along the rows and vectorizes, each element of ``Q^T`` loaded
   serves four rows (one row at a time read all ``r n`` numbers of ``Q^T``
   from L2 per row, which made the pass L2-bound: 3.0-3.4 ms against 1.8-2.1
   ms at 2000 x 2000, r = 8), the estimate is written once (no clearing
   pass) and the last sweep subtracts it from ``M``.

Measured in a step (2000 x 2000 float32, r = 8, one thread; memcpy of the
matrix 1.1 ms): pass 1 2.5 ms against 1.6 (``np.add``) + 1.7 ms (BLAS ``M
Q``); pass 2 1.1 against 1.5 ms (BLAS on ``M``'s transposed view); pass 3 1.8
against 1.45 (BLAS GEMM into the new array) + 1.5 ms (``np.subtract``). Each
product is ``r m n`` fused multiply-adds, about 0.9 ms with the data in cache
at the 8-lane (256-bit) vectors LLVM picks on this CPU; pass 1 pays it on top
of the addition's memory stream, pass 2 is bound by it, pass 3 hides it behind
its two writes (docs/methods/greedylore.md, "PowerSGD: cost on CPU").

Rounding, exactly (what makes the per-tensor path and the DDP bucket path
agree bit for bit, since both call these functions):

* ``M = g + e``: one float addition per element (``e + g`` when ``M`` is
  written into ``e``'s buffer: the same bits).
* ``M Q``: each ``sum_j M[i, j] Q[j, k]`` is a dot product vectorized by the
  compiler (``fastmath`` re-association and contraction): partial sums per
  lane, then a horizontal sum. The order is fixed for a given machine and
  compiler build (the same on every call), not across CPUs; this is one
  rank's contribution, summed over ranks by the allreduce, so ranks need not
  agree on it.
* ``M^T P``: ``out[j, k] = fma(P[m-1, k], M[m-1, j], ... fma(P[0, k], M[0, j],
  +0))``, one fused multiply-add per row in row order (contraction only, no
  re-association: independent of the vector width and of the blocking).
* ``P Q^T``: ``out[i, j] = fma(P[i, r-1], Q[j, r-1], ... fma(P[i, 0], Q[j, 0],
  +0))``, one fused multiply-add per rank term in ``k`` order (the grouping in
  sweeps of four terms and blocks of four rows does not change it); ``e = M -
  out`` is the same subtraction NumPy does. Every rank computes it from the
  same averaged ``P`` and ``Q``, so every rank gets the same estimate on CPUs
  with FMA (x86-64 with FMA3 -- Intel since Haswell, AMD since Piledriver --
  and ARMv8); LLVM rounds each product and sum separately where the host CPU
  has none, so ranks on mixed CPUs could differ in the last bits (as BLAS's
  GEMM, which the previous code used from rank 5 on, could). Until 2026-11
  this pass had no fused multiply-adds and ran only up to rank 4; the test
  against ``torch``'s ``powerSGD_hook`` bounds both.

Arguments: C-contiguous float32 or float64 arrays of one dtype (:func:`fits`);
callers fall back to NumPy otherwise.
"""
from __future__ import annotations

import numpy as np
from numba import njit

#: the dot products of ``M Q`` are reductions along a row: re-association lets them vectorize
_DOT = {"reassoc", "contract"}
#: ``M^T P`` and ``P Q^T`` vectorize across the row without re-association; contraction
#: makes every ``a + w * b`` one fused multiply-add
_FMA = {"contract"}


@njit(cache=True, fastmath=_DOT)
def _project(x: np.ndarray, e: np.ndarray, acc: np.ndarray, qt: np.ndarray, out: np.ndarray,
             mode: int) -> None:
    """``out = M @ qt.T`` with ``qt``: (r4, n), r4 a multiple of 4; ``out``: (m, r4).

    ``mode`` 0: ``M = x``; 1: ``acc = x + e`` first, ``M = acc``; 2: ``acc`` is
    ``e``: ``acc += x``, ``M = acc``. Rows go four at a time (their additions,
    then a 4 x 4 register block of dot products per four columns of ``Q``),
    the last ``m % 4`` rows one at a time.
    """
    m, n = x.shape
    r4 = qt.shape[0]
    src = acc if mode != 0 else x
    mb = m - m % 4
    for i in range(0, m, 4):
        top = min(i + 4, m)
        if mode == 1:
            for ii in range(i, top):
                t = acc[ii]
                xr = x[ii]
                er = e[ii]
                for j in range(n):
                    t[j] = xr[j] + er[j]
        elif mode == 2:
            for ii in range(i, top):
                t = acc[ii]
                xr = x[ii]
                for j in range(n):
                    t[j] = t[j] + xr[j]
        if i < mb:
            ra, rb, rc, rd = src[i], src[i + 1], src[i + 2], src[i + 3]
            for k in range(0, r4, 4):
                q0, q1, q2, q3 = qt[k], qt[k + 1], qt[k + 2], qt[k + 3]
                va, vb, vc, vd = ra[0], rb[0], rc[0], rd[0]
                u0, u1, u2, u3 = q0[0], q1[0], q2[0], q3[0]
                a0, a1, a2, a3 = va * u0, va * u1, va * u2, va * u3
                b0, b1, b2, b3 = vb * u0, vb * u1, vb * u2, vb * u3
                c0, c1, c2, c3 = vc * u0, vc * u1, vc * u2, vc * u3
                d0, d1, d2, d3 = vd * u0, vd * u1, vd * u2, vd * u3
                for j in range(1, n):
                    va, vb, vc, vd = ra[j], rb[j], rc[j], rd[j]
                    u0, u1, u2, u3 = q0[j], q1[j], q2[j], q3[j]
                    a0 += va * u0
                    a1 += va * u1
                    a2 += va * u2
                    a3 += va * u3
                    b0 += vb * u0
                    b1 += vb * u1
                    b2 += vb * u2
                    b3 += vb * u3
                    c0 += vc * u0
                    c1 += vc * u1
                    c2 += vc * u2
                    c3 += vc * u3
                    d0 += vd * u0
                    d1 += vd * u1
                    d2 += vd * u2
                    d3 += vd * u3
                out[i, k], out[i, k + 1], out[i, k + 2], out[i, k + 3] = a0, a1, a2, a3
                out[i + 1, k], out[i + 1, k + 1], out[i + 1, k + 2], out[i + 1, k + 3] = b0, b1, b2, b3
                out[i + 2, k], out[i + 2, k + 1], out[i + 2, k + 2], out[i + 2, k + 3] = c0, c1, c2, c3
                out[i + 3, k], out[i + 3, k + 1], out[i + 3, k + 2], out[i + 3, k + 3] = d0, d1, d2, d3
        else:
            for ii in range(i, top):
                ra = src[ii]
                for k in range(0, r4, 4):
                    q0, q1, q2, q3 = qt[k], qt[k + 1], qt[k + 2], qt[k + 3]
                    va = ra[0]
                    a0, a1, a2, a3 = va * q0[0], va * q1[0], va * q2[0], va * q3[0]
                    for j in range(1, n):
                        va = ra[j]
                        a0 += va * q0[j]
                        a1 += va * q1[j]
                        a2 += va * q2[j]
                        a3 += va * q3[j]
                    out[ii, k], out[ii, k + 1], out[ii, k + 2], out[ii, k + 3] = a0, a1, a2, a3


@njit(cache=True, fastmath=_FMA)
def _project_t(mat: np.ndarray, p: np.ndarray, outt: np.ndarray, zero: float) -> None:
    """``outt[k, j] = sum_i p[i, k] mat[i, j]`` in row order; ``p``: (m, r4), ``outt``: (r4, n).

    Four rows of ``mat`` at a time (read once from memory, then from L1 for
    every group of four columns of ``p``), the last ``m % 4`` rows one at a time.
    """
    m, n = mat.shape
    r4 = p.shape[1]
    mb = m - m % 4
    for i in range(0, mb, 4):
        a0, a1, a2, a3 = mat[i], mat[i + 1], mat[i + 2], mat[i + 3]
        for k in range(0, r4, 4):
            o0, o1, o2, o3 = outt[k], outt[k + 1], outt[k + 2], outt[k + 3]
            w00, w10, w20, w30 = p[i, k], p[i + 1, k], p[i + 2, k], p[i + 3, k]
            w01, w11, w21, w31 = p[i, k + 1], p[i + 1, k + 1], p[i + 2, k + 1], p[i + 3, k + 1]
            w02, w12, w22, w32 = p[i, k + 2], p[i + 1, k + 2], p[i + 2, k + 2], p[i + 3, k + 2]
            w03, w13, w23, w33 = p[i, k + 3], p[i + 1, k + 3], p[i + 2, k + 3], p[i + 3, k + 3]
            if i == 0:
                for j in range(n):
                    v0, v1, v2, v3 = a0[j], a1[j], a2[j], a3[j]
                    o0[j] = zero + w00 * v0 + w10 * v1 + w20 * v2 + w30 * v3
                    o1[j] = zero + w01 * v0 + w11 * v1 + w21 * v2 + w31 * v3
                    o2[j] = zero + w02 * v0 + w12 * v1 + w22 * v2 + w32 * v3
                    o3[j] = zero + w03 * v0 + w13 * v1 + w23 * v2 + w33 * v3
            else:
                for j in range(n):
                    v0, v1, v2, v3 = a0[j], a1[j], a2[j], a3[j]
                    o0[j] = o0[j] + w00 * v0 + w10 * v1 + w20 * v2 + w30 * v3
                    o1[j] = o1[j] + w01 * v0 + w11 * v1 + w21 * v2 + w31 * v3
                    o2[j] = o2[j] + w02 * v0 + w12 * v1 + w22 * v2 + w32 * v3
                    o3[j] = o3[j] + w03 * v0 + w13 * v1 + w23 * v2 + w33 * v3
    for i in range(mb, m):
        a0 = mat[i]
        for k in range(r4):
            w = p[i, k]
            o = outt[k]
            if i == 0:
                for j in range(n):
                    o[j] = zero + w * a0[j]
            else:
                for j in range(n):
                    o[j] = o[j] + w * a0[j]


@njit(cache=True, fastmath=_FMA)
def _four_rows(p: np.ndarray, i: int, qt: np.ndarray, o0: np.ndarray, o1: np.ndarray,
               o2: np.ndarray, o3: np.ndarray, a0: np.ndarray, a1: np.ndarray, a2: np.ndarray,
               a3: np.ndarray, subtract: bool, zero: float) -> None:
    """Rows ``o0..o3 = p[i:i+4] @ qt`` (and ``a -= o`` if ``subtract``), four rank terms per sweep.

    Each element of ``qt`` loaded serves four rows (a row at a time would read
    all of ``Q^T``, ``r n`` numbers, from L2 once per row: that, not memory,
    was the limit). The last sweep does the subtraction.
    """
    r = p.shape[1]
    n = qt.shape[1]
    k = 0
    while r - k >= 4:
        c0, c1, c2, c3 = qt[k], qt[k + 1], qt[k + 2], qt[k + 3]
        w00, w01, w02, w03 = p[i, k], p[i, k + 1], p[i, k + 2], p[i, k + 3]
        w10, w11, w12, w13 = p[i + 1, k], p[i + 1, k + 1], p[i + 1, k + 2], p[i + 1, k + 3]
        w20, w21, w22, w23 = p[i + 2, k], p[i + 2, k + 1], p[i + 2, k + 2], p[i + 2, k + 3]
        w30, w31, w32, w33 = p[i + 3, k], p[i + 3, k + 1], p[i + 3, k + 2], p[i + 3, k + 3]
        first, sub = k == 0, subtract and k + 4 == r
        if first and not sub:
            for j in range(n):
                u0, u1, u2, u3 = c0[j], c1[j], c2[j], c3[j]
                o0[j] = zero + w00 * u0 + w01 * u1 + w02 * u2 + w03 * u3
                o1[j] = zero + w10 * u0 + w11 * u1 + w12 * u2 + w13 * u3
                o2[j] = zero + w20 * u0 + w21 * u1 + w22 * u2 + w23 * u3
                o3[j] = zero + w30 * u0 + w31 * u1 + w32 * u2 + w33 * u3
        elif not sub:
            for j in range(n):
                u0, u1, u2, u3 = c0[j], c1[j], c2[j], c3[j]
                o0[j] = o0[j] + w00 * u0 + w01 * u1 + w02 * u2 + w03 * u3
                o1[j] = o1[j] + w10 * u0 + w11 * u1 + w12 * u2 + w13 * u3
                o2[j] = o2[j] + w20 * u0 + w21 * u1 + w22 * u2 + w23 * u3
                o3[j] = o3[j] + w30 * u0 + w31 * u1 + w32 * u2 + w33 * u3
        else:
            for j in range(n):
                u0, u1, u2, u3 = c0[j], c1[j], c2[j], c3[j]
                if first:
                    v0, v1, v2, v3 = zero, zero, zero, zero
                else:
                    v0, v1, v2, v3 = o0[j], o1[j], o2[j], o3[j]
                v0 = v0 + w00 * u0 + w01 * u1 + w02 * u2 + w03 * u3
                v1 = v1 + w10 * u0 + w11 * u1 + w12 * u2 + w13 * u3
                v2 = v2 + w20 * u0 + w21 * u1 + w22 * u2 + w23 * u3
                v3 = v3 + w30 * u0 + w31 * u1 + w32 * u2 + w33 * u3
                o0[j], o1[j], o2[j], o3[j] = v0, v1, v2, v3
                a0[j] = a0[j] - v0
                a1[j] = a1[j] - v1
                a2[j] = a2[j] - v2
                a3[j] = a3[j] - v3
        k += 4
    while k < r:                            # the last r % 4 terms, one sweep each
        c = qt[k]
        w0, w1, w2, w3 = p[i, k], p[i + 1, k], p[i + 2, k], p[i + 3, k]
        first, sub = k == 0, subtract and k + 1 == r
        for j in range(n):
            u = c[j]
            if first:
                v0, v1, v2, v3 = zero, zero, zero, zero
            else:
                v0, v1, v2, v3 = o0[j], o1[j], o2[j], o3[j]
            v0 = v0 + w0 * u
            v1 = v1 + w1 * u
            v2 = v2 + w2 * u
            v3 = v3 + w3 * u
            o0[j], o1[j], o2[j], o3[j] = v0, v1, v2, v3
            if sub:
                a0[j] = a0[j] - v0
                a1[j] = a1[j] - v1
                a2[j] = a2[j] - v2
                a3[j] = a3[j] - v3
        k += 1


@njit(cache=True, fastmath=_FMA)
def _low_rank_product(p: np.ndarray, qt: np.ndarray, out: np.ndarray, acc: np.ndarray,
                      subtract: bool, zero: float) -> None:
    """``out = p[:m] @ qt`` and, if ``subtract``, ``acc -= out``; ``p``: (m rounded up to 4) x r.

    Four rows at a time (:func:`_four_rows`); the last ``m % 4`` rows go
    through four scratch rows (``p``'s padding rows are zero), the same
    operations on every element.
    """
    m = out.shape[0]
    n = out.shape[1]
    mb = m - m % 4
    for i in range(0, mb, 4):
        _four_rows(p, i, qt, out[i], out[i + 1], out[i + 2], out[i + 3],
                   acc[i], acc[i + 1], acc[i + 2], acc[i + 3], subtract, zero)
    if mb < m:
        so = np.empty((4, n), dtype=out.dtype)
        sa = np.zeros((4, n), dtype=out.dtype)
        for t in range(m - mb):
            sa[t] = acc[mb + t]
        _four_rows(p, mb, qt, so[0], so[1], so[2], so[3], sa[0], sa[1], sa[2], sa[3],
                   subtract, zero)
        for t in range(m - mb):
            out[mb + t] = so[t]
            if subtract:
                acc[mb + t] = sa[t]


def _pad4(r: int) -> int:
    return (r + 3) // 4 * 4


def _run_project(x: np.ndarray, e: np.ndarray, acc: np.ndarray, q: np.ndarray,
                 mode: int) -> np.ndarray:
    m, n = x.shape
    r = q.shape[1]
    r4 = _pad4(r)
    qt = np.zeros((r4, n), dtype=x.dtype)   # Q^T, padded with zero columns to a multiple of 4
    qt[:r] = q.T
    out = np.empty((m, r4), dtype=x.dtype)
    _project(x, e, acc, qt, out, mode)
    return out if r4 == r else np.ascontiguousarray(out[:, :r])


def project(mat: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``mat @ q`` (``mat``: m x n, ``q``: n x r) as a new C-contiguous (m x r) array."""
    return _run_project(mat, mat, mat, q, 0)


def add_and_project(x: np.ndarray, e: np.ndarray, acc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``acc = x + e`` and ``acc @ q`` (a new (m x r) array) in one pass; ``acc`` may be ``e``.

    ``x``, ``e``, ``acc``: (m x n), C-contiguous, one dtype (:func:`fits`);
    ``acc`` is either ``e``'s memory (then ``acc += x``: the same bits) or
    shares none with ``x`` and ``e``. The product equals :func:`project` of
    ``acc`` afterwards bit for bit (the same dot-product loops, reading the
    rows just written).
    """
    inplace = acc.ctypes.data == e.ctypes.data
    if not inplace and (np.may_share_memory(acc, e) or np.may_share_memory(acc, x)):
        raise ValueError("add_and_project: acc must be e's memory or overlap neither x nor e")
    return _run_project(x, e, acc, q, 2 if inplace else 1)


def project_t(mat: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``mat.T @ p`` (``mat``: m x n, ``p``: m x r) as a new C-contiguous (n x r) array."""
    m, n = mat.shape
    r = p.shape[1]
    r4 = _pad4(r)
    if r4 != r:
        pp = np.zeros((m, r4), dtype=mat.dtype)
        pp[:, :r] = p
    else:
        pp = np.ascontiguousarray(p)
    outt = np.empty((r4, n), dtype=mat.dtype)
    _project_t(mat, pp, outt, mat.dtype.type(0))
    return np.ascontiguousarray(outt[:r].T)


def low_rank_product(p: np.ndarray, q: np.ndarray, out: np.ndarray,
                     acc: np.ndarray | None = None) -> np.ndarray:
    """``out = P Q^T`` (``p``: m x r, ``q``: n x r, ``out``: m x n) and, given ``acc``, ``acc -= out``.

    Returns ``out``. ``r >= 1``; ``out`` and ``acc`` C-contiguous of ``p``'s dtype.
    """
    m, r = p.shape
    qt = np.ascontiguousarray(q.T)
    if m % 4:
        pp = np.zeros((_pad4(m), r), dtype=out.dtype)  # P, padded with zero rows to a multiple of 4
        pp[:m] = p
    else:
        pp = np.ascontiguousarray(p)
    _low_rank_product(pp, qt, out, out if acc is None else acc, acc is not None, out.dtype.type(0))
    return out


def fits(*arrays: np.ndarray) -> bool:
    """Whether the kernels take these arrays: NumPy, C-contiguous, one float32/float64 dtype."""
    dtype = arrays[0].dtype
    return (dtype in (np.float32, np.float64)
            and all(isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.c_contiguous
                    for a in arrays))


__all__ = ["add_and_project", "fits", "low_rank_product", "project", "project_t"]
