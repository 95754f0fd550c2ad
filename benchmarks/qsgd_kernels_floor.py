"""Global-QSGD's kernels against memcpy and MPI_SUM, and their floors (issue 15), one process.

    .venv/bin/python benchmarks/qsgd_kernels_floor.py [N] [REPEAT] > benchmarks/qsgd_kernels_floor.md

Best of REPEAT (default 31) for N float32 elements (default 2^20), all in the same
process so the baselines share the machine state: memcpy (np.copyto) and MPI_SUM
(MPI.SUM.Reduce_local of N float32); quantize (exp8) and dequantize as the method
ran them before (two passes) and fused (qsgd_fused: codes and ``local`` in one pass);
Algorithm 2 as the MPI operator (Python callback, with the copy back) and called
directly (what the pipelined ring runs); and the floors: a SplitMix64 word per
element alone, Algorithm 2's logic with a one-multiply stand-in word, the
quantizer's logic with no random word.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI
from numba import njit

from horovod_compress.kernels.exp_reduce import exp_reduce8_range, exp_reduce_pair
from horovod_compress.kernels.qsgd_fused import exp_dequantize8_range, exp_quantize_dequant
from horovod_compress.kernels.quantize import (GOLDEN, exp_code, exp_dequantize_into, exp_quantize,
                                               splitmix64, word_state)
from horovod_compress.mpi_collectives.reduce_ops import exp_sum_op, reduce_stream


@njit
def _rng_only(out, key):
    s = word_state(key, np.uint64(0)) - GOLDEN
    for i in range(np.uint64(0), np.uint64(out.size)):
        s += GOLDEN
        out[i] = np.uint8(splitmix64(s) >> np.uint64(56))


@njit
def _reduce_logic_only(a, b, out):
    sat = 0
    for i in range(np.uint64(0), np.uint64(a.size)):
        w = np.uint64(a[i]) * np.uint64(0x9E3779B97F4A7C15)
        c, s = exp_reduce_pair(np.int64(a[i]), np.int64(b[i]), w, 7)
        out[i] = np.uint8(c)
        sat += s
    return sat


@njit
def _quantize_logic_only(x, scale, out):
    for i in range(np.uint64(0), np.uint64(x.size)):
        out[i] = exp_code(np.float64(x[i]), scale, 127, 128, 2.0 ** 180, np.uint64(i) << np.uint64(40))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 31
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    norm = float(np.abs(x).max())
    sc, ds = 2.0 ** -18 / norm, norm * 2.0 ** 18
    dst, acc, local = np.empty_like(x), x.copy(), np.empty_like(x)
    codes, codes2 = exp_quantize(x, sc, 8, 1), exp_quantize(x * 0.7, sc, 8, 2)
    out8, inout = np.empty(n, np.uint8), codes2.copy()
    op = exp_sum_op(8)

    def best(f, *a):
        f(*a)
        ts = []
        for _ in range(repeat):
            t = time.perf_counter()
            f(*a)
            ts.append(time.perf_counter() - t)
        return min(ts) * 1e3

    def mpi_op():
        inout[...] = codes2
        with reduce_stream(3):
            op.Reduce_local(codes, inout)

    load0 = os.getloadavg()[0]
    rows = [
        ("memcpy (np.copyto, float32)", best(np.copyto, dst, x)),
        ("MPI_SUM (Reduce_local, float32)", best(MPI.SUM.Reduce_local, x, acc)),
        ("exp8 quantize (exp_quantize)", best(exp_quantize, x, sc, 8, 1)),
        ("exp8 dequantize (exp_dequantize_into)", best(exp_dequantize_into, codes, ds, 7, local)),
        ("exp8 quantize + local, fused (qsgd_fused)", best(exp_quantize_dequant, x, sc, 8, 1, ds, local)),
        ("exp8 dequantize, range kernel (qsgd_fused)", best(exp_dequantize8_range, codes, ds, local, 0, n)),
        ("Algorithm 2 as MPI.Op (+ 1-byte copy to reset)", best(mpi_op)),
        ("  the 1-byte reset copy alone", best(np.copyto, inout, codes2)),
        ("Algorithm 2 kernel called directly (the ring)",
         best(exp_reduce8_range, codes, codes2, out8, np.uint64(3), np.uint64(0), 0, n)),
        ("floor: SplitMix64 word per element only", best(_rng_only, out8, np.uint64(5))),
        ("floor: Algorithm 2 logic, 1-multiply word", best(_reduce_logic_only, codes, codes2, out8)),
        ("floor: quantizer logic, no random word", best(_quantize_logic_only, x, sc, out8)),
    ]
    load1 = os.getloadavg()[0]
    mem, red = rows[0][1], rows[1][1]
    print(f"# Global-QSGD kernels vs memcpy and MPI_SUM, N = {n:,}\n")
    print(f"`.venv/bin/python benchmarks/qsgd_kernels_floor.py {n} {repeat}`; best of {repeat}; "
          f"load average (1 min) {load0:.1f} -> {load1:.1f}; one process, one thread.\n")
    print("| kernel | ms | / memcpy | / MPI_SUM |\n|---|---:|---:|---:|")
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {t / mem:.2f}x | {t / red:.2f}x |")


if __name__ == "__main__":
    main()
