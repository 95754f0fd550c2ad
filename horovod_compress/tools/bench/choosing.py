"""Generate ``docs/choosing.md`` and the shipped reference data from the measurements.

    python -m horovod_compress.tools.bench.choosing            # rewrite the page and the reference files
    python -m horovod_compress.tools.bench.choosing --check    # exit 1 if either differs from the output

Reads ``benchmarks/e2e.json`` (each method's measured step profile: CPU time
of compute and compression, bytes and calls per collective) and
``benchmarks/convergence.json`` (each method's accuracy at its defaults), and
writes

* ``horovod_compress/tools/bench/reference/profiles_transformer_cpu.json``: the
  profiles of one run (P = 4, 1 Gbit), which ``hvdc model`` uses when it is
  given no ``--profile``;
* ``horovod_compress/tools/bench/reference/accuracy.json``: each method's accuracy
  cost (:mod:`.advice`);
* ``docs/choosing.md``: per network preset and P, each method's predicted step
  speedup (the alpha-beta model of :mod:`horovod_compress.cost_model` on those
  profiles) beside its accuracy cost, the method the rule of :mod:`.advice`
  recommends, and the methods that need another learning rate.

A test checks that the committed files equal this module's output.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping

from ...cost_model import PRESETS, speedup
from . import advice
from .model_cmd import profiles_of_run

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "choosing.md"
E2E_JSON = ROOT / "benchmarks" / "e2e.json"
CONVERGENCE_JSON = ROOT / "benchmarks" / "convergence.json"
#: the networks of the page, and the numbers of ranks
NETWORKS = ("1gbe", "10gbe", "25gbe", "100gbe", "ib100")
RANKS = (4, 16, 64, 256)
#: the measurement the shipped profiles come from
REFERENCE_RUN = (4, "1gbit")
#: the fields of a method's measurement that the model reads
PROFILE_FIELDS = ("compute_cpu_s", "compress_cpu_s", "ops", "transport")
RUN_FIELDS = ("world_size", "bandwidth", "model", "cores", "threads_per_rank", "parameters")


def reference_profiles(e2e: Mapping[str, Any], which: tuple[int, str] = REFERENCE_RUN) -> dict[str, Any]:
    """The run ``which`` = (P, bandwidth) of an e2e JSON, cut to what ``hvdc model`` reads."""
    p, bw = which
    run = next((r for r in e2e["runs"] if r["world_size"] == p and r["bandwidth"] == bw), None)
    if run is None:
        raise ValueError(f"no run at P={p}, {bw} in the e2e measurements")
    kept = {k: run[k] for k in RUN_FIELDS if k in run}
    kept["methods"] = {label: {k: m[k] for k in PROFILE_FIELDS if k in m}
                       for label, m in run["methods"].items() if "error" not in m}
    kept["source"] = "benchmarks/e2e.json"
    return {"runs": [kept]}


def _dump(data: Any) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def render_page(run: Mapping[str, Any], costs: Mapping[str, advice.AccuracyCost]) -> str:
    """The Markdown of ``docs/choosing.md`` for one e2e run's profiles and the accuracy costs."""
    profiles = profiles_of_run(run)
    dense = profiles["none"]
    lines = [HEADER.format(model=run.get("model"), p=run["world_size"], bw=run["bandwidth"],
                           cores=run.get("cores", "?"), budget=advice.ACCURACY_BUDGET,
                           lr=advice.LEARNING_RATE_POINTS)]
    lines.append("## Predicted speedups and accuracy costs\n")
    lines.append("Accuracy cost: the worst of the two digits tasks of the "
                 "[convergence study](../benchmarks/convergence.md), in points of test accuracy "
                 "against dense at dense's learning rate. **Bold**: the recommended method at that P.\n")
    for key in NETWORKS:
        net = PRESETS[key]
        speeds = {p: {label: speedup(prof, dense, net, p) for label, prof in profiles.items()}
                  for p in RANKS}
        best = {p: advice.recommend(speeds[p], costs) for p in RANKS}
        lines.append(f"### {net.name} (`--network {key}`: alpha {net.alpha * 1e6:g} us, "
                     f"{net.bandwidth / 1e9:g} Gbit/s)\n")
        lines.append("| method | accuracy cost (pts) | " + " | ".join(f"P = {p}" for p in RANKS) + " |")
        lines.append("|---|---:|" + "---:|" * len(RANKS))
        order = sorted(profiles, key=lambda m: -speeds[RANKS[-1]][m])
        for label in order:
            cost = advice.cost_of(label, costs)
            acc = "n/a" if cost is None else f"{cost.points:+.2f}"
            if cost is not None and cost.needs_other_learning_rate:
                acc += " (needs another learning rate)"
            cells = [f"**{speeds[p][label]:.2f}x**" if best[p] == label else f"{speeds[p][label]:.2f}x"
                     for p in RANKS]
            lines.append(f"| `{label}` | {acc} | " + " | ".join(cells) + " |")
        picks = ", ".join(f"P = {p}: `{best[p]}`" for p in RANKS)
        lines.append(f"\nRecommended within {advice.ACCURACY_BUDGET:g} point: {picks}.\n")
    flagged = advice.warnings_for(profiles, costs)
    if flagged:
        lines.append("## Methods that need another learning rate\n")
        lines += [f"- {w}" for w in flagged]
        lines.append("")
    lines.append(FOOTER)
    return "\n".join(lines)


