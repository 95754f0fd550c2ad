"""Custom MPI reduction operators (``MPI.Op.Create``) with Numba-compiled inner loops.

* :func:`exp_sum_op` -- Global-QSGD's exponential reduce (paper, Algorithm 2)
  on 8-bit codes (one per byte) or 4-bit codes (two per byte). It is
  stochastic: its random words come from a per-rank stream that the caller
  seeds with :func:`reduce_stream` before the collective (key derived from
  seed, tensor name, step and rank), so a run is reproducible.
* :func:`nibble_sum_op` -- lane-wise sum of packed signed 4-bit integers
  (Global-QSGD's 4-bit linear dithering), deterministic.

Why :func:`allreduce_reduce_once` and not ``MPI_Allreduce`` for a stochastic
operator: MPI's allreduce algorithms may compute the same partial sum on two
ranks (recursive doubling does, for every element), and two independent
random roundings of the same sum differ -- the ranks would silently end with
different "averages". Reduce-scatter followed by allgather(v) reduces every
element on exactly one rank and then copies the result, so all ranks hold the
same bits. It moves the same volume as a ring allreduce, 2N(P-1)/P per rank,
and is counted as one allreduce of N bytes.

Operators are created lazily, once per process, and cached. MPI calls an
operator on the thread that entered the collective; a lock serialises the
stream so concurrent collectives with the stochastic operator cannot interleave
their random words.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import numpy as np

from ..kernels.exp_reduce import exp_reduce4_into, exp_reduce8_into
from ..kernels.quantize import nibble_add_into


class _Stream:
    """Per-rank state of the operator's counter-based generator."""

    def __init__(self) -> None:
        self.key = np.uint64(0)
        self.counter = 0
        self.saturated = 0
        self.calls = 0
        self.active = False


_STREAM = _Stream()
_STREAM_LOCK = threading.RLock()
_OPS: dict[str, Any] = {}   # MPI.Op objects (mpi4py imported on first use)


@contextlib.contextmanager
def reduce_stream(key: int) -> Iterator[_Stream]:
    """Seed the stochastic operators' per-rank stream for the enclosed collective.

    Inside, operator calls draw consecutive words ``0, 1, 2, ...`` of stream
    ``key`` (see :mod:`horovod_compress.kernels.quantize`); the yielded object
    reports ``saturated`` (elements clamped at 1/2) and ``calls`` afterwards.
    """
    with _STREAM_LOCK:
        _STREAM.key = np.uint64(key)
        _STREAM.counter = 0
        _STREAM.saturated = 0
        _STREAM.calls = 0
        _STREAM.active = True
        try:
            yield _STREAM
        finally:
            _STREAM.active = False


def _exp_apply(bits: int, inbuf: Any, inoutbuf: Any) -> None:
    a = np.frombuffer(inbuf, dtype=np.uint8)
    b = np.frombuffer(inoutbuf, dtype=np.uint8)
    # Outside reduce_stream() the stream simply continues (never raise inside MPI).
    counter = np.uint64(_STREAM.counter)
    # A separate output lets LLVM vectorise the loop (in place it is ~4x slower); then copy.
    # The output is a per-thread scratch buffer reused across calls: a fresh one per call
    # costs a page fault per 4 KiB, about as much as the reduction itself (issue 21).
    out = _scratch(b.size)
    if bits == 8:
        sat = exp_reduce8_into(a, b, out, _STREAM.key, counter)
        _STREAM.counter += a.size
    else:
        sat = exp_reduce4_into(a, b, out, _STREAM.key, counter)
        _STREAM.counter += 2 * a.size
    b[...] = out
    _STREAM.saturated += int(sat)
    _STREAM.calls += 1


_SCRATCH = threading.local()


