"""FSDP2's reduce-scatter: every method of ``hvdc.Compression`` inside ``fully_shard``.

::

    import horovod_compress as hvdc
    from horovod_compress.torch import fsdp as hvdc_fsdp
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = hvdc_fsdp.register(model, hvdc.Compression.topk(density=0.01))
    ...
    dcp.save({"model": ..., "hvdc": state.stateful()}, checkpoint_id=path)

Sharded data parallelism ("PyTorch FSDP: Experiences on Scaling Fully
Sharded Data Parallel", Zhao et al., VLDB 2023, Section 3.2) does not
allreduce gradients: after each module's backward, FSDP2 copies the module's
unsharded gradients into one flat buffer and reduce-scatters it, so that each
rank receives only its own shard of the average. :func:`register` sets a
:class:`CompressedReduceScatter` (torch's ``ReduceScatter`` protocol of
``torch.distributed.fsdp._fully_shard._fsdp_api``) on *every*
``FSDPModule`` of the model -- FSDP calls the one of the module whose
gradients it reduces; the root alone holds no parameter of the inner modules
and is never called for them.

The flat buffer. FSDP pads each parameter's first dimension to a multiple of
the P ranks and lays the buffer out as P equal rows (``foreach_reduce_scatter_copy_in``):
row r is the concatenation, over the module's parameters, of each
parameter's r-th chunk of rows; rank r's shard of the result is row r. So
the flat buffer *is* a vector whose j-th of P equal blocks is rank j's
shard:

* flat methods (``layout == "flat"``) run on the whole buffer through
  :meth:`~horovod_compress.compressors.base.Method.reduce_scatter`: rank r
  receives block r of the method's average of the buffer. Methods that
  reduce-scatter for real (``method.scatters``: none, fp16, bf16, 8-bit
  Global-QSGD, Rand-K, TopkDSA) move only what a block needs (the
  reduce-scatter half of their ring, N(P-1)/P of the buffer's N bytes for a
  dense one; TopkDSA's sparse reduce-scatter without its allgatherv); the
  others reduce the whole buffer and keep the slice (their allreduce's
  bytes). The method's state (error feedback, trackers) is kept per module
  buffer, keyed by its parameters.
* matrix methods (``layout == "matrix"``: PowerSGD, GreedyLore, ARC-Top-K,
  the row baselines) run on each parameter's gradient in its own shape,
  gathered from the buffer's rows (padding rows dropped), with their state
  per parameter, and write back only the rows of this rank's chunk
  (:meth:`~horovod_compress.compressors.base.Method.keep_rows` tells the
  method which: GreedyLore builds only those rows of its ``Q C``; PowerSGD's
  and ARC-Top-K's error feedback needs every row of their result anyway). A
  module's per-parameter collectives are fused as in the DDP hook.

The divide factor and the reduce dtype. FSDP gives the method a buffer in
``MixedPrecisionPolicy.reduce_dtype`` (the gradients' dtype by default) and
an operation: ``AVG`` (float32 and bfloat16 gradients, the default divide
factor), ``SUM`` after pre-dividing the buffer (float16, or
``set_force_sum_reduction_for_comms(True)``; FSDP post-divides the result),
or ``PREMUL_SUM(1/f)`` (``set_gradient_divide_factor(f)``). The method
always computes the average over ranks; the result handed back is that
average times P (``SUM``) or times P/f (``PREMUL_SUM``), so FSDP's own
pre- and post-division give what its reduce-scatter would. The method works in
float32 (float64 for float64 buffers) and its wire format is its own: the
reduce dtype decides what FSDP hands over and receives, not what travels.

Everything else is the DDP hook's (:mod:`horovod_compress.torch.ddp`, whose
:class:`~horovod_compress.torch.ddp.HookState` :class:`FSDPState` extends):
the method's checks (shapes, names and configuration agree across ranks, or
every rank raises), warm-up, NaN/Inf policy, error feedback, statistics
(``state.statistics()``: steps are backward passes, ``dense_bytes`` what
FSDP2's dense reduce-scatter would send, N(P-1)/P per module buffer) and the
communicator (:func:`~horovod_compress.mpi_collectives.default_communicator`:
inside ``torchrun`` a torch.distributed one, gloo on CPU, NCCL beside it for
CUDA arrays). An exception on one rank ends the job, as everywhere
(:func:`~horovod_compress.mpi_collectives.world.ensure_abort_on_exception`).

Checkpoints: ``state.state_dict()`` is this rank's state (tensors and plain
values, as the DDP hook's). Every rank's state differs (error feedback is
per rank), so with ``torch.distributed.checkpoint`` put ``state.stateful()``
beside the model: it saves each rank's state under a key of its own and
restores it on the same rank, bit for bit.
"""
from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..compressors.base import Method
from ..runtime.hook import ArraySlot
from ..mpi_collectives.accounting import reduce_scatter_volume
from .ddp import HookState
from .tensors import copy_into, to_array, to_numpy


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, FSDPModule]]:
    """Every ``FSDPModule`` in ``model`` (the root included) with its name ("" for the root)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def _param_group(module: FSDPModule) -> Any:
    """The module's FSDP parameter group (``None`` when it manages no parameter)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError("horovod_compress.torch.fsdp: a module with several FSDP parameter "
                         "groups (per-parameter meshes) is not supported")
    return groups[0] if groups else None


