"""Keras callbacks for compressed data-parallel training.

* :class:`BroadcastGlobalVariablesCallback` -- every rank starts from
  ``root_rank``'s model and optimizer variables.
* :class:`MetricAverageCallback` -- epoch-end metrics averaged over ranks.
* :class:`CompressionWarmupCallback` -- dense exchange for the first N steps
  or epochs, then the compression method.
* :class:`CompressionStatsCallback` -- bytes sent/received, compression
  ratio and compression error per epoch into ``logs`` (so into ``History``,
  ``CSVLogger`` and ``TensorBoard`` when those come later in the list).

All of them communicate through the model's optimizer's communicator (or the
one passed), identically on every rank, at the same points of ``fit``.
"""
from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np

from ..tensorflow import world
from ..tensorflow.broadcast import broadcast_variables
from .optimizer import reducer_of


def _comm_of(model: Any, comm: Any) -> Any:
    if comm is not None:
        return comm
    try:
        return reducer_of(model.optimizer).comm
    except ValueError:
        return world.communicator()


def model_state_variables(model: Any) -> list:
    """``model.variables`` without Keras 3's random-seed states (``seed_generator_state``).

    Dropout and other random layers keep their generator state in variables;
    broadcasting those would give every rank the same dropout masks.
    """
    return [v for v in model.variables
            if not str(getattr(v, "path", getattr(v, "name", ""))).endswith("seed_generator_state")]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` at train begin.

    Random layers' seed states are left alone, so ranks keep drawing different
    dropout masks (:func:`model_state_variables`).

    The optimizer is built first if it is not (Keras builds it lazily), so
    its slots and iteration counter are broadcast too and no step is taken
    from divergent states. If the model is not built yet when training
    begins (a subclassed model without an input shape), the broadcast happens
    after the first batch instead, as Horovod's callback does.
    """

    def __init__(self, root_rank: int = 0, comm: Any = None) -> None:
        super().__init__()
        self.root_rank = int(root_rank)
        self.comm = comm
        self.broadcast_done = False

    def _broadcast(self) -> None:
        model = self.model
        comm = _comm_of(model, self.comm)
        opt = model.optimizer
        if opt is not None and not opt.built and model.trainable_variables:
            opt.build(model.trainable_variables)
        broadcast_variables(model_state_variables(model), root_rank=self.root_rank, comm=comm)
        if opt is not None:
            broadcast_variables(opt.variables, root_rank=self.root_rank, comm=comm)
        self.broadcast_done = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each numeric epoch-end metric by its average over ranks.

    One allreduce of all values (sorted by name, so every rank sends the
    same vector). ``hvdc_*`` statistics stay per rank.
    """

    def __init__(self, comm: Any = None) -> None:
        super().__init__()
        self.comm = comm

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items()
                      if not k.startswith("hvdc_") and isinstance(v, (int, float, np.number)))
        if not keys:
            return
        comm = _comm_of(self.model, self.comm)
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        with comm.phase("hvdc_metric_average"):
            avg = comm.allreduce(values, op="avg")
        for k, v in zip(keys, avg):
            logs[k] = float(v)


class CompressionWarmupCallback(keras.callbacks.Callback):
    """Exchange gradients densely for the first ``steps`` batches or ``epochs`` epochs.

    Give exactly one of ``steps``/``epochs``. Steps count optimizer updates
    from the optimizer's ``iterations`` at train begin (so a resumed run
    continues the count); with ``steps_per_execution=k`` the switch happens
    at the first multiple of k at or after ``steps``. During warm-up the
    method's own state (residuals, step counter) is untouched.
    """

    def __init__(self, steps: int | None = None, epochs: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        if (steps is None) == (epochs is None):
            raise ValueError("CompressionWarmupCallback needs exactly one of steps= or epochs=")
        value, what = (steps, "steps") if steps is not None else (epochs, "epochs")
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"CompressionWarmupCallback: {what} must be an integer >= 0, got {value!r}")
        self.steps = None if steps is None else int(steps)
        self.epochs = None if epochs is None else int(epochs)
        self.verbose = verbose
        self._step = 0
        self._epoch = 0

    def _set(self, dense: bool) -> None:
        reducer = reducer_of(self.model.optimizer)
        if reducer.dense != dense and self.verbose and reducer.comm.rank == 0:
            print(f"CompressionWarmupCallback: {'dense' if dense else reducer.method.name} "
                  f"exchange from step {self._step}", flush=True)
        reducer.dense = dense

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._step = int(self.model.optimizer.iterations.numpy())
        if self.steps is not None:
            self._set(self._step < self.steps)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        if self.epochs is not None:
            self._set(epoch < self.epochs)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.steps is not None:
            self._set(self._step < self.steps)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._step += int(getattr(self.model, "steps_per_execution", 1) or 1)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.steps is not None:
            self._set(self._step < self.steps)


class CompressionStatsCallback(keras.callbacks.Callback):
    """Per-epoch statistics of the gradient exchange into ``logs``.

    Keys (this rank's values, bytes under the Communicator's volume model):

    * ``hvdc_bytes_sent``, ``hvdc_bytes_received`` -- the gradient exchange's
      bytes in the epoch, exactly the Communicator's counts around each step;
    * ``hvdc_steps`` -- exchanges in the epoch;
    * ``hvdc_compression_ratio`` -- bytes a dense ring allreduce of the same
      gradients would send (2N(P-1)/P per step) divided by
      ``hvdc_bytes_sent``;
    * ``hvdc_compression_error`` -- mean over the measured steps of
      ``||avg_method - avg_dense|| / ||avg_dense||``; measured on the first
      step of each epoch and every ``error_every`` steps (0: first step
      only; ``None``: never, then the key is absent). Each measurement costs
      one dense allreduce, counted separately as ``hvdc_check_bytes_sent``.

    Place it before ``TensorBoard``/``CSVLogger`` in the callback list.
    """

    def __init__(self, error_every: int | None = 0) -> None:
        super().__init__()
        if error_every is not None and (not isinstance(error_every, (int, np.integer))
                                        or error_every < 0):
            raise ValueError(f"error_every must be None or an integer >= 0, got {error_every!r}")
        self.error_every = error_every
        self._start = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        reducer_of(self.model.optimizer).measure_error_every = self.error_every or 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        reducer = reducer_of(self.model.optimizer)
        reducer.measure_next = self.error_every is not None
        self._start = reducer.stats.copy()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is None or self._start is None:
            return
        now, start = reducer_of(self.model.optimizer).stats, self._start
        sent = now.bytes_sent - start.bytes_sent
        dense = now.dense_bytes - start.dense_bytes
        logs["hvdc_bytes_sent"] = float(sent)
        logs["hvdc_bytes_received"] = float(now.bytes_received - start.bytes_received)
        logs["hvdc_steps"] = float(now.steps - start.steps)
        logs["hvdc_compression_ratio"] = float(dense / sent) if sent > 0 else math.inf
        if self.error_every is not None:
            count = now.error_count - start.error_count
            logs["hvdc_compression_error"] = (
                float((now.error_sum - start.error_sum) / count) if count else math.nan)
            logs["hvdc_check_bytes_sent"] = float(now.check_bytes_sent - start.check_bytes_sent)

    def on_train_end(self, logs: dict | None = None) -> None:
        reducer = reducer_of(self.model.optimizer)
        reducer.measure_error_every = 0
        reducer.measure_next = False
