"""``horovod.tensorflow``'s public API on mpi4py: change ``import horovod.tensorflow as hvd`` only.

Every public name of ``horovod.tensorflow`` 0.28 exists here with Horovod's
parameters (ours add keyword parameters at the end). Tensor collectives work
eagerly and inside ``tf.function`` (one ``tf.numpy_function`` per call,
:mod:`.bridge`); ``compression=`` takes any ``Compression.<method>`` (called
or uncalled). ``DistributedGradientTape`` and ``PartialDistributedGradientTape``
run our exchange (:mod:`.tape`); ``DistributedOptimizer`` wraps Keras 3
optimizers (:mod:`horovod_compress.keras`). What TF1 graph sessions need
(``broadcast_global_variables`` outside a graph, legacy ``tf.compat.v1``
optimizers, ``SyncBatchNormalization``) is refused with a message that names
the replacement.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from ..horovod_api import basics as hb
from ..compressors.registry import Compression, as_method
from ..horovod_api.basics import (  # noqa: F401 - Horovod's names
    check_num_rank_power_of_2,
    handle_average_backwards_compatibility,
    split_list,
)
from ..horovod_api.common import *  # noqa: F403 - Horovod's names every front-end shares
from .bridge import numpy_call
from ..runtime.buckets import DEFAULT_BUCKET_BYTES
from . import tape as _tape
from .broadcast import broadcast_variables as _bv

_FW = "tensorflow"
_CALLS = hb.FrontEndCalls(_FW)


# ------------------------------------------------------------------------------- world
(init, shutdown, rank, size, local_rank, local_size, cross_rank, cross_size, is_homogeneous,
 barrier) = _CALLS.world()
_comm = _CALLS.comm


def join() -> int:
    """Wait for every rank; the rank that arrived last (see :func:`horovod_basics.join`)."""
    return hb.join(_FW)


def gpu_available(ext_base_name: str = "tensorflow", verbose: bool = False) -> bool:
    """Whether TensorFlow sees a GPU."""
    return bool(tf.config.list_physical_devices("GPU"))


def rank_op(name: str | None = None) -> tf.Tensor:
    """This rank as a ``tf.int32`` constant."""
    return tf.constant(rank(), dtype=tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """The local rank as a ``tf.int32`` constant."""
    return tf.constant(local_rank(), dtype=tf.int32, name=name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The size of process set ``process_set_id`` as a ``tf.int32`` constant."""
    return tf.constant(_set_by_id(process_set_id).size() or size(), dtype=tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The local size as a ``tf.int32`` constant."""
    return tf.constant(local_size(), dtype=tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank is in process set ``process_set_id``, else 0 (``tf.int32``)."""
    return tf.constant(1 if _set_by_id(process_set_id).included() else 0, dtype=tf.int32,
                       name=name)


def _set_by_id(process_set_id: int) -> ProcessSet:
    if process_set_id == 0:
        hb.communicator(_FW)
        return global_process_set
    if process_set_id not in hb._SETS:
        raise ValueError(f"no process set with id {process_set_id}")
    return hb._SETS[process_set_id]


def vars_to_refs(vars: Sequence[Any]) -> tuple:
    """Horovod's helper: hashable references of variables (``ref()`` where it exists)."""
    if isinstance(vars, list):
        return tuple(vars_to_refs(v) for v in vars)
    return vars.ref() if hasattr(vars, "ref") else vars


def refs_to_vars(refs: Sequence[Any]) -> list:
    """Inverse of :func:`vars_to_refs`."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref() if hasattr(refs, "deref") else refs


# ------------------------------------------------------------------------------ bridge
def _wire(tensor: Any) -> tf.Tensor:
    t = tf.convert_to_tensor(tensor) if not isinstance(tensor, tf.IndexedSlices) \
        else tf.convert_to_tensor(tensor)
    return tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t


def _py(fn: Callable, inputs: list, out_dtypes: list, out_shapes: list) -> list:
    """Run NumPy ``fn`` eagerly or as one stateful graph op; ``out_shapes`` may be partial."""
    if tf.executing_eagerly():
        outs = fn(*[np.asarray(t) for t in inputs])
        return [tf.convert_to_tensor(np.ascontiguousarray(o), dtype=d)
                for o, d in zip(outs, out_dtypes)]
    outs = tf.numpy_function(lambda *a: [np.ascontiguousarray(o) for o in fn(*a)], inputs,
                             out_dtypes, stateful=True, name="hvdc_collective")
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for o, s in zip(outs, out_shapes):
        o.set_shape(s)
    return list(outs)


def allreduce(tensor: Any, average: Any = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: Any = global_process_set, ignore_name_scope: bool = False,
              comm: Any = None) -> tf.Tensor:
    """The reduction of ``tensor`` over ranks (default: the average), eager or graph.

    ``compression`` runs that method's compressed allreduce for Average/Sum
    (``name`` keys its per-tensor state). ``tf.IndexedSlices`` are reduced
    densely and returned dense. ``comm``: our Communicator to use instead of
    ``process_set``'s.
    """
    kind = hb.op_kind(op, average)
    method = as_method(compression)
    comm = _comm(process_set) if comm is None else comm
    dtype = tf.as_dtype(tensor.dtype)
    value = _wire(tensor)
    shape = value.shape

    def run(x: np.ndarray) -> list[np.ndarray]:
        out = hb.allreduce_scaled(method, comm, x, kind, name, prescale_factor, postscale_factor)
        return [np.ascontiguousarray(np.asarray(out).reshape(x.shape), dtype=x.dtype)]

    (out,) = numpy_call(run, [value], [value.dtype], [shape], name="hvdc_allreduce",
                        in_shapes=[shape])
    return tf.cast(out, dtype) if out.dtype != dtype else out


def grouped_allreduce(tensors: Sequence[Any], average: Any = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = global_process_set, ignore_name_scope: bool = False,
                      name: str | None = None) -> list:
    """:func:`allreduce` of each tensor (names ``name.i``); a list of results."""
    method = as_method(compression)
    return [allreduce(t, average, device_dense, device_sparse, method, op, prescale_factor,
                      postscale_factor, None if name is None else f"{name}.{i}", process_set)
            for i, t in enumerate(tensors)]


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = global_process_set) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ)."""
    comm = _comm(process_set)
    value = _wire(tensor)
    dtype = tf.as_dtype(tensor.dtype)
    (out,) = _py(lambda x: [hb.allgather_rows(comm, x)], [value], [value.dtype],
                 [tf.TensorShape([None]).concatenate(value.shape[1:]) if value.shape.rank
                  else tf.TensorShape([None])])
    return tf.cast(out, dtype) if out.dtype != dtype else out


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: Any = global_process_set) -> list:
    """:func:`allgather` of each tensor."""
    return [allgather(t, None, ignore_name_scope, process_set) for t in tensors]


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False, process_set: Any = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every rank (eager or graph)."""
    comm = _comm(process_set)
    root = hb.root_in(process_set, root_rank, _FW)
    value = _wire(tensor)
    dtype = tf.as_dtype(tensor.dtype)

    def run(x: np.ndarray) -> list[np.ndarray]:
        buf = np.ascontiguousarray(x).copy()
        comm.broadcast(buf, root=root)
        return [buf]

    (out,) = _py(run, [value], [value.dtype], [value.shape])
    return tf.cast(out, dtype) if out.dtype != dtype else out


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> list:
    """Assign ``root_rank``'s values to ``variables`` in place; returns their new values."""
    variables = list(variables)
    _bv(variables, root_rank=hb.root_in(process_set, root_rank, _FW), comm=_comm(process_set))
    return [v.read_value() if hasattr(v, "read_value") else v.value for v in variables]


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: Any = global_process_set, inplace: bool = False,
                        comm: Any = None) -> None:
    """``root_rank``'s values into ``variables`` (one fused broadcast; eager or graph)."""
    if comm is None:
        comm = _comm(process_set)
        root_rank = hb.root_in(process_set, root_rank, _FW)
    _bv(list(variables), root_rank=root_rank, comm=comm)


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graphs: every global variable from ``root_rank``. Eagerly refused, as in Horovod."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: Any = global_process_set, comm: Any = None) -> Any:
    """Any picklable ``obj`` from ``root_rank`` (eager)."""
    return _CALLS.broadcast_object(obj, root_rank, process_set, comm)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = global_process_set) -> Callable[[Any], Any]:
    """A function ``obj -> broadcast_object(obj, root_rank)``."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: Any = global_process_set) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    return _comm(process_set).allgather_object(obj)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False, process_set: Any = global_process_set) -> Any:
    """Rows ``splits[j]`` go to rank j; returns what arrived (and, given ``splits``, the rows
    received from each rank)."""
    comm = _comm(process_set)
    value = _wire(tensor)
    dtype = tf.as_dtype(tensor.dtype)
    rest = value.shape[1:] if value.shape.rank else tf.TensorShape([])
    inputs = [value] if splits is None else [value, tf.cast(splits, tf.int32)]

    def run(x: np.ndarray, *s: np.ndarray) -> list[np.ndarray]:
        out, recv = hb.alltoall_rows(comm, x, s[0] if s else None)
        return [out, recv.astype(np.int32)]

    out, recv = _py(run, inputs, [value.dtype, tf.int32],
                    [tf.TensorShape([None]).concatenate(rest), tf.TensorShape([comm.size])])
    out = tf.cast(out, dtype) if out.dtype != dtype else out
    return (out, recv) if splits is not None else out


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: Any = Average, name: str | None = None,
                  process_set: Any = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over ranks; keep this rank's block of rows (the first ``n % P`` ranks one more)."""
    hb.require_uncompressed_reducescatter(as_method(compression))
    comm = _comm(process_set)
    kind = hb.op_kind(op)
    value = _wire(tensor)
    dtype = tf.as_dtype(tensor.dtype)

    def run(x: np.ndarray) -> list[np.ndarray]:
        out = hb.reducescatter_scaled(comm, x, kind, prescale_factor, postscale_factor)
        return [out.astype(x.dtype, copy=False)]

    (out,) = _py(run, [value], [value.dtype], [tf.TensorShape([None]).concatenate(value.shape[1:])])
    return tf.cast(out, dtype) if out.dtype != dtype else out


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    """:func:`reducescatter` of each tensor."""
    return [reducescatter(t, device_dense, compression, op, None, process_set, False,
                          prescale_factor, postscale_factor) for t in tensors]


