"""COO messages of the sparse collectives: (index, value) entries as one byte buffer.

A sparse message is an array of packed entries ``(int32 index, value)``: with
float32 values 8 bytes, i.e. the "2 words per selected entry" of the Ok-Topk
paper's Table 1 (k values plus k indices). An array of entries is sent as its
raw bytes (``uint8``), so one message carries both halves, a slice of it is a
valid message, and receivers view the bytes back as entries.

Also here: the two count exchanges the sparse collectives need, through the
communicator's backend-neutral ``alltoall`` and ``allgatherv_into`` (mpi4py or
torch.distributed) with their bytes accounted like its own collectives (an
alltoall of one int64 per peer; an allgatherv whose counts are already known,
so they are not exchanged twice).
"""
from __future__ import annotations

from typing import Any

import numpy as np

MAX_INDEX = np.iinfo(np.int32).max


def entry_dtype(value_dtype: Any) -> np.dtype:
    """Packed structured dtype ``(index int32, value value_dtype)``."""
    return np.dtype([("index", "<i4"), ("value", np.dtype(value_dtype))])


def check_index_range(n: int, method: str = "sparse allreduce") -> None:
    """Indices travel as int32: refuse tensors with more than 2**31 - 1 entries."""
    if n > MAX_INDEX:
        raise ValueError(f"{method}: a tensor (or fused bucket) of {n} entries does not fit "
                         f"int32 indices; split it into buckets of at most {MAX_INDEX} entries")


def make_entries(indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Pack COO ``(indices, values)`` into one structured array of entries."""
    values = np.asarray(values)
    out = np.empty(values.size, dtype=entry_dtype(values.dtype))
    out["index"] = indices
    out["value"] = values
    return out


def as_bytes(entries: np.ndarray) -> np.ndarray:
    """The raw bytes of a contiguous entry array (what goes on the wire)."""
    return np.ascontiguousarray(entries).view(np.uint8)


def from_bytes(buf: np.ndarray, value_dtype: Any) -> np.ndarray:
    """View received bytes as entries."""
    return np.ascontiguousarray(buf, dtype=np.uint8).view(entry_dtype(value_dtype))


def split(entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(int64 indices, values)`` of an entry array."""
    return entries["index"].astype(np.int64), np.ascontiguousarray(entries["value"])


def exchange_counts(comm: Any, send_counts: np.ndarray) -> np.ndarray:
    """Alltoall of one int64 per peer: ``recv[j]`` = what rank j will send here.

    Accounted as 8 bytes to and from each other rank (op ``alltoall``).
    """
    send = np.ascontiguousarray(send_counts, dtype=np.int64)
    if send.size != comm.size:
        raise ValueError(f"need {comm.size} counts, got {send.size}")
    return comm.alltoall(send)


def gather_counts(comm: Any, count: int) -> np.ndarray:
    """Allgather of this rank's entry count (one int64): the P counts, same on every rank."""
    return comm.allgather(np.array([count], dtype=np.int64)).reshape(-1)


def allgatherv_entries(comm: Any, entries: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Allgatherv of entry arrays whose per-rank ``counts`` every rank already knows.

    Returns the concatenation in rank order. Bytes are accounted with the ring
    model of :meth:`Communicator.allgatherv` (receive every other rank's part;
    send everything but the successor's part), without a second count exchange.
    """
    dt = entries.dtype
    counts = np.asarray(counts, dtype=np.int64)
    if int(counts[comm.rank]) != entries.size:
        raise ValueError(f"rank {comm.rank}: counts[{comm.rank}]={int(counts[comm.rank])} "
                         f"but {entries.size} entries given")
    item = dt.itemsize
    out = np.empty(int(counts.sum()), dtype=dt)
    if comm.size == 1:
        out[:] = entries
        return out
    byte_counts = counts * item
    send = as_bytes(entries) if entries.size else np.empty(0, np.uint8)
    comm.allgatherv_into(send, byte_counts, out.view(np.uint8))
    return out


__all__ = ["allgatherv_entries", "as_bytes", "check_index_range", "entry_dtype",
           "exchange_counts", "from_bytes", "gather_counts", "make_entries", "split"]
