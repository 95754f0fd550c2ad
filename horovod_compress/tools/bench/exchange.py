"""``hvdc bench exchange``: one compressed allreduce of an n x n gradient per method, with its timeline.

Run under MPI (``mpirun -np P``, or ``hvdc cluster run`` for shaped links):

    hvdc cluster run --ephemeral --hosts 4 --bandwidth 1gbit --ranks 4 -- \\
        mpirun -np 4 python -m horovod_compress.tools.bench.exchange --methods topk,oktopk --out benchmarks/timeline

Each method sees the same gradients, a new one per call, of one of two kinds:

* ``independent``: ``g_i`` standard Gaussian, independent across ranks;
* ``shared70``: ``g_i = sqrt(0.7) s + sqrt(0.3) z_i`` -- 70% of every entry's variance is a
  part ``s`` common to all ranks (as gradients of one model on different batches share their mean).

``--warm`` untimed calls first (Ok-Topk's thresholds settle; its warm-up is set to 0 so every call is
sparse), then ``--steps`` timed calls, all ranks starting each together (a barrier). A call's time is
the slowest rank's; the parts are each rank's seconds inside MPI (``Communicator.timings``), of which
``agree`` is the per-call agreement where a rank waits for late peers, and the rest outside MPI
(selection, decompression, feedback). The median over calls is reported, with the ratio to TopkA's
in the same run. The timed calls of each (method, gradient) are recorded as one timeline
(``<name>_<method>_<kind>.json``, Chrome trace-event JSON) and the last of them drawn as a Gantt
chart (``.png``; ``hvdc timeline plot --start-ms/--end-ms`` draws any other).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from .timeline_view import plot_gantt, spans_by_rank

KINDS = ("independent", "shared70")
SHARED = 0.7


def gradient(kind: str, n: int, rank: int, step: int) -> np.ndarray:
    """This rank's ``n x n`` float32 gradient of call ``step`` (see the module docstring)."""
    own = np.random.default_rng([7, step, rank]).standard_normal(n * n, dtype=np.float32)
    if kind == "independent":
        return own
    if kind != "shared70":
        raise ValueError(f"gradient kind must be one of {KINDS}, got {kind!r}")
    common = np.random.default_rng([7, step, 1 << 20]).standard_normal(n * n, dtype=np.float32)
    return np.float32(SHARED ** 0.5) * common + np.float32((1 - SHARED) ** 0.5) * own


def measure(comm: Any, spec: str, kind: str, n: int, warm: int, steps: int,
            trace_path: Path | None) -> dict[str, Any]:
    """Time ``steps`` calls of method ``spec`` (``name`` or ``name:{json}``) after ``warm``; the
    timed calls' timeline goes to ``trace_path`` (rank 0 writes it, and a chart of the last call)."""
    from ...compressors.registry import create
    from ...mpi_collectives import timeline
    from ...mpi_collectives.timeline_file import write_trace
    name, _, raw = spec.partition(":")
    params = json.loads(raw) if raw else {}
    if "warmup_steps" not in params and name == "oktopk":
        params["warmup_steps"] = 0
    method = create(name, **params)
    rows = []
    rec = None
    for step in range(warm + steps):
        g = gradient(kind, n, comm.rank, step)
        last = step == warm + steps - 1
        comm.barrier()
        comm.reset_stats()
        if step == warm and trace_path is not None:      # every timed call (the plot shows the last)
            rec = timeline.start()
        t0 = time.perf_counter()
        method.allreduce(g, "w", comm)
        wall = time.perf_counter() - t0
        if last and rec is not None:
            timeline.stop()
        if step >= warm:
            t = comm.timings()
            rows.append([wall, t["total"], t["by_op"].get("agree", 0.0), comm.stats()["sent"]])
    mine = np.median(np.array(rows), axis=0)
    slowest = comm.allreduce(np.array([r[0] for r in rows]), "max")
    mean = comm.allreduce(mine, "sum") / comm.size
    out = {"call_s": float(np.median(slowest)), "mpi_s": float(mean[1]), "agree_s": float(mean[2]),
           "outside_mpi_s": float(mean[0] - mean[1]), "sent_bytes": float(mean[3]),
           "params": method.config()}
    if trace_path is not None:
        trace = timeline.gather_trace(comm, rec, {"method": spec, "gradient": kind, "n": n})
        if trace is not None:
            write_trace(trace, trace_path)
            lo, hi = last_call_window(trace, name)
            plot_gantt(trace, trace_path.with_suffix(".png"), f"{spec}, {kind} gradients, P = {comm.size}: "
                       f"the last timed call", lo, hi)
    return out


def file_label(spec: str) -> str:
    """The file-name part of a method spec: ``name``, or ``name_key-value_...`` with parameters
    (so ``oktopk`` and ``oktopk:{"p2p_gather_max_ranks": 1}`` in one run write different files)."""
    name, _, raw = spec.partition(":")
    params = json.loads(raw) if raw else {}
    return "_".join([name] + [f"{k}-{v}" for k, v in sorted(params.items())])


def last_call_window(trace: dict[str, Any], method: str) -> tuple[float, float]:
    """The milliseconds of the last call of ``method`` in ``trace`` (earliest start to latest end
    over the ranks), with a millisecond either side."""
    spans = spans_by_rank(trace)
    last = [max((e for e in evs if e["name"] == method and e["cat"] == "method"), key=lambda e: e["ts"])
            for evs in spans.values()]
    return min(e["ts"] for e in last) / 1e3 - 1, max(e["ts"] + e["dur"] for e in last) / 1e3 + 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="topk,oktopk", help="comma-separated: name or name:{json}")
    parser.add_argument("--gradients", default=",".join(KINDS), help=f"comma-separated of {KINDS}")
    parser.add_argument("--n", type=int, default=2000, help="the gradient is n x n float32")
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/timeline")
    parser.add_argument("--name", default=None, help="file stem (default exchange_p<P>)")
    parser.add_argument("--no-traces", action="store_true", help="do not record the timelines")
    parser.add_argument("--links", default="shared memory", help="what the ranks talk over (for the record)")
    args = parser.parse_args(argv)
    from ...mpi_collectives import Communicator
    comm = Communicator()
    out = Path(args.out)
    name = args.name or f"exchange_p{comm.size}"
    if comm.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"world_size": comm.size, "n": args.n, "warm": args.warm, "steps": args.steps,
                              "links": args.links,
                              "results": {}}
    methods = [m for m in args.methods.split(",") if m]
    for kind in args.gradients.split(","):
        for spec in methods:
            label = file_label(spec)
            trace = None if args.no_traces else out / f"{name}_{label}_{kind}.json"
            res = measure(comm, spec, kind, args.n, args.warm, args.steps, trace)
            result["results"][f"{spec} {kind}"] = res
            if comm.rank == 0:
                print(f"{kind:12s} {spec:24s} call {1e3 * res['call_s']:7.1f} ms  mpi {1e3 * res['mpi_s']:7.1f}"
                      f"  agree {1e3 * res['agree_s']:6.1f}  outside {1e3 * res['outside_mpi_s']:6.1f}"
                      f"  sent {res['sent_bytes'] / 1e6:6.2f} MB", flush=True)
    if comm.rank == 0:
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
