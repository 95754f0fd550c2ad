"""``hvdc bench deepreduce``: the DeepReduce paper's data-volume comparison (Figure 10).

For Top-k at 1 % of real gradients, every index codec, every value codec and
their combinations encode the sparse tensor into a container; we report its
bytes relative to the raw (index, value) pairs (8 bytes per selected entry),
split into header / index / permutation / value, the reconstruction error and
the encode/decode time (median of ``--repeats``; ratios to raw/raw measured in
the same run).

Real gradients: a small CNN and the digits MLP (:mod:`.digits`) trained with
plain SGD on scikit-learn's digits (real data, no download); gradients are
taken at a few points of training. The CNN's third convolution has
64 x 64 x 3 x 3 = 36 864 weights, the size of the ResNet-20 convolution the
paper's Figure 10 uses.

Writes ``benchmarks/deepreduce.md`` (tables), ``benchmarks/deepreduce.json``
(raw numbers) and ``benchmarks/deepreduce.png`` (stacked bars).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

INDEX_ONLY = ["raw", "bitmap", "rle", "huffman", "bloom-naive", "bloom-p0", "bloom-p1", "bloom-p2"]
VALUE_ONLY = ["deflate", "qsgd", "polyfit", "dexp"]
COMBOS = [("huffman", "qsgd"), ("huffman", "polyfit"), ("rle", "qsgd"),
          ("bloom-p0", "deflate"), ("bloom-p0", "qsgd"), ("bloom-p0", "polyfit"),
          ("bloom-p0", "dexp"), ("bloom-p2", "deflate"), ("bloom-p2", "qsgd"),
          ("bloom-p2", "polyfit"), ("bloom-p2", "dexp")]


def collect_gradients(checkpoints: tuple[int, ...] = (10, 100, 300), seed: int = 0
                      ) -> list[tuple[str, np.ndarray]]:
    """Gradients of a digits CNN's conv3 (36 864) and of the digits MLP (26 122, fused)."""
    import torch

    from .digits import load_digits_split, make_mlp
    torch.set_num_threads(1)
    data = load_digits_split(seed)
    x_all = torch.from_numpy(data.x_train)
    y_all = torch.from_numpy(data.y_train)
    torch.manual_seed(seed)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    mlp = make_mlp(128, seed)
    out: list[tuple[str, np.ndarray]] = []
    for label, model, shape in (("cnn.conv3", cnn, (-1, 1, 8, 8)), ("mlp", mlp, (-1, 64))):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(seed)
        for step in range(max(checkpoints) + 1):
            idx = torch.randint(0, len(y_all), (64,), generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_all[idx].reshape(shape)), y_all[idx])
            loss.backward()
            if step in checkpoints:
                if label == "mlp":
                    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                else:
                    g = model[4].weight.grad.reshape(-1)
                out.append((f"{label}@{step}", g.detach().numpy().astype(np.float32).copy()))
            opt.step()
    return out


def _codec_pair(index: str, value: str, fpr: float, fit_tol: float) -> tuple[Any, Any]:
    from ... import codecs  # noqa: F401 - registers the codecs
    if index.startswith("bloom-"):
        ic = codecs.make_index_codec("bloom", fpr=fpr, policy=index.split("-", 1)[1])
    else:
        ic = codecs.make_index_codec(index)
    vparams = {"polyfit": {"tol": fit_tol}, "dexp": {"tol": fit_tol}}.get(value, {})
    return ic, codecs.make_value_codec(value, **vparams)


def measure(grads: list[tuple[str, np.ndarray]], index: str, value: str, density: float,
            fpr: float, fit_tol: float, repeats: int) -> dict[str, Any]:
    """Sum of bytes over ``grads`` by section, mean errors, median encode/decode seconds."""
    from ... import codecs  # noqa: F401 - registers the codecs
    from ...compressors.sparse_common import k_from_density, topk_indices
    ic, vc = _codec_pair(index, value, fpr, fit_tol)
    totals = {"header": 0, "index": 0, "permutation": 0, "value": 0}
    pairs = dense_bytes = 0
    err_sparse, err_dense, err_topk = [], [], []
    enc_t, dec_t = [], []
    for gi, (_, g) in enumerate(grads):
        n = g.size
        k = k_from_density("topk", density, n)
        support = np.sort(topk_indices(g, k)).astype(np.int64)
        sparse = np.zeros_like(g)
        sparse[support] = g[support]
        enc = codecs.encode(support, g, (n,), ic, vc, seed=1000 + gi)   # warm-up and result
        dec = codecs.decode(enc.data, (n,))
        for key in totals:
            totals[key] += enc.section_bytes[key]
        pairs += 8 * k
        dense_bytes += 4 * n
        out = dec.to_dense().astype(np.float64)
        err_sparse.append(float(np.linalg.norm(out - sparse) / np.linalg.norm(sparse)))
        err_dense.append(float(np.linalg.norm(out - g) / np.linalg.norm(g)))
        err_topk.append(float(np.linalg.norm(sparse - g) / np.linalg.norm(g)))
        e_runs, d_runs = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            enc = codecs.encode(support, g, (n,), ic, vc, seed=1000 + gi)
            t1 = time.perf_counter()
            codecs.decode(enc.data, (n,))
            t2 = time.perf_counter()
            e_runs.append(t1 - t0)
            d_runs.append(t2 - t1)
        enc_t.append(statistics.median(e_runs))
        dec_t.append(statistics.median(d_runs))
    total = sum(totals.values())
    return {"index": index, "value": value, "bytes": total, "pairs_bytes": pairs,
            "dense_bytes": dense_bytes, "rel_pairs": total / pairs, "rel_dense": total / dense_bytes,
            **{f"rel_{k}": v / pairs for k, v in totals.items()},
            "err_vs_topk": float(np.mean(err_sparse)), "err_vs_dense": float(np.mean(err_dense)),
            "topk_err_vs_dense": float(np.mean(err_topk)),
            "encode_ms": 1e3 * float(np.mean(enc_t)), "decode_ms": 1e3 * float(np.mean(dec_t))}


