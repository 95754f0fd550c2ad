"""The alpha-beta model's transport-aware terms (horovod_compress/cost_model.py, hvdc bench e2e).

Each term is physical -- latency rounds x alpha + bytes / the rate the
transport that carried them reaches -- with its constants from the run's own
probes; these tests pin each term on hand-computed cases.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from horovod_compress.tools.bench.e2e import profile_of
from horovod_compress.tools.bench.e2e_calls import RING_OP, RingTransport
from horovod_compress.cost_model import ONE_WAY, RING, Network, OpCount, StepProfile, fit_link, predict
from horovod_compress.mpi_collectives.accounting import Accounting

RATE = 1e9                      # 1 Gbit/s
BPS = RATE / 8


def _net(**kw: object) -> Network:
    base = dict(efficiency={"allreduce": 0.6, "p2p": 0.9}, op_alpha={"allreduce": 1e-5, "p2p": 4e-5})
    base.update(kw)
    return Network("t", 1e-5, RATE, ring_from=65536, **base)   # type: ignore[arg-type]


def test_ring_bytes_are_priced_at_the_p2p_rate_with_ring_rounds():
    n = 11.56e6                               # Global-QSGD's 8-bit payload at P = 2 (volume 2N(P-1)/P = N)
    as_allreduce = StepProfile("global_qsgd", 2, 0.1, 0.0, {"allreduce": OpCount(1, n, n)})
    as_ring = StepProfile("global_qsgd", 2, 0.1, 0.0, {RING: OpCount(1, n, n)})
    net = _net()
    assert predict(as_allreduce, net).transfer_s == pytest.approx(n / (0.6 * BPS))
    ring = predict(as_ring, net)
    assert ring.transfer_s == pytest.approx(n / (0.9 * BPS))
    # 2 (P - 1) rounds at the point-to-point alpha, whatever the size (a ring of eager segments)
    assert ring.latency_s == pytest.approx(2 * 4e-5)
    at4 = StepProfile("global_qsgd", 4, 0.1, 0.0, {RING: OpCount(1, n, n)})
    assert predict(at4, net).latency_s == pytest.approx(6 * 4e-5)
    # no p2p probe: the nominal rate (textbook); the bytes per step are the same either way
    assert predict(as_ring, Network("t", 0.0, RATE)).transfer_s == pytest.approx(n / BPS)
    assert as_ring.bytes_per_step == as_allreduce.bytes_per_step


def test_work_on_the_ring_hides_the_wire():
    n = 11.56e6
    wire = n / (0.9 * BPS)                     # 0.103 s
    prof = StepProfile("global_qsgd", 2, 0.1, 0.0, {RING: OpCount(1, n, n)}, overlap_s={RING: 0.04})
    pr = predict(prof, _net())
    assert pr.transfer_s == pytest.approx(wire - 0.04)
    assert pr.latency_s == pytest.approx(2 * 4e-5)
    # work longer than the wire: the rank never waits inside MPI for this op
    long = StepProfile("global_qsgd", 2, 0.1, 0.0, {RING: OpCount(1, n, n)}, overlap_s={RING: 1.0})
    assert predict(long, _net()).comm_s == 0.0
    # overlap of one op does not touch another op's time
    mixed = StepProfile("m", 2, 0.1, 0.0, {RING: OpCount(1, n, n), "allreduce": OpCount(1, 1e6, 1e6)},
                        overlap_s={RING: 1.0})
    assert predict(mixed, _net()).transfer_s == pytest.approx(1e6 / (0.6 * BPS))


def test_profile_splits_the_ring_share_and_keeps_byte_totals():
    n = 11556352.0
    m = {"compute_cpu_s": 0.1, "compress_cpu_s": 0.05,
         "ops": {"allreduce": {"calls": 2.0, "sent": n + 8, "received": n + 8}},
         "transport": {RING_OP: {"of": "allreduce", "calls": 1.0, "sent": n, "received": n,
                                 "work_s": 0.03, "work_cpu_s": 0.03}}}
    prof = profile_of("global_qsgd", m, 2, {"allreduce": [8.0], RING_OP: [n]})
    assert set(prof.ops) == {"allreduce", RING}
    assert prof.ops["allreduce"].calls == 1 and prof.ops["allreduce"].sent == pytest.approx(8.0)
    assert prof.ops[RING].sent == n and prof.overlap_s == {RING: 0.03}
    assert prof.bytes_per_step == pytest.approx(n + 8)
    assert prof.call_bytes == {"allreduce": [8.0], RING: [n]}
    # all of an op carried by the ring: the op disappears from the profile
    fp16 = {"compute_cpu_s": 0.1, "compress_cpu_s": 0.05,
            "ops": {"allreduce": {"calls": 1.0, "sent": 2e7, "received": 2e7}},
            "transport": {RING_OP: {"of": "allreduce", "calls": 1.0, "sent": 2e7, "received": 2e7,
                                    "work_s": 0.02}}}
    assert set(profile_of("fp16", fp16, 2).ops) == {RING}
    # a run recorded before transports were: unchanged
    old = {"compute_cpu_s": 0.1, "compress_cpu_s": 0.05, "ops": m["ops"]}
    assert set(profile_of("global_qsgd", old, 2).ops) == {"allreduce"}


def test_the_p2p_probe_is_one_round():
    # a ring shift of 8 bytes (one send and one receive per rank) in 25 us: alpha_p2p = 25 us, so the
    # pipelined ring's 2 (P - 1) steps at P = 2 cost 2 x 25 us and one p2p call (half a round) 12.5 us
    net = fit_link(RATE, {"p2p": (25e-6, 0.15, 16 * 2**20, 2)}, ring_from=65536)
    assert net.op_alpha["p2p"] == pytest.approx(25e-6)
    ring = StepProfile("global_qsgd", 2, 0.1, 0.0, {RING: OpCount(1, 1e3, 1e3)})
    assert predict(ring, net).latency_s == pytest.approx(2 * 25e-6)
    one = StepProfile("gtopk", 2, 0.1, 0.0, {"p2p": OpCount(1, 1e3, 0.0)})
    assert predict(one, net).latency_s == pytest.approx(12.5e-6)


def test_a_send_and_a_receive_are_one_exchange_through_the_buckets():
    b = 262144.0
    net = Network("t", 0.0, 1e8, burst_bytes=b)
    # Ok-Topk at P = 2: one isend and one recv of 0.7 MB each way, counted as two p2p calls
    pair = StepProfile("oktopk", 2, 0.1, 0.0, {"p2p": OpCount(2, 7e5, 7e5)})
    assert predict(pair, net).transfer_s == pytest.approx((7e5 - b) / 1.25e7)
    # two sends (one direction): two messages, each through the (empty after the first) bucket
    sends = StepProfile("gtopk", 2, 0.1, 0.0, {"p2p": OpCount(2, 7e5, 0.0)})
    assert predict(sends, net).transfer_s == pytest.approx((7e5 - b) / 1.25e7)
    # latency still counts every call (one message each, counted on both sides: 1/2 round)
    lat = Network("t", 1e-4, 1e8)
    assert predict(pair, lat).latency_s == pytest.approx(2 * 0.5 * 1e-4)


def test_wait_for_peers_follows_the_spacing_of_calls():
    curve = ((1e-4, 1e-4), (1e-3, 4e-4), (1e-2, 1e-3))
    net = Network("t", 1e-5, RATE, ring_from=65536, round_latency=1e-4, call_wait_curve=curve)
    assert net.call_wait(1e-5) == pytest.approx(1e-4)             # below the probed range
    assert net.call_wait(1e-3) == pytest.approx(4e-4)
    assert net.call_wait(math.sqrt(1e-3 * 1e-2)) == pytest.approx(7e-4)   # log-linear between
    assert net.call_wait(1.0) == pytest.approx(1e-3)               # beyond it
    # 10 tiny calls 1 ms of CPU work apart at P = 4: each 2 rounds x alpha + one wait (not one per round)
    prof = StepProfile("powersgd", 4, 0.1, 0.01, {"allreduce": OpCount(10, 1e4, 1e4)})
    assert predict(prof, net).latency_s == pytest.approx(10 * (2 * 1e-5 + 4e-4))
    # a ring call (6 rounds at P = 4) waits for its peers once too
    big = StepProfile("m", 4, 0.1, 0.001, {"allreduce": OpCount(1, 1.5e6, 1.5e6)})
    assert predict(big, net).latency_s == pytest.approx(6 * 1e-5 + 4e-4)
    # fit_link: the interleaved probe's mean per call less the tiny allreduce's own 2 rounds x alpha
    probes = {"allreduce": (2e-5, 0.2, 2.4e7, 4)}                  # alpha = 1e-5 per round
    fitted = fit_link(RATE, probes, 2e-4, ring_from=65536, call_latency_curve=[(1e-3, 8e-4), (1e-4, 2e-4)])
    assert [w for w, _ in fitted.call_wait_curve] == [1e-4, 1e-3]
    assert [t for _, t in fitted.call_wait_curve] == pytest.approx([1.8e-4, 7.8e-4])
    # without a curve: the per-round floor, as before
    old = fit_link(RATE, probes, 2e-4, ring_from=65536)
    assert old.call_wait_curve == () and old.round_latency == pytest.approx(1e-4)
    assert predict(prof, old).latency_s == pytest.approx(10 * 2 * 1e-4)


class _Comm(Accounting):
    def __init__(self) -> None:
        self.rank, self.size = 0, 2
        self._init_accounting()


def test_ring_transport_records_bytes_and_overlapped_work(monkeypatch):
    from horovod_compress.mpi_collectives import reduce_ops

    def fake_ring(comm, nbytes, produce, own, reduce, consume=None, segment_bytes=61440, **kw):
        produce(0, nbytes)
        reduce(own, own, own, 0, nbytes)
        if consume is not None:
            consume(0, nbytes)
        vol = 2.0 * nbytes * (comm.size - 1) / comm.size
        comm._account("allreduce", vol, vol)
        return own, 0

    monkeypatch.setattr(reduce_ops, "ring_reduce_once", fake_ring)
    comm = _Comm()
    comm._account("allreduce", 8.0, 8.0)                 # an ordinary allreduce: not the ring's
    ring = RingTransport()
    busy = lambda lo, hi: sum(range(20000))             # noqa: E731 - some work to time
    with ring.installed():
        assert reduce_ops.ring_reduce_once is not fake_ring
        reduce_ops.ring_reduce_once(comm, 1000, busy, np.zeros(1000, np.uint8), lambda a, b, o, lo, hi: 0,
                                    consume=busy)
    assert reduce_ops.ring_reduce_once is fake_ring       # restored
    assert ring.calls == 1 and ring.sent == ring.received == 1000.0
    assert ring.work_s > 0 and ring.work_cpu_s > 0
    st = comm.stats()["by_op"]["allreduce"]               # the Communicator's own counts are unchanged
    assert st["calls"] == 2 and st["sent"] == 1008.0


def test_a_ring_call_through_the_items_variant_counts_once(monkeypatch):
    """ring_reduce_once runs ring_reduce_once_items: the recorder counts the outer call only."""
    from horovod_compress.mpi_collectives import reduce_ops

    def fake_inner_ring(comm, nbytes, counts, segment_bytes, slice_bytes, itemsize, produce, own,
                        reduce, consume, result, scratch):
        produce(0, nbytes)
        comm.count("allreduce", float(nbytes), float(nbytes))
        return own, 0

    monkeypatch.setattr(reduce_ops, "_ring", fake_inner_ring)
    comm = _Comm()
    ring = RingTransport()
    busy = lambda lo, hi: sum(range(20000))             # noqa: E731 - some work to time
    with ring.installed():
        reduce_ops.ring_reduce_once(comm, 1000, busy, np.zeros(1000, np.uint8), lambda a, b, o, lo, hi: 0)
    assert ring.calls == 1 and ring.sent == 1000.0 and ring.inside == 0
    assert comm.stats()["by_op"]["allreduce"]["calls"] == 1


def test_each_call_is_priced_at_the_rate_probed_for_its_size():
    # allreduce probed at 1 MB (eta 0.9) and 16 MB (eta 0.6) per rank; no bucket
    probes = {"allreduce": (2e-5, 2e-5 + 16e6 / (0.6 * BPS), 16e6, 2)}
    net = fit_link(RATE, probes, ring_from=65536, size_probes={"allreduce": [(1e6, 2e-5 + 1e6 / (0.9 * BPS))]})
    assert net.efficiency["allreduce"] == pytest.approx(0.6)
    assert [b for b, _ in net.efficiency_curve["allreduce"]] == [1e6, 16e6]
    assert net.eta("allreduce", 1e6) == pytest.approx(0.9)
    assert net.eta("allreduce", 1e5) == pytest.approx(0.9)        # below the probed sizes: the smallest's
    assert net.eta("allreduce", 4e6) == pytest.approx(0.9 - 0.3 * 0.5)   # log-linear: 4 MB is half way
    assert net.eta("allreduce", 1e9) == pytest.approx(0.6)
    assert net.eta("barrier", 4e6) == pytest.approx(0.75)         # PROBE_OF: a barrier takes the allreduce's
    # 72 calls of 0.14 MB (PowerSGD's factors) move at the small-message rate, one 46 MB call at the large
    small = StepProfile("powersgd", 2, 0.1, 0.0, {"allreduce": OpCount(72, 72 * 1.4e5, 72 * 1.4e5)},
                        call_bytes={"allreduce": [1.4e5] * 72})
    assert predict(small, net).transfer_s == pytest.approx(72 * 1.4e5 / (0.9 * BPS))
    big = StepProfile("none", 2, 0.1, 0.0, {"allreduce": OpCount(1, 4.6e7, 4.6e7)})
    assert predict(big, net).transfer_s == pytest.approx(4.6e7 / (0.6 * BPS))
    # a size within the token bucket says nothing about the rate: left out of the curve
    bucket = fit_link(RATE, probes, ring_from=65536, burst_bytes=262144.0,
                      size_probes={"allreduce": [(2e5, 1e-3)]})
    assert "allreduce" not in bucket.efficiency_curve
    # runs without size probes: one rate per op, as before
    assert fit_link(RATE, probes, ring_from=65536).efficiency_curve == {}


def test_the_ring_takes_its_own_probe_where_there_is_one():
    n = 16 * 2**20
    probes = {"p2p": (25e-6, 25e-6 + n / (0.9 * BPS), n, 2), RING: (25e-6, 25e-6 + n / (0.7 * BPS), n, 2)}
    net = fit_link(RATE, probes, ring_from=65536)
    assert net.op_alpha[RING] == pytest.approx(25e-6)             # its small probe is one shift: one round
    assert net.efficiency[RING] == pytest.approx(0.7)
    ring = StepProfile("fp16", 2, 0.1, 0.0, {RING: OpCount(1, 2.3e7, 2.3e7)})
    assert predict(ring, net).transfer_s == pytest.approx(2.3e7 / (0.7 * BPS))
    no_ring_probe = fit_link(RATE, {"p2p": probes["p2p"]}, ring_from=65536)
    assert predict(ring, no_ring_probe).transfer_s == pytest.approx(2.3e7 / (0.9 * BPS))


def test_a_one_way_transfer_takes_the_one_way_probe():
    # gTop-k at P = 2: rank 1 sends its top-k, rank 0 only receives (sent 0): one direction of the
    # link busy, priced at the one-way probe's rate; Ok-Topk's exchange (both ways) at the ring shift's
    n = 16 * 2**20
    probes = {"p2p": (25e-6, 25e-6 + n / (0.6 * BPS), n, 2), ONE_WAY: (50e-6, 50e-6 + n / (0.9 * BPS), n, 2)}
    net = fit_link(RATE, probes, ring_from=65536)
    assert net.efficiency[ONE_WAY] == pytest.approx(0.9)
    assert net.op_alpha[ONE_WAY] == pytest.approx(25e-6)          # a message there and a byte back: two rounds
    tree = StepProfile("gtopk", 2, 0.1, 0.0, {"p2p": OpCount(1, 0.0, 9e5)})
    assert predict(tree, net).transfer_s == pytest.approx(9e5 / (0.9 * BPS))
    both_ways = StepProfile("oktopk", 2, 0.1, 0.0, {"p2p": OpCount(2, 9e5, 9e5)})
    assert predict(both_ways, net).transfer_s == pytest.approx(9e5 / (0.6 * BPS))
    # the latency stays the p2p op's (its alpha: the probe of one message each way)
    assert predict(tree, net).latency_s == predict(tree, fit_link(RATE, {"p2p": probes["p2p"]},
                                                                  ring_from=65536)).latency_s
    # a run without the one-way probe prices it at the ring shift's, as before
    assert predict(tree, fit_link(RATE, {"p2p": probes["p2p"]}, ring_from=65536)).transfer_s == \
        pytest.approx(9e5 / (0.6 * BPS))


def test_recorded_gaps_wait_per_call_not_at_the_mean_gap():
    curve = ((1e-4, 1e-4), (1e-3, 1e-3), (1e-2, 1.5e-3))   # concave: waits flatten for long gaps
    net = Network("t", 0.0, RATE, ring_from=65536, call_wait_curve=curve)
    # 10 calls with 20.45 ms of CPU work in all: one long gap (after backward) and nine short ones
    gaps = [0.02] + [5e-5] * 9
    sizes = [1e3] * 10
    recorded = StepProfile("m", 4, 0.1, sum(gaps), {"allreduce": OpCount(10, 1e4, 1e4)},
                           call_bytes={"allreduce": sizes}, call_gaps={"allreduce": gaps})
    mean = StepProfile("m", 4, 0.1, sum(gaps), {"allreduce": OpCount(10, 1e4, 1e4)},
                       call_bytes={"allreduce": sizes})
    assert predict(recorded, net).latency_s == pytest.approx(1.5e-3 + 9 * 1e-4)
    assert predict(mean, net).latency_s == pytest.approx(10 * net.call_wait(sum(gaps) / 10))
    assert predict(recorded, net).latency_s < 0.3 * predict(mean, net).latency_s
    # gaps that do not match the calls (another step's log) are ignored
    stale = StepProfile("m", 4, 0.1, sum(gaps), {"allreduce": OpCount(10, 1e4, 1e4)},
                        call_bytes={"allreduce": sizes}, call_gaps={"allreduce": gaps[:3]})
    assert predict(stale, net).latency_s == pytest.approx(predict(mean, net).latency_s)
    # extrapolated to another P: the recorded calls no longer apply
    assert recorded.scaled(8).call_gaps == {}


def test_profile_reads_the_recorded_gaps_beside_the_sizes():
    from horovod_compress.tools.bench.e2e_calls import GAP_SUFFIX
    m = {"compute_cpu_s": 0.1, "compress_cpu_s": 0.05,
         "ops": {"allreduce": {"calls": 2.0, "sent": 3e3, "received": 3e3}}}
    prof = profile_of("powersgd", m, 2, {"allreduce": [1e3, 2e3], "allreduce" + GAP_SUFFIX: [0.04, 1e-4]})
    assert prof.call_bytes == {"allreduce": [1e3, 2e3]} and prof.call_gaps == {"allreduce": [0.04, 1e-4]}
    assert prof.gaps_of("allreduce", 2, 0.5) == [0.04, 1e-4]
    old = profile_of("powersgd", m, 2, {"allreduce": [1e3, 2e3]})      # a log without gaps
    assert old.call_gaps == {} and old.gaps_of("allreduce", 2, 0.5) == [0.5, 0.5]


def test_a_fused_group_is_priced_as_the_calls_on_the_wire():
    """A matrix method's group goes out fused (runtime/per_tensor.py): the communicator counts 72
    per-tensor allreduces, the call log two fused ones carrying the same bytes. The model takes the
    log's two calls (and scales them to other P as two); a log whose bytes differ is not taken."""
    from horovod_compress.tools.bench.e2e_calls import GAP_SUFFIX
    m = {"compute_cpu_s": 0.1, "compress_cpu_s": 0.05,
         "ops": {"allreduce": {"calls": 72.0, "sent": 3e6, "received": 3e6}}}
    prof = profile_of("powersgd", m, 4, {"allreduce": [1e6, 2e6], "allreduce" + GAP_SUFFIX: [0.02, 0.01]})
    assert prof.call_bytes == {"allreduce": [1e6, 2e6]} and prof.ops["allreduce"].calls == 2
    assert prof.scaled(64).ops["allreduce"].calls == 2
    other = profile_of("powersgd", m, 4, {"allreduce": [1e6, 1e6]})      # 2 MB logged, 3 MB measured
    assert other.call_bytes == {} and other.ops["allreduce"].calls == 72


