"""PowerSGD against PyTorch's own ``powerSGD_hook`` -- code nobody here wrote.

Paper: "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization" (Vogels, Karimireddy, Jaggi, NeurIPS 2019), Algorithm 1 with
error feedback and warm start, as implemented by PyTorch's DDP hook.

``case_powersgd_matches_torch`` (run on 2 and 4 real ranks) starts a
torch.distributed gloo group (env:// rendezvous on 127.0.0.1, a free port
chosen by rank 0) inside the same mpirun ranks, feeds identical inputs to
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (one tensor per
bucket) and to our PowerSGD on mpi4py with the same rank, seed, warm start,
error feedback, ``start_powerSGD_iter`` and ``min_compression_rate``, and
compares every output of every step. Single-process: the three m x n passes of
``kernels/powersgd.py`` against NumPy and their documented rounding order, and
the NaN/Inf check taken from ``M Q``'s pass. The remaining PowerSGD cases
(bytes, edge shapes, checkpoints) run with the other low-rank methods in
tests/test_greedylore.py.
"""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.compressors import base as method_base
from horovod_compress.compressors.base import NonFiniteGradientError
from horovod_compress.compressors.lowrank_common import orthogonalize, should_compress
from horovod_compress.compressors.powersgd import PowerSGD
from horovod_compress.kernels import powersgd as kernels
from horovod_compress.mpi_collectives.accounting import allreduce_volume
from horovod_compress.tools.testing import low_rank_gradient, relative_error, run_cases, same_on_all_ranks


# ----------------------------------------------------- PowerSGD vs torch
class _Bucket:
    """The four GradBucket methods powerSGD_hook calls, over one tensor (one bucket per tensor)."""

    def __init__(self, index, tensor, last):
        self._index, self._shape, self._last = index, tuple(tensor.shape), last
        self._buf = tensor.reshape(-1).clone()

    def index(self):
        return self._index

    def buffer(self):
        return self._buf

    def gradients(self):
        return [self._buf.view(self._shape)]

    def is_last(self):
        return self._last

    def parameters(self):
        return []


def _torch_hook(ph, state, g, k):
    """torch's powerSGD_hook on gradient ``g`` as bucket ``k`` of TORCH_SHAPES, as a NumPy array."""
    import torch
    bucket = _Bucket(k, torch.from_numpy(g.copy()), last=k == len(TORCH_SHAPES) - 1)
    return ph.powerSGD_hook(state, bucket).wait().view(g.shape).numpy().copy()


def _init_torch_dist(comm):
    import torch.distributed as dist
    if dist.is_initialized():
        return dist
    port = None
    if comm.rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.broadcast_object(port)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(comm.rank), "WORLD_SIZE": str(comm.size)})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="env://", rank=comm.rank, world_size=comm.size)
    return dist


TORCH_SHAPES = [(32, 48), (48, 24), (16, 4, 3, 3), (6, 6), (24,), (40, 40)]
TORCH_CONFIGS = [
    # (rank, warm_start, use_error_feedback, dtype, seed)
    (1, True, True, "float32", 0),      # Gram-Schmidt path, warm start
    (4, True, True, "float32", 3),      # Householder QR path, warm start
    (4, False, True, "float32", 5),     # fresh Q every step
    (2, True, False, "float32", 11),    # no error feedback
    (3, True, True, "float64", 7),
]


