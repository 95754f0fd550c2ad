"""``qsgd`` value codec: QSGD stochastic quantization per bucket (Alistarh et al.).

The paper combines Bloom-filter indices with QSGD values for NCF
(Section 6.3: 7-bit quantization, bucket size 512). For a bucket v of B values
with norm ||v||_2 and s levels, each value becomes sign(v_i) * l_i with

    l_i = floor(s |v_i| / ||v||) + Bernoulli(frac(s |v_i| / ||v||))  in [0, s]

so E[l_i ||v|| / s] = |v_i| (unbiased) and |decoded_i - v_i| <= ||v|| / s.
The norm is sent as float32, rounded *up* so that l_i never exceeds s; the
decoder returns sign * l * norm / s. Each value takes 1 + ceil(log2(s + 1))
bits (8 bits for the default s = 127). The random bits come from the
container's seed (sender only; decoding is deterministic). Payload::

    varint s | varint B | float32 norm * ceil(r / B) | packed (sign, level) fields
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..params import check_int
from .bitio import OK, bits_for, pack_fixed, unpack_fixed
from .registry import ValueCodec
from .wire import ByteReader, ByteWriter, ContainerError

MAX_LEVELS = 2**24


def _bucket_norms(v: np.ndarray, bucket: int) -> np.ndarray:
    """float32 L2 norm of each bucket, rounded up so that |v_i| <= norm holds in float32."""
    nb = -(-v.size // bucket)
    padded = np.zeros(nb * bucket)
    padded[:v.size] = v
    norms = np.sqrt(np.square(padded.reshape(nb, bucket)).sum(axis=1))
    n32 = norms.astype(np.float32)
    low = n32.astype(np.float64) < norms
    n32[low] = np.nextafter(n32[low], np.float32(np.inf))
    return n32


class QSGDValues(ValueCodec, name="qsgd", codec_id=3):
    """Stochastic quantization to ``levels`` levels per bucket of ``bucket`` values."""

    lossless = False

    def __init__(self, levels: int = 127, bucket: int = 512) -> None:
        self.levels = check_int("deepreduce", "qsgd_levels", levels, 1, MAX_LEVELS)
        self.bucket = check_int("deepreduce", "qsgd_bucket", bucket, 1, 2**31)

    def params(self) -> dict[str, Any]:
        return {"levels": self.levels, "bucket": self.bucket}

    def encode(self, values: np.ndarray, seed: int) -> tuple[bytes, None]:
        v = np.asarray(values, dtype=np.float64)
        if not np.isfinite(v).all():
            raise ValueError("deepreduce: the qsgd value codec cannot encode non-finite values")
        s, B = self.levels, self.bucket
        norms = _bucket_norms(v, B)
        scale = np.repeat(norms.astype(np.float64), B)[:v.size]
        with np.errstate(invalid="ignore", divide="ignore"):
            a = np.where(scale > 0, np.abs(v) / scale * s, 0.0)
        rng = np.random.Generator(np.random.Philox(int(seed) % 2**64))
        low = np.floor(a)
        level = np.minimum(low + (rng.random(v.size) < a - low), s).astype(np.uint64)
        lbits = bits_for(s + 1)
        sign = ((v < 0) & (level > 0)).astype(np.uint64)
        fields = (sign << np.uint64(lbits)) | level
        wr = ByteWriter().varint(s).varint(B).raw(norms.astype("<f4"))
        wr.raw(pack_fixed(fields, 1 + lbits))
        return wr.getvalue(), None

    @classmethod
    def decode(cls, payload: bytes, count: int, dtype: np.dtype) -> np.ndarray:
        rd = ByteReader(payload, "qsgd value section")
        s = rd.varint("levels", limit=MAX_LEVELS)
        B = rd.varint("bucket", limit=2**31)
        if s < 1 or B < 1:
            raise rd.fail(f"levels {s} and bucket {B} must be >= 1")
        nb = -(-count // B)
        with np.errstate(invalid="ignore"):
            norms = rd.array(nb, "<f4", "bucket norms").astype(np.float64)
        if not (np.isfinite(norms).all() and (norms >= 0).all()):
            raise rd.fail("bucket norms must be finite and non-negative")
        lbits = bits_for(s + 1)
        width = 1 + lbits
        body = np.frombuffer(rd.rest(), np.uint8)
        if body.size != (count * width + 7) // 8:
            raise ContainerError(f"qsgd value section: {body.size} bytes of levels, expected "
                                 f"{(count * width + 7) // 8}")
        fields, status = unpack_fixed(body, count, width)
        if status != OK:
            raise ContainerError("qsgd value section: truncated levels")
        level = (fields & np.uint64((1 << lbits) - 1)).astype(np.float64)
        if count and level.max() > s:
            raise ContainerError(f"qsgd value section: level above {s}")
        sign = np.where((fields >> np.uint64(lbits)) & np.uint64(1), -1.0, 1.0)
        scale = np.repeat(norms, B)[:count] / s
        return (sign * level * scale).astype(dtype)
