"""Counters of a training exchange and the compression-error probe.

Bytes follow the Communicator's volume model ("Near-Optimal Sparse Allreduce
for Distributed Deep Learning", Li and Hoefler, PPoPP 2022, Table 1): a dense
ring allreduce of N bytes sends ``2N(P-1)/P`` (:func:`ring_allreduce_bytes`),
which is what :func:`dense_ring_bytes` reports for an exchange's buckets and
a DDP hook for DDP's buckets. The error probe measures
``||avg_method - avg_dense|| / ||avg_dense||`` for one step with one extra
dense allreduce of the same inputs (:func:`record_error`).

Every front-end keeps one :class:`ExchangeStats` (the PyTorch optimizer's
``stats``, the TensorFlow reducer's, a DDP hook state's), with the same
meaning of every field.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np

from ..kernels.arrays import to_host
from ..mpi_collectives.accounting import allreduce_volume


@dataclass
class ExchangeStats:
    """Cumulative counters of one exchange on this rank (bytes under the volume model).

    ``bytes_*`` count the gradient exchange alone (the Communicator's delta
    around each step; whole bytes, what this rank sent and received),
    ``dense_bytes`` what a dense ring allreduce would have sent (the formula
    2N(P-1)/P, a mean over the ranks, so it may be fractional),
    ``error_sum / error_count`` the mean measured compression error,
    ``check_bytes_*`` the probes' dense allreduces, ``setup_bytes_*`` the
    one-time cross-rank checks when exchanges are built, and ``seconds`` the
    time the training loop spent inside the exchange (submitting and waiting;
    under DDP, inside the comm hook). ``steps`` counts training steps (DDP
    iterations).
    """

    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: float = 0.0
    error_sum: float = 0.0
    error_count: int = 0
    check_bytes_sent: int = 0
    check_bytes_received: int = 0
    setup_bytes_sent: int = 0
    setup_bytes_received: int = 0
    seconds: float = 0.0

    def copy(self) -> "ExchangeStats":
        """A shallow copy (a snapshot of the counters)."""
        return copy.copy(self)

    def compression_ratio(self) -> float:
        """``dense_bytes / bytes_sent``: how many times less than a dense ring allreduce (NaN before any byte)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent > 0 else float("nan")

    def reset(self) -> None:
        """Zero every counter but ``steps`` (the step count numbers the steps, e.g. for error probes)."""
        for f in fields(self):
            if f.name != "steps":
                setattr(self, f.name, f.default)


#: Bytes one rank sends in a dense ring allreduce of ``nbytes`` over ``size`` ranks: ``2N(P-1)/P``.
ring_allreduce_bytes = allreduce_volume


def dense_ring_bytes(buckets: Sequence[Any], size: int) -> float:
    """:func:`ring_allreduce_bytes` of ``buckets`` in their working dtypes."""
    return ring_allreduce_bytes(sum(b.numel * b.work_dtype.itemsize for b in buckets), size)


def skipped_count(methods: Sequence[Any]) -> int:
    """Steps ``methods`` dropped so far under ``nonfinite="skip"`` (their ``skipped_steps``).

    A :class:`~.session.NamespacedMethod` counts as the method it wraps.
    """
    return sum(int(getattr(getattr(m, "method", m), "skipped_steps", 0)) for m in methods)


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


def record_error(stats: ExchangeStats, comm: Any, inputs: Sequence[Any],
                 averaged: Sequence[Any]) -> float:
    """Probe one step (:func:`relative_error`) into ``stats``; the probe's bytes go to ``check_bytes_*``."""
    sent, received = comm.bytes_sent, comm.bytes_received
    err = relative_error(comm, inputs, averaged)
    stats.check_bytes_sent += comm.bytes_sent - sent
    stats.check_bytes_received += comm.bytes_received - received
    stats.error_sum += err
    stats.error_count += 1
    return err
