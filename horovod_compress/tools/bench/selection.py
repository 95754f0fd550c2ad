"""``hvdc bench selection`` -- top-k selection by a reused threshold vs ``torch.topk``.

Ok-Topk's key speed trick (paper Section 3.1.3): compute the exact k-th
largest |x| once every ``tau'`` steps, and in between select by comparing
with it -- one pass, no sort. This benchmark times, in one run on one
gradient-like vector (default 25M float32 entries, density 1%):

* ``select_by_threshold`` with a reused threshold (the Ok-Topk step),
* ``torch.topk(|x|, k)`` (what TopkA/TopkDSA/gTopk and the reference code use),
* ``kth_largest_abs`` (the exact re-evaluation, radix select),
* ``np.argpartition(|x|, n-k)`` (NumPy's introselect) for scale,

and reports the median of ``--repeats`` runs and the speed-up of the reused
threshold over ``torch.topk``. Writes ``<out>.md`` and ``<out>.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (JIT compilation, allocator)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gradient_like(n: int, seed: int) -> np.ndarray:
    """Heavy-tailed, mostly small values like a gradient: Laplace with a lognormal scale."""
    rng = np.random.default_rng(seed)
    return (rng.laplace(size=n) * np.exp(rng.normal(0.0, 0.5, size=n))).astype(np.float32)


def run(args: argparse.Namespace) -> int:
    import torch

    from ...kernels.selection import kth_largest_abs, select_by_threshold

    x = gradient_like(args.n, args.seed)
    k = max(1, int(round(args.density * args.n)))
    xt = torch.from_numpy(x)
    th = kth_largest_abs(x, k)
    # a threshold reused from an earlier step selects about k, not exactly k: emulate it
    reused = th * 1.01
    selected = select_by_threshold(x, reused)[0].size
    timings = {
        "select_by_threshold (reused threshold)": _median_seconds(
            lambda: select_by_threshold(x, reused), args.repeats),
        "torch.topk(abs(x), k)": _median_seconds(lambda: torch.topk(xt.abs(), k, sorted=False),
                                              args.repeats),
        "kth_largest_abs (exact, radix select)": _median_seconds(
            lambda: kth_largest_abs(x, k), args.repeats),
        "np.argpartition(abs(x), n-k)": _median_seconds(
            lambda: np.argpartition(np.abs(x), args.n - k), max(1, args.repeats // 2)),
    }
    base = timings["torch.topk(abs(x), k)"]
    ratio = base / timings["select_by_threshold (reused threshold)"]
    lines = [
        f"# Top-k selection: reused threshold vs torch.topk (n = {args.n:,}, density = {args.density}, "
        f"k = {k:,})",
        "",
        f"`hvdc bench selection --n {args.n} --density {args.density} --repeats {args.repeats}`, "
        f"median of {args.repeats} runs after one warm-up, float32 on CPU "
        f"(torch threads: {torch.get_num_threads()}). The reused threshold is the exact k-th "
        f"largest |x| times 1.01 (selects {selected:,} entries).",
        "",
        "| selection | seconds | vs torch.topk |",
        "|---|---|---|",
    ]
    for label, sec in timings.items():
        lines.append(f"| {label} | {sec:.4f} | {base / sec:.1f}x |")
    lines += ["", f"Reused-threshold selection is **{ratio:.1f}x** faster than torch.topk."]
    report = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report)
    out.with_suffix(".json").write_text(json.dumps({"n": args.n, "k": k, "density": args.density,
                                                    "seconds": timings, "speedup": ratio,
                                                    "torch_threads": torch.get_num_threads()},
                                                   indent=1))
    print(report)
    return 0


def register_bench(subparsers: Any) -> None:
    p = subparsers.add_parser("selection", help="top-k selection by a reused threshold vs torch.topk "
                                                "(Ok-Topk Section 3.1.3)")
    p.add_argument("--n", type=int, default=25_000_000)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/selection")
    p.set_defaults(func=run)
