"""``TrainingExchange``: one model's gradient exchange as a training loop sees it.

It wraps a :class:`~.engine.GradientExchange` with what every front-end needs
around it, on NumPy (or CuPy) arrays:

* op scaling (:class:`~.scaling.Scaling`): gradients are pre-divided as they
  are submitted, averages come back multiplied by
  ``predivide * (P if Sum) * postscale``;
* warm-up: while ``settings.dense`` is true a step runs an uncompressed
  exchange of the same tensors (built on first use), leaving the method's
  state untouched; the choice is made at a step's first submit;
* statistics (:class:`~.stats.ExchangeStats`): the Communicator's byte delta
  around each step, the dense ring equivalent, the seconds the caller spent
  inside :meth:`submit` and :meth:`finish`, the one-time setup bytes;
* the compression-error probe (:func:`~.stats.relative_error`) on the steps
  ``settings`` asks for, its dense allreduce counted apart;
* whether the step was dropped by the method's ``nonfinite="skip"`` policy
  (:attr:`step_skipped`: the methods' ``skipped_steps`` moved during the step).

``settings`` and ``stats`` may be shared by several exchanges (the
TensorFlow front-end's variable sets), so one switch and one set of counters
covers them all.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .buckets import DEFAULT_BUCKET_BYTES, TensorSpec
from .engine import GradientExchange
from .scaling import Scaling
from .stats import ExchangeStats, dense_ring_bytes, record_error, skipped_count
from ..compressors.registry import create


@dataclass
class StepSettings:
    """Switches a training callback sets between steps.

    ``dense``: exchange uncompressed (warm-up). ``measure_error_every`` n > 0:
    probe the compression error when the step count is a multiple of n.
    ``measure_next``: probe the next step (then reset).
    """

    dense: bool = False
    measure_error_every: int = 0
    measure_next: bool = False

    def probe_planned(self, step: int) -> bool:
        """Whether step number ``step`` (1-based) will be probed, as seen at its start (nothing consumed)."""
        every = self.measure_error_every
        return self.measure_next or (every > 0 and step % every == 0)

    def measure_due(self, steps: int) -> bool:
        """Whether step number ``steps`` (1-based) is probed; consumes ``measure_next``."""
        due = self.probe_planned(steps)
        if due:
            self.measure_next = False
        return due


class NamespacedMethod:
    """A method seen through a name prefix (keeps a second model's compressor state apart)."""

    def __init__(self, method: Any, prefix: str) -> None:
        self.method = method
        self.prefix = prefix
        self.layout = method.layout

    def allreduce(self, grad: Any, name: str, comm: Any) -> Any:
        """``method.allreduce`` under the name ``prefix + name``."""
        return self.method.allreduce(grad, self.prefix + name, comm)


class TrainingExchange:
    """Scaled, counted, optionally dense or probed exchange of ``specs`` (see module doc).

    Parameters
    ----------
    method: the compression method (or a :class:`NamespacedMethod`); its
        ``skipped_steps`` counter, where it has one, sets :attr:`step_skipped`.
    comm: the Communicator.
    specs: the gradients in the order they become ready (the exchange's names,
        shapes and working dtypes).
    scaling, settings, stats: shared objects, or fresh ones when ``None``.
    bucket_bytes, overlap: as in :class:`~.engine.GradientExchange`.
    """

    def __init__(self, method: Any, comm: Any, specs: Sequence[TensorSpec], *,
                 scaling: Scaling | None = None, settings: StepSettings | None = None,
                 stats: ExchangeStats | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True) -> None:
        self.method = method
        self.comm = comm
        self.specs = list(specs)
        self.scaling = scaling if scaling is not None else Scaling()
        self.settings = settings if settings is not None else StepSettings()
        self.stats = stats if stats is not None else ExchangeStats()
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.exchange = self._build(method)
        self._dense: GradientExchange | None = None
        self.dense_bytes_per_step = dense_ring_bytes(self.exchange.buckets, comm.size)
        self.step_skipped = False
        self._skipped_at_begin = 0
        self._active: GradientExchange | None = None
        self._inputs: dict[str, Any] | None = None   # kept only when a probe may be due
        self._sent = self._received = 0.0

    # ----------------------------------------------------------------- step
    def submit(self, name: str, grad: Any) -> None:
        """Pre-divide this rank's gradient ``name`` and hand it to the step's exchange."""
        t0 = time.perf_counter()
        if self._active is None:
            self._begin()
        grad = self.scaling.prescale(grad)
        if self._inputs is not None:
            self._inputs[name] = grad
        self._active.submit(name, grad)
        self.stats.seconds += time.perf_counter() - t0

    def finish(self) -> dict[str, Any]:
        """Wait for the step; return ``{name: scaled average}``, count it, probe it if due.

        Gradients never submitted are reduced as zeros (Horovod's rule for
        unused parameters), so every rank takes part in every collective.
        """
        t0 = time.perf_counter()
        if self._active is None:
            self._begin()
        exchange, inputs = self._active, self._inputs
        self._active, self._inputs = None, None
        averaged = exchange.finish(fill_missing=True)
        comm, st = self.comm, self.stats
        st.bytes_sent += comm.bytes_sent - self._sent
        st.bytes_received += comm.bytes_received - self._received
        st.steps += 1
        st.dense_bytes += self.dense_bytes_per_step
        self.step_skipped = self._skipped_count() != self._skipped_at_begin
        if inputs is not None and self.settings.measure_due(st.steps):
            self._measure_error(inputs, averaged)
        size = comm.size
        out = {name: self.scaling.apply(avg, size) for name, avg in averaged.items()}
        st.seconds += time.perf_counter() - t0
        return out

    # ------------------------------------------------------------ exchanges
    def dense_exchange(self) -> GradientExchange:
        """An uncompressed exchange of the same tensors (warm-up), built on first use."""
        if self._dense is None:
            self._dense = self._build(create("none"))
        return self._dense

    def exchanges(self) -> list[GradientExchange]:
        """The compressed exchange, then the dense one if it was built."""
        return [self.exchange] + ([self._dense] if self._dense is not None else [])

    @property
    def comm_seconds(self) -> float:
        """Seconds spent inside the methods' allreduce, both exchanges."""
        return sum(e.comm_seconds for e in self.exchanges())

    @property
    def wait_seconds(self) -> float:
        """Seconds :meth:`finish` waited for the communication thread, both exchanges."""
        return sum(e.wait_seconds for e in self.exchanges())

    def close(self) -> None:
        """Stop the exchanges' communication threads."""
        for e in self.exchanges():
            e.close()

    # ------------------------------------------------------------ internals
    def _begin(self) -> None:
        """A step's first call: pick the exchange, note the byte counts, keep inputs for a probe."""
        settings = self.settings
        self._active = self.dense_exchange() if settings.dense else self.exchange
        self._sent, self._received = self.comm.bytes_sent, self.comm.bytes_received
        self._skipped_at_begin = self._skipped_count()   # before any bucket of the step runs
        self._inputs = {} if settings.probe_planned(self.stats.steps + 1) else None

    def _build(self, method: Any) -> GradientExchange:
        comm = self.comm
        sent, received = comm.bytes_sent, comm.bytes_received
        exchange = GradientExchange(method, comm, self.specs, bucket_bytes=self.bucket_bytes,
                                    overlap=self.overlap)
        self.stats.setup_bytes_sent += comm.bytes_sent - sent
        self.stats.setup_bytes_received += comm.bytes_received - received
        return exchange

    def _skipped_count(self) -> int:
        """Steps the exchanges' methods dropped so far (``nonfinite="skip"``)."""
        return skipped_count([e.method for e in self.exchanges()])

    def _measure_error(self, inputs: dict[str, Any], averaged: dict[str, Any]) -> None:
        xs = [inputs[s.name] if s.name in inputs else np.zeros(s.shape, np.float64)
              for s in self.specs]
        record_error(self.stats, self.comm, xs, [averaged[s.name] for s in self.specs])
