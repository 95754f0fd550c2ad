"""``Compression.auto()``: the method that picks itself, per bucket, from the measured link.

Which compressor pays depends on what a script cannot see when it is
written: the link, P, the tensors' shapes, the CPU or GPU compression runs
on. Agarwal et al. ("On the Utility of Gradient Compression in Distributed
Training Systems", MLSys'22) found it paid in few of the setups they
studied; Espresso (Wang et al., EuroSys'23) prices each tensor with an
alpha-beta timeline, but with link constants given by hand and the
algorithm chosen by the user. ``auto`` measures and chooses:

1. On a bucket's first call (and whenever it decides again) every candidate
   runs ``dry_runs`` times (in turn with the others; its fastest call counts)
   on a throw-away copy of itself, on a copy of the bucket, on the
   communicator given: its compression time, its collectives' calls, bytes
   and seconds at the bucket's own message sizes, and its relative error
   against the exact average (:mod:`.auto_measure`). A tiny
   probe of each collective gives the latency term. The ranks agree on the
   numbers (their maximum over ranks), so all take the same decision.
2. The alpha-beta model prices every candidate; the one whose exchange time
   times its steps factor (how many times dense's steps it needs to the same
   loss, measured in the project's time-to-accuracy study; ``steps_factors``)
   is smallest, among those whose error is within ``error_budget``, runs the
   bucket from this call on (:mod:`.auto_decide`). Dense (``none``) and ``fp16`` are candidates, so
   when no compressor pays, one of them is chosen.
3. Each real step's exchange time is compared with the prediction over
   windows of ``window`` steps (the ranks agree on a complete window in the
   next link check's allreduce, so the windows cost no collective of their
   own); ``patience`` windows in a row outside the
   band ``band`` (a link got slower or faster) trigger a new measurement, and
   a method is replaced only by one predicted faster by ``switch_margin``.
   A new world size (an elastic reset) decides again at once.
4. Every ``link_every`` calls of the first bucket it measured, a timed dense
   allreduce of a fixed size checks the link itself (:mod:`.auto_link`): a
   link that changed speed shows there even where the running method's
   exchange time hides it (a compression-bound sparsifier); ``patience``
   checks in a row outside the band make every measured bucket decide again.
   After ten checks in a row inside the band the checks come three times
   less often, until the first one outside it.

Switching a bucket from a method with EF14 error feedback hands its
residual ``e`` (what compression has not yet delivered) to the next step:
the next call exchanges ``g + e`` with the new method, so nothing is dropped
(Seide et al. 2014; Ok-Topk's Algorithm 2 keeps the same invariant within
one method). The decisions, the drift windows, a residual waiting to be
flushed and every candidate's state are in :meth:`state_dict`.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import numpy as np

from ..kernels.arrays import get_array_module, is_cupy, is_gpu_array, to_device_like, to_host
from ..kernels.dispatch import PARALLEL_MIN_SIZE
from ..kernels.selection import SAMPLED_MIN_SIZE
from ..params import check_float, check_int
from ..mpi_collectives import world as _world
from ..mpi_collectives.consistency import TensorMismatchError
from .auto_bound import BOUND_MIN_SLICE, bound_candidates
from .auto_decide import Decision, DriftMonitor, choose, predict_exchange, steps_factor
from .auto_link import LinkCheck
from .auto_measure import NO_ERROR, CallClock, MeasureHook, StepClock, measure_candidates, preload
from .base import Method, TensorState
from .registry import MethodFactory, create, register

#: The default candidates, each at its paper's defaults (the biased ones with EF14 error
#: feedback), none needing another learning rate than dense: dense, the 16-bit cast,
#: Global-QSGD's 8-bit exponential dithering, Top-k at 1% density, DeepReduce (that Top-k in
#: Huffman-coded containers), Ok-Topk. Random-k is not among them: its unbiased form needs a
#: smaller learning rate (its variance grows as n/k). Nor is Gaussian-k: how many entries its
#: estimated threshold selects follows the residual's distribution, so the dry runs on a
#: bucket's first gradient do not predict its later calls (4.7 MB per step where its dry run
#: predicted a third of that, on the e2e Transformer at P = 4). Both join only when listed.
DEFAULT_CANDIDATES = ("none", "fp16", "global_qsgd", "topk", "deepreduce", "oktopk")
#: Error feedback ``auto`` can carry across a switch (EF14's residual is exactly what compression
#: has not delivered yet; EF21's trackers are not a debt that can be paid into another method).
CARRIED_FEEDBACK = ("none", "residual")
#: Buckets below this many values are latency-bound: every candidate costs at least dense's
#: rounds there, so they run dense without measuring.
DEFAULT_MIN_NUMEL = 4096

#: Values of the array the process's first decision preloads every candidate on (or the bucket's
#: own size, if smaller): large enough for the kernels that only large vectors take (the sampled
#: top-k bound from 64 Ki values, the multi-threaded kernels from 128 Ki), which a smaller array
#: would leave to the first dry run (a Top-k copy's first call on 4 Mi values: 93 ms after a
#: preload on 8 Ki values, 22 ms after one on 128 Ki).
PRELOAD_NUMEL = max(BOUND_MIN_SLICE, SAMPLED_MIN_SIZE, PARALLEL_MIN_SIZE)
#: A drift re-decision that keeps the bucket's method doubles the windows out of band the next
#: one needs, up to this factor times ``patience`` (a switch, or any other decision, resets it).
DRIFT_BACKOFF = 2
#: The link check's message (bytes) when the largest measured bucket is larger: at 1 Gbit its
#: allreduce at P = 2 takes about 2 ms, at 10 Gbit about 0.2 ms plus the latency, so the
#: bandwidth term shows a 10x change of the link several-fold.
DEFAULT_LINK_BYTES = 1 << 18

log = logging.getLogger(__name__)


def _candidate(item: Any, seed: int) -> Method:
    """A candidate method from a name, an uncalled ``Compression.<name>`` or a method."""
    if isinstance(item, str):
        method = create(item, seed=seed)
    elif isinstance(item, MethodFactory):
        method = item()
    elif isinstance(item, Method):
        method = item
    else:
        raise ValueError(f"auto: candidates must be method names, Compression.<name> or methods, "
                         f"got {item!r}")
    if method.name == "auto":
        raise ValueError("auto: a candidate cannot itself be auto")
    if method.layout != "flat":
        raise ValueError(f"auto: candidate {method.name!r} works per matrix (layout "
                         f"{method.layout!r}); auto runs on fused buckets and takes flat methods only: "
                         f"use Compression.{method.name}(...) directly for it")
    if method.feedback.name not in CARRIED_FEEDBACK:
        raise ValueError(f"auto: candidate {method.name!r} uses feedback={method.feedback.name!r}; "
                         f"auto carries error feedback across a switch for {list(CARRIED_FEEDBACK)} only")
    return method


@register
class Auto(Method):
    """Chooses, per bucket, the candidate whose measured exchange, weighed by the steps it needs to
    dense's loss, is shortest on the measured link (see the module docstring).

    Parameters
    ----------
    candidates: method names, ``Compression.<name>`` factories or methods (flat ones, each
        once); default :data:`DEFAULT_CANDIDATES`. The first listed wins a tie.
    steps_factors: ``{method name: factor}`` overriding :data:`.auto_decide.STEPS_FACTORS`, how
        many times dense's steps a candidate needs to the same loss (at least 1); its exchange
        time is weighed by it. ``{name: 1.0 for each}`` ranks by exchange time alone.
    error_budget: the largest relative compression error ``||avg_c - avg|| / ||avg||`` a
        candidate may show on the bucket (measured at each decision) to be chosen; ``None``:
        no limit (each default candidate is an accepted method at its paper's defaults).
    dry_runs: timed calls per candidate at each decision, in rounds over the candidates
        (its fastest call is the measurement).
    probe_repeats: repeats of each collective's tiny (latency) probe.
    window, band, patience: a new decision when the mean measured / predicted exchange time
        of ``patience`` consecutive windows of ``window`` steps leaves ``[1/(1+band), 1+band]``.
    switch_margin: a bucket changes method only for one predicted faster by this fraction.
    min_numel: smaller buckets run dense without measuring.
    link_every: calls of the first measured bucket between two link checks (:mod:`.auto_link`;
        0: no link check; three times as many once ten checks in a row met a calm link);
        ``patience`` checks in a row outside ``band`` decide again.
    link_bytes: the link check's allreduce size (capped at the largest measured bucket's bytes).
    measure_hook: ``hook(kind, seconds, nbytes) -> seconds`` applied to every time measured
        (``kind``: a collective's name, or ``"compress:<method>"``); for tests and what-if runs. Not part
        of the configuration.
    """

    name = "auto"
    layout = "flat"

    def __init__(self, *, candidates: Sequence[Any] | None = None, error_budget: float | None = None,
                 steps_factors: dict[str, float] | None = None,
                 dry_runs: int = 2, probe_repeats: int = 3, window: int = 10, band: float = 1.0,
                 patience: int = 2, switch_margin: float = 0.1, min_numel: int = DEFAULT_MIN_NUMEL,
                 link_every: int = 10, link_bytes: int = DEFAULT_LINK_BYTES,
                 seed: int = 0, measure_hook: MeasureHook | None = None) -> None:
        super().__init__(seed=seed)
        items = DEFAULT_CANDIDATES if candidates is None else candidates
        if isinstance(items, (str, Method, MethodFactory)) or len(items) == 0:
            raise ValueError(f"auto: candidates must be a non-empty list of methods, got {items!r}")
        methods = [_candidate(c, self.seed) for c in items]
        labels = [m.name for m in methods]
        if len(set(labels)) != len(labels):
            raise ValueError(f"auto: list each method once in candidates, got {labels}")
        self.candidates: dict[str, Method] = dict(zip(labels, methods))
        overrides = dict(steps_factors or {})
        unknown = sorted(set(overrides) - set(labels))
        if unknown:
            raise ValueError(f"auto: steps_factors names {unknown}, which are not candidates {labels}")
        for lb, f in overrides.items():
            overrides[lb] = check_float(self.name, f"steps_factors[{lb!r}]", f, 1.0, None)
        self.steps_factors: dict[str, float] = {lb: steps_factor(m, overrides)
                                                for lb, m in self.candidates.items()}
        self.error_budget = None if error_budget is None else \
            check_float(self.name, "error_budget", error_budget, 0.0, None)
        self.dry_runs = check_int(self.name, "dry_runs", dry_runs, 1, 100)
        self.probe_repeats = check_int(self.name, "probe_repeats", probe_repeats, 1, 1000)
        self.window = check_int(self.name, "window", window, 1)
        self.band = check_float(self.name, "band", band, 0.0, None, low_open=True)
        self.patience = check_int(self.name, "patience", patience, 1)
        self.switch_margin = check_float(self.name, "switch_margin", switch_margin, 0.0, 1.0,
                                         high_open=True)
        self.min_numel = check_int(self.name, "min_numel", min_numel, 0)
        self.link_every = check_int(self.name, "link_every", link_every, 0)
        self.link_bytes = check_int(self.name, "link_bytes", link_bytes, 8)
        self.measure_hook: MeasureHook | None = measure_hook
        self._decisions: dict[str, Decision] = {}
        self._monitors: dict[str, DriftMonitor] = {}
        self._redecide: set[str] = set()
        self._relink: set[str] = set()          # buckets to decide again after a link change
        self._link = LinkCheck(self.link_every, self.band, self.patience)
        self._link_bucket: str | None = None    # the bucket whose calls time the link checks
        self._link_cap = 0                      # the largest measured bucket's bytes
        self._link_kept = True                  # no bucket switched since the last link change
        self._pending: dict[str, np.ndarray] = {}
        self._history: list[Decision] = []
        self._calls: dict[str, int] = {}
        self._by_shape: dict[str, int] = {}     # "numel/dtype/P" -> the latest measured decision's seq
        self._tiny: dict[str, float] = {}       # latency probes of this link, op -> seconds
        self._tiny_world = 0                    # the world size they were taken at
        self._cost = {"deciding_s": 0.0, "first_s": 0.0, "first_calls_s": 0.0, "again_s": 0.0,
                      "loading_s": 0.0, "checking_s": 0.0, "link_s": 0.0, "link_checks": 0, "link_changes": 0,
                      "drift_agreements": 0,
                      "measured": 0, "rechecked": 0, "shared": 0, "ruled_out": 0}
        self._active: Method | None = None
        self._loaded: set[str] = set()          # dtypes whose candidates this process has called
        self.set_nonfinite(self.nonfinite)

    # ------------------------------------------------------------- settings
    def _measured(self, kind: str, seconds: float, nbytes: float) -> float:
        """A measured time as the decision sees it: through ``measure_hook`` where one is given."""
        return seconds if self.measure_hook is None else self.measure_hook(kind, seconds, nbytes)

    def params(self) -> dict[str, Any]:
        return {"candidates": tuple(repr(m) for m in self.candidates.values()),
                "error_budget": self.error_budget,
                "steps_factors": tuple(sorted(self.steps_factors.items())), "dry_runs": self.dry_runs,
                "probe_repeats": self.probe_repeats, "window": self.window, "band": self.band,
                "patience": self.patience, "switch_margin": self.switch_margin,
                "min_numel": self.min_numel, "link_every": self.link_every,
                "link_bytes": self.link_bytes}

    def set_nonfinite(self, policy: str | None) -> None:
        """The NaN/Inf policy, for ``auto`` and every candidate."""
        super().set_nonfinite(policy)
        for m in self.__dict__.get("candidates", {}).values():
            m.set_nonfinite(self.nonfinite)

    @property
    def skipped_steps(self) -> int:          # type: ignore[override]
        """Steps dropped under ``nonfinite="skip"``, by whichever candidate ran them."""
        return self.__dict__.get("_own_skipped", 0) + \
            sum(m.skipped_steps for m in self.__dict__.get("candidates", {}).values())

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._own_skipped = value

    @property
    def state(self) -> dict[str, TensorState]:      # type: ignore[override]
        """Each bucket's state in the method that runs it (a view; :meth:`state_dict` saves every
        candidate's state whole)."""
        decisions = self.__dict__.get("_decisions", {})
        return {b: self.candidates[d.chosen].state[b] for b, d in decisions.items()
                if b in self.candidates[d.chosen].state}

    @state.setter
    def state(self, value: dict) -> None:
        """Ignored: the candidates hold the state (``Method.__init__`` and the base restore set it)."""

    def _restore_states(self, saved: dict) -> dict:
        """None of its own: each candidate restores its tensors' state (:meth:`load_state_dict`)."""
        return {}

    @property
    def last_step_skipped(self) -> bool:     # type: ignore[override]
        active = self.__dict__.get("_active")
        return bool(active is not None and active.last_step_skipped)

    @last_step_skipped.setter
    def last_step_skipped(self, value: bool) -> None:
        """Ignored: the active candidate sets its own flag, which the getter reads (the base
        class's reset of it at each call has nothing to reset here)."""

    # ------------------------------------------------------------- exchange
    def allreduce(self, grad: Any, name: str, comm: Any) -> Any:
        """The average of ``grad`` over ranks by the method chosen for bucket ``name``."""
        _world.ensure_abort_on_exception(comm)
        if is_gpu_array(grad):          # CuPy: each candidate runs as it runs CuPy; others staged
            if not is_cupy(grad):
                self.device_calls["staged"] += 1
                return to_device_like(self.allreduce(to_host(grad), name, comm), grad)
            self.device_calls["native"] += 1
        self._calls[name] = self._calls.get(name, 0) + 1
        if name == self._link_bucket and comm.size > 1 and self._link.due(self._calls[name]):
            self._check_link(comm)
        decision = self._decisions.get(name)
        if decision is None:
            self._decide(grad, name, comm, "first call")
        elif decision.world_size != comm.size:
            self._decide(grad, name, comm, "world size")
        elif decision.numel != grad.size:
            self._decide(grad, name, comm, "new shape")
        elif name in self._relink:        # the link check: the more specific of the two reasons
            self._decide(grad, name, comm, "link")
        elif name in self._redecide:
            self._decide(grad, name, comm, "drift")
        inner = self._active = self.candidates[self._decisions[name].chosen]
        x = grad
        debt = self._pending.pop(name, None)
        if debt is not None:           # the previous method's residual, flushed into this step
            x = grad.astype(debt.dtype) + debt.reshape(grad.shape)
        if self.measure_hook is None:        # the cheap clock: one read of the timings each side
            step_clock = StepClock(comm)
            out = inner.allreduce(x, name, comm)
            if not inner.last_step_skipped:
                self._watch(name, inner, step_clock.stop(), comm)
        else:
            clock = CallClock(comm)
            out = inner.allreduce(x, name, comm)
            compress_s, ops = clock.stop(self._measured)
            if not inner.last_step_skipped:
                compress_s = self._measured(f"compress:{inner.name}", compress_s, 0.0)
                self._watch(name, inner, compress_s + sum(o.seconds for o in ops.values()), comm)
        return out.astype(grad.dtype, copy=False) if out.dtype != grad.dtype else out

    def _watch(self, name: str, inner: Method, seconds: float, comm: Any) -> None:
        """Count one step of ``name`` in its drift window (not the chosen method's warm-up steps)."""
        st = inner.state.get(name)
        if st is not None and st.t <= inner.warmup_steps:
            return
        monitor = self._monitors[name]
        if not monitor.observe(seconds):
            return
        # a complete window waits for the next link check, whose allreduce agrees it at no extra
        # collective; alone (one 8-byte allreduce) without link checks at least once a window,
        # when the lead bucket has not been called for another link interval (its calls are
        # the checks' clock); after a strike the window that confirms it waits at most the base
        # interval, not a calm link's longer one
        wait = self.link_every if monitor.strikes else self._link.spacing
        if self._folds_drift(comm) and len(monitor.samples) < monitor.window + wait:
            return
        t0 = time.perf_counter()
        ratio = np.array([monitor.ratio()], np.float64)
        agreed = float(comm.allreduce(ratio, "max")[0]) if comm.size > 1 else float(ratio[0])
        if monitor.close_window(agreed):
            self._redecide.add(name)
        self._cost["checking_s"] += time.perf_counter() - t0
        self._cost["drift_agreements"] += 1

    def _folds_drift(self, comm: Any) -> bool:
        """Whether complete drift windows are agreed in the link checks' allreduce: when a check
        comes at least once a window at the base spacing (a window then waits at most the
        checks' current spacing, :attr:`.auto_link.LinkCheck.spacing`, more calls)."""
        return (comm.size > 1 and 0 < self.link_every <= self.window
                and self._link_bucket is not None)

    def _due_windows(self) -> list[str]:
        """The buckets whose drift window is complete (the same on every rank: each rank counts
        the same calls), in a fixed order."""
        return sorted(b for b, m in self._monitors.items() if len(m.samples) >= m.window)

    def _check_link(self, comm: Any) -> None:
        """Time the link (:class:`.auto_link.LinkCheck`); on a change, every measured bucket
        decides again at its next call, with its latency probes taken again."""
        t0 = time.perf_counter()
        due = self._due_windows()
        changed = self._link.check(comm, min(self.link_bytes, self._link_cap), self._measured,
                                   self._calls[self._link_bucket],
                                   [self._monitors[b].ratio() for b in due])
        for b, agreed in zip(due, self._link.agreed):
            if self._monitors[b].close_window(agreed):
                self._redecide.add(b)
        if changed:
            self._relink.update(b for b, d in self._decisions.items() if "min_numel" not in d.reason)
            self._tiny = {}
            self._link_kept = True
            self._cost["link_changes"] += 1
            if comm.rank == 0:
                log.info("auto: the link check took %.3f x its reference for %d checks in a row: "
                         "every bucket decides again", self._link.ratio(), self.patience)
            self._link.reset()
        spent = time.perf_counter() - t0 - self._link.waited    # not the wait for later peers
        self._cost["checking_s"] += spent
        self._cost["link_s"] += spent
        self._cost["link_checks"] += 1

    # ------------------------------------------------------------- decisions
    def _decide(self, grad: Any, name: str, comm: Any, reason: str) -> None:
        """Decide for bucket ``name`` (:meth:`_decide_now`), its wall time counted in
        :meth:`decision_cost`."""
        t0 = time.perf_counter()
        loading = self._cost["loading_s"]
        try:
            self._decide_now(grad, name, comm, reason)
        finally:
            spent = time.perf_counter() - t0 - (self._cost["loading_s"] - loading)
            self._cost["deciding_s"] += spent
            self._cost["first_calls_s" if reason == "first call" else "again_s"] += spent
            if self._cost["first_s"] == 0.0 and self._cost["measured"]:
                self._cost["first_s"] = spent

    def _decide_now(self, grad: Any, name: str, comm: Any, reason: str) -> None:
        """Measure the candidates on this bucket (or reuse a bucket of the same shape's fresh
        measurement), choose, log, and switch if the choice changed.

        First the ranks check that they hold the same bucket and the same ``auto``, by the
        agreement every call of every method starts with (a 1-byte allgather, then a digest
        allgather where a rank's signature is new; :class:`TensorMismatchError` on every rank
        otherwise), before any dry run.
        """
        try:
            self._agree_step(comm, self._signature(grad, np.dtype(grad.dtype), name), True)
        except TensorMismatchError:
            self._calls[name] -= 1          # the call did not happen on any rank
            raise
        self._redecide.discard(name)
        self._relink.discard(name)
        current = self._decisions.get(name)
        step = self._calls[name]
        x = grad.astype(np.float64 if grad.dtype == np.float64 else np.float32, copy=False)
        if x.size < self.min_numel:
            labels = list(self.candidates)
            chosen = "none" if "none" in self.candidates else labels[0]
            decision = Decision(name, chosen, 0.0, 0.0, None, None, f"{reason}, below min_numel",
                                step, comm.size, int(x.size))
        else:
            shape = f"{x.size}/{x.dtype.str}/{comm.size}"
            seq = self._by_shape.get(shape, -1)
            if seq > (current.seq if current is not None else -1):   # measured since: reuse it
                decision = self._shared_decision(self._history[seq], name, reason, step, current)
            else:
                self._preload(x, name, comm)
                decision = self._measured_decision(x, name, comm, reason, step, current)
                self._by_shape[shape] = len(self._history)
            self._link_cap = max(self._link_cap, int(x.nbytes))
            if self._link_bucket is None:
                self._link_bucket = name
            if reason == "world size":
                self._link.reset()          # another P: another reference time
        decision.seq = len(self._history)
        decision.switched = current is None or current.chosen != decision.chosen
        if current is not None and decision.switched:
            self._hand_over(name, self.candidates[current.chosen])
        self._decisions[name] = decision
        self._history.append(decision)
        patience = self.patience
        previous = self._monitors.get(name)
        if reason == "drift" and not decision.switched and previous is not None:
            # a re-decision that kept the method: the drift was noise (a loaded machine's phases),
            # so the next one needs twice the windows, up to DRIFT_BACKOFF x the setting
            patience = min(2 * previous.patience, DRIFT_BACKOFF * self.patience)
        self._monitors[name] = DriftMonitor(max(decision.predicted_ms, 0.0) / 1e3, self.window,
                                            self.band, patience)
        if reason == "link":
            self._link_kept = self._link_kept and not decision.switched
            if not self._relink:        # every bucket has decided again after the link change
                # none switched: the change was noise or did not matter, so the next one needs
                # twice the checks out of band, up to DRIFT_BACKOFF x the setting
                self._link.patience = min(2 * self._link.patience, DRIFT_BACKOFF * self.patience) \
                    if self._link_kept else self.patience
        if comm.rank == 0:
            log.info(decision.line())

    def _preload(self, x: Any, name: str, comm: Any) -> None:
        """The process's first measured decision for ``x``'s dtype first calls every candidate
        twice on an array of :data:`PRELOAD_NUMEL` values, or the bucket's size if smaller
        (:func:`.auto_measure.preload`: loading compiled kernels, imports); its seconds are
        ``loading_s`` in :meth:`decision_cost`, not part of ``deciding_s``."""
        if x.dtype.str in self._loaded:
            return
        t0 = time.perf_counter()
        n = min(int(x.size), PRELOAD_NUMEL)
        xp = get_array_module(x)
        small = xp.asarray(np.random.default_rng(self.seed).standard_normal(n), dtype=x.dtype)
        preload(list(self.candidates.values()), small, f"{name}#load", comm)
        self._loaded.add(x.dtype.str)
        self._cost["loading_s"] += time.perf_counter() - t0

    def _choice(self, name: str, reason: str, step: int, world_size: int, numel: int,
                table: dict[str, dict[str, Any]], current: Decision | None) -> Decision:
        """The decision the rule of :func:`choose` takes on a table of predictions and errors."""
        labels = list(table)
        factors = [self.steps_factors[lb] for lb in labels]
        chosen, runner, eligible = choose(labels, [table[lb]["predicted_ms"] for lb in labels],
                                          [table[lb]["error"] for lb in labels], self.error_budget,
                                          current.chosen if current else None, self.switch_margin,
                                          factors)
        for lb, ok, f in zip(labels, eligible, factors):
            table[lb]["eligible"] = ok
            table[lb]["steps_factor"] = f
        return Decision(name, chosen, table[chosen]["predicted_ms"], table[chosen]["measured_ms"],
                        runner, table[runner]["predicted_ms"] if runner else None, reason, step,
                        world_size, numel, table)

    def _measured_decision(self, x: Any, name: str, comm: Any, reason: str, step: int,
                           current: Decision | None) -> Decision:
        """Bound the candidates on a slice, dry-run the rest on the bucket, price, choose."""
        if reason == "drift" or self._tiny_world != comm.size:
            self._tiny, self._tiny_world = {}, comm.size      # the link changed: probe it again
        labels = list(self.candidates)
        methods = list(self.candidates.values())
        factors = [self.steps_factors[lb] for lb in labels]
        keep, sliced, scale, bounds = bound_candidates(labels, methods, x, name, comm,
                                                       probe_repeats=self.probe_repeats,
                                                       hook=self._measured, tiny_cache=self._tiny,
                                                       factors=factors)
        # a drift or a link change is re-priced on the slices first (measured on the link as it
        # is now): the running method stays without dry runs on the bucket unless another
        # candidate's bound beats its own by the switch margin
        if reason in ("drift", "link") and sliced is not None and current is not None \
                and current.chosen in labels:
            cur = labels.index(current.chosen)
            weighed = [b * f for b, f in zip(bounds, factors)]
            if min(weighed) >= weighed[cur] * (1.0 - self.switch_margin):
                return self._rechecked_decision(name, reason, step, comm, int(x.size), current,
                                                labels, sliced, scale)
            # a challenger: the running method and every candidate the bound keeps are dry-run
            # on the bucket (the best bound alone can be the slices' error: at 10 Gbit a dense
            # slice priced itself below the 16-bit cast's, which won on the bucket)
            keep = sorted(set(keep) | {cur})
        measured = list(sliced) if sliced is not None else [None] * len(labels)
        scales = [scale] * len(labels)
        self._cost["measured"] += 1
        while True:
            full = measure_candidates([methods[i] for i in keep], x, name, comm,
                                      dry_runs=self.dry_runs, probe_repeats=self.probe_repeats,
                                      hook=self._measured, tiny_cache=self._tiny,
                                      errors=sliced is None or self.error_budget is not None)
            for i, m in zip(keep, full):
                if m.error == NO_ERROR:             # no reference on the bucket: the slice's error
                    m.error = sliced[i].error
                measured[i], scales[i] = m, 1.0
            table = {lb: {"predicted_ms": 1e3 * predict_exchange(lb, m, comm.size, sc),
                          "measured_ms": 1e3 * sc * (m.compress_s + m.mpi_s()),
                          "compress_ms": 1e3 * sc * m.compress_s, "error": m.error,
                          "dry_run": "bucket" if sc == 1.0 else f"slice 1/{sc:g}"}
                     for lb, m, sc in zip(labels, measured, scales)}
            decision = self._choice(name, reason, step, comm.size, int(x.size), table, current)
            chosen = labels.index(decision.chosen)
            if scales[chosen] == 1.0:
                break
            # the winner was priced on the slice alone: the candidates kept measured slower on the
            # bucket than their slices promised, so it is dry-run on the bucket before it can win
            keep = [chosen]
        self._cost["ruled_out"] += sum(sc != 1.0 for sc in scales)
        return decision

    def _rechecked_decision(self, name: str, reason: str, step: int, comm: Any, numel: int,
                            current: Decision, labels: list[str], sliced: list[Any],
                            scale: float) -> Decision:
        """A drift or link re-check the slices settled: no other candidate's bound beats the
        current method's by the switch margin, so it stays without dry runs on the whole bucket, its
        prediction the exchange time the last window measured (the old prediction times the
        window's agreed ratio); the others keep their extrapolated rows."""
        self._cost["rechecked"] += 1
        now_ms = current.predicted_ms * self._monitors[name].last_ratio
        table = {lb: {"predicted_ms": 1e3 * predict_exchange(lb, m, comm.size, scale),
                      "measured_ms": 1e3 * scale * (m.compress_s + m.mpi_s()),
                      "compress_ms": 1e3 * scale * m.compress_s, "error": m.error,
                      "dry_run": f"slice 1/{scale:g}"} for lb, m in zip(labels, sliced)}
        table[current.chosen].update(predicted_ms=now_ms, measured_ms=now_ms,
                                     dry_run="the last window's steps")
        ok = [self.error_budget is None or table[lb]["error"] <= self.error_budget for lb in labels]
        for lb, eligible in zip(labels, ok):
            table[lb]["eligible"] = eligible
            table[lb]["steps_factor"] = self.steps_factors[lb]
        others = sorted((table[lb]["predicted_ms"] * table[lb]["steps_factor"], i)
                        for i, lb in enumerate(labels) if lb != current.chosen and ok[i])
        runner = labels[others[0][1]] if others else None
        return Decision(name, current.chosen, now_ms, now_ms, runner,
                        table[runner]["predicted_ms"] if runner else None, f"{reason}, re-checked",
                        step, comm.size, numel, table)

    def _shared_decision(self, source: Decision, name: str, reason: str, step: int,
                         current: Decision | None) -> Decision:
        """The decision on ``source``'s measurement (a bucket of the same values, dtype and P,
        measured after this bucket's last decision), with this bucket's own hysteresis."""
        self._cost["shared"] += 1
        table = {lb: dict(row) for lb, row in source.candidates.items()}
        decision = self._choice(name, reason, step, source.world_size, source.numel, table, current)
        decision.shared_with = source.bucket
        return decision

    def _hand_over(self, name: str, previous: Method) -> None:
        """Take ``name``'s state out of the method that ran it; keep its EF14 residual as a debt
        the next call pays (exchanged with the new method), so no gradient mass is dropped."""
        st = previous.state.pop(name, None)
        residual = None if st is None else getattr(st.feedback, "residual", None)
        if residual is not None:
            self._pending[name] = np.array(residual, copy=True) if isinstance(residual, np.ndarray) \
                else residual.copy()

    def decisions(self) -> dict[str, dict[str, Any]]:
        """Each bucket's current decision (chosen method, predicted and measured ms, runner-up,
        every candidate's prediction and error), as plain values."""
        return {b: d.as_dict() for b, d in self._decisions.items()}

    def decision_log(self) -> list[dict[str, Any]]:
        """Every decision taken so far, in order (a bucket appears once per decision)."""
        return [d.as_dict() for d in self._history]

    def decision_cost(self) -> dict[str, float]:
        """What deciding has cost this process so far: ``deciding_s`` (wall seconds of the calls
        that decided, less their own exchange: bounds, dry runs, probes, agreement),
        ``loading_s`` (the process's one-off start-up, apart: every candidate's first call on a
        small array before the first measured decision, which loads its compiled kernels and
        imports its modules; not in ``deciding_s``), ``first_s`` (the first decision that
        measured), ``first_calls_s`` (every
        bucket's first decision) and ``again_s`` (the decisions after a drift, a new world size
        or a new bucket size, or after a link change; the two add up to ``deciding_s``), ``checking_s`` (the drift
        windows' agreements and the link checks), ``link_s`` (the link checks' share of it, the
        windows they agreed included), ``drift_agreements`` (windows agreed on their own, in an
        8-byte allreduce: without link checks, or when the lead bucket was not called),
        ``link_checks`` and ``link_changes`` (checks taken, and those that found the link
        changed), ``measured`` (decisions that measured), ``rechecked`` (drift
        and link re-checks the slices settled: the method stayed, no dry run on the bucket),
        ``shared`` (decisions that reused a bucket of the same shape's measurement) and
        ``ruled_out`` (candidates the bound spared a dry run on the whole bucket). Timings of
        this process, not part of the checkpoint."""
        return dict(self._cost)

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Base state plus the decisions, drift windows, debts and every candidate's state."""
        sd = super().state_dict()
        sd["auto"] = {
            "decisions": self.decisions(), "history": self.decision_log(),
            "monitors": {b: m.as_dict() for b, m in self._monitors.items()},
            "redecide": sorted(self._redecide), "calls": dict(self._calls),
            "relink": sorted(self._relink), "link": self._link.as_dict(),
            "link_bucket": self._link_bucket, "link_cap": self._link_cap,
            "link_kept": self._link_kept,
            "by_shape": dict(self._by_shape), "tiny": dict(self._tiny), "tiny_world": self._tiny_world,
            "pending": {b: np.array(np.asarray(getattr(v, "get", lambda: v)()), copy=True)
                        for b, v in self._pending.items()},
            "inner": {lb: m.state_dict() for lb, m in self.candidates.items()},
        }
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (of an ``auto`` with the same candidates)."""
        super().load_state_dict(sd)
        saved = sd.get("auto", {})
        inner = saved.get("inner", {})
        if sorted(inner) != sorted(self.candidates):
            raise ValueError(f"auto: checkpoint holds candidates {sorted(inner)}, this auto has "
                             f"{sorted(self.candidates)}; resume it with "
                             f"Compression.auto(candidates={list(inner)})")
        for lb, m in self.candidates.items():
            m.load_state_dict(inner[lb])
        self._decisions = {b: Decision.from_dict(d) for b, d in saved.get("decisions", {}).items()}
        self._history = [Decision.from_dict(d) for d in saved.get("history", [])]
        self._monitors = {b: DriftMonitor(**m) for b, m in saved.get("monitors", {}).items()}
        self._redecide = set(saved.get("redecide", []))
        self._relink = set(saved.get("relink", []))
        link = saved.get("link", {})
        # a checkpoint from before the calm spacing checked at multiples of link_every
        lead = int(saved.get("calls", {}).get(saved.get("link_bucket"), 0))
        self._link = LinkCheck(self.link_every, self.band, int(link.get("patience", self.patience)),
                               int(link.get("nbytes", 0)), link.get("monitor"), int(link.get("calm", 0)),
                               int(link.get("last", lead - lead % max(self.link_every, 1))))
        self._link_kept = bool(saved.get("link_kept", True))
        self._link_bucket = saved.get("link_bucket")
        self._link_cap = int(saved.get("link_cap", 0))
        self._calls = dict(saved.get("calls", {}))
        self._by_shape = dict(saved.get("by_shape", {}))
        self._tiny = dict(saved.get("tiny", {}))
        self._tiny_world = int(saved.get("tiny_world", 0))
        self._pending = {b: np.array(v, copy=True) for b, v in saved.get("pending", {}).items()}


__all__ = ["Auto", "CARRIED_FEEDBACK", "DEFAULT_CANDIDATES", "DEFAULT_LINK_BYTES", "DEFAULT_MIN_NUMEL",
           "PRELOAD_NUMEL",
           "DRIFT_BACKOFF"]
