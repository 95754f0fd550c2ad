"""``hvdc bench tta``: time to accuracy -- each method trains a real model until dense's final quality.

The task (:mod:`.tta_task`): a 6.4M-parameter byte-level GPT on the Python
standard library's own ``.py`` files (split into training and validation text
by file), quality = validation loss in bits per byte. Each rank trains on one
64-byte window per step (``--batch``): on half a CPU core a larger batch makes
the forward and backward pass, not the link, most of dense's step, where a
GPU-backed rank would spend milliseconds on it. For each P in ``--hosts``
the launcher builds an emulated cluster of P hosts (one rank per host, each
rank its share of the cores, as ``hvdc bench e2e``), and for each bandwidth:

1. dense (``none``) trains ``--steps`` steps with Adam; the **target** is the
   validation loss it ends at (per seed: dense of the same seed);
2. every other method trains with dense's hyperparameters until its
   validation loss is at or below the target, or ``--max-factor`` (1.5) x
   dense's steps;
3. the three methods that reached the target soonest, and dense, run again
   for every further seed of ``--seeds``.

Time to target = wall-clock seconds of training steps (evaluation, and the
one-off loading of the method's compiled kernels before the first step,
excluded) until the first evaluation at or below the target; speedup = dense's time to
its target / the method's (same seed, P and link). The convergence cost is
the steps ratio (method's steps to target / dense's), shown beside the
step-time ratio (method's seconds per step / dense's): speedup = 1 /
(steps ratio x step-time ratio).

Each run is appended to ``<out>/<name>.json`` as it finishes and a run
already there (same method, seed, P, link, model, steps, learning rate) is
skipped, so an interrupted study resumes where it stopped. At the end it
writes ``<name>.md`` and two plots (validation loss against wall-clock time
and against steps, one line per method)::

    sudo hvdc bench tta                                   # P = 4 at 1 Gbit and 100 Mbit
    sudo hvdc bench tta --bandwidths 1gbit --steps 60 --seeds 0 1
    hvdc bench tta --no-cluster --hosts 2 --model tiny --steps 10 --methods none,topk   # one machine
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .e2e import SHM, RanksDidNotStart, _commit, _stream, split_specs
from .machine import cpu_model, platform_summary
from .tta_task import MODELS, model_config

DEFAULT_METHODS = "none,fp16,topk,oktopk,global_qsgd,arc_topk,powersgd,greedylore,deepreduce,auto"
#: How many of the fastest methods (besides dense) run every seed.
FASTEST_RESEEDED = 3
#: The run's identity in the JSON: a run with the same values is not measured again.
RUN_KEY = ("method", "seed", "hosts", "bandwidth", "model", "batch", "dense_steps", "lr")


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tta", help="time to accuracy: a byte-level GPT on the stdlib's sources, every method",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, nargs="+", default=[4], help="values of P (one rank per host)")
    p.add_argument("--bandwidths", nargs="+", default=["1gbit", "100mbit"], help="link rates (tc units)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated method names (name:{json} sets parameters); names the registry "
                        "does not know are skipped with a note (default: %(default)s)")
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=None,
                   help="64-byte windows per rank and step (default: the model's, 1 for gpt)")
    p.add_argument("--steps", type=int, default=60, help="dense's step budget (default %(default)s)")
    p.add_argument("--max-factor", type=float, default=1.5,
                   help="the other methods stop at this many times dense's steps (default %(default)s)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                   help="seeds; the first for every method, the rest for dense and the three fastest")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate, every method")
    p.add_argument("--eval-every", type=int, default=5, help="steps between validation scores")
    p.add_argument("--val-windows", type=int, default=64, help="validation windows scored (all ranks together)")
    p.add_argument("--train-bytes", type=int, default=None, help="use at most this much training text")
    p.add_argument("--out", default="benchmarks")
    p.add_argument("--name", default="time_to_accuracy", help="file stem of the results")
    p.add_argument("--no-cluster", action="store_true", help="run on shared memory (no namespaces, no shaping)")
    p.add_argument("--cluster-name", default=None, help="name of the emulated cluster (default tta<pid>)")
    p.add_argument("--subnet", default=None, help="first three octets of the cluster's /24")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--start-timeout", type=float, default=120, help="seconds for mpirun to bring the ranks up")
    p.add_argument("--note", default=None,
                   help="a sentence about the run's conditions (e.g. a shared machine), shown under the header")
    p.add_argument("--report-only", action="store_true",
                   help="write the report and plots from <out>/<name>.json without running anything")
    p.set_defaults(func=run)


def known_methods(spec: str) -> tuple[list[str], list[str]]:
    """(the ``--methods`` items the registry knows, dense first; the names it does not know)."""
    from ...compressors import registry
    names = set(registry.available())
    items = split_specs(spec)
    kept = [i for i in items if i.partition(":")[0] in names]
    if not any(i.partition(":")[0] == "none" for i in kept):
        kept.insert(0, "none")
    kept.sort(key=lambda i: i.partition(":")[0] != "none")
    return kept, [i for i in items if i.partition(":")[0] not in names]


# ----------------------------------------------------------------- analysis
def first_at_or_below(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first point of ``curve`` whose validation loss is at or below ``target`` (None if none is)."""
    return next((c for c in curve if c["val_bpb"] <= target), None)


