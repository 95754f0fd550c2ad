"""An emulated cluster on one machine: network namespaces, a bridge, shaped veth links.

Topology (a star, like hosts on one switch)::

    <name>-h0 [eth0 10.213.0.1] ==veth== [p0]
    <name>-h1 [eth0 10.213.0.2] ==veth== [p1]   <name>-sw: bridge br0 over p0..p{N-1}
    ...

Each host is a network namespace with its own loopback and one interface;
the switch is a namespace holding a Linux bridge. Every link is shaped in
both directions with a token bucket filter (``tc qdisc ... tbf``): the host's
egress on ``eth0`` and the switch's egress towards the host on ``p<i>``, so
each host has a full-duplex link of the given rate, as a NIC on a switch port.

Nothing outside the namespaces is touched: interfaces are created directly
inside them (``ip -n NS link add ... peer ... netns SW``) and addresses exist
only there. ``down`` kills the processes still running inside the
namespaces and deletes them, which removes the links with them.

A propagation delay needs the ``netem`` qdisc; where the kernel lacks it
(``Specified qdisc kind is unknown``), a ``delay`` is refused with that reason
and links have the veth latency (tens of microseconds) plus queueing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...units import parse_duration, parse_rate
from .launch_files import write_launch_files

STATE_ROOT = Path(os.environ.get("HVDC_CLUSTER_STATE", "/run/hvdc-cluster"))

_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built, used or removed; the message says why."""


class ClusterUnavailable(ClusterError):
    """This machine does not allow network namespaces or traffic shaping."""


