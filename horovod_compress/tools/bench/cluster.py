"""``hvdc cluster up | run | status | down``: the emulated cluster from the command line.

    sudo hvdc cluster up --hosts 4 --bandwidth 1gbit
    sudo hvdc cluster run -- mpirun -np 4 python train.py     # inside host 0, MPI over the shaped links
    sudo hvdc cluster status
    sudo hvdc cluster down

``up`` is idempotent (an identical cluster is kept; a different one under the
same name is rebuilt) and removes what it built if any step fails. ``run``
needs a cluster that is up; ``--hosts/--bandwidth`` with ``--ephemeral``
builds one for the command and removes it afterwards, also when the command
fails or is interrupted. ``down`` kills what still runs in the namespaces and
deletes them. Needs root (network namespaces and tc); without it every verb
says what is missing and how to run without shaping.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from ..cluster import (ClusterError, ClusterSpec, EmulatedCluster, cluster_env, describe, down, in_host,
                       load_spec, namespaces_of, up)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="emulated cluster: hosts in network namespaces with shaped links",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--name", default="hvdc", help="cluster name (namespaces <name>-h0.., <name>-sw)")

    def shape(q: argparse.ArgumentParser) -> None:
        q.add_argument("--hosts", type=int, default=2, help="number of hosts (one namespace each)")
        q.add_argument("--bandwidth", default="1gbit", help="link rate per direction: 100mbit, 1gbit, 10gbit ...")
        q.add_argument("--delay", default=None, help="one-way delay per link end, e.g. 1ms (needs netem)")
        q.add_argument("--queue-latency", default="50ms", help="most a packet waits in the token bucket")
        q.add_argument("--subnet", default="10.213.0", help="first three octets of the hosts' /24")
        q.add_argument("--mtu", type=int, default=1500)

    q = verbs.add_parser("up", help="build the cluster (idempotent)")
    common(q)
    shape(q)
    q.set_defaults(func=cmd_up)
    q = verbs.add_parser("run", help="run a command inside host 0 with MPI pointed at the hosts")
    common(q)
    shape(q)
    q.add_argument("--ephemeral", action="store_true",
                   help="build the cluster for this command and remove it afterwards")
    q.add_argument("--ranks", type=int, default=None, help="ranks the command starts (for the thread share)")
    q.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    q.set_defaults(func=cmd_run)
    q = verbs.add_parser("status", help="show the cluster")
    common(q)
    q.set_defaults(func=cmd_status)
    q = verbs.add_parser("down", help="remove the cluster (idempotent)")
    common(q)
    q.set_defaults(func=cmd_down)


def _spec(args: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(hosts=args.hosts, bandwidth=args.bandwidth, name=args.name, subnet=args.subnet,
                       delay=args.delay, queue_latency=args.queue_latency, mtu=args.mtu)


def _fail(exc: ClusterError) -> int:
    print(f"hvdc cluster: {exc}", file=sys.stderr)
    return 3


def cmd_up(args: argparse.Namespace) -> int:
    try:
        spec = up(_spec(args))
    except ClusterError as exc:
        return _fail(exc)
    print(describe(spec, spec.hosts))
    print(f"run jobs with: hvdc cluster run --name {spec.name} -- mpirun -np {spec.hosts} python train.py")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("give the command after --, e.g. hvdc cluster run -- mpirun -np 2 python train.py")
    try:
        if args.ephemeral:
            with EmulatedCluster(_spec(args)) as cluster:
                return _run(cluster.spec, command, args.ranks)
        spec = load_spec(args.name)
        if spec is None:
            print(f"hvdc cluster: no cluster {args.name!r} is up; start one with `hvdc cluster up --name "
                  f"{args.name} --hosts N --bandwidth 1gbit`, or pass --ephemeral", file=sys.stderr)
            return 3
        return _run(spec, command, args.ranks)
    except ClusterError as exc:
        return _fail(exc)


def _run(spec: ClusterSpec, command: list[str], ranks: int | None) -> int:
    print(f"[hvdc cluster] {describe(spec, ranks or spec.hosts)}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(in_host(spec, command), env=cluster_env(spec, ranks))
    except KeyboardInterrupt:
        return 130


def cmd_status(args: argparse.Namespace) -> int:
    spec = load_spec(args.name)
    if spec is None:
        left = namespaces_of(args.name)
        print(f"cluster {args.name!r} is down" + (f" (stray namespaces: {left}; `hvdc cluster down` removes them)"
                                                  if left else ""))
        return 1
    print(describe(spec, spec.hosts))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    try:
        removed = down(args.name)
    except ClusterError as exc:
        return _fail(exc)
    print(f"removed {len(removed)} namespace(s) of cluster {args.name!r}" if removed
          else f"cluster {args.name!r} was not up")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m horovod_compress.tools.cluster")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
