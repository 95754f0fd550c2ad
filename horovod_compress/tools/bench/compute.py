"""``hvdc bench compute``: the price of compression on shared memory, at P = 1, 2, 4.

Where the network is fast (shared memory here, 10-100 Gbit on a cluster) a
compressed allreduce wins only if compressing costs less than sending. This
benchmark times one whole ``Method.allreduce`` of a ``--shape`` float32
gradient (error feedback, compression, communication, decompression) for
every method at its default parameters, at each ``P`` in ``--np``, with one
thread per rank (``OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1``, also with fewer
ranks than cores, so the numbers compare across P), warm-up off (warm-up steps
are dense allreduces; Ok-Topk's default is 32), and in the same run:

* a memcpy of the gradient (``np.copyto``): the floor of any pass over it;
* a dense float32 allreduce (``Communicator.allreduce(x, "avg")``).

Drift of the shared machine is kept out of the ratios: every timed call of a
method is preceded by a memcpy and a dense allreduce timed the same way, and
the method's x memcpy and x dense are taken against the medians of *those*
(``memcpy_s``/``dense_s`` of its row); the P header gives the medians over all
of them. On one node the 16-bit sums, Global-QSGD's 8-bit sum and ARC-Top-K's
rows go through the shared-memory window when each rank has a core of its own
(``HVDC_SHARED_WINDOW``, :mod:`horovod_compress.mpi_collectives.shared_window`);
the report says which transport each P used.

Each call is split by :meth:`Communicator.timings` into the seconds spent
*inside MPI* (communication; waiting for slower ranks and user-defined
reduction operators -- fp16/bf16 sums, Global-QSGD's exponential sum -- run
there too) and the rest, *outside MPI*: error feedback, compression and
decompression, which is the compute this benchmark is about (the two are
interleaved inside a method, so they are reported together). Ranks meet at a
barrier before every timed call; a call's time is the slowest rank's, its
compute the largest over ranks, each the median of ``--repeat`` calls after
``--warmup`` untimed ones.

Written: ``<out>.md`` (the table at every P, the speed targets at P = 2),
``<out>.json`` and ``<out>.png`` (cost as a multiple of the dense allreduce).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .launch import under_mpi_launcher
from .report_files import save_figure

#: Issue 21's ceilings at P = 2 (whole call as a multiple of the dense allreduce).
TARGET_X_DENSE = {"fp16": 1.0, "global_qsgd": 1.0, "topk": 1.5, "oktopk": 1.5,
                  "arc_topk": 1.5, "powersgd": 1.5, "greedylore": 2.0, "deepreduce": 2.0}
#: Issue 21's ceiling on compression + decompression compute, as a multiple of a memcpy.
TARGET_COMPUTE_X_MEMCPY = 3.0


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compute", help="one compressed allreduce per method on shared memory at "
                       "P = 1, 2, 4: compute vs communication, against memcpy and dense")
    p.add_argument("--np", type=int, nargs="+", default=[1, 2, 4], help="values of P")
    p.add_argument("--shape", default="2000x2000", help="gradient shape, e.g. 2000x2000")
    p.add_argument("--methods", default="all",
                   help="'all' (every method, default parameters) or comma-separated "
                        "name[:key=value;key=value] specs")
    p.add_argument("--repeat", type=int, default=9, help="timed calls per method (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    p.add_argument("--out", default="benchmarks/compute", help="file stem of the results")
    p.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def method_specs(spec: str) -> list[str]:
    """The method specs named by ``--methods`` ('all': every registered method)."""
    if spec == "all":
        from ...compressors.registry import available
        return available()
    return [s.strip() for s in spec.split(",") if s.strip()]


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name:key=value;key=value`` -> (name, params) with ints and floats converted."""
    name, _, rest = spec.partition(":")
    params: dict[str, Any] = {}
    for kv in filter(None, rest.split(";")):
        key, _, value = kv.partition("=")
        for conv in (int, float):
            try:
                params[key] = conv(value)
                break
            except ValueError:
                continue
        else:
            params[key] = value
    return name.strip(), params


