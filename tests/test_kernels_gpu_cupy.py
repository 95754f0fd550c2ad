"""The GPU kernels on CuPy arrays on a real device, against the CPU kernels.

Skipped cleanly when CuPy is not installed or no CUDA device is visible (or
when this process runs Numba's simulator, which cannot launch on CuPy memory).
The checks are the simulator's (``check_*`` in tests/test_kernels_gpu.py), so
both array kinds are held to the same bit-for-bit contract.
"""
from __future__ import annotations

import pytest
from test_kernels_gpu import CHECKS


@pytest.mark.parametrize("check", CHECKS)
def test_gpu_kernel_matches_cpu_on_cupy_arrays(check, cupy) -> None:
    check(cupy.asarray, cupy.asnumpy)


def test_dispatch_picks_gpu_for_cupy(cupy) -> None:
    from horovod_compress.kernels import dispatch
    x = cupy.arange(10, dtype=cupy.float32)
    assert dispatch.get_array_module(x) is cupy
    assert dispatch.device_of(x) == "gpu"
    idx, val = dispatch.select_by_threshold(x, 5.0)
    assert isinstance(idx, cupy.ndarray) and cupy.asnumpy(idx).tolist() == [5, 6, 7, 8, 9]
