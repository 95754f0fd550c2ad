"""``DistributedOptimizer`` for Keras 3 optimizers (TensorFlow backend).

``DistributedOptimizer(keras.optimizers.SGD(0.05), compression=...)`` returns
an optimizer of a subclass of the wrapped one's class (built from its
config, as Horovod does), so ``isinstance(opt, keras.optimizers.SGD)`` holds
and ``model.compile(optimizer=opt)`` / ``model.fit`` work unchanged.

Where the allreduce happens: Keras 3's ``apply()`` filters empty gradients,
then ``_backend_apply_gradients`` either updates every step or -- with
``gradient_accumulation_steps=N`` -- adds the gradient to an accumulator and
updates every N-th step with the accumulated mean. Both paths call
``_clip_gradients`` on exactly the gradients about to be applied, so that is
where ours reduces them (with the variables recorded by
``_backend_apply_gradients``): with accumulation the exchange runs once per
N micro-batches, on the accumulated gradient -- Horovod's
``backward_passes_per_step`` -- and clipping acts on the global average.
``None`` gradients are replaced by zeros before Keras filters them, so every
rank reduces the same tensors (Horovod's rule in PyTorch).

Compressor state (residuals, thresholds, step counters) is saved and
restored with Keras checkpoints (``model.save``, ``model.save_weights``,
``ModelCheckpoint``): see :mod:`.checkpoint`.
"""
from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from ..compressors.base import Method
from ..runtime.buckets import DEFAULT_BUCKET_BYTES
from ..runtime.scaling import check_backward_passes
from ..tensorflow.reducer import Average, GradientReducer
from .checkpoint import CompressionState
from ..compressors.registry import create


class _HvdcKerasState:
    """Plain holder (not tracked by Keras) of the optimizer's distributed state."""

    def __init__(self, reducer: GradientReducer) -> None:
        self.reducer = reducer
        self.saveable = CompressionState(reducer.method)
        self.pending_vars: list[Any] | None = None
        self.reduced = False


class _DistributedOptimizerMixin:
    """Methods put in front of the wrapped optimizer's class."""

    _hvdc: _HvdcKerasState

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        elif self.built:
            variables = list(self._trainable_variables)
        else:
            variables = None
        if variables is not None and len(variables) == len(grads) and any(g is None for g in grads):
            grads = [tf.zeros(v.shape, dtype=v.dtype) if g is None else g
                     for g, v in zip(grads, variables)]
        return super().apply(grads, trainable_variables)

    def _backend_apply_gradients(self, grads: Any, trainable_variables: Any) -> Any:
        state = self._hvdc
        state.pending_vars, state.reduced = list(trainable_variables), False
        try:
            out = super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            state.pending_vars = None
        if not state.reduced and not self.gradient_accumulation_steps:
            raise RuntimeError(
                f"{type(self).__name__} updated variables without calling _clip_gradients; "
                "horovod_compress cannot reduce its gradients")
        return out

    def _clip_gradients(self, grads: Any) -> Any:
        state = self._hvdc
        if state.pending_vars is not None:
            grads = state.reducer.reduce(list(grads), state.pending_vars)
            state.reduced = True
        return super()._clip_gradients(grads)

    # ------------------------------------------------------------ extras
    @property
    def hvdc_reducer(self) -> GradientReducer:
        """The reducer: statistics, the warm-up switch, the compression method."""
        return self._hvdc.reducer

    @property
    def compression(self) -> Method:
        return self._hvdc.reducer.method

    @property
    def communicator(self) -> Any:
        return self._hvdc.reducer.comm

    @property
    def hvdc_compression_state(self) -> CompressionState:
        """Keras saving visits this child: the compressor state in checkpoints."""
        return self._hvdc.saveable


_CLASSES: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    if issubclass(base, _DistributedOptimizerMixin):
        return base
    cls = _CLASSES.get(base)
    if cls is None:
        # Same name and module as the wrapped class: a saved model reloads with a
        # plain Keras optimizer (the compressor state entry is then ignored).
        cls = type(base.__name__, (_DistributedOptimizerMixin, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__})
        _CLASSES[base] = cls
    return cls


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, compression: Method | None = None,
                         name: str | None = None, op: Any = Average,
                         gradient_predivide_factor: float = 1.0,
                         backward_passes_per_step: int = 1,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                         comm: Any = None, sparse_as_dense: bool = True,
                         kernel_layout: str = "torch") -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that it applies rank-averaged (compressed) gradients.

    The signature follows ``horovod.keras.DistributedOptimizer``.
    ``compression`` defaults to ``Compression.none()`` (dense).
    ``backward_passes_per_step=N`` (N >= 2) sets Keras's
    ``gradient_accumulation_steps=N``: one exchange per N batches, of the
    accumulated mean. ``bucket_bytes``/``overlap``/``comm`` as in the
    PyTorch front-end. ``sparse_as_dense`` must be true (embedding
    gradients are densified). ``kernel_layout="torch"`` shows Keras kernels
    to matrix methods (low-rank, row-sparsifying) in PyTorch's ``(out, in, ...)``
    layout, so they compress a Dense/Conv layer exactly as they compress the
    equivalent PyTorch layer; ``"keras"`` leaves them as stored. Wrap the optimizer before it is built (before
    its first step); a built optimizer's slots are not carried over.

    Inside ``model.fit`` the exchange runs through ``tf.numpy_function``:
    compile with ``jit_compile=False`` where XLA would otherwise be used (GPU).
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"optimizer must be a Keras 3 optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "built", False):
        raise ValueError("wrap the optimizer before it is built (before its first step); "
                         "its slot variables would not carry over")
    if not sparse_as_dense:
        raise ValueError("sparse_as_dense must be True: compressed allreduce works on dense "
                         "gradients (IndexedSlices are densified)")
    passes = check_backward_passes(backward_passes_per_step)
    method = compression if compression is not None else create("none")
    reducer = GradientReducer(method, comm, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              bucket_bytes=bucket_bytes, overlap=overlap,
                              kernel_layout=kernel_layout)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    if passes > 1:
        if config.get("gradient_accumulation_steps") not in (None, passes):
            raise ValueError(f"backward_passes_per_step={passes} conflicts with the optimizer's "
                             f"gradient_accumulation_steps={config['gradient_accumulation_steps']}")
        config["gradient_accumulation_steps"] = passes
    cls = _distributed_class(type(optimizer))
    opt = cls.from_config(config)
    opt._hvdc = _HvdcKerasState(reducer)
    return opt


def reducer_of(optimizer: Any) -> GradientReducer:
    """The reducer of a model's optimizer; ``ValueError`` if it is not ours."""
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    for opt in (optimizer, inner):
        if isinstance(opt, _DistributedOptimizerMixin):
            return opt.hvdc_reducer
    raise ValueError("the model's optimizer is not a horovod_compress.keras.DistributedOptimizer "
                     f"(got {type(optimizer).__name__}); compile the model with one")
