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

:func:`ring_reduce_once` is the same reduce-scatter + allgather as a ring on
point-to-point segments, with the operator's kernel called directly and the
caller's quantization / dequantization filling the waits (Global-QSGD's
8-bit exponential path for large payloads).

Operators are created lazily, once per process, and cached. MPI calls an
operator on the thread that entered the collective; a lock serialises the
stream so concurrent collectives with the stochastic operator cannot interleave
their random words.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np

from ..kernels.exp_reduce import exp_reduce4_into, exp_reduce8_into
from ..kernels.quantize import nibble_add_into
from .accounting import ring_allreduce_rank_bytes
from ..kernels.halfprec import add16_into


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

    Inside, each operator call takes the next ``counter`` of stream ``key``
    (see :mod:`horovod_compress.kernels.quantize`), starting at 0, so no two
    calls of one collective share a random word: an 8-bit call of n bytes
    decides byte i with :func:`~horovod_compress.kernels.exp_reduce.lane_word`
    (key, counter + i) and advances ``counter`` by n rounded up to a multiple
    of 8 (every call then starts on a stream word, the kernel's one-SplitMix64-
    per-8-bytes path); a 4-bit call of n bytes uses words counter + 2i and
    counter + 2i + 1 and advances it by 2n. One collective uses one operator
    (the two layouts index the stream differently). The yielded object reports
    ``saturated`` (elements clamped at 1/2), ``calls`` and ``counter`` afterwards.
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
    # costs a page fault per 4 KiB, about as much as the reduction itself.
    out = _scratch(b.size)
    if bits == 8:
        sat = exp_reduce8_into(a, b, out, _STREAM.key, counter)
        _STREAM.counter += (a.size + 7) & ~7     # the next call starts on a stream word
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
    comm.count("allreduce", *ring_allreduce_rank_bytes(send.nbytes, p, rank))
    return out


# ---------------------------------------------------------------------------
# Pipelined ring: reduce-scatter + allgather on point-to-point messages, the
# operator's kernel called directly (no MPI user operator), and the caller's
# quantization / dequantization run between progress calls.

RING_TAG = 7919   # the tag of the ring's messages (one tag: ordered matching per neighbour)


#: The ring's (segment, slice) bytes between hosts: segments below Open MPI's 64 KiB TCP eager
#: limit flow while the ranks compute; each larger one waits for a rendezvous handshake behind the
#: data queued on a shaped link (fp16 at P = 2, 100 Mbit: 1 MiB segments carried 0.066 Gbit/s,
#: Global-QSGD's 60 KiB ones 0.093 in the same run).
NETWORK_RING_PIECES = (61440, 1 << 16)
_ONE_NODE: dict[int, bool] = {}


def all_ranks_on_one_node(comm: Any) -> bool:
    """Whether every rank of ``comm`` (the mpi4py :class:`Communicator`) shares this node's memory.

    ``MPI_Comm_split_type(COMM_TYPE_SHARED)``, asked once per communicator and
    cached: a collective, so every rank must reach its first call together (the
    rings call it at their first call on ``comm``, which every rank makes).
    """
    key = id(comm.comm)
    if key not in _ONE_NODE:
        from mpi4py import MPI
        local = comm.comm.Split_type(MPI.COMM_TYPE_SHARED)
        _ONE_NODE[key] = local.Get_size() == comm.size
        local.Free()
    return _ONE_NODE[key]


def ring_piece_sizes(comm: Any, one_node: tuple[int, int]) -> tuple[int, int]:
    """(segment_bytes, slice_bytes) for the rings on ``comm``: ``one_node`` when every rank shares
    this node's memory (copies through shared memory progress only inside MPI calls, so fewer,
    larger pieces cost less Python), else :data:`NETWORK_RING_PIECES`."""
    return one_node if all_ranks_on_one_node(comm) else NETWORK_RING_PIECES


