"""``hvdc bench convergence``: what each method costs in accuracy, at its paper defaults.

The small-scale analogue of ARC-Top-K's Table II and GreedyLore's Table III:
every method at its library defaults (the papers' defaults), with and without
error feedback where it applies, several seeds, P ranks, on data that ships
with scikit-learn (no download):

* ``mlp``: the demo's 64-128-128-10 MLP on the 8x8 digits, 30 epochs;
* ``cnn``: a small CNN (two 3x3 convolutions, 16 and 32 channels, max-pool,
  a 512-64-10 head; 38.5k parameters) on the same images, 15 epochs. Its
  convolution kernels are the tensors matrix methods see as out x in*kh*kw.

Both train with SGD (lr 0.05, batch 32 per rank, heavy-ball momentum 0.9;
methods with EF21M feedback run at lr/eta without momentum, the same
effective step -- see :func:`horovod_compress.tools.bench.digits.sgd_settings`);
the seed sets the initial weights, the train/test split and the data order.
Each run records final test accuracy, bytes sent per rank per step (gradient
exchange only), seconds per step and the run's wall time. Rank 0 shows a
progress bar; results are appended to ``convergence.json`` after every run,
so ``--resume`` continues an interrupted study. ``convergence.md`` (mean +- std
over seeds, difference to dense, comparison with the gaps the papers report)
and ``convergence.png`` (accuracy against bytes per step) are written at the
end::

    hvdc bench convergence                          # 4 ranks, both tasks, 3 seeds, every method
    hvdc bench convergence --tasks mlp --seeds 1 --methods none,topk,oktopk
    hvdc bench convergence --quick --np 2 --out /tmp/conv   # a minute: CI's size

One thread per rank (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``).
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TASKS = {"mlp": {"epochs": 30, "lr": 0.05}, "cnn": {"epochs": 15, "lr": 0.05}}
QUICK_METHODS = "none,topk,global_qsgd,powersgd"

# Accuracy difference to dense (percentage points) that the papers report at
# their scale, for the methods their tables cover, with the spread the paper
# reports on that difference (the method's and dense's standard deviations
# over seeds, added; 0 where the paper gives none); measured gaps are compared
# with these. ARC-Top-K Table II: ResNet-18 on CIFAR-10, MSGD, mu = 0.2, r = 4,
# mean +- std over 3 seeds (dense 95.08 +- 0.08). GreedyLore Table III:
# RoBERTa-base on GLUE, average over 8 tasks (AdamW baseline 86.41; top-2 %,
# rand-5 %, rank 8), no spread reported.
PAPER_GAPS: dict[tuple[str, bool], tuple[float, float, str]] = {
    ("topk_rows", True): (-0.13, 0.22, "ARC-Top-K Table II (Top-K, with EF)"),
    ("topk_rows", False): (-0.94, 0.18, "ARC-Top-K Table II (Top-K, without EF)"),
    ("randk_rows", True): (-0.27, 0.26, "ARC-Top-K Table II (Rand-K, with EF)"),
    ("randk_rows", False): (-2.81, 0.35, "ARC-Top-K Table II (Rand-K, without EF)"),
    ("arc_topk", True): (-0.08, 0.26, "ARC-Top-K Table II (ARC-Top-K, with EF)"),
    ("arc_topk", False): (-1.29, 0.17, "ARC-Top-K Table II (ARC-Top-K, without EF)"),
    ("greedylore", True): (-0.07, 0.0, "GreedyLore Table III (rank 8, average)"),
    ("powersgd", True): (-0.26, 0.0, "GreedyLore Table III (PowerSGD rank 8, average)"),
    ("lazy_projection", False): (-0.59, 0.0, "GreedyLore Table III (GaLore rank 8, average)"),
    ("topk", True): (-0.38, 0.0, "GreedyLore Table III (top-2 %, average)"),
    ("randk", True): (-0.80, 0.0, "GreedyLore Table III (rand-5 %, average)"),
}


def register_bench(sub: argparse._SubParsersAction) -> None:
    """Add ``hvdc bench convergence``."""
    p = sub.add_parser("convergence", help="accuracy of every method at paper defaults, with/without "
                                           "error feedback, over seeds (digits MLP and CNN)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The study's options (shared by the launcher and the MPI worker)."""
    p.add_argument("--np", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--tasks", default="mlp,cnn", help="comma-separated: mlp, cnn")
    p.add_argument("--methods", default="all", help="comma-separated method names, or all")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--epochs", type=int, default=None, help="override each task's epochs")
    p.add_argument("--no-ef-variants", action="store_true",
                   help="only the default feedback (not also feedback='none')")
    p.add_argument("--quick", action="store_true",
                   help=f"CI size: methods {QUICK_METHODS}, mlp, 1 seed, 2 epochs")
    p.add_argument("--resume", action="store_true", help="skip runs already in convergence.json")
    p.add_argument("--out", default="benchmarks", help="folder for convergence.md/json/png")


# ------------------------------------------------------------------ configs
def configs(methods: str, ef_variants: bool = True) -> list[dict[str, Any]]:
    """(method, feedback) pairs: each method at its defaults, plus ``feedback='none'``
    for methods that are biased and take a ``feedback`` argument."""
    from ...compressors.registry import available, method_class
    names = available() if methods == "all" else [m.strip() for m in methods.split(",") if m.strip()]
    out = []
    for name in names:
        cls = method_class(name)
        takes = "feedback" in inspect.signature(cls.__init__).parameters
        default = cls().config().get("feedback", "none")
        out.append({"method": name, "feedback": None, "ef": default != "none", "feedback_name": default})
        if ef_variants and takes and default != "none":
            out.append({"method": name, "feedback": "none", "ef": False, "feedback_name": "none"})
    return out


def make_cnn(seed: int) -> Any:
    """The ``cnn`` task's model (see the module docstring), initialised from ``seed``."""
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 8, 8)),
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def train_once(task: str, cfg: dict[str, Any], seed: int, comm: Any, epochs: int,
               batch_size: int = 32) -> dict[str, Any]:
    """One training run on all ranks of ``comm``; returns the metrics of the module docstring."""
    import torch

    from ...compressors.registry import create
    from ...torch import DistributedOptimizer, broadcast_parameters
    from .digits import (dense_bytes_per_step, evaluate, load_digits_split, make_mlp, sgd_settings,
                         train_epoch)

    kwargs: dict[str, Any] = {"seed": seed}
    if cfg["feedback"] is not None:
        kwargs["feedback"] = cfg["feedback"]
    method = create(cfg["method"], **kwargs)
    data = load_digits_split(seed)
    xs = torch.from_numpy(data.x_train[comm.rank::comm.size])
    ys = torch.from_numpy(data.y_train[comm.rank::comm.size])
    steps_per_epoch = max(1, (len(data.y_train) // comm.size) // batch_size)
    model = make_mlp(128, seed) if task == "mlp" else make_cnn(seed)
    broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    lr, momentum = sgd_settings(method, TASKS[task]["lr"], None)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                               named_parameters=model.named_parameters(), compression=method, comm=comm)
    num_params = sum(p.numel() for p in model.parameters())
    comm.reset_stats()
    comm.comm.Barrier()
    t0 = time.perf_counter()
    final_loss = math.nan
    try:
        for epoch in range(epochs):
            final_loss = train_epoch(model, opt, xs, ys, seed=seed, epoch=epoch, rank=comm.rank,
                                     batch_size=batch_size, steps_per_epoch=steps_per_epoch)
    finally:
        opt.close()
    wall = time.perf_counter() - t0
    wall = comm.comm.allreduce(wall, op=__import__("mpi4py").MPI.MAX)
    acc = evaluate(model, data)
    steps = epochs * steps_per_epoch
    sent = comm.comm.allreduce(comm.bytes_sent, op=__import__("mpi4py").MPI.MAX) / steps
    return {"task": task, "method": cfg["method"], "ef": cfg["ef"], "feedback": cfg["feedback_name"],
            "seed": seed, "world_size": comm.size, "epochs": epochs, "steps": steps,
            "num_params": num_params, "test_accuracy": acc,
            "train_loss": final_loss if math.isfinite(final_loss) else None,
            "bytes_sent_per_step": sent, "dense_bytes_per_step": dense_bytes_per_step(num_params, comm.size),
            "seconds_per_step": wall / steps, "wall_seconds": wall, "config": method.config(),
            **({"decisions": [{k: d[k] for k in ("bucket", "step", "reason", "chosen", "switched")}
                              for d in method.decision_log()]}
               if callable(getattr(method, "decision_log", None)) else {})}


def _key(r: dict[str, Any]) -> tuple:
    return (r["task"], r["method"], r["feedback"], r["seed"])


# ------------------------------------------------------------------- worker
def _plan(args: argparse.Namespace) -> tuple[list[str], list[dict[str, Any]], int, dict[str, int]]:
    if args.quick:
        methods, tasks, seeds = QUICK_METHODS if args.methods == "all" else args.methods, ["mlp"], 1
        epochs = {"mlp": args.epochs or 2}
    else:
        methods, tasks, seeds = args.methods, [t.strip() for t in args.tasks.split(",") if t.strip()], args.seeds
        epochs = {t: args.epochs or TASKS[t]["epochs"] for t in tasks}
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"--tasks: unknown task {t!r}; choose from {', '.join(TASKS)}")
    return tasks, configs(methods, not args.no_ef_variants), seeds, epochs


