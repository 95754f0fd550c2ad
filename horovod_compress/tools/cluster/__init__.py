"""An emulated cluster with shaped links on one machine (network namespaces + tc tbf).

``hvdc cluster up --hosts 4 --bandwidth 1gbit``, ``hvdc cluster run -- mpirun -np 4 ...``,
``hvdc cluster down``; from Python::

    with EmulatedCluster(ClusterSpec(hosts=4, bandwidth="1gbit")) as cluster:
        cluster.run(["mpirun", "-np", "4", "python", "train.py"])

The context manager removes everything it built on exit, also after an
exception, Ctrl-C or SIGTERM. Tooling only: nothing in the library's core
imports this package.
"""
from __future__ import annotations

import signal
import subprocess
from dataclasses import replace
from types import FrameType
from typing import Any

from .launch import cluster_env, describe, in_host, threads_per_rank
from .netns import _shape, _write_state
from .netns import (ClusterError, ClusterSpec, ClusterUnavailable, down, load_spec, namespaces_of,
                    parse_rate, preflight, up)

__all__ = ["ClusterError", "ClusterSpec", "ClusterUnavailable", "EmulatedCluster", "cluster_env",
           "describe", "down", "in_host", "load_spec", "namespaces_of", "parse_rate", "preflight",
           "threads_per_rank", "up", "run_in_cluster"]


def run_in_cluster(spec: ClusterSpec, command: list[str], ranks: int | None = None,
                   env: dict[str, str] | None = None, timeout: float | None = None,
                   capture: bool = False) -> subprocess.CompletedProcess:
    """Run ``command`` inside host 0 of the (running) cluster ``spec`` with the cluster's MPI setup."""
    return subprocess.run(in_host(spec, command), env=cluster_env(spec, ranks, env), timeout=timeout,
                          capture_output=capture, text=capture)


class EmulatedCluster:
    """Context manager: ``up`` on enter, ``down`` on exit (also on error, Ctrl-C and SIGTERM)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._old_term: Any = None

    def __enter__(self) -> "EmulatedCluster":
        self._old_term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_term)
        try:
            up(self.spec)
        except BaseException:
            signal.signal(signal.SIGTERM, self._old_term)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            down(self.spec.name)
        finally:
            signal.signal(signal.SIGTERM, self._old_term)

    @staticmethod
    def _on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)   # unwinds through __exit__, which tears down

    def reshape(self, bandwidth: str) -> None:
        """Change every link's rate in place (same hosts, same addresses)."""
        self.spec = replace(self.spec, bandwidth=bandwidth)
        for i in range(self.spec.hosts):
            _shape(self.spec.host(i), "eth0", self.spec)
            _shape(self.spec.switch, f"p{i}", self.spec)
        _write_state(self.spec)

    def run(self, command: list[str], ranks: int | None = None, env: dict[str, str] | None = None,
            timeout: float | None = None, capture: bool = False) -> subprocess.CompletedProcess:
        """Run ``command`` inside host 0 with the cluster's MPI environment."""
        return run_in_cluster(self.spec, command, ranks, env, timeout, capture)

