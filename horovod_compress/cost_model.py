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

    T = T_compute + T_compress + sum_op [ calls_op * rounds_op(P) * alpha
                                          + max(sent_op, received_op) / (eta_op * B) ]

with ``B`` the link bandwidth in bytes/s, ``sent``/``received`` the bytes per
rank the :class:`~horovod_compress.mpi_collectives.Communicator` counts under
the Ok-Topk volume model (a link is full duplex, so sending and receiving
overlap), ``rounds_op(P)`` the latency terms of Table 1, and ``eta_op`` the
fraction of the link a collective reaches (1 for the textbook model; fitted on
a testbed by :func:`fit_link`). ``T_compute`` (forward/backward) and
``T_compress`` (everything the method computes) are measured.

To extrapolate to other P, a method's bytes per step scale with its
algorithm's volume law (Table 1): allreduce-like volume ``(P-1)/P``
(dense, Ok-Topk, Global-QSGD, PowerSGD, ...), allgather-like ``(P-1)`` (TopkA,
Gaussiank, QSGD, DeepReduce), tree-like ``log2 P`` (gTopk).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from .cluster.netns import parse_duration, parse_rate


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


def _log2(p: int) -> float:
    return math.log2(p) if p > 1 else 0.0


#: Latency rounds per call of each Communicator operation (Ok-Topk Table 1; a
#: point-to-point call is one message, counted once on each side, hence 1/2).
ROUNDS: dict[str, Callable[[int], float]] = {
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
        return replace(self, world_size=world_size, ops=ops)


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


def predict(profile: StepProfile, network: Network, world_size: int | None = None) -> Prediction:
    """Predicted step time of ``profile`` on ``network`` (at ``world_size`` ranks, default its own)."""
    prof = profile.scaled(world_size or profile.world_size)
    p = prof.world_size
    latency = transfer = 0.0
    for name, o in prof.ops.items():
        rounds = ROUNDS.get(name, _log2)(p)
        per_call = max(rounds * network.op_alpha.get(name, network.alpha), network.call_latency)
        latency += o.calls * per_call
        eta = network.efficiency.get(name, 1.0)
        transfer += max(o.sent, o.received) / (eta * network.bytes_per_second)
    return Prediction(prof.compute_s, prof.compress_s, latency, transfer)


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
             call_latency: float = 0.0) -> Network:
    """A :class:`Network` fitted to measurements on a testbed, per operation.

    ``probes[op] = (small_seconds, large_seconds, large_bytes, world_size)``:
    one call's time with a tiny message (-> that op's alpha per round) and with
    ``large_bytes`` moved per rank (-> its efficiency eta against the nominal
    bandwidth). The link rate itself stays the nominal one, so a preset's
    efficiency says how much of it MPI's algorithm actually reaches.
    """
    op_alpha, eff = {}, {}
    for op, (t_small, t_large, nbytes, p) in probes.items():
        rounds = ROUNDS.get(op, _log2)(int(p)) or 1.0
        op_alpha[op] = t_small / rounds
        ideal = nbytes / (nominal_bandwidth / 8.0)
        eff[op] = min(1.0, ideal / max(t_large - t_small, 1e-12))
    alpha = op_alpha.get("allreduce", min(op_alpha.values()) if op_alpha else 0.0)
    return Network("testbed (fitted)", alpha, nominal_bandwidth, "fitted per operation on the emulated cluster",
                   efficiency=eff, op_alpha=op_alpha, call_latency=call_latency)
