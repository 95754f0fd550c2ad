"""``oktopk`` -- Ok-Topk SGD (Li & Hoefler, PPoPP'22, Algorithm 2) on the O(k) sparse allreduce.

Per rank and tensor (or fused bucket), with the default ``residual`` feedback:

    acc_i = e_i + g_i                                   (Algorithm 2, line 4)
    u, idx_i = ok_sparse_allreduce(acc_i, t, k)          (line 5; Algorithm 1)
    e_i = acc_i with acc_i[idx_i] = 0                    (line 6)
    the optimizer receives u / P                         (line 7)

where ``u = Topk(sum_i Topk(acc_i))`` (selected with thresholds that are
exact every ``tau_prime`` steps and reused in between) and ``idx_i`` is the
intersection of this rank's local top-k indices with the global ones: a local
entry that did not make the global top-k stays in the residual.
``_reduce`` therefore returns as ``local`` the accumulator restricted to
``idx_i``. The paper folds the learning rate into the accumulator
(``acc = e + lr * g``); like every method here we accumulate raw gradients and
let the wrapped optimizer apply ``lr`` (identical for SGD with a constant
rate, and it works with any optimizer).

Volume per rank and step: below ``6k(P-1)/P`` words (Table 1, Equation 3),
independent of P; ``2k(P-1)/P`` is the lower bound (Theorem 3.1). A step that
re-evaluates the thresholds (one in ``tau_prime``) allgathers every rank's
reduced region instead. The collective itself is
:func:`horovod_compress.mpi_collectives.oktopk.ok_sparse_allreduce`.

Warm-up: the paper's reference code runs dense allreduces first (128
iterations in its LSTM/VGG code, more for BERT) -- the
gradient distribution changes fastest at the start, when reused thresholds
would be least accurate. Those runs last tens of thousands of steps; our
default is ``warmup_steps=32`` (one threshold period ``tau_prime``), which keeps
the same idea without making a short run (hundreds of steps) mostly dense.
Pass ``warmup_steps=128`` to follow the reference.

Guards (ours, see :mod:`horovod_compress.mpi_collectives.oktopk`): a reused
threshold that selects more than ``local_guard * k`` local or
``global_guard * k`` global entries is re-evaluated exactly on the spot
(default 2; ``None`` disables a guard, giving the reference behaviour).

Under :meth:`~.base.Method.reduce_scatter` (sharded training: rank j needs
only block j of P equal blocks) the step runs the reduce-scatter variant,
:func:`horovod_compress.mpi_collectives.oktopk_reduce_scatter.ok_sparse_reduce_scatter`:
the local selection and split-and-reduce over the P blocks, no global
re-selection and no allgatherv; rank j receives block j of
``sum_i Sel(acc_i) / P`` and each rank's residual forgets everything it sent.

Global top-k exchange (ours): up to ``p2p_gather_max_ranks`` ranks (default 8)
a step that reuses the global threshold sends every rank's part of ``u``
point to point to every peer in one round, its count in the message's header,
instead of the paper's count allgather then allgatherv (Section 3.1.2): one
synchronising round instead of two, the same result bit for bit
(:func:`~horovod_compress.mpi_collectives.oktopk.exchange_parts`). Pass
``p2p_gather_max_ranks=1`` for the paper's two collectives.

State per tensor (checkpointed with the optimizer): ``local_th``,
``global_th``, ``boundaries`` (P+1 offsets), the residual ``fb_residual``,
the step counter ``t``, and the last step's ``local_count``/``global_count``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..kernels.arrays import as_module_array, get_array_module
from ..mpi_collectives import timeline as _timeline
from .base import Method, TensorState
from .state import OkTopkState
from ..params import check_float, check_int
from .registry import register
from .sparse_common import check_density, k_from_density, sparse_local
from ..mpi_collectives.oktopk import OkTopkSchedule, ok_sparse_allreduce
from ..mpi_collectives.oktopk_reduce_scatter import ok_sparse_reduce_scatter
from ..feedback import Feedback
from ..feedback.residual import ResidualFeedback
from ..kernels.oktopk_fused import cancel_at, densify

DEFAULT_WARMUP_STEPS = 32


@register
class OkTopk(Method):
    """Ok-Topk: O(k) sparse allreduce with reused thresholds and residuals (Algorithm 2)."""

    name = "oktopk"
    state_class = OkTopkState
    biased = True
    default_feedback = "residual"
    gpu_native = True  # the O(n) selection on the device, the O(k) collectives on the host
    scatters = True    # reduce_scatter: split-and-reduce over the P blocks, no allgatherv

    def __init__(self, *, density: float = 0.01, k: int | None = None, tau: int = 64,
                 tau_prime: int = 32, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 bucket_size: int = 4, balance_factor: float = 4.0,
                 local_guard: float | None = 2.0, global_guard: float | None = 2.0,
                 p2p_gather_max_ranks: int = 8,
                 feedback: str | None = None, seed: int = 0, **feedback_params: Any) -> None:
        self.density = check_density(self.name, density)
        self.k = None if k is None else check_int(self.name, "k", k, 1)
        self.tau = check_int(self.name, "tau", tau, 1)
        self.tau_prime = check_int(self.name, "tau_prime", tau_prime, 1)
        self.bucket_size = check_int(self.name, "bucket_size", bucket_size, 1)
        self.balance_factor = check_float(self.name, "balance_factor", balance_factor, 1.0)
        self.local_guard = (None if local_guard is None else
                            check_float(self.name, "local_guard", local_guard, 1.0))
        self.global_guard = (None if global_guard is None else
                             check_float(self.name, "global_guard", global_guard, 1.0))
        self.p2p_gather_max_ranks = check_int(self.name, "p2p_gather_max_ranks",
                                              p2p_gather_max_ranks, 1)
        super().__init__(feedback=feedback, warmup_steps=warmup_steps, seed=seed,
                         **feedback_params)

    def params(self) -> dict[str, Any]:
        return {"density": self.density, "k": self.k, "tau": self.tau,
                "tau_prime": self.tau_prime, "bucket_size": self.bucket_size,
                "balance_factor": self.balance_factor, "local_guard": self.local_guard,
                "global_guard": self.global_guard,
                "p2p_gather_max_ranks": self.p2p_gather_max_ranks, **self.feedback.params()}

    def k_for(self, n: int) -> int:
        """k for a tensor of n entries: ``k`` if given (may exceed n), else density * n."""
        if self.k is not None:
            return self.k
        return max(1, k_from_density(self.name, self.density, n))

    def schedule(self) -> Any:
        """The :class:`~horovod_compress.mpi_collectives.oktopk.OkTopkSchedule` of this method."""
        return OkTopkSchedule(
            tau=self.tau, tau_prime=self.tau_prime, bucket_size=self.bucket_size,
            balance_factor=self.balance_factor,
            local_guard=math.inf if self.local_guard is None else self.local_guard,
            global_guard=math.inf if self.global_guard is None else self.global_guard,
            p2p_gather_max_ranks=self.p2p_gather_max_ranks)

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray | None]:
        """Algorithm 2, lines 5-7 on ``x`` (the accumulator): ``(u / P, local)``.

        NumPy float vectors take the host path (:meth:`_host_step`); CuPy
        arrays select on the device and run the O(k) collectives on the host.
        ``local`` is ``None`` when no feedback reads it.
        """
        xp = get_array_module(x)
        if xp is np and x.dtype in (np.float32, np.float64):
            return self._host_step(np.ascontiguousarray(x).reshape(-1), None, name, comm, state,
                                   x.shape)
        self._gate(None)
        flat = x.reshape(-1)
        step = state.t - self.warmup_steps  # Algorithm 1's t: 1 at the first sparse step
        res = self._exchange(flat, comm)(comm, flat, self.k_for(flat.size), step, state,
                                         self.schedule())
        avg = xp.zeros(flat.shape, flat.dtype)   # (np.zeros: calloc'd pages, no clearing pass)
        avg[as_module_array(res.indices, xp)] = as_module_array(
            res.values / flat.dtype.type(comm.size), xp)
        # this rank's contribution: acc on the entries it put into the exchange, in a reused
        # buffer whose support EF14 reads, so the residual update is O(k), not O(n)
        local = sparse_local(self, name, flat.size, flat.dtype,
                             as_module_array(res.involved, xp), flat)
        return avg.reshape(x.shape), local.reshape(x.shape)

    def _exchange(self, flat: Any, comm: Any) -> Any:
        """Algorithm 1 (:func:`~horovod_compress.mpi_collectives.oktopk.ok_sparse_allreduce`),
        or inside :meth:`~.base.Method.reduce_scatter` its reduce-scatter variant
        (:func:`~horovod_compress.mpi_collectives.oktopk_reduce_scatter.ok_sparse_reduce_scatter`)."""
        if self._scatter_block(flat, comm) is not None:
            return ok_sparse_reduce_scatter
        return ok_sparse_allreduce

    def _reduce_residual(self, x: np.ndarray, e: np.ndarray, acc: np.ndarray, name: str,
                         comm: Any, state: TensorState
                         ) -> tuple[np.ndarray, None] | None:
        """EF14's ``acc = x + e`` (Algorithm 2, line 4) fused with the local selection.

        :class:`~horovod_compress.feedback.residual.ResidualFeedback` calls this
        instead of adding ``x + e`` into ``acc`` and calling :meth:`_reduce`;
        the results are the same bit for bit. On a step that reuses the local
        threshold the sum is written and compared with the threshold in the
        same pass (one read of ``x`` and ``e``, one write of ``acc``), which
        also tells whether ``x`` is finite (the call's deferred NaN/Inf check,
        :meth:`_defers_finite_check`). EF14's ``e = acc - local`` is applied
        here, in O(k) (:func:`~horovod_compress.kernels.oktopk_fused.cancel_at`:
        ``local`` is ``acc`` on the involved indices), so the result is
        ``(avg, None)`` and no dense ``local`` is built. ``None`` (nothing
        written) for inputs the fused kernels do not take (CuPy,
        non-contiguous, mixed dtypes).
        """
        if not (type(x) is np.ndarray and type(e) is np.ndarray and type(acc) is np.ndarray
                and x.dtype == e.dtype == acc.dtype and x.dtype in (np.float32, np.float64)
                and x.flags.c_contiguous and e.flags.c_contiguous and acc.flags.c_contiguous
                and x.size == e.size == acc.size):
            return None
        return self._host_step(acc.reshape(-1), (x.reshape(-1), e.reshape(-1)), name, comm,
                               state, acc.shape, residual=True)

    def _defers_finite_check(self, x: Any, name: str, comm: Any) -> bool:
        """NumPy float vectors under no feedback or EF14: every path ends in :meth:`_host_step`
        (which passes the gate once, before the first message); on EF14's fused path the pass
        that forms ``acc`` also reports whether the gradient is finite, so it is not read again."""
        return (type(x) is np.ndarray and x.dtype in (np.float32, np.float64)
                and type(self.feedback) in (Feedback, ResidualFeedback))

    def _gate(self, finite: bool | None) -> None:
        """The deferred NaN/Inf agreement of the call, where the base class offers one."""
        gate = getattr(self, "_pass_finite_gate", None)
        if gate is not None:
            gate(finite)

    def _host_step(self, flat: np.ndarray, addends: tuple[np.ndarray, np.ndarray] | None,
                   name: str, comm: Any, state: TensorState, shape: tuple[int, ...],
                   residual: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """One sparse step on a host float vector: Algorithm 1, then ``u / P`` and ``local``.

        ``flat`` is the accumulator (written as the sum of ``addends`` when
        given). Nothing of size n is allocated but the output: the selection
        buffers live in a per-tensor scratch dict, ``u / P`` is scattered
        into calloc'd zeros (:func:`~horovod_compress.kernels.oktopk_fused.densify`),
        and ``local`` (acc on the involved indices, Algorithm 2, line 6) is
        either applied to ``flat`` at once (``residual``: EF14's fused path,
        returns ``(avg, None)``), not built (no feedback reads it), or built
        in a reused buffer in O(k) (:func:`~horovod_compress.compressors.sparse_common.sparse_local`,
        whose support EF14 reads).
        """

        step = state.t - self.warmup_steps  # Algorithm 1's t: 1 at the first sparse step
        scratch = self.scratch.oktopk.setdefault(name, {})
        res = self._exchange(flat, comm)(comm, flat, self.k_for(flat.size), step, state,
                                         self.schedule(), addends=addends, scratch=scratch,
                                         gate=self._gate)
        with _timeline.span("oktopk.densify", "decompress", entries=int(res.indices.size)):
            avg = densify(flat.size, res.indices, res.values, comm.size, flat.dtype)
        if residual:
            with _timeline.span("feedback.residual", "feedback"):
                cancel_at(flat, res.involved)  # EF14: e = acc - local, local = acc on involved
            return avg.reshape(shape), None
        if not self.feedback.uses_local:
            return avg.reshape(shape), None
        local = sparse_local(self, name, flat.size, flat.dtype, res.involved, flat)
        return avg.reshape(shape), local.reshape(shape)


__all__ = ["DEFAULT_WARMUP_STEPS", "OkTopk"]
