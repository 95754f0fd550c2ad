"""``randk`` -- Rand-K with indices from a seed shared by all ranks.

At step t every rank draws the same k = density * n indices I_t from
``rng(seed, name, t)`` (no message spent on them), so a plain allreduce of the
k values suffices:

    avg[I_t] = (1/P) * sum_i x_i[I_t],  avg = 0 elsewhere

Volume: a ring allreduce of k words, 2k(P-1)/P words per rank. With
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
        vals = comm.allreduce(xp.ascontiguousarray(flat[idx]), op="avg")
        scale = flat.dtype.type(flat.size / max(idx.size, 1)) if self.unbiased else None
        avg = xp.zeros_like(flat)
        avg[idx] = vals * scale if scale is not None else vals
        if xp is np and scale is None:   # reused buffer, O(k) per step (issue 21)
            local = sparse_local(self, name, flat.size, flat.dtype, idx, flat)
        else:
            local = xp.zeros_like(flat)
            local[idx] = flat[idx] * scale if scale is not None else flat[idx]
        return avg.reshape(x.shape), local.reshape(x.shape)

    def expected_bytes(self, shape: tuple[int, ...], world_size: int, itemsize: int = 4) -> float:
        k = k_from_density(self.name, self.density, int(np.prod(shape)))
        return allreduce_volume(k * itemsize, world_size)