def run(args: argparse.Namespace) -> int:
    """Launcher: one mpirun per P, then the report; with ``--worker-json``: one rank's measurement."""
    if args.worker_json is not None:
        _worker(args)
        return 0
    if under_mpi_launcher():
        raise ValueError("hvdc bench compute starts its own ranks (one mpirun per P): "
                         "run it as a single process")
    if any(p < 1 for p in args.np):
        raise ValueError(f"--np values must be >= 1, got {args.np}")
    from tqdm import tqdm

    from ..testing import mpi_env, mpirun_command
    runs = []
    with tempfile.TemporaryDirectory() as tmp, tqdm(args.np, desc="compute", unit="P",
                                                    file=sys.stderr) as bar:
        for p in bar:
            bar.set_postfix_str(f"P={p}")
            path = Path(tmp) / f"p{p}.json"
            cmd = mpirun_command(p) + [sys.executable, "-m", "horovod_compress.tools.cli", "bench",
                                       "compute", "--shape", args.shape, "--methods",
                                       args.methods, "--repeat", str(args.repeat), "--warmup",
                                       str(args.warmup), "--worker-json", str(path)]
            env = mpi_env({"HVDC_LAUNCHED": "1", "OMP_NUM_THREADS": "1",
                           "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                           "MKL_NUM_THREADS": "1"})
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                tqdm.write(proc.stdout[-4000:] + proc.stderr[-4000:], file=sys.stderr)
                raise RuntimeError(f"hvdc bench compute: the run at P={p} failed "
                                   f"(mpirun exit {proc.returncode}); its output is above")
            runs.append(json.loads(path.read_text()))
    report = {"command": f"hvdc bench compute --np {' '.join(map(str, args.np))} --shape "
                         f"{args.shape} --methods {args.methods} --repeat {args.repeat} "
                         f"--warmup {args.warmup}",
              "shape": args.shape, "repeat": args.repeat, "warmup": args.warmup,
              "machine": _machine(), "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    png = out.with_suffix(".png")
    plot(report, png)
    text = render_markdown(report, png.name)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def _machine() -> dict[str, Any]:
    import numpy as np
    return {"cpu_count": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "numpy": np.__version__,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _worker(args: argparse.Namespace) -> None:
    """One rank: time memcpy, dense and every method; rank 0 writes the JSON."""
    import numpy as np
    from mpi4py import MPI

    from ...compressors.registry import create
    from ...mpi_collectives import Communicator

    comm = Communicator()
    shape = tuple(int(s) for s in args.shape.split("x"))
    grad = np.random.default_rng(1234 + comm.rank).standard_normal(shape).astype(np.float32)
    dst = np.empty_like(grad)

    def timed(fn: Any, *baselines: Any) -> list[dict[str, float]]:
        """Medians for ``fn`` and each of ``baselines``, every timed call of ``fn`` preceded by
        one of each baseline (so all see the same state of the machine)."""
        for _ in range(args.warmup):
            for f in (*baselines, fn):
                f()
        samples: list[tuple[list[float], list[float]]] = [([], []) for _ in range(1 + len(baselines))]
        for _ in range(args.repeat):
            for k, f in enumerate((*baselines, fn)):
                comm.comm.Barrier()
                inside0 = comm.timings()["total"]
                t0 = time.perf_counter()
                f()
                dt = time.perf_counter() - t0
                compute = dt - (comm.timings()["total"] - inside0)
                samples[k][0].append(comm.comm.allreduce(dt, op=MPI.MAX))
                samples[k][1].append(comm.comm.allreduce(compute, op=MPI.MAX))
        order = [len(baselines), *range(len(baselines))]     # fn first, then the baselines
        return [{"s": float(np.median(samples[k][0])), "compute_s": float(np.median(samples[k][1])),
                 "samples": samples[k][0]} for k in order]

    def copy() -> None:
        np.copyto(dst, grad)

    def dense_allreduce() -> None:
        comm.allreduce(grad, op="avg")

    rows = []
    memcpy_all: list[float] = []
    dense_all: list[float] = []
    dense_compute: list[float] = []
    for spec in method_specs(args.methods):
        name, params = parse_spec(spec)
        method = create(name, **params)
        if getattr(method, "warmup_steps", 0) and "warmup_steps" not in params:
            method = create(name, **{**params, "warmup_steps": 0})   # warm-up steps are dense
        t, mem, den = timed(lambda: method.allreduce(grad, "g", comm), copy, dense_allreduce)
        memcpy_all += mem["samples"]
        dense_all += den["samples"]
        dense_compute.append(den["compute_s"])
        comm.reset_stats()
        method.allreduce(grad, "g", comm)
        sent = float(comm.stats()["sent"])
        rows.append({"method": spec, "params": method.params(), "s": t["s"],
                     "compute_s": t["compute_s"], "sent_bytes": sent,
                     "memcpy_s": mem["s"], "dense_s": den["s"]})
    from ...mpi_collectives.shared_window import shared_window_policy, use_shared_window
    window_used = use_shared_window(comm)     # on every rank: its first call is a collective
    if comm.rank == 0:
        Path(args.worker_json).write_text(json.dumps({
            "P": comm.size, "threads_per_rank": int(os.environ.get("NUMBA_NUM_THREADS", "0") or 0),
            "memcpy_s": float(np.median(memcpy_all)) if memcpy_all else float("nan"),
            "dense_s": float(np.median(dense_all)) if dense_all else float("nan"),
            "dense_compute_s": float(np.median(dense_compute)) if dense_compute else float("nan"),
            "shared_window": {"policy": shared_window_policy(), "used": window_used},
            "grad_bytes": int(grad.nbytes), "rows": rows}))


def _ratio_rows(run_: dict[str, Any]) -> list[dict[str, Any]]:
    """Each row with its ratios: against the memcpy and dense allreduce timed alongside its
    own calls (reports before they were interleaved: against the run's one measurement)."""
    out = []
    for r in run_["rows"]:
        memcpy, dense = r.get("memcpy_s", run_["memcpy_s"]), r.get("dense_s", run_["dense_s"])
        comp = max(r["compute_s"], 0.0)
        out.append({**r, "x_memcpy": r["s"] / memcpy, "x_dense": r["s"] / dense,
                    "compute_x_memcpy": comp / memcpy, "comm_s": max(r["s"] - comp, 0.0)})
    return out


def render_markdown(report: dict[str, Any], plot_name: str | None = None) -> str:
    """The report: per P a table of ms, x memcpy, x dense, compute and communication; targets at P = 2."""
    m = report["machine"]
    lines = [
        "# Compute: the price of compression on shared memory",
        "",
        f"`{report['command'].strip()}` on {m['cpu_count']} cores ({m['machine']}), "
        f"{m['date']}, load average before the run "
        f"{', '.join(f'{x:.2f}' for x in m['load_average'] or [])}. "
        f"Gradient {report['shape']} float32; every method at its default parameters, warm-up "
        "off (`warmup_steps=0`: warm-up steps are dense); "
        f"one thread per rank; median of {report['repeat']} calls after {report['warmup']} "
        "untimed ones, each the slowest rank's time. *Compute* is the time outside MPI "
        "(error feedback, compression, decompression; the largest over ranks), *comm* the "
        "rest (inside MPI, including waiting and user-defined reduction operators). "
        "Memcpy and the dense float32 allreduce are measured in the same run" +
        (", one of each before every timed call of a method: a row's x memcpy and x dense are "
         "against those (its *dense ms* column), the header's figures are the medians over all."
         if any("dense_s" in r for run_ in report["runs"] for r in run_["rows"]) else "."),
        ""]
    for run_ in report["runs"]:
        p = run_["P"]
        window = run_.get("shared_window")
        transport = "" if window is None or p == 1 else (
            " 16-bit, Global-QSGD and ARC-Top-K row sums through the shared-memory window "
            f"(`HVDC_SHARED_WINDOW={window['policy']}`)." if window["used"] else
            f" Reduce-once sums on the pipelined ring (`HVDC_SHARED_WINDOW={window['policy']}`"
            "; the window needs a core per rank under `auto`).")
        lines += [f"## P = {p}", "",
                  f"memcpy of the gradient {1e3 * run_['memcpy_s']:.2f} ms; dense allreduce "
                  f"{1e3 * run_['dense_s']:.2f} ms ({run_['dense_s'] / run_['memcpy_s']:.1f}x memcpy)."
                  + transport, ""]
        paired = any("dense_s" in r for r in run_["rows"])
        header = "| method | ms | x memcpy | x dense | compute ms | compute x memcpy | comm ms |"
        sep = "|---|---:|---:|---:|---:|---:|---:|"
        if paired:
            header += " dense ms |"
            sep += "---:|"
        if p == 2:
            header += " target x dense | met |"
            sep += "---:|---|"
        lines += [header, sep]
        for r in _ratio_rows(run_):
            row = (f"| {r['method']} | {1e3 * r['s']:.2f} | {r['x_memcpy']:.1f} | "
                   f"{r['x_dense']:.2f} | {1e3 * r['compute_s']:.2f} | "
                   f"{r['compute_x_memcpy']:.1f} | {1e3 * r['comm_s']:.2f} |")
            if paired:
                row += f" {1e3 * r.get('dense_s', run_['dense_s']):.2f} |"
            if p == 2:
                target = TARGET_X_DENSE.get(parse_spec(r["method"])[0])
                met = "" if target is None else ("yes" if r["x_dense"] <= target else "no")
                row += f" {'' if target is None else f'<= {target:g}'} | {met} |"
            lines.append(row)
        lines.append("")
    two = [r for run_ in report["runs"] if run_["P"] == 2 for r in _ratio_rows(run_)]
    if two:
        within = [f"`{r['method']}`" for r in two
                  if r["compute_x_memcpy"] <= TARGET_COMPUTE_X_MEMCPY]
        beyond = [f"`{r['method']}` ({r['compute_x_memcpy']:.1f}x)" for r in two
                  if r["compute_x_memcpy"] > TARGET_COMPUTE_X_MEMCPY]
        lines += ["## Compute against the memcpy floor (P = 2)", "",
                  f"Within {TARGET_COMPUTE_X_MEMCPY:g}x a memcpy: "
                  f"{', '.join(within) if within else 'no method'}.", "",
                  f"Beyond it: {', '.join(beyond) if beyond else 'no method'}.", ""]
    if plot_name:
        lines += [f"![cost of one compressed allreduce against dense]({plot_name})", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Grouped bars: each method's whole call as a multiple of the dense allreduce, per P."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = report["runs"]
    methods = [r["method"] for r in runs[0]["rows"]] if runs else []
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(methods) + 2), 4.5))
    width = 0.8 / max(len(runs), 1)
    x = np.arange(len(methods))
    for i, run_ in enumerate(runs):
        by = {r["method"]: r["s"] / r.get("dense_s", run_["dense_s"]) for r in run_["rows"]}
        ax.bar(x + i * width, [by.get(m, np.nan) for m in methods], width, label=f"P = {run_['P']}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(x + width * (len(runs) - 1) / 2, methods, rotation=45, ha="right")
    ax.set_ylabel("one allreduce / dense allreduce")
    ax.set_title(f"Shared memory, {report['shape']} float32, one thread per rank")
    ax.legend()
    ax.grid(True, axis="y", which="both", alpha=0.3)
    save_figure(fig, path, dpi=110)
