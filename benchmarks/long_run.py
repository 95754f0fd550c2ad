"""What a long run holds: memory and communicators after 10,000 steps, per method, on real ranks.

Run (2 ranks; ``HVDC_MPI=mpich`` and ``mpiexec.mpich`` for MPICH, see
``horovod_compress/tools/mpi_launcher.py`` for the environment it needs)::

    mpirun -np 2 .venv/bin/python benchmarks/long_run.py --steps 10000 > benchmarks/long_run.md

The issue's model -- two linear layers, 64x64 and 10x64 weights with their
biases -- trains with ``horovod_compress.torch.DistributedOptimizer`` and each
method for ``--steps`` steps. Measured on every rank (the table shows the
largest): the resident memory's growth per step from the end of a warm-up to
the last step, the private check communicators the process holds
(``mpi_collectives.check_group.check_groups_alive``), the MPI communicators
created after the warm-up (every ``Dup``/``Split``/``Create`` of the world
communicator, which is a counting ``MPI.Intracomm`` subclass here), and the
growth of live Python objects per step.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import platform
import sys

import numpy as np
import torch
from mpi4py import MPI
from tqdm import tqdm

import horovod_compress as hvdc
import horovod_compress.torch as hvdc_torch
from horovod_compress.mpi_collectives import Communicator
from horovod_compress.mpi_collectives.check_group import check_groups_alive
from horovod_compress.torch import DistributedOptimizer

METHODS = {
    "GreedyLore r=4": ("greedylore", {"rank": 4}),
    "ARC-Top-K": ("arc_topk", {}),
    "lazy projection r=4": ("lazy_projection", {"rank": 4}),
    "PowerSGD r=4": ("powersgd", {"rank": 4}),
    "TopkA": ("topk", {"density": 0.01}),
    "Global-QSGD": ("global_qsgd", {}),
}
WARMUP = 2000


class CountingIntracomm(MPI.Intracomm):
    """``MPI.COMM_WORLD`` under another class: counts the communicators derived from it."""

    created = 0

    def Dup(self, *args, **kwargs):  # noqa: N802 - mpi4py's names
        CountingIntracomm.created += 1
        return super().Dup(*args, **kwargs)

    def Split(self, *args, **kwargs):  # noqa: N802
        CountingIntracomm.created += 1
        return super().Split(*args, **kwargs)

    def Create(self, *args, **kwargs):  # noqa: N802
        CountingIntracomm.created += 1
        return super().Create(*args, **kwargs)

    def Create_group(self, *args, **kwargs):  # noqa: N802
        CountingIntracomm.created += 1
        return super().Create_group(*args, **kwargs)


def rss_kb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024.0


def held() -> dict[str, float]:
    """Live objects, then resident memory (after the list of objects was made and dropped, at
    both ends alike: the allocator keeps that list's memory), and communicators created."""
    gc.collect()
    objects = len(gc.get_objects())
    return {"objects": objects, "rss": rss_kb(), "created": CountingIntracomm.created}


def measure(label: str, comm: Communicator, warmup: int, steps: int,
            bar: tqdm | None) -> dict[str, float]:
    name, params = METHODS[label]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(),
                               compression=hvdc.Compression.by_name(name, **params), comm=comm)
    gen = torch.Generator().manual_seed(comm.rank)
    batches = [(torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen))
               for _ in range(16)]
    start = {}
    for step in range(warmup + steps):
        if step == warmup:
            start = held()
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if bar is not None:
            bar.update(1)
    end = held()
    out = {"kb_per_step": (end["rss"] - start["rss"]) / steps,
           "objects_per_step": (end["objects"] - start["objects"]) / steps,
           "created": end["created"] - start["created"],
           "check_comms": check_groups_alive()}
    opt.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000, help="measured steps per method")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="steps before the measurement")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                        metavar="METHOD", help=f"methods to run (default all: {', '.join(METHODS)})")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    torch.set_num_threads(1)
    world = CountingIntracomm(MPI.COMM_WORLD)
    hvdc_torch.init(comm=world)
    comm = Communicator(world)
    bar = (tqdm(total=len(args.methods) * (args.warmup + args.steps), desc="steps", file=sys.stderr)
           if comm.rank == 0 else None)
    rows = collections.OrderedDict()
    for label in args.methods:
        mine = measure(label, comm, args.warmup, args.steps, bar)
        every = comm.allgather_object(mine)
        rows[label] = {k: max(e[k] for e in every) for k in mine}
    if bar is not None:
        bar.close()
    if comm.rank != 0:
        return
    library = MPI.Get_library_version().splitlines()[0].strip()
    print("# Long runs: memory and communicators per step\n")
    print(f"`benchmarks/long_run.py --warmup {args.warmup} --steps {args.steps}`, {comm.size} ranks, "
          f"{library}, "
          f"mpi4py {__import__('mpi4py').__version__}, torch {torch.__version__}, "
          f"Python {platform.python_version()}; a shared 2-core machine (other jobs running; no "
          f"timings are reported). "
          f"The 2-layer model (64x64 and 10x64 weights, biases) trained with "
          f"`horovod_compress.torch.DistributedOptimizer`; every number is the largest over the "
          f"ranks, measured from step {args.warmup} to step {args.warmup + args.steps}.\n")
    print("| method | RSS growth per step | check communicators held | MPI communicators "
          "created after warm-up | live objects per step |")
    print("|---|---:|---:|---:|---:|")
    for label, r in rows.items():
        print(f"| {label} | {r['kb_per_step']:.1f} KB | {r['check_comms']:.0f} | {r['created']:.0f} "
              f"| {r['objects_per_step']:+.3f} |")


if __name__ == "__main__":
    main()
