"""``fp16`` and ``bf16``: cast to 16 bits, allreduce in 16 bits, cast back.

Each rank sends q_i = round16(x_i / P); ranks sum the 16-bit values with a
custom reduction (float32 add, then rounding back to 16 bits, as 16-bit
hardware arithmetic would): on an mpi4py Communicator with P > 1 a pipelined
reduce-scatter + allgather ring that calls the addition kernel on each received
segment and widens each finished one into the result (:meth:`_HalfPrecision._reduce_ring`);
otherwise an MPI operator under mpi4py, alltoall + local
reduce + allgather under torch.distributed (``Communicator.allreduce_custom``); the result is widened to the gradient's
dtype. Conversions and the operator's inner loop are compiled kernels on the
bit patterns (:mod:`horovod_compress.kernels.halfprec`), one pass each. Pre-dividing by P keeps the partial sums inside the 16-bit range, as
Horovod's ``gradient_predivide_factor`` does. Volume: N elements * 2 bytes
through a ring allreduce, i.e. half the dense volume.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..mpi_collectives import is_mpi_communicator
from ..kernels.halfprec import decode16, encode16
from .base import Method, TensorState
from .registry import register
from ..mpi_collectives.accounting import allreduce_volume
from ..feedback import Feedback
from ..kernels.halfprec import add16_range, decode16_range, encode16_range, encode16_range_finite
from ..mpi_collectives.reduce_ops import ring_piece_sizes, ring_reduce_once_items
from ..mpi_collectives.shared_window import shared_window, use_shared_window, window_reduce_once_items

class _HalfPrecision(Method):
    kind = "fp16"
    horovod_compatible = True
    scatters = True     # reduce_scatter: the first half of the 16-bit ring

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)

    def encode(self, x: np.ndarray, world_size: int) -> np.ndarray:
        """16-bit words of x / P (float16 or bfloat16 bit patterns, one fused pass)."""
        return encode16(x, self.kind, scale=1.0 / world_size)

    def decode(self, words: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """float32 values of the 16-bit words times ``scale``."""
        return decode16(words, self.kind, scale=scale)

    #: Payloads of at least this many bytes take the pipelined ring (:meth:`_reduce_ring`) on an
    #: mpi4py Communicator with P > 1; smaller ones MPI's allreduce with the custom operator.
    ring_min_bytes: int = 1 << 16
    #: The ring's message granularity when every rank shares one node: about
    #: :attr:`ring_segments_per_block` segments per block, at least :attr:`ring_segment_bytes`.
    #: On shared memory (2000 x 2000 float32) 60 KiB segments cost ~30% more than 256 KiB ones
    #: in Python bookkeeping and progress calls, and at P = 2 (4 MB blocks) 1 MiB ones were
    #: another ~7% faster than 256 KiB ones. Between hosts the ring sends eager 60 KiB segments
    #: (``reduce_ops.NETWORK_RING_PIECES``), as Global-QSGD's does.
    ring_segment_bytes: int = 1 << 18
    ring_segments_per_block: int = 4
    ring_slice_bytes: int = 1 << 18

    def _use_ring(self, comm: Any, x: np.ndarray) -> bool:
        """Whether :meth:`_reduce_ring` runs: the mpi4py :class:`Communicator` itself (not
        torch.distributed, not a lockstep proxy), P > 1, a NumPy float32 gradient of at
        least :attr:`ring_min_bytes` of 16-bit payload."""
        if comm.size < 2 or type(x) is not np.ndarray or x.dtype != np.float32 \
                or 2 * x.size < self.ring_min_bytes:
            return False
        return is_mpi_communicator(comm)

    def _ring_buffers(self, name: str, n: int) -> list[np.ndarray]:
        """Four uint16 buffers of ``n`` words (own message, result, received and forwarded
        partial sums), reused per tensor (:meth:`_scratch_buffers`)."""
        return self._scratch_buffers(name, 4, n, np.uint16)

    def _defers_finite_check(self, x: Any, name: str, comm: Any) -> bool:
        """On the ring without feedback: the 16-bit rounding pass reports whether x is finite
        (one vector min per element), so the NaN/Inf agreement needs no separate read of x;
        that pass then runs whole before the ring starts (:meth:`_reduce_ring`)."""
        return (type(self.feedback) is Feedback and self._scatter_block(x, comm) is None
                and self._use_ring(comm, x)
                and encode16_range_finite(self.kind) is not None)

    def _reduce_ring(self, x: np.ndarray, name: str, comm: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """The 16-bit sum as a pipelined ring (:func:`~horovod_compress.mpi_collectives.reduce_ops.ring_reduce_once_items`).

        Rank r rounds x_r / P to 16 bits block by block in the order the ring
        needs them, while its first segments are on the wire -- or, when the
        call deferred its NaN/Inf agreement (:meth:`_defers_finite_check`), all
        at once first, the pass reporting finiteness, then the agreement, then
        the ring (measured 1 ms faster at P = 2 than the overlapped pass plus a
        separate finiteness read, docs/kernels.md); each received
        partial sum s is folded into its own words as round16(s + q_r) (float32
        add, one rounding -- the operator's kernel, called directly instead of
        through an MPI user operator); every finished segment of the sum is
        widened straight into the float32 result while later segments arrive.
        Each element is reduced along a chain of P - 1 additions on one rank
        and then copied, so all ranks hold the same bits. At P = 2 that is the
        one addition MPI's allreduce made (same bits); at P > 2 the order of
        the chain may differ from the one MPI's algorithm picked, which the MPI
        standard leaves unspecified anyway (Open MPI's ring allreduce is a
        chain too): the same number of 16-bit roundings per element.
        Bytes: 2N(P-1)/P each way for N = 2n, counted as one allreduce.
        """
        flat = np.ascontiguousarray(x).reshape(-1)
        n = flat.size
        own, total, partial, mine = self._ring_buffers(name, n)
        enc, dec, add = encode16_range(self.kind), decode16_range(self.kind), add16_range(self.kind)
        q_scale, one = np.float32(1.0 / comm.size), np.float32(1.0)
        if self._finite_gate_pending():
            # deferred NaN/Inf agreement: round everything first, reporting finiteness,
            # agree, and only then start the ring (nothing is produced during it)
            finite = encode16_range_finite(self.kind)(flat, q_scale, own, 0, n)
            self._pass_finite_gate(bool(finite))

            def produce(lo: int, hi: int) -> None:
                pass
        else:
            def produce(lo: int, hi: int) -> None:
                enc(flat, q_scale, own, lo >> 1, hi >> 1)
        avg = np.empty(n, dtype=np.float32)

        def reduce(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int) -> int:
            add(a.view(np.uint16), b.view(np.uint16), out.view(np.uint16), lo >> 1, hi >> 1)
            return 0

        def consume(lo: int, hi: int) -> None:
            dec(total, one, avg, lo >> 1, hi >> 1)

        segment, slice_ = ring_piece_sizes(
            comm, (max(self.ring_segment_bytes, 2 * n // (comm.size * self.ring_segments_per_block)),
                   self.ring_slice_bytes))
        ring_reduce_once_items(comm, n, 2, produce, own.view(np.uint8), reduce, consume,
                               segment_bytes=segment, slice_bytes=slice_, result=total.view(np.uint8),
                               scratch=(partial.view(np.uint8), mine.view(np.uint8)))
        avg = avg.reshape(x.shape)
        if not self.feedback.uses_local:
            return avg, None
        return avg, self.decode(own, scale=comm.size).reshape(x.shape)

    def _reduce_window(self, x: np.ndarray, name: str, comm: Any) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The ring's 16-bit sum through a node-wide shared-memory window
        (:func:`~horovod_compress.mpi_collectives.shared_window.window_reduce_once_items`),
        when every rank shares this node (:func:`~horovod_compress.mpi_collectives.shared_window.use_shared_window`).

        Each rank rounds x_r / P to 16 bits into its segment in one pass (the
        pass that also reports finiteness, when the call deferred its NaN/Inf
        agreement), rank j adds block j along the ring's chain, and every rank
        widens the P finished blocks into its float32 result: the same words,
        additions and bits as :meth:`_reduce_ring`, without its copies through
        MPI's transport and its per-segment progress calls. None (nothing done) when the
        node has no room for the window (:func:`~horovod_compress.mpi_collectives.shared_window.shared_window`).
        """
        flat = np.ascontiguousarray(x).reshape(-1)
        n = flat.size
        window = shared_window(comm, f"{self.kind}:{name}", n, 2)
        if window is None:
            return None
        enc, dec, add = encode16_range(self.kind), decode16_range(self.kind), add16_range(self.kind)
        q_scale, one = np.float32(1.0 / comm.size), np.float32(1.0)
        gate = self._finite_gate_pending()

        def produce(own: np.ndarray) -> None:
            words = own.view(np.uint16)
            if gate:
                self._pass_finite_gate(bool(encode16_range_finite(self.kind)(flat, q_scale, words, 0, n)))
            else:
                enc(flat, q_scale, words, 0, n)

        def reduce(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int, q: int) -> int:
            add(a.view(np.uint16), b.view(np.uint16), out.view(np.uint16), lo >> 1, hi >> 1)
            return 0

        avg = np.empty(n, dtype=np.float32)

        def consume(src: np.ndarray, lo: int, hi: int) -> None:
            dec(src.view(np.uint16), one, avg, lo >> 1, hi >> 1)

        scratch = self._scratch_buffers(f"{name}|chain", 1, 2 * n, np.uint8)[0] if comm.size > 2 else None
        window_reduce_once_items(comm, window, n, 2, produce, reduce, consume, scratch)
        avg = avg.reshape(x.shape)
        if not self.feedback.uses_local:
            return avg, None
        return avg, self.decode(window.messages[comm.rank].view(np.uint16), scale=comm.size).reshape(x.shape)

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        block = self._scatter_block(x, comm)
        if block is not None:
            return self._reduce_scatter(x, comm, block)
        if self._use_ring(comm, x):
            done = self._reduce_window(x, name, comm) if use_shared_window(comm) else None
            return done if done is not None else self._reduce_ring(x, name, comm)
        words = self.encode(x.reshape(-1), comm.size)
        out = comm.allreduce_custom(words, f"{self.kind}_sum")
        avg = self.decode(out).astype(x.dtype, copy=False).reshape(x.shape)
        if not self.feedback.uses_local:    # unbiased, no feedback: skip a pass over the gradient
            return avg, None
        local = self.decode(words, scale=comm.size).astype(x.dtype, copy=False).reshape(x.shape)
        return avg, local

    def _reduce_scatter(self, x: np.ndarray, comm: Any,
                        block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray | None]:
        """The reduce-scatter half of the 16-bit sum: the same rounded additions, this rank's
        block of words only (``comm.reduce_scatter_custom``), widened into a zero vector."""
        words = self.encode(x.reshape(-1), comm.size)
        mine = comm.reduce_scatter_custom(words, f"{self.kind}_sum")
        avg = np.zeros(x.size, dtype=x.dtype)
        avg[block[0]:block[1]] = self.decode(mine)
        if not self.feedback.uses_local:
            return avg.reshape(x.shape), None
        return avg.reshape(x.shape), self.decode(words, scale=comm.size).astype(
            x.dtype, copy=False).reshape(x.shape)

    def expected_bytes(self, shape: tuple[int, ...], world_size: int, itemsize: int = 4) -> float:
        n = int(np.prod(shape))
        return allreduce_volume(2 * n, world_size)

    # Horovod's Compressor protocol: Method.compress/decompress
    # (horovod_compat): fp16 is a cast around Horovod's allreduce; bf16 runs
    # our exchange (Horovod 0.28 has no bfloat16 allreduce).


@register
class FP16(_HalfPrecision):
    """IEEE half precision on the wire (Horovod's ``Compression.fp16``)."""

    name = "fp16"
    kind = "fp16"


@register
class BF16(_HalfPrecision):
    """bfloat16 on the wire: float32's exponent range, 8 bits of mantissa."""

    name = "bf16"
    kind = "bf16"
    horovod_compatible = False   # Horovod 0.28 has no bfloat16 allreduce: our exchange runs it
