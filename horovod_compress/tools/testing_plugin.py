"""pytest plugin: no MPI case that ran may fail unseen, and the run ends with a tally of them.

:func:`~horovod_compress.tools.testing.run_cases` records a failing case and raises only when a test
reads it; a case that no test reads would fail silently. This plugin closes that gap:

* :func:`every_failed_case_is_read` (autouse, once per test module) looks, when the module's
  tests are done, at every :class:`~horovod_compress.tools.testing.CaseResults` made during the module
  and fails the module's last test (an error at its teardown) with the tracebacks of each case
  that failed and that no test read;
* :func:`pytest_terminal_summary` prints, at the end of the run, how many case runs the suite made
  (one case on one world size), how many a test read, how many failed and how many of those
  no test read (0 in a healthy run; non-zero ones also failed a test above).

``tests/conftest.py`` imports both; another suite can load the plugin with
``-p horovod_compress.tools.testing_plugin``. :func:`cluster_or_skip` is the skip every test
of the emulated cluster starts with.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from .cluster import ClusterUnavailable, preflight
from .testing import CASE_LEDGER, CaseResults, horovod_build_skipped


def cluster_or_skip(name: str) -> None:
    """Skip the calling test, with the reason :func:`~horovod_compress.tools.cluster.preflight`
    gives, where network namespaces or ``tc`` shaping are not available (no root, no iproute2)."""
    try:
        preflight(name)
    except ClusterUnavailable as exc:
        pytest.skip(f"emulated cluster unavailable here: {exc}")


def unread_failure_report(results: list[CaseResults]) -> str:
    """The failed, unread cases of ``results`` with their tracebacks ("" when there are none)."""
    parts = [f"=== {r.module} at P = {r.nprocs}: {name} failed and no test read it ===\n{text}"
             for r in results for name, text in r.unread_failures().items()]
    return "\n".join(parts)


def ledger_tally(results: list[CaseResults]) -> dict[str, int]:
    """The sum of :meth:`CaseResults.tally` over ``results``, plus ``launches`` (their number)."""
    total = {"launches": len(results), "ran": 0, "read": 0, "failed": 0, "failed_unread": 0}
    for r in results:
        for key, count in r.tally().items():
            total[key] += count
    return total


@pytest.fixture(autouse=True, scope="module")
def every_failed_case_is_read() -> Iterator[None]:
    """Fail the module (at its last test's teardown) if a case it ran failed and no test read it."""
    start = len(CASE_LEDGER)
    yield
    report = unread_failure_report(CASE_LEDGER[start:])
    if report:
        pytest.fail("MPI cases failed and no test read them:\n" + report, pytrace=False)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line at the end of the run: the case runs of :func:`run_cases` and how they ended."""
    t = ledger_tally(CASE_LEDGER)
    if not t["launches"]:
        return
    terminalreporter.write_sep("-", "MPI cases (horovod_compress.tools.testing)")
    terminalreporter.write_line(
        f"{t['ran']} case runs in {t['launches']} launches: {t['read']} read by a test, "
        f"{t['ran'] - t['read']} checked only by their own assertions; {t['failed']} failed, "
        f"{t['failed_unread']} of them unread")


def import_horovod(module: str = "horovod.tensorflow") -> Any:
    """``module`` of Horovod, imported; a skip only when the setup skipped building Horovod.

    When :func:`~horovod_compress.tools.testing.horovod_build_skipped` says the environment was set
    up without Horovod on purpose, a failed import skips the test with its reason; otherwise it
    fails the test: a broken build (Horovod's TensorFlow plugin not loading) must not turn into
    a green run with skips."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - ImportError or the plugin's own load error
        if horovod_build_skipped():
            pytest.skip(f"{module} not built (scripts/setup.sh ran with HVDC_SKIP_HOROVOD=1): {exc!r}",
                        allow_module_level=True)
        pytest.fail(f"import {module} failed and scripts/setup.sh did not skip building Horovod "
                    f"(a broken build; rerun scripts/setup.sh, or set HVDC_SKIP_HOROVOD=1): {exc!r}",
                    pytrace=False)


#: Mark (or ``pytestmark`` entry) for tests that need Horovod built: they skip only when the setup
#: skipped building it on purpose (:func:`~horovod_compress.tools.testing.horovod_build_skipped`), and
#: otherwise run, so a missing or broken Horovod fails them.
needs_horovod = pytest.mark.skipif(
    horovod_build_skipped(),
    reason="Horovod not built: scripts/setup.sh ran with HVDC_SKIP_HOROVOD=1")
