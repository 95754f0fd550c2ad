"""Compressor state inside Keras checkpoints.

Keras 3 saving (``model.save``, ``model.save_weights``, ``ModelCheckpoint``)
walks the model's saveable children; the optimizer's child
``hvdc_compression_state`` is a :class:`CompressionState` that writes the
method's ``state_dict()`` (config plus per-tensor residuals, thresholds,
subspaces and step counters) as one ``uint8`` entry under
``optimizer/hvdc_compression_state``. The optimizer's own entry keeps its
standard layout, so a checkpoint also loads into a plain Keras optimizer (the
extra entry is then ignored), and restoring into another method raises the
method's ``ValueError``.

The state is per rank (each rank's residual differs): to resume exactly,
let every rank write its own checkpoint (e.g. ``f"ckpt-rank{rank}.weights.h5"``);
a checkpoint written by rank 0 alone gives every rank rank 0's state.
The entry holds no pickle: a magic, the state's structure as JSON (dicts,
lists, tuples, numbers, strings; arrays as dtype, shape and a byte range) and
the arrays' bytes, so loading a checkpoint cannot run code. Entries written
by older versions (pickles) are refused unless ``HVDC_KERAS_ALLOW_PICKLE=1``
says you trust them.
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Any

import numpy as np
from keras.src.saving.keras_saveable import KerasSaveable

from ..compressors.base import Method

STATE_KEY = "state"


MAGIC = b"HVDCKS1\n"
PICKLE_ENV = "HVDC_KERAS_ALLOW_PICKLE"


def _to_json(obj: Any, chunks: list[bytes], offset: list[int]) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):
        arr = np.array(obj, copy=True, order="C")
        raw = arr.tobytes()
        out = {"__nd__": arr.dtype.str, "shape": list(arr.shape),
               "scalar": isinstance(obj, np.generic), "at": offset[0], "n": len(raw)}
        chunks.append(raw)
        offset[0] += len(raw)
        return out
    if isinstance(obj, dict):
        return {"__map__": [[_to_json(k, chunks, offset), _to_json(v, chunks, offset)]
                            for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_to_json(v, chunks, offset) for v in obj]}
    if isinstance(obj, list):
        return [_to_json(v, chunks, offset) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"compressor state holds a {type(obj).__name__}, which the Keras "
                    f"checkpoint cannot store")


def _from_json(obj: Any, data: bytes) -> Any:
    if isinstance(obj, list):
        return [_from_json(v, data) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__nd__" in obj:
        dtype = np.dtype(obj["__nd__"])
        if dtype.hasobject:
            raise ValueError("Keras checkpoint: object arrays are not allowed")
        start, n = int(obj["at"]), int(obj["n"])
        shape = tuple(int(s) for s in obj["shape"])
        if start < 0 or start + n > len(data) or n != dtype.itemsize * int(np.prod(shape)):
            raise ValueError("Keras checkpoint: compressor state is truncated or corrupt")
        arr = np.frombuffer(data[start:start + n], dtype=dtype).reshape(shape).copy()
        return arr[()] if obj.get("scalar") else arr
    if "__tuple__" in obj:
        return tuple(_from_json(v, data) for v in obj["__tuple__"])
    if "__map__" in obj:
        return {_from_json(k, data): _from_json(v, data) for k, v in obj["__map__"]}
    raise ValueError("Keras checkpoint: unexpected entry in the compressor state")


def encode_state(method: Method) -> np.ndarray:
    """``method.state_dict()`` as a uint8 array (what the checkpoint stores; no pickle).

    Layout: ``MAGIC``, 8-byte little-endian length of the JSON structure, the
    JSON, then the arrays' bytes, which the JSON addresses by offset.
    """
    chunks: list[bytes] = []
    tree = json.dumps(_to_json(method.state_dict(), chunks, [0])).encode()
    blob = MAGIC + len(tree).to_bytes(8, "little") + tree + b"".join(chunks)
    return np.frombuffer(blob, dtype=np.uint8).copy()


def decode_state(array: Any) -> dict[str, Any]:
    """Invert :func:`encode_state`; a ``ValueError`` for anything malformed."""
    blob = np.asarray(array, dtype=np.uint8).tobytes()
    if not blob.startswith(MAGIC):
        if blob[:1] == b"\x80" and os.environ.get(PICKLE_ENV) == "1":
            return pickle.loads(blob)   # an older checkpoint the user said they trust
        raise ValueError("Keras checkpoint: the compressor state is not in this version's "
                         f"format (an older pickled entry? set {PICKLE_ENV}=1 to load it if "
                         "you trust the file)")
    size = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8
    if start + size > len(blob):
        raise ValueError("Keras checkpoint: compressor state is truncated")
    tree = json.loads(blob[start:start + size].decode())
    return _from_json(tree, blob[start + size:])


class CompressionState(KerasSaveable):
    """The saveable child that carries a method's state through Keras saving."""

    def __init__(self, method: Method) -> None:
        self.method = method

    def _obj_type(self) -> str:
        # Keras only accepts its own kinds here; the kind only selects which attribute
        # names the saver skips while looking for children (this object has none).
        return "Loss"

    def save_own_variables(self, store: Any) -> None:
        store[STATE_KEY] = encode_state(self.method)

    def load_own_variables(self, store: Any) -> None:
        if STATE_KEY in store.keys():
            self.method.load_state_dict(decode_state(store[STATE_KEY]))
