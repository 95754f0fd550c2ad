"""``hvdc bench e2e``: whole training steps of every method on shaped links, beside the model.

For each P in ``--hosts`` the launcher builds an emulated cluster of P hosts
(:mod:`horovod_compress.tools.cluster`), and for each bandwidth it reshapes the
links and runs :mod:`.e2e_worker` with one rank per host. Every rank gets
its share of the cores (threads = cores // P, at least 1), and says so.

The worker probes the links (small to 16 MiB messages of each collective
the methods use) -- what the links really carry -- before each round of the
methods and after the last, pooling the passes' samples, and times
``--steps`` training steps per method in each round. The launcher fits the alpha-beta model
to the probes (:func:`horovod_compress.cost_model.fit_link`: per collective
kind its alpha and carried rate, the links' token bucket, a per-round latency
floor measured between bursts of CPU work, the rounds of the algorithm the
cluster's MPI runs), predicts every method's communication time from the size
of each of its calls (recorded on shared memory by :mod:`.e2e_calls`, checked
against the measured bytes and calls) and the transport that carried them (an
allreduce a method runs as its own pipelined point-to-point ring is priced at
the point-to-point probe, less the method's work that ran while it was on the
wire; see :func:`profile_of`), and writes
``<out>/<name>.md``, ``.json`` and ``.png`` (speedup over dense against
bandwidth).

    hvdc bench e2e                                    # P = 2, 4 at 100 Mbit, 1 Gbit, 10 Gbit
    hvdc bench e2e --hosts 4 --bandwidths 1gbit --methods none,topk,oktopk
    hvdc bench e2e --model matrix2000 --name e2e_matrix2000
    hvdc bench e2e --no-cluster --hosts 2 --bandwidths shm   # shared memory, no shaping
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ...cost_model import PROBE_OF, RING, OpCount, StepProfile, break_even_bandwidth, fit_link, predict
from .e2e_calls import GAP_SUFFIX, PROBE_REPEATS, REST_SUFFIX, parse_spec, split_specs

#: The line rank 0 of :mod:`.e2e_worker` prints once every rank is in MPI.
STARTED_LINE = "HVDC-STARTED"

DEFAULT_BANDWIDTHS = ("100mbit", "1gbit", "10gbit")
SHM = "shm"
MODEL_CHECK = ("100mbit", "1gbit")   # where the model must be within 25%
TOLERANCE = 0.25
#: The emulated cluster's MPI runs allreduce by recursive doubling below 64 KiB and by the ring
#: from 64 KiB on (:data:`horovod_compress.tools.cluster.launch_files.ALLREDUCE_RULES`): the model counts those rounds.
RING_FROM = 65536
#: The probes in the link table, in order (a run that lacks one shows '-').
LINK_COLUMNS = ("p2p", "p2p_oneway", "ring", "allreduce", "allgatherv", "allgather", "alltoallv", "broadcast")


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("e2e", help="training steps of every method on an emulated cluster with shaped links",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4], help="values of P (one rank per host)")
    p.add_argument("--bandwidths", nargs="+", default=list(DEFAULT_BANDWIDTHS),
                   help="link rates (tc units: 100mbit, 1gbit, 10gbit); 'shm' with --no-cluster")
    p.add_argument("--methods", default="all",
                   help="'all' or comma-separated names; name:{json} sets parameters, e.g. "
                        "'powersgd:{\"rank\":4}'")
    p.add_argument("--model", default="transformer", choices=("transformer", "matrix2000", "tiny"))
    p.add_argument("--steps", type=int, default=5,
                   help="measured steps per method and round (median over all reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the methods this many times in turn (A B C, A B C, ...), so a slow "
                        "phase of a shared machine falls on all of them alike (default 1)")
    p.add_argument("--warm", type=int, default=3,
                   help="untimed steps first (default 3: a method's first steps load its compiled kernels "
                        "and map its buffers, and GreedyLore's first step is its SVD step)")
    p.add_argument("--out", default="benchmarks", help="directory for the results")
    p.add_argument("--name", default="e2e", help="file stem of the results")
    p.add_argument("--no-cluster", action="store_true", help="run on shared memory (no namespaces, no shaping)")
    p.add_argument("--cluster-name", default=None,
                   help="name of the emulated cluster it builds (default: e2e<pid>, so runs never share one)")
    p.add_argument("--subnet", default=None,
                   help="first three octets of the cluster's /24 (default 10.213.0; give concurrent runs their own)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per (P, bandwidth) run")
    p.add_argument("--probe-repeats", type=int, default=PROBE_REPEATS,
                   help="samples of each link probe in all, spread over the probe passes (one before "
                        "each round, one after the last; default %(default)s)")
    p.add_argument("--start-timeout", type=float, default=120,
                   help="seconds for mpirun to bring every rank up; a run whose ranks did not start "
                        "is launched once more (default 120)")
    p.add_argument("--call-sizes", metavar="JSON", default=None,
                   help="per-call message sizes of each method (default <out>/<name>_calls.json); a measuring "
                        "run records the missing P first, on shared memory (see bench/e2e_calls.py)")
    p.add_argument("--timeline", metavar="DIR", default=None,
                   help="write the timeline of the measured steps of each method's first round to "
                        "DIR/<name>_p<P>-<bandwidth>_<method>.json (Chrome trace-event JSON; docs/timeline.md)")
    p.add_argument("--rerender", metavar="JSON", nargs="+", default=None,
                   help="re-analyse and re-render earlier runs' JSON (no measurement); several files are "
                        "merged into one report, e.g. P=2 and P=4 measured in two invocations")
    p.set_defaults(func=run)


def method_list(spec: str) -> list[str]:
    """``'all'`` -> every registered method (dense first); else the comma-separated items."""
    from ...compressors import registry
    if spec == "all":
        return registry.available()
    items = split_specs(spec)
    for item in items:
        registry.method_class(item.partition(":")[0])      # ValueError naming the method
    if not any(i.partition(":")[0] == "none" for i in items):
        items.insert(0, "none")                             # the baseline of every ratio
    return items


def _worker_command(p: int, methods: list[str], args: argparse.Namespace, json_path: str,
                    local: bool) -> list[str]:
    from ..testing import mpirun_command
    mpirun = mpirun_command(p) if local else ["mpirun", "-np", str(p)]
    timeline = ([] if getattr(args, "timeline", None) is None else
                ["--timeline", os.path.abspath(os.path.join(args.timeline, f"{args.name}_{Path(json_path).stem}"))])
    return mpirun + [sys.executable, "-m", "horovod_compress.tools.bench.e2e_worker",
                     "--methods", ",".join(methods), "--model", args.model, "--steps", str(args.steps),
                     "--warm", str(args.warm), "--rounds", str(args.rounds),
                     "--probe-repeats", str(args.probe_repeats), "--json", json_path, *timeline]


class RanksDidNotStart(RuntimeError):
    """mpirun did not bring the workers up (no rank reported in within the start timeout)."""


def _stream(cmd: list[str], env: dict[str, str], bar: Any, label: str, timeout: float,
            json_path: str | None = None, start_timeout: float | None = None) -> None:
    """Run the workers, advancing ``bar`` on each progress line; raise with stderr's tail on failure.

    A rank that fails writes its traceback to ``<json_path>.rank<r>.err`` (see :mod:`.e2e_worker`):
    Open MPI may drop an aborting remote rank's stderr, so those files are read too.
    ``start_timeout``: seconds until rank 0 must have reported in (its ``HVDC-STARTED`` line, once
    every rank is in MPI), else :class:`RanksDidNotStart`. Once in a long run mpirun launched no
    workers across the emulated hosts and waited, with no rank and no error, for the whole
    ``--timeout`` (2026-11-28, P = 4 at 10 Gbit after five runs that started)."""
    import threading
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        expired, started, stalled = threading.Event(), threading.Event(), threading.Event()

        def expire() -> None:          # a hung job must not hang the benchmark
            expired.set()
            proc.kill()

        def check_start() -> None:
            if not started.is_set():
                stalled.set()
                proc.kill()
        timer = threading.Timer(timeout, expire)
        timer.start()
        watchdog = threading.Timer(start_timeout, check_start) if start_timeout else None
        if watchdog is not None:
            watchdog.start()
        try:
            other: list[str] = []
            for line in proc.stdout:
                if line.startswith(STARTED_LINE):
                    started.set()
                elif line.startswith("HVDC-PROGRESS "):
                    started.set()
                    bar.set_postfix_str(f"{label} {line.split(' ', 1)[1].strip()}")
                    bar.update(1)
                else:
                    other = (other + [line])[-50:]
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            timer.cancel()
            if watchdog is not None:
                watchdog.cancel()
        if stalled.is_set():
            raise RanksDidNotStart(f"benchmark workers at {label}: no rank started within {start_timeout:.0f} s "
                                   f"of mpirun (--start-timeout)")
        if expired.is_set():
            raise RuntimeError(f"benchmark workers at {label} did not finish within {timeout:.0f} s (--timeout)")
        if rc != 0:
            err.seek(0)
            ranks = ""
            if json_path:
                import glob
                for f in sorted(glob.glob(glob.escape(json_path) + ".rank*.err")):
                    ranks += f"--- {os.path.basename(f)} ---\n{Path(f).read_text()[-3000:]}\n"
            raise RuntimeError(f"benchmark workers failed (exit {rc}) at {label}:\n{''.join(other)[-2000:]}"
                               f"{err.read()[-4000:]}{ranks}")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..cluster import ClusterSpec, EmulatedCluster, cluster_env, describe, in_host, threads_per_rank
    from ..testing import mpi_env
    if args.rerender:
        olds = [json.loads(Path(f).read_text()) for f in args.rerender]
        report = analyse([r for old in olds for r in old["runs"]], args)
        report["analysed"] = f"{report['when']} with the cost model at commit `{report['commit']}`"
        for key in ("when", "command", "machine", "versions", "commit"):
            values = [old[key] for old in olds if key in old]
            if values:
                report[key] = values[0] if len(set(values)) == 1 else "; ".join(dict.fromkeys(values))
        for key in ("warm", "steps"):                 # the runs' own, not this command's defaults
            values = {old[key] for old in olds if key in old}
            if len(values) == 1 and all(key in old for old in olds):
                report[key] = values.pop()
            else:
                report.pop(key, None)
        # a run that failed in one invocation and was measured by another one given here is no gap
        measured = {(r["world_size"], r["bandwidth"]) for r in report["runs"]}
        report["failed_runs"] = [f for old in olds for f in old.get("failed_runs", [])
                                 if (f["world_size"], f["bandwidth"]) not in measured]
        if all("namespaces_left" in old for old in olds):   # the runs' own teardown check
            report["namespaces_left"] = [n for old in olds for n in old["namespaces_left"]]
        write_results(report, Path(args.out), args.name)
        print(render_markdown(report))
        return 0
    methods = method_list(args.methods)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.probe_repeats < 1:
        raise ValueError(f"--probe-repeats must be >= 1, got {args.probe_repeats}")
    if args.no_cluster:
        bws = [SHM]
    else:
        bws = list(args.bandwidths)
        if SHM in bws:
            raise ValueError("'shm' needs --no-cluster")
        from ..cluster import parse_rate
        for bw in bws:
            parse_rate(bw)
    calls_path = _calls_path(args)
    known = json.loads(calls_path.read_text()).get(args.model, {}) if calls_path.exists() else {}
    missing = [p for p in args.hosts if any(not _has_calls(known.get(str(p), {}), _label(m)) for m in methods)]
    if missing:
        from .e2e_calls import record
        print(f"[e2e] recording each method's per-call message sizes at P={missing} on shared memory "
              f"-> {calls_path}", file=sys.stderr)
        record(missing, methods, args.model, calls_path)
    runs: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []       # a run that fails or times out is reported, the others kept

    def measure(cmd: list[str], env: dict[str, str], p: int, bw: str, path: str,
                extra: dict[str, Any] | None = None) -> None:
        extra = {**(extra or {}), "load_before": os.getloadavg()[0]}   # the machine is shared: say how much
        try:
            try:
                _stream(cmd, env, bar, f"P={p} {bw}", args.timeout, path, args.start_timeout)
            except RanksDidNotStart as exc:     # nothing ran: launch it once more
                tqdm.write(f"[e2e] P={p} {bw}: {exc}; launching it again", file=sys.stderr)
                _stream(cmd, env, bar, f"P={p} {bw}", args.timeout, path, args.start_timeout)
            runs.append({"bandwidth": bw, **json.loads(Path(path).read_text()), **extra,
                         "load_after": os.getloadavg()[0]})
        except RuntimeError as exc:
            tqdm.write(f"[e2e] P={p} {bw}: {exc}", file=sys.stderr)
            failed.append({"world_size": p, "bandwidth": bw, "error": str(exc)[-3000:]})
    from .e2e_worker import probe_passes
    total = len(args.hosts) * len(bws) * (len(methods) * args.rounds + probe_passes(args.rounds))
    with tempfile.TemporaryDirectory(prefix="hvdc-e2e-") as tmp, \
            tqdm(total=total, desc="e2e", unit="item", file=sys.stderr) as bar:
        for p in args.hosts:
            threads = threads_per_rank(p)
            if args.no_cluster:
                env = mpi_env({k: str(threads) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS",
                                                         "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
                path = os.path.join(tmp, f"p{p}-shm.json")
                tqdm.write(f"[e2e] P={p} on shared memory, {threads} thread(s) per rank", file=sys.stderr)
                measure(_worker_command(p, methods, args, path, True), env, p, SHM, path)
                continue
            spec = ClusterSpec(hosts=p, bandwidth=bws[0], name=args.cluster_name or f"e2e{os.getpid() % 10**8}",
                               **({"subnet": args.subnet} if args.subnet else {}))
            with EmulatedCluster(spec) as cluster:
                for bw in bws:
                    cluster.reshape(bw)
                    tqdm.write(f"[e2e] {describe(cluster.spec, p)}", file=sys.stderr)
                    path = os.path.join(tmp, f"p{p}-{bw}.json")
                    cmd = in_host(cluster.spec, _worker_command(p, methods, args, path, False))
                    measure(cmd, cluster_env(cluster.spec, p), p, bw, path,
                            {"burst_bytes": cluster.spec.burst_bytes()})
    report = analyse(runs, args)
    report["failed_runs"] = failed
    if not args.no_cluster:
        from ..cluster import namespaces_of
        name = args.cluster_name or f"e2e{os.getpid() % 10**8}"
        report["namespaces_left"] = namespaces_of(name)
    write_results(report, Path(args.out), args.name)
    print(render_markdown(report))
    if failed:
        print(f"[e2e] {len(failed)} run(s) failed: " + ", ".join(f"P={f['world_size']} {f['bandwidth']}"
                                                            for f in failed), file=sys.stderr)
    return 1 if failed or not runs else 0


# ----------------------------------------------------------------- analysis
def profile_of(label: str, m: dict[str, Any], p: int,
               calls: dict[str, list[float]] | None = None, share: float = 1.0) -> StepProfile:
    """The method's step as the model sees it: CPU time of compute and compression (what they cost
    on a rank with a core of its own), bytes and calls per operation, and where ``calls`` (recorded by
    :mod:`.e2e_calls`) has as many calls of an op as measured, each call's size (the recorded sizes
    rescaled to the measured bytes) and the CPU work before it; ``share``: wall seconds per CPU
    second of the rank's work where ranks share cores (how long the links rest between calls).

    Bytes the worker saw cross the links on another transport than the op's own (``m["transport"]``:
    an allreduce run as the pipelined point-to-point ring) move from that op to the transport's op
    (:data:`~horovod_compress.cost_model.RING`), with the wall time of the method's work that ran
    while they were on the wire (``overlap_s``); the byte total is unchanged."""
    ops = {op: OpCount(v["calls"], v["sent"], v["received"]) for op, v in m["ops"].items()}
    overlap: dict[str, float] = {}
    for name, t in (m.get("transport") or {}).items():
        base = ops.get(t.get("of", ""))
        if base is None or t["calls"] <= 0:
            continue
        rest = OpCount(max(base.calls - t["calls"], 0.0), max(base.sent - t["sent"], 0.0),
                       max(base.received - t["received"], 0.0))
        if rest.calls > 1e-9 or max(rest.sent, rest.received) > 1.0:
            ops[t["of"]] = rest
        else:
            del ops[t["of"]]
        ops[name] = OpCount(t["calls"], t["sent"], t["received"])
        overlap[name] = float(t.get("work_s", 0.0))
    sizes, gaps, rests = {}, {}, {}
    for op, v in (calls or {}).items():
        o = ops.get(op)
        if o is None:
            continue
        total = max(o.sent, o.received)
        # a matrix method's group goes out fused (runtime/per_tensor.py): fewer calls on the wire
        # than the per-tensor calls the communicator counts, carrying the same bytes
        fused = len(v) < round(o.calls) and total > 0 and abs(sum(v) - total) <= 0.01 * total
        if len(v) != round(o.calls) and not fused:
            continue
        if fused:      # the model prices calls on the wire (and scales them to other P)
            ops[op] = OpCount(float(len(v)), o.sent, o.received)
        # as many calls as measured: the recorded pattern, rescaled to the measured bytes. A
        # data-dependent method (Ok-Topk's selection, its threshold re-evaluations) moves other
        # bytes on the recorded step than on the measured ones, but calls in the same order with
        # the same work between them -- which the waits for peers depend on
        sizes[op] = [x * total / sum(v) if sum(v) > 0 else total / len(v) for x in v]
        for suffix, into in ((GAP_SUFFIX, gaps), (REST_SUFFIX, rests)):   # CPU work before each call
            recorded = (calls or {}).get(op + suffix)
            if recorded and len(recorded) == len(v):
                into[op] = [float(g) for g in recorded]
    return StepProfile(label.split("(")[0], p, m["compute_cpu_s"], m["compress_cpu_s"], ops, call_bytes=sizes,
                       overlap_s=overlap, call_gaps=gaps, call_rests=rests, core_share=share)


def _has_calls(recorded: dict[str, Any], label: str) -> bool:
    """Whether ``recorded`` (one P of the call log) has ``label``'s calls with their CPU gaps
    (a log written before the gaps were recorded is recorded again)."""
    calls = recorded.get(label)
    return calls is not None and (not calls or any(k.endswith(REST_SUFFIX) for k in calls))


def _label(spec: str) -> str:
    """The report's label of a ``--methods`` item (``name`` or ``name(k=v,...)``)."""
    return parse_spec(spec)[2]


