"""``deflate`` value codec: DEFLATE (zlib, RFC 1950/1951) of the value bytes.

The paper's Deflate value compressor. Lossless; on float32 gradient values it
saves little (the mantissas are close to random), which is the paper's point
in favour of curve fitting. Before compressing, the bytes of the values are
*shuffled* (all first bytes, then all second bytes, ...; as Blosc and HDF5's
shuffle filter do), which groups the sign/exponent bytes and lets DEFLATE find
their redundancy. Uses the standard library's ``zlib``. Payload::

    u8 flags (bit 0: shuffled) | zlib stream

Decompression is bounded to the expected size (no decompression bomb) and
every zlib error becomes a ``ContainerError``.
"""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ..params import check_int
from .registry import ValueCodec
from .wire import ByteReader, ContainerError

SHUFFLED = 1


class DeflateValues(ValueCodec, name="deflate", codec_id=2):
    """zlib-compressed, byte-shuffled values."""

    def __init__(self, level: int = 6) -> None:
        self.level = check_int("deepreduce", "deflate_level", level, 1, 9)

    def params(self) -> dict[str, Any]:
        return {"level": self.level}

    def encode(self, values: np.ndarray, seed: int) -> tuple[bytes, None]:
        v = np.ascontiguousarray(values).astype(values.dtype.newbyteorder("<"))
        shuffled = v.view(np.uint8).reshape(v.size, v.dtype.itemsize).T.tobytes()
        return bytes((SHUFFLED,)) + zlib.compress(shuffled, self.level), None

    @classmethod
    def decode(cls, payload: bytes, count: int, dtype: np.dtype) -> np.ndarray:
        rd = ByteReader(payload, "deflate value section")
        flags = rd.u8("flags")
        if flags & ~SHUFFLED:
            raise rd.fail(f"unknown flags {flags:#x}")
        dt = np.dtype(dtype).newbyteorder("<")
        expected = count * dt.itemsize
        stream = zlib.decompressobj()
        try:
            data = stream.decompress(rd.rest(), expected + 1)
        except zlib.error as exc:
            raise ContainerError(f"deflate value section: {exc}") from None
        if len(data) != expected or not stream.eof or stream.unused_data or stream.unconsumed_tail:
            raise ContainerError(f"deflate value section: decompresses to {len(data)} bytes"
                                 f"{'' if stream.eof else ' (stream incomplete)'}, "
                                 f"expected {expected}")
        raw = np.frombuffer(data, np.uint8)
        if flags & SHUFFLED:
            raw = raw.reshape(dt.itemsize, count).T.copy()
        return raw.view(dt).reshape(count).astype(dt.newbyteorder("="))