def worker(args: argparse.Namespace) -> None:
    """One MPI rank: run every (task, config, seed) and, on rank 0, write the results."""
    import torch

    from ...mpi_collectives import Communicator
    torch.set_num_threads(1)
    comm = Communicator()
    tasks, cfgs, seeds, epochs = _plan(args)
    out = Path(args.out)
    json_path = out / "convergence.json"
    results: list[dict[str, Any]] = []
    if args.resume and json_path.is_file():
        results = json.loads(json_path.read_text())["runs"]
    done = {_key(r) for r in results}
    todo = [(t, c, s) for t in tasks for c in cfgs for s in range(seeds)
            if (t, c["method"], c["feedback_name"], s) not in done]
    bar = None
    if comm.rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), desc="convergence", unit="run", dynamic_ncols=True, file=sys.stderr)
    t_start = time.time()
    for task, cfg, seed in todo:
        if bar is not None:
            bar.set_postfix_str(f"{task} {cfg['method']}{'' if cfg['ef'] else ' (no EF)'} seed {seed}")
        res = train_once(task, cfg, seed, comm, epochs[task])
        if comm.rank == 0:
            results.append(res)
            out.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps({"runs": results}, indent=1, default=str))
            bar.update(1)
    if comm.rank == 0:
        bar.close()
        print(f"{len(todo)} runs in {time.time() - t_start:.0f} s", file=sys.stderr, flush=True)
        write_report(results, out, command=" ".join(["hvdc", "bench", "convergence", *args.argv]))


