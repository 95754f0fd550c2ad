"""``hvdc bench hot_path``: one compressed allreduce per method against memcpy and dense, on 2 ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi


def test_hot_path_reports_every_method_against_memcpy_and_dense(tmp_path: Path) -> None:
    out = tmp_path / "hot_path.md"
    proc = subprocess.run(
        [sys.executable, "-m", "horovod_compress.tools.cli", "bench", "hot_path", "--np", "2",
         "--shape", "64x50", "--repeat", "2", "--warmup", "1",
         "--methods", "topk:density=0.05,global_qsgd:bits=8;dithering=linear", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["method"] for r in data["rows"]] == ["topk:density=0.05",
                                                   "global_qsgd:bits=8;dithering=linear"]
    assert data["memcpy_ms"] > 0 and data["dense_ms"] > 0
    for r in data["rows"]:
        assert r["ms"] > 0
        assert r["x_memcpy"] == pytest.approx(r["ms"] / data["memcpy_ms"])
        assert r["x_dense"] == pytest.approx(r["ms"] / data["dense_ms"])
    text = out.read_text()
    assert "NUMBA_NUM_THREADS=1" in text and "| dense allreduce |" in text
    # the page shows what was measured: every row's time and its ratios to the two baselines
    # (derived here from the JSON's times), the baselines' own rows included
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
             for line in text.splitlines() if line.startswith("| ") and "---" not in line}
    memcpy, dense = data["memcpy_ms"], data["dense_ms"]
    assert table["memcpy"] == [f"{memcpy:.2f}", "1.0", f"{memcpy / dense:.2f}"], table
    assert table["dense allreduce"] == [f"{dense:.2f}", f"{dense / memcpy:.1f}", "1.00"], table
    for r in data["rows"]:
        assert table[r["method"]] == [f"{r['ms']:.2f}", f"{r['ms'] / memcpy:.1f}",
                                      f"{r['ms'] / dense:.2f}"], (r, table)
