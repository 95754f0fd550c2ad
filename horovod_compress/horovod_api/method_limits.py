"""What a compression method can do inside Horovod's calls: the adapter's error and its stateless test.

Shared by the Horovod adapter (:mod:`horovod_compress.horovod_compat`) and the
front-ends' Horovod API (:mod:`.basics`, ``torch.horovod_api``): both refuse a
method where it cannot run with :class:`HorovodAdapterError`, and both let an
unnamed reduction use a method only when :func:`is_stateless` holds (no
per-tensor state for a missing name to mix up).
"""
from __future__ import annotations

from typing import Any

#: Methods that keep no per-tensor state between calls besides a step counter.
_STATELESS = ("none", "fp16", "bf16", "qsgd", "global_qsgd", "randk", "topk", "gaussiank",
              "topk_dsa", "gtopk")


class HorovodAdapterError(ValueError):
    """A method cannot run where Horovod called it; the message says what to use instead."""

    #: Raised inside ``tf.function``: AutoGraph re-raises it as it is (without
    #: this, a ValueError subclass comes out as an ``autograph.StagingError``).
    ag_pass_through = True


def is_stateless(method: Any) -> bool:
    """Whether ``method`` keeps no state between calls that depends on which tensor it saw."""
    return method.name in _STATELESS and getattr(method.feedback, "name", "none") == "none"
