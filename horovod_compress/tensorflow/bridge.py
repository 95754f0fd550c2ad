"""The one place TensorFlow hands tensors to NumPy code: eager or inside ``tf.function``.

Eagerly, :func:`numpy_call` takes ``np.asarray(tensor)`` (a view of the CPU
buffer: no copy, unlike ``tensor.numpy()``), runs the NumPy function and
hands each output to TensorFlow as a fresh copy through DLPack (one copy,
about half the cost of ``tf.convert_to_tensor``). Inside a ``tf.function`` it
inserts one ``tf.numpy_function`` op (``stateful=True``): TensorFlow runs the
Python function when the graph executes, on the step's values. Stateful ops in
a ``tf.function`` run in program order (automatic control dependencies), so
every rank issues its collectives in the same order; the op is never pruned
or deduplicated. XLA cannot compile a Python call: under ``jit_compile=True``
a clear ``ValueError`` says so instead of TensorFlow's generic one.

``numpy_function`` converts every input and output separately (tens of
microseconds each), so in graph mode small tensors are *fused per dtype*
first: one ``tf.concat`` of the flattened small inputs of each dtype crosses
the bridge, the NumPy side splits it into views, and the outputs come back as
one flat array per dtype that ``tf.split`` cuts up again. Tensors above
``FUSE_MAX_ELEMENTS`` cross on their own (fusing them would only add two
copies).
What the bridge costs is measured by ``hvdc bench tf_bridge``
(docs/tensorflow.md).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf


def _in_xla_context() -> bool:
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - private module moved
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is ``align``-byte aligned.

    TensorFlow aborts the process on an unaligned buffer (Eigen's 64-byte
    rule), and NumPy only guarantees 16 bytes.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _to_tensor(array: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    """A tensor owning a fresh copy of ``array`` (one NumPy copy, handed over by DLPack).

    The copy (into a 64-byte aligned buffer, as TensorFlow requires) keeps the
    tensor independent of arrays the method may reuse; DLPack then shares it
    with TensorFlow instead of ``convert_to_tensor``'s slower second copy.
    Falls back to ``convert_to_tensor`` where DLPack cannot take the array.
    """
    np_dtype = np.dtype(dtype.as_numpy_dtype)
    fresh = _aligned_empty(np.shape(array), np_dtype)
    fresh[...] = array
    try:
        t = tf.experimental.dlpack.from_dlpack(fresh.__dlpack__())
        if t.dtype == dtype and t.shape == fresh.shape:
            return t
    except Exception:  # noqa: BLE001 - any refusal: take the portable path
        pass
    return tf.convert_to_tensor(fresh, dtype=dtype)


FUSE_MAX_ELEMENTS = 1 << 16  # tensors up to 256 KiB (float32) share a fused transfer


def _groups(dtypes: Sequence[tf.DType], sizes: Sequence[int]) -> list[tuple[tf.DType, list[int]]]:
    """Transfers: the small tensors of each dtype together, every large tensor on its own.

    Fusing saves the per-tensor conversion of many small tensors; a large
    tensor gains nothing from it and would pay two extra copies (concat, split).
    """
    small: dict[tf.DType, list[int]] = {}
    groups: list[tuple[tf.DType, list[int]]] = []
    for i, (d, n) in enumerate(zip(dtypes, sizes)):
        if n <= FUSE_MAX_ELEMENTS:
            if d not in small:
                small[d] = []
                groups.append((d, small[d]))
            small[d].append(i)
        else:
            groups.append((d, [i]))
    return groups


def numpy_call(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[Any],
               out_dtypes: Sequence[tf.DType], out_shapes: Sequence[Any],
               name: str = "hvdc_numpy", in_shapes: Sequence[Any] | None = None) -> list[tf.Tensor]:
    """Run ``fn(*numpy_inputs) -> numpy_outputs`` eagerly or as one graph op.

    ``fn`` must return one C-contiguous array per entry of ``out_dtypes``, of
    exactly that dtype (the caller casts); ``out_shapes`` (fully defined)
    restore the static shapes. ``in_shapes`` give the inputs' shapes where
    their static shapes are not fully defined (e.g. densified IndexedSlices).
    """
    out_dtypes = [tf.as_dtype(d) for d in out_dtypes]
    if not out_dtypes:
        raise ValueError("numpy_call needs at least one output")
    if tf.executing_eagerly():
        outs = fn(*[np.asarray(t) for t in inputs])  # views of the CPU buffers, no copy
        return [_to_tensor(o, d) for o, d in zip(outs, out_dtypes)]
    if _in_xla_context():
        raise ValueError(
            "horovod_compress exchanges gradients through tf.numpy_function, which XLA cannot "
            "compile: use jit_compile=False (model.compile(..., jit_compile=False) or "
            "@tf.function(jit_compile=False))")
    inputs = [tf.convert_to_tensor(t) for t in inputs]
    shapes_in = [tf.TensorShape(s) for s in (in_shapes if in_shapes is not None
                                             else [t.shape for t in inputs])]
    shapes_out = [tf.TensorShape(s) for s in out_shapes]
    if not all(s.is_fully_defined() for s in shapes_in + shapes_out):
        raise ValueError("numpy_call needs fully defined shapes in graph mode")
    in_sizes = [int(s.num_elements()) for s in shapes_in]
    out_sizes = [int(s.num_elements()) for s in shapes_out]
    in_groups = _groups([t.dtype for t in inputs], in_sizes)
    out_groups = _groups(out_dtypes, out_sizes)
    np_in_shapes = [tuple(s.as_list()) for s in shapes_in]

    def fused_fn(*flats: np.ndarray) -> list[np.ndarray]:
        arrays: list[np.ndarray | None] = [None] * len(inputs)
        for flat, (_, idx) in zip(flats, in_groups):
            start = 0
            for i in idx:
                arrays[i] = flat[start:start + in_sizes[i]].reshape(np_in_shapes[i])
                start += in_sizes[i]
        outs = fn(*arrays)
        fused = []
        for dtype, idx in out_groups:
            if len(idx) == 1:
                fused.append(np.ascontiguousarray(outs[idx[0]], dtype=dtype.as_numpy_dtype)
                             .reshape(-1))
                continue
            buf = np.empty(sum(out_sizes[i] for i in idx), dtype=dtype.as_numpy_dtype)
            start = 0
            for i in idx:
                buf[start:start + out_sizes[i]] = np.asarray(outs[i]).reshape(-1)
                start += out_sizes[i]
            fused.append(buf)
        return fused

    flat_in = [tf.concat([tf.reshape(inputs[i], [-1]) for i in idx], 0) if len(idx) > 1
               else tf.reshape(inputs[idx[0]], [-1]) for _, idx in in_groups]
    flat_out = tf.numpy_function(fused_fn, flat_in, [d for d, _ in out_groups],
                                 stateful=True, name=name)
    if not isinstance(flat_out, (list, tuple)):
        flat_out = [flat_out]
    outs: list[tf.Tensor | None] = [None] * len(out_dtypes)
    for flat, (_, idx) in zip(flat_out, out_groups):
        flat.set_shape([sum(out_sizes[i] for i in idx)])
        pieces = tf.split(flat, [out_sizes[i] for i in idx]) if len(idx) > 1 else [flat]
        for i, piece in zip(idx, pieces):
            outs[i] = tf.reshape(piece, shapes_out[i])
    return outs  # type: ignore[return-value]
