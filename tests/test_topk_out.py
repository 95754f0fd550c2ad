"""TopkA's deferred NaN/Inf agreement and compiled residual update, on real MPI ranks.

TopkA (NumPy float32, no feedback or EF14) does not test its gradient for
NaN/Inf before the call's agreement: its selection pass reports finiteness
(``Method._defers_finite_check`` / ``_pass_finite_gate``) and the agreement
runs after that local pass, before the allgather. The cases below run the
same steps -- clean ones, a NaN on one rank, an Inf on the other, at the first
step (no residual yet) and later (EF14's fused pass) -- through the deferred
path and through the up-front check (the path every other method takes) and
require identical results, states, skip counts and errors under each policy.
This file is also the case module of ``run_cases``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

CASES = Path(__file__)
ALL = ["case_deferred_equals_upfront"]

#: (step, rank, value) injected into the gradient
_BAD = [(1, 1, np.nan), (4, 1, np.nan), (6, 0, np.inf), (7, 1, -np.inf)]


def _run(comm: Any, policy: str, feedback: str, defer: bool, steps: int = 9) -> dict[str, Any]:
    from horovod_compress.compressors import base
    from horovod_compress.compressors.registry import create

    m = create("topk", density=0.02, feedback=feedback)
    m.set_nonfinite(policy)
    if not defer:
        m._defers_finite_check = lambda x, name, comm: False
    finite_calls = [0]
    real_finite = base._finite

    def counting(x: Any) -> bool:
        finite_calls[0] += 1
        return real_finite(x)

    base._finite = counting
    outs, errors = [], []
    try:
        rng = np.random.default_rng(7 + comm.rank)
        for step in range(steps):
            g = rng.standard_normal((300, 400)).astype(np.float32)
            for s, r, v in _BAD:
                if s == step and r == comm.rank:
                    g[17, 23] = v
            try:
                outs.append(m.allreduce(g, "w", comm).copy())
                errors.append(None)
            except base.NonFiniteGradientError as exc:
                outs.append(None)
                errors.append(str(exc))
    finally:
        base._finite = real_finite
    st = m.state.get("w", {})
    return {"outs": outs, "errors": errors, "skipped": m.skipped_steps,
            "t": int(st.get("t", 0)) if st else 0,
            "resid": None if not st or st.get("fb_residual") is None else st["fb_residual"].copy(),
            "finite_calls": finite_calls[0]}


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)))


def case_deferred_equals_upfront(comm: Any) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for feedback in ("residual", "none"):
        for policy in ("skip", "propagate", "raise"):
            a = _run(comm, policy, feedback, defer=True)
            b = _run(comm, policy, feedback, defer=False)
            res[f"{feedback}/{policy}"] = {
                "outs": all(_same(x, y) for x, y in zip(a["outs"], b["outs"])),
                "errors": a["errors"] == b["errors"],
                "n_errors": sum(e is not None for e in a["errors"]),
                "skipped": (a["skipped"], b["skipped"]),
                "t": (a["t"], b["t"]),
                "resid": _same(a["resid"], b["resid"]),
                "finite_calls": (a["finite_calls"], b["finite_calls"]),
            }
    return res


pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def world():
    from horovod_compress.tools.testing import run_cases
    return run_cases(2, CASES, ALL, timeout=600)


def test_deferred_agreement_is_the_upfront_one(world):
    for rank, per_rank in world["case_deferred_equals_upfront"].items():
        for key, r in per_rank.items():
            assert r["outs"] and r["errors"] and r["resid"], (rank, key, r)
            assert r["skipped"][0] == r["skipped"][1], (rank, key, r)
            assert r["t"][0] == r["t"][1], (rank, key, r)
            policy = key.split("/")[1]
            if policy == "raise":
                assert r["n_errors"] == len({s for s, _, _ in _BAD}), (rank, key, r)
            if policy == "skip":
                assert r["skipped"][0] == len({s for s, _, _ in _BAD}), (rank, key, r)


def test_fused_pass_replaces_the_finite_read(world):
    """Under EF14 the fused pass reports finiteness: ``_finite`` runs only where no residual
    exists yet (first step, and a step after a non-finite first step) or on the up-front path."""
    for rank, per_rank in world["case_deferred_equals_upfront"].items():
        deferred, upfront = per_rank["residual/skip"]["finite_calls"]
        assert upfront == 9, (rank, per_rank)
        assert deferred <= 2, (rank, per_rank)
