"""``randk`` -- Rand-K with indices from a seed shared by all ranks.

At step t every rank draws the same k = density * n indices I_t from
``rng(seed, name, t)`` (no message spent on them), so a plain allreduce of the
k values suffices:

    avg[I_t] = (1/P) * sum_i x_i[I_t],  avg = 0 elsewhere

Volume: a ring allreduce of k words, 2k(P-1)/P words per rank. Under
:meth:`~.base.Method.reduce_scatter` (P equal blocks of the vector) only the
reduce half travels: every rank knows I_t, hence how many of the k indices
fall into each block, and sends each rank the values of its block (one
alltoallv, k(P-1)/P words per rank on average, each block summed in rank
order). With
``unbiased=True`` the result is scaled by n/k (E[avg] = true average, the
classic unbiased Rand-K, no feedback by default); otherwise it is the biased
"random sparsification" used with error feedback (default ``residual``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.arrays import as_module_array, get_array_module
from .base import TensorState
from .lowrank_common import check_bool
from .registry import register
from .sparse_common import DensitySparsifier, k_from_density, sparse_local
from ..mpi_collectives.accounting import allreduce_volume
from ..kernels.scatter import cancel_at


def shared_random_indices(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """k distinct indices in [0, n), sorted, from ``rng`` (identical on every rank)."""
    if k >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=k, replace=False))


@register
class RandK(DensitySparsifier):
    """Shared-seed Rand-K."""

    name = "randk"
    gpu_native = True
    scatters = True     # reduce_scatter: each block's values to its rank (alltoallv)

    def __init__(self, *, density: float = 0.01, unbiased: bool = False,
                 feedback: str | None = None, warmup_steps: int = 0, seed: int = 0,
                 **feedback_params: Any) -> None:
        self.unbiased = check_bool(self.name, "unbiased", unbiased)
        if feedback is None and self.unbiased:
            feedback = "none"
        super().__init__(density=density, feedback=feedback, warmup_steps=warmup_steps,
                         seed=seed, **feedback_params)

    def params(self) -> dict[str, Any]:
        return {"density": self.density, "unbiased": self.unbiased, **self.feedback.params()}

    def indices(self, name: str, step: int, n: int) -> np.ndarray:
        """The shared index set I_t of tensor ``name`` at ``step``."""
        return shared_random_indices(self.rng(name, step, "randk"), n,
                                     k_from_density(self.name, self.density, n))

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        xp = get_array_module(x)
        flat = x.reshape(-1)
        idx = as_module_array(self.indices(name, state.t, flat.size), xp)  # drawn on the host
        vals = self._average_values(xp.ascontiguousarray(flat[idx]), idx, flat, comm)
        scale = flat.dtype.type(flat.size / max(idx.size, 1)) if self.unbiased else None
        avg = xp.zeros_like(flat)
        avg[idx] = vals * scale if scale is not None else vals
        if xp is np and scale is None:   # reused buffer, O(k) per step
            local = sparse_local(self, name, flat.size, flat.dtype, idx, flat)
        else:
            local = xp.zeros_like(flat)
            local[idx] = flat[idx] * scale if scale is not None else flat[idx]
        return avg.reshape(x.shape), local.reshape(x.shape)

    def _reduce_residual(self, x: np.ndarray, e: np.ndarray, acc: np.ndarray, name: str, comm: Any,
                         state: TensorState) -> tuple[np.ndarray, None] | None:
        """EF14 (``ResidualFeedback``) fused with the exchange, the same bits as ``_reduce(x + e)``.

        The k values sent are ``x[I_t] + e[I_t]`` (I_t does not depend on the data), so the
        allreduce starts after O(k) work; EF14's ``acc = x + e`` and ``acc -= local``
        (``local`` is ``acc`` on I_t: those entries become ``acc - acc``) follow the call.
        The ranks then meet the call with a gather behind them instead of a pass over three
        n-element arrays, whose time varies between ranks by milliseconds (on the 1 Gbit
        testbed, 2 ranks, a rank waited 4-10 ms inside the allreduce for its peer). ``None`` (not
        fused) for the unbiased variant and for non-NumPy or non-contiguous arrays.
        """
        if self.unbiased or not all(type(a) is np.ndarray and a.flags.c_contiguous and a.dtype == x.dtype
                                    for a in (x, e, acc)):
            return None
        flat_x, flat_e, flat = x.reshape(-1), e.reshape(-1), acc.reshape(-1)
        idx = self.indices(name, state.t, flat.size)
        vals = self._average_values(flat_x[idx] + flat_e[idx], idx, flat, comm)
        np.add(flat_x, flat_e, out=flat)
        cancel_at(flat, idx)
        avg = np.zeros_like(flat)
        avg[idx] = vals
        return avg.reshape(x.shape), None

    def _average_values(self, vals: Any, idx: Any, flat: Any, comm: Any) -> Any:
        """The average over ranks of the k values at the shared indices ``idx`` (sorted).

        In a plain allreduce, one allreduce of the k values. Under
        :meth:`~.base.Method.reduce_scatter` (host arrays) only this rank's
        block is reduced: the values whose index falls into block j go to rank
        j (one alltoallv; the split points come from ``idx``, the same on every
        rank), which sums the P parts in rank order and divides by P; the
        other entries of the returned vector are zero.
        """
        block = self._scatter_block(flat, comm)
        if block is None or type(vals) is not np.ndarray:
            return comm.allreduce(vals, op="avg")
        size = block[1] - block[0]
        host_idx = np.asarray(idx)
        cuts = np.searchsorted(host_idx, np.arange(comm.size + 1) * size)
        parts = comm.alltoallv([vals[cuts[j]:cuts[j + 1]] for j in range(comm.size)])
        mine = np.array(parts[0], copy=True)
        for part in parts[1:]:
            mine += part
        mine /= mine.dtype.type(comm.size)
        out = np.zeros_like(vals)
        out[cuts[comm.rank]:cuts[comm.rank + 1]] = mine
        return out

    def expected_bytes(self, shape: tuple[int, ...], world_size: int, itemsize: int = 4) -> float:
        k = k_from_density(self.name, self.density, int(np.prod(shape)))
        return allreduce_volume(k * itemsize, world_size)
