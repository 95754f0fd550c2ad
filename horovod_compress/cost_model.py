"""The alpha-beta cost model of a data-parallel training step.

The papers model communication with the classic latency-bandwidth (Hockney)
model: sending L bytes costs ``alpha + L * beta``. Ok-Topk (Li & Hoefler,
"Near-Optimal Sparse Allreduce for Distributed Deep Learning", PPoPP'22,
Section 2 and Table 1) gives each collective's latency term -- allreduce
``2 log2(P) alpha``, allgather ``log2(P) alpha``, Ok-Topk's point-to-point
phases ``(2P + 2 log2 P) alpha`` -- and its bandwidth term from the volume a
rank moves; Global-QSGD (Section 7) models a tree allreduce as
``2 log(n) alpha + 2 log(n) S / B + log(n) S / gamma``, i.e. adds the
compute of the reduction. Here one step costs

    T = T_compute + T_compress + sum_op max(0, calls_op * rounds_op(P) * alpha
                                               + max(sent_op, received_op) / (eta_op * B) - W_op)

with ``B`` the link bandwidth in bytes/s, ``sent``/``received`` the bytes per
rank the :class:`~horovod_compress.mpi_collectives.Communicator` counts under
the Ok-Topk volume model (a link is full duplex, so sending and receiving
overlap), ``rounds_op(P)`` the latency terms of Table 1, and ``eta_op`` the
fraction of the link a collective reaches (1 for the textbook model; measured
on a testbed by :func:`fit_link` from that op's own probe), and ``W_op`` the
method's work that runs while the op's bytes are on the wire (0 except for a
pipelined ring, below). ``T_compute`` (forward/backward) and ``T_compress``
(everything the method computes) are measured.

On a shaped testbed these refinements bring the same model closer
(:func:`predict` applies each only when the :class:`Network` carries the
quantity, so a preset stays the textbook model):

* **Rounds of the algorithm MPI really runs.** Table 1's allreduce term
  ``2 log2(P) alpha`` is Rabenseifner's reduce-scatter + allgather (Thakur,
  Rabenseifner & Gropp, "Optimization of Collective Communication Operations
  in MPICH", IJHPCA 2005, Section 4.4); the testbed's MPI is told to run
  recursive doubling below ``ring_from`` bytes (``log2 P`` rounds, same paper)
  and the ring from there on (``2 (P-1)`` rounds; Patarasuk & Yuan,
  "Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations",
  JPDC 2009). Rounds therefore depend on each call's message size, which
  :attr:`StepProfile.call_bytes` records per call.
* **A per-round latency floor** ``round_latency``: the time one round of a
  tiny allreduce takes between bursts of CPU work (measured), i.e. the
  scheduler's share of alpha when ranks outnumber cores. A call costs
  ``rounds * max(alpha_op, round_latency)``.
* **The token bucket of a shaped link** (``burst_bytes``, the ``burst`` of
  Linux's token bucket filter, tc-tbf(8)): a link that was idle lets its
  first ``b`` bytes through at the speed of the wire underneath, so a call
  moving ``L`` bytes per link waits
  for tokens only for ``max(0, L - tokens)`` bytes; the bucket refills at the
  link rate during the CPU work between calls (``tokens = min(b, left + B
  gap)``). Without it every sub-megabyte exchange is over-predicted at 100
  Mbit (Rand-K's 0.46 MB allreduce at P = 2: 37 ms at the full link rate,
  21 ms measured).
* **Each collective kind at its own measured rate and alpha, the rate at
  each message size** (``Network.efficiency_curve``): every op is probed at
  several sizes and a call is priced at the rate probed for its own size
  (log-linear between two). On the testbed a 1 MB allreduce at P = 2 reached
  0.90 of 1 Gbit and a 16 MB one 0.62, so PowerSGD's 72 factor allreduces and
  a dense 46 MB one cannot share one rate. An operation without a probe of
  its own takes the nearest one's (:data:`PROBE_OF`).
* **The transport that really carried the bytes.** A method may run an
  allreduce as its own pipelined ring of point-to-point messages
  (``reduce_ops.ring_reduce_once``: Global-QSGD's 8-bit exponential payload,
  the 16-bit casts) instead of MPI's allreduce. Its bytes are still an
  allreduce's (2N(P-1)/P per rank), but they cross the links as eager
  point-to-point segments, so the profile lists them under the op
  :data:`RING`: ``2 (P-1)`` latency rounds (Patarasuk & Yuan's ring, one
  pipeline start per step) at the ring's own probe (the same ring over a
  whole message; the point-to-point probe's alpha and rate where a run has
  no ring probe).
* **Work that hides the wire** (``StepProfile.overlap_s``): that ring runs the
  method's quantization, reduction and dequantization between its progress
  calls while segments are on the wire, so a rank is inside MPI only for the
  part of the wire time its own work did not cover:
  ``T_op = max(0, latency + transfer - W_op)`` with ``W_op`` the measured
  wall time of that work (the pipelining bound ``max(T_wire, W)`` of a
  pipelined ring, minus the ``W`` counted as compression).
* **Point-to-point exchanges** (op ``p2p``): a send and a receive counted as
  two calls are one exchange on a full-duplex link (each direction has its
  own token bucket), so without recorded sizes ``calls / 2`` exchanges of
  ``max(sent, received)`` bytes in all pass through the buckets, not ``calls``.
  A p2p op that only receives or only sends (gTop-k's tree levels) is one
  way on the wire and takes the rate of the one-way probe (:data:`ONE_WAY`)
  where the run has it: with both directions busy (the ring-shift probe) each
  direction's ACKs queue behind the other's data in the shaper, and at P = 2,
  100 Mbit a 1 MB ring shift reached 0.62 of the link where one-way transfers
  of that size (gTop-k's, the broadcast probe's) reached about 0.9.
* **A per-call wait for peers, measured as a mean at the method's own spacing
  of calls** (``Network.call_wait_curve``): with more ranks than cores a call
  first waits for the peers the scheduler has not run yet, then runs its
  rounds. The interleaved probe times one tiny allreduce between bursts of CPU
  work of a few lengths; its *mean* (a step's comm time is a sum over calls,
  and a median drops the long waits that dominate the sum) less the tiny
  allreduce's own rounds x alpha is the wait ``w(g)``, read at the CPU work
  ``g`` between the method's calls (its compression CPU time / its calls),
  log-linear between the probed lengths. A call then costs
  ``rounds x alpha_op + w(g)``: the wait is once per call (the ranks arrive
  once), not once per round. ``g`` is each call's own (``StepProfile.call_gaps``,
  the CPU work since the ranks last met, recorded per call): ``w`` is concave,
  so a step of a few long gaps and many short ones (a low-rank method's
  per-tensor calls) waits far less than as many calls at the mean gap. The
  ranks also meet in every ``Method.allreduce``'s 1-byte agreement, which the
  benchmark times apart as the step's *wait*: a bucket's first call waits only
  for the work after it (the forward and backward pass are waited out there).

To extrapolate to other P, a method's bytes per step scale with its
algorithm's volume law (Table 1): allreduce-like volume ``(P-1)/P``
(dense, Ok-Topk, Global-QSGD, PowerSGD, ...), allgather-like ``(P-1)`` (TopkA,
Gaussiank, QSGD, DeepReduce), tree-like ``log2 P`` (gTopk).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from .units import parse_duration, parse_rate


@dataclass(frozen=True)
class Network:
    """A network: latency ``alpha`` (s per message round) and link ``bandwidth`` (bits/s)."""

    name: str
    alpha: float
    bandwidth: float
    note: str = ""
    efficiency: Mapping[str, float] = field(default_factory=dict)   # eta_op, 1 where absent
    op_alpha: Mapping[str, float] = field(default_factory=dict)     # per-op alpha where fitted
    call_latency: float = 0.0      # least time per collective call (scheduling on a shared machine)
    round_latency: float = 0.0     # least time per message round (scheduling), replaces call_latency when set
    burst_bytes: float = 0.0       # token bucket depth of each shaped link direction (tbf burst); 0: none
    ring_from: float | None = None  # allreduce by recursive doubling below, ring from this many bytes
    #: (CPU work between calls in s, mean wait for peers per call in s), ascending in work: the
    #: interleaved probe at several spacings of calls; replaces the floors above when set
    call_wait_curve: tuple[tuple[float, float], ...] = ()
    #: per operation, (bytes moved per rank in one call, eta) ascending in bytes: the op's probes at
    #: several message sizes; :meth:`eta` reads it log-linearly and falls back on :attr:`efficiency`
    efficiency_curve: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def eta(self, op: str, nbytes: float) -> float:
        """Fraction of the link one ``op`` call moving ``nbytes`` per rank reaches.

        The op's :attr:`efficiency_curve` (its own, else :data:`PROBE_OF`'s) at
        ``nbytes``: the nearest probed size beyond the ends, log-linear between
        two; without a curve the single :attr:`efficiency` (1 where absent).
        MPI's algorithms and TCP's congestion window behave differently for a
        message of a few hundred kilobytes and one of tens of megabytes on the
        same link, so one rate per op cannot price both.
        """
        curve = self.efficiency_curve.get(op) or self.efficiency_curve.get(PROBE_OF.get(op, ""))
        if not curve:
            return _per_op(self.efficiency, op, 1.0)
        return _log_linear(curve, nbytes)

    def call_wait(self, gap: float) -> float:
        """Mean wait for peers of one call issued after ``gap`` seconds of CPU work
        (:attr:`call_wait_curve`: the nearest probed spacing, log-linear between two, constant
        beyond the ends; 0 without a curve)."""
        return _log_linear(self.call_wait_curve, gap) if self.call_wait_curve else 0.0

    def rounds(self, op: str, world_size: int, message_bytes: float) -> float:
        """Latency rounds of one ``op`` call moving ``message_bytes`` per rank (volume model).

        Table 1's rounds (:data:`ROUNDS`), except an allreduce on a network
        with ``ring_from`` set: ``log2 P`` rounds (recursive doubling) for a
        message ``N = bytes / (2 (P-1) / P)`` below it, ``2 (P-1)`` (ring) from it on.
        """
        p = world_size
        if op == RING:
            return float(2 * (p - 1)) if p > 1 else 0.0
        if op == "allreduce" and self.ring_from is not None and p > 1:
            n = message_bytes / (2.0 * (p - 1) / p)
            return float(2 * (p - 1)) if n >= self.ring_from else math.ceil(_log2(p))
        return ROUNDS.get(op, _log2)(p)

    @property
    def bytes_per_second(self) -> float:
        return self.bandwidth / 8.0

    def with_bandwidth(self, bandwidth: float) -> "Network":
        """A copy of this network with link rate ``bandwidth`` (bits/s)."""
        return replace(self, bandwidth=bandwidth)


#: Presets: typical published figures, not measurements of this project (pass
#: ``--latency``/``--bandwidth`` for your own network).
PRESETS: dict[str, Network] = {
    "shm": Network("shared memory", 1e-6, 80e9, "one node, MPI over shared memory (~10 GB/s)"),
    "1gbe": Network("1 GbE", 50e-6, 1e9, "TCP over 1 Gbit Ethernet"),
    "10gbe": Network("10 GbE", 20e-6, 10e9, "TCP over 10 Gbit Ethernet"),
    "25gbe": Network("25 GbE", 10e-6, 25e9, "TCP over 25 Gbit Ethernet"),
    "100gbe": Network("100 GbE", 5e-6, 100e9, "RoCE over 100 Gbit Ethernet"),
    "ib100": Network("100 Gb InfiniBand", 1.5e-6, 100e9, "EDR InfiniBand, RDMA"),
    "aries": Network("Cray Aries", 1.3e-6, 80e9, "Cray XC (Piz Daint) dragonfly, ~10 GB/s injection"),
}


def network_from(preset: str | None = None, latency: str | None = None,
                 bandwidth: str | None = None) -> Network:
    """A preset, optionally with its latency (``'5us'``) or bandwidth (``'25gbit'``) replaced."""
    if preset is None and (latency is None or bandwidth is None):
        preset = "1gbe"
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"network preset must be one of {sorted(PRESETS)}, got {preset!r}")
    net = PRESETS[preset] if preset else Network("custom", 0.0, 1.0)
    if latency is not None:
        net = replace(net, alpha=parse_duration(latency), name=f"{net.name}, alpha {latency}")
    if bandwidth is not None:
        net = replace(net, bandwidth=parse_rate(bandwidth), name=f"{net.name}, {bandwidth}")
    return net


def _log_linear(curve: Sequence[tuple[float, float]], x: float) -> float:
    """``curve`` (ascending ``(x_i, y_i)`` pairs) at ``x``: linear in ``log x`` between two
    points, the end value beyond either end."""
    if x <= curve[0][0] or len(curve) == 1:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0) if x1 > x0 > 0 else 1.0
            return y0 + w * (y1 - y0)
    return curve[-1][1]


def _median_of_three(curve: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """``curve`` with each inner point's value replaced by the median of it and its two
    neighbours' (the ends kept).

    A rate probe at one size can hit a stall the calls around it did not (one
    run's 2 MiB allgatherv at P = 2 took 48 ms in 3 of 5 repeats, where the
    allgather of the same bytes took 17 ms and its own 1 and 8 MiB probes ran
    at 0.83 and 0.91 of the link): a single point off both neighbours is taken
    as that, while a monotone trend (the allgather's rate falling with size on
    100 Mbit) passes unchanged.
    """
    pts = list(curve)
    if len(pts) < 3:
        return tuple(pts)
    inner = [(pts[i][0], sorted(y for _, y in pts[i - 1:i + 2])[1]) for i in range(1, len(pts) - 1)]
    return (pts[0], *inner, pts[-1])


def _log2(p: int) -> float:
    return math.log2(p) if p > 1 else 0.0


#: The op under which a profile lists the bytes of an allreduce run as a pipelined ring of
#: point-to-point messages (``reduce_ops.ring_reduce_once``), priced at the p2p probe.
RING = "ring"

#: The probe of a one-way point-to-point transfer (one direction of a link busy, the other
#: carrying only TCP's ACKs): a p2p op a rank only receives or only sends in (gTop-k's tree
#: levels) is priced at its rate where a run has it, not at the ring shift's (both directions busy).
ONE_WAY = "p2p_oneway"

#: Latency rounds per call of each Communicator operation (Ok-Topk Table 1; a
#: point-to-point call is one message, counted once on each side, hence 1/2; the
#: pipelined ring: 2 (P-1) steps, Patarasuk & Yuan).
ROUNDS: dict[str, Callable[[int], float]] = {
    RING: lambda p: float(2 * (p - 1)),
    "allreduce": lambda p: 2 * _log2(p),
    "allgather": _log2,
    "allgatherv": _log2,
    "allgather_object": _log2,
    "broadcast": _log2,
    "alltoallv": lambda p: float(p - 1),
    "alltoall": lambda p: float(p - 1),
    "p2p": lambda p: 0.5,
    "barrier": lambda p: 2 * _log2(p),
}

#: How a method's per-rank bytes grow with P (Ok-Topk Table 1's bandwidth column).
VOLUME_LAW: dict[str, str] = {
    "topk": "allgather", "gaussiank": "allgather", "qsgd": "allgather", "deepreduce": "allgather",
    "gtopk": "tree",
}
_LAWS: dict[str, Callable[[int], float]] = {
    "allreduce": lambda p: (p - 1) / p,
    "allgather": lambda p: float(p - 1),
    "tree": _log2,
}


@dataclass
class OpCount:
    """Calls and bytes (per rank) of one operation in one step."""

    calls: float
    sent: float
    received: float


@dataclass
class StepProfile:
    """What one rank measured for one method's training step at ``world_size`` ranks."""

    method: str
    world_size: int
    compute_s: float                       # forward + backward
    compress_s: float                      # the method's own computation (exchange minus MPI time)
    ops: dict[str, OpCount]
    #: per operation, the bytes (max of sent, received) of each call in one step, in call order,
    #: where recorded; otherwise every call is taken to move the op's mean
    call_bytes: dict[str, list[float]] = field(default_factory=dict)
    #: per operation, wall seconds of the method's own work run between that op's progress
    #: calls while its bytes are on the wire (the pipelined ring's quantize/reduce/dequantize)
    overlap_s: dict[str, float] = field(default_factory=dict)
    #: per operation, the CPU seconds of the method's own work before each call since the ranks
    #: last met (the previous call, or its bucket's agreement), parallel to :attr:`call_bytes`,
    #: where recorded; otherwise the compression time is taken as spread evenly over the calls
    call_gaps: dict[str, list[float]] = field(default_factory=dict)
    #: per operation, the CPU seconds of work since the previous call itself (the gap's clock
    #: restarts where the ranks meet in a call's agreement; the links rest on through it), parallel
    #: to :attr:`call_bytes`, where recorded; otherwise the gaps
    call_rests: dict[str, list[float]] = field(default_factory=dict)
    #: wall seconds per CPU second of the rank's own work: P/cores where ranks share a machine's
    #: cores (the testbed), 1 with a core per rank; how long the links idle during a gap
    core_share: float = 1.0

    def gaps_of(self, op: str, count: int, default: float) -> list[float]:
        """CPU work before each of ``count`` ``op`` calls: recorded (:attr:`call_gaps`) when it
        matches the calls :meth:`calls_of` lists, else ``default`` for each."""
        recorded = self.call_gaps.get(op)
        if recorded and len(recorded) == count and self.call_bytes.get(op):
            return list(recorded)
        return [default] * count

    def rests_of(self, op: str, count: int, default: float) -> list[float]:
        """CPU work since the call before each of ``count`` ``op`` calls (:attr:`call_rests`,
        else :meth:`gaps_of`)."""
        recorded = self.call_rests.get(op)
        if recorded and len(recorded) == count and self.call_bytes.get(op):
            return list(recorded)
        return self.gaps_of(op, count, default)

    def calls_of(self, op: str) -> tuple[list[float], float]:
        """(bytes of each ``op`` call in one step, how many calls each entry stands for).

        Recorded sizes stand for one call each; otherwise ``ceil(calls)`` equal
        parts of the op's bytes, each weighted so the latency counts ``calls``
        (a mean over steps may be fractional) calls. Point-to-point calls that
        both send and receive pair up: a send and a receive of one exchange
        overlap on the full-duplex link, so ``calls / 2`` exchanges of
        ``max(sent, received) / (calls / 2)`` bytes (latency still per call).
        """
        o = self.ops[op]
        recorded = self.call_bytes.get(op)
        if recorded:
            return list(recorded), 1.0
        total = max(o.sent, o.received)
        calls = o.calls / 2.0 if op == "p2p" and o.sent > 0 and o.received > 0 else o.calls
        n = max(math.ceil(calls - 1e-9), 1 if total > 0 else 0)
        return ([total / n] * n, o.calls / n) if n else ([], 0.0)

    @property
    def bytes_per_step(self) -> float:
        return sum(max(o.sent, o.received) for o in self.ops.values())

    def scaled(self, world_size: int) -> "StepProfile":
        """This profile extrapolated to ``world_size`` ranks by the method's volume law."""
        if world_size == self.world_size:
            return self
        law = _LAWS[VOLUME_LAW.get(self.method, "allreduce")]
        base = law(self.world_size)
        factor = law(world_size) / base if base > 0 else 1.0
        ops = {}
        for name, o in self.ops.items():
            calls = o.calls
            if name in ("p2p",) and self.world_size > 1:   # one message per peer (Ok-Topk) or per level (gTopk)
                peers = _LAWS["tree"] if VOLUME_LAW.get(self.method) == "tree" else (lambda p: float(p - 1))
                calls = o.calls * peers(world_size) / max(peers(self.world_size), 1e-12)
            ops[name] = OpCount(calls, o.sent * factor, o.received * factor)
        return replace(self, world_size=world_size, ops=ops, call_bytes={}, call_gaps={}, call_rests={})


