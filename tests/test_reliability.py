"""Issue 19 on real MPI ranks: no hang from a failing rank; mismatches and NaN/Inf through the core.

The per-rank cases (``case_*``, run on 2 and 3 ranks by ``run_cases``) drive
every method's ``allreduce`` into mismatches between ranks (shape, dtype,
name, parameters, count, order) and non-finite gradients under each policy,
and round-trip checkpoints (PyTorch ``weights_only``, the Keras encoding);
each asserts on every rank. The abort tests launch this file itself under
``mpirun`` / ``horovodrun`` (``python tests/test_reliability.py SCRIPT``,
SCRIPT the name of one of :data:`SCRIPTS`): the last rank raises while the
others wait in a collective, and our exception hook must end the job.
"""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.compressors.base import NonFiniteGradientError
from horovod_compress.mpi_collectives.consistency import TensorMismatchError
from horovod_compress.tools.testing import (find_cases, mpi_env, mpirun_command, run_cases, run_horovodrun,
                                      same_on_all_ranks)
from horovod_compress.tools.testing_plugin import import_horovod


# --------------------------------------------------------------------- cases
SHAPE = (64, 32)


def _make(name, **extra):
    params = dict(extra)
    cls_params = hvdc.Compression.by_name(name).config()
    if cls_params["warmup_steps"]:
        params["warmup_steps"] = 0     # oktopk: test its compressed steps
    if "density" in cls_params:
        params.setdefault("density", 0.1)
    return hvdc.Compression.by_name(name, **params)


def _grad(comm, step, shape=SHAPE, dtype=np.float32):
    return np.random.default_rng([7, step, comm.rank]).standard_normal(shape).astype(dtype)


def _bits(x):
    """``x``'s bytes: compared with ``same_on_all_ranks`` they are bit for bit (NaN payloads, signed zeros)."""
    return np.ascontiguousarray(x).view(np.uint8).reshape(-1)


def _expect_mismatch(comm, fn, *needles):
    """``fn`` must raise TensorMismatchError on this rank, with every needle in the message."""
    try:
        fn()
    except TensorMismatchError as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, (needle, text)
        return text
    raise AssertionError("no mismatch error")


def case_mismatches_every_method(comm):
    """Shape, dtype, name, parameter, count and order mismatches raise on every rank, for every method."""
    r = comm.rank
    seen = {}
    for name in hvdc.Compression.available():
        msgs = []
        # shape (first call: the signature is new on every rank)
        m = _make(name)
        msgs.append(_expect_mismatch(comm, lambda: m.allreduce(
            _grad(comm, 0, (64, 32 + r)), "w", comm), "'w'", "shape", "rank 1 (64, 33)"))
        # shape changed on one rank only, after matched steps (rank 0 sees a known signature)
        m = _make(name)
        for step in range(2):
            m.allreduce(_grad(comm, step), "w", comm)
        shape = SHAPE if r == 0 else (64, 31)
        msgs.append(_expect_mismatch(comm, lambda: m.allreduce(_grad(comm, 2, shape), "w", comm),
                                     "shape"))
        # the ranks still agree afterwards: a matched call works again
        out = m.allreduce(_grad(comm, 3), "w", comm)
        assert same_on_all_ranks(comm, _bits(out))
        # dtype
        m = _make(name)
        dtype = np.float32 if r == 0 else np.float64
        msgs.append(_expect_mismatch(comm, lambda: m.allreduce(_grad(comm, 0, dtype=dtype), "w", comm),
                                     "dtype"))
        # name (shared randomness is keyed by it)
        m = _make(name)
        msgs.append(_expect_mismatch(comm, lambda: m.allreduce(_grad(comm, 0), f"w{r}", comm),
                                     "tensor name", "'w0'", "'w1'"))
        # parameters: seed differs (every method has one)
        m = _make(name, seed=r)
        msgs.append(_expect_mismatch(comm, lambda: m.allreduce(_grad(comm, 0), "w", comm),
                                     "method parameter seed"))
        # count: rank 0 reduces one more tensor in a step
        m = _make(name)
        m.allreduce(_grad(comm, 0), "a", comm)
        if r == 0:
            msgs.append(_expect_mismatch(comm, lambda: m.allreduce(_grad(comm, 1), "extra", comm),
                                         "'extra'"))
        else:
            msgs.append(_expect_mismatch(comm, lambda: m.allreduce(_grad(comm, 1), "a", comm),
                                         "'extra'"))
        # order
        m = _make(name)
        first = "a" if r == 0 else "b"
        msgs.append(_expect_mismatch(comm, lambda: m.allreduce(_grad(comm, 0), first, comm),
                                     "tensor name"))
        seen[name] = msgs
    # a method-specific parameter
    m = _make("topk", density=0.1 if r == 0 else 0.2)
    _expect_mismatch(comm, lambda: m.allreduce(_grad(comm, 0), "w", comm),
                     "method parameter density", "rank 0 0.1", "rank 1 0.2")
    m = _make("powersgd", rank=4 + r)
    _expect_mismatch(comm, lambda: m.allreduce(_grad(comm, 0), "w", comm), "method parameter rank")
    # every rank raised the very same messages
    gathered = comm.allgather_object(seen)
    assert all(g == gathered[0] for g in gathered)
    return sorted(seen)


