"""``topk`` -- TopkA: local top-k, allgather of (index, value) pairs, local sum.

Each rank selects the k = density * n entries of largest magnitude of its
input x_i (Ok-Topk paper, Table 1, "TopkA"; Renggli et al.'s SparCML
allgather variant). All ranks allgather the 2k-word COO messages and sum:

    avg = (1/P) * sum_i Topk(x_i)

Volume per rank: 2k(P-1) words received (and sent, ring allgather), which
grows linearly with P -- the problem Ok-Topk solves. Biased, so the default
feedback is ``residual`` (EF14): what was not sent stays in e_i.

CPU hot path: the exact top-k (above the k-th largest ``|x_i|``,
then the first ties) in one read of x_i -- a sampled lower bound on the
threshold, the few entries above it collected, the exact threshold found
among them -- written straight into the two halves of the COO message, a compiled
float32 scatter-add of the P gathered messages (scaled by 1/P per value when P
is a power of two -- exact -- else once after the sum), and the dense
``local`` kept in a reused buffer whose k entries are erased next step. A
rank with fewer than k nonzeros pads its message with ``(0, 0.0)`` pairs.
CuPy (and float64) inputs keep the ``xp.argpartition`` / ``bincount`` path.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.arrays import get_array_module
from ..mpi_collectives import timeline as _timeline
from .base import TensorState
from .registry import register
from .sparse_common import (
    DensitySparsifier,
    exact_topk_coo,
    k_from_density,
    pack_coo,
    scatter_sum,
    sparse_local,
    topk_indices,
    unpack_coo,
)
from ..feedback import Feedback
from ..feedback.residual import ResidualFeedback
from ..kernels.selection import add_topk
from ..kernels.scatter import cancel_at


@register
class TopkA(DensitySparsifier):
    """Local top-k + allgather (TopkA)."""

    name = "topk"
    gpu_native = True

    def select(self, x: np.ndarray) -> np.ndarray:
        """Indices this rank sends (its local top-k of |x|)."""
        return topk_indices(x, k_from_density(self.name, self.density, x.size))

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        xp = get_array_module(x)
        if xp is np and x.dtype == np.float32:
            return self._reduce_cpu(x, name, comm)
        flat = x.reshape(-1)
        idx = self.select(flat)
        gathered = comm.allgather(pack_coo(idx, flat[idx]))  # (P, 2k) words
        k = idx.size
        all_idx = xp.ascontiguousarray(gathered[:, :k]).view(np.int32).reshape(-1)
        all_val = gathered[:, k:].reshape(-1)
        total = scatter_sum(flat.size, all_idx, all_val.astype(np.float64), flat.dtype)
        avg = (total / flat.dtype.type(comm.size)).reshape(x.shape)
        local = xp.zeros_like(flat)
        local[idx] = flat[idx]
        return avg, local.reshape(x.shape)

    def _defers_finite_check(self, x: Any, name: str, comm: Any) -> bool:
        """NumPy float32 under no feedback or EF14: every path ends in :meth:`_exchange`, which
        passes the gate; EF14's fused pass (:meth:`_reduce_residual`) reports finiteness from
        its read of x, so the gradient is not read a second time for the NaN/Inf check."""
        return (type(x) is np.ndarray and x.dtype == np.float32
                and type(self.feedback) in (Feedback, ResidualFeedback))

    def _reduce_residual(self, x: np.ndarray, e: np.ndarray, acc: np.ndarray, name: str, comm: Any,
                         state: TensorState) -> tuple[np.ndarray, None] | None:
        """EF14's ``acc = x + e`` fused with the selection: ``_reduce(acc)`` in one read of x and e,
        and EF14's ``acc -= local`` applied in place, so ``(avg, None)`` is returned.

        :class:`~horovod_compress.feedback.residual.ResidualFeedback` calls
        this (when a method has it) instead of adding ``x + e`` into ``acc``
        and calling :meth:`_reduce`; the results are the same bit for bit.
        ``None`` (nothing written) for inputs the fused kernel does not take.
        """
        if not (type(x) is np.ndarray and x.dtype == e.dtype == acc.dtype == np.float32
                and x.flags.c_contiguous and e.flags.c_contiguous and acc.flags.c_contiguous):
            return None
        n = x.size
        k = k_from_density(self.name, self.density, n)
        msg = np.empty(2 * k, np.float32)
        out_idx, out_val = msg[:k].view(np.int32), msg[k:]
        flat = acc.reshape(-1)
        report: dict = {}
        with _timeline.span("topk.select", "compress"):
            real = add_topk(x.reshape(-1), e.reshape(-1), flat, k, out_idx, out_val,
                            scratch=self.scratch.select, report=report)
            if real is None:     # no usable sampled bound: acc is written, select over it
                _idx, _val, real = exact_topk_coo(flat, k, out_idx=out_idx, out_val=out_val,
                                                  scratch=self.scratch.select)
        return self._exchange(msg, k, real, flat, name, comm, acc.shape,
                              finite=report.get("finite"), residual=True)

    def _reduce_cpu(self, x: np.ndarray, name: str, comm: Any) -> tuple[np.ndarray, np.ndarray]:
        """NumPy path: select into the message, allgather, compiled scatter-add (see module doc)."""
        flat = np.ascontiguousarray(x).reshape(-1)
        n = flat.size
        k = k_from_density(self.name, self.density, n)
        itype = np.int32
        msg = np.empty(2 * k, np.float32)
        with _timeline.span("topk.select", "compress"):
            _idx, _val, real = exact_topk_coo(
                flat, k, out_idx=msg[:k].view(itype), out_val=msg[k:],
                scratch=self.scratch.select)
        return self._exchange(msg, k, real, flat, name, comm, x.shape)

    def _exchange(self, msg: np.ndarray, k: int, real: int, flat: np.ndarray, name: str, comm: Any,
                  shape: tuple[int, ...], finite: bool | None = None,
                  residual: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """Allgather the COO messages, sum them, and this rank's ``local`` (``flat`` on its k indices).

        First the call's deferred NaN/Inf agreement (:meth:`Method._pass_finite_gate`), with
        ``finite`` as the selection pass found it (``None``: the gradient is tested there).
        ``residual`` (EF14's fused path): instead of ``local``, apply EF14's ``flat -= local``
        here -- ``local`` is ``flat`` on its k entries, so that is ``flat[i] - flat[i]`` at
        them (:func:`~horovod_compress.kernels.scatter.cancel_at`, same bits) -- and return
        ``(avg, None)``.
        """
        self._pass_finite_gate(finite)
        n = flat.size
        itype = np.int32
        idx = msg[:k].view(itype)
        gathered = comm.allgather(msg)  # (P, 2k) words
        all_idx = np.ascontiguousarray(gathered[:, :k]).view(itype).reshape(-1)
        all_val = np.ascontiguousarray(gathered[:, k:]).reshape(-1)
        with _timeline.span("topk.scatter_sum", "decompress", entries=int(all_idx.size)):
            avg = scatter_sum(n, all_idx, all_val, flat.dtype, scale=1.0 / comm.size)
        if residual:
            with _timeline.span("feedback.residual", "feedback"):
                cancel_at(flat, idx, real)
            return avg.reshape(shape), None
        if not self.feedback.uses_local:   # e.g. feedback="none": nobody reads local
            return avg.reshape(shape), None
        local = sparse_local(self, name, n, flat.dtype, idx, flat, real)
        return avg.reshape(shape), local.reshape(shape)

    def expected_bytes(self, shape: tuple[int, ...], world_size: int, itemsize: int = 4) -> float:
        k = k_from_density(self.name, self.density, int(np.prod(shape)))
        return float(2 * k * itemsize * (world_size - 1))


__all__ = ["TopkA", "unpack_coo"]
