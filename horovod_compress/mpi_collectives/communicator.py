"""The MPI communicator every method talks through, with exact byte accounting.

Byte accounting follows the volume model of the Ok-Topk paper (Table 1), so a
measured count compares directly with the papers' formulas:

* point-to-point and ``alltoallv`` count exactly the bytes sent and received
  (a rank's message to itself is free);
* a collective counts what its bandwidth-optimal algorithm moves per rank:
  ``allreduce`` of N bytes is ``2N(P-1)/P`` each way on average over the
  ranks (reduce-scatter + allgather ring; each rank counts the whole chunks it
  sends and receives, ``accounting.ring_allreduce_rank_bytes``), ``allgather(v)`` receives every other rank's part and sends,
  in a ring, everything except its successor's part, ``broadcast`` of N bytes
  is N sent by the root and N received by every other rank.

Counters are kept in total and per operation (and per *phase*, a label a
method sets with :meth:`Communicator.phase`), so a benchmark can report the
volume of, e.g., Ok-Topk's split-and-reduce separately from its allgatherv.
"""
from __future__ import annotations

import contextlib
import pickle
from typing import Any, Callable, Iterator, Sequence, Union

import numpy as np
from mpi4py import MPI

from ..kernels.arrays import is_gpu_array, to_device_like, to_host
from .accounting import FusingAccounting, OpStats, PendingRequest, reduce_scatter_volume
from .datatypes import NAMED_OPS as _NAMED_OPS
from .datatypes import mpi_datatype  # noqa: F401 - also this module's name for it
from .cuda_aware import DeviceCollectives
from .reduce_ops import allreduce_reduce_once, check_custom, mpi_custom_op

OpLike = Union[str, MPI.Op]

def _contiguous(array: np.ndarray) -> np.ndarray:
    """C-contiguous view or copy that keeps the shape (0-d arrays stay 0-d)."""
    arr = np.asarray(array)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(arr.shape)


@contextlib.contextmanager
def _timed(comm: "Communicator | None", op: str) -> Iterator[None]:
    """Add the enclosed wall time (a wait for requests) to ``comm``'s seconds in MPI under ``op``
    (no-op without a communicator)."""
    if comm is None:
        yield
        return
    with comm.in_mpi(op, span="wait"):
        yield


class Request(PendingRequest):
    """A pending non-blocking MPI operation; :meth:`wait` returns its result."""

    def __init__(self, mpi_request: MPI.Request, result: Any = None,
                 on_complete: Callable[[], Any] | None = None, comm: "Communicator | None" = None,
                 op: str = "wait") -> None:
        super().__init__(result, on_complete, comm, op)
        self._req = mpi_request

    def _wait_transfers(self) -> None:
        self._req.Wait()

    @staticmethod
    def wait_all(requests: Sequence["Request"]) -> list[Any]:
        """Wait for every request (one MPI Waitall); return their results in order."""
        pending = [r for r in requests if not r._done]
        with _timed(pending[0]._comm if pending else None, pending[0]._op if pending else "wait"):
            MPI.Request.Waitall([r._req for r in pending])
        out = []
        for r in requests:
            if not r._done:
                r._complete()
            out.append(r._result)
        return out


