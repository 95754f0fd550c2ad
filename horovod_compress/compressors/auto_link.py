"""The link check of ``Compression.auto``: a timed collective of a fixed size, whatever method runs.

The drift windows (:class:`.auto_decide.DriftMonitor`) watch the running
method's own exchange time. Where that time is mostly compression (a
sparsifier's selection, or Global-QSGD's pipelined ring hiding the wire
behind its work), a link that gets ten times faster barely moves it, and a
candidate that the faster link would now favour (dense, say) is never
tried. The link check measures the link itself, independently of the method:
every ``every`` calls of one bucket (the first one ``auto`` measured), all
ranks run :data:`LINK_REPEATS` dense allreduces of ``nbytes`` bytes back to
back (a size at which the bandwidth term dominates the latency term on a
1-10 Gbit link: the Hockney model's ``alpha + L / B`` with ``L / B`` several
times ``alpha``) and keep the fastest but the first: the first lines the
ranks up and drains what a traffic shaper lets through at line rate after an
idle spell (a token bucket's burst: the emulated cluster's is 256 KiB at
1 Gbit, so an idle link would pass a lone 256 KiB message at 10 Gbit speed),
and of the others a call that met interference (a rank descheduled on a
busy machine) is only ever slower. The ranks agree on the smallest time
over ranks (one 8-byte allreduce, of the times negated under ``max``, so
the drift windows' ratios ride in it under ``max`` too): the rank that
entered a collective last waited for no peer, so its time is the
collective's own, while a rank that entered early also timed its wait for a
peer the scheduler had not run (four ranks on two cores); a link that got
slower slows every rank's call, the last one's included. Every rank sees
the same number.

The first check after a decision is the reference; a later check whose time,
divided by the reference, leaves ``[1 / (1 + band), 1 + band]`` is a strike,
and ``patience`` strikes in a row mean the link changed: every measured bucket
decides again, with its latency probes taken again. The same rule as the
drift windows (:class:`.auto_decide.DriftMonitor` with one-sample windows):
noise inside the band never triggers, one check outside it does not either.
A link that stays calm is checked less often: after :data:`CALM_CHECKS`
checks in a row inside the band, the checks come every :data:`CALM_FACTOR`
times ``every`` calls, and the first check out of band brings them back to
every ``every`` calls, so the strikes after it come at the base spacing
(a drift window out of band is confirmed by its bucket's next window, which
waits for a check at most ``every`` calls and is then agreed on its own). A
change after a calm spell is then noticed within ``(CALM_FACTOR + patience
- 1) * every`` calls (40 at the defaults: 10 calls, 2 strikes), a change
early in the run within ``patience * every``; a check's cost, fixed whatever
the step, weighs a third as much on a long run of short steps.

A change after which no bucket switched method (the check met a loaded
machine's phases, or the change did not matter) doubles the checks out of
band the next one needs, up to twice ``patience`` (``Auto`` sets
:attr:`LinkCheck.patience`; a change that made a bucket switch resets it).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from .auto_decide import DriftMonitor
from .auto_measure import MeasureHook

#: Allreduces per check, back to back (the first untimed, the fastest of the others counts).
LINK_REPEATS = 3
#: In-band checks in a row after which the link counts as calm and is checked less often.
CALM_CHECKS = 10
#: A calm link is checked every this many times ``every`` calls (the first strike resets it).
CALM_FACTOR = 3
#: The measured kind the link check's seconds pass through ``measure_hook`` as.
LINK_KIND = "link"


def link_seconds(comm: Any, nbytes: int, hook: MeasureHook,
                 extra: Sequence[float] = ()) -> tuple[float, float, list[float]]:
    """(seconds of one dense allreduce of ``nbytes`` bytes: the fastest of :data:`LINK_REPEATS`
    but the first, after a barrier, through ``hook``, the smallest over ranks (identical on every rank); this
    rank's seconds in the barrier, a wait for later peers that the run pays anyway; the largest
    over ranks of each of ``extra``, agreed in the same 8-byte-per-value allreduce: the drift
    windows' ratios ride along)."""
    buf = np.zeros(max(nbytes // 4, 1), np.float32)
    t_wait = time.perf_counter()
    comm.barrier()
    wait = time.perf_counter() - t_wait
    comm.allreduce(buf)
    best = float("inf")
    for _ in range(LINK_REPEATS - 1):
        t0 = time.perf_counter()
        comm.allreduce(buf)
        best = min(best, time.perf_counter() - t0)
    # max of the negated time: the smallest over ranks, in the allreduce that takes the extras' max
    mine = np.array([-hook(LINK_KIND, best, float(buf.nbytes)), *extra], np.float64)
    agreed = comm.allreduce(mine, "max") if comm.size > 1 else mine
    return -float(agreed[0]), wait, [float(v) for v in agreed[1:]]


@dataclass
class LinkCheck:
    """When to time the link, and whether it changed since the reference (module docstring)."""

    every: int
    band: float
    patience: int
    nbytes: int = 0                       # the probe's size the reference was taken at
    monitor: dict[str, Any] | None = None  # a DriftMonitor's fields: its predicted_s is the reference
    calm: int = 0                         # in-band checks in a row since the reference
    last: int = 0                         # the lead bucket's call that took the last check
    checks: int = 0                       # checks taken since the process started or resumed
    waited: float = 0.0                   # the last check's wait for peers at its barrier
    agreed: list = field(default_factory=list)   # the last check's agreed extra values

    @property
    def spacing(self) -> int:
        """Calls of the lead bucket between two checks now: ``every``, or :data:`CALM_FACTOR`
        times it once the link has been calm for :data:`CALM_CHECKS` checks."""
        return self.every * (CALM_FACTOR if self.calm >= CALM_CHECKS else 1)

    def due(self, calls: int) -> bool:
        """Whether the lead bucket's ``calls``-th call checks the link."""
        return self.every > 0 and calls - self.last >= self.spacing

    def check(self, comm: Any, nbytes: int, hook: MeasureHook, calls: int,
              extra: Sequence[float] = ()) -> bool:
        """Time the link at the lead bucket's ``calls``-th call; ``True`` when ``patience`` checks
        in a row left the band. The seconds this rank waited for its peers at the check's barrier
        are in :attr:`waited`; ``extra`` values agreed (their maximum over ranks) in the same
        allreduce are in :attr:`agreed`."""
        seconds, self.waited, self.agreed = link_seconds(comm, nbytes, hook, extra)
        self.checks += 1
        self.last = calls
        if self.monitor is None or nbytes != self.nbytes:     # a new reference
            self.nbytes = nbytes
            ref = DriftMonitor(max(seconds, 1e-9), 1, self.band, self.patience)
            ref.close_window(1.0)
            self.monitor = ref.as_dict()
            self.calm = 0
            return False
        monitor = DriftMonitor(**self.monitor)
        changed = monitor.close_window(seconds / monitor.predicted_s)
        self.monitor = monitor.as_dict()
        self.calm = self.calm + 1 if monitor.strikes == 0 else 0
        return changed

    def reset(self) -> None:
        """Take a new reference at the next check (after the decisions a change triggered)."""
        self.monitor = None
        self.calm = 0

    def ratio(self) -> float:
        """The last check's time over the reference's (1 before any check)."""
        return 1.0 if self.monitor is None else float(self.monitor["last_ratio"])

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain values (checkpoints; ``checks`` is this process's count)."""
        return {k: v for k, v in asdict(self).items() if k not in ("checks", "waited", "agreed")}


__all__ = ["CALM_CHECKS", "CALM_FACTOR", "LINK_KIND", "LINK_REPEATS", "LinkCheck", "link_seconds"]