def test_each_direction_of_a_link_has_its_own_token_bucket():
    """gTop-k's root receives a partner's top-k point to point, then broadcasts: the broadcast
    leaves through the outgoing bucket, which the receive did not drain."""
    burst, k = 262144.0, 320000.0
    net = Network("t", 0.0, RATE, efficiency={"p2p": 1.0, "broadcast": 1.0}, burst_bytes=burst)
    ops = {"p2p": OpCount(1, 0.0, k), "broadcast": OpCount(1, k, 0.0)}
    root = StepProfile("gtopk", 2, 0.1, 0.0, ops, call_bytes={"p2p": [k], "broadcast": [k]},
                       call_gaps={"p2p": [1.0], "broadcast": [0.0]})
    # each call pays only its own direction's bytes beyond a full bucket
    assert predict(root, net).transfer_s == pytest.approx(2 * (k - burst) / BPS)
    # both calls in one direction share one bucket: the second finds it empty
    same = StepProfile("gtopk", 2, 0.1, 0.0, {"p2p": OpCount(1, 0.0, k), "broadcast": OpCount(1, 0.0, k)},
                       call_bytes={"p2p": [k], "broadcast": [k]},
                       call_gaps={"p2p": [1.0], "broadcast": [0.0]})
    assert predict(same, net).transfer_s == pytest.approx((2 * k - burst) / BPS)
    # an exchange that sends and receives alike waits as with one bucket
    both = StepProfile("x", 2, 0.1, 0.0, {"allgather": OpCount(1, k, k)}, call_bytes={"allgather": [k]},
                       call_gaps={"allgather": [1.0]})
    assert predict(both, net).transfer_s == pytest.approx((k - burst) / BPS)


