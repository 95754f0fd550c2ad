"""``HookExchange``: the framework-free part of a comm hook (buckets fused by the framework).

Under PyTorch DDP the framework fuses gradients into its own buckets and hands
a comm hook one at a time, in the same order on every rank; the hook returns
their averages over ranks. The front-end (``horovod_compress.torch.ddp``)
wraps each bucket as a :class:`BucketView` (arrays that are, where possible,
views of the framework's memory, and how to write results back) and calls
:meth:`HookExchange.reduce`. Everything else is here:

* flat methods (``layout == "flat"``) reduce the whole bucket as one vector,
  as DDP's own allreduce and the Ok-Topk paper's whole-model sparsification
  do ("Near-Optimal Sparse Allreduce for Distributed Deep Learning", Li and
  Hoefler, PPoPP 2022, Section 5), its state named by :func:`~.hook_buckets.flat_key`;
* matrix methods reduce each parameter's gradient in its own shape, as
  PyTorch's ``powerSGD_hook`` does ("PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization", Vogels et al., NeurIPS 2019,
  Section 4: one collective per round for all of a bucket's ``P``\\ s, one
  for its ``Q``\\ s), through :class:`~.per_tensor.PerTensorReducer` (the
  optimizers' engine uses the same): the method's ``allreduce_many`` where
  it has one, else in lockstep, else (``lockstep = False``) one by one --
  the same results and bytes;
* the bucket layout across DDP's rebuild and a checkpoint restore
  (:class:`~.hook_buckets.HookBuckets`); the state of flat buckets that no
  longer exist is dropped;
* statistics (:class:`~.stats.ExchangeStats`, as the optimizer and reducer
  keep them): per bucket the Communicator's byte delta and the dense ring
  equivalent ``2N(P-1)/P`` of the bucket's N bytes (``N(P-1)/P``, the ring's
  reduce-scatter half, for a reduce-scatter) and one in :attr:`calls`;
  per iteration (the bucket marked last) one step; the seconds inside the hook;
* the switches of :class:`~.session.StepSettings` per iteration: ``dense``
  runs the iteration uncompressed (``Compression.none()``, the method's state
  untouched), and a due error probe (``measure_error_every``,
  ``measure_next``) compares the iteration's averages with one dense
  allreduce of its inputs (:func:`~.stats.record_error`, bytes counted apart);
* ``step_skipped``: the method's ``nonfinite="skip"`` policy dropped a bucket
  of the last iteration;
* ``record``: when a list, every compressed allreduce's ``(name, input,
  average)`` as host copies (tests replay them on another communicator);
* the checkpoint: method state, layout and counters as plain values.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..kernels.arrays import get_array_module, to_host
from ..mpi_collectives import timeline as _timeline
from ..mpi_collectives.accounting import reduce_scatter_volume
from .hook_buckets import FLAT_PREFIX, HookBuckets, flat_key
from .per_tensor import PerTensorReducer
from .session import StepSettings
from .stats import ExchangeStats, record_error, ring_allreduce_bytes, skipped_count
from ..compressors.registry import create

STATE_VERSION = 1


@dataclass
class ArraySlot:
    """One gradient as the runtime sees it.

    ``array``: NumPy or CuPy, a view of the framework's memory where the
    dtype and device allow (else a copy in the working dtype);
    ``write(avg)``: put a result of ``array``'s shape back into the
    framework's tensor (a no-op where ``avg`` already is that memory).
    """

    array: Any
    write: Callable[[Any], None]


class BucketView(Protocol):
    """A framework's bucket as :meth:`HookExchange.reduce` uses it."""

    names: tuple[str, ...]   # its parameters, in bucket order
    numel: int               # elements of the flat buffer
    nbytes: int              # bytes of the flat buffer in the framework's dtype
    is_last: bool            # the iteration's last bucket
    # optional ``scatter: bool`` -- the framework wants this rank's block of the flat average
    # (a reduce-scatter, FSDP): see :meth:`HookExchange.reduce`

    def flat(self) -> ArraySlot:
        """The whole buffer."""

    def parameters(self) -> list[ArraySlot]:
        """Each parameter's gradient in its own shape (views into the buffer), in bucket order."""

    def complete(self) -> None:
        """Hand the buffer's averages to the framework (DDP: complete the future)."""


def _host_copy(array: Any) -> np.ndarray:
    return np.array(to_host(array), copy=True)


