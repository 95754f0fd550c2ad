"""``hvdc bench compute``: every method at P = 1 and 2, split into compute and communication."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_compress.tools.bench.compute import parse_spec, render_markdown

pytestmark = pytest.mark.mpi


def test_parse_spec_converts_numbers() -> None:
    assert parse_spec("topk:density=0.05;feedback=none") == ("topk", {"density": 0.05,
                                                                       "feedback": "none"})
    assert parse_spec("powersgd:rank=4") == ("powersgd", {"rank": 4})


def test_compute_reports_each_p_against_memcpy_and_dense(tmp_path: Path) -> None:
    stem = tmp_path / "compute"
    proc = subprocess.run(
        [sys.executable, "-m", "horovod_compress.tools.cli", "bench", "compute", "--np", "1", "2",
         "--shape", "64x50", "--repeat", "2", "--warmup", "1",
         "--methods", "topk:density=0.05,fp16,powersgd:rank=2", "--out", str(stem)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(stem.with_suffix(".json").read_text())
    assert [r["P"] for r in report["runs"]] == [1, 2]
    for run_ in report["runs"]:
        assert run_["threads_per_rank"] == 1
        assert run_["memcpy_s"] > 0 and run_["dense_s"] > 0
        assert [r["method"] for r in run_["rows"]] == ["topk:density=0.05", "fp16",
                                                       "powersgd:rank=2"]
        assert run_["shared_window"]["policy"] == "auto"
        assert run_["shared_window"]["used"] is (run_["P"] > 1 and (os.cpu_count() or 1) >= 2)
        for r in run_["rows"]:
            assert 0 < r["s"] and r["compute_s"] <= r["s"] * 1.0001
            # each method against the memcpy and dense allreduce timed alongside its calls
            assert r["memcpy_s"] > 0 and r["dense_s"] > 0
    # bytes are the methods' own counts: fp16 sends half of a float32 ring allreduce at P = 2
    fp16 = report["runs"][1]["rows"][1]
    assert fp16["sent_bytes"] == pytest.approx(2 * 64 * 50 * 2 * (2 - 1) / 2)
    assert report["runs"][0]["rows"][1]["sent_bytes"] == 0
    text = stem.with_suffix(".md").read_text()
    assert text == render_markdown(report, "compute.png")
    assert "## P = 2" in text and "| fp16 |" in text and "<= 1 |" in text
    assert "dense ms |" in text
    row = next(r for r in report["runs"][1]["rows"] if r["method"] == "fp16")
    assert f"| fp16 | {1e3 * row['s']:.2f} | {row['s'] / row['memcpy_s']:.1f} | " \
           f"{row['s'] / row['dense_s']:.2f} |" in text
    assert stem.with_suffix(".png").stat().st_size > 0
