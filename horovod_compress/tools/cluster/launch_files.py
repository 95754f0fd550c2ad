"""The files that point Open MPI at an emulated cluster's hosts: the ssh stand-in, the hostfile,
the collective rules (written by :func:`~.netns.up`, read through :func:`~.launch.cluster_env`)."""
from __future__ import annotations

import stat
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # a type only: netns writes these files while it builds the cluster
    from .netns import ClusterSpec

AGENT = "agent.sh"
HOSTFILE = "hostfile"
COLL_RULES = "coll_rules.conf"

#: Open MPI's tuned-collective rules: allreduce (collective id 2) by recursive
#: doubling (algorithm 3) below 64 KiB and by the bandwidth-optimal ring
#: (algorithm 4) from 64 KiB on, for every communicator size >= 2. Measured on
#: this testbed (4 hosts, 1 Gbit, 16 MiB): ring 0.25-0.29 s, Open MPI 4.1's
#: default choice 0.39-0.42 s, the ring's volume bound 0.20 s.
ALLREDUCE_RULES = """1
2
1
2
2
0 3 0 0
65536 4 0 0
"""


def write_launch_files(spec: ClusterSpec, directory: Path, slots: int = 1) -> None:
    """Write the ssh stand-in and the hostfile for ``spec`` into ``directory``."""
    cases = "\n".join(f"  {spec.address(i)}) ns={spec.host(i)} ;;" for i in range(spec.hosts))
    agent = f"""#!/bin/sh
# ssh stand-in for Open MPI on the emulated cluster {spec.name!r}:
#   agent.sh [ssh options] HOST COMMAND...  ->  ip netns exec <namespace of HOST> sh -c COMMAND
while [ $# -gt 0 ]; do
  case "$1" in
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
case "$host" in
{cases}
  *) echo "agent.sh: $host is not a host of cluster {spec.name}" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" /bin/sh -c "$*"
"""
    path = directory / AGENT
    path.write_text(agent)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    (directory / COLL_RULES).write_text(ALLREDUCE_RULES)
    (directory / HOSTFILE).write_text(
        "".join(f"{spec.address(i)} slots={slots}\n" for i in range(spec.hosts)))
