"""``horovod.torch``'s public API on mpi4py: change ``import horovod.torch as hvd`` only.

Every public name of ``horovod.torch`` 0.28 exists here with Horovod's
parameters (ours add keyword parameters at the end where they have some):
collectives on tensors (``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter``, their in-place ``_``, ``grouped_`` and
``_async`` forms with ``synchronize``/``poll``), objects
(``broadcast_object``, ``allgather_object``), the world
(``init``, ``rank``, ``local_size``, ``cross_rank``, ``is_initialized``, ...),
process sets, ``SyncBatchNorm``, ``elastic`` and ``DistributedOptimizer``.

``compression=`` takes any ``Compression.<method>`` -- called, or uncalled as
Horovod scripts write ``hvd.Compression.fp16`` -- and, for ``allreduce``,
runs the method's compressed allreduce (``op`` Average or Sum; Adasum, Min,
Max and Product reduce uncompressed). Asynchronous calls run when issued and
return a completed handle. What cannot be done on a fixed MPI world says so
when called: elastic membership changes.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from ..horovod_api import basics as hb
from ..compressors.registry import Compression, as_method
from ..horovod_api.basics import HorovodInternalError, poll, synchronize  # noqa: F401 - Horovod's
from ..horovod_api.common import *  # noqa: F403 - Horovod's names every front-end shares
from ..horovod_api.method_limits import HorovodAdapterError
from . import broadcast as _bcast
from . import optimizer as _opt
from .tensors import to_numpy
from ..runtime.buckets import DEFAULT_BUCKET_BYTES

_FW = "torch"
_CALLS = hb.FrontEndCalls(_FW)


# ------------------------------------------------------------------------------ world
(init, shutdown, rank, size, local_rank, local_size, cross_rank, cross_size, is_homogeneous,
 barrier) = _CALLS.world()
_comm = _CALLS.comm


def join(device: int = -1) -> int:
    """Wait for every rank; return the rank that arrived last (see :func:`horovod_basics.join`)."""
    return hb.join(_FW)


# ------------------------------------------------------------------------- tensors
def _like(array: np.ndarray, tensor: torch.Tensor) -> torch.Tensor:
    arr = np.ascontiguousarray(array)
    out = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
    return out.to(device=tensor.device, dtype=tensor.dtype)


def _host(tensor: torch.Tensor) -> np.ndarray:
    t = tensor.detach()
    if t.is_sparse:
        t = t.to_dense()
    if not t.dtype.is_floating_point:
        return t.cpu().contiguous().numpy()
    return to_numpy(t)


def allreduce(tensor: torch.Tensor, average: Any = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """The reduction of ``tensor`` over ranks (default: the average), as a new tensor.

    ``compression`` runs that method's compressed allreduce (Average or Sum;
    ``name`` keys its per-tensor state). ``prescale_factor`` multiplies the
    input, ``postscale_factor`` the result (Horovod's order).
    """
    kind = hb.op_kind(op, average)
    method = as_method(compression)
    comm = _comm(process_set)
    out = hb.allreduce_scaled(method, comm, _host(tensor), kind, name, prescale_factor,
                              postscale_factor)
    return _like(np.asarray(out).reshape(tuple(tensor.shape)), tensor)


def allreduce_(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce` (uncompressed)."""
    out = allreduce(tensor, average, name, Compression.none, op, prescale_factor,
                    postscale_factor, process_set)
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


def allreduce_async(tensor: torch.Tensor, average: Any = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> int:
    """Start :func:`allreduce` (runs now); returns a handle for :func:`synchronize`."""
    return hb.make_handle(allreduce(tensor, average, name, Compression.none, op, prescale_factor,
                                    postscale_factor, process_set))


def allreduce_async_(tensor: torch.Tensor, average: Any = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> int:
    """Start :func:`allreduce_` (runs now); returns a handle for :func:`synchronize`."""
    return hb.make_handle(allreduce_(tensor, average, name, op, prescale_factor,
                                     postscale_factor, process_set))


def _names(name: str | None, n: int) -> list[str | None]:
    return [None if name is None else f"{name}.{i}" for i in range(n)]


def grouped_allreduce(tensors: list, average: Any = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = global_process_set) -> list:
    """:func:`allreduce` of each tensor (names ``name.i``); a list of results."""
    method = as_method(compression)
    return [allreduce(t, average, nm, method, op, prescale_factor, postscale_factor, process_set)
            for t, nm in zip(tensors, _names(name, len(tensors)))]


def grouped_allreduce_(tensors: list, average: Any = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list:
    """:func:`allreduce_` of each tensor, in place."""
    return [allreduce_(t, average, nm, op, prescale_factor, postscale_factor, process_set)
            for t, nm in zip(tensors, _names(name, len(tensors)))]


def grouped_allreduce_async(tensors: list, average: Any = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> int:
    """Start :func:`grouped_allreduce` (runs now); returns a handle."""
    return hb.make_handle(grouped_allreduce(tensors, average, name, Compression.none, op,
                                            prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(tensors: list, average: Any = None, name: str | None = None,
                             op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> int:
    """Start :func:`grouped_allreduce_` (runs now); returns a handle."""
    return hb.make_handle(grouped_allreduce_(tensors, average, name, op, prescale_factor,
                                             postscale_factor, process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: Any = global_process_set) -> int:
    """Allreduce of a sparse tensor (densified; the result is sparse again)."""
    dense = allreduce(tensor.to_dense() if tensor.is_sparse else tensor, None, name,
                      Compression.none, op, 1.0, 1.0, process_set)
    return hb.make_handle(dense.to_sparse() if tensor.is_sparse else dense)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ)."""
    out = hb.allgather_rows(_comm(process_set), _host(tensor))
    return torch.from_numpy(np.ascontiguousarray(out)).to(device=tensor.device, dtype=tensor.dtype)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = global_process_set) -> int:
    """Start :func:`allgather` (runs now); returns a handle."""
    return hb.make_handle(allgather(tensor, name, process_set))


def grouped_allgather(tensors: list, name: str | None = None,
                      process_set: Any = global_process_set) -> list:
    """:func:`allgather` of each tensor."""
    return [allgather(t, None, process_set) for t in tensors]


def grouped_allgather_async(tensors: list, name: str | None = None,
                            process_set: Any = global_process_set) -> int:
    """Start :func:`grouped_allgather` (runs now); returns a handle."""
    return hb.make_handle(grouped_allgather(tensors, name, process_set))


def allgather_object(obj: Any, name: str | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    return hb.communicator(_FW).allgather_object(obj)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor."""
    comm = _comm(process_set)
    buf = np.ascontiguousarray(_host(tensor)).copy()
    comm.broadcast(buf, root=hb.root_in(process_set, root_rank, _FW))
    return torch.from_numpy(buf).to(device=tensor.device, dtype=tensor.dtype)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """In-place :func:`broadcast` from ``root_rank``."""
    out = broadcast(tensor, root_rank, name, process_set)
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> int:
    """Start :func:`broadcast` (runs now); returns a handle."""
    return hb.make_handle(broadcast(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> int:
    """Start :func:`broadcast_` (runs now); returns a handle."""
    return hb.make_handle(broadcast_(tensor, root_rank, name, process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set, comm: Any = None) -> Any:
    """Any picklable ``obj`` from ``root_rank``."""
    return _CALLS.broadcast_object(obj, root_rank, process_set, comm)


def broadcast_parameters(params: Any, root_rank: int = 0, comm: Any = None) -> None:
    """``root_rank``'s values into ``params`` (a ``state_dict()`` or ``named_parameters()``)."""
    _bcast.broadcast_parameters(params, root_rank=root_rank, comm=comm)


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0, model: Any = None,
                              comm: Any = None) -> None:
    """``root_rank``'s optimizer state (with our compressor state) on every rank."""
    _bcast.broadcast_optimizer_state(optimizer, root_rank=root_rank, comm=comm)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Rows ``splits[j]`` of ``tensor`` go to rank j; returns what arrived (and, given
    ``splits``, the rows received from each rank), as Horovod does."""
    out, recv = hb.alltoall_rows(_comm(process_set), _host(tensor),
                                 None if splits is None else np.asarray(
                                     splits.cpu() if isinstance(splits, torch.Tensor) else splits))
    result = torch.from_numpy(np.ascontiguousarray(out)).to(device=tensor.device,
                                                            dtype=tensor.dtype)
    if splits is None:
        return result
    return result, torch.from_numpy(recv)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> int:
    """Start :func:`alltoall` (runs now); the handle gives ``(output, received_splits)``."""
    out = alltoall(tensor, splits, name, process_set)
    if splits is None:
        out = (out, None)
    return hb.make_handle(out)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: Any = Average,
                  process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks and keep this rank's block of rows (the first ``n % P`` ranks one more)."""
    hb.require_uncompressed_reducescatter(as_method(compression))
    out = hb.reducescatter_scaled(_comm(process_set), _host(tensor), hb.op_kind(op),
                                  prescale_factor, postscale_factor)
    return torch.from_numpy(np.ascontiguousarray(out)).to(device=tensor.device, dtype=tensor.dtype)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start :func:`reducescatter` (runs now); returns a handle."""
    return hb.make_handle(reducescatter(tensor, name, Compression.none, op, process_set,
                                        prescale_factor, postscale_factor))


def grouped_reducescatter(tensors: list, name: str | None = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    """:func:`reducescatter` of each tensor."""
    return [reducescatter(t, None, compression, op, process_set, prescale_factor,
                          postscale_factor) for t in tensors]


def grouped_reducescatter_async(tensors: list, name: str | None = None, op: Any = Average,
                                process_set: Any = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start :func:`grouped_reducescatter` (runs now); returns a handle."""
    return hb.make_handle(grouped_reducescatter(tensors, name, Compression.none, op, process_set,
                                                prescale_factor, postscale_factor))


# ------------------------------------------------------------------------ optimizer
class _AdasumDistributedOptimizer(torch.optim.Optimizer):
    """Horovod's Adasum optimizer: a local step per parameter, then Adasum of the model deltas."""

    def __init__(self, params: Any, named_parameters: Any, method: Any,
                 backward_passes_per_step: int, comm: Any) -> None:
        super(self.__class__, self).__init__(params)
        self._hvdc_method = method
        self._hvdc_comm = comm
        self.backward_passes_per_step = int(backward_passes_per_step)

    def synchronize(self) -> None:
        """Nothing to wait for: the Adasum exchange happens inside ``step()``."""

    def skip_synchronize(self) -> Any:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        starts = [p.detach().clone() for p in params]
        super(self.__class__, self).step()
        for p, start in zip(params, starts):
            delta = to_numpy((p.detach() - start).float())
            combined = hb.reduce_with_method(self._hvdc_method, self._hvdc_comm,
                                             delta.astype(np.float32), Adasum, None)
            with torch.no_grad():
                p.copy_(start + torch.from_numpy(np.ascontiguousarray(combined)).to(
                    device=p.device, dtype=p.dtype).reshape(p.shape))
        return loss


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set, *,
                         bucket_bytes: int | None = None, overlap: bool = True,
                         comm: Any = None) -> torch.optim.Optimizer:
    """Horovod's ``DistributedOptimizer``: gradients averaged over ranks with ``compression``.

    ``op``: Average or Sum with any method; Adasum with ``none``/``fp16``/
    ``bf16`` (Horovod's Adasum optimizer: local step, Adasum of the deltas).
    ``num_groups``/``groups`` are accepted and do not change results (our
    fusion buckets decide the grouping: ``bucket_bytes``); sparse gradients
    are reduced densely whatever ``sparse_as_dense`` says. ``process_set``
    restricts the exchange to its ranks (other ranks step locally, as in
    Horovod). See :func:`horovod_compress.torch.optimizer.DistributedOptimizer`
    for ``bucket_bytes``, ``overlap`` and ``comm``.
    """
    kind = hb.op_kind(op)
    if gradient_predivide_factor != 1.0 and kind != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    method = as_method(compression)
    if comm is None:
        if process_set is not None and getattr(process_set, "process_set_id", 0) != 0 \
                and not process_set.included():
            return optimizer   # Horovod: ranks outside the set train locally
        comm = _comm(process_set)
    if kind == Adasum and comm.size > 1:
        if method.name not in ("none", "fp16", "bf16"):
            raise HorovodAdapterError(
                f"{method.name}: op=Adasum combines the ranks' model deltas with the Adasum rule, "
                "which a compressed average cannot replace; use op=Average or op=Sum with this "
                "method, or compression=Compression.none/fp16/bf16 with Adasum")
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                   dict(_AdasumDistributedOptimizer.__dict__))
        return cls(optimizer.param_groups, named_parameters, method, backward_passes_per_step,
                   comm)
    if kind not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer: op must be Average, Sum or Adasum, got {op!r}")
    return _opt.DistributedOptimizer(
        optimizer, named_parameters=named_parameters, compression=method,
        backward_passes_per_step=backward_passes_per_step, op=kind,
        gradient_predivide_factor=gradient_predivide_factor,
        bucket_bytes=DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
        overlap=overlap, comm=comm)


# ----------------------------------------------------------------------- SyncBatchNorm
class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any, bias: Any, eps: float, comm: Any) -> Any:
        dims = [0] + list(range(2, x.dim()))
        n_local = x.numel() // x.shape[1]
        stats = torch.cat([x.sum(dims), (x * x).sum(dims),
                           torch.tensor([float(n_local)], dtype=x.dtype, device=x.device)])
        total = torch.from_numpy(comm.allreduce(to_numpy(stats.detach().double()), op="sum"))
        c = x.shape[1]
        count = float(total[-1])
        mean = (total[:c] / count).to(x.dtype).to(x.device)
        var = (total[c:2 * c] / count).to(x.dtype).to(x.device) - mean * mean
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var.clamp_min(0) + eps)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        out = xhat * weight.view(shape) + bias.view(shape) if weight is not None else xhat
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.comm, ctx.count, ctx.dims = comm, count, dims
        return out, mean, var * count / max(count - 1.0, 1.0)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _gm: Any, _gv: Any) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        dims, c = ctx.dims, xhat.shape[1]
        shape = [1, c] + [1] * (xhat.dim() - 2)
        g = grad_out * weight.view(shape) if weight is not None else grad_out
        local = torch.cat([g.sum(dims), (g * xhat).sum(dims)])
        total = torch.from_numpy(ctx.comm.allreduce(to_numpy(local.detach().double()), op="sum"))
        sum_g = total[:c].to(g.dtype).to(g.device).view(shape)
        sum_gx = total[c:].to(g.dtype).to(g.device).view(shape)
        grad_x = invstd.view(shape) * (g - sum_g / ctx.count - xhat * sum_gx / ctx.count)
        grad_w = (grad_out * xhat).sum(dims) if weight is not None else None
        grad_b = grad_out.sum(dims) if weight is not None else None
        return grad_x, grad_w, grad_b, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalisation with statistics over every rank's batch (Horovod's ``SyncBatchNorm``).

    Training: mean and variance of the whole global batch (one allreduce of
    per-channel sums forward, one backward); running statistics updated with
    the global values. Evaluation: the running statistics, like ``BatchNorm``.
    """

    def __init__(self, num_features: int, eps: float = 1e-05, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise with the global batch's statistics (training) or the running ones."""
        self._check_input_dim(input)
        if not self.training or hb.size(_FW) == 1:
            return super().forward(input)
        out, mean, unbiased_var = _SyncBatchNormFn.apply(
            input, self.weight, self.bias, self.eps, hb.communicator(_FW))
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else \
                    1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(m * mean.detach())
                self.running_var.mul_(1 - m).add_(m * unbiased_var.detach())
        return out
