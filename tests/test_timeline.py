"""The timeline: every rank's phases as Chrome trace-event JSON, merged on rank 0.

Format: "Trace Event Format" (Google; what Perfetto and chrome://tracing open):
a ``traceEvents`` list of complete events (``"ph": "X"``, ``ts``/``dur`` in
microseconds, ``pid``/``tid``) and metadata events (``"ph": "M"``) naming each
process. The cases run on real ranks (P = 2 and 4): collectives of every kind,
an Ok-Topk and a TopkA exchange; rank 0 checks the merged trace against what
each rank did (spans, peers, bytes equal to the communicator's counts, time
order). The last test runs one of Horovod's example scripts, with only its
import changed, under ``HOROVOD_TIMELINE``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.mpi_collectives import timeline
from horovod_compress.mpi_collectives.accounting import allreduce_volume
from horovod_compress.mpi_collectives import timeline_file
from horovod_compress.tools.testing import mpi_env, mpirun_command, run_cases

pytestmark = pytest.mark.mpi


# --------------------------------------------------------------- checks of a trace
def check_trace(trace: dict, world: int) -> dict[int, list[dict]]:
    """Assert ``trace`` is valid trace-event JSON with one named process per rank; returns each
    rank's complete events, sorted by start."""
    trace = json.loads(json.dumps(trace))          # plain JSON: no NumPy scalars, no NaN
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(world)}, names
    spans: dict[int, list[dict]] = {r: [] for r in range(world)}
    for e in events:
        assert e["ph"] in ("X", "M"), e
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and isinstance(e["cat"], str), e
            assert isinstance(e["tid"], int) and e["ts"] >= 0 and e["dur"] >= 0, e
            spans[e["pid"]].append(e)
    for r in range(world):
        assert spans[r], f"rank {r} has no spans"
        spans[r].sort(key=lambda e: e["ts"])
    return spans


def check_nesting(spans: list[dict]) -> None:
    """On each thread, spans either nest or follow each other (what a trace viewer stacks).

    ``ts`` and ``dur`` are each rounded to 1 ns, so an end may be off by 2 ns: 10 ns of slack."""
    slack = 0.01
    by_thread: dict[int, list[dict]] = {}
    for e in spans:
        by_thread.setdefault(e["tid"], []).append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []
        for e in evs:
            while open_ends and e["ts"] >= open_ends[-1] - slack:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + slack, (e, open_ends)
            open_ends.append(end)


# --------------------------------------------------------------------------- cases
def case_collectives_and_methods(comm):
    """Every kind of call on every rank, then the merged trace checked on rank 0."""
    p, r = comm.size, comm.rank
    assert timeline.recorder is None
    comm.allreduce(np.ones(100, np.float32))          # before the timeline: not recorded
    rec = timeline.start()
    comm.allreduce(np.ones(1000, np.float32))
    comm.allgatherv(np.ones(10 * (r + 1), np.float64))
    req = comm.isend(np.full(50 + r, r, np.float32), (r + 1) % p, tag=11)
    got = comm.recv((r - 1) % p, tag=11, dtype=np.float32)
    req.wait()
    assert got[0] == (r - 1) % p
    rng = np.random.default_rng(100 + r)
    ok = hvdc.Compression.oktopk(density=0.05, warmup_steps=0)
    top = hvdc.Compression.topk(density=0.05)
    for step in range(3):
        g = rng.standard_normal(4000).astype(np.float32)
        ok.allreduce(g, "w", comm)
        top.allreduce(g, "w", comm)
    with timeline.span("custom phase", "step", note="by the caller"):
        pass
    assert timeline.stop() is rec
    trace = timeline.gather_trace(comm, rec, {"case": "collectives"})
    if r != 0:
        assert trace is None
        return None
    spans = check_trace(trace, p)
    out = {}
    for rank, evs in spans.items():
        check_nesting(evs)
        names = [e["name"] for e in evs]
        allreduce = [e for e in evs if e["name"] == "allreduce" and e["cat"] == "mpi"]
        # the first recorded allreduce is the 4000-byte one, with its counted bytes
        assert allreduce[0]["args"]["sent"] == allreduce_volume(4000, p), allreduce[0]
        sends = [e for e in evs if e["name"] == "p2p" and e["args"].get("sent")]
        assert sends[0]["args"]["peer"] == (rank + 1) % p and sends[0]["args"]["sent"] == 4 * (50 + rank)
        probes = [e for e in evs if e["name"] == "probe"]
        assert probes[0]["args"]["peer"] == (rank - 1) % p
        out[rank] = {
            "clock_offset_s": trace["otherData"]["clock_offsets_s"][rank],
            "names": sorted(set(names)),
            "oktopk_calls": names.count("oktopk"), "topk_calls": names.count("topk"),
            "waits": sum(e["cat"] == "wait" for e in evs),
            "agree": sum(e["cat"] == "agree" for e in evs),
            "split_peers": sorted({e["args"]["peer"] for e in evs
                                   if e["name"] == "p2p" and "peer" in e["args"]
                                   and e["args"].get("sent")}),
        }
    return out