def case_powersgd_matches_torch(comm):
    """Same inputs through torch's powerSGD_hook (gloo) and our PowerSGD (mpi4py)."""
    import torch

    import horovod_compress.torch  # noqa: F401  (registers q_init="torch")
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
    torch.set_num_threads(1)
    dist = _init_torch_dist(comm)
    start, steps = 2, 7
    out = {}
    for rank, warm, ef, dt, seed in TORCH_CONFIGS:
        dtype = np.dtype(dt)
        state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                 start_powerSGD_iter=start, min_compression_rate=2,
                                 use_error_feedback=ef, warm_start=warm, random_seed=seed)
        ours = hvdc.Compression.powersgd(rank=rank, warm_start=warm, q_init="torch", seed=seed,
                                         warmup_steps=start,
                                         feedback="residual" if ef else "none")
        worst = 0.0
        compressed = 0
        for step in range(1, steps + 1):
            for k, shape in enumerate(TORCH_SHAPES):
                g = low_rank_gradient(shape, comm.rank, step, k, seed=seed, dtype=dtype)
                theirs = _torch_hook(ph, state, g, k)
                mine = ours.allreduce(g, f"t{k}", comm)
                assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
                err = relative_error(mine, theirs)
                worst = max(worst, err)
                assert same_on_all_ranks(comm, mine)
                if step > start and ours.expected_bytes(shape, comm.size) < \
                        allreduce_volume(np.prod(shape) * dtype.itemsize, comm.size):
                    compressed += 1
        if rank == 4 and warm:
            # control: the same algorithm with our own Q stream is far from torch's outputs
            control = hvdc.Compression.powersgd(rank=rank, warm_start=warm, seed=seed,
                                                warmup_steps=start)
            ph_state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=start, use_error_feedback=ef,
                                        warm_start=warm, random_seed=seed)
            diff = 0.0
            for step in range(1, start + 2):
                for k, shape in enumerate(TORCH_SHAPES):
                    g = low_rank_gradient(shape, comm.rank, step, k, seed=seed, dtype=dtype)
                    theirs = _torch_hook(ph, ph_state, g, k)
                    diff = max(diff, relative_error(control.allreduce(g, f"t{k}", comm), theirs))
            out["control_shared_q_init_rel"] = diff
        tol = 1e-9 if dtype == np.float64 else 2e-4
        assert worst < tol, (rank, warm, ef, dt, worst)
        out[f"r{rank}_warm{int(warm)}_ef{int(ef)}_{dt}"] = {"worst_rel": worst,
                                                            "compressed_calls": compressed}
    dist.barrier()
    return out


def case_checkpoint_torch_rng(comm):
    """The torch-compatible Q stream (a RandomState shared by all tensors) survives a checkpoint:
    state_dict mid-run -> fresh instance -> identical outputs afterwards."""
    import horovod_compress.torch  # noqa: F401  (registers q_init="torch")

    def make():
        return PowerSGD(rank=2, seed=3, q_init="torch", warm_start=False)
    a = make()
    for t in range(1, 6):
        a.allreduce(low_rank_gradient((10, 14), comm.rank, t, 0), "w", comm)
    b = make()
    b.load_state_dict(a.state_dict())
    same = True
    for t in range(6, 10):
        g = low_rank_gradient((10, 14), comm.rank, t, 0)
        same &= bool(np.array_equal(a.allreduce(g, "w", comm), b.allreduce(g, "w", comm)))
    assert same, "powersgd_torch"
    return {"powersgd_torch": same}


# ------------------------------------------------------ tests on MPI results
@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def torch_run(request):
    pytest.importorskip("torch")
    return request.param, run_cases(request.param, __file__, timeout=900)


def test_matches_torch_powersgd_hook(torch_run):
    """Every output of 7 steps (2 dense, 5 compressed) over 6 tensors, for five configs
    (rank 1 Gram-Schmidt, rank 2-4 QR, warm start on/off, error feedback on/off,
    float32/float64), equals the hook's: float32 within 2e-4 relative (measured ~3e-6),
    float64 within 1e-9 (measured ~3e-15). The control -- the same algorithm drawing Q
    from our own seed -- is far off, so the agreement is not an accident."""
    _p, res = torch_run
    for out in res[case_powersgd_matches_torch].values():
        configs = {k: v for k, v in out.items() if k != "control_shared_q_init_rel"}
        assert len(configs) == 5
        for key, v in configs.items():
            tol = 1e-9 if key.endswith("float64") else 2e-4
            assert v["worst_rel"] < tol, (key, v)
            assert v["compressed_calls"] > 0
        assert out["control_shared_q_init_rel"] > 1e-2


