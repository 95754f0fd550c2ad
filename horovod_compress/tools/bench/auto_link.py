"""``Compression.auto`` on a link re-shaped in the middle of a run (the emulated cluster).

Two emulated hosts (one rank each) exchange one bucket of ``--numel`` float32
values with ``Compression.auto()`` for ``--steps`` calls. Before call
``s + 1`` of each ``s`` in ``--changes`` (``s:rate``, e.g. ``50:10gbit``) rank
0 writes ``at<s>`` into a folder shared with the driver and waits; the driver
re-shapes every link of the running cluster
(:meth:`~horovod_compress.tools.cluster.EmulatedCluster.reshape`), writes
``go<s>``, and the ranks leave a barrier together: the link changes between
two calls, at the same call on every rank. Each rank records every call's
wall time and ``auto``'s decision log (the call each decision was taken at,
the method chosen, why, its prediction), so the report gives the decisions
against the call and the link it ran on.

Run (root, network namespaces; hold the cluster lock, as every cluster user)::

    flock /tmp/hvdc-cluster.lock python -m horovod_compress.tools.bench.auto_link --out benchmarks/auto_link_change

Written: ``<out>.md``, ``<out>.json`` and ``<out>.png`` (each call's time
against the call, the link's rate and the decisions marked).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...compressors.auto import Auto
from ..cluster import ClusterSpec, EmulatedCluster, cluster_env, in_host
from .report_files import save_figure, write_report

#: The bucket: 4 Mi float32 values (16 MiB), whose dense exchange takes about 130 ms at 1 Gbit
#: and P = 2 and about 15-20 ms at 10 Gbit.
NUMEL = 4 << 20
#: The candidates: dense, the 16-bit cast and Top-k (1%, EF14; weighed by its steps factor, 2.3
#: times dense's steps), whose selection costs a few ns per value on the 2-core machine: at 1 Gbit
#: (32 ns per value of dense's wire time at P = 2, 16 of the cast's) Top-k wins even weighed, at
#: the emulated 10 Gbit dense or the cast does. With the default candidates Global-QSGD's 8-bit
#: sum wins at both rates there (the emulated 10 Gbit link carries about 3-5 Gbit/s on 2 busy
#: cores, and dense spends 7-9 ms outside MPI on 16 MiB): no change of decision to show.
CANDIDATES = ["none", "fp16", "topk"]
STEPS = 150
CHANGES = {50: "10gbit", 100: "1gbit"}
START = "1gbit"
#: Seconds rank 0 waits for the driver to re-shape the links.
SYNC_TIMEOUT_S = 120.0


def parse_changes(text: str) -> dict[int, str]:
    """``"50:10gbit,100:1gbit"`` -> ``{50: "10gbit", 100: "1gbit"}`` (a change after that call)."""
    out = {}
    for item in filter(None, text.split(",")):
        step, _, rate = item.partition(":")
        if not step.strip().isdigit() or not rate:
            raise ValueError(f"--changes: expected CALL:RATE items, got {item!r}")
        out[int(step)] = rate.strip()
    return out


def link_at(call: int, start: str, changes: dict[int, str]) -> str:
    """The link's rate during call ``call`` (1-based)."""
    rate = start
    for step, r in sorted(changes.items()):
        if call > step:
            rate = r
    return rate


def _wait_for_driver(comm: Any, sync: Path, step: int) -> None:
    """Rank 0 asks the driver for the change after ``step`` and waits for it; all leave together."""
    if comm.rank == 0:
        (sync / f"at{step}").touch()
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while not (sync / f"go{step}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the driver did not re-shape the links after call {step}")
            time.sleep(0.01)
    comm.barrier()


def rank_loop(comm: Any, sync: Path, *, numel: int = NUMEL, steps: int = STEPS,
              changes: dict[int, str] | None = None, candidates: list[str] | None = None,
              seed: int = 0) -> dict[str, Any]:
    """One rank's run (module docstring): each call's milliseconds and auto's decision log."""
    changes = CHANGES if changes is None else changes
    method = Auto(candidates=CANDIDATES if candidates is None else candidates, seed=seed)
    rng = np.random.default_rng(1000 * seed + comm.rank)
    grads = [rng.standard_normal(numel).astype(np.float32) for _ in range(2)]
    call_ms = []
    for t in range(1, steps + 1):
        if t - 1 in changes:
            _wait_for_driver(comm, sync, t - 1)
        t0 = time.perf_counter()
        method.allreduce(grads[t % 2], "bucket", comm)
        call_ms.append(1e3 * (time.perf_counter() - t0))
    log = [{**{k: d[k] for k in ("step", "chosen", "reason", "predicted_ms", "runner_up",
                                 "runner_up_ms", "switched")},
            "predicted_by_candidate": {c: row["predicted_ms"] for c, row in d["candidates"].items()}}
           for d in method.decision_log()]
    return {"log": log, "call_ms": call_ms, "cost": method.decision_cost(),
            "candidates": list(method.candidates)}


