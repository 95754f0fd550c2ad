"""The local step both sparse-allreduce baselines of Ok-Topk start from: each rank's exact top-k.

TopkDSA and gTopk (Ok-Topk paper, Table 1) differ only in the collective
that sums the ranks' selections; both first take the flat input x_i, check
that its indices fit the COO messages' index type, and select its exact
local top-k, ``k = max(1, round(density * n))``, sorted ascending as the
collectives expect.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .sparse_common import k_from_density, topk_indices


def sorted_local_topk(method: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(flat view of ``x``, indices of its k largest |x| ascending, k) for ``method.density``."""
    # imported here: importing the package must not start MPI
    from ..mpi_collectives.coo_messages import check_index_range

    flat = x.reshape(-1)
    check_index_range(flat.size, method.name)
    k = k_from_density(method.name, method.density, flat.size)
    return flat, np.sort(topk_indices(flat, k)), k


__all__ = ["sorted_local_topk"]