def test_torch_rng_stream_survives_checkpoint(torch_run):
    _p, res = torch_run
    for out in res[case_checkpoint_torch_rng].values():
        assert out["powersgd_torch"]


# ------------------------------------------------------ single process
@pytest.mark.parametrize("rows, cols, rank, rate", [
    (32, 48, 1, 2), (6, 6, 4, 2), (10, 128, 8, 2), (16, 36, 4, 2), (16, 36, 8, 2),
    (5, 12, 9, 0), (100, 100, 25, 2), (100, 100, 24, 2), (3, 1000, 2, 1.5)])
def test_should_compress_equals_torch_rule(rows, cols, rank, rate):
    ph = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    r = min(rows, cols, rank)
    assert should_compress(rows, cols, rank, rate) == ph._should_compress(rows, cols, r, rate)[0]


@pytest.mark.parametrize("ours", [orthogonalize], ids=["lowrank_common"])
@pytest.mark.parametrize("cols, eps", [(1, 0.0), (2, 0.0), (2, 1e-8), (3, 0.0), (7, 0.0)])
def test_orthogonalize_equals_torch(cols, eps, ours):
    torch = pytest.importorskip("torch")
    ph = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    rng = np.random.default_rng(cols)
    a = rng.standard_normal((20, cols))
    theirs = torch.from_numpy(a.copy())[None]
    ph._orthogonalize(theirs, eps)
    mine = ours(a.copy(), eps)
    assert np.allclose(mine, theirs[0].numpy(), atol=1e-12)
    # float32 (PowerSGD's usual dtype; torch's QR in float32 too), C- and F-ordered input
    for order in "CF":
        a32 = np.array(a, dtype=np.float32, order=order)
        theirs32 = torch.from_numpy(np.ascontiguousarray(a32))[None]
        ph._orthogonalize(theirs32, eps)
        mine32 = ours(a32, eps)
        assert mine32 is a32                       # in place, whatever the order
        assert np.allclose(mine32, theirs32[0].numpy(), atol=2e-6)


def test_orthogonalize_keeps_zero_column_zero():
    a = np.zeros((5, 2))
    a[:, 1] = 1.0
    out = orthogonalize(a.copy())
    assert np.all(np.isfinite(out)) and not out[:, 0].any()
    assert np.allclose(np.linalg.norm(out[:, 1]), 1.0)


def test_torch_q_init_reproduces_hook_seeding():
    """q_init='torch': RandomState(seed).randint(1e9) -> torch.manual_seed -> randn(1, cols, r)."""
    torch = pytest.importorskip("torch")
    import horovod_compress.torch  # noqa: F401  (registers the torch generator)
    m = hvdc.Compression.powersgd(rank=3, q_init="torch", seed=17)
    rs = np.random.RandomState(17)
    for _ in range(3):
        torch.manual_seed(rs.randint(1_000_000_000))
        want = torch.randn(1, 11, 3, dtype=torch.float32)[0].numpy()
        got = m.initial_q("w", 1, 11, 3, np.dtype(np.float32))
        assert np.array_equal(got, want)


def test_torch_q_init_needs_the_torch_front_end(monkeypatch):
    """The core never imports torch: without horovod_compress.torch's generator, q_init='torch' says so."""
    from horovod_compress.compressors import powersgd
    monkeypatch.delitem(powersgd.Q_SOURCES, "torch", raising=False)
    m = hvdc.Compression.powersgd(rank=3, q_init="torch", seed=17)
    with pytest.raises(RuntimeError, match="import horovod_compress.torch"):
        m.initial_q("w", 1, 11, 3, np.dtype(np.float32))


