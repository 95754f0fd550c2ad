"""``Compression.auto()`` on real MPI ranks (P = 2 and 4) and its decision rules in one process.

The per-rank cases check: every rank takes the same decision and gets the same
bits; a crafted disagreement between the ranks' measurements (each rank's
link slow for another collective) still yields one decision, where the ranks'
own measurements alone would not agree; a link that gets slower triggers a new
decision after ``patience`` windows, a one-window blip does not, and a method is
replaced only by one faster by the switch margin; switching away from a method
with error feedback flushes its residual into the next step exactly; a
checkpoint taken after a switch resumes bit-identical.

A synthetic link (``measure_hook``) replaces every measured time in the cases
that need determinism: ``alpha + bytes / rate`` per collective, a fixed time
for compression, so decisions depend on the link the test sets and not on a
shared machine's noise.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.compressors import auto_measure
from horovod_compress.compressors.auto import DEFAULT_CANDIDATES, Auto
from horovod_compress.compressors.auto_decide import (BIASED_STEPS_FACTOR, DriftMonitor, choose,
                                                      predict_exchange, steps_factor)
from horovod_compress.compressors.auto_measure import Measurement, OpProbe
from horovod_compress.compressors.registry import as_method
from horovod_compress.tools.testing import gather_float64, run_cases, same_on_all_ranks

N = 1 << 18          # a 1 MiB bucket of float32 (real measurements)
N_SYN = 1 << 14      # the synthetic-link cases' bucket (above min_numel, quick to compress)
FAST, SLOW = 1e12, 1e6   # bytes/s of the synthetic link
ALPHA = 1e-5
#: seconds outside MPI per method on the synthetic link: dense computes least
COMPRESS_S = {"none": 1e-3, "topk": 2e-3}


class SyntheticLink:
    """``measure_hook``: every collective takes ``alpha + bytes / rate``, each method's
    compression a fixed time (:data:`COMPRESS_S`)."""

    def __init__(self, rate: float = FAST) -> None:
        self.rate = rate

    def __call__(self, kind: str, seconds: float, nbytes: float) -> float:
        if kind.startswith("compress:"):
            return COMPRESS_S[kind.split(":")[1]]
        return ALPHA + nbytes / self.rate


def _auto(**kw):
    """``Compression.auto`` ranking by exchange time alone (every steps factor 1): the cases below
    time synthetic links and test the measuring, the windows and the switches; the weighing by
    steps has its own test (``test_steps_factor_weighs_the_exchange_by_the_steps_a_method_needs``)."""
    names = [c if isinstance(c, str) else c.name for c in kw["candidates"]]
    kw.setdefault("steps_factors", {c: 1.0 for c in names})
    return hvdc.Compression.auto(**kw)


def _grad(rank: int, step: int, n: int = N_SYN) -> np.ndarray:
    return np.random.default_rng(1000 * step + rank).standard_normal(n).astype(np.float32)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _chosen_everywhere(comm, method: Auto) -> list[list[str]]:
    """Each rank's (bucket, chosen) list, gathered."""
    mine = sorted((b, d["chosen"]) for b, d in method.decisions().items())
    return comm.allgather_object(mine)


# --------------------------------------------------------------------- per-rank cases
def case_all_ranks_choose_the_same(comm):
    """Real measurements (default candidates): one decision and the same bits on every rank."""
    method = hvdc.Compression.auto(dry_runs=1, probe_repeats=2)
    for step in range(1, 4):
        out = method.allreduce(_grad(comm.rank, step, N), "bucket0", comm)
        assert same_on_all_ranks(comm, _bits(out)), "ranks disagree on the result"
        avg = gather_float64(comm, _grad(comm.rank, step, N)).mean(axis=0)
        assert np.isfinite(out).all() and out.shape == avg.shape
    small = method.allreduce(np.ones(100, np.float32), "tiny", comm)
    np.testing.assert_allclose(small, 1.0)
    d = method.decisions()
    assert d["tiny"]["chosen"] == "none" and "min_numel" in d["tiny"]["reason"]
    table = d["bucket0"]["candidates"]
    assert set(table) == set(DEFAULT_CANDIDATES)
    assert table["none"]["error"] < 1e-6 and table["fp16"]["error"] < 1e-2
    chosen = d["bucket0"]["chosen"]
    assert d["bucket0"]["predicted_ms"] == min(v["predicted_ms"] for v in table.values()) \
        or d["bucket0"]["predicted_ms"] == table[chosen]["predicted_ms"]
    gathered = _chosen_everywhere(comm, method)
    assert all(g == gathered[0] for g in gathered)
    return {"chosen": chosen, "table": table, "decisions": len(method.decision_log())}


def _disagreeing_hook(rank: int):
    """Rank 0's link is slow for allgathers, rank 1's for allreduces; the others' as measured."""
    slow = {0: ("allgather", "allgatherv"), 1: ("allreduce",)}.get(rank, ())

    def hook(kind: str, seconds: float, nbytes: float) -> float:
        if kind.startswith("compress:"):
            return COMPRESS_S[kind.split(":")[1]]
        return ALPHA + nbytes / FAST + (0.5 if kind in slow else 0.0)
    return hook