def _calls_path(args: argparse.Namespace | None) -> Path:
    if args is not None and getattr(args, "call_sizes", None):
        return Path(args.call_sizes)
    out = Path(getattr(args, "out", "benchmarks") or "benchmarks")
    return out / f"{getattr(args, 'name', 'e2e') or 'e2e'}_calls.json"


def core_share(world_size: int, cores: int) -> float:
    """How many ranks share a core: a rank's CPU work takes this many times its CPU time in wall time."""
    return max(1.0, world_size / max(cores, 1))


def measured_share(m: dict[str, Any], p: int, run: dict[str, Any]) -> float:
    """The core share as the scheduler really gave it: wall / CPU time of the method's forward and
    backward pass (:func:`core_share` of P and the cores where the run has no CPU time)."""
    if m.get("compute_cpu_s", 0) > 0:
        return max(1.0, m["compute_s"] / m["compute_cpu_s"])
    return core_share(p, run.get("cores", 1))


def analyse(runs: list[dict[str, Any]], args: argparse.Namespace | None = None) -> dict[str, Any]:
    """Add the fitted network and the model's prediction to every measurement."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from ..cluster import ClusterSpec, parse_rate
    calls_path = _calls_path(args)
    all_calls = json.loads(calls_path.read_text()) if calls_path.exists() else {}
    for r in runs:
        p = r["world_size"]
        nominal = 80e9 if r["bandwidth"] == SHM else parse_rate(r["bandwidth"])
        # the links' token bucket: recorded by the run, else the cluster's default for this rate
        burst = 0.0 if r["bandwidth"] == SHM else float(
            r.get("burst_bytes") or ClusterSpec(bandwidth=r["bandwidth"]).burst_bytes())
        probes = {op: v for op, v in r["probe"].items() if "large_s" in v}
        inter = r["probe"].get("interleaved", {})
        # a step's comm time is a sum over calls: the mean per call at each probed spacing of calls
        # (runs before the curve was recorded: the median at the one spacing they probed)
        curve = [(c["work_s"], c["call_mean_s"]) for c in inter.get("curve", [])]
        # each probe's mean over ranks where recorded (what a step's comm time is: each rank's time
        # in MPI, averaged over ranks), else the slowest rank's (runs before 2026-11-28)
        fitted = fit_link(nominal, {op: (v.get("small_rank_mean_s", v["small_s"]),
                                         v.get("large_rank_mean_s", v["large_s"]), v["large_bytes"], p)
                                    for op, v in probes.items()},
                          call_latency=inter.get("call_mean_s", inter.get("call_s", 0.0)),
                          ring_from=None if r["bandwidth"] == SHM else RING_FROM, burst_bytes=burst,
                          call_latency_curve=curve,
                          size_probes={op: [(float(b), float(t))
                                            for b, t in v.get("sizes_rank_mean", v.get("sizes", []))]
                                       for op, v in probes.items()})
        r["link"] = {op: {"alpha_us": 1e6 * fitted.op_alpha[op], "efficiency": fitted.efficiency[op],
                          "carried_gbit": v["large_bytes"] * 8 / v.get("large_rank_mean_s", v["large_s"]) / 1e9,
                          "efficiency_curve": [list(c) for c in fitted.efficiency_curve.get(op, ())]}
                     for op, v in probes.items()}
        r["call_latency_us"] = 1e6 * inter.get("call_mean_s", inter.get("call_s", 0.0))
        r["round_latency_us"] = 1e6 * fitted.round_latency
        r["call_wait_curve_us"] = [[1e6 * w, 1e6 * f] for w, f in fitted.call_wait_curve]
        r["burst_bytes"] = burst
        run_calls = all_calls.get(r.get("model", ""), {}).get(str(p), {})
        dense = r["methods"].get("none")
        dense_prof = profile_of("none", dense, p, run_calls.get("none"), measured_share(dense, p, r)) \
            if dense and "error" not in dense else None
        for label, m in r["methods"].items():
            if "error" in m:
                continue
            # On the testbed P ranks share the machine's cores: each rank's CPU work
            # stretches by the share (and the links rest that long between calls), and a
            # rank waits in MPI for peers still computing. Ranks wait for the slowest
            # peer's compute and compression (imbalance, measured per step).
            share = measured_share(m, p, r)
            prof = profile_of(label, m, p, run_calls.get(label), share)
            pred = predict(prof, fitted)
            work = m["compute_cpu_s"] + m["compress_cpu_s"]
            wait = m.get("imbalance_s", 0.0)
            step = share * work + pred.comm_s + wait
            # The comm prediction is the alpha-beta part alone: every Method.allreduce starts with a
            # 1-byte agreement allgather (mpi_collectives/consistency.py) where a rank waits for a peer still
            # computing; runs that time it report that wait apart ("wait_s", not in comm or compress),
            # older runs left it in compress.
            m["predicted"] = {"comm_s": pred.comm_s, "alpha_beta_s": pred.comm_s, "wait_s": wait,
                              "latency_s": pred.latency_s, "transfer_s": pred.transfer_s, "step_s": step,
                              "core_share": share, "ops": sorted(prof.ops),
                              "overlap_s": sum(prof.overlap_s.values()),
                              "call_wait_us": 1e6 * fitted.call_wait(
                                  prof.compress_s / max(sum(len(prof.calls_of(o)[0]) for o in prof.ops), 1)),
                              "call_sizes": "recorded" if prof.call_bytes else "mean per call"}
            m["model_error"] = (m["predicted"]["comm_s"] - m["comm_s"]) / m["comm_s"] if m["comm_s"] > 0 else 0.0
            m["step_model_error"] = (step - m["step_s"]) / m["step_s"]
            m["compress_vs_memcpy"] = m["compress_s"] / r["memcpy_s"] if r["memcpy_s"] > 0 else float("nan")
            m["bytes_per_step"] = max(m["sent"], m["received"])
            if dense_prof is not None:
                m["speedup"] = dense["step_s"] / m["step_s"]
                m["predicted_speedup"] = dense["predicted"]["step_s"] / pred.step_s \
                    if "predicted" in dense else float("nan")
                m["break_even_gbit"] = break_even_bandwidth(prof, dense_prof, fitted) / 1e9
    return {
        "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "hvdc bench e2e " + (" ".join(shlex.quote(a) for a in sys.argv[3:])
                                        if len(sys.argv) > 2 and sys.argv[1:3] == ["bench", "e2e"] else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs, {platform.system()} "
                   f"{platform.release()}",
        "versions": f"Python {platform.python_version()}, torch {torch.__version__}, NumPy {np.__version__}, "
                    f"{MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip()}",
        "commit": _commit(),
        **({"warm": args.warm, "steps": args.steps} if args is not None and hasattr(args, "warm") else {}),
        "model": runs[0]["model"] if runs else None,
        "runs": runs,
    }


def _rounds(runs: list[dict[str, Any]]) -> int:
    """The runs' rounds (``--rounds``; 1 for runs recorded before the option or mixed ones)."""
    values = {int(r.get("rounds", 1)) for r in runs}
    return values.pop() if len(values) == 1 else 1


