"""``hvdc model``: predict step time, speedup and break-even bandwidth on your network.

Takes each method's measured step profile from ``hvdc bench e2e``'s JSON
(CPU time of compute and compression, bytes and calls per collective) and the
alpha-beta model of :mod:`horovod_compress.cost_model`:

    hvdc model                                   # 1 GbE, P of the measurement
    hvdc model --network 10gbe --ranks 4 64 1024
    hvdc model --network aries --plot benchmarks/model_aries.png
    hvdc model --latency 2us --bandwidth 25gbit  # your own network

Presets: shm, 1gbe, 10gbe, 100gbe, ib100, aries (typical published figures;
see ``hvdc model --list``). Compression and compute times are the ones
measured on the machine that ran the benchmark (one core per rank).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..cost_model import PRESETS, break_even_bandwidth, network_from, predict, speedup


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="alpha-beta model: step time, speedup, break-even bandwidth per method",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profiles", default="benchmarks/e2e.json", help="JSON written by hvdc bench e2e")
    p.add_argument("--run", default=None, help="which measurement: 'P:bandwidth', e.g. 4:1gbit "
                                               "(default: the largest P, at 1gbit if measured)")
    p.add_argument("--network", default=None, help=f"preset: {', '.join(PRESETS)} (default 1gbe)")
    p.add_argument("--latency", default=None, help="alpha, e.g. 5us (overrides the preset's)")
    p.add_argument("--bandwidth", default=None, help="link rate, e.g. 25gbit (overrides the preset's)")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="P values for the table")
    p.add_argument("--plot", default=None, help="write speedup against P (2..1024) to this PNG")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")
    p.add_argument("--list", action="store_true", help="list the network presets and exit")
    p.set_defaults(func=run)


def load_profiles(path: str, which: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run, {label: StepProfile}) from an e2e JSON; ``which`` = 'P:bandwidth'."""
    from .e2e import profile_of
    file = Path(path)
    if not file.exists():
        raise ValueError(f"{path} not found: run `hvdc bench e2e` first (or pass --profiles)")
    runs = json.loads(file.read_text())["runs"]
    if not runs:
        raise ValueError(f"{path} holds no runs")
    if which:
        p, _, bw = which.partition(":")
        matches = [r for r in runs if str(r["world_size"]) == p and (not bw or r["bandwidth"] == bw)]
        if not matches:
            raise ValueError(f"no run {which!r} in {path}; it has "
                             f"{sorted({(r['world_size'], r['bandwidth']) for r in runs})}")
        run = matches[0]
    else:
        top = [r for r in runs if r["world_size"] == max(r["world_size"] for r in runs)]
        run = next((r for r in top if r["bandwidth"] == "1gbit"), top[0])
    profiles = {label: profile_of(label, m, run["world_size"]) for label, m in run["methods"].items()
                if "error" not in m}
    if "none" not in profiles:
        raise ValueError("the measurement has no dense ('none') profile to compare with")
    return run, common_forward_backward(profiles)


def common_forward_backward(profiles: dict[str, Any]) -> dict[str, Any]:
    """The profiles with one forward and backward CPU time for all: the median of theirs.

    Every method trains the same model on the same batches, so the methods'
    measured forward and backward passes differ only by the machine's noise
    (23-30 ms between two methods' medians on this testbed, as much as the
    gap between two methods' exchanges); a prediction that kept each
    method's own would rank methods by that noise, and a method whose pass
    happened to run faster than dense's would "win at any bandwidth".
    """
    compute = statistics.median(prof.compute_s for prof in profiles.values())
    return {label: replace(prof, compute_s=compute) for label, prof in profiles.items()}


def _bw(bits: float) -> str:
    if math.isinf(bits):
        return "any"
    if bits <= 0:
        return "never"
    return f"{bits / 1e9:.3g} Gbit/s"


def run(args: argparse.Namespace) -> int:
    if args.list:
        for key, net in PRESETS.items():
            print(f"{key:8s} {net.name:20s} alpha {net.alpha * 1e6:6.2f} us  {net.bandwidth / 1e9:6.1f} Gbit/s  "
                  f"{net.note}")
        return 0
    net = network_from(args.network, args.latency, args.bandwidth)
    run_, profiles = load_profiles(args.profiles, args.run)
    ranks = args.ranks or [run_["world_size"]]
    text = render(profiles, net, ranks, f"{args.profiles}, measured at P={run_['world_size']} "
                                        f"{run_['bandwidth']}, model {run_.get('model')}")
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"table: {args.out}")
    if args.plot:
        plot_scaling(profiles, net, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def render(profiles: dict[str, Any], net: Any, ranks: list[int], source: str) -> str:
    """Markdown: predicted step time, speedup and break-even bandwidth per method and P."""
    dense = profiles["none"]
    lines = [f"Network: {net.name} (alpha {net.alpha * 1e6:.2f} us, {net.bandwidth / 1e9:g} Gbit/s); "
             f"profiles from {source}. Break-even: the bandwidth below which the method's step is faster "
             f"than dense.", "",
             "| method | " + " | ".join(f"P={p}: step s (speedup), break-even" for p in ranks) + " |",
             "|---|" + "---:|" * len(ranks)]
    for label, prof in profiles.items():
        cells = []
        for p in ranks:
            pr = predict(prof, net, p)
            be = "-" if label == "none" else _bw(break_even_bandwidth(prof, dense, net, p))
            cells.append(f"{pr.step_s:.3f} ({speedup(prof, dense, net, p):.2f}x), {be}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_scaling(profiles: dict[str, Any], net: Any, path: Path, max_p: int = 1024) -> None:
    """Predicted speedup over dense against P = 2 .. ``max_p`` on ``net``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ps = [2 ** i for i in range(1, int(math.log2(max_p)) + 1)]
    dense = profiles["none"]
    from .plotting import method_style, speedup_axes
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, prof) in enumerate(profiles.items()):
        ax.plot(ps, [speedup(prof, dense, net, p) for p in ps], label=label, **method_style(i))
    speedup_axes(ax, "ranks P", "predicted step speedup over dense", f"alpha-beta model on {net.name}",
                 log_base_x=2)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