def fpr_sweep(grads: list[tuple[str, np.ndarray]], density: float, fit_tol: float,
              repeats: int) -> list[dict[str, Any]]:
    rows = []
    for fpr in (0.1, 0.01, 0.001, 0.0001):
        for policy in ("bloom-p0", "bloom-p2"):
            row = measure(grads, policy, "raw", density, fpr, fit_tol, repeats)
            row["fpr"] = fpr
            rows.append(row)
    return rows


def index_bytes_per_entry(grads: list[tuple[str, np.ndarray]], density: float,
                          fpr: float) -> list[dict[str, Any]]:
    """Index-section bytes per selected entry, per gradient, plus an i.i.d. Gaussian vector.

    Clustered supports (consecutive or nearby indices) favour RLE and Huffman
    of gaps; the Bloom filter's size depends only on r and fpr.
    """
    from ... import codecs  # noqa: F401 - registers the codecs
    from ...compressors.sparse_common import k_from_density, topk_indices
    rng = np.random.default_rng(0)
    cases = list(grads) + [("iid-gaussian", rng.standard_normal(36864).astype(np.float32))]
    rows = []
    for name, g in cases:
        k = k_from_density("topk", density, g.size)
        support = np.sort(topk_indices(g, k)).astype(np.int64)
        gaps = np.diff(support)
        row: dict[str, Any] = {"gradient": name, "n": int(g.size), "k": int(k),
                               "consecutive": float(np.mean(gaps == 1)) if gaps.size else 0.0}
        for index in ("raw", "bitmap", "rle", "huffman", "bloom-p2"):
            ic, _ = _codec_pair(index, "raw", fpr, 0.01)
            row[index] = len(ic.encode(support, g.size, 7).payload) / k
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]], base: dict[str, Any], with_fpr: bool = False) -> str:
    head = ("| index | value | " + ("fpr | " if with_fpr else "") +
            "bytes / raw pairs | index | perm. | value | header | bytes / dense | "
            "err vs Top-k | err vs g | encode ms | decode ms | enc+dec vs raw |")
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep]
    base_t = base["encode_ms"] + base["decode_ms"]
    for r in rows:
        lines.append(
            f"| {r['index']} | {r['value']} | " + (f"{r['fpr']:g} | " if with_fpr else "") +
            f"**{r['rel_pairs']:.3f}** | {r['rel_index']:.3f} | {r['rel_permutation']:.3f} | "
            f"{r['rel_value']:.3f} | {r['rel_header']:.3f} | {r['rel_dense']:.4f} | "
            f"{r['err_vs_topk']:.4f} | {r['err_vs_dense']:.4f} | {r['encode_ms']:.2f} | "
            f"{r['decode_ms']:.2f} | {(r['encode_ms'] + r['decode_ms']) / base_t:.1f}x |")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['index']} + {r['value']}" for r in rows]
    y = np.arange(len(rows))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 0.32 * len(rows) + 1.8),
                                  gridspec_kw={"width_ratios": [3, 2]})
    left = np.zeros(len(rows))
    for key, color in (("rel_index", "#4477aa"), ("rel_permutation", "#66ccee"),
                       ("rel_value", "#ee6677"), ("rel_header", "#bbbbbb")):
        vals = np.array([r[key] for r in rows])
        ax.barh(y, vals, left=left, color=color, label=key[4:])
        left += vals
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("bytes relative to raw (index, value) pairs of Top-k")
    ax.legend(fontsize=8, loc="lower right")
    err = np.array([max(r["err_vs_topk"], 1e-5) for r in rows])
    ax2.barh(y, err, color="#228833")
    ax2.set_xscale("log")
    ax2.set_yticks(y, [""] * len(rows))
    ax2.invert_yaxis()
    ax2.set_xlabel("relative error vs the Top-k tensor (log; 1e-5 = exact)")
    fig.suptitle("DeepReduce codecs on Top-k (1%) of real gradients (digits CNN conv3, MLP)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = (10, 100) if args.quick else (10, 100, 300)
    grads = collect_gradients(checkpoints)
    kw = dict(density=args.density, fpr=args.fpr, fit_tol=args.fit_tol, repeats=args.repeats)
    base = measure(grads, "raw", "raw", **kw)
    index_rows = [base] + [measure(grads, i, "raw", **kw) for i in INDEX_ONLY[1:]]
    value_rows = [measure(grads, "raw", v, **kw) for v in VALUE_ONLY]
    combo_rows = [measure(grads, i, v, **kw) for i, v in COMBOS]
    sweep = fpr_sweep(grads, args.density, args.fit_tol, max(1, args.repeats // 2))
    per_grad = index_bytes_per_entry(grads, args.density, args.fpr)
    result = {"args": vars(args) | {"func": None},
              "gradients": [(name, int(g.size)) for name, g in grads],
              "machine": f"{platform.machine()} {platform.processor() or ''} python {platform.python_version()}",
              "index": index_rows, "value": value_rows, "combinations": combo_rows, "fpr_sweep": sweep,
              "index_bytes_per_entry": per_grad}
    (out / "deepreduce.json").write_text(json.dumps(result, indent=1))
    _plot(index_rows + value_rows + combo_rows, out / "deepreduce.png")
    grad_list = ", ".join(f"{n} ({s})" for n, s in result["gradients"])
    md = [
        "# DeepReduce: data volume of index and value codecs (Top-k, real gradients)",
        "",
        f"Command: `hvdc bench deepreduce --density {args.density} --fpr {args.fpr} "
        f"--fit-tol {args.fit_tol} --repeats {args.repeats}{' --quick' if args.quick else ''}`  ",
        f"Machine: {result['machine']} (shared; times are medians, compare them as ratios).  ",
        f"Gradients (real data, scikit-learn digits, plain SGD): {grad_list}; Top-k keeps "
        f"{args.density:.0%} of each.",
        "",
        "Columns: container bytes relative to the raw (index, value) pairs (8 bytes per selected "
        "entry; the paper's baseline), split into index, permutation (value order for curve fits), "
        "value and header bytes; relative to the dense float32 gradient; relative L2 error of "
        "the decoded tensor against the Top-k tensor and against the dense gradient g (Top-k "
        f"alone: {base['topk_err_vs_dense']:.4f}); encode and decode time per tensor.",
        "Bloom policies send dense-gradient values at the chosen false positives (GRACE's "
        "choice, the method's default `fp_values=\"dense\"`), so P0's error against Top-k is "
        "the extra true gradient it carries, and its error against g is below Top-k's.",
        "",
        "## Index codecs (raw values)", "", _table(index_rows, base), "",
        "## Value codecs (raw indices; raw indices carry the value order, no permutation)", "",
        _table(value_rows, base), "",
        "## Combinations", "", _table(combo_rows, base), "",
        f"## Bloom filter: false-positive rate (raw values, Top-k {args.density:.0%})", "",
        _table(sweep, base, with_fpr=True), "",
        "## Index bytes per selected entry, per gradient", "",
        "Real gradients' Top-k entries cluster (whole rows of a layer, neighbouring weights), "
        "which RLE and Huffman-coded gaps exploit. Even on a scattered support (an i.i.d. "
        "Gaussian vector) Huffman-coded gaps come close to log2(e n / k) bits per index, the "
        "size of an arbitrary k-subset (about 1 byte at 1 %), below the Bloom filter's "
        "1.44 log2(1/fpr) bits (1.8 bytes at fpr 0.001), which is also lossy. The paper "
        "compares the Bloom filter with 32-bit keys, where it does halve the index volume.", "",
        "| gradient | n | k | consecutive gaps | raw | bitmap | rle | huffman | bloom (p2) |",
        "|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['gradient']} | {r['n']} | {r['k']} | {r['consecutive']:.2f} | {r['raw']:.2f} | "
          f"{r['bitmap']:.2f} | {r['rle']:.2f} | {r['huffman']:.2f} | {r['bloom-p2']:.2f} |"
          for r in per_grad], "",
        "![DeepReduce volume](deepreduce.png)", "",
    ]
    (out / "deepreduce.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


def register_bench(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "deepreduce", help="DeepReduce: bytes of index/value codecs on Top-k of real gradients",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--density", type=float, default=0.01, help="Top-k density (default 0.01)")
    p.add_argument("--fpr", type=float, default=0.001, help="Bloom false-positive rate (0.001)")
    p.add_argument("--fit-tol", type=float, default=0.01,
                   help="curve-fit error bound, relative to max |value| (0.01)")
    p.add_argument("--repeats", type=int, default=5, help="timing repetitions (median)")
    p.add_argument("--quick", action="store_true", help="fewer gradients")
    p.add_argument("--out", default="benchmarks", help="output folder (benchmarks/)")
    p.set_defaults(func=run)
