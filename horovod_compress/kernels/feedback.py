"""Fused element-wise passes of EF21 / EF21M error feedback (Numba, CPU).

EF21M (Fatkhullin, Tyurin, Richtarik, "Momentum Provably Improves Error
Feedback!", 2023; as written in the ARC-Top-K paper's eqs. (11a)-(11c)) does,
per step and element, ``h <- (1 - eta) h + eta x`` (11a), compresses
``d = h - g``, then ``g <- g + c`` (11b) and ``G <- G + avg c`` (11c) and hands
``G`` to the optimizer. Written with NumPy these are seven passes over the
gradient and three fresh arrays; here they are two passes:

* :func:`momentum_diff` -- (11a) in place and ``d = h - g`` into a buffer the
  caller reuses across steps;
* :func:`track_and_copy` -- (11b) and (11c) in place and the copy of ``G``
  the optimizer receives.

Each element sees the same float operations, in the same order, as the NumPy
expressions (``h * (1 - eta)`` rounded, ``eta * x`` rounded, their sum
rounded; no fused multiply-add: no ``fastmath``), so the results are
bit-identical to them.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _momentum_diff(h, x, g, keep, eta, d, with_momentum):
    if with_momentum:                      # two loops: no branch inside, both vectorise
        for i in range(h.size):
            v = h[i] * keep + eta * x[i]
            h[i] = v
            d[i] = v - g[i]
    else:
        for i in range(h.size):
            d[i] = h[i] - g[i]


@njit(cache=True)
def _track_and_copy(g, c, big_g, avg_c, out):
    for i in range(g.size):
        g[i] += c[i]
        v = big_g[i] + avg_c[i]
        big_g[i] = v
        out[i] = v


def fusable(*arrays: np.ndarray) -> bool:
    """Whether the kernels take these arrays: NumPy, one float dtype, C-contiguous, equal sizes."""
    first = arrays[0]
    return all(type(a) is np.ndarray and a.dtype == first.dtype and a.flags.c_contiguous
               and a.size == first.size for a in arrays) and first.dtype in (np.float32, np.float64)


def momentum_diff(h: np.ndarray, x: np.ndarray, g: np.ndarray, eta: float | None,
                  out: np.ndarray) -> np.ndarray:
    """``h <- (1 - eta) h + eta x`` in place (skipped when ``eta`` is None: EF21), then ``out = h - g``."""
    t = h.dtype.type
    with_momentum = eta is not None
    e = 1.0 if eta is None else eta
    _momentum_diff(h.reshape(-1), x.reshape(-1), g.reshape(-1), t(1.0 - e), t(e),
                   out.reshape(-1), with_momentum)
    return out


def track_and_copy(g: np.ndarray, c: np.ndarray, big_g: np.ndarray, avg_c: np.ndarray) -> np.ndarray:
    """``g += c`` and ``G += avg_c`` in place; returns a fresh copy of the new ``G``."""
    out = np.empty_like(big_g)
    _track_and_copy(g.reshape(-1), c.reshape(-1), big_g.reshape(-1), avg_c.reshape(-1),
                    out.reshape(-1))
    return out


__all__ = ["fusable", "momentum_diff", "track_and_copy"]
