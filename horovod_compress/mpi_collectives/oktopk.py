"""Ok-Topk's O(k) sparse allreduce (Li & Hoefler, PPoPP'22, Algorithm 1).

Semantics: every rank ends with ``u = Topk(sum_i Topk(acc_i))`` as a COO
vector (Section 3.1), computed with two phases of communication:

1. :func:`split_and_reduce` (Section 3.1.1, Figures 1 and 2): rank i selects
   its local top-k by a threshold, cuts it into P regions at shared
   ``boundaries`` and sends region j to rank j -- destinations rotated (at
   step s rank i sends to (i+s) % P and receives from (i-s) % P) and grouped
   into buckets of non-blocking point-to-point messages, the previous
   bucket's entries reduced while the current one is in flight. Rank j ends
   with ``reduced_j``, the sum over ranks restricted to region j. Volume
   about ``2k(P-1)/P`` words per rank (Equation 1). Receivers learn sizes
   from the messages (matched probes), so no size exchange precedes them,
   and take them in the order they arrive (:func:`receive_bucket`; ours,
   the sums are formed in schedule order all the same).
2. :func:`balance_and_allgatherv` (Section 3.1.2, Figure 3): rank j keeps the
   entries of ``reduced_j`` with ``|v| >= global_th``; the counts are
   allgathered; when the largest count exceeds ``balance_factor`` times the
   mean (the paper uses 4) entries are moved point-to-point so every rank
   holds an equal share; an allgatherv gives every rank ``u``. At most
   ``4k(P-1)/P`` words (Equation 2). Ours, for P <= ``p2p_gather_max_ranks``
   (8) on a step that reuses the global threshold: :func:`exchange_parts`
   sends every rank's part to every peer in one point-to-point round with the
   counts in the messages' headers (no count allgather, no allgatherv); a
   part above ``2k/P`` entries (:func:`p2p_gather_cap`) sends only its header
   and follows in :func:`complete_parts`' balance-and-allgatherv. Same ``u``.

The boundaries are recomputed every ``tau`` steps (:func:`local_region_boundaries`
then :func:`agree_boundaries`: an allreduce of a P-vector); the local and
global thresholds are exact (:func:`~horovod_compress.kernels.selection.kth_largest_abs`)
every ``tau_prime`` steps and reused in between (Section 3.1.3), which makes
selection a single compare pass. Between exact evaluations the reference
implementation (github.com/Shigangli/Ok-Topk, ``allreducer.py``) nudges the
thresholds when the selected count drifts: local ``th /= 1.012`` below 3k/4
selected, ``th *= 1.012`` above 5k/4; global ``th /= 1.01`` below 3k/4 and
``th *= 1.008`` above 5k/4. We do the same (3k/4 as the lower limit, as the
reference code has it). On a step that
re-evaluates the global threshold, as in the reference, the whole
``reduced_j`` of every rank is allgathered and the exact top-k taken from the
union, so such a step costs more than the bound (once per ``tau_prime`` steps).

The boundaries are also recomputed at sparse steps 2, 3, 5, 9, ... below
``tau`` (:func:`repartition_due`, ours): right after the dense warm-up the
distribution of the local top-k across the index space moves fastest.

Round trips (each collective call is one on a slow link; ours, the paper
counts only volume). A step that reuses both thresholds makes, up to 8
ranks, no collective call: one round of point-to-point messages per bucket of
split-and-reduce (one for P <= 5 with the reference's bucket size 4), then one
round carrying the global top-k with every rank's count (and its largest
candidate key) in the headers, plus an allgatherv when a part exceeds the cap.
Above 8 ranks it makes two, as in the paper: one allgather of the counts and
one allgatherv of the global top-k (and the balancing messages when they run).
A scheduled exact step (one in ``tau_prime``) makes two: a count
allgather and the allgatherv of the union. A repartition costs no call of its
own: when step t+1 is due, the proposals for it (from step t's local top-k)
ride on step t's headers (count allgather or messages) and every rank averages them -- a deviation
from Algorithm 1, lines 5-7, which use step t+1's own local top-k: the
boundaries are one step older (they are reused for ``tau`` steps anyway, and
any boundaries give the same result; they only balance the work). Only the
first sparse step agrees its boundaries with an allreduce.

Guards, not in the paper, keep degenerate inputs and stale thresholds cheap
and correct (each documented where it acts):

* a non-positive threshold (the tensor had at most k nonzeros when it was
  evaluated) is re-evaluated instead of reused, so an all-zero start cannot
  turn into dense messages later;
* a reused local threshold that selects more than ``local_guard * k``
  entries (default 2k) is re-evaluated on the spot -- local work only, and
  only over the entries it selected (they contain the true top k);
* a reused global threshold whose candidates total more than
  ``global_guard * k`` (default 2k; every rank knows the total after the
  count allgather) is replaced by the exact k-th largest ``|v|`` of the
  candidates, found by :func:`distributed_kth_largest_abs`: a radix select
  on the float bit patterns between the stale threshold's and the largest
  candidate's (both known from the count allgather), one histogram
  collective per round, no values moved; with ``2**bits <= k/4`` buckets
  (:func:`radix_bits_for`) that is 2 rounds at k = 40,000 over 8 binades,
  and its last round (an allgather of the per-rank histograms) also gives
  the new counts for the allgatherv. The candidates contain the true global
  top-k, so this step's ``u`` is exact. (The bisection it replaces took 31
  allreduces plus a second count allgather.)

Without them the early steps after the dense warm-up, when the residuals grow
fast, select up to ~10k entries with thresholds from 30 steps before (we
measured this on the digits MLP); the paper reports the same overestimate in
early epochs (Figure 6). Setting both guards to ``inf`` gives the reference
behaviour.

All functions take a :class:`~horovod_compress.mpi_collectives.Communicator`
and use only its accounted operations.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, MutableMapping

import numpy as np

from ..kernels import dispatch
from ..kernels.arrays import get_array_module, to_host
from ..kernels.oktopk_fused import (
    add_select_at_least,
    compact_at_least,
    filter_at_least,
    intersect_sorted,
    merge_sum,
    select_at_least,
)
from ..kernels.selection import kth_largest_abs, select_by_threshold, select_topk
from . import timeline
from .coo_messages import (
    allgatherv_entries,
    as_bytes,
    check_index_range,
    from_bytes,
    gather_counts,
    make_entries,
    split,
)

TAG_SPLIT = 7301
TAG_BALANCE = 7302
TAG_GATHER = 7303


# ------------------------------------------------------------- boundaries
def local_region_boundaries(sorted_indices: np.ndarray, n: int, nranks: int) -> np.ndarray:
    """This rank's proposal of P regions holding equal shares of its local top-k.

    Returns P+1 int64 offsets ``[0, b_1, ..., b_{P-1}, n]`` with
    ``b_j = idx[floor(j m / P)]`` for the m sorted local top-k indices, so
    region j = ``[b_j, b_{j+1})`` holds m/P of them (Section 3.1.1). With no
    local entries the proposal is the even split ``b_j = floor(j n / P)``.
    """
    idx = np.asarray(sorted_indices, dtype=np.int64)
    m = idx.size
    out = np.empty(nranks + 1, dtype=np.int64)
    out[0], out[nranks] = 0, n
    j = np.arange(1, nranks, dtype=np.int64)
    out[1:nranks] = idx[(j * m) // nranks] if m > 0 else (j * n) // nranks
    return out


def union_region_boundaries(local_sorted: np.ndarray, global_sorted: np.ndarray | None, n: int,
                            nranks: int) -> np.ndarray:
    """This rank's proposal of P regions holding equal shares of its local top-k **and** the last
    global top-k together (ours): ``b_j`` = the ``floor(j m / P)``-th smallest of the m indices of
    both (ascending arrays; the union counted with repeats, found by bisection on the index,
    without merging them).

    Region j's owner receives the peers' local entries in it (split and reduce) and sends the
    global entries in it to every peer (the point-to-point gather): its work grows with
    ``L_j + G_j``. The paper's boundaries (:func:`local_region_boundaries`) balance ``L_j``
    alone, and where the reduced sums' large entries gather in a few regions (a transformer's
    embedding gradients, say) one region's global part can exceed the gather's cap and force
    the fallback round. Every rank holds the same last global top-k, so its indices pull every
    proposal the same way. ``global_sorted`` ``None`` or empty: :func:`local_region_boundaries`.
    """
    if global_sorted is None or global_sorted.size == 0:
        return local_region_boundaries(local_sorted, n, nranks)
    a = np.asarray(local_sorted, dtype=np.int64)
    b = np.asarray(global_sorted, dtype=np.int64)
    m = a.size + b.size
    ranks = (np.arange(1, nranks, dtype=np.int64) * m) // nranks      # 0-based positions
    lo = np.zeros(nranks - 1, dtype=np.int64)
    hi = np.full(nranks - 1, max(n - 1, 0), dtype=np.int64)
    while np.any(lo < hi):     # the smallest x with more than ranks[j] indices <= x
        mid = (lo + hi) // 2
        le = np.searchsorted(a, mid, side="right") + np.searchsorted(b, mid, side="right")
        above = le > ranks
        hi = np.where(above, mid, hi)
        lo = np.where(above, lo, mid + 1)
    out = np.empty(nranks + 1, dtype=np.int64)
    out[0], out[nranks] = 0, n
    out[1:nranks] = lo
    return out


def agree_boundaries(comm: Any, proposal: np.ndarray) -> np.ndarray:
    """Average the ranks' proposals with one allreduce of P-1 int64 and round down.

    The average of non-decreasing vectors is non-decreasing, so the result is
    a valid partition of ``[0, n)`` (possibly with empty regions), identical
    on every rank.
    """
    proposal = np.asarray(proposal, dtype=np.int64)
    p = comm.size
    if p == 1:
        return proposal.copy()
    inner = comm.allreduce(np.ascontiguousarray(proposal[1:p]), op="sum")
    out = proposal.copy()
    out[1:p] = inner // p
    return out


def region_cuts(sorted_indices: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Positions in ``sorted_indices`` where each region starts (P+1 values)."""
    return np.searchsorted(sorted_indices, boundaries, side="left")


