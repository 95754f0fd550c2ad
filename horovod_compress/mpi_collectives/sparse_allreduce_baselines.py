"""The sparse allreduces Ok-Topk is compared with (Ok-Topk paper, Table 1 and Section 2).

Each takes this rank's COO top-k ``(indices ascending, values)`` of a length-n
vector and a :class:`~horovod_compress.mpi_collectives.Communicator`:

* :func:`allgatherv_sum` -- TopkA/Gaussiank's allgather-based reduction with
  per-rank counts: every rank receives every other rank's entries and sums
  locally. ``2k(P-1)`` words per rank: grows with P.
* :func:`dsa_allreduce` -- TopkDSA, SparCML's dynamic sparse allreduce
  (Renggli et al., SC'19): a sparse reduce-scatter over P equal regions of
  the index space (an alltoallv), then an allgatherv of the reduced regions,
  each sent sparse or *dense* -- whichever is smaller -- so fill-in never
  costs more than the dense region. ``4k(P-1)/P`` words when all ranks pick
  the same indices, up to ``(2k + n)(P-1)/P`` under fill-in. The result is
  the full sum ``sum_i Topk(x_i)`` (no re-selection).
* :func:`gtopk_allreduce` -- gTopk (Shi et al., ICDCS'19): a binomial
  reduction tree of ceil(log2 P) levels; at each level the receiver adds the
  two COO vectors and keeps only the top k, then rank 0 broadcasts the final
  k entries. Table 1 counts ``4k log P`` words (tree reduce plus tree
  broadcast); our accounting of the broadcast is the root sending k entries
  once and every other rank receiving them once.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.selection import coo_sum, topk_of_coo
from .coo_messages import (
    allgatherv_entries,
    as_bytes,
    entry_dtype,
    from_bytes,
    gather_counts,
    make_entries,
    split,
)
from ..kernels.scatter import scatter_sum

TAG_GTOPK = 7311


def _dense_sum(n: int, indices: np.ndarray, values: np.ndarray, dtype: np.dtype,
               scale: float = 1.0) -> np.ndarray:
    """``scale * sum`` of a COO list as a dense length-n vector in ``dtype``.

    A compiled scatter-add in ``dtype`` (:func:`~horovod_compress.kernels.scatter.scatter_sum`:
    no float64 ``bincount`` temporary; ``scale`` exact per value for 1/2^m).
    """
    return scatter_sum(n, indices, np.asarray(values, dtype=dtype), dtype, scale=scale)


# ------------------------------------------------------------------ TopkA
def allgatherv_sum(comm: Any, indices: np.ndarray, values: np.ndarray, n: int,
                   scale: float = 1.0) -> np.ndarray:
    """``scale * sum_i (indices_i, values_i)`` as a dense length-n vector, via one allgatherv.

    Counts may differ per rank (Gaussiank's threshold selection); the counts
    are allgathered first (one int64 each). ``scale = 1/P`` gives the average.
    """
    entries = make_entries(indices, values)
    everything = allgatherv_entries(comm, entries, gather_counts(comm, entries.size))
    idx, val = split(everything)
    return _dense_sum(n, idx, val, values.dtype, scale=scale)


# ----------------------------------------------------------------- TopkDSA
def uniform_boundaries(n: int, nranks: int) -> np.ndarray:
    """P+1 offsets of P equal regions of ``[0, n)`` (SparCML's static split)."""
    return (np.arange(nranks + 1, dtype=np.int64) * n) // nranks


def dsa_allreduce(comm: Any, indices: np.ndarray, values: np.ndarray, n: int,
                  scatter_only: bool = False) -> tuple[np.ndarray, dict[str, int]]:
    """TopkDSA: sparse reduce-scatter, then a sparse-or-dense allgatherv.

    ``scatter_only``: stop after the reduce-scatter; the returned sum holds
    this rank's region only (zeros elsewhere) and ``nnz`` its entries -- the
    reduce-scatter of sharded data parallelism, whose shards are SparCML's
    equal regions when P divides n.

    Returns the dense sum over ranks (length n, ``values``' dtype) and
    ``{"sparse_regions", "dense_regions", "nnz"}`` describing the allgather
    phase (``nnz`` = entries of the reduced result, the fill-in).
    A region is sent dense when its ``nnz`` entries take at least as many
    bytes as its dense values; the receiver tells the two apart by length
    (a sparse message is always shorter than the dense region).
    """
    p, r = comm.size, comm.rank
    dtype = np.dtype(values.dtype)
    bounds = uniform_boundaries(n, p)
    cuts = np.searchsorted(indices, bounds, side="left")
    entries = make_entries(indices, values)
    with comm.phase("topk_dsa.reduce_scatter"):
        received = comm.alltoallv([as_bytes(entries[cuts[j]:cuts[j + 1]]) for j in range(p)])
    parts = [from_bytes(b, dtype) for b in received]
    red_idx, red_val = coo_sum(np.concatenate([q["index"].astype(np.int64) for q in parts]),
                               np.concatenate([q["value"].astype(np.float64) for q in parts]))
    red_val = red_val.astype(dtype)
    if scatter_only:
        mine = np.zeros(n, dtype=dtype)
        mine[red_idx] = red_val
        return mine, {"sparse_regions": 0, "dense_regions": 0, "nnz": int(red_idx.size)}
    lo, hi = int(bounds[r]), int(bounds[r + 1])
    edt = entry_dtype(dtype)
    if red_idx.size * edt.itemsize < (hi - lo) * dtype.itemsize:
        payload = as_bytes(make_entries(red_idx, red_val))
    else:
        region = np.zeros(hi - lo, dtype=dtype)
        region[red_idx - lo] = red_val
        payload = region.view(np.uint8)
    with comm.phase("topk_dsa.allgatherv"):
        everything, counts = comm.allgatherv(payload)
    out = np.zeros(n, dtype=dtype)
    info = {"sparse_regions": 0, "dense_regions": 0, "nnz": 0}
    off = 0
    for j in range(p):
        nbytes = int(counts[j])
        chunk = everything[off:off + nbytes]
        off += nbytes
        lo, hi = int(bounds[j]), int(bounds[j + 1])
        if nbytes == (hi - lo) * dtype.itemsize:
            region = chunk.view(dtype)
            out[lo:hi] = region
            info["dense_regions"] += 1
            info["nnz"] += int(np.count_nonzero(region))
        else:
            e = from_bytes(chunk, dtype)
            out[e["index"].astype(np.int64)] = e["value"]
            info["sparse_regions"] += 1
            info["nnz"] += int(e.size)
    return out, info


# ------------------------------------------------------------------- gTopk
def gtopk_tree_schedule(nranks: int) -> list[list[tuple[int, int]]]:
    """Binomial-tree levels: level l pairs ``(receiver, sender)`` with sender = receiver + 2^l."""
    levels = []
    d = 1
    while d < nranks:
        levels.append([(i, i + d) for i in range(0, nranks, 2 * d) if i + d < nranks])
        d *= 2
    return levels


def gtopk_allreduce(comm: Any, indices: np.ndarray, values: np.ndarray, k: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """gTopk: tree reduction re-selecting the top k at every level, then a broadcast.

    Returns ``(indices ascending, values)`` of the final k entries, identical
    on every rank; the values are sums over the ranks whose entries survived
    each level's selection (divide by P for the average). Sums are formed in
    float64 and stored in ``values``' dtype at every level, as on the wire.
    """
    p, r = comm.size, comm.rank
    dtype = np.dtype(values.dtype)
    cur_idx, cur_val = np.asarray(indices, dtype=np.int64), np.asarray(values, dtype=dtype)
    with comm.phase("gtopk.reduce"):
        for level in gtopk_tree_schedule(p):
            for receiver, sender in level:
                if r == sender:
                    comm.isend(as_bytes(make_entries(cur_idx, cur_val)), receiver, TAG_GTOPK).wait()
                elif r == receiver:
                    got = from_bytes(comm.recv(sender, TAG_GTOPK, dtype=np.uint8), dtype)
                    s_idx, s_val = coo_sum(np.concatenate([cur_idx, got["index"].astype(np.int64)]),
                                           np.concatenate([cur_val.astype(np.float64),
                                                           got["value"].astype(np.float64)]))
                    cur_idx, cur_val = topk_of_coo(s_idx, s_val.astype(dtype), k)
    with comm.phase("gtopk.broadcast"):
        count = comm.broadcast(np.array([cur_idx.size if r == 0 else 0], dtype=np.int64), root=0)
        edt = entry_dtype(dtype)
        buf = (as_bytes(make_entries(cur_idx, cur_val)).copy() if r == 0
               else np.empty(int(count[0]) * edt.itemsize, dtype=np.uint8))
        comm.broadcast(buf, root=0)
    return split(from_bytes(buf, dtype))


__all__ = ["allgatherv_sum", "dsa_allreduce", "gtopk_allreduce", "gtopk_tree_schedule",
           "uniform_boundaries"]