class _Layout:
    """Where each of a module's parameters sits in FSDP's flat reduce-scatter buffer.

    ``rows[i]``: parameter i's rows per rank (its padded first dimension / P);
    ``offsets[i]``, ``numels[i]``: its chunk's place in every row of the (P, S) buffer.
    """

    def __init__(self, fsdp_params: Sequence[Any], names: Sequence[str], world: int) -> None:
        self.names = tuple(names)
        self.shapes = [tuple(int(d) for d in p._orig_size) for p in fsdp_params]
        self.rows = [int(p.padded_sharded_param_size[0]) if len(p.padded_sharded_param_size)
                     else 1 for p in fsdp_params]
        self.numels = [int(p.padded_sharded_param_size.numel()) for p in fsdp_params]
        self.offsets = list(np.cumsum([0] + self.numels[:-1]).astype(int))
        self.shard_numel = int(sum(self.numels))
        self.world = world
        self.shard_dims = [int(p.fsdp_placement.dim) for p in fsdp_params]

    def full_gradient(self, buf: np.ndarray, i: int) -> np.ndarray:
        """Parameter i's whole (unpadded) gradient, gathered from the rows of ``buf`` (P x S)."""
        rows, rest = self.rows[i], self.shapes[i][1:]
        chunk = buf[:, self.offsets[i]:self.offsets[i] + self.numels[i]]
        full = chunk.reshape((self.world * rows,) + rest)
        return np.ascontiguousarray(full[:self.shapes[i][0]]) if self.shapes[i] else \
            np.ascontiguousarray(full.reshape(()))

    def row_ranges(self, rank: int) -> dict[str, tuple[int, int]]:
        """Each parameter's rows ``[lo, hi)`` (of its unpadded first dimension) in rank ``rank``'s chunk."""
        return {name: (rank * rows, min((rank + 1) * rows, shape[0]))
                for name, rows, shape in zip(self.names, self.rows, self.shapes) if shape}

    def local_rows(self, avg: np.ndarray, i: int, rank: int) -> np.ndarray:
        """Rank ``rank``'s chunk of parameter i's average ``avg`` (padding rows zero), flat."""
        rows = self.rows[i]
        shape = self.shapes[i]
        if not shape:
            return avg.reshape(1) if rank == 0 else np.zeros(0, avg.dtype)
        out = np.zeros((rows,) + shape[1:], dtype=avg.dtype)
        lo, hi = rank * rows, min((rank + 1) * rows, shape[0])
        if hi > lo:
            out[:hi - lo] = avg[lo:hi]
        return out.reshape(-1)


