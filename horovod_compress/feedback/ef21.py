"""EF21 (Richtarik, Sokolov, Fatkhullin 2021) and EF21M (Fatkhullin, Tyurin, Richtarik 2023).

The feedback family, for every biased method (``feedback=`` on any of them):

* ``none``      -- compress the gradient itself: the optimizer gets C(avg g);
* ``residual``  -- EF14: compress g_i + e_i, keep e_i = what was not sent;
* ``ef21``      -- compress the *change* of a per-rank gradient tracker;
* ``ef21m``     -- EF21 on a momentum tracker h_i (parameter ``eta``).

EF21M, per rank i and tensor, as in the ARC-Top-K paper's eqs. (11a)-(11c)::

    h_i <- (1 - eta) h_i + eta x_i            (11a)  momentum tracker of the gradient x_i
    c_i  = C_local(h_i - g_i)                         one compressed allreduce:
    g_i <- g_i + c_i                          (11b)  what the others know of h_i
    G   <- G + avg_i c_i                      (11c)  G = avg_i g_i, the update direction

EF21 is EF21M with eta = 1 (h_i = x_i, no tracker stored). ``c_i`` and
``avg_i c_i`` are the ``(local, avg)`` pair that ``method._reduce(h_i - g_i)``
returns, so any method works; the only message is that method's compressed
allreduce. Every rank holds the same G (it adds the same allreduced vectors),
and the optimizer receives G.

State (:class:`~horovod_compress.feedback.state.EF21State` in the method's
per-tensor state, checkpointed with it as ``fb_h``, ``fb_g``, ``fb_G``):
``h`` (h_i, EF21M only), ``g`` (g_i), ``G`` (G). On the first compressed step of a
tensor without state they start at zero (EF21's g_i^0 = 0 choice), so early
directions are scaled by the momentum's warm-up like a zero-initialised EMA.

Dense (warm-up) steps, :meth:`EF21M.on_dense_step`: the optimizer receives the
exact average avg_i x_i, and the trackers are re-initialised to the state
EF21M prescribes at its start with an exact gradient (h_i^0 = g_i^0 = x_i,
Fatkhullin et al., Alg. 1 with V_0 = ||g - h||^2 = 0): h_i = g_i = x_i and
G = avg_i x_i. The invariant G = avg_i g_i thus holds after every step, and
the first compressed step after warm-up continues from the last dense
direction instead of from zero.

Trackers live where the gradient does (NumPy or CuPy arrays).

Passes over the gradient: a method with ``_reduce_ef21(x, h, g, G, eta, name,
comm, state)`` (ARC-Top-K) runs (11a)-(11c) inside its own passes and returns
the optimizer's copy of G, or ``None`` for inputs it does not fuse; it must
leave every tracker as it was when the call's NaN/Inf agreement fails. Other
methods get (11a) with ``h - g`` in one pass and (11b), (11c) with G's copy in
another (:mod:`horovod_compress.kernels.feedback`), bit for bit the NumPy
expressions.

Use a plain optimizer step on G (SGD without momentum, as in eq. (11c), or
Adam): EF21M already carries the momentum (eta = 1 - beta of heavy-ball SGD).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..params import check_float
from ..kernels.arrays import get_array_module
from ..kernels.feedback import fusable, momentum_diff, track_and_copy
from .base import Feedback, register_feedback
from .state import EF21State


def _fits(arr: Any, like: Any) -> bool:
    """Whether tracker ``arr`` can be reused for ``like``: same array type, shape and dtype."""
    return (arr is not None and type(arr) is type(like) and arr.shape == like.shape
            and arr.dtype == like.dtype)


@register_feedback
class EF21M(Feedback):
    """EF21M: error feedback on a momentum tracker (eqs. 11a-11c); ``eta`` in (0, 1]."""

    name = "ef21m"
    uses_local = True
    state_class = EF21State

    def __init__(self, method: str = "", eta: float = 0.1) -> None:
        super().__init__(method)
        self.eta = check_float(method, "eta", eta, 0.0, 1.0, low_open=True)
        self._scratch: dict[str, np.ndarray] = {}   # per tensor: the h - g buffer

    def params(self) -> dict[str, Any]:
        return {"eta": self.eta}

    def trackers_fit(self, state: Any, like: Any) -> bool:
        """Whether every tracker this scheme keeps in ``state`` exists and fits ``like`` (so
        :meth:`reduce` re-creates none of them: a step that changes no state before its
        first collective)."""
        fb = state.feedback
        if type(fb) is not self.state_class:
            return False
        attrs = ["g", "G"] + ([] if self.eta == 1.0 and self.name == "ef21" else ["h"])
        return all(_fits(getattr(fb, a), like) for a in attrs)

    def _tracker(self, state: Any, attr: str, like: np.ndarray) -> np.ndarray:
        """Tracker ``attr`` of ``state``'s memory, (re-)created at zero unless it fits ``like``."""
        memory = self.memory(state)
        arr = getattr(memory, attr)
        if not _fits(arr, like):
            arr = get_array_module(like).zeros_like(like)
            setattr(memory, attr, arr)
        return arr

    def _momentum(self, x: np.ndarray, state: Any) -> np.ndarray:
        """Eq. (11a): h_i <- (1 - eta) h_i + eta x_i, in place in ``state``."""
        h = self._tracker(state, "h", x)
        h *= h.dtype.type(1.0 - self.eta)
        h += h.dtype.type(self.eta) * x
        return h

    def reduce(self, method: Any, x: np.ndarray, name: str, comm: Any, state: Any) -> np.ndarray:
        g = self._tracker(state, "g", x)
        big_g = self._tracker(state, "G", x)
        h = x if self.eta == 1.0 and self.name == "ef21" else self._tracker(state, "h", x)
        fused = getattr(method, "_reduce_ef21", None)
        if fused is not None:
            # the method runs (11a)-(11c) inside its own passes (ARC-Top-K: with the sketch;
            # only the selected rows of g and G change) and returns the copy of G, or None
            out = fused(x, None if h is x else h, g, big_g, None if h is x else self.eta,
                        name, comm, state)
            if out is not None:
                return out
        if fusable(x, h, g, big_g):
            # (11a) and h - g in one pass, into a buffer reused across steps (the method's
            # _reduce consumes it within the call); (11b), (11c) and G's copy in another
            d = self._scratch.get(name)
            if d is None or d.shape != x.shape or d.dtype != x.dtype:
                d = self._scratch[name] = np.empty_like(x)
            momentum_diff(h, x, g, None if h is x else self.eta, d)
            avg_c, c = method._reduce(d, name, comm, state)
            if fusable(g, c, big_g, avg_c):
                return track_and_copy(g, c, big_g, avg_c)
        else:
            h = self._momentum(x, state)
            avg_c, c = method._reduce(h - g, name, comm, state)
        g += c                               # (11b)
        big_g += avg_c                       # (11c): G = avg_i g_i
        return big_g.copy()

    def on_dense_step(self, x: np.ndarray, avg: np.ndarray, state: Any) -> None:
        """Re-initialise h_i = g_i = x_i and G = avg (see the module docstring)."""
        memory = self.memory(state)
        memory.h = x.copy()
        memory.g = x.copy()
        memory.G = avg.copy()


@register_feedback
class EF21(EF21M):
    """EF21: error feedback on the gradient itself (EF21M with eta = 1, no tracker h)."""

    name = "ef21"

    def __init__(self, method: str = "") -> None:
        super().__init__(method, eta=1.0)

    def params(self) -> dict[str, Any]:
        return {}

    def _momentum(self, x: np.ndarray, state: Any) -> np.ndarray:
        return x

    def on_dense_step(self, x: np.ndarray, avg: np.ndarray, state: Any) -> None:
        memory = self.memory(state)
        memory.g = x.copy()
        memory.G = avg.copy()
