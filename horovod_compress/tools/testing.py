"""Run test cases on real MPI ranks from pytest.

A test module holds its per-rank cases (top-level functions ``case_*(comm)``)
next to the tests that check them. ``run_cases(nprocs, __file__)`` finds the
cases by name, starts ``mpirun -np nprocs`` on :func:`_worker_main`, which
imports the module on every rank and calls each case with a fresh
:class:`Communicator`. A case asserts on every rank; an exception on any rank
aborts the job (no hang), marks that case failed with its tracebacks, and the
remaining cases run in a fresh job, so one failing case fails only the tests
that read it. Whatever a case returns (JSON-serialisable) comes back as
``results[case_fn][rank]`` for further checks in the test.
"""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Sequence, Union

from .mpi_launcher import CASES_RUN
from .mpi_launcher import selected as selected_mpi


def mpirun_command(nprocs: int) -> list[str]:
    """The MPI launcher (``mpirun``, or MPICH's ``mpiexec`` under ``HVDC_MPI=mpich``) with the
    flags this machine needs (root, oversubscription): :mod:`horovod_compress.tools.mpi_launcher`."""
    return selected_mpi().command(nprocs)


#: The order in which the launcher below probes Horovod's framework extensions. Before every job
#: ``horovodrun`` asks whether Horovod was built with MPI and with Gloo by importing an extension in
#: a forked process, TensorFlow's first (``horovod.common.util.EXTENSIONS``): 8 s of TensorFlow
#: import per launch on this machine, even for a PyTorch job. The PyTorch extension gives the same
#: answer (one build) in a fraction of that.
HOROVOD_PROBE_ORDER = ("torch", "tensorflow", "mxnet")


def horovodrun_command(nprocs: int) -> list[str]:
    """``horovodrun -np N`` as the tests start it: Horovod's own launcher (the console script's
    entry point, ``horovod.runner.launch.run_commandline``, in this interpreter), its build probe
    trying the PyTorch extension first (:data:`HOROVOD_PROBE_ORDER`); everything else is Horovod's.
    ``tests/test_examples.py`` runs the console script itself (``examples/horovodrun.sh``)."""
    import importlib.util
    if importlib.util.find_spec("horovod") is None:
        raise RuntimeError("Horovod is not installed: run scripts/setup.sh (builds it)")
    boot = ("import horovod.common.util as u; "
            f"u.EXTENSIONS = {list(HOROVOD_PROBE_ORDER)!r}; "
            "from horovod.runner.launch import run_commandline; run_commandline()")
    return [sys.executable, "-c", boot, "-np", str(nprocs)]


