"""Reduce-once allreduce through an MPI-3 shared-memory window, for ranks that share one node.

When every rank of a communicator runs on one node, the pipelined ring of
:func:`~horovod_compress.mpi_collectives.reduce_ops.ring_reduce_once` still
copies each segment into MPI's shared-memory transport and out again, and pays
Python work and a progress call per segment (fp16 at P = 2 cost
1.02-1.18x a dense float32 allreduce, most of it that overhead). Here the
ranks read each other's messages in place instead:
``MPI_Win_allocate_shared`` gives every rank a segment of one node-wide
mapping that all ranks can address (``MPI_Win_shared_query``), synchronised
by ``MPI_Win_sync`` + ``MPI_Barrier`` + ``MPI_Win_sync`` under a passive
``MPI_Win_lock_all`` epoch (the pattern the MPI 3.1 standard describes for
shared-memory windows, sections 11.2.3 and 11.7).

One call, with N payload bytes split into P blocks (``block_counts``):

1. every rank writes its own message (``produce``) into its segment;
2. sync;
3. rank j reduces block j along the *same chain the ring uses*: it starts
   from rank j+1's message and folds in ranks j+2, ..., j+P (mod P) in that
   order, ``reduce(a, b, out, lo, hi, q)`` with q the rank whose message b
   is -- the rank that would have run that reduction in the ring, so a
   stochastic operator can draw from q's stream and every bit matches the
   ring's result; the chain runs slice by slice, its partial sums staying in
   cache, and the last step writes block j of a second window, whose
   per-rank segments (one block each) MPI lays out back to back, so the sum
   is one array (:class:`SharedWindow`);
4. sync;
5. every rank reads the finished sum (``consume``), and the call
   returns. The next call's writes cannot race with this one's reads: a rank
   writes its message segment only before step 2 and its result segment only
   after it, and every other rank finishes reading both before it reaches
   the next call's step 2.

Bytes: each rank reads (P-1)/P of every other rank's message in step 3
(N(P-1)/P) and (P-1)/P of the result in step 5 -- the reduce-scatter +
allgather volume 2N(P-1)/P of the ring, accounted as one allreduce of N
bytes, as the ring is. Rounds: two barriers instead of 2(P-1) ring steps.

Windows are kept per (communicator, tensor name) and reused; a new size
reallocates (a collective, which every rank reaches at the same call, as
it does for the call itself). They live in ``/dev/shm``; where it has no
room, :func:`shared_window` says so and the callers take the ring. :func:`use_shared_window` decides whether a
communicator takes this path (``HVDC_SHARED_WINDOW``: ``auto``, ``on``,
``off``).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from .accounting import ring_allreduce_rank_bytes
from .reduce_ops import all_ranks_on_one_node, block_counts
from . import is_mpi_communicator

#: Environment variable: ``auto`` (default) -- the window when all ranks share one node and
#: each has a core of its own; ``on`` -- whenever all ranks share one node; ``off`` -- never.
ENV_SWITCH = "HVDC_SHARED_WINDOW"

#: The chain of step 3 runs in slices of this many bytes, so partial sums stay in L2.
SLICE_BYTES = 1 << 18


def shared_window_policy() -> str:
    """``auto``, ``on`` or ``off`` from :data:`ENV_SWITCH`; anything else is a ``ValueError``."""
    value = os.environ.get(ENV_SWITCH, "auto").strip().lower() or "auto"
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{ENV_SWITCH}={value!r}: expected 'auto', 'on' or 'off'")
    return value


def use_shared_window(comm: Any) -> bool:
    """Whether a reduce-once allreduce on ``comm`` goes through :func:`window_reduce_once_items`.

    Only on the mpi4py :class:`~horovod_compress.mpi_collectives.communicator.Communicator`
    with P >= 2 whose ranks all share this node (``COMM_TYPE_SHARED``; ranks on
    other hosts, including the emulated hosts of ``hvdc cluster``, which Open
    MPI starts one daemon each for, never do). Under ``auto`` also only while
    P <= the cores this node reports: when ranks time-share cores, a rank that
    waits at a barrier holds a core the others need, and the pipelined ring,
    which overlaps its waits with work, was faster (4 ranks on 2 cores, fp16,
    2000 x 2000: 33 ms against the ring's 23 ms).
    """
    if comm.size < 2 or not is_mpi_communicator(comm):
        return False
    policy = shared_window_policy()
    if policy == "off":
        return False
    if policy == "auto" and comm.size > (os.cpu_count() or 1):
        return False
    return all_ranks_on_one_node(comm)


class SharedWindow:
    """Two node-wide shared windows for a payload of ``nitems`` items of ``itemsize`` bytes:
    every rank's message segment (the whole payload), and the result, one block per rank
    (``block_counts``), which MPI lays out back to back ("contiguous across process ranks",
    MPI 3.1 section 11.2.3), so :attr:`result` is the whole sum as one array.

    ``messages[q]``: rank q's message (uint8). :attr:`result` is None where an MPI pads
    the segments apart (checked here); :func:`shared_window` then frees the windows and
    the callers take the ring.
    """

    def __init__(self, comm: Any, nitems: int, itemsize: int) -> None:
        from mpi4py import MPI
        p, r = comm.size, comm.rank
        # held, so that the id the window is filed under (shared_window) stays this comm's
        self.mpi_comm = comm.comm
        self.nbytes = int(nitems) * int(itemsize)
        self.itemsize = int(itemsize)
        self.counts = block_counts(int(nitems), p) * self.itemsize
        self.starts = np.zeros(p + 1, dtype=np.int64)
        np.cumsum(self.counts, out=self.starts[1:])
        self.win = MPI.Win.Allocate_shared(self.nbytes, 1, comm=comm.comm)
        self.messages = [_segment(self.win, q, self.nbytes) for q in range(p)]
        self.res_win = MPI.Win.Allocate_shared(int(self.counts[r]), 1, comm=comm.comm)
        self.result: np.ndarray | None = _contiguous_blocks(self.res_win, self.starts)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.res_win.Lock_all(MPI.MODE_NOCHECK)

    def free(self) -> None:
        """End the access epochs and free both windows (collectives)."""
        for win in (self.win, self.res_win):
            win.Unlock_all()
            win.Free()

    def sync(self, comm: Any) -> None:
        """Make every rank's stores visible to all: ``Win_sync``, barrier, ``Win_sync``."""
        with comm.in_mpi("allreduce"):
            self.win.Sync()
            self.res_win.Sync()
            comm.comm.Barrier()
            self.win.Sync()
            self.res_win.Sync()


def _segment(win: Any, q: int, nbytes: int) -> np.ndarray:
    """Rank q's segment of ``win`` as a uint8 array of ``nbytes``."""
    buf, _ = win.Shared_query(q)
    return np.frombuffer(buf, dtype=np.uint8, count=nbytes) if nbytes else np.empty(0, np.uint8)


def _contiguous_blocks(win: Any, starts: np.ndarray) -> np.ndarray | None:
    """The ranks' segments of ``win`` (rank q's of ``starts[q+1] - starts[q]`` bytes) as one
    uint8 array, if they lie back to back in this process's mapping; else None."""
    import ctypes
    from mpi4py import MPI
    base = None
    for q in range(len(starts) - 1):
        size = int(starts[q + 1] - starts[q])
        if size == 0:
            continue
        buf, _ = win.Shared_query(q)
        addr = MPI.Get_address(buf)
        if base is None:
            base = addr - int(starts[q])
        elif addr != base + int(starts[q]):
            return None
    total = int(starts[-1])
    if base is None or total == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(base))


