"""``hvdc timeline``: read a timeline file without a browser -- a Gantt chart and a table.

A timeline (``HOROVOD_TIMELINE=file.json``, ``hvdc bench e2e --timeline DIR``;
docs/timeline.md) is Chrome trace-event JSON: one process per rank, spans
with a category. Perfetto (https://ui.perfetto.dev) and ``chrome://tracing``
open it; where neither is at hand:

    hvdc timeline plot trace.json --out trace.png        # rank x phase Gantt chart
    hvdc timeline summary trace.json                     # milliseconds per rank and span name
    hvdc timeline summary trace.json --per-call oktopk   # the same per call (median over calls)
    hvdc timeline cost                                   # what a probe point costs, off and on

The chart gives every rank five lanes, top to bottom: the step (training
step, bucket, the method's call), the method's labelled phases, its local
work (compression, decompression, feedback), the collectives (MPI calls,
coloured by kind) and the waits (a request's wait, the per-call agreement
where a rank waits for late peers).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

#: Lanes of one rank in the chart: (label, categories drawn there).
LANES = (("step", ("step", "bucket", "method")), ("phase", ("phase",)),
         ("local work", ("compress", "decompress", "feedback")), ("MPI", ("mpi",)),
         ("wait", ("wait", "agree")))


def load_trace(path: str | Path) -> dict[str, Any]:
    """A trace file as written by the timeline (``{"traceEvents": [...]}``; a bare list is accepted)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not trace-event JSON (no traceEvents list)")
    return data


def spans_by_rank(trace: dict[str, Any], start_ms: float | None = None,
                  end_ms: float | None = None) -> dict[int, list[dict[str, Any]]]:
    """Complete events per process (rank), sorted by start; only those overlapping the window."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        t0, t1 = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
        if (start_ms is not None and t1 < start_ms) or (end_ms is not None and t0 > end_ms):
            continue
        out[int(e["pid"])].append(e)
    for evs in out.values():
        evs.sort(key=lambda e: e["ts"])
    return dict(sorted(out.items()))


def seconds_by_name(trace: dict[str, Any], start_ms: float | None = None,
                    end_ms: float | None = None) -> dict[int, dict[str, float]]:
    """Per rank: the seconds spent in each span name (``name [category]``), nested spans counted
    in their own name as well as in their parents'."""
    out: dict[int, dict[str, float]] = {}
    for rank, evs in spans_by_rank(trace, start_ms, end_ms).items():
        acc: dict[str, float] = defaultdict(float)
        for e in evs:
            acc[f"{e['name']} [{e.get('cat', '')}]"] += e["dur"] / 1e6
        out[rank] = dict(acc)
    return out


def summary_table(trace: dict[str, Any], start_ms: float | None = None,
                  end_ms: float | None = None, top: int = 30) -> str:
    """A markdown table: span names (longest total first) x ranks, in milliseconds."""
    per = seconds_by_name(trace, start_ms, end_ms)
    ranks = sorted(per)
    totals: dict[str, float] = defaultdict(float)
    for acc in per.values():
        for k, v in acc.items():
            totals[k] += v
    names = sorted(totals, key=lambda k: -totals[k])[:top]
    lines = ["| span [category] | " + " | ".join(f"rank {r} (ms)" for r in ranks) + " |",
             "|---|" + "---:|" * len(ranks)]
    for k in names:
        lines.append(f"| {k} | " + " | ".join(f"{1e3 * per[r].get(k, 0.0):.2f}" for r in ranks) + " |")
    return "\n".join(lines)