def case_crafted_disagreement_yields_one_decision(comm):
    """Without the agreement each rank would pick another method; with it, one decision."""
    labels = ["none", "topk"]
    methods = [hvdc.Compression.none(), hvdc.Compression.topk()]
    hook = _disagreeing_hook(comm.rank)
    x = _grad(comm.rank, 1, N)
    real_agree = auto_measure.agree
    auto_measure.agree = lambda comm_, ms: list(ms)       # each rank's own numbers
    try:
        own = auto_measure.measure_candidates(methods, x, "b", comm, dry_runs=1, probe_repeats=1,
                                              hook=hook)
    finally:
        auto_measure.agree = real_agree
    own_pick = choose(labels, [predict_exchange(lb, m, comm.size) for lb, m in zip(labels, own)],
                      [m.error for m in own], None)[0]
    picks = comm.allgather_object(own_pick)
    method = _auto(candidates=labels, dry_runs=1, probe_repeats=1, measure_hook=hook)
    out = method.allreduce(x, "b", comm)
    assert same_on_all_ranks(comm, _bits(out))
    gathered = _chosen_everywhere(comm, method)
    assert all(g == gathered[0] for g in gathered)
    return {"own_picks": picks, "chosen": method.decisions()["b"]["chosen"]}


def _run_steps(method, comm, link, steps, rate_at, name="b"):
    outs = {}
    for t in steps:
        link.rate = rate_at(t)
        outs[t] = method.allreduce(_grad(comm.rank, t), name, comm)
    return outs


def case_drift_redecides_with_hysteresis(comm):
    """Fast link (dense), a one-window blip (no decision), a sustained slow link (a new decision
    within two windows: Top-k), back to fast (a new decision that keeps Top-k: dense is faster
    there, by 50%, but not by the switch margin of 60%). Exchange time alone (Top-k's steps
    factor 1): the windows' mechanics, not the weighing."""
    link = SyntheticLink()
    method = _auto(candidates=["none", "topk"], window=5, patience=2, band=0.5,
                                   switch_margin=0.6, dry_runs=2, probe_repeats=1, measure_hook=link,
                                   link_every=0)      # the windows alone (the link check: below)

    def rate(t: int) -> float:
        return SLOW if 11 <= t <= 15 or 21 <= t <= 45 else FAST
    _run_steps(method, comm, link, range(1, 66), rate)
    log = [(d["step"], d["chosen"], d["reason"], d["switched"]) for d in method.decision_log()]
    # at the slow link dense was pruned after one dry run (50x Top-k's time): its single
    # measurement still priced it (the synthetic link gives every call the same time)
    slow = method.decision_log()[1]["candidates"]
    assert slow["none"]["predicted_ms"] > 3 * slow["topk"]["predicted_ms"]
    gathered = comm.allgather_object(log)
    assert all(g == gathered[0] for g in gathered)
    return {"log": log}


def case_switch_flushes_the_residual(comm):
    """Top-k's residual e_i at the switch to dense is exchanged in the next step: out = avg(g + e)."""
    link = SyntheticLink(SLOW)
    method = _auto(candidates=["none", "topk"], window=2, patience=1, band=0.5,
                                   switch_margin=0.0, dry_runs=1, probe_repeats=1, measure_hook=link)
    for t in range(1, 5):                     # slow: Top-k; windows close at calls 2 and 4
        method.allreduce(_grad(comm.rank, t), "b", comm)
    assert method.decisions()["b"]["chosen"] == "topk"
    link.rate = FAST
    for t in range(5, 7):                     # fast: the window of calls 5-6 is outside the band
        method.allreduce(_grad(comm.rank, t), "b", comm)
    residual = method.candidates["topk"].state["b"]["fb_residual"].astype(np.float64)
    assert np.abs(residual).sum() > 0
    g = _grad(comm.rank, 7)
    out = method.allreduce(g, "b", comm)     # call 7 decides again: dense wins by the alpha term
    d = method.decisions()["b"]
    assert d["chosen"] == "none" and d["reason"] == "drift" and d["switched"]
    expected = gather_float64(comm, g.astype(np.float64) + residual).mean(axis=0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert "b" not in method.candidates["topk"].state      # handed over, not kept twice
    out8 = method.allreduce(_grad(comm.rank, 8), "b", comm)   # paid once: plain dense afterwards
    np.testing.assert_allclose(out8, gather_float64(comm, _grad(comm.rank, 8)).mean(axis=0),
                               rtol=1e-5, atol=1e-6)
    return {}


def case_error_budget_excludes_a_faster_method(comm):
    """On a slow link Top-k is predicted fastest, but its measured one-step error (about 0.9 at
    1% density from a zero residual) exceeds a budget of 0.5: dense is chosen, and the table says why."""
    link = SyntheticLink(SLOW)
    free = _auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1,
                                 measure_hook=link)
    bounded = _auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1,
                                    error_budget=0.5, measure_hook=link)
    g = _grad(comm.rank, 1)
    free.allreduce(g, "b", comm)
    out = bounded.allreduce(g, "b", comm)
    assert free.decisions()["b"]["chosen"] == "topk"
    d = bounded.decisions()["b"]
    assert d["chosen"] == "none" and d["runner_up"] is None
    table = d["candidates"]
    assert table["topk"]["error"] > 0.5 and not table["topk"]["eligible"]
    assert table["none"]["error"] == 0.0 and table["none"]["eligible"]
    np.testing.assert_allclose(out, gather_float64(comm, g).mean(axis=0), rtol=1e-5, atol=1e-6)
    return {}


