"""``hvdc bench kernels-gpu``: runs end to end on the simulator's device arrays, refuses cleanly without a GPU.

The real measurement needs CuPy and a CUDA device; here the benchmark's own
code (inputs, dispatch to every GPU kernel, comparison with the CPU kernel,
report) runs under Numba's CUDA simulator at a tiny size, where every GPU
kernel's output must equal its CPU kernel's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _hvdc(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "horovod_compress.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})


def test_every_gpu_kernel_benchmarked_and_equal_to_cpu_under_simulator(tmp_path: Path) -> None:
    out = tmp_path / "kernels_gpu.md"
    proc = _hvdc(["bench", "kernels-gpu", "--sizes", "2048", "--repeat", "1", "--out", str(out)],
                 {"NUMBA_ENABLE_CUDASIM": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["simulator"] is True
    names = [r["name"] for r in data["results"]]
    assert len(names) == 23 and len(set(names)) == 23
    assert all(r["same_as_cpu"] for r in data["results"]), [r["name"] for r in data["results"]
                                                            if not r["same_as_cpu"]]
    text = out.read_text()
    assert "timings are meaningless" in text and "**NO**" not in text


def test_refuses_without_cupy_or_device() -> None:
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed: the benchmark would run for real")
    except ImportError:
        pass
    proc = _hvdc(["bench", "kernels-gpu", "--sizes", "2048"], {"NUMBA_ENABLE_CUDASIM": "0"}, timeout=120)
    assert proc.returncode != 0
    assert "needs CuPy and a CUDA device" in proc.stderr + proc.stdout


@pytest.mark.parametrize("bench", ["kernels", "kernels-gpu"])
def test_bad_option_is_a_clean_error(bench: str) -> None:
    proc = _hvdc(["bench", bench, "--sizes", "10"], {"NUMBA_ENABLE_CUDASIM": "1"}, timeout=120)
    assert proc.returncode == 2
    assert "hvdc: error: --sizes must be >= 1024 each" in proc.stderr
    assert "Traceback" not in proc.stderr
