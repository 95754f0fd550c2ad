"""``hvdc model``: predict step time, speedup and break-even bandwidth on your network.

Takes step profiles (CPU time of compute and compression, bytes and calls per
collective) and the alpha-beta model of horovod_compress.cost_model:

    hvdc model                                   # 1 GbE, the shipped reference profiles
    hvdc model --network 10gbe --ranks 4 64 1024
    hvdc model --profile my_profile.json --network 25gbe --ranks 16   # from hvdc profile
    hvdc model --profile benchmarks/e2e.json --run 4:1gbit            # from hvdc bench e2e
    hvdc model --latency 2us --bandwidth 25gbit  # your own network

Presets: shm, 1gbe, 10gbe, 25gbe, 100gbe, ib100, aries (typical published
figures; see hvdc model --list). Without --profile the reference profiles
shipped with the package are used: the Transformer of hvdc bench e2e on a
2-core CPU machine. Beside each method the table shows what it cost in
accuracy in the convergence study, the method the stated rule recommends
(the fastest within --accuracy-budget points; see docs/choosing.md), and a
warning for each method that needs another learning rate than dense.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from ...compressors.registry import available
from ...cost_model import PRESETS, break_even_bandwidth, network_from, predict, speedup
from . import advice
from .e2e import profile_of


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="alpha-beta model: step time, speedup, break-even bandwidth per method",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", "--profiles", dest="profiles", default=None,
                   help="a profile written by 'hvdc profile' or 'hvdc bench e2e' (default: the "
                        "reference profiles shipped with the package)")
    p.add_argument("--run", default=None, help="which measurement of the file: 'P:bandwidth', e.g. 4:1gbit "
                                               "(default: the largest P, at 1gbit if measured)")
    p.add_argument("--network", default=None, help=f"preset: {', '.join(PRESETS)} (default 1gbe)")
    p.add_argument("--latency", default=None, help="alpha, e.g. 5us (overrides the preset's)")
    p.add_argument("--bandwidth", default=None, help="link rate, e.g. 25gbit (overrides the preset's)")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="P values for the table")
    p.add_argument("--accuracy", default=None,
                   help="convergence JSON of 'hvdc bench convergence' (default: the shipped summary)")
    p.add_argument("--accuracy-budget", type=float, default=advice.ACCURACY_BUDGET,
                   help="points of test accuracy a recommended method may lose (default %(default)s)")
    p.add_argument("--plot", default=None, help="write speedup against P (2..1024) to this PNG")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")
    p.add_argument("--list", action="store_true", help="list the network presets and exit")
    p.set_defaults(func=run)


def load_profiles(path: str | None, which: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run, {label: StepProfile}) from an e2e or profile JSON (default: the shipped reference);
    ``which`` = 'P:bandwidth'."""
    file = Path(path) if path else advice.reference_file(advice.REFERENCE_PROFILES)
    if not file.exists():
        raise ValueError(f"{path} not found: write one with `hvdc profile` (your model) or "
                         f"`hvdc bench e2e` (the emulated cluster), or leave out --profile")
    runs = json.loads(file.read_text()).get("runs")
    if not runs:
        raise ValueError(f"{file} holds no runs")
    if which:
        p, _, bw = which.partition(":")
        matches = [r for r in runs if str(r["world_size"]) == p and (not bw or r["bandwidth"] == bw)]
        if not matches:
            raise ValueError(f"no run {which!r} in {file}; it has "
                             f"{sorted({(r['world_size'], r['bandwidth']) for r in runs})}")
        run = matches[0]
    else:
        top = [r for r in runs if r["world_size"] == max(r["world_size"] for r in runs)]
        run = next((r for r in top if r["bandwidth"] == "1gbit"), top[0])
    return run, profiles_of_run(run)


def profiles_of_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """{label: StepProfile} of one run's methods, with one forward and backward pass for all."""
    order = available()
    labels = sorted((label for label, m in run["methods"].items() if "error" not in m),
                    key=lambda label: (order.index(label.split("(")[0]) if label.split("(")[0] in order
                                       else len(order), label))
    profiles = {label: profile_of(label, run["methods"][label], run["world_size"]) for label in labels}
    if "none" not in profiles:
        raise ValueError("the measurement has no dense ('none') profile to compare with")
    return common_forward_backward(profiles)


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
    costs = advice.load_accuracy(args.accuracy)
    ranks = args.ranks or [run_["world_size"]]
    where = args.profiles or "the reference profiles"
    source = (f"{where}, measured at P={run_['world_size']} {run_['bandwidth']}, "
              f"model {run_.get('model')}" + (f" on {run_['device']}" if run_.get("device") else ""))
    text = render(profiles, net, ranks, source, costs, args.accuracy_budget)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"table: {args.out}")
    if args.plot:
        plot_scaling(profiles, net, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def render(profiles: dict[str, Any], net: Any, ranks: list[int], source: str,
           costs: Mapping[str, advice.AccuracyCost] | None = None,
           budget: float = advice.ACCURACY_BUDGET) -> str:
    """Markdown: predicted step time, speedup and break-even bandwidth per method and P, each
    method's accuracy cost, the recommended method per P and the learning-rate warnings."""
    costs = costs or {}
    dense = profiles["none"]
    lines = [f"Network: {net.name} (alpha {net.alpha * 1e6:.2f} us, {net.bandwidth / 1e9:g} Gbit/s); "
             f"profiles from {source}. Break-even: the bandwidth below which the method's step is faster "
             f"than dense. Accuracy: points against dense in the convergence study.", "",
             "| method | accuracy (pts) | " + " | ".join(f"P={p}: step s (speedup), break-even" for p in ranks)
             + " |",
             "|---|---:|" + "---:|" * len(ranks)]
    speeds: dict[int, dict[str, float]] = {p: {} for p in ranks}
    for label, prof in profiles.items():
        cells = []
        for p in ranks:
            pr = predict(prof, net, p)
            be = "-" if label == "none" else _bw(break_even_bandwidth(prof, dense, net, p))
            speeds[p][label] = speedup(prof, dense, net, p)
            cells.append(f"{pr.step_s:.3f} ({speeds[p][label]:.2f}x), {be}")
        cost = advice.cost_of(label, costs)
        acc = "n/a" if cost is None else f"{cost.points:+.2f}" + (" (!)" if cost.needs_other_learning_rate else "")
        lines.append(f"| {label} | {acc} | " + " | ".join(cells) + " |")
    if costs:
        picks = ", ".join(f"P={p}: {advice.recommend(speeds[p], costs, budget)}" for p in ranks)
        lines += ["", f"Recommended (fastest within {budget:g} point(s) of dense's accuracy): {picks}"]
        warnings = advice.warnings_for(profiles, costs)
        if warnings:
            lines += ["", "Warnings:", *[f"- (!) {w}" for w in warnings]]
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
