"""Error feedback, written once for every biased method.

A feedback scheme decides what a method compresses and what the optimizer
receives. It calls ``method._reduce(x, name, comm, state) -> (avg, local)``
(see :mod:`horovod_compress.compressors.base`) on the vector of its choice and
keeps its own per-tensor memory in the ``feedback`` field of the method's
``TensorState``: an instance of its ``state_class``
(:mod:`horovod_compress.feedback.state`), checkpointed with the method under
keys starting with ``fb_``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, ClassVar

import numpy as np

from .state import FeedbackState

_REGISTRY: dict[str, Callable[..., "Feedback"]] = {}

#: Other names of the registered schemes, as the literature writes them: residual
#: feedback is EF14 (Seide et al., "1-bit stochastic gradient descent and its
#: application to data-parallel distributed training of speech DNNs", 2014).
ALIASES: dict[str, str] = {"ef14": "residual"}


def register_feedback(cls: type["Feedback"]) -> type["Feedback"]:
    """Class decorator: make a scheme available as ``feedback=<cls.name>``."""
    _REGISTRY[cls.name] = cls
    return cls


def available_feedback() -> list[str]:
    """Names of the registered feedback kinds (``none``, ``residual``, ``ef21``, ``ef21m``)."""
    return sorted(_REGISTRY)


def feedback_parameters(name: str) -> list[str]:
    """The parameter names scheme ``name`` (or its alias) takes, e.g. ``["eta"]`` for ``ef21m``;
    ``[]`` for an unknown name (:func:`make_feedback` reports that one)."""
    cls = _REGISTRY.get(ALIASES.get(name, name) if isinstance(name, str) else name)
    if cls is None:
        return []
    return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "method")]


def make_feedback(method: str, name: str, **params: Any) -> "Feedback":
    """Build feedback scheme ``name`` (or an alias in :data:`ALIASES`, e.g. ``"ef14"``);
    ``ValueError`` names a bad scheme or parameter."""
    name = ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in _REGISTRY:
        aliases = ", ".join(f"{a!r} for {n!r}" for a, n in ALIASES.items())
        raise ValueError(f"{method}: feedback must be one of {available_feedback()} "
                         f"(aliases: {aliases}), got {name!r}")
    cls = _REGISTRY[name]
    allowed = feedback_parameters(name)
    for key in params:
        if key not in allowed:
            hint = f" (feedback {name!r} takes {allowed})" if allowed else ""
            raise ValueError(f"{method}: unknown parameter {key!r}{hint}")
    return cls(method=method, **params)


class Feedback:
    """Base class: no memory at all (``feedback="none"``)."""

    name: ClassVar[str] = "none"
    #: whether :meth:`reduce` reads the ``local`` that ``method._reduce`` returns (methods whose
    #: ``local`` costs a pass over the gradient may return ``None`` when it does not)
    uses_local: ClassVar[bool] = False
    #: what this scheme remembers of a tensor (:mod:`horovod_compress.feedback.state`)
    state_class: ClassVar[type[FeedbackState]] = FeedbackState

    def __init__(self, method: str = "") -> None:
        self.method = method

    def new_state(self) -> FeedbackState:
        """This scheme's empty memory of a new tensor."""
        return self.state_class()

    def memory(self, state: Any) -> Any:
        """This scheme's memory in a method's tensor ``state`` (created if the state holds
        another scheme's, e.g. a state built without the method)."""
        fb = state.feedback
        if type(fb) is not self.state_class:
            fb = state.feedback = self.new_state()
        return fb

    def reduce(self, method: Any, x: np.ndarray, name: str, comm: Any, state: Any) -> np.ndarray:
        """Return what the optimizer receives for input ``x`` (the average estimate)."""
        avg, _local = method._reduce(x, name, comm, state)
        return avg

    def on_dense_step(self, x: np.ndarray, avg: np.ndarray, state: Any) -> None:
        """Called after a dense (warm-up) step; schemes with trackers sync them here."""

    def params(self) -> dict[str, Any]:
        """This feedback's parameters, as recorded in the method's ``config()`` (none by default)."""
        return {}


register_feedback(Feedback)
