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

Statistics (:class:`ExchangeStats`) count this rank's bytes of the exchange
alone (the Communicator's delta around each step), what a dense ring
allreduce would have sent, and -- on request -- the compression error
``||avg_method - avg_dense|| / ||avg_dense||`` measured with one extra dense
allreduce whose bytes are counted separately.

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

import copy
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from ..compressors.base import Method
from ..runtime.buckets import DEFAULT_BUCKET_BYTES, TensorSpec
from ..runtime.engine import GradientExchange
from ..runtime.ops import Average, Sum, op_name  # noqa: E402  (re-exported)
from . import world
from .bridge import numpy_call
from .tensors import (
    check_float_dtype,
    numpy_dtype_name,
    to_wire,
    unique_names,
    wire_dtype,
)


@dataclass
class ExchangeStats:
    """Cumulative counters of one reducer on this rank (bytes under the volume model)."""

    steps: int = 0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    dense_bytes: float = 0.0
    error_sum: float = 0.0
    error_count: int = 0
    check_bytes_sent: float = 0.0
    check_bytes_received: float = 0.0
    setup_bytes_sent: float = 0.0
    setup_bytes_received: float = 0.0
    seconds: float = 0.0

    def copy(self) -> "ExchangeStats":
        """A shallow copy (a snapshot of the counters)."""
        return copy.copy(self)


class _Namespaced:
    """A method seen through a name prefix (keeps a second variable set's state apart)."""

    def __init__(self, method: Method, prefix: str) -> None:
        self.method = method
        self.prefix = prefix
        self.layout = method.layout

    def allreduce(self, grad: np.ndarray, name: str, comm: Any) -> np.ndarray:
        return self.method.allreduce(grad, self.prefix + name, comm)


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
    """The exchange(s) for one list of variables."""

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
        self.specs = [TensorSpec(n, s, numpy_dtype_name(d))
                      for n, s, d in reversed(list(zip(names, exchange_shapes, dtypes)))]
        self._reducer = reducer
        method = reducer.method if not prefix else _Namespaced(reducer.method, prefix)
        self.exchange = reducer._build_exchange(method, self.specs)
        self._dense: GradientExchange | None = None
        p = reducer.comm.size
        self.dense_bytes_per_step = sum(b.numel * b.work_dtype.itemsize
                                        for b in self.exchange.buckets) * 2.0 * (p - 1) / p

    def dense_exchange(self) -> GradientExchange:
        """An uncompressed exchange of the same tensors (CompressionWarmupCallback)."""
        if self._dense is None:
            from ..compressors.registry import create
            self._dense = self._reducer._build_exchange(create("none"), self.specs)
        return self._dense

    def exchanges(self) -> list[GradientExchange]:
        return [self.exchange] + ([self._dense] if self._dense is not None else [])


class GradientReducer:
    """Averages TensorFlow gradients with ``method``'s compressed allreduce (see module doc)."""

    def __init__(self, method: Method, comm: Any = None, *, op: Any = Average,
                 gradient_predivide_factor: float = 1.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                 kernel_layout: str = "torch") -> None:
        if not isinstance(method, Method):
            raise ValueError("compression must be a hvdc.Compression.<method>(...) object, "
                             f"got {type(method).__name__}")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        if int(bucket_bytes) <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if kernel_layout not in ("torch", "keras"):
            raise ValueError(f"kernel_layout must be 'torch' or 'keras', got {kernel_layout!r}")
        self.kernel_layout = kernel_layout
        self.method = method
        self.comm = comm if comm is not None else world.communicator()
        self.op = op_name(op)
        self.predivide = float(gradient_predivide_factor)
        self.postscale = 1.0  # extra factor on results (Horovod keras: summed accumulation)
        self.bucket_bytes = int(bucket_bytes)
        self.overlap = bool(overlap)
        self.dense = False               # True: exchange uncompressed (warm-up)
        self.measure_error_every = 0     # >0: measure the compression error every n steps
        self.measure_next = False        # measure on the next step (then reset)
        self.stats = ExchangeStats()
        self._sets: dict[tuple, _VariableSet] = {}
        self._by_identity: dict[tuple, tuple[_VariableSet, list]] = {}

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
        return sum(e.comm_seconds for s in self._sets.values() for e in s.exchanges())

    @property
    def wait_seconds(self) -> float:
        """Seconds the bridge waited for the communication thread, all exchanges."""
        return sum(e.wait_seconds for s in self._sets.values() for e in s.exchanges())

    def close(self) -> None:
        """Close every bucket exchange (stops their communication threads)."""
        for s in self._sets.values():
            for e in s.exchanges():
                e.close()

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

    def _build_exchange(self, method: Any, specs: list[TensorSpec]) -> GradientExchange:
        sent, received = self.comm.bytes_sent, self.comm.bytes_received
        exchange = GradientExchange(method, self.comm, specs, bucket_bytes=self.bucket_bytes,
                                    overlap=self.overlap)
        self.stats.setup_bytes_sent += self.comm.bytes_sent - sent
        self.stats.setup_bytes_received += self.comm.bytes_received - received
        return exchange

    def _reduce_arrays(self, vset: _VariableSet,
                       arrays: list[np.ndarray | None]) -> list[np.ndarray]:
        """The NumPy side of one step: submit, wait, scale, count."""
        t0 = time.perf_counter()
        exchange = vset.dense_exchange() if self.dense else vset.exchange
        if self.predivide != 1.0:
            arrays = [a if a is None else a / a.dtype.type(self.predivide) for a in arrays]
        comm = self.comm
        sent, received = comm.bytes_sent, comm.bytes_received
        for j in reversed(range(len(arrays))):  # the exchange's order: last variable first
            a = arrays[j]
            if a is not None:
                if vset.perms[j] is not None:
                    a = np.ascontiguousarray(np.transpose(a, vset.perms[j]))
                exchange.submit(vset.names[j], a)
        averaged = exchange.finish(fill_missing=True)
        st = self.stats
        st.bytes_sent += comm.bytes_sent - sent
        st.bytes_received += comm.bytes_received - received
        st.steps += 1
        st.dense_bytes += vset.dense_bytes_per_step
        every = self.measure_error_every
        if self.measure_next or (every > 0 and st.steps % every == 0):
            self.measure_next = False
            self._measure_error(vset, arrays, averaged)
        scale = self.predivide * (comm.size if self.op == Sum else 1) * self.postscale
        outs = []
        for name, dt, inv in zip(vset.names, vset.np_dtypes, vset.inverse):
            avg = averaged[name] if inv is None else np.transpose(averaged[name], inv)
            if scale != 1.0:
                avg = avg * avg.dtype.type(scale)
            outs.append(np.ascontiguousarray(avg, dtype=dt))
        st.seconds += time.perf_counter() - t0
        return outs

    def _measure_error(self, vset: _VariableSet, arrays: list[np.ndarray | None],
                       averaged: dict[str, np.ndarray]) -> None:
        """Relative error of this step's average against a dense allreduce of the same inputs."""
        comm = self.comm
        x = np.concatenate([np.zeros(s, np.float64).ravel() if a is None
                            else np.asarray(a, np.float64).ravel()
                            for a, s in zip(arrays, vset.shapes)])
        got = np.concatenate([np.asarray(averaged[n] if inv is None else np.transpose(averaged[n], inv),
                                         np.float64).ravel()
                              for n, inv in zip(vset.names, vset.inverse)])
        sent, received = comm.bytes_sent, comm.bytes_received
        with comm.phase("hvdc_compression_error"):
            ref = comm.allreduce(x, op="avg")
        self.stats.check_bytes_sent += comm.bytes_sent - sent
        self.stats.check_bytes_received += comm.bytes_received - received
        norm = float(np.linalg.norm(ref))
        err = float(np.linalg.norm(got - ref))
        self.stats.error_sum += err / norm if norm > 0 else (0.0 if err == 0 else float("inf"))
        self.stats.error_count += 1
