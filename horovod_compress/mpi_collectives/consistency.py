"""Cross-rank check that every rank reduces the same tensors in the same order.

A mismatch (a parameter missing on one rank, a different shape or order)
would otherwise hang the job inside a collective. The check is cheap: one
allgather of a 16-byte digest of the (name, shape, dtype) list; only on a
mismatch are the full lists gathered, to name the first differing tensor.
The same ``ValueError`` is raised on every rank.

:func:`agree` and :func:`check_same_signature` do the same per call of
``Method.allreduce`` (name, shape, dtype, method parameters) and agree on
non-finite gradients, on a private duplicate of the communicator.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .check_group import check_group_of


@dataclass(frozen=True)
class TensorSpec:
    """A gradient the exchange handles: its name, shape and dtype (a NumPy dtype string).

    Defined here, beside the check that compares these across ranks; the runtime's bucket
    plan (:mod:`horovod_compress.runtime.buckets`) builds its buckets from them.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


class TensorMismatchError(ValueError):
    """Ranks disagree on the tensors to reduce."""


def digest(specs: Sequence[TensorSpec]) -> np.ndarray:
    """16-byte BLAKE2b digest of the tensors' names, shapes and dtypes (compared across ranks)."""
    text = ";".join(f"{s.name}:{s.shape}:{s.dtype}" for s in specs)
    return np.frombuffer(hashlib.blake2b(text.encode(), digest_size=16).digest(), dtype=np.uint8)


def check_same_tensors(comm: Any, specs: Sequence[TensorSpec]) -> None:
    """Raise :class:`TensorMismatchError` on every rank unless all ranks pass equal ``specs``."""
    if comm.size == 1:
        return
    with comm.phase("consistency_check"):
        all_digests = comm.allgather(digest(specs))
        if (all_digests == all_digests[0]).all():
            return
        lists = comm.allgather_object([(s.name, s.shape, s.dtype) for s in specs])
    raise TensorMismatchError(_describe(lists))


def _describe(lists: list[list[tuple]]) -> str:
    longest = max(len(lst) for lst in lists)
    for i in range(longest):
        entries = [lst[i] if i < len(lst) else None for lst in lists]
        if any(e != entries[0] for e in entries):
            per_rank = ", ".join(
                f"rank {r}: " + ("nothing" if e is None else f"{e[0]!r} shape {tuple(e[1])} {e[2]}")
                for r, e in enumerate(entries))
            name = next(e[0] for e in entries if e is not None)
            return (f"gradient tensors differ across ranks at position {i} (tensor {name!r}): "
                    f"{per_rank}. Every rank must build the same model and pass the same "
                    f"named_parameters.")
    return "gradient tensors differ across ranks"


# ---------------------------------------------------------------------------
# Per-call agreement and signature check for Method.allreduce.
#
# Every Method.allreduce call starts with the same tiny collective on every
# rank (:func:`agree`: one byte per rank saying "my gradient is not finite"
# and "this call's signature is new to me"), so ranks always agree on whether
# a signature check follows, even when only one rank changed a shape. Both run
# on a private duplicate of the communicator (``check_comm``), so their
# messages can never be matched with a method's own collectives, and they are
# not counted in the Communicator's byte statistics (which follow the
# methods' volume model).

NONFINITE = 1
NEW_SIGNATURE = 2


def check_comm(comm: Any) -> Any:
    """The communicator ``comm``'s checks run on: one private duplicate per real MPI communicator.

    :func:`~horovod_compress.mpi_collectives.check_group.check_group_of`:
    cached on the MPI communicator itself, whatever objects wrap it (a lockstep
    proxy routes its checks to its round instead), created at the first check
    -- the first ``Method.allreduce`` on the communicator, the same point on
    every rank -- and freed by MPI with the communicator. ``None`` for
    communicator-like objects without an mpi4py ``comm``.
    """
    return check_group_of(comm)


def _allgather(comm: Any, mine: np.ndarray) -> np.ndarray:
    """Allgather of a small uint8 array on the check communicator: shape ``(P, mine.size)``.

    Timed on ``comm`` under the op ``"agree"`` (:meth:`~horovod_compress.mpi_collectives.accounting.Accounting.timings`):
    the first collective of every call is where a rank waits for peers still
    computing, and a benchmark reports that wait apart from compression and
    from the payload's communication.
    """
    dup = check_comm(comm)
    timed = comm.in_mpi("agree") if hasattr(comm, "in_mpi") else contextlib.nullcontext()
    if dup is None:
        if not hasattr(comm, "allgather"):   # a stand-in without collectives: this rank only
            return mine.reshape(1, -1)
        with timed:
            return np.asarray(comm.allgather(mine)).reshape(comm.size, mine.size)
    out = np.empty((dup.Get_size(), mine.size), dtype=np.uint8)
    with timed:
        dup.Allgather(mine, out)
    return out


def agree(comm: Any, flags: int) -> np.ndarray:
    """Every rank's ``flags`` byte (``NONFINITE | NEW_SIGNATURE``): one 1-byte allgather."""
    if getattr(comm, "size", 1) <= 1:
        return np.array([flags], dtype=np.uint8)
    return _allgather(comm, np.array([flags], dtype=np.uint8))[:, 0]


def signature_digest(signature: tuple) -> np.ndarray:
    """16-byte digest of a call signature ``(name, shape, dtype, method config)``."""
    return np.frombuffer(hashlib.blake2b(repr(signature).encode(), digest_size=16).digest(),
                         dtype=np.uint8)


def check_same_signature(comm: Any, signature: tuple) -> None:
    """Raise :class:`TensorMismatchError` on every rank unless all pass an equal ``signature``.

    ``signature`` is ``(name, shape, dtype, config)`` with ``config`` a sorted
    tuple of ``(key, value)``. One allgather of 16 bytes; only on a mismatch
    the signatures themselves are gathered to name what differs. A
    communicator stand-in without ``comm`` or ``allgather`` (unit tests) has
    nothing to compare with: the check passes.
    """
    if getattr(comm, "size", 1) <= 1:
        return
    all_digests = _allgather(comm, signature_digest(signature))
    if (all_digests == all_digests[0]).all():
        return
    dup = check_comm(comm)
    signatures = dup.allgather(signature) if dup is not None else comm.allgather_object(signature)
    raise TensorMismatchError(describe_signatures(signatures))


def describe_signatures(signatures: Sequence[tuple]) -> str:
    """Name the tensor and each field that differs across ranks' signatures."""
    fields = ("tensor name", "shape", "dtype")
    parts = []
    for i, field in enumerate(fields):
        values = [s[i] for s in signatures]
        if any(v != values[0] for v in values):
            parts.append(f"{field}: " + ", ".join(
                f"rank {r} {tuple(v) if field == 'shape' else v!r}" for r, v in enumerate(values)))
    configs = [dict(s[3]) for s in signatures]
    for key in sorted(set().union(*configs)):
        values = [c.get(key, "<unset>") for c in configs]
        if any(v != values[0] for v in values):
            parts.append(f"method parameter {key}: " + ", ".join(
                f"rank {r} {v}" for r, v in enumerate(values)))
    names = sorted({s[0] for s in signatures})
    return (f"Method.allreduce: ranks disagree on tensor "
            f"{repr(names[0]) if len(names) == 1 else ' / '.join(map(repr, names))}"
            f" ({'; '.join(parts) or 'signatures differ'}). Every rank must reduce the same "
            f"tensors, in the same order, with the same shape, dtype and method parameters.")
