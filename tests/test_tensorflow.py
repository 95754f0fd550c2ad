"""TensorFlow front-end on real MPI ranks (2 here; the tape cases again at 4 in test_keras.py).

The tape (eager and tf.function) against MPI references, dtypes / None /
IndexedSlices, broadcast, Horovod's own tape with our compressors, and
PyTorch == TensorFlow for every method. Gradients in the cases are exact and
known: the loss ``sum(v * G)`` has gradient ``G``, and every rank can
regenerate every other rank's ``G`` from its seed, so references are computed
locally from all ranks' data.
"""
import inspect

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import horovod_compress as hvdc  # noqa: E402
import horovod_compress.tensorflow as hvdc_tf  # noqa: E402
from horovod_compress.tools.testing import (  # noqa: E402
    horovod_build_skipped,
    run_cases,
    same_on_all_ranks,
    value_error_messages,
)


# --------------------------------------------------------------------------- cases
def _g(seed, rank, step, shape, dtype=np.float32):
    return np.random.default_rng([seed, rank, step]).standard_normal(shape).astype(dtype)


def _both_modes(fn):
    """fn run eagerly and as a tf.function (a fresh trace per call site)."""
    return {"eager": fn, "graph": tf.function(fn)}


# --------------------------------------------------------------------------- none is exact
def case_tape_none_exact(comm):
    """`none` through the tape equals one MPI allreduce of the fused gradients (bit for bit),
    eagerly and in tf.function; op=Sum and gradient_predivide_factor keep Horovod's meaning."""
    from mpi4py import MPI

    p, r = comm.size, comm.rank
    w = tf.Variable(tf.zeros([5, 3]), name="w")
    b = tf.Variable(tf.zeros([3]), name="b")
    out = {}
    for mode in ("eager", "graph"):
        for step in range(2):
            gw, gb = _g(1, r, step, (5, 3)), _g(2, r, step, (3,))

            def grads(op=hvdc_tf.Average, pre=1.0, gw=gw, gb=gb):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(w * gw) + tf.reduce_sum(b * gb)
                tape = hvdc_tf.DistributedGradientTape(tape, op=op, gradient_predivide_factor=pre,
                                                       comm=comm)
                return tape.gradient(loss, [w, b])

            fn = tf.function(grads) if mode == "graph" else grads
            got_w, got_b = (t.numpy() for t in fn())
            # the exchange fuses in reverse variable order: b, then w
            fused = np.concatenate([gb.ravel(), gw.ravel()])
            ref = np.empty_like(fused)
            MPI.COMM_WORLD.Allreduce(fused, ref, op=MPI.SUM)
            ref /= np.float32(p)
            assert np.array_equal(got_b, ref[:3]) and np.array_equal(got_w, ref[3:].reshape(5, 3)), mode
            sum_w, _ = (t.numpy() for t in fn(op=hvdc_tf.Sum))
            hvd_sum_w, _ = (t.numpy() for t in fn(op=1))  # horovod.tensorflow.Sum == 1
            assert np.array_equal(hvd_sum_w, sum_w)
            assert np.allclose(sum_w, ref[3:].reshape(5, 3) * p, rtol=1e-6, atol=1e-6), mode
            pre_w, _ = (t.numpy() for t in fn(pre=4.0))
            assert np.allclose(pre_w, ref[3:].reshape(5, 3), rtol=1e-6, atol=1e-7), mode
        out[mode] = float(got_w.sum())
    return out


# ------------------------------------------------- dtypes, None gradients, IndexedSlices
def _dtype_case_vars():
    return {
        "w32": tf.Variable(tf.zeros([4, 3]), name="w32"),
        "w16": tf.Variable(tf.zeros([5], tf.float16), name="w16"),
        "wbf": tf.Variable(tf.zeros([3, 2], tf.bfloat16), name="wbf"),
        "w64": tf.Variable(tf.zeros([2], tf.float64), name="w64"),
        "emb": tf.Variable(tf.zeros([10, 4]), name="emb"),
        "unused": tf.Variable(tf.zeros([3]), name="unused"),
        "rank0_only": tf.Variable(tf.zeros([2]), name="rank0_only"),
    }