@dataclass
class Prediction:
    """The model's step time, split as the measurement is."""

    compute_s: float
    compress_s: float
    latency_s: float
    transfer_s: float

    @property
    def comm_s(self) -> float:
        return self.latency_s + self.transfer_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.compress_s + self.comm_s


#: Operations without a probe of their own take the measured constants of the closest one
#: (the pipelined ring, where the testbed has no probe of the ring itself, the point to point).
PROBE_OF: dict[str, str] = {"allgather": "allgatherv", "allgather_object": "allgatherv",
                            "alltoall": "alltoallv", "broadcast": "p2p", "barrier": "allreduce",
                            RING: "p2p"}


def _per_op(table: Mapping[str, float], op: str, default: float) -> float:
    if op in table:
        return table[op]
    return table.get(PROBE_OF.get(op, ""), default)


def predict(profile: StepProfile, network: Network, world_size: int | None = None) -> Prediction:
    """Predicted step time of ``profile`` on ``network`` (at ``world_size`` ranks, default its own).

    Per call ``i`` of an operation moving ``L_i`` bytes per rank (the volume
    model's ``max(sent, received)``):

        latency_i  = rounds(op, P, L_i) * alpha_op + w(g_i)              with a wait curve,
                     rounds(op, P, L_i) * max(alpha_op, round_latency)  with a round floor,
                     max(rounds(op, P, L_i) * alpha_op, call_latency)   otherwise
        transfer_i = max(0, L_i - tokens_i) / (eta_op(L_i) * B)
        T_op       = max(0, sum_i (latency_i + transfer_i) - W_op)

    ``alpha_op``: the op's own probe, else :data:`PROBE_OF`'s (the pipelined
    ring, op :data:`RING`, takes its own ring probe's where the network has
    one, else the point-to-point probe's); ``eta_op(L)``: :meth:`Network.eta`,
    the op's rate at that message size. ``g_i``: the CPU work before call
    ``i`` since the ranks last met, in a call or in a bucket's agreement
    (:meth:`StepProfile.gaps_of`: recorded per call, else the profile's
    compression time spread evenly over its calls); ``w(g)``:
    :meth:`Network.call_wait`. The wait for peers grows with the work before
    a call and flattens out (a concave curve), so a step of a few long gaps
    and many short ones waits far less than as many calls at the mean gap.
    ``tokens_i = B`` (no bucket) on a network without ``burst_bytes``; with one,
    each direction of the rank's link has its own bucket (tbf shapes each veth end's
    egress), which starts full and refills at ``B`` (in wall time, as tbf does) while
    the link idles before the call's bytes move: ``r_i x s + latency_i``, the CPU work
    since the previous call ``r_i`` (:meth:`StepProfile.rests_of`: ``g_i`` plus the
    work before a bucket's agreement, where the gap's clock restarts) stretched by the
    core share ``s`` (:attr:`StepProfile.core_share`), and the call's own wait for
    peers and rounds; a call
    sends ``L_i * sent/max(sent, received)`` and receives ``L_i * received/max(...)``
    (the op's totals' ratio) and waits for the direction that runs out first:
    ``L_i - tokens_i`` is ``max(0, out_i - tokens_out, in_i - tokens_in)``. A root's
    broadcast after a phase of receiving (gTop-k's tree) thus starts with a full
    outgoing bucket.
    ``W_op``: :attr:`StepProfile.overlap_s`, the method's work that runs
    while the op's bytes are on the wire (0 for MPI's own collectives); what it
    covers comes off the transfer first, then off the latency.

    A tree reduction (a method whose volume law is ``"tree"``, gTop-k) adds
    :func:`tree_dependency_wait` to the latency: the ranks that leave the tree
    early wait in the final broadcast for the merges and transfers of the
    levels after them, work that is not theirs.
    """
    prof = profile.scaled(world_size or profile.world_size)
    p = prof.world_size
    rate = network.bytes_per_second
    per_op = {name: prof.calls_of(name) for name in prof.ops}
    n_calls = sum(len(v[0]) for v in per_op.values())
    mean_gap = prof.compress_s / n_calls if n_calls else 0.0
    bucket = network.burst_bytes
    tokens_out = tokens_in = bucket          # each direction of a rank's link has its own bucket
    latency = transfer = 0.0
    p2p_transfers: list[float] = []        # per point-to-point call: a tree's levels (gTop-k)
    for name, (sizes, weight) in per_op.items():
        alpha = _per_op(network.op_alpha, name, network.alpha)
        op_latency = op_transfer = 0.0
        o = prof.ops[name]
        most = max(o.sent, o.received)
        share_out, share_in = (o.sent / most, o.received / most) if most > 0 else (1.0, 1.0)
        # a point-to-point op that only receives (or only sends) is one way on the wire
        one_way = name == "p2p" and min(share_out, share_in) == 0 and \
            (ONE_WAY in network.efficiency_curve or ONE_WAY in network.efficiency)
        rate_op = ONE_WAY if one_way else name
        for nbytes, gap, rest in zip(sizes, prof.gaps_of(name, len(sizes), mean_gap),
                                     prof.rests_of(name, len(sizes), mean_gap)):
            rounds = network.rounds(name, p, nbytes)
            if network.call_wait_curve:
                call_latency = rounds * alpha + network.call_wait(gap)
            elif network.round_latency > 0:
                call_latency = rounds * max(alpha, network.round_latency)
            else:
                call_latency = max(rounds * alpha, network.call_latency)
            op_latency += weight * call_latency
            if bucket > 0:
                out_bytes, in_bytes = nbytes * share_out, nbytes * share_in
                idle = rest * prof.core_share + call_latency    # wall seconds the link rests
                tokens_out = min(bucket, tokens_out + rate * idle)
                tokens_in = min(bucket, tokens_in + rate * idle)
                waiting = max(0.0, out_bytes - tokens_out, in_bytes - tokens_in)
                tokens_out = max(0.0, tokens_out - out_bytes)
                tokens_in = max(0.0, tokens_in - in_bytes)
            else:
                waiting = nbytes
            seconds = waiting / (network.eta(rate_op, nbytes) * rate)
            if name == "p2p":
                p2p_transfers.append(seconds)
            op_transfer += seconds
        hidden = prof.overlap_s.get(name, 0.0)
        cut = min(hidden, op_transfer)
        op_transfer -= cut
        op_latency -= min(hidden - cut, op_latency)
        latency += op_latency
        transfer += op_transfer
    if VOLUME_LAW.get(prof.method) == "tree":
        latency += tree_dependency_wait(prof, p2p_transfers)
    return Prediction(prof.compute_s, prof.compress_s, latency, transfer)


