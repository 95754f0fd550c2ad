"""The local step both sparse-allreduce baselines of Ok-Topk start from: each rank's exact top-k.

TopkDSA and gTopk (Ok-Topk paper, Table 1) differ only in the collective
that sums the ranks' selections; both first take the flat input x_i, check
that its indices fit the COO messages' index type, and select its exact
local top-k, ``k = max(1, round(density * n))``, sorted ascending as the
collectives expect. :class:`LocalTopkSparsifier` is that shared method; each
baseline supplies only its collective.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import TensorState
from .sparse_common import DensitySparsifier, k_from_density, sparse_local, topk_indices
from ..mpi_collectives.coo_messages import check_index_range


def sorted_local_topk(method: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(flat view of ``x``, indices of its k largest |x| ascending, k) for ``method.density``."""
    flat = x.reshape(-1)
    check_index_range(flat.size, method.name)
    k = k_from_density(method.name, method.density, flat.size)
    return flat, np.sort(topk_indices(flat, k)), k


class LocalTopkSparsifier(DensitySparsifier):
    """A baseline that sums every rank's exact local top-k with a sparse collective.

    :meth:`_reduce` selects (:func:`sorted_local_topk`), runs the subclass's
    :meth:`_sum_selections` and keeps in the residual what the rank did not send.
    """

    def _sum_selections(self, comm: Any, flat: np.ndarray, idx: np.ndarray, k: int,
                        state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        """(the average over ranks as a dense flat array, the local indices it includes)."""
        raise NotImplementedError

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        flat, idx, k = sorted_local_topk(self, x)
        avg, included = self._sum_selections(comm, flat, idx, k, state)
        local = sparse_local(self, name, flat.size, flat.dtype, included, flat)
        return avg.reshape(x.shape), local.reshape(x.shape)


__all__ = ["LocalTopkSparsifier", "sorted_local_topk"]
