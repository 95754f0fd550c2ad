"""PyTorch's random generator for ``powersgd(q_init="torch")``.

``torch.distributed``'s ``powerSGD_hook`` seeds ``torch.manual_seed`` with a
draw from ``numpy.random.RandomState(random_seed)`` and fills each fresh ``Q``
with ``torch.randn(1, cols, r)`` inside ``torch.random.fork_rng``. The core
(:mod:`horovod_compress.compressors.powersgd`) keeps the NumPy side and never
imports torch; importing this front-end registers the torch side.
"""
from __future__ import annotations

import numpy as np
import torch

from ..compressors.powersgd import register_q_source


def torch_randn_q(seed: int, cols: int, r: int, dtype: np.dtype) -> np.ndarray:
    """``torch.randn(1, cols, r)`` after ``torch.manual_seed(seed)``, without touching torch's global stream."""
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        q = torch.randn(1, cols, r, device="cpu", dtype=tdtype)
    return q.numpy()[0].astype(dtype, copy=True)


register_q_source("torch", torch_randn_q)
