"""One rank of ``hvdc bench e2e``: probe the links, then time training steps per method.

Run under mpirun (the launcher in :mod:`.e2e` starts it inside the emulated
cluster). Rank 0 prints one ``HVDC-PROGRESS <label>`` line per finished item
for the launcher's progress bar and writes the JSON result.

A step is timed with ``overlap=False`` so its parts add up: buckets are
reduced inside the backward pass, in the hooks, so

    step = forward + backward + exchange + optimizer update
    exchange (method.allreduce, wall)  = compression + MPI time
    MPI time (Communicator.timings)    = communication (incl. waiting)

and compute = step - exchange. The same parts are also taken in thread CPU
time (``time.thread_time``): with more ranks than cores a rank's wall time
includes waiting for the CPU, and its MPI time waiting for peers that wait
for the CPU; CPU time is what the work itself costs. All ranks start each step together (a
barrier), so the MPI time measures the exchange, not the previous step's skew.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from .e2e_models import build_model, synthetic_batch

PROBE_SMALL = 8
PROBE_LARGE = 16 * 1024 * 1024


def _timed(comm: Any, fn: Any, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, all ranks starting together (max over ranks)."""
    times = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    local = float(np.median(times))
    return float(comm.allreduce(np.array([local]), "max")[0])


def probe_links(comm: Any, repeats: int) -> dict[str, Any]:
    """Small- and large-message times of each collective the methods use, and its bytes per rank."""
    p, rank = comm.size, comm.rank
    out: dict[str, Any] = {}
    small = np.zeros(PROBE_SMALL // 4, np.float32)
    large = np.ones(PROBE_LARGE // 4, np.float32)
    part = np.ones(PROBE_LARGE // 4 // p, np.float32)

    def volume(fn: Any) -> float:
        comm.reset_stats()
        fn()
        st = comm.stats()
        return max(st["sent"], st["received"])

    cases = {
        "allreduce": (lambda: comm.allreduce(small), lambda: comm.allreduce(large)),
        "allgatherv": (lambda: comm.allgatherv(small), lambda: comm.allgatherv(part)),
        "alltoallv": (lambda: comm.alltoallv([small] * p),
                      lambda: comm.alltoallv([part] * p)),
    }
    for op, (f_small, f_large) in cases.items():
        nbytes = volume(f_large)
        t_small = _timed(comm, f_small, repeats * 3)
        t_large = _timed(comm, f_large, repeats)
        out[op] = {"small_s": t_small, "large_s": t_large, "large_bytes": nbytes}
    # point to point: a ring shift of the large buffer (every link busy both ways)
    dest, src = (rank + 1) % p, (rank - 1) % p

    def shift(buf: np.ndarray) -> None:
        req = comm.isend(buf, dest, tag=7)
        comm.recv(src, tag=7, dtype=np.float32)
        req.wait()
    t_small = _timed(comm, lambda: shift(small), repeats * 3)
    t_large = _timed(comm, lambda: shift(large), repeats)
    out["p2p"] = {"small_s": t_small, "large_s": t_large, "large_bytes": float(large.nbytes)}
    out["interleaved"] = probe_interleaved(comm, repeats * 10)
    comm.reset_stats()
    return out


def probe_interleaved(comm: Any, iterations: int, work_n: int = 200_000) -> dict[str, float]:
    """Small allreduces between short bursts of CPU work, as a training step issues them.

    Returns the mean over ranks of the median time one such allreduce takes
    (``call_s``): with more ranks than cores it is dominated by the time the
    peers need to be scheduled again, not by the wire, and the model charges
    it per collective call on the testbed.
    """
    data = np.random.default_rng(comm.rank).standard_normal(work_n).astype(np.float32)
    small = np.zeros(2, np.float32)
    calls = []
    comm.barrier()
    for _ in range(iterations):
        float(np.sort(data[: work_n // 4]).sum())        # ~1 ms of CPU work
        t0 = time.perf_counter()
        comm.allreduce(small)
        calls.append(time.perf_counter() - t0)
    local = float(np.median(calls))
    return {"call_s": float(comm.allreduce(np.array([local]), "sum")[0]) / comm.size}


def memcpy_seconds(n: int, repeats: int = 5) -> float:
    """Median time to copy ``n`` float32 values (the floor for touching a gradient once)."""
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


class _ExchangeClock:
    """Wraps ``method.allreduce`` to add up its wall and thread CPU time (overlap is off: one thread)."""

    def __init__(self, method: Any) -> None:
        self.wall = self.cpu = 0.0
        inner = method.allreduce

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - t0
                self.cpu += time.thread_time() - c0
        method.allreduce = timed

    def reset(self) -> None:
        self.wall = self.cpu = 0.0


def time_method(name: str, params: dict[str, Any], model_name: str, comm: Any, steps: int,
                warm: int, seed: int) -> dict[str, Any]:
    """Train ``warm + steps`` steps with method ``name``; per-step parts of the measured ones."""
    import torch

    from ..compressors.registry import create
    from ..torch.optimizer import DistributedOptimizer
    method = create(name, **params)
    if getattr(method, "warmup_steps", 0) and "warmup_steps" not in params:
        # warm-up steps are dense steps (the dense column): measure the method itself
        method = create(name, **{**params, "warmup_steps": 0})
    torch.manual_seed(seed)
    model = build_model(model_name)
    base = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt = DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=method,
                               overlap=False, comm=comm)
    clock = _ExchangeClock(method)
    records = []
    for step in range(warm + steps):
        x, y = synthetic_batch(model_name, comm.rank, step)
        comm.barrier()
        comm.reset_stats()
        clock.reset()
        t0, c0 = time.perf_counter(), time.thread_time()
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        total, cpu = time.perf_counter() - t0, time.thread_time() - c0
        timings = comm.timings()
        mpi, mpi_cpu = timings["total"], timings["cpu_total"]
        st = comm.stats()
        work = np.array([total - mpi])                   # this rank's compute + compression wall time
        imbalance = float(comm.allgather(work).max() - work[0])
        if step >= warm:
            ex = clock.wall
            records.append({"step_s": total, "compute_s": total - ex, "exchange_s": ex,
                            "comm_s": mpi, "compress_s": max(ex - mpi, 0.0), "imbalance_s": imbalance,
                            "compute_cpu_s": cpu - clock.cpu,
                            "compress_cpu_s": max(clock.cpu - mpi_cpu, 0.0), "comm_cpu_s": mpi_cpu,
                            "sent": st["sent"], "received": st["received"],
                            "ops": {k: v for k, v in st["by_op"].items()}})
    opt.close()
    # each part: the mean over ranks of the median over steps; the step: the slowest rank
    summary: dict[str, Any] = {"params": method.config()}
    for key in ("compute_s", "exchange_s", "comm_s", "compress_s", "compute_cpu_s", "compress_cpu_s",
                "comm_cpu_s", "imbalance_s", "sent", "received"):
        local = float(np.median([r[key] for r in records]))
        summary[key] = float(comm.allreduce(np.array([local]), "sum")[0]) / comm.size
    local_step = float(np.median([r["step_s"] for r in records]))
    summary["step_s"] = float(comm.allreduce(np.array([local_step]), "max")[0])
    summary["step_mean_s"] = float(comm.allreduce(np.array([np.mean([r["step_s"] for r in records])]),
                                                  "max")[0])
    ops: dict[str, dict[str, float]] = {}
    for r in records:
        for op, v in r["ops"].items():
            acc = ops.setdefault(op, {"calls": 0.0, "sent": 0.0, "received": 0.0})
            for k in acc:
                acc[k] += v[k] / len(records)
    summary["ops"] = ops
    return summary


def main(argv: list[str] | None = None) -> None:
    """Run :func:`_main`; a rank that fails writes its traceback to ``<json>.rank<r>.err`` first.

    Open MPI may drop the stderr of a remote rank that aborts (the project's
    excepthook calls ``MPI_Abort``), so the launcher reads these files to say why a run failed."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _main(args)
    except BaseException:
        import traceback
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "x"))
        try:
            with open(f"{args.json}.rank{rank}.err", "w") as fh:
                traceback.print_exc(file=fh)
        except OSError:
            pass
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one rank of hvdc bench e2e")
    parser.add_argument("--methods", required=True, help="comma-separated; name or name:json-params")
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warm", type=int, default=1)
    parser.add_argument("--probe-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True)
    return parser


def _main(args: argparse.Namespace) -> None:
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from ..mpi_collectives import Communicator
    comm = Communicator()
    rank0 = comm.rank == 0

    def progress(label: str) -> None:
        if rank0:
            print(f"HVDC-PROGRESS {label}", flush=True)

    result: dict[str, Any] = {"world_size": comm.size, "model": args.model,
                              "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                              else os.cpu_count(),
                              "threads_per_rank": torch.get_num_threads(), "methods": {}}
    result["probe"] = probe_links(comm, args.probe_repeats)
    progress("probe")
    model = build_model(args.model)
    result["parameters"] = int(sum(p.numel() for p in model.parameters()))
    result["tensors"] = int(sum(1 for _ in model.parameters()))
    result["memcpy_s"] = memcpy_seconds(result["parameters"])
    del model
    for spec in args.methods.split(","):
        name, _, raw = spec.partition(":")
        params = json.loads(raw) if raw else {}
        label = name if not params else f"{name}({','.join(f'{k}={v}' for k, v in params.items())})"
        try:
            result["methods"][label] = time_method(name, params, args.model, comm, args.steps,
                                                   args.warm, args.seed)
        except Exception as exc:  # noqa: BLE001 - every rank raises the same; record and go on
            if rank0:
                print(f"[e2e] {label} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            result["methods"][label] = {"error": f"{type(exc).__name__}: {exc}"}
            comm.barrier()
        progress(label)
    if rank0:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