def per_call_table(trace: dict[str, Any], method: str, top: int = 14) -> str:
    """A markdown table: for each rank, the median over the calls of ``method`` (its ``method``
    spans) of the milliseconds spent in each span name inside a call, and the call itself."""
    import numpy as np
    by_rank = spans_by_rank(trace)
    per: dict[int, dict[str, list[float]]] = {}
    for rank, evs in by_rank.items():
        calls = [e for e in evs if e["name"] == method and e.get("cat") == "method"]
        acc: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(calls))
        for i, c in enumerate(calls):
            t0, t1 = c["ts"], c["ts"] + c["dur"]
            acc[f"{method} (the call)"][i] = c["dur"] / 1e3
            for e in evs:
                if e is not c and e["ts"] >= t0 and e["ts"] + e["dur"] <= t1 + 1e-3:
                    acc[f"{e['name']} [{e.get('cat', '')}]"][i] += e["dur"] / 1e3
        per[rank] = dict(acc)
    if not any(per.values()):
        raise ValueError(f"no calls of {method!r} in the trace")
    names = sorted({k for acc in per.values() for k in acc},
                   key=lambda k: -max(float(np.median(per[r][k])) if k in per[r] else 0.0 for r in per))
    ranks = sorted(per)
    calls = min(len(next(iter(acc.values()))) for acc in per.values() if acc)
    lines = [f"| median of {calls} calls (ms) | " + " | ".join(f"rank {r}" for r in ranks) + " |",
             "|---|" + "---:|" * len(ranks)]
    for k in names[:top]:
        lines.append(f"| {k} | " + " | ".join(
            f"{float(np.median(per[r][k])):.1f}" if k in per[r] else "-" for r in ranks) + " |")
    return "\n".join(lines)


#: Fixed colours: the categories of local work, waits and the collectives by kind (so the same
#: colour means the same thing in every chart); a method's phases get the pastel palette.
CATEGORY_COLOURS = {"compress": "#1f77b4", "decompress": "#9467bd", "feedback": "#8c564b",
                    "wait": "#d62728", "agree": "#ff9896", "step": "#c7c7c7", "bucket": "#9edae5",
                    "method": "#aec7e8"}
MPI_COLOURS = {"allreduce": "#2ca02c", "allgather": "#17becf", "allgatherv": "#bcbd22",
               "p2p": "#ff7f0e", "probe": "#ffbb78", "barrier": "#7f7f7f", "broadcast": "#e377c2",
               "alltoall": "#98df8a", "alltoallv": "#98df8a"}


#: Half the bar height of the kinds that nest inside each other in the step lane.
NESTED_HALF_HEIGHT = {"step": 0.4, "bucket": 0.28, "method": 0.16}


def _colour_of(event: dict[str, Any], palette: dict[str, Any], cmap: Any) -> Any:
    """The colour of a span; records it in ``palette`` (name -> colour) for the legend."""
    cat, name = event.get("cat", ""), event["name"]
    if cat == "mpi":
        colour = MPI_COLOURS.get(name, "#c5b0d5")
    elif cat in CATEGORY_COLOURS:
        colour = CATEGORY_COLOURS[cat]
        name = cat if cat in ("wait", "agree", "compress", "decompress", "feedback") else name
    else:
        phases = sum(1 for k in palette if k.startswith("phase: "))
        colour = palette.get(f"phase: {name}", cmap(phases % 12))
        name = f"phase: {name}"
    if cat not in ("step", "bucket", "method"):
        palette.setdefault(name, colour)
    return colour


