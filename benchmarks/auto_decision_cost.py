"""What ``Compression.auto`` spends on deciding, against the exchanges it then runs, on real ranks.

Run (P = 2 and 4; the machine's own links, shared memory)::

    flock /tmp/hvdc-bench.lock mpirun -np 2 --oversubscribe .venv/bin/python benchmarks/auto_decision_cost.py
    flock /tmp/hvdc-bench.lock mpirun -np 4 --oversubscribe .venv/bin/python benchmarks/auto_decision_cost.py

For each bucket size: the wall time of a bucket's first ``auto`` call (its
decision: ``dry_runs`` calls of every default candidate, the tiny probes, the
agreement, then the exchange itself), the median of ``STEPS`` later calls (the
chosen method's exchange plus ``auto``'s bookkeeping, drift agreement included),
and the same median of the chosen method run by hand, the two alternating (the
baseline of the same run). The first row is the process's first decision, which
also loads every candidate's compiled kernels. ``decision / 1000 exchanges`` bounds the share of a 1,000-step run the
decision costs when every step were nothing but its exchange (a real step also
computes its forward and backward pass, so the share is smaller). Prints one
markdown table on rank 0.
"""
from __future__ import annotations

import os
import platform
import time

import numpy as np

import horovod_compress as hvdc
from horovod_compress.compressors.registry import create
from horovod_compress.mpi_collectives import Communicator

SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)     # float32 values per bucket
STEPS = 30


def _timed(comm, fn) -> float:
    comm.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _slowest(comm, seconds: float) -> float:
    return float(comm.allreduce(np.array([seconds]), "max")[0])


def _decide_and_run(comm, n: int) -> tuple:
    """One bucket of ``n`` values: its decision, then STEPS interleaved calls of auto and of the
    chosen method by hand (same gradients, alternating, so both meet the same machine)."""
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    auto = hvdc.Compression.auto()
    first = _slowest(comm, _timed(comm, lambda: auto.allreduce(grads[0], "bucket", comm)))
    d = auto.decisions()["bucket"]
    by_hand = create(d["chosen"]) if d["chosen"] != "oktopk" else create("oktopk", warmup_steps=0)
    by_hand.allreduce(grads[0], "bucket", comm)
    auto_s, hand_s = [], []
    for step in range(STEPS):
        g = grads[step % 4]
        auto_s.append(_timed(comm, lambda: auto.allreduce(g, "bucket", comm)))
        hand_s.append(_timed(comm, lambda: by_hand.allreduce(g, "bucket", comm)))
    steady = _slowest(comm, float(np.median(auto_s)))
    alone = _slowest(comm, float(np.median(hand_s)))
    return d, first, steady, alone, len(auto.decision_log())


def main() -> None:
    comm = Communicator()
    # the process's first decision also loads every candidate's compiled kernels (once per process)
    warm = _decide_and_run(comm, SIZES[0])
    rows = [(SIZES[0], "first in the process", *warm)]
    for n in SIZES:
        rows.append((n, "", *_decide_and_run(comm, n)))
    if comm.rank == 0:
        print(f"# Cost of `Compression.auto`'s decision, P = {comm.size}\n")
        print(f"`mpirun -np {comm.size}` on one machine ({platform.machine()}, {hvdc.__name__} "
              f"{hvdc.__version__}; shared-memory transport), load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} cores when it started, {comm.size} ranks"
              f"{' (oversubscribed)' if comm.size > 2 else ''}: timings carry that machine's noise. "
              f"Default candidates, `dry_runs=2`; times are the slowest rank's, in ms; the steady "
              f"columns are medians of {STEPS} calls, auto's and the chosen method's by hand "
              f"alternating (the baseline of the same run).\n")
        print("| values | note | chosen | runner-up | first call (decision) | steady auto call | "
              "chosen method alone | auto / alone | decision / 1000 exchanges | decisions |")
        print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|")
        for n, note, d, first, steady, alone, count in rows:
            print(f"| {n:,} | {note} | {d['chosen']} | {d['runner_up']} | {1e3 * first:.1f} | "
                  f"{1e3 * steady:.2f} | {1e3 * alone:.2f} | {steady / alone:.2f} | "
                  f"{100 * first / (1000 * steady):.2f}% | {count} |")


if __name__ == "__main__":
    main()