class HookExchange:
    """Averages framework-fused buckets with ``method`` (see the module doc).

    ``named``: the front-end names parameters stably (needed to regroup after
    a restore); ``lockstep``: fuse a bucket's per-parameter collectives.
    """

    def __init__(self, method: Any, comm: Any, *, settings: StepSettings | None = None,
                 stats: ExchangeStats | None = None) -> None:
        self.method = method
        self.comm = comm
        self.settings = settings if settings is not None else StepSettings()
        self.stats = stats if stats is not None else ExchangeStats()
        self.buckets = HookBuckets()
        self.named = False
        self.record: list[tuple[str, np.ndarray, np.ndarray | None]] | None = None
        self.calls = 0                # buckets reduced (hook calls)
        self.comm_seconds = 0.0       # inside the method's allreduce
        self.step_skipped = False
        self._skipped_at_begin = 0
        self._per_tensor = PerTensorReducer()
        self._dense_method: Any = None
        self._new_iteration()

    @property
    def lockstep(self) -> bool:
        """Fuse a bucket's per-parameter collectives (:class:`~.per_tensor.PerTensorReducer`)."""
        return self._per_tensor.lockstep

    @lockstep.setter
    def lockstep(self, value: bool) -> None:
        self._per_tensor.lockstep = bool(value)

    @property
    def wait_seconds(self) -> float:
        """Always 0: the hook is synchronous, nothing waits for a communication thread."""
        return 0.0

    # ----------------------------------------------------------------- work
    def reduce(self, bucket: BucketView) -> None:
        """Average ``bucket`` over ranks; it is completed now, or (regrouping) by a later call.

        A bucket with ``scatter = True`` asks for a reduce-scatter: a flat
        method's slot receives only this rank's block of the average
        (:meth:`~horovod_compress.compressors.base.Method.reduce_scatter`: P
        equal blocks of the flat buffer), a matrix method's slots the whole
        average of each parameter (their writes keep what the framework
        needs). No error probe is taken in such an iteration (the averages
        are partial).
        """
        t0 = time.perf_counter()
        comm, st = self.comm, self.stats
        sent0, received0 = comm.bytes_sent, comm.bytes_received
        try:
            if self._active is None:
                self._begin()
            with _timeline.span("bucket", "bucket", tensors=len(bucket.names),
                                numel=int(bucket.numel), last=bool(bucket.is_last)):
                self._bucket(bucket)
            st.bytes_sent += max(comm.bytes_sent - sent0, 0)
            st.bytes_received += max(comm.bytes_received - received0, 0)
            dense = reduce_scatter_volume if getattr(bucket, "scatter", False) \
                else ring_allreduce_bytes
            st.dense_bytes += dense(bucket.nbytes, comm.size)
            self.calls += 1
            if bucket.is_last:
                self._end_iteration()
        except BaseException:
            self.buckets.new_iteration()
            self._new_iteration()
            raise
        finally:
            st.seconds += time.perf_counter() - t0

    def _bucket(self, bucket: BucketView) -> None:
        names, buckets = bucket.names, self.buckets
        key = flat_key(names, bucket.numel)
        scatter = bool(getattr(bucket, "scatter", False))
        if scatter:
            self._probe = None
        if not buckets.defers(key, self.named):
            if self.method.layout == "flat":
                self._reduce_slot(bucket.flat(), key, scatter)
            else:
                self._reduce_matrices(bucket.parameters(), names)
            buckets.reduced(key, names)
            bucket.complete()
            return
        buckets.defer(bucket, names, bucket.parameters())
        for gkey, gnames in buckets.ready_groups():
            self._reduce_group(gkey, gnames)
        rest = buckets.rest_group() if bucket.is_last else None
        if rest is not None:
            self._reduce_group(*rest)
        for done in buckets.completed():
            done.complete()

    def _reduce_group(self, key: str, names: tuple[str, ...]) -> None:
        """Reduce deferred parameters ``names`` as one bucket of the saved layout."""
        slots = [self.buckets.pending[n] for n in names]
        if self.method.layout == "flat":
            xp = get_array_module(slots[0].array)
            avg = self._allreduce(xp.concatenate([s.array.reshape(-1) for s in slots]), key)
            offset = 0
            for s in slots:
                n = s.array.size
                s.write(avg[offset:offset + n].reshape(s.array.shape))
                offset += n
        else:
            self._reduce_matrices(slots, names)
        self.buckets.reduced(key, names, handed=False)

    def _reduce_slot(self, slot: ArraySlot, name: str, scatter: bool = False) -> None:
        slot.write(self._allreduce(slot.array, name, scatter))

    def _allreduce(self, x: Any, name: str, scatter: bool = False) -> Any:
        """``method.allreduce`` of one array (``scatter``: ``method.reduce_scatter``, this
        rank's block), captured for the record and the probe."""
        keep = self.record is not None or self._probe is not None
        if keep:
            self._capture(name, _host_copy(x), None)
        t0 = time.perf_counter()
        reduce = self._active.reduce_scatter if scatter else self._active.allreduce
        avg = reduce(x, name, self.comm)
        self.comm_seconds += time.perf_counter() - t0
        if keep:
            self._capture(name, None, avg)
        return avg

    def _reduce_matrices(self, slots: Sequence[ArraySlot], names: tuple[str, ...]) -> None:
        """A matrix method on each gradient in its own shape, the bucket's collectives fused.

        A method with a bucket-level path (``allreduce_many``: PowerSGD) runs
        the whole bucket on this thread, one fused collective per round, and
        writes the averages straight into the arrays (views of the bucket);
        the others run in lockstep (one greenlet per tensor, the same fusion).
        """
        comm, method = self.comm, self._active
        if not self._per_tensor.fuses(comm):
            for slot, name in zip(slots, names):
                self._reduce_slot(slot, name)
            return
        xs = [s.array for s in slots]
        keep = self.record is not None or self._probe is not None
        inputs = [_host_copy(x) for x in xs] if keep else None
        t0 = time.perf_counter()
        outs = self._per_tensor.reduce(method, comm, xs, names, out=xs)
        self.comm_seconds += time.perf_counter() - t0
        for j, (slot, name, avg) in enumerate(zip(slots, names, outs)):
            if inputs is not None:
                self._capture(name, inputs[j], None)
                self._capture(name, None, avg)
            slot.write(avg)

    def _capture(self, name: str, x: np.ndarray | None, avg: Any) -> None:
        """Note an input (``x``) or, for the input just noted, its average (``avg``)."""
        if x is not None:
            if self.record is not None:
                self.record.append((name, x, None))
            if self._probe is not None:
                self._probe[0].append(x)
            return
        host = _host_copy(avg)
        if self.record is not None:
            self.record[-1] = (name, self.record[-1][1], host)
        if self._probe is not None:
            self._probe[1].append(host)

    # ------------------------------------------------------------ iterations
    def _new_iteration(self) -> None:
        self._active: Any = None
        self._probe: tuple[list[np.ndarray], list[np.ndarray]] | None = None

    def _begin(self) -> None:
        """An iteration's first bucket: pick the method (warm-up switch), note skips, plan a probe."""
        if self.settings.dense and self._dense_method is None:
            self._dense_method = create("none")
        self._active = self._dense_method if self.settings.dense else self.method
        self._skipped_at_begin = self._skipped_count()
        self._probe = ([], []) if self.settings.probe_planned(self.stats.steps + 1) else None

    def end_iteration(self) -> None:
        """End the current iteration now (a framework that cannot mark its last bucket calls
        it when the next iteration's first bucket shows); a no-op between iterations."""
        if self._active is not None:
            self._end_iteration()

    def _skipped_count(self) -> int:
        return skipped_count([self.method, self._dense_method])

    def _end_iteration(self) -> None:
        st = self.stats
        st.steps += 1
        self.step_skipped = self._skipped_count() != self._skipped_at_begin
        probe = self._probe
        keep = self.buckets.end_iteration()
        if keep is not None and self.method.layout == "flat":
            # new buckets (DDP's rebuild): drop the state of flat buckets that no longer exist
            for k in [k for k in self.method.state if k.startswith(FLAT_PREFIX) and k not in keep]:
                del self.method.state[k]
        if probe is not None and self.settings.measure_due(st.steps):
            record_error(st, self.comm, *probe)
        self._new_iteration()

    # ---------------------------------------------------------- statistics
    def statistics(self) -> dict[str, Any]:
        """Iterations, calls, bytes (this rank, volume model), the ratio to dense, seconds, skips, ``by_op``;
        ``decisions`` for a method that chooses per bucket (``Compression.auto``).

        ``by_op`` is the communicator's breakdown since its last
        ``reset_stats()`` (shared by everything that uses it).
        """
        st = self.stats
        out = {"method": self.method.name, "iterations": st.steps, "calls": self.calls,
               "bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received,
               "dense_bytes": st.dense_bytes, "compression": st.compression_ratio(),
               "seconds": st.seconds, "skipped_steps": self.method.skipped_steps,
               "by_op": self.comm.stats()["by_op"]}
        decisions = getattr(self.method, "decisions", None)
        if decisions is not None:
            out["decisions"] = decisions()
        return out

    def reset_statistics(self) -> None:
        """Zero the counters (all but ``steps``), ``calls``, ``comm_seconds`` and the communicator's.

        The method's state is left as it is.
        """
        self.comm.reset_stats()
        self.stats.reset()
        self.calls = 0
        self.comm_seconds = 0.0

    # ---------------------------------------------------------- checkpoints
    def state_dict(self, encode: Callable[[Any], Any] = lambda s: s) -> dict[str, Any]:
        """Method state (through ``encode``), the saved bucket layout and the counters, as plain values."""
        st = self.stats
        return {"version": STATE_VERSION, "method": encode(self.method.state_dict()),
                "iteration": st.steps, "calls": self.calls, "dense_bytes": st.dense_bytes,
                "bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received,
                "layout": self.buckets.saved_lists()}

    def load_state_dict(self, sd: dict[str, Any],
                        decode: Callable[[Any], Any] = lambda s: s) -> None:
        """Restore :meth:`state_dict` output (``ValueError`` for another version).

        The method refuses another method's state.

        The next iteration regroups DDP's buckets into the saved layout if
        they differ from it (the first iteration of a fresh DDP model).
        """
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"hook state version {sd.get('version')!r} is not {STATE_VERSION}")
        self.method.load_state_dict(decode(sd["method"]))
        st = self.stats
        st.steps = int(sd["iteration"])
        self.calls = int(sd["calls"])
        st.dense_bytes = float(sd["dense_bytes"])
        st.bytes_sent = int(sd.get("bytes_sent", 0))
        st.bytes_received = int(sd.get("bytes_received", 0))
        self.buckets.load_saved(sd.get("layout"))
        self._new_iteration()
