"""What ``Compression.auto`` measures before it chooses, and how the ranks agree on it.

For one bucket ``x`` (this rank's gradient) and each candidate method, a
**dry run** is one call of a throw-away copy of the candidate (fresh state,
no warm-up) on a copy of ``x`` on the real communicator, all ranks starting
together (a barrier). The Communicator's counters around it give

* per collective ``op``: calls, bytes sent and received per rank (its volume
  model, "Near-Optimal Sparse Allreduce for Distributed Deep Learning", Li &
  Hoefler, PPoPP'22, Table 1) and seconds inside MPI -- the probe of that
  collective at the bucket's own message size, on the communicator given;
* the compression time: the call's wall time less its time inside MPI
  (the per-call 1-byte agreement, where a rank waits for peers, excluded);
* the relative compression error ``||avg_c - avg|| / ||avg||`` against the
  exact average (the dense candidate's result, or one dense allreduce).

A **tiny probe** times each used collective with an 8-byte message: its
latency, the model's ``alpha`` (the rounds of Table 1 divide it).

Every rank measures its own; :func:`agree` replaces each number by its
maximum over ranks (one float64 allreduce, exact and order-independent), so
every rank then runs the same model on the same numbers and takes the same
decision, however the ranks' clocks disagreed.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..feedback import make_feedback
from ..kernels.arrays import get_array_module, to_host
from .state import MethodScratch

#: The collectives a method's calls are counted under (the Communicator's op names), in the
#: fixed order of the agreement vector.
OPS = ("allreduce", "allgather", "allgatherv", "allgather_object", "alltoall", "alltoallv",
       "broadcast", "p2p")
#: Bytes of the tiny probe's message (the latency term).
TINY_BYTES = 8
#: Every candidate runs a second dry run; after it, only those within this factor of the
#: fastest run the further rounds asked for (the others cannot win), and those still warming up
#: (:data:`WARMING_RATIO`) run again whatever their time; when only the fastest is left, no
#: further round runs (it would refine the winner's own prediction, not the choice).
PRUNE_FACTOR = 1.5
#: A candidate whose last dry run took less than this fraction of the one before is still warming
#: up (buffers sized, a threshold hint formed: a fresh Top-k copy on 11.6M values took 319, 162,
#: then 22 ms), so it runs again, even past ``dry_runs`` and whatever its time, up to
#: :data:`MAX_WARMING_CALLS` calls; its fastest call counts.
WARMING_RATIO = 2 / 3
#: The most dry runs of one candidate at one decision, while it is still warming up.
MAX_WARMING_CALLS = 5
#: Dry runs a candidate with error feedback gets at least (within :data:`MAX_WARMING_CALLS`): its
#: residual is formed by its first call and first added by its second, each allocating and
#: faulting in an n-element buffer the later calls reuse, so its steady call is the third (a
#: fresh Top-k copy on 4 Mi values: 21.9, 21.5, then 10.3 and 8.6 ms, kernels already loaded).
FEEDBACK_SETTLE_CALLS = 3
#: The error of a measurement taken without a reference (``errors=False``).
NO_ERROR = -1.0
#: Timing op of the per-call agreement (a wait for peers, not the method's exchange).
AGREE_OP = "agree"

#: ``hook(kind, seconds, nbytes) -> seconds``: every measured time passes through it (``kind``:
#: a collective's name, or ``"compress:<method>"`` for a method's time outside MPI); tests
#: inject a slower or disagreeing link with it.
MeasureHook = Callable[[str, float, float], float]


def _identity(kind: str, seconds: float, nbytes: float) -> float:
    return seconds


@dataclass
class OpProbe:
    """One collective as a call of a method used it: calls, bytes per rank, seconds inside MPI."""

    calls: float = 0.0
    sent: float = 0.0
    received: float = 0.0
    seconds: float = 0.0
    tiny_s: float = 0.0      # one call with an 8-byte message

    @property
    def moved(self) -> float:
        """Bytes the op moved per rank under the volume model (a full-duplex link: the larger way)."""
        return max(self.sent, self.received)


@dataclass
class Measurement:
    """One candidate on one bucket: its compression time, error and collectives."""

    compress_s: float = 0.0
    error: float = 0.0
    ops: dict[str, OpProbe] = field(default_factory=dict)

    def mpi_s(self) -> float:
        """Seconds inside MPI over every collective of the call."""
        return sum(o.seconds for o in self.ops.values())

    def as_vector(self) -> list[float]:
        """``[compress_s, error, (calls, sent, received, seconds, tiny_s) per op of OPS]``."""
        out = [self.compress_s, self.error]
        for op in OPS:
            o = self.ops.get(op, OpProbe())
            out += [o.calls, o.sent, o.received, o.seconds, o.tiny_s]
        return out

    @classmethod
    def from_vector(cls, v: Sequence[float]) -> "Measurement":
        """The inverse of :meth:`as_vector` (ops without calls left out)."""
        m = cls(float(v[0]), float(v[1]))
        for i, op in enumerate(OPS):
            calls, sent, received, seconds, tiny = (float(a) for a in v[2 + 5 * i: 7 + 5 * i])
            if calls > 0:
                m.ops[op] = OpProbe(calls, sent, received, seconds, tiny)
        return m


VECTOR_LEN = 2 + 5 * len(OPS)


class CallClock:
    """The Communicator's bytes and seconds inside MPI per op, as deltas around a call."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self._bytes = comm.stats()["by_op"]
        self._seconds = comm.timings()["by_op"]
        self._t0 = time.perf_counter()

    def stop(self, hook: MeasureHook = _identity) -> tuple[float, dict[str, OpProbe]]:
        """(wall seconds outside MPI, per-op counts and hooked seconds) since construction.

        The per-call agreement's seconds (op ``agree``) are left out of both:
        they are a wait for peers, not the exchange.
        """
        wall = time.perf_counter() - self._t0
        after_b, after_s = self.comm.stats()["by_op"], self.comm.timings()["by_op"]
        ops: dict[str, OpProbe] = {}
        mpi = 0.0
        for op in OPS:
            b0, b1 = self._bytes.get(op, {}), after_b.get(op, {})
            calls = b1.get("calls", 0) - b0.get("calls", 0)
            seconds = after_s.get(op, 0.0) - self._seconds.get(op, 0.0)
            mpi += seconds
            if calls > 0:
                sent = b1["sent"] - b0.get("sent", 0.0)
                received = b1["received"] - b0.get("received", 0.0)
                ops[op] = OpProbe(calls, sent, received, hook(op, seconds, max(sent, received)))
        other = sum(after_s.get(op, 0.0) - self._seconds.get(op, 0.0)
                    for op in after_s if op not in OPS)
        return max(wall - mpi - other, 0.0), ops


