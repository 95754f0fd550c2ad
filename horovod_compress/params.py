"""Argument checks shared by every method's constructor.

Each check raises ``ValueError`` naming the argument and the allowed range, so
bad configuration fails before any communication starts. Used by the methods,
the codecs and the feedback schemes alike, so it sits below all of them.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np


def check_float(method: str, name: str, value: Any, low: float | None = None,
                high: float | None = None, *, low_open: bool = False,
                high_open: bool = False) -> float:
    """Return ``value`` as float, or raise if it is not a finite number in range."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{method}: {name} must be a number, got {value!r}") from None
    lo_ok = low is None or (v > low if low_open else v >= low)
    hi_ok = high is None or (v < high if high_open else v <= high)
    if not math.isfinite(v) or not (lo_ok and hi_ok):
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        raise ValueError(f"{method}: {name} must be in {'(' if low_open else '['}{lo}, "
                         f"{hi}{')' if high_open else ']'}, got {value!r}")
    return v


def check_int(method: str, name: str, value: Any, low: int | None = None,
              high: int | None = None) -> int:
    """Return ``value`` as int, or raise if it is not an integer in ``[low, high]``.

    Only integers are accepted (Python ``int`` or a NumPy integer): a float such
    as ``10.0`` is refused, since a count given as a float is most often a
    density or a ratio passed to the wrong parameter.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{method}: {name} must be an integer, got {value!r}"
                         + (" (a float; pass an int)" if isinstance(value, float) else ""))
    v = int(value)
    if (low is not None and v < low) or (high is not None and v > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{method}: {name} must be an integer in [{lo}, {hi}], got {value!r}")
    return v


def check_choice(method: str, name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return ``value`` if it is one of ``choices``, else raise listing them."""
    options = list(choices)
    if value not in options:
        raise ValueError(f"{method}: {name} must be one of {options}, got {value!r}")
    return value
