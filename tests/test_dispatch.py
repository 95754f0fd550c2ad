"""The dispatch layer: array kinds, the registry, and the CPU/parallel/GPU choice."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from horovod_compress.kernels import dispatch


class FakeDeviceArray:
    """Stands in for a CuPy/torch CUDA array: only the CUDA array interface matters to dispatch."""

    __cuda_array_interface__ = {"shape": (3,), "typestr": "<f4", "data": (0, False), "version": 3}
    size = 3


def test_array_kinds() -> None:
    x = np.zeros(3)
    assert not dispatch.is_gpu_array(x) and not dispatch.is_gpu_array([1, 2])
    assert dispatch.is_gpu_array(FakeDeviceArray())
    assert dispatch.get_array_module(x) is np and dispatch.get_array_module() is np
    assert dispatch.device_of(x, 1.0, "a") == "cpu" and dispatch.device_of(2.0) == "cpu"
    assert dispatch.device_of(FakeDeviceArray(), 3) == "gpu"
    with pytest.raises(ValueError, match="mix"):
        dispatch.device_of(x, FakeDeviceArray())


def _py(f):
    return getattr(f, "py_func", f)


@pytest.mark.parametrize("name", dispatch.registered())
def test_every_kernel_resolves_with_matching_signatures(name: str) -> None:
    """CPU, GPU (and parallel) versions exist and take the same parameters, so callers can swap them."""
    cpu = dispatch.implementation(name, "cpu")
    gpu = dispatch.implementation(name, "gpu")
    assert cpu.__name__.lstrip("_") == name or _py(cpu).__name__ == name
    cpu_params = list(inspect.signature(_py(cpu)).parameters)
    assert list(inspect.signature(_py(gpu)).parameters)[:len(cpu_params)] == cpu_params
    entry = dispatch._entry(name)
    if entry.cpu_parallel is not None:
        par = dispatch.implementation(name, "cpu_parallel")
        assert list(inspect.signature(_py(par)).parameters) == cpu_params


def test_numpy_inputs_run_the_cpu_kernel() -> None:
    from horovod_compress.kernels import quantize, selection
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    i1, v1 = dispatch.call("select_by_threshold", x, 1.5)
    i2, v2 = selection.select_by_threshold(x, 1.5)
    assert np.array_equal(i1, i2) and np.array_equal(v1, v2)
    assert dispatch.choose("select_by_threshold", x, 1.5) == "cpu"  # below PARALLEL_MIN_SIZE
    q = dispatch.exp_quantize(x, 0.01, 4, 9)  # attribute access = kernel(name)
    assert np.array_equal(q, quantize.exp_quantize(x, 0.01, 4, 9))
    assert dispatch.kernel("coo_sum").__name__ == "coo_sum"
    with pytest.raises(AttributeError):
        dispatch.no_such_kernel  # noqa: B018


def test_parallel_variant_is_chosen_for_large_inputs_with_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    big = np.ones(dispatch.PARALLEL_MIN_SIZE, np.float32)
    monkeypatch.setattr(dispatch, "_numba_threads", lambda: 4)
    assert dispatch.choose("select_by_threshold", big, 0.5) == "cpu_parallel"
    assert dispatch.choose("select_by_threshold", big[:-1], 0.5) == "cpu"
    assert dispatch.choose("coo_sum", big.astype(np.int64), big) == "cpu"  # no parallel variant
    # the Bloom query's work is n (every i < n is tested), not the size of the small filter
    filt = np.zeros(16, np.uint8)
    assert dispatch.choose("bloom_query_range", filt, 128, 3, np.uint64(1), dispatch.PARALLEL_MIN_SIZE) \
        == "cpu_parallel"
    assert dispatch.choose("bloom_query_range", filt, 128, 3, np.uint64(1), 1000) == "cpu"
    monkeypatch.setattr(dispatch, "_numba_threads", lambda: 1)
    assert dispatch.choose("select_by_threshold", big, 0.5) == "cpu"
    assert dispatch.choose("select_by_threshold", FakeDeviceArray(), 0.5) == "gpu"


def test_registry_validation() -> None:
    with pytest.raises(ValueError, match="identifier"):
        dispatch.register_kernel("not a name", "m:f")
    with pytest.raises(ValueError, match="already registered"):
        dispatch.register_kernel("coo_sum", "m:f")
    with pytest.raises(ValueError, match="gpu must be"):
        dispatch.register_kernel("tmp_kernel_x", "m:f", gpu="no_colon")
    with pytest.raises(ValueError, match="cpu must be"):
        dispatch.register_kernel("tmp_kernel_x", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        dispatch.implementation("nope", "cpu")
    with pytest.raises(ValueError, match="device must be"):
        dispatch.implementation("coo_sum", "tpu")


def test_kernel_without_gpu_version_refuses_device_arrays() -> None:
    dispatch.register_kernel("tmp_cpu_only", "numpy:flatnonzero")
    try:
        assert dispatch.call("tmp_cpu_only", np.array([0, 3, 0, 1])).tolist() == [1, 3]
        assert not dispatch.has_gpu("tmp_cpu_only") and dispatch.has_gpu("coo_sum")
        with pytest.raises(ValueError, match="no GPU implementation"):
            dispatch.call("tmp_cpu_only", FakeDeviceArray())
    finally:
        dispatch._REGISTRY.pop("tmp_cpu_only")


def test_cpu_only_code_imports_no_gpu_module() -> None:
    """GPU implementations are resolved lazily: a NumPy call loads neither numba.cuda nor CuPy."""
    import subprocess
    import sys
    code = ("import sys, numpy as np\n"
            "from horovod_compress.kernels import dispatch\n"
            "dispatch.call('pack_nibbles', np.arange(6, dtype=np.uint8))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('cupy', 'numba.cuda', "
            "'horovod_compress.kernels.gpu'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
