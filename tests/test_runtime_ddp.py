"""runtime.HookExchange without a framework: the comm-hook runtime on stand-in buckets (issue 18).

Buckets are NumPy buffers whose parameter gradients are views into them, as
DDP's ``GradBucket`` is; the communicator has one rank (``MPI.COMM_SELF``),
so an average is the method's own compression of the input. Real DDP runs
(2 and 4 ranks, torchrun) are tests/test_ddp.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.runtime.delegate import delegated
from horovod_compress.runtime.hook import ArraySlot, HookExchange
from horovod_compress.runtime.hook_buckets import FLAT_PREFIX, flat_key

SHAPES = {"w1": (20, 10), "b1": (10,), "w2": (10, 5), "b2": (5,)}


@pytest.fixture
def comm():
    from mpi4py import MPI

    from horovod_compress.mpi_collectives import Communicator
    return Communicator(MPI.COMM_SELF)


def _write_into(view: np.ndarray):
    def write(avg):
        if not (isinstance(avg, np.ndarray) and np.shares_memory(avg, view)):
            view[...] = np.asarray(avg).reshape(view.shape)
    return write


class Bucket:
    """A stand-in GradBucket: a flat buffer, views of each parameter's gradient, a done flag."""

    def __init__(self, grads: dict[str, np.ndarray], is_last: bool) -> None:
        self.names = tuple(grads)
        self.buf = np.concatenate([g.ravel() for g in grads.values()])
        self.numel, self.nbytes, self.is_last = self.buf.size, self.buf.nbytes, is_last
        self.views, offset = [], 0
        for g in grads.values():
            self.views.append(self.buf[offset:offset + g.size].reshape(g.shape))
            offset += g.size
        self.done = False

    def flat(self) -> ArraySlot:
        return ArraySlot(self.buf, _write_into(self.buf))

    def parameters(self) -> list[ArraySlot]:
        return [ArraySlot(v, _write_into(v)) for v in self.views]

    def complete(self) -> None:
        self.done = True


def _grads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def _iteration(ex: HookExchange, grads: dict[str, np.ndarray],
               groups: list[list[str]]) -> list[Bucket]:
    buckets = [Bucket({n: grads[n] for n in g}, is_last=i == len(groups) - 1)
               for i, g in enumerate(groups)]
    for b in buckets:
        ex.reduce(b)
    assert all(b.done for b in buckets)
    return buckets


ONE = [["b2", "w2", "b1", "w1"]]
REBUILT = [["b2", "w2"], ["b1", "w1"]]


def test_flat_layout_rebuild_drops_stale_state_and_counts(comm):
    method = hvdc.Compression.topk(density=0.1, warmup_steps=0, feedback="residual")
    ex = HookExchange(method, comm)
    _iteration(ex, _grads(0), ONE)
    assert ex.buckets.saved == [(flat_key(tuple(ONE[0]), 265), tuple(ONE[0]))]
    _iteration(ex, _grads(1), REBUILT)
    keys = {k for k in method.state if k.startswith(FLAT_PREFIX)}
    assert keys == {k for k, _ in ex.buckets.saved} and len(keys) == 2   # the single bucket's is gone
    st = ex.statistics()
    assert st["iterations"] == 2 and st["calls"] == 3 and ex.stats.steps == 2
    assert st["dense_bytes"] == 0.0 and st["seconds"] > 0                 # one rank: nothing to send
    ex.reset_statistics()
    assert ex.calls == 0 and ex.stats.seconds == 0 and ex.stats.steps == 2