def test_a_bucket_refills_in_wall_time_the_link_rests():
    """tbf adds tokens with the clock: between two calls the link rests for the rank's CPU work
    stretched by the core share, plus the second call's own latency (waiting for peers, rounds)."""
    burst = 262144.0
    half = burst / 2 / BPS                     # seconds that refill half the bucket
    sizes, gaps = [burst, burst], [0.0, half]   # the first call drains the bucket
    def profile(share: float) -> StepProfile:
        return StepProfile("m", 2, 0.1, half, {"allgather": OpCount(2, 2 * burst, 2 * burst)},
                           call_bytes={"allgather": sizes}, call_gaps={"allgather": gaps}, core_share=share)
    flat = Network("t", 0.0, RATE, efficiency={"allgather": 1.0}, burst_bytes=burst)
    assert predict(profile(1.0), flat).transfer_s == pytest.approx((burst / 2) / BPS)
    assert predict(profile(2.0), flat).transfer_s == pytest.approx(0.0)      # two ranks a core: full again
    # the call's latency rests the link too: a quarter bucket more at one rank per core
    slow = Network("t", 0.0, RATE, efficiency={"allgather": 1.0}, burst_bytes=burst,
                   op_alpha={"allgather": half / 2})
    rounds = slow.rounds("allgather", 2, burst)
    assert rounds == 1
    assert predict(profile(1.0), slow).transfer_s == pytest.approx((burst / 4) / BPS)
    assert predict(profile(1.0), slow).latency_s == pytest.approx(2 * half / 2)