def _group(run: dict[str, Any]) -> tuple[int, str]:
    return run["hosts"], run["bandwidth"]


def target_of(runs: list[dict[str, Any]], hosts: int, bandwidth: str, seed: int) -> float | None:
    """Dense's final validation loss at (hosts, bandwidth) for ``seed`` (else for its first seed)."""
    dense = [r for r in runs if r["method"] == "none" and _group(r) == (hosts, bandwidth)]
    same = [r for r in dense if r["seed"] == seed]
    pick = same or sorted(dense, key=lambda r: r["seed"])
    return pick[0]["final_val_bpb"] if pick else None


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: time and steps to dense's target, and the ratios against dense."""
    out = []
    for r in runs:
        target = target_of(runs, r["hosts"], r["bandwidth"], r["seed"])
        hit = first_at_or_below(r["curve"], target) if target is not None else None
        dense = [d for d in runs if d["method"] == "none" and _group(d) == _group(r)]
        dense_run = next((d for d in dense if d["seed"] == r["seed"]), dense[0] if dense else None)
        dense_hit = first_at_or_below(dense_run["curve"], target) if dense_run and target is not None else None
        row = {"method": r["method"], "hosts": r["hosts"], "bandwidth": r["bandwidth"], "seed": r["seed"],
               "target_val_loss": target,
               "time_to_target_s": hit["time_s"] if hit else None,
               "steps_to_target": hit["step"] if hit else None,
               "final_val_loss": r["final_val_bpb"], "steps_run": r["steps_run"], "step_s": r["step_s"],
               "speedup_vs_dense": None, "steps_ratio": None,
               "step_time_ratio": r["step_s"] / dense_run["step_s"] if dense_run else None}
        if hit and dense_hit:
            row["speedup_vs_dense"] = dense_hit["time_s"] / hit["time_s"] if hit["time_s"] > 0 else None
            row["steps_ratio"] = hit["step"] / dense_hit["step"]
        out.append(row)
    return out


def fastest(table: list[dict[str, Any]], hosts: int, bandwidth: str, count: int = FASTEST_RESEEDED) -> list[str]:
    """The ``count`` non-dense methods of (hosts, bandwidth) with the highest speedup (first seed's rows)."""
    cand = [r for r in table if (r["hosts"], r["bandwidth"]) == (hosts, bandwidth) and r["method"] != "none"
            and r["speedup_vs_dense"] is not None]
    first_seed = min((r["seed"] for r in cand), default=0)
    cand = sorted((r for r in cand if r["seed"] == first_seed), key=lambda r: -r["speedup_vs_dense"])
    return [r["method"] for r in cand[:count]]


def reason(row: dict[str, Any]) -> str:
    """Why a method missed the target or reached it later than dense, read off its curve's ratios."""
    if row["method"] == "none":
        return "baseline"
    slow = row["step_time_ratio"] is not None and row["step_time_ratio"] > 1.0
    if row["time_to_target_s"] is None:
        why = (f"did not reach {row['target_val_loss']:.3f} in {row['steps_run']} steps "
               f"(ended at {row['final_val_loss']:.3f}): more steps to the same loss")
        return why + (f", and {row['step_time_ratio']:.2f}x dense's step time" if slow else "")
    if row["speedup_vs_dense"] is not None and row["speedup_vs_dense"] < 1.0:
        parts = []
        if slow:
            parts.append(f"fewer steps per second ({row['step_time_ratio']:.2f}x dense's step time)")
        if row["steps_ratio"] is not None and row["steps_ratio"] > 1.0:
            parts.append(f"more steps to the same loss ({row['steps_ratio']:.2f}x)")
        return "; ".join(parts) or "slower"
    return "-"