class _FSDPBuffer:
    """One reduce-scatter call of FSDP as the runtime's :class:`~horovod_compress.runtime.hook.BucketView`."""

    scatter = True

    def __init__(self, state: "FSDPState", layout: _Layout, output: torch.Tensor,
                 input_tensor: torch.Tensor, scale: float, is_last: bool) -> None:
        self._state, self._layout, self._out, self._in = state, layout, output, input_tensor
        self._scale = scale
        self.names = layout.names
        self.numel = input_tensor.numel()
        self.nbytes = self.numel * input_tensor.element_size()
        self.is_last = is_last

    def _put(self, target: torch.Tensor, values: Any) -> None:
        if self._scale != 1.0:
            values = values * values.dtype.type(self._scale)
        copy_into(target, values)

    def flat(self) -> ArraySlot:
        return ArraySlot(to_array(self._in), lambda shard: self._put(self._out, shard))

    def parameters(self) -> list[ArraySlot]:
        lay, rank = self._layout, self._state.comm.rank
        if any(d != 0 for d in lay.shard_dims):
            raise ValueError(f"{self._state.method.name}: matrix methods need FSDP's default "
                             f"Shard(0) placement, got dims {lay.shard_dims} for {lay.names}")
        buf = to_numpy(self._in).reshape(lay.world, -1)
        # only this rank's rows of each average are read (write below): a method that can
        # builds only those (GreedyLore's Q C)
        self._state.method.keep_rows(lay.row_ranges(rank))
        slots = []
        for i in range(len(lay.names)):
            def write(avg: Any, i: int = i) -> None:
                lo = lay.offsets[i]
                self._put(self._out[lo:lo + lay.numels[i]],
                          lay.local_rows(np.asarray(avg), i, rank))
            slots.append(ArraySlot(lay.full_gradient(buf, i), write))
        return slots

    def complete(self) -> None:
        """Nothing to hand over: the writes filled FSDP's output tensor."""


class CompressedReduceScatter(ReduceScatter):
    """The ``ReduceScatter`` of one ``FSDPModule``: its flat buffer through ``state``'s method."""

    def __init__(self, state: "FSDPState", module: FSDPModule, name: str) -> None:
        self.state, self.module, self.module_name = state, module, name

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """FSDP2's buffers (its input and output): plain ``torch.empty`` on ``device``."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` with the method, synchronously
        (``async_op`` is ignored: the result is in ``output_tensor`` on return; FSDP2 calls
        it without)."""
        self.state.reduce_scatter(self, output_tensor, input_tensor, group, op)
        return None


class FSDPState(HookState):
    """The compressed reduce-scatter's state: the method, its communicator, the modules' layouts.

    As :class:`~horovod_compress.torch.ddp.HookState` (statistics, ``state_dict``,
    ``close``); :meth:`stateful` is the object to hand ``torch.distributed.checkpoint``.
    """

    def __init__(self, method: Method, model: torch.nn.Module, comm: Any = None,
                 process_group: Any = None) -> None:
        super().__init__(method, comm=comm, process_group=process_group)
        self.comms: list[CompressedReduceScatter] = []
        self._layouts: dict[int, _Layout] = {}
        self._param_names: dict[int, str] = {}
        self._seen: set[int] = set()
        self.set_model(model)

    def set_model(self, model: Any) -> None:
        """Name parameters after ``model.named_parameters()`` (the state's keys)."""
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self.exchange.named = False      # FSDP's buffers never change: nothing to regroup

    def _layout(self, rs: CompressedReduceScatter, numel: int) -> _Layout:
        layout = self._layouts.get(id(rs))
        if layout is not None and layout.shard_numel * layout.world == numel:
            return layout
        group = _param_group(rs.module)
        params = list(group.fsdp_params) if group is not None else []
        names = [self._param_names.get(id(p.sharded_param),
                                       f"{rs.module_name}.{p._module_info.param_name}".lstrip("."))
                 for p in params]
        layout = _Layout(params, names, self.comm.size)
        if layout.shard_numel * layout.world != numel:
            raise ValueError(
                f"horovod_compress.torch.fsdp: module {rs.module_name or '<root>'!r} reduce-scatters "
                f"{numel} elements but its parameters hold {layout.shard_numel * layout.world}: "
                f"some parameter got no gradient; call "
                f"module.set_reduce_scatter_unused_params(True) so FSDP reduces every parameter")
        self._layouts[id(rs)] = layout
        return layout

    def _scale(self, rs: CompressedReduceScatter, op: Any) -> float:
        """What multiplies the method's average: 1 (AVG), P (SUM), P/f (PREMUL_SUM(1/f))."""
        if op == dist.ReduceOp.AVG:
            return 1.0
        if op == dist.ReduceOp.SUM:
            return float(self.comm.size)
        factor = getattr(_param_group(rs.module), "gradient_divide_factor", None)
        if factor is None:
            raise ValueError(f"horovod_compress.torch.fsdp: unsupported reduce-scatter op {op!r} "
                             f"(AVG, SUM and PREMUL_SUM with a gradient divide factor are)")
        return float(self.comm.size) / float(factor)

    def reduce_scatter(self, rs: CompressedReduceScatter, output: torch.Tensor,
                       input_tensor: torch.Tensor, group: Any, op: Any) -> None:
        """Reduce-scatter ``input_tensor`` (module ``rs``'s flat buffer) into ``output``."""
        world = group.size() if group is not None else dist.get_world_size()
        if world != self.comm.size:
            raise ValueError(f"horovod_compress.torch.fsdp: FSDP reduce-scatters over {world} "
                             f"ranks, the communicator has {self.comm.size} (HSDP and meshes "
                             f"other than the default group are not supported)")
        layout = self._layout(rs, input_tensor.numel())
        if id(rs) in self._seen:           # a module reduced twice: a new backward began
            self.exchange.end_iteration()
            self._seen.clear()
        self._seen.add(id(rs))
        is_last = len(self._seen) == len(self._expected())
        if is_last:
            self._seen.clear()
        self.exchange.reduce(_FSDPBuffer(self, layout, output, input_tensor,
                                         self._scale(rs, op), is_last))

    def _expected(self) -> list[CompressedReduceScatter]:
        """The registered modules that reduce-scatter (hold parameters)."""
        return [rs for rs in self.comms if _param_group(rs.module) is not None]

    def stateful(self) -> "RankState":
        """This state for ``torch.distributed.checkpoint`` (``dcp.save``/``dcp.load``)."""
        return RankState(self)


