"""Byte and time accounting shared by every communicator backend (mpi4py and torch.distributed).

:class:`Accounting` holds the counters and their public API (``bytes_sent``,
``bytes_received``, ``stats()``, ``reset_stats()``, ``timings()``,
``in_mpi(op)``, ``phase(label)``, ``_account(op, sent, received)``) with the
same semantics as :class:`~horovod_compress.mpi_collectives.Communicator`
(mpi4py), so a method's byte counts compare across backends. The volume model
is that of the Ok-Topk paper (Renggli et al. / Li and Hoefler, "Near-Optimal
Sparse Allreduce for Distributed Deep Learning", PPoPP 2022, Table 1):
point-to-point and alltoall(v) exact, allreduce of N bytes 2N(P-1)/P each way
(on average over the ranks: each rank counts the whole chunks of the ring it
really sends and receives, :func:`ring_allreduce_rank_bytes`), allgather(v) the
other ranks' parts (ring), broadcast N. Every counter is a whole number of bytes.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from . import timeline as _timeline


@dataclass
class OpStats:
    """Calls and bytes of one kind of operation (or one phase) on this rank."""

    calls: int = 0
    sent: int = 0
    received: int = 0

    def as_dict(self) -> dict[str, int]:
        """``{"calls", "sent", "received"}`` as a plain dict."""
        return {"calls": self.calls, "sent": self.sent, "received": self.received}


@dataclass
class _Stats:
    sent: int = 0
    received: int = 0
    by_op: dict[str, OpStats] = field(default_factory=dict)
    by_phase: dict[str, OpStats] = field(default_factory=dict)


class PendingRequest:
    """A pending non-blocking operation of any backend; :meth:`wait` returns its result.

    A backend's request says how to wait for its transfers (:meth:`_wait_transfers`,
    timed under ``op`` on ``comm``); ``on_complete`` (if given) computes the result
    once they are done.
    """

    def __init__(self, result: Any = None, on_complete: Callable[[], Any] | None = None,
                 comm: "Accounting | None" = None, op: str = "wait") -> None:
        self._result = result
        self._on_complete = on_complete
        self._comm = comm
        self._op = op
        self._done = False

    def _wait_transfers(self) -> None:
        """Block until the backend's transfers finished."""
        raise NotImplementedError

    def _complete(self) -> None:
        self._done = True
        if self._on_complete is not None:
            self._result = self._on_complete()

    def wait(self) -> Any:
        """Block until the operation completed; return its result."""
        if not self._done:
            with (contextlib.nullcontext() if self._comm is None
                  else self._comm.in_mpi(self._op, span="wait")):
                self._wait_transfers()
            self._complete()
        return self._result


class PhaseLabel:
    """``phase(label)``: the label the enclosed calls' bytes are also counted under (``_phase``)."""

    _phase: str | None = None

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """Attribute the bytes of the enclosed calls to ``label`` as well (and, while a
        timeline records, show the block as a span ``label``)."""
        previous, self._phase = self._phase, label
        rec = _timeline.recorder
        start = time.perf_counter() if rec is not None else 0.0
        try:
            yield
        finally:
            self._phase = previous
            if rec is not None:
                rec.add(label, _timeline.PHASE, start, time.perf_counter())


def allreduce_volume(nbytes: float, p: int) -> float:
    """Bytes one rank sends, and receives, in a ring allreduce of ``nbytes`` over ``p`` ranks:
    2N(P-1)/P (the volume model of "Near-Optimal Sparse Allreduce for Distributed Deep
    Learning" (Ok-Topk), Table 1). The one place the project writes it."""
    return 2.0 * nbytes * (p - 1) / p


def ring_allreduce_rank_bytes(nbytes: int, p: int, rank: int, item: int = 1) -> tuple[int, int]:
    """Bytes rank ``rank`` sends and receives in a ring allreduce of ``nbytes`` over ``p`` ranks.

    The ring (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", J. Parallel Distrib. Comput. 69(2), 2009, section 3) cuts the
    n = nbytes / item elements into p contiguous chunks, the first n mod p of them one element
    longer: chunk j has c_j elements. In its reduce-scatter, chunk j travels j+1 -> j+2 -> ...
    -> j (p - 1 hops) and ends reduced on rank j, so rank r sends every chunk but c_r and
    receives every chunk but c_(r-1); in its allgather chunk j travels j -> j+1 -> ... -> j-1,
    so rank r sends every chunk but c_(r+1) and receives every chunk but c_r:

        sent = (2n - c_r - c_(r+1)) item,   received = (2n - c_(r-1) - c_r) item.

    Summed over the ranks both are 2n(p-1) items, so their mean is :func:`allreduce_volume`'s
    2N(P-1)/P exactly, and each rank's count is within 2 items of it (equal to it when p
    divides n). ``p = 1`` moves nothing.
    """
    if p <= 1:
        return 0, 0
    n = int(nbytes) // item
    base, longer = divmod(n, p)

    def chunk(j: int) -> int:
        return base + (1 if j % p < longer else 0)
    sent = 2 * n - chunk(rank) - chunk(rank + 1)
    received = 2 * n - chunk(rank - 1) - chunk(rank)
    return sent * item, received * item


