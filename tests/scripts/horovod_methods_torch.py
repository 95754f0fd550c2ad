"""Every method inside Horovod's own PyTorch DistributedOptimizer (run under horovodrun -np 2).

For each method x op (Average, Sum): Horovod's optimizer with the method must
give, step after step, exactly the gradients our own
``horovod_compress.torch.DistributedOptimizer`` gives with a fresh instance of
the same method (same buckets, names, state) -- and ``none``/``fp16``/``bf16``,
which Horovod reduces itself, the dense average. Every compressed method also
against a NumPy oracle of its paper (``torch_oracle[<method>]``, method_oracles.py
beside this script), and digits training against dense. Plus the options: Adasum
refused for compressed methods, predivide, backward_passes_per_step, the
uncalled factory, direct ``hvd.allreduce``, non-linear ops and reducescatter
refused, a process set. Writes {check: "ok" | error text} as JSON (rank 0) to
the path given as the only argument (with ``HVDC_ORACLES_ONLY=1``, as the
4-rank launch runs it, only the oracle checks): ``torch_optimizer[<method>-<op>]`` for
each method x op, and each ``case_*(comm)`` below under its function name
(tests/test_horovod_methods.py finds them by name). Launched by horovodrun
(it imports Horovod at the top and runs every check on import), so it is not
a test module.
"""
import json
import os
import sys

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")

import horovod.torch as hvd  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import horovod_compress as hvdc  # noqa: E402
import horovod_compress.torch as hvdc_torch  # noqa: E402
from horovod_compress.mpi_collectives import Communicator  # noqa: E402
from horovod_compress.tools.testing import CheckRecorder, same_on_all_ranks  # noqa: E402
from method_oracles import ORACLE_PARAMS, RESIDUAL_PARAMS, MethodOracle  # noqa: E402  (beside this script)

hvd.init()
hvdc_torch.init()
torch.set_num_threads(1)
comm = hvdc_torch.communicator()
RANK, SIZE = comm.rank, comm.size
STEPS = 3
_checks = CheckRecorder(comm)          # each check "ok" or its error, by name
report, record, case = _checks.report, _checks.record, _checks.case


def model_pair(seed=0):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    b = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    b.load_state_dict(a.state_dict())
    return a, b


def batch(step, rank=RANK):
    g = np.random.default_rng(1000 * step + rank)
    return (torch.from_numpy(g.standard_normal((8, 32)).astype(np.float32)),
            torch.from_numpy(g.standard_normal((8, 8)).astype(np.float32)))


def grads(model):
    return [p.grad.detach().clone().numpy() for p in model.parameters()]


def backward(model, step, passes=1):
    for k in range(passes):
        x, y = batch(10 * step + k)
        ((model(x) - y) ** 2).mean().backward()


def dense_reference(model_fresh, step):
    """Every rank's local gradients at the model's current weights, averaged."""
    model_fresh.zero_grad()
    backward(model_fresh, step)
    local = grads(model_fresh)
    return [comm.allgather(g).mean(0) for g in local]


def same_on_ranks(arrays):
    for a in arrays:
        assert same_on_all_ranks(comm, a), "ranks disagree"


