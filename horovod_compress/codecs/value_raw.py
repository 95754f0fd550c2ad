"""``raw`` value codec: the values as they are (little-endian, the tensor's dtype).

The "f32" half of the paper's (key, value) pairs: 4 bytes per value for
float32 (2 for float16, 8 for float64). Payload: ``r * itemsize`` bytes.
"""
from __future__ import annotations

import numpy as np

from .registry import ValueCodec
from .wire import ByteReader


class RawValues(ValueCodec, name="raw", codec_id=1):
    """Values verbatim."""

    def encode(self, values: np.ndarray, seed: int) -> tuple[bytes, None]:
        return np.ascontiguousarray(values).astype(values.dtype.newbyteorder("<")).tobytes(), None

    @classmethod
    def decode(cls, payload: bytes, count: int, dtype: np.dtype) -> np.ndarray:
        rd = ByteReader(payload, "raw value section")
        out = rd.array(count, dtype, "values")
        rd.expect_end()
        return out
