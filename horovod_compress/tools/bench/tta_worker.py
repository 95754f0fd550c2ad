"""One rank of ``hvdc bench tta``: train the byte-level GPT with one method until a target loss.

Run under mpirun (the launcher in :mod:`.tta` starts it, on the emulated
cluster or on shared memory). Every rank reads the same corpus split
(:mod:`.tta_task`), builds the same model from ``--seed`` and trains with
Adam at ``--lr`` through :class:`~horovod_compress.torch.DistributedOptimizer`
with the method. Every ``--eval-every`` steps (and after the last) the ranks
score the fixed validation windows together (each its share; the mean loss is
an allreduce) in bits per byte.

Training time is wall-clock time of the training steps only: each stretch of
steps between two evaluations starts and ends at a barrier, so it is the time
of the slowest rank, and evaluation is left out, as is loading the method's
compiled kernels before the first step (:func:`load_kernels`, reported apart). The run stops at the first
evaluation at or below ``--target`` (when given) or after ``--steps`` steps.
Rank 0 prints ``HVDC-PROGRESS`` once per step for the launcher's progress bar
and writes the curve as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from ...compressors.auto_measure import preload
from .e2e import STARTED_LINE
from .e2e_worker import run_leaving_traceback
from .tta_task import (MODELS, bits_per_byte, build_gpt, corpus_files, model_config, parameter_count,
                       read_bytes, train_batch, validation_windows)


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:{json}`` -> (name, parameters)."""
    name, _, raw = spec.partition(":")
    return name, (json.loads(raw) if raw else {})


def evaluate(model: Any, comm: Any, x: Any, y: Any) -> float:
    """Mean validation loss over all ranks' windows, in bits per byte."""
    import torch
    with torch.no_grad():
        local = np.array([float(model.loss(x, y)) * len(x), float(len(x))])
    total = comm.allreduce(local, "sum")
    return bits_per_byte(total[0] / total[1])


def load_kernels(method: Any, comm: Any) -> float:
    """Seconds to load ``method``'s compiled kernels before the clock starts (every candidate's, for
    ``auto``): two untimed calls of a throw-away copy on a small array, a matrix for the methods
    that work per matrix (:func:`~horovod_compress.compressors.auto_measure.preload`). That
    one-off start-up of a process (0.5-0.9 s per method on 4 ranks sharing 2 cores) is not
    training: left in, a run of a hundred steps would count it against every method but dense."""
    methods = list(getattr(method, "candidates", {}).values()) or [method]
    rng = np.random.default_rng(0)
    comm.barrier()
    t0 = time.perf_counter()
    for m in methods:
        shape = (128, 64) if m.layout == "matrix" else (8192,)
        preload([m], rng.standard_normal(shape).astype(np.float32), "tta#load", comm)
    comm.barrier()
    return time.perf_counter() - t0


def train_to_target(args: argparse.Namespace, comm: Any, progress: Any = None) -> dict[str, Any]:
    """Train with ``args.method`` for at most ``args.steps`` steps, stopping at the first evaluation
    whose validation loss is at or below ``args.target``; the curve and the run's figures."""
    import torch

    from ...compressors.registry import create
    from ...torch.optimizer import DistributedOptimizer
    cfg = model_config(args.model, args.batch)
    train_files, val_files = corpus_files()
    train = read_bytes(train_files, args.train_bytes)
    val = read_bytes(val_files)
    vx, vy = validation_windows(val, cfg, args.val_windows, comm.rank, comm.size)
    name, params = parse_method(args.method)
    method = create(name, **params)
    torch.manual_seed(args.seed)
    model = build_gpt(args.model)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                               named_parameters=model.named_parameters(), compression=method, comm=comm)
    loading_s = load_kernels(method, comm)
    curve = [{"step": 0, "time_s": 0.0, "val_bpb": evaluate(model, comm, vx, vy)}]
    train_s, reached = 0.0, None
    step = 0
    while step < args.steps and reached is None:
        stretch = min(args.eval_every, args.steps - step)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(stretch):
            x, y = train_batch(train, cfg, args.seed, comm.rank, step)
            opt.zero_grad()
            model.loss(x, y).backward()
            opt.step()
            step += 1
            if progress is not None:
                progress(step)
        comm.barrier()
        train_s += time.perf_counter() - t0
        bpb = evaluate(model, comm, vx, vy)
        curve.append({"step": step, "time_s": train_s, "val_bpb": bpb})
        if args.target is not None and bpb <= args.target:
            reached = step
    opt.close()
    return {"method": args.method, "seed": args.seed, "world_size": comm.size, "model": args.model,
            "parameters": parameter_count(model), "batch": cfg.batch, "seq": cfg.seq, "lr": args.lr, "max_steps": args.steps,
            "target_bpb": args.target, "eval_every": args.eval_every, "curve": curve,
            "steps_run": step, "train_s": train_s, "step_s": train_s / max(step, 1), "loading_s": loading_s,
            "final_val_bpb": curve[-1]["val_bpb"], "method_params": method.config(),
            **({"decisions": {b: d["chosen"] for b, d in method.decisions().items()}}
               if callable(getattr(method, "decisions", None)) else {}),
            "threads_per_rank": torch.get_num_threads(),
            "train_bytes": int(len(train)), "val_bytes": int(len(val)),
            "files": [len(train_files), len(val_files)]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="one rank of hvdc bench tta")
    p.add_argument("--method", required=True, help="name or name:{json parameters}")
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=None, help="windows per rank and step (default: the model's)")
    p.add_argument("--steps", type=int, required=True, help="most training steps")
    p.add_argument("--target", type=float, default=None, help="stop at this validation bits per byte")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--train-bytes", type=int, default=None, help="use at most this much training text")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    return p


def _main(args: argparse.Namespace) -> None:
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from ...mpi_collectives import Communicator
    comm = Communicator()
    rank0 = comm.rank == 0
    comm.barrier()
    if rank0:
        print(STARTED_LINE, flush=True)

    def progress(step: int) -> None:
        if rank0:
            print(f"HVDC-PROGRESS step {step}", flush=True)
    result = train_to_target(args, comm, progress)
    if rank0:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


def main(argv: list[str] | None = None) -> None:
    """Run one rank; a failing rank leaves its traceback in ``<json>.rank<r>.err`` (Open MPI may drop
    a remote rank's stderr)."""
    run_leaving_traceback(_main, parser().parse_args(argv))


if __name__ == "__main__":
    main()