def case_off_records_nothing(comm):
    """Without a running timeline nothing is kept, and the probes are a no-op context."""
    assert timeline.recorder is None
    assert timeline.span("x") is timeline.span("y")       # the shared no-op context
    m = hvdc.Compression.oktopk(density=0.05, warmup_steps=0)
    m.allreduce(np.ones(1000, np.float32), "w", comm)
    assert timeline.recorder is None
    trace = timeline.gather_trace(comm, None)
    if comm.rank == 0:
        assert [e for e in trace["traceEvents"] if e["ph"] == "X"] == []
    return True


def case_start_stop_writes_one_file(comm):
    """``start_timeline``/``stop_timeline`` (Horovod's names): rank 0 writes one merged file."""
    path = os.path.join(os.environ["HVDC_TIMELINE_TEST_DIR"], f"p{comm.size}.json")
    timeline_file.start_timeline(comm, path)
    assert timeline_file.timeline_running(comm)
    hvdc.Compression.topk(density=0.1).allreduce(np.arange(500, dtype=np.float32), "t", comm)
    assert timeline_file.stop_timeline() == path
    assert not timeline_file.timeline_running()
    comm.barrier()
    with open(path) as fh:
        spans = check_trace(json.load(fh), comm.size)
    return sorted({e["name"] for e in spans[comm.rank]})


# --------------------------------------------------------------------------- tests
def test_recorder_rows_become_trace_events():
    rec = timeline.Recorder()
    with rec.span("outer", "phase", a=1) as args:
        args["b"] = 2
        rec.add("allreduce", timeline.MPI, 1.0, 1.5)
        rec.add_bytes("allreduce", 10, 20)
        rec.add_bytes("allgather", 1, 1)          # not the last op: ignored
    events = timeline.trace_events(3, rec.rows, 1.0, rec.thread_names())
    meta = [e for e in events if e["ph"] == "M"]
    assert {"name": "process_name", "ph": "M", "pid": 3, "tid": 0, "args": {"name": "rank 3"}} in meta
    x = {e["name"]: e for e in events if e["ph"] == "X"}
    assert x["allreduce"]["ts"] == 0.0 and x["allreduce"]["dur"] == 500000.0
    assert x["allreduce"]["args"] == {"sent": 10.0, "received": 20.0}
    assert x["outer"]["args"] == {"a": 1, "b": 2} and x["outer"]["cat"] == "phase"


