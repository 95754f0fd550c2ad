"""Per-step cost of Method.allreduce's reliability checks (issue 19), on real ranks.

Run: ``mpirun -np 2 .venv/bin/python benchmarks/consistency_check.py > benchmarks/consistency_check.md``

After a tensor's first call, each ``Method.allreduce`` does three extra things:
the signature tuple and a set lookup (name, shape, dtype, method config), a
finiteness test (one float64 sum over the gradient) and one 1-byte-per-rank
allgather on the check communicator (``mpi_collectives.consistency.agree``) that
carries both "non-finite here" and "new signature here". This script times
each part alone and the whole call, per tensor size, as medians of
interleaved repetitions (barrier before each timed call).
"""
from __future__ import annotations

import platform
import time

import numpy as np
from mpi4py import MPI

import horovod_compress as hvdc
from horovod_compress.compressors import base
from horovod_compress.compressors.base import _finite
from horovod_compress.mpi_collectives import Communicator
from horovod_compress.mpi_collectives.consistency import agree

REPS = 300


def _median_us(fn, comm) -> float:
    times = []
    for _ in range(REPS):
        comm.comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def _unchecked(fn, method):
    """Run ``fn`` with the checks switched off (the code path of Method.allreduce before issue 19)."""
    saved = base.agree, base._finite, method._signature
    base.agree = lambda comm, flags: np.zeros(comm.size, dtype=np.uint8)
    base._finite = lambda x: True
    method._signature = lambda grad, dtype, name: next(iter(method._signatures))
    try:
        return fn()
    finally:
        base.agree, base._finite = saved[0], saved[1]
        del method._signature


def main() -> None:
    comm = Communicator()
    rows = []
    for method in ("none", "topk"):
        for n in (1_000, 100_000, 1_000_000):
            m = hvdc.Compression.by_name(method)
            x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
            m.allreduce(x, "w", comm)                       # first call: the signature check
            whole = _median_us(lambda: m.allreduce(x, "w", comm), comm)
            core = _median_us(lambda: m.feedback.reduce(m, x, "w", comm, m.state["w"]), comm)
            off = _unchecked(lambda: _median_us(lambda: m.allreduce(x, "w", comm), comm), m)
            sig = _median_us(lambda: m._signature(x, x.dtype, "w") in m._signatures, comm)
            fin = _median_us(lambda: _finite(x), comm)
            agr = _median_us(lambda: agree(comm, 0), comm)
            rows.append((method, n, whole, off, core, sig, fin, agr))
    if comm.rank == 0:
        print("# Cost of the per-call reliability checks in Method.allreduce\n")
        print(f"`mpirun -np {comm.size}` on one machine ({platform.processor() or platform.machine()}, "
              f"shared-memory transport), medians of {REPS} barrier-separated calls, microseconds. "
              "`allreduce, checks off` is the same call with the "
              "three checks patched out (the code path before issue 19); `core` the method's "
              "feedback+reduce alone; `signature` is building the (name, shape, dtype, config) tuple "
              "and the set lookup; `finite` the finiteness test (one `x . x` dot product); `agree` the 1-byte allgather "
              "that tells every rank whether anyone has a NaN/Inf or a new signature. The "
              "16-byte digest allgather runs only on a tensor's first call or a change.\n")
        print("| method | elements | allreduce | allreduce, checks off | core | signature | "
              "finite | agree | checks (sum) | checks / allreduce off |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for method, n, whole, off, core, sig, fin, agr in rows:
            checks = sig + fin + agr
            print(f"| {method} | {n:,} | {whole:.1f} | {off:.1f} | {core:.1f} | {sig:.1f} | "
                  f"{fin:.1f} | {agr:.1f} | {checks:.1f} | {100 * checks / off:.0f}% |")
        print("\nThe difference between the first two columns also carries timing noise (the "
              "machine's cores are shared); the per-part columns are the measurement of the "
              "checks' cost. On a network `agree` costs one small-message allgather latency.")


if __name__ == "__main__":
    main()
