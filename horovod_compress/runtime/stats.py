"""Counters of a training exchange and the compression-error probe.

Bytes follow the Communicator's volume model (Ok-Topk paper, Table 1): a dense
ring allreduce of N bytes sends ``2N(P-1)/P``, which is what
:func:`dense_ring_bytes` reports for the exchange's buckets. The error probe
measures ``||avg_method - avg_dense|| / ||avg_dense||`` for one step with one
extra dense allreduce of the same inputs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..kernels.arrays import to_host


@dataclass
class ExchangeStats:
    """Cumulative counters of one exchange on this rank (bytes under the volume model).

    ``bytes_*`` count the gradient exchange alone (the Communicator's delta
    around each step), ``dense_bytes`` what a dense ring allreduce would have
    sent, ``error_sum / error_count`` the mean measured compression error,
    ``check_bytes_*`` the probes' dense allreduces, ``setup_bytes_*`` the
    one-time cross-rank checks when exchanges are built, and ``seconds`` the
    time the training loop spent inside the exchange (submitting and waiting).
    """

    steps: int = 0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    dense_bytes: float = 0.0
    error_sum: float = 0.0
    error_count: int = 0
    check_bytes_sent: float = 0.0
    check_bytes_received: float = 0.0
    setup_bytes_sent: float = 0.0
    setup_bytes_received: float = 0.0
    seconds: float = 0.0

    def copy(self) -> "ExchangeStats":
        """A shallow copy (a snapshot of the counters)."""
        return copy.copy(self)


def dense_ring_bytes(buckets: Sequence[Any], size: int) -> float:
    """Bytes one rank sends in a dense ring allreduce of ``buckets``: ``2N(P-1)/P``."""
    n = sum(b.numel * b.work_dtype.itemsize for b in buckets)
    return n * 2.0 * (size - 1) / size


def relative_error(comm: Any, inputs: Sequence[Any], averaged: Sequence[Any]) -> float:
    """``||got - ref|| / ||ref||`` where ``ref`` is a dense average of ``inputs`` over ranks.

    ``inputs`` are this rank's gradients, ``averaged`` the method's averages
    of them (same order and shapes). One float64 allreduce in the phase
    ``hvdc_compression_error``; ``inf`` when the reference is zero and the
    result is not.
    """
    x = np.concatenate([np.asarray(to_host(a), np.float64).ravel() for a in inputs])
    got = np.concatenate([np.asarray(to_host(a), np.float64).ravel() for a in averaged])
    with comm.phase("hvdc_compression_error"):
        ref = comm.allreduce(x, op="avg")
    norm = float(np.linalg.norm(ref))
    err = float(np.linalg.norm(got - ref))
    return err / norm if norm > 0 else (0.0 if err == 0 else float("inf"))
