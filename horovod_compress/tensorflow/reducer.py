"""``GradientReducer``: TensorFlow gradients through the framework-independent exchange.

One reducer serves one compression method (a ``DistributedGradientTape`` or a
Keras ``DistributedOptimizer``). For a list of variables it builds, once, a
:class:`~horovod_compress.runtime.GradientExchange` over their gradients --
named after the variables, in reverse order (the order in which backprop
produces them, as the PyTorch front-end does), so the same model gives the
same buckets, the same compressor state names and the same averages in both
frameworks. Each call hands the step's gradients to that exchange through the
NumPy bridge (:mod:`.bridge`), eagerly or inside ``tf.function``.

Per call:

* ``None`` gradients (a variable the loss does not reach on this rank) are
  reduced as zeros (Horovod's rule in its PyTorch optimizer), so every rank
  takes part in every collective; the result is the average of the ranks
  that had one, divided by P, returned as a dense tensor.
* ``tf.IndexedSlices`` are densified (``sparse_as_dense``).
* float16/float32/float64 gradients go in as they are, bfloat16 widened to
  float32; the result comes back in each variable's dtype.
* ``op=Sum`` multiplies the average by P; ``gradient_predivide_factor`` f
  divides inputs by f and multiplies results by f (Horovod's semantics).

Everything that is not TensorFlow -- argument checks, op scaling, the
warm-up switch, statistics and the compression-error probe -- is the
framework-independent runtime's (:mod:`horovod_compress.runtime.scaling`,
:mod:`~horovod_compress.runtime.stats`,
:class:`~horovod_compress.runtime.session.TrainingExchange`), shared with the
PyTorch optimizer. Statistics (:class:`ExchangeStats`) count this rank's
bytes of the exchange alone (the Communicator's delta around each step), what
a dense ring allreduce would have sent, and -- on request -- the compression
error ``||avg_method - avg_dense|| / ||avg_dense||`` measured with one extra
dense allreduce whose bytes are counted separately; all variable sets of a
reducer share one :class:`ExchangeStats` and one warm-up/probe switch.

Matrix methods (``layout == "matrix"``: low-rank and row-sparsifying) view a
tensor as ``(shape[0], rest)``, PyTorch's ``(out, in, kh, kw)`` convention.
Keras stores kernels channels-last -- ``Dense`` ``(in, out)``, ``Conv2D``
``(kh, kw, in, out)`` -- so with ``kernel_layout="torch"`` (the default)
every variable whose name ends in ``kernel`` is handed to a matrix method
permuted to PyTorch's layout (``(out, in)``, ``(out, in, kh, kw)``) and
permuted back afterwards: the method sees the very matrix it sees for the
equivalent PyTorch layer (``weight == kernel.T``), so both front-ends
compress a model identically. Flat methods see every tensor as it is.

A second, different list of variables with the same method (e.g. a GAN's two
models) gets its own exchange whose compressor state is namespaced
``varset<k>/``; the first list's state keeps the plain bucket names.
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from ..compressors.base import Method
from ..runtime.buckets import DEFAULT_BUCKET_BYTES, TensorSpec
from ..runtime.delegate import delegated
from ..runtime.engine import GradientExchange
from ..runtime.ops import Average, Sum, op_name  # noqa: F401  (re-exported)
from ..runtime.scaling import Scaling, check_bucket_bytes, check_method, working_dtype
from ..runtime.session import NamespacedMethod, StepSettings, TrainingExchange
from ..runtime.stats import ExchangeStats  # noqa: F401  (re-exported)
from . import world
from .bridge import numpy_call
from .tensors import check_float_dtype, to_wire, unique_names, wire_dtype


def torch_kernel_permutation(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Axes that turn a channels-last kernel into PyTorch's layout, or ``None`` below 2-D.

    ``(in, out) -> (out, in)``, ``(k, in, out) -> (out, in, k)``,
    ``(kh, kw, in, out) -> (out, in, kh, kw)``: output axis, input axis, then the
    spatial axes in order.
    """
    d = len(shape)
    if d < 2:
        return None
    return (d - 1, d - 2, *range(d - 2))


