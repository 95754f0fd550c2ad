"""The foundation on real MPI ranks (mpirun -np 2 and -np 4): Communicator, first methods, optimizer.

The per-rank cases (``case_*``, one ``run_cases`` launch per world size) check
the Communicator's collectives and its byte counts against the volume model,
``none`` / fp16 / bf16 / Top-k / Rand-K against dense references computed from
all ranks' gradients, residual error feedback (nothing lost), and the PyTorch
``DistributedOptimizer`` (identical parameters on every rank, equality with a
plain MPI allreduce, unused parameters, gradient accumulation, state_dict
round trip, mismatched models, bucketed overlap). Top-k's volume is the
allgather bound 2k(P-1) words of "Near-Optimal Sparse Allreduce for
Distributed Deep Learning" (TopkA in Table 1).
"""
import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.compressors.sparse_common import k_from_density
from horovod_compress.mpi_collectives.accounting import ring_allreduce_rank_bytes
from horovod_compress.tools.testing import gather_float64, run_cases, same_on_all_ranks


def _grad(comm, n=1000, seed=0):
    return np.random.default_rng([seed, comm.rank]).standard_normal(n).astype(np.float32)


def case_communicator_bytes(comm):
    """Every collective counts the volume model's bytes; results are correct."""
    p, r = comm.size, comm.rank
    x = np.arange(10, dtype=np.float32) + r
    comm.reset_stats()
    s = comm.allreduce(x, "sum")
    assert np.array_equal(s, np.arange(10, dtype=np.float32) * p + p * (p - 1) / 2)
    # this rank's whole chunks of the ring (P = 4 does not divide 10 elements): within one
    # float32 either side of the volume model's 2N(P-1)/P, its mean over the ranks
    assert (comm.bytes_sent, comm.bytes_received) == ring_allreduce_rank_bytes(40, p, r, 4)
    assert abs(comm.bytes_sent - 2 * 40 * (p - 1) / p) < 2 * 4
    assert np.array_equal(comm.allreduce(x, "max"), x - r + (p - 1))
    a = comm.allreduce(x, "avg")
    assert np.allclose(a, np.arange(10) + (p - 1) / 2)
    comm.reset_stats()
    g = comm.allgather(x)
    assert g.shape == (p, 10) and all(np.array_equal(g[j], x - r + j) for j in range(p))
    assert comm.bytes_received == 40 * (p - 1) and comm.bytes_sent == 40 * (p - 1)
    comm.reset_stats()
    part = np.full(r + 1, r, dtype=np.int32)
    cat, counts = comm.allgatherv(part)
    assert list(counts) == list(range(1, p + 1))
    assert np.array_equal(cat, np.concatenate([np.full(j + 1, j) for j in range(p)]))
    # lengths: allgather of one int64 per rank; data: ring model
    total = sum(range(1, p + 1)) * 4
    assert comm.stats()["by_op"]["allgatherv"]["received"] == total - (r + 1) * 4
    assert comm.stats()["by_op"]["allgatherv"]["sent"] == total - ((r + 1) % p + 1) * 4
    comm.reset_stats()
    chunks = [np.full(j + r + 1, 10 * r + j, dtype=np.float64) for j in range(p)]
    got = comm.alltoallv(chunks)
    for j in range(p):
        assert np.array_equal(got[j], np.full(r + j + 1, 10 * j + r))
    sent = sum((j + r + 1) * 8 for j in range(p) if j != r) + 8 * (p - 1)
    assert comm.bytes_sent == sent
    comm.reset_stats()
    buf = np.arange(5, dtype=np.float64) if r == 0 else np.zeros(5)
    comm.broadcast(buf, root=0)
    assert np.array_equal(buf, np.arange(5))
    assert comm.bytes_sent == (40 if r == 0 else 0) and comm.bytes_received == (0 if r == 0 else 40)
    comm.reset_stats()
    # non-blocking ring exchange of unknown-length messages
    msg = np.arange(r + 3, dtype=np.float32)
    req = comm.isend(msg, (r + 1) % p, tag=7)
    got = comm.recv((r - 1) % p, tag=7, dtype=np.float32)
    req.wait()
    assert np.array_equal(got, np.arange((r - 1) % p + 3))
    assert comm.bytes_sent == msg.nbytes and comm.bytes_received == got.nbytes
    with comm.phase("demo"):
        comm.allreduce(np.ones(4, np.float32))
    assert comm.stats()["by_phase"]["demo"]["calls"] == 1
    iar = comm.iallreduce(np.ones(3, np.float32) * r, "avg")
    assert np.allclose(iar.wait(), (p - 1) / 2)
    return comm.stats()["sent"]


