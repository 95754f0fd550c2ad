"""``horovod.tensorflow.keras``'s public API for Keras 3: change ``import horovod.tensorflow.keras as hvd`` only.

Every public name of ``horovod.tensorflow.keras`` 0.28 exists here with
Horovod's parameters (ours add keyword parameters at the end): the world,
process sets, value collectives (``allreduce``, ``allgather``, ``broadcast``,
``reducescatter`` on NumPy values or tensors, returning NumPy like
Horovod's), ``DistributedOptimizer`` (any ``Compression.<method>``, called
or uncalled), ``load_model``, ``callbacks`` and ``elastic``.
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ..compressors.registry import Compression, as_method
from ..horovod_api.basics import is_version_greater_equal_than  # noqa: F401 - Horovod's name
from ..horovod_api.basics import op_kind as _op_kind
from ..horovod_api.common import *  # noqa: F403 - Horovod's names every front-end shares
from ..tensorflow import horovod_api as _tf
from ..tensorflow.horovod_api import (  # noqa: F401 - Horovod's names
    cross_rank,
    cross_size,
    init,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from . import optimizer as _opt
from ..runtime.buckets import DEFAULT_BUCKET_BYTES


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


def allreduce(value: Any, name: str | None = None, average: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: Any = Compression.none) -> np.ndarray:
    """The reduction of ``value`` over ranks, as a NumPy value (Horovod's Keras ``allreduce``)."""
    return _numpy(_tf.allreduce(tf.constant(_numpy(value)), average=average,
                                compression=compression, op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, name=name))


def allgather(value: Any, name: str | None = None) -> np.ndarray:
    """Every rank's ``value`` concatenated along the first dimension, as NumPy."""
    return _numpy(_tf.allgather(tf.constant(_numpy(value)), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> np.ndarray:
    """``root_rank``'s ``value`` on every rank, as NumPy."""
    return _numpy(_tf.broadcast(tf.constant(_numpy(value)), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> np.ndarray:
    """Reduce ``value`` over ranks and keep this rank's rows, as NumPy."""
    return _numpy(_tf.reducescatter(tf.constant(_numpy(value)), op=op, name=name))


def broadcast_global_variables(root_rank: int) -> None:
    """Refused in eager Keras 3, as in Horovod: use ``callbacks.BroadcastGlobalVariablesCallback``."""
    raise RuntimeError(
        "hvd.broadcast_global_variables() does not support eager execution (Keras 3). Use "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(0) in fit(), or "
        "hvd.broadcast_variables(model.variables, root_rank=0)")


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = global_process_set,
                         scale_local_gradients: bool = True, *, bucket_bytes: int | None = None,
                         overlap: bool = True, comm: Any = None,
                         kernel_layout: str = "torch") -> Any:
    """Horovod's Keras ``DistributedOptimizer`` on Keras 3 (see :mod:`.optimizer`).

    ``op`` Average or Sum with any method. ``backward_passes_per_step=N``
    uses Keras's gradient accumulation: one exchange per N batches; with
    ``average_aggregated_gradients=False`` (Horovod's default) the exchanged
    gradient is the *sum* of the N micro-batch gradients, with ``True`` their
    mean, as in Horovod. ``num_groups``/``groups`` are accepted and do not
    change results; ``IndexedSlices`` are reduced densely whatever
    ``sparse_as_dense`` says.
    """
    kind = _op_kind(op)
    if gradient_predivide_factor != 1.0 and kind != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if kind not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer: op must be Average or Sum with horovod_compress, "
                         f"got {op!r}")
    if comm is None:
        comm = _tf._comm(process_set)
    opt = _opt.DistributedOptimizer(
        optimizer, compression=as_method(compression), name=name, op=kind,
        gradient_predivide_factor=gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step,
        bucket_bytes=DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
        overlap=overlap, comm=comm, sparse_as_dense=True, kernel_layout=kernel_layout)
    if int(backward_passes_per_step) > 1 and not average_aggregated_gradients:
        opt.hvdc_reducer.postscale = float(backward_passes_per_step)
    return opt


def load_model(filepath: str, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> Any:
    """``keras.models.load_model`` with the optimizer wrapped in :func:`DistributedOptimizer`.

    A model saved with our optimizer reloads with the plain Keras optimizer of
    the same class (plus its slots); it is then rebuilt as a distributed one
    with ``compression`` and its variables are copied over.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    inner = getattr(model, "optimizer", None)
    if inner is None:
        return model
    dist = DistributedOptimizer(type(inner).from_config(inner.get_config()),
                                compression=compression)
    if inner.built and model.trainable_variables:
        dist.build(model.trainable_variables)
        for dst, src in zip(dist.variables, inner.variables):
            if tuple(dst.shape) == tuple(src.shape):
                dst.assign(src)
    model.optimizer = dist
    model.train_function = None   # rebuilt by the next fit() with the distributed optimizer
    return model
