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
  ``P`` matrices and the tensors sent dense in one allreduce, all ``Q``
  matrices in the next, as that hook does), with byte counts and results per parameter as in
  a sequential run (``hook.state.lockstep = False`` runs them one by one).
  PowerSGD does it itself (``PowerSGD.allreduce_many``: the whole bucket on
  the hook's thread, the estimates written straight into the bucket); the
  other matrix methods run in lockstep, one greenlet per parameter
  (:class:`~horovod_compress.mpi_collectives.lockstep.Lockstep`).

Everything else is the method's own: error feedback (``feedback=``), warm-up
(``warmup_steps=``: dense allreduces first, per tensor), the NaN/Inf policy and
the cross-rank signature check of :meth:`Method.allreduce`.

Names. A matrix method's state is keyed by the parameter's name (pass
``model=`` to use ``model.named_parameters()``; otherwise by bucket position,
``b<bucket index>.<position>``). A flat
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
no MPI needed); under ``mpirun`` the mpi4py one.

Statistics are the other front-ends': ``hook.state.stats`` is an
:class:`~horovod_compress.runtime.stats.ExchangeStats` (steps = DDP
iterations, bytes under the project's volume model, the
dense ring equivalent, seconds inside the hook, probed compression errors),
with ``comm_seconds``, ``step_skipped`` and the switches
``hook.state.settings`` (:class:`~horovod_compress.runtime.session.StepSettings`:
``measure_error_every``, ``measure_next``, ``dense``) as on the optimizer;
:meth:`HookState.statistics` summarises them as a dict.

This module only turns DDP's ``GradBucket`` into the runtime's
:class:`~horovod_compress.runtime.hook.BucketView` (NumPy views of CPU
buffers, a write-back for the rest) and completes its future; bucket
layouts, regrouping, fusion, statistics and checkpoints are
:class:`~horovod_compress.runtime.hook.HookExchange`'s.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..compressors.base import Method
from ..runtime.delegate import delegated
from ..runtime.hook import ArraySlot, HookExchange
from ..mpi_collectives.timeline_file import ensure_env_timeline, stop_timeline, timeline_running
from ..runtime.scaling import check_method
from .optimizer import from_safe_state, to_safe_state
from .tensors import tensor_slot
from ..mpi_collectives.torch_dist import TorchCommunicator, default_communicator, release_default_communicator


class _DDPBucket:
    """A ``GradBucket`` and its future as the runtime's :class:`~horovod_compress.runtime.hook.BucketView`."""

    def __init__(self, bucket: Any, names: tuple[str, ...], fut: torch.futures.Future) -> None:
        self._bucket, self._fut = bucket, fut
        self._buf = bucket.buffer()
        self.names = names
        self.numel = self._buf.numel()
        self.nbytes = self.numel * self._buf.element_size()
        self.is_last = bucket.is_last()

    def flat(self) -> ArraySlot:
        return tensor_slot(self._buf)

    def parameters(self) -> list[ArraySlot]:
        return [tensor_slot(g) for g in self._bucket.gradients()]

    def complete(self) -> None:
        self._fut.set_result(self._buf)


