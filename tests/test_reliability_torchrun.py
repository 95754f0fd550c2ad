"""Issue 19 under ``torchrun`` (gloo, no MPI): a failing rank ends the job; mismatches and NaN/Inf in DDP hooks.

This file is also the script the ``torchrun`` ranks run (``python
tests/test_reliability_torchrun.py ENTRY [OUT]``, ENTRY the name of one of
:data:`ENTRY_POINTS`), with mpi4py blocked: the DDP path must not need MPI.

* :func:`ranks_abort_in_main` / :func:`ranks_abort_in_thread`: both ranks
  train one DDP step with our hook; then the last rank raises (in its main
  thread, or in a thread its main thread waits on) while the others wait in
  our DDP hook's collective. Our exception hooks, installed by the first
  compressed allreduce, must end the job promptly, the failing rank printing
  ``[hvdc] rank R of P: uncaught ...``.
* :func:`ranks_abort_plain` is the control without any of our code:
  torchrun's agent alone ends a job whose rank raised in its main thread.
* :func:`ranks_checks`: mismatches between ranks (model shape, parameter
  count, dtype, parameter order, bucket layout, method parameters, method,
  NaN policy) for the DDP hook of every method, and NaN/Inf steps under
  ``skip``, ``propagate`` and ``raise``. Each check either completes with
  equal, finite parameters on every rank, or raises on every rank with the
  expected words; each is reported by name.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from horovod_compress.tools.testing import torchrun_command, torchrun_env

ROOT = Path(__file__).resolve().parents[1]


# ====================================================== on the ranks
class _BlockMPI:
    def find_spec(self, name, path=None, target=None):  # noqa: ARG002
        if name == "mpi4py" or name.startswith("mpi4py."):
            raise ImportError("mpi4py is blocked under torchrun: the DDP path must not need MPI")
        return None


# Every method, with parameters that compress something on the small MLP in a few steps.
METHODS = {
    "none": {}, "fp16": {}, "bf16": {},
    "topk": {"density": 0.05}, "randk": {"density": 0.1}, "gaussiank": {"density": 0.05},
    "topk_dsa": {"density": 0.05}, "gtopk": {"density": 0.05},
    "oktopk": {"density": 0.05, "warmup_steps": 1, "tau": 2, "tau_prime": 1},
    "qsgd": {}, "global_qsgd": {},
    "deepreduce": {"sparsifier_params": {"density": 0.05}},
    "arc_topk": {"rank": 2}, "powersgd": {"rank": 2},
    "greedylore": {"rank": 2, "period": 2}, "lazy_projection": {"rank": 2, "period": 2},
    "randk_rows": {}, "topk_rows": {},
}


def make(name, **extra):
    import horovod_compress as hvdc
    return hvdc.Compression.by_name(name, **{**METHODS[name], **extra})


def mlp(seed=0, hidden=48, dtype=torch.float32, swap=False, extra=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 32),
              torch.nn.ReLU(), torch.nn.Linear(32, 10)]
    if extra:
        layers += [torch.nn.ReLU(), torch.nn.Linear(10, 10)]
    model = torch.nn.Sequential(*layers).to(dtype)
    if swap:   # the same shapes, registered under other names: parameter order differs
        model = torch.nn.Sequential()
        model.add_module("first", torch.nn.Linear(64, hidden))
        model.add_module("act", torch.nn.ReLU())
        model.add_module("second", torch.nn.Linear(hidden, 32))
        model.add_module("act2", torch.nn.ReLU())
        model.add_module("third", torch.nn.Linear(32, 10))
    return model


def ddp_with_hook(model, method, bucket_cap_mb=0.004):
    from horovod_compress.torch import ddp as hvdc_ddp
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    hook = hvdc_ddp.comm_hook(method, model=ddp)
    ddp.register_comm_hook(hook.state, hook)
    return ddp, hook.state


def batch(rank, step, n=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 64, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g)


def backward(ddp, rank, step, poison=None, dtype=torch.float32):
    x, y = batch(rank, step, dtype=dtype)
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    if poison is not None:
        loss = loss * poison
    loss.backward()


def same_everywhere(tensors):
    """Whether the given tensors are bit-identical on every rank (gathered on the default group)."""
    mine = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return all(torch.equal(o.view(torch.int64), mine.view(torch.int64)) for o in out)


# ------------------------------------------------------------------ abort entry points
def _train_then_fail(fail) -> None:
    """One DDP step with our hook; then the last rank calls ``fail`` and the others go on into
    the next step's hook collective, where they would wait forever."""
    rank, size = dist.get_rank(), dist.get_world_size()
    ddp, _ = ddp_with_hook(mlp(), make("topk"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    backward(ddp, rank, 0)
    opt.step()
    opt.zero_grad()
    if rank == size - 1:
        fail()
    backward(ddp, rank, 1)   # the others wait in the hook's collective
    print(f"unreachable on rank {rank}", flush=True)


def ranks_abort_in_main() -> None:
    """The last rank raises in its main thread."""
    def fail():
        raise RuntimeError("boom from the failing rank")
    _train_then_fail(fail)


def ranks_abort_in_thread() -> None:
    """The last rank's thread raises while its main thread waits for that thread's result."""
    def fail():
        done = threading.Event()

        def comm_thread():
            1 / 0          # noqa: B018 - the thread dies; ``done`` is never set
            done.set()

        threading.Thread(target=comm_thread, name="hvdc-comm-test").start()
        done.wait(float(os.environ.get("HVDC_THREAD_WAIT_S", "120")))   # without the hook: waits
    _train_then_fail(fail)


def ranks_abort_plain() -> None:
    """Control: a plain ``torch.distributed`` all_reduce, nothing of ours called or installed."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == size - 1:
        raise RuntimeError("boom from the failing rank (plain torch.distributed)")
    dist.all_reduce(x)
    print(f"unreachable on rank {rank}", flush=True)


# ------------------------------------------------------------------ checks
def expect_error(fn, *needles):
    """``fn`` must raise on this rank with every needle in its message; returns the message."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        text = f"{type(exc).__name__}: {exc}"
        missing = [n for n in needles if n not in text]
        if missing:
            raise AssertionError(f"error lacks {missing}: {text[-2000:]}") from exc
        return text
    raise AssertionError(f"no error (expected one mentioning {needles})")


def agree_on(text):
    """Every rank's outcome must be equal (the same words on every rank)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, text)
    assert all(o == out[0] for o in out), f"ranks differ: {out}"


def mismatch_in_hook(rank, label, method_kwargs_per_rank, needles, **model_kwargs):
    """Build DDP + hook with per-rank method arguments; the first backward must raise on every rank."""
    name, kwargs = method_kwargs_per_rank(rank)
    ddp, _ = ddp_with_hook(mlp(**model_kwargs), make(name, **kwargs))
    text = expect_error(lambda: backward(ddp, rank, 0), "TensorMismatchError", *needles)
    agree_on(text[text.index("TensorMismatchError"):].split("\n")[0])
    return text


def refused_before_ddp(model):
    """Our check before wrapping (DDP's own check raises on one rank only and the other waits in
    its parameter broadcast: PyTorch 2.13, gloo): the same TensorMismatchError on every rank."""
    from horovod_compress.torch.model_check import check_same_model
    text = expect_error(lambda: check_same_model(model), "TensorMismatchError", "differ across ranks")
    agree_on(text)
    return text


def check_model_shape(rank):
    """A different layer width on one rank: refused on every rank, naming the tensor."""
    return refused_before_ddp(mlp(hidden=48 + rank))


def check_param_count(rank):
    """One more layer on one rank: refused on every rank."""
    return refused_before_ddp(mlp(extra=rank == 1))


def check_param_names(rank, name):
    """The same shapes under other parameter names on one rank (order of names differs):
    DDP accepts it; the hook's signature check names the tensors on every rank."""
    return mismatch_in_hook(rank, name, lambda r: (name, {}), ["tensor name"], swap=rank == 1)


def check_bucket_layout(rank, name):
    """Different ``bucket_cap_mb`` per rank: never a hang, never a silent wrong result.

    DDP's first iteration puts every parameter into one bucket whatever the
    cap; from the second on the caps could differ. PyTorch 2.13 (the pinned
    version) makes the layouts agree -- it rebuilds every rank's buckets
    from rank 0's -- so every step must run and leave bit-identical
    parameters everywhere. Another PyTorch could keep the layouts apart;
    the hook's check must then name the differing tensors on every rank
    (the second outcome below), and this check fails until the expected
    outcome is updated for that version (``EXPECTED_BUCKET_OUTCOMES``).
    """
    ddp, _ = ddp_with_hook(mlp(), make(name), bucket_cap_mb=0.004 if rank == 0 else 25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    outcomes = []
    for step in range(3):
        try:
            backward(ddp, rank, step)
            opt.step()
            opt.zero_grad()
            outcomes.append("ok")
        except Exception as exc:  # noqa: BLE001
            text = f"{type(exc).__name__}: {exc}"
            assert "TensorMismatchError" in text and "tensor name" in text, text[-2000:]
            outcomes.append("mismatch")
            break
    agree_on(outcomes)
    if outcomes[-1] == "ok":
        assert same_everywhere(list(ddp.parameters())), "layouts differ yet no error"
    expected = EXPECTED_BUCKET_OUTCOMES.get(".".join(torch.__version__.split(".")[:2]))
    assert outcomes == expected, (torch.__version__, outcomes, expected)
    return outcomes


#: What :func:`check_bucket_layout` sees per PyTorch version (major.minor): 2.13 makes every
#: rank's buckets rank 0's, so all three steps run.
EXPECTED_BUCKET_OUTCOMES = {"2.13": ["ok", "ok", "ok"]}


def check_dtype(rank):
    """float64 model on one rank: refused by DDP or by the hook's check, on every rank, never a hang."""
    dtype = torch.float64 if rank == 1 else torch.float32
    try:
        ddp, _ = ddp_with_hook(mlp(dtype=dtype), make("topk"))
        backward(ddp, rank, 0, dtype=dtype)
    except Exception as exc:  # noqa: BLE001
        text = f"{type(exc).__name__}: {exc}"
        where = "hook" if "TensorMismatchError" in text else "ddp"
        if where == "hook":
            assert "dtype" in text, text
        agree_on(where)
        return where
    raise AssertionError("a float32/float64 model pair trained without an error")


def check_nonfinite(rank, size, name, policy, value):
    """NaN/Inf on the last rank at step 2: skip/propagate leave the method's state untouched, so
    the next clean steps are finite, equal everywhere and bit-identical to a run without the bad
    step (the optimizer step is dropped there, as a loss scaler does); raise errors on every rank."""
    ddp, hs = ddp_with_hook(mlp(), make(name, nonfinite=policy))
    ref, _ = ddp_with_hook(mlp(), make(name, nonfinite=policy))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        for m, o in ((ddp, opt), (ref, ref_opt)):
            o.zero_grad()
            backward(m, rank, step)
            o.step()
    opt.zero_grad()
    poison = torch.tensor(value) if rank == size - 1 else None
    if policy == "raise":
        text = expect_error(lambda: backward(ddp, rank, 2, poison=poison),
                            "NonFiniteGradientError", f"rank {size - 1}")
        agree_on(text.split("\n")[0])
        return
    backward(ddp, rank, 2, poison=poison)
    grads = [p.grad for p in ddp.parameters()]
    if policy == "skip":
        assert hs.method.skipped_steps >= 1 and hs.statistics()["skipped_steps"] >= 1
        assert all(not g.any() for g in grads), "skip must hand DDP zeros"
    else:
        assert not all(torch.isfinite(g).all() for g in grads), "propagate must show the NaN/Inf"
        assert same_everywhere(grads)
    for st in hs.method.state.values():            # feedback never keeps a non-finite value
        for key, arr in st.items():
            if isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
                assert np.isfinite(arr).all(), (name, policy, key)
    for step in range(3, 5):
        for m, o in ((ddp, opt), (ref, ref_opt)):
            o.zero_grad()
            backward(m, rank, step)
            o.step()
        params = list(ddp.parameters())
        assert all(torch.isfinite(p).all() for p in params), (name, policy, step)
        assert same_everywhere(params), (name, policy, step)
        for a, b in zip(params, ref.parameters()):
            assert torch.equal(a, b), (name, policy, step, "differs from the run without the bad step")


def checks_table(rank: int, size: int) -> list[tuple[str, object]]:
    """Every check as ``(label, callable)``, in the order every rank runs them."""
    table = [("model_shape_refused_before_ddp", lambda: check_model_shape(rank)),
             ("param_count_refused_before_ddp", lambda: check_param_count(rank)),
             ("dtype", lambda: check_dtype(rank))]
    for name in METHODS:
        table.append((f"seed[{name}]", lambda name=name: mismatch_in_hook(
            rank, name, lambda r: (name, {"seed": r}), ["method parameter seed"])))
    table += [
        ("density[topk]", lambda: mismatch_in_hook(
            rank, "topk", lambda r: ("topk", {"density": 0.05 * (1 + r)}),
            ["method parameter density", "rank 0 0.05", "rank 1 0.1"])),
        ("rank[powersgd]", lambda: mismatch_in_hook(
            rank, "powersgd", lambda r: ("powersgd", {"rank": 2 + r}), ["method parameter rank"])),
        ("method[topk_vs_randk]", lambda: mismatch_in_hook(
            rank, "topk", lambda r: ("topk" if r == 0 else "randk", {}), ["method parameter name"])),
        ("nonfinite_policy[powersgd]", lambda: mismatch_in_hook(
            rank, "powersgd", lambda r: ("powersgd", {"nonfinite": "skip"} if r else {}),
            ["method parameter nonfinite"])),
    ]
    for name in ("topk", "powersgd", "oktopk"):
        table.append((f"param_names[{name}]", lambda name=name: check_param_names(rank, name)))
    for name in ("topk", "powersgd"):
        table.append((f"bucket_layout[{name}]", lambda name=name: check_bucket_layout(rank, name)))
    for name in METHODS:
        for policy, value in (("skip", float("nan")), ("propagate", float("inf"))):
            table.append((f"nonfinite[{name}-{policy}]",
                          lambda name=name, policy=policy, value=value: check_nonfinite(
                              rank, size, name, policy, value)))
    for name in ("topk", "powersgd"):
        table.append((f"nonfinite[{name}-raise]",
                      lambda name=name: check_nonfinite(rank, size, name, "raise", float("nan"))))
    return table


def ranks_checks(out: str) -> None:
    """Every check of :func:`checks_table`, each reported by label in ``OUT/checks_rank<r>.json``."""
    out = Path(out)
    rank, size = dist.get_rank(), dist.get_world_size()
    results = {}
    for label, fn in checks_table(rank, size):
        start = time.monotonic()
        try:
            fn()
            results[label] = "ok"
        except Exception:  # noqa: BLE001 - reported by label
            results[label] = traceback.format_exc(limit=8)[-3000:]
        dist.barrier()
        if rank == 0:
            print(f"{label}: {results[label][:2]} {time.monotonic() - start:.1f} s", flush=True)
    assert "mpi4py" not in sys.modules
    out.mkdir(parents=True, exist_ok=True)
    (out / f"checks_rank{rank}.json").write_text(json.dumps(results))


# ====================================================== tests
def _torchrun(nprocs: int, entry, *args: str, timeout: float, extra_env=None):
    start = time.monotonic()
    """Run this file's ``entry`` (one of :data:`ENTRY_POINTS`) on ``nprocs`` torchrun ranks."""
    proc = subprocess.run(torchrun_command(nprocs, __file__, entry.__name__, *args),
                          capture_output=True, text=True, timeout=timeout,
                          env=torchrun_env(extra_env), cwd=ROOT)
    return proc, time.monotonic() - start


@pytest.mark.mpi
@pytest.mark.parametrize("entry,error", [(ranks_abort_in_main, "RuntimeError"),
                                         (ranks_abort_in_thread, "ZeroDivisionError")])
def test_exception_on_one_rank_ends_the_torchrun_job(entry, error):
    """The last rank raises while the other waits in the hook's collective: ends promptly, non-zero, naming it."""
    proc, seconds = _torchrun(2, entry, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"[hvdc] rank 1 of 2: uncaught {error}" in out, out[-6000:]
    assert "torchrun stops every other rank" in out
    assert "unreachable" not in out, out[-6000:]
    assert seconds < 60, (seconds, out[-6000:])


@pytest.mark.mpi
def test_thread_exception_hangs_without_our_hook():
    """Control: with ``HVDC_ABORT_ON_EXCEPTION=0`` a thread's exception does not end its rank, so the job
    waits (here bounded by the script's own 10 s wait); with the hook it ends at once (test above)."""
    proc, seconds = _torchrun(2, ranks_abort_in_thread, timeout=120,
                              extra_env={"HVDC_ABORT_ON_EXCEPTION": "0", "HVDC_THREAD_WAIT_S": "10"})
    out = proc.stdout + proc.stderr
    assert "[hvdc] rank" not in out, out[-6000:]
    assert seconds >= 10, (seconds, out[-6000:])


@pytest.mark.mpi
def test_plain_torch_distributed_failure_ends_by_torchrun():
    """Control without our code: a main-thread exception is ended by torchrun's agent (nothing of ours printed)."""
    proc, seconds = _torchrun(2, ranks_abort_plain, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "[hvdc]" not in out and "unreachable" not in out, out[-6000:]
    assert seconds < 60


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability-torchrun")
    proc, _ = _torchrun(2, ranks_checks, str(out), timeout=900,
                        extra_env={"HVDC_ABORT_ON_EXCEPTION": "0"})
    if proc.returncode != 0:
        raise AssertionError(f"torchrun checks failed (exit {proc.returncode})\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return [json.loads((out / f"checks_rank{r}.json").read_text()) for r in range(2)]


def _labels() -> list[str]:
    """The labels of :func:`checks_table` (what the test expects in every rank's JSON)."""
    return [label for label, _ in checks_table(0, 2)]


@pytest.mark.mpi
@pytest.mark.parametrize("label", _labels())
def test_ddp_hook_check(checks, label):
    """Each mismatch is refused on every rank with the same words; each NaN/Inf policy recovers or raises."""
    for rank, res in enumerate(checks):
        assert res.get(label) == "ok", f"rank {rank}, {label}:\n{res.get(label)}"


# What ``python tests/test_reliability_torchrun.py ENTRY [OUT]`` runs on torchrun ranks.
ENTRY_POINTS = (ranks_abort_in_main, ranks_abort_in_thread, ranks_abort_plain, ranks_checks)


if __name__ == "__main__":
    sys.meta_path.insert(0, _BlockMPI())
    _entry = {f.__name__: f for f in ENTRY_POINTS}[sys.argv[1]]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    _entry(*sys.argv[2:])
    dist.barrier()
    dist.destroy_process_group()
