"""``hvdc bench overlap``: what overlapping communication with the backward pass buys.

Trains the digits MLP (widened with ``--hidden`` so communication matters)
twice per method -- buckets reduced after the backward pass, and buckets
reduced on the communication thread as soon as they are ready -- and reports
seconds per step, the time ``step()`` waited for communication, and the
speed-up. Both runs are in the same job, alternating, so machine noise hits
both alike.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .launch import relaunch, under_mpi_launcher


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("overlap", help="seconds per step with and without overlap")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--compression", default="none,topk")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", default="benchmarks/overlap.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.np > 1 and not under_mpi_launcher():
        import sys
        return relaunch(args.np, "horovod_compress.tools.cli", sys.argv[1:])
    from ...compressors.registry import create
    from ...mpi_collectives import Communicator
    from .digits import train_digits
    comm = Communicator()
    rows = []
    for name in [s.strip() for s in args.compression.split(",") if s.strip()]:
        timing = {False: [], True: []}
        waits = {False: [], True: []}
        for _ in range(args.repeat):
            for overlap in (False, True):
                r = train_digits(create(name), comm, epochs=args.epochs, hidden=args.hidden,
                                 overlap=overlap, bucket_bytes=int(args.bucket_mb * 2**20))
                timing[overlap].append(r["seconds_per_step"])
                waits[overlap].append(r["wait_seconds_per_step"] if overlap else r["comm_seconds_per_step"])
        best = {k: min(v) for k, v in timing.items()}
        rows.append({"method": name, "num_params": r["num_params"],
                     "ms_per_step_no_overlap": 1e3 * best[False],
                     "ms_per_step_overlap": 1e3 * best[True],
                     "ms_waiting_no_overlap": 1e3 * min(waits[False]),
                     "ms_waiting_overlap": 1e3 * min(waits[True]),
                     "speedup": best[False] / best[True]})
    if comm.rank == 0:
        lines = ["# Overlap of communication with the backward pass\n",
                 f"`hvdc bench overlap --np {comm.size} --hidden {args.hidden} --bucket-mb {args.bucket_mb}` "
                 f"(digits MLP, {rows[0]['num_params']} parameters, best of {args.repeat}; "
                 f"{comm.size} ranks on this machine's cores).\n",
                 "| method | ms/step, reduce after backward | ms/step, overlapped | "
                 "ms/step step() waits (after / overlapped) | speed-up |",
                 "|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['method']} | {r['ms_per_step_no_overlap']:.2f} | {r['ms_per_step_overlap']:.2f} | "
                         f"{r['ms_waiting_no_overlap']:.2f} / {r['ms_waiting_overlap']:.2f} | {r['speedup']:.2f}x |")
        text = "\n".join(lines) + "\n"
        print(text)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0
