"""``hvdc bench volume`` -- bytes per rank per step of the sparse allreduces vs P (Ok-Topk, Table 1).

For each world size P (default 2, 4, 8) this launches ``mpirun -np P`` and
trains the digits MLP (:func:`horovod_compress.tools.bench.flat_training.train_flat`,
85k parameters fused into one vector, as the paper sparsifies the whole model)
once per method: dense (``none``), TopkA (``topk``), TopkDSA, gTopk, Gaussiank
and Ok-Topk, all at the same density, all with the same dense warm-up. Every
sparse step's bytes (sent and received, per rank, by the Communicator's
volume model) are recorded; the report gives the mean per rank per step in
words (4 bytes) beside the paper's Table 1 formulas, the worst rank's mean,
and the test accuracy reached, then plots measured volume against P.

Writes ``<out>.md``, ``<out>.json`` and ``<out>.png`` (default
``benchmarks/volume``).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .launch import worker_bench
from .report_files import save_figure

METHODS = ["none", "topk", "topk_dsa", "gtopk", "gaussiank", "oktopk"]
LABELS = {"none": "Dense", "topk": "TopkA", "topk_dsa": "TopkDSA", "gtopk": "gTopk",
          "gaussiank": "Gaussiank", "oktopk": "Ok-Topk"}
WORD = 4


def table1_words(method: str, n: int, k: int, p: int) -> tuple[float, float]:
    """Bandwidth term of the Ok-Topk paper's Table 1, in words: ``(low, high)`` (equal if exact)."""
    f = (p - 1) / p
    if method == "none":
        v = 2 * n * f
        return v, v
    if method in ("topk", "gaussiank"):
        v = 2 * k * (p - 1)
        return v, v
    if method == "topk_dsa":
        return 4 * k * f, (2 * k + n) * f
    if method == "gtopk":
        v = 4 * k * math.log2(p)
        return v, v
    if method == "oktopk":
        return 2 * k * f, 6 * k * f
    raise ValueError(f"no Table 1 formula for {method!r}")


def _format_formula(method: str) -> str:
    return {"none": "2n(P-1)/P", "topk": "2k(P-1)", "gaussiank": "2k(P-1)",
            "topk_dsa": "[4k(P-1)/P, (2k+n)(P-1)/P]", "gtopk": "4k log2 P",
            "oktopk": "[2k(P-1)/P, 6k(P-1)/P]"}[method]


# --------------------------------------------------------------- worker side
def worker(args: argparse.Namespace) -> None:
    """Runs on every rank under mpirun: train once per method, record every sparse step's bytes."""
    import numpy as np

    import horovod_compress as hvdc
    from horovod_compress.mpi_collectives import Communicator

    from .flat_training import train_flat

    comm = Communicator()
    results: dict[str, Any] = {}
    for name in args.methods:
        kw: dict[str, Any] = {}
        if name != "none":   # dense has nothing to warm up: it is dense every step
            kw = {"density": args.density, "warmup_steps": args.warmup}
        method = hvdc.Compression.by_name(name, **kw)
        sent: list[float] = []
        received: list[float] = []

        def record(step: int, _method: Any, c: Any) -> None:
            if step > args.warmup:
                sent.append(c.bytes_sent)
                received.append(c.bytes_received)
            c.reset_stats()

        comm.reset_stats()
        out = train_flat(method, comm, args.steps, seed=args.seed, on_step=record)
        per_rank = comm.allgather(np.array([np.mean(sent), np.mean(received), np.max(sent),
                                            np.max(received)]))
        results[name] = {"n": out["n_params"], "test_accuracy": out["test_accuracy"],
                         "mean_sent": per_rank[:, 0].tolist(), "mean_received": per_rank[:, 1].tolist(),
                         "max_sent": per_rank[:, 2].tolist(), "max_received": per_rank[:, 3].tolist()}
    if comm.rank == 0:
        Path(args.json).write_text(json.dumps({"P": comm.size, "results": results}))


# --------------------------------------------------------------- parent side
def run(args: argparse.Namespace) -> int:
    from ..testing import mpi_env, mpirun_command

    measured: dict[int, Any] = {}
    for p in args.ranks:
        with tempfile.TemporaryDirectory(prefix="hvdc-volume-") as tmp:
            out = Path(tmp, "volume.json")
            cmd = mpirun_command(p) + [sys.executable, "-m", "horovod_compress.tools.bench.volume",
                                       "--worker", "--json", str(out), "--steps", str(args.steps),
                                       "--warmup", str(args.warmup), "--density", str(args.density),
                                       "--seed", str(args.seed), "--methods", *args.methods]
            print(f"P={p}: {' '.join(cmd[-14:])}", flush=True)
            subprocess.run(cmd, check=True, env=mpi_env())
            measured[p] = json.loads(out.read_text())["results"]
    report = build_report(measured, args)
    base = Path(args.out)
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps({"args": vars_of(args), "measured": measured},
                                                    indent=1))
    base.with_suffix(".md").write_text(report)
    plot(measured, args, base.with_suffix(".png"))
    print(report)
    return 0


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "func"}