def test_rate_curve_skips_sizes_barely_past_the_bucket_and_one_off_stalls():
    burst = 262144.0
    t_small = 2e-5

    def took(nbytes: float, eta: float) -> float:
        return t_small + (nbytes - burst) / (eta * BPS)
    probes = {"allgatherv": (t_small, took(8388616.0, 0.91), 8388616.0, 2)}
    sizes = [(262152.0, 0.66e-3),                 # 8 bytes past the bucket: eta 0.0001 if kept
             (524296.0, took(524296.0, 0.76)), (1048584.0, took(1048584.0, 0.83)),
             (2097160.0, took(2097160.0, 0.30))]  # a stall the neighbouring sizes did not have
    net = fit_link(RATE, probes, ring_from=65536, burst_bytes=burst, size_probes={"allgatherv": sizes})
    curve = dict(net.efficiency_curve["allgatherv"])
    assert 262152.0 not in curve                                   # beyond-bucket bytes < the bucket
    assert curve[524296.0] == pytest.approx(0.76)                  # an end: kept
    assert curve[1048584.0] == pytest.approx(0.76)                 # median(0.76, 0.83, 0.30)
    assert curve[2097160.0] == pytest.approx(0.83)                 # median(0.83, 0.30, 0.91)
    assert curve[8388616.0] == pytest.approx(0.91)
    # a monotone trend (the allgather's rate falling with size on 100 Mbit) passes unchanged
    falling = [(393e3, 0.76), (786e3, 0.71), (1.57e6, 0.66), (3.1e6, 0.59), (12.6e6, 0.51)]
    from horovod_compress.cost_model import _median_of_three
    assert _median_of_three(falling) == tuple(falling)