def case_checkpoint_after_switch_resumes_bit_identical(comm):
    """A checkpoint taken after dense -> Top-k (error feedback live) resumes the same bits,
    including the later switch back to dense and its flush of the residual."""
    def rate(t: int) -> float:
        return SLOW if 6 <= t <= 30 else FAST

    def fresh(link):
        return _auto(candidates=["none", "topk"], window=3, patience=2, band=0.5,
                                     switch_margin=0.0, dry_runs=1, probe_repeats=1, measure_hook=link)
    link_a = SyntheticLink()
    a = fresh(link_a)
    _run_steps(a, comm, link_a, range(1, 21), rate)
    assert a.decisions()["b"]["chosen"] == "topk" and len(a.decision_log()) == 2
    saved = pickle.dumps(a.state_dict())
    tail_a = _run_steps(a, comm, link_a, range(21, 46), rate)
    link_b = SyntheticLink()
    b = fresh(link_b)
    b.load_state_dict(pickle.loads(saved))
    tail_b = _run_steps(b, comm, link_b, range(21, 46), rate)
    for t in tail_a:
        assert np.array_equal(_bits(tail_a[t]), _bits(tail_b[t])), f"step {t} differs after resume"
    assert a.decision_log() == b.decision_log()
    assert [d["chosen"] for d in a.decision_log()] == ["none", "topk", "none"]
    return {"decisions": len(a.decision_log())}


def case_torch_optimizer_with_auto(comm):
    """Our torch DistributedOptimizer accepts auto: parameters stay equal on every rank."""
    import torch
    from horovod_compress.torch import DistributedOptimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    method = _auto(candidates=["none", "fp16", "topk"], dry_runs=1, probe_repeats=1,
                                   min_numel=1024)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression=method)
    gen = torch.Generator().manual_seed(comm.rank)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(32, 64, generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (32,), generator=gen))
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert same_on_all_ranks(comm, _bits(flat))
    assert method.decisions(), "no bucket decided"
    return {"buckets": len(method.decisions())}


def case_bound_rules_out_and_shapes_share(comm):
    """On a slow synthetic link a 256 Ki-value bucket's slice (1/16) prices dense far above
    Top-k, so dense is not dry-run on the bucket (its row is the slice's extrapolation); a
    second bucket of the same values reuses the measurement, one of another size measures."""
    from horovod_compress.compressors.auto_bound import BOUND_DIVISOR, BOUND_MIN_SLICE
    n = BOUND_DIVISOR * BOUND_MIN_SLICE
    method = _auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1,
                                   measure_hook=SyntheticLink(SLOW))
    for bucket in ("a", "b"):
        method.allreduce(_grad(comm.rank, 1, n), bucket, comm)
    method.allreduce(_grad(comm.rank, 1, N_SYN), "c", comm)
    d = method.decisions()
    assert [d[b]["chosen"] for b in "abc"] == ["topk"] * 3
    assert d["a"]["candidates"]["none"]["dry_run"] == f"slice 1/{BOUND_DIVISOR}"
    assert d["a"]["candidates"]["topk"]["dry_run"] == "bucket"
    assert d["b"]["shared_with"] == "a" and d["b"]["candidates"] == d["a"]["candidates"]
    assert d["c"]["shared_with"] is None and d["c"]["candidates"]["none"]["dry_run"] == "bucket"
    cost = method.decision_cost()
    assert (cost["measured"], cost["shared"], cost["ruled_out"]) == (2, 1, 1)
    # the slice extrapolation of dense: 16x the slice's compression and bytes, alpha kept
    row = d["a"]["candidates"]["none"]
    assert row["predicted_ms"] > 10 * d["a"]["candidates"]["topk"]["predicted_ms"]
    return {"none_ms": row["predicted_ms"], "topk_error": d["a"]["candidates"]["topk"]["error"]}


def case_link_recheck_on_slices(comm):
    """A link check that finds a change its slices do not confirm (the check's allreduce 3x
    slower from call 25, the collectives the candidates use unchanged: a loaded machine's
    phase) keeps the running method without a dry run on the bucket: one measured decision,
    one re-checked on the slices."""
    from horovod_compress.compressors.auto_bound import BOUND_DIVISOR, BOUND_MIN_SLICE
    n = BOUND_DIVISOR * BOUND_MIN_SLICE
    base = SyntheticLink(SLOW)
    calls = [0]

    def hook(kind: str, seconds: float, nbytes: float) -> float:
        t = base(kind, seconds, nbytes)
        return 3.0 * t if kind == "link" and calls[0] >= 25 else t
    method = _auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1, measure_hook=hook)
    for t in range(1, 46):
        calls[0] = t
        method.allreduce(_grad(comm.rank, t, n), "b", comm)
    log = [(d["step"], d["chosen"], d["reason"], d["switched"]) for d in method.decision_log()]
    cost = method.decision_cost()
    assert (cost["measured"], cost["rechecked"], cost["link_changes"]) == (1, 1, 1), cost
    rechecked = method.decision_log()[1]
    assert rechecked["candidates"]["none"]["dry_run"] == f"slice 1/{BOUND_DIVISOR}"
    assert rechecked["candidates"]["topk"]["dry_run"] == "the last window's steps"
    return {"log": log}