def case_agreement_wait_is_timed_apart(comm):
    """A call's 1-byte agreement is where a rank waits for a late peer: timed under "agree",
    with no bytes counted, and the payload's collective after it does not wait."""
    import time
    method = hvdc.Compression.topk(density=0.1)
    x = _grad(comm)
    method.allreduce(x, "warm", comm)               # signatures known: one 1-byte allgather per call
    comm.barrier()
    comm.reset_stats()
    if comm.rank == comm.size - 1:
        time.sleep(1.0)
    method.allreduce(x, "warm", comm)
    t, st = comm.timings(), comm.stats()
    assert set(st["by_op"]) == {"allgather"}, st       # the agreement counts no bytes
    if comm.rank != comm.size - 1:
        # the late peer's 1 s lands in "agree", not in the payload's collective: bounds at half of
        # it either way, so a shared, oversubscribed machine's delays of the waiting rank itself
        # (it reaches the agreement late, or the payload's exchange is slow) cannot decide them
        assert t["by_op"]["agree"] >= 0.5, t
        assert t["total"] - t["by_op"]["agree"] < 0.5, t
    assert t["cpu_by_op"]["agree"] <= t["cpu_total"] + 1e-9


def case_none_bit_exact(comm):
    """`none` equals a plain MPI allreduce (sum, then / P) bit for bit."""
    from mpi4py import MPI
    for dtype in (np.float32, np.float64):
        g = _grad(comm, 4097).astype(dtype)
        ref = np.empty_like(g)
        MPI.COMM_WORLD.Allreduce(g, ref, op=MPI.SUM)
        ref /= dtype(comm.size)
        out = hvdc.Compression.none().allreduce(g, "t", comm)
        assert out.dtype == dtype and np.array_equal(out, ref)
    return True


def case_methods_vs_dense_reference(comm):
    """topk, randk, fp16, bf16 against references computed from all ranks' gradients."""
    n, p = 2000, comm.size
    g = _grad(comm, n, seed=1)
    all_g = gather_float64(comm, g)  # (P, n): every rank's gradient
    out = {}
    # TopkA: (1/P) sum_i Topk(g_i)
    m = hvdc.Compression.topk(density=0.02, feedback="none")
    comm.reset_stats()
    got = m.allreduce(g, "t", comm)
    k = k_from_density("topk", 0.02, n)
    ref = np.zeros(n)
    for i in range(p):
        idx = np.argsort(-np.abs(all_g[i]), kind="stable")[:k]
        ref[idx] += all_g[i][idx]
    ref /= p
    assert np.allclose(got, ref, rtol=1e-6, atol=1e-7)
    # TopkA byte count: 2k words from each of the P-1 other ranks
    assert comm.bytes_received == 2 * k * 4 * (p - 1) == m.expected_bytes((n,), p)
    out["topk_bytes"] = comm.bytes_received
    # randk: shared indices (same on all ranks), average of their values
    m = hvdc.Compression.randk(density=0.05, feedback="none", seed=3)
    comm.reset_stats()
    got = m.allreduce(g, "t", comm)
    idx = m.indices("t", 1, n)
    assert same_on_all_ranks(comm, idx), "ranks drew different indices"
    ref = np.zeros(n)
    ref[idx] = all_g[:, idx].mean(0)
    assert np.allclose(got, ref, rtol=1e-6, atol=1e-7)
    kk = idx.size
    assert comm.stats()["by_op"]["allreduce"]["sent"] == 2 * kk * 4 * (p - 1) / p
    # unbiased randk scales by n/k
    mu = hvdc.Compression.randk(density=0.05, unbiased=True, seed=3)
    got_u = mu.allreduce(g, "t", comm)
    assert np.allclose(got_u, ref * n / kk, rtol=1e-5)
    # fp16 / bf16: each rank rounds g_i/P to 16 bits, sums; error within 16-bit rounding
    for name, eps in (("fp16", 2.0 ** -10), ("bf16", 2.0 ** -7)):
        m = hvdc.Compression.by_name(name)
        comm.reset_stats()
        got = m.allreduce(g, "t", comm)
        true = all_g.mean(0)
        bound = eps * (np.abs(all_g).sum(0) / p * 2 + np.abs(true)) + 1e-7
        assert np.all(np.abs(got - true) <= bound), name
        assert comm.bytes_sent == 2 * n * 2 * (p - 1) / p == m.expected_bytes((n,), p)
    return out


