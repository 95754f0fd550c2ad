"""Shared look of the benchmark plots: one distinct line style per method, log-log speedup axes."""
from __future__ import annotations

from typing import Any

_MARKERS = "osD^v<>pPhX*"


def method_style(i: int) -> dict[str, Any]:
    """Marker, colour and dash of the i-th method's line (distinct for up to 20 methods)."""
    import matplotlib.pyplot as plt
    return {"marker": _MARKERS[i % len(_MARKERS)], "color": plt.get_cmap("tab20")(i % 20),
            "linestyle": "-" if i < 10 else "--"}


def speedup_axes(ax: Any, xlabel: str, ylabel: str, title: str, log_base_x: int = 10) -> None:
    """Log-log axes with the break-even line at 1 and a grid."""
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=log_base_x)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
