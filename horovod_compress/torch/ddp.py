"""DDP communication hooks: every method of ``hvdc.Compression`` inside ``DistributedDataParallel``.

::

    import horovod_compress as hvdc
    from horovod_compress.torch import ddp as hvdc_ddp

    model = torch.nn.parallel.DistributedDataParallel(net)
    hook = hvdc_ddp.comm_hook(hvdc.Compression.powersgd(rank=4, warmup_steps=10), model=model)
    model.register_comm_hook(hook.state, hook)
    ...
    torch.save({"model": model.state_dict(), "hvdc": hook.state.state_dict()}, path)
    hook.state.load_state_dict(torch.load(path)["hvdc"])

DDP hands the hook one *bucket* at a time: a flat buffer holding the local
gradients of some parameters (``GradBucket.buffer()``) and, as views into it,
the per-parameter gradients (``GradBucket.gradients()``). The hook returns the
average over ranks in a completed ``torch.futures.Future``:

* methods on flat vectors (``layout == "flat"``: none, fp16, bf16, topk,
  randk, gaussiank, topk_dsa, gtopk, oktopk, qsgd, global_qsgd, deepreduce)
  run on the whole bucket buffer, as DDP's own allreduce and the Ok-Topk
  paper's whole-model sparsification do ("Near-Optimal Sparse Allreduce for
  Distributed Deep Learning", Li and Hoefler, PPoPP 2022, Section 5);
* matrix methods (``layout == "matrix"``: powersgd, greedylore, arc_topk and
  the row baselines, lazy_projection) run on each parameter's gradient in its
  own shape -- the per-parameter views PyTorch's ``powerSGD_hook`` uses
  ("PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", Vogels et al., NeurIPS 2019, Section 3 / Algorithm 1).
  A bucket's collectives of one round are fused into one call each (all
  ``P``\ s and the tensors sent dense in one allreduce, all ``Q``\ s in the
  next, as that hook does), with byte counts and results per parameter as in
  a sequential run (``hook.state.lockstep = False`` runs them one by one).
  PowerSGD does it itself (``PowerSGD.allreduce_many``: the whole bucket on
  the hook's thread, the estimates written straight into the bucket); the
  other matrix methods run in lockstep, one thread per parameter
  (:class:`~horovod_compress.mpi_collectives.lockstep.Lockstep`).

Everything else is the method's own: error feedback (``feedback=``), warm-up
(``warmup_steps=``: dense allreduces first, per tensor), the NaN/Inf policy and
the cross-rank signature check of :meth:`Method.allreduce`. The hook only
converts tensors (zero-copy NumPy views of CPU buffers) and names the state.

Names. A matrix method's state is keyed by the parameter's name (pass
``model=`` to use ``model.named_parameters()``; otherwise ``param<i>`` in the
order of ``model.parameters()`` if given, else by bucket position). A flat
method's state is keyed by the parameters the bucket holds, in bucket order.
DDP puts every parameter into one bucket in the first iteration and rebuilds
its buckets after it (``torch.nn.parallel.DistributedDataParallel``'s bucket
rebuild); a bucket whose composition changed starts with fresh state, as
PyTorch's PowerSGD hook requires ``start_powerSGD_iter > 1`` for the same
reason, and the state of buckets that no longer exist is dropped. Use
``warmup_steps >= 1`` with flat methods that keep state (error feedback).

Checkpoints. The hook state records the bucket layout of the last iteration
(the parameter names of each bucket). A model restored from a checkpoint is a
fresh DDP object whose first iteration again has DDP's initial buckets; in
that first iteration after :meth:`HookState.load_state_dict` the hook
regroups them into the checkpointed buckets (it gathers each saved bucket's
gradients from DDP's buckets, reduces them as that bucket -- a flat method's
state is per bucket, a matrix method's fused collectives are, and on more
than two ranks the order of a fused sum shows in the last bits -- scatters
back, and completes DDP's futures once all their parameters are done), so
training resumes bit for bit where it stopped. This needs parameter names
(``model=``).

Communication goes through :func:`~horovod_compress.mpi_collectives.default_communicator`:
inside a ``torchrun`` job a
:class:`~horovod_compress.mpi_collectives.torch_dist.TorchCommunicator` (gloo,
no MPI needed); under ``mpirun`` the mpi4py one. Its byte counts follow the
project's volume model and are summarised by :meth:`HookState.statistics`.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

import numpy as np
import torch

from ..compressors.base import Method
from ..mpi_collectives.lockstep import Lockstep
from .optimizer import from_safe_state, to_safe_state
from .tensors import copy_into, to_array

STATE_VERSION = 1
_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                 torch.float16: np.dtype(np.float16)}
_FLAT_PREFIX = "ddp["


def _flat_key(names: tuple[str, ...], numel: int) -> str:
    """The state key of a flat bucket: its parameters (in bucket order) and size."""
    digest = hashlib.blake2b("\0".join(names).encode(), digest_size=4).hexdigest()
    return f"{_FLAT_PREFIX}{names[0]}..{names[-1]}|{len(names)}|{numel}|{digest}]"


class HookState:
    """What the hook keeps between calls: the method (with its per-tensor state), names, counters.

    ``state_dict()`` holds tensors and plain Python values only (``torch.load``
    with ``weights_only=True`` reads it) and ``load_state_dict`` restores the
    method's state bit for bit.
    """

    def __init__(self, method: Method, model: Any = None, comm: Any = None,
                 process_group: Any = None) -> None:
        if not isinstance(method, Method):
            raise TypeError(f"comm_hook needs an hvdc.Compression method, got {type(method).__name__}")
        self.method = method
        self._process_group = process_group
        self._comm = comm
        if comm is None:
            self._comm = self._make_comm()
        self._names: dict[int, str] = {}
        if model is not None:
            self.set_model(model)
        self.iteration = 0          # completed DDP iterations (buckets with is_last())
        self.calls = 0              # hook calls (buckets)
        self.dense_bytes = 0.0      # what DDP's own allreduce would have sent (2N(P-1)/P)
        self.bytes_sent = 0.0       # what this hook sent / received (volume model, this rank)
        self.bytes_received = 0.0
        self.seconds = 0.0          # wall time inside the hook
        self.record: list[tuple[str, np.ndarray, np.ndarray]] | None = None
        self.lockstep = True        # fuse the per-parameter collectives of a bucket
        self._lockstep: Lockstep | None = None
        # DDP's buckets [(bucket key, parameter names)] of the last iteration; a bucket key is
        # a flat method's state key (saved: a restored model's first iteration regroups by it)
        self._layout: list[tuple[str, tuple[str, ...]]] | None = None
        self._restored = False      # load_state_dict ran and no iteration completed since
        self._new_iteration()

    def _new_iteration(self) -> None:
        self._iter_groups: list[tuple[str, tuple[str, ...]]] = []
        self._deferring = False
        self._pending: dict[str, torch.Tensor] = {}     # name -> gradient view (deferred)
        self._pending_order: list[str] = []
        self._processed: set[str] = set()
        self._done_groups: set[str] = set()
        self._waiting: list[tuple[torch.futures.Future, tuple[str, ...], torch.Tensor]] = []

    def _make_comm(self) -> Any:
        if self._process_group is not None:
            from ..mpi_collectives.torch_dist import TorchCommunicator
            return TorchCommunicator(self._process_group)
        from ..mpi_collectives.torch_dist import default_communicator
        return default_communicator()

    @property
    def comm(self) -> Any:
        """The communicator the method talks through (byte counts: ``comm.stats()``)."""
        return self._comm

    def set_model(self, model: Any) -> None:
        """Name parameters after ``model.named_parameters()`` (stable keys for checkpoints)."""
        self._names = {id(p): n for n, p in model.named_parameters()}

    def _name(self, param: torch.Tensor, fallback: str) -> str:
        return self._names.get(id(param), fallback)

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The method's state, the bucket layout and the hook's counters, as tensors and plain values."""
        layout = None if self._layout is None else [[k, list(n)] for k, n in self._layout]
        return {"version": STATE_VERSION, "method": to_safe_state(self.method.state_dict()),
                "iteration": self.iteration, "calls": self.calls,
                "dense_bytes": self.dense_bytes, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received, "layout": layout}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (refuses another method's state).

        The next iteration runs flat methods on the saved bucket layout if
        DDP's buckets differ from it (DDP's first iteration of a fresh model).
        """
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"hook state version {sd.get('version')!r} is not {STATE_VERSION}")
        self.method.load_state_dict(from_safe_state(sd["method"]))
        self.iteration = int(sd["iteration"])
        self.calls = int(sd["calls"])
        self.dense_bytes = float(sd["dense_bytes"])
        self.bytes_sent = float(sd.get("bytes_sent", 0.0))
        self.bytes_received = float(sd.get("bytes_received", 0.0))
        layout = sd.get("layout")
        self._layout = None if layout is None else [(str(k), tuple(str(x) for x in n))
                                                    for k, n in layout]
        self._restored = self._layout is not None
        self._new_iteration()

    # ----------------------------------------------------------- statistics
    def statistics(self) -> dict[str, Any]:
        """Iterations, hook calls, bytes (this rank, volume model) and the ratio to dense DDP.

        Bytes, calls and ``dense_bytes`` are this hook's and continue across a
        checkpoint restore; ``by_op`` is the communicator's breakdown since its
        last ``reset_stats()`` (shared by everything that uses it).
        """
        stats = self._comm.stats()
        sent = self.bytes_sent
        return {"method": self.method.name, "iterations": self.iteration, "calls": self.calls,
                "bytes_sent": sent, "bytes_received": self.bytes_received,
                "dense_bytes": self.dense_bytes,
                "compression": self.dense_bytes / sent if sent > 0 else float("nan"),
                "seconds": self.seconds, "skipped_steps": self.method.skipped_steps,
                "by_op": stats["by_op"]}

    def reset_statistics(self) -> None:
        """Zero the byte counters (the hook's and the communicator's), calls and seconds (not the method's state)."""
        self._comm.reset_stats()
        self.calls = 0
        self.dense_bytes = 0.0
        self.bytes_sent = 0.0
        self.bytes_received = 0.0
        self.seconds = 0.0

    # ---------------------------------------------------------------- work
    def reduce_bucket(self, bucket: Any) -> torch.futures.Future:
        """Average ``bucket``'s gradients over ranks with the method.

        Returns a future of the bucket buffer: completed on return, except in
        the first iteration after a restore when the checkpointed layout
        groups parameters of later buckets with this one (then it completes
        in the call that brings the last of them).
        """
        t0 = time.perf_counter()
        fut: torch.futures.Future = torch.futures.Future()
        buf = bucket.buffer()
        comm = self._comm
        names = tuple(self._name(p, f"b{bucket.index()}.{j}")
                      for j, p in enumerate(bucket.parameters()))
        sent0, received0 = comm.bytes_sent, comm.bytes_received
        try:
            self._bucket(bucket, buf, names, fut)
            self.bytes_sent += max(comm.bytes_sent - sent0, 0.0)
            self.bytes_received += max(comm.bytes_received - received0, 0.0)
            itemsize = buf.element_size()
            self.dense_bytes += 2.0 * buf.numel() * itemsize * (comm.size - 1) / comm.size
            self.calls += 1
            if bucket.is_last():
                self._end_iteration()
        except BaseException:
            self._new_iteration()
            raise
        finally:
            self.seconds += time.perf_counter() - t0
        return fut

    def _bucket(self, bucket: Any, buf: torch.Tensor, names: tuple[str, ...],
                fut: torch.futures.Future) -> None:
        # A bucket is identified by its parameters in bucket order; for a flat method that is
        # also the key of its state. In the first iteration after a restore, DDP's initial
        # buckets are regrouped into the saved ones (same state keys, same fused collectives).
        key = _flat_key(names, buf.numel())
        if not self._deferring and self._restored and self._names and self._layout is not None \
                and key not in {k for k, _ in self._layout}:
            self._deferring = True
        if not self._deferring:
            if self.method.layout == "flat":
                self._reduce_into(buf, key)
            else:
                self._reduce_matrices(bucket.gradients(), names)
            self._iter_groups.append((key, names))
            self._processed.update(names)
            self._done_groups.add(key)
            fut.set_result(buf)
            return
        for name, grad in zip(names, bucket.gradients()):
            self._pending[name] = grad
            self._pending_order.append(name)
        self._waiting.append((fut, names, buf))
        for gkey, gnames in self._layout or ():
            if gkey not in self._done_groups and all(n in self._pending for n in gnames):
                self._reduce_group(gkey, gnames)
        if bucket.is_last():                # parameters no saved bucket holds: one more group
            rest = tuple(n for n in self._pending_order if n not in self._processed)
            if rest:
                self._reduce_group(_flat_key(rest, sum(self._pending[n].numel() for n in rest)),
                                   rest)
        still = []
        for w_fut, w_names, w_buf in self._waiting:
            if all(n in self._processed for n in w_names):
                w_fut.set_result(w_buf)
            else:
                still.append((w_fut, w_names, w_buf))
        self._waiting = still

    def _reduce_group(self, key: str, names: tuple[str, ...]) -> None:
        """Reduce the pending gradients ``names`` as one bucket of the saved layout."""
        grads = [self._pending[n] for n in names]
        if self.method.layout == "flat":
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._reduce_into(flat, key)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        else:
            self._reduce_matrices(grads, names)
        self._processed.update(names)
        self._done_groups.add(key)

    def _reduce_matrices(self, grads: list[torch.Tensor], names: tuple[str, ...]) -> None:
        """A matrix method on each gradient in its own shape, the bucket's collectives fused.

        A method with a bucket-level path (``allreduce_many``: PowerSGD) runs
        the whole bucket on this thread, one fused collective per round, and
        writes the averages straight into the bucket's gradient views; the
        others run in lockstep (one thread per tensor, the same fusion).
        """
        if not (self.lockstep and Lockstep.supports(self._comm)):
            for grad, name in zip(grads, names):
                self._reduce_into(grad, name)
            return
        xs = [to_array(g) for g in grads]
        inputs = [np.array(x, copy=True) for x in xs] if self.record is not None else None
        many = getattr(self.method, "allreduce_many", None)
        if many is not None and self.method.can_reduce_many(xs, self._comm):
            outs = many(xs, names, self._comm, out=xs)
        elif len(grads) > 1:
            if self._lockstep is None:
                self._lockstep = Lockstep(self._comm)
            outs = self._lockstep.run([
                (lambda c, x=x, name=name: self.method.allreduce(x, name, c))
                for x, name in zip(xs, names)])
        else:
            outs = [self.method.allreduce(xs[0], names[0], self._comm)]
        for j, (g, name, avg) in enumerate(zip(grads, names, outs)):
            if inputs is not None:
                self.record.append((name, inputs[j], np.array(avg, copy=True)))
            if not _is_view_of(avg, g):
                copy_into(g, avg)

    def _end_iteration(self) -> None:
        if not self._deferring and self._iter_groups != self._layout:
            # new buckets (DDP's rebuild): drop the state of flat buckets that no longer exist
            if self.method.layout == "flat":
                keep = {k for k, _ in self._iter_groups}
                for k in [k for k in self.method.state
                          if k.startswith(_FLAT_PREFIX) and k not in keep]:
                    del self.method.state[k]
            self._layout = list(self._iter_groups) if self._iter_groups else None
        leftover = self._waiting
        self.iteration += 1
        self._restored = False
        self._new_iteration()
        if leftover:    # cannot happen: every parameter is reduced by the last bucket
            raise RuntimeError(f"{len(leftover)} DDP bucket(s) left without a result")

    def _reduce_into(self, tensor: torch.Tensor, name: str) -> None:
        x = to_array(tensor)
        if self.record is not None:
            self.record.append((name, np.array(x, copy=True), None))
        avg = self.method.allreduce(x, name, self._comm)
        if self.record is not None:
            self.record[-1] = (name, self.record[-1][1], np.array(avg, copy=True))
        copy_into(tensor, avg)


def _is_view_of(array: Any, tensor: torch.Tensor) -> bool:
    """Whether ``array`` is a NumPy array over exactly ``tensor``'s memory (no copy back needed)."""
    return (isinstance(array, np.ndarray) and tensor.device.type == "cpu"
            and array.dtype == _NUMPY_DTYPES.get(tensor.dtype)
            and tensor.is_contiguous() and array.size == tensor.numel()
            and array.__array_interface__["data"][0] == tensor.data_ptr())


def comm_hook(method: Method, *, model: Any = None, comm: Any = None,
              process_group: Any = None) -> Callable[[Any, Any], torch.futures.Future]:
    """A DDP communication hook that averages gradients with ``method``.

    Returns a function ``hook(state, bucket)`` for
    ``ddp_model.register_comm_hook(state, hook)``; its ``hook.state`` is the
    :class:`HookState` to pass as ``state`` (``None`` works as well: the hook
    then uses its own). ``model``: the DDP model (or the module it wraps),
    used to name parameters; ``comm``: a communicator to use instead of the
    automatic choice; ``process_group``: the group DDP runs on, when not the
    default one. Building the hook is a collective call on torch.distributed
    (it creates the communicator's groups): call it on every rank.
    """
    hook_state = HookState(method, model=model, comm=comm, process_group=process_group)

    # No annotations: DDP's register_comm_hook inspects the signature and accepts only
    # ``dist.GradBucket`` / ``Future[Tensor]`` objects there, while ``from __future__ import
    # annotations`` would turn any annotation into a string it rejects.
    def hvdc_comm_hook(state, bucket):  # noqa: ANN001, ANN202
        st = state if isinstance(state, HookState) else hook_state
        return st.reduce_bucket(bucket)

    hvdc_comm_hook.state = hook_state  # type: ignore[attr-defined]
    hvdc_comm_hook.__qualname__ = f"hvdc_comm_hook[{method.name}]"
    return hvdc_comm_hook


def one_bucket_at_a_time(hook: Callable[[Any, Any], torch.futures.Future]
                         ) -> Callable[[Any, Any], torch.futures.Future]:
    """``hook`` with each bucket's future waited for before DDP gets it back.

    For PyTorch's own ``powerSGD_hook`` on gloo: it waits on allreduces
    inside its future callbacks, which run on gloo's worker threads (two per
    process group), so with several buckets in flight every worker can end up
    blocked in a callback and the ranks deadlock (and callbacks of different
    buckets may issue their collectives in different orders on different
    ranks). Finished one bucket at a time its arithmetic is unchanged -- and
    it is synchronous like the hooks of :func:`comm_hook`.
    """
    def waited(state, bucket):  # noqa: ANN001, ANN202 - no annotations, see comm_hook
        fut = hook(state, bucket)
        fut.wait()
        return fut

    waited.__qualname__ = f"one_bucket_at_a_time[{getattr(hook, '__name__', 'hook')}]"
    return waited


def register(ddp_model: Any, method: Method, **kwargs: Any) -> HookState:
    """``comm_hook(method, model=ddp_model)`` registered on ``ddp_model``; returns its state."""
    hook = comm_hook(method, model=ddp_model, **kwargs)
    ddp_model.register_comm_hook(hook.state, hook)
    return hook.state


__all__ = ["HookState", "comm_hook", "one_bucket_at_a_time", "register"]