def _dtype_case_grads(rank, step):
    """This rank's G per variable (rows of emb gathered at rank-dependent indices)."""
    return {"w32": _g(10, rank, step, (4, 3)), "w16": _g(11, rank, step, (5,)).astype(np.float16),
            "wbf": _g(12, rank, step, (3, 2)), "w64": _g(13, rank, step, (2,), np.float64),
            "emb_rows": _g(14, rank, step, (3, 4)), "emb_idx": np.array([rank % 10, 7, 7]),
            "rank0_only": _g(15, rank, step, (2,))}


def _dense_grad(rank, step):
    """The dense gradient every variable gets on ``rank`` (zeros where it has none)."""
    g = _dtype_case_grads(rank, step)
    emb = np.zeros((10, 4), np.float32)
    np.add.at(emb, g["emb_idx"], g["emb_rows"])
    wbf = tf.cast(tf.cast(g["wbf"], tf.bfloat16), tf.float32).numpy()
    return {"w32": g["w32"], "w16": g["w16"].astype(np.float32), "wbf": wbf, "w64": g["w64"],
            "emb": emb, "unused": np.zeros(3, np.float32),
            "rank0_only": g["rank0_only"] if rank == 0 else np.zeros(2, np.float32)}


def case_tape_dtypes_none_indexed_slices(comm):
    """float16/bfloat16/float32/float64 variables, a variable no rank reaches, one only rank 0
    reaches, and embedding (IndexedSlices) gradients: eager and graph give the dense average of
    all ranks' gradients in each variable's dtype; ranks agree bit for bit."""
    p, r = comm.size, comm.rank
    v = _dtype_case_vars()
    names = list(v)

    def loss_fn(g):
        loss = tf.reduce_sum(v["w32"] * g["w32"])
        loss += tf.cast(tf.reduce_sum(v["w16"] * g["w16"]), tf.float32)
        loss += tf.reduce_sum(tf.cast(v["wbf"], tf.float32) * g["wbf"])
        loss += tf.cast(tf.reduce_sum(v["w64"] * g["w64"]), tf.float32)
        loss += tf.reduce_sum(tf.gather(v["emb"], g["emb_idx"]) * g["emb_rows"])
        if r == 0:
            loss += tf.reduce_sum(v["rank0_only"] * g["rank0_only"])
        return loss

    g0 = _dtype_case_grads(r, 0)
    with tf.GradientTape() as plain:
        loss = loss_fn(g0)
    raw = plain.gradient(loss, [v[n] for n in names])
    assert isinstance(raw[names.index("emb")], tf.IndexedSlices), "embedding grads must be sparse here"
    assert raw[names.index("unused")] is None

    method = hvdc.Compression.none()
    tol = {"w32": 1e-6, "w16": 2e-3, "wbf": 1e-2, "w64": 1e-12, "emb": 1e-6, "unused": 0,
           "rank0_only": 1e-6}
    for mode in ("eager", "graph"):
        def step_fn(g):
            with tf.GradientTape() as tape:
                loss = loss_fn(g)
            tape = hvdc_tf.DistributedGradientTape(tape, compression=method, comm=comm)
            return tape.gradient(loss, [v[n] for n in names])

        fn = tf.function(step_fn) if mode == "graph" else step_fn
        for step in range(2):
            got = fn(_dtype_case_grads(r, step))
            every = [_dense_grad(q, step) for q in range(p)]
            for n, t in zip(names, got):
                assert isinstance(t, tf.Tensor), (mode, n, type(t))
                assert t.dtype == v[n].dtype, (mode, n, t.dtype)
                want = np.mean([e[n].astype(np.float64) for e in every], axis=0)
                have = tf.cast(t, tf.float64).numpy()
                assert np.allclose(have, want, rtol=tol[n], atol=tol[n]), (mode, n, have, want)
                assert have.shape == tuple(v[n].shape)
            flat = np.concatenate([tf.cast(t, tf.float64).numpy().ravel() for t in got])
            assert same_on_all_ranks(comm, flat), f"{mode}: ranks disagree"
    assert not np.any(_dense_grad(r, 0)["unused"])
    return sorted(names)


