"""Fusion plan: which gradients share a buffer.

Flat-vector methods run on fused buckets, as Horovod's tensor fusion and DDP's
buckets do: tensors are taken in the order given (front-ends pass them in the
order their gradients become ready, i.e. reverse registration order) and
packed greedily until a bucket would exceed ``bucket_bytes`` (a tensor larger
than the cap gets a bucket of its own). Tensors of different working dtype
(float64 vs. everything else, computed in float32) never share a bucket.
Matrix methods (``layout == "matrix"``) run per tensor, each tensor in its own
shape, but are grouped the same way (``fused=False``): a group is launched when
all its gradients are in, and its tensors' collectives go out fused, one per
round (:class:`~.per_tensor.PerTensorReducer`), as PyTorch's ``powerSGD_hook``
does on a DDP bucket.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..mpi_collectives.consistency import TensorSpec

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024  # Horovod's HOROVOD_FUSION_THRESHOLD default


@dataclass
class Bucket:
    """Tensors reduced together; ``offsets[j]`` is tensor j's start in the fused vector."""

    index: int
    name: str
    specs: list[TensorSpec]
    work_dtype: np.dtype
    fused: bool
    offsets: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)


def _work_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def plan_buckets(specs: list[TensorSpec], layout: str,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Group ``specs`` into buckets (see module docstring)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    fused = layout != "matrix"
    current: list[TensorSpec] = []
    current_bytes = 0
    current_dtype: np.dtype | None = None

    def close() -> None:
        nonlocal current, current_bytes
        if current:
            offs = np.concatenate([[0], np.cumsum([s.numel for s in current])[:-1]]).astype(int)
            buckets.append(Bucket(len(buckets), f"bucket{len(buckets)}" if fused else f"group{len(buckets)}",
                                  current, current_dtype, fused=fused, offsets=[int(o) for o in offs]))
        current, current_bytes = [], 0

    for s in specs:
        wd = _work_dtype(s.dtype)
        nbytes = s.numel * wd.itemsize
        if current and (wd != current_dtype or current_bytes + nbytes > bucket_bytes):
            close()
        current_dtype = wd
        current.append(s)
        current_bytes += nbytes
    close()
    return buckets