def _poison(comm, step, bad_rank, value):
    g = _grad(comm, step)
    if comm.rank == bad_rank:
        g[3, 5] = value
    return g


def case_nonfinite_policies_every_method(comm):
    """skip/propagate: the next clean step is finite, equal everywhere, as if the bad step never happened."""
    bad_rank = comm.size - 1
    report = {}
    for name in hvdc.Compression.available():
        for policy in ("skip", "propagate"):
            for value in (np.nan, np.inf):
                m = _make(name, nonfinite=policy)
                ref = _make(name, nonfinite=policy)
                outs, refs = [], []
                for step in range(3):
                    outs.append(m.allreduce(_grad(comm, step), "w", comm))
                    refs.append(ref.allreduce(_grad(comm, step), "w", comm))
                before = m.state_dict()
                bad = m.allreduce(_poison(comm, 3, bad_rank, value), "w", comm)
                after = m.state_dict()
                for key, arr in before["state"]["w"].items():   # feedback state untouched
                    assert np.array_equal(np.asarray(arr), np.asarray(after["state"]["w"][key])), key
                if policy == "skip":
                    assert m.last_step_skipped and m.skipped_steps == 1
                    assert not bad.any()
                else:
                    assert not np.isfinite(bad).all()
                    assert same_on_all_ranks(comm, _bits(bad))
                for step in range(4, 6):
                    out = m.allreduce(_grad(comm, step), "w", comm)
                    want = ref.allreduce(_grad(comm, step), "w", comm)
                    assert np.isfinite(out).all(), (name, policy)
                    assert same_on_all_ranks(comm, _bits(out)), (name, policy)
                    assert np.array_equal(out, want), (name, policy)   # as if step 3 never happened
                for st in m.state.values():
                    for key, arr in st.items():
                        if isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
                            assert np.isfinite(arr).all(), (name, policy, key)
        report[name] = True
    return sorted(report)


def case_nonfinite_raise_every_method(comm):
    """Default policy: every rank raises NonFiniteGradientError naming the tensor and the rank."""
    bad_rank = comm.size - 1
    for name in hvdc.Compression.available():
        m = _make(name)
        m.allreduce(_grad(comm, 0), "w", comm)
        try:
            m.allreduce(_poison(comm, 1, bad_rank, np.nan), "w", comm)
        except NonFiniteGradientError as exc:
            assert "'w'" in str(exc) and f"rank {bad_rank}" in str(exc), str(exc)
        else:
            raise AssertionError(f"{name}: no error for a NaN gradient")
        out = m.allreduce(_grad(comm, 2), "w", comm)   # the job can go on after catching it
        assert np.isfinite(out).all() and same_on_all_ranks(comm, _bits(out))
    return True