class _VariableSet:
    """The training exchange of one list of variables (and their kernel permutations)."""

    def __init__(self, reducer: "GradientReducer", names: list[str], shapes: list[tuple],
                 dtypes: list[tf.DType], prefix: str) -> None:
        self.names, self.shapes, self.dtypes = names, shapes, dtypes
        self.np_dtypes = [np.dtype(wire_dtype(d).as_numpy_dtype) for d in dtypes]
        permute = reducer.method.layout == "matrix" and reducer.kernel_layout == "torch"
        self.perms = [torch_kernel_permutation(s) if permute and n.split("#")[0].endswith("kernel")
                      else None for n, s in zip(names, shapes)]
        self.inverse = [None if p is None else tuple(int(i) for i in np.argsort(p))
                        for p in self.perms]
        exchange_shapes = [s if p is None else tuple(s[i] for i in p)
                           for s, p in zip(shapes, self.perms)]
        self.specs = [TensorSpec(n, s, working_dtype(d.name))
                      for n, s, d in reversed(list(zip(names, exchange_shapes, dtypes)))]
        method = reducer.method if not prefix else NamespacedMethod(reducer.method, prefix)
        self.session = TrainingExchange(method, reducer.comm, self.specs,
                                        scaling=reducer.scaling, settings=reducer.settings,
                                        stats=reducer.stats, bucket_bytes=reducer.bucket_bytes,
                                        overlap=reducer.overlap)
        self.exchange = self.session.exchange
        self.dense_bytes_per_step = self.session.dense_bytes_per_step

    def dense_exchange(self) -> GradientExchange:
        """An uncompressed exchange of the same tensors (CompressionWarmupCallback)."""
        return self.session.dense_exchange()

    def exchanges(self) -> list[GradientExchange]:
        """The compressed exchange, then the dense one if it was built."""
        return self.session.exchanges()


