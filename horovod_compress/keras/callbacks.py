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

from ..horovod_api.basics import is_version_greater_equal_than  # noqa: F401 - Horovod's name here
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

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None,
                 comm: Any = None) -> None:
        super().__init__()
        self.root_rank = int(root_rank)
        self.comm = comm
        self.device = device
        self._local = {id(v) for v in (local_variables or [])}
        self.broadcast_done = False

    def _broadcast(self) -> None:
        model = self.model
        comm = _comm_of(model, self.comm)
        opt = model.optimizer
        if opt is not None and not opt.built and model.trainable_variables:
            opt.build(model.trainable_variables)
        keep = [v for v in model_state_variables(model) if id(v) not in self._local]
        broadcast_variables(keep, root_rank=self.root_rank, comm=comm)
        if opt is not None:
            broadcast_variables([v for v in opt.variables if id(v) not in self._local],
                                root_rank=self.root_rank, comm=comm)
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

    def __init__(self, device: str = "", comm: Any = None) -> None:
        super().__init__()
        self.device = device
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


def _decision_log(reducer: Any) -> list:
    """The decisions of the reducer's method so far (``Compression.auto``), else none."""
    log = getattr(getattr(reducer, "method", None), "decision_log", None)
    return log() if log is not None else []


class CompressionStatsCallback(keras.callbacks.Callback):
    """Per-epoch statistics of the gradient exchange into ``logs``.

    Keys (this rank's values, bytes under the Communicator's volume model):

    * ``hvdc_bytes_sent``, ``hvdc_bytes_received`` -- the gradient exchange's
      bytes in the epoch, exactly the Communicator's counts around each step;
    * ``hvdc_steps`` -- exchanges in the epoch;
    * ``hvdc_compression_ratio`` -- bytes a dense ring allreduce of the same
      gradients would send (2N(P-1)/P per step) divided by
      ``hvdc_bytes_sent``;
    * ``hvdc_auto_decisions`` -- with ``Compression.auto``: the decisions it took in the
      epoch (its ``decisions()`` says which);
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
        self._decisions_start = len(_decision_log(reducer))

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
        if hasattr(getattr(reducer_of(self.model.optimizer), "method", None), "decision_log"):
            logs["hvdc_auto_decisions"] = float(len(_decision_log(reducer_of(self.model.optimizer)))
                                                - self._decisions_start)
        if self.error_every is not None:
            count = now.error_count - start.error_count
            logs["hvdc_compression_error"] = (
                float((now.error_sum - start.error_sum) / count) if count else math.nan)
            logs["hvdc_check_bytes_sent"] = float(now.check_bytes_sent - start.check_bytes_sent)

    def on_train_end(self, logs: dict | None = None) -> None:
        reducer = reducer_of(self.model.optimizer)
        reducer.measure_error_every = 0
        reducer.measure_next = False


# ------------------------------------------------- Horovod's learning-rate callbacks
def _get_lr(optimizer: Any) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _set_lr(optimizer: Any, value: float) -> None:
    optimizer.learning_rate = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's ``LearningRateScheduleCallback``: ``lr = initial_lr * multiplier(epoch)``.

    From ``start_epoch`` to ``end_epoch`` (exclusive): per epoch with
    ``staircase`` (at its first batch), else per batch with a fractional
    epoch (``steps_per_epoch`` from ``fit``'s ``steps`` if not given). A
    constant ``multiplier`` m means ``m ** (epoch - start_epoch)``. With
    ``momentum_correction`` an optimizer's ``momentum`` is scaled by
    new_lr / old_lr for the batch after a change (Goyal et al.). The epoch's
    learning rate goes into ``logs["lr"]``.
    """

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.restore_momentum: float | None = None
        self.current_epoch: int | None = None
        self.multiplier = multiplier if callable(multiplier) else \
            (lambda epoch: multiplier ** (epoch - start_epoch))

    def _autodetect_steps_per_epoch(self) -> int:
        steps = (self.params or {}).get("steps")
        if steps:
            return int(steps)
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify the "
                         f"steps_per_epoch parameter to {type(self).__name__}()")

    def _adjust_learning_rate(self, epoch: float) -> None:
        opt = self.model.optimizer
        old_lr = _get_lr(opt)
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(opt, new_lr)
        momentum = getattr(opt, "momentum", None)
        if self.momentum_correction and isinstance(momentum, float) and momentum and old_lr > 0:
            self.restore_momentum = momentum
            opt.momentum = momentum * new_lr / old_lr

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            self.model.optimizer.momentum = self.restore_momentum
            self.restore_momentum = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.current_epoch < self.start_epoch or (
                self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's ``LearningRateWarmupCallback``: lr from ``initial_lr / P`` to ``initial_lr``.

    Over ``warmup_epochs`` epochs, per batch:
    ``lr = initial_lr / P * (e * (P - 1) / warmup_epochs + 1)`` with ``e`` the
    fractional epoch at the batch's end (Goyal et al.'s gradual warm-up).
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            p = world.size()
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / p * (epoch * (p - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and world.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.", flush=True)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's ``BestModelCheckpoint``: ``ModelCheckpoint(save_best_only=True)``, rank 0 writes.

    Horovod leaves ``filepath`` to its Spark estimator; here it defaults to
    ``best.keras`` (``best.weights.h5`` with ``save_weights_only``) and can be
    given as ``filepath=``. Other ranks write nothing.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: Any = "epoch", filepath: str | None = None) -> None:
        if filepath is None:
            filepath = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)

    def _save_model(self, *args: Any, **kwargs: Any) -> Any:
        if world.rank() != 0:
            return None
        return super()._save_model(*args, **kwargs)