def _torch_setup(comm, name, **extra):
    import torch

    from horovod_compress.torch import DistributedOptimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), comm=comm,
                               compression=_make(name, **extra))
    return model, opt


def _torch_step(comm, model, opt, step, poison=False):
    import torch
    gen = torch.Generator().manual_seed(1000 * step + comm.rank)
    x = torch.randn(8, 32, generator=gen)
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    if poison and comm.rank == comm.size - 1:
        loss = loss * float("nan")
    loss.backward()
    opt.step()


def case_torch_checkpoint_weights_only_every_method(comm):
    """torch.load(path) with the default weights_only=True restores every method bit-identically."""
    import os
    import tempfile

    import torch
    for name in hvdc.Compression.available():
        model, opt = _torch_setup(comm, name)
        for step in range(3):
            _torch_step(comm, model, opt, step)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ckpt.pt")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
            ckpt = torch.load(path)            # PyTorch's default: weights_only=True
        for step in range(3, 6):
            _torch_step(comm, model, opt, step)
        model2, opt2 = _torch_setup(comm, name)
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
        for key, st in opt.compression.state_dict()["state"].items():
            assert key in opt2.compression.state
        for step in range(3, 6):
            _torch_step(comm, model2, opt2, step)
        for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
            assert torch.equal(a, b), (name, n)
        a_state, b_state = opt.compression.state_dict()["state"], opt2.compression.state_dict()["state"]
        assert a_state.keys() == b_state.keys()
        for tensor in a_state:
            for key, value in a_state[tensor].items():
                other = b_state[tensor][key]
                if isinstance(value, np.ndarray):
                    assert value.dtype == other.dtype and np.array_equal(value, other), (name, key)
                else:
                    assert value == other or (value != value and other != other), (name, key)
        opt.close()
        opt2.close()
    return True


def case_torch_skip_step(comm):
    """nonfinite='skip' in the PyTorch front-end: the step is dropped on every rank, training goes on."""
    import torch
    for name in ("topk", "powersgd", "none"):
        model, opt = _torch_setup(comm, name, nonfinite="skip")
        ref_model, ref_opt = _torch_setup(comm, name, nonfinite="skip")
        _torch_step(comm, model, opt, 0)
        _torch_step(comm, ref_model, ref_opt, 0)
        _torch_step(comm, model, opt, 1, poison=True)
        assert opt.step_skipped
        for step in (2, 3):
            _torch_step(comm, model, opt, step)
            _torch_step(comm, ref_model, ref_opt, step)
            assert not opt.step_skipped
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), name       # as if the NaN step never happened
            assert torch.isfinite(a).all()
            assert same_on_all_ranks(comm, a.detach().numpy())
        opt.close()
        ref_opt.close()
    return True


def case_keras_state_encoding_every_method(comm):
    """The Keras checkpoint entry (no pickle) restores every method's real state: resume bit-identical."""
    from horovod_compress.keras.checkpoint import decode_state, encode_state
    for name in hvdc.Compression.available():
        a = _make(name)
        for step in range(3):
            a.allreduce(_grad(comm, step), "w", comm)
            a.allreduce(_grad(comm, step, (40,)), "v", comm)
        blob = encode_state(a)
        assert not bytes(blob[:1]) == b"\x80"           # not a pickle
        b = _make(name)
        b.load_state_dict(decode_state(blob))
        for step in range(3, 6):
            for m in (a, b):
                m.allreduce(_grad(comm, step), "w", comm)
                m.allreduce(_grad(comm, step, (40,)), "v", comm)
            assert np.array_equal(a.allreduce(_grad(comm, 9), "w", comm),
                                  b.allreduce(_grad(comm, 9), "w", comm)), name
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for tensor in sa:
            for key, value in sa[tensor].items():
                if isinstance(value, np.ndarray):
                    assert value.dtype == sb[tensor][key].dtype
                    assert np.array_equal(value, sb[tensor][key]), (name, key)
                else:
                    assert value == sb[tensor][key], (name, key)
    return True