def test_timeline_env_path(monkeypatch):
    monkeypatch.delenv(timeline_file.OWN_ENV, raising=False)
    # a Horovod that an earlier test imported into this process is not running here
    monkeypatch.delitem(sys.modules, "horovod.common.basics", raising=False)
    monkeypatch.setenv(timeline_file.TIMELINE_ENV, "/tmp/x/t.json")
    assert timeline_file.env_path() == "/tmp/x/t.json"
    monkeypatch.setitem(sys.modules, "horovod.common.basics", object())   # Horovod owns that file
    assert timeline_file.env_path() == "/tmp/x/t.hvdc.json"
    monkeypatch.setenv(timeline_file.OWN_ENV, "/tmp/own.json")
    assert timeline_file.env_path() == "/tmp/own.json"
    with pytest.raises(ValueError, match="path"):
        timeline_file.start_timeline(object(), "")


@pytest.fixture(scope="module", params=[2, 4])
def results(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("timeline")
    return request.param, run_cases(request.param, __file__, timeout=240,
                                    env={"HVDC_TIMELINE_TEST_DIR": str(d)})


def test_every_rank_has_its_spans(results):
    p, res = results
    out = {int(k): v for k, v in res[case_collectives_and_methods][0].items()}
    for rank in range(p):
        got = out[rank]
        for name in ("allreduce", "allgatherv", "allgather", "p2p", "probe", "wait", "agree",
                     "oktopk", "oktopk.local_selection", "oktopk.split_and_reduce",
                     "oktopk.densify", "feedback.residual", "topk", "topk.select",
                     "topk.scatter_sum", "custom phase"):
            assert name in got["names"], (rank, name, got["names"])
        assert got["oktopk_calls"] == 3 and got["topk_calls"] == 3
        assert got["waits"] >= 1 and got["agree"] >= 6
        # one host: every rank reads the same monotonic clock, so the estimated offsets are ~0
        assert abs(got["clock_offset_s"]) < 0.1, got["clock_offset_s"]
        # split-and-reduce sends one message to every other rank (Figure 2(c))
        assert set(got["split_peers"]) == set(range(p)) - {rank}, got


def test_off_and_file(results):
    p, res = results
    assert res[case_off_records_nothing][0] is True
    for rank in range(p):
        names = res[case_start_stop_writes_one_file][rank]
        assert {"topk", "allgather", "agree"} <= set(names), names


def test_horovod_timeline_from_a_horovod_script(tmp_path):
    """Horovod's synthetic benchmark, only its import changed, under HOROVOD_TIMELINE."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_horovod_examples import EXAMPLES, ours_copy   # (imports Horovod: not in the ranks)
    script = ours_copy("pytorch_synthetic_benchmark.py", tmp_path)
    trace_path = tmp_path / "timeline.json"
    env = mpi_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   "HVD_EXAMPLE_OUT": str(tmp_path), "HOROVOD_TIMELINE": str(trace_path)})
    env.pop("HVDC_LAUNCHED", None)
    proc = subprocess.run(mpirun_command(2) + [sys.executable, str(script), "--compression", "topk"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spans = check_trace(json.loads(trace_path.read_text()), 2)
    for rank in (0, 1):
        names = {e["name"] for e in spans[rank]}
        assert {"topk", "allgather", "agree", "synchronize", "optimizer update",
                "gradients arriving", "forward + backward to first gradient"} <= names, names
        assert any(e["cat"] == "bucket" for e in spans[rank])
        check_nesting(spans[rank])
    assert (EXAMPLES / "pytorch_synthetic_benchmark.py").exists()


def test_gantt_chart_and_table_of_a_trace(tmp_path):
    """``hvdc timeline plot|summary`` on a two-rank trace made by the recorder itself."""
    from horovod_compress.tools.bench import timeline_view
    from horovod_compress.tools.cli import main
    events = []
    for rank in range(2):
        rec = timeline.Recorder()
        rec.add("oktopk", "method", 0.0, 0.010)
        rec.add("oktopk.split_and_reduce", timeline.PHASE, 0.001, 0.004 + 0.002 * rank)
        rec.add("wait", timeline.WAIT, 0.002, 0.004 + 0.002 * rank, {"op": "p2p"})
        events += timeline.trace_events(rank, rec.rows, 0.0, rec.thread_names())
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    per = timeline_view.seconds_by_name(timeline_view.load_trace(path))
    assert per[1]["wait [wait]"] == pytest.approx(0.004) and per[0]["wait [wait]"] == pytest.approx(0.002)
    table = timeline_view.summary_table(timeline_view.load_trace(path))
    assert "| wait [wait] | 2.00 | 4.00 |" in table
    calls = timeline_view.per_call_table(timeline_view.load_trace(path), "oktopk")
    assert "| wait [wait] | 2.0 | 4.0 |" in calls and "| oktopk (the call) | 10.0 | 10.0 |" in calls
    assert main(["timeline", "plot", str(path), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 10_000
    cost = timeline_view.probe_cost(calls=50, repeats=1)      # runs both ways, leaves it off
    assert set(cost) == {f"{k}_{w}_s" for k in ("span", "in_mpi", "allreduce") for w in ("off", "on")}
    assert timeline.recorder is None
    with pytest.raises(ValueError, match="traceEvents"):
        (tmp_path / "bad.json").write_text("{}")
        timeline_view.load_trace(tmp_path / "bad.json")


@pytest.mark.horovod
def test_horovod_timeline_beside_horovods_own(tmp_path):
    """Horovod itself with one of our methods: Horovod writes its timeline to HOROVOD_TIMELINE,
    ours (every rank's exchange) goes beside it as <stem>.hvdc.json."""
    pytest.importorskip("horovod.torch")
    from horovod_compress.tools.testing import horovodrun_command
    for name in ("_report.py", "pytorch_synthetic_benchmark.py"):
        (tmp_path / name).write_text((Path(__file__).parent / "horovod_examples" / name).read_text())
    env = mpi_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   "HVD_EXAMPLE_OUT": str(tmp_path), "HOROVOD_TIMELINE": str(tmp_path / "t.json")})
    env.pop("HVDC_LAUNCHED", None)
    proc = subprocess.run([*horovodrun_command(2), sys.executable, str(tmp_path / "pytorch_synthetic_benchmark.py"),
                           "--compression", "topk"], capture_output=True, text=True, timeout=400, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "t.json").stat().st_size > 0            # Horovod's own
    spans = check_trace(json.loads((tmp_path / "t.hvdc.json").read_text()), 2)
    for rank in (0, 1):
        assert {"topk", "allgather", "agree", "topk.select"} <= {e["name"] for e in spans[rank]}