def case_slice_winner_is_dry_run_on_the_bucket(comm):
    """A candidate the bound ruled out on its slice wins only after a dry run on the bucket. The
    slices promise dense 1.6 ms (16 x 0.1 ms) and Top-k 16 ms (16 x 1 ms): Top-k is ruled out.
    On the bucket dense takes 20 ms, so Top-k's slice row is now the best: it is dry-run on the
    bucket (2 ms there) and chosen on that measurement, not on its slice's extrapolation. (The
    shaped links of the emulated cluster mislead alike: a slice's small messages pass within
    the shaper's burst, so every sparse slice looks cheaper than its bucket.)"""
    from horovod_compress.compressors.auto_bound import BOUND_DIVISOR, BOUND_MIN_SLICE
    n = BOUND_DIVISOR * BOUND_MIN_SLICE
    # compression seconds by method, on the slice and on the bucket, told apart by the bytes of
    # the call's last collective (the hook sees the ops before the compression time)
    compress = {"none": (1e-4, 20e-3), "topk": (1e-3, 2e-3)}
    bucket_bytes = {"none": 4 * n / 2, "topk": 8 * 0.01 * n / 2}
    last = [0.0]

    def hook(kind: str, seconds: float, nbytes: float) -> float:
        if kind.startswith("compress:"):
            name = kind.split(":")[1]
            return compress[name][last[0] >= bucket_bytes[name]]
        last[0] = nbytes
        return ALPHA + nbytes / FAST
    method = _auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1, measure_hook=hook)
    method.allreduce(_grad(comm.rank, 1, n), "b", comm)
    d = method.decisions()["b"]
    assert d["chosen"] == "topk", d
    assert d["candidates"]["topk"]["dry_run"] == "bucket", d
    assert d["candidates"]["none"]["dry_run"] == "bucket", d
    assert abs(d["candidates"]["topk"]["compress_ms"] - 2.0) < 1e-9, d
    assert method.decision_cost()["ruled_out"] == 0
    return {"predicted_ms": d["predicted_ms"]}


def case_drift_recheck_on_slices(comm):
    """A drift whose slices still rank the running method first keeps it without a dry run on
    the bucket: its new prediction is the exchange time the last window measured."""
    from horovod_compress.compressors.auto_bound import BOUND_DIVISOR, BOUND_MIN_SLICE
    n = BOUND_DIVISOR * BOUND_MIN_SLICE
    link = SyntheticLink(SLOW)
    COMPRESS_S.setdefault("gaussiank", 5e-3)     # the slowest to compress on this link
    method = _auto(candidates=["none", "topk", "gaussiank"], window=2, patience=1,
                                   band=0.5, dry_runs=1, probe_repeats=1, measure_hook=link)
    for t in range(1, 5):            # Top-k; the window of calls 2-3 is the reference
        method.allreduce(_grad(comm.rank, t, n), "b", comm)
    before = method.decisions()["b"]["predicted_ms"]
    link.rate = SLOW / 10            # every byte 10x slower: Top-k still far ahead of dense
    for t in range(5, 8):            # the window of calls 4-5 is out of band; call 6 re-checks
        method.allreduce(_grad(comm.rank, t, n), "b", comm)
    log = method.decision_log()
    d = log[1]
    assert d["reason"] == "drift, re-checked" and d["chosen"] == "topk" and not d["switched"]
    assert d["candidates"]["none"]["dry_run"].startswith("slice")
    assert d["candidates"]["topk"]["dry_run"] == "the last window's steps"
    cost = method.decision_cost()
    assert (cost["measured"], cost["rechecked"]) == (1, 1)
    # the link turns fast: the slices rank dense first, a challenger; it and Top-k (the running
    # method) are dry-run on the bucket, Gaussian-k, which the bound rules out, keeps its slice row
    link.rate = FAST
    for t in range(8, 14):
        method.allreduce(_grad(comm.rank, t, n), "b", comm)
    d = method.decision_log()[2]
    assert d["reason"] == "drift" and d["chosen"] == "none" and d["switched"]
    assert [d["candidates"][lb]["dry_run"] for lb in ("none", "topk", "gaussiank")] == \
        ["bucket", "bucket", f"slice 1/{BOUND_DIVISOR}"]
    return {"ratio": log[1]["predicted_ms"] / before}


def case_many_switches_conserve_the_gradient(comm):
    """A link that alternates between slow and fast every 7 steps makes the bucket switch
    between dense and the sparsifiers many times; no gradient mass is lost or made up:
    sum_t out_t + avg_r(what is still owed: the running method's residual or a pending debt)
    = sum_t avg_r(g_t,r), to float32 rounding (EF14 with every hand-over)."""
    COMPRESS_S.setdefault("gaussiank", 5e-3)
    link = SyntheticLink(SLOW)
    method = _auto(candidates=["none", "topk", "gaussiank"], window=2, patience=1,
                                   band=0.3, switch_margin=0.0, dry_runs=1, probe_repeats=1,
                                   measure_hook=link)
    sent = np.zeros(N_SYN)
    exact = np.zeros(N_SYN)
    for t in range(60):
        link.rate = SLOW if (t // 7) % 2 == 0 else FAST
        g = _grad(comm.rank, t)
        sent += method.allreduce(g, "b", comm)
        exact += gather_float64(comm, g).mean(axis=0)
    owed = np.zeros(N_SYN)
    for inner in method.candidates.values():
        st = inner.state.get("b")
        if st is not None and st.get("fb_residual") is not None:
            owed += np.asarray(st["fb_residual"], np.float64)
    owed += method.state_dict()["auto"]["pending"].get("b", 0.0)
    np.testing.assert_allclose(sent + gather_float64(comm, owed).mean(axis=0), exact, atol=2e-5)
    switches = sum(d["switched"] for d in method.decision_log()) - 1
    assert switches >= 4, method.decision_log()
    return {"switches": switches}


#: A link on which Top-k's exchange is compression-bound: at LINK_SLOW Top-k is the faster
#: (dense's 64 KiB take 3.3 ms at P = 2), at 10x the rate dense is, by more than the switch
#: margin (1.3 against 2.0 ms at P = 2; 1.5 against 2.0 at P = 4), while Top-k's own exchange
#: time moves by a few percent: its drift windows cannot see the change.
LINK_SLOW, LINK_FAST = 2e7, 2e8


def _link_run(method, comm, link, steps, change_at):
    return _run_steps(method, comm, link, steps, lambda t: LINK_SLOW if t <= change_at else LINK_FAST)


def _resumed_link_run(fresh, comm, saved_at, end, change_at):
    """Run ``fresh(link)`` for calls 1..``end`` with the link 10x faster after ``change_at``,
    and a second one resumed from the first's checkpoint after call ``saved_at``; asserts the
    two give the same bits and decisions after it. Returns (the first, the resumed one)."""
    link_a = SyntheticLink()
    a = fresh(link_a)
    _link_run(a, comm, link_a, range(1, saved_at + 1), change_at)
    saved = pickle.dumps(a.state_dict())
    tail_a = _link_run(a, comm, link_a, range(saved_at + 1, end + 1), change_at)
    link_b = SyntheticLink()
    b = fresh(link_b)
    b.load_state_dict(pickle.loads(saved))
    tail_b = _link_run(b, comm, link_b, range(saved_at + 1, end + 1), change_at)
    for t in tail_a:
        assert np.array_equal(_bits(tail_a[t]), _bits(tail_b[t])), f"step {t} differs after resume"
    assert a.decision_log() == b.decision_log()
    return a, b


def case_link_change_redecides(comm):
    """The link gets 10x faster after call 30: the link check (every 10 calls, 2 strikes) finds it
    at call 50 and the bucket switches from Top-k to dense; the drift windows alone do not. A
    checkpoint taken between the two strikes resumes the same decisions and bits."""
    def fresh(link, **kw):
        return _auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1,
                                     measure_hook=link, **kw)
    blind_link = SyntheticLink()
    blind = fresh(blind_link, link_every=0)
    _link_run(blind, comm, blind_link, range(1, 101), 30)
    a, _ = _resumed_link_run(fresh, comm, 45, 100, 30)
    log = [(d["step"], d["chosen"], d["reason"]) for d in a.decision_log()]
    gathered = comm.allgather_object(log)
    assert all(g == gathered[0] for g in gathered)
    cost = a.decision_cost()
    return {"log": log, "blind": [(d["step"], d["chosen"]) for d in blind.decision_log()],
            "checks": cost["link_checks"], "changes": cost["link_changes"],
            "link_s": cost["link_s"], "checking_s": cost["checking_s"]}