class GradientReducer:
    """Averages TensorFlow gradients with ``method``'s compressed allreduce (see module doc)."""

    def __init__(self, method: Method, comm: Any = None, *, op: Any = Average,
                 gradient_predivide_factor: float = 1.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                 kernel_layout: str = "torch") -> None:
        self.method = check_method(method)
        self.scaling = Scaling.from_args(op, gradient_predivide_factor)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        if kernel_layout not in ("torch", "keras"):
            raise ValueError(f"kernel_layout must be 'torch' or 'keras', got {kernel_layout!r}")
        self.kernel_layout = kernel_layout
        self.comm = comm if comm is not None else world.communicator()
        self.overlap = bool(overlap)
        self.settings = StepSettings()   # warm-up switch and error probes, all variable sets
        self.stats = ExchangeStats()
        self._sets: dict[tuple, _VariableSet] = {}
        self._by_identity: dict[tuple, tuple[_VariableSet, list]] = {}

    # ------------------------------------------------- switches and factors
    op = delegated("scaling.op", '``"average"`` or ``"sum"``.')
    predivide = delegated("scaling.predivide", "The ``gradient_predivide_factor``.")
    postscale = delegated("scaling.postscale",
                          "Extra factor on results (Horovod keras: summed accumulation).", float)
    dense = delegated("settings.dense", "True: exchange uncompressed (warm-up).", bool)
    measure_error_every = delegated("settings.measure_error_every",
                                    "n > 0: measure the compression error every n steps.", int)
    measure_next = delegated("settings.measure_next", "Measure on the next step (then reset).", bool)

    # ----------------------------------------------------------------- API
    def reduce(self, grads: Sequence[Any], variables: Sequence[Any],
               names: Sequence[str] | None = None) -> list[tf.Tensor]:
        """Averaged gradients, one dense tensor per variable, in the variables' dtypes."""
        grads, variables = list(grads), list(variables)
        if len(grads) != len(variables):
            raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
        if not variables:
            return []
        vset = self._variable_set(variables, names)
        present = [i for i, g in enumerate(grads) if g is not None]
        inputs = [to_wire(grads[i]) for i in present]

        def run(*arrays: np.ndarray) -> list[np.ndarray]:
            full: list[np.ndarray | None] = [None] * len(vset.names)
            for i, a in zip(present, arrays):
                full[i] = a
            return self._reduce_arrays(vset, full)

        outs = numpy_call(run, inputs, [wire_dtype(d) for d in vset.dtypes], vset.shapes,
                          name="hvdc_allreduce", in_shapes=[vset.shapes[i] for i in present])
        return [tf.cast(o, d) if o.dtype != d else o for o, d in zip(outs, vset.dtypes)]

    def variable_sets(self) -> list[_VariableSet]:
        """The variable sets this reducer has seen, one per distinct list of variables."""
        return list(self._sets.values())

    @property
    def comm_seconds(self) -> float:
        """Seconds spent inside the method's allreduce, all exchanges."""
        return sum(s.session.comm_seconds for s in self._sets.values())

    @property
    def wait_seconds(self) -> float:
        """Seconds the bridge waited for the communication thread, all exchanges."""
        return sum(s.session.wait_seconds for s in self._sets.values())

    def close(self) -> None:
        """Close every bucket exchange (stops their communication threads)."""
        for s in self._sets.values():
            s.session.close()

    # ------------------------------------------------------------ internals
    def _variable_set(self, variables: list[Any], names: Sequence[str] | None) -> _VariableSet:
        fast_key = (tuple(id(v) for v in variables), None if names is None else tuple(names))
        cached = self._by_identity.get(fast_key)
        if cached is not None and all(r() is v for r, v in zip(cached[1], variables)):
            return cached[0]
        vset = self._lookup(variables, names)
        try:
            self._by_identity[fast_key] = (vset, [weakref.ref(v) for v in variables])
        except TypeError:  # an object without weak references: no cache
            pass
        return vset

    def _lookup(self, variables: list[Any], names: Sequence[str] | None) -> _VariableSet:
        names = list(names) if names is not None else unique_names(variables)
        if len(names) != len(variables):
            raise ValueError(f"{len(names)} names for {len(variables)} variables")
        shapes, dtypes = [], []
        for n, v in zip(names, variables):
            shape = tf.TensorShape(v.shape)
            if not shape.is_fully_defined():
                raise ValueError(f"variable {n!r} has shape {shape}; gradients to allreduce "
                                 "need fully defined shapes")
            shapes.append(tuple(int(d) for d in shape))
            dtypes.append(check_float_dtype(v.dtype, n))
        key = tuple(zip(names, shapes, [d.name for d in dtypes]))
        vset = self._sets.get(key)
        if vset is None:
            prefix = "" if not self._sets else f"varset{len(self._sets)}/"
            vset = _VariableSet(self, names, shapes, dtypes, prefix)
            self._sets[key] = vset
        return vset

    def _reduce_arrays(self, vset: _VariableSet,
                       arrays: list[np.ndarray | None]) -> list[np.ndarray]:
        """The NumPy side of one step: permute kernels, run the step, permute back, cast."""
        session = vset.session
        for j in reversed(range(len(arrays))):  # the exchange's order: last variable first
            a = arrays[j]
            if a is not None:
                if vset.perms[j] is not None:
                    a = np.ascontiguousarray(np.transpose(a, vset.perms[j]))
                session.submit(vset.names[j], a)
        averaged = session.finish()
        outs = []
        for name, dt, inv in zip(vset.names, vset.np_dtypes, vset.inverse):
            avg = averaged[name] if inv is None else np.transpose(averaged[name], inv)
            outs.append(np.ascontiguousarray(avg, dtype=dt))
        return outs