def run(args: argparse.Namespace) -> int:
    """Launch the study on ``--np`` ranks (one thread each) unless already under MPI."""
    from .launch import relaunch, under_mpi_launcher
    argv = [a for a in sys.argv[sys.argv.index("convergence") + 1:]] if "convergence" in sys.argv else []
    if under_mpi_launcher():
        args.argv = argv
        worker(args)
        return 0
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    return relaunch(args.np, "horovod_compress.tools.cli", ["bench", "convergence", *argv])


# ------------------------------------------------------------------- report
def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group runs by (task, method, feedback): mean and std of accuracy, bytes, time."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["task"], r["method"], r["feedback"]), []).append(r)
    rows = []
    for (task, method, fb), rs in groups.items():
        accs = [100 * r["test_accuracy"] for r in rs]
        rows.append({"task": task, "method": method, "feedback": fb, "ef": rs[0]["ef"], "n": len(rs),
                     "acc_mean": statistics.fmean(accs),
                     "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                     "bytes": statistics.fmean(r["bytes_sent_per_step"] for r in rs),
                     "dense_bytes": rs[0]["dense_bytes_per_step"],
                     "ms_per_step": 1e3 * statistics.fmean(r["seconds_per_step"] for r in rs),
                     "wall": statistics.fmean(r["wall_seconds"] for r in rs),
                     "epochs": rs[0]["epochs"], "world_size": rs[0]["world_size"],
                     "num_params": rs[0]["num_params"]})
    return rows