def run_pair(method_name, op, hvd_kwargs=None, our_kwargs=None, passes=1, factory=False):
    a, b = model_pair()
    params = {}
    make = getattr(hvdc.Compression, method_name)
    comp_a = make if factory else make(**params)
    comp_b = make(**params)
    opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.05),
                                     named_parameters=a.named_parameters(), compression=comp_a,
                                     op=op, backward_passes_per_step=passes, **(hvd_kwargs or {}))
    opt_b = hvdc_torch.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.05),
                                            named_parameters=b.named_parameters(),
                                            compression=comp_b, op=op,
                                            backward_passes_per_step=passes, **(our_kwargs or {}))
    worst = 0.0
    for step in range(STEPS):
        ref = None
        if method_name in ("none", "fp16", "bf16"):
            fresh, _ = model_pair()
            fresh.load_state_dict(a.state_dict())
            ref = dense_reference(fresh, step) if passes == 1 else None
        for opt, m in ((opt_a, a), (opt_b, b)):
            opt.zero_grad()
            backward(m, step, passes)
            opt.synchronize()
        ga, gb = grads(a), grads(b)
        if ref is not None:
            scale = SIZE if op == hvd.Sum else 1.0
            tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}[method_name]
            for x, r in zip(ga, ref):
                assert np.allclose(x, r * scale, rtol=tol, atol=tol * np.abs(r).max() * scale), \
                    (method_name, step, np.abs(x - r * scale).max())
        else:
            exact = not (our_kwargs or hvd_kwargs)   # predivide rounds differently
            for x, y in zip(ga, gb):
                worst = max(worst, float(np.abs(x - y).max()))
                ok = np.array_equal(x, y) if exact else \
                    np.allclose(x, y, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(y).max())))
                assert ok, (f"step {step}: Horovod's optimizer differs from ours by "
                            f"{np.abs(x - y).max()} (max |ours| {np.abs(y).max()})")
        same_on_ranks(ga)
        for opt in (opt_a, opt_b):
            with opt.skip_synchronize():
                opt.step()
    same_on_ranks([p.detach().numpy() for p in a.parameters()])
    opt_b.close()
    return worst


def against_the_oracle(method_name, residual=False):
    """Horovod's optimizer with the method (its :data:`method_oracles.ORACLE_PARAMS`), three
    steps, each step's averaged gradients against the NumPy reference of
    :class:`method_oracles.MethodOracle`, built from every rank's local gradients (a plain
    model at the same weights) without running any of our code. Flat methods see the
    optimizer's one fused bucket (the four small tensors share it)."""
    a, fresh = model_pair()
    params = (RESIDUAL_PARAMS if residual else ORACLE_PARAMS)[method_name]
    method = getattr(hvdc.Compression, method_name)(**params)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.05),
                                   named_parameters=a.named_parameters(), compression=method,
                                   op=hvd.Average)
    oracle = MethodOracle(method_name, residual=residual)
    for step in range(STEPS):
        fresh.load_state_dict(a.state_dict())
        fresh.zero_grad()
        backward(fresh, step)
        ranks = [comm.allgather(g) for g in grads(fresh)]
        opt.zero_grad()
        backward(a, step)
        opt.synchronize()
        oracle.check(step, grads(a), ranks, fused=True)
        with opt.skip_synchronize():
            opt.step()
    same_on_ranks([p.detach().numpy() for p in a.parameters()])


def write_report():
    if RANK == 0:
        json.dump(report, open(sys.argv[1], "w"), indent=1)
    comm.barrier()


for name in ORACLE_PARAMS:
    record(f"torch_oracle[{name}]", lambda name=name: against_the_oracle(name))
for name in RESIDUAL_PARAMS:
    record(f"torch_oracle[{name}+residual]", lambda name=name: against_the_oracle(name, True))
if os.environ.get("HVDC_ORACLES_ONLY") == "1":    # the 4-rank launch: the oracles alone
    write_report()
    sys.exit(0)


for name in hvdc.Compression.available():
    for op_label, op in (("Average", hvd.Average), ("Sum", hvd.Sum)):
        record(f"torch_optimizer[{name}-{op_label}]",
               lambda name=name, op=op: run_pair(name, op))


