"""The ``gpu_native`` methods on CuPy arrays on a real device, against their NumPy results.

Skipped cleanly without CuPy or a CUDA device (this project's CI machine has
neither; tests/test_device_methods.py covers the device plumbing under Numba's
simulator). One process, so the Communicator has one rank: the check is that
the xp-generic code and the dispatched GPU kernels compute what the CPU does.
"""
from __future__ import annotations

import numpy as np
import pytest

from horovod_compress import Compression

NATIVE = {
    "none": ({}, 0.0),
    "topk": ({"density": 0.1}, 0.0),
    "oktopk": ({"density": 0.1, "warmup_steps": 1, "tau_prime": 2}, 0.0),
    "randk": ({"density": 0.1}, 0.0),
    "global_qsgd": ({}, 0.0),
    "global_qsgd_linear": ({"dithering": "linear"}, 0.0),
    "global_qsgd_4bit_sparse": ({"bits": 4, "sparse": True}, 0.0),
    "arc_topk": ({"ratio": 0.25, "rank": 2}, 1e-5),   # the sketch is a matmul: rounding may differ
    "topk_rows": ({"ratio": 0.25}, 0.0),
    "qsgd": ({"norm": "inf"}, 0.0),
    "qsgd_4bit": ({"bits": 4, "norm": "inf"}, 0.0),
    "randk_rows": ({"ratio": 0.25}, 0.0),
}


@pytest.mark.parametrize("case", sorted(NATIVE))
def test_native_method_on_cupy_matches_numpy(case: str, cupy) -> None:
    from horovod_compress.mpi_collectives import Communicator
    params, rtol = NATIVE[case]
    name = case.split("_4bit")[0].replace("_linear", "")
    comm = Communicator()
    host = Compression.by_name(name, seed=3, **params)
    dev = Compression.by_name(name, seed=3, **params)
    for step in range(1, 4):
        g = np.random.default_rng(step).standard_normal((32, 12)).astype(np.float32)
        h = host.allreduce(g, "w", comm)
        d = dev.allreduce(cupy.asarray(g), "w", comm)
        assert isinstance(d, cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(d), h, rtol=rtol, atol=rtol, err_msg=f"step {step}")
    assert dev.device_calls == {"native": 3, "staged": 0}
    sd = dev.state_dict()   # checkpoints hold host arrays
    assert all(not isinstance(v, cupy.ndarray) for st in sd["state"].values() for v in st.values())


def test_staged_method_on_cupy_gives_cupy(cupy) -> None:
    from horovod_compress.mpi_collectives import Communicator
    method = Compression.oktopk(density=0.1)
    g = np.random.default_rng(0).standard_normal(500).astype(np.float32)
    out = method.allreduce(cupy.asarray(g), "w", Communicator())
    assert isinstance(out, cupy.ndarray) and method.device_calls["staged"] == 1


def test_torch_cuda_tensor_becomes_cupy_without_copy(cupy) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from horovod_compress.torch.tensors import copy_into, to_array
    t = torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)
    a = to_array(t)
    assert isinstance(a, cupy.ndarray) and a.data.ptr == t.data_ptr()
    dst = torch.zeros_like(t)
    copy_into(dst, a * 2)
    assert torch.equal(dst, t * 2)
