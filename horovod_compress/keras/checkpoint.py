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
The entry is a pickle, like ``torch.save`` of the PyTorch optimizer's
``state_dict``: load checkpoints you trust.
"""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from keras.src.saving.keras_saveable import KerasSaveable

from ..compressors.base import Method

STATE_KEY = "state"


def encode_state(method: Method) -> np.ndarray:
    """``method.state_dict()`` as a uint8 array (what the checkpoint stores)."""
    blob = pickle.dumps(method.state_dict(), protocol=pickle.HIGHEST_PROTOCOL)
    return np.frombuffer(blob, dtype=np.uint8).copy()


def decode_state(array: Any) -> dict[str, Any]:
    return pickle.loads(np.asarray(array, dtype=np.uint8).tobytes())


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
