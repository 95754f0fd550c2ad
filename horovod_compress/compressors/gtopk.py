"""``gtopk`` -- gTopk: a reduction tree that re-selects the top k at every level.

Each rank selects its exact local top-k (k = density * n) of its input x_i.
Along a binomial tree of ceil(log2 P) levels the receiving rank adds its own
and the sender's k entries and keeps the k largest; rank 0 broadcasts the
final k (Shi et al., ICDCS'19; Ok-Topk paper, Table 1). For P = 4:

    u = Topk( Topk(Topk(x_0) + Topk(x_1)) + Topk(Topk(x_2) + Topk(x_3)) ),  avg = u / P

Volume: ``4k log P`` words in Table 1's model (tree reduce + tree broadcast);
here rank 0 receives 2k words per level and sends 2k once (broadcast).
Biased; with the default ``residual`` feedback a rank's residual forgets only
its local entries that are in the final k (the reference code's
``included_indexes``), like Ok-Topk. The collective is
:func:`horovod_compress.mpi_collectives.sparse_allreduce_baselines.gtopk_allreduce`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import TensorState
from .local_topk import LocalTopkSparsifier
from .registry import register
from ..mpi_collectives.sparse_allreduce_baselines import gtopk_allreduce


@register
class GTopk(LocalTopkSparsifier):
    """Global top-k by a reduction tree with re-selection (gTopk)."""

    name = "gtopk"

    def _sum_selections(self, comm: Any, flat: np.ndarray, idx: np.ndarray, k: int,
                        state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        g_idx, g_val = gtopk_allreduce(comm, idx, flat[idx], k)
        avg = np.zeros_like(flat)
        avg[g_idx] = g_val / flat.dtype.type(comm.size)
        return avg, np.intersect1d(idx, g_idx, assume_unique=True)


__all__ = ["GTopk"]
