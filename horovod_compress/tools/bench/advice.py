"""Advice from the measurements: each method's accuracy cost beside its predicted speedup.

The accuracy cost of a method is read from the convergence study
(``hvdc bench convergence``, ``benchmarks/convergence.json``): every method at
its library defaults (its default error feedback) and at dense's learning
rate, on each task, as the mean final test accuracy over seeds minus dense's,
in points. A method's cost is its worst task's.

The recommendation rule, stated once and used by ``hvdc model`` and the
generated page ``docs/choosing.md``: **among the methods whose accuracy cost is
within the budget (default 1 point), the one with the highest predicted
speedup; dense when none is faster than dense.** A method that loses more than
:data:`LEARNING_RATE_POINTS` at dense's learning rate is flagged: it needs a
different learning rate (or other parameters) than dense, which the study did
not tune, so its accuracy at the speed shown is unknown.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from ...compressors.registry import UnknownMethodError, defaults

#: default accuracy budget of the recommendation, in points of test accuracy
ACCURACY_BUDGET = 1.0
#: a loss beyond this many points at dense's learning rate means "needs another learning rate"
LEARNING_RATE_POINTS = 10.0
#: the reference data shipped with the package (``hvdc model`` works from any directory)
REFERENCE_PACKAGE = "horovod_compress.tools.bench.reference"
REFERENCE_PROFILES = "profiles_transformer_cpu.json"
REFERENCE_ACCURACY = "accuracy.json"


@dataclass(frozen=True)
class AccuracyCost:
    """What a method cost in accuracy in the convergence study, at dense's learning rate."""

    method: str
    points: float                     # worst task's mean accuracy minus dense's (negative: a loss)
    task: str                         # that task
    per_task: dict[str, float]

    @property
    def needs_other_learning_rate(self) -> bool:
        return self.points < -LEARNING_RATE_POINTS


def accuracy_costs(runs: Iterable[Mapping[str, Any]]) -> dict[str, AccuracyCost]:
    """Per method, its :class:`AccuracyCost` from convergence runs (``convergence.json``'s
    ``runs``), at the method's default feedback (the runs whose config is the method's default)."""
    acc: dict[tuple[str, str], list[float]] = {}
    for r in (r for r in runs if _is_default(r)):
        acc.setdefault((r["task"], r["method"]), []).append(100.0 * float(r["test_accuracy"]))
    dense = {task: statistics.fmean(v) for (task, m), v in acc.items() if m == "none"}
    out: dict[str, AccuracyCost] = {}
    for (task, method), values in sorted(acc.items()):
        if task not in dense:
            continue
        per = out[method].per_task if method in out else {}
        per[task] = round(statistics.fmean(values) - dense[task], 2)
        worst = min(per, key=per.get)
        out[method] = AccuracyCost(method, per[worst], worst, per)
    return out


def _is_default(run: Mapping[str, Any]) -> bool:
    """Whether a convergence run used the method's own default feedback."""
    try:
        default = defaults(run["method"]).get("feedback", "none")
    except UnknownMethodError:
        return False
    return run.get("feedback", default) == default


def cost_of(label: str, costs: Mapping[str, AccuracyCost]) -> AccuracyCost | None:
    """The accuracy cost of a profile's ``label`` (``name`` or ``name(k=v,...)``): the method's
    own where every parameter in the label is its default, ``None`` (not measured) otherwise."""
    name, _, rest = label.partition("(")
    cost = costs.get(name)
    if cost is None or not rest:
        return cost
    try:
        own = defaults(name)
    except UnknownMethodError:
        return None
    for item in rest.rstrip(")").split(","):
        key, _, value = item.partition("=")
        if key not in own or str(own[key]) != value:
            return None
    return cost


def recommend(speedups: Mapping[str, float], costs: Mapping[str, AccuracyCost],
              budget: float = ACCURACY_BUDGET) -> str:
    """The rule of the module docstring: the fastest method within ``budget`` points, else dense."""
    best, best_speed = "none", 1.0
    for method, s in speedups.items():
        cost = cost_of(method, costs)
        if method == "none" or cost is None or cost.points < -budget:
            continue
        if s > best_speed:
            best, best_speed = method, s
    return best


def warnings_for(methods: Iterable[str], costs: Mapping[str, AccuracyCost]) -> list[str]:
    """One line per method that needs another learning rate than dense, or has no accuracy data."""
    lines = []
    for m in methods:
        cost = cost_of(m, costs)
        if cost is None:
            if m != "none":
                lines.append(f"{m}: not in the convergence study; its accuracy cost is unknown")
        elif cost.needs_other_learning_rate:
            lines.append(f"{m}: loses {-cost.points:.0f} points of accuracy at dense's learning rate "
                         f"(digits {cost.task.upper()}, convergence study): it needs a different "
                         f"learning rate or parameters; its speed is no recommendation")
    return lines


def reference_file(name: str) -> Path:
    """Path of a reference file shipped in :data:`REFERENCE_PACKAGE`."""
    return Path(str(resources.files(REFERENCE_PACKAGE).joinpath(name)))


def load_accuracy(path: str | Path | None = None) -> dict[str, AccuracyCost]:
    """Accuracy costs from a convergence JSON (``runs``) or the shipped summary (``costs``)."""
    data = json.loads(Path(path or reference_file(REFERENCE_ACCURACY)).read_text())
    if "runs" in data:
        return accuracy_costs(data["runs"])
    return {m: AccuracyCost(m, c["points"], c["task"], c["per_task"]) for m, c in data["costs"].items()}


def accuracy_summary(costs: Mapping[str, AccuracyCost], source: str) -> dict[str, Any]:
    """The shipped form of ``costs`` (what :func:`load_accuracy` reads back)."""
    return {"source": source, "rule": {"budget_points": ACCURACY_BUDGET,
                                       "learning_rate_points": LEARNING_RATE_POINTS},
            "costs": {m: {"points": c.points, "task": c.task, "per_task": c.per_task}
                      for m, c in sorted(costs.items())}}
