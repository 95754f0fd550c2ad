"""Link rates and durations as people and ``tc`` write them (``'1gbit'``, ``'50ms'``).

A bottom-layer module (no imports of the package): the cost model
(:mod:`horovod_compress.cost_model`) and the emulated cluster
(:mod:`horovod_compress.tools.cluster.netns`) both read these units.
"""
from __future__ import annotations

import re

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")


def parse_rate(rate: str) -> float:
    """``'1gbit'`` -> 1e9 bits per second (tc's units: bit, kbit, mbit, gbit, tbit)."""
    m = _RATE.match(str(rate).strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bandwidth must look like 100mbit, 1gbit or 10gbit, got {rate!r}")
    return float(m.group(1)) * _UNIT[m.group(2).lower()]


def parse_duration(value: str) -> float:
    """``'50ms'`` -> 0.05 seconds (units us, ms, s)."""
    m = _TIME.match(str(value).strip())
    if not m:
        raise ValueError(f"a duration must look like 100us, 5ms or 1s, got {value!r}")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


__all__ = ["parse_duration", "parse_rate"]