# ----------------------------------------------------------------- running
def _worker_command(method: str, seed: int, steps: int, target: float | None, args: argparse.Namespace,
                    json_path: str) -> list[str]:
    cmd = [sys.executable, "-m", "horovod_compress.tools.bench.tta_worker", "--method", method, "--model", args.model,
           "--batch", str(args.batch), "--steps", str(steps),
           "--seed", str(seed), "--lr", str(args.lr), "--eval-every", str(args.eval_every),
           "--val-windows", str(args.val_windows), "--json", json_path]
    if target is not None:
        cmd += ["--target", repr(target)]
    if args.train_bytes:
        cmd += ["--train-bytes", str(args.train_bytes)]
    return cmd


def load_results(path: Path) -> dict[str, Any]:
    """The results file, or an empty one."""
    return json.loads(path.read_text()) if path.exists() else {"runs": []}


def is_done(runs: list[dict[str, Any]], key: dict[str, Any]) -> bool:
    return any(all(r.get(k) == key[k] for k in RUN_KEY) for r in runs)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..cluster import ClusterSpec, EmulatedCluster, cluster_env, describe, in_host, parse_rate, threads_per_rank
    from ..testing import mpi_env, mpirun_command
    if args.steps < 1 or args.max_factor < 1 or args.eval_every < 1:
        raise ValueError("--steps and --eval-every must be >= 1 and --max-factor >= 1")
    args.batch = model_config(args.model, args.batch).batch     # the model's when not given
    methods, unknown = known_methods(args.methods)
    if unknown:
        print(f"[tta] skipping methods the registry does not know: {', '.join(unknown)}", file=sys.stderr)
    bws = [SHM] if args.no_cluster else list(args.bandwidths)
    for bw in bws:
        if bw != SHM:
            parse_rate(bw)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.json"
    results = load_results(path)
    if args.note:
        results["note"] = args.note
    if args.report_only:
        if not results["runs"]:
            raise ValueError(f"--report-only: no runs in {path}")
        results.setdefault("when", "up to " + dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        write_report(results, out, args.name)
        return 0
    words = sys.argv[1:]
    given = words[words.index("tta") + 1:] if "tta" in words else []
    results.update({"command": " ".join(["hvdc bench tta", *given]),
                    "machine": f"{cpu_model('unknown CPU')}, {os.cpu_count()} logical CPUs, {platform_summary()}",
                    "commit": _commit(), "max_factor": args.max_factor})
    failed: list[str] = []
    max_steps = int(round(args.steps * args.max_factor))
    first, rest = args.seeds[0], args.seeds[1:]
    planned = len(args.hosts) * len(bws) * (args.steps * len(args.seeds) + max_steps * (
        len(methods) - 1 + FASTEST_RESEEDED * len(rest)))
    with tempfile.TemporaryDirectory(prefix="hvdc-tta-") as tmp, \
            tqdm(total=planned, desc="tta", unit="step", file=sys.stderr) as bar:

        def one(method: str, seed: int, p: int, bw: str, launch: Any) -> None:
            key = {"method": method, "seed": seed, "hosts": p, "bandwidth": bw, "model": args.model,
                   "batch": args.batch, "dense_steps": args.steps,
                   "lr": args.lr}
            steps = args.steps if method == "none" else max_steps
            if is_done(results["runs"], key):
                bar.update(steps)
                return
            target = None if method == "none" else target_of(results["runs"], p, bw, seed)
            if method != "none" and target is None:
                failed.append(f"{method} seed {seed} P={p} {bw}: no dense run for the target")
                return
            jpath = os.path.join(tmp, f"{method.partition(':')[0]}-{seed}-{p}-{bw}.json")
            cmd, env = launch(_worker_command(method, seed, steps, target, args, jpath))
            label = f"P={p} {bw} {method} seed {seed}"
            done_before, started = bar.n, time.perf_counter()
            try:
                try:
                    _stream(cmd, env, bar, label, args.timeout, jpath, args.start_timeout)
                except RanksDidNotStart as exc:
                    tqdm.write(f"[tta] {label}: {exc}; launching it again", file=sys.stderr)
                    _stream(cmd, env, bar, label, args.timeout, jpath, args.start_timeout)
            except RuntimeError as exc:
                tqdm.write(f"[tta] {label} failed: {exc}", file=sys.stderr)
                failed.append(f"{label}: {str(exc)[-500:]}")
                return
            bar.update(max(0, steps - (bar.n - done_before)))     # a run that stopped at its target
            run_json = json.loads(Path(jpath).read_text())
            results["runs"].append({**key, **run_json, "hosts": p, "bandwidth": bw,
                                    "wall_s": time.perf_counter() - started, "load_avg": os.getloadavg()[0]})
            results["rows"] = rows(results["runs"])
            path.write_text(json.dumps(results, indent=1))       # resumable: every finished run is kept

        def study(p: int, bw: str, launch: Any) -> None:
            for seed in args.seeds:
                one("none", seed, p, bw, launch)
            for method in methods[1:]:
                one(method, first, p, bw, launch)
            for method in fastest(rows(results["runs"]), p, bw):
                for seed in rest:
                    one(method, seed, p, bw, launch)

        for p in args.hosts:
            threads = threads_per_rank(p)
            if args.no_cluster:
                env = mpi_env({k: str(threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                         "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")})
                study(p, SHM, lambda w: (mpirun_command(p) + w, env))
                continue
            spec = ClusterSpec(hosts=p, bandwidth=bws[0], name=args.cluster_name or f"tta{os.getpid() % 10**8}",
                               **({"subnet": args.subnet} if args.subnet else {}))
            with EmulatedCluster(spec) as cluster:
                for bw in bws:
                    cluster.reshape(bw)
                    tqdm.write(f"[tta] {describe(cluster.spec, p)}", file=sys.stderr)
                    study(p, bw, lambda w: (in_host(cluster.spec, ["mpirun", "-np", str(p)] + w),
                                            cluster_env(cluster.spec, p)))
    results["when"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    write_report(results, out, args.name)
    if failed:
        print(f"[tta] {len(failed)} run(s) failed:\n" + "\n".join(failed), file=sys.stderr)
    return 1 if failed else 0


# ----------------------------------------------------------------- report
def write_report(results: dict[str, Any], out: Path, name: str) -> None:
    """Rows into ``<name>.json``; ``<name>.md``, ``<name>_time.png`` and ``<name>_steps.png`` beside it."""
    results["rows"] = rows(results["runs"])
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    plot_curves(results, out / f"{name}_time.png", "time_s", "training wall-clock time (s)")
    plot_curves(results, out / f"{name}_steps.png", "step", "training steps")
    md = render_markdown(results, name)
    (out / f"{name}.md").write_text(md)
    print(md)


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def spread(table: list[dict[str, Any]], hosts: int, bandwidth: str) -> list[str]:
    """Lines 'method: time to target mean +- std over n seeds (speedup ...)' for methods run with >= 2 seeds."""
    lines = []
    for method in dict.fromkeys(r["method"] for r in table):
        rr = [r for r in table if r["method"] == method and (r["hosts"], r["bandwidth"]) == (hosts, bandwidth)]
        times = [r["time_to_target_s"] for r in rr if r["time_to_target_s"] is not None]
        if len(rr) < 2:
            continue
        speed = [r["speedup_vs_dense"] for r in rr if r["speedup_vs_dense"] is not None]
        finals = [r["final_val_loss"] for r in rr]
        lines.append(f"- `{method}`, {len(rr)} seeds: time to target "
                     + (f"{statistics.mean(times):.1f} +- {statistics.stdev(times) if len(times) > 1 else 0:.1f} s"
                        f" ({len(times)} reached)" if times else "never reached")
                     + (f", speedup {min(speed):.2f}x to {max(speed):.2f}x" if speed else "")
                     + f", final loss {min(finals):.3f} to {max(finals):.3f} bits/byte")
    return lines


def dense_step_note(group_rows: list[dict[str, Any]]) -> list[str]:
    """Dense's seconds per step for each seed of one (P, link): the same work, so a spread between
    them is the machine's load, and every row of that seed is measured against its seed's dense."""
    dense = sorted((r["seed"], r["step_s"]) for r in group_rows if r["method"] == "none")
    if len(dense) < 2:
        return []
    steps = [s for _, s in dense]
    line = ("Dense's seconds per step, by seed: " + ", ".join(f"seed {sd} {st:.3f} s" for sd, st in dense)
            + f" (the same work; {max(steps) / min(steps):.2f}x apart).")
    if max(steps) / min(steps) > 1.2:
        slow = max(dense, key=lambda d: d[1])[0]
        fast_seed, fast_step = min(dense, key=lambda d: d[1])
        dense_slow = next(r for r in group_rows if r["method"] == "none" and r["seed"] == slow)
        again = [f"{r['method']} {dense_slow['steps_to_target'] * fast_step / r['time_to_target_s']:.2f}x"
                 for r in group_rows if r["seed"] == slow and r["method"] != "none" and r["time_to_target_s"]]
        line += (f" Seed {slow}'s dense run met a busier machine, and every speedup of seed {slow} is "
                 f"against it. At seed {fast_seed}'s dense step time ({fast_step:.3f} s) for its "
                 f"{dense_slow['steps_to_target']} steps, seed {slow}'s speedups would read: "
                 + (", ".join(again) if again else "none reached") + ".")
    return ["", line]


def render_markdown(results: dict[str, Any], name: str = "time_to_accuracy") -> str:
    runs, table = results["runs"], results.get("rows") or rows(results["runs"])
    first = runs[0] if runs else {}
    lines = ["# Time to accuracy: a byte-level GPT on the Python standard library", "",
             f"Measured {results.get('when', '?')} at commit `{results.get('commit', '?')}` on "
             f"{results.get('machine', '?')}, with `{results.get('command', 'hvdc bench tta')}`.", ""]
    if first:
        lines += [f"Model `{first['model']}`: {first['parameters'] / 1e6:.2f}M parameters, byte-level (vocabulary "
                  f"256), trained with Adam (lr {first['lr']}) on {first.get('batch', 4)} window(s) of "
                  f"{first.get('seq', 64)} bytes per rank and step, from {first['train_bytes'] / 1e6:.1f} MB of the "
                  f"standard library's `.py` files ({first['files'][0]} files) and scored every "
                  f"{first['eval_every']} steps on {first['files'][1]} held-out files ({first['val_bytes'] / 1e6:.1f}"
                  f" MB; split by file). Target = dense's validation loss after its {first['dense_steps']} steps "
                  f"(same seed); the other methods stop at the target or at "
                  f"{results.get('max_factor', 1.5):g}x dense's steps. Time = wall-clock time of the training "
                  f"steps, evaluation and kernel loading excluded, with {first.get('threads_per_rank', '?')} thread(s) per rank. "
                  f"Speedup = dense's time to target / the method's; steps ratio and step-time ratio are the "
                  f"method's against dense's, and speedup = 1 / (steps ratio x step-time ratio) up to the "
                  f"evaluation grid.", ""]
    loading = [r["loading_s"] for r in runs if "loading_s" in r]
    if loading:
        lines += [f"Before its first step each run loads its method's compiled kernels (two untimed calls on a "
                  f"small array; every candidate's for `auto`): {min(loading):.2f} to {max(loading):.2f} s, "
                  f"left out of the time as a process's one-off start-up.", ""]
    loads = [r["load_avg"] for r in runs if "load_avg" in r]
    if loads:
        lines += [f"Load average (1 min) of the machine after each run: {min(loads):.1f} to {max(loads):.1f}"
                  f" ({os.cpu_count()} logical CPUs here); with more ranks than cores the ranks share them, "
                  f"so close orderings are within the noise.", ""]
    if results.get("note"):
        lines += [results["note"], ""]
    for hosts, bw in dict.fromkeys(_group(r) for r in runs):
        rr = [r for r in table if (r["hosts"], r["bandwidth"]) == (hosts, bw)]
        lines += [f"## P = {hosts}, {bw}", "",
                  "| method | seed | time to target (s) | steps to target | speedup vs dense | steps ratio | "
                  "step-time ratio | final loss (bits/byte) | why not faster |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rr:
            lines.append(f"| {r['method']} | {r['seed']} | {_fmt(r['time_to_target_s'], '.1f', 'not reached')} | "
                         f"{_fmt(r['steps_to_target'], 'd', '-')} | {_fmt(r['speedup_vs_dense'], '.2f')}{'x' if r['speedup_vs_dense'] is not None else ''} | "
                         f"{_fmt(r['steps_ratio'], '.2f')} | {_fmt(r['step_time_ratio'], '.2f')} | "
                         f"{r['final_val_loss']:.3f} | {reason(r)} |")
        fast = [r for r in rr if (r["speedup_vs_dense"] or 0) >= 2.0]
        lines += ["", f"Methods at least 2x sooner than dense here: {len({r['method'] for r in fast})}"
                  + (" (" + "; ".join(f"{r['method']} seed {r['seed']}" for r in fast) + ")." if fast else ".")]
        lines += dense_step_note(rr)
        sp = spread(table, hosts, bw)
        if sp:
            lines += ["", "Spread over seeds:", ""] + sp
        lines.append("")
    lines += [f"![validation loss against wall-clock time]({name}_time.png)", "",
              f"![validation loss against steps]({name}_steps.png)", ""]
    return "\n".join(lines + reading_guide(results))


def reading_guide(results: dict[str, Any]) -> list[str]:
    """How to reproduce the study, what it cost here, and how to carry it to another cluster."""
    runs = results["runs"]
    walls = [r["wall_s"] for r in runs if "wall_s" in r]
    cost = (f"Here the {len(runs)} runs took {sum(walls) / 60:.0f} minutes from launch to result "
            f"({sum(r['train_s'] for r in runs) / 60:.0f} of them training steps; the rest is start-up -- "
            f"MPI, imports, reading the corpus -- and the evaluations)." if walls and len(walls) == len(runs)
            else f"Here the runs' training steps took {sum(r['train_s'] for r in runs) / 60:.0f} minutes "
                 f"in all, plus each run's start-up (MPI, imports, reading the corpus) and evaluations.")
    return ["## Reproduce it", "",
            "The emulated cluster needs root (network namespaces and `tc`); one rank per emulated host:", "",
            "```", "sudo hvdc bench tta                       # P = 4 at 1 Gbit and 100 Mbit, seeds 0 and 1",
            "sudo hvdc bench tta --bandwidths 1gbit --steps 40 --eval-every 4",
            "hvdc bench tta --no-cluster --hosts 2 --model tiny --steps 10   # one machine, no shaping",
            "hvdc bench tta --report-only              # the page and plots again from the JSON", "```", "",
            "An interrupted study resumes: the same command skips every run already in the JSON. " + cost, "",
            "## Reading it for another cluster", "",
            "Time to target = steps to target x seconds per step. The steps to target (the steps ratio "
            "column) is a property of the method and the task, not of the link; the seconds per step is "
            "what changes on another cluster. `hvdc model --network 10gbe --ranks 8` (or `--latency 2us "
            "--bandwidth 25gbit` for your own links) predicts each method's step speedup over dense there, "
            "from the step profiles `hvdc bench e2e` measured (its 11.6M-parameter Transformer: a model of "
            "the same kind and twice this one's size); that step speedup divided by the steps ratio "
            "measured here estimates the speedup in time to target on that cluster. A method whose "
            "steps ratio exceeds its predicted step speedup will not pay off there.", ""]


def plot_curves(results: dict[str, Any], path: Path, x_key: str, xlabel: str) -> None:
    """Validation loss against ``x_key`` (time or steps), one panel per (P, link), one line per method
    (its first seed), dense's target as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plotting import method_style
    from .report_files import save_figure
    runs = results["runs"]
    groups = list(dict.fromkeys(_group(r) for r in runs))
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 5), squeeze=False)
    for ax, (hosts, bw) in zip(axes[0], groups):
        rr = [r for r in runs if _group(r) == (hosts, bw)]
        seed = min(r["seed"] for r in rr)
        for i, method in enumerate(dict.fromkeys(r["method"] for r in rr)):
            r = next((r for r in rr if r["method"] == method and r["seed"] == seed), None)
            if r is None:
                continue
            ax.plot([c[x_key] for c in r["curve"]], [c["val_bpb"] for c in r["curve"]], label=method,
                    markersize=3, **method_style(i))
        target = target_of(runs, hosts, bw, seed)
        if target is not None:
            ax.axhline(target, color="black", linestyle=":", linewidth=1, label="target (dense's final)")
            low = min(c["val_bpb"] for r in rr for c in r["curve"])
            ax.set_ylim(low - 0.1, target + 1.5)     # the approach to the target, not the first drop from 8
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (bits per byte)")
        ax.set_title(f"P = {hosts}, {bw}, seed {seed}")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    save_figure(fig, path, dpi=110)