def compare_with_paper(row: dict[str, Any], dense: dict[str, Any] | None) -> dict[str, Any] | None:
    """Our gap to dense against the paper's, for methods a paper's table covers (else ``None``).

    ``tolerance`` is the spread of the two differences: ours (this method's and
    dense's standard deviations over seeds, added) plus the paper's (the same,
    where it reports them). ``verdict``: ``"within"`` when our gap is within
    ``tolerance`` of the paper's, ``"better"`` when it is smaller than that,
    ``"outside"`` when it is larger (we lose more accuracy than the paper did).
    """
    paper = PAPER_GAPS.get((row["method"], row["ef"]))
    if paper is None or dense is None:
        return None
    gap, paper_spread, source = paper
    ours = row["acc_mean"] - dense["acc_mean"]
    tolerance = row["acc_std"] + dense["acc_std"] + paper_spread
    verdict = "outside" if ours < gap - tolerance else "better" if ours > gap + tolerance else "within"
    return {"ours": ours, "paper": gap, "paper_spread": paper_spread, "source": source,
            "tolerance": tolerance, "verdict": verdict}


def _verdict(row: dict[str, Any], dense: dict[str, Any] | None) -> str:
    c = compare_with_paper(row, dense)
    if c is None:
        return ""
    paper = f"{c['paper']:+.2f} ± {c['paper_spread']:.2f}" if c["paper_spread"] else f"{c['paper']:+.2f}"
    return f"{paper}, {c['source']}: {c['verdict']} (± {c['tolerance']:.2f})"