def run_horovodrun(nprocs: int, args: Sequence[str], *, timeout: float, cwd: str | Path | None = None,
                   extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``args`` under :func:`horovodrun_command` on ``nprocs`` ranks, in :func:`mpi_env` (root
    allowed, not marked as launched by ``hvdc``): the finished process, output captured."""
    env = mpi_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(extra_env or {})})
    env.pop("HVDC_LAUNCHED", None)
    return subprocess.run([*horovodrun_command(nprocs), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


#: The file ``scripts/setup.sh`` leaves in the virtual environment when it was told not to build
#: Horovod (``HVDC_SKIP_HOROVOD=1``); it removes it when it builds or finds a working Horovod.
HOROVOD_SKIPPED_MARKER = ".hvdc-horovod-skipped"


def horovod_build_skipped() -> bool:
    """Whether this environment was set up without Horovod on purpose: the setup's marker
    (:data:`HOROVOD_SKIPPED_MARKER` in ``sys.prefix``) exists or ``HVDC_SKIP_HOROVOD=1`` is set.

    Only then may a test that needs Horovod skip; otherwise a Horovod that is missing or does
    not import (a broken build of its TensorFlow plugin) is a failure, not a skip."""
    return (os.environ.get("HVDC_SKIP_HOROVOD") == "1"
            or Path(sys.prefix, HOROVOD_SKIPPED_MARKER).exists())


#: Variables that tie a process to a running MPI job: Open MPI's singleton ``MPI_Init`` (a test or
#: script that made a one-process Communicator) sets them in the C environment, which every child
#: process inherits, and an ``mpirun`` started with them exits 1 without a word
JOB_VARIABLE_PREFIXES = ("PMIX_", "PMI_", "ORTE_", "OMPI_COMM_WORLD_", "OMPI_APP_CTX", "OMPI_UNIVERSE",
                         "OMPI_FIRST_RANKS", "OMPI_NUM_APP_CTX", "OMPI_FILE_LOCATION", "OMPI_MCA_orte_ess",
                         "OMPI_MCA_orte_launch", "OMPI_MCA_orte_precondition", "OMPI_MCA_orte_hnp",
                         "OMPI_MCA_ess", "OMPI_MCA_pmix", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")


def launcher_free_environ() -> dict[str, str]:
    """This process's environment without the variables of an MPI job it belongs to
    (:data:`JOB_VARIABLE_PREFIXES`): what a new ``mpirun`` must start from. User settings
    (``OMPI_MCA_btl``, ``OMPI_ALLOW_RUN_AS_ROOT``, ...) stay."""
    return {k: v for k, v in os.environ.items() if not k.startswith(JOB_VARIABLE_PREFIXES)}


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for launching MPI ranks: one thread per rank, oversubscription allowed, quiet TF, plus ``extra``.

    Starts from :func:`launcher_free_environ`, so a launcher that belongs to an MPI job itself
    (a one-process Communicator made earlier) still starts a fresh one."""
    env = launcher_free_environ()
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NUMBA_NUM_THREADS", "1")
    env = selected_mpi({**env, **(extra or {})}).environ(env)    # the implementation's settings
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if extra:
        env.update(extra)
    return env


def torchrun_command(nprocs: int, script: str | Path, *args: str) -> list[str]:
    """``torchrun`` (as ``python -m torch.distributed.run``) of ``script`` on ``nprocs`` local ranks.

    A fresh free port on 127.0.0.1 for the rendezvous, so concurrent launches
    never meet. The ranks form a ``torch.distributed`` job (gloo on CPU),
    no MPI world.
    """
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
            "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), *args]


def torchrun_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for ``torchrun`` ranks: no MPI launcher variables, one thread per rank, plus ``extra``.

    The repository root goes first on ``PYTHONPATH`` so the ranks import this
    checkout of ``horovod_compress``.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX_", "HVDC_LAUNCHED"))}
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONHASHSEED="0",
               TF_CPP_MIN_LOG_LEVEL="3")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if extra:
        env.update(extra)
    return env


CaseRef = Union[str, Callable[..., Any]]


class CaseFailed(AssertionError):
    """Raised when a test reads the result of an MPI case that failed on some rank."""


def find_cases(module_file: str | Path) -> list[str]:
    """The ``case_*`` functions defined at the top level of ``module_file``, in file order.

    Found by parsing, not importing, so the pytest process does not import what
    a case needs (a framework, a second MPI world) just to list them.
    """
    tree = ast.parse(Path(module_file).read_text(), filename=str(module_file))
    return [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("case_")]


def _case_name(case: CaseRef) -> str:
    return case if isinstance(case, str) else case.__name__


class CaseResults(Mapping):
    """Per-case results of :func:`run_cases`: ``results[case] -> {rank: value}``.

    ``case`` is the case function itself (``results[case_volume]``) or its
    name. Reading a case that failed raises :class:`CaseFailed` with that
    case's tracebacks and the job's output, so one failing case fails only
    the tests that read it; the cases after it ran in a fresh job.

    Every instance is entered in :data:`CASE_LEDGER` with which cases a test
    read, so a case that failed and that no test read still fails the run
    (the pytest plugin :mod:`horovod_compress.tools.testing_plugin` checks the
    ledger when a test module ends).
    """

    def __init__(self, values: dict[str, dict[int, Any]], failures: dict[str, str],
                 seconds: dict[str, float] | None = None, *, nprocs: int = 0,
                 module: str = "") -> None:
        self._values = values
        self._failures = failures
        self._seconds = dict(seconds or {})
        self.nprocs = nprocs
        self.module = module
        self.read: set[str] = set()
        self.failures_read = False
        CASE_LEDGER.append(self)
        CASES_RUN[selected_mpi().name] += len(values) + len(failures)

    def __getitem__(self, case: CaseRef) -> dict[int, Any]:
        name = _case_name(case)
        if name in self._failures:
            self.read.add(name)
            raise CaseFailed(self._failures[name])
        value = self._values[name]
        self.read.add(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._values) + list(self._failures))

    def __len__(self) -> int:
        return len(self._values) + len(self._failures)

    @property
    def failures(self) -> dict[str, str]:
        """Case name -> what went wrong, for the cases that failed (a test that reads this
        has seen every failure: none of them counts as unread)."""
        self.failures_read = True
        return dict(self._failures)

    @property
    def seconds(self) -> dict[str, float]:
        """Case name (and ``"(import)"``, the module's import, once per ``mpirun``) -> wall
        seconds on the slowest rank, for the cases that finished: where a module's time goes."""
        return dict(self._seconds)

    def unread_failures(self) -> dict[str, str]:
        """The failed cases no test has read (and :attr:`failures` not read either)."""
        if self.failures_read:
            return {}
        return {name: text for name, text in self._failures.items() if name not in self.read}

    def tally(self) -> dict[str, int]:
        """Case runs of this launch: ``ran``, ``read`` (by a test), ``failed``,
        ``failed_unread``."""
        ran = set(self._values) | set(self._failures)
        return {"ran": len(ran), "read": len(ran & self.read), "failed": len(self._failures),
                "failed_unread": len(self.unread_failures())}