class StepClock:
    """A real step's exchange seconds, cheaply: its wall time less the seconds it spent in ops
    that are not the exchange's own (the per-call agreement's wait for peers, barriers).

    The same number :class:`CallClock` gives as compression plus every op's seconds, from one
    read of the Communicator's timings before and after (no byte counts): what every call of
    ``auto`` pays to watch for drift.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self._seconds = comm.timings()["by_op"]
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds of the exchange since construction."""
        wall = time.perf_counter() - self._t0
        after = self.comm.timings()["by_op"]
        other = sum(t - self._seconds.get(op, 0.0) for op, t in after.items() if op not in OPS)
        return max(wall - other, 0.0)


def dry_run(method: Any, x: Any, name: str, comm: Any,
            hook: MeasureHook = _identity) -> tuple[Measurement, Any]:
    """One timed call of ``method`` (a throw-away copy) on a copy of ``x``; (measurement, its average)."""
    comm.barrier()
    clock = CallClock(comm)
    avg = method.allreduce(x.copy(), name, comm)
    compress_s, ops = clock.stop(hook)
    return Measurement(hook(f"compress:{method.name}", compress_s, 0.0), 0.0, ops), avg


#: Attributes of a method a dry run's copy does not take: per-tensor state, scratch buffers,
#: pending agreements, the signatures already checked (the copy checks its own).
_PER_TENSOR = ("state", "feedback", "scratch", "_finite_gates", "_signatures")


