"""``hvd.elastic`` for Keras 3 on a fixed MPI world (see :mod:`horovod_compress.horovod_api.elastic`).

``KerasState(model, optimizer, **attrs)`` (= ``TensorFlowKerasState``),
the callbacks that commit and track batch/epoch, and ``@run``.
"""
from __future__ import annotations

from typing import Any, Callable

import keras

from ..horovod_api.elastic import run_fn as _run_fn
from ..tensorflow.elastic import TensorFlowKerasState


class KerasState(TensorFlowKerasState):
    """Horovod's ``KerasState``: model, optimizer and attributes synced from rank 0."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


def run(func: Callable) -> Callable:
    """Decorator for the training function ``func(state, ...)``: sync, then run it."""
    return _run_fn(func, lambda: None)


class _StateCallback(keras.callbacks.Callback):
    """A Keras callback that updates the elastic ``state`` it is given."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state


class CommitStateCallback(_StateCallback):
    """Commit ``state`` every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__(state)
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()
        self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(_StateCallback):
    """Keep ``state.batch`` at the number of batches done in the epoch."""

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(_StateCallback):
    """Keep ``state.epoch`` at the number of epochs done."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = epoch + 1


__all__ = ["CommitStateCallback", "KerasState", "TensorFlowKerasState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