#: Every :class:`CaseResults` made in this process, in order: what the pytest plugin
#: (:mod:`horovod_compress.tools.testing_plugin`) checks for failed cases nobody read and counts.
CASE_LEDGER: list[CaseResults] = []


def run_cases(nprocs: int, module_file: str | Path, cases: Sequence[CaseRef] | None = None,
              timeout: float = 300, env: dict[str, str] | None = None) -> CaseResults:
    """Run ``cases`` (default: every ``case_*`` of ``module_file``) on ``nprocs`` MPI ranks.

    Every rank imports ``module_file`` and calls each ``case(comm)`` in turn with
    a fresh :class:`Communicator`, recording each case's start and result as it
    goes. An exception on any rank aborts the job at once (no rank is left
    waiting in a collective); the case it happened in is marked failed with its
    tracebacks, and the cases after it run in a fresh ``mpirun``. A job that
    runs past ``timeout`` seconds is killed with all its processes, and the
    case then running is marked failed as a hang.
    """
    names = [_case_name(c) for c in cases] if cases is not None else find_cases(module_file)
    if not names:
        raise ValueError(f"no case_* functions in {module_file}")
    values: dict[str, dict[int, Any]] = {}
    failures: dict[str, str] = {}
    seconds: dict[str, float] = {}
    remaining = list(names)
    while remaining:
        done, failed, message, job_seconds = _run_job(nprocs, module_file, remaining, timeout, env)
        values.update(done)
        for case, secs in job_seconds.items():
            seconds[case] = seconds.get(case, 0.0) + secs
        if failed is not None:
            failures[failed] = message
        finished = set(done) | ({failed} if failed else set())
        if not finished or "(import)" in message:   # nothing ran: the same on every case
            failures.update({name: message for name in remaining if name not in done})
            break
        remaining = [n for n in remaining if n not in finished]
    return CaseResults(values, failures, seconds, nprocs=nprocs, module=Path(module_file).name)


def _slowest_seconds(events: dict[int, dict[str, dict[str, Any]]]) -> dict[str, float]:
    """Case -> the largest of the ranks' recorded wall seconds."""
    out: dict[str, float] = {}
    for ev in events.values():
        for case, secs in ev["seconds"].items():
            out[case] = max(out.get(case, 0.0), float(secs))
    return out