def tree_dependency_wait(profile: StepProfile, level_transfers: Sequence[float]) -> float:
    """Mean over ranks of the time a rank waits in gTop-k's final broadcast for work that is
    not its own (gTop-k, Shi et al., ICDCS'19, as "Near-Optimal Sparse Allreduce for
    Distributed Deep Learning" lists it in Table 1: a binomial reduction tree that
    re-selects the top k at every level, then rank 0 broadcasts;
    ``mpi_collectives.sparse_allreduce_baselines.gtopk_allreduce``).

    At level ``l = 0 .. L-1`` (``L = log2 P``) a fraction ``2^-(l+1)`` of the
    ranks sends its top-k and leaves the tree; it then waits for the
    receivers' merge (top-k of the sum) at level ``l`` and every later level
    and for the later levels' transfers:

        wait = sum_l 2^-(l+1) * (sum_{j >= l} m_j * s + sum_{j > l} t_j)

    ``m_j``: the root's CPU work after its level-``j`` receive (its recorded
    gaps: before the next receive, and before the broadcast after the last
    level); ``s``: the core share; ``t_j``: the predicted transfer of the
    root's level-``j`` receive. 0 without recorded gaps (an extrapolation to
    another P): the merges are then unknown.
    """
    p = profile.world_size
    levels = math.ceil(_log2(p))
    receives = profile.call_gaps.get("p2p", [])
    broadcasts = profile.call_gaps.get("broadcast", [])
    if levels == 0 or len(receives) != levels or not broadcasts:
        return 0.0
    merges = [g * profile.core_share for g in receives[1:] + broadcasts[:1]]
    transfers = list(level_transfers) if len(level_transfers) == levels else [0.0] * levels
    return sum(2.0 ** -(lv + 1) * (sum(merges[lv:]) + sum(transfers[lv + 1:])) for lv in range(levels))