def drive(cluster: EmulatedCluster, proc: subprocess.Popen, sync: Path, changes: dict[int, str],
          timeout: float) -> int:
    """Re-shape ``cluster``'s links when the ranks of ``proc`` ask (:func:`rank_loop`); the exit
    status of ``proc`` (killed after ``timeout`` seconds in all)."""
    deadline = time.monotonic() + timeout
    try:
        for step, rate in sorted(changes.items()):
            while not (sync / f"at{step}").exists():
                if proc.poll() is not None:
                    return proc.returncode
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(proc.args, timeout)
                time.sleep(0.01)
            cluster.reshape(rate)
            (sync / f"go{step}").touch()
        return proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def launch(cluster: EmulatedCluster, command: list[str], sync: Path,
           changes: dict[int, str], timeout: float, ranks: int = 2) -> int:
    """Run ``command`` (an ``mpirun`` line) in host 0 of ``cluster`` with the sync folder in
    ``HVDC_AUTO_LINK_SYNC``, re-shaping the links as its ranks ask; its exit status."""
    env = cluster_env(cluster.spec, ranks)
    env["HVDC_AUTO_LINK_SYNC"] = str(sync)
    proc = subprocess.Popen(in_host(cluster.spec, command), env=env)
    return drive(cluster, proc, sync, changes, timeout)


# -------------------------------------------------------------------- the report
def decision_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Rank 0's decisions with the link each was taken on and the calls since the last change."""
    changes = {int(k): v for k, v in res["changes"].items()}
    rows = []
    for d in res["log"]:
        since = max([s for s in changes if s < d["step"]], default=0)
        rows.append({**d, "link": link_at(d["step"], res["start"], changes),
                     "calls_since_change": d["step"] - since if since else None})
    return rows


def render(res: dict[str, Any]) -> str:
    """The markdown page of one run."""
    changes = {int(k): v for k, v in res["changes"].items()}
    lines = [f"# `Compression.auto` on a link re-shaped during the run (P = {res['ranks']}, "
             f"{res['numel'] / 2 ** 20:g} Mi values)", "",
             f"`{res['command']}`, {res['date']}, on an x86_64 machine with {res['cores']} cores "
             f"shared with other jobs (load average {res['load'][0]:.1f} before, "
             f"{res['load'][1]:.1f} after): {res['ranks']} emulated hosts, one rank each, links "
             f"shaped by tc. Every time below carries that machine's noise.", "",
             f"One bucket of {res['numel']:,} float32 values, averaged by `Compression.auto()` "
             f"(candidates {', '.join(res['candidates'])}) for {res['steps']} calls. The links run at "
             f"{res['start']}, then "
             + ", then ".join(f"{r} from call {s + 1}" for s, r in sorted(changes.items()))
             + " (the driver re-shapes them between two calls, the ranks waiting at a barrier).", "",
             "## Decisions", "",
             "| call | link | calls since the change | reason | chosen | predicted (ms) | runner-up | "
             "runner-up predicted (ms) | switched |", "|---:|---|---:|---|---|---:|---|---:|---|"]
    for r in decision_rows(res):
        since = "" if r["calls_since_change"] is None else str(r["calls_since_change"])
        runner = r["runner_up"] or ""
        runner_ms = "" if r["runner_up_ms"] is None else f"{r['runner_up_ms']:.2f}"
        lines.append(f"| {r['step']} | {r['link']} | {since} | {r['reason']} | {r['chosen']} | "
                     f"{r['predicted_ms']:.2f} | {runner} | {runner_ms} | {'yes' if r['switched'] else 'no'} |")
    lines += ["", "Every rank's decision log is the same: "
              + ("yes." if res["same_log_on_every_rank"] else "**no**."), "",
              "## Call times", "",
              "| calls | link | median ms per call (slowest rank) | method at the segment's end |",
              "|---|---|---:|---|"]
    for seg in segments(res):
        lines.append(f"| {seg['first']}-{seg['last']} | {seg['link']} | {seg['median_ms']:.1f} | "
                     f"{seg['method']} |")
    c = res["cost"]
    lines += ["", f"Deciding took {c['deciding_s']:.2f} s and the drift windows and link checks "
              f"{c['checking_s']:.2f} s ({c['link_checks']} link checks, {c['link_changes']} of them "
              f"finding a change) of the run's {res['run_s']:.1f} s (rank 0).", "",
              "![calls](auto_link_change.png)", ""]
    return "\n".join(lines)