def _run_job(nprocs: int, module_file: str | Path, cases: list[str], timeout: float,
             env: dict[str, str] | None
             ) -> tuple[dict[str, dict[int, Any]], str | None, str, dict[str, float]]:
    """One ``mpirun``: the cases every rank finished, the case that failed (if any), why, and
    the seconds each case (and the import) took on the slowest rank."""
    with tempfile.TemporaryDirectory(prefix="hvdc-mpi-") as out:
        cmd = mpirun_command(nprocs) + [sys.executable, "-m", "horovod_compress.tools.testing",
                                        str(module_file), out, *cases]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=mpi_env(env), start_new_session=True)
        timed_out = False
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            stdout, stderr = proc.communicate()
        events = {rank: _read_events(Path(out, f"rank{rank}.jsonl")) for rank in range(nprocs)}
    done: dict[str, dict[int, Any]] = {}
    for case in cases:
        per_rank = {rank: ev["results"][case] for rank, ev in events.items()
                    if case in ev["results"]}
        if len(per_rank) < nprocs:
            break
        done[case] = per_rank
    seconds = _slowest_seconds(events)
    if proc.returncode == 0 and not timed_out and len(done) == len(cases):
        return done, None, "", seconds
    failed = next(c for c in cases if c not in done) if len(done) < len(cases) else None
    errors = "".join(f"--- rank {rank}, {case} ---\n{text}\n" for rank, ev in events.items()
                     for case, text in ev["errors"].items() if case in (failed, "(import)"))
    why = (f"hung: mpirun -np {nprocs} killed after {timeout:g} s" if timed_out
           else f"mpirun -np {nprocs} exited {proc.returncode}")
    message = (f"case {failed or '(after the last case)'} of {Path(module_file).name} failed on "
               f"real MPI ranks ({why})\n{errors}"
               f"--- stdout ---\n{stdout[-6000:]}\n--- stderr ---\n{stderr[-6000:]}")
    if failed is None:   # every case finished but the job did not exit cleanly
        return {}, cases[-1], message, seconds
    return done, failed, message, seconds


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill mpirun and every rank it started (they share its new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_events(path: Path) -> dict[str, dict[str, Any]]:
    """A rank's journal: ``{"results": {case: value}, "errors": {case: traceback},
    "seconds": {case or "(import)": wall seconds on this rank}}``."""
    events: dict[str, dict[str, Any]] = {"results": {}, "errors": {}, "seconds": {}}
    if not path.exists():
        return events
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:   # a line cut short by an abort
            continue
        if "error" in entry:
            events["errors"][entry["case"]] = entry["error"]
        elif "value" in entry:
            events["results"][entry["case"]] = entry["value"]
        if "seconds" in entry:
            events["seconds"][entry["case"]] = entry["seconds"]
    return events



# ------------------------------------------------- helpers for the cases themselves
def gather_float64(comm: Any, x: Any) -> Any:
    """All ranks' copies of ``x`` as float64, shape ``(P, *x.shape)``: for dense references."""
    import numpy as np
    return comm.allgather(np.ascontiguousarray(x, dtype=np.float64))


def same_on_all_ranks(comm: Any, x: Any) -> bool:
    """Whether ``x`` is bit for bit the same array on every rank (one allgather).

    Compares shape, dtype and bytes, so NaNs in the same places with the same
    payload agree and -0.0 differs from 0.0.
    """
    import numpy as np
    mine = np.ascontiguousarray(x)
    everyone = comm.allgather(mine)
    return all(other.shape == mine.shape and other.dtype == mine.dtype
               and other.tobytes() == everyone[0].tobytes() for other in everyone)


def ring_rounding_ok(comm: Any, measured: int, formula: float, op: str = "allreduce") -> bool:
    """Whether a rank's whole-byte count ``measured`` matches the volume model's ``formula``.

    Each ring allreduce a rank makes counts its own whole chunks
    (:func:`~horovod_compress.mpi_collectives.accounting.ring_allreduce_rank_bytes`): within two
    elements (at most 8 bytes each) of 2N(P-1)/P, its mean over the ranks. So ``measured``
    must be an int within 16 bytes per ``op`` call counted since the last ``reset_stats()``.
    """
    calls = comm.stats()["by_op"].get(op, {}).get("calls", 0)
    return isinstance(measured, int) and abs(measured - formula) <= 16 * max(calls, 1)


def relative_error(a: Any, b: Any) -> float:
    """``||a - b|| / ||b||`` in float64 (``||a - b||`` when ``b`` is zero)."""
    import numpy as np
    b = np.asarray(b, dtype=np.float64)
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(np.asarray(a, dtype=np.float64) - b)) / (nb if nb > 0 else 1.0)


def low_rank_gradient(shape: tuple[int, ...], rank: int, step: int, tid: int, seed: int = 0,
                      true_rank: int = 3, noise: float = 0.3, dtype: Any = "float32") -> Any:
    """A gradient of ``shape`` for low-rank methods: a rank-``true_rank`` part shared by every
    rank plus ``noise`` times this rank's own Gaussian noise, seeded by (seed, step, tid, rank).

    Reshaped as rows x (product of the other dimensions); a 1-D shape is one column.
    """
    import numpy as np
    rows, cols = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
    common = np.random.default_rng([seed, step, tid, 7])
    k = min(true_rank, rows, cols)
    scale = np.geomspace(4.0, 1.0, k)
    left = common.standard_normal((rows, k)) * scale
    base = left @ common.standard_normal((k, cols)) / np.sqrt(cols)
    own = np.random.default_rng([seed, step, tid, 1000 + rank]).standard_normal((rows, cols))
    return (base + noise * own).reshape(shape).astype(dtype)



def value_error_messages(calls: Sequence[Callable[[], Any]]) -> list[str]:
    """Each call's ``ValueError`` message; AssertionError if a call accepts its bad argument."""
    messages = []
    for call in calls:
        try:
            call()
        except ValueError as exc:
            messages.append(str(exc))
        else:
            raise AssertionError("bad argument accepted")
    return messages