# -------------------------------------------------------------------- tapes, optimizers
def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "", compression: Any = Compression.none,
                            sparse_as_dense: bool = False, op: Any = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: Any = global_process_set,
                            scale_local_gradients: bool = True, *, bucket_bytes: int | None = None,
                            overlap: bool = True, comm: Any = None,
                            names: list[str] | None = None,
                            kernel_layout: str = "torch") -> tf.GradientTape:
    """Horovod's ``DistributedGradientTape``: ``gradient()`` averages over ranks with ``compression``.

    ``op`` Average or Sum (Adasum/Min/Max/Product are refused: gradients are
    averaged or summed). ``num_groups``/``groups`` are accepted and do not
    change results (our fusion buckets group tensors: ``bucket_bytes``).
    ``tf.IndexedSlices`` gradients are always reduced densely (as with
    ``sparse_as_dense=True``). ``process_set`` restricts the exchange to its
    ranks. See :func:`horovod_compress.tensorflow.tape.DistributedGradientTape`
    for ``bucket_bytes``, ``overlap``, ``comm``, ``names`` and ``kernel_layout``.
    """
    kind = hb.op_kind(op)
    if gradient_predivide_factor != 1.0 and kind != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if kind not in (Average, Sum):
        raise ValueError(f"DistributedGradientTape: op must be Average or Sum with "
                         f"horovod_compress, got {op!r} (Adasum/Min/Max/Product of gradients "
                         "are not supported)")
    if comm is None:
        comm = _comm(process_set)
    out = _tape.DistributedGradientTape(
        gradtape, compression=as_method(compression), op=kind,
        gradient_predivide_factor=gradient_predivide_factor,
        bucket_bytes=DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
        overlap=overlap, comm=comm, names=names, sparse_as_dense=True,
        kernel_layout=kernel_layout)
    out._hvdc_scale_local = bool(scale_local_gradients)
    return out


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "", compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: Any = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: Any = global_process_set,
                                   local_layers: Any = None, scale_local_gradients: bool = True,
                                   **options: Any) -> tf.GradientTape:
    """A ``DistributedGradientTape`` that keeps the gradients of ``local_layers`` local.

    Their gradients are not exchanged; with ``scale_local_gradients`` they are
    divided by the number of ranks (Horovod's rule).
    """
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients, **options)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = global_process_set,
                         scale_local_gradients: bool = True, **options: Any) -> Any:
    """Horovod's TF ``DistributedOptimizer``: Keras 3 optimizers (see :mod:`horovod_compress.keras`).

    Legacy ``tf.compat.v1.train.Optimizer`` (TF1 sessions) is refused: use
    ``DistributedGradientTape`` or a Keras optimizer.
    """
    import keras
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"horovod_compress.tensorflow.DistributedOptimizer wraps Keras 3 optimizers; got "
            f"{type(optimizer).__name__} (TF1 tf.compat.v1.train.Optimizer and graph sessions "
            "are not supported): use hvd.DistributedGradientTape with a Keras optimizer")
    from ..keras.horovod_api import DistributedOptimizer as _keras_opt
    return _keras_opt(optimizer, name=name, device_dense=device_dense,
                      device_sparse=device_sparse, compression=compression,
                      sparse_as_dense=sparse_as_dense,
                      gradient_predivide_factor=gradient_predivide_factor, op=op,
                      backward_passes_per_step=backward_passes_per_step,
                      average_aggregated_gradients=average_aggregated_gradients,
                      num_groups=num_groups, groups=groups, process_set=process_set,
                      scale_local_gradients=scale_local_gradients, **options)