@case
def case_topk_against_a_numpy_reference(comm):
    """An oracle independent of our optimizer: Horovod's optimizer with Top-k (no feedback)
    gives, step after step, the average over ranks of each rank's k largest |gradient| entries
    of the fused bucket (these four small tensors share one 64 MB bucket: k = max(1, round(
    density n)) of their n entries together), built here from NumPy alone ("Sparse
    Communication for Distributed Gradient Descent", Aji and Heafield 2017, Section 2), with
    each rank's local gradient taken by a plain model at the same weights."""
    density = 0.25
    a, fresh = model_pair()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.05),
                                   named_parameters=a.named_parameters(),
                                   compression=hvdc.Compression.topk(density=density, feedback="none"),
                                   op=hvd.Average)
    for step in range(STEPS):
        fresh.load_state_dict(a.state_dict())
        fresh.zero_grad()
        backward(fresh, step)
        local = np.concatenate([g.reshape(-1) for g in grads(fresh)])
        opt.zero_grad()
        backward(a, step)
        opt.synchronize()
        got = np.concatenate([g.reshape(-1) for g in grads(a)])
        n = local.size
        k = min(n, max(1, round(density * n)))
        want = np.zeros(n)
        for row in comm.allgather(local).astype(np.float64):     # (P, n)
            top = np.argsort(-np.abs(row), kind="stable")[:k]
            want[top] += row[top]
        want /= SIZE
        assert np.array_equal(np.flatnonzero(got), np.flatnonzero(want)), step
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        with opt.skip_synchronize():
            opt.step()
    same_on_ranks([p.detach().numpy() for p in a.parameters()])