def _commit() -> str:
    """The source's git commit (with ``+dirty`` for uncommitted changes), or ``unknown``."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no",
                                "--", "horovod_compress"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def write_results(report: dict[str, Any], out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=float))
    (out / f"{name}.md").write_text(render_markdown(report, plot=f"{name}.png"))
    plot(report, out / f"{name}.png")


def _nominal_gbit(bw: str) -> float:
    from ..cluster import parse_rate
    return parse_rate(bw) / 1e9


def exchange_speedup_table(runs: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """Markdown lines: each method's exchange (its compressed allreduces of one step, without the
    forward/backward pass) against dense's, measured in the same run, with the milliseconds.

    For a one-tensor model (``matrix2000``) this is one compressed allreduce of the gradient;
    the whole-step table adds the same compute to both sides of the ratio.
    """
    cols = [f"P={r['world_size']} {_fmt_bw(r['bandwidth'])}" for r in runs]
    lines = ["", "## Speedup of the exchange alone over dense", "",
             "The gradient exchange of one step (compression + communication + decompression, the "
             "method's `allreduce` calls; no forward/backward pass): dense exchange time / the method's, "
             "in the same run, and the method's exchange in ms.", "",
             "| method | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for label in labels:
        cells = []
        for r in runs:
            m, dense = r["methods"].get(label, {}), r["methods"].get("none", {})
            if "error" in m or "exchange_s" not in m or "exchange_s" not in dense or m["exchange_s"] <= 0:
                cells.append("error" if "error" in m else "-")
                continue
            cells.append(f"{dense['exchange_s'] / m['exchange_s']:.2f}x ({m['exchange_s'] * 1e3:.1f} ms)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _fmt_bw(bw: str) -> str:
    return {"100mbit": "100 Mbit", "1gbit": "1 Gbit", "10gbit": "10 Gbit", SHM: "shm"}.get(bw, bw)


def page_title(report: dict[str, Any]) -> str:
    """What a report measures, as its page's title: the model, the methods (named when
    three or fewer, else counted), the rank counts and the links."""
    runs = report["runs"]
    labels = list(dict.fromkeys(label for r in runs for label in r["methods"]))
    shown = ", ".join(labels) if len(labels) <= 3 else f"{len(labels)} methods"
    ps = ", ".join(str(p) for p in sorted({r["world_size"] for r in runs}))
    bws = ", ".join(_fmt_bw(bw) for bw in sorted({r["bandwidth"] for r in runs if r["bandwidth"] != SHM},
                                                   key=_nominal_gbit))
    return f"Whole training steps on shaped links: {runs[0]['model']}, {shown}, P = {ps}, {bws}"


def auto_choices(runs: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """What ``auto`` ran in each column, per bucket, and how fast against the fastest fixed method
    and dense (lines for the report; none when no ``auto`` row has decisions)."""
    out = []
    for label in labels:
        for r in runs:
            m = r["methods"].get(label, {})
            if not m.get("decisions"):
                continue
            fixed = {lb: v["step_s"] for lb, v in r["methods"].items()
                     if lb != label and "step_s" in v and not v.get("decisions")}
            best = min(fixed, key=fixed.get) if fixed else None
            chosen = ", ".join(f"{b}: {d['chosen']} (predicted {d['predicted_ms']:.1f} ms"
                               + (f", runner-up {d['runner_up']} {d['runner_up_ms']:.1f} ms" if d.get("runner_up")
                                  else "") + ")" for b, d in m["decisions"].items())
            vs = (f"; step {m['step_s'] / fixed[best]:.2f}x the fastest fixed method's ({best})"
                  + (f", {m['step_s'] / fixed['none']:.2f}x dense's" if "none" in fixed else "")) if best else ""
            out.append(f"- `{label}` at P={r['world_size']} {_fmt_bw(r['bandwidth'])}: {chosen}{vs}.")
    return ["", "What `auto` chose, per bucket, at the end of its measured steps:", ""] + out if out else []


def auto_pricing(runs: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """Each ``auto`` decision's table beside the fixed rows of the same run: every candidate's
    predicted exchange, what it was priced on (a dry run on the bucket, or its slice's
    extrapolation), its steps factor and weighed time, and the exchange its own fixed row took
    once warm (lines for the report; none when no decision recorded its table)."""
    rows = []
    for label in labels:
        for r in runs:
            decisions = r["methods"].get(label, {}).get("decisions") or {}
            for bucket, d in decisions.items():
                for cand, row in (d.get("candidates") or {}).items():
                    fixed = r["methods"].get(cand, {})
                    real = f"{1e3 * fixed['exchange_s']:.1f}" if "exchange_s" in fixed else "-"
                    factor = row.get("steps_factor", 1.0)
                    mark = " (chosen)" if cand == d["chosen"] else ""
                    rows.append(f"| {r['world_size']} | {_fmt_bw(r['bandwidth'])} | {bucket} | {cand}{mark} | "
                                f"{row.get('dry_run', '-')} | {row['predicted_ms']:.1f} | {factor:g} | "
                                f"{factor * row['predicted_ms']:.1f} | {real} |")
    if not rows:
        return []
    return ["", "How `auto` priced its candidates at its last decision in each column: the predicted "
            "exchange (compression + communication) from dry runs on the bucket or, for a candidate "
            "the bound ruled out, its 1/16 slice's extrapolation; weighed = predicted x the steps "
            "factor, the smallest wins; beside it, the exchange the candidate's own fixed row took "
            "in the same run, once warm:", "",
            "| P | link | bucket | candidate | priced on | predicted (ms) | steps factor | weighed (ms) "
            "| its fixed row's exchange (ms) |",
            "|---|---|---|---|---|---:|---:|---:|---:|"] + rows


def render_markdown(report: dict[str, Any], plot: str | None = None) -> str:
    runs = report["runs"]
    failed = report.get("failed_runs", [])
    failures = ["", "## Runs that did not finish", ""] + [
        f"- P={f['world_size']} {_fmt_bw(f['bandwidth'])}: " + f["error"].strip().splitlines()[0]
        for f in failed] if failed else []
    if not runs:
        return "no runs\n" + "\n".join(failures) + "\n"
    first = runs[0]
    lines = [f"# {page_title(report)}", "",
             f"Measured {report['when']} with `{report['command'].strip()}` on {report['machine']}; "
             f"{report['versions']}; source at commit `{report.get('commit', 'unknown')}`."
             + (f" Analysed again (`--rerender`, the same measurements) {report['analysed']}."
                if report.get("analysed") else ""), "",
             f"Model `{first['model']}`: {first['parameters'] / 1e6:.2f}M parameters in {first['tensors']} tensors, "
             f"synthetic inputs. One rank per emulated host, {first['threads_per_rank']} thread(s) per rank "
             f"(the machine's cores shared out), `overlap=False` so the parts add up, warm-up steps off "
             f"(they are dense steps). Each figure is the median of the measured steps"
             + (f" ({report['steps']} per method, after {report['warm']} untimed ones)"
                if "steps" in report and "warm" in report and _rounds(runs) == 1 else "")
             + (f" ({report['steps']} per method in each of {_rounds(runs)} rounds, the methods taking turns "
                f"(A B C, A B C, ...), each round after {report['warm']} untimed steps of a fresh method)"
                if "steps" in report and "warm" in report and _rounds(runs) > 1 else "")
             + "; speedup = dense step time / method step time, measured in the same run.", ""]
    lines += ["## What the links carry", "",
              "A 16 MiB message per collective, a ring shift of 16 MiB point to point (also the transport of "
              "the methods' pipelined ring) and a one-way transfer of 16 MiB between pairs of ranks "
              "(p2p_oneway: the receiver answers with one byte; gTop-k's tree levels are priced at it), each "
              "after a burst of CPU work that leaves the links idle as a step's "
              "compute does (runs that record it), against the nominal rate (effective Gbit/s = bytes moved per "
              "rank x 8 / time; time = the median over repeats of the mean over ranks, as a step's comm time is "
              "taken, in runs that record it, else of the slowest rank; runs made with --rounds pool "
              "the samples of a probe pass before each round and one after the last); alpha = small-message "
              "time per latency round; '-': not probed in that run.", "",
              "| P | link | " + " | ".join(f"{op} Gbit/s" for op in LINK_COLUMNS) + " | alpha allreduce (us) |",
              "|---|---|" + "---:|" * (len(LINK_COLUMNS) + 1)]
    for r in runs:
        link = r["link"]
        cells = [f"{link[op]['carried_gbit']:.2f}" if op in link else "-" for op in LINK_COLUMNS]
        lines.append(f"| {r['world_size']} | {_fmt_bw(r['bandwidth'])} | " + " | ".join(cells) +
                     f" | {link['allreduce']['alpha_us']:.0f} |")
    curves = [r for r in runs if any(v.get("efficiency_curve") for v in r["link"].values())]
    if curves:
        lines += ["", "The same calls at other message sizes, as the fraction of the nominal rate each reaches "
                  "(eta, after the token bucket's burst; bytes per rank of one call), which the model reads at "
                  "each call's own size; 'ring' is the pipelined point-to-point ring the 16-bit casts and "
                  "Global-QSGD run:", "",
                  "| P | link | op | eta at MB per rank |", "|---|---|---|---|"]
        for r in curves:
            for op in LINK_COLUMNS:
                c = r["link"].get(op, {}).get("efficiency_curve")
                if c:
                    lines.append(f"| {r['world_size']} | {_fmt_bw(r['bandwidth'])} | {op} | " + ", ".join(
                        f"{e:.2f} at {b / 1e6:.2g}" for b, e in c) + " |")
    bound = [r for r in runs if r["bandwidth"] != SHM and r["world_size"] > 1 and r.get("cores", 2) == 1]
    if bound:
        lines += ["", "**Ranks bound to one core:** " + ", ".join(
            f"P={r['world_size']} {_fmt_bw(r['bandwidth'])}" for r in bound) + ": rank 0 could run on one core only "
            "(Open MPI binds each rank to core 0 of its node when np <= 2, and every emulated host is a node: the "
            "ranks shared one physical core). Their rates and times are those of ranks sharing a core; the "
            "cluster now runs ranks unbound (`OMPI_MCA_hwloc_base_binding_policy=none`)."]
    loaded = [r for r in runs if "load_before" in r]
    if loaded:
        lines += ["", "Load average (1 min) of the machine before -> after each run: " + "; ".join(
            f"P={r['world_size']} {_fmt_bw(r['bandwidth'])} {r['load_before']:.1f} -> {r['load_after']:.1f}"
            for r in loaded) + f" ({first.get('cores', '?')} cores seen by rank 0)."]
    short = [r for r in runs if r["bandwidth"] != SHM
             and r["link"]["p2p"]["carried_gbit"] < 0.8 * _nominal_gbit(r["bandwidth"])]
    if short:
        lines += ["", "**Where the testbed falls short of the nominal rate:** " + "; ".join(
            f"P={r['world_size']} at {_fmt_bw(r['bandwidth'])} the links carry "
            f"{r['link']['p2p']['carried_gbit']:.2f} Gbit/s point to point and "
            f"{r['link']['allreduce']['carried_gbit']:.2f} Gbit/s in a dense allreduce"
            for r in short) + ". The machine's cores, not the shaping, bound these runs (TCP over veth, "
            "MPI progress and the ranks' compute share the same cores); read those columns as "
            "'the fastest link this machine can emulate', and use `hvdc model` for the nominal rate."]
    labels = list(first["methods"])
    cols = [(r["world_size"], r["bandwidth"]) for r in runs]
    lines += ["", "## Speedup of a whole step over dense", "",
              "| method | " + " | ".join(f"P={p} {_fmt_bw(b)}" for p, b in cols) + " | MB/step/rank P="
              + ", ".join(str(p) for p in sorted({c[0] for c in cols})) + " |",
              "|---|" + "---:|" * (len(cols) + 1)]
    for label in labels:
        cells = []
        for r in runs:
            m = r["methods"].get(label, {})
            cells.append("error" if "error" in m else f"{m.get('speedup', float('nan')):.2f}x")
        mb = []
        for p in sorted({c[0] for c in cols}):
            r = next(r for r in runs if r["world_size"] == p)
            m = r["methods"].get(label, {})
            mb.append("-" if "error" in m else f"{m['bytes_per_step'] / 1e6:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {', '.join(mb)} |")
    lines += auto_choices(runs, labels)
    lines += auto_pricing(runs, labels)
    lines += exchange_speedup_table(runs, labels)
    for r in runs:
        lines += ["", f"## Breakdown, P = {r['world_size']}, {_fmt_bw(r['bandwidth'])}", "",
                  f"Seconds per step (mean over ranks of the median step). compress = the method's own "
                  f"computation, shown also against a memcpy of the gradient ({r['memcpy_s'] * 1e3:.1f} ms); "
                  f"{_wait_text(r)}"
                  f"comm = time inside the method's collectives (including waiting for other ranks there). "
                  f"Predicted comm: the alpha-beta "
                  f"model fitted to this run's probes, from each method's bytes per call -- latency = "
                  f"{_latency_text(r)}, transfer = bytes beyond the links' "
                  f"{r.get('burst_bytes', 0) / 1024:.0f} KiB token bucket (refilled while the link rests between "
                  f"calls: the work since the previous call x the core share, and the call's latency) / the rate "
                  f"the probe of that collective carried (an allreduce a method runs as its own pipelined ring: the point-to-point probe's, less "
                  f"the method's work that ran while it was on the wire). Predicted step = CPU time x the "
                  f"measured core share + predicted comm + wait (the time "
                  f"a rank waits for the slowest peer's compute and compression, measured per step).", "",
                  "| method | step | speedup | compute | compress | compress / memcpy | wait | comm | predicted comm: latency + transfer | comm model error | predicted step (error) | MB/step | break-even Gbit/s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for label, m in r["methods"].items():
            if "error" in m:
                lines.append(f"| {label} | {m['error']} |" + " |" * 12)
                continue
            be = m.get("break_even_gbit", float("nan"))
            be_s = "always" if be == float("inf") else ("never" if be == 0 else f"{be:.2f}")
            if label == "none":
                be_s = "-"
            pr = m["predicted"]
            lines.append(f"| {label} | {m['step_s']:.3f} | {m.get('speedup', float('nan')):.2f}x | "
                         f"{m['compute_s']:.3f} | {m['compress_s']:.3f} | {m['compress_vs_memcpy']:.0f}x | "
                         f"{_fmt_wait(m)} | {m['comm_s']:.3f} | {pr.get('latency_s', 0):.3f} + {pr.get('transfer_s', 0):.3f} = {pr['comm_s']:.3f} | "
                         f"{100 * m['model_error']:+.0f}% | {pr['step_s']:.3f} ({100 * m['step_model_error']:+.0f}%) | "
                         f"{m['bytes_per_step'] / 1e6:.2f} | {be_s} |")
    checked = [(r, label, m) for r in runs if r["bandwidth"] in MODEL_CHECK for label, m in r["methods"].items()
               if "error" not in m]
    if checked:
        ok = [c for c in checked if abs(c[2]["model_error"]) <= TOLERANCE]
        lines += ["", "## The model against the measurement", "",
                  f"Communication time within {TOLERANCE:.0%} of the prediction at 100 Mbit and 1 Gbit: "
                  f"**{len(ok)} of {len(checked)}** (method, P, bandwidth) cases."]
        bad = [c for c in checked if abs(c[2]["model_error"]) > TOLERANCE]
        if bad:
            lines.append("Outside: " + "; ".join(f"{label} P={r['world_size']} {_fmt_bw(r['bandwidth'])} "
                                                 f"({100 * m['model_error']:+.0f}%)" for r, label, m in bad) + ".")
            lines += ["", "What each miss was made of (diagnosis only, not used by the model): *carried* = the "
                      "method's bytes beyond the token bucket / (measured comm - predicted latency), against the "
                      "rate the probe of its main collective carried; *share* = wall / CPU time of the rank's "
                      "forward and backward (2 = P/cores on an idle machine at P = 4, 1 at P = 2).", "",
                      "| case | comm | predicted: latency + transfer | error | calls | carried / probe Gbit/s | share |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for r, label, m in bad:
                pr = m["predicted"]
                main = max(m["ops"], key=lambda op: max(m["ops"][op]["sent"], m["ops"][op]["received"]))
                ring = (m.get("transport") or {}).get(RING, {})
                if ring.get("of") == main and 2 * max(ring["sent"], ring["received"]) > max(
                        m["ops"][main]["sent"], m["ops"][main]["received"]):
                    main = RING                         # mostly carried by the pipelined p2p ring
                probe = r["link"].get(main) or r["link"].get(PROBE_OF.get(main, ""), {})
                left = m["comm_s"] - pr.get("latency_s", 0.0)
                beyond = pr.get("transfer_s", 0.0) * probe.get("efficiency", 1.0) * _nominal_gbit(r["bandwidth"]) * 1e9
                carried = f"{beyond / left / 1e9:.3f}" if left > 0 and beyond > 0 else "-"
                lines.append(f"| {label} P={r['world_size']} {_fmt_bw(r['bandwidth'])} | {m['comm_s']:.3f} | "
                             f"{pr.get('latency_s', 0):.3f} + {pr.get('transfer_s', 0):.3f} | "
                             f"{100 * m['model_error']:+.0f}% | {sum(v['calls'] for v in m['ops'].values()):.0f} | "
                             f"{carried} / {probe.get('carried_gbit', float('nan')):.3f} ({main}) | "
                             f"{pr.get('core_share', float('nan')):.1f} |")
    if "namespaces_left" in report:
        left = report["namespaces_left"]
        lines += ["", "After the run: " + (f"**namespaces left behind: {left}**" if left else
                                           "`ip netns list` shows none of the run's namespaces (torn down).")]
    if plot:
        lines += ["", f"![speedup against bandwidth]({plot})"]
    return "\n".join(lines + failures) + "\n"


def _wait_text(r: dict[str, Any]) -> str:
    """The breakdown's words for its wait column: what it holds in runs that time the agreement."""
    if any("wait_s" in m for m in r["methods"].values()):
        return ("wait = time in the calls' 1-byte agreement (the first collective of every call), where a "
                "rank waits for peers still computing; ")
    return ("wait: not timed apart in this run (before the agreement was timed; it is inside compress); ")