@pytest.mark.parametrize("kwargs, words", [
    ({"rank": 0}, ["rank"]),
    ({"warm_start": "yes"}, ["warm_start"]),
    ({"min_compression_rate": -0.5}, ["min_compression_rate"]),
    ({"orthogonalization_epsilon": -1}, ["orthogonalization_epsilon"]),
    ({"q_init": "numpy"}, ["q_init", "torch"]),
    ({"q_init": "torch", "seed": 2**40}, ["seed", "RandomState"]),
    ({"feedback": "magic"}, ["feedback"]),
])
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError) as info:
        hvdc.Compression.powersgd(**kwargs)
    for w in words:
        assert w in str(info.value)


def test_expected_bytes():
    m = hvdc.Compression.powersgd(rank=4)
    w = 2.0 * 4 * 3 / 4
    assert m.expected_bytes((32, 48), 4) == (32 + 48) * 4 * w
    assert m.expected_bytes((6, 6), 4) == 36 * w
    assert m.expected_bytes((16, 4, 3, 3), 4) == (16 + 36) * 4 * w
    assert m.expected_bytes((30,), 4) == 30 * w


# ------------------------------------------ the m x n passes (kernels/powersgd.py)
KERNEL_SHAPES = [(1, 1), (3, 5), (5, 1), (4, 4), (7, 9), (13, 40), (64, 16), (2, 200), (201, 33)]


def _fma_chain(pairs):
    """float32 ``fma(a_last, b_last, ... fma(a_0, b_0, +0))`` per element, emulated in float64
    (each product is exact there; the seeded inputs hit no double-rounding case)."""
    out = None
    for a, b in pairs:
        prod = a.astype(np.float64) * b.astype(np.float64)
        out = (prod + (0.0 if out is None else out.astype(np.float64))).astype(np.float32)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernels_equal_numpy_within_rounding(dtype):
    """add_and_project, project, project_t and low_rank_product against float64 NumPy, for
    row counts that are and are not multiples of 4 and every rank 1-9 (padded to 4 columns)."""
    rng = np.random.default_rng(5)
    eps = np.finfo(dtype).eps
    for m, n in KERNEL_SHAPES:
        for r in range(1, 10):
            x, e = rng.standard_normal((2, m, n)).astype(dtype)
            q = rng.standard_normal((n, r)).astype(dtype)
            acc = np.empty_like(x)
            p = kernels.add_and_project(x, e, acc, q)
            assert np.array_equal(acc, x + e)
            big = acc.astype(np.float64)
            for got, want, k in ((p, big @ q, n), (kernels.project_t(acc, p), big.T @ p, m)):
                assert got.dtype == dtype and got.flags.c_contiguous and got.shape == want.shape
                assert np.abs(got - want).max() <= 4 * k * eps * (1 + np.abs(want).max()), (m, n, r)
            qq = rng.standard_normal((n, r)).astype(dtype)
            est, err = np.empty_like(x), acc.copy()
            kernels.low_rank_product(p, qq, est, err)
            want = p.astype(np.float64) @ qq.T
            assert np.abs(est - want).max() <= 4 * r * eps * (1 + np.abs(want).max()), (m, n, r)
            assert np.array_equal(err, acc - est)
            alone = np.empty_like(x)
            assert np.array_equal(kernels.low_rank_product(p, qq, alone), est)


def test_add_and_project_gives_the_same_bits_in_place_and_alone():
    """M = x + e into a fresh buffer (the per-tensor path), into e itself (the DDP bucket path),
    and project() of the finished M give the same M Q bit for bit -- what keeps the two
    paths equal on 2 ranks."""
    rng = np.random.default_rng(6)
    for dtype in (np.float32, np.float64):
        for m, n in KERNEL_SHAPES:
            for r in (1, 3, 4, 8):
                x, e = rng.standard_normal((2, m, n)).astype(dtype)
                q = rng.standard_normal((n, r)).astype(dtype)
                acc = np.empty_like(x)
                fresh = kernels.add_and_project(x, e, acc, q)
                inplace_e = e.copy()
                inplace = kernels.add_and_project(x, inplace_e, inplace_e, q)
                assert np.array_equal(inplace_e, acc)
                assert np.array_equal(fresh, inplace) and np.array_equal(fresh, kernels.project(acc, q))
    x = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        kernels.add_and_project(x, x.copy(), x, np.ones((4, 2), np.float32))


