"""``hvdc bench kernels-gpu``: runs end to end on the simulator's device arrays, refuses cleanly without a GPU.

The real measurement needs CuPy and a CUDA device; here the benchmark's own
code (inputs, dispatch to the GPU kernels, comparison with the CPU kernel,
report) runs under Numba's CUDA simulator at a tiny size on one kernel of each
family, whose output must equal its CPU kernel's (every kernel is compared with
its CPU kernel under the simulator in test_kernels_gpu.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _hvdc(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})


# One GPU kernel of each family (quantization, 4-bit codes, Bloom filter, rows, selection): the
# benchmark's own code is the same for every case, and every kernel's equality with its CPU kernel
# is test_kernels_gpu.py's job -- under the simulator the full list costs a minute more.
SUBSET = ("count_at_least", "linear_dequantize", "nibble_add (4-bit sum)", "bloom_insert",
          "gather_rows (10% rows)")     # in the benchmark's order


def test_gpu_kernels_benchmarked_and_equal_to_cpu_under_simulator(tmp_path: Path) -> None:
    out = tmp_path / "kernels_gpu.md"
    proc = _hvdc(["bench", "kernels-gpu", "--sizes", "2048", "--repeat", "1", "--only", ",".join(SUBSET),
                  "--out", str(out)], {"NUMBA_ENABLE_CUDASIM": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["simulator"] is True
    names = [r["name"] for r in data["results"]]
    assert names == list(SUBSET), names
    assert all(r["same_as_cpu"] for r in data["results"]), [r["name"] for r in data["results"]
                                                            if not r["same_as_cpu"]]
    text = out.read_text()
    assert "timings are meaningless" in text and "**NO**" not in text


def test_every_gpu_kernel_has_a_benchmark_case() -> None:
    """The benchmark keeps a case for each of the 23 GPU kernels, the subset above among them
    (counted in its source: building the cases needs a device or the simulator)."""
    import re

    from horovod_compress.tools.bench import kernels_gpu
    src = Path(kernels_gpu.__file__).read_text()
    labels = re.findall(r'GpuCase\(\s*f?"([^"]+)"', src)
    assert len(labels) == 23 and len(set(labels)) == 23, labels
    assert set(SUBSET) <= set(labels), set(SUBSET) - set(labels)


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
