"""PowerSGD against PyTorch's own ``powerSGD_hook`` -- code nobody here wrote.

The MPI case (tests/cases/lowrank_cases.py, ``case_powersgd_matches_torch``)
starts a torch.distributed gloo group (env:// rendezvous on 127.0.0.1, a free
port chosen by rank 0) inside the same mpirun ranks, feeds identical inputs to
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (one tensor per
bucket) and to our PowerSGD on mpi4py with the same rank, seed, warm start,
error feedback, ``start_powerSGD_iter`` and ``min_compression_rate``, and
compares every output of every step. The remaining PowerSGD cases (bytes, edge
shapes, checkpoints) run in tests/test_greedylore.py's launches. The 4-rank
launch is shared with tests/test_greedylore_digits.py (tests/cases/lowrank_launch.py).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.compressors.lowrank_common import orthogonalize, should_compress


def lowrank_launch():
    """tests/cases/lowrank_launch.py, loaded once per session (its launches are cached)."""
    name = "hvdc_tests_lowrank_launch"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parent / "cases" / "lowrank_launch.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def torch_run(request):
    pytest.importorskip("torch")
    return request.param, lowrank_launch().torch_launch(request.param)


def test_matches_torch_powersgd_hook(torch_run):
    """Every output of 7 steps (2 dense, 5 compressed) over 6 tensors, for five configs
    (rank 1 Gram-Schmidt, rank 2-4 QR, warm start on/off, error feedback on/off,
    float32/float64), equals the hook's: float32 within 2e-4 relative (measured ~3e-6),
    float64 within 1e-9 (measured ~3e-15). The control -- the same algorithm drawing Q
    from our own seed -- is far off, so the agreement is not an accident."""
    _p, res = torch_run
    for out in res["case_powersgd_matches_torch"].values():
        configs = {k: v for k, v in out.items() if k != "control_shared_q_init_rel"}
        assert len(configs) == 5
        for key, v in configs.items():
            tol = 1e-9 if key.endswith("float64") else 2e-4
            assert v["worst_rel"] < tol, (key, v)
            assert v["compressed_calls"] > 0
        assert out["control_shared_q_init_rel"] > 1e-2


def test_torch_rng_stream_survives_checkpoint(torch_run):
    _p, res = torch_run
    for out in res["case_checkpoint_torch_rng"].values():
        assert out["powersgd_torch"]


# ------------------------------------------------------ single process
@pytest.mark.parametrize("rows, cols, rank, rate", [
    (32, 48, 1, 2), (6, 6, 4, 2), (10, 128, 8, 2), (16, 36, 4, 2), (16, 36, 8, 2),
    (5, 12, 9, 0), (100, 100, 25, 2), (100, 100, 24, 2), (3, 1000, 2, 1.5)])
def test_should_compress_equals_torch_rule(rows, cols, rank, rate):
    ph = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    r = min(rows, cols, rank)
    assert should_compress(rows, cols, rank, rate) == ph._should_compress(rows, cols, r, rate)[0]


@pytest.mark.parametrize("cols, eps", [(1, 0.0), (2, 0.0), (2, 1e-8), (3, 0.0), (7, 0.0)])
def test_orthogonalize_equals_torch(cols, eps):
    torch = pytest.importorskip("torch")
    ph = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    rng = np.random.default_rng(cols)
    a = rng.standard_normal((20, cols))
    theirs = torch.from_numpy(a.copy())[None]
    ph._orthogonalize(theirs, eps)
    mine = orthogonalize(a.copy(), eps)
    assert np.allclose(mine, theirs[0].numpy(), atol=1e-12)


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
