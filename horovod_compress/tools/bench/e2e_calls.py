"""The size of every collective call a method issues in one training step, for the e2e model.

The alpha-beta model needs, per call, how many bytes it moves: the number of
latency rounds of the algorithm MPI runs depends on the message size (Open
MPI's recursive doubling below 64 KiB, the ring from there on, as the
emulated cluster configures it), and a shaped link's token bucket lets a
small message through at wire speed (see :mod:`horovod_compress.cost_model`).
``hvdc bench e2e`` records only each operation's totals, so this module runs
one training step per method on shared memory -- the byte counts are those of
the Communicator's volume model and do not depend on the link -- and logs every
call. Nothing here is timed. An allreduce that a method runs as the pipelined
point-to-point ring of ``reduce_ops`` is logged under the op ``ring``
(:class:`RingTransport`), the transport the model prices it at.

    mpirun -np 4 python -m horovod_compress.tools.bench.e2e_calls --model transformer --json out.json

:func:`record` runs it for several P and merges the result into one JSON file
``{"<model>": {"<P>": {"<method label>": {"<op>": [bytes per call, ...],
"<op>@gap_s": [CPU seconds of work before each call, ...], "<op>@rest_s": [...]}}}}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import contextlib
import inspect
import time
from pathlib import Path
from typing import Any, Callable, Iterator

#: The op name under which the model prices an allreduce run as a pipelined p2p ring
#: (:data:`horovod_compress.cost_model.RING`).
RING_OP = "ring"
#: The pipelined rings of ``mpi_collectives.reduce_ops``: allreduces accounted as such whose bytes
#: cross the links as eager point-to-point segments (Global-QSGD's 8-bit codes, the 16-bit casts).
RING_FUNCTIONS = ("ring_reduce_once", "ring_reduce_once_items")
_CALLBACKS = ("produce", "reduce", "consume")
#: The op under which ``mpi_collectives.consistency`` times every call's 1-byte agreement (not counted as a call)
AGREE_OP = "agree"
#: Key suffix of the per-call CPU gaps beside an op's per-call sizes (``"allreduce@gap_s"``).
GAP_SUFFIX = "@gap_s"
#: Key suffix of the CPU work since the previous call itself, agreements included (``"allreduce@rest_s"``)
REST_SUFFIX = "@rest_s"
#: Samples of each link probe in a run of ``hvdc bench e2e``, spread over its probe passes
#: (the launcher's and the worker's ``--probe-repeats`` default).
PROBE_REPEATS = 6


class RingTransport:
    """Which allreduce bytes the pipelined point-to-point ring carried, and the work it overlapped.

    While :meth:`installed`, the ring functions of ``reduce_ops`` (the methods
    import them at call time) are wrapped: each call adds its calls and bytes
    (the allreduce accounting it does itself, unchanged) to :attr:`calls`,
    :attr:`sent`, :attr:`received`, and the wall time of the caller's
    ``produce``/``reduce``/``consume`` callbacks -- the work the ring runs
    between its progress calls while segments are on the wire -- to
    :attr:`work_s` (and its thread CPU time to :attr:`work_cpu_s`). :attr:`inside` is
    true during a ring call (for a per-call log).
    Byte totals per op are not changed: the model splits them
    (``hvdc bench e2e``'s ``profile_of``).
    """

    def __init__(self) -> None:
        self.inside = 0
        self.reset()

    def reset(self) -> None:
        self.calls, self.sent, self.received, self.work_s, self.work_cpu_s = 0, 0.0, 0.0, 0.0, 0.0

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "sent": self.sent, "received": self.received, "work_s": self.work_s,
                "work_cpu_s": self.work_cpu_s}

    def _timed(self, fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
        if fn is None:
            return None

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.work_s += time.perf_counter() - t0
                self.work_cpu_s += time.thread_time() - c0
        return timed

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        def wrapped(comm: Any, *args: Any, **kwargs: Any) -> Any:
            if self.inside:     # one ring function calling the other: the outer call counts
                return fn(comm, *args, **kwargs)
            bound = sig.bind(comm, *args, **kwargs)
            for name in _CALLBACKS:
                if name in bound.arguments:
                    bound.arguments[name] = self._timed(bound.arguments[name])
            before = comm.stats()["by_op"].get("allreduce", {})
            self.inside += 1
            try:
                return fn(*bound.args, **bound.kwargs)
            finally:
                self.inside -= 1
                after = comm.stats()["by_op"].get("allreduce", {})
                self.calls += after.get("calls", 0) - before.get("calls", 0)
                self.sent += after.get("sent", 0.0) - before.get("sent", 0.0)
                self.received += after.get("received", 0.0) - before.get("received", 0.0)
        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    @contextlib.contextmanager
    def installed(self) -> Iterator["RingTransport"]:
        """Wrap the ring functions for the enclosed code (restored after)."""
        from ...mpi_collectives import reduce_ops
        saved = {n: getattr(reduce_ops, n) for n in RING_FUNCTIONS if hasattr(reduce_ops, n)}
        for n, fn in saved.items():
            setattr(reduce_ops, n, self._wrap(fn))
        try:
            yield self
        finally:
            for n, fn in saved.items():
                setattr(reduce_ops, n, fn)


#: Training steps run per method before the logged one: ``hvdc bench e2e``'s default untimed steps
#: (3), so the logged step is one it times (Ok-Topk's thresholds and GreedyLore's subspace settle
#: over the first steps, and with them the bytes and calls of a step)
RECORD_STEPS = 4


def split_specs(spec: str) -> list[str]:
    """Comma-separated items, stripped, empty ones dropped; commas inside ``{...}`` parameters do not split."""
    out, depth, cur = [], 0, ""
    for ch in spec:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [item.strip() for item in out if item.strip()]


def parse_spec(spec: str) -> tuple[str, dict[str, Any], str]:
    """One ``--methods`` item (``name`` or ``name:{json}``) as (name, parameters, the report's
    label ``name`` or ``name(k=v,...)``)."""
    name, _, raw = spec.partition(":")
    params = json.loads(raw) if raw else {}
    return name, params, name if not params else f"{name}({','.join(f'{k}={v}' for k, v in params.items())})"


def call_sizes(methods: list[str], model_name: str, comm: Any,
               steps: int = RECORD_STEPS) -> dict[str, dict[str, list[float]]]:
    """``{label: {op: [max(sent, received) of each call], op + GAP_SUFFIX: [CPU s before each call],
    op + REST_SUFFIX: [CPU s since the previous call]}}`` of the last of ``steps`` training steps.

    The gap before a call is this rank's CPU time outside MPI since the
    previous call returned: the method's own work between its calls, which
    decides how long a call waits for peers when ranks share cores
    (``cost_model.Network.call_wait``). CPU time, so the recording on an
    oversubscribed machine is not stretched by the core share; the process's
    (``time.process_time``), so the work of a matrix method's lockstep
    workers between two fused calls counts.

    Every ``Method.allreduce`` starts with a 1-byte agreement allgather
    (``mpi_collectives.consistency``, timed under the op ``agree`` and reported as the
    step's *wait*, not as its comm): the ranks meet there, so the clock
    restarts when it returns, and the gap of a bucket's first call is only the
    method's work between the agreement and that call. The forward and
    backward pass before it (0.2-0.3 s of CPU on the Transformer here, over
    which the ranks drift apart) is waited out in the agreement, measured apart.
    The links, though, rest from one call to the next, agreement or not: the
    *rest* before a call is the CPU work since the previous call itself (the
    time a shaped link's token bucket refills, ``cost_model.predict``).

    A matrix method's group of tensors goes out fused
    (``runtime.per_tensor``): one collective per round carries every tensor's
    call, and the communicator then accounts each original call apart
    (``_account_as``). The log keeps what crossed the wire: the fused call once,
    at its whole size, and none of its parts.
    """
    import torch

    from ...compressors.registry import create
    from ...torch.optimizer import DistributedOptimizer
    from .e2e_models import build_model, synthetic_batch
    log: list[tuple[str, float, float, float]] = []
    inner = comm._account
    ring = RingTransport()
    clock = [0.0, 0.0]      # the process's CPU time and its CPU time inside MPI when the ranks last met
    rest_clock = [0.0, 0.0]  # the same at the last call (not restarted by an agreement)

    def restart_clock(agreement: bool = False) -> None:
        clock[:] = [time.process_time(), comm.timings()["cpu_total"]]
        if not agreement:
            rest_clock[:] = clock

    parts = [0]   # inside _account_as: one original call of a fused collective, logged with it

    def account(op: str, sent: float, received: float) -> None:
        if parts[0]:
            inner(op, sent, received)
            return
        # CPU work outside MPI since the previous call (a call is counted after it returns)
        cpu, in_mpi = time.process_time(), comm.timings()["cpu_total"]
        gap = max(0.0, (cpu - clock[0]) - (in_mpi - clock[1]))
        rest = max(0.0, (cpu - rest_clock[0]) - (in_mpi - rest_clock[1]))
        clock[:] = rest_clock[:] = [cpu, in_mpi]
        # an allreduce the pipelined ring carried is logged under the ring's op (the model's RING)
        log.append((RING_OP if op == "allreduce" and ring.inside else op, max(sent, received), gap, rest))
        inner(op, sent, received)
    comm._account = account
    plain_account_as = getattr(comm, "_account_as", None)

    def account_part(phase: Any, op: str, sent: float, received: float) -> None:
        parts[0] += 1
        try:
            plain_account_as(phase, op, sent, received)
        finally:
            parts[0] -= 1
    if plain_account_as is not None:
        comm._account_as = account_part
    plain_in_mpi = comm.in_mpi

    @contextlib.contextmanager
    def restarting_after_agreement(op: str, **where: Any) -> Iterator[None]:
        with plain_in_mpi(op, **where):
            yield
        if op == AGREE_OP:      # the ranks just met: the next call's wait is for work since here
            restart_clock(agreement=True)
    comm.in_mpi = restarting_after_agreement
    out: dict[str, dict[str, list[float]]] = {}
    stack = contextlib.ExitStack()
    stack.enter_context(ring.installed())
    try:
        for spec in methods:
            name, params, label = parse_spec(spec)
            method = create(name, **params)
            if getattr(method, "warmup_steps", 0) and "warmup_steps" not in params:
                method = create(name, **{**params, "warmup_steps": 0})   # as hvdc bench e2e times it
            torch.manual_seed(0)
            model = build_model(model_name)
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters(), compression=method,
                                       overlap=False, comm=comm)
            for step in range(steps):
                log.clear()
                x, y = synthetic_batch(model_name, comm.rank, step)
                opt.zero_grad()
                model.loss(x, y).backward()
                restart_clock()         # a call before any agreement counts its work from here
                opt.step()
            opt.close()
            calls: dict[str, list[float]] = {}
            for op, nbytes, gap, rest in log:
                calls.setdefault(op, []).append(float(nbytes))
                calls.setdefault(op + GAP_SUFFIX, []).append(float(gap))
                calls.setdefault(op + REST_SUFFIX, []).append(float(rest))
            out[label] = calls
    finally:
        comm._account = inner
        if plain_account_as is not None:
            del comm._account_as
        del comm.in_mpi
        stack.close()
    return out


def record(world_sizes: list[int], methods: list[str], model_name: str, path: Path,
           timeout: float = 1200) -> dict[str, Any]:
    """Run :func:`call_sizes` at each P on shared memory (mpirun) and merge into ``path``."""
    import tempfile

    from ..testing import mpi_env, mpirun_command
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    for p in world_sizes:
        with tempfile.TemporaryDirectory(prefix="hvdc-calls-") as tmp:
            out = os.path.join(tmp, "calls.json")
            cmd = mpirun_command(p) + [sys.executable, "-m", "horovod_compress.tools.bench.e2e_calls",
                                       "--methods", ",".join(methods), "--model", model_name, "--json", out]
            proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"recording call sizes at P={p} failed (exit {proc.returncode}):\n"
                                   f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            data.setdefault(model_name, {}).setdefault(str(p), {}).update(json.loads(Path(out).read_text()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return data


def main(argv: list[str] | None = None) -> None:
    """One rank: log the calls of every method, rank 0 writes ``--json``."""
    parser = argparse.ArgumentParser(description="per-call message sizes of every method (one rank)")
    parser.add_argument("--methods", required=True, help="comma-separated; name or name:json-params")
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from ...mpi_collectives import Communicator
    comm = Communicator()
    result = call_sizes(split_specs(args.methods), args.model, comm)
    if comm.rank == 0:
        Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
