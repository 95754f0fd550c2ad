"""``hvdc bench hot_path``: one compressed allreduce per method against a memcpy and a dense allreduce.

The measurement: a 2000x2000 float32 gradient, ``--np`` ranks on shared
memory, one thread per rank (``OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1`` are
set for the ranks), median of ``--repeat`` timed calls after ``--warmup``
untimed ones. In the same run it times a memcpy of the gradient
(``np.copyto``) and a dense float32 allreduce (``comm.allreduce(x, "avg")``),
and reports every method's whole ``Method.allreduce`` (error feedback,
compression, communication, decompression) in ms, as a multiple of the
memcpy and of the dense allreduce. Ranks are barrier-synchronised before
every timed call and the time is the slowest rank's.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .compute import parse_spec
from .launch import relaunch, under_mpi_launcher

DEFAULT_METHODS = ("topk:density=0.01,gaussiank:density=0.01,topk_dsa:density=0.01,"
                   "gtopk:density=0.01,randk:density=0.01,powersgd:rank=4,arc_topk,"
                   "topk_rows,lazy_projection,global_qsgd:bits=8")


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hot_path", help="ms of one compressed allreduce vs memcpy and dense")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--shape", default="2000x2000")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated name[:key=value;key=value] specs")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--label", default="", help="column label in the markdown (e.g. 'after')")
    p.add_argument("--out", default="benchmarks/hot_path.md")
    p.set_defaults(func=run)


def _timed(comm, fn, repeat: int, warmup: int) -> float:
    """Median over ``repeat`` calls of the slowest rank's seconds for ``fn()``."""
    import numpy as np
    from mpi4py import MPI
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        comm.comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(comm.comm.allreduce(dt, op=MPI.MAX))
    return float(np.median(times))


def run(args: argparse.Namespace) -> int:
    if args.np > 1 and not under_mpi_launcher():
        import sys
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["NUMBA_NUM_THREADS"] = "1"
        return relaunch(args.np, "horovod_compress.tools.cli", sys.argv[1:])
    import numpy as np

    from ...compressors.registry import create
    from ...mpi_collectives import Communicator

    comm = Communicator()
    shape = tuple(int(s) for s in args.shape.split("x"))
    rng = np.random.default_rng(1234 + comm.rank)
    grad = rng.standard_normal(shape).astype(np.float32)
    dst = np.empty_like(grad)
    memcpy = _timed(comm, lambda: np.copyto(dst, grad), args.repeat, args.warmup)
    dense = _timed(comm, lambda: comm.allreduce(grad, op="avg"), args.repeat, args.warmup)
    rows = []
    for spec in filter(None, (s.strip() for s in args.methods.split(","))):
        name, params = parse_spec(spec)
        method = create(name, **params)
        t = _timed(comm, lambda: method.allreduce(grad, "g", comm), args.repeat, args.warmup)
        rows.append({"method": spec, "ms": 1e3 * t, "x_memcpy": t / memcpy, "x_dense": t / dense})
    if comm.rank == 0:
        threads = os.environ.get("NUMBA_NUM_THREADS", "?")
        lines = [f"| method {args.label} | ms | x memcpy | x dense |", "|---|---:|---:|---:|",
                 f"| memcpy | {1e3 * memcpy:.2f} | 1.0 | {memcpy / dense:.2f} |",
                 f"| dense allreduce | {1e3 * dense:.2f} | {dense / memcpy:.1f} | 1.00 |"]
        for r in rows:
            lines.append(f"| {r['method']} | {r['ms']:.2f} | {r['x_memcpy']:.1f} | {r['x_dense']:.2f} |")
        text = (f"`hvdc bench hot_path --np {comm.size} --shape {args.shape}` "
                f"({comm.size} ranks, shared memory, NUMBA_NUM_THREADS={threads}, "
                f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')}, "
                f"median of {args.repeat}, slowest rank)\n\n" + "\n".join(lines) + "\n")
        print(text)
        if args.out != "-":
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            out.with_suffix(".json").write_text(json.dumps(
                {"memcpy_ms": 1e3 * memcpy, "dense_ms": 1e3 * dense, "rows": rows}, indent=1))
    return 0