def _fmt_wait(m: dict[str, Any]) -> str:
    """A method's measured wait in the breakdown, or '-' for runs that did not time it."""
    return f"{m['wait_s']:.3f}" if "wait_s" in m else "-"


def _latency_text(r: dict[str, Any]) -> str:
    """The latency term of run ``r`` in words: rounds x alpha plus the measured wait per call, or
    (runs before the wait curve was recorded) rounds x max(alpha, one per-round floor)."""
    curve = r.get("call_wait_curve_us") or []
    if not curve:
        return (f"rounds of the algorithm MPI runs x max(alpha, {r.get('round_latency_us', 0):.0f} us per round "
                f"measured between bursts of CPU work)")
    return ("rounds of the algorithm MPI runs x alpha + the mean wait for peers per call measured between "
            "bursts of CPU work (" + ", ".join(f"{f:.0f} us after {w / 1e3:.2g} ms" for w, f in curve) +
            " of CPU work; read at the work before each of the method's calls since the ranks last met, "
            "in a call or in a bucket's agreement)")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..cluster import parse_rate
    runs = [r for r in report["runs"] if r["bandwidth"] != SHM]
    if not runs:
        return
    ps = sorted({r["world_size"] for r in runs})
    fig, axes = plt.subplots(1, len(ps), figsize=(7 * len(ps), 5), squeeze=False)
    from .plotting import method_style, speedup_axes
    labels = list(runs[0]["methods"])
    for ax, p in zip(axes[0], ps):
        rr = sorted((r for r in runs if r["world_size"] == p), key=lambda r: parse_rate(r["bandwidth"]))
        xs = [parse_rate(r["bandwidth"]) / 1e9 for r in rr]
        for i, label in enumerate(labels):
            ys = [r["methods"].get(label, {}).get("speedup", float("nan")) for r in rr]
            ax.plot(xs, ys, label=label, **method_style(i))
        speedup_axes(ax, "link bandwidth (emulated)", "step speedup over dense",
                     f"P = {p}, model {report['model']}")
        ax.set_xticks(xs, [_fmt_bw(r["bandwidth"]) for r in rr])
        ax.minorticks_off()
    axes[0][-1].legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
