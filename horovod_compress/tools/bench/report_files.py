"""The files a benchmark writes: its figures, and a one-shot run's ``<stem>.json``, ``.md`` and ``.png``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def write_report(out: Path, stem: str, res: dict[str, Any],
                 format_report: Callable[[dict[str, Any]], str],
                 plot: Callable[[dict[str, Any], Path], Any]) -> str:
    """Write ``res`` as JSON, its markdown report and its plot under ``out`` (created if missing).

    Prints the report and the three paths; returns the report.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    report = format_report(res)
    (out / f"{stem}.md").write_text(report)
    plot(res, out / f"{stem}.png")
    print(report)
    print(f"wrote {out / f'{stem}.md'}, {out / f'{stem}.json'}, {out / f'{stem}.png'}")
    return report


def save_figure(fig: Any, path: Path, dpi: int = 120) -> Path:
    """Lay out ``fig``, write it to ``path`` at ``dpi`` and close it (pyplot keeps no reference)."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


__all__ = ["save_figure", "write_report"]
