"""Running MPI jobs on the emulated cluster.

A command runs inside host 0's namespace with Open MPI pointed at the hosts
through environment variables (so a plain ``mpirun -np 4 python train.py``
works unchanged):

* ``orte_default_hostfile``: one line per host address with its slots;
* ``plm_rsh_agent``: a script standing in for ssh -- it runs the remote
  daemon under ``ip netns exec`` of the namespace that owns the address;
* ``btl=tcp,self``, one TCP connection per peer pair (full duplex), and ``btl_tcp_if_include``/``oob_tcp_if_include`` = the
  cluster's subnet, so every byte between ranks crosses the shaped links
  (no shared-memory transport between hosts);
* allreduce by the bandwidth-optimal ring from 64 KiB on (``launch_files.ALLREDUCE_RULES``),
  the algorithm the volume model assumes and a cluster-tuned MPI picks;
* no process binding (Open MPI would pin every rank of a P = 2 job to core
  0, since each emulated host looks like its own node);
* one share of the machine's cores per rank: ``OMP_NUM_THREADS``,
  ``NUMBA_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` (torch
  reads ``OMP_NUM_THREADS``), since oversubscribed thread pools distort every
  timing.
"""
from __future__ import annotations

import os

from ..testing import launcher_free_environ
from .launch_files import AGENT, COLL_RULES, HOSTFILE
from .netns import ClusterSpec, state_dir

def threads_per_rank(ranks: int, cores: int | None = None) -> int:
    """Each rank's share of the machine's cores (at least one)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, ranks))


def cluster_env(spec: ClusterSpec, ranks: int | None = None,
                base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes ``mpirun`` inside host 0 use the cluster's hosts and links."""
    d = state_dir(spec.name)
    env = dict(launcher_free_environ() if base is None else base)
    threads = str(threads_per_rank(ranks or spec.hosts))
    env.update({
        "OMPI_MCA_plm_rsh_agent": str(d / AGENT),
        "OMPI_MCA_orte_default_hostfile": str(d / HOSTFILE),
        "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
        "OMPI_MCA_btl": "tcp,self",
        # One TCP connection per peer pair (Open MPI's default). Two
        # (btl_tcp_links=2) once measured a higher ring-shift rate, but Open
        # MPI 4.x's multi-link TCP has known hangs (open-mpi/ompi#8498,
        # #4795) and a whole-suite e2e run hung twice in an Allgatherv at
        # P = 4 with it; with one link the probes reach 0.92 of 1 Gbit for
        # point to point and allreduce. Set OMPI_MCA_btl_tcp_links to override.
        "OMPI_MCA_btl_tcp_links": env.get("OMPI_MCA_btl_tcp_links", "1"),
        "OMPI_MCA_btl_tcp_if_include": spec.cidr,
        "OMPI_MCA_oob_tcp_if_include": spec.cidr,
        "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
        "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(d / COLL_RULES),
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        # No binding. Every emulated host is a separate node to Open MPI, and
        # with np <= 2 it binds each rank to core 0 *of its node*: both ranks
        # of a P = 2 run landed on the same physical core (the other idle),
        # which halved the links' measured rate (0.48 of 1 Gbit point to
        # point, 0.05 of 100 Mbit) and stretched every rank's compute 2x.
        # Unbound (as np > 2 already is on one NUMA node), the same probe
        # carries 0.96 and 0.095. Set OMPI_MCA_hwloc_base_binding_policy to override.
        "OMPI_MCA_hwloc_base_binding_policy": env.get("OMPI_MCA_hwloc_base_binding_policy", "none"),
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "HVDC_CLUSTER": spec.name,
        "HVDC_CLUSTER_BANDWIDTH": spec.bandwidth,
    })
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, threads)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def in_host(spec: ClusterSpec, command: list[str], host: int = 0) -> list[str]:
    """``command`` prefixed to run inside host ``host``'s namespace."""
    if not command:
        raise ValueError("no command to run (give it after --)")
    return ["ip", "netns", "exec", spec.host(host), *command]


def describe(spec: ClusterSpec, ranks: int) -> str:
    """One line on where a job runs and with how many threads per rank."""
    t = threads_per_rank(ranks)
    return (f"emulated cluster {spec.name!r}: {spec.hosts} hosts {spec.address(0)}..{spec.address(spec.hosts - 1)}, "
            f"links {spec.bandwidth} full duplex via a bridge"
            f"{', delay ' + spec.delay if spec.delay else ''}; {ranks} rank(s), "
            f"{t} thread(s) per rank (OMP/Numba/BLAS/torch) on {threads_per_rank(1)} core(s)")