# ------------------------------------------------------ state across steps, eager == graph
def case_stateful_eager_equals_graph(comm):
    """A stateful method (topk + residual feedback) gives the same results and the same
    residuals eagerly and in tf.function over several steps, with a new tape every step."""
    r = comm.rank
    w = tf.Variable(tf.zeros([30, 4]), name="layer/kernel")
    b = tf.Variable(tf.zeros([4]), name="layer/bias")
    results = {}
    methods = {}
    for mode in ("eager", "graph"):
        method = hvdc.Compression.topk(density=0.1)
        methods[mode] = method

        def step(gw, gb, method=method):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * gw) + tf.reduce_sum(b * gb)
            return hvdc_tf.DistributedGradientTape(tape, compression=method,
                                                   comm=comm).gradient(loss, [w, b])

        fn = tf.function(step) if mode == "graph" else step
        outs = []
        for s in range(4):
            gw, gb = fn(_g(20, r, s, (30, 4)), _g(21, r, s, (4,)))
            outs.append(np.concatenate([gb.numpy().ravel(), gw.numpy().ravel()]))
        results[mode] = outs
    for a, b_ in zip(results["eager"], results["graph"]):
        assert np.array_equal(a, b_)
    se, sg = methods["eager"].state["bucket0"], methods["graph"].state["bucket0"]
    assert se.t == sg.t == 4
    assert np.array_equal(se["fb_residual"], sg["fb_residual"]) and np.abs(se["fb_residual"]).sum() > 0
    # names come from the variables, in reverse order (backprop order), fused in one bucket
    reducer = hvdc_tf.DistributedGradientTape(tf.GradientTape(), compression=methods["eager"],
                                              comm=comm).reducer
    specs = reducer.variable_sets()[0].specs
    assert [s.name for s in specs] == ["layer/bias", "layer/kernel"], specs
    return [float(o.sum()) for o in results["eager"]]


# ----------------------------------------------------------------------------- broadcast
def case_broadcast_variables(comm):
    """broadcast_variables gives every rank the root's values, eagerly and in tf.function, for
    float32/bfloat16/float16/int32 variables, with the Communicator's exact byte counts."""
    p, r = comm.size, comm.rank
    vs = [tf.Variable(tf.fill([3, 2], float(r))), tf.Variable(tf.fill([4], tf.cast(r + 0.5, tf.bfloat16))),
          tf.Variable(tf.fill([2], tf.cast(r - 1, tf.float16))), tf.Variable(tf.fill([5], r))]
    nbytes = 6 * 4 + 4 * 2 + 2 * 2 + 5 * 4
    root = p - 1
    comm.reset_stats()
    hvdc_tf.broadcast_variables(vs, root_rank=root, comm=comm)
    assert comm.bytes_sent == (nbytes if r == root else 0)
    assert comm.bytes_received == (0 if r == root else nbytes)
    assert np.all(vs[0].numpy() == root) and np.all(tf.cast(vs[1], tf.float32).numpy() == root + 0.5)
    assert np.all(vs[2].numpy() == root - 1) and np.all(vs[3].numpy() == root)
    for v in vs:
        v.assign(v + tf.cast(r + 1, v.dtype))

    @tf.function
    def in_graph():
        hvdc_tf.broadcast_variables(vs, root_rank=0, comm=comm)

    in_graph()
    assert np.all(vs[0].numpy() == root + 1) and np.all(vs[3].numpy() == root + 1)
    flat = np.concatenate([tf.cast(v, tf.float64).numpy().ravel() for v in vs])
    assert same_on_all_ranks(comm, flat)
    with_bad_root = False
    try:
        hvdc_tf.broadcast_variables(vs, root_rank=p, comm=comm)
    except ValueError as exc:
        with_bad_root = "root_rank" in str(exc)
    assert with_bad_root
    return True


