"""``hvdc bench kernels``: every CPU kernel against a memcpy and the library call it replaces.

For each kernel and each size n (default 1M and 25M elements) one run
measures, with the same inputs:

* the kernel (best of ``--repeat`` timed calls after one warm-up call that
  also pays Numba's compilation), interleaved with the other columns;
* a memcpy of the kernel's input bytes (``np.copyto`` into a preallocated
  buffer) -- the speed of light of a kernel that must read its input once
  and write a result of about the same size;
* the pure-NumPy code the kernel replaces (same algorithm, same random words
  where it is randomized, so the outputs are compared and must be equal);
* the obvious library call where there is one (``torch.topk``,
  ``np.partition``, NumPy QSGD with NumPy's generator, MPI's float32 sum).

Ratios: "x memcpy" = kernel time / memcpy time (1 = speed of light), "x lib"
and "x NumPy" = library time / kernel time (> 1: the kernel is faster).
Writes ``benchmarks/kernels.md``, ``benchmarks/kernels.json`` and
``benchmarks/kernels.png`` (kernel time over memcpy time per kernel and size).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .machine import cpu_model
from .report_files import save_figure

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)
KEY = 0x5EED5EED12345678


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="kernel speed vs memcpy and vs the library calls they replace",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_bench_options(p, repeat=5, out="benchmarks/kernels.md")
    p.set_defaults(func=run)


def add_kernel_bench_options(p: argparse.ArgumentParser, repeat: int, out: str) -> None:
    """The options of ``hvdc bench kernels`` and ``kernels-gpu`` (checked by :func:`checked_args`)."""
    p.add_argument("--sizes", default="1000000,25000000",
                   help="comma-separated element counts (default 1000000,25000000)")
    p.add_argument("--repeat", type=int, default=repeat,
                   help=f"timed calls per measurement, best taken (default {repeat})")
    p.add_argument("--density", type=float, default=0.01, help="selection density (default 0.01)")
    p.add_argument("--only", default="", help="comma-separated kernel names to run (default: all)")
    p.add_argument("--out", default=out, help="markdown output; its json (and plot) go beside it")
    p.add_argument("--note", default="", help="a line about the machine, written into the report")


# ------------------------------------------------------------- NumPy references
def np_mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * M1
    z = (z ^ (z >> np.uint64(27))) * M2
    return z ^ (z >> np.uint64(31))


def np_words(key: int, start: int, n: int) -> np.ndarray:
    i = np.arange(start + 1, start + 1 + n, dtype=np.uint64)
    return np_mix(np.uint64(key) + i * GOLDEN)


def np_uniforms(key: int, n: int) -> np.ndarray:
    return (np_words(key, 0, n) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def np_linear_quantize(x: np.ndarray, scale: float, levels: int, key: int) -> np.ndarray:
    xd = x.astype(np.float64)
    y = np.abs(xd) * scale * levels
    lo = np.floor(y)
    q = lo + (np_uniforms(key, x.size) < (y - lo))
    q = np.minimum(q, levels)
    q[~((y > 0) & np.isfinite(y))] = 0
    return np.where(xd < 0, -q, q).astype(np.int8)


def np_qsgd_library(x: np.ndarray, scale: float, levels: int, rng: np.random.Generator) -> np.ndarray:
    """The usual NumPy QSGD: floor(y + U) with NumPy's own generator."""
    y = np.abs(x) * np.float32(scale * levels)
    q = np.floor(y + rng.random(x.size, dtype=np.float32))
    return (np.sign(x) * q).astype(np.int8)


def np_exp_quantize(x: np.ndarray, scale: float, emax: int, sign_shift: int, key: int) -> np.ndarray:
    xd = x.astype(np.float64)
    a = np.abs(xd) * scale
    m, ex = np.frexp(a)
    e_low = 1 - ex.astype(np.int64)
    u = np_uniforms(key, x.size)
    e_in = np.maximum(np.where(u < 2.0 * m - 1.0, e_low - 1, e_low), 1)
    e_tiny = np.where(u < np.ldexp(a, emax), emax, 0)
    e = np.where(e_low > emax, e_tiny, e_in)
    e[~((a > 0) & np.isfinite(a))] = 0
    neg = (xd < 0) & (e > 0)
    return (e | (neg.astype(np.int64) << sign_shift)).astype(np.uint8)