def segments(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Each stretch of calls on one link: its calls, rate, median call time, final method."""
    changes = {int(k): v for k, v in res["changes"].items()}
    bounds = [0, *sorted(changes), res["steps"]]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        ms = res["call_ms"][a:b]
        method = [d["chosen"] for d in res["log"] if d["step"] <= b][-1]
        out.append({"first": a + 1, "last": b, "link": link_at(a + 1, res["start"], changes),
                    "median_ms": float(np.median(ms)), "method": method})
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    """Each call's time (slowest rank) against the call, the links' changes and the decisions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    calls = np.arange(1, len(res["call_ms"]) + 1)
    ax.semilogy(calls, res["call_ms"], lw=1, color="0.3", label="call time (slowest rank)")
    for step, rate in res["changes"].items():
        ax.axvline(int(step) + 0.5, color="tab:red", ls="--")
        ax.text(int(step) + 1, max(res["call_ms"]), f"link -> {rate}", color="tab:red", va="top")
    for d in res["log"]:
        ax.axvline(d["step"], color="tab:blue", alpha=0.4)
        ax.text(d["step"], min(res["call_ms"]), d["chosen"], rotation=90, va="bottom",
                color="tab:blue", fontsize=8)
    ax.set_xlabel("call")
    ax.set_ylabel("ms per call")
    ax.set_title(f"auto on a re-shaped link, P = {res['ranks']}, start {res['start']}")
    ax.legend(loc="center right")
    save_figure(fig, path)


# --------------------------------------------------------------------- entry
def _worker(args: argparse.Namespace) -> None:
    from ...mpi_collectives import Communicator     # starts MPI: only in the ranks
    comm = Communicator()
    out = rank_loop(comm, Path(os.environ["HVDC_AUTO_LINK_SYNC"]), numel=args.numel,
                    steps=args.steps, changes=parse_changes(args.changes),
                    candidates=args.candidates.split(","))
    per_rank = comm.allgather_object(out)
    if comm.rank == 0:
        slowest = np.max([r["call_ms"] for r in per_rank], axis=0)
        res = {**out, "call_ms": [float(v) for v in slowest],
               "same_log_on_every_rank": all(r["log"] == out["log"] for r in per_rank),
               "run_s": float(sum(slowest)) / 1e3}
        Path(args.json).write_text(json.dumps(res))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=NUMEL)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--start", default=START, help="the links' rate at the start")
    ap.add_argument("--changes", default=",".join(f"{s}:{r}" for s, r in CHANGES.items()))
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--cluster", default="hvdcauto", help="the emulated cluster's name")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default="benchmarks/auto_link_change")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    changes = parse_changes(args.changes)
    spec = ClusterSpec(hosts=2, bandwidth=args.start, name=args.cluster)
    sync = Path(tempfile.mkdtemp(prefix="hvdc_auto_link_"))
    tmp_json = sync / "result.json"
    load0 = os.getloadavg()[0]
    try:
        with EmulatedCluster(spec) as cluster:
            cmd = ["mpirun", "-np", "2", "-x", "HVDC_AUTO_LINK_SYNC", sys.executable, "-m",
                   "horovod_compress.tools.bench.auto_link", "--worker", "--json", str(tmp_json),
                   "--numel", str(args.numel), "--steps", str(args.steps), "--changes", args.changes,
                   "--candidates", args.candidates]
            rc = launch(cluster, cmd, sync, changes, args.timeout)
        if rc != 0:
            print(f"the ranks failed: exit status {rc}", file=sys.stderr)
            return 1
        res = json.loads(tmp_json.read_text())
    finally:
        shutil.rmtree(sync, ignore_errors=True)
    res.update(ranks=2, numel=args.numel, steps=args.steps, start=args.start, changes=changes,
               load=[load0, os.getloadavg()[0]], cores=os.cpu_count(),
               command="python -m horovod_compress.tools.bench.auto_link "
               + " ".join(sys.argv[1:] if argv is None else argv),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out = Path(args.out)
    write_report(out.parent, out.stem, res, render, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