# ----------------------------------------------------------- allreduce, errors, mismatches
def case_allreduce_and_errors(comm):
    """hvdc_tf.allreduce (fp16 on the wire) against the dense average; tensor mismatches raise
    a ValueError naming the tensor on every rank; bad arguments raise ValueError."""
    p, r = comm.size, comm.rank
    x = _g(30, r, 0, (7,))
    want = np.mean([_g(30, q, 0, (7,)) for q in range(p)], axis=0)
    for fn in (lambda t: hvdc_tf.allreduce(t, name="x", compression=hvdc.Compression.fp16(), comm=comm),
               tf.function(lambda t: hvdc_tf.allreduce(t, name="x", comm=comm))):
        got = fn(tf.constant(x)).numpy()
        assert got.dtype == np.float32 and np.allclose(got, want, rtol=2e-3, atol=2e-3)
    summed = hvdc_tf.allreduce(tf.constant(x, tf.float64), op=hvdc_tf.Sum, comm=comm).numpy()
    assert summed.dtype == np.float64 and np.allclose(summed, want * p, rtol=1e-6)

    v = tf.Variable(tf.zeros([3 if r == 0 else 4]), name="mismatched")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v)
    try:
        hvdc_tf.DistributedGradientTape(tape, comm=comm).gradient(loss, [v])
    except ValueError as exc:
        assert "differ across ranks" in str(exc) and "'mismatched'" in str(exc), str(exc)
    else:
        raise AssertionError("mismatch not detected")

    errors = value_error_messages([
        lambda: hvdc_tf.DistributedGradientTape(tf.GradientTape(), compression="topk"),
        lambda: hvdc_tf.DistributedGradientTape(tf.GradientTape(), comm=comm, op="max"),
        lambda: hvdc_tf.DistributedGradientTape(tf.GradientTape(), comm=comm,
                                                gradient_predivide_factor=0),
        lambda: hvdc_tf.DistributedGradientTape(object(), comm=comm)])
    iv = tf.Variable([1, 2])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.cast(iv, tf.float32))
    try:
        hvdc_tf.DistributedGradientTape(tape, comm=comm).reducer.reduce([tf.constant([1, 1])], [iv])
    except ValueError as exc:
        errors.append(str(exc))
    else:
        raise AssertionError("integer gradient accepted")
    try:  # XLA cannot compile the Python bridge: a clear error instead of TF's generic one
        tf.function(lambda t: hvdc_tf.allreduce(t, comm=comm), jit_compile=True)(tf.constant(x))
    except ValueError as exc:
        errors.append(str(exc))
    else:
        raise AssertionError("jit_compile=True accepted")
    return errors


