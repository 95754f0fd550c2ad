"""GPU arrays end to end through the Communicator and every method, on real MPI ranks.

The cases run with ``NUMBA_ENABLE_CUDASIM=1`` (passed to ``run_cases``):
Numba device arrays are then the simulator's (host memory), so the device
code paths run on a CPU-only machine. Numba device arrays have no
arithmetic, so every method takes its staging path with them (copy to host,
run, copy back); CuPy arrays on a real GPU take the native path of the
``gpu_native`` methods (tests/test_gpu_methods_cupy.py, skipped without a
device).
"""
from __future__ import annotations

import numpy as np
import pytest

from horovod_compress import Compression
from horovod_compress.tools.testing import run_cases

SIM = {"NUMBA_ENABLE_CUDASIM": "1"}


# ------------------------------------------------------------------------ cases
# (method, params): every registered method, with parameters that make it compress a small tensor.
METHODS = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "topk": {"density": 0.1},
    "randk": {"density": 0.1},
    "oktopk": {"density": 0.1},
    "topk_dsa": {"density": 0.1},
    "gtopk": {"density": 0.1},
    "gaussiank": {"density": 0.1},
    "global_qsgd": {},
    "qsgd": {},
    "arc_topk": {"ratio": 0.25, "rank": 2},
    "topk_rows": {"ratio": 0.25},
    "randk_rows": {"ratio": 0.25},
    "greedylore": {"rank": 2},
    "powersgd": {"rank": 2},
    "lazy_projection": {"rank": 2},
    "deepreduce": {"density": 0.1},
    "auto": {},
}


def _grad(rank: int, step: int, shape: tuple[int, ...] = (24, 10)) -> np.ndarray:
    return np.random.default_rng(1000 * step + rank).standard_normal(shape).astype(np.float32)


def case_communicator_takes_device_arrays(comm):
    """Every Communicator entry point with (simulated) device arrays, staged and direct."""
    from numba import cuda

    from horovod_compress.kernels.arrays import is_gpu_array

    p, rank = comm.size, comm.rank
    everyone = [_grad(j, 0, (37,)) for j in range(p)]
    out = {}
    for aware in (False, True):
        comm.device.cuda_aware = aware
        comm.reset_stats()
        host = {}
        host["allreduce"] = comm.allreduce(everyone[rank], "avg")
        host["iallreduce"] = comm.iallreduce(everyone[rank], "sum").wait()
        host["allgather"] = comm.allgather(everyone[rank])
        host["allgatherv"] = comm.allgatherv(everyone[rank][: rank + 2])[0]
        host["broadcast"] = comm.broadcast(everyone[rank].copy(), root=p - 1)
        host["alltoallv"] = np.concatenate(comm.alltoallv(
            [np.full(j + 1, rank, np.float32) for j in range(p)]))
        host_stats = comm.stats()
        comm.reset_stats()
        dev = {}
        dev["allreduce"] = comm.allreduce(cuda.to_device(everyone[rank]), "avg")
        dev["iallreduce"] = comm.iallreduce(cuda.to_device(everyone[rank]), "sum").wait()
        dev["allgather"] = comm.allgather(cuda.to_device(everyone[rank]))
        dev["allgatherv"] = comm.allgatherv(cuda.to_device(everyone[rank][: rank + 2]))[0]
        dev["broadcast"] = comm.broadcast(cuda.to_device(everyone[rank].copy()), root=p - 1)
        parts = comm.alltoallv([cuda.to_device(np.full(j + 1, rank, np.float32)) for j in range(p)])
        assert all(is_gpu_array(a) for a in parts)
        dev["alltoallv"] = cuda.to_device(np.concatenate([a.copy_to_host() for a in parts]))
        for key, value in dev.items():
            assert is_gpu_array(value), f"{key} returned {type(value).__name__}, not a device array"
            np.testing.assert_array_equal(value.copy_to_host(), host[key], err_msg=key)
        dev_stats = comm.stats()
        assert dev_stats == host_stats, (aware, dev_stats, host_stats)

        # point to point: a ring of device buffers of known length
        right, left = (rank + 1) % p, (rank - 1) % p
        buf = cuda.device_array(5, dtype=np.float32)
        recv = comm.irecv(buf, source=left, tag=7)
        send = comm.isend(cuda.to_device(np.full(5, rank, np.float32)), dest=right, tag=7)
        got = recv.wait()
        send.wait()
        assert is_gpu_array(got)
        np.testing.assert_array_equal(got.copy_to_host(), np.full(5, left, np.float32))
        out[f"aware={aware}"] = {"staged": comm.device.staged, "direct": comm.device.direct}
    return out