def speedup(profile: StepProfile, dense: StepProfile, network: Network,
            world_size: int | None = None) -> float:
    """Predicted step-time speedup of ``profile`` over ``dense`` (> 1: the method is faster)."""
    return predict(dense, network, world_size).step_s / predict(profile, network, world_size).step_s


def break_even_bandwidth(profile: StepProfile, dense: StepProfile, network: Network,
                         world_size: int | None = None) -> float:
    """Bandwidth (bits/s) below which ``profile`` beats ``dense``: ``inf`` if at every bandwidth, 0 if never.

    With ``T(B) = c + V / B`` for both (c: compute, compression and latency, V:
    bytes over efficiency), the method wins when
    ``(V_dense - V_m) / B > c_m - c_dense``.
    """
    m = predict(profile, network, world_size)
    d = predict(dense, network, world_size)
    v_m, v_d = m.transfer_s * network.bytes_per_second, d.transfer_s * network.bytes_per_second
    c_m = m.compute_s + m.compress_s + m.latency_s
    c_d = d.compute_s + d.compress_s + d.latency_s
    dv, dc = v_d - v_m, c_m - c_d
    if dv <= 0:
        return math.inf if dc < 0 and dv == 0 else 0.0
    if dc <= 0:
        return math.inf
    return 8.0 * dv / dc


