"""The MPI test harness itself (``horovod_compress.tools.testing.run_cases``) on real ranks.

One failing or hanging case must fail only itself: the cases after it still
run (in a fresh ``mpirun``) and report their own results; and a failing case
that no test reads still fails the run (``horovod_compress.tools.testing_plugin``).
"""
from __future__ import annotations

import textwrap

import pytest

from horovod_compress.tools.testing import CaseFailed, find_cases, run_cases

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
    # each finished case's wall time on its slowest rank, and the imports of the three jobs
    assert set(res.seconds) == {"(import)", "case_first", "case_after_the_failure", "case_last"}
    assert all(secs >= 0 for secs in res.seconds.values()) and res.seconds["(import)"] > 0


INNER_TEST = textwrap.dedent('''
    import pytest
    from horovod_compress.tools.testing import run_cases

    CASES = {cases!r}

    @pytest.fixture(scope="module")
    def results():
        return run_cases(2, CASES, ["case_first", "case_fails_on_last_rank"], timeout=60)

    def test_reads_only_the_passing_case(results):
        assert results["case_first"] == {{0: 0, 1: 10}}

    def test_reads_the_failing_case(results):
        if {read_failure}:
            results["case_fails_on_last_rank"]
''')


def _inner_pytest(tmp_path, read_failure: bool):
    """A pytest session (with the plugin) over INNER_TEST: its exit code and output."""
    import subprocess
    import sys
    cases = tmp_path / "cases.py"
    cases.write_text(MODULE)
    (tmp_path / "test_inner.py").write_text(INNER_TEST.format(cases=str(cases), read_failure=read_failure))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "horovod_compress.tools.testing_plugin", "--rootdir", str(tmp_path),
                           str(tmp_path / "test_inner.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_an_unread_failing_case_fails_the_run(tmp_path):
    """Both tests pass (neither reads the failing case), yet the module errors at its last
    teardown with the case's traceback, and the tally counts the failure as unread."""
    code, out = _inner_pytest(tmp_path, read_failure=False)
    assert code == 1, out
    assert "2 passed, 1 error" in out, out
    assert "case_fails_on_last_rank failed and no test read it" in out, out
    assert "rank-specific failure in the case" in out, out
    assert "2 case runs in 1 launches: 1 read by a test, 1 checked only by their own " \
           "assertions; 1 failed, 1 of them unread" in out, out


@pytest.mark.timeout(300)
def test_a_read_failing_case_fails_only_its_reader(tmp_path):
    """The same failure read by a test: that test fails, once, and nothing else errors."""
    code, out = _inner_pytest(tmp_path, read_failure=True)
    assert code == 1, out
    assert "1 failed, 1 passed in" in out and "error" not in out.split("\n")[-2], out
    assert "no test read it" not in out, out
    assert "2 case runs in 1 launches: 2 read by a test, 0 checked only by their own " \
           "assertions; 1 failed, 0 of them unread" in out, out


def test_an_import_error_fails_every_case_once(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_module_anywhere\n\ndef case_a(comm):\n    pass\n\n"
                    "def case_b(comm):\n    pass\n")
    res = run_cases(2, path, timeout=60)
    for case in ("case_a", "case_b"):
        with pytest.raises(CaseFailed, match="not_a_module_anywhere"):
            res[case]


def test_mpi_env_drops_a_running_jobs_variables_and_keeps_user_settings(monkeypatch):
    from horovod_compress.tools.testing import mpi_env
    monkeypatch.setenv("PMIX_NAMESPACE", "singleton")
    monkeypatch.setenv("OMPI_MCA_ess", "singleton")
    monkeypatch.setenv("OMPI_MCA_orte_ess_num_procs", "1")
    monkeypatch.setenv("OMPI_MCA_btl", "self,vader")
    env = mpi_env()
    assert not {"PMIX_NAMESPACE", "OMPI_MCA_ess", "OMPI_MCA_orte_ess_num_procs"} & set(env)
    assert env["OMPI_MCA_btl"] == "self,vader"


@pytest.mark.timeout(120)
def test_a_process_that_made_a_one_rank_communicator_still_launches_mpirun():
    """Open MPI's singleton MPI_Init puts its job's variables into the C environment, which
    children inherit; mpirun started from there exited 1 with no output (seen when a test made a
    Communicator() in the pytest process before `hvdc bench e2e` ran)."""
    import subprocess
    import sys
    launcher = textwrap.dedent(r"""
        import re, subprocess, sys
        from horovod_compress.tools.testing import mpi_env, mpirun_command
        cmd = mpirun_command(2) + [sys.executable, "-c",
                                   "import sys; from mpi4py import MPI; "
                                   "sys.stdout.write(f'<{MPI.COMM_WORLD.Get_size()}>')"]
        proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=90)
        # one write per rank, no newline: two ranks' prints came out once as "22" and two newlines
        print(proc.returncode, sorted(re.findall(r"<(\d+)>", proc.stdout)))
    """)
    # a one-rank job (as pytest's own process after a Communicator()), then a launcher started
    # from it the plain way (inheriting the C environment), as a test starts `hvdc bench e2e`
    script = textwrap.dedent(f"""
        import subprocess, sys
        from mpi4py import MPI
        assert MPI.COMM_WORLD.Get_size() == 1
        proc = subprocess.run([sys.executable, "-c", {launcher!r}], capture_output=True, text=True,
                              timeout=100)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
    """)
    from horovod_compress.tools.testing import mpi_env
    proc = subprocess.run([sys.executable, "-c", script], env=mpi_env(), capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "0 ['2', '2']", proc.stdout


def test_a_broken_horovod_fails_unless_setup_skipped_it(monkeypatch, tmp_path):
    """A Horovod module that does not import fails the test; it skips only when the setup said
    it skipped building Horovod (its marker in the environment's prefix, or HVDC_SKIP_HOROVOD=1)."""
    import sys

    from horovod_compress.tools.testing import HOROVOD_SKIPPED_MARKER, horovod_build_skipped
    from horovod_compress.tools.testing_plugin import import_horovod
    monkeypatch.delenv("HVDC_SKIP_HOROVOD", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))          # an environment without the marker
    monkeypatch.setitem(sys.modules, "horovod.broken_plugin", None)   # import raises ImportError
    assert not horovod_build_skipped()
    with pytest.raises(pytest.fail.Exception, match="did not skip building Horovod"):
        import_horovod("horovod.broken_plugin")
    (tmp_path / HOROVOD_SKIPPED_MARKER).touch()                 # what setup.sh leaves behind
    assert horovod_build_skipped()
    with pytest.raises(pytest.skip.Exception, match="HVDC_SKIP_HOROVOD=1"):
        import_horovod("horovod.broken_plugin")
    (tmp_path / HOROVOD_SKIPPED_MARKER).unlink()
    monkeypatch.setenv("HVDC_SKIP_HOROVOD", "1")
    with pytest.raises(pytest.skip.Exception):
        import_horovod("horovod.broken_plugin")