def np_exp_dequantize(codes: np.ndarray, scale: float, sign_shift: int) -> np.ndarray:
    c = codes.astype(np.int64)
    e = c & ((1 << sign_shift) - 1)
    val = np.ldexp(scale, -e)
    val[e == 0] = 0.0
    return np.where((c >> sign_shift) & 1, -val, val).astype(np.float32)


def np_exp_reduce(a: np.ndarray, b: np.ndarray, r: np.ndarray, sign_shift: int) -> np.ndarray:
    """Algorithm 2 of Global-QSGD, vectorised."""
    c1, c2 = a.astype(np.int64), b.astype(np.int64)
    emask = (1 << sign_shift) - 1
    e1, e2 = c1 & emask, c2 & emask
    sign1 = 1 - 2 * ((c1 >> sign_shift) & 1)
    sign2 = 1 - 2 * ((c2 >> sign_shift) & 1)
    gz1, gz2 = (e1 > 0).astype(np.int64), (e2 > 0).astype(np.int64)
    sign12 = sign1 * sign2 * gz1 * gz2
    diff = np.abs(e1 - e2) - (1 - sign12) // 2
    smaller = ((e1 <= e2).astype(np.int64) + (1 - gz2)) * gz1
    non_zero = 1 - (e1 == e2) * (sign12 == -1)
    sign = sign1 * smaller + sign2 * (1 - smaller)
    dc = np.clip(diff, 0, 63).astype(np.uint64)
    event = ((((r >> (np.uint64(63) - dc)) >> np.uint64(1)) == 0) & (diff < 64)).astype(np.int64)
    e_sel = e1 * smaller + e2 * (1 - smaller)
    e = e_sel * non_zero - sign12 * event * non_zero
    sat = (e == 0) & (e_sel * non_zero > 0)
    e = e + sat
    neg = (sign < 0) & (e > 0)
    return (e | (neg.astype(np.int64) << sign_shift)).astype(np.uint8)


def np_exp_reduce4(a: np.ndarray, b: np.ndarray, key: int) -> np.ndarray:
    w = np_words(key, 0, 2 * a.size)
    lo = np_exp_reduce(a & 15, b & 15, w[0::2], 3)
    hi = np_exp_reduce(a >> 4, b >> 4, w[1::2], 3)
    return lo | (hi << 4)


