"""The emulated cluster (network namespaces + tc) and the alpha-beta cost model.

The cluster tests need root and network namespaces; where those are not
allowed they skip with the reason the cluster itself gives. The per-rank
case (``case_topk_across_hosts``) runs on ranks that live on different
emulated hosts; every cluster a test brings up is gone when it ends, also
after a failure or an interrupt.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import horovod_compress as hvdc

from horovod_compress.tools.cluster import ClusterSpec, EmulatedCluster, namespaces_of, parse_rate
from horovod_compress.cost_model import (Network, OpCount, StepProfile, break_even_bandwidth, fit_link,
                                         predict, speedup)
from horovod_compress.tools.testing import read_case_results, worker_command
from horovod_compress.tools.testing_plugin import cluster_or_skip

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the model
def _profile(method: str, p: int, nbytes: float, calls: int = 1, op: str = "allreduce",
             compute: float = 0.1, compress: float = 0.0) -> StepProfile:
    return StepProfile(method, p, compute, compress, {op: OpCount(calls, nbytes, nbytes)})


def test_predict_is_alpha_beta():
    net = Network("t", alpha=1e-4, bandwidth=8e9)            # 1 GB/s
    prof = _profile("none", 4, 1e9 * 0.75, calls=2)           # 0.75 s of bytes, 2 allreduces
    pr = predict(prof, net)
    assert pr.transfer_s == pytest.approx(0.75)
    assert pr.latency_s == pytest.approx(2 * 2 * math.log2(4) * 1e-4)   # 2 log2 P rounds per allreduce
    assert pr.step_s == pytest.approx(0.1 + 0.75 + pr.latency_s)


def test_volume_laws_scale_with_p():
    dense = _profile("none", 4, 1.5e6)                        # 2N(P-1)/P with N = 1 MB
    topk = _profile("topk", 4, 3e5, op="allgatherv")          # (P-1) parts
    assert dense.scaled(1024).bytes_per_step == pytest.approx(2e6 * 1023 / 1024)
    assert topk.scaled(1024).bytes_per_step == pytest.approx(1e5 * 1023)
    gtopk = _profile("gtopk", 4, 2e5, op="p2p")
    assert gtopk.scaled(64).bytes_per_step == pytest.approx(2e5 * 6 / 2)


def test_break_even_bandwidth_closed_form():
    net = Network("t", alpha=0.0, bandwidth=1e9)
    dense = _profile("none", 4, 1e8, compute=0.1)
    method = _profile("oktopk", 4, 1e6, compute=0.1, compress=0.05)
    b = break_even_bandwidth(method, dense, net)
    # 0.05 s of extra compute pays for (1e8 - 1e6) bytes at b bits/s
    assert b == pytest.approx(8 * (1e8 - 1e6) / 0.05)
    just_below, just_above = net.with_bandwidth(b * 0.99), net.with_bandwidth(b * 1.01)
    assert speedup(method, dense, just_below) > 1 > speedup(method, dense, just_above)
    assert break_even_bandwidth(dense, dense, net) == 0.0
    free = _profile("oktopk", 4, 1e6, compute=0.1)
    assert break_even_bandwidth(free, dense, net) == math.inf


def test_fit_link_recovers_constants():
    # an allreduce at P = 4 with alpha 50 us per round, at 80% of 1 Gbit
    alpha, eff, p = 50e-6, 0.8, 4
    nbytes = 24e6
    small = 2 * math.log2(p) * alpha
    large = small + nbytes / (eff * 1e9 / 8)
    net = fit_link(1e9, {"allreduce": (small, large, nbytes, p)})
    assert net.op_alpha["allreduce"] == pytest.approx(alpha)
    assert net.efficiency["allreduce"] == pytest.approx(eff)


def test_rounds_follow_the_algorithm_mpi_runs():
    # Table 1 (Rabenseifner): 2 log2 P; the testbed: recursive doubling below 64 KiB, ring from it on
    table1, testbed = Network("t", 1e-5, 1e9), Network("t", 1e-5, 1e9, ring_from=65536)
    small, large = 1000.0, 2 * 3 / 4 * 65536            # the ring's volume of a 64 KiB message at P = 4
    assert table1.rounds("allreduce", 4, small) == table1.rounds("allreduce", 4, large) == 4
    assert testbed.rounds("allreduce", 4, small) == 2 and testbed.rounds("allreduce", 4, large) == 6
    assert testbed.rounds("allgatherv", 8, large) == 3
    # a per-round floor: 10 small ring-less calls at P = 4 cost 10 x 2 x max(alpha, floor)
    floor = Network("t", 1e-5, 1e9, ring_from=65536, round_latency=1e-4)
    assert predict(_profile("m", 4, small * 10, calls=10), floor).latency_s == pytest.approx(10 * 2 * 1e-4)


def test_token_bucket_lets_the_first_burst_through():
    b, rate = 262144.0, 1e8                                 # 256 KiB bucket on a 100 Mbit link
    net = Network("t", 0.0, rate, burst_bytes=b)
    one = predict(_profile("m", 2, 1e6), net)
    assert one.transfer_s == pytest.approx((1e6 - b) / (rate / 8))
    assert predict(_profile("m", 2, 1e5), net).transfer_s == 0.0
    # two 200 kB calls with no CPU work between: the second finds 62 kB of tokens left
    two = predict(_profile("m", 2, 4e5, calls=2), net)
    assert two.transfer_s == pytest.approx((2e5 - (b - 2e5)) / (rate / 8))
    # ... and with enough work between them the bucket refills: both pass at wire speed
    assert predict(_profile("m", 2, 4e5, calls=2, compress=1.0), net).transfer_s == 0.0
    # recorded per-call sizes replace the mean: one 1 MB call, then a tiny one into the empty bucket
    prof = StepProfile("m", 2, 0.1, 0.0, {"allreduce": OpCount(2, 1e6 + 8, 1e6 + 8)},
                       call_bytes={"allreduce": [1e6, 8.0]})
    assert predict(prof, net).transfer_s == pytest.approx((1e6 + 8 - b) / (rate / 8))
    assert predict(_profile("m", 2, 1e6 + 8, calls=2), net).transfer_s == pytest.approx(
        2 * (5e5 + 4) / (rate / 8) - b / (rate / 8))


def test_fit_link_on_the_testbed_rounds_and_bucket():
    # an allreduce at P = 4, recursive doubling (2 rounds) for the small probe, 90% of 1 Gbit,
    # a 256 KiB token bucket, 200 us for one tiny allreduce between bursts of CPU work
    alpha, eff, p, b = 40e-6, 0.9, 4, 262144.0
    nbytes = 24e6
    small = 2 * alpha
    large = small + (nbytes - b) / (eff * 1e9 / 8)
    net = fit_link(1e9, {"allreduce": (small, large, nbytes, p), "allgatherv": (small, large, nbytes, p)},
                   call_latency=200e-6, ring_from=65536, burst_bytes=b)
    assert net.op_alpha["allreduce"] == pytest.approx(alpha)
    assert net.efficiency["allreduce"] == pytest.approx(eff)
    assert net.round_latency == pytest.approx(100e-6) and net.call_latency == 0.0
    # an operation without a probe of its own (allgather) takes allgatherv's rate
    gather = StepProfile("m", p, 0.1, 0.0, {"allgather": OpCount(1, 1e7, 1e7)})
    assert predict(gather, net).transfer_s == pytest.approx((1e7 - b) / (eff * 1e9 / 8))


def test_probe_passes_pool_their_samples():
    """A run probes before each round and after the last; one slow pass must not become the link."""
    from horovod_compress.tools.bench.e2e_worker import merge_probes, probe_passes

    def one_pass(large: float) -> dict:
        op = {"large_bytes": 1000.0, "idle_cpu_s": 0.05,
              "small_samples_s": [1e-4] * 3, "small_rank_samples_s": [8e-5] * 3,
              "large_samples_s": [large, large * 1.1], "large_rank_samples_s": [large * 0.9, large],
              "size_samples": [{"bytes": 10.0, "slowest_s": [large / 4], "rank_mean_s": [large / 5]}]}
        curve = [{"work_s": 1e-4, "call_mean_s": large / 100, "call_median_s": large / 200,
                  "call_p90_s": large / 50}]
        return {"allreduce": op, "interleaved": {"call_s": 0.0, "call_mean_s": 0.0, "curve": curve}}
    assert probe_passes(2) == 3
    merged = merge_probes([one_pass(1.0), one_pass(2.0), one_pass(1.0)])["allreduce"]
    # six samples each: 0.9 1.0 | 1.8 2.0 | 0.9 1.0 -> the median of the pool, not of the slow pass
    assert merged["large_rank_mean_s"] == pytest.approx(1.0)
    assert merged["large_s"] == pytest.approx(1.1)
    assert len(merged["large_samples_s"]) == len(merged["large_rank_samples_s"]) == 6
    assert merged["sizes"] == [[10.0, pytest.approx(0.25)]] and merged["sizes_rank_mean"] == [[10.0, 0.2]]
    inter = merge_probes([one_pass(1.0), one_pass(2.0)])["interleaved"]
    assert inter["call_mean_s"] == pytest.approx(0.015) and inter["curve"][0]["call_p90_s"] == pytest.approx(0.03)
    with pytest.raises(ValueError, match="at least one probe pass"):
        merge_probes([])


def test_e2e_report_says_what_auto_chose_against_the_fastest_fixed_method():
    from horovod_compress.tools.bench.e2e import auto_choices
    decision = {"chosen": "topk", "predicted_ms": 31.5, "runner_up": "oktopk", "runner_up_ms": 33.0,
                "reason": "first call"}
    run = {"world_size": 4, "bandwidth": "1gbit",
           "methods": {"none": {"step_s": 0.9}, "topk": {"step_s": 0.30}, "oktopk": {"step_s": 0.32},
                       "fp16": {"error": "failed"}, "auto": {"step_s": 0.33, "decisions": {"bucket0": decision}}}}
    lines = auto_choices([run], list(run["methods"]))
    assert lines[1] == "What `auto` chose, per bucket, at the end of its measured steps:"
    assert lines[-1] == ("- `auto` at P=4 1 Gbit: bucket0: topk (predicted 31.5 ms, runner-up oktopk 33.0 ms); "
                         "step 1.10x the fastest fixed method's (topk), 0.37x dense's.")
    assert auto_choices([dict(run, methods={"none": {"step_s": 0.9}})], ["none"]) == []   # no auto: no lines


def test_e2e_worker_reads_parameters_with_commas_of_their_own():
    from horovod_compress.tools.bench.e2e import _label
    from horovod_compress.tools.bench.e2e_worker import method_specs
    text = 'none,auto:{"steps_factors":{"topk":1,"oktopk":1}},topk:{"density":0.02}'
    specs = method_specs(text)
    assert [(n, p) for n, p, _ in specs] == [("none", {}), ("auto", {"steps_factors": {"topk": 1, "oktopk": 1}}),
                                             ("topk", {"density": 0.02})]
    # the worker's labels are the parent's, which keys the report's rows
    assert [lb for _, _, lb in specs] == [_label(s) for s in ("none", 'auto:{"steps_factors":{"topk":1,"oktopk":1}}',
                                                              'topk:{"density":0.02}')]


def test_e2e_report_prices_auto_candidates_beside_their_fixed_rows():
    from horovod_compress.tools.bench.e2e import auto_pricing
    table = {"topk": {"predicted_ms": 20.0, "dry_run": "bucket", "steps_factor": 2.3},
             "none": {"predicted_ms": 150.0, "dry_run": "slice 1/16", "steps_factor": 1.0}}
    decision = {"chosen": "topk", "predicted_ms": 20.0, "candidates": table}
    run = {"world_size": 2, "bandwidth": "10gbit",
           "methods": {"none": {"exchange_s": 0.066}, "auto": {"decisions": {"bucket0": decision}}}}
    lines = auto_pricing([run], list(run["methods"]))
    assert lines[-2:] == ["| 2 | 10 Gbit | bucket0 | topk (chosen) | bucket | 20.0 | 2.3 | 46.0 | - |",
                          "| 2 | 10 Gbit | bucket0 | none | slice 1/16 | 150.0 | 1 | 150.0 | 66.0 |"]
    # a report from before the decisions recorded their tables: no lines
    assert auto_pricing([dict(run, methods={"auto": {"decisions": {"b": {"chosen": "topk"}}}})], ["auto"]) == []


def test_a_run_whose_ranks_never_start_fails_fast():
    """The launcher's start watchdog: a job that prints nothing is killed after --start-timeout
    (not --timeout) with its own error, which the bench answers by launching the run once more;
    a job whose rank 0 reports in runs to the end."""
    from horovod_compress.tools.bench.e2e import STARTED_LINE, RanksDidNotStart, _stream

    class Bar:
        """What the launcher's progress bar is told: the count and the last label."""
        n, label = 0, ""

        def update(self, k: int) -> None:
            self.n += k

        def set_postfix_str(self, text: str) -> None:
            self.label = text
    env = dict(os.environ)
    bar = Bar()
    t0 = time.monotonic()
    with pytest.raises(RanksDidNotStart, match="no rank started within 1 s"):
        _stream([sys.executable, "-c", "import time; time.sleep(60)"], env, bar, "P=2 1gbit",
                timeout=60, start_timeout=1)
    assert time.monotonic() - t0 < 30
    script = (f"import time; print({STARTED_LINE!r}, flush=True); time.sleep(2); "
              "print('HVDC-PROGRESS probe (1/1)', flush=True); print('HVDC-PROGRESS none', flush=True)")
    _stream([sys.executable, "-c", script], env, bar, "P=2 1gbit", timeout=60, start_timeout=1)
    assert bar.n == 2 and bar.label == "P=2 1gbit none"
    with pytest.raises(RuntimeError, match="did not finish within 1 s"):
        _stream([sys.executable, "-c", f"print({STARTED_LINE!r}, flush=True); import time; time.sleep(60)"],
                env, bar, "P=2 1gbit", timeout=1, start_timeout=30)


