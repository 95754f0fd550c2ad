"""The exchange engine: fused buckets (or a matrix method's groups), compressed allreduce, overlap.

Front-ends call :meth:`GradientExchange.submit` as each gradient becomes
ready (a backward hook) and :meth:`GradientExchange.finish` before the
optimizer step. A bucket is launched as soon as all its gradients are in *and*
every earlier bucket has been launched -- so all ranks issue the same
collectives in the same order, whatever order their hooks fire in. With
``overlap=True`` launched buckets are reduced on one communication thread
(mpi4py releases the GIL inside MPI calls and NumPy inside its kernels) while
autograd goes on computing the remaining gradients; ``finish`` waits for it.
A matrix method's group (``runtime.buckets``) runs each tensor in its own
shape, the group's collectives fused one per round
(:class:`~.per_tensor.PerTensorReducer`).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Sequence

import numpy as np

from ..kernels.arrays import as_module_array, get_array_module, is_gpu_array
from ..mpi_collectives import timeline as _timeline
from .buckets import DEFAULT_BUCKET_BYTES, Bucket, TensorSpec, plan_buckets
from ..mpi_collectives.consistency import check_same_tensors
from .per_tensor import PerTensorReducer


class GradientExchange:
    """Runs ``method``'s compressed allreduce over a model's gradients, bucket by bucket.

    Parameters
    ----------
    method: a :class:`horovod_compress.Method`.
    comm: a :class:`horovod_compress.mpi_collectives.Communicator`.
    specs: the gradients, in the order they are expected to become ready.
    bucket_bytes: fusion cap for flat methods (Horovod's 64 MiB default).
    overlap: reduce on a communication thread while the backward pass runs.
    """

    def __init__(self, method: Any, comm: Any, specs: Sequence[TensorSpec],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True) -> None:
        self.method = method
        self.comm = comm
        self.specs = list(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor name {dup!r} appears twice; names must be unique")
        check_same_tensors(comm, self.specs)
        self.buckets: list[Bucket] = plan_buckets(self.specs, method.layout, bucket_bytes)
        self._where = {s.name: (b.index, j) for b in self.buckets for j, s in enumerate(b.specs)}
        self.overlap = overlap and self._threads_allowed()
        self.per_tensor = PerTensorReducer()   # a matrix method's groups, collectives fused
        self.comm_seconds = 0.0  # time spent inside the method's allreduce (all buckets)
        self.wait_seconds = 0.0  # time finish() waited for communication
        self._reset_step()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- step
    def _reset_step(self) -> None:
        self._inputs: list[list[np.ndarray | None]] = [[None] * len(b.specs) for b in self.buckets]
        self._missing = [len(b.specs) for b in self.buckets]
        self._next_launch = 0
        self._results: list[Any] = [None] * len(self.buckets)   # an array per fused bucket, a list per group
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._launched = 0
        self._arrivals: tuple[float, float] | None = None   # first and last submit (timeline)

    def submit(self, name: str, grad: np.ndarray) -> None:
        """Hand in this rank's gradient ``name`` for the current step (a NumPy or CuPy array)."""
        if name not in self._where:
            raise KeyError(f"unknown gradient {name!r}; the exchange was built for {len(self._where)} tensors")
        b, j = self._where[name]
        spec = self.buckets[b].specs[j]
        if tuple(grad.shape) != spec.shape:
            raise ValueError(f"gradient {name!r} has shape {tuple(grad.shape)}, expected {spec.shape}")
        if self._inputs[b][j] is not None:
            raise RuntimeError(f"gradient {name!r} submitted twice in one step "
                               f"(use backward_passes_per_step to accumulate)")
        self._inputs[b][j] = grad
        self._missing[b] -= 1
        if _timeline.recorder is not None:      # the backward pass as the exchange sees it
            now = time.perf_counter()
            self._arrivals = (self._arrivals[0] if self._arrivals else now, now)
        self._launch_ready()

    def pending(self) -> list[str]:
        """Names not yet submitted this step."""
        return [s.name for b in self.buckets for j, s in enumerate(b.specs)
                if self._inputs[b.index][j] is None]

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self._missing[self._next_launch] == 0:
            b = self._next_launch
            self._next_launch += 1
            if self.overlap:
                self._ensure_thread()
                self._queue.put(b)
            else:
                self._reduce_bucket(b)

    def finish(self, fill_missing: bool = True) -> dict[str, np.ndarray]:
        """Wait for every bucket; return ``{name: averaged gradient}`` and start a new step.

        Gradients never submitted (unused parameters) are reduced as zeros when
        ``fill_missing`` is true, as Horovod does, so every rank still takes
        part in every collective.
        """
        arrivals = self._arrivals           # the backward pass's gradients, not the zeros below
        if fill_missing:
            for name in self.pending():
                b, j = self._where[name]
                spec = self.buckets[b].specs[j]
                self.submit(name, np.zeros(spec.shape, dtype=np.dtype(spec.dtype)))
        elif self.pending():
            raise RuntimeError(f"gradients not submitted: {self.pending()[:5]}")
        t0 = time.perf_counter()
        if self.overlap and self.buckets:
            while self._launched < len(self.buckets):
                self._done.wait()
                self._done.clear()
        t1 = time.perf_counter()
        self.wait_seconds += t1 - t0
        rec = _timeline.recorder
        if rec is not None:
            if arrivals is not None:
                rec.add("gradients arriving", "step", *arrivals, {"buckets": len(self.buckets)})
            if self.overlap:
                rec.add("wait for buckets", _timeline.WAIT, t0, t1)
        error, results = self._error, self._results
        self._reset_step()
        if error is not None:
            raise error
        out: dict[str, np.ndarray] = {}
        for bucket, avg in zip(self.buckets, results):
            for j, spec in enumerate(bucket.specs):
                if bucket.fused:
                    start = bucket.offsets[j]
                    out[spec.name] = avg[start:start + spec.numel].reshape(spec.shape)
                else:
                    out[spec.name] = avg[j].reshape(spec.shape)
        return out

    # ------------------------------------------------------------- reducing
    def _reduce_bucket(self, b: int) -> None:
        bucket = self.buckets[b]
        with _timeline.span(f"bucket {b}", "bucket", tensors=len(bucket.specs), fused=bucket.name):
            self._reduce_bucket_timed(b, bucket)

    def _reduce_bucket_timed(self, b: int, bucket: Bucket) -> None:
        t0 = time.perf_counter()
        try:
            inputs = self._inputs[b]
            xp = get_array_module(*inputs)   # CuPy if any gradient of the bucket is on a GPU
            if bucket.fused:
                x = xp.empty(bucket.numel, dtype=bucket.work_dtype)
                for j, grad in enumerate(inputs):
                    start = bucket.offsets[j]
                    x[start:start + grad.size] = as_module_array(grad, xp).reshape(-1)
                self._results[b] = self.method.allreduce(x, bucket.name, self.comm)
            else:
                xs = [g if is_gpu_array(g) else np.asarray(g) for g in inputs]
                self._results[b] = self.per_tensor.reduce(self.method, self.comm, xs,
                                                          [s.name for s in bucket.specs])
        except BaseException as exc:  # noqa: BLE001 - surfaced in finish()
            if self._error is None:
                self._error = exc
        finally:
            self._inputs[b] = [None] * len(bucket.specs)
            self.comm_seconds += time.perf_counter() - t0
            self._launched += 1

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._worker, name="hvdc-comm", daemon=True)
            self._thread.start()

    def _worker(self) -> None:
        while True:
            b = self._queue.get()
            if b is None:
                return
            self._reduce_bucket(b)
            self._done.set()

    def close(self) -> None:
        """Stop the communication thread (also done at interpreter exit)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _threads_allowed(self) -> bool:
        allowed = getattr(self.comm, "threads_allowed", None)
        if callable(allowed):
            return bool(allowed())
        from mpi4py import MPI
        return MPI.Query_thread() >= MPI.THREAD_SERIALIZED

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
