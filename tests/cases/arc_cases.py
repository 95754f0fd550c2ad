"""Per-rank cases for ARC-Top-K and the row baselines (run by tests/test_arc_topk.py).

Every case builds this rank's data from a seed, runs the method on real MPI
ranks, and checks it against a dense reference computed in the case from all
ranks' data (gathered *after* the measured call, outside the byte counts).
"""
from __future__ import annotations

import math

import numpy as np

import horovod_compress as hvdc
from horovod_compress.kernels.rows import row_sq_norms

F32 = 4


def _gather(comm, x: np.ndarray) -> np.ndarray:
    """All ranks' arrays, float64, shape (P, *x.shape) -- for references only."""
    return comm.allgather(np.ascontiguousarray(x, dtype=np.float64))


def _ring(nbytes: float, p: int) -> float:
    return 2.0 * nbytes * (p - 1) / p


# ------------------------------------------------------------- Proposition 1
def case_prop1(comm):
    """P ranks alternate g = [-1, 0.1] and [1, 0.1]; avg g = [0, 0.1]; K = 1."""
    assert comm.size % 2 == 0
    sign = -1.0 if comm.rank % 2 == 0 else 1.0
    vec = np.array([sign, 0.1], dtype=np.float32)
    g_avg = np.array([0.0, 0.1])
    norm2 = float(g_avg @ g_avg)
    out = {}

    # Element form, exactly the paper's: averaged local Top-1 of a 2-vector.
    topk = hvdc.Compression.topk(density=0.5, feedback="none")
    c = topk.allreduce(vec, "g", comm)
    out["topk_elem"] = float(np.sum((c - g_avg) ** 2))

    # Row form: entry j of the vector becomes row j of a 2 x n matrix (the paper's view).
    n = 64
    mat = np.repeat(vec[:, None], n, axis=1)
    mat_avg = np.repeat(g_avg[:, None], n, axis=1)
    mat_norm2 = float(np.sum(mat_avg ** 2))
    topk_rows = hvdc.Compression.topk_rows(ratio=0.5, feedback="none")
    c = topk_rows.allreduce(mat, "g", comm)
    out["topk_rows"] = float(np.sum((c - mat_avg) ** 2)) / mat_norm2
    out["topk_rows_zero"] = bool(np.all(c == 0))
    for r in (1, 4):
        arc = hvdc.Compression.arc_topk(ratio=0.5, rank=r, feedback="none", seed=3)
        c = arc.allreduce(mat, "g", comm)
        out[f"arc_rows_r{r}"] = float(np.sum((c - mat_avg) ** 2)) / mat_norm2
        assert list(arc.state["g"]["rows"]) == [1]
    # The literal 2 x 1 matrix (no saving possible: only with dense_fallback=False).
    arc = hvdc.Compression.arc_topk(ratio=0.5, rank=1, feedback="none", dense_fallback=False)
    c = arc.allreduce(vec[:, None], "g", comm)
    out["arc_2x1"] = float(np.sum((c[:, 0] - g_avg) ** 2))
    out["norm2"] = norm2
    return out


# ----------------------------------------------------------- Proposition 2
def _cancelling_matrices(rank: int, m: int = 20, n: int = 16):
    """G_i = A + s_i B + N_i: a signal A, a part B that cancels over ranks (s_i = +-1), noise.

    A's rows 0..9 are tiny and B lives on them, so every rank's *local* top
    rows are rows 0..9 while the average's important rows are 10..19.
    """
    rng = np.random.default_rng(1234)
    a = rng.standard_normal((m, n))
    a[:10] *= 0.01
    a[10:] *= np.linspace(0.5, 3.0, m - 10)[:, None]
    b = np.zeros((m, n))
    b[:10] = 20.0 * rng.standard_normal((10, n))
    noise = 0.3 * np.random.default_rng(99 + rank).standard_normal((m, n))
    s = -1.0 if rank % 2 == 0 else 1.0
    return (a + s * b + noise).astype(np.float32)