def case_calm_link_is_checked_less_often(comm):
    """A link calm for ten checks (calls 20-110) is checked every 30 calls (140, 170), and a
    change after that spell (10x faster after call 145) is still noticed within 40 calls: the
    first check out of band (170) brings the spacing back to 10, the second strike comes at
    180. A checkpoint taken in the calm spell (call 150) resumes the same checks and bits."""
    def fresh(link):
        return _auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1, measure_hook=link)
    a, b = _resumed_link_run(fresh, comm, 150, 200, 145)
    return {"log": [(d["step"], d["chosen"], d["reason"]) for d in a.decision_log()],
            "checks": a.decision_cost()["link_checks"], "resumed_checks": b.decision_cost()["link_checks"]}


def case_link_noise_inside_the_band(comm):
    """A link check that varies by up to 1.4x (each rank its own noise; band 1.0) for 100 calls
    never triggers a decision."""
    rng = np.random.default_rng(comm.rank)
    base = SyntheticLink(LINK_SLOW)

    def noisy(kind: str, seconds: float, nbytes: float) -> float:
        t = base(kind, seconds, nbytes)
        return t * rng.uniform(1.0, 1.4) if kind == "link" else t
    method = _auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1,
                                   measure_hook=noisy)
    for t in range(1, 101):
        method.allreduce(_grad(comm.rank, t), "b", comm)
    cost = method.decision_cost()
    return {"decisions": len(method.decision_log()), "checks": cost["link_checks"],
            "changes": cost["link_changes"]}


def case_link_backoff(comm):
    """A link check that is out of band at every check (each 3x the last) while the bucket's
    choice never changes: the first change needs 2 checks, and after a change whose decisions
    kept every method the next needs twice as many (DRIFT_BACKOFF x patience at most)."""
    base = SyntheticLink(LINK_SLOW)
    checks = [0]

    def growing(kind: str, seconds: float, nbytes: float) -> float:
        if kind == "link":
            checks[0] += 1
            return base(kind, seconds, nbytes) * 3.0 ** checks[0]
        return base(kind, seconds, nbytes)
    method = _auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1,
                                   measure_hook=growing)
    for t in range(1, 141):
        method.allreduce(_grad(comm.rank, t), "b", comm)
    return {"log": [(d["step"], d["chosen"], d["reason"]) for d in method.decision_log()]}


def case_drift_windows_ride_the_link_check(comm):
    """With a link check every window (the defaults: 10 and 10), two buckets' drift windows are
    agreed inside the checks' allreduce: no 8-byte allreduce of their own in 100 calls, and a
    link the checks cannot see (their own allreduce keeps its time) that gets slow at call 35
    still makes both buckets decide again by drift, dense -> Top-k, within 30 calls."""
    link = SyntheticLink()

    def hook(kind: str, seconds: float, nbytes: float) -> float:
        return 1e-4 if kind == "link" else link(kind, seconds, nbytes)
    method = _auto(candidates=["none", "topk"], window=10, link_every=10, patience=2, band=0.5,
                   switch_margin=0.0, dry_runs=1, probe_repeats=1, measure_hook=hook)
    for t in range(1, 101):
        link.rate = FAST if t < 35 else SLOW
        for name in ("a", "b"):
            method.allreduce(_grad(comm.rank, t), name, comm)
    log = [(d["bucket"], d["step"], d["chosen"], d["reason"]) for d in method.decision_log()]
    cost = method.decision_cost()
    return {"log": log, "agreements": cost["drift_agreements"], "checks": cost["link_checks"],
            "changes": cost["link_changes"]}


