"""User pages speak to users: no work-item numbers, no notes about how the project was built,
no timestamps of individual runs outside a benchmark page's header.

Scanned: every Markdown page under ``docs/``, ``README.md``, ``examples/README.md`` and the
benchmark pages (``benchmarks/**/*.md``). Code (fenced blocks and inline code spans) is not
scanned, so a literal such as ``tensor#2`` may appear there.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from horovod_compress.tools.bench import all as bench_all

ROOT = Path(__file__).resolve().parents[1]

#: Work-item references: "issue 21", "issues 15 and 21", "#12", "work item".
WORK_ITEM = re.compile(r"\bissue\s+#?\d+|\bissues\s+#?\d+\s*(,|and|&)|(?<![\w&/#])#\d+\b|\bwork[- ]items?\b", re.I)
#: Notes written by the team about its own work rather than for the reader.
TEAM_NOTES = re.compile(r"\b(engineers?|worktrees?|(this|our|the last|a previous) session|the lead|"
                        r"the issue('s)?|this change|these changes|TODO|FIXME)\b", re.I)
#: A run's date or clock time (allowed only in a benchmark page's header, its first lines).
TIMESTAMP = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d UTC\b")
HEADER_LINES = bench_all.HEADER_LINES


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
    index = ROOT / "benchmarks" / "README.md"        # the index repeats each page's header date
    hits += [h for p in benchmark_pages() if p != index for h in findings(p, [TIMESTAMP], skip_header=True)]
    assert not hits, "\n".join(hits)


#: A file name that points at a work item or a work space rather than at what it measures.
WORK_ITEM_NAME = re.compile(r"issue|\bwi\d|(^|[_\-.])(s\d+|wt\d+\w*|pr\d+|ticket\d*|session\d*)([_\-.]|$)", re.I)


@pytest.mark.parametrize("name, bad", [
    ("e2e_matrix2000_issue15.md", True), ("e2e_transformer_Issue15.png", True), ("timeline_s11.json", True),
    ("e2e_wt41.md", True), ("ddp_e2e.md", False), ("fsdp_e2e_p2.md", False), ("kernels_2threads.md", False),
    ("exchange_p4_1gbit_after_topk_shared70.png", False), ("qsgd_e2e.json", False),
])
def test_the_work_item_name_rule(name, bad):
    assert bool(WORK_ITEM_NAME.search(name)) == bad


def test_benchmark_pages_are_not_named_after_work_items():
    names = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*")
             if any(WORK_ITEM_NAME.search(part) for part in p.relative_to(ROOT).parts)]
    assert not names, names


@pytest.mark.parametrize("header, missing", [
    ("*Run 2026-11-21 with `hvdc bench arc --np 4` on x86_64, 2 cores.*", set()),
    ("Measured 2026-11-28 with `hvdc bench e2e --hosts 4` on x86_64, 2 logical CPUs.", set()),
    ("Run with `hvdc bench arc --np 4` on x86_64, 2 cores.", {"date"}),
    ("Run 2026-11-21 on x86_64, 2 cores.", {"command"}),
    ("Run 2026-11-21 with `hvdc bench arc --np 4` on this machine.", {"machine"}),
    ("Some prose.\n\nMore prose.\n\n*Run 2026-11-21 with `hvdc bench arc` on 2 cores.*", {"command", "date", "machine"}),
])
def test_the_header_rule(header, missing, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Some benchmark\n\n{header}\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    facts = bench_all.page_facts(page)
    assert {k for k in ("command", "date", "machine") if not getattr(facts, k)} == missing


def test_benchmark_pages_state_command_date_and_machine_in_their_header():
    """Every results page says, under its title, how it was produced, when and on what machine."""
    pages = bench_all.results_pages(ROOT / "benchmarks")
    assert len(pages) > 20
    bad = []
    for page in pages:
        facts = bench_all.page_facts(page)
        missing = [k for k in ("title", "command", "date", "machine") if not getattr(facts, k)]
        if missing:
            bad.append(f"{page.relative_to(ROOT)}: no {', '.join(missing)} in its first "
                       f"{bench_all.HEADER_LINES} lines")
    assert not bad, "\n".join(bad)


def test_benchmark_index_is_current():
    """``benchmarks/README.md`` is what ``hvdc bench all --index-only`` writes: one row per page."""
    out = ROOT / "benchmarks"
    record = out / "all.json"
    expected = bench_all.index_text(out, json.loads(record.read_text()) if record.is_file() else {})
    assert (out / "README.md").read_text() == expected, \
        "benchmarks/README.md is out of date: run `hvdc bench all --index-only`"
    titles = [bench_all.page_facts(p).title for p in bench_all.results_pages(out)]
    assert len(set(titles)) == len(titles), "two results pages share a title: the index cannot tell them apart"


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