def throwaway_copy(method: Any) -> Any:
    """A copy of ``method``'s configuration with no per-tensor state and no warm-up (what a dry
    run calls): its error feedback starts from zero, as a bucket's first step does."""
    clone = copy.copy(method)
    clone.__dict__ = copy.deepcopy({k: v for k, v in method.__dict__.items() if k not in _PER_TENSOR})
    clone.state = {}
    clone.scratch = MethodScratch()
    clone.feedback = make_feedback(method.name, method.feedback.name, **method.feedback.params())
    clone._signatures = set()
    clone.warmup_steps = 0
    return clone


#: Untimed calls of each method in :func:`preload` (the second runs the error-feedback paths
#: that a first call from a zero residual does not).
PRELOAD_CALLS = 2


def preload(methods: Sequence[Any], x: Any, name: str, comm: Any) -> None:
    """:data:`PRELOAD_CALLS` untimed calls of a throw-away copy of each method on ``x`` (a small
    array of the buckets' dtype and device): the process's one-off costs of each method's first
    calls -- loading its compiled kernels from Numba's cache, importing the modules it needs,
    creating shared-memory windows -- paid here once, so no decision's timings carry them."""
    for method in methods:
        clone = throwaway_copy(method)
        for _ in range(PRELOAD_CALLS):
            comm.barrier()
            clone.allreduce(x.copy(), name, comm)


def relative_error(avg: Any, reference: Any) -> float:
    """``||avg - reference|| / ||reference||`` in the arrays' own precision (a float32 norm is
    exact to about 1e-7 of the error it measures; 0 for two zero vectors)."""
    a = np.asarray(to_host(avg)).ravel()
    r = np.asarray(to_host(reference)).ravel()
    norm = float(np.linalg.norm(r))
    err = float(np.linalg.norm(a - r))
    return err / norm if norm > 0 else (0.0 if err == 0 else float("inf"))


