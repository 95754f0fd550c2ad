"""Bitmap index codecs: the plain bitmap, and the bitmap run-length encoded.

The paper's second representation of the support S (Section 3): a bit string
B of n bits with B[i] = 1 iff i in S.

* ``bitmap`` sends B itself, ceil(n / 8) bytes whatever r is: the cheapest
  index code once the density exceeds about 1/32 (e.g. inherently sparse
  gradients such as NCF's, about 60 % non-zero).
* ``rle`` (the paper's RLE, Appendix 11.0.1) sends the run lengths of B as
  LEB128 varints (:mod:`horovod_compress.kernels.rle`): payload
  ``varint number_of_runs | varints``. At density 1 % with scattered indices
  that is about 2 bytes per index; long runs of consecutive indices cost
  almost nothing.
"""
from __future__ import annotations

import numpy as np

from ..kernels import rle
from .registry import IndexCodec, IndexEncoding
from .wire import ByteReader, ContainerError


class BitmapIndex(IndexCodec, name="bitmap", codec_id=2):
    """The support as an n-bit bitmap (bit i of byte i // 8, least significant first)."""

    def encode(self, indices: np.ndarray, n: int, seed: int) -> IndexEncoding:
        mask = np.zeros(n, dtype=np.bool_)
        mask[indices] = True
        return IndexEncoding(np.packbits(mask, bitorder="little").tobytes(), indices, indices)

    @classmethod
    def decode(cls, payload: bytes, n: int, n_slots: int, seed: int) -> np.ndarray:
        if len(payload) != (n + 7) // 8:
            raise ContainerError(f"bitmap index section: {len(payload)} bytes, expected "
                                 f"{(n + 7) // 8} for n = {n}")
        bits = np.unpackbits(np.frombuffer(payload, np.uint8), bitorder="little")
        if bits[n:].any():
            raise ContainerError("bitmap index section: bits set past the end of the tensor")
        idx = np.flatnonzero(bits[:n]).astype(np.int64)
        if idx.size != n_slots:
            raise ContainerError(f"bitmap index section: {idx.size} bits set, header says {n_slots}")
        return idx


class RunLengthIndex(IndexCodec, name="rle", codec_id=3):
    """The bitmap's run lengths as LEB128 varints."""

    def encode(self, indices: np.ndarray, n: int, seed: int) -> IndexEncoding:
        runs = rle.runs_from_sorted_indices(np.ascontiguousarray(indices, dtype=np.int64), n)
        body = rle.varint_encode(runs)
        head = rle.varint_encode(np.array([runs.size], dtype=np.int64))
        return IndexEncoding(head.tobytes() + body.tobytes(), indices, indices)

    @classmethod
    def decode(cls, payload: bytes, n: int, n_slots: int, seed: int) -> np.ndarray:
        rd = ByteReader(payload, "rle index section")
        count = rd.varint("number of runs", limit=2 * n_slots + 1)
        body = np.frombuffer(rd.rest(), np.uint8)
        runs, used, status = rle.varint_decode(body, count)
        if status != rle.OK:
            raise ContainerError("rle index section: "
                                 + ("truncated run lengths" if status == rle.TRUNCATED
                                    else "run length too large"))
        if used != body.size:
            raise ContainerError(f"rle index section: {body.size - used} unexpected trailing bytes")
        idx, status = rle.indices_from_runs(runs, n)
        if status != rle.OK:
            raise ContainerError(f"rle index section: the runs do not describe a bitmap of {n} bits")
        if idx.size != n_slots:
            raise ContainerError(f"rle index section: {idx.size} indices, header says {n_slots}")
        return idx
