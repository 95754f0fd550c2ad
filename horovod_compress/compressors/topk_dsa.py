"""``topk_dsa`` -- TopkDSA: SparCML's dynamic sparse allreduce of the local top-k.

Each rank selects its exact local top-k (k = density * n) of its input x_i;
a sparse reduce-scatter over P equal regions of the index space sums them,
and an allgatherv distributes the reduced regions, each sparse or dense --
whichever is smaller (Renggli et al., SC'19; Ok-Topk paper, Table 1):

    avg = (1/P) * sum_i Topk(x_i)          (the same result as TopkA)

Under :meth:`~.base.Method.reduce_scatter` (P equal blocks, SparCML's
regions) only the sparse reduce-scatter runs: rank j keeps region j, no
allgatherv (about ``2k(P-1)/P`` words sent per rank: each rank's selection
outside its own region).

Volume per rank: ``4k(P-1)/P`` words in the best case (every rank selects
the same indices), up to ``(2k + n)(P-1)/P`` when fill-in makes the reduced
regions dense. The collective is
:func:`horovod_compress.mpi_collectives.sparse_allreduce_baselines.dsa_allreduce`.
Biased, so the default feedback is ``residual``: what a rank did not select
stays in its residual.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import TensorState
from .state import FillInState
from .local_topk import LocalTopkSparsifier
from .registry import register
from ..mpi_collectives.sparse_allreduce_baselines import dsa_allreduce


@register
class TopkDSA(LocalTopkSparsifier):
    """Local top-k + SparCML dynamic sparse allreduce (TopkDSA)."""

    name = "topk_dsa"
    state_class = FillInState
    scatters = True     # reduce_scatter: the sparse reduce-scatter alone

    def _sum_selections(self, comm: Any, flat: np.ndarray, idx: np.ndarray, k: int,
                        state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        total, info = dsa_allreduce(comm, idx, flat[idx], flat.size,
                                    scatter_only=self._scatter_block(flat, comm) is not None)
        state.fill_in = int(info["nnz"])
        return total / flat.dtype.type(comm.size), idx


__all__ = ["TopkDSA"]
