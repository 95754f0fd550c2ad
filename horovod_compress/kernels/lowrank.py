"""Fused passes of GreedyLore's ordinary step (Numba, CPU, one thread).

GreedyLore ("Greedy Low-Rank Gradient Compression for Distributed Learning
with Convergence Guarantees", Sections V-A to V-D, Algorithm 3; eqs. 9a, 9b, 10, 23)
touches the ``m x n`` matrices of a step in three places:

* before the scores: ``A_i = M_i + e_i`` (eq. 9a) and the probe products
  ``v_k = A_i xi_k`` (the shared-probe form of eq. 23; the scores are then
  ``U^T v``, see :mod:`horovod_compress.compressors.greedylore`);
* after the scores' allreduce (which chooses ``Q``): ``C_i = Q^T A_i`` (eq. 10);
* after the projection allreduce: the estimate ``Q C`` (eq. 10) and the new
  error ``e_i = A_i - Q Q^T A_i = A_i - Q C_i`` (eq. 9b, ``C_i = Q^T A_i``).

The error need not be written at all: kept as ``A_i`` and the factors
``(Q, C_i)``, it is applied where it is next read, in the first pass of the
next step (:func:`add_lowrank_and_probe`), which streams the same bytes as
:func:`add_and_probe`.

Written with NumPy the first is two passes over the ``m n`` numbers (add,
then GEMV); :func:`add_and_probe` is one, row by row, with the first probe's
dot product in the addition's loop. :func:`project` reads ``A_i`` for
``C_i`` in row order, four rows per update of ``C_i`` (BLAS's GEMM on this thin
shape is slower up to r = 4). The estimate ``Q C`` is a thin GEMM whose BLAS
``beta = 0`` path first clears the output; :func:`reconstruct` writes it
once. (The error is one BLAS GEMM with ``beta = 1`` in place,
:func:`horovod_compress.compressors.greedylore.subtract_low_rank`.)
The arithmetic is the same; only the order of the float additions differs
from BLAS (``fastmath`` allows re-association and fused multiply-adds,
nothing that changes NaN/Inf handling).

A tall tensor (more rows than columns) is worked on transposed, so its
arrays are row-major in the tensor's own orientation: :func:`add_and_probe_rows`
and :func:`add_lowrank_and_probe_rows` are the first pass for that layout,
one sweep of the short rows with the probe products summed per column.

Arguments must be C-contiguous 2-D arrays of one float dtype; the caller
(``GreedyLore``) falls back to NumPy otherwise.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_FLAGS = {"reassoc", "contract"}


@njit(cache=True, fastmath=_FLAGS)
def add_and_probe(mat: np.ndarray, err: np.ndarray, xi: np.ndarray, out: np.ndarray,
                  dst: np.ndarray) -> None:
    """``dst = mat + err`` (``A = M + e``) and ``out[:, k] = A xi[k]`` in one pass.

    ``mat``, ``err``, ``dst``: (m, n), ``dst`` may be ``err`` (in place) or a
    second buffer (the error is then left as it was, for a step that the
    NaN/Inf agreement may still reject); ``xi``: (probes, n), probes >= 1;
    ``out``: (m, probes). The first probe's dot product runs in the same loop
    as the addition (each ``A`` entry is used while in a register); further
    probes sweep the row again, in L1. The dot products accumulate in float64.
    """
    m, n = err.shape
    probes = xi.shape[0]
    p0 = xi[0]
    for i in range(m):
        row = dst[i]
        old = err[i]
        src = mat[i]
        acc = 0.0
        for j in range(n):
            t = old[j] + src[j]
            row[j] = t
            acc += t * p0[j]
        out[i, 0] = acc
        for k in range(1, probes):
            p = xi[k]
            acc = 0.0
            for j in range(n):
                acc += row[j] * p[j]
            out[i, k] = acc


@njit(cache=True, fastmath=_FLAGS)
def add_lowrank_and_probe(mat: np.ndarray, base: np.ndarray, q: np.ndarray, c: np.ndarray,
                          xi: np.ndarray, out: np.ndarray, dst: np.ndarray) -> None:
    """``dst = mat + base - q @ c`` and ``out[:, k] = dst xi[k]`` in one pass.

    GreedyLore's ``A_i = M_i + e_i`` (eq. 9a) when the error is kept as
    ``e_i = base - Q C_i`` (``base`` the previous ``A_i``, ``q`` m x r the
    previous ``Q``, ``c`` r x n the previous ``C_i = Q^T A_i``; eq. 9b): the
    previous step then never wrote the error, and this pass, which reads
    ``base`` where :func:`add_and_probe` reads ``e``, applies the rank-r
    correction from cache (``c``'s rows) in registers. ``r`` must be a
    multiple of 4 (pad ``q`` and ``c`` with zero columns and rows: exact);
    each further block of four rank terms sweeps the row again in L1. ``dst``
    must not overlap ``base``. ``xi``: (probes, n); ``out``: (m, probes);
    dot products in float64.
    """
    m, n = dst.shape
    r = q.shape[1]
    probes = xi.shape[0]
    p0 = xi[0]
    for i in range(m):
        row = dst[i]
        b = base[i]
        src = mat[i]
        acc = 0.0
        for k in range(0, r, 4):
            w0, w1, w2, w3 = q[i, k], q[i, k + 1], q[i, k + 2], q[i, k + 3]
            c0, c1, c2, c3 = c[k], c[k + 1], c[k + 2], c[k + 3]
            first, last = k == 0, k + 4 >= r
            if first and last:
                for j in range(n):
                    t = b[j] + src[j] - (w0 * c0[j] + w1 * c1[j] + w2 * c2[j] + w3 * c3[j])
                    row[j] = t
                    acc += t * p0[j]
            elif first:
                for j in range(n):
                    row[j] = b[j] + src[j] - (w0 * c0[j] + w1 * c1[j] + w2 * c2[j] + w3 * c3[j])
            elif last:
                for j in range(n):
                    t = row[j] - (w0 * c0[j] + w1 * c1[j] + w2 * c2[j] + w3 * c3[j])
                    row[j] = t
                    acc += t * p0[j]
            else:
                for j in range(n):
                    row[j] -= w0 * c0[j] + w1 * c1[j] + w2 * c2[j] + w3 * c3[j]
        out[i, 0] = acc
        for k in range(1, probes):
            p = xi[k]
            acc = 0.0
            for j in range(n):
                acc += row[j] * p[j]
            out[i, k] = acc


def add_and_probe_rows(mat_t: np.ndarray, err_t: np.ndarray, xi: np.ndarray, out: np.ndarray,
                       dst_t: np.ndarray) -> None:
    """:func:`add_and_probe` on a tall tensor, in the tensor's own (transposed) orientation.

    A GreedyLore tensor with more rows than columns is worked on as
    ``A = M^T`` (m x n, m the short side); its arrays are row-major n x m
    (``mat_t``, ``err_t``, ``dst_t``), so this sweeps their n short rows
    once: ``dst_t = mat_t + err_t`` and ``out[:, k] = A xi[k] = sum_i
    dst_t[i, :] xi[k, i]``, accumulated in float64 (``probes x m`` sums, in
    L1). ``dst_t`` may be ``err_t``. ``xi``: (probes, n); ``out``: (m,
    probes). :func:`add_lowrank_and_probe_rows` with no pending error (r = 0).
    """
    n, m = dst_t.shape
    add_lowrank_and_probe_rows(mat_t, err_t, np.zeros((n, 0), dtype=dst_t.dtype),
                               np.zeros((0, m), dtype=dst_t.dtype), xi, out, dst_t)


@njit(cache=True, fastmath=_FLAGS)
def add_lowrank_and_probe_rows(mat_t: np.ndarray, base_t: np.ndarray, c_t: np.ndarray,
                               q_t: np.ndarray, xi: np.ndarray, out: np.ndarray,
                               dst_t: np.ndarray) -> None:
    """:func:`add_lowrank_and_probe` on a tall tensor, in its own (transposed) orientation.

    ``dst_t = mat_t + base_t - c_t @ q_t``, i.e. ``A_i^T = M_i^T + (base -
    Q C_i)^T`` with ``c_t = C_i^T`` (n x r) and ``q_t = Q^T`` (r x m), and
    ``out[:, k] = A xi[k] = sum_i dst_t[i, :] xi[k, i]`` (``xi``: (probes,
    n); ``out``: (m, probes)), accumulated in float64 (``probes x m`` sums,
    in L1): one sweep of the n short rows, the rank-r correction from
    ``q_t``'s rows in cache. ``r`` must be a multiple of 4 (:func:`pad_rank`),
    and ``dst_t`` must not overlap ``base_t`` unless r = 0
    (:func:`add_and_probe_rows`: no pending error, in place allowed).
    """
    n, m = dst_t.shape
    r = q_t.shape[0]
    probes = xi.shape[0]
    acc = np.zeros((probes, m), dtype=np.float64)
    for i in range(n):
        row = dst_t[i]
        b = base_t[i]
        src = mat_t[i]
        for k in range(0, r, 4):
            w0, w1, w2, w3 = c_t[i, k], c_t[i, k + 1], c_t[i, k + 2], c_t[i, k + 3]
            q0, q1, q2, q3 = q_t[k], q_t[k + 1], q_t[k + 2], q_t[k + 3]
            if k == 0:
                for j in range(m):
                    row[j] = b[j] + src[j] - (w0 * q0[j] + w1 * q1[j] + w2 * q2[j] + w3 * q3[j])
            else:
                for j in range(m):
                    row[j] -= w0 * q0[j] + w1 * q1[j] + w2 * q2[j] + w3 * q3[j]
        if r == 0:
            for j in range(m):
                row[j] = b[j] + src[j]
        for k in range(probes):
            x = xi[k, i]
            a = acc[k]
            for j in range(m):
                a[j] += row[j] * x
    for k in range(probes):
        for j in range(m):
            out[j, k] = acc[k, j]


def pad_rank(q: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``q`` (m x r) and ``c`` (r x n) padded with zero columns / rows to a multiple of 4
    (``q @ c`` unchanged), C-contiguous, for :func:`add_lowrank_and_probe`."""
    r = q.shape[1]
    r4 = -(-r // 4) * 4
    if r4 == r:
        return np.ascontiguousarray(q), np.ascontiguousarray(c)
    qp = np.zeros((q.shape[0], r4), dtype=q.dtype)
    cp = np.zeros((r4, c.shape[1]), dtype=c.dtype)
    qp[:, :r] = q
    cp[:r] = c
    return qp, cp


@njit(cache=True, fastmath=_FLAGS)
def reconstruct(q: np.ndarray, c: np.ndarray, out: np.ndarray) -> None:
    """``out = q @ c`` row by row: ``q`` (m, r), ``c`` (r, n), ``out`` (m, n), r >= 1.

    Four rank terms per sweep of a row (the row stays in L1 between sweeps),
    so the innermost loop runs along the row and vectorizes; the first sweep
    assigns, so ``out`` is written once, without the clearing pass of BLAS's
    ``beta = 0`` GEMM. Each further sweep reads four more rows of ``c`` from
    cache, so BLAS wins from ``r = 6`` on (measured for 2000 x 2000, one thread).
    """
    m, n = out.shape
    r = q.shape[1]
    for i in range(m):
        o = out[i]
        k = 0
        while k < r:
            if r - k >= 4:
                w0, w1, w2, w3 = q[i, k], q[i, k + 1], q[i, k + 2], q[i, k + 3]
                c0, c1, c2, c3 = c[k], c[k + 1], c[k + 2], c[k + 3]
                if k == 0:
                    for j in range(n):
                        o[j] = w0 * c0[j] + w1 * c1[j] + w2 * c2[j] + w3 * c3[j]
                else:
                    for j in range(n):
                        o[j] += w0 * c0[j] + w1 * c1[j] + w2 * c2[j] + w3 * c3[j]
                k += 4
            else:
                w = q[i, k]
                ck = c[k]
                if k == 0:
                    for j in range(n):
                        o[j] = w * ck[j]
                else:
                    for j in range(n):
                        o[j] += w * ck[j]
                k += 1


@njit(cache=True, fastmath=_FLAGS)
def project(a: np.ndarray, q: np.ndarray, c: np.ndarray) -> None:
    """``c = q^T a``: ``a`` (m, n), ``q`` (m, r), ``c`` (r, n), written.

    The projection ``C_i = Q^T A_i`` of eq. 10, one read of ``a`` in row
    order. Each row of ``c`` (in L1/L2) is updated once per four rows of
    ``a``, ``c_k += q[i,k] a_i + q[i+1,k] a_(i+1) + q[i+2,k] a_(i+2) +
    q[i+3,k] a_(i+3)``, a loop with one stored stream, so it vectorizes;
    BLAS's GEMM on this thin shape (``a`` read as the transpose, ``r`` columns)
    is slower. Each entry of ``c`` is summed over the rows in groups of four,
    in order.
    """
    m, n = a.shape
    r = q.shape[1]
    c[...] = 0
    for i0 in range(0, m, 4):
        rows = min(4, m - i0)
        for k in range(r):
            ck = c[k]
            if rows == 4:
                a0, a1, a2, a3 = a[i0], a[i0 + 1], a[i0 + 2], a[i0 + 3]
                w0, w1, w2, w3 = q[i0, k], q[i0 + 1, k], q[i0 + 2, k], q[i0 + 3, k]
                for j in range(n):
                    ck[j] += w0 * a0[j] + w1 * a1[j] + w2 * a2[j] + w3 * a3[j]
            else:
                for t in range(rows):
                    at = a[i0 + t]
                    wt = q[i0 + t, k]
                    for j in range(n):
                        ck[j] += wt * at[j]


@njit(cache=True, fastmath=_FLAGS)
def reconstruct_and_subtract(q: np.ndarray, c: np.ndarray, c_local: np.ndarray,
                             out: np.ndarray, a: np.ndarray) -> None:
    """``out = q @ c`` and ``a -= q @ c_local`` in one sweep of the rows.

    The two writes of an ordinary GreedyLore step after the projection
    allreduce: the estimate ``Q C`` (eq. 10, ``C`` the average over ranks)
    and the new error ``e_i = A_i - Q C_i`` (eq. 9b, ``C_i = Q^T A_i`` this
    rank's). :func:`reconstruct` then a BLAS GEMM with ``beta = 1`` sweep
    the rows twice (a write of ``out``, then a read and a write of ``a``);
    here each row of ``a`` and ``out`` is touched once, four rank terms of
    both products per sweep (the rows of ``c`` and ``c_local`` come from
    cache). ``q`` (m, r), ``c``, ``c_local`` (r, n), ``out``, ``a`` (m, n);
    one float dtype, C-contiguous, r >= 1.
    """
    m, n = out.shape
    r = q.shape[1]
    for i in range(m):
        o = out[i]
        ai = a[i]
        k = 0
        while k < r:
            if r - k >= 4:
                w0, w1, w2, w3 = q[i, k], q[i, k + 1], q[i, k + 2], q[i, k + 3]
                c0, c1, c2, c3 = c[k], c[k + 1], c[k + 2], c[k + 3]
                l0, l1, l2, l3 = c_local[k], c_local[k + 1], c_local[k + 2], c_local[k + 3]
                if k == 0:
                    for j in range(n):
                        o[j] = w0 * c0[j] + w1 * c1[j] + w2 * c2[j] + w3 * c3[j]
                        ai[j] -= w0 * l0[j] + w1 * l1[j] + w2 * l2[j] + w3 * l3[j]
                else:
                    for j in range(n):
                        o[j] += w0 * c0[j] + w1 * c1[j] + w2 * c2[j] + w3 * c3[j]
                        ai[j] -= w0 * l0[j] + w1 * l1[j] + w2 * l2[j] + w3 * l3[j]
                k += 4
            else:
                w = q[i, k]
                ck = c[k]
                lk = c_local[k]
                if k == 0:
                    for j in range(n):
                        o[j] = w * ck[j]
                        ai[j] -= w * lk[j]
                else:
                    for j in range(n):
                        o[j] += w * ck[j]
                        ai[j] -= w * lk[j]
                k += 1
