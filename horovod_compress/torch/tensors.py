"""Conversion between torch tensors and the NumPy arrays the core works on.

The dtype rule is the runtime's (:func:`~horovod_compress.runtime.scaling.working_dtype`):
CPU tensors of dtype float32/float64/float16 are viewed without a copy
(``tensor.numpy()``); bfloat16 (no NumPy dtype) and every other dtype are
widened to float32, and GPU tensors become CuPy arrays without a copy (DLPack)
when CuPy is installed -- then the GPU-native methods compress on the device
-- and are staged through host memory otherwise. :func:`tensor_slot` wraps a
tensor for the runtime's comm-hook exchange (its array and the write-back).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..runtime.hook import ArraySlot
from ..runtime.scaling import NATIVE_DTYPES, working_dtype

_NUMPY_OK = {getattr(torch, name) for name in NATIVE_DTYPES}


def cupy_available() -> bool:
    """Whether CuPy imports (checked once); without it CUDA tensors are staged through the host."""
    global _CUPY_OK
    if _CUPY_OK is None:
        try:
            import cupy  # noqa: F401, PLC0415 - optional dependency
            _CUPY_OK = True
        except ImportError:
            _CUPY_OK = False
    return _CUPY_OK


_CUPY_OK: bool | None = None


def to_array(tensor: torch.Tensor) -> Any:
    """The array the core works on: a CuPy view (DLPack, no copy) of a CUDA tensor when CuPy is
    installed, else a NumPy view or host copy (:func:`to_numpy`)."""
    if tensor.device.type == "cuda" and cupy_available():
        import cupy  # noqa: PLC0415
        t = tensor.detach()
        if t.dtype not in _NUMPY_OK:
            t = t.float()
        return cupy.from_dlpack(t.contiguous())
    return to_numpy(tensor)


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
    return working_dtype(str(tensor.dtype))


def copy_into(tensor: torch.Tensor, array: np.ndarray) -> None:
    """Write ``array`` (NumPy, or CuPy through DLPack) into ``tensor`` (casting to its dtype and device)."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy  # noqa: PLC0415
        tensor.copy_(torch.from_dlpack(cupy.ascontiguousarray(array)).view(tensor.shape))
        return
    src = torch.from_numpy(np.ascontiguousarray(array)).view(tensor.shape)
    tensor.copy_(src)


def is_view_of(array: Any, tensor: torch.Tensor) -> bool:
    """Whether ``array`` is a NumPy array over exactly ``tensor``'s memory (no copy back needed)."""
    return (isinstance(array, np.ndarray) and tensor.device.type == "cpu"
            and tensor.dtype in _NUMPY_OK and array.dtype == np.dtype(numpy_dtype_name(tensor))
            and tensor.is_contiguous() and array.size == tensor.numel()
            and array.__array_interface__["data"][0] == tensor.data_ptr())


def tensor_slot(tensor: torch.Tensor) -> ArraySlot:
    """``tensor`` for the runtime: :func:`to_array` of it, and a write-back that skips its own memory."""
    def write(avg: Any) -> None:
        if not is_view_of(avg, tensor):
            copy_into(tensor, avg)

    return ArraySlot(to_array(tensor), write)
