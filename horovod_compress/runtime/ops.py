"""The reduction a front-end applies to averaged gradients: ``Average`` or ``Sum``.

Accepts our constants, their names, and Horovod's integer constants
(``hvd.Average == 0``, ``hvd.Sum == 1``) so a Horovod script's ``op=`` works.
"""
from __future__ import annotations

from typing import Any

import numpy as np

Average = "average"
Sum = "sum"

_HOROVOD_OPS = {0: Average, 1: Sum}


def op_name(op: Any) -> str:
    """Normalise ``op`` to ``"average"`` or ``"sum"``; ``ValueError`` otherwise (e.g. Adasum)."""
    if isinstance(op, (int, np.integer)) and not isinstance(op, bool):
        if int(op) in _HOROVOD_OPS:
            return _HOROVOD_OPS[int(op)]
        raise ValueError(f"op must be Average or Sum (Horovod's Adasum is not supported), got {op!r}")
    text = str(getattr(op, "name", op)).lower()
    if text in ("average", "avg") or text.endswith("average"):
        return Average
    if text == "sum" or text.endswith("sum"):
        return Sum
    raise ValueError(f"op must be Average or Sum, got {op!r}")