def test_spec_validation():
    assert parse_rate("100mbit") == 1e8 and parse_rate("10gbit") == 1e10
    for bad, match in (({"bandwidth": "fast"}, "bandwidth must look like"),
                       ({"hosts": 0}, "hosts must be an integer"),
                       ({"name": "Bad-Name"}, "cluster name must be"),
                       ({"subnet": "10.1"}, "subnet must be three octets"),
                       ({"delay": "5 ms"}, "a duration must look like")):
        with pytest.raises(ValueError, match=match):
            ClusterSpec(**bad)


# ---------------------------------------------------------------- the cluster
def case_topk_across_hosts(comm):
    """A compressed allreduce across two hosts equals its dense reference, and the traffic crossed the
    shaped link: 4 MB take at least what 100 Mbit allow."""
    rng = np.random.default_rng(100 + comm.rank)
    grads = [np.random.default_rng(100 + r).standard_normal(50_000).astype(np.float32)
             for r in range(comm.size)]
    x = grads[comm.rank]
    assert np.array_equal(x, rng.standard_normal(50_000).astype(np.float32))
    # density 1.0 keeps every element: TopkA must then equal the dense average exactly (up to fp32 sums)
    method = hvdc.Compression.topk(density=1.0)
    avg = method.allreduce(x, name="w", comm=comm)
    ref = np.mean(np.stack(grads), axis=0)
    np.testing.assert_allclose(avg, ref, rtol=1e-5, atol=1e-6)
    # a sparse one: the sum of each rank's exact top-k, averaged
    k = 500
    sparse = hvdc.Compression.topk(density=k / x.size).allreduce(x, name="s", comm=comm)
    expect = np.zeros_like(x)
    for g in grads:
        idx = np.argpartition(np.abs(g), -k)[-k:]
        expect[idx] += g[idx]
    np.testing.assert_allclose(sparse, expect / comm.size, rtol=1e-5, atol=1e-6)
    # fp16's pipelined ring between hosts: eager 60 KiB segments, the same bits as the 16-bit sum
    from horovod_compress.kernels.halfprec import add16_range, decode16, encode16
    from horovod_compress.mpi_collectives.reduce_ops import NETWORK_RING_PIECES, ring_piece_sizes
    assert ring_piece_sizes(comm, (1 << 20, 1 << 18)) == NETWORK_RING_PIECES   # two nodes to MPI
    from horovod_compress.mpi_collectives.shared_window import use_shared_window
    os.environ["HVDC_SHARED_WINDOW"] = "on"        # even when asked for: no window between hosts
    assert not use_shared_window(comm)
    halves = [np.random.default_rng(200 + r).standard_normal(300_000).astype(np.float32)
              for r in range(comm.size)]
    words = [encode16(g, "fp16", scale=1.0 / comm.size) for g in halves]
    total = np.empty_like(words[0])
    add16_range("fp16")(words[0], words[1], total, 0, total.size)
    half = hvdc.Compression.fp16().allreduce(halves[comm.rank], name="h", comm=comm)
    assert np.array_equal(half, decode16(total, "fp16"))
    big = np.ones(1_000_000, np.float32)           # 4 MB: ring allreduce moves 4 MB each way at P = 2
    comm.barrier()
    t0 = time.perf_counter()
    out = comm.allreduce(big)
    seconds = time.perf_counter() - t0
    assert out[0] == comm.size
    return {"netns": os.readlink("/proc/self/ns/net"), "seconds": seconds}