def case_residual_feedback_keeps_everything(comm):
    """EF14: residual + what was sent == accumulator, exactly, over several steps."""
    m = hvdc.Compression.topk(density=0.05)
    n = 500
    e_prev = np.zeros(n, np.float32)
    for step in range(3):
        g = _grad(comm, n, seed=10 + step)
        acc = g + e_prev
        m.allreduce(g, "w", comm)
        e = m.state["w"]["fb_residual"]
        k = k_from_density("topk", 0.05, n)
        # the oracle, from acc alone: the k largest |acc| (ties to the lower index) were sent, so
        # the residual is acc with exactly those entries zeroed and every other entry unchanged
        top = np.sort(np.argsort(-np.abs(acc), kind="stable")[:k])
        want = acc.copy()
        want[top] = 0
        assert np.array_equal(e, want), step      # nothing lost, nothing sent twice
        e_prev = e.copy()
    return True


def case_randk_fused_residual_is_the_unfused_one(comm):
    """Rand-K under EF14 sends x[I] + e[I] and forms acc = x + e after its allreduce: the same
    averages and residuals, bit for bit, as adding first and reducing acc; nothing lost."""
    n = 4000
    fused = hvdc.Compression.randk(density=0.05, seed=5)
    plain = hvdc.Compression.randk(density=0.05, seed=5)
    plain._reduce_residual = None          # ResidualFeedback then adds x + e and calls _reduce
    calls = []
    inner = fused._reduce_residual

    def counting(*args):
        calls.append(1)
        return inner(*args)
    fused._reduce_residual = counting
    e_prev = np.zeros(n, np.float32)
    for step in range(4):
        g = _grad(comm, n, seed=40 + step)
        a, b = fused.allreduce(g, "w", comm), plain.allreduce(g, "w", comm)
        ea, eb = fused.state["w"]["fb_residual"], plain.state["w"]["fb_residual"]
        assert np.array_equal(a, b) and a.dtype == b.dtype == np.float32, step
        assert np.array_equal(ea, eb), step
        acc = g + e_prev
        # the oracle, from acc and the shared index set alone: the residual is acc with the
        # sent entries zeroed and every other entry unchanged (nothing lost, nothing sent twice)
        idx = fused.indices("w", step + 1, n)
        want = acc.copy()
        want[idx] = 0
        assert np.array_equal(ea, want), step
        e_prev = ea.copy()
    assert len(calls) == 3                  # steps 2-4 (the first has no residual yet)
    return True


def case_optimizer_identical_params(comm):
    """Through the torch DistributedOptimizer every rank ends each step with identical params."""
    import torch

    from horovod_compress.torch import DistributedOptimizer, broadcast_parameters
    torch.manual_seed(comm.rank)  # different init on purpose: broadcast must fix it
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    results = {}
    for name in ("none", "fp16", "topk", "randk"):
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvdc.Compression.by_name(name), comm=comm)
        for step in range(3):
            x = torch.from_numpy(np.random.default_rng([comm.rank, step]).standard_normal((4, 6))
                                 .astype(np.float32))
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
            assert same_on_all_ranks(comm, flat), f"{name}: ranks diverged at step {step}"
        opt.close()
        results[name] = float(flat.sum())
    return results


