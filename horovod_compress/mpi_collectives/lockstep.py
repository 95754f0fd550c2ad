"""Run several per-tensor compressed allreduces in lockstep and fuse their collectives.

A matrix method (PowerSGD, GreedyLore, ARC-Top-K, ...) runs once per tensor,
and each run issues a few small collectives: the 1-byte consistency
allgather, then one or two allreduces. A DDP bucket holds many tensors, so
run one after the other they cost a latency per collective per tensor, where
PyTorch's ``powerSGD_hook`` allreduces all of a bucket's ``P`` matrices (and
its ``Q``s, and its uncompressed tensors) in one call each ("PowerSGD:
Practical Low-Rank Gradient Compression for Distributed Optimization",
Vogels et al., NeurIPS 2019, Section 4: "we pack all the P matrices of
the layers into one buffer").

:class:`Lockstep` gets that batching for every method without touching its
code: each tensor's ``method.allreduce`` runs as its own coroutine against a
proxy communicator; they run one at a time, in tensor order, each
until its next collective (so every Python-side effect -- random draws,
state updates -- happens in the same order as a sequential run), and when
every unfinished thread has posted a collective the round is executed:

* allreduces with the same elementwise operator and dtype are concatenated
  into one (``avg`` is a ``sum`` divided by P afterwards, as the
  communicator's own ``avg`` does);
* allgathers are concatenated as bytes into one;
* the consistency checks' allgathers (``mpi_collectives.consistency``) likewise, on
  the check group;
* anything else runs as it is, in tensor order.

Every rank posts the same calls in the same order (the signature check makes
sure), so the fused calls match across ranks. Byte accounting is per original
call with its own phase, identical to a sequential run; only the fused
collective's latency is paid once.

The tensors' calls are greenlets (the ``greenlet`` package: stackful
coroutines switched in-process, about a microsecond per switch), not OS
threads: a proxy's collective switches back to the scheduler, which resumes
the next tensor, and after the last one executes the round on the calling
thread. With threads, every hand-off of the turn waited for the OS to
schedule the next thread; on an oversubscribed machine (4 ranks on 2 cores,
the emulated cluster) that gave the core to another rank at each of the
~150 hand-offs of a Transformer's step and cost GreedyLore 60-90 ms per
step, more than the fused latency saved (and earlier, with one shared
condition and ``notify_all``, O(n^2) wake-ups: 117 ms of a 154 ms DDP hook
call). MPI is only ever called from the calling thread. A method that
knows its own rounds needs no coroutines either: :func:`fused_allreduce` and
:func:`fused_check_allgather` run one round's calls, fused and accounted
exactly as here (``PowerSGD.allreduce_many``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from greenlet import greenlet

from ..kernels.arrays import is_gpu_array
from .accounting import PhaseLabel
from .check_group import check_group_of

_ELEMENTWISE = {"sum": "sum", "avg": "sum", "average": "sum", "max": "max", "min": "min",
                "prod": "prod"}


class _Call:
    __slots__ = ("kind", "name", "args", "kwargs", "phase", "result", "error")

    def __init__(self, kind: str, name: str, args: tuple, kwargs: dict, phase: str | None) -> None:
        self.kind, self.name, self.args, self.kwargs, self.phase = kind, name, args, kwargs, phase
        self.result: Any = None
        self.error: BaseException | None = None


class _CheckProxy:
    """A proxy's check group: the mpi4py-like surface ``mpi_collectives.consistency`` uses, posting to the
    round (which fuses the round's checks into one allgather on the real communicator's group)."""

    def __init__(self, proxy: "_Proxy") -> None:
        self._proxy = proxy

    def Get_size(self) -> int:  # noqa: N802
        return self._proxy.size

    def Get_rank(self) -> int:  # noqa: N802
        return self._proxy.rank

    def Allgather(self, send: np.ndarray, out: np.ndarray) -> None:  # noqa: N802
        out[...] = self._proxy._post("check_allgather", "Allgather", np.ascontiguousarray(send))

    def allgather(self, obj: Any) -> list[Any]:
        return self._proxy._post("check_generic", "allgather", obj)


class _Proxy(PhaseLabel):
    """The communicator one tensor's method sees: posts its collectives to the round."""

    _COLLECTIVES = {"iallreduce", "allgatherv", "allgatherv_into", "alltoall", "alltoallv",
                    "allreduce_custom", "broadcast", "broadcast_object", "allgather_object",
                    "barrier", "isend", "recv", "irecv"}

    def __init__(self, rnd: "_Round", index: int) -> None:
        self._round = rnd
        self._index = index
        self._phase: str | None = None
        self.rank = rnd.real.rank
        self.size = rnd.real.size

    def check_group(self) -> _CheckProxy:
        """Where this tensor's checks go: the round, not a communicator of their own. A new
        small object per call, holding nothing once the call returns -- the proxies are new
        at every step, so nothing may be cached per proxy (that grew with the step count)."""
        return _CheckProxy(self)

    @property
    def comm(self) -> _CheckProxy:
        """The mpi4py-like view code that reads ``comm.comm`` gets (never the real communicator:
        a collective on it would bypass the round)."""
        return _CheckProxy(self)

    @property
    def backend(self) -> str:
        return getattr(self._round.real, "backend", "mpi")

    @contextlib.contextmanager
    def in_mpi(self, op: str, **_: Any) -> Iterator[None]:
        yield

    def allreduce(self, array: Any, op: Any = "sum") -> Any:
        if isinstance(op, str) and op in _ELEMENTWISE and not is_gpu_array(array):
            return self._post("allreduce", "allreduce", np.ascontiguousarray(array), op)
        return self._post("generic", "allreduce", array, op)

    def allgather(self, array: Any) -> Any:
        if not is_gpu_array(array):
            return self._post("allgather", "allgather", np.ascontiguousarray(array))
        return self._post("generic", "allgather", array)

    def _post(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any:
        call = _Call(kind, name, args, kwargs, self._phase)
        self._round.post(call)
        if call.error is not None:
            raise call.error
        return call.result

    def __getattr__(self, name: str) -> Any:
        if name in self._COLLECTIVES:
            return lambda *a, **kw: self._post("generic", name, *a, **kw)
        return getattr(self._round.real, name)


class _Round:
    """The scheduler of one lockstep run: each tensor's call a greenlet, resumed in index order.

    A greenlet runs until its proxy posts a collective (it switches back here
    with the :class:`_Call`) or until it returns; when every unfinished one
    has posted, the round's calls are executed on the calling thread and the
    greenlets resumed with their results.
    """

    def __init__(self, real: Any, n: int) -> None:
        self.real = real
        self.n = n
        self.scheduler = greenlet.getcurrent()

    def post(self, call: _Call) -> None:
        """From a tensor's greenlet: hand ``call`` to the scheduler; return when it has run."""
        self.scheduler.switch(call)

    def run(self, fns: Sequence[Callable[[Any], Any]]) -> tuple[list[Any], list[BaseException | None]]:
        n = self.n
        check_group_of(self.real)   # the real communicator's check group exists before any tensor runs
        lets = [greenlet(lambda k=k, fn=fn: fn(_Proxy(self, k)), parent=self.scheduler)
                for k, fn in enumerate(fns)]
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n
        active = list(range(n))
        while active:
            pending: list[_Call] = []
            still: list[int] = []
            for k in active:
                try:
                    got = lets[k].switch()
                except BaseException as exc:  # noqa: BLE001 - raised after the others, in tensor order
                    errors[k] = exc
                    continue
                if lets[k].dead:
                    results[k] = got
                else:
                    pending.append(got)
                    still.append(k)
            if pending:
                try:
                    execute(self.real, pending)
                except BaseException as exc:  # noqa: BLE001 - every waiting call re-raises it
                    for c in pending:
                        if c.error is None:
                            c.error = exc
            active = still
        return results, errors


def execute(real: Any, calls: Sequence[_Call]) -> None:
    """Run one round's calls on ``real``: fusable groups as one collective each, in first-use order."""
    groups: dict[tuple, list[_Call]] = {}
    order: list[tuple] = []
    for i, c in enumerate(calls):
        if c.kind == "allreduce":
            key = ("allreduce", _ELEMENTWISE[c.args[1]], c.args[0].dtype.str)
        elif c.kind in ("allgather", "check_allgather"):
            key = (c.kind,)
        else:
            key = ("single", i)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(c)
    for key in order:
        group = groups[key]
        if key[0] == "allreduce":
            _fused_allreduce(real, group, key[1])
        elif key[0] == "allgather":
            _fused_allgather(real, group)
        elif key[0] == "check_allgather":
            _fused_check_allgather(real, group)
        else:
            c = group[0]
            target = _check_group(real) if c.kind == "check_generic" else real
            previous = real._phase
            real._phase = c.phase
            try:
                c.result = getattr(target, c.name)(*c.args, **c.kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the posting thread
                c.error = exc
            finally:
                real._phase = previous


def _fused_allreduce(real: Any, group: list[_Call], op: str) -> None:
    parts = [c.args[0] for c in group]
    if len(parts) == 1:
        flat = parts[0].reshape(-1)
    else:
        flat = np.concatenate([p.reshape(-1) for p in parts])
    with real.unaccounted():
        total = real.allreduce(flat, op)
    offset = 0
    for c, p in zip(group, parts):
        out = total[offset:offset + p.size].reshape(p.shape)
        offset += p.size
        if c.args[1] in ("avg", "average"):
            if not np.issubdtype(out.dtype, np.floating):
                c.error = ValueError("op='avg' needs a floating-point array")
                continue
            out = out / out.dtype.type(real.size)
        c.result = out
        real._account_as(c.phase, "allreduce", *real._allreduce_bytes(p.nbytes, p.itemsize))


def _fused_allgather(real: Any, group: list[_Call]) -> None:
    raw = [np.ascontiguousarray(c.args[0]).reshape(-1).view(np.uint8) for c in group]
    with real.unaccounted():
        got = real.allgather(np.concatenate(raw) if len(raw) > 1 else raw[0])
    got = got.reshape(real.size, -1)
    offset = 0
    for c, b in zip(group, raw):
        a = c.args[0]
        piece = np.ascontiguousarray(got[:, offset:offset + b.size])
        offset += b.size
        c.result = piece.view(a.dtype).reshape((real.size,) + a.shape)
        n = b.size
        real._account_as(c.phase, "allgather", n * (real.size - 1), n * (real.size - 1))


def _check_group(real: Any) -> Any:
    """The group ``mpi_collectives.consistency`` runs its checks on: one per real communicator (:mod:`.check_group`)."""
    group = check_group_of(real)
    return group if group is not None else real.comm


def _fused_check_allgather(real: Any, group: list[_Call]) -> None:
    """The round's agreements (and signature digests) as one allgather, timed under ``agree``
    as ``mpi_collectives.consistency`` times each of them: where a rank waits for late peers."""
    raw = [c.args[0].reshape(-1).view(np.uint8) for c in group]
    send = np.concatenate(raw)
    out = np.empty((real.size, send.size), dtype=np.uint8)
    timed = real.in_mpi("agree") if hasattr(real, "in_mpi") else contextlib.nullcontext()
    with timed:
        _check_group(real).Allgather(send, out)
    offset = 0
    for c, b in zip(group, raw):
        c.result = out[:, offset:offset + b.size].reshape(real.size, b.size)
        offset += b.size


def fused_allreduce(real: Any, items: Sequence[tuple[np.ndarray, str, str | None]]) -> list[np.ndarray]:
    """One round of elementwise allreduces ``(array, op, phase)`` on ``real``, fused as :func:`execute` does.

    For a caller that already knows all of a round's calls (a method's own
    bucket-level path, e.g. ``PowerSGD.allreduce_many``) and needs no
    threads: arrays of one dtype and operator family go out in one
    collective, ``avg`` parts are divided by P afterwards, and every part is
    accounted as its own allreduce under its own ``phase`` -- results and byte
    counts equal those of calling ``real.allreduce`` once per item (bit for
    bit on 2 ranks, where every element is one addition). ``real`` must
    support :meth:`Lockstep.supports`. Raises the first item's error.
    """
    calls = [_Call("allreduce", "allreduce", (np.ascontiguousarray(a), op), {}, phase)
             for a, op, phase in items]
    if calls:
        execute(real, calls)
    for c in calls:
        if c.error is not None:
            raise c.error
    return [c.result for c in calls]


def fused_check_allgather(real: Any, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The consistency checks' small allgathers of one round as one, on the check group.

    Returns, per array, the ``(P, nbytes)`` uint8 matrix that
    ``mpi_collectives.consistency``'s allgather of that array alone would give.
    """
    calls = [_Call("check_allgather", "Allgather", (np.ascontiguousarray(a),), {}, None)
             for a in arrays]
    if calls:
        _fused_check_allgather(real, calls)
    return [c.result for c in calls]


class Lockstep:
    """Runs ``fns[k](comm_k)`` for k = 0..n-1 in lockstep on ``comm`` (see the module docstring).

    ``comm`` must support ``unaccounted()`` and ``_account_as`` (the
    :class:`~.accounting.Accounting` backends); results come back in order,
    and the first exception (in tensor order) is raised after all have ended.
    Everything runs on the calling thread.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    @staticmethod
    def supports(comm: Any) -> bool:
        """Whether ``comm`` can account fused calls per original call (the Accounting backends)."""
        return hasattr(comm, "unaccounted") and hasattr(comm, "_account_as")

    def run(self, fns: Sequence[Callable[[Any], Any]]) -> list[Any]:
        """Call ``fns[k](proxy_k)`` for every k in lockstep; return their results in order."""
        n = len(fns)
        if n == 0:
            return []
        if n == 1:
            return [fns[0](self.comm)]
        results, errors = _Round(self.comm, n).run(fns)
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error
        return results


__all__ = ["Lockstep", "fused_allreduce", "fused_check_allgather"]
