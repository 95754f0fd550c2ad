"""The counter-based generator of :mod:`horovod_compress.kernels.quantize`, as CUDA device functions.

Word ``i`` of stream ``key`` is ``splitmix64(key + (i + 1) * G)``,
``G = 0x9E3779B97F4A7C15`` (Steele, Lea, Flood 2014); a uniform double in
[0, 1) is its top 53 bits times 2^-53. All arithmetic is on uint64 modulo
2^64 and the uniform is exact, so a GPU thread computing element i draws the
very bits the CPU kernel draws for element i.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ._common import empty, grid_stride, guard_simulator_globals

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
TWO_POW_M53 = 1.0 / 9007199254740992.0


@cuda.jit(device=True)
def splitmix64(z):
    """SplitMix64 finaliser of a uint64 state."""
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


@cuda.jit(device=True)
def random_word(key, index):
    """Word ``index`` (uint64) of stream ``key`` (uint64)."""
    return splitmix64(key + (index + np.uint64(1)) * GOLDEN)


@cuda.jit(device=True)
def random_uniform(key, index):
    """Uniform double ``index`` of stream ``key``: (word >> 11) * 2^-53."""
    return np.float64(random_word(key, index) >> np.uint64(11)) * TWO_POW_M53


@cuda.jit(device=True)
def _word_at(i, key, start, out, _3, _4, _5):
    out[i] = random_word(key, start + np.uint64(i))


@cuda.jit(device=True)
def _uniform_at(i, key, start, out, _3, _4, _5):
    out[i] = random_uniform(key, start + np.uint64(i))


_WORDS = grid_stride(_word_at)
_UNIFORMS = grid_stride(_uniform_at)


def random_words(key: int, start: int, n: int, like=None):
    """Words ``start .. start+n-1`` of stream ``key`` as a uint64 device array."""
    out = empty(like, int(n), np.uint64)
    _WORDS(n, np.uint64(key), np.uint64(start), out)
    return out


def random_uniforms(key: int, start: int, n: int, like=None):
    """Uniforms ``start .. start+n-1`` of stream ``key`` as a float64 device array."""
    out = empty(like, int(n), np.float64)
    _UNIFORMS(n, np.uint64(key), np.uint64(start), out)
    return out


__all__ = ["GOLDEN", "random_uniform", "random_uniforms", "random_word", "random_words", "splitmix64"]


guard_simulator_globals(globals())