# ------------------------------------------------ scripts of the abort tests
# Run under mpirun/horovodrun as ``python tests/test_reliability.py NAME``: the
# last rank raises (main thread or a thread); the others wait in a collective.
def _world(abort_on_exception=None):
    from horovod_compress.mpi_collectives import world
    return world.FrontEndWorld("horovod.torch").init(abort_on_exception=abort_on_exception)


def _others_wait(comm):
    comm.allreduce(np.ones(4, dtype=np.float32), "sum")   # the others would wait here forever
    print("unreachable on the failing rank", flush=True)


def script_raise_in_main():
    """The last rank raises in its main thread."""
    comm = _world()
    if comm.rank == comm.size - 1:
        raise RuntimeError("boom from the failing rank")
    _others_wait(comm)


def script_raise_in_thread():
    """The last rank's thread raises while its main thread joins it."""
    comm = _world()
    if comm.rank == comm.size - 1:
        t = threading.Thread(target=lambda: 1 / 0, name="hvdc-comm-test")
        t.start()
        t.join()
    _others_wait(comm)


def script_report_hook():
    """Each rank prints whether the exception hook is installed (default init)."""
    from horovod_compress.mpi_collectives import world
    comm = _world()
    print(f"rank {comm.rank} installed={world.abort_on_exception_installed()}", flush=True)


def script_report_hook_init_false():
    """The same after ``init(abort_on_exception=False)``."""
    from horovod_compress.mpi_collectives import world
    comm = _world(abort_on_exception=False)
    print(f"rank {comm.rank} installed={world.abort_on_exception_installed()}", flush=True)


SCRIPTS = (script_raise_in_main, script_raise_in_thread, script_report_hook,
           script_report_hook_init_false)


# --------------------------------------------------------------------- tests
@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def results(request):
    return request.param, run_cases(request.param, __file__, timeout=600)


@pytest.mark.mpi
@pytest.mark.parametrize("case", find_cases(__file__))
def test_core_case(results, case):
    nprocs, res = results
    assert set(res[case]) == set(range(nprocs))


def _abort_run(script, extra_env=None, timeout=60):
    cmd = mpirun_command(2) + [sys.executable, __file__, script.__name__]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=mpi_env(extra_env))
    return proc, time.monotonic() - start


@pytest.mark.mpi
@pytest.mark.parametrize("script,error", [(script_raise_in_main, "RuntimeError"),
                                          (script_raise_in_thread, "ZeroDivisionError")])
def test_exception_on_one_rank_ends_the_job(script, error):
    """Rank 1 raises while rank 0 waits in an allreduce: the job ends promptly, non-zero, naming rank 1."""
    proc, seconds = _abort_run(script)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"[hvdc] rank 1 of 2: uncaught {error}" in out, out
    assert "unreachable" not in out
    assert seconds < 60


@pytest.mark.mpi
@pytest.mark.parametrize("script,env", [(script_report_hook, {"HVDC_ABORT_ON_EXCEPTION": "0"}),
                                        (script_report_hook_init_false, None)])
def test_abort_hook_can_be_turned_off(script, env):
    proc, _ = _abort_run(script, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("installed=False") == 2


@pytest.mark.mpi
def test_abort_hook_installed_by_default():
    proc, _ = _abort_run(script_report_hook, {"HVDC_ABORT_ON_EXCEPTION": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("installed=True") == 2


@pytest.mark.mpi
def test_exception_under_horovodrun():
    """The same under Horovod's launcher (it starts mpirun)."""
    import_horovod("horovod.runner")
    start = time.monotonic()
    proc = run_horovodrun(2, ["--mpi-args=--oversubscribe", sys.executable, __file__,
                              script_raise_in_main.__name__], timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "[hvdc] rank 1 of 2: uncaught RuntimeError" in out, out
    assert time.monotonic() - start < 90


if __name__ == "__main__":
    {f.__name__: f for f in SCRIPTS}[sys.argv[1]]()