@pytest.mark.timeout(240)
def test_compressed_allreduce_across_two_shaped_hosts(tmp_path):
    name = f"t{os.getpid() % 100000}"
    cluster_or_skip(name)
    spec = ClusterSpec(hosts=2, bandwidth="100mbit", name=name)
    with EmulatedCluster(spec) as cluster:
        assert sorted(namespaces_of(name)) == sorted(spec.namespaces)
        cmd = ["mpirun", "-np", "2", *worker_command(__file__, tmp_path, [case_topk_across_hosts])]
        proc = cluster.run(cmd, timeout=180, capture=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert namespaces_of(name) == []
    results = list(read_case_results(tmp_path, 2)[case_topk_across_hosts].values())
    assert results[0]["netns"] != results[1]["netns"]            # two hosts, not one
    # 4 MB each way over a 100 Mbit link cannot take less than 0.32 s (0.34 s at line rate)
    assert min(r["seconds"] for r in results) > 0.3, results


@pytest.mark.timeout(120)
def test_nothing_left_after_a_failure():
    name = f"f{os.getpid() % 100000}"
    cluster_or_skip(name)
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(ClusterSpec(hosts=2, name=name)) as cluster:
            assert cluster.run(["false"]).returncode == 1
            raise RuntimeError("boom")
    assert namespaces_of(name) == []
    # the CLI's ephemeral run: the command fails, the cluster goes away, the exit code comes back
    rc = subprocess.call([sys.executable, "-m", "horovod_compress.tools.cli", "cluster", "run", "--ephemeral",
                          "--name", name, "--hosts", "2", "--", "sh", "-c", "exit 7"], cwd=ROOT)
    assert rc == 7
    assert namespaces_of(name) == []


@pytest.mark.timeout(400)
def test_bench_e2e_writes_its_tables(tmp_path):
    name = f"e{os.getpid() % 100000}"
    cluster_or_skip(name)
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", "bench", "e2e", "--hosts", "2",
                           "--bandwidths", "1gbit", "--model", "tiny", "--methods", "topk,oktopk",
                           "--steps", "1", "--warm", "1", "--rounds", "2", "--probe-repeats", "3",
                           "--out", str(out), "--cluster-name", name],
                          capture_output=True, text=True, cwd=ROOT, timeout=360)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert namespaces_of(name) == []
    report = json.loads((out / "e2e.json").read_text())
    run = report["runs"][0]
    assert run["world_size"] == 2 and set(run["methods"]) == {"none", "topk", "oktopk"}
    for label, m in run["methods"].items():
        assert "error" not in m, (label, m)
        assert m["step_s"] > 0 and m["predicted"]["comm_s"] > 0
    assert run["methods"]["none"]["speedup"] == pytest.approx(1.0)
    # the calls' agreement (where a rank waits for a peer still computing) is timed apart from
    # compression and from the payload's comm, and the breakdown has its column
    assert all(m["wait_s"] >= 0 and 0 <= m["wait_cpu_s"] for m in run["methods"].values())
    assert "| compress / memcpy | wait | comm |" in (out / "e2e.md").read_text()
    # two rounds, the methods taking turns: each method's median is over both rounds' steps
    assert run["rounds"] == 2 and "in each of 2 rounds" in (out / "e2e.md").read_text()
    assert all(m["steps_measured"] == 2 for m in run["methods"].values())
    # the model used each method's recorded per-call sizes (recorded first, on shared memory)
    calls = json.loads((out / "e2e_calls.json").read_text())["tiny"]["2"]
    assert set(calls) == {"none", "topk", "oktopk"}
    assert all(m["predicted"]["call_sizes"] == "recorded" for m in run["methods"].values() if m["ops"])
    # ... with the CPU work before each call (since the ranks last met, and since the previous
    # call itself: the links rest through a bucket's agreement) beside each call's size
    for label, ops in calls.items():
        for op, sizes in ops.items():
            if "@" not in op:
                gaps, rests = ops[op + "@gap_s"], ops[op + "@rest_s"]
                assert len(gaps) == len(rests) == len(sizes), (label, op)
                assert all(0 <= g <= r + 1e-9 for g, r in zip(gaps, rests)), (label, op, gaps, rests)
    # every collective and the pipelined ring were probed at several sizes: a rate per message size
    for op in ("allreduce", "allgather", "p2p", "p2p_oneway", "ring"):
        curve = run["link"][op]["efficiency_curve"]
        # (a mean over ranks can beat the wire where a root returns early: eta > 1 is allowed, but
        # no op moves its bytes more than P times faster than the link)
        assert len(curve) >= 2 and all(0 < eta <= run["world_size"] for _, eta in curve), (op, curve)
        assert [b for b, _ in curve] == sorted(b for b, _ in curve)
    # the links were probed before each of the 2 rounds and after the last, the passes' samples pooled
    assert run["probe_passes"] == 3
    assert all(len(v["large_rank_samples_s"]) == len(v["large_samples_s"]) >= 3
               for op, v in run["probe"].items() if op != "interleaved")
    # each probe holds the slowest rank's time and the mean over ranks (never above it), and the
    # model's rate is fitted to the mean: what a step's comm time (each rank's MPI time, averaged) is
    for op, v in run["probe"].items():
        if op == "interleaved":
            continue
        assert 0 < v["large_rank_mean_s"] <= v["large_s"] and 0 < v["small_rank_mean_s"] <= v["small_s"], op
        assert [b for b, _ in v["sizes_rank_mean"]] == [b for b, _ in v["sizes"]]
        assert all(0 < m <= s for (_, m), (_, s) in zip(v["sizes_rank_mean"], v["sizes"])), op
        ideal = (v["large_bytes"] - run["burst_bytes"]) / (1e9 / 8)
        eta = ideal / (v["large_rank_mean_s"] - v["small_rank_mean_s"])
        assert run["link"][op]["efficiency"] == pytest.approx(eta), op
    assert run["burst_bytes"] > 0 and run["load_before"] >= 0 and run["load_after"] >= 0
    assert (out / "e2e.png").stat().st_size > 1000
    assert "Speedup of a whole step over dense" in (out / "e2e.md").read_text()
    assert "Speedup of the exchange alone over dense" in (out / "e2e.md").read_text()
    # hvdc model reads those profiles: a row per method, dense at 1.00x, a break-even for the others
    table = out / "model.md"
    proc = subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", "model", "--profiles",
                           str(out / "e2e.json"), "--network", "10gbe", "--ranks", "2", "1024", "--out", str(table),
                           "--plot", str(out / "model.png")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in table.read_text().splitlines()
            if line.startswith("| ") and "method" not in line}
    assert set(rows) == {"none", "topk", "oktopk"}
    assert "(1.00x), -" in rows["none"]
    accuracy, *cells = [c.strip() for c in rows["oktopk"].split("|")[2:-1]]
    assert accuracy.startswith(("+", "-"))          # the convergence study's points against dense
    assert len(cells) == 2 and all(c.endswith(("Gbit/s", "any", "never")) for c in cells), cells
    assert (out / "model.png").stat().st_size > 1000
    # --rerender analyses the same measurements again (no cluster) and says so under the header
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(out / "e2e_calls.json", again / "e2e_calls.json")
    proc = subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", "bench", "e2e", "--rerender",
                           str(out / "e2e.json"), "--out", str(again)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    redone = json.loads((again / "e2e.json").read_text())
    assert redone["when"] == report["when"] and redone["commit"] == report["commit"]
    assert redone["runs"][0]["methods"]["oktopk"]["comm_s"] == run["methods"]["oktopk"]["comm_s"]
    assert redone["runs"][0]["methods"]["oktopk"]["predicted"] == run["methods"]["oktopk"]["predicted"]
    assert "Analysed again (`--rerender`, the same measurements)" in (again / "e2e.md").read_text()
    # an invocation whose run failed, merged with one that measured it: no gap is left to report
    failed = dict(report, runs=[], failed_runs=[{"world_size": run["world_size"], "bandwidth": run["bandwidth"],
                                                 "error": "benchmark workers failed"}])
    (again / "failed.json").write_text(json.dumps(failed))
    proc = subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", "bench", "e2e", "--rerender",
                           str(again / "failed.json"), str(out / "e2e.json"), "--out", str(again), "--name", "merged"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads((again / "merged.json").read_text())
    assert merged["failed_runs"] == [] and len(merged["runs"]) == 1
    assert "Runs that did not finish" not in (again / "merged.md").read_text()