def build_report(measured: dict[int, Any], args: argparse.Namespace) -> str:
    """Markdown: one row per (method, P): measured words vs Table 1, worst rank, accuracy."""
    first = next(iter(measured.values()))
    n = next(iter(first.values()))["n"]
    k = max(1, round(args.density * n))
    lines = [
        f"# Communication volume per rank per step (digits MLP, n = {n}, density = {args.density}, k = {k})",
        "",
        f"`hvdc bench volume --ranks {' '.join(map(str, args.ranks))} --steps {args.steps} "
        f"--warmup {args.warmup} --density {args.density}`: every method trains the same model "
        f"from the same seed; {args.warmup} dense warm-up steps, then "
        f"{args.steps - args.warmup} compressed steps measured. Words = 4 bytes; "
        "\"sent\"/\"received\" are the mean over ranks of each rank's mean per step, "
        "\"worst rank\" the largest per-rank mean (sent or received). Ok-Topk's mean "
        "includes its threshold re-evaluation steps (one in 32).",
        "",
        "| method | P | sent (words) | received (words) | worst rank | Table 1 | Table 1 (words) | test acc. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.methods:
        for p in sorted(measured):
            r = measured[p][name]
            sent = sum(r["mean_sent"]) / p / WORD
            recv = sum(r["mean_received"]) / p / WORD
            worst = max(max(r["mean_sent"]), max(r["mean_received"])) / WORD
            lo, hi = table1_words(name, n, k, p)
            formula = f"{lo:.0f}" if lo == hi else f"{lo:.0f} .. {hi:.0f}"
            lines.append(f"| {LABELS[name]} | {p} | {sent:.0f} | {recv:.0f} | {worst:.0f} | "
                         f"{_format_formula(name)} | {formula} | {r['test_accuracy']:.3f} |")
    if "oktopk" in args.methods:
        lines += ["", "Ok-Topk against its bound 6k(P-1)/P (worst rank's mean):", ""]
        for p in sorted(measured):
            r = measured[p]["oktopk"]
            worst = max(max(r["mean_sent"]), max(r["mean_received"])) / WORD
            bound = 6 * k * (p - 1) / p
            lines.append(f"- P = {p}: {worst:.0f} words = {worst / bound:.2f} x 6k(P-1)/P"
                         + ("" if "topk" not in measured[p] else
                            f"; TopkA {sum(measured[p]['topk']['mean_sent']) / p / WORD:.0f} words"))
    return "\n".join(lines) + "\n"


def plot(measured: dict[int, Any], args: argparse.Namespace, path: Path) -> None:
    """Worst rank's measured words per step against P (solid) with Table 1 (dashed).

    The worst rank (largest mean of sent or received) is what Table 1's
    per-rank model describes: e.g. gTopk's root receives one message per level.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted(measured)
    n = next(iter(measured[ps[0]].values()))["n"]
    k = max(1, round(args.density * n))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(args.methods):
        color = f"C{i}"
        words = [max(max(measured[p][name]["mean_sent"]), max(measured[p][name]["mean_received"]))
                 / WORD for p in ps]
        ax.plot(ps, words, "o-", color=color, label=f"{LABELS[name]} (measured)")
        lo = [table1_words(name, n, k, p)[0] for p in ps]
        hi = [table1_words(name, n, k, p)[1] for p in ps]
        ax.plot(ps, hi, "--", color=color, alpha=0.6)
        if lo != hi:
            ax.fill_between(ps, lo, hi, color=color, alpha=0.08)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.set_xlabel("ranks P")
    ax.set_ylabel("words per step, busiest rank")
    ax.set_title(f"Sparse allreduce volume, digits MLP (n={n}, k={k}); dashed: Table 1")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--out", default="benchmarks/volume")


register_bench, main = worker_bench(
    "volume", "bytes per rank per step of the sparse allreduces vs P (Ok-Topk paper, Table 1)",
    __doc__, add_arguments, worker, run)


if __name__ == "__main__":
    main()
