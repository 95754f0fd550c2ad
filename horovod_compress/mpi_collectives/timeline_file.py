"""``HOROVOD_TIMELINE=file.json``: one merged timeline file of every rank's phases.

As in Horovod, setting ``HOROVOD_TIMELINE`` to a path (or calling
``hvd.start_timeline(path)`` / ``hvd.stop_timeline()`` on every rank) records
the exchange's phases on every rank (:mod:`horovod_compress.mpi_collectives.timeline`)
and rank 0 writes them, merged, as Chrome trace-event JSON (one process per
rank) when the timeline stops: at ``stop_timeline()`` or when the script
exits. Open the file in https://ui.perfetto.dev or ``chrome://tracing``
(docs/timeline.md).

The environment variable is read at the first compressed allreduce (or
front-end ``init()``) of the process. ``HVDC_TIMELINE`` has the same meaning
and wins over ``HOROVOD_TIMELINE``; when Horovod itself runs in the process
(the Horovod adapter), ``HOROVOD_TIMELINE`` is Horovod's own file and ours is
written beside it as ``<stem>.hvdc.json``.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from . import timeline

TIMELINE_ENV = "HOROVOD_TIMELINE"
OWN_ENV = "HVDC_TIMELINE"

_lock = threading.Lock()
_session: dict[str, Any] = {}     # "path", "comm" while a timeline file is being recorded
_ENV_DONE = False


def _horovod_running() -> bool:
    """Whether Horovod's own library is loaded in this process (it then owns ``HOROVOD_TIMELINE``)."""
    return "horovod.common.basics" in sys.modules


def env_path() -> str | None:
    """The timeline path the environment asks for (see the module docstring), or ``None``."""
    own = os.environ.get(OWN_ENV, "").strip()
    if own:
        return own
    path = os.environ.get(TIMELINE_ENV, "").strip()
    if not path:
        return None
    if _horovod_running():
        p = Path(path)
        return str(p.with_name(p.stem + ".hvdc" + (p.suffix or ".json")))
    return path


def start_timeline(comm: Any, path: str | os.PathLike) -> None:
    """Start recording this rank's phases; rank 0 writes the merged file at :func:`stop_timeline`.

    Every rank of ``comm`` must call it (and :func:`stop_timeline`, which is
    collective); a running timeline keeps its file. The file is also written
    when the process exits.
    """
    path = os.fspath(path)
    if not path:
        raise ValueError("start_timeline needs a file path")
    with _lock:
        if _session:
            return
        _session.update(path=path, comm=comm)
        timeline.start()
        if not _session.get("atexit"):
            atexit.register(_stop_at_exit)
            _session["atexit"] = True


def timeline_running(comm: Any = None) -> bool:
    """Whether a timeline file is being recorded (given ``comm``: merged over that communicator)."""
    return bool(_session.get("path")) and (comm is None or _session.get("comm") is comm)


def stop_timeline() -> str | None:
    """Stop recording and write the merged trace on rank 0 (collective); returns the path
    (``None`` if no timeline was running)."""
    with _lock:
        path, comm = _session.pop("path", None), _session.pop("comm", None)
    if path is None:
        return None
    rec = timeline.stop()
    trace = timeline.gather_trace(comm, rec, {"source": "horovod_compress"})
    if trace is not None:
        write_trace(trace, path)
    return path


def write_trace(trace: dict[str, Any], path: str | os.PathLike) -> None:
    """Write a merged trace (:func:`~horovod_compress.mpi_collectives.timeline.gather_trace`) as JSON."""
    target = Path(path)
    if target.parent and not target.parent.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(trace, fh, separators=(",", ":"))
    os.replace(tmp, target)


def _stop_at_exit() -> None:
    """At exit: write the file; if the communicator is gone, say so rather than hang or fail."""
    if not _session.get("path"):
        return
    try:
        stop_timeline()
    except Exception as exc:  # noqa: BLE001 - exiting: report, never raise
        warnings.warn(f"horovod_compress: the timeline could not be merged at exit ({exc}); "
                      f"call hvd.stop_timeline() before shutting the communicator down", stacklevel=1)


def ensure_env_timeline(comm: Any) -> None:
    """Start the timeline the environment asks for, once per process (a flag test afterwards).

    Called by the first :meth:`~horovod_compress.compressors.base.Method.allreduce`
    and by the front-ends' ``init()``.
    """
    global _ENV_DONE
    if _ENV_DONE:
        return
    _ENV_DONE = True
    path = env_path()
    if path is not None and comm is not None and hasattr(comm, "allgather_object"):
        start_timeline(comm, path)


__all__ = ["OWN_ENV", "TIMELINE_ENV", "ensure_env_timeline", "env_path", "start_timeline",
           "stop_timeline", "timeline_running", "write_trace"]
