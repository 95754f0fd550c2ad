"""Every GPU kernel against its CPU kernel, under Numba's CUDA simulator (no GPU needed).

``NUMBA_ENABLE_CUDASIM=1`` must be set before Numba is imported, so the
checks (tests/cases/kernels_gpu_cases.py) run in one subprocess started here;
each check is reported as its own test. Results must be bit-identical to the
CPU kernels' (the randomized kernels share the counter-based generator), with
1e-12 relative tolerance only for the two float reductions whose summation
order differs by design (Gaussian threshold, row norms).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).parent / "cases" / "kernels_gpu_cases.py"
sys.path.insert(0, str(CASES.parent))
import kernels_gpu_cases  # noqa: E402  (only to list the checks; the simulator runs elsewhere)

sys.path.pop(0)


@pytest.fixture(scope="module")
def simulator_results() -> dict[str, str]:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, str(CASES)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=Path(__file__).parent.parent)
    if proc.returncode != 0:
        pytest.fail(f"simulator run failed (exit {proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", kernels_gpu_cases.CHECKS)
def test_gpu_kernel_matches_cpu_under_simulator(simulator_results: dict[str, str], check: str) -> None:
    assert check in simulator_results, f"{check} did not run"
    assert simulator_results[check] == "ok", simulator_results[check]


def test_every_dispatchable_gpu_kernel_is_checked() -> None:
    """A kernel registered with a GPU version must be called by some simulator check."""
    from horovod_compress.kernels import dispatch
    source = CASES.read_text()
    missing = [name for name in dispatch.registered()
               if dispatch.has_gpu(name) and f"gpu.{name}(" not in source and f"dispatch.{name}(" not in source]
    assert not missing, f"GPU kernels without a simulator check: {missing}"