_WINDOWS: dict[tuple[int, str], SharedWindow] = {}
_NO_ROOM: set[tuple[int, str, int]] = set()

#: Head room left free in the shared-memory file system beyond the windows themselves.
SHM_HEADROOM_BYTES = 64 << 20


def _shm_free_bytes() -> int:
    """Free bytes where Open MPI maps shared windows (``/dev/shm``, else the temp dir)."""
    import tempfile
    path = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    st = os.statvfs(path)
    return int(st.f_bavail) * int(st.f_frsize)


def shared_window(comm: Any, name: str, nitems: int, itemsize: int = 1) -> SharedWindow | None:
    """The window of tensor ``name`` on ``comm`` for ``nitems`` items of ``itemsize`` bytes,
    created on first use and when the layout changes (a collective: every rank reaches it at
    the same call); None -- on every rank alike, decided by rank 0 -- when the node's
    shared-memory file system lacks room for the P message and result segments plus
    :data:`SHM_HEADROOM_BYTES` (a container's 64 MiB ``/dev/shm``, say; a warning says so
    once per tensor), or where the MPI does not lay the result blocks out back to back:
    the caller then takes the ring."""
    key = (id(comm.comm), name)
    nbytes = nitems * itemsize
    win = _WINDOWS.get(key)
    if win is not None and win.nbytes == nbytes and win.itemsize == itemsize:
        return win
    if (key[0], name, nbytes) in _NO_ROOM:
        return None
    if win is not None:
        del _WINDOWS[key]
        win.free()
    need = 2 * nbytes * comm.size + SHM_HEADROOM_BYTES
    room = comm.comm.bcast(_shm_free_bytes() >= need if comm.rank == 0 else None, root=0)
    if not room:
        _NO_ROOM.add((key[0], name, nbytes))
        import warnings
        warnings.warn(f"horovod_compress: no room for a {2 * nbytes * comm.size} byte shared-memory "
                      f"window for {name!r} (free space of /dev/shm); its sums take the ring. "
                      f"Enlarge /dev/shm (docker run --shm-size) or set {ENV_SWITCH}=off.",
                      RuntimeWarning, stacklevel=3)
        return None
    win = SharedWindow(comm, nitems, itemsize)
    if win.result is None:            # segments not back to back (not Open MPI's layout)
        win.free()
        _NO_ROOM.add((key[0], name, nbytes))
        return None
    _WINDOWS[key] = win
    return win


