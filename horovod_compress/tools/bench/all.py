"""``hvdc bench all``: run the benchmark suite, record provenance, regenerate the results pages.

Examples::

    hvdc bench all                       # every benchmark at its full size -> benchmarks/
    hvdc bench all --quick               # small sizes, minutes -> results/bench-quick/
    hvdc bench all --only convergence,volume
    hvdc bench all --skip e2e --dry-run  # print the commands only
    hvdc bench all --index-only          # just rebuild benchmarks/README.md from what is there

Each benchmark runs as its own ``hvdc bench <name> ...`` process, one after the
other (they measure the machine: nothing else should run meanwhile). For every
run, ``all.json`` in the output folder records the machine (CPU, cores,
memory, OS), the versions (Python, NumPy, PyTorch, TensorFlow, mpi4py, the MPI
library, Numba, Horovod, this package and its git commit), the command line of
``hvdc bench all`` and of the benchmark, its exit code and wall time; every
Markdown page the benchmark wrote gets a provenance footer with the same
facts, as the line under its title. Then ``README.md`` of the output folder
-- the index, one row per results page: what it measures, the command, when
and on what machine it ran, read from the page's header (:func:`page_facts`)
-- is regenerated; when the output folder is the repository's
``benchmarks/``, the generated "which method" page (``docs/choosing.md``,
the alpha-beta model's predictions per network) and the reference data
shipped with the package are regenerated too (:mod:`.choosing`).
A benchmark whose prerequisites are missing (root for the emulated cluster, a
GPU) fails on its own and the others still run; the exit code is 1 when any
failed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import choosing
from .machine import cpu_model

PROVENANCE_MARK = "<!-- hvdc:provenance -->"
#: A results page's header: its title and the lines up to this one (1-based) state the
#: command, the date and the machine of the run (:func:`page_facts` reads them).
HEADER_LINES = 5
_COMMAND = re.compile(r"`((?:hvdc|python3?|\.venv/bin/python|mpirun|torchrun|bash) [^`]*)`")
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_CORES = re.compile(r"\b(\d+) (?:logical CPUs|cores)\b")
_CPU = re.compile(r"\b(Intel\(R\) Xeon\(R\)|Xeon|AMD EPYC|EPYC|x86_64|aarch64|arm64)\b")


@dataclass
class Benchmark:
    """One entry of the suite: the ``hvdc bench`` sub-command and its arguments.

    ``full`` and ``quick`` are argument lists in which ``{out}`` stands for the
    output folder; ``root`` marks benchmarks that need root (the emulated
    cluster); ``gpu`` those that need a GPU (skipped without one).
    """

    name: str
    full: list[str]
    quick: list[str]
    root: bool = False
    gpu: bool = False
    note: str = ""
    outputs: list[str] = field(default_factory=list)


SUITE: list[Benchmark] = [
    Benchmark("volume", ["--out", "{out}/volume"],
              ["--ranks", "2", "4", "--steps", "24", "--warmup", "8", "--out", "{out}/volume"]),
    Benchmark("oktopk-counts", ["--out", "{out}/oktopk_counts"],
              ["--steps", "80", "--warmup", "8", "--tau", "16", "--tau-prime", "8",
               "--out", "{out}/oktopk_counts"]),
    Benchmark("selection", ["--out", "{out}/selection"],
              ["--n", "1000000", "--repeats", "2", "--out", "{out}/selection"]),
    Benchmark("kernels", ["--out", "{out}/kernels.md"],
              ["--sizes", "100000", "--repeat", "2", "--out", "{out}/kernels.md"]),
    Benchmark("hot_path", ["--out", "{out}/hot_path.md"],
              ["--shape", "300x300", "--repeat", "3", "--warmup", "1", "--out", "{out}/hot_path.md"]),
    Benchmark("qsgd", ["--out", "{out}"], ["--sizes", "65536", "--repeat", "2", "--out", "{out}"]),
    Benchmark("qsgd-model", ["--from", "{out}/qsgd.json", "--out", "{out}/qsgd_model.md"],
              ["--from", "{out}/qsgd.json", "--out", "{out}/qsgd_model.md"]),
    Benchmark("deepreduce", ["--out", "{out}"], ["--quick", "--repeats", "1", "--out", "{out}"]),
    Benchmark("arc", ["--out", "{out}"],
              ["--steps", "21", "--every", "10", "--repeats", "1", "--split", "iid", "--out", "{out}"]),
    Benchmark("lowrank", ["--out", "{out}"],
              ["--ranks", "8", "--warmup", "2", "--steps", "3", "--d-model", "128", "--layers", "1",
               "--seq", "16", "--batch-size", "2", "--timing-steps", "2", "--out", "{out}"]),
    Benchmark("overlap", ["--out", "{out}/overlap.md"],
              ["--hidden", "128", "--epochs", "1", "--repeat", "1", "--out", "{out}/overlap.md"]),
    Benchmark("tf_bridge", ["--out", "{out}"], ["--repeats", "3", "--out", "{out}"]),
    Benchmark("convergence", ["--out", "{out}"], ["--quick", "--out", "{out}"]),
    Benchmark("e2e", ["--out", "{out}"],
              ["--hosts", "2", "--bandwidths", "1gbit", "--model", "tiny", "--methods", "none,topk",
               "--steps", "2", "--out", "{out}"], root=True,
              note="needs root for the emulated cluster (network namespaces)"),
    Benchmark("kernels-gpu", [], [], gpu=True, note="needs a CUDA GPU and CuPy"),
]


def register_bench(sub: argparse._SubParsersAction) -> None:
    """Add ``hvdc bench all``."""
    p = sub.add_parser("all", help="run the whole suite, record machine/versions, regenerate the results pages",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sizes (minutes); writes to results/bench-quick unless --out is given")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/, or "
                                               "results/bench-quick with --quick)")
    p.add_argument("--only", default="", help="comma-separated benchmark names to run")
    p.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--index-only", action="store_true",
                   help="only regenerate the output folder's README.md (the index)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark (default 3600)")
    p.set_defaults(func=run)


# ----------------------------------------------------------------- provenance
def _version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _first_line(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in (out.stdout or out.stderr).splitlines() if line.strip()]
    return lines[0] if lines else None


def machine_info() -> dict[str, Any]:
    """CPU model, core count, memory, OS and Python implementation of this machine."""
    cpu = cpu_model(platform.processor() or None)
    mem = None
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = f"{kb / 2**20:.1f} GiB"
    except (OSError, AttributeError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory": mem, "os": platform.platform(),
            "python": platform.python_version()}


def versions() -> dict[str, Any]:
    """Versions of the libraries the results depend on, the MPI library and the git commit."""
    out: dict[str, Any] = {name: _version(dist) for name, dist in (
        ("horovod-compress", "horovod-compress"), ("numpy", "numpy"), ("torch", "torch"),
        ("tensorflow", "tensorflow-cpu"), ("keras", "keras"), ("mpi4py", "mpi4py"),
        ("numba", "numba"), ("scipy", "scipy"), ("scikit-learn", "scikit-learn"),
        ("horovod", "horovod"), ("cupy", "cupy-cuda12x"))}
    if out["tensorflow"] is None:
        out["tensorflow"] = _version("tensorflow")
    out["mpi"] = _first_line(["mpirun", "--version"])
    root = Path(__file__).resolve().parents[3]
    commit = _first_line(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"])
    if commit:
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        out["git"] = commit + ("+dirty" if dirty else "")
    return {k: v for k, v in out.items() if v is not None}


def provenance(command: list[str], argv: list[str]) -> dict[str, Any]:
    """Everything recorded with a result: time, machine, versions, command lines."""
    return {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_info(), "versions": versions(),
            "command": " ".join(shlex.quote(a) for a in command),
            "suite_command": " ".join(shlex.quote(a) for a in argv)}


def provenance_line(prov: dict[str, Any]) -> str:
    """The line ``hvdc bench all`` puts under the title of each page a benchmark wrote:
    command, date, machine and versions (:data:`PROVENANCE_MARK` ends it)."""
    m, v = prov["machine"], prov["versions"]
    vers = ", ".join(f"{k} {val}" for k, val in v.items())
    return (f"*Produced {prov['date']} by `{prov['command']}` (within `{prov['suite_command']}`) on "
            f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory')}, {m.get('os')}; {vers}.* "
            f"{PROVENANCE_MARK}")


def stamp_page(path: Path, prov: dict[str, Any]) -> None:
    """Put (or replace) the provenance line under the page's title (its header)."""
    lines = [line for line in path.read_text().splitlines() if PROVENANCE_MARK not in line]
    while lines and lines[-1].strip() in ("", "---"):       # an old footer's separator
        lines.pop()
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ")), 0)
    lines[at:at] = ["", provenance_line(prov)] if at else [provenance_line(prov), ""]
    text = "\n".join(lines)
    path.write_text(re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n")


# --------------------------------------------------------------------- index
def _title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


@dataclass
class PageFacts:
    """What a results page's header says about its run (empty strings where it says nothing)."""

    title: str
    command: str
    date: str
    machine: str


def page_facts(path: Path) -> PageFacts:
    """Read the title, the command, the date and the machine from a results page's header.

    The header is the first :data:`HEADER_LINES` lines: the title and the paragraph under
    it. The command is the first inline-code span that starts like one (``hvdc``,
    ``python``, ``mpirun``, ...), under the title if there is one there, else in the
    title; the date the first ``YYYY-MM-DD``; the machine the core count ("2 cores",
    "2 logical CPUs"), with the CPU's name where the header gives one.
    """
    lines = path.read_text().splitlines()[:HEADER_LINES]
    head = "\n".join(lines)
    command = _COMMAND.search("\n".join(lines[1:])) or _COMMAND.search(head)
    date = _DATE.search(head)
    cores = _CORES.search(head)
    machine = ""
    if cores:
        cpu = _CPU.search(head)
        machine = ((cpu.group(1).replace("Intel(R) Xeon(R)", "Xeon") + ", ") if cpu else "") + \
            f"{cores.group(1)} cores"
    return PageFacts(_title(path), command.group(1) if command else "", date.group(0) if date else "",
                     machine)


def results_pages(out: Path) -> list[Path]:
    """Every results page under ``out`` (sub-folders included), the index itself left out."""
    return sorted((p for p in out.rglob("*.md") if p != out / "README.md"),
                  key=lambda p: p.relative_to(out).as_posix())


def _cell(text: str, limit: int = 0) -> str:
    text = text.replace("|", "\\|")
    return text if not limit or len(text) <= limit else text[:limit - 1].rstrip() + "…"


def index_text(out: Path, record: dict[str, Any]) -> str:
    """The index of ``out``: one row per results page -- what it measures (its title, linked),
    the command, when and where it ran (:func:`page_facts`) -- and the last suite run's status."""
    lines = ["# Benchmark results", "",
             "One page per benchmark, each written by the command in its row; each page's header "
             "(the lines under its title) gives the full command, the date and the machine. "
             "Timings come from that machine, most of them a shared 2-core virtual machine: "
             "compare them within a page, as ratios against the baseline measured in the same "
             "run. Byte counts and accuracies do not depend on the machine. `hvdc bench all` "
             "reruns the suite and regenerates this index.", ""]
    runs = record.get("runs", {})
    if runs:
        lines += ["| benchmark | status | wall time | last run |", "|---|---|---:|---|"]
        for name, r in sorted(runs.items()):
            status = "ok" if r.get("returncode") == 0 else (
                "skipped: " + r["skipped"] if r.get("skipped") else f"failed (exit {r.get('returncode')})")
            wall = f"{r['seconds']:.0f} s" if r.get("seconds") is not None else ""
            lines.append(f"| `{name}` | {status} | {wall} | {r.get('date', '')} |")
        lines.append("")
    lines += ["| what it measures | command | date | machine |", "|---|---|---|---|"]
    for page in results_pages(out):
        facts = page_facts(page)
        command = f"`{_cell(facts.command, 90)}`" if facts.command else "-"
        lines.append(f"| [{_cell(facts.title)}]({page.relative_to(out).as_posix()}) | {command} "
                     f"| {facts.date or '-'} | {facts.machine or '-'} |")
    return "\n".join(lines).rstrip("\n") + "\n"


def write_index(out: Path, record: dict[str, Any]) -> Path:
    """(Re)write ``out/README.md`` with :func:`index_text`."""
    path = out / "README.md"
    path.write_text(index_text(out, record))
    return path


# ----------------------------------------------------------------------- run
def _selected(only: str, skip: str) -> list[Benchmark]:
    names = {b.name for b in SUITE}
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    unwanted = [s.strip() for s in skip.split(",") if s.strip()]
    for n in wanted + unwanted:
        if n not in names:
            raise ValueError(f"unknown benchmark {n!r}; the suite has: {', '.join(sorted(names))}")
    return [b for b in SUITE if (not wanted or b.name in wanted) and b.name not in unwanted]


def _gpu_available() -> bool:
    try:
        import cupy  # noqa: F401
        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 -- no CuPy, no driver, no device: all mean no GPU
        return False


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmarks one after the other; see the module docstring."""
    out = Path(args.out or ("results/bench-quick" if args.quick else "benchmarks"))
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "all.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"runs": {}}
    argv = ["hvdc", "bench", "all", *sys.argv[sys.argv.index("all") + 1:]] if "all" in sys.argv else \
        ["hvdc", "bench", "all"]
    base = [sys.executable, "-m", "horovod_compress.tools.cli"]
    failed = 0
    if not args.index_only:
        suite = _selected(args.only, args.skip)
        for i, bench in enumerate(suite, 1):
            cmd_args = [a.format(out=out) for a in (bench.quick if args.quick else bench.full)]
            cmd = [*base, "bench", bench.name, *cmd_args]
            shown = ["hvdc", "bench", bench.name, *cmd_args]
            print(f"[{i}/{len(suite)}] {' '.join(shlex.quote(a) for a in shown)}", flush=True)
            if args.dry_run:
                continue
            skip = None
            if bench.root and hasattr(os, "geteuid") and os.geteuid() != 0:
                skip = bench.note
            if bench.gpu and not _gpu_available():
                skip = bench.note
            prov = provenance(shown, argv)
            if skip:
                print(f"    skipped: {skip}", flush=True)
                record["runs"][bench.name] = {**prov, "skipped": skip, "returncode": None, "seconds": None}
                continue
            t0 = time.time()
            try:
                rc = subprocess.call(cmd, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                rc = 124
            seconds = time.time() - t0
            written = sorted(p for p in out.rglob("*") if p.is_file() and p.stat().st_mtime >= t0 - 1
                             and p.name not in ("README.md", "all.json"))
            for page in written:
                if page.suffix == ".md":
                    stamp_page(page, prov)
            record["runs"][bench.name] = {**prov, "returncode": rc, "seconds": round(seconds, 1),
                                          "outputs": [str(p.relative_to(out)) for p in written]}
            print(f"    {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {seconds:.0f} s; "
                  f"wrote {len(written)} file(s)", flush=True)
            failed += rc != 0
            record_path.write_text(json.dumps(record, indent=1))
        if args.dry_run:
            return 0
        if out.resolve() == choosing.E2E_JSON.parent.resolve():
            choosing.main([])          # docs/choosing.md and the shipped reference data
    record_path.write_text(json.dumps(record, indent=1))
    index = write_index(out, record)
    print(f"wrote {index} and {record_path}", flush=True)
    return 1 if failed else 0