def case_optimizer_none_matches_plain_allreduce(comm):
    """Dense SGD through the optimizer == SGD on gradients averaged by one plain MPI allreduce."""
    import torch

    from mpi4py import MPI

    from horovod_compress.torch import DistributedOptimizer
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 4)
    ref = torch.nn.Linear(7, 4)
    ref.load_state_dict(model.state_dict())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters(), comm=comm)
    x = torch.from_numpy(np.random.default_rng(comm.rank).standard_normal((3, 7)).astype(np.float32))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    ref(x).sum().backward()
    # the fused bucket holds gradients in reverse registration order: bias, then weight
    fused = np.concatenate([ref.bias.grad.numpy().ravel(), ref.weight.grad.numpy().ravel()])
    avg = np.empty_like(fused)
    MPI.COMM_WORLD.Allreduce(fused, avg, op=MPI.SUM)
    avg /= np.float32(comm.size)
    ref.bias.grad = torch.from_numpy(avg[:4].copy())
    ref.weight.grad = torch.from_numpy(avg[4:].reshape(4, 7).copy())
    torch.optim.SGD(ref.parameters(), lr=0.05).step()
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
    return True


def case_unused_parameter_and_accumulation(comm):
    """A parameter with no gradient is averaged as zeros (Horovod's rule); passes accumulate."""
    import torch

    from horovod_compress.torch import DistributedOptimizer
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    params = list(used.named_parameters()) + [("unused." + n, p) for n, p in unused.named_parameters()]
    before = unused.weight.detach().clone()
    opt = DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                               named_parameters=params, comm=comm,
                               compression=hvdc.Compression.topk(density=0.5),
                               backward_passes_per_step=2)
    for _ in range(2):
        used(torch.ones(1, 3) * (comm.rank + 1)).sum().backward()
    opt.step()
    assert torch.equal(unused.weight, before) and unused.weight.grad is not None
    assert float(unused.weight.grad.abs().sum()) == 0.0
    # rank-dependent accumulated grads of the bias: 2 passes of (rank+1)... bias grad = 2 per pass
    assert same_on_all_ranks(comm, used.weight.detach().numpy()), "ranks diverged"
    return True


def case_state_dict_roundtrip(comm):
    """Compressor state (residuals, step counters) is in the optimizer state_dict and restores."""
    import io

    import torch

    from horovod_compress.torch import DistributedOptimizer
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 10)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), comm=comm,
                               compression=hvdc.Compression.topk(density=0.05))
    x = torch.ones(2, 20) * (comm.rank + 1)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    residual = opt.compression.state["bucket0"]["fb_residual"].copy()
    assert np.abs(residual).sum() > 0
    model2 = torch.nn.Linear(20, 10)
    opt2 = DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                named_parameters=model2.named_parameters(), comm=comm,
                                compression=hvdc.Compression.topk(density=0.05))
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    assert np.array_equal(opt2.compression.state["bucket0"]["fb_residual"], residual)
    assert opt2.compression.state["bucket0"].t == 2
    try:
        opt3 = DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                    named_parameters=model2.named_parameters(), comm=comm,
                                    compression=hvdc.Compression.randk())
        buf.seek(0)
        opt3.load_state_dict(torch.load(buf, weights_only=False))
    except ValueError as exc:
        assert "topk" in str(exc)
    else:
        raise AssertionError("restoring topk state into randk must fail")
    return True


def case_mismatch_raises_everywhere(comm):
    """Different models on different ranks: a ValueError naming the tensor on every rank, no hang."""
    import torch

    from horovod_compress.torch import DistributedOptimizer
    width = 4 if comm.rank == 0 else 5
    model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Linear(width, 2))
    try:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=model.named_parameters(), comm=comm)
    except ValueError as exc:
        assert "differ across ranks" in str(exc) and "'1.weight'" in str(exc), str(exc)
        return str(exc)
    raise AssertionError("mismatch not detected")