class Communicator(FusingAccounting):
    """mpi4py communicator on NumPy buffers with per-rank byte accounting.

    ``Communicator()`` wraps ``MPI.COMM_WORLD``; pass any mpi4py
    intracommunicator to wrap another. All methods take and return NumPy
    arrays (contiguous copies are made where needed); results are new arrays
    unless a method says it works in place.
    """

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        self.comm: MPI.Intracomm = comm if comm is not None else MPI.COMM_WORLD
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self._init_accounting()
        self._device: Any = None

    def threads_allowed(self) -> bool:
        """Whether MPI may be called from more than one thread, one at a time (``MPI_THREAD_SERIALIZED``
        or more): what the engine's communication thread and :class:`~.lockstep.Lockstep` need."""
        return MPI.Query_thread() >= MPI.THREAD_SERIALIZED

    @property
    def device(self) -> Any:
        """The :class:`~.cuda_aware.DeviceCollectives` GPU arrays go through (created on first use)."""
        if self._device is None:
            self._device = DeviceCollectives(self)
        return self._device

    # ------------------------------------------------------------ collectives
    # (byte and time accounting: inherited from Accounting)
    def allreduce(self, array: np.ndarray, op: OpLike = "sum") -> np.ndarray:
        """Elementwise reduction over ranks; ``op`` is sum/max/min/prod/avg or an ``MPI.Op``.

        ``avg`` sums then divides by P in the array's dtype (floats only).
        Counts this rank's whole chunks of the ring: ``2N(P-1)/P`` bytes each way for
        N bytes on average over the ranks.
        """
        if is_gpu_array(array):
            return self.device.allreduce(array, op)
        send = _contiguous(array)
        mpi_op = _NAMED_OPS[op] if isinstance(op, str) else op
        if isinstance(op, str) and op not in _NAMED_OPS:
            raise ValueError(f"op must be one of {sorted(_NAMED_OPS)} or an MPI.Op, got {op!r}")
        out = np.empty_like(send)
        with self.in_mpi("allreduce"):
            self.comm.Allreduce(send, out, op=mpi_op)
        self._account("allreduce", *self._allreduce_bytes(send.nbytes, send.itemsize))
        if op in ("avg", "average"):
            if not np.issubdtype(out.dtype, np.floating):
                raise ValueError("op='avg' needs a floating-point array")
            out /= out.dtype.type(self.size)
        return out

    def iallreduce(self, array: np.ndarray, op: OpLike = "sum") -> Request:
        """Non-blocking :meth:`allreduce`; ``wait()`` returns the reduced array.

        A GPU array is reduced at once (blocking) and returns a completed request.
        """
        if is_gpu_array(array):
            return Request(MPI.REQUEST_NULL, result=self.device.allreduce(array, op))
        send = _contiguous(array)
        mpi_op = _NAMED_OPS[op] if isinstance(op, str) else op
        out = np.empty_like(send)
        with self.in_mpi("allreduce"):
            req = self.comm.Iallreduce(send, out, op=mpi_op)
        self._account("allreduce", *self._allreduce_bytes(send.nbytes, send.itemsize))
        size = self.size

        def finish() -> np.ndarray:
            if op in ("avg", "average"):
                out.__itruediv__(out.dtype.type(size))
            return out

        req_obj = Request(req, on_complete=finish, comm=self, op="allreduce")
        req_obj._keep = send  # keep the send buffer alive until completion
        return req_obj

    def allgather(self, array: np.ndarray) -> np.ndarray:
        """Gather equal-shaped arrays: returns shape ``(P, *array.shape)``."""
        if is_gpu_array(array):
            return self.device.allgather(array)
        send = _contiguous(array)
        out = np.empty((self.size,) + send.shape, dtype=send.dtype)
        with self.in_mpi("allgather"):
            self.comm.Allgather(send, out)
        n = send.nbytes
        self._account("allgather", n * (self.size - 1), n * (self.size - 1))
        return out

    def allgatherv(self, array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gather 1-D arrays of different lengths.

        Returns ``(concatenated, counts)`` where ``counts[j]`` is rank j's
        length; rank j's part is ``concatenated[offsets[j]:offsets[j+1]]``.
        Counts the exchange of lengths (an allgather of one int64) as well.
        """
        if is_gpu_array(array):
            return self.device.allgatherv(array)
        send = _contiguous(array).reshape(-1)
        counts = self.allgather(np.array([send.size], dtype=np.int64)).reshape(-1)
        displs = np.zeros(self.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=displs[1:])
        out = np.empty(int(counts.sum()), dtype=send.dtype)
        with self.in_mpi("allgatherv"):
            self.comm.Allgatherv(send, [out, counts, displs, mpi_datatype(send.dtype)])
        item = send.dtype.itemsize
        self._account_allgatherv(counts, send.size, item)
        return out, counts

    def alltoallv(self, chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Send ``chunks[j]`` (1-D, same dtype) to rank j; return what each rank sent here."""
        if len(chunks) != self.size:
            raise ValueError(f"alltoallv needs {self.size} chunks, got {len(chunks)}")
        if any(is_gpu_array(c) for c in chunks):
            return self.device.alltoallv(chunks)
        dtype = np.result_type(*[np.asarray(c).dtype for c in chunks])
        parts = [np.ascontiguousarray(c, dtype=dtype).reshape(-1) for c in chunks]
        send_counts = np.array([p.size for p in parts], dtype=np.int64)
        recv_counts = np.empty_like(send_counts)
        with self.in_mpi("alltoallv"):
            self.comm.Alltoall(send_counts, recv_counts)
        send = np.concatenate(parts) if parts else np.empty(0, dtype)
        sdispl = np.zeros(self.size, np.int64)
        np.cumsum(send_counts[:-1], out=sdispl[1:])
        rdispl = np.zeros(self.size, np.int64)
        np.cumsum(recv_counts[:-1], out=rdispl[1:])
        recv = np.empty(int(recv_counts.sum()), dtype=dtype)
        mpitype = mpi_datatype(dtype)
        with self.in_mpi("alltoallv"):
            self.comm.Alltoallv([send, send_counts, sdispl, mpitype], [recv, recv_counts, rdispl, mpitype])
        item = dtype.itemsize
        others = np.arange(self.size) != self.rank
        sent = int(send_counts[others].sum()) * item + 8 * (self.size - 1)
        received = int(recv_counts[others].sum()) * item + 8 * (self.size - 1)
        self._account("alltoallv", sent, received)
        return [recv[rdispl[j]:rdispl[j] + recv_counts[j]] for j in range(self.size)]

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Broadcast in place from ``root`` (``array`` must be contiguous); returns it.

        A GPU array is broadcast in place when MPI is CUDA-aware; staged through
        the host otherwise, the result is a new device array.
        """
        if is_gpu_array(array):
            return self.device.broadcast(array, root)
        if not array.flags.c_contiguous:
            raise ValueError("broadcast works in place and needs a C-contiguous array")
        with self.in_mpi("broadcast"):
            self.comm.Bcast(array, root=root)
        if self.size > 1:
            if self.rank == root:
                self._account("broadcast", array.nbytes, 0)
            else:
                self._account("broadcast", 0, array.nbytes)
        return array

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object; bytes counted as its pickled size."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else None
        with self.in_mpi("broadcast"):
            data = self.comm.bcast(data, root=root)
        if self.size > 1:
            self._account("broadcast", len(data) if self.rank == root else 0,
                          0 if self.rank == root else len(data))
        return pickle.loads(data)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Allgather picklable objects (used for checks, not for gradients)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self.in_mpi("allgather_object"):
            parts = self.comm.allgather(data)
        received = sum(len(p) for j, p in enumerate(parts) if j != self.rank)
        self._account("allgather_object", len(data) * (self.size - 1), received)
        return [pickle.loads(p) for p in parts]

    def barrier(self) -> None:
        """Block until every rank has entered the barrier."""
        with self.in_mpi("barrier"):
            self.comm.Barrier()

    # -------------------------------------------------------- point-to-point
    def isend(self, array: np.ndarray, dest: int, tag: int = 0) -> Request:
        """Non-blocking send of an array (any length) to ``dest``.

        A GPU array is sent from device memory when MPI is CUDA-aware, else
        from a host copy.
        """
        if is_gpu_array(array) and self.device.cuda_aware:
            send = array
            nbytes = int(array.size) * np.dtype(array.dtype).itemsize
        else:
            send = _contiguous(to_host(array))
            nbytes = send.nbytes
        with self.in_mpi("p2p", peer=dest):
            req = self.comm.Isend(send, dest=dest, tag=tag)
        if dest != self.rank:
            self._account("p2p", nbytes, 0)
        r = Request(req, comm=self, op="p2p")
        r._keep = send
        return r

    def recv(self, source: int, tag: int = 0, dtype: Any = np.float32) -> np.ndarray:
        """Blocking receive of a message of unknown length (matched probe)."""
        return self._probed_recv(source, tag, dtype)[1]

    def recv_any(self, tag: int = 0, dtype: Any = np.float32) -> tuple[int, np.ndarray]:
        """Blocking receive of the first message with ``tag`` to arrive from any rank:
        ``(source, array)`` (matched probe on ``MPI.ANY_SOURCE``; sizes from the message).

        For a caller that expects one message from each of several ranks and
        would otherwise wait for them in a fixed order while later ones have
        already arrived (:func:`~.oktopk.split_and_reduce`).
        """
        return self._probed_recv(None, tag, dtype)

    def _probed_recv(self, source: int | None, tag: int, dtype: Any) -> tuple[int, np.ndarray]:
        """Matched probe (on ``source``, or any rank for ``None``), then receive what it matched."""
        status = MPI.Status()
        with self.in_mpi("p2p", peer=source, span="probe"):
            msg = self.comm.Mprobe(source=MPI.ANY_SOURCE if source is None else source, tag=tag,
                                   status=status)
        source = status.Get_source()
        dt = np.dtype(dtype)
        nbytes = status.Get_count(MPI.BYTE)
        out = np.empty(nbytes // dt.itemsize, dtype=dt)
        with self.in_mpi("p2p", peer=source):
            msg.Recv(out)
        if source != self.rank:
            self._account("p2p", 0, nbytes)
        return source, out

    def irecv(self, buffer: np.ndarray, source: int, tag: int = 0) -> Request:
        """Non-blocking receive into a preallocated ``buffer`` of known size.

        A GPU ``buffer`` receives directly when MPI is CUDA-aware; otherwise the
        message lands in host memory and is copied into it when the request completes.
        """
        nbytes = int(buffer.size) * np.dtype(buffer.dtype).itemsize
        if source != self.rank:
            self._account("p2p", 0, nbytes)
        if is_gpu_array(buffer) and not self.device.cuda_aware:
            host = np.empty(tuple(buffer.shape), dtype=np.dtype(buffer.dtype))
            with self.in_mpi("p2p", peer=source):
                req = self.comm.Irecv(host, source=source, tag=tag)

            def to_device() -> Any:
                if hasattr(buffer, "set"):      # CuPy
                    buffer.set(host)
                else:                           # Numba device array
                    buffer.copy_to_device(host)
                return buffer
            return Request(req, on_complete=to_device, comm=self, op="p2p")
        with self.in_mpi("p2p", peer=source):
            req = self.comm.Irecv(buffer, source=source, tag=tag)
        return Request(req, result=buffer, comm=self, op="p2p")

    # ------------------------------------------- backend-neutral entry points
    # The core calls these instead of raw ``comm.comm.*`` so that every backend
    # (this one, ``torch_dist.TorchCommunicator``) runs it.
    def alltoall(self, array: np.ndarray) -> np.ndarray:
        """Equal-block alltoall: row j of ``array`` (shape ``(P, ...)``) goes to rank j.

        Returns the rows received, row j from rank j. Counts each row exactly
        (``(P-1) * row bytes`` each way; op ``alltoall``).
        """
        send = _contiguous(array)
        if send.shape[0] != self.size:
            raise ValueError(f"alltoall needs {self.size} rows, got {send.shape[0]}")
        recv = np.empty_like(send)
        with self.in_mpi("alltoall"):
            self.comm.Alltoall(send, recv)
        vol = send.nbytes // max(self.size, 1) * (self.size - 1)
        self._account("alltoall", vol, vol)
        return recv

    def allgatherv_into(self, send: np.ndarray, byte_counts: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Allgatherv of raw bytes whose per-rank ``byte_counts`` every rank already knows.

        ``send`` (uint8, ``byte_counts[rank]`` long) lands in ``out`` (uint8,
        ``sum(byte_counts)`` long) in rank order; no count exchange. Counted with
        the ring model of :meth:`allgatherv` (op ``allgatherv``).
        """
        counts = np.asarray(byte_counts, dtype=np.int64)
        displs = np.zeros(self.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=displs[1:])
        with self.in_mpi("allgatherv"):
            self.comm.Allgatherv(send, [out, counts, displs, MPI.BYTE])
        total = int(counts.sum())
        received = total - int(counts[self.rank])
        sent = total - int(counts[(self.rank + 1) % self.size])
        self._account("allgatherv", sent, received)
        return out

    def allreduce_custom(self, buf: np.ndarray, op: str) -> np.ndarray:
        """Allreduce of a byte/word buffer with a reduction MPI lacks (``reduce_ops.CUSTOM_REDUCTIONS``).

        ``op``: ``fp16_sum``/``bf16_sum`` (16-bit words), ``nibble`` (packed
        4-bit lanes), ``exp8``/``exp4`` (Global-QSGD's stochastic exponential
        reduce; each element reduced on one rank only, see
        :func:`~.reduce_ops.allreduce_reduce_once`). Counted as one allreduce
        of ``buf.nbytes`` (2N(P-1)/P each way). Returns a new array of ``buf``'s dtype.
        """
        _fn, item, once = check_custom(op)
        send = _contiguous(buf).reshape(-1)
        if once:
            return allreduce_reduce_once(self, send, mpi_custom_op(op)[1])
        words = send.view(np.uint8).size // item
        out = np.empty_like(send)
        dtype, mpi_op = mpi_custom_op(op)
        with self.in_mpi("allreduce"):
            self.comm.Allreduce([send, words, dtype], [out, words, dtype], op=mpi_op)
        self._account("allreduce", *self._allreduce_bytes(send.nbytes, item))
        return out

    def reduce_scatter(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        """This rank's block of the elementwise sum (or ``avg``) over ranks.

        ``array`` (its length a multiple of P) is cut into P equal blocks; rank
        j receives block j reduced (``MPI_Reduce_scatter_block``; ``avg`` sums
        then divides by P in the array's dtype). Counts ``N(P-1)/P`` bytes
        each way for N bytes (the ring's reduce-scatter half).
        """
        if op not in ("sum", "avg", "average"):
            raise ValueError(f"reduce_scatter op must be 'sum' or 'avg', got {op!r}")
        send = to_host(array) if is_gpu_array(array) else array
        send = _contiguous(np.asarray(send)).reshape(-1)
        if send.size % self.size:
            raise ValueError(f"reduce_scatter needs a length that is a multiple of the "
                             f"{self.size} ranks, got {send.size}")
        if op != "sum" and not np.issubdtype(send.dtype, np.floating):
            raise ValueError("op='avg' needs a floating-point array")
        out = np.empty(send.size // self.size, dtype=send.dtype)
        with self.in_mpi("reduce_scatter"):
            self.comm.Reduce_scatter_block(send, out, op=MPI.SUM)
        vol = reduce_scatter_volume(send.nbytes, self.size)
        self._account("reduce_scatter", vol, vol)
        if op != "sum":
            out /= out.dtype.type(self.size)
        return to_device_like(out, array) if is_gpu_array(array) else out

    def reduce_scatter_custom(self, buf: np.ndarray, op: str) -> np.ndarray:
        """This rank's block of :meth:`allreduce_custom`'s reduction, without the allgather.

        ``buf`` is cut into P equal blocks of whole elements and rank j gets
        block j reduced with the custom operator (``MPI_Reduce_scatter_block``;
        every element is reduced on one rank). Counts ``N(P-1)/P`` bytes each way.
        """
        _fn, item, _once = check_custom(op)
        send = _contiguous(buf).reshape(-1)
        words = send.view(np.uint8).size // item
        if words % self.size:
            raise ValueError(f"reduce_scatter_custom needs a multiple of {self.size} elements, "
                             f"got {words}")
        mine = words // self.size
        out = np.empty(send.size // self.size, dtype=send.dtype)
        dtype, mpi_op = mpi_custom_op(op)
        with self.in_mpi("reduce_scatter"):
            self.comm.Reduce_scatter_block([send, mine, dtype], [out, mine, dtype], op=mpi_op)
        vol = reduce_scatter_volume(send.nbytes, self.size)
        self._account("reduce_scatter", vol, vol)
        return out

    def self_communicator(self) -> "Communicator":
        """A one-rank communicator (``MPI.COMM_SELF``) for work local to this rank."""
        return Communicator(MPI.COMM_SELF)

    backend = "mpi"

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"
