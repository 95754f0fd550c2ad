"""Horovod's elastic API on a fixed MPI world (shared by the torch, TensorFlow and Keras front-ends).

Horovod Elastic (``horovodrun --min-np/--host-discovery-script``) lets hosts
join and leave a running job; it needs Horovod's elastic driver and Gloo. The
front-ends here run on a fixed MPI world (mpirun/srun/horovodrun -np N), so
the elastic API keeps its meaning for that case: ``@hvd.elastic.run`` syncs
the state from rank 0 and runs the training function; ``state.commit()``
saves a copy to return to; reset callbacks are kept (a fixed world never
resets). A script written for Horovod Elastic therefore runs unchanged at a
fixed size. Launching in elastic mode (``HOROVOD_ELASTIC=1``, set by
``horovodrun`` with ``--min-np``/``--host-discovery-script``) is refused with
a clear error, and a collective failing on one rank ends the job
(``MPI_Abort``, docs/failures.md) instead of restoring the last commit.
"""
from __future__ import annotations

import copy
import functools
import os
from typing import Any, Callable

from .basics import HorovodInternalError, HostsUpdatedInterrupt

ELASTIC_ENV = "HOROVOD_ELASTIC"


def refuse_elastic_launch() -> None:
    """Raise if the job was started by Horovod's elastic driver."""
    if os.environ.get(ELASTIC_ENV, "0") == "1":
        raise RuntimeError(
            "this job was launched in Horovod elastic mode (HOROVOD_ELASTIC=1: horovodrun with "
            "--min-np/--max-np/--host-discovery-script). horovod_compress runs on a fixed MPI "
            "world and cannot add or remove hosts: launch with a fixed size (horovodrun -np N "
            "or mpirun -np N); @hvd.elastic.run then runs the training function once")


class State:
    """Horovod's ``State``: ``commit``/``save``/``restore``/``sync`` and reset callbacks."""

    def __init__(self, bcast_object: Callable, get_rank: Callable) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable] = []

    def register_reset_callbacks(self, callbacks: list[Callable]) -> None:
        """Functions to call when the world changes (never, on a fixed world)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Horovod calls this after the world changed: ``reset()``, then the registered callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: Any, update_res: Any) -> None:
        """Never called on a fixed world."""

    def commit(self) -> None:
        """Save the state (the point ``restore()`` returns to); hosts never change here."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """A fixed MPI world has no host updates: nothing to raise."""

    def save(self) -> None:
        """Keep a copy of the state (what :meth:`restore` returns to)."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Return to the state of the last :meth:`save`/``commit()``."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Give every rank rank 0's state."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Hook for subclasses after a reset (nothing here)."""
        pass


class ObjectState(State):
    """Horovod's ``ObjectState``: keyword arguments become attributes synced from rank 0."""

    def __init__(self, bcast_object: Callable, get_rank: Callable, **kwargs: Any) -> None:
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Keep a copy of the state (what :meth:`restore` returns to)."""
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        """Return to the state of the last :meth:`save`/``commit()``."""
        self._set_attrs()

    def sync(self) -> None:
        """Give every rank rank 0's state."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, v)


def run_fn(func: Callable, reset: Callable) -> Callable:
    """Horovod's ``run_fn``: sync the state, run ``func(state, ...)``; ``reset`` never runs here."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        refuse_elastic_launch()
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "refuse_elastic_launch", "run_fn"]
