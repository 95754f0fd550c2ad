"""``DistributedGradientTape``: Horovod's signature, our compressed allreduce underneath.

Usage (eager or inside ``tf.function``)::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvdc_tf.DistributedGradientTape(tape, compression=hvdc.Compression.topk(density=0.01))
    grads = tape.gradient(loss, model.trainable_variables)   # averaged over ranks
    opt.apply_gradients(zip(grads, model.trainable_variables))

As Horovod does, the returned object is an instance of a subclass of the
wrapped tape's class sharing its recorded operations, so ``isinstance(tape,
tf.GradientTape)`` holds. Tensor names come from the variables (Keras 3
``variable.path``, a ``tf.Variable``'s name). Scripts build a new tape every
step: the exchange (buckets, compressor state) lives in a
:class:`~.reducer.GradientReducer` kept per compression object, so the
method's state carries over from step to step.
"""
from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf

from ..compressors.base import Method
from ..runtime.buckets import DEFAULT_BUCKET_BYTES
from ..runtime.scaling import check_method
from . import world
from .reducer import Average, GradientReducer
from ..compressors.registry import create

_REDUCERS: "weakref.WeakKeyDictionary[Method, dict[tuple, GradientReducer]]" = \
    weakref.WeakKeyDictionary()


def reducer_for(method: Method, comm: Any, op: Any, gradient_predivide_factor: float,
                bucket_bytes: int, overlap: bool, kernel_layout: str = "torch") -> GradientReducer:
    """The reducer of ``method`` with these settings (created on first use, then reused)."""
    comm = comm if comm is not None else world.communicator()
    per_method = _REDUCERS.setdefault(method, {})
    key = (id(comm), str(op), float(gradient_predivide_factor), int(bucket_bytes), bool(overlap),
           kernel_layout)
    if key not in per_method:
        per_method[key] = GradientReducer(method, comm, op=op,
                                          gradient_predivide_factor=gradient_predivide_factor,
                                          bucket_bytes=bucket_bytes, overlap=overlap,
                                          kernel_layout=kernel_layout)
    return per_method[key]


class _DistributedGradientTape(tf.GradientTape):
    """A GradientTape whose ``gradient()`` returns rank-averaged gradients."""

    _hvdc_reducer: GradientReducer

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
                 use_generic_names: bool = False) -> Any:
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        local = getattr(self, "_hvdc_local_sources", None)
        if not local:
            averaged = self._hvdc_reducer.reduce(flat_grads, flat_sources, self._hvdc_names)
            return tf.nest.pack_sequence_as(sources, averaged)
        # Horovod's PartialDistributedGradientTape: local sources are not exchanged.
        is_local = [_ref(s) in local for s in flat_sources]
        shared = [i for i, loc in enumerate(is_local) if not loc]
        names = self._hvdc_names
        averaged = self._hvdc_reducer.reduce(
            [flat_grads[i] for i in shared], [flat_sources[i] for i in shared],
            None if names is None else [names[i] for i in shared]) if shared else []
        out = list(flat_grads)
        for i, g in zip(shared, averaged):
            out[i] = g
        if getattr(self, "_hvdc_scale_local", True):
            p = self._hvdc_reducer.comm.size
            for i, loc in enumerate(is_local):
                if loc and out[i] is not None:
                    g = out[i]
                    out[i] = tf.IndexedSlices(g.values / p, g.indices, g.dense_shape) \
                        if isinstance(g, tf.IndexedSlices) else g / tf.cast(p, g.dtype)
        return tf.nest.pack_sequence_as(sources, out)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local (not exchanged; divided by P, as Horovod does)."""
        local = getattr(self, "_hvdc_local_sources", None)
        if local is None:
            local = self._hvdc_local_sources = set()
        local.add(_ref(source))

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list, list]:
        """``([(local source, grad)], [(exchanged source, grad)])``, as in Horovod."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        local = getattr(self, "_hvdc_local_sources", None) or set()
        pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(grads)))
        return ([(s, g) for s, g in pairs if _ref(s) in local],
                [(s, g) for s, g in pairs if _ref(s) not in local])

    @property
    def reducer(self) -> GradientReducer:
        """The reducer (statistics, compression method) behind this tape."""
        return self._hvdc_reducer


def _ref(source: Any) -> Any:
    """A hashable identity of a variable (``ref()`` where TensorFlow has it, else ``id``)."""
    return source.ref() if hasattr(source, "ref") else id(source)


_CLASSES: dict[type, type] = {}


def DistributedGradientTape(gradtape: tf.GradientTape, compression: Method | None = None,
                            op: Any = Average, gradient_predivide_factor: float = 1.0,
                            bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                            comm: Any = None, names: list[str] | None = None,
                            sparse_as_dense: bool = True,
                            kernel_layout: str = "torch") -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages over ranks with ``compression``.

    The signature follows ``horovod.tensorflow.DistributedGradientTape``
    (``compression``, ``op``, ``gradient_predivide_factor``,
    ``sparse_as_dense``); ``compression`` defaults to
    ``Compression.none()`` (dense, bit-exact with an MPI allreduce).
    ``bucket_bytes`` is the fusion cap of flat methods, ``overlap`` reduces
    buckets on a communication thread, ``comm`` defaults to :func:`init`'s,
    and ``names`` overrides the tensor names taken from the sources.
    ``kernel_layout="torch"`` hands ``*kernel`` variables to matrix methods in
    PyTorch's ``(out, in, ...)`` layout (see :mod:`.reducer`); ``"keras"``
    leaves them as stored.
    ``sparse_as_dense`` must be true: every method works on dense vectors,
    so ``tf.IndexedSlices`` gradients are densified.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ValueError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    if not sparse_as_dense:
        raise ValueError("sparse_as_dense must be True: compressed allreduce works on dense "
                         "gradients (IndexedSlices are densified)")
    method = check_method(compression if compression is not None else create("none"))
    reducer = reducer_for(method, comm, op, gradient_predivide_factor, bucket_bytes, overlap,
                          kernel_layout)
    base = type(gradtape)
    if issubclass(base, _DistributedGradientTape):
        base = base.__mro__[2]
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedGradientTape, base), {"__module__": __name__})
        _CLASSES[base] = cls
    tape = cls(persistent=gradtape._persistent,
               watch_accessed_variables=gradtape._watch_accessed_variables)
    tape._tape = gradtape._tape
    tape._watched_variables = gradtape._watched_variables
    tape._hvdc_reducer = reducer
    tape._hvdc_names = list(names) if names is not None else None
    return tape