def ring_segments(size: int, start: int, segment_bytes: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of about ``segment_bytes`` covering ``size`` bytes from ``start``
    (at least one range, empty when ``size`` is 0)."""
    k = max(1, -(-size // max(1, segment_bytes)))
    cuts = [start + (size * i) // k for i in range(k + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def ring_reduce_once(comm: Any, nbytes: int, produce: Callable[[int, int], None], own: np.ndarray,
                     reduce: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], int],
                     consume: Callable[[int, int], None] | None = None,
                     **options: Any) -> tuple[np.ndarray, int]:
    """Allreduce of ``own`` (``nbytes`` uint8) in which every byte is reduced on one rank only,
    as a pipelined ring; returns (result identical on every rank, sum of ``reduce``'s returns).

    The structure of :func:`allreduce_reduce_once` -- reduce-scatter (block j
    to rank j, ``block_counts``) then allgather, 2N(P-1)/P bytes each way,
    accounted as one allreduce of N bytes -- written as the ring algorithm on
    ``Isend``/``Irecv`` (Patarasuk and Yuan, "Bandwidth optimal all-reduce
    algorithms for clusters of workstations", JPDC 2009): at reduce-scatter
    step s rank r sends block r-s-1 to r+1 and receives block r-s-2 from r-1,
    which it reduces with its own; after P-1 steps it holds block r, and P-1
    allgather steps pass the finished blocks around. Each block travels in
    segments of ``segment_bytes``, so a segment is reduced and forwarded while
    the next one is on the wire. The default, 60 KiB, stays below Open MPI's
    TCP eager limit (64 KiB): such messages need no rendezvous handshake, which
    progresses only inside MPI calls, so they keep flowing while this rank
    computes (on the emulated 1 Gbit cluster the time inside MPI fell below
    the wire time with 60 KiB segments and stayed at it with 256 KiB ones).

    Because the operator runs here, not inside MPI, the caller's work fills
    the waits: ``own`` is produced lazily by ``produce(lo, hi)`` (fill
    own[lo:hi], e.g. quantize), slice by slice in the order the ring needs the
    blocks (r-1 first, r last), between ``MPI_Test`` calls that also progress
    the transfers; ``consume(lo, hi)`` is called once for every finished range
    of the result (e.g. dequantize) while later segments still arrive;
    ``result`` (``nbytes`` uint8, optional) is the buffer the result is built in,
    ``scratch`` two more (received and forwarded partial sums) a caller may reuse
    across calls (a fresh buffer costs a page fault per 4 KiB).
    ``reduce(a, b, out, lo, hi)`` must set out[lo:hi] = a[lo:hi] (op) b[lo:hi]
    (a: the partial sum received, b: ``own``) and return a count. ``options``:
    ``segment_bytes`` (61440), ``slice_bytes`` (65536), ``result``, ``scratch``,
    as :func:`ring_reduce_once_items` takes them.
    """
    return ring_reduce_once_items(comm, nbytes, 1, produce, own, reduce, consume, **options)


def ring_reduce_once_items(comm: Any, nitems: int, itemsize: int, produce: Callable[[int, int], None],
                           own: np.ndarray,
                           reduce: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], int],
                           consume: Callable[[int, int], None] | None = None,
                           segment_bytes: int = 61440, slice_bytes: int = 1 << 16,
                           result: np.ndarray | None = None,
                           scratch: tuple[np.ndarray, np.ndarray] | None = None,
                           ) -> tuple[np.ndarray, int]:
    """:func:`ring_reduce_once` on ``nitems`` items of ``itemsize`` bytes each: every block,
    segment and slice boundary falls between items, so the callbacks (which still receive
    byte offsets, multiples of ``itemsize``) never see a split item.

    Blocks: ``block_counts(nitems, P)`` items (block j to rank j); segments and
    slices of about ``segment_bytes`` / ``slice_bytes`` rounded to whole items.
    Bytes moved and accounted as :func:`ring_reduce_once` of ``nitems * itemsize`` bytes.
    ``own``, ``result`` and ``scratch`` are uint8 buffers of ``nitems * itemsize`` bytes
    (e.g. ``words.view(np.uint8)``).
    """
    counts = block_counts(nitems, comm.size) * itemsize
    return _ring(comm, nitems * itemsize, counts, segment_bytes, slice_bytes, itemsize, produce,
                 own, reduce, consume, result, scratch)


def _item_segments(size: int, start: int, segment_bytes: int, itemsize: int) -> list[tuple[int, int]]:
    """:func:`ring_segments` with every cut on a multiple of ``itemsize`` (``size``, ``start`` are)."""
    if itemsize == 1:
        return ring_segments(size, start, segment_bytes)
    return [(lo * itemsize, hi * itemsize) for lo, hi in
            ring_segments(size // itemsize, start // itemsize, max(1, segment_bytes // itemsize))]


def _ring(comm: Any, nbytes: int, counts: np.ndarray, segment_bytes: int, slice_bytes: int,
          itemsize: int, produce: Callable[[int, int], None], own: np.ndarray,
          reduce: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], int],
          consume: Callable[[int, int], None] | None, result: np.ndarray | None,
          scratch: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, int]:
    """The ring of :func:`ring_reduce_once` for blocks of ``counts`` bytes (see there)."""
    from mpi4py import MPI
    p, r = comm.size, comm.rank
    mpi = comm.comm
    starts = np.zeros(p + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    segs = [_item_segments(int(counts[j]), int(starts[j]), segment_bytes, itemsize) for j in range(p)]
    if result is None:
        result = np.empty(nbytes, dtype=np.uint8)
    if p == 1:
        produce(0, nbytes)
        result[...] = own
        if consume is not None:
            consume(0, nbytes)
        return result, 0
    left, right = (r - 1) % p, (r + 1) % p
    # Work between progress calls: produce own's blocks in the order needed, then consume.
    work: collections.deque = collections.deque()
    pending = [0] * p
    for s in range(p):
        j = (r - 1 - s) % p
        for lo, hi in _item_segments(int(counts[j]), int(starts[j]), slice_bytes, itemsize):
            work.append((0, j, lo, hi))
            pending[j] += 1

    def run_one() -> None:
        kind, j, lo, hi = work.popleft()
        if kind == 0:
            produce(lo, hi)
            pending[j] -= 1
        elif consume is not None:
            consume(lo, hi)

    def ensure(j: int) -> None:
        while pending[j] > 0:
            run_one()

    def wait(req: Any) -> None:
        while work:
            with comm.in_mpi("allreduce"):
                if req.Test():
                    return
            run_one()
        with comm.in_mpi("allreduce"):
            req.Wait()

    if scratch is None:
        scratch = (np.empty(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8))
    partial, mine = scratch   # received partial sums; reduced partial sums, forwarded
    u8 = MPI.UINT8_T
    recvs = []
    with comm.in_mpi("allreduce"):
        # every receive posted up front, in the order the left neighbour sends
        for s in range(p - 1):
            for lo, hi in segs[(r - s - 2) % p]:
                recvs.append(mpi.Irecv([partial[lo:hi], u8], source=left, tag=RING_TAG))
        for t in range(p - 1):
            for lo, hi in segs[(r - t - 1) % p]:
                recvs.append(mpi.Irecv([result[lo:hi], u8], source=left, tag=RING_TAG))
    sends = []
    ensure((r - 1) % p)
    with comm.in_mpi("allreduce"):
        for lo, hi in segs[(r - 1) % p]:
            sends.append(mpi.Isend([own[lo:hi], u8], dest=right, tag=RING_TAG))
    total = 0
    k = 0
    for s in range(p - 1):
        j = (r - s - 2) % p
        last = s == p - 2
        for lo, hi in segs[j]:
            wait(recvs[k])
            k += 1
            ensure(j)
            out = result if last else mine
            total += int(reduce(partial, own, out, lo, hi))
            with comm.in_mpi("allreduce"):
                sends.append(mpi.Isend([out[lo:hi], u8], dest=right, tag=RING_TAG))
            if last:
                work.append((1, j, lo, hi))
    for t in range(p - 1):
        j = (r - t - 1) % p
        for lo, hi in segs[j]:
            wait(recvs[k])
            k += 1
            if t < p - 2:
                with comm.in_mpi("allreduce"):
                    sends.append(mpi.Isend([result[lo:hi], u8], dest=right, tag=RING_TAG))
            work.append((1, j, lo, hi))
    for req in sends:
        wait(req)
    while work:
        run_one()
    comm.count("allreduce", *ring_allreduce_rank_bytes(nbytes, p, comm.rank, itemsize))
    return result, total


# ---------------------------------------------------------------------------
# The same reductions without MPI: ``local_reduce(name, a, inout)`` folds the
# bytes of ``a`` into ``inout`` with the kernel the MPI operator runs. Backends
# without user-defined operators (torch.distributed) reduce with it after an
# alltoall (``Communicator.allreduce_custom``).

def _add16(kind: str) -> Any:
    def add(inbuf: Any, inoutbuf: Any, datatype: Any = None) -> None:
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


# ---------------------------------------------------------------------------
# Reduce-once allreduce whose every element is summed in a tree of depth
# ceil(log2 P) (Global-QSGD's 4-bit exponential codes).

TREE_TAG = 7927   # tag base of :func:`tree_reduce_once`'s messages (+ block index)


def tree_rounds(p: int) -> int:
    """ceil(log2 p): the depth of :func:`tree_reduce_once`'s binomial trees (0 for p = 1)."""
    return max(0, (p - 1).bit_length())


def tree_round(p: int, r: int, t: int) -> tuple[list[int], list[int]]:
    """Round ``t`` of :func:`tree_reduce_once` on rank ``r`` of ``p``: (blocks received from rank
    r + 2^t, blocks sent to rank r - 2^t), ascending.

    In block j's binomial tree rank r is node q = (r - j) mod p; node q != 0
    sends at round ctz(q) to q - 2^ctz(q); node q receives at round t from
    q + 2^t when that node exists (q + 2^t < p) and q has not sent yet
    (q = 0 or ctz(q) > t).
    """
    recv, send = [], []
    step = 1 << t
    for j in range(p):
        q = (r - j) % p
        low = (q & -q).bit_length() - 1 if q else p.bit_length() + 1   # ctz(q); "never" for 0
        if low > t and q + step < p:
            recv.append(j)
        elif q != 0 and low == t:
            send.append(j)
    return recv, send


def tree_reduce_once(comm: Any, own: np.ndarray,
                     reduce: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int, int], int],
                     ) -> tuple[np.ndarray, int]:
    """Allreduce of the uint8 buffer ``own`` in which every block is reduced along a binomial
    tree of depth ceil(log2 P), on one rank per tree node; returns (result identical on every
    rank, sum of ``reduce``'s returns), on any backend (mpi4py or torch.distributed: only
    the communicator's ``isend``/``irecv``/``allgatherv_into``), so both give the same bits.

    Block j (``block_counts``) is reduced towards rank j: relative to it, rank r
    is node q = (r - j) mod P; node q != 0 sends its partial sum to node
    q - 2^t at round t = ctz(q), after adding the partial sums of its children
    q + 2^u (u < t, q + 2^u < P) received in rounds u = 0, 1, ...; then an
    allgatherv returns the P reduced blocks to everyone. Every non-root node
    sends each block once, so a rank sends the same N(P-1)/P bytes as MPI's
    reduce-scatter (counted, on either backend, as one allreduce of N bytes:
    2N(P-1)/P each way), in ceil(log2 P) rounds.

    Why a tree (Global-QSGD paper, section 4.3): a stochastic exponential sum
    at most doubles its larger operand, so a node of height h outputs at most
    2^h times the largest input. With inputs <= 2^-c and 2^c >= 2P >= 2^(h+1)
    for h = ceil(log2 P), every partial sum stays <= 1/2 and nothing can
    saturate, whatever the random words; a chain ((c1 + c2) + c3) + c4, which
    MPI's ring reduce-scatter runs for large payloads, has height P - 1.

    ``reduce(a, b, out, lo, hi, t)`` must set out[lo:hi] = a[lo:hi] (op)
    b[lo:hi] (a: the child's partial sum received, b: this rank's partial sum)
    in round ``t`` (a rank reduces a byte at most once per round, so
    ``(t, byte)`` indexes distinct random words) and return a count.
    """
    own = np.ascontiguousarray(own, dtype=np.uint8).reshape(-1)
    p, r = comm.size, comm.rank
    nbytes = own.size
    if p == 1:
        return own.copy(), 0
    sent, received = ring_allreduce_rank_bytes(nbytes, p, r)
    with comm.counted_as("allreduce", sent, received):    # the volume of the allreduce it replaces
        counts = block_counts(nbytes, p)
        starts = np.zeros(p + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        acc = own.copy()                          # this rank's partial sums, block by block
        got = np.empty(nbytes, dtype=np.uint8)     # children's partial sums
        tmp = np.empty(nbytes, dtype=np.uint8)     # reduce output (a separate ``out`` vectorises)
        total = 0
        for t in range(tree_rounds(p)):
            step = 1 << t
            recv_blocks, send_blocks = tree_round(p, r, t)
            recvs = [(comm.irecv(got[int(starts[j]):int(starts[j + 1])], (r + step) % p,
                                 tag=TREE_TAG + j), int(starts[j]), int(starts[j + 1]))
                     for j in recv_blocks]                        # child node q + 2^t's partial sums
            sends = [comm.isend(acc[int(starts[j]):int(starts[j + 1])], (r - step) % p,
                                tag=TREE_TAG + j) for j in send_blocks]   # this node's turn: to q - 2^t
            for req, lo, hi in recvs:
                req.wait()
                if hi > lo:
                    total += int(reduce(got, acc, tmp, lo, hi, t))
                    acc[lo:hi] = tmp[lo:hi]
            for req in sends:
                req.wait()
        out = np.empty(nbytes, dtype=np.uint8)
        comm.allgatherv_into(acc[int(starts[r]):int(starts[r + 1])], counts, out)
    return out, total
