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
on rank 0. The ranks' clocks are aligned at the merge: every rank reads its
clock right after one barrier, and that instant is the same point of every
rank's time line (exact on one host, within a barrier's skew between hosts).

Off, the cost of a probe is one module attribute test (``timeline.recorder
is None``); on, a span costs about two clock reads and one list append.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

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


def gather_trace(comm: Any, rec: "Recorder | None", metadata: dict[str, Any] | None = None
                 ) -> dict[str, Any] | None:
    """Every rank's spans merged into one trace (returned on rank 0, ``None`` elsewhere).

    Collective: every rank of ``comm`` calls it (with its own recorder, or
    ``None`` for a rank that recorded nothing). The clocks are aligned at a
    barrier (see the module docstring) and time 0 is the earliest span of any
    rank. Stop the recorder first, or the gather records itself.
    """
    rows = [] if rec is None else list(rec.rows)
    names = {} if rec is None else rec.thread_names()
    comm.barrier()
    now = time.perf_counter()
    first = min((r[2] for r in rows), default=now)
    # each rank's rows relative to the shared instant; the earliest of all becomes 0
    parts = comm.allgather_object((now - first, trace_events(comm.rank, rows, now, names)))
    if comm.rank != 0:
        return None
    lead = max(p[0] for p in parts) * 1e6
    events = []
    for _, evs in parts:
        for ev in evs:
            if "ts" in ev:
                ev["ts"] = round(ev["ts"] + lead, 3)
            events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"world_size": comm.size, **(metadata or {})}}


__all__ = ["AGREE", "MPI", "PHASE", "Recorder", "WAIT", "gather_trace", "recorder", "span",
           "start", "stop", "trace_events"]