def case_dry_runs_prune_on_agreed_times(comm):
    """Three dry runs with a rank whose own timings would prune Top-k after its second call
    (its dense is 3x faster than the others'): the pruning reads the agreed times (the maximum
    over ranks), so every rank runs the same calls -- no rank waits in a collective the others
    never enter -- and all hold the same measurements."""
    calls = {"none": 0, "topk": 0}

    def hook(kind: str, seconds: float, nbytes: float) -> float:
        if not kind.startswith("compress:"):
            return 0.0
        name = kind.split(":", 1)[1]
        calls[name] += 1
        if name == "none":
            return 0.010 if comm.rank == 0 else 0.025
        return 0.030
    methods = [hvdc.Compression.none(), hvdc.Compression.topk()]
    x = _grad(comm.rank, 1)
    got = auto_measure.measure_candidates(methods, x, "b", comm, dry_runs=3, probe_repeats=1, hook=hook)
    assert calls == {"none": 3, "topk": 3}, calls       # 0.030 <= 1.5 x the agreed 0.025
    return {"calls": calls, "times": [m.compress_s for m in got]}


CORE_CASES = [case_all_ranks_choose_the_same, case_dry_runs_prune_on_agreed_times, case_crafted_disagreement_yields_one_decision,
              case_drift_redecides_with_hysteresis, case_switch_flushes_the_residual,
              case_error_budget_excludes_a_faster_method,
              case_checkpoint_after_switch_resumes_bit_identical, case_bound_rules_out_and_shapes_share,
              case_slice_winner_is_dry_run_on_the_bucket, case_link_recheck_on_slices, case_drift_recheck_on_slices, case_many_switches_conserve_the_gradient,
              case_link_change_redecides, case_calm_link_is_checked_less_often,
              case_link_noise_inside_the_band, case_link_backoff,
              case_drift_windows_ride_the_link_check]


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def mpi(request):
    return run_cases(request.param, __file__, CORE_CASES, timeout=600)


# ----------------------------------------------------------------------- tests
def test_all_ranks_choose_the_same(mpi):
    out = mpi[case_all_ranks_choose_the_same]
    assert all(v == out[0] for v in out.values())
    assert out[0]["decisions"] == 2          # the bucket and the tiny one, each decided once


def test_dry_runs_prune_on_agreed_times(mpi):
    out = mpi[case_dry_runs_prune_on_agreed_times]
    assert all(v == {"calls": {"none": 3, "topk": 3}, "times": [0.025, 0.030]} for v in out.values()), out


def test_crafted_disagreement_yields_one_decision(mpi):
    out = mpi[case_crafted_disagreement_yields_one_decision]
    picks = out[0]["own_picks"]
    assert picks[0] == "none" and picks[1] == "topk", picks   # the ranks alone disagree
    assert len({v["chosen"] for v in out.values()}) == 1


def test_drift_redecides_with_hysteresis(mpi):
    log = mpi[case_drift_redecides_with_hysteresis][0]["log"]
    # call 1: dense; the blip (calls 11-15) is one window: nothing; slow from call 21: windows
    # 21-25 and 26-30 -> a new decision at call 31 (10 steps after the change); fast from call 46:
    # windows 46-50 and 51-55 (counted from call 31) -> call 56 decides again and keeps Top-k
    assert log == [[1, "none", "first call", True], [31, "topk", "drift", True],
                   [56, "topk", "drift", False]], log


def test_switch_flushes_the_residual(mpi):
    assert all(v == {} for v in mpi[case_switch_flushes_the_residual].values())


def test_error_budget_excludes_a_faster_method(mpi):
    assert all(v == {} for v in mpi[case_error_budget_excludes_a_faster_method].values())


def test_checkpoint_after_switch_resumes_bit_identical(mpi):
    assert all(v == {"decisions": 3} for v in mpi[case_checkpoint_after_switch_resumes_bit_identical].values())


def test_bound_rules_out_and_shapes_share(mpi):
    out = mpi[case_bound_rules_out_and_shapes_share]
    assert len({v["none_ms"] for v in out.values()}) == 1      # agreed: the same on every rank
    # Top-k's error came from the slice (no dense reference on the bucket): about 0.9 at 1%
    assert all(0.5 < v["topk_error"] < 1.1 for v in out.values())


def test_link_recheck_on_slices(mpi):
    # checks at 10 (reference), 20, 30 and 40 (3x: strikes) -> call 40 re-checks on the slices
    out = mpi[case_link_recheck_on_slices]
    assert all(v["log"] == [[1, "topk", "first call", True], [40, "topk", "link, re-checked", False]]
               for v in out.values()), out


def test_slice_winner_is_dry_run_on_the_bucket(mpi):
    out = mpi[case_slice_winner_is_dry_run_on_the_bucket]
    assert len({v["predicted_ms"] for v in out.values()}) == 1 and out[0]["predicted_ms"] < 3.0, out


def test_drift_recheck_on_slices(mpi):
    # the window after the change measured Top-k's exchange several times slower (the synthetic
    # link's bytes at a tenth of the rate, its compression time unchanged), the same on every rank
    ratios = {v["ratio"] for v in mpi[case_drift_recheck_on_slices].values()}
    assert len(ratios) == 1 and ratios.pop() > 1.5


def test_many_switches_conserve_the_gradient(mpi):
    out = mpi[case_many_switches_conserve_the_gradient]
    assert len({v["switches"] for v in out.values()}) == 1     # the same switches on every rank