class HookState:
    """What the hook keeps between calls: parameter names and the runtime's exchange.

    ``exchange`` is the :class:`~horovod_compress.runtime.hook.HookExchange`
    (the method with its per-tensor state, bucket layout, statistics); the
    properties below are its public names.

    ``state_dict()`` holds tensors and plain Python values only (``torch.load``
    with ``weights_only=True`` reads it) and ``load_state_dict`` restores the
    method's state bit for bit.
    """

    method = delegated("exchange.method", "The compression method (with its per-tensor state).")
    comm = delegated("_comm", "The communicator the method talks through (``comm.stats()``).")
    stats = delegated("exchange.stats", "Cumulative ExchangeStats on this rank (as the optimizer's).")
    settings = delegated("exchange.settings", "StepSettings: warm-up (``dense``), error probes.")
    comm_seconds = delegated("exchange.comm_seconds", "Seconds inside the method's allreduce.")
    wait_seconds = delegated("exchange.wait_seconds", "0: the hook is synchronous.")
    step_skipped = delegated("exchange.step_skipped", "A bucket of the last iteration was dropped "
                             "(``nonfinite='skip'``, NaN/Inf on some rank).")
    lockstep = delegated("exchange.lockstep", "Fuse the per-parameter collectives of a bucket.", bool)
    record = delegated("exchange.record", "A list: every allreduce's (name, input, average).",
                       writable=True)
    iteration = delegated("exchange.stats.steps", "Completed DDP iterations.", int)
    calls = delegated("exchange.calls", "Hook calls (DDP buckets).", int)
    dense_bytes = delegated("exchange.stats.dense_bytes", "What DDP's allreduce would send.", float)
    bytes_sent = delegated("exchange.stats.bytes_sent", "Bytes this hook sent (whole bytes).", int)
    bytes_received = delegated("exchange.stats.bytes_received", "Bytes it received (whole bytes).", int)
    seconds = delegated("exchange.stats.seconds", "Wall seconds inside the hook.", float)

    def __init__(self, method: Method, model: Any = None, comm: Any = None,
                 process_group: Any = None) -> None:
        check_method(method, "comm_hook's method", TypeError)
        self._process_group = process_group
        self._owns_comm = comm is None and process_group is not None
        self._comm = comm if comm is not None else self._make_comm()
        ensure_env_timeline(self._comm)     # HOROVOD_TIMELINE (also read by the first allreduce)
        self.exchange = HookExchange(method, self._comm)
        self._names: dict[int, str] = {}
        if model is not None:
            self.set_model(model)

    def _make_comm(self) -> Any:
        if self._process_group is not None:
            return TorchCommunicator(self._process_group)
        return default_communicator()

    def set_model(self, model: Any) -> None:
        """Name parameters after ``model.named_parameters()`` (stable keys for checkpoints)."""
        self._names = {id(p): n for n, p in model.named_parameters()}
        self.exchange.named = bool(self._names)

    def state_dict(self) -> dict[str, Any]:
        """The method's state, the bucket layout and the hook's counters, as tensors and plain values."""
        return self.exchange.state_dict(encode=to_safe_state)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (refuses another method's state).

        The next iteration runs flat methods on the saved bucket layout if
        DDP's buckets differ from it (DDP's first iteration of a fresh model).
        """
        self.exchange.load_state_dict(sd, decode=from_safe_state)

    def statistics(self) -> dict[str, Any]:
        """Iterations, hook calls, bytes (this rank, volume model) and the ratio to dense DDP.

        Bytes, calls and ``dense_bytes`` are this hook's and continue across a
        checkpoint restore; ``by_op`` is the communicator's breakdown since its
        last ``reset_stats()`` (shared by everything that uses it).
        """
        return self.exchange.statistics()

    def reset_statistics(self) -> None:
        """Zero the counters (all but ``iteration``) and the communicator's; not the method's state."""
        self.exchange.reset_statistics()

    def close(self) -> None:
        """Release the communicator's process groups before the process exits (idempotent).

        Call it after the last iteration, before ``dist.destroy_process_group()``:
        a communicator this hook created for ``process_group`` is closed, and
        the process-wide default one (the automatic choice) is released --
        :meth:`~horovod_compress.mpi_collectives.torch_dist.TorchCommunicator.close`
        says why groups must not outlive Python's finalization. A communicator
        passed as ``comm`` is the caller's to close. The hook cannot reduce
        buckets afterwards.
        """
        if timeline_running(self._comm):
            stop_timeline()                   # its merge needs the communicator: write it first
        if self._owns_comm:
            self._comm.close()
        else:
            release_default_communicator(self._comm)

    def reduce_bucket(self, bucket: Any) -> torch.futures.Future:
        """Average ``bucket``'s gradients over ranks with the method.

        Returns a future of the bucket buffer: completed on return, except in
        the first iteration after a restore when the checkpointed layout
        groups parameters of later buckets with this one (then it completes
        in the call that brings the last of them).
        """
        fut: torch.futures.Future = torch.futures.Future()
        names = tuple(self._names.get(id(p), f"b{bucket.index()}.{j}")
                      for j, p in enumerate(bucket.parameters()))
        self.exchange.reduce(_DDPBucket(bucket, names, fut))
        return fut


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
