"""Per-step compute of GreedyLore against PowerSGD on one 2000 x 2000 float32 gradient.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/greedylore_step.py [--ranks 4 8] [--steps 40] [--svd]
    mpirun -np 4 ... python benchmarks/greedylore_step.py      # P ranks (2 cores: oversubscribed)

Both methods run interleaved on the same inputs (the first two calls -- the
SVD step / first Q and the Numba compilation -- are not timed). For each
call: the thread CPU time outside MPI (compute of the method, its error
feedback and the framework's checks; the collectives' own CPU time is
subtracted as the communicator measures it). Printed: median and min over
steps, the largest over ranks. Also the time of each piece of GreedyLore's
ordinary step on rank 0 alone (no communication), to show where it goes.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from horovod_compress.compressors.greedylore import GreedyLore, left_singular_vectors, subtract_low_rank
from horovod_compress.compressors.lowrank_common import top_indices
from horovod_compress.compressors.powersgd import PowerSGD
from horovod_compress.kernels.lowrank import add_and_probe, reconstruct
from horovod_compress.mpi_collectives import Communicator

SHAPE = (2000, 2000)


def step_times(comm: Communicator, rank: int, steps: int) -> dict[str, tuple[float, float]]:
    """``{method: (median, min)}`` CPU seconds per call outside MPI, max over ranks."""
    grads = [np.random.default_rng([comm.rank, s]).standard_normal(SHAPE, dtype=np.float32)
             for s in range(3)]
    methods = {"greedylore": GreedyLore(rank=rank), "powersgd": PowerSGD(rank=rank)}
    for meth in methods.values():
        meth.allreduce(grads[0], "w", comm)
        meth.allreduce(grads[1], "w", comm)
    samples: dict[str, list[float]] = {k: [] for k in methods}
    for s in range(steps):
        for key, meth in methods.items():
            comm.barrier()
            comm.reset_stats()
            c0 = time.thread_time()
            meth.allreduce(grads[s % 3], "w", comm)
            cpu = time.thread_time() - c0
            samples[key].append(cpu - comm.timings()["cpu_total"])
    out = {}
    for key, v in samples.items():
        both = comm.allreduce(np.array([np.median(v), np.min(v)]), "max")
        out[key] = (float(both[0]), float(both[1]))
    return out


def pieces(rank: int, repeats: int = 21) -> dict[str, float]:
    """Median CPU seconds of each piece of an ordinary GreedyLore step (one process, no MPI)."""
    rng = np.random.default_rng(0)
    m_mat = rng.standard_normal(SHAPE, dtype=np.float32)
    err = np.zeros(SHAPE, np.float32)
    u = np.linalg.qr(rng.standard_normal((SHAPE[0],) * 2))[0].astype(np.float32)
    meth = GreedyLore(rank=rank)
    times: dict[str, list[float]] = {}

    def tick(label: str, t0: float) -> float:
        t = time.thread_time()
        times.setdefault(label, []).append(t - t0)
        return t

    for it in range(repeats + 3):
        t = time.thread_time()
        xi = meth.probes_for("w", it, *SHAPE, np.float32)
        t = tick("draw probes xi (n numbers)", t)
        v = np.empty((SHAPE[0], 1), np.float32)
        add_and_probe(m_mat, err, xi, v, err)
        t = tick("A = M + e and v = A xi (one pass)", t)
        score = np.square(u.T @ v, dtype=np.float64)[:, 0]
        t = tick("scores U^T v (GEMV)", t)
        q = np.ascontiguousarray(u[:, top_indices(score, rank)])
        t = tick("top-r and Q = U[:, I]", t)
        c = np.ascontiguousarray((err.T @ q).T)
        t = tick("C_i = Q^T A (GEMM)", t)
        out = np.empty(SHAPE, np.float32)
        if rank <= 5:
            reconstruct(q, c, out)
        else:
            np.matmul(q, c, out=out)
        t = tick("Q C (one write)", t)
        subtract_low_rank(err, q, c)
        tick("e = A - Q C_i (in-place GEMM)", t)
    return {k: float(np.median(v[3:])) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8], help="values of r")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--svd", action="store_true",
                        help="also time the SVD step's U: eigh of G G^T against numpy.linalg.svd")
    args = parser.parse_args()
    comm = Communicator()
    if args.svd and comm.rank == 0:
        g = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
        t0 = time.perf_counter()
        left_singular_vectors(g)
        t1 = time.perf_counter()
        np.linalg.svd(g.astype(np.float64), full_matrices=False)
        t2 = time.perf_counter()
        print(f"U of a {SHAPE[0]} x {SHAPE[1]} G: eigh of G G^T {t1 - t0:.2f} s, "
              f"numpy.linalg.svd {t2 - t1:.2f} s\n")
    rows = []
    for r in args.ranks:
        t = step_times(comm, r, args.steps)
        rows.append(f"| {r} | {1e3 * t['greedylore'][0]:.2f} / {1e3 * t['greedylore'][1]:.2f} "
                    f"| {1e3 * t['powersgd'][0]:.2f} / {1e3 * t['powersgd'][1]:.2f} |")
    if comm.rank == 0:
        print(f"P = {comm.size}, {SHAPE[0]} x {SHAPE[1]} float32, {args.steps} interleaved steps; "
              "CPU ms per step outside MPI, median / min, max over ranks\n")
        print("| r | GreedyLore | PowerSGD |\n|---|---:|---:|")
        print("\n".join(rows))
        for r in args.ranks:
            print(f"\nPieces of one ordinary GreedyLore step, r = {r}, one process (median CPU ms):\n")
            print("| piece | ms |\n|---|---:|")
            for k, v in pieces(r).items():
                print(f"| {k} | {1e3 * v:.2f} |")


if __name__ == "__main__":
    main()
