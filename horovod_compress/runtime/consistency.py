"""Cross-rank check that every rank reduces the same tensors in the same order.

A mismatch (a parameter missing on one rank, a different shape or order)
would otherwise hang the job inside a collective. The check is cheap: one
allgather of a 16-byte digest of the (name, shape, dtype) list; only on a
mismatch are the full lists gathered, to name the first differing tensor.
The same ``ValueError`` is raised on every rank.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from .buckets import TensorSpec


class TensorMismatchError(ValueError):
    """Ranks disagree on the tensors to reduce."""


def digest(specs: Sequence[TensorSpec]) -> np.ndarray:
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
