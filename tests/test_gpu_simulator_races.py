"""The two races of Numba's CUDA simulator that ``kernels.gpu._simulator`` removes.

A CI run once failed ``check_rows`` of tests/test_kernels_gpu.py with a row
norm off by a whole row's value: two simulated threads of one block had been
given two different "shared" arrays. These checks pin both fixes down
deterministically where that is possible (the module swap: a fixed sequence
of enters and exits from two threads) and under contention otherwise (the
shared array: 64 threads released at once by a barrier, a block reduction
launched many times with a tiny GIL switch interval).

The simulator must be switched on before Numba is imported, so the checks
run in one subprocess: this file run as a script prints ``{check: "ok" |
traceback}`` as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path

if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def check_patch_installed() -> None:
    from numba.cuda.simulator import kernel, kernelapi

    from horovod_compress.kernels.gpu import _common, _simulator  # noqa: F401 - importing installs it
    assert _simulator.make_simulator_thread_safe() is True
    assert kernel.swapped_cuda_module is _simulator._counted_swap
    assert kernelapi.FakeCUDAShared.array is _simulator._shared_array
    assert kernel.BlockManager.run is _simulator._run_block


def check_block_loop_keeps_barriers_and_errors() -> None:
    """The pausing block loop: threads that meet at 20 barriers see each other's writes at
    every one, and an exception in one thread of a block is raised by the launch."""
    global cuda   # the simulator swaps a kernel's *global* ``cuda`` for its fake module
    from numba import cuda

    from horovod_compress.kernels.gpu import _common  # noqa: F401 - installs the loop

    @cuda.jit
    def rotate(out, rounds):
        buf = cuda.shared.array(32, np.int64)
        t = cuda.threadIdx.x
        buf[t] = t
        for _ in range(rounds):
            cuda.syncthreads()
            mine = buf[(t + 1) % 32]
            cuda.syncthreads()
            buf[t] = mine
        cuda.syncthreads()
        out[cuda.blockIdx.x, t] = buf[t]

    out = cuda.to_device(np.zeros((2, 32), np.int64))
    rotate[2, 32](out, 20)
    assert np.array_equal(out.copy_to_host(), np.tile((np.arange(32) + 20) % 32, (2, 1)))

    @cuda.jit
    def fail_in_one_thread(out):
        t = cuda.threadIdx.x
        cuda.syncthreads()
        if t == 5:
            out[100] = 1   # out of bounds: the simulator raises IndexError in this thread
        cuda.syncthreads()
        out[t] = t

    with pytest.raises(IndexError):   # a thread's exception fails the launch
        fail_in_one_thread[1, 32](cuda.to_device(np.zeros(32, np.int64)))


def check_module_swap_survives_overlapping_calls() -> None:
    """Thread A enters, thread B enters, A leaves: B must still see the fake module (the
    simulator's own swap restored the real one here), and it is restored when B leaves."""
    from numba import cuda
    from numba.cuda.simulator import kernel

    from horovod_compress.kernels.gpu import _common  # noqa: F401 - installs the fix
    namespace: dict = {"cuda": cuda}
    exec("def device_fn():\n    return cuda\n", namespace)
    fn = namespace["device_fn"]
    fake = object()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def thread_a() -> None:
        with kernel.swapped_cuda_module(fn, fake):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def thread_b() -> None:
        a_in.wait(10)
        with kernel.swapped_cuda_module(fn, fake):
            b_in.set()
            a_out.wait(10)
            seen["b_after_a_left"] = fn()
        seen["after_both"] = fn()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["b_after_a_left"] is fake, "the real module came back while a call was still active"
    assert seen["after_both"] is cuda and namespace["cuda"] is cuda


def check_shared_array_is_one_array_for_all_threads() -> None:
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    from horovod_compress.kernels.gpu import _common  # noqa: F401 - installs the fix
    sys.setswitchinterval(1e-6)
    for _ in range(20):
        shared = FakeCUDAShared(0)
        start = threading.Barrier(64)
        got: list = [None] * 64

        def take(i: int) -> None:
            start.wait(10)
            got[i] = shared.array(32, np.float64)

        threads = [threading.Thread(target=take, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert all(g is got[0] for g in got), len({id(g) for g in got})
        assert shared.array(0, np.dtype(np.float64)).size == 0  # dynamic shared memory still goes to the original


def check_block_reduction_under_contention() -> None:
    """The kernel whose CI failure started this: row norms by a shared-memory block
    reduction, many launches with the GIL handed over every 10 microseconds."""
    from numba import cuda

    from horovod_compress.kernels import rows as cpu
    from horovod_compress.kernels.gpu import rows as gpu
    sys.setswitchinterval(1e-5)
    rng = np.random.default_rng(7)
    for _ in range(12):
        mat = rng.standard_normal((7, 23)).astype(np.float32)
        got = gpu.row_sq_norms(cuda.to_device(mat)).copy_to_host()
        np.testing.assert_allclose(got, cpu.row_sq_norms(mat), rtol=1e-6, atol=0)


CHECKS = [f for name, f in dict(globals()).items() if name.startswith("check_")]


def _main() -> None:
    results = {}
    for check in CHECKS:
        try:
            check()
            results[check.__name__] = "ok"
        except BaseException:  # noqa: BLE001 - report every failure, keep going
            results[check.__name__] = traceback.format_exc()
    print(json.dumps(results))


@pytest.fixture(scope="module")
def simulator_results() -> dict[str, str]:
    from horovod_compress.tools.testing import simulator_check_results
    return simulator_check_results(__file__, timeout=300)


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
def test_simulator_race_fixed(simulator_results: dict[str, str], check) -> None:
    assert simulator_results.get(check.__name__) == "ok", simulator_results.get(check.__name__, "did not run")


def test_no_patch_outside_the_simulator() -> None:
    code = ("from horovod_compress.kernels.gpu import _simulator as s; "
            "from numba.cuda.simulator import kernelapi as k; "
            "assert s.make_simulator_thread_safe() is False; print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


if __name__ == "__main__":
    _main()
