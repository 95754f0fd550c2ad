"""Conversion between torch tensors and the NumPy arrays the core works on.

CPU tensors of dtype float32/float64/float16 are viewed without a copy
(``tensor.numpy()``); bfloat16 (no NumPy dtype) is widened to float32, and GPU
tensors are staged through host memory.
"""
from __future__ import annotations

import numpy as np
import torch

_NUMPY_OK = {torch.float32, torch.float64, torch.float16}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view (or, for bfloat16/GPU, a host copy) of ``tensor``'s data."""
    t = tensor.detach()
    if t.dtype not in _NUMPY_OK:
        t = t.float()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().numpy()


def numpy_dtype_name(tensor: torch.Tensor) -> str:
    """The NumPy dtype the core sees for ``tensor`` (bfloat16 -> float32)."""
    return str(np.dtype(str(tensor.dtype).replace("torch.", ""))) if tensor.dtype in _NUMPY_OK \
        else "float32"


def copy_into(tensor: torch.Tensor, array: np.ndarray) -> None:
    """Write ``array`` into ``tensor`` (casting to its dtype and device)."""
    src = torch.from_numpy(np.ascontiguousarray(array)).view(tensor.shape)
    tensor.copy_(src)