def plot_gantt(trace: dict[str, Any], out: str | Path, title: str = "",
               start_ms: float | None = None, end_ms: float | None = None) -> Path:
    """Draw ranks x lanes (:data:`LANES`) over time to ``out`` (PNG); returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from .report_files import save_figure
    by_rank = spans_by_rank(trace, start_ms, end_ms)
    if not by_rank:
        raise ValueError("the trace has no spans in the chosen window")
    ranks = sorted(by_rank)
    lane_of = {cat: i for i, (_, cats) in enumerate(LANES) for cat in cats}
    n_lanes = len(LANES)
    fig, ax = plt.subplots(figsize=(13, 1.1 + 1.25 * len(ranks)))
    palette: dict[str, Any] = {}
    cmap = plt.get_cmap("Set3")
    t_lo = min(e["ts"] for evs in by_rank.values() for e in evs) / 1e3
    t_hi = max(e["ts"] + e["dur"] for evs in by_rank.values() for e in evs) / 1e3
    if start_ms is not None:
        t_lo = max(t_lo, start_ms)
    if end_ms is not None:
        t_hi = min(t_hi, end_ms)
    ticks, labels = [], []
    for row, rank in enumerate(ranks):
        base = row * (n_lanes + 1)
        for lane, (label, _) in enumerate(LANES):
            y = base + (n_lanes - 1 - lane)
            ticks.append(y)
            labels.append(f"rank {rank}  {label}" if lane == 0 else label)
        for e in by_rank[rank]:
            lane = lane_of.get(e.get("cat", ""), 0)
            y = base + (n_lanes - 1 - lane)
            x0, w = e["ts"] / 1e3, e["dur"] / 1e3
            cat = e.get("cat", "")
            colour = _colour_of(e, palette, cmap)
            half = NESTED_HALF_HEIGHT.get(cat, 0.4)    # nested kinds of the step lane: thinner
            ax.broken_barh([(x0, max(w, (t_hi - t_lo) * 2e-4))], (y - half, 2 * half),
                           facecolors=colour, edgecolors="none")
            if w > (t_hi - t_lo) * 0.06 and cat in ("phase", "method"):
                ax.text(x0 + w / 2, y, e["name"], ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlim(t_lo, t_hi)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "timeline")
    ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(color=c, label=n) for n, c in palette.items()][:20]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path)


def probe_cost(calls: int = 20_000, repeats: int = 5) -> dict[str, float]:
    """Seconds per probe point with the timeline off and on (best of ``repeats`` x ``calls``), in
    one process: a ``timeline.span`` block, a communicator's ``in_mpi`` block and a 16-float
    allreduce at P = 1."""
    import time

    import numpy as np

    from ...mpi_collectives import Communicator, timeline
    if timeline.recorder is not None:
        raise ValueError("a timeline is recording in this process; measure without one")
    comm = Communicator()
    x = np.ones(16, np.float32)

    def in_mpi() -> None:
        with comm.in_mpi("p2p", peer=0):
            pass

    def span() -> None:
        with timeline.span("x"):
            pass
    probes = {"span": span, "in_mpi": in_mpi, "allreduce": lambda: comm.allreduce(x)}

    def best(fn: Any) -> float:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - t0) / calls)
        return min(out)
    result = {f"{k}_off_s": best(fn) for k, fn in probes.items()}
    timeline.start()
    try:
        result.update({f"{k}_on_s": best(fn) for k, fn in probes.items()})
    finally:
        timeline.stop()
    return result


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("timeline", help="read a timeline file: Gantt chart (PNG) or a table per rank",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("plot", "summary", "cost"),
                   help="cost: what a probe point costs with the timeline off and on (no trace needed)")
    p.add_argument("trace", nargs="?", default=None, help="the timeline file (trace-event JSON)")
    p.add_argument("--out", default=None, help="PNG to write (plot; default: the trace's name with .png)")
    p.add_argument("--start-ms", type=float, default=None, help="window start (ms on the trace's clock)")
    p.add_argument("--end-ms", type=float, default=None, help="window end (ms)")
    p.add_argument("--title", default="")
    p.add_argument("--per-call", metavar="METHOD", default=None,
                   help="summary: the median over the calls of METHOD (e.g. oktopk) of each span inside a call")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "cost":
        for key, sec in probe_cost().items():
            print(f"{key:16s} {sec * 1e6:8.2f} us")
        return 0
    if args.trace is None:
        raise ValueError(f"hvdc timeline {args.action} needs a trace file")
    trace = load_trace(args.trace)
    if args.action == "summary":
        print(per_call_table(trace, args.per_call) if args.per_call else
              summary_table(trace, args.start_ms, args.end_ms))
        return 0
    out = args.out or str(Path(args.trace).with_suffix(".png"))
    print(plot_gantt(trace, out, args.title or Path(args.trace).name, args.start_ms, args.end_ms))
    return 0


__all__ = ["LANES", "load_trace", "per_call_table", "plot_gantt", "probe_cost", "seconds_by_name", "spans_by_rank", "summary_table"]