class CheckRecorder:
    """Checks a script runs at import, each recorded as ``"ok"`` or its error (for scripts a
    launcher such as ``horovodrun`` starts, which report to the test through a JSON file).

    ``record(label, fn)`` runs ``fn()`` now; ``case`` decorates a ``case_*(comm)`` function,
    runs it now and records it under its name, which the test finds by name.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.report: dict[str, str] = {}

    def record(self, label: str, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` now; ``report[label]`` becomes ``"ok"`` or the error and its traceback."""
        try:
            fn()
            self.report[label] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded per check
            self.report[label] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"

    def case(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Decorator: run ``fn(comm)`` now, recorded under ``fn.__name__``; returns ``fn``."""
        self.record(fn.__name__, lambda: fn(self.comm))
        return fn


# ------------------------------------------- cases under a launcher of the caller's
def worker_command(module_file: str | Path, out_dir: str | Path,
                   cases: Sequence[CaseRef]) -> list[str]:
    """The command every rank runs for ``cases`` of ``module_file``, as under :func:`run_cases`,
    for a launch ``run_cases`` cannot make itself (e.g. ``mpirun`` inside an emulated
    cluster's network namespaces): prefix it with the launcher, then read the results
    with :func:`read_case_results` (``out_dir`` must exist and be empty)."""
    return [sys.executable, "-m", "horovod_compress.tools.testing", str(module_file), str(out_dir),
            *[_case_name(c) for c in cases]]


def read_case_results(out_dir: str | Path, nprocs: int) -> CaseResults:
    """What the ranks of a :func:`worker_command` launch recorded in ``out_dir``: a case every
    rank finished has its values; a case that raised on some rank is failed (reading it raises
    :class:`CaseFailed` with its tracebacks)."""
    events = {rank: _read_events(Path(out_dir, f"rank{rank}.jsonl")) for rank in range(nprocs)}
    names = {case for ev in events.values() for case in (*ev["results"], *ev["errors"])}
    values: dict[str, dict[int, Any]] = {}
    failures: dict[str, str] = {}
    for case in sorted(names):
        errors = "".join(f"--- rank {rank}, {case} ---\n{ev['errors'][case]}\n"
                         for rank, ev in events.items() if case in ev["errors"])
        per_rank = {rank: ev["results"][case] for rank, ev in events.items()
                    if case in ev["results"]}
        if errors or len(per_rank) < nprocs:
            failures[case] = (f"case {case} failed on some of {nprocs} ranks "
                              f"(finished on {sorted(per_rank)})\n{errors}")
        else:
            values[case] = per_rank
    return CaseResults(values, failures, _slowest_seconds(events), nprocs=nprocs,
                       module=str(out_dir))

def _worker_main(argv: list[str]) -> None:
    import importlib.util

    from mpi4py import MPI

    from ..mpi_collectives import Communicator

    module_file, out_dir, *cases = argv
    rank = MPI.COMM_WORLD.Get_rank()
    journal = open(Path(out_dir, f"rank{rank}.jsonl"), "a", buffering=1)

    def record(entry: dict[str, Any]) -> None:
        journal.write(json.dumps(entry, default=_jsonable) + "\n")
        journal.flush()
        os.fsync(journal.fileno())

    spec = importlib.util.spec_from_file_location("hvdc_mpi_cases", module_file)
    module = importlib.util.module_from_spec(spec)
    case = "(import)"
    try:
        started = time.perf_counter()
        spec.loader.exec_module(module)
        record({"case": "(import)", "seconds": time.perf_counter() - started})
        for case in cases:
            started = time.perf_counter()
            comm = Communicator()
            value = getattr(module, case)(comm)
            record({"case": case, "value": value, "seconds": time.perf_counter() - started})
            MPI.COMM_WORLD.Barrier()
    except BaseException:  # noqa: BLE001 - any failure must abort every rank
        text = traceback.format_exc()
        sys.stderr.write(f"[rank {rank}] case {case} failed:\n{text}")
        sys.stderr.flush()
        record({"case": case, "error": text})
        MPI.COMM_WORLD.Abort(1)
    journal.close()


def _jsonable(obj: Any) -> Any:
    import numpy as np
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"case returned a non-JSON value of type {type(obj).__name__}")


def simulator_check_results(script: Union[str, Path], timeout: float) -> dict[str, str]:
    """Run a test file's checks under Numba's CUDA simulator, in a subprocess; their results.

    ``NUMBA_ENABLE_CUDASIM=1`` must be set before Numba is imported, so such a
    file runs its checks when executed as a script and prints
    ``{check name: "ok" | traceback}`` as JSON on its last line. Raises
    ``AssertionError`` with the end of its output when the process fails.
    """
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=Path(script).resolve().parent.parent)
    if proc.returncode != 0:
        raise AssertionError(f"simulator run failed (exit {proc.returncode})\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