def test_communicator_times_mpi_calls():
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()
    comm.allreduce(np.ones(1000, np.float32))
    comm.allgatherv(np.ones(10, np.float32))        # an allgather of the counts, then the allgatherv
    t = comm.timings()
    assert set(t["by_op"]) == {"allreduce", "allgather", "allgatherv"}
    assert t["total"] == pytest.approx(sum(t["by_op"].values())) and t["total"] > 0
    assert t["cpu_total"] >= 0
    comm.reset_stats()
    assert comm.timings() == {"total": 0, "by_op": {}, "cpu_total": 0.0, "cpu_by_op": {}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_nothing_left_after_an_interrupt(signame):
    import signal
    name = f"i{os.getpid() % 100000}{signame[3].lower()}"
    cluster_or_skip(name)
    # a shell's background job (`pytest ... &`) starts with SIGINT ignored, which children
    # inherit; the script restores Python's handler so that it sees the Ctrl-C a terminal sends
    script = (f"import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              f"from horovod_compress.tools.cluster import *\n"
              f"with EmulatedCluster(ClusterSpec(hosts=2, name={name!r})):\n"
              f"    print('up', flush=True)\n"
              f"    import time; time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "up"
    assert len(namespaces_of(name)) == 3
    proc.send_signal(getattr(signal, signame))
    proc.wait(timeout=60)
    assert proc.returncode != 0
    deadline = time.monotonic() + 10
    while namespaces_of(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert namespaces_of(name) == []


@pytest.mark.timeout(120)
def test_up_refuses_to_rebuild_a_cluster_in_use():
    from horovod_compress.tools.cluster import ClusterError, up
    name = f"u{os.getpid() % 100000}"
    cluster_or_skip(name)
    with EmulatedCluster(ClusterSpec(hosts=2, name=name, bandwidth="1gbit")) as cluster:
        job = subprocess.Popen(["ip", "netns", "exec", cluster.spec.host(1), "sleep", "30"])
        try:
            time.sleep(0.3)
            assert up(ClusterSpec(hosts=2, name=name, bandwidth="1gbit")) == cluster.spec   # same: kept
            with pytest.raises(ClusterError, match="in use"):
                up(ClusterSpec(hosts=2, name=name, bandwidth="100mbit"))
            assert job.poll() is None                                                     # not killed
        finally:
            job.kill()
            job.wait()
    assert namespaces_of(name) == []