def digits_accuracy(compression, epochs=10, batch_size=64):
    """Test accuracy after training a 64-64-10 MLP on scikit-learn's 8x8 digits (1,797 real
    images, 360 held out) with Horovod's DistributedOptimizer (SGD, lr 0.1, momentum 0.9),
    each rank on its own half of the training set in a seeded order (10 epochs of 11 steps)."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.from_numpy((data.data / 16.0).astype(np.float32))
    y = torch.from_numpy(data.target.astype(np.int64))
    order = np.random.default_rng(0).permutation(len(y))
    test, train = order[:360], order[360:][RANK::SIZE]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    steps = len(train) // batch_size
    for epoch in range(epochs):
        shuffled = np.random.default_rng([epoch, RANK]).permutation(train)
        for step in range(steps):
            idx = torch.from_numpy(shuffled[step * batch_size:(step + 1) * batch_size])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    same_on_ranks([p.detach().numpy() for p in model.parameters()])
    with torch.no_grad():
        return float((model(x[test]).argmax(1) == y[test]).float().mean())


#: Methods trained on the digits through Horovod's optimizer with their default feedback: one
#: sparsifier, one quantizer, one low-rank method (each method's own convergence on the digits
#: through our front-end is tested in its own file; torch_optimizer[...] shows Horovod's
#: optimizer gives exactly our optimizer's gradients).
DIGITS_METHODS = {"topk": dict(density=0.05), "global_qsgd": dict(), "powersgd": dict(rank=4)}


@case
def case_digits_training_against_dense(comm):
    """Convergence on real data, an oracle that runs none of our code for its reference:
    dense training with Horovod's own allreduce (``Compression.none``, Horovod's native path)
    reaches >= 90 % test accuracy on the digits, and each compressed method, with its default
    error feedback, ends within 3 points of it after the same 10 epochs (the compressed
    methods' convergence results: Top-k with residual feedback, Stich et al., "Sparsified SGD
    with Memory", 2018, Theorem 2.4; Global-QSGD unbiased with bounded variance, Xin et al.,
    Section 6; PowerSGD with error feedback, Vogels et al. 2019, Section 3)."""
    dense = digits_accuracy(hvdc.Compression.none())
    assert dense >= 0.9, f"dense training reached {dense:.3f}"
    worst = {}
    for name, params in DIGITS_METHODS.items():
        acc = digits_accuracy(getattr(hvdc.Compression, name)(**params))
        worst[name] = acc
    print(f"digits accuracy: dense {dense:.3f}, " +
          ", ".join(f"{k} {v:.3f}" for k, v in worst.items()), flush=True)
    low = {k: v for k, v in worst.items() if v < dense - 0.03}
    assert not low, f"more than 3 points below dense ({dense:.3f}): {low}"


@case
def case_uncalled_factory_topk(comm):
    run_pair("topk", hvd.Average, factory=True)


@case
def case_uncalled_factory_fp16(comm):
    run_pair("fp16", hvd.Average, factory=True)


@case
def case_predivide_topk(comm):
    run_pair("topk", hvd.Average, hvd_kwargs={"gradient_predivide_factor": 4.0},
             our_kwargs={"gradient_predivide_factor": 4.0})


@case
def case_backward_passes_topk(comm):
    run_pair("topk", hvd.Average, passes=2)


@case
def case_adasum_refused_topk(comm):
    a, _ = model_pair()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.05),
                                   named_parameters=a.named_parameters(),
                                   compression=hvdc.Compression.topk(), op=hvd.Adasum)
    opt.zero_grad()
    try:
        backward(a, 0)
    except ValueError as exc:
        assert "Adasum" in str(exc), exc
        return
    raise AssertionError("Adasum with topk was not refused")


@case
def case_adasum_fp16_runs(comm):
    a, _ = model_pair()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.05),
                                   named_parameters=a.named_parameters(),
                                   compression=hvdc.Compression.fp16(), op=hvd.Adasum)
    opt.zero_grad()
    backward(a, 0)
    opt.step()
    same_on_ranks([p.detach().numpy() for p in a.parameters()])


@case
def case_allreduce_direct_topk_sum(comm):
    x = batch(7)[0]
    m1, m2 = hvdc.Compression.topk(density=0.1), hvdc.Compression.topk(density=0.1)
    for step in range(2):
        got = hvd.allreduce(x * (step + 1), name="direct.x", compression=m1, op=hvd.Sum).numpy()
        want = m2.allreduce((x * (step + 1)).numpy(), "direct.x", comm) * SIZE
        assert np.array_equal(got, want), np.abs(got - want).max()


@case
def case_allreduce_unnamed_stateful_refused(comm):
    try:
        hvd.allreduce(batch(7)[0], compression=hvdc.Compression.oktopk())
    except ValueError as exc:
        assert "name=" in str(exc), exc
        return
    raise AssertionError("no error")


@case
def case_allreduce_min_refused(comm):
    try:
        hvd.allreduce(batch(7)[0], name="min.x", compression=hvdc.Compression.topk(),
                      op=hvd.Min)
    except ValueError as exc:
        assert "non-linear" in str(exc), exc
        return
    raise AssertionError("no error")


@case
def case_reducescatter_refused(comm):
    try:
        hvd.reducescatter(batch(7)[0], compression=hvdc.Compression.topk())
    except ValueError as exc:
        assert "reducescatter" in str(exc), exc
        return
    raise AssertionError("no error")


@case
def case_process_set_topk(comm):
    ps = hvd.add_process_set([0])
    a, b = model_pair()
    opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.05),
                                     named_parameters=a.named_parameters(),
                                     compression=hvdc.Compression.topk(), process_set=ps)
    self_comm = Communicator(__import__("mpi4py").MPI.COMM_SELF)
    opt_b = hvdc_torch.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.05),
                                            named_parameters=b.named_parameters(),
                                            compression=hvdc.Compression.topk(), comm=self_comm)
    for step in range(2):
        for opt, m in ((opt_a, a), (opt_b, b)):
            opt.zero_grad()
            backward(m, step)
            if RANK == 0 or opt is opt_b:
                opt.synchronize()
        if RANK == 0:   # in the set: the method over the set's one rank, as ours gives it
            for x, y in zip(grads(a), grads(b)):
                assert np.array_equal(x, y), np.abs(x - y).max()
        for opt in (opt_a, opt_b):
            if RANK == 0 or opt is opt_b:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
    comm.barrier()
    hvd.remove_process_set(ps)


write_report()
