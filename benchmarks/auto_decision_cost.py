"""What ``Compression.auto`` spends on deciding, as a share of a 1,000-step training run, on real ranks.

Run (P = 2 and 4; the machine's own links, shared memory)::

    flock /tmp/hvdc-bench.lock mpirun -np 2 --oversubscribe .venv/bin/python benchmarks/auto_decision_cost.py
    flock /tmp/hvdc-bench.lock mpirun -np 4 --oversubscribe .venv/bin/python benchmarks/auto_decision_cost.py

One run: an MLP (``IN`` inputs, ``LAYERS`` hidden layers of ``WIDTH`` x ``WIDTH``, 10 classes)
trained for ``STEPS`` steps of SGD with our torch ``DistributedOptimizer`` and
``Compression.auto()`` (default candidates), buckets capped at ``BUCKET_BYTES`` so each hidden
layer is a bucket of its own (same shape: the decision is shared between them). The run's
wall time is the slowest rank's; ``auto.decision_cost()`` gives the seconds spent deciding
(bounds, dry runs, probes, agreement), split into every bucket's first decision and the
decisions taken again after a drift or a link change; apart from them, the process's one-off
loading of every candidate's compiled kernels before its first decision, and the drift
windows' agreements and link checks (each the largest over ranks; a window is agreed in the
next link check's allreduce, or on its own where no check came). Prints one markdown
section on rank 0.
"""
from __future__ import annotations

import os
import platform
import time
from collections import Counter

import numpy as np
import torch

import horovod_compress as hvdc
from horovod_compress.mpi_collectives import Communicator
from horovod_compress.torch import DistributedOptimizer

IN, WIDTH, LAYERS, BATCH = 256, 512, 3, 32
STEPS = int(os.environ.get("AUTO_COST_STEPS", "1000"))    # fewer for a smoke test
BUCKET_BYTES = 1100 << 10   # one hidden layer (1 MiB + its bias) per bucket


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN, WIDTH), torch.nn.ReLU()]
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def main() -> None:
    torch.set_num_threads(1)
    comm = Communicator()
    model = _model()
    auto = hvdc.Compression.auto()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), compression=auto,
                               bucket_bytes=BUCKET_BYTES)
    gen = torch.Generator().manual_seed(comm.rank)
    xs = [torch.randn(BATCH, IN, generator=gen) for _ in range(8)]
    ys = [torch.randint(0, 10, (BATCH,), generator=gen) for _ in range(8)]
    comm.barrier()
    t0 = time.perf_counter()
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs[step % 8]), ys[step % 8])
        loss.backward()
        opt.step()
    total = time.perf_counter() - t0
    cost = auto.decision_cost()
    mine = np.array([total, cost["deciding_s"], cost["first_calls_s"], cost["again_s"],
                     cost["checking_s"], cost["loading_s"], cost["link_s"]], np.float64)
    run_s, deciding, first, again, checking, loading, link = comm.allreduce(mine, "max")
    if comm.rank != 0:
        return
    decisions = auto.decisions()
    chosen = ", ".join(f"{b}: {d['chosen']}" + (f" (as {d['shared_with']})" if d["shared_with"] else "")
                       for b, d in sorted(decisions.items()))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"## P = {comm.size}\n")
    print(f"`mpirun -np {comm.size}` on one machine ({platform.machine()}, {os.cpu_count()} cores, "
          f"shared memory), load average {os.getloadavg()[0]:.1f} when the run ended"
          f"{'; 4 ranks on 2 cores: oversubscribed' if comm.size > (os.cpu_count() or 1) else ''}. "
          f"MLP {IN}-{'-'.join([str(WIDTH)] * (LAYERS + 1))}-10 ({n_params:,} parameters), batch "
          f"{BATCH} per rank, {STEPS} SGD steps, one thread per rank; buckets of at most "
          f"{BUCKET_BYTES / 2 ** 20:.2f} MiB. Times are the slowest rank's.\n")
    print(f"| {STEPS:,}-step run (s) | loading kernels, once (s) | / run | first decisions (s) | / run | "
          "decisions again (s) | drift windows + link checks (s) | of which link checks (s) | "
          "deciding + checks / run | windows agreed on their own | "
          "decisions measured | re-checked on slices | shared | candidates ruled out by the bound |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {run_s:.2f} | {loading:.3f} | {100 * loading / run_s:.2f}% | {first:.3f} | "
          f"{100 * first / run_s:.2f}% | {again:.3f} | {checking:.3f} | {link:.3f} | "
          f"{100 * (deciding + checking) / run_s:.2f}% | {cost['drift_agreements']} | "
          f"{cost['measured']} | {cost['rechecked']} | {cost['shared']} | {cost['ruled_out']} |\n")
    reasons = Counter(d["reason"].split(",")[0] for d in auto.decision_log())
    print(f"Decisions at the end: {chosen}; {len(auto.decision_log())} decisions in all "
          f"({', '.join(f'{n} {r}' for r, n in sorted(reasons.items()))}); "
          f"{cost['link_checks']} link checks, {cost['link_changes']} of them finding a change.\n")


if __name__ == "__main__":
    main()