def window_reduce_once_items(comm: Any, window: SharedWindow, nitems: int, itemsize: int,
                             produce: Callable[[np.ndarray], None],
                             reduce: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int, int], int],
                             consume: Callable[[np.ndarray, int, int], None],
                             scratch: np.ndarray | None = None) -> int:
    """Allreduce of ``nitems`` items of ``itemsize`` bytes, each reduced on one rank only,
    through ``window`` (module docstring); returns the sum of ``reduce``'s returns.

    ``produce(own)`` writes this rank's message into ``own`` (uint8, all
    ``nitems * itemsize`` bytes). ``reduce(a, b, out, lo, hi, q)`` folds bytes
    [lo, hi) of rank q's message ``b`` into the partial sum ``a``, writing
    ``out`` (``out`` may be ``a``). ``consume(src, 0, nbytes)`` reads the finished
    sum from ``src`` (uint8, the whole payload).
    Blocks, segments and the chain's order are those of
    :func:`~horovod_compress.mpi_collectives.reduce_ops.ring_reduce_once_items`,
    so the bits equal the ring's. ``scratch``: a uint8 buffer of ``nitems * itemsize``
    bytes for the chain's partial sums at P > 2 (allocated if None); only the
    pages of block r are ever touched.
    """
    p, r = comm.size, comm.rank
    nbytes = nitems * itemsize
    if window.nbytes != nbytes or window.itemsize != itemsize:
        raise ValueError(f"window of {window.nbytes} bytes in items of {window.itemsize} for a "
                         f"payload of {nitems} items of {itemsize}")
    starts = window.starts
    produce(window.messages[r])
    window.sync(comm)
    total = 0
    lo_r, hi_r = int(starts[r]), int(starts[r + 1])
    chain = [(r + s) % p for s in range(2, p + 1)]   # ranks folded in, the ring's order
    # one fold per element at P = 2: the whole block at once; longer chains slice by slice,
    # so the partial sums stay in cache
    step = max(hi_r - lo_r, 1) if p == 2 else max(itemsize, SLICE_BYTES // itemsize * itemsize)
    if p > 2 and (scratch is None or scratch.size < nbytes):
        scratch = np.empty(nbytes, dtype=np.uint8)
    for lo in range(lo_r, hi_r, step):
        hi = min(hi_r, lo + step)
        a = window.messages[(r + 1) % p]
        for i, q in enumerate(chain):
            out = window.result if i == len(chain) - 1 else scratch
            total += int(reduce(a, window.messages[q], out, lo, hi, q))
            a = out
    window.sync(comm)
    consume(window.result, 0, nbytes)
    comm.count("allreduce", *ring_allreduce_rank_bytes(nbytes, p, comm.rank, itemsize))
    return total


def window_allreduce_sum(comm: Any, name: str, array: np.ndarray,
                         out: np.ndarray | None = None) -> np.ndarray:
    """Elementwise sum over ranks of a C-contiguous float32/float64 ``array`` through the
    window of ``name`` (:func:`window_reduce_once_items`): the ring's chain of additions per
    block, so at P = 2 the one addition MPI's allreduce makes (the same bits); at P > 2 the
    order MPI leaves unspecified is the ring's. The same bits on every rank; bytes accounted
    as one allreduce of the array.

    ``array`` may be this rank's message segment itself (:func:`window_message`: written
    in place by the caller, nothing is copied in). The sum goes to ``out``; with ``out``
    None it is the window's result array itself (:attr:`SharedWindow.result`; valid until
    the next call on ``name``).
    """
    if array.dtype not in (np.float32, np.float64) or not array.flags.c_contiguous:
        raise TypeError(f"window_allreduce_sum takes C-contiguous float32/float64 arrays, "
                        f"not {array.dtype} ({'' if array.flags.c_contiguous else 'non-'}contiguous)")
    flat = array.reshape(-1)
    dtype, item = array.dtype, array.dtype.itemsize
    window = shared_window(comm, name, flat.size, item)
    if window is None:            # no room for a window: MPI's allreduce
        total = comm.allreduce(array, op="sum")
        if out is None:
            return total
        np.copyto(out, total.reshape(out.shape))
        return out
    own = window.messages[comm.rank]
    in_place = flat.size > 0 and own.__array_interface__["data"][0] == flat.__array_interface__["data"][0]
    view = out is None
    result = window.result.view(dtype) if view else out.reshape(-1)

    def produce(own: np.ndarray) -> None:
        if not in_place:
            np.copyto(own.view(dtype), flat)

    def reduce(a: np.ndarray, b: np.ndarray, dst: np.ndarray, lo: int, hi: int, q: int) -> int:
        np.add(a[lo:hi].view(dtype), b[lo:hi].view(dtype), out=dst[lo:hi].view(dtype))
        return 0

    def consume(src: np.ndarray, lo: int, hi: int) -> None:
        if not view:
            np.copyto(result[lo // item:hi // item], src[lo:hi].view(dtype))

    window_reduce_once_items(comm, window, flat.size, item, produce, reduce, consume)
    return result.reshape(array.shape)


def window_message(comm: Any, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
    """This rank's message segment of the window of ``name`` as an array of ``shape`` and
    ``dtype``, for a caller that writes its message there and then calls
    :func:`window_allreduce_sum` on it (no copy in); None where :func:`shared_window` is."""
    dtype = np.dtype(dtype)
    nitems = int(np.prod(shape))
    window = shared_window(comm, name, nitems, dtype.itemsize)
    return None if window is None else window.messages[comm.rank].view(dtype).reshape(shape)