def fit_link(nominal_bandwidth: float, probes: Mapping[str, tuple[float, float, float, float]],
             call_latency: float = 0.0, *, ring_from: float | None = None, burst_bytes: float = 0.0,
             small_bytes: float = 8.0,
             call_latency_curve: Sequence[tuple[float, float]] = (),
             size_probes: Mapping[str, Sequence[tuple[float, float]]] | None = None) -> Network:
    """A :class:`Network` fitted to measurements on a testbed, per operation.

    ``probes[op] = (small_seconds, large_seconds, large_bytes, world_size)``:
    one call's time with a tiny message (-> that op's alpha per round; ``p2p``
    is a ring shift, one send and one receive per rank: one round) and with
    ``large_bytes`` moved per rank (-> its efficiency eta against the nominal
    bandwidth: ``eta = (large_bytes - burst) / (B (t_large - t_small))``). The
    link rate itself stays the nominal one, so a preset's efficiency says how
    much of it MPI's algorithm actually reaches. The times are a call's mean
    over ranks (what a step's comm time is), so eta is not capped at 1: where
    some ranks return before their bytes have crossed the wire, it exceeds 1.
    A broadcast's root hands a message that fits the kernel's socket buffers
    (4 MiB here) to them and returns, so at P = 2 the mean over ranks is about
    half the wire time (eta 1.8-1.9 up to 4 MiB, 1.0-1.1 at 16 MiB); capped,
    gTop-k's final broadcast at P = 2 was priced at twice what it cost.

    The ring's own probe (op :data:`RING`, where present) is a whole
    pipelined ring for the large message and a ring shift (one round) for the small one.
    ``call_latency``: one tiny allreduce's time between bursts of CPU work. With
    ``ring_from`` (the size from which the MPI runs the ring allreduce) rounds
    follow the algorithm really run (:meth:`Network.rounds`) and
    ``call_latency`` becomes a per-round floor (``round_latency`` = it divided by
    the tiny allreduce's rounds); without, Table 1's rounds and a per-call
    floor, as the textbook model has it. ``burst_bytes``: the links' token bucket.
    ``call_latency_curve``: ``(CPU work between calls, mean time of one tiny
    allreduce)`` pairs from the interleaved probe at several spacings; each
    less the tiny allreduce's own rounds x alpha (the allreduce probe's) is the
    wait for peers per call, ``Network.call_wait_curve``, which :func:`predict`
    reads at each method's own spacing of calls.
    ``size_probes[op]``: further ``(bytes per rank, seconds)`` calls of ``op`` at
    other message sizes; each gives an eta as the large one does, and together
    they make ``Network.efficiency_curve[op]``, eta against the bytes of a call.
    A size that moves fewer bytes beyond the token bucket than the bucket holds
    is left out: its time is mostly latency and scheduling, and a probe 8 bytes
    past a 256 KiB bucket gave eta = 0.0001, which priced every call just above
    the bucket at a crawl. The curve is then median-filtered over each three
    neighbouring sizes (:func:`_median_of_three`).
    """
    shape = Network("", 0.0, nominal_bandwidth, ring_from=ring_from)
    op_alpha: dict[str, float] = {}
    eff: dict[str, float] = {}
    curves: dict[str, tuple[tuple[float, float], ...]] = {}
    for op, (t_small, t_large, nbytes, p) in probes.items():
        # the p2p probe is a ring shift: every rank sends one message and receives one, i.e. two
        # p2p calls of half a round each -- one round (before, it was taken as half a round)
        rounds = 1.0 if op in ("p2p", RING) else 2.0 if op == ONE_WAY else (shape.rounds(op, int(p), small_bytes) if ring_from is not None
                                          else ROUNDS.get(op, _log2)(int(p))) or 1.0
        op_alpha[op] = t_small / rounds

        def eta(nbytes: float, seconds: float) -> float:
            ideal = max(nbytes - burst_bytes, 0.0) / (nominal_bandwidth / 8.0)
            return ideal / max(seconds - t_small, 1e-12)
        eff[op] = eta(nbytes, t_large)
        points = {float(nbytes): eff[op]}
        for b, t in (size_probes or {}).get(op, ()):
            if b >= 2 * burst_bytes and b != nbytes:
                points[float(b)] = eta(b, t)
        if len(points) > 1:
            curves[op] = _median_of_three(sorted(points.items()))
    alpha = op_alpha.get("allreduce", min(op_alpha.values()) if op_alpha else 0.0)
    round_latency = 0.0
    curve: tuple[tuple[float, float], ...] = ()
    if probes:
        p = int(next(iter(probes.values()))[3])
        tiny_rounds = (shape.rounds("allreduce", p, small_bytes) if ring_from is not None
                       else ROUNDS["allreduce"](p)) or 1.0
        if ring_from is not None and call_latency > 0:
            round_latency = call_latency / tiny_rounds
        own = tiny_rounds * op_alpha.get("allreduce", 0.0)
        curve = tuple(sorted((float(w), max(float(t) - own, 0.0)) for w, t in call_latency_curve))
    return Network("testbed (fitted)", alpha, nominal_bandwidth, "fitted per operation on the emulated cluster",
                   efficiency=eff, op_alpha=op_alpha, call_latency=call_latency if round_latency == 0 else 0.0,
                   round_latency=round_latency, burst_bytes=burst_bytes, ring_from=ring_from,
                   call_wait_curve=curve, efficiency_curve=curves)