def case_overlap_bucketed(comm):
    """Small buckets + overlap give the same result as one bucket without overlap."""
    import torch

    from horovod_compress.torch import DistributedOptimizer
    out = []
    for overlap, bucket in ((False, 1 << 30), (True, 256)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), comm=comm,
                                   overlap=overlap, bucket_bytes=bucket)
        assert len(opt.exchange.buckets) == (1 if bucket > 1e6 else 4)
        for step in range(3):
            x = torch.from_numpy(np.random.default_rng([comm.rank, step]).standard_normal((5, 8))
                                 .astype(np.float32))
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
    assert np.allclose(out[0], out[1], rtol=1e-6, atol=1e-7)
    return True


def case_matrix_groups_fused_equal_one_by_one(comm):
    """The optimizer's groups of a matrix method go out fused (one collective per round,
    ``runtime.per_tensor``): the same parameters as the tensors one by one, and far fewer
    collectives -- one agreement and one or two allreduces per step, not per tensor."""
    import contextlib
    from collections import Counter

    import torch

    from horovod_compress.torch import DistributedOptimizer
    methods = {"powersgd": dict(rank=2), "greedylore": dict(rank=2), "lazy_projection": dict(rank=2),
               "arc_topk": dict(), "randk_rows": dict(), "topk_rows": dict()}
    plain_in_mpi = comm.in_mpi
    calls: Counter = Counter()

    @contextlib.contextmanager
    def counting(op):
        calls[op] += 1
        with plain_in_mpi(op):
            yield
    comm.in_mpi = counting
    try:
        for name, params in methods.items():
            out, collectives = [], []
            for fused in (True, False):
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.ReLU(),
                                            torch.nn.Linear(64, 40), torch.nn.ReLU(),
                                            torch.nn.Linear(40, 8))
                method = getattr(hvdc.Compression, name)(**params, seed=3)
                opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                           named_parameters=model.named_parameters(), comm=comm,
                                           compression=method, overlap=False)
                opt.exchange.per_tensor.lockstep = fused
                assert len(opt.exchange.buckets) == 1, name      # one group of six tensors
                for step in range(4):
                    x = torch.from_numpy(np.random.default_rng([comm.rank, step])
                                         .standard_normal((16, 48)).astype(np.float32))
                    if step == 3:
                        calls.clear()     # the exchange may run inside backward (overlap=False)
                    opt.zero_grad()
                    model(x).square().mean().backward()
                    opt.step()
                collectives.append(calls["agree"] + calls["allreduce"] + calls["allgather"])
                opt.close()
                out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
            if comm.size == 2:     # one addition per element: fused or not, bit for bit
                assert np.array_equal(out[0], out[1]), name
            else:
                assert np.allclose(out[0], out[1], rtol=1e-4, atol=1e-6), (name, np.abs(out[0] - out[1]).max())
            assert same_on_all_ranks(comm, out[0]), name
            assert collectives[0] <= 4 and collectives[1] >= 12, (name, collectives)
    finally:
        del comm.in_mpi
    return True


MPI_CASES = [f for name, f in list(globals().items()) if name.startswith("case_")]


# ------------------------------------------------------------ tests on MPI results
@pytest.fixture(scope="module", params=[2, 4], ids=["np2", "np4"])
def results(request):
    return request.param, run_cases(request.param, __file__)


@pytest.mark.mpi
@pytest.mark.parametrize("case", MPI_CASES, ids=lambda case: case.__name__)
def test_case(results, case):
    nprocs, res = results
    assert set(res[case]) == set(range(nprocs))  # every rank finished the case


@pytest.mark.mpi
def test_topk_bytes_formula(results):
    nprocs, res = results
    for rank_value in res[case_methods_vs_dense_reference].values():
        k = 40  # density 0.02 of 2000
        assert rank_value["topk_bytes"] == 2 * k * 4 * (nprocs - 1)
