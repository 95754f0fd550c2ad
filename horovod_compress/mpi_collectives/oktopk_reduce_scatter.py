"""Ok-Topk's reduce-scatter variant: split-and-reduce over P fixed equal blocks, no allgatherv.

Ok-Topk's sparse allreduce ("Near-Optimal Sparse Allreduce for Distributed
Deep Learning", Li and Hoefler, PPoPP 2022, Algorithm 1) has two phases:
split-and-reduce (Section 3.1.1, line 8), a sparse reduce-scatter of every
rank's local top-k over P regions, and balance-and-allgatherv (Section
3.1.2, lines 9-13), which keeps the entries of each reduced region above the
global threshold and gives every rank all of them. Sharded data parallelism
(PyTorch FSDP2) needs only the first half: rank j keeps block j of the
result. :func:`ok_sparse_reduce_scatter` is that half alone:

1. the local selection of Algorithm 1, lines 2-4, unchanged: ``local_th``
   exact (the k-th largest ``|acc_i|``) every ``tau_prime`` steps, reused
   and nudged in between, with the local guard
   (:mod:`~horovod_compress.mpi_collectives.oktopk`);
2. the regions are the P equal blocks of the flat index space,
   ``[j n / P, (j + 1) n / P)`` -- FSDP2's shard boundaries, fixed, the
   same on every rank, so lines 5-7 (boundary proposals and their
   allreduce) do not run;
3. split-and-reduce (line 8, :func:`~.oktopk.split_and_reduce`): region j of
   the selection goes to rank j (the rotated, bucketed point-to-point
   schedule of Figure 2(c)); rank j sums what it receives with its own
   entries (float64 sums: its own entry, then the messages in schedule
   order, rounded once to the values' dtype).

What rank j keeps is the **whole reduced region**: the sum over ranks of
every selected entry in block j, not its global-threshold selection. The
re-selection of lines 9-13 is left out because exact error feedback would
then need, on every rank, which of its sent entries survived in some other
rank's block (Algorithm 2, line 6: ``e_i = acc_i`` with the entries of
``idx_i = local top-k ∩ global top-k`` cleared) -- what the allgatherv tells
it and a reduce-scatter does not. Delivering the full reduced sum keeps it
exact with nothing more sent: every selected entry reaches the result, so
``involved`` is the whole local selection and the residual is
``acc_i - (what rank i sent)``. The result on block j is

    u_j = (sum_i Sel(acc_i))[block j],     Sel(a) = a on {|a| >= local_th}, 0 elsewhere

(``Topk(sum_i Topk(acc_i))`` of the allreduce without its outer ``Topk``;
up to P k nonzeros over the whole vector instead of about k).

Volume per rank (each way): the selected entries outside its own block,
one COO entry each (int32 index and the value: 8 bytes for float32), at most
``local_guard * k`` entries (the guard re-selects exactly above it) and
about ``k (P - 1) / P`` for a selection spread evenly -- half of Equation
(1)'s bound ``2k (P-1)/P`` words, since only the reduce-scatter half runs. No
counts are exchanged (the receivers learn sizes from the messages) and
there is no allgatherv.
"""
from __future__ import annotations

from typing import Any, Callable, MutableMapping

import numpy as np

from ..kernels.arrays import get_array_module, to_host
from . import timeline
from .coo_messages import check_index_range
from .oktopk import (
    OkTopkResult,
    OkTopkSchedule,
    _local_selection,
    _nudge,
    split_and_reduce,
)


def block_boundaries(n: int, nranks: int) -> np.ndarray:
    """The P equal blocks of ``[0, n)`` as P+1 int64 offsets ``j n / P`` (n a multiple of P)."""
    if n % nranks:
        raise ValueError(f"oktopk: a reduce-scatter needs a size that is a multiple of the "
                         f"{nranks} ranks, got {n}")
    return np.arange(nranks + 1, dtype=np.int64) * (n // nranks)


def ok_sparse_reduce_scatter(comm: Any, acc: Any, k: int, step: int,
                             state: MutableMapping[str, Any],
                             schedule: OkTopkSchedule = OkTopkSchedule(), *,
                             addends: tuple[np.ndarray, np.ndarray] | None = None,
                             scratch: MutableMapping[str, Any] | None = None,
                             gate: Callable[[bool | None], None] | None = None) -> OkTopkResult:
    """Algorithm 1, lines 2-4 and 8, over the P equal blocks of ``acc`` (see the module doc).

    Arguments as :func:`~.oktopk.ok_sparse_allreduce` (``addends = (g, e)``
    writes ``acc = g + e`` in the selection pass; ``scratch`` keeps the
    selection buffers; ``gate`` is called once, before the first message).
    Returns an :class:`~.oktopk.OkTopkResult` whose ``indices`` and
    ``values`` are this rank's block of ``sum_i Sel(acc_i)`` (ascending
    global indices, sums over ranks: divide by P for the average) and whose
    ``involved`` is the whole local selection (everything sent reached the
    result). ``state`` (an :class:`~horovod_compress.compressors.state.OkTopkState`) keeps ``local_th`` and gets ``local_count``,
    ``local_count_reused`` and ``global_count`` (the entries of this block);
    the allreduce's ``global_th`` and ``boundaries`` are left as they are.
    """
    if addends is not None:
        acc, addends = acc.reshape(-1), (addends[0].reshape(-1), addends[1].reshape(-1))
    else:
        acc = get_array_module(acc).ascontiguousarray(acc).reshape(-1)
    n, p = acc.size, comm.size
    check_index_range(n, "oktopk")
    bounds = block_boundaries(n, p)
    if step < 1:
        raise ValueError(f"oktopk: step must be >= 1, got {step}")
    if k < 1:
        raise ValueError(f"oktopk: k must be >= 1, got {k}")
    th = float(state.local_th or 0.0)
    exact = (step - 1) % schedule.tau_prime == 0 or state.local_th is None or th <= 0.0
    with timeline.span("oktopk.local_selection", "compress", exact=bool(exact)):
        idx, val, th, reused, exact = _local_selection(
            acc, addends, th, exact, k, schedule.local_guard, scratch, gate)
    idx, val = to_host(idx), to_host(val)
    state.local_th = (th if exact else
                      _nudge(th, idx.size, k, schedule.low, schedule.high,
                             schedule.local_scale, schedule.local_scale))
    with comm.phase("oktopk.split_and_reduce"):
        red_idx, red_val = split_and_reduce(comm, idx, val, bounds, schedule.bucket_size)
    state.local_count = int(idx.size)
    state.local_count_reused = reused
    state.global_count = int(red_idx.size)
    return OkTopkResult(red_idx, red_val, np.asarray(idx, dtype=np.int64), int(idx.size),
                        int(red_idx.size), reused, int(red_idx.size), exact, False, False)


__all__ = ["block_boundaries", "ok_sparse_reduce_scatter"]
