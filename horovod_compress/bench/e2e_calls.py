"""The size of every collective call a method issues in one training step, for the e2e model.

The alpha-beta model needs, per call, how many bytes it moves: the number of
latency rounds of the algorithm MPI runs depends on the message size (Open
MPI's recursive doubling below 64 KiB, the ring from there on, as the
emulated cluster configures it), and a shaped link's token bucket lets a
small message through at wire speed (see :mod:`horovod_compress.cost_model`).
``hvdc bench e2e`` records only each operation's totals, so this module runs
one training step per method on shared memory -- the byte counts are those of
the Communicator's volume model and do not depend on the link -- and logs every
call. Nothing here is timed.

    mpirun -np 4 python -m horovod_compress.bench.e2e_calls --model transformer --json out.json

:func:`record` runs it for several P and merges the result into one JSON file
``{"<model>": {"<P>": {"<method label>": {"<op>": [bytes per call, ...]}}}}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def call_sizes(methods: list[str], model_name: str, comm: Any, steps: int = 2) -> dict[str, dict[str, list[float]]]:
    """``{label: {op: [max(sent, received) of each call]}}`` of the last of ``steps`` training steps."""
    import torch

    from ..compressors.registry import create
    from ..torch.optimizer import DistributedOptimizer
    from .e2e_models import build_model, synthetic_batch
    log: list[tuple[str, float]] = []
    inner = comm._account

    def account(op: str, sent: float, received: float) -> None:
        log.append((op, max(sent, received)))
        inner(op, sent, received)
    comm._account = account
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for spec in methods:
            name, _, raw = spec.partition(":")
            params = json.loads(raw) if raw else {}
            label = name if not params else f"{name}({','.join(f'{k}={v}' for k, v in params.items())})"
            method = create(name, **params)
            if getattr(method, "warmup_steps", 0) and "warmup_steps" not in params:
                method = create(name, **{**params, "warmup_steps": 0})   # as hvdc bench e2e times it
            torch.manual_seed(0)
            model = build_model(model_name)
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters(), compression=method,
                                       overlap=False, comm=comm)
            for step in range(steps):
                log.clear()
                x, y = synthetic_batch(model_name, comm.rank, step)
                opt.zero_grad()
                model.loss(x, y).backward()
                opt.step()
            opt.close()
            calls: dict[str, list[float]] = {}
            for op, nbytes in log:
                calls.setdefault(op, []).append(float(nbytes))
            out[label] = calls
    finally:
        comm._account = inner
    return out


def record(world_sizes: list[int], methods: list[str], model_name: str, path: Path,
           timeout: float = 1200) -> dict[str, Any]:
    """Run :func:`call_sizes` at each P on shared memory (mpirun) and merge into ``path``."""
    import tempfile

    from ..testing import mpi_env, mpirun_command
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    for p in world_sizes:
        with tempfile.TemporaryDirectory(prefix="hvdc-calls-") as tmp:
            out = os.path.join(tmp, "calls.json")
            cmd = mpirun_command(p) + [sys.executable, "-m", "horovod_compress.bench.e2e_calls",
                                       "--methods", ",".join(methods), "--model", model_name, "--json", out]
            proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"recording call sizes at P={p} failed (exit {proc.returncode}):\n"
                                   f"{proc.stderr[-3000:]}")
            data.setdefault(model_name, {}).setdefault(str(p), {}).update(json.loads(Path(out).read_text()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return data


def main(argv: list[str] | None = None) -> None:
    """One rank: log the calls of every method, rank 0 writes ``--json``."""
    parser = argparse.ArgumentParser(description="per-call message sizes of every method (one rank)")
    parser.add_argument("--methods", required=True, help="comma-separated; name or name:json-params")
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from ..mpi_collectives import Communicator
    from .e2e import split_specs
    comm = Communicator()
    result = call_sizes(split_specs(args.methods), args.model, comm)
    if comm.rank == 0:
        Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
