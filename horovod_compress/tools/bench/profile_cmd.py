"""``hvdc profile``: profile your own training step, dense and each candidate method, in one run.

    hvdc profile --script my_model.py --np 2 --out my_profile.json
    hvdc profile --script my_model.py --methods none,topk,oktopk,powersgd --steps 5
    hvdc profile --script my_model.py --device cuda --np 2           # one GPU per rank
    hvdc model --profile my_profile.json --network 10gbe --ranks 8 64 256

The script is a Python file that defines

    def build_model() -> torch.nn.Module
    def batch(rank: int, step: int) -> tuple[inputs, targets]   # this rank's batch of step
    def loss(model, inputs, targets) -> torch.Tensor             # optional; default cross-entropy

On --np ranks of this machine (started with mpirun; shared memory), each method
trains --warm untimed and --steps timed steps of your model on your batches
through DistributedOptimizer (overlap off, so the parts add up), and the profile
records what the model in hvdc model needs: the forward and backward time, the
method's own compression time, and the bytes and calls of each collective per
step. On the CPU these are CPU times (what the work costs with a core per rank,
even where the ranks share cores); on a GPU, wall times (--device cuda has been
tested on PyTorch's meta device only, not yet on a real GPU). hvdc model then
predicts each method's step time and speedup on any network and number of
ranks. A method that fails on the model is reported and left out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from ...compressors.registry import available, parameter_names
from .e2e_worker import _summary, measure_method
from .launch import relaunch, under_mpi_launcher
from .train import parse_params
from .workload import script_workload

#: the methods profiled by default: dense and one of each family
DEFAULT_METHODS = ("none", "fp16", "topk", "oktopk", "global_qsgd", "powersgd", "greedylore", "deepreduce")
#: the fields of a method's measurement that the profile keeps (what hvdc model reads, and the parts)
KEPT = ("compute_cpu_s", "compress_cpu_s", "compute_s", "compress_s", "comm_s", "step_s", "ops",
        "transport", "params", "steps_measured")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="profile your own training step for dense and candidate methods",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", required=True, help="Python file defining build_model() and batch(rank, step)")
    p.add_argument("--np", type=int, default=2, help="ranks to launch with mpirun (default 2)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated methods, 'all', or name:json-params (default: %(default)s)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="parameter for every method that takes it (repeatable), e.g. --param density=0.01")
    p.add_argument("--device", default="cpu", help="torch device of the model and batches (default cpu)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per method (default 3)")
    p.add_argument("--warm", type=int, default=2, help="untimed steps before them (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="hvdc_profile.json", help="the profile file (default %(default)s)")
    p.set_defaults(func=run)


def method_specs(spec: str, params: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, name, parameters) of each method in ``spec``; ``params`` go to each method that takes
    them. ``none`` is always profiled first (the baseline)."""
    items = list(available()) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    out, seen = [], set()
    for item in ["none", *items]:
        name, _, raw = item.partition(":")
        if name not in available():
            raise ValueError(f"unknown method {name!r}; available: {', '.join(available())}")
        own = json.loads(raw) if raw else {}
        mine = {k: v for k, v in params.items() if k in parameter_names(name)}
        merged = {**mine, **own}
        label = name if not merged else f"{name}({','.join(f'{k}={v}' for k, v in merged.items())})"
        if label not in seen:
            seen.add(label)
            out.append((label, name, merged))
    return out


def run(args: argparse.Namespace) -> int:
    specs = method_specs(args.methods, parse_params(args.param))
    script_workload(args.script, args.device)           # a clear error before any rank starts
    if args.np > 1 and not under_mpi_launcher():
        return relaunch(args.np, "horovod_compress.tools.cli", sys.argv[1:])
    from ...mpi_collectives import Communicator
    comm = Communicator()
    workload = script_workload(args.script, args.device)
    methods: dict[str, Any] = {}
    bar = _progress(len(specs)) if comm.rank == 0 else None
    for label, name, params in specs:
        try:
            method, records = measure_method(name, params, workload, comm, args.steps, args.warm, args.seed)
            summary = _summary(method, comm, records)
            methods[label] = _kept(summary, args.device)
        except Exception as exc:  # noqa: BLE001 -- a method that cannot run this model is reported, not fatal
            if comm.rank == 0:
                traceback.print_exc()
            methods[label] = {"error": f"{type(exc).__name__}: {exc}"}
            if label == "none":
                raise
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(label)
    if bar is not None:
        bar.close()
    if comm.rank == 0:
        profile = {"format": "hvdc-profile/1", "runs": [{
            "world_size": comm.size, "bandwidth": "profile", "model": workload.name,
            "script": str(Path(args.script).resolve()), "device": args.device,
            "cores": os.cpu_count(), "steps": args.steps, "warm": args.warm, "methods": methods}]}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(profile, indent=1, sort_keys=True) + "\n")
        failed = [label for label, m in methods.items() if "error" in m]
        print(f"profile of {workload.name} on {comm.size} rank(s), {args.device}: {args.out}"
              + (f" (failed: {', '.join(failed)})" if failed else ""), flush=True)
        print(f"next: hvdc model --profile {args.out} --network 10gbe --ranks 8 64", flush=True)
    return 0


def _kept(summary: dict[str, Any], device: str) -> dict[str, Any]:
    """The fields of one method's measurement a profile keeps. On a GPU the CPU time of the
    forward and backward pass misses the device's work: the wall times are taken instead."""
    kept = {k: summary[k] for k in KEPT if k in summary}
    if device != "cpu":
        kept["compute_cpu_s"], kept["compress_cpu_s"] = summary["compute_s"], summary["compress_s"]
    return kept


def _progress(total: int) -> Any:
    """A progress bar over the methods on a terminal; ``None`` (no bar) otherwise."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="profile", unit="method", file=sys.stderr)
