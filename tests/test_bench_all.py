"""``hvdc bench all`` and ``hvdc bench convergence``: one quick suite run records provenance,
stamps the page it wrote and regenerates the results index; the convergence report's
arithmetic on known numbers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_compress.tools.bench import all as bench_all
from horovod_compress.tools.bench import convergence
from horovod_compress.tools.testing import mpi_env

ROOT = Path(__file__).resolve().parents[1]


def _hvdc(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = mpi_env()
    env.pop("HVDC_LAUNCHED", None)
    return subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_lists_the_suite(tmp_path):
    proc = _hvdc("bench", "all", "--quick", "--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for bench in bench_all.SUITE:
        assert f"hvdc bench {bench.name}" in proc.stdout
    assert _hvdc("bench", "all", "--only", "nosuch", "--out", str(tmp_path)).returncode == 2


@pytest.mark.mpi
@pytest.mark.slow
def test_quick_suite_runs_convergence_and_records_provenance(tmp_path):
    proc = _hvdc("bench", "all", "--quick", "--only", "convergence", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "all.json").read_text())
    run = record["runs"]["convergence"]
    assert run["returncode"] == 0 and run["seconds"] > 0
    assert run["machine"]["cores"] and run["versions"]["numpy"] and run["versions"]["torch"]
    assert run["command"].startswith("hvdc bench convergence --quick")
    assert run["suite_command"].startswith("hvdc bench all --quick")
    page = (tmp_path / "convergence.md").read_text()
    assert page.count(bench_all.PROVENANCE_MARK) == 1 and "within `hvdc bench all --quick" in page
    assert (tmp_path / "convergence.png").stat().st_size > 10_000
    runs = json.loads((tmp_path / "convergence.json").read_text())["runs"]
    # quick: mlp, 1 seed, 4 methods, the biased ones also without feedback
    got = {(r["method"], r["feedback"]) for r in runs}
    assert ("none", "none") in got and ("topk", "residual") in got and ("topk", "none") in got
    dense = next(r for r in runs if r["method"] == "none")
    topk = next(r for r in runs if r["method"] == "topk" and r["feedback"] == "residual")
    assert topk["bytes_sent_per_step"] < dense["bytes_sent_per_step"] / 5
    assert dense["test_accuracy"] > 0.5                      # 2 epochs of the digits MLP
    index = (tmp_path / "README.md").read_text()
    assert "[Convergence" in index and "`convergence` | ok" in index


def test_convergence_report_statistics(tmp_path):
    def run(method, fb, ef, seed, acc, sent):
        return {"task": "mlp", "method": method, "feedback": fb, "ef": ef, "seed": seed, "world_size": 4,
                "epochs": 30, "steps": 330, "num_params": 26122, "test_accuracy": acc,
                "bytes_sent_per_step": sent, "dense_bytes_per_step": 156732.0,
                "seconds_per_step": 0.01, "wall_seconds": 3.3}
    results = [run("none", "none", False, s, a, 156732.0) for s, a in enumerate([0.97, 0.98, 0.975])]
    results += [run("arc_topk", "ef21m", True, s, a, 40000.0) for s, a in enumerate([0.96, 0.97, 0.965])]
    results += [run("arc_topk", "none", False, s, a, 40000.0) for s, a in enumerate([0.90, 0.91, 0.92])]
    rows = {(r["method"], r["feedback"]): r for r in convergence.summarize(results)}
    assert rows[("none", "none")]["acc_mean"] == pytest.approx(97.5)
    assert rows[("none", "none")]["acc_std"] == pytest.approx(0.5)
    md = convergence.write_report(results, tmp_path).read_text()
    # -1.0 vs the paper's -0.08 with EF: within (ours 0.5 + 0.5, the paper's 0.18 + 0.08);
    # -6.5 vs -1.29 without: outside (1.0 + 0.5 + 0.09 + 0.08)
    assert "| `arc_topk` | ef21m | 96.50 ± 0.50 | -1.00 |" in md
    assert "-0.08 ± 0.26, ARC-Top-K Table II (ARC-Top-K, with EF): within (± 1.26)" in md
    assert "without EF): outside (± 1.67)" in md
    outside = md[md.index("## Outside the paper's spread"):]
    assert "`arc_topk` with feedback none: -6.50 points against the paper's -1.29" in outside
    assert "ef21m" not in outside
    assert "3.9x less" in md and "| (baseline) |" in md
    dense, arc = rows[("none", "none")], rows[("arc_topk", "ef21m")]
    assert convergence.compare_with_paper(dense, dense) is None          # no paper row for dense
    assert convergence.compare_with_paper({**arc, "acc_mean": 98.9}, dense)["verdict"] == "better"
    assert convergence.compare_with_paper({**arc, "acc_mean": 96.2}, dense)["verdict"] == "within"
    assert convergence.compare_with_paper({**arc, "acc_mean": 96.1}, dense)["verdict"] == "outside"