def _run_method(name: str, comm, wrap, steps: int = 3):
    method = Compression.by_name(name, seed=5, **METHODS[name])
    results = []
    for step in range(1, steps + 1):
        out = method.allreduce(wrap(_grad(comm.rank, step)), "w", comm)
        results.append(out)
    return method, results


def case_every_method_on_device_arrays(comm):
    """Device gradients give the host result bit for bit, as device arrays, state kept across steps."""
    from numba import cuda

    from horovod_compress.kernels.arrays import is_gpu_array

    report = {}
    for name in METHODS:
        host_method, host_out = _run_method(name, comm, lambda a: a)
        dev_method, dev_out = _run_method(name, comm, cuda.to_device)
        for step, (h, d) in enumerate(zip(host_out, dev_out), start=1):
            assert is_gpu_array(d), f"{name}: step {step} returned {type(d).__name__}"
            assert tuple(d.shape) == h.shape and np.dtype(d.dtype) == h.dtype, name
            np.testing.assert_array_equal(d.copy_to_host(), h, err_msg=f"{name} step {step}")
        assert dev_method.device_calls == {"native": 0, "staged": 3}, (name, dev_method.device_calls)
        assert host_method.device_calls == {"native": 0, "staged": 0}, name
        # the staged run left host state behind: it checkpoints like the host run
        sd_h, sd_d = host_method.state_dict(), dev_method.state_dict()
        assert sd_h["state"].keys() == sd_d["state"].keys(), name
        for tensor, st in sd_h["state"].items():
            for key, value in st.items():
                other = sd_d["state"][tensor][key]
                if isinstance(value, np.ndarray):
                    np.testing.assert_array_equal(other, value, err_msg=f"{name}.{key}")
                else:
                    assert other == value or (value != value and other != other), (name, key)
        report[name] = dev_method.device_calls["staged"]
    return report


# ------------------------------------------------------------------------ tests
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_communicator_takes_device_arrays(nprocs: int) -> None:
    results = run_cases(nprocs, __file__, [case_communicator_takes_device_arrays], env=SIM)
    for rank in range(nprocs):
        r = results[case_communicator_takes_device_arrays][rank]
        # six collectives each way (alltoallv always staged); counters accumulate over both modes
        assert r["aware=False"] == {"staged": 6, "direct": 0}
        assert r["aware=True"] == {"staged": 7, "direct": 5}


@pytest.mark.mpi
def test_every_method_accepts_device_arrays() -> None:
    results = run_cases(2, __file__, [case_every_method_on_device_arrays], env=SIM, timeout=600)
    report = results[case_every_method_on_device_arrays][0]
    assert sorted(report) == sorted(Compression.available())
    assert set(report.values()) == {3}


def test_gpu_native_methods_declared() -> None:
    """The methods whose ``_reduce`` runs on CuPy arrays (docs/kernels.md lists the same)."""
    from horovod_compress.compressors.registry import method_class
    native = sorted(n for n in Compression.available() if method_class(n).gpu_native)
    assert native == ["arc_topk", "global_qsgd", "none", "oktopk", "qsgd", "randk", "randk_rows",
                      "topk", "topk_rows"]