def tiny_probes(comm: Any, ops: Sequence[str], repeats: int,
                hook: MeasureHook = _identity) -> dict[str, float]:
    """Median seconds of one ``op`` call moving an 8-byte message, per op in ``ops``."""
    p, rank = comm.size, comm.rank
    small = np.zeros(TINY_BYTES // 4, np.float32)
    dest, src = (rank + 1) % p, (rank - 1) % p

    def shift() -> None:
        req = comm.isend(small, dest, tag=0x4155)
        comm.recv(src, tag=0x4155, dtype=np.float32)
        req.wait()
    calls = {"allreduce": lambda: comm.allreduce(small),
             "allgather": lambda: comm.allgather(small),
             "allgatherv": lambda: comm.allgatherv(small),
             "allgather_object": lambda: comm.allgather_object(0),
             "alltoall": lambda: comm.alltoall(np.zeros(p, np.float32)),
             "alltoallv": lambda: comm.alltoallv([small] * p),
             "broadcast": lambda: comm.broadcast(small),
             "p2p": shift}
    out = {}
    for op in ops:
        times = []
        for _ in range(repeats):
            comm.barrier()
            t0 = time.perf_counter()
            calls[op]()
            times.append(time.perf_counter() - t0)
        out[op] = hook(op, float(np.median(times)), float(TINY_BYTES))
    return out


def agree(comm: Any, measurements: Sequence[Measurement]) -> list[Measurement]:
    """Each number of ``measurements`` replaced by its maximum over ranks (one allreduce).

    The maximum is exact and does not depend on the order MPI reduces in, so
    every rank holds the same numbers afterwards; ranks must pass the same
    number of measurements (the candidates, in the same order).
    """
    v = np.array([m.as_vector() for m in measurements], np.float64)
    v = comm.allreduce(v.ravel(), "max").reshape(v.shape) if comm.size > 1 else v
    return [Measurement.from_vector(row) for row in v]


def measure_candidates(methods: Sequence[Any], x: Any, name: str, comm: Any, *,
                       dry_runs: int, probe_repeats: int, reference: Any = None,
                       hook: MeasureHook = _identity, prune_factor: float | None = PRUNE_FACTOR,
                       tiny_cache: dict[str, float] | None = None,
                       errors: bool = True) -> list[Measurement]:
    """Dry runs of every method on ``x``, the tiny probes of the ops they used, agreed over ranks.

    The methods run in turn, ``dry_runs`` rounds of one call each (one throw-away copy per
    method), so a slow phase of a shared machine falls on several candidates rather than on
    all of one's calls; after the second round only those within ``prune_factor`` of the
    fastest run the further rounds (all of them with ``None``), and a method whose last call took less than
    :data:`WARMING_RATIO` of its previous one runs again whatever its time, up to
    :data:`MAX_WARMING_CALLS` calls (it is still warming up), as does one with error feedback
    until its :data:`FEEDBACK_SETTLE_CALLS`-th call (with ``dry_runs`` above 1). Each method's measurement is its
    fastest call (a call's first ones pay one-off costs: allocation, a threshold search; a call
    that met interference is slower, never faster). ``reference``:
    the exact average, where the caller has it; otherwise the first method whose name is
    ``none`` gives it, or one dense allreduce. ``tiny_cache``: latency probes already taken
    on this communicator (op -> seconds, this rank's); only the ops missing from it are
    probed, and their probes are added to it. ``errors=False``: where no method is ``none``,
    the errors are not measured (no dense allreduce for a reference) and read :data:`NO_ERROR`.
    """
    clones = [throwaway_copy(m) for m in methods]
    settle = [FEEDBACK_SETTLE_CALLS if m.feedback.name != "none" else 0 for m in methods]
    measured: list[Measurement | None] = [None] * len(methods)
    averages: list[Any] = [None] * len(methods)
    running = list(range(len(methods)))
    last = [float("inf")] * len(methods)          # each method's previous call, agreed
    best_agreed = [float("inf")] * len(methods)   # each method's fastest call, agreed
    rounds = max(dry_runs, MAX_WARMING_CALLS) if dry_runs > 1 else 1
    for round_ in range(rounds):
        now = []
        for i in running:
            m, averages[i] = dry_run(clones[i], x, name, comm, hook)
            now.append(m.compress_s + m.mpi_s())
            best = measured[i]
            if best is None or now[-1] < best.compress_s + best.mpi_s():
                measured[i] = m
        if round_ + 1 == rounds:
            break
        # the times are agreed first (the maximum over ranks), so every rank keeps the same
        agreed = comm.allreduce(np.array(now, np.float64), "max") if comm.size > 1 else now
        for i, t in zip(running, agreed):
            best_agreed[i] = min(best_agreed[i], float(t))
        fastest = min(best_agreed)                # the same on every rank: agreed times only
        asked, warming = [], []
        # a running candidate has run every round so far (one left out never returns): its
        # calls are round_ + 1
        for i, t in zip(running, agreed):
            if (t < WARMING_RATIO * last[i] or round_ + 1 < settle[i]) and round_ + 1 < MAX_WARMING_CALLS:
                warming.append(i)                 # still getting faster (or settling): again
            elif round_ == 0 or (round_ + 1 < dry_runs
                                 and (prune_factor is None or t <= prune_factor * fastest)):
                asked.append(i)                   # a second call; then the rounds asked for
            last[i] = float(t)
        if round_ > 0 and not warming and len(asked) < 2:
            break         # only the fastest left: more rounds would refine its own prediction
        running = sorted(asked + warming)
        if not running:
            break
    if reference is None:
        dense = [i for i, m in enumerate(methods) if m.name == "none"]
        if dense:
            reference = averages[dense[0]]
        elif errors:
            xp = get_array_module(x)
            reference = comm.allreduce(xp.asarray(x, dtype=xp.float64), op="avg")
    used = sorted({op for m in measured for op in m.ops}, key=OPS.index)
    tiny = {} if tiny_cache is None else tiny_cache
    tiny.update(tiny_probes(comm, [op for op in used if op not in tiny], probe_repeats, hook))
    for m, avg in zip(measured, averages):
        m.error = NO_ERROR if reference is None else relative_error(avg, reference)
        for op, probe in m.ops.items():
            probe.tiny_s = tiny[op]
    return agree(comm, measured)


__all__ = ["FEEDBACK_SETTLE_CALLS", "NO_ERROR", "OPS", "CallClock", "StepClock", "Measurement", "MeasureHook", "OpProbe", "agree", "dry_run",
           "measure_candidates", "preload", "relative_error", "throwaway_copy", "tiny_probes"]