def reduce_scatter_volume(nbytes: float, p: int) -> float:
    """Bytes one rank sends, and receives, in a ring reduce-scatter of ``nbytes`` over ``p``
    ranks (every rank ends with one of ``p`` equal blocks reduced): N(P-1)/P, the first half of
    :func:`allreduce_volume`'s ring."""
    return float(nbytes) * (p - 1) / p


class Accounting(PhaseLabel):
    """Counters of bytes (volume model) and of seconds spent inside collectives."""

    rank: int
    size: int

    def _init_accounting(self) -> None:
        self._stats = _Stats()
        self._phase: str | None = None
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._cpu_seconds = 0.0
        self._cpu_by_op: dict[str, float] = {}
        self._timing_depth = threading.local()

    @property
    def bytes_sent(self) -> int:
        """Cumulative bytes this rank sent under the volume model (a whole number)."""
        return self._stats.sent

    @property
    def bytes_received(self) -> int:
        """Cumulative bytes this rank received under the volume model (a whole number)."""
        return self._stats.received

    def stats(self) -> dict[str, Any]:
        """Totals plus per-operation and per-phase breakdowns (plain dicts)."""
        with self._lock:
            return {
                "sent": self._stats.sent,
                "received": self._stats.received,
                "by_op": {k: v.as_dict() for k, v in self._stats.by_op.items()},
                "by_phase": {k: v.as_dict() for k, v in self._stats.by_phase.items()},
            }

    def reset_stats(self) -> None:
        """Zero every counter (bytes and seconds)."""
        with self._lock:
            self._stats = _Stats()
            self._seconds = {}
            self._cpu_seconds = 0.0
            self._cpu_by_op = {}

    def timings(self) -> dict[str, Any]:
        """Seconds this rank spent inside collectives:
        ``{"total": s, "by_op": {op: s}, "cpu_total": s, "cpu_by_op": {op: s}}``.

        ``total`` and ``by_op`` are wall time; ``cpu_total`` (and
        ``cpu_by_op``) the calling threads' CPU time inside the calls
        (polling, copies, user-defined reduction operators), which lets a
        benchmark separate a method's own CPU work from time spent waiting.
        ``by_op["agree"]`` is the per-call agreement of
        :meth:`~horovod_compress.compressors.base.Method.allreduce` (one
        1-byte allgather, :mod:`~horovod_compress.mpi_collectives.consistency`): as
        the first collective of a call it is where a rank waits for peers
        still computing, and it moves no payload (no bytes are counted for it).

        Waiting for other ranks counts here too (a collective returns when its
        slowest participant has taken part), which is what a step loses to
        communication. Kept apart from :meth:`stats` so byte counts stay
        deterministic and comparable across runs.
        """
        with self._lock:
            return {"total": sum(self._seconds.values()), "by_op": dict(self._seconds),
                    "cpu_total": self._cpu_seconds, "cpu_by_op": dict(self._cpu_by_op)}

    @contextlib.contextmanager
    def in_mpi(self, op: str, peer: int | None = None, span: str | None = None) -> Iterator[None]:
        """Time the enclosed collective call(s) under ``op`` (nested uses count once).

        Named as on the mpi4py communicator so the core calls one method on
        either backend. While a timeline records (:mod:`.timeline`), the call
        is also a span: named ``span`` (default ``op``; ``"wait"`` for a
        request's wait, ``"agree"`` for the per-call agreement), with the
        ``peer`` of a point-to-point call and the bytes counted for it.
        """
        rec = _timeline.recorder
        if rec is not None:
            with self._in_mpi_timed(op):
                start = time.perf_counter()
                try:
                    yield
                finally:
                    name = span or op
                    cat = (_timeline.WAIT if name == "wait" else
                           _timeline.AGREE if name == "agree" else _timeline.MPI)
                    args: dict[str, Any] = {"op": op} if name != op else {}
                    if peer is not None:
                        args["peer"] = int(peer)
                    rec.add(name, cat, start, time.perf_counter(), args)
            return
        with self._in_mpi_timed(op):
            yield

    @contextlib.contextmanager
    def _in_mpi_timed(self, op: str) -> Iterator[None]:
        """:meth:`in_mpi`'s seconds: wall and thread CPU time under ``op``."""
        depth = getattr(self._timing_depth, "value", 0)
        self._timing_depth.value = depth + 1
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._timing_depth.value = depth
            if depth == 0:
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                with self._lock:
                    self._seconds[op] = self._seconds.get(op, 0.0) + dt
                    self._cpu_seconds += dc
                    self._cpu_by_op[op] = self._cpu_by_op.get(op, 0.0) + dc

    def _account_allgatherv(self, counts: Any, own: int, item: int) -> None:
        """Count an allgatherv of ``counts[j]`` items of ``item`` bytes from rank j (``own`` here):
        the ring model, every part but this rank's received and every part but the successor's sent."""
        total = int(counts.sum()) * item
        received = total - own * item
        successor = int(counts[(self.rank + 1) % self.size]) * item
        sent = total - successor if self.size > 1 else 0
        self._account("allgatherv", sent, received)

    def count(self, op: str, sent: float, received: float) -> None:
        """Count one call of ``op`` that moved ``sent``/``received`` bytes.

        For an algorithm that makes its own MPI calls (``reduce_ops``' rings,
        ``cuda_aware``'s device buffers) and reports them under the volume model.
        """
        self._account(op, sent, received)

    @contextlib.contextmanager
    def counted_as(self, op: str, sent: float, received: float) -> Iterator[None]:
        """Count the calls inside as one ``op`` of ``sent``/``received`` bytes, not one by one.

        For an algorithm built from this communicator's own calls that stands in
        for a collective (``reduce_ops.tree_reduce_once`` for an allreduce), so
        its bytes read as the collective's on every backend.
        """
        self._suspended = getattr(self, "_suspended", 0) + 1
        rec = _timeline.recorder
        start = time.perf_counter() if rec is not None else 0.0
        try:
            yield
        finally:
            self._suspended -= 1
        if rec is not None:      # the stand-in as one span of ``op`` (its bytes added just below)
            rec.add(op, _timeline.MPI, start, time.perf_counter(), {"as": "point-to-point"})
        self._account(op, sent, received)

    def _account(self, op: str, sent: float, received: float) -> None:
        if getattr(self, "_suspended", 0):
            return
        sent, received = _whole(sent, op), _whole(received, op)
        rec = _timeline.recorder
        if rec is not None:
            rec.add_bytes(op, sent, received)
        with self._lock:
            self._stats.sent += sent
            self._stats.received += received
            entry = self._stats.by_op.setdefault(op, OpStats())
            entry.calls += 1
            entry.sent += sent
            entry.received += received
            if self._phase is not None:
                ph = self._stats.by_phase.setdefault(self._phase, OpStats())
                ph.calls += 1
                ph.sent += sent
                ph.received += received

    def _allreduce_bytes(self, nbytes: int, item: int = 1) -> tuple[int, int]:
        """(sent, received) of this rank in a ring allreduce of ``nbytes`` in elements of
        ``item`` bytes (:func:`ring_allreduce_rank_bytes`)."""
        return ring_allreduce_rank_bytes(nbytes, self.size, self.rank, item)


def _whole(nbytes: float, op: str) -> int:
    """``nbytes`` as an int; a fractional byte count is a bug in the caller's accounting."""
    whole = int(nbytes)
    if whole != nbytes:
        raise ValueError(f"{op}: a byte count must be a whole number, got {nbytes!r}")
    return whole


class FusingAccounting(Accounting):
    """:class:`Accounting` that lets a caller fuse calls and account them itself.

    What :class:`~.lockstep.Lockstep` needs (``Lockstep.supports``): every
    backend has it (the mpi4py ``Communicator``, the torch.distributed ones).
    """

    @contextlib.contextmanager
    def unaccounted(self) -> Iterator[None]:
        """Count nothing inside (a caller that accounts the calls itself, e.g. ``lockstep``)."""
        self._suspended = getattr(self, "_suspended", 0) + 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _account_as(self, phase: str | None, op: str, sent: float, received: float) -> None:
        """:meth:`_account` under ``phase`` instead of the current one."""
        with self._lock:
            previous, self._phase = self._phase, phase
        try:
            self._account(op, sent, received)
        finally:
            self._phase = previous


__all__ = ["Accounting", "FusingAccounting", "OpStats", "allreduce_volume", "ring_allreduce_rank_bytes"]