HEADER = """# Which method for my network

<!-- Generated by `python -m horovod_compress.tools.bench.choosing` from benchmarks/e2e.json and
benchmarks/convergence.json; edit the generator, not this page. -->

A compressor pays when the time it saves on the wire is more than the time it
spends computing; and it is only worth it if it keeps the accuracy you need.
This page puts both side by side for typical networks, from the project's own
measurements:

- **Speed**: the step time each method is predicted to take on each network,
  against dense (`speedup = dense step / method step`), by the alpha-beta model
  (sending L bytes costs α + L/B; see [the testbed guide](testbed.md#4-predict-for-your-cluster-hvdc-model))
  applied to the step profiles measured by `hvdc bench e2e`: the
  {model} model at P = {p}, {bw}, on a {cores}-core CPU machine (one rank's
  compute and compression CPU time, bytes and calls per collective; bytes
  scaled to other P by each method's volume law).
- **Accuracy**: what each method at its defaults cost in the
  [convergence study](../benchmarks/convergence.md) (digits MLP and CNN, 4
  ranks, 3 seeds, dense's learning rate).

**The rule.** Among the methods whose accuracy cost is at most {budget:g}
point, recommend the one with the highest predicted speedup; dense when none
is faster. A method that loses more than {lr:g} points at dense's learning rate
is flagged: it needs a different learning rate (or parameters), which the
study did not tune, so its speed is no recommendation.

These numbers are for that model on that CPU. Compression runs on the CPU
here; a faster CPU or a GPU changes every method's compression time, and your
model changes the ratio of compute to bytes. To predict for your own job,
profile it and give the profile to `hvdc model`:

```bash
hvdc profile --script my_model.py --np 2 --out my_profile.json   # your model, batch and device
hvdc model --profile my_profile.json --network 10gbe --ranks 8 64
hvdc model --network 25gbe --ranks 16                            # the reference profiles below
hvdc model --latency 2us --bandwidth 25gbit --ranks 16 --accuracy-budget 2
```
"""

FOOTER = """## What bytes buy: the volume of each method

| method | volume law in P | bytes/rank/step (n floats) |
|---|---|---|
| `none` | (P−1)/P | 8n(P−1)/P |
| `fp16` | (P−1)/P | 4n(P−1)/P |
| `global_qsgd` 8-bit | (P−1)/P | 2(8 + n)(P−1)/P |
| `oktopk` | (P−1)/P | between 2k and 6k words ×(P−1)/P |
| `powersgd`, `greedylore`, `arc_topk` | (P−1)/P | per matrix, see [Methods](methods/index.md) |
| `topk`, `gaussiank`, `qsgd`, `deepreduce` | P−1 | grows with every rank added |
| `gtopk` | log₂P | 4k·log₂P words |

Methods whose volume grows as P − 1 (allgather-based) fall behind as P grows,
which the tables above show at P = 64 and 256.
"""


def outputs(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file and its content."""
    e2e = json.loads((root / "benchmarks" / "e2e.json").read_text())
    conv = json.loads((root / "benchmarks" / "convergence.json").read_text())
    profiles = reference_profiles(e2e)
    costs = advice.accuracy_costs(conv["runs"])
    ref = root / "horovod_compress" / "tools" / "bench" / "reference"
    return {ref / advice.REFERENCE_PROFILES: _dump(profiles),
            ref / advice.REFERENCE_ACCURACY: _dump(advice.accuracy_summary(costs, "benchmarks/convergence.json")),
            root / "docs" / "choosing.md": render_page(profiles["runs"][0], costs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if args.check and stale:
        print("out of date: " + ", ".join(str(p.relative_to(ROOT)) for p in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
