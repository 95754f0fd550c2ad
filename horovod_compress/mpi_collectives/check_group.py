"""The private communicator the per-call consistency checks run on: one per real communicator.

Every ``Method.allreduce`` begins with a 1-byte agreement and, for a new
signature, a digest allgather (``mpi_collectives.consistency``). They run on a
private duplicate of the communicator, so their messages can never match a
method's own collectives. That duplicate must exist once per *real* MPI
communicator, whatever stands in front of it: the :class:`Communicator` of a
front-end, a second ``Communicator`` built on the same mpi4py communicator,
a device wrapper, or the per-tensor proxies of the lockstep runner (which are
new objects at every step). A cache keyed by those Python objects made a new
duplicate -- or, for the proxies, a new stand-in -- at every step and kept
them all, and an MPI implementation with a small pool of communicator context
ids (MPICH and Cray MPICH: 2,048 by default) would then fail hours into a run.

So the duplicate is cached on the MPI communicator itself, as an MPI
attribute ("MPI: A Message-Passing Interface Standard", version 4.0, Section
7.7 "Caching": ``MPI_Comm_create_keyval``, ``MPI_Comm_set_attr``): every
Python object wrapping the same communicator finds the same duplicate, the
attribute is not copied to the user's own ``Dup`` of the communicator (no
copy callback), and the delete callback frees the duplicate when the
communicator is freed (``MPI_Comm_free``: e.g. a removed process set), at the
same collective point on every rank. It is created at the first check on the
communicator, which every rank reaches in the same order (the first
``Method.allreduce``; :class:`~.lockstep.Lockstep` creates it before a
round starts, on the calling thread).

An object that routes its checks elsewhere says so with a ``check_group()``
method (the lockstep proxies: the round, which fuses them); one whose
``comm`` is not an mpi4py communicator but offers ``Allgather`` and
``allgather`` (torch.distributed's private group) is its own check group.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

_LOCK = threading.Lock()
_KEYVAL: Any = None
_ALIVE = 0


def _mpi() -> Any:
    """The ``mpi4py.MPI`` module if this process imported it (else no mpi4py communicator exists)."""
    return sys.modules.get("mpi4py.MPI")


def _free_duplicate(comm: Any, keyval: Any, dup: Any) -> None:  # noqa: ARG001 - MPI's signature
    """MPI's delete callback: ``comm`` is being freed (or the attribute deleted): free its duplicate."""
    global _ALIVE
    mpi = _mpi()
    if mpi is None or mpi.Is_finalized() or dup == mpi.COMM_NULL:
        return
    dup.Free()
    _ALIVE -= 1


def _keyval(mpi: Any) -> Any:
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = mpi.Comm.Create_keyval(delete_fn=_free_duplicate)
    return _KEYVAL


def duplicate_of(raw: Any) -> Any:
    """The checks' private duplicate of the mpi4py communicator ``raw``, one per MPI communicator.

    Collective on ``raw`` the first time (``MPI_Comm_dup``); afterwards a
    lookup of ``raw``'s attribute. Freed by MPI when ``raw`` is freed.
    """
    global _ALIVE
    mpi = _mpi()
    with _LOCK:
        keyval = _keyval(mpi)
        dup = raw.Get_attr(keyval)
        if dup is None:
            dup = raw.Dup()
            raw.Set_attr(keyval, dup)
            _ALIVE += 1
    return dup


def is_mpi_comm(raw: Any) -> bool:
    """Whether ``raw`` is an mpi4py communicator (decided without importing mpi4py)."""
    mpi = _mpi()
    return mpi is not None and isinstance(raw, mpi.Comm)


def check_group_of(comm: Any) -> Any:
    """The communicator ``comm``'s checks run on; ``None`` if it has none (a one-rank stand-in).

    In order: ``comm.check_group()`` if defined; the duplicate of ``comm.comm``
    if that is an mpi4py communicator (:func:`duplicate_of`); ``comm.comm``
    itself if it offers ``Allgather`` (a group private to the checks already);
    else the check group of ``comm.comm`` (a wrapper in front of a communicator).
    """
    for _ in range(8):   # wrappers of wrappers; bounded against a comm that is its own .comm
        own = getattr(type(comm), "check_group", None)
        if own is not None:
            return own(comm)
        raw = getattr(comm, "comm", None)
        if raw is None:
            return None
        if is_mpi_comm(raw):
            return duplicate_of(raw)
        if hasattr(raw, "Allgather"):
            return raw
        comm = raw
    return None


def check_groups_alive() -> int:
    """How many private check duplicates this process holds now (one per communicator used)."""
    return _ALIVE


__all__ = ["check_group_of", "check_groups_alive", "duplicate_of", "is_mpi_comm"]
