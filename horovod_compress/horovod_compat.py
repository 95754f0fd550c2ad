"""Horovod ``Compressor`` protocol for our stateless methods, on torch or TF tensors.

Horovod's optimizers call ``compression.compress(tensor) -> (tensor, ctx)``,
allreduce the result densely, then ``compression.decompress(tensor, ctx)``.
Methods with ``horovod_compatible = True`` expose those two calls and route
here; this module dispatches on the tensor's framework.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def _is_torch(tensor: Any) -> bool:
    return type(tensor).__module__.startswith("torch")


def compress_cast(tensor: Any, kind: str) -> tuple[Any, Any]:
    """Cast a floating tensor to fp16/bf16; ctx is the original dtype."""
    if _is_torch(tensor):
        import torch
        target = torch.float16 if kind == "fp16" else torch.bfloat16
        if tensor.dtype.is_floating_point and tensor.dtype != target:
            return tensor.to(target), tensor.dtype
        return tensor, None
    import tensorflow as tf
    target = tf.float16 if kind == "fp16" else tf.bfloat16
    if tensor.dtype.is_floating and tensor.dtype != target:
        return tf.cast(tensor, target), tensor.dtype
    return tensor, None


def decompress_cast(tensor: Any, ctx: Any) -> Any:
    if ctx is None:
        return tensor
    if _is_torch(tensor):
        return tensor.to(ctx)
    import tensorflow as tf
    return tf.cast(tensor, ctx)


def compress_select(tensor: Any, idx: np.ndarray, scale: float) -> tuple[Any, Any]:
    """Gather the flat entries ``idx``; ctx remembers shape and indices for the scatter."""
    if _is_torch(tensor):
        import torch
        ti = torch.from_numpy(idx.astype(np.int64)).to(tensor.device)
        vals = tensor.reshape(-1).index_select(0, ti)
        return (vals * scale if scale != 1.0 else vals), (tensor.shape, ti)
    import tensorflow as tf
    ti = tf.constant(idx.astype(np.int64))
    vals = tf.gather(tf.reshape(tensor, [-1]), ti)
    return (vals * scale if scale != 1.0 else vals), (tensor.shape, ti)


def decompress_select(tensor: Any, ctx: Any) -> Any:
    shape, ti = ctx
    if _is_torch(tensor):
        import torch
        out = torch.zeros(int(np.prod(tuple(shape))), dtype=tensor.dtype, device=tensor.device)
        out.index_copy_(0, ti, tensor)
        return out.reshape(shape)
    import tensorflow as tf
    n = int(np.prod(shape.as_list() if hasattr(shape, "as_list") else shape))
    out = tf.scatter_nd(tf.reshape(ti, [-1, 1]), tensor, [n])
    return tf.reshape(out, shape)
