"""Conversion between TensorFlow tensors/variables and the NumPy arrays the core works on.

The core sees float16, float32 and float64 gradients as they are; bfloat16
(whose NumPy type is an ``ml_dtypes`` extension the core does not compute in)
crosses the bridge widened to float32, as the PyTorch front-end does, and is
narrowed back afterwards. ``tf.IndexedSlices`` (embedding gradients) are
densified first: every method works on dense vectors, exactly like Horovod's
``sparse_as_dense=True``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

_FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def check_float_dtype(dtype: tf.DType, name: str) -> tf.DType:
    """``dtype`` as a ``tf.DType``; ``ValueError`` unless it is a float type."""
    dtype = tf.as_dtype(dtype)
    if dtype not in _FLOATS:
        raise ValueError(f"gradient of {name!r} has dtype {dtype.name}; only float16, bfloat16, "
                         "float32 and float64 gradients can be allreduced")
    return dtype


def wire_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype a gradient has while it crosses into NumPy (bfloat16 -> float32)."""
    return tf.float32 if dtype == tf.bfloat16 else dtype


def numpy_dtype_name(dtype: tf.DType) -> str:
    """The NumPy dtype name the core sees for a gradient of ``dtype``."""
    return wire_dtype(tf.as_dtype(dtype)).name


def densify(grad: Any) -> Any:
    """``tf.IndexedSlices`` -> dense tensor (``sparse_as_dense``); others unchanged."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def to_wire(grad: Any) -> tf.Tensor:
    """A dense tensor of :func:`wire_dtype` (a graph op or an eager value)."""
    grad = densify(grad)
    return tf.cast(grad, tf.float32) if grad.dtype == tf.bfloat16 else grad


def from_wire(value: Any, dtype: tf.DType) -> tf.Tensor:
    """A NumPy array or wire tensor back to a tensor of the variable's ``dtype``."""
    t = tf.convert_to_tensor(value)
    return tf.cast(t, dtype) if t.dtype != dtype else t


def variable_name(variable: Any, index: int) -> str:
    """A name every rank gives this variable: a Keras 3 ``path``, a ``tf.Variable``'s
    name without its ``:0`` suffix, or ``tensor<index>`` for a watched tensor."""
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    if isinstance(variable, tf.Variable):
        name = variable.name
        return name[:-2] if name.endswith(":0") else name
    return f"tensor{index}"


def unique_names(variables: list[Any]) -> list[str]:
    """:func:`variable_name` of each, with ``#2``, ``#3`` ... appended to repeats."""
    seen: dict[str, int] = {}
    out = []
    for i, v in enumerate(variables):
        base = variable_name(v, i)
        seen[base] = seen.get(base, 0) + 1
        out.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return out


def as_numpy(value: Any) -> np.ndarray:
    """An eager tensor or variable as a NumPy array (bfloat16 widened to float32)."""
    t = tf.convert_to_tensor(value)
    if t.dtype == tf.bfloat16:
        t = tf.cast(t, tf.float32)
    return t.numpy()