def case_contractive(comm):
    """Mean over 200 sketches of ||C(g)-g||^2 / ||g||^2 against 1 - K/m (Proposition 2)."""
    m, n, ratio, steps = 20, 16, 0.2, 200
    g_i = _cancelling_matrices(comm.rank, m, n)
    g = _gather(comm, g_i).mean(axis=0)
    norm2 = float(np.sum(g ** 2))
    k = math.ceil(ratio * m)
    row_n2 = np.sort(row_sq_norms(g))[::-1]
    oracle = 1.0 - float(row_n2[:k].sum()) / norm2          # best any K rows can do
    methods = {
        "arc_r1": hvdc.Compression.arc_topk(ratio=ratio, rank=1, feedback="none", seed=7),
        "arc_r4": hvdc.Compression.arc_topk(ratio=ratio, rank=4, feedback="none", seed=7),
        "randk_rows": hvdc.Compression.randk_rows(ratio=ratio, feedback="none", seed=7),
        "topk_rows": hvdc.Compression.topk_rows(ratio=ratio, feedback="none"),
    }
    out = {"bound": 1.0 - k / m, "oracle": oracle}
    for label, method in methods.items():
        errs = []
        for _ in range(steps):
            c = method.allreduce(g_i, "w", comm).astype(np.float64)
            errs.append(float(np.sum((c - g) ** 2)) / norm2)
            if label != "topk_rows":    # shared row sets: at most K nonzero rows
                assert np.count_nonzero(np.any(c != 0, axis=1)) <= k
        out[label] = float(np.mean(errs))
        out[label + "_max"] = float(np.max(errs))
        out[label + "_min"] = float(np.min(errs))
    return out


# ----------------------------------------------------------------- volume
def _one_call(comm, method, shape, dtype=np.float32, name="t"):
    rng = np.random.default_rng(comm.rank + 10 * len(shape) + shape[0])
    x = rng.standard_normal(shape).astype(dtype)
    comm.reset_stats()
    out = method.allreduce(x, name, comm)
    stats = comm.stats()
    return x, out, stats


def case_bytes(comm):
    """Bytes per rank per step = ring allreduce of the m x r sketch + the K x n rows, exactly."""
    p = comm.size
    results = {}
    # (shape, rank r, dense_fallback, expected (sketch words, row words) or None for dense)
    cases = [
        ((32, 24), 4, True, (32 * 4, math.ceil(0.2 * 32) * 24)),          # K = 7
        ((16, 4, 3, 3), 2, True, (16 * 2, math.ceil(0.2 * 16) * 36)),     # conv -> (16, 36)
        ((3, 40), 4, True, (3 * 4, 1 * 40)),                              # m < 1/ratio: K = 1
        ((50,), 4, True, None),                                           # 1-D: dense
        ((1, 64), 4, True, None),                                         # 1 x n: K = m: dense
        ((1, 64), 4, False, (1 * 4, 64)),                                 # forced: sketch + row
        ((8, 3), 4, True, None),                                          # r > n: dense
        ((8, 3), 4, False, (8 * 4, 2 * 3)),                               # forced: r > n sketch
    ]
    for shape, r, fallback, words in cases:
        arc = hvdc.Compression.arc_topk(ratio=0.2, rank=r, dense_fallback=fallback,
                                        feedback="none")
        _x, _out, st = _one_call(comm, arc, shape)
        n_total = int(np.prod(shape))
        if words is None:
            want = _ring(n_total * F32, p)
            assert st["by_op"]["allreduce"]["calls"] == 1
        else:
            sketch_b, rows_b = _ring(words[0] * F32, p), _ring(words[1] * F32, p)
            want = sketch_b + rows_b
            assert st["by_op"]["allreduce"]["calls"] == 2, st
            assert st["by_phase"]["arc_sketch"]["sent"] == sketch_b
            assert st["by_phase"]["arc_rows"]["sent"] == rows_b
        assert set(st["by_op"]) == {"allreduce"}, st           # no allgather: no index is sent
        assert st["sent"] == want == st["received"], (shape, st, want)
        assert arc.expected_bytes(shape, p) == want
        results[f"{shape}/{r}/{fallback}"] = st["sent"]
    # float64 gradients: 8-byte words.
    arc = hvdc.Compression.arc_topk(ratio=0.25, rank=3, feedback="none")
    _x, _out, st = _one_call(comm, arc, (12, 10), np.float64)
    want = _ring((12 * 3 + 3 * 10) * 8, p)
    assert st["sent"] == want == arc.expected_bytes((12, 10), p, itemsize=8)
    # The row baselines: Rand-K rows 2Kn(P-1)/P; Top-K rows (P-1)(Kn + K) (Table I).
    rk = hvdc.Compression.randk_rows(ratio=0.2, feedback="none")
    _x, _out, st = _one_call(comm, rk, (32, 24))
    assert st["sent"] == _ring(7 * 24 * F32, p) == rk.expected_bytes((32, 24), p)
    tk = hvdc.Compression.topk_rows(ratio=0.2, feedback="none")
    _x, _out, st = _one_call(comm, tk, (32, 24))
    assert st["received"] == (p - 1) * (7 * 24 + 7) * F32 == tk.expected_bytes((32, 24), p)
    return results


