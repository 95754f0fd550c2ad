"""The digits workload through Keras 3: ``model.fit`` with our optimizer and callbacks.

The same data, split and sharding as :mod:`.digits` (the PyTorch run), the
same 64-128-128-10 MLP, SGD with momentum: rank i trains on every P-th
training example, all ranks take the same number of steps (the shard is cut
to whole batches), every rank starts from rank 0's variables
(``BroadcastGlobalVariablesCallback``). ``hvdc train --framework tensorflow``
calls :func:`train_digits_keras`.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

from .digits import dense_bytes_per_step, load_digits_split


def make_keras_mlp(hidden: int = 128, seed: int = 0) -> Any:
    """64 -> hidden -> hidden -> 10 Keras MLP with ReLU, initialised from ``seed``."""
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(hidden, activation="relu", name="dense0"),
        keras.layers.Dense(hidden, activation="relu", name="dense1"),
        keras.layers.Dense(10, name="logits"),
    ], name="digits_mlp")


def test_accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy of ``model``'s argmax on ``(x, y)`` (one eager forward pass)."""
    logits = model(x, training=False)
    return float((np.argmax(np.asarray(logits), axis=1) == y).mean())


def params_digest(model: Any) -> str:
    """A hash of the model's weights (equal on every rank when they agree)."""
    return hashlib.blake2b(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights()),
                           digest_size=8).hexdigest()


def _recorder(data: Any, reducer: Any, history: list, bar: Any, steps_per_call: int) -> Any:
    import keras

    class EpochRecorder(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if bar is not None:
                bar.update(steps_per_call)

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            logs = logs or {}
            acc = test_accuracy(self.model, data.x_test, data.y_test)
            history.append({"epoch": epoch + 1, "test_accuracy": acc,
                            "bytes_sent": reducer.stats.bytes_sent,
                            "train_loss": float(logs.get("loss", float("nan"))),
                            "compression_error": float(logs.get("hvdc_compression_error",
                                                                float("nan")))})
            if bar is not None:
                bar.set_postfix(acc=f"{acc:.3f}")

    return EpochRecorder()


def train_digits_keras(compression: Any = None, comm: Any = None, *, epochs: int = 30,
                       batch_size: int = 32, hidden: int = 128, lr: float = 0.05,
                       momentum: float = 0.9, seed: int = 0, bucket_bytes: int | None = None,
                       overlap: bool = True, progress: bool = False, label: str = "",
                       steps_per_execution: int = 1,
                       extra_callbacks: list | None = None) -> dict[str, Any]:
    """Train the digits MLP with ``model.fit`` on all ranks of ``comm``; return metrics.

    Returns the keys of :func:`horovod_compress.tools.bench.digits.train_digits`:
    ``test_accuracy``, ``train_loss``, ``history`` (per epoch: accuracy,
    cumulative gradient-exchange bytes sent by this rank, loss, compression
    error), ``steps``, ``num_params``, ``bytes_sent_per_step``,
    ``bytes_received_per_step`` (the exchange alone, as counted by the
    Communicator), ``dense_bytes_per_step``, ``compression_ratio``,
    ``seconds_per_step``, ``comm_seconds_per_step``,
    ``wait_seconds_per_step``, ``params_digest``, ``method``, ``config``,
    ``world_size``. ``extra_callbacks`` run after the statistics callback and
    before the metric averaging. ``steps_per_execution`` is Keras's (several
    steps per ``tf.function`` call; batch-level callbacks then fire once per call).
    """
    import keras

    from ...compressors.registry import create
    from ...keras import (
        BroadcastGlobalVariablesCallback,
        CompressionStatsCallback,
        DistributedOptimizer,
        MetricAverageCallback,
    )
    from ...mpi_collectives import Communicator
    from ...runtime.buckets import DEFAULT_BUCKET_BYTES

    comm = comm if comm is not None else Communicator()
    method = compression if compression is not None else create("none")
    data = load_digits_split(seed)
    steps_per_epoch = max(1, (len(data.y_train) // comm.size) // batch_size)
    n = steps_per_epoch * batch_size
    xs = data.x_train[comm.rank::comm.size][:n]
    ys = data.y_train[comm.rank::comm.size][:n]

    model = make_keras_mlp(hidden, seed)
    keras.utils.set_random_seed(seed * 1000 + comm.rank + 1)  # per-rank shuffling
    opt = DistributedOptimizer(keras.optimizers.SGD(learning_rate=lr, momentum=momentum),
                               compression=method, comm=comm, overlap=overlap,
                               bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False, steps_per_execution=steps_per_execution)
    num_params = int(sum(np.prod(w.shape) for w in model.trainable_weights))
    reducer = opt.hvdc_reducer
    history: list[dict[str, Any]] = []
    bar = None
    if progress and comm.rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=epochs * steps_per_epoch, desc=label or method.name, unit="step",
                   leave=False, dynamic_ncols=True)
    callbacks = [BroadcastGlobalVariablesCallback(0, comm=comm),
                 CompressionStatsCallback(error_every=0),
                 *(extra_callbacks or []),
                 MetricAverageCallback(comm=comm),
                 _recorder(data, reducer, history, bar, steps_per_execution)]
    t_start = time.perf_counter()
    model.fit(xs, ys, batch_size=batch_size, epochs=epochs, shuffle=True, verbose=0,
              callbacks=callbacks)
    elapsed = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    steps = epochs * steps_per_epoch
    if reducer.stats.steps != steps:
        raise RuntimeError(f"expected {steps} gradient exchanges, the reducer ran {reducer.stats.steps}")
    sent = reducer.stats.bytes_sent / steps
    dense = dense_bytes_per_step(num_params, comm.size)
    return {
        "method": method.name, "config": method.config(), "world_size": comm.size,
        "test_accuracy": history[-1]["test_accuracy"], "train_loss": history[-1]["train_loss"],
        "history": history, "steps": steps, "num_params": num_params,
        "bytes_sent_per_step": sent,
        "bytes_received_per_step": reducer.stats.bytes_received / steps,
        "dense_bytes_per_step": dense, "compression_ratio": dense / sent if sent else float("inf"),
        "seconds_per_step": elapsed / steps,
        "comm_seconds_per_step": reducer.comm_seconds / steps,
        "wait_seconds_per_step": reducer.wait_seconds / steps,
        "params_digest": params_digest(model),
    }
