"""``hvd.elastic`` for TensorFlow on a fixed MPI world (see :mod:`horovod_compress.horovod_api.elastic`).

``TensorFlowKerasState(model, optimizer, **attrs)`` and
``TensorFlowState(variables, **attrs)`` sync their variables from rank 0
and keep a copy at ``commit()`` that ``restore()`` returns to; ``@run``
syncs the state and calls the training function.
"""
from __future__ import annotations

from typing import Any, Callable

from ..horovod_api.basics import HorovodInternalError
from ..horovod_api.elastic import HostsUpdatedInterrupt, ObjectState, State, refuse_elastic_launch
from ..horovod_api.elastic import run_fn as _run_fn
from .horovod_api import broadcast_object, broadcast_object_fn, broadcast_variables, rank
from .horovod_api import init as _init
from .horovod_api import shutdown as _shutdown


def init(*args: Any, **kwargs: Any) -> None:
    """Horovod's ``elastic.init``: the ordinary ``init`` on a fixed world (refused in elastic mode)."""
    refuse_elastic_launch()
    _init(*args, **kwargs)


def shutdown() -> None:
    """Mark the front-end uninitialised (MPI is finalised by mpi4py at exit)."""
    _shutdown()


def run_fn(func: Callable, reset: Callable) -> Callable:
    """Horovod's ``run_fn``: sync the state, then run ``func`` (``reset`` never runs here)."""
    return _run_fn(func, reset)


def run(func: Callable) -> Callable:
    """Decorator for the training function ``func(state, ...)``: sync, then run it."""
    return _run_fn(func, lambda: None)


def _values(variables: list) -> list:
    return [v.numpy().copy() for v in variables]


class TensorFlowState(ObjectState):
    """Variables and attributes synced from rank 0 (eager TensorFlow)."""

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError("TensorFlowState: TF1 sessions are not supported; run eagerly")
        self.variables = list(variables) if variables is not None else []
        self._saved_values = _values(self.variables)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        """Keep a copy of the state (what :meth:`restore` returns to)."""
        self._saved_values = _values(self.variables)
        super().save()

    def restore(self) -> None:
        """Return to the state of the last :meth:`save`/``commit()``."""
        for v, val in zip(self.variables, self._saved_values):
            v.assign(val)
        super().restore()

    def sync(self) -> None:
        """Give every rank rank 0's state."""
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        self._saved_values = _values(self.variables)
        super().sync()


class TensorFlowKerasState(ObjectState):
    """A Keras model (and optimizer) plus attributes, synced from rank 0."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._saved_model: list = []
        self._saved_opt: list = []
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)
        self._save_variables()

    def _opt_vars(self) -> list:
        opt = self.optimizer
        return list(opt.variables) if opt is not None and getattr(opt, "built", True) else []

    def _save_variables(self) -> None:
        self._saved_model = _values(self.model.variables)
        self._saved_opt = _values(self._opt_vars())

    def save(self) -> None:
        """Keep a copy of the state (what :meth:`restore` returns to)."""
        self._save_variables()
        super().save()

    def restore(self) -> None:
        """Return to the state of the last :meth:`save`/``commit()``."""
        for v, val in zip(self.model.variables, self._saved_model):
            v.assign(val)
        for v, val in zip(self._opt_vars(), self._saved_opt):
            v.assign(val)
        super().restore()

    def sync(self) -> None:
        """Give every rank rank 0's state."""
        if self.model.variables:
            broadcast_variables(self.model.variables, root_rank=0)
        if self._opt_vars():
            broadcast_variables(self._opt_vars(), root_rank=0)
        self._save_variables()
        super().sync()


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "broadcast_object", "broadcast_object_fn",
           "broadcast_variables", "init", "rank", "run", "run_fn", "shutdown"]
