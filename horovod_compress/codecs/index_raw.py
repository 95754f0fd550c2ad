"""``raw`` index codec: the support as plain integers (the baseline of the paper's tables).

Each index is a little-endian uint32 (uint64 when n > 2**32): 4 bytes per
entry, the "i32" of the paper's (key, value) pairs. It is the only codec that
can send the indices in any order, so when the value codec sorts the values
(curve fits) the index order itself carries the permutation at no extra cost.
Payload: ``u8 width (4 or 8) | width * r bytes``.
"""
from __future__ import annotations

import numpy as np

from .registry import IndexCodec, IndexEncoding
from .wire import ByteReader, ByteWriter, ContainerError


def _width(n: int) -> int:
    return 4 if n <= 2**32 else 8


class RawIndex(IndexCodec, name="raw", codec_id=1):
    """Indices as uint32 (or uint64 for n > 2**32)."""

    carries_order = True

    def encode(self, indices: np.ndarray, n: int, seed: int) -> IndexEncoding:
        return IndexEncoding(self.encode_in_order(indices, n), indices, indices)

    def encode_in_order(self, slots: np.ndarray, n: int) -> bytes:
        w = _width(n)
        dt = "<u4" if w == 4 else "<u8"
        return ByteWriter().u8(w).raw(np.asarray(slots).astype(dt)).getvalue()

    @classmethod
    def decode(cls, payload: bytes, n: int, n_slots: int, seed: int) -> np.ndarray:
        rd = ByteReader(payload, "raw index section")
        w = rd.u8("width")
        if w != _width(n):
            raise rd.fail(f"index width {w} does not match n = {n}")
        idx = rd.array(n_slots, "<u4" if w == 4 else "<u8", "indices").astype(np.int64)
        rd.expect_end()
        if idx.size:
            if idx.max() >= n or idx.min() < 0:
                raise ContainerError(f"raw index section: index {int(idx.max())} outside [0, {n})")
            if np.unique(idx).size != idx.size:
                raise ContainerError("raw index section: repeated indices")
        return idx