# -------------------------------------------------------- split and reduce
def rotation_schedule(rank: int, nranks: int, bucket_size: int) -> list[list[tuple[int, int]]]:
    """Figure 2(c): buckets of ``(destination, source)`` pairs for ``rank``.

    At step s = 1 .. P-1 rank i sends to (i+s) % P and receives from (i-s) % P,
    so at every step each rank is the destination of exactly one other rank
    (no endpoint hot spot); steps are grouped ``bucket_size`` at a time, and
    every rank's bucket b holds the same steps, so what rank i sends in bucket
    b is what its destination receives in bucket b.
    """
    steps = [((rank + s) % nranks, (rank - s) % nranks) for s in range(1, nranks)]
    return [steps[i:i + bucket_size] for i in range(0, len(steps), bucket_size)]


def split_and_reduce(comm: Any, indices: np.ndarray, values: np.ndarray,
                     boundaries: np.ndarray, bucket_size: int = 4
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Sparse reduce-scatter over regions (Algorithm 1, line 8; Figure 2(c)).

    ``indices`` (ascending) and ``values`` are this rank's local top-k.
    Region j of it is sent to rank j; returns ``(indices, sums)`` of region
    ``comm.rank`` summed over all ranks, by ascending index, in ``values``'
    dtype (sums are formed in float64 first, adding equal indices in the
    order: this rank's entry, then the messages in the order of the rotation
    schedule). Every message is a slice of an ascending list, so the
    reduction is a merge of sorted runs
    (:func:`~horovod_compress.kernels.oktopk_fused.merge_sum`, O(m) for a
    bucket's m entries) -- the same bits as a sort-based ``coo_sum`` of the
    concatenation, which it replaced.

    One round trip per bucket and no size exchange: every rank sends one
    message to each destination of the bucket (possibly empty: zero bytes
    still tell the receiver "nothing") and receives with a matched probe,
    which learns the size from the message itself. (Sizing receive buffers
    with an alltoall of counts first, as we did before, cost one more round
    trip per step.)
    """
    p, r = comm.size, comm.rank
    cuts = region_cuts(indices, boundaries)
    acc_idx, acc_val = indices[cuts[r]:cuts[r + 1]], values[cuts[r]:cuts[r + 1]]
    if p == 1:
        return acc_idx.astype(np.int64), acc_val.astype(values.dtype)
    entries = make_entries(indices, values)
    edt = entries.dtype

    def reduce_into(acc_idx: np.ndarray, acc_val: np.ndarray,
                    received: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # every message (and acc) is ascending by index: a merge of the sorted runs, sums in
        # float64 in run order -- what coo_sum gives on the concatenation, without its sort
        parts = [b for b in received if b.size]
        if not parts:
            return acc_idx, acc_val
        cat = from_bytes(np.concatenate(parts) if len(parts) > 1 else parts[0], values.dtype)
        starts = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([b.size // edt.itemsize for b in parts], out=starts[1:])
        return merge_sum(acc_idx, acc_val, cat["index"], cat["value"], starts)

    in_flight: list[np.ndarray] = []
    early: dict[int, np.ndarray] = {}
    for bucket in rotation_schedule(r, p, bucket_size):
        sends = [comm.isend(as_bytes(entries[cuts[dst]:cuts[dst + 1]]), dst, TAG_SPLIT)
                 for dst, _ in bucket]
        # overlap: reduce the previous bucket while this one is on the wire
        acc_idx, acc_val = reduce_into(acc_idx, acc_val, in_flight)
        in_flight = receive_bucket(comm, [src for _, src in bucket], early)
        wait_all(sends)
    acc_idx, acc_val = reduce_into(acc_idx, acc_val, in_flight)
    return acc_idx.astype(np.int64, copy=False), acc_val.astype(values.dtype)


def receive_bucket(comm: Any, sources: list[int], early: dict[int, np.ndarray],
                   tag: int = TAG_SPLIT) -> list[np.ndarray]:
    """One message with ``tag`` from each of ``sources``, returned in the order of ``sources``.

    Received in the order they arrive (``comm.recv_any``, where the backend
    has it): waiting for the sources in schedule order would leave a rank
    blocked on a late peer while the others' messages wait, already sent --
    and, for messages above the eager limit, not even moved, since a
    rendezvous transfer starts only when its receive is posted. Every rank
    sends exactly one message with ``tag`` to each other rank per call
    (``TAG_SPLIT`` in split-and-reduce, ``TAG_GATHER`` in :func:`exchange_parts`),
    so one from a later bucket's source is kept in ``early`` for its bucket.
    The sums do not depend on the order of arrival: :func:`split_and_reduce`
    reduces the messages in schedule order.
    """
    recv_any = getattr(comm, "recv_any", None)
    if recv_any is None:
        return [comm.recv(src, tag, dtype=np.uint8) for src in sources]
    got = {src: early.pop(src) for src in sources if src in early}
    while len(got) < len(sources):
        src, data = recv_any(tag, dtype=np.uint8)
        (got if src in sources else early)[src] = data
    return [got[src] for src in sources]


def wait_all(requests: list[Any]) -> None:
    """Wait for point-to-point requests of any communicator backend (its ``Request.wait_all``)."""
    if requests:
        type(requests[0]).wait_all(requests)


# ------------------------------------------------- balance and allgatherv
def balanced_shares(total: int, nranks: int) -> np.ndarray:
    """Equal shares of ``total`` entries: the first ``total % P`` ranks get one more."""
    shares = np.full(nranks, total // nranks, dtype=np.int64)
    shares[: total % nranks] += 1
    return shares


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def balance(comm: Any, entries: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Data balancing (Figure 3): move entries so rank j holds share j of the global order.

    The concatenation in rank order is unchanged; only who holds which slice
    of it changes. Every rank computes the same plan from ``counts``; pieces
    go point-to-point (exact byte counts). Returns ``(my new entries, shares)``.
    """
    p, r = comm.size, comm.rank
    shares = balanced_shares(int(counts.sum()), p)
    src_off, dst_off = _offsets(counts), _offsets(shares)
    out = np.empty(int(shares[r]), dtype=entries.dtype)
    requests: list[Any] = []
    # receive the parts of my target slice [dst_off[r], dst_off[r+1]) held by others
    for i in range(p):
        lo, hi = max(src_off[i], dst_off[r]), min(src_off[i + 1], dst_off[r + 1])
        if hi <= lo:
            continue
        if i == r:
            out[lo - dst_off[r]:hi - dst_off[r]] = entries[lo - src_off[r]:hi - src_off[r]]
        else:
            requests.append(comm.irecv(out[lo - dst_off[r]:hi - dst_off[r]].view(np.uint8), i, TAG_BALANCE))
    # send the parts of my slice [src_off[r], src_off[r+1]) that belong to others
    for j in range(p):
        lo, hi = max(src_off[r], dst_off[j]), min(src_off[r + 1], dst_off[j + 1])
        if hi > lo and j != r:
            requests.append(comm.isend(as_bytes(entries[lo - src_off[r]:hi - src_off[r]]), j, TAG_BALANCE))
    wait_all(requests)
    return out, shares


def balance_and_allgatherv(comm: Any, indices: np.ndarray, values: np.ndarray,
                           balance_factor: float = 4.0, counts: np.ndarray | None = None
                           ) -> tuple[np.ndarray, np.ndarray, bool]:
    """Allgatherv of every rank's COO part, balanced first when it is skewed.

    Returns ``(indices, values, balanced)``: the concatenation of all ranks'
    parts in rank order (identical on every rank) and whether the balancing
    step ran (largest count > ``balance_factor`` x mean count, Section 5.3).
    ``counts`` (every rank's entry count) is allgathered unless given.
    """
    entries = make_entries(indices, values)
    if counts is None:
        counts = gather_counts(comm, entries.size)
    total = int(counts.sum())
    balanced = False
    if comm.size > 1 and total > 0 and counts.max() > balance_factor * total / comm.size:
        entries, counts = balance(comm, entries, counts)
        balanced = True
    everything = allgatherv_entries(comm, entries, counts)
    idx, val = split(everything)
    return idx, val, balanced


# ------------------------------------------ the global top-k point to point
def p2p_gather_cap(k: int, nranks: int, schedule: "OkTopkSchedule") -> int:
    """Most entries a rank sends to every peer in :func:`exchange_parts`: ``c k / P``.

    ``c = min(global_guard, balance_factor)`` (2 with the defaults). When every
    rank's part is at most ``global_guard k / P`` the total is at most
    ``global_guard k``, so the global guard cannot trip and the parts that
    moved are exactly the allgatherv's; a rank sends at most ``2 c k (P-1)/P``
    words, Equation 2's ``4k(P-1)/P`` at ``c = 2``.
    """
    return int(min(schedule.global_guard, schedule.balance_factor) * k // nranks)


def exchange_parts(comm: Any, entries: np.ndarray, header: np.ndarray, send_entries: bool
                   ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray] | None]]:
    """One point-to-point round: this rank's ``header`` and (``send_entries``) ``entries`` to every peer.

    Ours, in place of the count allgather and the allgatherv of Section 3.1.2
    for P <= ``p2p_gather_max_ranks``: every rank sends one message to each
    other rank (destinations rotated, (r+s) % P at s = 1 .. P-1, as in Figure
    2(c)) and takes the P-1 messages in the order they arrive
    (:func:`receive_bucket`; sizes from the messages). That is one
    synchronising round where the count allgather and the allgatherv were two
    (the allgatherv a ring of P-1 dependent steps); each rank sends
    ``(P-1) c_r`` entries, the same as the ring's ``sum of the others' c_j``
    when the parts are balanced.

    ``header`` (int64, same length on every rank) starts with the entry count;
    a message carries the entries iff its length says so, so an empty part and
    a header-only message are told apart. Returns ``(headers, parts)``:
    ``headers[j]`` rank j's header (identical on every rank) and ``parts[j]``
    rank j's ``(int64 indices, values)``, or ``None`` where j sent only its
    header (and for this rank when ``send_entries`` is false).
    """
    p, r = comm.size, comm.rank
    head = np.ascontiguousarray(header, dtype=np.int64)
    if int(head[0]) != entries.size:
        raise ValueError(f"rank {r}: header count {int(head[0])} but {entries.size} entries")
    msg = head.view(np.uint8)
    if send_entries and entries.size:
        msg = np.concatenate([msg, as_bytes(entries)])
    sends = [comm.isend(msg, (r + s) % p, TAG_GATHER) for s in range(1, p)]
    sources = [(r - s) % p for s in range(1, p)]
    received = receive_bucket(comm, sources, {}, TAG_GATHER)
    wait_all(sends)
    headers = np.empty((p, head.size), np.int64)
    headers[r] = head
    parts: list[tuple[np.ndarray, np.ndarray] | None] = [None] * p
    if send_entries:
        parts[r] = split(entries)
    hb = head.nbytes
    for src, buf in zip(sources, received):
        if buf.size < hb:
            raise RuntimeError(f"oktopk: a {buf.size}-byte message from rank {src}, "
                               f"shorter than the {hb}-byte header")
        headers[src] = np.ascontiguousarray(buf[:hb]).view(np.int64)
        body = buf[hb:]
        if body.size == int(headers[src, 0]) * entries.dtype.itemsize:
            parts[src] = split(from_bytes(body, entries.dtype["value"]))
    return headers, parts


def complete_parts(comm: Any, parts: list[tuple[np.ndarray, np.ndarray] | None],
                   indices: np.ndarray, values: np.ndarray, counts: np.ndarray,
                   balance_factor: float = 4.0) -> tuple[np.ndarray, np.ndarray, bool]:
    """Every rank's part in rank order, the parts :func:`exchange_parts` did not carry added.

    ``indices, values`` are this rank's part, ``counts`` every rank's count.
    The parts of ranks that sent only their header come in one
    :func:`balance_and_allgatherv` (the other ranks contribute nothing to it),
    so the result is what one balance-and-allgatherv of every part gives
    (identical on every rank). Returns ``(indices, values, balanced)``.
    """
    p, r = comm.size, comm.rank
    missing = np.array([part is None for part in parts])
    m_counts = np.where(missing, np.asarray(counts, dtype=np.int64), 0)
    rest_idx, rest_val, balanced = indices[:0], values[:0], False
    if missing.any():
        mine = (indices, values) if missing[r] else (indices[:0], values[:0])
        rest_idx, rest_val, balanced = balance_and_allgatherv(comm, mine[0], mine[1],
                                                              balance_factor, m_counts)
    off = _offsets(m_counts)
    pieces = []
    for j in range(p):
        if j == r:
            pieces.append((indices, values))
        elif missing[j]:
            pieces.append((rest_idx[off[j]:off[j + 1]], rest_val[off[j]:off[j + 1]]))
        else:
            pieces.append(parts[j])
    u_idx = np.concatenate([q[0] for q in pieces]).astype(np.int64, copy=False)
    u_val = np.concatenate([q[1] for q in pieces]).astype(values.dtype, copy=False)
    return u_idx, u_val, balanced


# ------------------------------------------------- distributed exact selection
def _abs_keys(values: np.ndarray) -> tuple[np.ndarray, np.dtype]:
    """IEEE bit patterns of ``|v|``: uint32 for float32 (and narrower, widened), uint64 for float64.

    Keys of non-negative floats order like the floats themselves.
    """
    v = np.abs(np.ascontiguousarray(values).reshape(-1))
    if v.dtype == np.float64:
        return v.view(np.uint64), np.dtype(np.float64)
    v = v.astype(np.float32, copy=False)
    return v.view(np.uint32), np.dtype(np.float32)


def abs_key(value: float, dtype: Any) -> int:
    """The key (IEEE bit pattern) of ``|value|`` as float64 if ``dtype`` is float64, else float32."""
    if np.dtype(dtype) == np.float64:
        return int(np.array([abs(value)], np.float64).view(np.uint64)[0])
    return int(np.array([abs(value)], np.float32).view(np.uint32)[0])


def max_abs_key(values: np.ndarray) -> int:
    """Largest key of ``|values|`` (0 for an empty array)."""
    keys, _ = _abs_keys(values)
    return int(keys.max()) if keys.size else 0


def radix_rounds(width: int, bits: int) -> list[int]:
    """Shifts of the histogram rounds that pin one key among ``width`` consecutive keys.

    ``R = ceil(L / bits)`` rounds for ``L = bit_length(width - 1)``, the L
    bits spread evenly over them: round r histograms ``(key - base) >>
    shifts[r]`` into at most ``2**bits`` buckets; the last shift is 0.
    """
    total = max(1, int(width - 1).bit_length())
    rounds = -(-total // bits)
    per = -(-total // rounds)
    return [max(0, total - per * (r + 1)) for r in range(rounds)]


def radix_bits_for(k: int, max_bits: int = 13) -> int:
    """Histogram size per round for selecting the k-th value: ``2**bits <= k / 4`` buckets.

    With int32 counts a round then moves at most k bytes per rank (an eighth of
    the 8k bytes of the k selected entries), so the step's volume bound holds;
    between 16 and ``2**max_bits`` buckets. At k = 40,000 (1% of a 2000 x 2000
    gradient) that is 13 bits: two rounds for a key range of up to 8 binades.
    """
    return int(min(max_bits, max(4, (max(int(k), 1) // 4).bit_length() - 1)))


def distributed_kth_largest_abs(comm: Any, values: np.ndarray, k: int, *,
                                key_range: tuple[int, int] | None = None, bits: int = 11,
                                with_counts: bool = False, count_dtype: Any = np.int64,
                                gather_max_ranks: int = 8) -> Any:
    """Exact k-th largest ``|v|`` over the union of every rank's ``values``: a radix select.

    The keys (IEEE bit patterns of ``|v|``, which order like the magnitudes)
    lie in ``key_range = (lo, hi)`` (inclusive; default every non-negative
    float up to inf); keys below ``lo`` are ignored, none may exceed ``hi``.
    Each round every rank histograms ``(key - base) >> shift`` of its keys in
    the current interval into at most ``2**bits`` buckets, one allreduce
    (int64) sums the histograms, and every rank walks the global histogram
    from the top until the count reaches the rank still wanted: the interval
    shrinks to that bucket. With ``L = bit_length(hi - lo)`` this takes
    ``ceil(L / bits)`` rounds (:func:`radix_rounds`), one collective each:
    3 for the whole float32 range with the default 11 bits (2048 buckets, 16
    KB), 2 with 13 bits when ``hi/lo`` spans at most 8 binades; the bisection it
    replaces took 31 one-integer allreduces. No values move. The union must
    hold at least k keys in the range. Histograms travel as ``count_dtype``
    (int32 halves the bytes when the union is known to hold fewer than 2**31
    keys; every rank must pass the same).

    With ``with_counts`` the function returns ``(threshold, counts)`` where
    ``counts[j]`` is how many of rank j's keys are ``>= threshold`` -- what
    an allgatherv of the selection needs. For P <= ``gather_max_ranks`` (8)
    the last round is then an allgather of the per-rank histograms instead of
    an allreduce (no extra call; P times the bytes); for larger P one extra
    allgather of one int64 per rank follows.

    This is Ok-Topk's ``th_re_evaluate`` (Algorithm 1, line 11) on values
    spread over the ranks: the exact k-th largest, as gathering the values
    and selecting would give, with O(2**bits) words per round.
    """
    keys, fdt = _abs_keys(values)
    top = 0x7FF0000000000000 if fdt == np.float64 else 0x7F800000
    lo, hi = (0, top) if key_range is None else (int(key_range[0]), int(key_range[1]))
    if not 1 <= bits <= 20:
        raise ValueError(f"bits must be in [1, 20], got {bits}")
    if hi < lo:
        raise ValueError(f"empty key range [{lo}, {hi}]")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    kt = keys.dtype.type
    sel = keys[keys >= kt(lo)] if lo > 0 else keys
    above = 0                    # this rank's keys above the current interval
    base, width, want = lo, hi - lo + 1, int(k)
    shifts = radix_rounds(width, bits)
    gather_last = with_counts and comm.size <= gather_max_ranks
    counts = None
    for r, shift in enumerate(shifts):
        nb = ((width - 1) >> shift) + 1
        digit = ((sel - kt(base)) >> kt(shift)).astype(np.intp)
        hist = np.bincount(digit, minlength=nb).astype(count_dtype)
        if hist.size > nb:
            raise ValueError(f"a key above the range's top {hi}")
        last = r == len(shifts) - 1
        if last and gather_last:
            rows = comm.allgather(np.concatenate([np.array([above], count_dtype), hist]))
            rows = rows.reshape(comm.size, nb + 1).astype(np.int64)
            ghist = rows[:, 1:].sum(axis=0)
        else:
            ghist = comm.allreduce(hist, op="sum") if comm.size > 1 else hist
        from_top = np.cumsum(ghist[::-1], dtype=np.int64)
        pos = int(np.searchsorted(from_top, want))       # first position with from_top >= want
        if pos >= nb:
            raise ValueError(f"fewer than k={k} values in the key range")
        b = nb - 1 - pos
        want -= int(from_top[pos] - ghist[b])
        if last and gather_last:
            counts = rows[:, 0] + rows[:, 1 + b:].sum(axis=1)
        above += int(np.count_nonzero(digit > b))
        sel = sel[digit == b]
        base += b << shift
        width = min(1 << shift, width - (b << shift))
    th = float(np.array([base], dtype=keys.dtype).view(fdt)[0])
    if not with_counts:
        return th
    if counts is None:
        counts = gather_counts(comm, above + sel.size)
    return th, np.asarray(counts, dtype=np.int64)


# --------------------------------------------------------------- Algorithm 1
@dataclass(frozen=True)
class OkTopkSchedule:
    """Periods and threshold-drift rules of Ok-Topk (defaults: the paper and its code)."""

    tau: int = 64                   # space repartition period (Section 3.1.1)
    tau_prime: int = 32             # threshold re-evaluation period (Section 3.1.3)
    bucket_size: int = 4            # messages per bucket in split_and_reduce (reference: 4)
    balance_factor: float = 4.0     # balance when max count > factor x mean (Section 5.3)
    low: float = 0.75               # drift limits, as fractions of k (reference: 3k/4, 5k/4)
    high: float = 1.25
    local_scale: float = 1.012      # reference: local th /= or *= 1.012
    global_scale_up: float = 1.01   # reference: global th /= 1.01 when too few selected
    global_scale_down: float = 1.008  # reference: global th *= 1.008 when too many
    early_repartition: bool = True  # also repartition at steps 2, 3, 5, 9, ... < tau (ours)
    repartition_with_global: bool = True  # proposals balance local + last global top-k (ours)
    local_guard: float = 2.0        # re-evaluate local_th when a reused one selects > guard*k
    global_guard: float = 2.0       # re-select exactly when a reused global_th selects > guard*k
    radix_bits: int = 13            # at most 2**radix_bits buckets per round of the exact select
    p2p_gather_max_ranks: int = 8   # up to this P, the global top-k goes point to point (ours)


@dataclass
class OkTopkResult:
    """What one Ok-Topk sparse allreduce returns on every rank."""

    indices: np.ndarray        # global top-k indices (ascending, identical on every rank)
    values: np.ndarray         # their values: sums over ranks (divide by P for the average)
    involved: np.ndarray       # local top-k indices ∩ global ones (line 14): the residual forgets these
    local_count: int           # how many entries this rank selected locally
    global_count: int          # how many entries u has
    local_count_reused: int    # how many the reused local_th selected (before the guard)
    global_count_reused: int   # how many the reused global_th selected (before the guard)
    exact_local: bool          # whether local_th was re-evaluated this step
    exact_global: bool         # whether global_th was re-evaluated this step
    balanced: bool             # whether the data-balancing step ran


def repartition_due(step: int, schedule: OkTopkSchedule) -> bool:
    """Whether sparse step ``step`` recomputes the region boundaries.

    Every ``tau`` steps (Algorithm 1, line 5) and, with ``early_repartition``,
    also at steps 2, 3, 5, 9, 17, ... (one plus a power of two) below ``tau``:
    right after the dense warm-up the residuals are still building up and the
    local top-k drift across the index space (on the digits MLP at P=8 the
    first boundaries left rank 0 receiving 4x its share for 60 steps). Each
    extra repartition is one allreduce of P-1 int64.
    """
    if (step - 1) % schedule.tau == 0:
        return True
    s = step - 1
    return schedule.early_repartition and s < schedule.tau and s & (s - 1) == 0


def _nudge(th: float, count: int, k: int, low: float, high: float,
           up: float, down: float) -> float:
    if count < low * k:
        return th / up
    if count > high * k:
        return th * down
    return th


def _host_float_vector(a: Any) -> bool:
    """Whether ``a`` is a contiguous float32/float64 NumPy vector (what the fused kernels take)."""
    return (type(a) is np.ndarray and a.dtype in (np.float32, np.float64)
            and a.flags.c_contiguous)


def _selection_buffers(scratch: MutableMapping[str, Any] | None, n: int, k: int,
                       dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Reused COO buffers for a threshold selection over n entries (room for ~4k hits at first).

    They grow (to twice the largest count seen, at most n) when a selection
    overflows them, so a stale threshold costs one extra pass once, not every step.
    """
    store: MutableMapping[str, Any] = {} if scratch is None else scratch
    bi, bv = store.get("sel_idx"), store.get("sel_val")
    want = min(n, max(4 * k, 4096, int(store.get("sel_want", 0))))
    if bi is None or bi.size < want or bv.dtype != dtype:
        bi = store["sel_idx"] = np.empty(want, np.int64)
        bv = store["sel_val"] = np.empty(want, dtype)
    return bi, bv


def _local_selection(acc: Any, addends: tuple[np.ndarray, np.ndarray] | None, th: float,
                     exact: bool, k: int, guard: float,
                     scratch: MutableMapping[str, Any] | None,
                     gate: Callable[[bool | None], None] | None
                     ) -> tuple[Any, Any, float, int, bool]:
    """Algorithm 1, lines 2-4 (and Algorithm 2, line 4 when ``addends`` is given).

    Returns ``(idx, val, th, count_reused, exact)``: the selected COO (ascending
    indices), the threshold it used, how many the reused threshold selected
    (before the guard) and whether the threshold is now exact. With
    ``addends = (g, e)`` the accumulator ``acc = g + e`` is written during the
    selection pass (host float vectors only). ``gate`` is called once, before
    anything is selected or after the pass that wrote ``acc`` (with whether
    ``g`` was finite, as that pass found), and raises to abandon the step.
    """
    n = acc.size
    fused = addends is not None and not exact and _host_float_vector(acc)
    if gate is not None and not fused:
        gate(None)                      # no fused pass reads g: the gate tests it
    if not _host_float_vector(acc):
        # CuPy (or other) arrays: the O(n) passes run where acc lives, through the dispatcher
        if exact:
            th = dispatch.call("kth_largest_abs", acc, k)
        idx, val = dispatch.call("select_by_threshold", acc, th)
        reused = int(idx.size)
        if not exact and idx.size > guard * k:
            th = dispatch.call("kth_largest_abs", val, k)
            pos, val = dispatch.call("select_by_threshold", val, th)
            idx = idx[pos]
            exact = True
        return idx, val, th, reused, exact
    if exact:
        if addends is not None:
            np.add(addends[0], addends[1], out=acc)
        # the threshold and the selection in one read of acc (a sampled bound, then the
        # exact k-th largest among the few candidates above it; same result)
        store = None if scratch is None else scratch.setdefault("topk", {})
        idx, val, th = select_topk(acc, k, scratch=store)
        return idx, val, th, int(idx.size), True
    # a reused threshold: one compare pass (fused with acc = g + e), hits into reused buffers
    bi, bv = _selection_buffers(scratch, n, k, acc.dtype)
    if addends is not None:
        report: dict[str, bool] = {}
        count = add_select_at_least(addends[0], addends[1], acc, th, bi, bv, report=report)
        if gate is not None:
            gate(report["finite"])      # before the guard's work, and before any message
    else:
        count = select_at_least(acc, th, bi, bv)
    if count > bi.size and scratch is not None:
        scratch["sel_want"] = min(n, 2 * count)     # room for it from the next step on
    if count > guard * k:
        # the stale selection has more than k entries, so it holds the true top k: the
        # exact k-th largest |acc| is found among these candidates and selected from
        # them (O(candidates), not two more O(n) passes over acc; same result)
        if count <= bi.size:
            th = kth_largest_abs(bv[:count], k)
            kept = compact_at_least(bi, bv, count, th)
            return bi[:kept], bv[:kept], th, count, True
        idx, val, th = select_topk(acc, k)      # they did not fit: the same selection over acc
        return idx, val, th, count, True
    if count > bi.size:                         # (only when the guard is off or above 4)
        bi, bv = _selection_buffers(scratch, n, k, acc.dtype) if scratch is not None else \
            (np.empty(count, np.int64), np.empty(count, acc.dtype))
        select_at_least(acc, th, bi, bv)
    return bi[:count], bv[:count], th, count, False


def ok_sparse_allreduce(comm: Any, acc: np.ndarray, k: int, step: int,
                        state: Any,
                        schedule: OkTopkSchedule = OkTopkSchedule(), *,
                        addends: tuple[np.ndarray, np.ndarray] | None = None,
                        scratch: MutableMapping[str, Any] | None = None,
                        gate: Callable[[bool | None], None] | None = None) -> OkTopkResult:
    """Algorithm 1 on this rank's flat accumulator ``acc`` at sparse step ``step`` (1-based).

    ``state`` (the method's ``OkTopkState``: attributes, ``None`` until set)
    holds ``local_th``, ``global_th``, ``boundaries`` and the agreed
    ``next_boundaries`` (for step ``next_boundaries_step``) between calls,
    and gets this step's ``local_count``, ``global_count``,
    ``local_count_reused`` and ``global_count_reused``; it must be the same
    tensor's state on every rank. ``k`` may exceed ``acc.size`` (then every
    nonzero entry is selected).

    ``addends = (g, e)`` (flat contiguous NumPy vectors of ``acc``'s dtype):
    ``acc`` is an output buffer, written as ``g + e`` (Algorithm 2, line 4)
    in the same pass as the local selection. ``scratch`` (a dict the caller
    keeps per tensor) holds the selection buffers between calls, so a step
    allocates nothing of size n. Neither changes the result. ``gate``
    (:meth:`~horovod_compress.compressors.base.Method._pass_finite_gate`) is
    called exactly once, after the local pass and before the first message,
    with whether ``g`` is finite when the fused pass found it (else ``None``);
    it may raise to abandon the step before ``state`` is changed.
    """
    if addends is not None:
        g, e = addends
        if not (_host_float_vector(acc) and _host_float_vector(g) and _host_float_vector(e)
                and g.dtype == e.dtype == acc.dtype and g.size == e.size == acc.size):
            raise ValueError("oktopk: addends must be contiguous NumPy vectors of acc's dtype and size")
        acc, addends = acc.reshape(-1), (g.reshape(-1), e.reshape(-1))
    else:
        acc = get_array_module(acc).ascontiguousarray(acc).reshape(-1)
    n, p = acc.size, comm.size
    check_index_range(n, "oktopk")
    if step < 1:
        raise ValueError(f"oktopk: step must be >= 1, got {step}")
    if k < 1:
        raise ValueError(f"oktopk: k must be >= 1, got {k}")
    first_of_period = (step - 1) % schedule.tau_prime == 0

    # lines 2-4: local threshold, exact every tau' steps, reused (and nudged) otherwise
    th = float(state.local_th or 0.0)
    exact_local = first_of_period or state.local_th is None or th <= 0.0
    with timeline.span("oktopk.local_selection", "compress", exact=bool(exact_local)) as where:
        idx, val, th, local_reused, exact_local = _local_selection(
            acc, addends, th, exact_local, k, schedule.local_guard, scratch, gate)
        if where is not None:       # a timeline records: which rank re-evaluated, and how many it kept
            where.update(k=int(k), selected=int(idx.size), selected_by_reused=int(local_reused),
                         re_evaluated=bool(exact_local))
    idx, val = to_host(idx), to_host(val)
    state.local_th = (th if exact_local else
                      _nudge(th, idx.size, k, schedule.low, schedule.high,
                             schedule.local_scale, schedule.local_scale))

    # lines 5-7: region boundaries every tau steps (or when missing / for another size).
    # A due repartition normally arrives agreed already: the proposals rode on the
    # previous step's count allgather (see _count_message); else one allreduce here.
    bounds = state.boundaries
    ahead, ahead_step = state.next_boundaries, state.next_boundaries_step
    state.next_boundaries = None                  # used on this step or never
    if ahead is not None:
        state.next_boundaries_step = None
    ahead_ok = (ahead is not None and ahead_step == step
                and len(ahead) == p + 1 and int(ahead[-1]) == n)
    if ahead_ok:
        bounds = np.asarray(ahead, dtype=np.int64)
    elif (repartition_due(step, schedule) or bounds is None or len(bounds) != p + 1
            or int(bounds[-1]) != n):
        with comm.phase("oktopk.space_repartition"):
            bounds = agree_boundaries(comm, local_region_boundaries(idx, n, p))
    state.boundaries = bounds
    bounds = np.asarray(bounds, dtype=np.int64)
    propose = p > 1 and repartition_due(step + 1, schedule)

    def count_header(count: int, max_key: int) -> np.ndarray:
        """This rank's count, its largest key and (when due) its proposal of next step's boundaries."""
        msg = [np.array([count, max_key], dtype=np.int64)]
        if propose:
            last = state.last_global if schedule.repartition_with_global else None
            if last is not None:
                last = np.asarray(last, dtype=np.int64)
                if last.size and int(last[-1]) >= n:
                    last = None                            # another tensor size: not this one's
            msg.append(union_region_boundaries(idx, last, n, p)[1:p])
        return np.concatenate(msg)

    def count_exchange(count: int, max_key: int) -> tuple[np.ndarray, int]:
        """One allgather of the headers: every rank's count, the largest key, next step's boundaries."""
        return read_headers(comm.allgather(count_header(count, max_key)).reshape(p, -1))

    def read_headers(rows: np.ndarray) -> tuple[np.ndarray, int]:
        """Every rank's count and the largest key from the P headers; next step's boundaries agreed."""
        if propose:
            nxt = np.empty(p + 1, dtype=np.int64)
            nxt[0], nxt[p] = 0, n
            nxt[1:p] = rows[:, 2:].sum(axis=0) // p      # = agree_boundaries' rounding
            state.next_boundaries, state.next_boundaries_step = nxt, step + 1
        return rows[:, 0].copy(), int(rows[:, 1].max())

    # line 8: split and reduce
    with comm.phase("oktopk.split_and_reduce"):
        red_idx, red_val = split_and_reduce(comm, idx, val, bounds, schedule.bucket_size)

    # lines 9-13: global threshold and balance-and-allgatherv
    gth = float(state.global_th or 0.0)
    exact_global = first_of_period or state.global_th is None or gth <= 0.0
    balanced = False
    if exact_global:
        with comm.phase("oktopk.threshold_allgatherv"):
            counts, _ = count_exchange(red_idx.size, 0)
            union = allgatherv_entries(comm, make_entries(red_idx, red_val), counts)
        u_idx_all, u_val_all = split(union)
        gth = kth_largest_abs(u_val_all, k)
        pos, u_val = select_by_threshold(u_val_all, gth)
        u_idx = u_idx_all[pos]
        global_reused = int(u_idx.size)
        state.global_th = gth
    else:
        direct = 1 < p <= schedule.p2p_gather_max_ranks
        with comm.phase("oktopk.gather_p2p" if direct else "oktopk.balance_and_allgatherv"):
            g_idx, g_val, top = filter_at_least(red_idx, red_val, gth)
            parts = None
            if direct:
                # one round of messages, the counts in their headers (exchange_parts); a part
                # above the cap sends only its header and follows in complete_parts
                rows, parts = exchange_parts(
                    comm, make_entries(g_idx, g_val), count_header(g_idx.size, abs_key(top, g_val.dtype)),
                    g_idx.size <= p2p_gather_cap(k, p, schedule))
                counts, top_key = read_headers(rows)
            else:
                counts, top_key = count_exchange(g_idx.size, abs_key(top, g_val.dtype))
            global_reused = int(counts.sum())
            if global_reused > schedule.global_guard * k:
                # the reused threshold went stale: the candidates (keys between gth's and the
                # largest) hold the true top k; find its exact threshold with a few histogram
                # allreduces, the last of which also tells every rank's new count
                lo = max(0, abs_key(gth, g_val.dtype) - 1)
                with comm.phase("oktopk.threshold_select"):
                    gth, counts = distributed_kth_largest_abs(
                        comm, g_val, k, key_range=(lo, max(lo, top_key)),
                        bits=radix_bits_for(k, schedule.radix_bits), with_counts=True,
                        count_dtype=np.int32 if global_reused < 2**31 else np.int64)
                g_idx, g_val, _ = filter_at_least(g_idx, g_val, gth)
                if parts is not None:   # the parts already here: the same filter as their ranks'
                    parts = [None if q is None else filter_at_least(q[0], q[1], gth)[:2]
                             for q in parts]
                exact_global = True
            if parts is None:
                u_idx, u_val, balanced = balance_and_allgatherv(
                    comm, g_idx, g_val, schedule.balance_factor, counts)
            else:
                u_idx, u_val, balanced = complete_parts(
                    comm, parts, g_idx, g_val, counts, schedule.balance_factor)
        rec = timeline.recorder
        if rec is not None:         # every rank's share of u: the regions' balance, as a mark
            now = time.perf_counter()
            rec.add("oktopk.global_counts", timeline.PHASE, now, now,
                    {"counts": [int(c) for c in counts], "balanced": bool(balanced)})
        state.global_th = (gth if exact_global else
                           _nudge(gth, u_idx.size, k, schedule.low, schedule.high,
                                  schedule.global_scale_up, schedule.global_scale_down))

    # line 14: which local entries made it into u
    # (both ascending: one merge, no sort)
    involved = intersect_sorted(idx, u_idx)
    # the next step proposes step + 2's boundaries when one is due then (union_region_boundaries)
    state.last_global = (np.array(u_idx, dtype=np.int64, copy=True)
                         if schedule.repartition_with_global and p > 1
                         and repartition_due(step + 2, schedule) else None)
    state.local_count = int(idx.size)
    state.global_count = int(u_idx.size)
    state.local_count_reused = local_reused
    state.global_count_reused = global_reused
    return OkTopkResult(u_idx, u_val, involved, int(idx.size), int(u_idx.size),
                        local_reused, global_reused, exact_local, exact_global, balanced)


__all__ = ["OkTopkResult", "OkTopkSchedule", "abs_key", "agree_boundaries", "balance",
           "balance_and_allgatherv", "balanced_shares", "complete_parts", "distributed_kth_largest_abs",
           "exchange_parts", "p2p_gather_cap",
           "local_region_boundaries", "max_abs_key", "union_region_boundaries", "radix_bits_for", "radix_rounds",
           "receive_bucket", "repartition_due", "rotation_schedule", "ok_sparse_allreduce", "region_cuts",
           "split_and_reduce"]