def test_step_spans_nest_when_a_gradient_is_missing():
    """A gradient never submitted is reduced as zeros inside finish(): 'gradients arriving' still
    ends with the last real gradient, before the wait, so the spans nest (P = 1, in process)."""
    from horovod_compress.mpi_collectives import Communicator
    from horovod_compress.runtime.buckets import TensorSpec
    from horovod_compress.runtime.engine import GradientExchange
    comm = Communicator()
    specs = [TensorSpec("a", (100,), "float32"), TensorSpec("b", (50,), "float32")]
    ex = GradientExchange(hvdc.Compression.topk(density=0.1), comm, specs, bucket_bytes=256,
                          overlap=False)
    rec = timeline.start()
    try:
        ex.submit("a", np.ones(100, np.float32))
        with timeline.span("synchronize", "step"):
            out = ex.finish()                  # "b" filled with zeros here
    finally:
        timeline.stop()
    assert np.allclose(out["b"], 0)
    origin = min(row[2] for row in rec.rows)
    spans = check_trace({"traceEvents": timeline.trace_events(0, rec.rows, origin)}, 1)[0]
    check_nesting(spans)
    arriving = [e for e in spans if e["name"] == "gradients arriving"]
    sync = [e for e in spans if e["name"] == "synchronize"][0]
    assert len(arriving) == 1 and arriving[0]["ts"] + arriving[0]["dur"] <= sync["ts"] + 0.01
