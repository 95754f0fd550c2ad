"""How ``Compression.auto`` turns agreed measurements into a decision, and when it decides again.

Pure functions of numbers every rank holds identically (see
:mod:`.auto_measure`), so every rank computes the same result.

**Prediction.** A candidate's exchange on a bucket is priced with the
project's alpha-beta model (:mod:`horovod_compress.cost_model`; Ok-Topk,
Li & Hoefler, PPoPP'22, Section 2 and Table 1):

    T = T_compress + sum_op calls_op * (rounds_op(P) * alpha_op + L_op / (eta_op * B))

``alpha_op`` from the op's tiny probe (divided by Table 1's rounds),
``eta_op * B`` the rate the op reached in the candidate's dry run at the
bucket's own message size ``L_op`` (:func:`cost_model.fit_link`), and
``T_compress`` the dry run's time outside MPI.

**Choice.** Among the candidates whose measured relative compression error
is within the budget (all of them without one), the smallest ``s_c * T``;
the candidate listed first wins a tie. ``s_c`` is the candidate's **steps
factor**: how many times dense's steps it needs to reach the same loss
(:data:`STEPS_FACTORS`, measured in the project's time-to-accuracy study,
``benchmarks/time_to_accuracy.md``). Time to a given loss is steps times
step time, so a method whose step is faster but that needs ``s_c`` times
the steps pays only when its exchange is more than ``s_c`` times faster.
Weighing the bucket's exchange alone (not the whole step, which the
extra steps also repeat) under-weighs the extra steps, so the factor
errs towards the faster exchange. A bucket that already has a method keeps
it unless the best is better by more than ``switch_margin`` (a fraction of
the current one's weighed prediction): the first half of the hysteresis.

**Drift.** After a decision, every real step's exchange time (outside the
agreement's wait) is divided by the prediction; at the end of a window of
``window`` steps the ranks agree on the largest median of that ratio (in
the next link check's allreduce, :mod:`.auto_link`, where the windows of
every bucket due ride along; one 8-byte allreduce of its own without link
checks). The first window is the reference (the model's bias on
this bucket, clamped to the band); a later window whose ratio, divided by the reference, leaves
``[1 / (1 + band), 1 + band]`` is a strike, and ``patience`` strikes in a
row trigger a new measurement and decision: the second half of the
hysteresis (one slow step, or one slow window, does not).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any, Sequence

from ..cost_model import OpCount, StepProfile, fit_link, predict
from .auto_measure import TINY_BYTES, Measurement

#: Steps to the same loss as dense, per method (the steps factor of the module docstring), from
#: the time-to-accuracy study (byte-level GPT, Adam, P = 4; ``benchmarks/time_to_accuracy.md``,
#: steps to dense's final validation loss over dense's steps) for the flat methods a candidate
#: can be: fp16 1.00, Global-QSGD 1.13 and 1.20 (QSGD, its per-bucket-norm form, taken alike),
#: Ok-Topk 1.47 (with its 32 dense warm-up steps) on the emulated cluster; TopkA 2.27,
#: Gaussian-k 2.00 and DeepReduce 2.00 in a longer run on shared memory (up to 3x dense's
#: steps). Methods not listed take :data:`BIASED_STEPS_FACTOR` when they run with error
#: feedback, as the sparsifiers measured.
STEPS_FACTORS = {"none": 1.0, "fp16": 1.0, "bf16": 1.0, "global_qsgd": 1.2, "qsgd": 1.2,
                 "oktopk": 1.5, "topk": 2.3, "gaussiank": 2.0, "deepreduce": 2.0}
#: The steps factor of a method the table does not list: biased ones (those run with error
#: feedback) as the sparsifiers measured, the others as dense.
BIASED_STEPS_FACTOR = 2.0


def steps_factor(method: Any, overrides: dict[str, float] | None = None) -> float:
    """``method``'s steps factor: ``overrides`` first, then :data:`STEPS_FACTORS`, then
    :data:`BIASED_STEPS_FACTOR` for a method with error feedback and 1.0 for one without."""
    name = method.name
    if overrides and name in overrides:
        return float(overrides[name])
    if name in STEPS_FACTORS:
        return STEPS_FACTORS[name]
    return BIASED_STEPS_FACTOR if method.feedback.name != "none" else 1.0


#: The link rate the fit is expressed against; each op's fitted efficiency carries its real rate,
#: so the nominal value cancels out of every prediction.
NOMINAL_BITS_PER_S = 1e9


def predict_exchange(label: str, m: Measurement, world_size: int, scale: float = 1.0) -> float:
    """Predicted seconds of one exchange of the bucket by the candidate measured as ``m``.

    ``scale``: ``m`` was measured on a slice of the bucket ``scale`` times smaller (the bound of
    :func:`bound_candidates`): the compression time and every op's bytes grow by ``scale``, each
    op keeps the latency its tiny probe gave and the rate its dry run reached at the slice's
    message size, so the bandwidth term grows linearly (the alpha-beta model's extrapolation).
    """
    probes = {}
    for op, o in m.ops.items():
        per_call_s = o.seconds / o.calls
        per_call_bytes = max(o.moved / o.calls, float(TINY_BYTES))
        probes[op] = (min(o.tiny_s, per_call_s), per_call_s, per_call_bytes, world_size)
    profile = StepProfile(method=label, world_size=world_size, compute_s=0.0,
                          compress_s=scale * m.compress_s,
                          ops={op: OpCount(o.calls, max(scale * o.sent, TINY_BYTES),
                                           max(scale * o.received, TINY_BYTES))
                               for op, o in m.ops.items()})
    if not probes:
        return scale * m.compress_s
    p = predict(profile, fit_link(NOMINAL_BITS_PER_S, probes))
    return p.compress_s + p.comm_s


@dataclass
class Decision:
    """One bucket's decision: what runs it, why, and what the others were predicted at."""

    bucket: str
    chosen: str
    predicted_ms: float
    measured_ms: float            # the chosen candidate's dry run (compression + MPI)
    runner_up: str | None
    runner_up_ms: float | None
    reason: str                   # "first call", "drift", "world size"
    step: int                     # the bucket's call count when it was taken
    world_size: int
    numel: int
    candidates: dict[str, dict[str, Any]] = field(default_factory=dict)   # label -> ms, error, eligible
    switched: bool = True
    seq: int = -1                 # its place in the method's decision log
    shared_with: str | None = None   # the bucket of the same shape whose measurement it reuses

    def as_dict(self) -> dict[str, Any]:
        """The decision as plain values (what ``decisions()`` and checkpoints hold)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Decision":
        """The inverse of :meth:`as_dict`."""
        return cls(**d)

    def line(self) -> str:
        """The one log line of this decision."""
        def steps(label: str) -> str:
            f = self.candidates.get(label, {}).get("steps_factor", 1.0)
            return f" x{f:g} steps" if f != 1.0 else ""
        runner = (f"runner-up {self.runner_up} {self.runner_up_ms:.2f} ms{steps(self.runner_up)}"
                  if self.runner_up else "no runner-up")
        kept = "" if self.switched else " (kept: the best was not faster by the switch margin)"
        shared = f", as bucket {self.shared_with!r}" if self.shared_with else ""
        return (f"auto: bucket {self.bucket!r} ({self.numel} values, P={self.world_size}, "
                f"{self.reason}{shared}, call {self.step}): {self.chosen} predicted {self.predicted_ms:.2f} ms"
                f"{steps(self.chosen)}, "
                f"measured {self.measured_ms:.2f} ms; {runner}{kept}")


def choose(labels: Sequence[str], predicted: Sequence[float], errors: Sequence[float],
           error_budget: float | None, current: str | None = None,
           switch_margin: float = 0.0, factors: Sequence[float] | None = None
           ) -> tuple[str, str | None, list[bool]]:
    """(chosen, runner-up, eligible per candidate) by the rule of the module docstring.

    ``factors``: each candidate's steps factor (1 for all when not given); the ranking is by
    ``factor * predicted``. With an error budget that no candidate meets, the one with the least
    error is chosen (the budget cannot be honoured; the decision says so through ``eligible``).
    """
    weighed = list(predicted) if factors is None else [p * f for p, f in zip(predicted, factors)]
    eligible = [error_budget is None or e <= error_budget for e in errors]
    pool = [i for i, ok in enumerate(eligible) if ok]
    if not pool:
        pool = [min(range(len(labels)), key=lambda i: (errors[i], i))]
    ranked = sorted(pool, key=lambda i: (weighed[i], i))
    best = ranked[0]
    if current is not None and current in labels:
        cur = labels.index(current)
        if cur in pool and weighed[best] >= weighed[cur] * (1.0 - switch_margin):
            best = cur
    others = [i for i in ranked if i != best]
    return labels[best], (labels[others[0]] if others else None), eligible


@dataclass
class DriftMonitor:
    """One bucket's measured exchange time against its prediction, in windows of steps.

    A window's statistic is the median of its steps' measured / predicted seconds (one step
    slowed by the scheduler does not move it). The first window after a decision is the
    reference: the model's error on this bucket as the real steps meet it (a method's steady
    steps differ from its dry run by a stable factor: buffers already allocated, thresholds
    reused), clamped to the band, so a link that changed within that first window still
    shows; later windows are compared with it, so the band measures a change of the link,
    not the model's own bias.
    """

    predicted_s: float
    window: int
    band: float
    patience: int
    samples: list = field(default_factory=list)
    reference: float | None = None
    strikes: int = 0
    last_ratio: float = 1.0       # the last window's agreed measured / predicted

    def observe(self, seconds: float) -> bool:
        """Add one step's measured seconds; ``True`` when a window is complete (time to agree)."""
        self.samples.append(seconds / max(self.predicted_s, 1e-9))
        return len(self.samples) >= self.window

    def ratio(self) -> float:
        """This rank's window: the median of measured / predicted over its last ``window`` steps
        (a window agreed late, at a link check that comes less often than every ``window``
        steps, reads the latest steps, not the older ones it held while it waited)."""
        return float(median(self.samples[-self.window:])) if self.samples else 1.0

    def close_window(self, agreed_ratio: float) -> bool:
        """Start a new window after the ranks agreed on ``agreed_ratio``; ``True``: decide again."""
        self.samples = []
        self.last_ratio = agreed_ratio
        if self.reference is None:     # the model's bias, as far as the band allows
            self.reference = min(max(agreed_ratio, 1.0 / (1.0 + self.band)), 1.0 + self.band)
            return False
        drift = agreed_ratio / self.reference
        outside = drift > 1.0 + self.band or drift < 1.0 / (1.0 + self.band)
        self.strikes = self.strikes + 1 if outside else 0
        return self.strikes >= self.patience

    def as_dict(self) -> dict[str, Any]:
        """The monitor's fields as plain values (checkpoints)."""
        return asdict(self)


__all__ = ["BIASED_STEPS_FACTOR", "Decision", "DriftMonitor", "NOMINAL_BITS_PER_S", "STEPS_FACTORS", "choose",
           "predict_exchange", "steps_factor"]
