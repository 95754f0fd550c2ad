"""EF14 residual accumulation (Seide et al. 2014; Ok-Topk's Algorithm 2, lines 3-6).

Per rank and tensor:  acc_i = x_i + e_i;  (avg, local_i) = reduce(acc_i);
e_i = acc_i - local_i, where ``local_i`` is the part of ``acc_i`` this rank's
message carried (its selected entries). Nothing is lost: ``acc_i = e_i +
local_i`` exactly, and the optimizer receives ``avg``.

The learning rate is *not* folded into the residual (Ok-Topk's paper does
``acc = eps + lr * g``); we accumulate raw gradients and let the wrapped
optimizer apply ``lr``, which is the same for plain SGD with a constant rate
and works with any optimizer.

Works on NumPy or CuPy arrays (the residual lives where the gradient does).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.arrays import get_array_module
from ..mpi_collectives import timeline as _timeline
from .base import Feedback, register_feedback
from .state import ResidualState
from ..kernels.scatter import subtract_at


@register_feedback
class ResidualFeedback(Feedback):
    """EF14 error feedback: what compression dropped is added to the next gradient.

    The residual ``e`` is kept per tensor: the method compresses ``x + e`` and
    keeps ``e = x + e - C(x + e)`` (its own contribution ``C`` as the method reports it).
    A method with ``_reduce_residual(x, e, acc, name, comm, state)`` (TopkA) writes
    ``acc = x + e`` itself during its first pass over the data and returns what
    ``_reduce(acc)`` would (or ``None`` for inputs it does not fuse); or ``(avg, None)``
    when it has also applied ``acc -= local`` itself (TopkA: ``local`` is ``acc`` on its
    support, so no dense ``local`` is built).
    """
    name = "residual"
    uses_local = True
    state_class = ResidualState

    def __init__(self, method: str = "") -> None:
        super().__init__(method)
        # per tensor: the buffer of the residual before last -- next step's acc is written there
        # (two buffers alternate, so no step allocates and faults in a fresh n-element array)
        self._spare: dict[str, np.ndarray] = {}

    def reduce(self, method: Any, x: np.ndarray, name: str, comm: Any, state: Any) -> np.ndarray:
        xp = get_array_module(x)
        memory = self.memory(state)
        e = memory.residual
        result = None
        if e is not None and e.shape == x.shape and e.dtype == x.dtype:
            spare = self._spare.get(name)
            if spare is None or spare.shape != x.shape or spare.dtype != x.dtype or \
                    get_array_module(spare) is not xp or spare is e:
                spare = xp.empty_like(x)
            fused = getattr(method, "_reduce_residual", None)
            if fused is not None:   # the method adds x + e into spare during its first pass
                result = fused(x, e, spare, name, comm, state)
            acc = spare if result is not None else xp.add(x, e, out=spare)
            self._spare[name] = e           # the old residual's memory: next step's acc
        elif e is not None and e.shape == x.shape:
            acc = x + e
        else:
            acc = x.copy()
        avg, local = result if result is not None else method._reduce(acc, name, comm, state)
        if result is not None and local is None:   # the fused method left acc - local in acc
            memory.residual = acc
            return avg
        with _timeline.span("feedback.residual", "feedback"):
            self._forget_sent(method, acc, local, name, xp)
        memory.residual = acc
        return avg

    @staticmethod
    def _forget_sent(method: Any, acc: Any, local: Any, name: str, xp: Any) -> None:
        """``e = acc - local`` in ``acc`` (O(k) over ``local``'s support when the method knows it)."""
        support = method.local_support(name, local) if acc.flags.c_contiguous else None
        if support is None:
            xp.subtract(acc, local, out=acc)
        else:                      # local is zero outside its support: O(k), same values
            flat, lflat = acc.reshape(-1), local.reshape(-1)
            if xp is np and flat.dtype == lflat.dtype and lflat.flags.c_contiguous:
                subtract_at(flat, lflat, support)   # compiled: one read-modify-write per index
            else:
                flat[support] -= lflat[support]