class LocalGradientAggregationHelper:
    """Horovod's internal helper of its TF1 optimizer (``backward_passes_per_step``).

    Not needed here: Keras 3 accumulates gradients itself
    (``gradient_accumulation_steps``, set by ``DistributedOptimizer``'s
    ``backward_passes_per_step``).
    """

    def __init__(self, backward_passes_per_step: int, allreduce_func: Any, sparse_as_dense: bool,
                 average_aggregated_gradients: bool, rank: int, optimizer_type: Any,
                 process_set: Any = global_process_set, scale_local_gradients: bool = True,
                 name: str = "") -> None:
        raise NotImplementedError(
            "LocalGradientAggregationHelper is Horovod's internal helper for TF1 optimizers; "
            "use DistributedOptimizer(keras_optimizer, backward_passes_per_step=N) (Keras "
            "gradient accumulation) instead")


class SyncBatchNormalization:
    """Horovod's ``SyncBatchNormalization`` (a TF1/Keras 2 layer): not available.

    Refused at construction: Keras 3's ``BatchNormalization`` cannot be
    synchronised through this front-end; use per-rank ``BatchNormalization``
    or the PyTorch front-end's ``SyncBatchNorm``.
    """

    def __init__(self, fused: bool = False, **kwargs: Any) -> None:
        raise NotImplementedError(
            "SyncBatchNormalization is not available in horovod_compress.tensorflow (Keras 3): "
            "use keras.layers.BatchNormalization (per-rank statistics) or "
            "horovod_compress.torch.SyncBatchNorm")