def test_products_are_fma_chains_in_documented_order():
    """P Q^T: out[i, j] = fma over k = 0..r-1 from +0; M^T P: out[j, k] = fma over rows
    i = 0..m-1 from +0 (kernels/powersgd.py's docstring), whatever the grouping in sweeps."""
    rng = np.random.default_rng(7)
    for r in (1, 2, 3, 4, 5, 8, 9):
        p = rng.standard_normal((37, r)).astype(np.float32)
        q = rng.standard_normal((531, r)).astype(np.float32)
        out = kernels.low_rank_product(p, q, np.empty((37, 531), np.float32))
        want = _fma_chain((p[:, k:k + 1], q[None, :, k]) for k in range(r))
        assert np.array_equal(out, want), r
    mat = rng.standard_normal((23, 301)).astype(np.float32)
    p = rng.standard_normal((23, 8)).astype(np.float32)
    want = _fma_chain((mat[i][:, None], p[i][None, :]) for i in range(23))
    assert np.array_equal(kernels.project_t(mat, p), want)


class _Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, x):
        self.calls += 1
        return self.fn(x)


def test_finite_check_comes_from_m_q(monkeypatch):
    """With q_init='shared', under EF14 or no feedback, the NaN/Inf check of a compressed
    gradient comes from M Q (a NaN or infinity in M makes its row of M Q non-finite): no
    extra read of the gradient; the exact test runs only when M Q is not finite."""
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()
    counter = _Counter(method_base._finite)
    monkeypatch.setattr(method_base, "_finite", counter)
    rng = np.random.default_rng(8)
    for feedback in ("residual", "none"):
        m = PowerSGD(rank=4, feedback=feedback)
        for _ in range(3):
            m.allreduce(rng.standard_normal((40, 30)).astype(np.float32), "w", comm)
        assert counter.calls == 0, feedback
        assert not m._defers_finite_check(np.zeros(30, np.float32), "b", comm)   # sent dense
    assert not PowerSGD(q_init="torch")._defers_finite_check(np.zeros((40, 30), np.float32),
                                                             "w", comm)
    # a finite gradient whose M = g + e overflows: M Q is not finite, the exact test says finite
    m = PowerSGD(rank=4)
    m.allreduce(np.ones((40, 30), np.float32), "w", comm)
    m.state["w"]["fb_residual"][...] = np.float32(3e38)
    m.allreduce(np.full((40, 30), 3e38, np.float32), "w", comm)
    assert counter.calls == 1


def test_nonfinite_gradient_leaves_the_state_as_it_was():
    """A NaN or infinity found by M Q's pass: 'raise' raises, 'skip' returns zeros; either way
    the residual, Q and step count stay as they were, and later steps equal those of a twin
    that never saw the bad gradient."""
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()
    rng = np.random.default_rng(9)
    grads = [rng.standard_normal((40, 30)).astype(np.float32) for _ in range(5)]
    for policy in ("raise", "skip"):
        for bad_value in (np.nan, np.inf):
            m, twin = PowerSGD(rank=4, nonfinite=policy), PowerSGD(rank=4, nonfinite=policy)
            for g in grads[:2]:
                m.allreduce(g, "w", comm)
                twin.allreduce(g, "w", comm)
            before = {k: np.array(v, copy=True) for k, v in m.state["w"].items()}
            bad = grads[2].copy()
            bad[7, 3] = bad_value
            if policy == "raise":
                with pytest.raises(NonFiniteGradientError):
                    m.allreduce(bad, "w", comm)
            else:
                assert not m.allreduce(bad, "w", comm).any() and m.last_step_skipped
            assert m.state["w"].keys() == before.keys()
            for k, v in before.items():
                assert np.array_equal(m.state["w"][k], v), (policy, k)
            for g in grads[3:]:
                assert np.array_equal(m.allreduce(g, "w", comm), twin.allreduce(g, "w", comm))