def test_link_change_redecides_within_50_steps(mpi):
    out = mpi[case_link_change_redecides]
    log = out[0]["log"]
    # checks at calls 10 (the reference), 20, 30 (slow), 40 and 50 (fast: two strikes) -> call 50
    # decides again, 20 calls after the change; the reference is taken again at call 60
    assert log == [[1, "topk", "first call"], [50, "none", "link"]], log
    assert all(v["log"] == log for v in out.values())
    assert all(v["blind"] == [[1, "topk"]] for v in out.values())    # the windows alone: never
    assert all(v["checks"] == 10 and v["changes"] == 1 for v in out.values())
    assert all(0 < v["link_s"] <= v["checking_s"] for v in out.values())


def test_calm_link_is_checked_less_often(mpi):
    out = mpi[case_calm_link_is_checked_less_often]
    # checks at 10 (reference), 20-110 (ten calm), 140, 170 (strike), 180 (strike: a change,
    # 35 calls after it), 190 (the new reference), 200; the resumed copy ran those from 170 on
    assert all(v["log"] == [[1, "topk", "first call"], [180, "none", "link"]] for v in out.values()), out
    assert all(v["checks"] == 16 and v["resumed_checks"] == 4 for v in out.values()), out


def test_link_noise_inside_the_band_does_not_redecide(mpi):
    out = mpi[case_link_noise_inside_the_band]
    assert all(v == {"decisions": 1, "checks": 10, "changes": 0} for v in out.values()), out


def test_link_changes_that_keep_every_method_back_off(mpi):
    # checks at 10 (reference), 20, 30: a change, the decision keeps Top-k, patience 2 -> 4;
    # reference at 40, strikes at 50-80: a change at 80 (patience stays 4: DRIFT_BACKOFF x 2);
    # reference at 90, strikes at 100-130: a change at 130
    out = mpi[case_link_backoff]
    assert all(v["log"] == [[1, "topk", "first call"], [30, "topk", "link"], [80, "topk", "link"],
                            [130, "topk", "link"]] for v in out.values()), out[0]["log"]


def test_drift_windows_ride_the_link_check(mpi):
    out = mpi[case_drift_windows_ride_the_link_check]
    log = out[0]["log"]
    assert all(v["log"] == log for v in out.values())
    assert [(b, c, r) for b, _, c, r in log] == [("a", "none", "first call"), ("b", "none", "first call"),
                                                 ("a", "topk", "drift"), ("b", "topk", "drift")], log
    assert all(35 < step <= 65 for _, step, _, _ in log[2:]), log
    assert all(v["agreements"] == 0 and v["checks"] == 10 and v["changes"] == 0
               for v in out.values()), out


def test_torch_optimizer_with_auto():
    """Two ranks suffice for the front-end path (the cases above cover P = 4)."""
    out = run_cases(2, __file__, [case_torch_optimizer_with_auto], timeout=600)[case_torch_optimizer_with_auto]
    assert all(v["buckets"] >= 1 for v in out.values())


# ----------------------------------------------------------------- one process
def _m(compress_s, **ops):
    return Measurement(compress_s, 0.0, {op: OpProbe(*v) for op, v in ops.items()})


def test_prediction_reproduces_the_probed_calls():
    """At the probed size the model gives back compression + each op's measured seconds."""
    m = _m(0.002, allreduce=(2, 4e6, 4e6, 0.05, 1e-4), allgatherv=(1, 1e5, 1e5, 0.004, 5e-5))
    assert predict_exchange("x", m, 4) == pytest.approx(0.002 + 0.05 + 0.004, rel=1e-9)
    assert predict_exchange("x", _m(0.001), 2) == 0.001


def test_prediction_extrapolates_a_slice_linearly_in_bytes():
    """A slice 4x smaller: compression and the bandwidth term grow 4x, the latency term does not."""
    m = _m(0.001, allreduce=(1, 1e6, 1e6, 0.0101, 1e-4))
    whole = predict_exchange("x", m, 2, scale=4.0)
    assert whole == pytest.approx(4 * 0.001 + 1e-4 + 4 * 0.01, rel=1e-6)
    assert predict_exchange("x", _m(0.001), 2, scale=4.0) == pytest.approx(0.004)


def test_choose_budget_tie_and_margin():
    labels = ["none", "fp16", "topk"]
    assert choose(labels, [3.0, 2.0, 1.0], [0, 1e-3, 0.9], None)[:2] == ("topk", "fp16")
    assert choose(labels, [3.0, 2.0, 1.0], [0, 1e-3, 0.9], 0.1)[:2] == ("fp16", "none")
    assert choose(labels, [1.0, 1.0, 1.0], [0, 0, 0], None)[0] == "none"        # first listed
    # hysteresis: the current one stays unless the best is faster by the margin
    assert choose(labels, [1.0, 0.95, 2.0], [0, 0, 0], None, "none", 0.1)[0] == "none"
    assert choose(labels, [1.0, 0.85, 2.0], [0, 0, 0], None, "none", 0.1)[0] == "fp16"
    # a budget nobody meets: the least error, and nobody eligible
    chosen, _, ok = choose(labels, [3.0, 2.0, 1.0], [0.5, 0.2, 0.9], 0.01)
    assert chosen == "fp16" and ok == [False, False, False]


