"""bfloat16 <-> float32 conversion on bit patterns (NumPy has no bfloat16).

bfloat16 is the upper half of an IEEE float32. Rounding to nearest-even:
bits16 = (bits32 + 0x7FFF + ((bits32 >> 16) & 1)) >> 16, with NaN kept NaN.
"""
from __future__ import annotations

import numpy as np


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest-even); returns uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen uint16 bfloat16 bit patterns to float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
