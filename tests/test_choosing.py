"""The advice: accuracy costs from convergence runs, the recommendation rule, the generated
``docs/choosing.md`` and the shipped reference data, and ``hvdc model`` from any directory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_compress.tools.bench import advice, choosing

ROOT = Path(__file__).resolve().parents[1]


def _run(task, method, acc, feedback=None, seed=0):
    r = {"task": task, "method": method, "test_accuracy": acc, "seed": seed}
    if feedback is not None:
        r["feedback"] = feedback
    return r


def test_accuracy_cost_is_the_worst_task_mean_against_dense_at_default_feedback():
    runs = [_run("mlp", "none", 0.90, "none", 0), _run("mlp", "none", 0.92, "none", 1),
            _run("cnn", "none", 0.98, "none", 0),
            _run("mlp", "topk", 0.89, "residual", 0), _run("mlp", "topk", 0.91, "residual", 1),
            _run("cnn", "topk", 0.95, "residual", 0),
            _run("cnn", "topk", 0.50, "none", 0),          # not topk's default feedback: ignored
            _run("mlp", "arc_topk", 0.91, "ef21m", 0)]
    costs = advice.accuracy_costs(runs)
    assert costs["topk"].per_task == {"mlp": pytest.approx(-1.0), "cnn": pytest.approx(-3.0)}
    assert costs["topk"].points == pytest.approx(-3.0) and costs["topk"].task == "cnn"
    assert costs["arc_topk"].points == pytest.approx(0.0)
    assert costs["none"].points == 0.0


def test_recommendation_is_the_fastest_within_the_budget_else_dense():
    cost = lambda m, p: advice.AccuracyCost(m, p, "mlp", {"mlp": p})   # noqa: E731
    costs = {"none": cost("none", 0.0), "fast_bad": cost("fast_bad", -5.0),
             "ok": cost("ok", -0.5), "slow_ok": cost("slow_ok", 0.0), "lr": cost("lr", -80.0)}
    speeds = {"none": 1.0, "fast_bad": 3.0, "ok": 2.0, "slow_ok": 1.5, "lr": 4.0, "unknown": 9.0}
    assert advice.recommend(speeds, costs) == "ok"
    assert advice.recommend(speeds, costs, budget=5.0) == "fast_bad"
    assert advice.recommend({"none": 1.0, "ok": 0.9}, costs) == "none"
    warnings = advice.warnings_for(speeds, costs)
    assert any(w.startswith("lr: loses 80 points") for w in warnings)
    assert any(w.startswith("unknown: not in the convergence study") for w in warnings)
    assert not any(w.startswith(("ok", "fast_bad", "none")) for w in warnings)


def test_committed_page_and_reference_data_equal_the_generator_output():
    for path, text in choosing.outputs().items():
        assert path.read_text() == text, (f"{path.relative_to(ROOT)} is out of date: run "
                                          f"python -m horovod_compress.tools.bench.choosing")


def test_choosing_page_recommends_by_the_measurements():
    page = (ROOT / "docs" / "choosing.md").read_text()
    for key in choosing.NETWORKS:
        assert f"`--network {key}`" in page
    assert "needs another learning rate" in page and "`randk`" in page
    # every recommendation respects the budget: no method that loses more than it is recommended
    costs = advice.load_accuracy()
    for line in page.splitlines():
        if line.startswith("Recommended within"):
            for pick in line.split("`")[1::2]:
                assert pick == "none" or costs[pick].points >= -advice.ACCURACY_BUDGET, line


def test_hvdc_model_works_outside_the_repository_and_warns(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", "model", "--network", "10gbe",
                           "--ranks", "4", "64"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| randk | -88.30 (!)" in out
    assert "randk: loses 88 points of accuracy at dense's learning rate" in out
    assert "Recommended (fastest within 1 point(s) of dense's accuracy): P=4: global_qsgd" in out
    missing = subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", "model", "--profile", "nope.json"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "hvdc profile" in missing.stderr


def test_a_variant_s_accuracy_is_its_method_s_only_at_the_defaults():
    costs = {"powersgd": advice.AccuracyCost("powersgd", -0.5, "cnn", {"cnn": -0.5})}
    assert advice.cost_of("powersgd", costs).points == -0.5
    assert advice.cost_of("powersgd(rank=8)", costs).points == -0.5      # rank 8 is the default
    assert advice.cost_of("powersgd(rank=4)", costs) is None             # not measured
    assert advice.cost_of("topk", costs) is None
