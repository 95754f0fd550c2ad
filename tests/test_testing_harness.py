"""The MPI test harness itself (``horovod_compress.testing.run_cases``) on real ranks.

One failing or hanging case must fail only itself: the cases after it still
run (in a fresh ``mpirun``) and report their own results.
"""
from __future__ import annotations

import textwrap

import pytest

from horovod_compress.testing import CaseFailed, find_cases, run_cases

pytestmark = pytest.mark.mpi

MODULE = textwrap.dedent('''
    import time

    def case_first(comm):
        return comm.rank * 10

    def case_fails_on_last_rank(comm):
        if comm.rank == comm.size - 1:
            raise ValueError("rank-specific failure in the case")
        comm.barrier()          # the other ranks wait here: the abort must free them
        return "unreachable"

    def case_after_the_failure(comm):
        return comm.size

    def case_hangs_on_rank_0(comm):
        if comm.rank == 0:
            time.sleep(600)
        comm.barrier()

    def case_last(comm):
        return "still ran"

    def helper_not_a_case(comm):
        raise AssertionError("never called")
''')


def test_cases_are_found_by_name_in_file_order(tmp_path):
    path = tmp_path / "cases.py"
    path.write_text(MODULE)
    assert find_cases(path) == ["case_first", "case_fails_on_last_rank", "case_after_the_failure",
                                "case_hangs_on_rank_0", "case_last"]


def test_a_failing_or_hanging_case_fails_alone(tmp_path):
    path = tmp_path / "cases.py"
    path.write_text(MODULE)
    res = run_cases(2, path, timeout=20)
    assert res["case_first"] == {0: 0, 1: 10}
    with pytest.raises(CaseFailed, match="rank-specific failure in the case"):
        res["case_fails_on_last_rank"]
    assert res["case_after_the_failure"] == {0: 2, 1: 2}
    with pytest.raises(CaseFailed, match="hung"):
        res["case_hangs_on_rank_0"]
    assert res["case_last"] == {0: "still ran", 1: "still ran"}
    assert set(res.failures) == {"case_fails_on_last_rank", "case_hangs_on_rank_0"}


def test_an_import_error_fails_every_case_once(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_module_anywhere\n\ndef case_a(comm):\n    pass\n\n"
                    "def case_b(comm):\n    pass\n")
    res = run_cases(2, path, timeout=60)
    for case in ("case_a", "case_b"):
        with pytest.raises(CaseFailed, match="not_a_module_anywhere"):
            res[case]
