"""User pages speak to users: no work-item numbers, no notes about how the project was built,
no timestamps of individual runs outside a benchmark page's header.

Scanned: every Markdown page under ``docs/``, ``README.md``, ``examples/README.md`` and the
benchmark pages (``benchmarks/**/*.md``). Code (fenced blocks and inline code spans) is not
scanned, so a literal such as ``tensor#2`` may appear there.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Work-item references: "issue 21", "issues 15 and 21", "#12", "work item".
WORK_ITEM = re.compile(r"\bissue\s+#?\d+|\bissues\s+#?\d+\s*(,|and|&)|(?<![\w&/#])#\d+\b|\bwork[- ]items?\b", re.I)
#: Notes written by the team about its own work rather than for the reader.
TEAM_NOTES = re.compile(r"\b(engineers?|worktrees?|(this|our|the last|a previous) session|the lead|"
                        r"the issue('s)?|this change|these changes|TODO|FIXME)\b", re.I)
#: A run's date or clock time (allowed only in a benchmark page's header, its first lines).
TIMESTAMP = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d UTC\b")
HEADER_LINES = 5


def user_pages() -> list[Path]:
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md", ROOT / "examples" / "README.md"]
    return [p for p in pages if "_site" not in p.parts]


def benchmark_pages() -> list[Path]:
    return sorted((ROOT / "benchmarks").rglob("*.md"))


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code, with inline code spans removed."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"``[^`]*``|`[^`]*`", "", line)))
    return out


def findings(path: Path, patterns: list[re.Pattern], skip_header: bool = False) -> list[str]:
    hits = []
    for number, line in prose_lines(path.read_text()):
        if skip_header and number <= HEADER_LINES:
            continue
        for pattern in patterns:
            for m in pattern.finditer(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return hits


@pytest.mark.parametrize("text, bad", [
    ("As issue 21 asked, the kernel is faster.", True),
    ("## CPU hot path (Issue 15)", True),
    ("see #12 for the history", True),
    ("measured in this session", True),
    ("another engineer's jobs were running", True),
    ("after our session's kernel work", True),
    ("the issue's target is 2x; before this change it was 4x", True),
    ("one pass over the gradient; a second pass over the indices", False),
    ("the `tensor#2` name, pytorch/pytorch#75666 asks for it", False),
    ("an [anchor](#section-2) and &#8212;", False),
    ("Rank 0 issues 4 sends", False),
])
def test_the_rules_catch_work_notes_and_nothing_else(text, bad, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\n{text}\n")
    old = globals()["ROOT"]
    globals()["ROOT"] = tmp_path
    try:
        assert bool(findings(page, [WORK_ITEM, TEAM_NOTES])) == bad
    finally:
        globals()["ROOT"] = old


def test_user_pages_have_no_work_notes():
    hits = [h for p in user_pages() for h in findings(p, [WORK_ITEM, TEAM_NOTES, TIMESTAMP])]
    assert not hits, "\n".join(hits)


def test_benchmark_pages_have_no_work_notes_and_dates_only_in_their_header():
    hits = [h for p in benchmark_pages() for h in findings(p, [WORK_ITEM, TEAM_NOTES])]
    hits += [h for p in benchmark_pages() for h in findings(p, [TIMESTAMP], skip_header=True)]
    assert not hits, "\n".join(hits)


def test_benchmark_pages_are_not_named_after_work_items():
    names = [p.name for p in (ROOT / "benchmarks").rglob("*") if re.search(r"issue|\bwi\d", p.name, re.I)]
    assert not names, names


def test_docstrings_have_no_work_item_numbers():
    """Docstrings are user text too: the API reference and ``hvdc <command> --help`` show them."""
    import ast
    hits = []
    for path in sorted((ROOT / "horovod_compress").rglob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                        ast.ClassDef))]
        for node in nodes:
            doc = ast.get_docstring(node) or ""
            for m in WORK_ITEM.finditer(re.sub(r"``[^`]*``|`[^`]*`", "", doc)):
                hits.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}: {m.group(0)!r}")
    assert not hits, "\n".join(hits)
