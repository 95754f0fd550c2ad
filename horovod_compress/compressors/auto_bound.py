"""Bound first, then time: which candidates ``Compression.auto`` need not dry-run on a whole bucket.

A dry run of every candidate on a large bucket costs what an exchange of
each costs; the slow ones (an exact Top-k selection over millions of values
on a CPU, say) dominate a decision. The alpha-beta model (Hockney; Ok-Topk,
Li & Hoefler, PPoPP'22, Section 2 and Table 1) says how a candidate's time
grows with the bucket: its compression time and each collective's bytes
grow linearly with the values, its latency rounds do not. So each candidate
first runs on a **slice** of the bucket ``scale`` times smaller
(``scale`` = :data:`BOUND_DIVISOR`), twice (the first call pays the
process's one-off costs: loading compiled kernels, a slice-sized buffer),
and the model extrapolates the fastest call to the whole bucket:

    T_bound(c) = scale * T_compress(c, slice)
                 + sum_op calls_op * (rounds_op(P) * alpha_op + scale * L_op / (eta_op * B))

A candidate whose extrapolated ``T_bound``, times its steps factor (the
weight the choice gives it, :mod:`.auto_decide`), exceeds :data:`BOUND_FACTOR`
times the smallest such product is ruled out: it keeps the slice measurement (its
decision row says so) and is not dry-run on the bucket. The extrapolation
errs on the side of keeping candidates: at a slice's message sizes the
latency term, which does not grow, is a larger share of every time, so the
ratios between candidates are closer to 1 than on the whole bucket. The
slice measurements are agreed over ranks (their maximum) before the model
runs, so every rank rules out the same candidates.

The extrapolation can also err the other way: on a shaped link a slice's
messages are small enough to pass within the shaper's burst (the emulated
cluster's token bucket holds 256 KiB), so a sparsifier's slice looks
cheaper than its bucket (Top-k at P = 4, 100 Mbit: 158 ms extrapolated,
423 ms on the bucket). So a ruled-out candidate is never chosen on its
slice alone: when the kept candidates measure slower on the bucket than
their slices promised and a ruled-out one's extrapolation becomes the best,
it is dry-run on the bucket before the choice (``Auto``'s decision loop).
"""
from __future__ import annotations

from typing import Any, Sequence

from .auto_decide import predict_exchange
from .auto_measure import Measurement, MeasureHook, measure_candidates

#: The slice is the bucket's values divided by this (its first values).
BOUND_DIVISOR = 16
#: Buckets whose slice would hold fewer values than this are dry-run whole: their exchange is
#: short, and a smaller slice measures mostly latency.
BOUND_MIN_SLICE = 8192
#: A candidate is ruled out when its extrapolated time exceeds this factor times the best one's.
BOUND_FACTOR = 2.0
#: Dry runs per candidate on the slice (the first pays the process's one-off costs).
BOUND_DRY_RUNS = 2


def slice_numel(numel: int) -> int:
    """Values of the bound's slice of a bucket of ``numel`` values; 0 when the bucket is dry-run whole."""
    s = numel // BOUND_DIVISOR
    return s if s >= BOUND_MIN_SLICE else 0


def bound_candidates(labels: Sequence[str], methods: Sequence[Any], x: Any, name: str, comm: Any, *,
                     probe_repeats: int, hook: MeasureHook,
                     tiny_cache: dict[str, float] | None = None,
                     factors: Sequence[float] | None = None
                     ) -> tuple[list[int], list[Measurement] | None, float, list[float]]:
    """(indices of the candidates to dry-run on the whole bucket, every candidate's agreed
    measurement on the slice, the slice's ``scale``, every candidate's extrapolated seconds),
    by the rule of the module docstring.

    Where the bucket is too small for a slice (:func:`slice_numel`) every candidate is kept
    and there are no slice measurements (``None``, scale 1, no bounds). The slice measurements carry
    each candidate's relative error on the slice, against the dense candidate's average there.
    ``factors``: each candidate's steps factor (1 for all when not given); ``bounds`` are returned
    unweighed.
    """
    flat = x.reshape(-1)
    s = slice_numel(int(flat.size))
    if s == 0 or len(methods) < 2:
        return list(range(len(methods))), None, 1.0, []
    scale = flat.size / s
    sliced = measure_candidates(methods, flat[:s], f"{name}#bound", comm, dry_runs=BOUND_DRY_RUNS,
                                probe_repeats=probe_repeats, hook=hook, prune_factor=None,
                                tiny_cache=tiny_cache)
    bounds = [predict_exchange(lb, m, comm.size, scale) for lb, m in zip(labels, sliced)]
    weighed = [t * (1.0 if factors is None else factors[i]) for i, t in enumerate(bounds)]
    best = min(weighed)
    return [i for i, t in enumerate(weighed) if t <= BOUND_FACTOR * best], sliced, scale, bounds


__all__ = ["BOUND_DIVISOR", "BOUND_DRY_RUNS", "BOUND_FACTOR", "BOUND_MIN_SLICE", "bound_candidates",
           "slice_numel"]
