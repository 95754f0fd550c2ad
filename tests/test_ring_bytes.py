"""Whole-byte counters: what each rank of a ring allreduce really sends, against the volume model.

The volume model (Ok-Topk paper, "Near-Optimal Sparse Allreduce for Distributed Deep
Learning", Table 1) gives a ring allreduce of N bytes 2N(P-1)/P each way, a fraction when P
does not divide N. The communicators count each rank's whole chunks instead
(:func:`~horovod_compress.mpi_collectives.accounting.ring_allreduce_rank_bytes`); checked here
against a step-by-step simulation of the ring (the independent oracle), against the formula
(their mean over the ranks is the formula exactly, each rank within 2 elements of it), and on
real ranks (mpirun -np 2 and -np 4): the counters are ints, and the session's counters leave the
initial ``broadcast_parameters`` out (it is counted under ``setup_bytes_*``).
"""
from __future__ import annotations

import numpy as np
import pytest

from horovod_compress.mpi_collectives.accounting import allreduce_volume, ring_allreduce_rank_bytes
from horovod_compress.tools.testing import run_cases


def simulated_ring(n: int, p: int, item: int) -> tuple[list[int], list[int]]:
    """Bytes each rank sends and receives, by playing the ring's 2(p-1) steps chunk by chunk.

    Chunks: ``np.array_split``'s (the first n mod p one element longer). Reduce-scatter step
    s: rank r sends chunk (r - 1 - s) mod p to rank r + 1 (chunk j starts on rank j + 1 and
    ends reduced on rank j); allgather step s: rank r sends chunk (r - s) mod p.
    """
    sizes = [len(c) for c in np.array_split(np.arange(n), p)]
    sent, received = [0] * p, [0] * p
    for phase_offset in (1, 0):
        for s in range(p - 1):
            for r in range(p):
                chunk = (r - phase_offset - s) % p
                sent[r] += sizes[chunk] * item
                received[(r + 1) % p] += sizes[chunk] * item
    return sent, received


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("item", [1, 2, 4, 8])
def test_each_rank_counts_the_chunks_the_ring_moves(p, item):
    for n in [0, 1, 2, 3, 7, 10, 85002 // item, 1001, 4096]:
        sent, received = simulated_ring(n, p, item)
        got = [ring_allreduce_rank_bytes(n * item, p, r, item) for r in range(p)]
        assert [g[0] for g in got] == sent and [g[1] for g in got] == received, (n, p, item)
        assert all(isinstance(x, int) for g in got for x in g)
        formula = allreduce_volume(n * item, p)
        assert sum(sent) == sum(received) == formula * p            # the mean is the formula exactly
        assert all(abs(x - formula) < 2 * item for x in sent + received)
        if n % p == 0:
            assert sent == received == [formula] * p


def case_counters_are_whole_bytes(comm):
    """An allreduce of 10 float32 (P does not divide 10 at P = 4): int counters, mean = formula."""
    p, r = comm.size, comm.rank
    comm.reset_stats()
    for dtype, n in ((np.float32, 10), (np.float64, 7), (np.uint8, 13)):
        comm.allreduce(np.ones(n, dtype=dtype))
    sent, received = comm.bytes_sent, comm.bytes_received
    assert isinstance(sent, int) and isinstance(received, int)
    stats = comm.stats()
    assert isinstance(stats["sent"], int) and isinstance(stats["by_op"]["allreduce"]["received"], int)
    want = [ring_allreduce_rank_bytes(n * np.dtype(d).itemsize, p, r, np.dtype(d).itemsize)
            for d, n in ((np.float32, 10), (np.float64, 7), (np.uint8, 13))]
    assert (sent, received) == (sum(w[0] for w in want), sum(w[1] for w in want))
    total_sent = int(comm.comm.allreduce(sent))
    total_received = int(comm.comm.allreduce(received))
    formula = allreduce_volume(40, p) + allreduce_volume(56, p) + allreduce_volume(13, p)
    assert total_sent == total_received == pytest.approx(formula * p, abs=1e-9)
    return sent


def case_session_counts_the_exchange_not_the_broadcast(comm):
    """``broadcast_parameters`` goes to ``setup_bytes_*``; ``bytes_sent`` is the gradient exchange."""
    torch = pytest.importorskip("torch")
    import horovod_compress.torch as hvd_torch
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)                       # 18 parameters: P = 4 does not divide them
    opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), comm=comm,
                                         overlap=False)
    sent0 = comm.bytes_sent
    hvd_torch.broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    broadcast = comm.bytes_sent - sent0
    assert opt.stats.bytes_sent == 0
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(comm.rank))
    model(x).sum().backward()
    opt.step()
    st = opt.stats
    assert isinstance(st.bytes_sent, int) and isinstance(st.bytes_received, int)
    total = int(comm.comm.allreduce(st.bytes_sent))
    assert total == pytest.approx(st.dense_bytes * comm.size)     # dense exchange: the formula's mean
    if comm.rank == 0:
        assert broadcast > 0                             # the root sent the parameters, not counted above
    return st.bytes_sent


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_counters_on_real_ranks(nprocs):
    # the torch session once, at P = 4 (where P does not divide its 24 parameters)
    cases = [case_counters_are_whole_bytes] + ([case_session_counts_the_exchange_not_the_broadcast]
                                               if nprocs == 4 else [])
    res = run_cases(nprocs, __file__, cases, timeout=240)
    for case in cases:
        assert set(res[case]) == set(range(nprocs))