@dataclass(frozen=True)
class ClusterSpec:
    """What ``up`` builds: ``hosts`` namespaces on one bridge, each link shaped to ``bandwidth``.

    ``delay`` (e.g. ``'1ms'``) adds a one-way propagation delay per link end
    with ``netem`` where the kernel has it; ``queue_latency`` bounds the time a
    packet may wait in the token bucket (tbf's ``latency``); ``subnet`` is the
    first three octets of the /24 the hosts get, inside the namespaces only.
    """

    hosts: int = 2
    bandwidth: str = "1gbit"
    name: str = "hvdc"
    subnet: str = "10.213.0"
    delay: str | None = None
    queue_latency: str = "50ms"
    mtu: int = 1500

    def __post_init__(self) -> None:
        if not isinstance(self.hosts, int) or not 1 <= self.hosts <= 64:
            raise ValueError(f"hosts must be an integer in [1, 64], got {self.hosts!r}")
        parse_rate(self.bandwidth)
        parse_duration(self.queue_latency)
        if self.delay is not None:
            parse_duration(self.delay)
        if not _NAME.match(self.name):
            raise ValueError(f"cluster name must be 1-12 lowercase letters/digits starting with a letter, "
                             f"got {self.name!r}")
        octets = self.subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ValueError(f"subnet must be three octets like 10.213.0, got {self.subnet!r}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be in [576, 65535], got {self.mtu}")

    @property
    def rate_bits(self) -> float:
        return parse_rate(self.bandwidth)

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    def host(self, i: int) -> str:
        """Name of host ``i``'s network namespace (``<name>-h<i>``)."""
        return f"{self.name}-h{i}"

    def address(self, i: int) -> str:
        """IPv4 address of host ``i`` inside the cluster's /24 subnet."""
        return f"{self.subnet}.{i + 1}"

    @property
    def cidr(self) -> str:
        return f"{self.subnet}.0/24"

    @property
    def namespaces(self) -> list[str]:
        return [self.host(i) for i in range(self.hosts)] + [self.switch]

    def burst_bytes(self) -> int:
        """Token bucket size: at least 256 KiB and one millisecond at the rate (tbf needs >= rate/HZ)."""
        return int(max(256 * 1024, self.rate_bits / 8 * 1e-3, 2 * self.mtu))


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def existing_namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def preflight(name: str = "hvdc") -> None:
    """Raise :class:`ClusterUnavailable` naming what is missing, unless namespaces and tbf work."""
    how = ("run the benchmark without shaping (shared memory: `hvdc bench e2e --no-cluster`) "
           "or on a real cluster with mpirun/srun")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        raise ClusterUnavailable(f"the emulated cluster needs root (CAP_NET_ADMIN) to create network "
                                 f"namespaces; run as root, or {how}")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"`{tool}` is missing (Debian package {pkg}: "
                                     f"apt-get install -y {pkg}); or {how}")
    probe = f"{name}-probe"
    _run(["ip", "netns", "del", probe], check=False)
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        raise ClusterUnavailable(f"network namespaces are not allowed here ({made.stderr.strip()}); {how}")
    try:
        _run(["ip", "-n", probe, "link", "set", "lo", "up"])
        tbf = _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit",
                    "burst", "256kb", "latency", "50ms"], check=False)
        if tbf.returncode != 0:
            raise ClusterUnavailable(f"traffic shaping (tc tbf) is not allowed here "
                                     f"({tbf.stderr.strip()}); {how}")
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (needed for a propagation delay)."""
    probe = "hvdc-netem-probe"
    if _run(["ip", "netns", "add", probe], check=False).returncode != 0:
        return False
    try:
        _run(["ip", "-n", probe, "link", "set", "lo", "up"], check=False)
        return _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                    check=False).returncode == 0
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def _shape(ns: str, dev: str, spec: ClusterSpec) -> None:
    tbf = ["tbf", "rate", spec.bandwidth, "burst", str(spec.burst_bytes()), "latency", spec.queue_latency]
    if spec.delay is None:
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf])
    else:   # netem delay at the root, the token bucket below it
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem",
              "delay", spec.delay])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])


def state_dir(name: str) -> Path:
    """Folder that holds the state files of the cluster called ``name``."""
    return STATE_ROOT / name


def load_spec(name: str) -> ClusterSpec | None:
    """The spec of the cluster ``name`` that is up, or None."""
    path = state_dir(name) / "spec.json"
    if not path.exists():
        return None
    spec = ClusterSpec(**json.loads(path.read_text()))
    if not all(ns in existing_namespaces() for ns in spec.namespaces):
        return None
    return spec


def up(spec: ClusterSpec) -> ClusterSpec:
    """Build the cluster (idempotent: an identical cluster that is up is kept).

    A different cluster under the same name is removed first. If any step
    fails, everything built so far is removed before the error propagates.
    """
    current = load_spec(spec.name)
    if current == spec:
        return spec
    busy = processes_in(spec.name)
    if busy:
        raise ClusterError(
            f"cluster {spec.name!r} is up with other settings and in use (pids {busy[:8]}); rebuilding it would cut "
            f"those jobs off their links. Wait for them, run `hvdc cluster down --name {spec.name}`, or pick "
            f"another --name")
    preflight(spec.name)
    if spec.delay is not None and not netem_available():
        raise ClusterUnavailable(
            f"a propagation delay ({spec.delay}) needs the netem qdisc, which this kernel lacks "
            "(`tc qdisc add ... netem`: 'Specified qdisc kind is unknown'); leave out --delay: links then "
            "have the veth latency, and the alpha-beta model uses the latency measured on them")
    down(spec.name)
    try:
        sw = spec.switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i in range(spec.hosts):
            h, port = spec.host(i), f"p{i}"
            _run(["ip", "netns", "add", h])
            _run(["ip", "-n", h, "link", "set", "lo", "up"])
            _run(["ip", "-n", h, "link", "add", "eth0", "mtu", str(spec.mtu), "type", "veth",
                  "peer", "name", port, "mtu", str(spec.mtu), "netns", sw])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", h, "addr", "add", f"{spec.address(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", h, "link", "set", "eth0", "up"])
            _shape(h, "eth0", spec)
            _shape(sw, port, spec)
        _write_state(spec)
        _wait_reachable(spec)
    except BaseException:
        down(spec.name)
        raise
    return spec


def _wait_reachable(spec: ClusterSpec, timeout: float = 10.0) -> None:
    """Wait until host 0 reaches every other host (the bridge learns addresses at once,
    but a port may take a moment to come up)."""
    deadline = time.monotonic() + timeout
    for i in range(1, spec.hosts):
        while True:
            ok = _run(["ip", "netns", "exec", spec.host(0), "ping", "-c", "1", "-W", "1", spec.address(i)],
                      check=False).returncode == 0 if shutil.which("ping") else True
            if ok:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"host {spec.address(i)} is not reachable from {spec.address(0)} "
                                   f"after {timeout:.0f} s")
            time.sleep(0.2)


def _write_state(spec: ClusterSpec) -> None:
    d = state_dir(spec.name)
    d.mkdir(parents=True, exist_ok=True)
    write_launch_files(spec, d)
    (d / "spec.json").write_text(json.dumps(asdict(spec), indent=1))


def namespaces_of(name: str) -> list[str]:
    """The namespaces that belong to cluster ``name`` (whatever its host count was)."""
    pattern = re.compile(rf"^{re.escape(name)}-(sw|h\d+)$")
    return [ns for ns in existing_namespaces() if pattern.match(ns)]


def processes_in(name: str) -> list[int]:
    """Pids of the processes running inside cluster ``name``'s namespaces."""
    pids: list[int] = []
    for ns in namespaces_of(name):
        pids += [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
    return pids


def down(name: str = "hvdc") -> list[str]:
    """Remove cluster ``name``: kill its processes, delete its namespaces and state. Idempotent.

    Returns the namespaces that were removed.
    """
    removed = namespaces_of(name)
    for ns in removed:
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in removed:
        _run(["ip", "netns", "del", ns], check=False)
    left = namespaces_of(name)
    if left:
        raise ClusterError(f"could not remove namespaces {left}; try `ip netns del NAME` as root")
    shutil.rmtree(state_dir(name), ignore_errors=True)
    return removed
