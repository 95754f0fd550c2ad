"""How a benchmark names the machine it ran on (for the provenance lines of its reports)."""
from __future__ import annotations

import platform
from pathlib import Path


def cpu_model(default: str | None) -> str | None:
    """The CPU's model name from /proc/cpuinfo, or ``default`` where that file says none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default


def platform_summary() -> str:
    """``"<architecture>, <OS>, Python <version>"``, e.g. ``x86_64, Linux, Python 3.12.3``."""
    return f"{platform.machine()}, {platform.system()}, Python {platform.python_version()}"


__all__ = ["cpu_model", "platform_summary"]
