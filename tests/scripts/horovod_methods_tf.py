"""Every method inside Horovod's own TensorFlow DistributedGradientTape (run under horovodrun -np 2).

For each method x op (Average, Sum), inside a ``tf.function`` step with plain
``tf.Variable``s (Horovod 0.28's tape needs ``Variable.ref()``, which Keras 3
variables lack): the gradients Horovod's tape returns must equal, step after
step, what the method's own ``allreduce`` gives on the same local gradients
under the same tensor names (a fresh instance of the method, times P for Sum);
``none``/``fp16``/``bf16``, which Horovod reduces itself, the dense average.
Every compressed method also against a NumPy oracle of its paper
(``tf_oracle[<method>]``, method_oracles.py beside this script). Plus: direct ``hvd.allreduce``, Adasum refused, the uncalled factory.
Writes {check: "ok" | error text} as JSON (rank 0) to the path given as the
only argument: ``tf_tape[<method>-<op>]`` for each method x op, and each
``case_*(comm)`` below under its function name (tests/test_horovod_methods.py
finds them by name). Launched by horovodrun (it imports Horovod at the top and
runs every check on import), so it is not a test module.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod_compress as hvdc  # noqa: E402
import horovod_compress.tensorflow as hvdc_tf  # noqa: E402
from horovod_compress.tools.testing import CheckRecorder, same_on_all_ranks  # noqa: E402
from method_oracles import ORACLE_PARAMS, MethodOracle  # noqa: E402  (beside this script)

hvd.init()
hvdc_tf.init()
comm = hvdc_tf.communicator()
RANK, SIZE = comm.rank, comm.size
STEPS = 3
_checks = CheckRecorder(comm)          # each check "ok" or its error, by name
report, record, case = _checks.report, _checks.record, _checks.case


def variables():
    g = np.random.default_rng(0)
    return [tf.Variable(g.standard_normal((32, 16)).astype(np.float32) * 0.2, name="W1"),
            tf.Variable(np.zeros(16, np.float32), name="b1"),
            tf.Variable(g.standard_normal((16, 8)).astype(np.float32) * 0.2, name="W2")]


def batch(step, rank=RANK):
    g = np.random.default_rng(1000 * step + rank)
    return (tf.constant(g.standard_normal((8, 32)).astype(np.float32)),
            tf.constant(g.standard_normal((8, 8)).astype(np.float32)))


def loss_fn(vs, x, y):
    h = tf.nn.relu(x @ vs[0] + vs[1])
    return tf.reduce_mean((h @ vs[2] - y) ** 2)


def local_grads(vs, x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(vs, x, y)
    return [g.numpy() for g in tape.gradient(loss, vs)]


def run(method_name, op, factory=False):
    vs = variables()
    make = getattr(hvdc.Compression, method_name)
    comp = make if factory else make()
    mine = make()
    # Record what the adapter hands the method (graph-mode gradients may round
    # differently from eager ones), then replay it through a fresh instance.
    inst = comp.default() if factory else comp
    seen = {}
    original = inst.allreduce

    def spy(x, name, c):
        seen[name] = np.array(x, copy=True)
        return original(x, name, c)

    inst.allreduce = spy

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, x, y)
        tape = hvd.DistributedGradientTape(tape, compression=comp, op=op)
        return tape.gradient(loss, vs)

    for step in range(STEPS):
        x, y = batch(step)
        got = [g.numpy() for g in step_fn(x, y)]
        local = local_grads(vs, x, y)
        scale = SIZE if op == hvd.Sum else 1
        if method_name in ("none", "fp16", "bf16"):
            tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}[method_name]
            for g, l in zip(got, local):
                r = comm.allgather(l).mean(0) * scale
                assert np.allclose(g, r, rtol=tol, atol=tol * np.abs(r).max()), \
                    (step, np.abs(g - r).max())
        else:
            for j, (g, l, v) in enumerate(zip(got, local, vs)):
                name = v.name[:-2] if v.name.endswith(":0") else v.name
                key = f"tape/{j}/{name}"
                assert key in seen, f"the method never saw {key}; it saw {sorted(seen)}"
                x = seen.pop(key)
                assert np.allclose(x, l, rtol=1e-5, atol=1e-6), \
                    f"step {step} {name}: the method got {np.abs(x - l).max()} off the gradient"
                want = mine.allreduce(x, key, comm) * np.float32(scale)
                assert np.array_equal(g, want), \
                    f"step {step} {name}: differs by {np.abs(g - want).max()}"
        for g in got:
            assert same_on_all_ranks(comm, g), "ranks disagree"
        for v, g in zip(vs, got):
            v.assign_sub(0.05 * g)


for name in hvdc.Compression.available():
    for op_label, op in (("Average", hvd.Average), ("Sum", hvd.Sum)):
        record(f"tf_tape[{name}-{op_label}]", lambda name=name, op=op: run(name, op))


def against_the_oracle(method_name):
    """Horovod's tape (inside ``tf.function``) with the method (its
    :data:`method_oracles.ORACLE_PARAMS`), three steps, each step's gradients against the
    NumPy reference of :class:`method_oracles.MethodOracle`, built from every rank's local
    gradients without running any of our code; the tape reduces each tensor on its own."""
    vs = variables()
    method = getattr(hvdc.Compression, method_name)(**ORACLE_PARAMS[method_name])
    oracle = MethodOracle(method_name)

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, x, y)
        tape = hvd.DistributedGradientTape(tape, compression=method, op=hvd.Average)
        return tape.gradient(loss, vs)

    for step in range(STEPS):
        x, y = batch(step)
        ranks = [comm.allgather(g) for g in local_grads(vs, x, y)]
        got = [g.numpy() for g in step_fn(x, y)]
        oracle.check(step, got, ranks, fused=False)
        for v, g in zip(vs, got):
            v.assign_sub(0.05 * g)


for name in ORACLE_PARAMS:
    record(f"tf_oracle[{name}]", lambda name=name: against_the_oracle(name))


@case
def case_uncalled_factory_topk(comm):
    run("topk", hvd.Average, factory=True)


@case
def case_allreduce_direct_topk(comm):
    x = batch(5)[0]
    m1, m2 = hvdc.Compression.topk(density=0.1), hvdc.Compression.topk(density=0.1)
    for step in range(2):
        got = hvd.allreduce(x * (step + 1), name="direct.x", compression=m1).numpy()
        want = m2.allreduce((x * (step + 1)).numpy(), "direct.x", comm)
        assert np.array_equal(got, want), np.abs(got - want).max()


@case
def case_adasum_refused_topk(comm):
    vs = variables()
    x, y = batch(0)
    with tf.GradientTape() as tape:
        loss = loss_fn(vs, x, y)
    tape = hvd.DistributedGradientTape(tape, compression=hvdc.Compression.topk(), op=hvd.Adasum)
    try:
        tape.gradient(loss, vs)
    except ValueError as exc:
        assert "Adasum" in str(exc), exc
        return
    raise AssertionError("Adasum with topk was not refused")


if RANK == 0:
    json.dump(report, open(sys.argv[1], "w"), indent=1)
comm.barrier()
