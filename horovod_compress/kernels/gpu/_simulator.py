"""Thread-safety fixes and a pausing block loop for Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).

The simulator runs every CUDA thread of a block as a Python thread. Two of
its bookkeeping steps are check-then-act sequences without a lock, and both
were seen to give wrong kernel results under load (CI, a busy 2-core VM);
neither can happen on a real device:

1. ``cuda.shared.array(shape, dtype)`` -- every thread of a launch must get
   the same array, keyed by the call's source line. The simulator looks the
   key up and, when it is missing, allocates and stores a new array; two
   threads that both find it missing get two different arrays, and a block
   reduction over "shared" memory then sums the halves separately (a row norm
   off by a whole row's value in ``kernels.gpu.rows.row_sq_norms``).
2. ``swapped_cuda_module`` -- each call of a device function replaces the
   ``cuda`` module in that function's module globals by the launch's fake
   module and puts the original back on return. A thread that enters while
   another thread's call is active finds nothing to replace and saves nothing;
   when the first thread returns it restores the real module under the
   second one, whose next ``cuda.syncthreads()`` then fails with
   "module 'numba.cuda' has no attribute ..." (reported upstream as
   NVIDIA/numba-cuda pull request 690).

:func:`make_simulator_thread_safe` replaces both with locked versions: the
shared-array lookup and insert happen under one lock, and the module swap is
reference-counted per globals dictionary (the first entrant swaps, the last
one to leave restores). :func:`guard_simulator_globals` removes a third,
smaller hazard (a globals dictionary growing while it is iterated).

Not a race but a cost: the block manager's loop polls every thread's state
without pause, and so holds the GIL against the very threads it waits for
(4 million ``is_alive`` calls, three quarters of a 95 s run of the kernel
checks). :func:`make_simulator_thread_safe` also installs :func:`_run_block`,
which sleeps ``POLL_SECONDS`` between passes and releases a barrier, or
raises a thread's exception, exactly as before. All of it is a no-op outside
the simulator.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
from numba import config

SIMULATOR = bool(config.ENABLE_CUDASIM)

_LOCK = threading.Lock()
_SWAPS: dict[int, list[Any]] = {}   # id(globals) -> [active calls, {name: original cuda module}]
_PATCHED = False


def guard_simulator_globals(module_globals: dict) -> None:
    """Make a kernel module's globals safe for Numba's CUDA simulator (call at the end of the module).

    The simulator's module swap (see the module docstring) iterates a device
    function's module globals. The first warning raised from code of a module
    -- NumPy's "overflow in scalar multiply" from SplitMix64's uint64
    arithmetic, wrapping as intended -- inserts ``__warningregistry__`` into
    its globals, and a thread iterating them at that moment fails with
    "dictionary changed size during iteration". Creating the registry up front
    leaves nothing to insert.
    """
    if SIMULATOR:
        module_globals.setdefault("__warningregistry__", {})


def _shared_array(self: Any, shape: Any, dtype: Any) -> np.ndarray:
    """``FakeCUDAShared.array`` with the lookup and the insert under one lock.

    Same key as the simulator's own (the caller's file and line), so the same
    aliasing rules apply; dynamic shared memory (``shape == 0``) is left to
    the original, which has no race.
    """
    if shape == 0:
        return _ORIGINAL_SHARED_ARRAY(self, shape, dtype)
    from numba.core import types
    from numba.np import numpy_support
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    caller = sys._getframe(1)
    key = (caller.f_code.co_filename, caller.f_lineno)
    with _LOCK:
        found = self._allocations.get(key)
        if found is None:
            found = self._allocations[key] = np.empty(shape, dtype)
    return found


@contextmanager
def _counted_swap(fn: Any, fake_cuda_module: Any) -> Iterator[None]:
    """``swapped_cuda_module`` made reentrant across threads: per globals dictionary, the
    first active call swaps ``cuda`` for the fake module and the last one restores it."""
    from numba import cuda
    globs = fn.__globals__
    key = id(globs)
    with _LOCK:
        entry = _SWAPS.get(key)
        if entry is None:
            originals = {name: value for name, value in list(globs.items()) if value is cuda}
            globs.update(dict.fromkeys(originals, fake_cuda_module))
            entry = _SWAPS[key] = [0, originals]
        entry[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                globs.update(entry[1])
                del _SWAPS[key]


POLL_SECONDS = 1e-4   # between two passes over a block's threads (a barrier waits at most this long)


def _run_block(self: Any, grid_point: Any, *args: Any) -> None:
    """``BlockManager.run`` that sleeps between its passes over the threads.

    One pass: a thread's exception aborts the others and is raised; once every
    live thread waits in ``syncthreads()`` they are all released; the launch
    ends when no thread is alive. The simulator's own loop does the same
    without ever pausing.
    """
    from numba.cuda.simulator.kernel import BlockThread

    def body() -> None:
        self._f(*args)

    threads = [BlockThread(body, self, grid_point, point, self._debug)
               for point in np.ndindex(*self._block_dim)]
    for thread in threads:
        thread.start()
    live = threads
    while live:
        time.sleep(POLL_SECONDS)
        _raise_first_exception(threads, abort=True)
        live = [thread for thread in live if thread.is_alive()]
        if live and all(thread.syncthreads_blocked for thread in live):
            for thread in live:
                thread.syncthreads_blocked = False
                thread.syncthreads_event.set()
    _raise_first_exception(threads, abort=False)


def _raise_first_exception(threads: list[Any], abort: bool) -> None:
    """Raise the first simulated thread's exception, after telling the others to abort."""
    failed = next((thread for thread in threads if thread.exception), None)
    if failed is None:
        return
    if abort:
        for thread in threads:
            thread.abort = True
            thread.syncthreads_blocked = False
            thread.syncthreads_event.set()
    raise failed.exception[0].with_traceback(failed.exception[1])


_ORIGINAL_SHARED_ARRAY: Any = None


def make_simulator_thread_safe() -> bool:
    """Install the two locked replacements and the pausing block loop into Numba's simulator
    (once; later calls do nothing).

    Returns whether the simulator is patched (False outside the simulator, or
    when this Numba's simulator lacks the patched names).
    """
    global _ORIGINAL_SHARED_ARRAY, _PATCHED
    if not SIMULATOR:
        return False
    with _LOCK:
        if _PATCHED:
            return True
        from numba.cuda.simulator import kernel, kernelapi
        if not (hasattr(kernelapi, "FakeCUDAShared") and hasattr(kernel, "swapped_cuda_module")
                and hasattr(kernel, "BlockManager")):
            return False
        _ORIGINAL_SHARED_ARRAY = kernelapi.FakeCUDAShared.array
        kernelapi.FakeCUDAShared.array = _shared_array
        kernel.swapped_cuda_module = _counted_swap      # what FakeCUDAKernel.__call__ looks up
        kernelapi.swapped_cuda_module = _counted_swap
        kernel.BlockManager.run = _run_block
        _PATCHED = True
        return True


__all__ = ["SIMULATOR", "guard_simulator_globals", "make_simulator_thread_safe"]