class RankState:
    """A ``Stateful`` for ``torch.distributed.checkpoint``: each rank's state under ``rank<r>``.

    DCP saves a tensor that every rank holds under the same key once (as
    replicated); error feedback differs per rank, so each rank's state goes
    under a key of its own, as one serialized blob (``torch.save`` of
    :meth:`FSDPState.state_dict`, tensors and plain values), and comes back
    to the same rank.
    """

    def __init__(self, state: FSDPState) -> None:
        self.state = state

    def _key(self) -> str:
        return f"rank{self.state.comm.rank}"

    def state_dict(self) -> dict[str, Any]:
        """``{"rank<r>": bytes}``: this rank's :meth:`FSDPState.state_dict`, serialized."""
        buf = io.BytesIO()
        torch.save(self.state.state_dict(), buf)
        return {self._key(): buf.getvalue()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore this rank's state from what DCP loaded under its key."""
        blob = sd[self._key()]
        self.state.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))


def register(model: torch.nn.Module, method: Method, *, comm: Any = None,
             process_group: Any = None) -> FSDPState:
    """Set ``method``'s compressed reduce-scatter on every ``FSDPModule`` of ``model``; return its state.

    ``model``: the root after ``fully_shard`` (its sub-modules sharded as the
    user chose). ``comm``: a communicator to use instead of the automatic
    choice; ``process_group``: the group FSDP shards over, when not the
    default one. A collective call (it creates the communicator's groups):
    call it on every rank.
    """
    mods = fsdp_modules(model)
    if not mods:
        raise ValueError("horovod_compress.torch.fsdp.register: the model holds no FSDPModule "
                         "(apply torch.distributed.fsdp.fully_shard first)")
    state = FSDPState(method, model, comm=comm, process_group=process_group)
    for name, module in mods:
        rs = CompressedReduceScatter(state, module, name)
        module.set_custom_reduce_scatter(rs)
        state.comms.append(rs)
    return state


def dense_reduce_scatter_bytes(model: torch.nn.Module, world: int) -> float:
    """Bytes per rank (each way) of one backward's dense reduce-scatters: N(P-1)/P per module
    buffer of N bytes (FSDP's padded flat buffers), the baseline of the statistics."""
    total = 0.0
    for _name, module in fsdp_modules(model):
        group = _param_group(module)
        if group is None:
            continue
        numel = sum(int(p.padded_sharded_param_size.numel()) for p in group.fsdp_params) * world
        itemsize = group.fsdp_params[0].sharded_param.element_size()
        total += reduce_scatter_volume(numel * itemsize, world)
    return total


__all__ = ["CompressedReduceScatter", "FSDPState", "RankState", "dense_reduce_scatter_bytes",
           "fsdp_modules", "register"]
