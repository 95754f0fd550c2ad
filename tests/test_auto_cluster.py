"""``Compression.auto`` on the emulated cluster: a link re-shaped during the run changes the decision.

Two emulated hosts, one rank each, one bucket of 4 Mi values for 150 calls;
the links run at 1 Gbit, then 10 Gbit from call 51, then 1 Gbit again from
call 101 (the driver re-shapes them between two calls while the ranks wait
at a barrier: :mod:`horovod_compress.tools.bench.auto_link`). At 1 Gbit the
bucket's dense exchange takes about 130 ms and a compressor pays; at 10 Gbit
a tenth of that, and the compressors' own work no longer does. Real links,
real timings: the test asserts that a decision is taken again (reason
``link`` or ``drift``, re-checked on the slices or not) within 50 calls of each change, that the method running
50 calls after the change is the one it chose, and that every rank holds the
same decision log. Which method that decision chooses depends on what
compression costs on the machine against the links it can emulate: on the
2-core machine the 16-bit cast and Top-k (weighed by the steps it needs)
can be close at 1 Gbit, so the test does not require the method to change;
``benchmarks/auto_link_change.md`` shows a run where it changed both times,
and ``tests/test_auto.py`` checks the switch itself on timings it controls. Needs root and network namespaces (skipped,
with the cluster's reason, where they are not allowed).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from horovod_compress.tools.bench.auto_link import CHANGES, START, launch, rank_loop
from horovod_compress.tools.cluster import ClusterSpec, EmulatedCluster
from horovod_compress.tools.testing import read_case_results, worker_command
from horovod_compress.tools.testing_plugin import cluster_or_skip

#: Calls within which a change of the link must change the decision.
WITHIN = 50


def case_link_reshaped(comm):
    return rank_loop(comm, Path(os.environ["HVDC_AUTO_LINK_SYNC"]))


def _running_at(log: list[dict], call: int) -> str:
    """The method that ran call ``call``: the last decision taken at or before it."""
    return [d["chosen"] for d in log if d["step"] <= call][-1]


@pytest.mark.timeout(300)
def test_a_reshaped_link_changes_the_decision(tmp_path):
    name = f"a{os.getpid() % 100000}"
    cluster_or_skip(name)
    sync, out = tmp_path / "sync", tmp_path / "out"
    sync.mkdir()
    out.mkdir()
    with EmulatedCluster(ClusterSpec(hosts=2, bandwidth=START, name=name)) as cluster:
        cmd = ["mpirun", "-np", "2", "-x", "HVDC_AUTO_LINK_SYNC",
               *worker_command(__file__, out, [case_link_reshaped])]
        assert launch(cluster, cmd, sync, CHANGES, timeout=240) == 0
    results = read_case_results(out, 2)[case_link_reshaped]
    log = results[0]["log"]
    assert all(r["log"] == log for r in results.values()), "the ranks' decision logs differ"
    summary = [(d["step"], d["chosen"], d["reason"], round(d["predicted_ms"], 1), d["runner_up"],
                round(d["runner_up_ms"] or 0.0, 1)) for d in log]
    for change, link in CHANGES.items():
        again = [d for d in log if change < d["step"] <= change + WITHIN]
        assert again and again[0]["reason"].split(",")[0] in ("link", "drift"), \
            f"no decision taken again within {WITHIN} calls of the change to {link}: {summary}"
        assert _running_at(log, change + WITHIN) == again[-1]["chosen"]