# -------------------------------------------------------------- selection
def _check_arc_step(comm, arc, x, out, name, step):
    """Compare one ARC-Top-K step with the float64 reference from all ranks' data."""
    plan = arc.plan(x.shape)
    g_all = _gather(comm, x)
    g_avg = g_all.mean(axis=0)
    if plan.dense:
        np.testing.assert_allclose(out, g_avg, rtol=1e-5, atol=1e-6)
        return None
    v = arc.sketch_matrix(name, step, plan.n, plan.r, np.dtype(np.float64))
    sigma = row_sq_norms(g_avg.reshape(plan.m, plan.n) @ v)
    rows = np.asarray(arc.state[name]["rows"])
    # (1) every rank selected the same rows
    all_rows = comm.allgather_object(rows.tolist())
    assert all(r == all_rows[0] for r in all_rows), all_rows
    assert rows.size == plan.k and np.all(np.diff(rows) > 0)
    # (2) they are the top-K of the reference sketch scores (float32 rounding slack)
    others = np.setdiff1d(np.arange(plan.m), rows)
    if others.size:
        slack = 1e-4 * float(sigma.max())
        assert sigma[rows].min() >= sigma[others].max() - slack, (sigma, rows)
    # (3) the selected rows are the exact average, every other row is zero
    o = out.reshape(plan.m, plan.n)
    np.testing.assert_allclose(o[rows], g_avg.reshape(plan.m, plan.n)[rows], rtol=1e-5, atol=1e-6)
    assert np.all(o[others] == 0)
    return rows.tolist()


def case_selection(comm):
    """Same rows on every rank, the reference top-K, the exact row average; edge shapes."""
    out = {}
    specs = [  # name, shape, ratio, rank, dense_fallback
        ("fc", (24, 20), 0.2, 4, True),
        ("conv", (12, 3, 3, 3), 0.25, 2, True),
        ("short", (3, 40), 0.2, 4, True),       # m < 1/ratio -> K = 1
        ("row", (1, 64), 0.2, 4, True),          # 1 x n -> dense
        ("row_forced", (1, 64), 0.2, 4, False),  # 1 x n forced: K = m = 1, exact average
        ("wide_r", (8, 3), 0.2, 4, True),        # rank > n -> dense
        ("wide_r_forced", (8, 3), 0.2, 4, False),
        ("bias", (7,), 0.2, 4, True),            # 1-D -> dense
    ]
    for name, shape, ratio, r, fallback in specs:
        arc = hvdc.Compression.arc_topk(ratio=ratio, rank=r, dense_fallback=fallback,
                                        feedback="none", seed=11)
        for step in (1, 2, 3):
            rng = np.random.default_rng(1000 * step + comm.rank)
            x = rng.standard_normal(shape).astype(np.float32)
            res = arc.allreduce(x, name, comm)
            assert res.shape == x.shape and res.dtype == x.dtype
            out[f"{name}/{step}"] = _check_arc_step(comm, arc, x, res, name, step)
    # The sketch changes with the step (fresh V each iteration, same on all ranks).
    assert len({tuple(out[f"fc/{s}"]) for s in (1, 2, 3)}) > 1
    # Ties: an all-zero gradient selects rows 0..K-1 on every rank.
    arc = hvdc.Compression.arc_topk(ratio=0.25, rank=2, feedback="none")
    res = arc.allreduce(np.zeros((16, 10), np.float32), "z", comm)
    assert np.all(res == 0) and list(arc.state["z"]["rows"]) == [0, 1, 2, 3]
    # float16 in, float16 out (computed in float32).
    x16 = np.random.default_rng(comm.rank).standard_normal((20, 12)).astype(np.float16)
    res = hvdc.Compression.arc_topk(feedback="none").allreduce(x16, "h", comm)
    assert res.dtype == np.float16 and res.shape == (20, 12)
    return out