# ------------------------------------------------------------------ Horovod's own tape
def case_horovod_tape(comm):
    """horovod.tensorflow.DistributedGradientTape(compression=<ours>): fp16 (Horovod reduces
    the 16-bit values) and bf16 (Horovod has no bfloat16 kernel: our exchange) give the
    dense average, eagerly and in tf.function; randk runs its exchange at every step
    (a fresh shared index set per step, not the first trace's). Every method x op is
    checked against its own result, and every compressed method against a NumPy oracle of
    its paper, in tests/test_horovod_methods.py."""
    if horovod_build_skipped():     # set up without Horovod on purpose: the test skips
        return {"skipped": "Horovod not built: scripts/setup.sh ran with HVDC_SKIP_HOROVOD=1"}
    import horovod.tensorflow as hvd    # a broken build fails the case
    if not hvd.is_initialized():
        hvd.init(comm=comm.comm)
    p, r = comm.size, comm.rank
    w = tf.Variable(tf.zeros([6, 5]), name="hw")
    checked = {}
    supports = []
    for name in ("fp16", "bf16", "randk"):
        for mode in ("eager", "graph"):
            method = hvdc.Compression.by_name(name, **({"density": 0.3, "feedback": "none"}
                                                       if name == "randk" else {}))

            def step(gw, method=method):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(w * gw)
                return hvd.DistributedGradientTape(tape, compression=method).gradient(loss, [w])[0]

            fn = tf.function(step) if mode == "graph" else step
            for s in range(2):
                got = fn(tf.constant(_g(40, r, s, (6, 5)))).numpy()
                assert got.dtype == np.float32 and got.shape == (6, 5)
                assert same_on_all_ranks(comm, got), (name, mode)
                dense = np.mean([_g(40, q, s, (6, 5)) for q in range(p)], axis=0)
                if name == "randk":
                    support = np.flatnonzero(got.ravel())
                    assert 0 < support.size < got.size
                    assert np.allclose(got.ravel()[support], dense.ravel()[support],
                                       rtol=1e-5, atol=1e-6)
                    supports.append(support.tolist())
                else:
                    tol = 2e-3 if name == "fp16" else 2e-2
                    assert np.allclose(got, dense, rtol=tol, atol=tol * np.abs(dense).max()), name
            checked[f"{name}/{mode}"] = float(np.abs(got).sum())
    # randk draws a new shared set at each step (the exchange runs when the graph runs)
    assert supports[0] != supports[1] and supports[2] != supports[3], supports
    return {"checked": checked}


# -------------------------------------------------------- cross-framework consistency
CROSS_SHAPES = [("conv/kernel", (8, 4, 3, 3)), ("conv/bias", (8,)), ("fc1/kernel", (24, 16)),
                ("fc1/bias", (24,)), ("fc2/kernel", (10, 24)), ("fc2/bias", (10,))]


def keras_layout(name, array):
    """A PyTorch weight as the equivalent Keras kernel: Linear (out, in) -> (in, out),
    Conv2d (out, in, kh, kw) -> (kh, kw, in, out); biases unchanged."""
    if array.ndim == 2:
        return array.T
    if array.ndim == 4:
        return np.transpose(array, (2, 3, 1, 0))
    return array


CROSS_STEPS = 3


def cross_framework_method(name):
    """Method ``name`` with a fixed seed, no warm-up and every matrix compressed (so the
    compressed path runs on these small tensors)."""
    sig = inspect.signature(hvdc.Compression.by_name(name).__class__.__init__).parameters
    kwargs = {"seed": 1234} if "seed" in sig else {}
    if "warmup_steps" in sig:
        kwargs["warmup_steps"] = 0
    if "min_compression_rate" in sig:  # compress these small matrices too
        kwargs["min_compression_rate"] = 0.0
    return hvdc.Compression.by_name(name, **kwargs)


def _cross_grads(rank, step):
    return [_g(50 + i, rank, step, shape) for i, (_, shape) in enumerate(CROSS_SHAPES)]


def _torch_run(name, comm):
    import torch

    from horovod_compress.torch import DistributedOptimizer
    params = [(n, torch.nn.Parameter(torch.zeros(shape))) for n, shape in CROSS_SHAPES]
    opt = DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.0),
                               named_parameters=params, compression=cross_framework_method(name),
                               comm=comm)
    out = []
    for s in range(CROSS_STEPS):
        opt.zero_grad()
        loss = sum((p * torch.from_numpy(g)).sum() for (_, p), g in zip(params, _cross_grads(comm.rank, s)))
        loss.backward()
        opt.synchronize()
        out.append([p.grad.numpy().copy() for _, p in params])
        with opt.skip_synchronize():
            opt.step()
    opt.close()
    return out


