"""Device plumbing shared by the GPU kernels: allocation, launch shapes, scan and compaction.

Arrays. A GPU kernel takes *device arrays*: CuPy arrays, or Numba device
arrays (``numba.cuda.to_device``; under ``NUMBA_ENABLE_CUDASIM=1`` the
simulator's stand-ins). Every allocation is made "like" an input, so a CuPy
input gives CuPy outputs and a Numba input gives Numba outputs. CuPy is
imported only when a CuPy array is seen.

Launch shapes. ``TPB`` threads per block (256 on a device, 32 in the
simulator, which runs every thread as a Python thread); element-wise kernels
use grid-stride loops over at most ``MAX_BLOCKS`` blocks.

Ordered stream compaction. ``flatnonzero(pred)`` on a device, with the output
in ascending order (the CPU kernels return sorted COO indices, so the GPU
ones must too). The index range [0, n) is cut into one contiguous chunk per
block; pass 1 counts the hits of every chunk, the host turns the (at most
``MAX_BLOCKS``) counts into chunk offsets (one small copy each way, which is
also where the output size must become known to allocate it), pass 2 walks
each chunk one tile of ``TILE = TPB * ITEMS`` elements at a time: every
thread evaluates the predicate on ``ITEMS`` consecutive elements (kept as a
bit mask), a block-wide Hillis-Steele scan of the per-thread counts gives
every thread its first slot, and the thread writes its hits in order (the
"blocked arrangement" of CUB's block scans). The same two passes with values
instead of flags make :func:`exclusive_scan`.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from numba import cuda, int64

from ..arrays import is_cupy, is_gpu_array, to_device_like, to_host  # noqa: F401 - re-exported
from ._simulator import SIMULATOR, guard_simulator_globals, make_simulator_thread_safe  # noqa: F401 - re-exported

make_simulator_thread_safe()  # a no-op on a device; see _simulator for the two races it removes

TPB = 32 if SIMULATOR else 256          # threads per block (a power of two)
ITEMS = 16 if SIMULATOR else 8          # consecutive items per thread in a scan tile (<= 64)
TILE = TPB * ITEMS                      # items per block-wide scan
MAX_BLOCKS = 3 if SIMULATOR else 1024


# ------------------------------------------------------------------- arrays
def is_device_array(x: Any) -> bool:
    """CuPy arrays, Numba device arrays (real or simulated), anything with a CUDA array interface."""
    return is_gpu_array(x)


def _cupy():
    import cupy  # noqa: PLC0415 - optional dependency, imported on first CuPy array
    return cupy


def empty(like: Any, shape: Any, dtype: Any) -> Any:
    """Uninitialised device array of ``shape``/``dtype`` of the same kind as ``like``."""
    if is_cupy(like):
        return _cupy().empty(shape, dtype=dtype)
    return cuda.device_array(shape, dtype=dtype)


def zeros(like: Any, shape: Any, dtype: Any) -> Any:
    """Zero-filled device array of the same kind as ``like`` (filled on the device)."""
    if is_cupy(like):
        return _cupy().zeros(shape, dtype=dtype)
    out = cuda.device_array(shape, dtype=dtype)
    fill(out, 0)
    return out


def to_device(host: np.ndarray, like: Any) -> Any:
    """Copy a NumPy array to the device, as the same kind of array as ``like``."""
    return to_device_like(host, like)


def flat(x: Any, name: str = "x") -> Any:
    """A contiguous 1-D view of device array ``x`` (CuPy copies if needed, Numba must be contiguous)."""
    if not is_device_array(x):
        raise ValueError(f"{name} must be a device array (CuPy or numba.cuda), got {type(x).__name__}")
    if is_cupy(x):
        return _cupy().ascontiguousarray(x).reshape(-1)
    if not x.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous")
    return x.reshape(x.size)


def dtype_of(x: Any) -> np.dtype:
    return np.dtype(x.dtype)


def blocks_for(n: int) -> int:
    """Blocks of an element-wise grid-stride launch over ``n`` items (>= 1)."""
    return max(1, min(MAX_BLOCKS, (int(n) + TPB - 1) // TPB))


def launch(kernel: Any, n: int, *args: Any) -> None:
    """Run the grid-stride ``kernel(*args)`` over ``n`` items (:func:`blocks_for`); nothing when n = 0."""
    if n:
        kernel[blocks_for(n), TPB](*args)


def chunking(n: int) -> tuple[int, int]:
    """(blocks, chunk): contiguous chunks of a multiple of TILE items, one per block."""
    nb = max(1, min(MAX_BLOCKS, (int(n) + TILE - 1) // TILE))
    per = (int(n) + nb - 1) // nb
    chunk = ((per + TILE - 1) // TILE) * TILE
    nb = max(1, (int(n) + chunk - 1) // chunk) if n > 0 else 1
    return nb, chunk


# ------------------------------------------------------------------ kernels
if SIMULATOR:
    @cuda.jit(device=True)
    def ldexp(x, e):
        """x * 2^e, exact (the simulator's Python ``math.ldexp`` wants a Python int)."""
        return math.ldexp(x, int(e))
else:
    @cuda.jit(device=True)
    def ldexp(x, e):
        """x * 2^e, exact (libdevice ``__nv_ldexp`` takes an int32 exponent)."""
        return math.ldexp(x, np.int32(e))


GRID_ARGS = 6   # arguments of a grid_stride body after the index


def grid_stride(body: Callable) -> Callable[..., None]:
    """``run(n, *args)``: ``body(i, a0, ..., a5)`` for every i in [0, n), one grid-stride launch.

    ``body`` is a device function of the index and ``GRID_ARGS`` arguments
    (``run`` passes 0 for those not given); the launch is :func:`launch`'s.
    ``body`` must not use ``cuda`` itself (atomics, shared memory): the
    simulator swaps the ``cuda`` global of the kernel's module (this one) for
    the whole launch, but that of a device function's module only while one
    thread runs it, so another thread may find it restored.
    """
    @cuda.jit
    def kernel(n, a0, a1, a2, a3, a4, a5):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < n:
            body(i, a0, a1, a2, a3, a4, a5)
            i += stride

    def run(n: int, *args: Any) -> None:
        launch(kernel, n, np.int64(n), *args, *(0,) * (GRID_ARGS - len(args)))

    return run


@cuda.jit(device=True)
def _fill_at(i, a, value, _2, _3, _4, _5):
    a[i] = value


@cuda.jit(device=True)
def _divide_at(i, a, d, _2, _3, _4, _5):
    a[i] = a[i] / d


@cuda.jit(device=True)
def _cast_at(i, src, dst, _2, _3, _4, _5):
    dst[i] = src[i]


@cuda.jit(device=True)
def _gather_at(i, src, idx, out, _3, _4, _5):
    out[i] = src[idx[i]]


_FILL = grid_stride(_fill_at)
_DIVIDE = grid_stride(_divide_at)
_CAST = grid_stride(_cast_at)
_GATHER = grid_stride(_gather_at)


def _with_scalar_inplace(a: Any, scalar: Any, run: Callable, cupy_op: Callable) -> None:
    """Run an in-place element-wise ``run(n, a_flat, scalar)`` (:func:`grid_stride`) on a contiguous
    device array.

    ``scalar`` is converted to ``a``'s dtype first; CuPy arrays use
    ``cupy_op(a, scalar)`` instead of the Numba kernel; an empty ``a`` is left alone.
    """
    if a.size == 0:
        return
    s = a.dtype.type(scalar)
    if is_cupy(a):
        cupy_op(a, s)
        return
    v = a.reshape(a.size)
    run(v.size, v, s)


def _cupy_fill(a: Any, value: Any) -> None:
    a.fill(value)


def _cupy_divide(a: Any, divisor: Any) -> None:
    a /= divisor


def fill(a: Any, value: Any) -> None:
    """a[:] = value for a contiguous device array of any shape."""
    _with_scalar_inplace(a, value, _FILL, _cupy_fill)


def divide_inplace(a: Any, divisor: Any) -> None:
    """a[:] /= divisor on the device (in a's dtype), for a contiguous array of any shape."""
    _with_scalar_inplace(a, divisor, _DIVIDE, _cupy_divide)


def cast(x: Any, dtype: Any) -> Any:
    """A 1-D copy of ``x`` converted to ``dtype`` on the device (C casting rules)."""
    out = empty(x, x.size, dtype)
    _CAST(x.size, x, out)
    return out


@cuda.jit(device=True)
def block_exclusive_scan(sh, t, v):
    """Exclusive prefix sum of ``v`` over the block's threads: (prefix, block total).

    Hillis-Steele on a shared array of TPB int64; every thread must call it.
    """
    sh[t] = v
    cuda.syncthreads()
    off = 1
    while off < TPB:
        add = sh[t - off] if t >= off else 0
        cuda.syncthreads()
        sh[t] += add
        cuda.syncthreads()
        off *= 2
    incl = sh[t]
    total = sh[TPB - 1]
    cuda.syncthreads()
    return incl - v, total


@cuda.jit(device=True)
def block_sum(sh, t, v):
    """Sum of ``v`` over the block's threads, returned to every thread (shared array of TPB)."""
    sh[t] = v
    cuda.syncthreads()
    s = TPB // 2
    while s > 0:
        if t < s:
            sh[t] += sh[t + s]
        cuda.syncthreads()
        s //= 2
    total = sh[0]
    cuda.syncthreads()
    return total


def _chunk_offsets(counts_dev: Any) -> tuple[np.ndarray, int]:
    counts = to_host(counts_dev).astype(np.int64)
    offsets = np.zeros(counts.size, np.int64)
    if counts.size > 1:
        np.cumsum(counts[:-1], out=offsets[1:])
    return offsets, int(counts.sum())


def chunk_sums_kernel(weight: Callable) -> Any:
    """A kernel ``(n, chunk, a0, a1, a2, a3, sums)``: ``sums[b]`` = sum of ``weight(a0..a3, i)``
    over block b's chunk of [0, n) (int64; pass 1 of the compaction and of the scan)."""
    @cuda.jit
    def kernel(n, chunk, a0, a1, a2, a3, sums):
        sh = cuda.shared.array(TPB, int64)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        start = b * chunk
        stop = min(start + chunk, n)
        s = int64(0)
        i = start + t
        while i < stop:
            s += weight(a0, a1, a2, a3, i)
            i += TPB
        total = block_sum(sh, t, s)
        if t == 0:
            sums[b] = total

    return kernel


def chunk_tiles_kernel(tally: Callable, emit: Callable) -> Any:
    """Pass 2 of the compaction and of the scan: ``(n, chunk, a0, a1, a2, a3, offsets, out)``.

    Block b walks its chunk of [0, n) one tile at a time; every thread takes
    ``ITEMS`` consecutive items ``[first, last)``: ``tally(a0..a3, first, last)``
    gives their int64 weight and a bit mask (kept for ``emit``), a block-wide
    exclusive scan of the weights plus ``offsets[b]`` gives the thread's first
    output position ``w``, and ``emit(a0..a3, first, last, mask, w, out)``
    writes its items.
    """
    @cuda.jit
    def kernel(n, chunk, a0, a1, a2, a3, offsets, out):
        sh = cuda.shared.array(TPB, int64)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        start = b * chunk
        stop = min(start + chunk, n)
        base = offsets[b]
        tile = start
        while tile < stop:
            first = tile + t * ITEMS
            last = min(first + ITEMS, stop)
            s, mask = tally(a0, a1, a2, a3, first, last)
            excl, total = block_exclusive_scan(sh, t, s)
            emit(a0, a1, a2, a3, first, last, mask, base + excl, out)
            base += total
            tile += TILE

    return kernel


class Compactor:
    """Ordered compaction for one predicate ``pred(a0, a1, a2, a3, i) -> bool``.

    ``count(n, a0..a3, like)`` counts the i in [0, n) with pred true;
    ``indices(n, a0..a3, like)`` returns them ascending as an int64 device
    array. Unused arguments are passed as 0.
    """

    def __init__(self, pred: Callable) -> None:
        @cuda.jit(device=True)
        def hit(a0, a1, a2, a3, i):
            return int64(1) if pred(a0, a1, a2, a3, i) else int64(0)

        @cuda.jit(device=True)
        def tally(a0, a1, a2, a3, first, last):
            """(hits in [first, last), their bit mask: bit i - first)."""
            mask = np.uint64(0)
            c = int64(0)
            for i in range(first, last):
                if pred(a0, a1, a2, a3, i):
                    mask |= np.uint64(1) << np.uint64(i - first)
                    c += 1
            return c, mask

        self._count = chunk_sums_kernel(hit)
        self._write = chunk_tiles_kernel(tally, _emit_hits)

    def _counts(self, n: int, a0: Any, a1: Any, a2: Any, a3: Any, like: Any) -> tuple[Any, int, int]:
        nb, chunk = chunking(n)
        counts = empty(like, nb, np.int64)
        self._count[nb, TPB](n, chunk, a0, a1, a2, a3, counts)
        return counts, nb, chunk

    def count(self, n: int, a0: Any, a1: Any, a2: Any, a3: Any, like: Any) -> int:
        if n <= 0:
            return 0
        counts, _, _ = self._counts(n, a0, a1, a2, a3, like)
        return int(to_host(counts).sum())

    def indices(self, n: int, a0: Any, a1: Any, a2: Any, a3: Any, like: Any) -> Any:
        if n <= 0:
            return empty(like, 0, np.int64)
        counts, nb, chunk = self._counts(n, a0, a1, a2, a3, like)
        offsets, total = _chunk_offsets(counts)
        out = empty(like, total, np.int64)
        if total:
            self._write[nb, TPB](n, chunk, a0, a1, a2, a3, to_device(offsets, like), out)
        return out


@cuda.jit(device=True)
def _emit_hits(a0, a1, a2, a3, first, last, mask, w, out):
    """The compaction's output: the hits of [first, last) (``mask``), in order from ``out[w]``."""
    for i in range(first, last):
        if (mask >> np.uint64(i - first)) & np.uint64(1):
            out[w] = i
            w += 1


@cuda.jit(device=True)
def _value(vals, a1, a2, a3, i):
    return int64(vals[i])


@cuda.jit(device=True)
def _sum_values(vals, a1, a2, a3, first, last):
    s = int64(0)
    for i in range(first, last):
        s += int64(vals[i])
    return s, np.uint64(0)


@cuda.jit(device=True)
def _emit_prefixes(vals, a1, a2, a3, first, last, mask, w, out):
    """The scan's output: the exclusive prefix sum of every item of [first, last), from ``w``."""
    for i in range(first, last):
        out[i] = w
        w += int64(vals[i])


_chunk_sums_kernel = chunk_sums_kernel(_value)
_chunk_scan_kernel = chunk_tiles_kernel(_sum_values, _emit_prefixes)


def exclusive_scan(vals: Any) -> tuple[Any, int]:
    """Exclusive prefix sums of an integer device array (int64 output) and the total."""
    n = int(vals.size)
    out = empty(vals, n, np.int64)
    if n == 0:
        return out, 0
    nb, chunk = chunking(n)
    sums = empty(vals, nb, np.int64)
    _chunk_sums_kernel[nb, TPB](n, chunk, vals, 0, 0, 0, sums)
    offsets, total = _chunk_offsets(sums)
    _chunk_scan_kernel[nb, TPB](n, chunk, vals, 0, 0, 0, to_device(offsets, vals), out)
    return out, total


@cuda.jit
def _minmax_kernel(vals, n, mins, maxs):
    shmin = cuda.shared.array(TPB, int64)
    shmax = cuda.shared.array(TPB, int64)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    lo = int64(9223372036854775807)
    hi = int64(-9223372036854775807 - 1)
    while i < n:
        v = int64(vals[i])
        lo = min(lo, v)
        hi = max(hi, v)
        i += stride
    shmin[t] = lo
    shmax[t] = hi
    cuda.syncthreads()
    s = TPB // 2
    while s > 0:
        if t < s:
            shmin[t] = min(shmin[t], shmin[t + s])
            shmax[t] = max(shmax[t], shmax[t + s])
        cuda.syncthreads()
        s //= 2
    if t == 0:
        mins[cuda.blockIdx.x] = shmin[0]
        maxs[cuda.blockIdx.x] = shmax[0]


def int_min_max(vals: Any) -> tuple[int, int]:
    """(min, max) of a non-empty integer device array."""
    nb = blocks_for(vals.size)
    mins = empty(vals, nb, np.int64)
    maxs = empty(vals, nb, np.int64)
    _minmax_kernel[nb, TPB](vals, int(vals.size), mins, maxs)
    return int(to_host(mins).min()), int(to_host(maxs).max())


def gather(src: Any, idx: Any, dtype: Any = None) -> Any:
    """out[j] = src[idx[j]] (1-D), in ``dtype`` (default: src's)."""
    out = empty(src, idx.size, dtype if dtype is not None else src.dtype)
    _GATHER(idx.size, src, idx, out)
    return out


guard_simulator_globals(globals())