@pytest.mark.parametrize("label", ["topk", "powersgd"])
def test_restore_regroups_into_the_saved_buckets(comm, label):
    """After load_state_dict, one bucket of everything is reduced as the saved two: same bits."""
    def make():
        if label == "topk":
            return hvdc.Compression.topk(density=0.1, warmup_steps=0, feedback="residual")
        return hvdc.Compression.powersgd(rank=2, warmup_steps=0)

    a = HookExchange(make(), comm)
    a.named = True
    _iteration(a, _grads(0), ONE)
    _iteration(a, _grads(1), REBUILT)
    sd = a.state_dict(encode=lambda s: s)
    b = HookExchange(make(), comm)
    b.named = True
    b.load_state_dict(sd)
    assert b.buckets.restored and b.stats.steps == 2
    grads = _grads(2)
    ra = _iteration(a, grads, REBUILT)
    rb = _iteration(b, grads, ONE)
    got_a = np.concatenate([r.buf for r in ra])
    got_b = rb[0].buf
    order = {n: i for i, n in enumerate(ONE[0])}
    assert [order[n] for g in REBUILT for n in g] == list(range(4))    # same parameter order
    assert np.array_equal(got_a, got_b)
    assert b.buckets.saved == a.buckets.saved and not b.buckets.restored
    if label == "topk":                                                # flat: state per saved bucket
        assert set(a.method.state) == set(b.method.state)
        for k, st in a.method.state.items():
            assert st.keys() == b.method.state[k].keys()
            assert all(np.array_equal(v, b.method.state[k][f]) for f, v in st.items())


def test_record_probe_dense_switch_and_skips(comm):
    method = hvdc.Compression.topk(density=0.05, warmup_steps=0, nonfinite="skip")
    ex = HookExchange(method, comm)
    ex.record = []
    ex.settings.measure_error_every = 2
    for step in range(4):
        _iteration(ex, _grads(10 + step), REBUILT)
    assert len(ex.record) == 8 and all(avg is not None for _, _, avg in ex.record)
    assert ex.stats.error_count == 2 and 0.0 < ex.stats.error_sum / 2 < 1.0
    ex.settings.dense = True                                           # warm-up: exact, no state
    state_before = {k: dict(v) for k, v in method.state.items()}
    grads = _grads(20)
    out = _iteration(ex, grads, REBUILT)
    assert np.array_equal(np.concatenate([b.buf for b in out]),
                          np.concatenate([grads[n].ravel() for g in REBUILT for n in g]))
    assert {k: v["t"] for k, v in method.state.items()} == {k: v["t"] for k, v in state_before.items()}
    ex.settings.dense = False
    bad = _grads(21)
    bad["w1"][0, 0] = np.nan
    _iteration(ex, bad, REBUILT)
    assert ex.step_skipped and method.skipped_steps == 1
    _iteration(ex, _grads(22), REBUILT)
    assert not ex.step_skipped and ex.wait_seconds == 0.0


def test_failed_bucket_starts_the_next_iteration_afresh(comm):
    ex = HookExchange(hvdc.Compression.topk(density=0.1), comm)

    class Broken(Bucket):
        def flat(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ex.reduce(Broken(_grads(0), is_last=False))
    _iteration(ex, _grads(1), ONE)                                     # nothing half-done is kept
    assert ex.stats.steps == 1 and ex.calls == 1


def test_state_dict_version_is_checked(comm):
    ex = HookExchange(hvdc.Compression.topk(density=0.1), comm)
    sd = ex.state_dict()
    assert sorted(sd) == sorted(["version", "method", "iteration", "calls", "dense_bytes",
                                 "bytes_sent", "bytes_received", "layout"])
    with pytest.raises(ValueError, match="version"):
        ex.load_state_dict({**sd, "version": 99})


def test_delegated_properties():
    class Inner:
        x = 1

    class Outer:
        def __init__(self) -> None:
            self.inner = Inner()

        ro = delegated("inner.x", "read-only")
        rw = delegated("inner.x", "converted", int)

    o = Outer()
    assert o.ro == 1 and Outer.ro.__doc__ == "read-only"
    o.rw = "7"
    assert o.inner.x == 7 and o.ro == 7
    with pytest.raises(AttributeError, match="ro is read-only"):
        o.ro = 3