def format_table(rows: list[dict[str, Any]], task: str) -> str:
    """Markdown table of one task (dense first, then by bytes per step)."""
    rows = [r for r in rows if r["task"] == task]
    dense = next((r for r in rows if r["method"] == "none"), None)
    rows.sort(key=lambda r: (r["method"] != "none", -r["bytes"], r["method"], not r["ef"]))
    head = ("| method | feedback | accuracy (%) | vs dense (pts) | KiB/rank/step | vs dense bytes | "
            "ms/step | wall s/run | paper's gap vs dense (pts) |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---|")
    lines = [head]
    for r in rows:
        diff = f"{r['acc_mean'] - dense['acc_mean']:+.2f}" if dense and r is not dense else ""
        ratio = ("(baseline)" if r is dense else
                 f"{r['dense_bytes'] / r['bytes']:.1f}x less" if r["bytes"] else "")
        lines.append(f"| `{r['method']}` | {r['feedback']} | {r['acc_mean']:.2f} ± {r['acc_std']:.2f} | {diff} | "
                     f"{r['bytes'] / 1024:.1f} | {ratio} | {r['ms_per_step']:.2f} | {r['wall']:.1f} | "
                     f"{_verdict(r, dense)} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Accuracy (mean, std bars) against bytes per step, one panel per task; hollow = no EF."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = sorted({r["task"] for r in rows}, key=list(TASKS).index)
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 7.5), squeeze=False)
    methods = sorted({r["method"] for r in rows})
    colors = {m: plt.cm.tab20(i % 20) for i, m in enumerate(methods)}
    markers = "osD^v<>phX*P8"
    for ax, task in zip(axes[0], tasks):
        for r in (r for r in rows if r["task"] == task):
            i = methods.index(r["method"])
            ax.errorbar(r["bytes"] / 1024, r["acc_mean"], yerr=r["acc_std"], fmt=markers[i % len(markers)],
                        color=colors[r["method"]], mfc=colors[r["method"]] if r["ef"] else "none",
                        markersize=9, capsize=2,
                        label=r["method"] + (" (no EF)" if not r["ef"] and _takes_ef(r, rows) else ""))
        ax.set_xscale("log")
        ax.set_xlabel("KiB sent per rank per step", fontsize=12)
        ax.set_ylabel("test accuracy (%)", fontsize=12)
        r0 = next(r for r in rows if r["task"] == task)
        ax.set_title(f"digits {task.upper()}, {r0['world_size']} ranks, {r0['epochs']} epochs, "
                     f"{r0['n']} seed(s); hollow = no error feedback", fontsize=12)
        ax.grid(True, which="both", alpha=0.3)
        lo = min(r["acc_mean"] for r in rows if r["task"] == task)
        ax.set_ylim(max(0, min(lo - 2, 85)), 100)
    handles, labels = axes[0][0].get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab, h)
    # a legend readable when the page scales the figure to its text width (~900 px)
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=5, fontsize=12, markerscale=1.2)
    fig.tight_layout(rect=(0, 0.3, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _takes_ef(row: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    return any(r["method"] == row["method"] and r["task"] == row["task"] and r["ef"] for r in rows)


def write_report(results: list[dict[str, Any]], out: Path, command: str = "hvdc bench convergence") -> Path:
    """Write ``convergence.md`` and ``convergence.png`` in ``out`` from the runs."""
    rows = summarize(results)
    png = plot(rows, out / "convergence.png")
    tasks = sorted({r["task"] for r in rows}, key=list(TASKS).index)
    parts = ["# Convergence: what each method costs in accuracy", "",
             f"`{command}` — every method at its paper defaults (library defaults), with its default "
             "error feedback and, for biased methods, also without (`feedback=none`); "
             "mean ± standard deviation of the final test accuracy over seeds; bytes are sent per "
             "rank per step by the gradient exchange (the Ok-Topk paper's volume model), against a "
             "dense ring allreduce; wall time is one whole training run on this machine. Method "
             "definitions: `horovod_compress/tools/bench/convergence.py`; analysis: "
             "[the convergence section of the methods overview](../docs/methods/index.md#accuracy-convergence-study).",
             "", f"![accuracy against bytes]({png.name})", ""]
    for task in tasks:
        r0 = next(r for r in rows if r["task"] == task)
        parts += [f"## digits {task.upper()} ({r0['num_params']} parameters, {r0['world_size']} ranks, "
                  f"{r0['epochs']} epochs, {r0['n']} seed(s))", "", format_table(rows, task), ""]
    parts += ["The last column compares the difference to dense with the one the paper reports for "
              "the corresponding method at its scale (± the spread the paper reports on it, where it "
              "does): *within* when the two differences agree to within their spreads added (the "
              "standard deviations over seeds of the method and of dense, ours and the paper's; the "
              "± in parentheses), *better* when ours loses less accuracy than that, *outside* when "
              "it loses more. Methods no paper table covers have no entry.", ""]
    outside = []
    for task in tasks:
        dense = next((r for r in rows if r["task"] == task and r["method"] == "none"), None)
        for r in rows:
            c = compare_with_paper(r, dense) if r["task"] == task else None
            if c is not None and c["verdict"] == "outside":
                outside.append((r, c))
    if outside:
        parts += ["## Outside the paper's spread", "",
                  "These lose more accuracy against dense than the paper's method did, by more than "
                  "the spreads; why is discussed in [the analysis of the methods overview]"
                  "(../docs/methods/index.md#accuracy-convergence-study):", ""]
        parts += [f"- digits {r['task'].upper()}, `{r['method']}` with feedback {r['feedback']}: "
                  f"{c['ours']:+.2f} points against the paper's {c['paper']:+.2f} "
                  f"(± {c['tolerance']:.2f}; {c['source']})" for r, c in outside]
        parts.append("")
    md = out / "convergence.md"
    md.write_text("\n".join(parts))
    return md