def _tf_run(name, comm, graph, keras_kernels=False):
    """The TF tape on the same gradients (same names as the PyTorch run). Without
    ``keras_kernels`` the weights have PyTorch's shapes and ``kernel_layout="keras"`` keeps
    them as they are; with it they are the equivalent Keras kernels (channels-last), which
    the default ``kernel_layout="torch"`` hands to matrix methods in PyTorch's layout."""
    convert = keras_layout if keras_kernels else (lambda n, a: a)
    names = [n for n, _ in CROSS_SHAPES]
    layout = "torch" if keras_kernels else "keras"
    variables = [tf.Variable(tf.zeros(convert(n, np.zeros(shape)).shape))
                 for n, shape in CROSS_SHAPES]
    method = cross_framework_method(name)

    def step(*grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        return hvdc_tf.DistributedGradientTape(tape, compression=method, comm=comm, names=names,
                                               kernel_layout=layout).gradient(loss, variables)

    fn = tf.function(step) if graph else step
    out = []
    for s in range(CROSS_STEPS):
        grads = [convert(n, g) for (n, _), g in zip(CROSS_SHAPES, _cross_grads(comm.rank, s))]
        got = [t.numpy() for t in fn(*grads)]
        if keras_kernels:  # back to PyTorch's layout for the comparison
            got = [g.T if g.ndim == 2 else np.transpose(g, (3, 2, 0, 1)) if g.ndim == 4 else g
                   for g in got]
        out.append(got)
    return out


def case_cross_framework(comm):
    """Every registered method: the same per-rank gradients through the PyTorch optimizer and
    the TensorFlow tape (eager and tf.function) give identical averages at every step; for
    matrix methods also when the TF weights are the equivalent Keras kernels (channels-last)."""
    import torch
    torch.set_num_threads(1)
    report = {}
    for name in hvdc.Compression.available():
        ref = _torch_run(name, comm)
        matrix = cross_framework_method(name).layout == "matrix"
        for graph, kernels in ((False, False), (True, False), (False, True)):
            got = _tf_run(name, comm, graph, kernels)
            what = f"TF ({'graph' if graph else 'eager'}{', Keras kernels' if kernels else ''})"
            for s in range(CROSS_STEPS):
                for (tname, _), a, b in zip(CROSS_SHAPES, ref[s], got[s]):
                    assert a.shape == b.shape and a.dtype == b.dtype
                    # flat methods see Keras kernels in Keras's element order: only matrix
                    # methods (which are handed PyTorch's layout) must then agree bit for bit
                    if (matrix or not kernels) and not np.array_equal(a, b):
                        diff = float(np.max(np.abs(a - b)))
                        raise AssertionError(f"{name}: torch and {what} differ on {tname} at "
                                             f"step {s + 1}: max |diff| {diff}")
        moved = float(sum(np.abs(t).sum() for t in ref[-1]))
        assert np.isfinite(moved) and moved > 0, name
        report[name] = moved
    return report


# --------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def results():
    return run_cases(2, __file__, timeout=600)


@pytest.mark.mpi
@pytest.mark.parametrize("case", [case_tape_none_exact, case_tape_dtypes_none_indexed_slices,
                                  case_stateful_eager_equals_graph, case_broadcast_variables,
                                  case_allreduce_and_errors])
def test_case(results, case):
    assert set(results[case]) == {0, 1}  # every rank finished the case


@pytest.mark.mpi
def test_argument_errors_name_the_argument(results):
    messages = results[case_allreduce_and_errors][0]
    for word in ("compression", "op", "gradient_predivide_factor", "gradtape",
                 "int32", "jit_compile=False"):
        assert any(word in m for m in messages), (word, messages)


@pytest.mark.mpi
@pytest.mark.horovod
def test_horovod_tape_accepts_our_compressors(results):
    per_rank = results[case_horovod_tape]
    if "skipped" in per_rank[0]:
        pytest.skip(per_rank[0]["skipped"])
    assert {"fp16/eager", "fp16/graph", "bf16/eager", "bf16/graph", "randk/eager",
            "randk/graph"} <= set(per_rank[0]["checked"])
    assert per_rank[0] == per_rank[1]


@pytest.mark.mpi
@pytest.mark.parametrize("method", hvdc.Compression.available())
def test_cross_framework_identical(results, method):
    """Checked bit for bit on the ranks; here: every registered method was covered."""
    for rank in (0, 1):
        assert method in results[case_cross_framework][rank]