def np_bloom_probes(idx: np.ndarray, m: int, seed: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    """(a mod m, b mod m) of every index: first probe and probe step (kernels/bloom.py)."""
    a = np_mix(idx.astype(np.uint64) ^ seed)
    b = np_mix(a ^ GOLDEN)
    return (a % np.uint64(m)).astype(np.int64), (b % np.uint64(m)).astype(np.int64)


def np_bloom_insert(idx: np.ndarray, m: int, h: int, seed: np.uint64) -> np.ndarray:
    q, step = np_bloom_probes(idx, m, seed)
    bits = np.zeros(((m + 7) // 8) * 8, bool)
    for _ in range(h):
        bits[q] = True
        q = (q + step) % m
    return np.packbits(bits, bitorder="little")


def np_bloom_query(filt: np.ndarray, m: int, h: int, seed: np.uint64, n: int) -> np.ndarray:
    out = []
    for start in range(0, n, 1 << 20):
        i = np.arange(start, min(n, start + (1 << 20)), dtype=np.int64)
        q, step = np_bloom_probes(i, m, seed)
        ok = np.ones(i.size, bool)
        for _ in range(h):
            ok &= ((filt[q >> 3] >> (q & 7)) & 1).astype(bool)
            q = (q + step) % m
        out.append(i[ok])
    return np.concatenate(out)


def np_runs(idx: np.ndarray, n: int) -> np.ndarray:
    brk = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk - 1, [idx.size - 1]])
    runs = np.empty(2 * starts.size + 1, np.int64)
    runs[1::2] = idx[ends] - idx[starts] + 1
    runs[0] = idx[0]
    runs[2:-1:2] = idx[starts[1:]] - idx[ends[:-1]] - 1
    runs[-1] = n - idx[-1] - 1
    return runs


def np_indices_from_runs(runs: np.ndarray) -> np.ndarray:
    pos = np.cumsum(runs) - runs
    ones = runs[1::2]
    before = np.cumsum(ones) - ones
    return np.arange(int(ones.sum()), dtype=np.int64) + np.repeat(pos[1::2] - before, ones)


def np_varint_encode(v: np.ndarray) -> np.ndarray:
    sizes = np.ones(v.size, np.int64)
    for s in range(1, 9):  # a value < 2^63 has at most 9 bytes
        sizes += v >= (np.int64(1) << np.int64(7 * s))
    offs = np.cumsum(sizes) - sizes
    out = np.empty(int(sizes.sum()), np.uint8)
    for byte in range(int(sizes.max()) if v.size else 0):
        sel = sizes > byte
        more = (sizes[sel] > byte + 1).astype(np.int64) << 7
        out[offs[sel] + byte] = (((v[sel] >> (7 * byte)) & 127) | more).astype(np.uint8)
    return out


def np_varint_decode(buf: np.ndarray, count: int) -> np.ndarray:
    ends = np.flatnonzero(buf < 128)[:count]
    starts = np.concatenate([[0], ends[:-1] + 1])
    used = int(ends[-1]) + 1
    lengths = ends - starts + 1
    shift = 7 * (np.arange(used) - np.repeat(starts, lengths))
    return np.add.reduceat((buf[:used].astype(np.int64) & 127) << shift, starts)


def torch_or_none() -> Any:
    try:
        import torch
        return torch
    except ImportError:
        return None


# ------------------------------------------------------------------ the cases
@dataclass
class Case:
    """One kernel at one size: what to time and what to compare it with."""

    name: str
    group: str
    input_bytes: int
    kernel: Callable[[], Any]
    numpy_ref: Callable[[], Any] | None = None
    library: Callable[[], Any] | None = None
    library_label: str = ""
    same: Callable[[Any, Any], bool] | None = None
    note: str = ""


@dataclass
class Result:
    name: str
    group: str
    n: int
    input_bytes: int
    kernel_s: float
    memcpy_s: float
    numpy_s: float | None = None
    library_s: float | None = None
    library_label: str = ""
    same_as_numpy: bool | None = None
    note: str = ""


def _eq_tuple(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def build_cases(n: int, density: float) -> list[Case]:
    from ...kernels import bloom, exp_reduce, parallel, quantize, rle, rows, selection
    torch = torch_or_none()
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    k = max(1, int(density * n))
    thr = selection.kth_largest_abs(x, k)
    scale = 1.0 / float(np.linalg.norm(x.astype(np.float64)))
    cases: list[Case] = []
    xt = torch.from_numpy(x) if torch is not None else None

    def topk_lib():
        return torch.topk(xt.abs(), k, sorted=False)

    cases.append(Case(
        "select_by_threshold", "selection", x.nbytes, lambda: selection.select_by_threshold(x, thr),
        numpy_ref=lambda: (lambda i: (i, x[i]))(np.flatnonzero((np.abs(x) >= thr) & (x != 0))),
        library=topk_lib if torch else None, library_label=f"torch.topk(k={k})", same=_eq_tuple,
        note=f"density {density:g}"))
    cases.append(Case(
        "select_by_threshold [parallel]", "selection", x.nbytes,
        lambda: parallel.select_by_threshold(x, thr),
        numpy_ref=lambda: (lambda i: (i, x[i]))(np.flatnonzero((np.abs(x) >= thr) & (x != 0))),
        library=topk_lib if torch else None, library_label=f"torch.topk(k={k})", same=_eq_tuple))
    cases.append(Case(
        "count_at_least", "selection", x.nbytes, lambda: selection.count_at_least(x, thr),
        numpy_ref=lambda: int(np.count_nonzero((np.abs(x) >= thr) & (x != 0))), same=_eq_tuple))
    cases.append(Case(
        "kth_largest_abs (exact)", "selection", x.nbytes, lambda: selection.kth_largest_abs(x, k),
        numpy_ref=lambda: float(np.partition(np.abs(x), n - k)[n - k]),
        library=(lambda: torch.topk(xt.abs(), k, sorted=False).values.min()) if torch else None,
        library_label="torch.topk(...).min()", same=lambda a, b: a == b, note="NumPy: np.partition"))

    def np_gauss():
        from scipy.special import ndtri
        xd = x.astype(np.float64)
        return abs(xd.mean()) + xd.std(ddof=1) * float(ndtri(1 - density / 2))

    cases.append(Case(
        "gaussian_threshold (estimate)", "selection", x.nbytes,
        lambda: selection.gaussian_threshold(x, density), numpy_ref=np_gauss,
        same=lambda a, b: abs(a - b) <= 1e-9 * abs(b)))

    ranks = 8
    coo_idx = np.concatenate([np.sort(rng.choice(n, k, replace=False)) for _ in range(ranks)])
    coo_val = rng.standard_normal(coo_idx.size).astype(np.float32)

    def np_coo():
        u, inv = np.unique(coo_idx, return_inverse=True)
        return u, np.bincount(inv, weights=coo_val.astype(np.float64))

    cases.append(Case(
        "coo_sum", "selection", coo_idx.nbytes + coo_val.nbytes, lambda: selection.coo_sum(coo_idx, coo_val),
        numpy_ref=np_coo, same=_eq_tuple, note=f"{ranks} ranks x k={k} COO entries"))

    cases.append(Case(
        "linear_quantize (s=127)", "quantize", x.nbytes, lambda: quantize.linear_quantize(x, scale, 127, KEY),
        numpy_ref=lambda: np_linear_quantize(x, scale, 127, KEY),
        library=lambda: np_qsgd_library(x, scale, 127, np.random.default_rng(0)),
        library_label="NumPy QSGD, np.random", same=_eq_tuple))
    cases.append(Case(
        "linear_quantize [parallel]", "quantize", x.nbytes, lambda: parallel.linear_quantize(x, scale, 127, KEY),
        numpy_ref=lambda: np_linear_quantize(x, scale, 127, KEY),
        library=lambda: np_qsgd_library(x, scale, 127, np.random.default_rng(0)),
        library_label="NumPy QSGD, np.random", same=_eq_tuple))
    q8 = quantize.linear_quantize(x, scale, 127, KEY)
    cases.append(Case(
        "linear_dequantize", "quantize", q8.nbytes, lambda: quantize.linear_dequantize(q8, scale / 127),
        numpy_ref=lambda: (q8.astype(np.float64) * (scale / 127)).astype(np.float32), same=_eq_tuple))
    cases.append(Case(
        "exp_quantize (8-bit)", "quantize", x.nbytes, lambda: quantize.exp_quantize(x, scale, 8, KEY),
        numpy_ref=lambda: np_exp_quantize(x, scale, 127, 7, KEY),
        library=lambda: np_qsgd_library(x, scale, 127, np.random.default_rng(0)),
        library_label="NumPy QSGD, np.random", same=_eq_tuple))
    cases.append(Case(
        "exp_quantize (8-bit) [parallel]", "quantize", x.nbytes,
        lambda: parallel.exp_quantize(x, scale, 8, KEY),
        numpy_ref=lambda: np_exp_quantize(x, scale, 127, 7, KEY),
        library=lambda: np_qsgd_library(x, scale, 127, np.random.default_rng(0)),
        library_label="NumPy QSGD, np.random", same=_eq_tuple))
    codes = quantize.exp_quantize(x, scale / 4, 8, KEY)
    cases.append(Case(
        "exp_dequantize (8-bit)", "quantize", codes.nbytes, lambda: quantize.exp_dequantize(codes, scale, 8),
        numpy_ref=lambda: np_exp_dequantize(codes, scale, 7), same=_eq_tuple))
    nib = (codes & 15).astype(np.uint8)
    cases.append(Case(
        "pack_nibbles", "quantize", nib.nbytes, lambda: quantize.pack_nibbles(nib),
        numpy_ref=lambda: nib[0::2] | (nib[1::2] << 4), same=_eq_tuple))
    packed = quantize.pack_nibbles(nib)

    def np_unpack():
        out = np.empty(2 * packed.size, np.uint8)
        out[0::2] = packed & 15
        out[1::2] = packed >> 4
        return out

    cases.append(Case(
        "unpack_nibbles", "quantize", packed.nbytes, lambda: quantize.unpack_nibbles(packed, 2 * packed.size),
        numpy_ref=np_unpack, same=_eq_tuple))
    pa = quantize.pack_nibbles(rng.integers(-4, 4, n).astype(np.int8))
    pb = quantize.pack_nibbles(rng.integers(-4, 4, n).astype(np.int8))
    pout = np.empty_like(pa)

    def nib_add():
        quantize.nibble_add_into(pa, pb, pout)
        return pout

    cases.append(Case(
        "nibble_add (4-bit sum)", "quantize", pa.nbytes + pb.nbytes, nib_add,
        numpy_ref=lambda: ((pa & 0x77) + (pb & 0x77)) ^ ((pa ^ pb) & 0x88), same=_eq_tuple,
        note="n nibbles per operand"))

    c1 = quantize.exp_quantize(x, scale / 8, 8, KEY)
    c2 = quantize.exp_quantize(x[::-1].copy(), scale / 8, 8, KEY + 1)
    eout = np.empty_like(c1)
    a32 = x.copy()
    b32 = x[::-1].copy()
    mpi_sum = None
    try:
        from mpi4py import MPI
        mpi_sum = lambda: MPI.SUM.Reduce_local(a32, b32)  # noqa: E731
    except ImportError:
        pass

    def er8():
        exp_reduce.exp_reduce8_into(c1, c2, eout, np.uint64(KEY), np.uint64(0))
        return eout

    def er8p():
        parallel.exp_reduce8_into(c1, c2, eout, np.uint64(KEY), np.uint64(0))
        return eout

    cases.append(Case(
        "exp_reduce (8-bit)", "exp_reduce", c1.nbytes + c2.nbytes, er8,
        numpy_ref=lambda: np_exp_reduce(c1, c2, np_words(KEY, 0, n), 7), library=mpi_sum,
        library_label=f"MPI float32 SUM, {n} elements", same=_eq_tuple))
    cases.append(Case(
        "exp_reduce (8-bit) [parallel]", "exp_reduce", c1.nbytes + c2.nbytes, er8p,
        numpy_ref=lambda: np_exp_reduce(c1, c2, np_words(KEY, 0, n), 7), library=mpi_sum,
        library_label=f"MPI float32 SUM, {n} elements", same=_eq_tuple))
    if mpi_sum is not None:
        from ...mpi_collectives.reduce_ops import exp_sum_op, reduce_stream
        op8 = exp_sum_op(8)
        via = c2.copy()

        def er8_mpi():
            with reduce_stream(KEY):
                op8.Reduce_local(c1, via)
            return via

        cases.append(Case(
            "exp_reduce (8-bit) as MPI.Op", "exp_reduce", c1.nbytes + c2.nbytes, er8_mpi, library=mpi_sum,
            library_label=f"MPI float32 SUM, {n} elements", note="the operator MPI calls, incl. Python callback"))
    p1 = quantize.pack_nibbles(quantize.exp_quantize(x, scale / 8, 4, KEY))
    p2 = quantize.pack_nibbles(quantize.exp_quantize(x[::-1].copy(), scale / 8, 4, KEY + 1))
    pout4 = np.empty_like(p1)

    def er4():
        exp_reduce.exp_reduce4_into(p1, p2, pout4, np.uint64(KEY), np.uint64(0))
        return pout4

    cases.append(Case(
        "exp_reduce (4-bit packed)", "exp_reduce", p1.nbytes + p2.nbytes, er4,
        numpy_ref=lambda: np_exp_reduce4(p1, p2, KEY), library=mpi_sum,
        library_label=f"MPI float32 SUM, {n} elements", same=_eq_tuple, note="n codes, 2 per byte"))

    seed = np.uint64(1234567)
    sel_idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    m_bits, h = 10 * k, 4
    filt = bloom.bloom_insert(sel_idx, m_bits, h, seed)
    cases.append(Case(
        "bloom_insert", "bloom", sel_idx.nbytes, lambda: bloom.bloom_insert(sel_idx, m_bits, h, seed),
        numpy_ref=lambda: np_bloom_insert(sel_idx, m_bits, h, seed), same=_eq_tuple,
        note=f"k={k} indices, m={m_bits} bits, h={h}"))
    cases.append(Case(
        "bloom_query_range", "bloom", 8 * n, lambda: bloom.bloom_query_range(filt, m_bits, h, seed, n),
        numpy_ref=lambda: np_bloom_query(filt, m_bits, h, seed, n), same=_eq_tuple,
        note="tests every i < n; input = n int64 indices"))
    cases.append(Case(
        "bloom_query_range [parallel]", "bloom", 8 * n,
        lambda: parallel.bloom_query_range(filt, m_bits, h, seed, n),
        numpy_ref=lambda: np_bloom_query(filt, m_bits, h, seed, n), same=_eq_tuple))

    runs = rle.runs_from_sorted_indices(sel_idx, n)
    cases.append(Case(
        "runs_from_sorted_indices", "rle", sel_idx.nbytes, lambda: rle.runs_from_sorted_indices(sel_idx, n),
        numpy_ref=lambda: np_runs(sel_idx, n), same=_eq_tuple, note=f"k={k} sorted indices"))
    cases.append(Case(
        "indices_from_runs", "rle", runs.nbytes, lambda: rle.indices_from_runs(runs, n)[0],
        numpy_ref=lambda: np_indices_from_runs(runs), same=_eq_tuple))
    enc = rle.varint_encode(runs)
    cases.append(Case(
        "varint_encode", "rle", runs.nbytes, lambda: rle.varint_encode(runs),
        numpy_ref=lambda: np_varint_encode(runs), same=_eq_tuple))
    cases.append(Case(
        "varint_decode", "rle", enc.nbytes, lambda: rle.varint_decode(enc, runs.size)[0],
        numpy_ref=lambda: np_varint_decode(enc, runs.size), same=_eq_tuple))

    cols = 1024
    mat = x[: (n // cols) * cols].reshape(-1, cols)
    nrows = mat.shape[0]
    chosen = np.sort(rng.choice(nrows, max(1, nrows // 10), replace=False)).astype(np.int64)
    block = mat[chosen]
    mt = torch.from_numpy(mat) if torch else None
    ct = torch.from_numpy(chosen) if torch else None
    bt = torch.from_numpy(block) if torch else None
    cases.append(Case(
        "gather_rows (10% rows)", "rows", block.nbytes, lambda: rows.gather_rows(mat, chosen),
        numpy_ref=lambda: mat[chosen], library=(lambda: torch.index_select(mt, 0, ct)) if torch else None,
        library_label="torch.index_select", same=_eq_tuple, note=f"{nrows} x {cols} float32"))
    cases.append(Case(
        "scatter_rows (10% rows)", "rows", mat.nbytes, lambda: rows.scatter_rows(block, chosen, nrows),
        numpy_ref=lambda: (lambda o: (o.__setitem__(chosen, block), o)[1])(np.zeros_like(mat)),
        library=(lambda: torch.zeros(nrows, cols).index_copy_(0, ct, bt)) if torch else None,
        library_label="torch.zeros().index_copy_", same=_eq_tuple, note="writes the dense m x n output"))
    cases.append(Case(
        "row_sq_norms", "rows", mat.nbytes, lambda: rows.row_sq_norms(mat),
        numpy_ref=lambda: (mat * mat).sum(axis=1),
        library=(lambda: torch.linalg.vector_norm(mt, dim=1) ** 2) if torch else None,
        library_label="torch.linalg.vector_norm**2",
        same=lambda a, b: bool(np.allclose(a, b, rtol=1e-4)), note="NumPy: (M*M).sum(1)"))
    return cases


# ------------------------------------------------------------------- timing
def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(n: int, case: Case, repeat: int) -> Result:
    """Time the kernel, the memcpy of its input bytes and the references, interleaved.

    One warm-up call each (compilation, caches, page faults), then ``repeat``
    rounds of kernel + memcpy (the references join the first ``min(repeat, 3)``
    rounds); each column keeps its best round. Interleaving makes the ratios
    robust to slow changes of the load on a shared machine.
    """
    src = np.random.default_rng(0).integers(0, 255, case.input_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    copy = lambda: np.copyto(dst, src)  # noqa: E731
    out = case.kernel()
    copy()
    ref = case.numpy_ref() if case.numpy_ref is not None else None
    if case.library is not None:
        case.library()
    best = {"kernel": math.inf, "memcpy": math.inf, "numpy": math.inf, "library": math.inf}
    for r in range(repeat):
        best["kernel"] = min(best["kernel"], _timed(case.kernel))
        best["memcpy"] = min(best["memcpy"], _timed(copy))
        if r < 3 and case.numpy_ref is not None:
            best["numpy"] = min(best["numpy"], _timed(case.numpy_ref))
        if r < 3 and case.library is not None:
            best["library"] = min(best["library"], _timed(case.library))
    res = Result(case.name, case.group, n, case.input_bytes, best["kernel"], best["memcpy"],
                 library_label=case.library_label, note=case.note)
    if case.numpy_ref is not None:
        res.numpy_s = best["numpy"]
        if case.same is not None:
            res.same_as_numpy = bool(case.same(out, ref))
    if case.library is not None:
        res.library_s = best["library"]
    return res


# ------------------------------------------------------------------ reports
def _fmt_ratio(r: float | None) -> str:
    if r is None or not math.isfinite(r):
        return "–"
    return f"{r:.2f}" if r < 10 else f"{r:.0f}" if r >= 100 else f"{r:.1f}"


def targets(results: list[Result]) -> list[tuple[str, str, bool | None]]:
    """The kernels' speed targets, evaluated on these results: (target, measured, met)."""
    out = []
    by = {(r.name, r.n): r for r in results}
    sizes = sorted({r.n for r in results})
    big = sizes[-1] if sizes else 0
    for name in ("select_by_threshold", "linear_quantize (s=127)", "exp_quantize (8-bit)",
                 "exp_quantize (8-bit) [parallel]"):
        for n in sizes:
            r = by.get((name, n))
            if r:
                ratio = r.kernel_s / r.memcpy_s
                out.append((f"{name} within 3x of memcpy (n={n:,})", f"{ratio:.2f}x", ratio <= 3.0))
    r = by.get(("select_by_threshold", big))
    if r and r.library_s:
        sp = r.library_s / r.kernel_s
        out.append((f"select_by_threshold >= 10x faster than torch.topk (n={big:,})", f"{sp:.1f}x", sp >= 10))
    for name in ("exp_reduce (8-bit)", "exp_reduce (8-bit) as MPI.Op", "exp_reduce (4-bit packed)"):
        for n in sizes:
            r = by.get((name, n))
            if r and r.library_s:
                ratio = r.kernel_s / r.library_s
                out.append((f"{name} within 10x of MPI float32 sum (n={n:,})", f"{ratio:.2f}x", ratio <= 10))
    # rows.* are NumPy calls themselves (take, fancy assignment, einsum): their "x NumPy" compares
    # two NumPy spellings of the same copy, 1 +- noise, so they replace nothing and are not counted.
    slower = [r for r in results if r.numpy_s is not None and r.kernel_s > r.numpy_s
              and r.group != "rows"]
    out.append(("no kernel slower than the NumPy code it replaces (rows.* are NumPy code: excluded)",
                ", ".join(f"{r.name} n={r.n:,}: {r.numpy_s / r.kernel_s:.2f}x" for r in slower) or "none slower",
                not slower))
    return out


def size_tables(results: list[Any], time_column: str, ratio_column: str,
                row: Callable[[Any], str]) -> list[str]:
    """Markdown lines of one table per input size ``r.n`` (heading ``## n = ...``), ``row(r)``
    per result; the columns of both kernel reports, with their names for the time and the
    reference ratio."""
    lines: list[str] = []
    for n in sorted({r.n for r in results}):
        lines += [f"## n = {n:,} elements", "",
                  f"| kernel | input MB | {time_column} | GB/s | x memcpy | {ratio_column} | same | "
                  "library | x lib | note |",
                  "|---|---:|---:|---:|---:|---:|:-:|---|---:|---|"]
        lines += [row(r) for r in results if r.n == n]
        lines.append("")
    return lines


def _table_row(r: Result) -> str:
    gbs = r.input_bytes / r.kernel_s / 1e9
    same = "–" if r.same_as_numpy is None else ("yes" if r.same_as_numpy else "**NO**")
    return (f"| {r.name} | {r.input_bytes / 1e6:.1f} | {r.kernel_s * 1e3:.2f} | {gbs:.2f} | "
            f"{_fmt_ratio(r.kernel_s / r.memcpy_s)} | "
            f"{_fmt_ratio(r.numpy_s / r.kernel_s if r.numpy_s else None)} | {same} | "
            f"{r.library_label or '–'} | {_fmt_ratio(r.library_s / r.kernel_s if r.library_s else None)} | "
            f"{r.note} |")


def write_markdown(results: list[Result], path: Path, meta: dict[str, Any]) -> None:
    threads = meta["numba_threads"]
    lines = [f"# Kernel benchmark, {threads} Numba thread{'s' if threads != 1 else ''}"
             + (f": {meta['only']} only" if meta.get("only") else "") + " (`hvdc bench kernels`)", "",
             f"`{meta.get('command', 'hvdc bench kernels')}` with NUMBA_NUM_THREADS={threads}. "
             f"Machine: {meta['machine']}. {meta['note']}".rstrip(), "",
             f"Numba threads: {meta['numba_threads']}; best of {meta['repeat']} rounds after a warm-up call, "
             f"kernel and memcpy interleaved in every round (references in the first 3); all columns "
             f"measured in the same run ({meta['date']}).", "",
             "* **x memcpy** = kernel time / time of `np.copyto` of the kernel's input bytes into a "
             "preallocated buffer (1.0 = speed of light for a kernel that reads its input once).",
             "* **x NumPy** = time of the pure-NumPy code the kernel replaces / kernel time (> 1: kernel "
             "faster); **same** = identical output (same algorithm, same random words).",
             "* **x lib** = time of the library call / kernel time; for `exp_reduce` the library is MPI's "
             "built-in float32 `MPI_SUM` (`MPI.SUM.Reduce_local`) on the same element count, so there "
             "**x lib** below 1 means the kernel is that many times slower.", ""]
    lines += size_tables(results, "time ms", "x NumPy", _table_row)
    lines += ["## Targets", "", "| target | measured | met |", "|---|---|:-:|"]
    for target, measured, met in targets(results):
        lines.append(f"| {target} | {measured} | {'yes' if met else '**no**'} |")
    lines.append("")
    path.write_text("\n".join(lines))


def write_plot(results: list[Result], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r.name for r in results))
    sizes = sorted({r.n for r in results})
    by = {(r.name, r.n): r for r in results}
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(names) * max(1, len(sizes)) + 1.5))
    height = 0.8 / max(1, len(sizes))
    for j, n in enumerate(sizes):
        ys = [i + j * height for i in range(len(names))]
        vals = [by[(nm, n)].kernel_s / by[(nm, n)].memcpy_s if (nm, n) in by else np.nan for nm in names]
        ax.barh(ys, vals, height=height, label=f"n = {n:,}")
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))])
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(3.0, color="r", lw=0.8, ls="--", label="3x memcpy")
    ax.set_xlabel("kernel time / memcpy time of its input bytes (log; 1 = speed of light)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("CPU kernels vs memcpy")
    save_figure(fig, path, dpi=110)


def _machine() -> str:
    model = cpu_model(platform.processor() or platform.machine())
    return f"{model}, {os.cpu_count()} logical CPUs, {platform.system()}"


def checked_args(args: argparse.Namespace) -> tuple[list[int], set[str]]:
    """(sizes, kernel names of ``--only``) of a kernel benchmark; ``ValueError`` on a bad option."""
    try:
        sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated integers, got {args.sizes!r}") from None
    if not sizes or min(sizes) < 1024:
        raise ValueError(f"--sizes must be >= 1024 each, got {args.sizes!r}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    if not 0.0 < args.density < 1.0:
        raise ValueError(f"--density must be in (0, 1), got {args.density}")
    return sizes, {s.strip() for s in args.only.split(",") if s.strip()}


def run(args: argparse.Namespace) -> int:
    import numba
    from tqdm import tqdm
    sizes, only = checked_args(args)
    results: list[Result] = []
    with tqdm(total=0, unit="kernel", desc="bench kernels") as bar:
        for n in sizes:
            cases = [c for c in build_cases(n, args.density)
                     if not only or c.name in only or c.name.split(" ")[0] in only]
            bar.total += len(cases)
            bar.refresh()
            for case in cases:
                bar.set_postfix_str(f"{case.name} n={n:,}")
                results.append(measure(n, case, args.repeat))
                bar.update(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": _machine(), "note": args.note, "numba_threads": numba.get_num_threads(),
            "repeat": args.repeat, "date": time.strftime("%Y-%m-%d"), "only": args.only,
            "command": "hvdc " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    write_markdown(results, out, meta)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "results": [r.__dict__ for r in results]}, indent=1))
    write_plot(results, out.with_suffix(".png"))
    for target, measured, met in targets(results):
        print(f"{'ok  ' if met else 'MISS'} {target}: {measured}")
    print(f"wrote {out}, {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return 0


__all__ = ["build_cases", "checked_args", "measure", "register_bench", "run", "targets"]