def test_hvdc_model_gives_every_method_the_same_forward_and_backward():
    """The same model on the same batches: the methods' passes differ only by noise, which must not
    rank them (a method whose pass ran faster than dense's would win "at any bandwidth")."""
    from horovod_compress.tools.bench.model_cmd import common_forward_backward
    from horovod_compress.cost_model import break_even_bandwidth
    ops = {"allgather": OpCount(1, 1e6, 1e6)}
    dense = StepProfile("none", 4, 0.43, 0.02, {"allreduce": OpCount(1, 7e7, 7e7)})
    lucky = StepProfile("topk", 4, 0.39, 0.05, ops)      # its pass happened to run 40 ms faster
    other = StepProfile("oktopk", 4, 0.41, 0.05, ops)
    net = Network("t", 2e-5, 10e9)
    assert math.isinf(break_even_bandwidth(lucky, dense, net))          # "any": noise as a result
    same = common_forward_backward({"none": dense, "topk": lucky, "oktopk": other})
    assert {p.compute_s for p in same.values()} == {0.41}
    assert same["topk"].compress_s == 0.05 and same["topk"].ops == ops
    assert not math.isinf(break_even_bandwidth(same["topk"], same["none"], net))


def test_a_root_that_returns_early_gives_an_effective_rate_above_the_link():
    """A 2 MiB broadcast at P = 2: the root's call returns once the message is in the socket
    buffers, the other rank waits for the wire, so the mean over ranks is half the wire time --
    and a gTop-k step's broadcast costs that mean, not the whole wire time."""
    burst, n = 262144.0, 2 * 1048576.0
    wire = (n - burst) / (0.93 * BPS)
    net = fit_link(RATE, {"broadcast": (2e-5, 2e-5 + wire / 2, n, 2)}, ring_from=65536, burst_bytes=burst)
    assert net.efficiency["broadcast"] == pytest.approx(1.86)
    prof = StepProfile("x", 2, 0.1, 0.0, {"broadcast": OpCount(1, n, n)}, call_bytes={"broadcast": [n]})
    assert predict(prof, net).transfer_s == pytest.approx(wire / 2)
