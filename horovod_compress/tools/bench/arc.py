"""``hvdc bench arc``: ARC-Top-K's compression error and volume on real gradients.

A CNN on scikit-learn's digits (conv 1->32->64, fc 1024->512->256->10,
0.68 M parameters) is trained with dense SGD on P ranks; every ``--every``
steps each rank's own minibatch gradient of every weight tensor is compressed
by each method (feedback off, so the compressor itself is measured) and
compared with the exact average g = avg_i g_i:

    relative error = ||C(g) - g||^2 / ||g||^2     (Definition 1 of the paper)

Methods, per tensor, at *equal volume* -- every method moves the bytes per
rank that ARC-Top-K moves, 2B(P-1)/P words with B = m r + K n and
K = ceil(ratio * m) (see :func:`equal_volume_methods`):

* ARC-Top-K (``arc_topk``: sketch m x r + K rows, two allreduces);
* Top-K rows, local and averaged (``topk_rows``, floor(2B / (P(n+1))) rows +
  indices, allgather) -- the paper's Top-K;
* Rand-K rows (``randk_rows``, round(B / n) shared rows, allreduce);
* element-wise local Top-K averaged (``topk``, B/P (index, value) pairs,
  allgather) and shared Rand-K (``randk``, B values, allreduce);
* for reference, the best K rows of g itself (needs g, i.e. a dense allreduce)
  and the Rand-K-rows expectation at equal K, 1 - K/m (Proposition 2's bound).

``--split iid`` gives every rank a random shard; ``--split label`` sorts the
training set by label first, so ranks see different classes and their
gradients disagree (the regime of the paper's Proposition 1).

Bytes per step (all weight tensors, one call each) are measured with the
Communicator and compared with 2 (K n + m r)(P-1)/P words (exact ring
allreduce model) and the paper's 2Kn + 2mr (its P -> infinity limit).
Finally the row kernels (gather + scatter) are timed on each layer's shape:
the NumPy functions of :mod:`horovod_compress.kernels.rows` that the methods
use against bounds-checked ``@njit`` loops (the alternative that was not taken).

Writes ``arc.md``, ``arc.json`` and ``arc.png`` into ``--out`` (benchmarks/).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .launch import relaunch, under_mpi_launcher
from .machine import platform_summary
from .report_files import save_figure, write_report
from ...mpi_collectives.accounting import allreduce_volume

METHODS = ["arc_topk", "topk_rows", "randk_rows", "topk", "randk"]
LABELS = {"arc_topk": "ARC-Top-K", "topk_rows": "Top-K rows (local, avg)",
          "randk_rows": "Rand-K rows", "topk": "Top-K elem. (local, avg)",
          "randk": "Rand-K elem.", "oracle": "best K rows of g (dense)",
          "bound": "1 - K/m"}


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("arc", help="ARC-Top-K: compression error and bytes on real gradients",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--ratio", type=float, default=0.2, help="ARC-Top-K ratio mu (default 0.2)")
    p.add_argument("--rank", type=int, default=4, help="sketch rank r (default 4)")
    p.add_argument("--steps", type=int, default=101, help="dense training steps (default 101)")
    p.add_argument("--every", type=int, default=20, help="snapshot period in steps (default 20)")
    p.add_argument("--repeats", type=int, default=3,
                   help="compressions per snapshot (fresh sketch/rows each; default 3)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--split", default="iid,label", help="data splits: iid, label or both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks", help="folder for arc.md/json/png")
    p.set_defaults(func=run)


# --------------------------------------------------------------- workload
def make_cnn(seed: int) -> Any:
    """Conv(1,32,3) ReLU Conv(32,64,3) ReLU MaxPool2 | FC 1024-512-256-10 (0.68 M params)."""
    import torch
    from torch import nn
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def _shard(y: np.ndarray, rank: int, size: int, split: str) -> np.ndarray:
    if split == "iid":
        return np.arange(rank, len(y), size)
    order = np.argsort(y, kind="stable")                 # ranks see different classes
    return np.array_split(order, size)[rank]


def equal_volume_methods(shape: tuple[int, ...], ratio: float, rank: int, seed: int,
                         world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One instance per method for a tensor of ``shape``, all moving ARC-Top-K's bytes per rank.

    ARC-Top-K contributes B = m r + K n words to ring allreduces, which move
    2B(P-1)/P words per rank; so do Rand-K rows (round(B/n) rows) and Rand-K
    (B values). The allgather methods move (P-1) x their payload, so they get a
    payload of 2B/P words: floor(2B / (P (n+1))) rows + indices for Top-K
    rows, B/P (index, value) pairs for element-wise Top-K.
    """
    from ...compressors.registry import create
    arc = create("arc_topk", ratio=ratio, rank=rank, feedback="none", seed=seed)
    plan = arc.plan(shape)
    m, n = plan.m, plan.n
    if plan.dense:
        raise ValueError(f"shape {shape} is sent dense by ARC-Top-K; nothing to compare")
    b = plan.words
    b_gather = 2.0 * b / world_size if world_size > 1 else float(b)
    k_rand = min(m, max(1, round(b / n)))
    k_top = min(m, max(1, int(b_gather // (n + 1))))
    size = m * n
    methods = {
        "arc_topk": arc,
        "topk_rows": create("topk_rows", ratio=k_top / m, feedback="none"),
        "randk_rows": create("randk_rows", ratio=k_rand / m, feedback="none", seed=seed),
        "topk": create("topk", density=min(1.0, b_gather / 2 / size), feedback="none"),
        "randk": create("randk", density=min(1.0, b / size), feedback="none", seed=seed),
    }
    info = {"m": m, "n": n, "K": plan.k, "r": plan.r, "payload_words": b,
            "K_randk_rows": k_rand, "K_topk_rows": k_top, "k_topk": round(b_gather / 2),
            "k_randk": b}
    return methods, info


def measure(args: argparse.Namespace, comm: Any, split: str) -> dict[str, Any]:
    """Train densely, snapshot real per-rank gradients, compress them with every method."""
    import torch

    from ...kernels.rows import row_sq_norms
    from .digits import load_digits_split
    torch.set_num_threads(1)
    data = load_digits_split(args.seed)
    idx = _shard(data.y_train, comm.rank, comm.size, split)
    xs = torch.from_numpy(data.x_train[idx].reshape(-1, 1, 8, 8))
    ys = torch.from_numpy(data.y_train[idx])
    model = make_cnn(args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    weights = [(name, p) for name, p in model.named_parameters() if p.dim() >= 2]
    per_layer: dict[str, dict[str, Any]] = {}
    for name, p in weights:
        methods, info = equal_volume_methods(tuple(p.shape), args.ratio, args.rank,
                                             args.seed, comm.size)
        per_layer[name] = {"shape": list(p.shape), **info, "methods": methods,
                           "err": {k: [] for k in [*METHODS, "oracle"]},
                           "bytes": {k: 0.0 for k in METHODS}, "norm2": []}
    totals: dict[str, list[float]] = {k: [] for k in [*METHODS, "oracle"]}
    rng = np.random.default_rng([args.seed, comm.rank])
    snapshots = 0
    for step in range(args.steps):
        batch = torch.from_numpy(rng.choice(len(ys), size=args.batch_size, replace=False))
        opt.zero_grad()
        loss = loss_fn(model(xs[batch]), ys[batch])
        loss.backward()
        if step % args.every == 0:
            snapshots += 1
            for rep in range(args.repeats):
                sums = {k: 0.0 for k in totals}
                norm_sum = 0.0
                for name, p in weights:
                    entry = per_layer[name]
                    g_i = p.grad.detach().numpy().astype(np.float32)
                    g = comm.allreduce(g_i.astype(np.float64), op="avg")
                    n2 = float(np.sum(g * g))
                    norm_sum += n2
                    if rep == 0:
                        entry["norm2"].append(n2)
                    for label, method in entry["methods"].items():
                        comm.reset_stats()
                        c = method.allreduce(g_i, name, comm).astype(np.float64)
                        if rep == 0 and snapshots == 1:
                            entry["bytes"][label] = comm.bytes_sent
                        e = float(np.sum((c - g) ** 2))
                        entry["err"][label].append(e / n2)
                        sums[label] += e
                    row_n2 = np.sort(row_sq_norms(g.reshape(entry["m"], -1)))[::-1]
                    best = n2 - float(row_n2[:entry["K"]].sum())   # best K rows of g
                    entry["err"]["oracle"].append(best / n2)
                    sums["oracle"] += best
                for k in totals:
                    totals[k].append(sums[k] / norm_sum)
        for _name, p in model.named_parameters():       # dense data-parallel SGD step
            p.grad.copy_(torch.from_numpy(comm.allreduce(p.grad.numpy(), op="avg")))
        opt.step()
    for entry in per_layer.values():
        entry.pop("methods")
        entry["err_mean"] = {k: float(np.mean(v)) for k, v in entry["err"].items()}
        entry["err"] = {k: [float(x) for x in v] for k, v in entry["err"].items()}
        entry["bound"] = 1.0 - entry["K"] / entry["m"]
    return {"split": split, "final_loss": float(loss.detach()), "snapshots": snapshots,
            "layers": per_layer,
            "model_err_mean": {k: float(np.mean(v)) for k, v in totals.items()},
            "model_err": {k: [float(x) for x in v] for k, v in totals.items()}}


def volume_table(layers: dict[str, dict[str, Any]], p: int, itemsize: int = 4) -> dict[str, float]:
    """Measured bytes per step (all weight tensors) per method and the formulas."""
    out = {f"measured_{k}": float(sum(e["bytes"][k] for e in layers.values())) for k in METHODS}
    out["formula_arc_ring"] = float(sum(allreduce_volume((e["K"] * e["n"] + e["m"] * e["r"])
                                                         * itemsize, p) for e in layers.values()))
    out["paper_2Kn_2mr"] = float(sum((2 * e["K"] * e["n"] + 2 * e["m"] * e["r"]) * itemsize
                                     for e in layers.values()))
    out["dense_ring"] = float(sum(allreduce_volume(e["m"] * e["n"] * itemsize, p)
                                  for e in layers.values()))
    return out


# ----------------------------------------------------------- row kernels
def _numba_row_kernels() -> tuple[Any, Any]:
    """Bounds-checked ``@njit`` gather and scatter: the alternative kernels/rows.py measured."""
    from numba import njit

    @njit(nogil=True)
    def gather_nb(mat, rows):                            # pragma: no cover - compiled
        m, n = mat.shape
        out = np.empty((rows.size, n), mat.dtype)
        for i in range(rows.size):
            src = rows[i]
            if src < 0 or src >= m:
                raise ValueError("row index out of range")
            out[i, :] = mat[src, :]
        return out

    @njit(nogil=True)
    def scatter_nb(block, rows, m):                      # pragma: no cover - compiled
        out = np.empty((m, block.shape[1]), block.dtype)
        slot = np.full(m, -1, np.int64)
        for i in range(rows.size):
            r = rows[i]
            if r < 0 or r >= m:
                raise ValueError("row index out of range")
            slot[r] = i
        for r in range(m):                               # every element written once
            if slot[r] < 0:
                out[r, :] = 0
            else:
                out[r, :] = block[slot[r], :]
        return out

    return gather_nb, scatter_nb


def time_row_kernels(shapes: dict[str, tuple[int, int, int]], reps: int = 500) -> list[dict]:
    """Best-of-``reps`` time of gather + scatter of K rows of m x n: NumPy (used) vs Numba."""
    from ...kernels.rows import gather_rows, scatter_rows
    gather_nb, scatter_nb = _numba_row_kernels()

    def best(fn) -> float:
        fn()                                             # compile / warm caches outside timing
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    rows_out = []
    for name, (m, n, k) in shapes.items():
        rng = np.random.default_rng(0)
        mat = rng.standard_normal((m, n)).astype(np.float32)
        rows = np.sort(rng.choice(m, size=k, replace=False)).astype(np.int64)
        assert np.array_equal(scatter_nb(gather_nb(mat, rows), rows, m),
                              scatter_rows(gather_rows(mat, rows), rows, m))
        t_np = best(lambda: scatter_rows(gather_rows(mat, rows), rows, m))
        t_nb = best(lambda: scatter_nb(gather_nb(mat, rows), rows, m))
        rows_out.append({"layer": name, "m": m, "n": n, "K": k,
                         "numpy_us": t_np * 1e6, "numba_us": t_nb * 1e6})
    return rows_out


# ---------------------------------------------------------------- report
def _fmt(x: float) -> str:
    return f"{x:.3f}"


def format_report(res: dict[str, Any]) -> str:
    a = res["args"]
    lines = [
        "# ARC-Top-K on real gradients (`hvdc bench arc`)", "",
        f"Model: CNN on scikit-learn digits ({res['num_params']:,} parameters; conv kernels "
        f"viewed as (out, in*kh*kw)), {res['world_size']} MPI ranks, batch {a['batch_size']} "
        f"per rank, dense SGD for {a['steps']} steps; a snapshot of every rank's own gradient "
        f"every {a['every']} steps, {a['repeats']} compressions per snapshot (new sketch / "
        f"rows each). ratio mu = {a['ratio']}, sketch rank r = {a['rank']}, feedback off. "
        f"Machine: {res['machine']}; run took {res['seconds']:.0f} s.", "",
        "Relative error ||C(g) - g||^2 / ||g||^2 of the averaged gradient g (mean over "
        "snapshots and repeats), at equal volume: every method moves ARC-Top-K's bytes per rank "
        "(allreduce methods contribute B = m r + K n words, the allgather-based Top-K methods "
        "2B/P, since an allgather moves (P-1) x its payload); *best K rows of g* needs the "
        "dense average and is the floor "
        "for any K-row selection; 1 - K/m is Proposition 2's bound (= Rand-K rows' "
        "expectation at equal K).", ""]
    cols = [*METHODS, "oracle"]
    for split in res["splits"]:
        layers = split["layers"]
        lines += [f"## Split: {split['split']}"
                  + (" (ranks hold different classes)" if split["split"] == "label" else
                     " (random shards)"), "",
                  "| tensor | m x n | K | B words | " + " | ".join(LABELS[c] for c in cols)
                  + " | 1 - K/m |",
                  "|---|---|---:|---:|" + "---:|" * (len(cols) + 1)]
        for name, e in layers.items():
            lines.append(f"| {name} | {e['m']} x {e['n']} | {e['K']} | {e['payload_words']} | "
                         + " | ".join(_fmt(e["err_mean"][c]) for c in cols)
                         + f" | {_fmt(e['bound'])} |")
        tot = split["model_err_mean"]
        lines.append("| **all weights** | | | | " + " | ".join(f"**{_fmt(tot[c])}**" for c in cols)
                     + " | |")
        lines.append("")
    vol = res["volume"]
    p = res["world_size"]
    lines += ["## Bytes per rank per step (all weight tensors, one compressed allreduce each)", "",
              "| | bytes | vs dense |", "|---|---:|---:|"]
    dense = vol["dense_ring"]
    for k in METHODS:
        lines.append(f"| measured: {LABELS[k]} | {vol[f'measured_{k}']:,.0f} | "
                     f"{vol[f'measured_{k}'] / dense:.3f} |")
    lines += [f"| formula 2 (Kn + mr)(P-1)/P words, P = {p} | {vol['formula_arc_ring']:,.0f} | "
              f"{vol['formula_arc_ring'] / dense:.3f} |",
              f"| paper 2Kn + 2mr words (P -> inf) | {vol['paper_2Kn_2mr']:,.0f} | "
              f"{vol['paper_2Kn_2mr'] / dense:.3f} |",
              f"| dense ring allreduce 2mn(P-1)/P | {dense:,.0f} | 1.000 |", "",
              f"ARC-Top-K measured = formula exactly: **{vol['measured_arc_topk'] == vol['formula_arc_ring']}**"
              f" (= (P-1)/P x the paper's count). The allgather-based Top-K methods were given "
              f"a 2B/P-word payload to move the same bytes; at a fixed K their volume, "
              f"(P-1)(Kn + K) words for Top-K rows, grows with P, ARC-Top-K's does not.", "",
              "## Row kernels: gather + scatter of K rows (best of 500, this machine)", "",
              "| tensor | m x n | K | NumPy, used (us) | Numba @njit (us) | Numba / NumPy |",
              "|---|---|---:|---:|---:|---:|"]
    for k in res["kernels"]:
        lines.append(f"| {k['layer']} | {k['m']} x {k['n']} | {k['K']} | {k['numpy_us']:.1f} | "
                     f"{k['numba_us']:.1f} | {k['numba_us'] / k['numpy_us']:.2f} |")
    lines += ["", "Reproduce: `hvdc bench arc --np 4` (writes this file, arc.json and arc.png).", ""]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    splits = res["splits"]
    fig, axes = plt.subplots(1, len(splits), figsize=(6.5 * len(splits), 4.2), squeeze=False)
    cols = [*METHODS, "oracle"]
    for ax, split in zip(axes[0], splits):
        names = [*split["layers"], "all"]
        width = 0.8 / len(cols)
        for j, c in enumerate(cols):
            vals = [split["layers"][n]["err_mean"][c] for n in split["layers"]]
            vals.append(split["model_err_mean"][c])
            ax.bar(np.arange(len(names)) + (j - len(cols) / 2 + 0.5) * width, vals, width,
                   label=LABELS[c])
        ax.axhline(1 - res["args"]["ratio"], color="k", ls=":", lw=1, label="1 - mu")
        ax.set_xticks(np.arange(len(names)))
        ax.set_xticklabels([n.replace(".weight", "") for n in names], fontsize=8)
        ax.set_ylabel("||C(g) - g||² / ||g||²")
        ax.set_title(f"split: {split['split']}, P = {res['world_size']}, equal bytes per rank")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    if args.np > 1 and not under_mpi_launcher():
        return relaunch(args.np, "horovod_compress.tools.cli", sys.argv[1:])
    from ...mpi_collectives import Communicator
    comm = Communicator()
    t0 = time.perf_counter()
    splits = [s.strip() for s in args.split.split(",") if s.strip()]
    for s in splits:
        if s not in ("iid", "label"):
            raise SystemExit(f"--split must list iid and/or label, got {s!r}")
    results = [measure(args, comm, s) for s in splits]
    if comm.rank != 0:
        return 0
    layers = results[0]["layers"]
    shapes = {n: (e["m"], e["n"], e["K"]) for n, e in layers.items()}
    res = {"args": {k: v for k, v in vars(args).items() if k != "func"},
           "world_size": comm.size, "num_params": sum(
               int(np.prod(e["shape"])) for e in layers.values()) + _bias_count(args.seed),
           "machine": platform_summary(),
           "splits": results, "volume": volume_table(layers, comm.size),
           "kernels": time_row_kernels(shapes)}
    res["seconds"] = time.perf_counter() - t0
    write_report(Path(args.out), "arc", res, format_report, plot)
    return 0


def _bias_count(seed: int) -> int:
    model = make_cnn(seed)
    return sum(p.numel() for p in model.parameters() if p.dim() < 2)


__all__ = ["equal_volume_methods", "make_cnn", "measure", "register_bench", "run"]
