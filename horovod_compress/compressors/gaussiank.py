"""``gaussiank`` -- Gaussiank: a threshold from the Gaussian percent-point function, then allgather.

Each rank estimates the k-th largest |x_i| (k = density * n) without any
selection: it fits N(mu, sigma^2) to x_i and takes
``th = |mu| + sigma * Phi^-1(1 - density/2)`` (Shi et al. 2019; Ok-Topk paper,
Section 2 and Figure 4), then sends the entries with ``|x_i| >= th`` to every
rank with TopkA's allgather (variable counts: an allgatherv) and sums:

    avg = (1/P) * sum_i x_i[|x_i| >= th_i]

Real gradients are not Gaussian, so the estimate usually selects far fewer
than k entries. With ``adjust=True`` (the default, as in the Ok-Topk paper's
experiments, Section 5.4, and its reference code) the threshold is divided by
1.012 until at least 3k/4 entries are selected (at most 50 times). The number
of divisions is found in closed form from the exact (3k/4)-th largest |x_i|
and then checked by counting, so the result is the reference loop's without
its up-to-50 passes over x_i.

Volume: ``2k'(P-1)`` words per rank for the k' entries actually selected
(Table 1: ``2k(P-1)``). Biased; default feedback ``residual``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..kernels.selection import (
    count_at_least,
    gaussian_threshold,
    kth_largest_abs,
    select_by_threshold,
)
from .base import TensorState
from .state import ThresholdState
from .lowrank_common import check_bool
from .registry import register
from .sparse_common import DensitySparsifier, k_from_density, sparse_local
from ..mpi_collectives.coo_messages import check_index_range
from ..mpi_collectives.sparse_allreduce_baselines import allgatherv_sum

ADJUST_FACTOR = 1.012
ADJUST_MAX_STEPS = 50


def adjusted_threshold(x: np.ndarray, th: float, k: int) -> float:
    """Divide ``th`` by 1.012 until ``|x| >= th`` selects at least ``3k//4`` entries (<= 50 times).

    Equals the reference loop ``while count(th) < 3k//4 and loops < 50: th /= 1.012``
    (with ``>=`` selection) using one exact selection instead of up to 50 counts.
    """
    need = (3 * k) // 4
    if need == 0 or count_at_least(x, th) >= need:
        return th
    target = kth_largest_abs(x, need)   # count(t) >= need  <=>  t <= target (target > 0)
    if target <= 0.0:
        return th / ADJUST_FACTOR ** ADJUST_MAX_STEPS
    steps = math.ceil(math.log(th / target) / math.log(ADJUST_FACTOR))
    steps = min(max(steps - 1, 1), ADJUST_MAX_STEPS)
    t = th / ADJUST_FACTOR ** steps
    while steps < ADJUST_MAX_STEPS and count_at_least(x, t) < need:
        steps += 1
        t = th / ADJUST_FACTOR ** steps
    return t


@register
class Gaussiank(DensitySparsifier):
    """Gaussian-estimated threshold + allgather (Gaussiank)."""

    name = "gaussiank"
    state_class = ThresholdState

    def __init__(self, *, density: float = 0.01, adjust: bool = True,
                 feedback: str | None = None, warmup_steps: int = 0, seed: int = 0,
                 **feedback_params: Any) -> None:
        self.adjust = check_bool(self.name, "adjust", adjust)
        super().__init__(density=density, feedback=feedback, warmup_steps=warmup_steps,
                         seed=seed, **feedback_params)

    def params(self) -> dict[str, Any]:
        return {"density": self.density, "adjust": self.adjust, **self.feedback.params()}

    def threshold(self, x: np.ndarray) -> float:
        """This rank's threshold for flat ``x`` (Gaussian estimate, adjusted if enabled)."""
        th = gaussian_threshold(x, self.density)
        if self.adjust and x.size:
            th = adjusted_threshold(x, th, k_from_density(self.name, self.density, x.size))
        return th

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        flat = x.reshape(-1)
        check_index_range(flat.size, self.name)
        th = self.threshold(flat)
        idx, val = select_by_threshold(flat, th)
        state.threshold = float(th)
        state.selected = int(idx.size)
        avg = allgatherv_sum(comm, idx, val, flat.size, scale=1.0 / comm.size)
        local = sparse_local(self, name, flat.size, flat.dtype, idx, flat)
        return avg.reshape(x.shape), local.reshape(x.shape)


__all__ = ["Gaussiank", "adjusted_threshold"]
