"""A timeline of one rank's phases, written as Chrome trace-event JSON.

Horovod's ``HOROVOD_TIMELINE=file.json`` records, per rank, when each tensor
was negotiated, reduced and copied; this is the same idea for the compressed
exchange: every rank records *spans* (a name, a category, a start and a
duration, and arguments such as bytes and peers) of

* every collective of the communicator (``allreduce``, ``allgatherv``,
  ``p2p`` with its peer, ...), with the bytes it moved under the volume model
  (:mod:`.accounting`),
* every wait for a non-blocking request (category ``wait``) and the per-call
  agreement (category ``agree``), where a rank waits for late peers,
* every *phase* a method labels with ``comm.phase(label)`` (Ok-Topk's
  split-and-reduce, balance-and-allgatherv, ...) and the spans the layers
  above add (a method's compression, decompression and feedback, a bucket, a
  training step).

:func:`trace_events` turns every rank's records into the trace-event format
(``"ph": "X"`` complete events in microseconds, one *process* per rank, one
*thread* per recording thread; "Trace Event Format", Google, the format
Perfetto and ``chrome://tracing`` open) and :func:`gather_trace` merges them
on rank 0. The ranks' clocks are aligned at the merge by ping-pongs with
rank 0 (:func:`clock_offsets`, Cristian's algorithm): within half the
shortest round trip, microseconds on one host or a LAN.

Off, the cost of a probe is one module attribute test (``timeline.recorder
is None``); on, a span costs about two clock reads and one list append.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import numpy as np

#: The recorder of this process while a timeline runs, else ``None`` (what every probe tests).
recorder: "Recorder | None" = None

#: Span categories: a collective's call, a wait for a request or for peers, a labelled phase.
MPI, WAIT, AGREE, PHASE = "mpi", "wait", "agree", "phase"


class Recorder:
    """One rank's spans: ``[name, category, start_s, end_s, thread, args]`` rows, in end order."""

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self._threads: dict[int, int] = {}
        self._thread_names: dict[int, str] = {}
        self._lock = threading.Lock()
        self._last: dict[int, list[Any]] = {}   # per thread: its last closed collective span

    def _thread(self) -> int:
        ident = threading.get_ident()
        tid = self._threads.get(ident)
        if tid is None:
            with self._lock:
                tid = self._threads.setdefault(ident, len(self._threads))
                self._thread_names[tid] = threading.current_thread().name
        return tid

    def add(self, name: str, category: str, start: float, end: float,
            args: dict[str, Any] | None = None) -> list[Any]:
        """Record a span from ``start`` to ``end`` (``time.perf_counter`` seconds); returns its row."""
        row = [name, category, start, end, self._thread(), args or {}]
        self.rows.append(row)         # list.append is atomic under the GIL
        if category == MPI:
            self._last[row[4]] = row
        return row

    @contextlib.contextmanager
    def span(self, name: str, category: str = PHASE, /, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the enclosed block; yields its ``args`` dict (add to it inside)."""
        start = time.perf_counter()
        try:
            yield args
        finally:
            self.add(name, category, start, time.perf_counter(), args)

    def add_bytes(self, op: str, sent: float, received: float) -> None:
        """Put a collective's counted bytes on this thread's last ``op`` span (the communicators
        count a call's bytes right after timing it)."""
        row = self._last.get(self._thread())
        if row is not None and row[0] == op:
            args = row[5]
            args["sent"] = args.get("sent", 0.0) + float(sent)
            args["received"] = args.get("received", 0.0) + float(received)

    def thread_names(self) -> dict[int, str]:
        """Thread number -> the name of the thread that recorded under it."""
        with self._lock:
            return dict(self._thread_names)


def start() -> Recorder:
    """Start recording in this process (a running recording continues); returns the recorder."""
    global recorder
    if recorder is None:
        recorder = Recorder()
    return recorder


def stop() -> "Recorder | None":
    """Stop recording; returns what was recorded (``None`` if nothing was running)."""
    global recorder
    done, recorder = recorder, None
    return done


_OFF = contextlib.nullcontext()


def span(name: str, category: str = PHASE, /, **args: Any) -> contextlib.AbstractContextManager:
    """:meth:`Recorder.span` on the running recorder; a shared no-op context (yielding
    ``None``) when none runs, so a probe costs one attribute test."""
    rec = recorder
    if rec is None:
        return _OFF
    return rec.span(name, category, **args)


def trace_events(rank: int, rows: list[list[Any]], origin: float,
                 thread_names: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """One rank's rows as trace events: process ``rank`` ("rank R"), microseconds since ``origin``.

    Complete events (``"ph": "X"``) with ``ts``/``dur`` in microseconds, plus
    the metadata events that name the process and its threads.
    """
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    for tid, tname in sorted((thread_names or {}).items()):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": tname}})
    for name, cat, start, end, tid, args in rows:
        events.append({"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid,
                       "ts": round((start - origin) * 1e6, 3),
                       "dur": round(max(end - start, 0.0) * 1e6, 3), "args": args})
    return events


#: Tag of the clock-offset ping-pong (:func:`clock_offsets`).
TAG_CLOCK = 7401


def clock_offsets(comm: Any, rounds: int = 8) -> list[float] | None:
    """Each rank's ``time.perf_counter`` minus rank 0's, as rank 0 estimates it (``None`` elsewhere).

    Rank 0 and each other rank exchange ``rounds`` ping-pongs: rank 0 sends at
    ``t0``, the peer answers with its clock ``t1``, rank 0 receives at ``t2``;
    the offset is ``t1 - (t0 + t2) / 2`` from the round with the shortest
    round trip, off by at most half of it (Cristian's algorithm, as NTP
    does). Collective over ``comm``.
    """
    if comm.rank != 0:
        for _ in range(rounds):
            comm.recv(0, TAG_CLOCK, dtype=np.float64)
            comm.isend(np.array([time.perf_counter()]), 0, TAG_CLOCK).wait()
        return None
    offsets = [0.0] * comm.size
    for peer in range(1, comm.size):
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            comm.isend(np.array([t0]), peer, TAG_CLOCK).wait()
            t1 = float(comm.recv(peer, TAG_CLOCK, dtype=np.float64)[0])
            t2 = time.perf_counter()
            if t2 - t0 < best:
                best, offsets[peer] = t2 - t0, t1 - (t0 + t2) / 2
    return offsets


def gather_trace(comm: Any, rec: "Recorder | None", metadata: dict[str, Any] | None = None
                 ) -> dict[str, Any] | None:
    """Every rank's spans merged into one trace (returned on rank 0, ``None`` elsewhere).

    Collective: every rank of ``comm`` calls it (with its own recorder, or
    ``None`` for a rank that recorded nothing). Each rank's times are put on
    rank 0's clock (:func:`clock_offsets`) and time 0 is the earliest span of
    any rank. Stop the recorder first, or the gather records itself.
    """
    rows = [] if rec is None else list(rec.rows)
    names = {} if rec is None else rec.thread_names()
    offsets = clock_offsets(comm) if comm.size > 1 else [0.0]
    parts = comm.allgather_object((rows, names))
    if comm.rank != 0:
        return None
    starts = [r[2] - offsets[rank] for rank, (rws, _) in enumerate(parts) for r in rws]
    origin = min(starts, default=0.0)
    events = []
    for rank, (rws, nms) in enumerate(parts):
        events += trace_events(rank, rws, origin + offsets[rank], nms)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"world_size": comm.size, "clock_offsets_s": offsets, **(metadata or {})}}


__all__ = ["AGREE", "MPI", "PHASE", "Recorder", "WAIT", "clock_offsets", "gather_trace", "recorder", "span",
           "start", "stop", "trace_events"]
