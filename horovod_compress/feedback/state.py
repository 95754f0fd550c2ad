"""What each error-feedback scheme remembers of a tensor between steps.

A method's per-tensor state (:class:`~horovod_compress.compressors.state.TensorState`)
holds one of these in its ``feedback`` field, created by the method's feedback
scheme (:meth:`~horovod_compress.feedback.base.Feedback.new_state`). Checkpoints
save each field under its key, the attribute name prefixed with ``fb_``
(``fb_residual``, ``fb_g``, ``fb_G``, ``fb_h``), as earlier versions did.

Arrays live where the gradient does (NumPy or CuPy) and have the shape and
dtype of the method's work array for the tensor (float32, or float64 for a
float64 gradient). ``None`` means "not created yet": the scheme creates it on
its first compressed step.
"""
from __future__ import annotations

from typing import Any, ClassVar, Iterator


class FeedbackState:
    """No memory: ``feedback="none"`` compresses the gradient itself."""

    __slots__ = ()
    #: (checkpoint key, attribute) of every field
    FIELDS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, **fields: Any) -> None:
        for _key, attr in self.FIELDS:
            object.__setattr__(self, attr, None)
        for attr, value in fields.items():
            setattr(self, attr, value)

    def saved(self) -> Iterator[tuple[str, str, Any]]:
        """``(checkpoint key, attribute, value)`` of every field that is set."""
        for key, attr in self.FIELDS:
            value = getattr(self, attr)
            if value is not None:
                yield key, attr, value

    def __repr__(self) -> str:
        body = ", ".join(f"{attr}={getattr(value, 'shape', value)!r}"
                         for _key, attr, value in self.saved())
        return f"{type(self).__name__}({body})"


class ResidualState(FeedbackState):
    """EF14 (``feedback="residual"``; Seide et al., "1-bit stochastic gradient descent and its
    application to data-parallel distributed training of speech DNNs", 2014).

    The method compresses ``x_i + e_i`` and keeps ``e_i <- x_i + e_i - C(x_i + e_i)``.
    """

    __slots__ = ("residual",)
    FIELDS = (("fb_residual", "residual"),)

    #: ``e_i``: the part of this rank's past inputs not yet sent (work dtype, the tensor's
    #: shape). Replaced every compressed step; the buffer it replaces becomes the next step's
    #: ``x + e`` (the scheme's spare buffer, not checkpointed).
    residual: Any


class EF21State(FeedbackState):
    """EF21 / EF21M trackers (``feedback="ef21"``/``"ef21m"``): eqs. (11a)-(11c) of "An
    All-Reduce Compatible Top-K Compressor for Communication-Efficient Distributed Learning"
    (EF21M: Fatkhullin, Tyurin, Richtarik, "Momentum provably improves error feedback!", 2023).

    All three start at zero on a tensor's first compressed step and are reset after a dense
    (warm-up) step to ``h_i = g_i = x_i``, ``G = avg_i x_i``.
    """

    __slots__ = ("g", "G", "h")
    FIELDS = (("fb_g", "g"), ("fb_G", "G"), ("fb_h", "h"))

    #: ``g_i`` (eq. 11b): what the other ranks know of this rank's tracker; ``g_i += c_i``.
    g: Any
    #: ``G = avg_i g_i`` (eq. 11c): the direction the optimizer receives; ``G += avg_i c_i``,
    #: the same on every rank.
    G: Any
    #: ``h_i`` (eq. 11a): EF21M's momentum tracker ``(1 - eta) h_i + eta x_i``; always ``None``
    #: under EF21 (``h_i = x_i`` is not stored).
    h: Any


__all__ = ["EF21State", "FeedbackState", "ResidualState"]