def _scratch(n: int) -> np.ndarray:
    """An uninitialised uint8 buffer of ``n`` bytes, reused by this thread's operator calls."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1 << 16), dtype=np.uint8)
        _SCRATCH.buf = buf
    return buf[:n]


def _exp8(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    _exp_apply(8, inbuf, inoutbuf)


def _exp4(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    _exp_apply(4, inbuf, inoutbuf)


def _nibble_sum(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    a = np.frombuffer(inbuf, dtype=np.uint8)
    b = np.frombuffer(inoutbuf, dtype=np.uint8)
    out = np.empty_like(b)
    nibble_add_into(a, b, out)
    b[...] = out


def exp_sum_op(bits: int) -> MPI.Op:
    """The exponential-reduce operator on ``bits``-bit codes (8: one per byte, 4: two per byte).

    Use it on ``MPI.UINT8_T`` buffers inside :func:`reduce_stream`; it is
    commutative in distribution (Algorithm 2 is symmetric in its operands).
    """
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    from mpi4py import MPI
    name = f"exp{bits}"
    if name not in _OPS:
        _OPS[name] = MPI.Op.Create(_exp8 if bits == 8 else _exp4, commute=True)
    return _OPS[name]


def nibble_sum_op() -> MPI.Op:
    """Lane-wise sum of signed 4-bit integers packed two per byte (``MPI.UINT8_T``)."""
    from mpi4py import MPI
    if "nibble" not in _OPS:
        _OPS["nibble"] = MPI.Op.Create(_nibble_sum, commute=True)
    return _OPS["nibble"]


def block_counts(n: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` contiguous blocks covering ``n`` items (the first n % parts get one more)."""
    counts = np.full(parts, n // parts, dtype=np.int64)
    counts[: n % parts] += 1
    return counts


def allreduce_reduce_once(comm: Any, buf: np.ndarray, op: MPI.Op) -> np.ndarray:
    """Allreduce of a uint8 buffer with ``op`` in which each element is reduced on one rank only.

    Reduce-scatter (block j to rank j) then allgatherv, through the raw mpi4py
    communicator; bytes are accounted as one allreduce of ``buf.nbytes``
    (2N(P-1)/P each way), what a ring allreduce moves. Returns a new array
    identical on every rank.
    """
    from mpi4py import MPI
    send = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    p, rank = comm.size, comm.rank
    if p == 1:
        return send.copy()
    counts = block_counts(send.size, p)
    displs = np.zeros(p, dtype=np.int64)
    np.cumsum(counts[:-1], out=displs[1:])
    mine = np.empty(int(counts[rank]), dtype=np.uint8)
    out = np.empty_like(send)
    with comm.in_mpi("allreduce"):
        comm.comm.Reduce_scatter([send, MPI.UINT8_T], [mine, MPI.UINT8_T],
                                 recvcounts=[int(c) for c in counts], op=op)
        comm.comm.Allgatherv([mine, MPI.UINT8_T], [out, counts, displs, MPI.UINT8_T])
    vol = 2.0 * send.nbytes * (p - 1) / p
    comm._account("allreduce", vol, vol)
    return out


# ---------------------------------------------------------------------------
# The same reductions without MPI: ``local_reduce(name, a, inout)`` folds the
# bytes of ``a`` into ``inout`` with the kernel the MPI operator runs. Backends
# without user-defined operators (torch.distributed) reduce with it after an
# alltoall (``Communicator.allreduce_custom``).

def _add16(kind: str) -> Any:
    def add(inbuf: Any, inoutbuf: Any, datatype: Any = None) -> None:
        from ..kernels.halfprec import add16_into
        add16_into(np.frombuffer(inbuf, dtype=np.uint16), np.frombuffer(inoutbuf, dtype=np.uint16),
                   kind)
    return add


#: name -> (inner loop ``f(inbuf, inoutbuf, datatype)``, bytes per element, reduce on one rank only)
CUSTOM_REDUCTIONS: dict[str, tuple[Any, int, bool]] = {
    "exp8": (_exp8, 1, True),
    "exp4": (_exp4, 1, True),
    "nibble": (_nibble_sum, 1, False),
    "fp16_sum": (_add16("fp16"), 2, False),
    "bf16_sum": (_add16("bf16"), 2, False),
}


def check_custom(name: str) -> tuple[Any, int, bool]:
    """The :data:`CUSTOM_REDUCTIONS` entry of ``name`` (``ValueError`` naming the choices otherwise)."""
    try:
        return CUSTOM_REDUCTIONS[name]
    except KeyError:
        raise ValueError(f"custom reduction must be one of {sorted(CUSTOM_REDUCTIONS)}, "
                         f"got {name!r}") from None


def local_reduce(name: str, a: np.ndarray, inout: np.ndarray) -> None:
    """``inout <- a (op) inout`` with the inner loop of reduction ``name`` (contiguous buffers)."""
    fn, _item, _once = check_custom(name)
    fn(a, inout, None)


def mpi_custom_op(name: str) -> tuple[Any, Any]:
    """``(MPI datatype, MPI.Op)`` of reduction ``name`` for ``Allreduce`` (created once)."""
    from mpi4py import MPI
    fn, item, _once = check_custom(name)
    key = f"custom:{name}"
    if key not in _OPS:
        dtype = MPI.UINT8_T if item == 1 else MPI.BYTE.Create_contiguous(item).Commit()
        _OPS[key] = (dtype, MPI.Op.Create(fn, commute=True))
    return _OPS[key]
