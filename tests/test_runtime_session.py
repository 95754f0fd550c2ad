"""runtime.TrainingExchange without a framework: op scaling, warm-up, statistics, the error probe.

On a one-rank communicator (``MPI.COMM_SELF``) the average of a gradient is
the gradient itself (or its compression), so each step's result is known
exactly; the multi-rank behaviour is exercised through both front-ends
(tests/test_training.py, tests/test_tensorflow.py).
"""
from __future__ import annotations

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.runtime import ExchangeStats, Scaling, StepSettings, TrainingExchange
from horovod_compress.runtime.buckets import TensorSpec
from horovod_compress.runtime.ops import Average, Sum
from horovod_compress.runtime.scaling import check_backward_passes, check_bucket_bytes, working_dtype

SPECS = [TensorSpec("w", (40, 30), "float32"), TensorSpec("b", (30,), "float32")]


@pytest.fixture
def comm():
    from mpi4py import MPI

    from horovod_compress.mpi_collectives import Communicator
    return Communicator(MPI.COMM_SELF)


def _grads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}


def _step(ex: TrainingExchange, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for name, g in grads.items():
        ex.submit(name, g)
    return ex.finish()


@pytest.mark.parametrize("op,pre,post", [(Average, 1.0, 1.0), (Sum, 4.0, 1.0), (Average, 2.0, 0.5)])
def test_scaling_round_trip_is_exact_on_one_rank(comm, op, pre, post):
    """pre-divide, average over one rank, then predivide * (P if Sum) * postscale: the gradient times postscale."""
    scaling = Scaling.from_args(op, pre)
    scaling.postscale = post
    ex = TrainingExchange(hvdc.Compression.none(), comm, SPECS, scaling=scaling, overlap=False)
    grads = _grads(0)
    out = _step(ex, grads)
    for name, g in grads.items():
        np.testing.assert_allclose(out[name], g * np.float32(post), rtol=1e-6)
    ex.close()


def test_warmup_runs_dense_and_leaves_the_method_untouched(comm):
    method = hvdc.Compression.topk(density=0.05)
    settings = StepSettings(dense=True)
    ex = TrainingExchange(method, comm, SPECS, settings=settings, overlap=False)
    grads = _grads(1)
    out = _step(ex, grads)
    assert all(np.array_equal(out[n], g) for n, g in grads.items())      # dense: exact
    assert method.state == {} and len(ex.exchanges()) == 2
    settings.dense = False
    out = _step(ex, grads)
    assert np.count_nonzero(out["w"]) < grads["w"].size                  # compressed now
    assert method.state                                                  # and it kept state
    ex.close()


def test_statistics_and_error_probe(comm):
    stats = ExchangeStats()
    settings = StepSettings(measure_error_every=2)
    ex = TrainingExchange(hvdc.Compression.topk(density=0.05), comm, SPECS, stats=stats,
                          settings=settings, overlap=False)
    for step in range(4):
        _step(ex, _grads(10 + step))
    assert stats.steps == 4 and stats.error_count == 2                   # steps 2 and 4 probed
    assert 0.0 < stats.error_sum / stats.error_count < 1.0               # top-5% keeps part of the norm
    assert stats.dense_bytes == 0.0 and stats.seconds > 0.0              # one rank: nothing to send
    settings.measure_next = True
    _step(ex, _grads(20))
    assert stats.error_count == 3 and not settings.measure_next
    ex.close()


def test_argument_checks_and_dtype_rule():
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        Scaling.from_args(Average, 0.0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        check_bucket_bytes(0)
    with pytest.raises(ValueError, match="backward_passes_per_step must be >= 1"):
        check_backward_passes(0)
    assert working_dtype("float16") == "float16" and working_dtype("float64") == "float64"
    assert working_dtype("bfloat16") == "float32" and working_dtype("int32") == "float32"


def test_settings_probe_plan_and_stats_helpers():
    settings = StepSettings(measure_error_every=3)
    assert [settings.probe_planned(s) for s in (1, 2, 3, 6)] == [False, False, True, True]
    settings.measure_next = True
    assert settings.probe_planned(1) and settings.measure_next          # planning consumes nothing
    assert settings.measure_due(1) and not settings.measure_next       # the due check does
    st = ExchangeStats(steps=5, bytes_sent=10.0, dense_bytes=40.0, seconds=1.5, error_count=2)
    assert st.compression_ratio() == 4.0
    st.reset()
    assert st == ExchangeStats(steps=5) and np.isnan(st.compression_ratio())