def test_steps_factor_weighs_the_exchange_by_the_steps_a_method_needs():
    """Time to a loss = steps x step time: a method that needs 1.5x dense's steps is chosen only
    when its exchange is more than 1.5x faster (Top-k 1.3x faster loses to dense, 2x faster wins);
    the margin compares weighed predictions too."""
    labels = ["none", "topk"]
    assert choose(labels, [1.3, 1.0], [0, 0.9], None, factors=[1.0, 1.5])[:2] == ("none", "topk")
    assert choose(labels, [2.0, 1.0], [0, 0.9], None, factors=[1.0, 1.5])[0] == "topk"
    assert choose(labels, [1.3, 1.0], [0, 0.9], None)[0] == "topk"            # time alone
    # running Top-k, dense weighed 1.0 against Top-k's 1.2: better by 17%, past a 10% margin
    assert choose(labels, [1.0, 0.8], [0, 0.9], None, "topk", 0.1, [1.0, 1.5])[0] == "none"
    auto = hvdc.Compression.auto()
    assert auto.steps_factors == {"none": 1.0, "fp16": 1.0, "global_qsgd": 1.2, "topk": 2.3,
                                  "deepreduce": 2.0, "oktopk": 1.5}
    assert steps_factor(hvdc.Compression.randk()) == BIASED_STEPS_FACTOR      # EF: as sparsifiers
    assert steps_factor(hvdc.Compression.topk(), {"topk": 1.1}) == 1.1
    own = hvdc.Compression.auto(candidates=["none", "topk"], steps_factors={"topk": 1.0})
    assert own.steps_factors == {"none": 1.0, "topk": 1.0}
    assert "steps_factors" in own.config()
    for bad, words in [({"powersgd": 1.2}, "not candidates"), ({"topk": 0.5}, "steps_factors")]:
        with pytest.raises(ValueError, match=words):
            hvdc.Compression.auto(candidates=["none", "topk"], steps_factors=bad)


def test_dry_runs_continue_while_a_candidate_warms_up():
    """A candidate whose calls keep getting faster (a fresh Top-k copy allocates its buffers
    over its first calls) runs again until it settles, even far above the fastest, up to
    MAX_WARMING_CALLS calls, and its fastest call is its measurement; one with error feedback
    runs at least FEEDBACK_SETTLE_CALLS calls (Gaussian-k: slow, settled, 3); dense, slow or
    not, stops after the rounds asked for."""
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()                       # one process: MPI.COMM_WORLD of size 1
    calls = {"topk": 0, "gaussiank": 0, "none": 0}
    warming = [0.300, 0.160, 0.020, 0.019, 0.019, 0.019]

    def hook(kind: str, seconds: float, nbytes: float) -> float:
        if not kind.startswith("compress:"):
            return 0.0
        name = kind.split(":", 1)[1]
        calls[name] += 1
        return {"topk": warming[calls["topk"] - 1], "gaussiank": 0.100, "none": 0.010}[name]
    methods = [hvdc.Compression.none(), hvdc.Compression.topk(), hvdc.Compression.gaussiank()]
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    got = auto_measure.measure_candidates(methods, x, "b", comm, dry_runs=2, probe_repeats=1, hook=hook)
    assert calls == {"topk": 4, "gaussiank": 3, "none": 2}, calls     # 300, 160, 20 (still 1/3 less), 19
    assert [round(m.compress_s, 3) for m in got] == [0.010, 0.019, 0.100]
    assert auto_measure.MAX_WARMING_CALLS == 5 and auto_measure.WARMING_RATIO == pytest.approx(2 / 3)
    assert auto_measure.FEEDBACK_SETTLE_CALLS == 3
    calls.update(topk=0, gaussiank=0, none=0)          # one dry run asked for: one call each
    auto_measure.measure_candidates(methods, x, "b", comm, dry_runs=1, probe_repeats=1, hook=hook)
    assert calls == {"topk": 1, "gaussiank": 1, "none": 1}, calls


def test_drift_monitor_reference_band_and_patience():
    m = DriftMonitor(predicted_s=0.5, window=3, band=0.5, patience=2)
    assert not m.observe(1.0) and not m.observe(9.0) and m.observe(1.2)
    assert m.ratio() == pytest.approx(2.4)                 # the median: one slow step does not count
    assert not m.close_window(1.2) and m.reference == 1.2  # the first window is the reference
    assert not m.close_window(1.6)                         # 1.33x the reference: inside the band
    assert not m.close_window(2.0) and m.close_window(0.5)   # two windows out of band in a row
    assert m.strikes == 2
    assert not m.close_window(1.2) and m.strikes == 0
    late = DriftMonitor(predicted_s=1.0, window=1, band=0.5, patience=1)
    assert not late.close_window(10.0) and late.reference == 1.5   # clamped: a change within the
    assert late.close_window(10.0)                                 # first window still shows


def test_accepted_everywhere_a_method_is_and_checks_its_arguments():
    assert isinstance(as_method(hvdc.Compression.auto), Auto)
    assert hvdc.Compression.auto(candidates=["none", hvdc.Compression.fp16]).candidates.keys() == {"none", "fp16"}
    assert "randk" not in DEFAULT_CANDIDATES and "gaussiank" not in DEFAULT_CANDIDATES
    for bad, words in [(dict(candidates=["powersgd"]), "flat methods only"),
                       (dict(candidates=["topk", "topk"]), "once"),
                       (dict(candidates=[]), "non-empty"),
                       (dict(candidates=["auto"]), "cannot itself"),
                       (dict(candidates=[hvdc.Compression.topk(feedback="ef21")]), "carries"),
                       (dict(window=0), "window"), (dict(error_budget=-1), "error_budget")]:
        with pytest.raises(ValueError, match=words):
            hvdc.Compression.auto(**bad)


def test_nonfinite_policy_reaches_every_candidate():
    m = hvdc.Compression.auto(nonfinite="skip")
    assert {c.nonfinite for c in m.candidates.values()} == {"skip"}


def test_state_dict_refuses_other_candidates():
    sd = hvdc.Compression.auto(candidates=["none", "fp16"]).state_dict()
    with pytest.raises(ValueError, match="candidates"):
        hvdc.Compression.auto(candidates=["none", "topk"]).load_state_dict(sd)