# --------------------------------------------------------------- training
def case_training_identical(comm):
    """Softmax regression with a conv-shaped and a bias parameter, ARC-Top-K + EF21M.

    Every rank has its own data; after 40 SGD steps the parameters are bit-for-bit
    identical on every rank and the loss went down.
    """
    rng = np.random.default_rng(5)
    d, c = 18, 8                                   # features = 2*3*3, classes
    w_true = rng.standard_normal((c, d))
    xs = np.random.default_rng(100 + comm.rank).standard_normal((64, d))
    ys = np.argmax(xs @ w_true.T, axis=1)
    params = {"conv": np.zeros((c, 2, 3, 3), np.float32), "bias": np.zeros(c, np.float32)}
    arc = hvdc.Compression.arc_topk(ratio=0.25, rank=2, eta=0.5, warmup_steps=3, seed=2)

    def loss_and_grads():
        w = params["conv"].reshape(c, d).astype(np.float64)
        logits = xs @ w.T + params["bias"]
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        loss = -np.mean(np.log(p[np.arange(len(ys)), ys]))
        p[np.arange(len(ys)), ys] -= 1.0
        p /= len(ys)
        return loss, {"conv": (p.T @ xs).reshape(c, 2, 3, 3), "bias": p.sum(axis=0)}

    first = None
    for _ in range(40):
        loss, grads = loss_and_grads()
        first = loss if first is None else first
        for key in ("conv", "bias"):
            step = arc.allreduce(grads[key].astype(np.float32), key, comm)
            params[key] -= np.float32(0.5) * step
    flat = np.concatenate([params["conv"].ravel(), params["bias"]]).view(np.uint32)
    everyone = comm.allgather(flat)
    assert all(np.array_equal(everyone[0], e) for e in everyone), "parameters differ"
    gs = comm.allgather(arc.state["conv"]["fb_G"].ravel().view(np.uint32))
    assert all(np.array_equal(gs[0], e) for e in gs)
    total = comm.allreduce(np.array([loss_and_grads()[0]]), op="avg")[0]
    start = comm.allreduce(np.array([first]), op="avg")[0]
    assert total < 0.7 * start, (start, total)
    return {"start_loss": float(start), "end_loss": float(total)}


# ------------------------------------------------------------ convergence
def case_digits(comm):
    """Digits MLP at P ranks, ratio 0.2: dense vs ARC-Top-K + EF21M vs Rand-K rows + EF21M.

    Dense uses train_digits' defaults (SGD, lr 0.05, heavy-ball momentum 0.9).
    The EF21M runs put the momentum in the feedback (eta = 0.1 = 1 - 0.9, eq. 11a)
    and step plain SGD on G (eq. 11c) with lr 0.05 / (1 - 0.9) = 0.5, the same
    effective step. ARC-Top-K and Rand-K rows are compared at identical settings,
    at that lr and at 0.2 (where Rand-K rows, less stable, trains better).
    """
    from horovod_compress.bench.digits import train_digits

    keys = ("test_accuracy", "bytes_sent_per_step", "dense_bytes_per_step")
    out = {"dense": train_digits(hvdc.Compression.none(), comm, epochs=30)}
    for lr in (0.5, 0.2):
        common = dict(epochs=30, lr=lr, momentum=0.0)
        out[f"arc/{lr}"] = train_digits(
            hvdc.Compression.arc_topk(ratio=0.2, rank=4, eta=0.1), comm, **common)
        out[f"randk_rows/{lr}"] = train_digits(
            hvdc.Compression.randk_rows(ratio=0.2, eta=0.1), comm, **common)
    digests = comm.allgather_object(out["arc/0.5"]["params_digest"])
    assert len(set(digests)) == 1, digests            # identical parameters on every rank
    return {label: {k: r[k] for k in keys} for label, r in out.items()}
