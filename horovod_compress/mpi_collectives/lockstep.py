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
code: each tensor's ``method.allreduce`` runs on its own thread against a
proxy communicator; the threads run one at a time, in tensor order, each
until its next collective (so every Python-side effect -- random draws,
state updates -- happens in the same order as a sequential run), and when
every unfinished thread has posted a collective the round is executed:

* allreduces with the same elementwise operator and dtype are concatenated
  into one (``avg`` is a ``sum`` divided by P afterwards, as the
  communicator's own ``avg`` does);
* allgathers are concatenated as bytes into one;
* the consistency checks' allgathers (``runtime.consistency``) likewise, on
  the check group;
* anything else runs as it is, in tensor order.

Every rank posts the same calls in the same order (the signature check makes
sure), so the fused calls match across ranks. Byte accounting is per original
call with its own phase, identical to a sequential run; only the fused
collective's latency is paid once.

Passing the turn wakes exactly the next thread (one condition per thread on
a shared lock). Waking every thread on each hand-off (one shared condition,
``notify_all``) costs O(n^2) wake-ups per round: on a DDP bucket of 52
tensors on one core that was 117 ms of a 154 ms hook call (cProfile, issue
17). A method that knows its own rounds avoids the threads altogether:
:func:`fused_allreduce` and :func:`fused_check_allgather` run one round's
calls, fused and accounted exactly as here, from a single thread
(``PowerSGD.allreduce_many``).
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..kernels.arrays import is_gpu_array
from .accounting import PhaseLabel

_ELEMENTWISE = {"sum": "sum", "avg": "sum", "average": "sum", "max": "max", "min": "min",
                "prod": "prod"}


class _Call:
    __slots__ = ("kind", "name", "args", "kwargs", "phase", "result", "error")

    def __init__(self, kind: str, name: str, args: tuple, kwargs: dict, phase: str | None) -> None:
        self.kind, self.name, self.args, self.kwargs, self.phase = kind, name, args, kwargs, phase
        self.result: Any = None
        self.error: BaseException | None = None


class _CheckProxy:
    """``comm.comm`` of a proxy: the mpi4py-like surface ``runtime.consistency`` uses."""

    def __init__(self, proxy: "_Proxy") -> None:
        self._proxy = proxy

    def Dup(self) -> "_CheckProxy":  # noqa: N802 - mpi4py's name
        return self

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
        self.comm = _CheckProxy(self)

    @property
    def backend(self) -> str:
        return getattr(self._round.real, "backend", "mpi")

    @contextlib.contextmanager
    def in_mpi(self, op: str) -> Iterator[None]:
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
        self._round.submit(self._index, call)
        if call.error is not None:
            raise call.error
        return call.result

    def __getattr__(self, name: str) -> Any:
        if name in self._COLLECTIVES:
            return lambda *a, **kw: self._post("generic", name, *a, **kw)
        return getattr(self._round.real, name)


class _Round:
    """The scheduler of one lockstep run: a turn passed in index order, rounds of posted calls.

    Each worker waits on its own condition (sharing one lock), and passing
    the turn wakes exactly the next worker: with ``notify_all`` on a shared
    condition every hand-off woke all n threads to re-check the turn, O(n^2)
    wake-ups per round, which dominated a DDP bucket of ~50 tensors.
    """

    def __init__(self, real: Any, n: int) -> None:
        self.real = real
        self.n = n
        self.lock = threading.Lock()
        self.conds = [threading.Condition(self.lock) for _ in range(n)]
        self.turn = 0
        self.active = list(range(n))
        self.pending: dict[int, _Call] = {}

    def _wait_turn(self, k: int) -> None:
        cond = self.conds[k]
        while self.turn != k:
            cond.wait()

    def worker(self, k: int, fn: Callable[[Any], Any]) -> Any:
        with self.lock:
            self._wait_turn(k)
        try:
            return fn(_Proxy(self, k))
        finally:
            with self.lock:
                self.active.remove(k)
                self._advance(k)

    def submit(self, k: int, call: _Call) -> None:
        with self.lock:
            self.pending[k] = call
            self._advance(k)
            self._wait_turn(k)

    def _advance(self, k: int) -> None:
        """Pass the turn on from ``k`` (lock held); after the last active worker, run the round."""
        nxt = next((j for j in self.active if j > k), None)
        if nxt is not None:
            self.turn = nxt
        else:
            if self.pending:
                calls = [self.pending[j] for j in sorted(self.pending)]
                self.pending = {}
                try:
                    execute(self.real, calls)
                except BaseException as exc:  # noqa: BLE001 - every waiting call re-raises it
                    for c in calls:
                        if c.error is None:
                            c.error = exc
            self.turn = self.active[0] if self.active else self.n
        if self.turn < self.n and self.turn != k:
            self.conds[self.turn].notify()


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
            target = real.comm if c.kind == "check_generic" else real
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
        vol = real._allreduce_volume(p.nbytes)
        real._account_as(c.phase, "allreduce", vol, vol)


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


def _fused_check_allgather(real: Any, group: list[_Call]) -> None:
    raw = [c.args[0].reshape(-1).view(np.uint8) for c in group]
    send = np.concatenate(raw)
    out = np.empty((real.size, send.size), dtype=np.uint8)
    real.comm.Dup().Allgather(send, out)
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
    ``runtime.consistency``'s allgather of that array alone would give.
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
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0

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
        if self._pool is None or self._workers < n:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._workers = max(n, 2 * self._workers)
            self._pool = ThreadPoolExecutor(max_workers=self._workers,
                                            thread_name_prefix="hvdc-lockstep")
        rnd = _Round(self.comm, n)
        futures = [self._pool.submit(rnd.worker, k, fn) for k, fn in enumerate(fns)]
        results, first_error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as exc:  # noqa: BLE001
                results.append(None)
                if first_error is None:
                    first_error = exc
        if first_error is not None:
            raise first_error
        return results

    def close(self) -> None:
        """Stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["Lockstep", "fused_allreduce", "fused_check_allgather"]
