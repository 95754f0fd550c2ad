"""GreedyLore and the lazy-projection baseline; PowerSGD's bytes, edge shapes and checkpoints.

Paper: "Greedy Low-Rank Gradient Compression for Distributed Learning with
Convergence Guarantees" (GreedyLore): Algorithm 3 (+ Appendix D), Propositions
2-4, Lemma 2; lazy projection is its Algorithm 1 / Appendix E baseline.

The per-rank cases (``case_*``, one ``run_cases`` launch per world size, 2 and
4 real ranks) run on every rank, assert what they can locally and return
numbers the tests check. Dense references are computed from all ranks' data
(gathered with ``comm.allgather``), never from the method under test. The
single-process tests at the end check the pieces that need no communication
and the argument checks. PowerSGD's comparison with PyTorch's hook is in
tests/test_powersgd.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.compressors.greedylore import (
    GreedyLore,
    current_error,
    materialize_error,
    left_singular_vectors,
    probe_values,
    shared_probe_values,
    subtract_low_rank,
    working_matrix,
)
from horovod_compress.compressors.lazy_projection import LazyProjection
from horovod_compress.compressors.lowrank_common import should_compress, top_indices
from horovod_compress.compressors.powersgd import PowerSGD
from horovod_compress.kernels.lowrank import (
    add_and_probe,
    add_and_probe_rows,
    add_lowrank_and_probe,
    add_lowrank_and_probe_rows,
    pad_rank,
    project,
    reconstruct,
    reconstruct_and_subtract,
)
from horovod_compress.tools.testing import (
    gather_float64,
    low_rank_gradient,
    relative_error,
    ring_rounding_ok,
    run_cases,
    same_on_all_ranks,
)


def _gathered_mean(comm, x):
    """avg_i x_i computed from every rank's copy (float64)."""
    return gather_float64(comm, x).mean(axis=0)


# ------------------------------------------------------ GreedyLore reference
def _reference_greedylore(all_inputs, method, name, t, state):
    """One GreedyLore step computed densely from every rank's input (float64).

    ``all_inputs``: (P, rows, cols) gradients of all ranks; ``state`` holds the
    reference's own U and per-rank errors. Returns (avg estimate, columns or None).
    """
    p = all_inputs.shape[0]
    mats = all_inputs.astype(np.float64)
    transposed = mats.shape[1] > mats.shape[2]
    if transposed:
        mats = mats.transpose(0, 2, 1)
    m, n = mats.shape[1:]
    if method.is_svd_step(t):
        g = mats.mean(axis=0)
        state["U"] = np.linalg.svd(g)[0]
        state["E"] = np.zeros_like(mats)
        est, cols = g, None
    else:
        u = state["U"]
        a = mats + state["E"]
        # the method's probes, drawn in the gradient's dtype as the method draws them: (k, [m,] n)
        xi = method.probes_for(name, t, m, n, all_inputs.dtype).astype(np.float64)
        if xi.ndim == 2:                      # shared probes: the same xi_k for every column
            xi = np.broadcast_to(xi[:, None, :], (xi.shape[0], m, n))
        s = np.zeros((m, xi.shape[0]))
        for i in range(p):
            for j in range(m):
                s[j] += (u[:, j] @ a[i] @ xi[:, j, :].T) / p
        score = (s ** 2).mean(axis=1)
        r = min(method.rank, m)
        cols = np.sort(np.argsort(-score, kind="stable")[:r])
        q = u[:, cols]
        est = q @ np.mean([q.T @ a[i] for i in range(p)], axis=0)
        state["E"] = np.stack([a[i] - q @ (q.T @ a[i]) for i in range(p)])
    return (est.T if transposed else est), cols


REF_SHAPES = [(12, 20), (20, 10), (6, 2, 2, 2)]


def case_greedylore_reference(comm, probe_mode="shared"):
    """GreedyLore equals a dense float64 re-implementation of Algorithm 3 (+ Appendix D)."""
    method = hvdc.Compression.greedylore(rank=3, period=4, warmup_steps=1, seed=5,
                                         min_compression_rate=1.0, probe_mode=probe_mode)
    refs = [dict() for _ in REF_SHAPES]
    worst, cols_equal, svd_exact = 0.0, True, True
    for t in range(1, 11):
        for k, shape in enumerate(REF_SHAPES):
            g = low_rank_gradient(shape, comm.rank, t, k, seed=2)
            out = method.allreduce(g, f"w{k}", comm)
            assert same_on_all_ranks(comm, out)
            mat_all = comm.allgather(g.reshape(shape[0], -1))
            if t <= method.warmup_steps:
                assert np.array_equal(out, comm.allreduce(g, op="avg"))
                continue
            est, cols = _reference_greedylore(mat_all, method, f"w{k}", t, refs[k])
            worst = max(worst, relative_error(out.reshape(est.shape), est))
            st = method.state[f"w{k}"]
            if cols is None:
                svd_exact &= bool(np.array_equal(out, comm.allreduce(g, op="avg")))
                svd_exact &= bool(not current_error(st).any())
                assert st["U"].shape == (min(est.shape),) * 2
            else:
                cols_equal &= bool(np.array_equal(st["columns"], cols))
    assert worst < 1e-4 and cols_equal and svd_exact, (worst, cols_equal, svd_exact)
    return {"worst_rel": worst, "cols_equal": cols_equal, "svd_exact": svd_exact}


def case_greedylore_fast_paths(comm):
    """The fused step (Numba kernels for r <= 5, BLAS GEMMs above, float64, transposed
    tensors) against the dense float64 reference; ``_reduce``'s ``local`` is Q Q^T A_i."""
    out = {}
    for dtype, tol in ((np.float32, 1e-4), (np.float64, 1e-10)):
        for rank in (1, 5, 7):
            method = GreedyLore(rank=rank, period=3, seed=9, min_compression_rate=0.0)
            shapes = [(16, 24), (24, 16)]
            refs = [dict() for _ in shapes]
            worst, cols_equal, local_worst = 0.0, True, 0.0
            for t in range(1, 8):
                for k, shape in enumerate(shapes):
                    g = low_rank_gradient(shape, comm.rank, t, k, seed=4, dtype=dtype)
                    name = f"w{k}"
                    st = method.state.get(name)
                    e_before = None if st is None or method.is_svd_step(t) else current_error(st)
                    if t % 2 == 0 and not method.is_svd_step(t):
                        st = method.state[name]
                        st.t += 1                           # what allreduce does before _reduce
                        res, local = method._reduce(g, name, comm, st)
                        a = (g.T if shape[0] > shape[1] else g).astype(np.float64) + e_before
                        q = st["U"][:, st["columns"]].astype(np.float64)
                        want_local = q @ (q.T @ a)
                        got_local = local.T if shape[0] > shape[1] else local
                        local_worst = max(local_worst, relative_error(got_local, want_local))
                    else:
                        res = method.allreduce(g, name, comm)
                    assert res.dtype == dtype and same_on_all_ranks(comm, res)
                    est, cols = _reference_greedylore(comm.allgather(g), method, name, t, refs[k])
                    worst = max(worst, relative_error(res, est))
                    if cols is not None:
                        cols_equal &= bool(np.array_equal(method.state[name]["columns"], cols))
            assert worst < tol and cols_equal and local_worst < tol, \
                (dtype.__name__, rank, worst, cols_equal, local_worst)
            out[f"{dtype.__name__}_r{rank}"] = {"worst_rel": worst, "cols_equal": cols_equal,
                                                 "local_worst": local_worst, "tol": tol}
    return out


def case_greedylore_reference_independent(comm):
    """The paper's own estimator (an independent probe per column) against the reference."""
    return case_greedylore_reference(comm, probe_mode="independent")


def case_greedylore_unbiased(comm):
    """Proposition 4: averaged over seeds, s_j^2 -> ||u_j^T avg(A)||^2.

    A_i = D + N_i with sum_i N_i = 0 and N_i large: the unbiased target is
    ||u_j^T D||^2, while a rank-local (unshared) probe would give
    (1/P^2) sum_i ||u_j^T A_i||^2 -- much larger here.
    """
    m, n, rounds, probes = 6, 10, 30, 100     # 3000 independent probe vectors per column
    rng = np.random.default_rng(42)  # same on all ranks
    u = np.linalg.qr(rng.standard_normal((m, m)))[0].astype(np.float32)
    d = (rng.standard_normal((m, n)) * np.linspace(2.0, 0.3, m)[:, None]).astype(np.float32)
    noise = rng.standard_normal((comm.size, m, n)).astype(np.float32) * 3.0
    noise -= noise.mean(axis=0)
    a = d + noise[comm.rank]
    means = {}
    for mode in ("shared", "independent"):
        acc = np.zeros(m)
        for s in range(rounds):                   # a fresh seed per round
            method = GreedyLore(rank=2, seed=s, probes=probes, probe_mode=mode)
            acc += method.scores(u, a, "p4", 1, comm)
        means[mode] = acc / rounds
    mean = means["shared"]
    avg_a = _gathered_mean(comm, a)
    target = np.sum((u.T.astype(np.float64) @ avg_a) ** 2, axis=1)
    local_only = np.sum(np.stack([np.sum((u.T.astype(np.float64) @ (d + noise[i])) ** 2, axis=1)
                                  for i in range(comm.size)]), axis=0) / comm.size ** 2
    ratio = mean / target
    return {"ratio": ratio.tolist(), "local_only_ratio": (local_only / target).tolist(),
            "ratio_independent": (means["independent"] / target).tolist(),
            "draws": rounds * probes}


def case_greedylore_many_probes(comm):
    """With many probes the selected columns are the true global top-r of ||u_j^T avg(A)||."""
    m, n, r = 10, 16, 3
    method = GreedyLore(rank=r, period=100, probes=4000, seed=1, feedback="none",
                        min_compression_rate=0.0)
    rng = np.random.default_rng(3)
    g1 = rng.standard_normal((m, n)).astype(np.float32)       # defines U at the SVD step
    method.allreduce(g1 + 0.0 * comm.rank, "w", comm)
    u = method.state["w"]["U"].astype(np.float64)
    # Column energies ||u_j^T avg A||^2 chosen well separated, in a scrambled order;
    # each rank's A_i adds zero-sum noise in U's coordinates.
    energies = np.array([1.0, 9.0, 0.5, 4.0, 16.0, 0.2, 2.0, 0.1, 6.5, 0.3])
    coords = rng.standard_normal((m, n))
    coords *= np.sqrt(energies)[:, None] / np.linalg.norm(coords, axis=1, keepdims=True)
    noise = rng.standard_normal((comm.size, m, n)) * 0.8
    noise -= noise.mean(axis=0)
    a = (u @ (coords + noise[comm.rank])).astype(np.float32)
    method.allreduce(a, "w", comm)
    avg_a = _gathered_mean(comm, a)
    true_energy = np.sum((u.T @ avg_a) ** 2, axis=1)
    true_top = np.sort(np.argsort(-true_energy)[:r])
    chosen = method.state["w"]["columns"]
    assert np.array_equal(chosen, true_top), (chosen, true_top)
    # One probe (the paper's default) is noisy: over 40 seeds it finds the exact set
    # less often, but captures more energy than a uniformly random choice of r columns.
    hits, captured = 0, []
    for seed in range(40):
        one = GreedyLore(rank=r, period=100, probes=1, seed=seed, feedback="none",
                         min_compression_rate=0.0)
        one.allreduce(g1, "w", comm)
        one.allreduce(a, "w", comm)
        cols = one.state["w"]["columns"]
        hits += int(np.array_equal(cols, true_top))
        captured.append(true_energy[cols].sum() / true_energy[true_top].sum())
    return {"chosen": chosen.tolist(), "true_top": true_top.tolist(), "one_probe_hits": hits,
            "one_probe_captured": float(np.mean(captured)),
            "random_captured": float(r / m * true_energy.sum() / true_energy[true_top].sum())}


def case_greedylore_error_feedback(comm):
    """e_{t+1} = A_t - Q Q^T A_t with A_t = M_t + e_t: input = sent + error exactly."""
    method = GreedyLore(rank=2, period=5, seed=4)
    shape = (9, 14)
    worst_identity, reset_ok, sent_ok = 0.0, True, True
    e_prev = np.zeros(shape, dtype=np.float32)
    for t in range(1, 13):
        g = low_rank_gradient(shape, comm.rank, t, 0, seed=8)
        out = method.allreduce(g, "w", comm)
        st = method.state["w"]
        if method.is_svd_step(t):
            reset_ok &= bool(not current_error(st).any())
            reset_ok &= bool(np.array_equal(out, comm.allreduce(g, op="avg")))
        else:
            a = g + e_prev
            q = st["U"][:, st["columns"]]
            sent = q @ (q.T @ a)                       # this rank's contribution Q Q^T A_i
            worst_identity = max(worst_identity,
                                 float(np.max(np.abs(a - (sent + current_error(st))))) /
                                 float(np.max(np.abs(a))))
            # the average of what the ranks sent is what every rank received
            sent_ok &= relative_error(out, _gathered_mean(comm, sent)) < 1e-5
        e_prev = current_error(st)
    assert worst_identity < 1e-6 and reset_ok and sent_ok
    return {"worst_identity": worst_identity, "reset_ok": reset_ok, "sent_ok": sent_ok}


def case_contractive(comm):
    """Proposition 3 (in expectation, Lemma 2) for GreedyLore; Proposition 2 for lazy projection."""
    m, n, r = 8, 12, 2
    # (a) Prop. 2's situation: the new gradient lies outside the lazy subspace.
    g1 = np.zeros((m, n), dtype=np.float32)
    g1[np.arange(m), np.arange(m)] = np.arange(m, 0, -1)     # U = I up to signs; top-2 rows 0, 1
    g2 = np.zeros((m, n), dtype=np.float32)
    rng = np.random.default_rng([5, comm.rank])
    g2[3:5] = rng.standard_normal((2, n))                      # every rank: rows 3 and 4 only
    avg2 = _gathered_mean(comm, g2)
    lazy = LazyProjection(rank=r, period=50, min_compression_rate=0.0)
    greedy = GreedyLore(rank=r, period=50, min_compression_rate=0.0, feedback="none")
    for meth in (lazy, greedy):
        meth.allreduce(g1, "w", comm)
    lazy_err = relative_error(lazy.allreduce(g2, "w", comm), avg2) ** 2
    greedy_err = relative_error(greedy.allreduce(g2, "w", comm), avg2) ** 2
    # (b) random matrices with a spread spectrum: mean relative error over seeds.
    base_rng = np.random.default_rng(11)
    u0 = np.linalg.qr(base_rng.standard_normal((m, m)))[0]
    errs, worst = [], 0.0

    def data(seed, rank):
        coef = np.random.default_rng([seed, rank]).standard_normal((m, n))
        return (u0 @ (coef * np.geomspace(3.0, 0.3, m)[:, None])).astype(np.float32)

    errs_independent = []
    for seed in range(80):
        a = data(seed, comm.rank)
        avg_a = np.mean([data(seed, j).astype(np.float64) for j in range(comm.size)], axis=0)
        for mode, sink in (("shared", errs), ("independent", errs_independent)):
            meth = GreedyLore(rank=r, period=50, seed=seed, feedback="none",
                              min_compression_rate=0.0, probe_mode=mode)
            meth.allreduce(np.random.default_rng(seed).standard_normal((m, n)).astype(np.float32),
                           "w", comm)                            # U unrelated to a's structure
            out = meth.allreduce(a, "w", comm)
            e = relative_error(out, avg_a) ** 2
            sink.append(e)
            worst = max(worst, e)
    return {"lazy_err": lazy_err, "greedy_err": greedy_err, "mean_err": float(np.mean(errs)),
            "mean_err_independent": float(np.mean(errs_independent)),
            "worst_err": worst, "bound": 1 - r / m}


# ------------------------------------------------------------------ bytes
BYTE_SHAPES = [(24, 40), (40, 24), (8, 3, 3, 3), (6, 6), (30,), ()]


def case_bytes(comm):
    """Measured bytes per step equal the formulas exactly (sent and received)."""
    methods = {
        "greedylore": GreedyLore(rank=4, period=3, warmup_steps=1, probes=2),
        "greedylore_p1": GreedyLore(rank=5, period=4),
        "lazy_projection": LazyProjection(rank=4, period=3, warmup_steps=1),
        "powersgd": PowerSGD(rank=4, warmup_steps=1),
    }
    out = {}
    for label, meth in methods.items():
        period = getattr(meth, "period", 1)
        per_shape = {}
        for k, shape in enumerate(BYTE_SHAPES):
            if shape == () and label == "powersgd":
                continue  # 0-d + residual feedback: see the report (core residual.py)
            measured = []
            for t in range(1, 2 + 2 * period):
                g = low_rank_gradient(shape if shape else (1,), comm.rank, t, k).reshape(shape)
                comm.reset_stats()
                meth.allreduce(g, f"x{k}", comm)
                want = (meth.step_bytes(shape, comm.size, t) if hasattr(meth, "step_bytes")
                        else meth.expected_bytes(shape, comm.size) if t > meth.warmup_steps
                        else 2.0 * max(1, int(np.prod(shape))) * 4 * (comm.size - 1) / comm.size)
                assert ring_rounding_ok(comm, comm.bytes_sent, want) \
                    and ring_rounding_ok(comm, comm.bytes_received, want), \
                    (label, shape, t, comm.bytes_sent, want)
                total = int(comm.comm.allreduce(comm.bytes_sent))
                assert abs(total - want * comm.size) < 1e-6 * max(want, 1) * comm.size + 1e-9, \
                    (label, shape, t, total, want)           # the formula is the mean over ranks
                measured.append(comm.bytes_sent)
            # one full period after warm-up averages to expected_bytes (over the ranks too)
            w = meth.warmup_steps
            mean = comm.comm.allreduce(float(np.mean(measured[w:w + period]))) / comm.size
            assert np.isclose(mean, meth.expected_bytes(shape, comm.size))
            per_shape[str(shape)] = measured
        out[label] = per_shape
    return out


# ------------------------------------------------------------- edge cases
def case_edge_shapes(comm):
    """m > n, rank >= min(m, n), and tensors too small to be worth compressing."""
    res = {}
    # rank >= min(m, n) with min_compression_rate=0: compressed, and exact.
    for shape in [(12, 5), (5, 12), (7, 2, 3)]:
        for label, meth in {
            "greedylore": GreedyLore(rank=9, period=10, min_compression_rate=0.0),
            "lazy_projection": LazyProjection(rank=9, period=10, min_compression_rate=0.0),
            "powersgd": PowerSGD(rank=9, min_compression_rate=0.0),
        }.items():
            worst = 0.0
            for t in range(1, 5):
                g = low_rank_gradient(shape, comm.rank, t, 0, true_rank=2)
                comm.reset_stats()
                out = meth.allreduce(g, "w", comm)
                worst = max(worst, relative_error(out, _gathered_mean(comm, g)))
                small = min(shape[0], int(np.prod(shape[1:])))
                if label == "greedylore" and t > 1:
                    assert meth.state["w"]["U"].shape == (small, small)
                    assert len(meth.state["w"]["columns"]) == small
            assert worst < 1e-5, (label, shape, worst)
            res[f"{label}{shape}"] = worst
    # too small for the rule (default rate 2), vectors and scalars: one dense allreduce,
    # bit-for-bit the plain average, no error kept.
    for shape in [(6, 6), (3, 40), (16,), ()]:
        for meth in (GreedyLore(rank=4), LazyProjection(rank=4), PowerSGD(rank=4)):
            if shape == () and meth.name == "powersgd":
                continue  # 0-d + residual feedback: see the report (core residual.py)
            for t in range(1, 4):
                g = low_rank_gradient(shape if shape else (1,), comm.rank, t, 1).reshape(shape)
                comm.reset_stats()
                out = meth.allreduce(g, "s", comm)
                assert np.array_equal(out, comm.allreduce(g, op="avg")), (meth.name, shape)
                fb = meth.state["s"].get("fb_residual")
                assert fb is None or not np.any(fb)
                assert "U" not in meth.state["s"] and "error" not in meth.state["s"]
    # m > n keeps the orientation of the output and of U (small side).
    # Its error is kept in the gradient's own memory order (column-major as 8 x 30) and
    # takes the fused first pass in that order (kernels.lowrank.add_and_probe_rows): A_i goes
    # into the spare buffer and the error stays pending as (A_i, Q, C_i), so the two buffers
    # swap from the SVD step on -- no m x n temporary per step.
    meth = GreedyLore(rank=2, period=5)
    buffers = set()
    for t in range(1, 6):
        g = low_rank_gradient((30, 8), comm.rank, t, 2)
        out = meth.allreduce(g, "tall", comm)
        assert out.shape == (30, 8)
        buffers.add(meth.state["tall"]["error"].__array_interface__["data"][0])
    assert meth.state["tall"]["U"].shape == (8, 8)
    assert meth.state["tall"]["error"].shape == (8, 30)
    assert meth.state["tall"]["error"].flags.f_contiguous and len(buffers) == 2
    assert "error_q" in meth.state["tall"]       # the fused path's pending error
    res["tall_ok"] = True
    return res


def case_checkpoint(comm):
    """state_dict mid-run -> fresh instance -> identical outputs afterwards."""
    def make(kind):
        return {"greedylore": lambda: GreedyLore(rank=2, period=3, seed=3),
                "powersgd": lambda: PowerSGD(rank=2, seed=3),
                "lazy_projection": lambda: LazyProjection(rank=2, period=3)}[kind]()
    res = {}
    for kind in ("greedylore", "powersgd", "lazy_projection"):
        a = make(kind)
        for t in range(1, 6):
            a.allreduce(low_rank_gradient((10, 14), comm.rank, t, 0), "w", comm)
        b = make(kind)
        b.load_state_dict(a.state_dict())
        same = True
        for t in range(6, 10):
            g = low_rank_gradient((10, 14), comm.rank, t, 0)
            same &= bool(np.array_equal(a.allreduce(g, "w", comm), b.allreduce(g, "w", comm)))
        assert same, kind
        res[kind] = same
    return res


def case_nan_step(comm):
    """A NaN on one rank under nonfinite="skip": every rank skips the step, the error and the
    step counter stay as they were (the fused pass wrote A into the spare buffer), and the next
    finite step gives the same result as on a method that never saw the NaN."""
    rng = np.random.default_rng(20 + comm.rank)
    grads = [rng.standard_normal((24, 40)).astype(np.float32) for _ in range(4)]
    a, b = (GreedyLore(rank=2, period=50, seed=3) for _ in range(2))
    a.set_nonfinite("skip")
    for g in grads[:2]:
        assert np.array_equal(a.allreduce(g, "w", comm), b.allreduce(g, "w", comm))
    err, t = current_error(a.state["w"]), a.state["w"].t
    bad = grads[2].copy()
    if comm.rank == comm.size - 1:
        bad[5, 7] = np.nan
    a.allreduce(bad, "w", comm)
    assert a.last_step_skipped
    assert np.array_equal(current_error(a.state["w"]), err) and a.state["w"].t == t
    assert np.array_equal(a.allreduce(grads[3], "w", comm), b.allreduce(grads[3], "w", comm))
    assert np.array_equal(current_error(a.state["w"]), current_error(b.state["w"]))
    return True


# ------------------------------------------------------ tests on MPI results
@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def mpi(request):
    """All the cases of this file on P real ranks, one launch."""
    return request.param, run_cases(request.param, __file__)


def test_matches_dense_reference_of_algorithm3(mpi):
    """Outputs equal a float64 re-implementation from all ranks' data (m<n, m>n, 4-D),
    the selected columns are the reference's, and SVD steps give the exact average."""
    _p, res = mpi
    for case in (case_greedylore_reference, case_greedylore_reference_independent):
        for out in res[case].values():
            assert out["worst_rel"] < 1e-4
            assert out["cols_equal"] and out["svd_exact"]


def test_fast_paths_match_reference(mpi):
    """The fused kernels (r <= 5), the BLAS path (r = 7), float64 and transposed tensors
    give the reference's output and columns; ``_reduce``'s ``local`` is Q Q^T A_i."""
    _p, res = mpi
    for out in res[case_greedylore_fast_paths].values():
        assert len(out) == 6
        for v in out.values():
            assert v["cols_equal"] and v["worst_rel"] < v["tol"] and v["local_worst"] < v["tol"]


def test_score_estimator_is_unbiased_proposition4(mpi):
    """Mean of s_j^2 over 3000 shared probes is ||u_j^T avg(A)||^2 within 12%
    (s_j is Gaussian: the mean's relative std is sqrt(2/3000) = 2.6%). A rank-local
    probe would be biased (here by factors 1.2 to 17): the shared seed matters."""
    _p, res = mpi
    for out in res[case_greedylore_unbiased].values():
        ratio = np.array(out["ratio"])
        assert np.all(np.abs(ratio - 1.0) < 0.12), ratio
        ratio = np.array(out["ratio_independent"])       # the paper's per-column probes
        assert np.all(np.abs(ratio - 1.0) < 0.12), ratio
        assert np.max(np.abs(np.array(out["local_only_ratio"]) - 1.0)) > 0.2


def test_many_probes_select_true_top_r(mpi):
    """With 4000 probes per column the chosen columns are exactly the global top-r;
    with one probe the choice is noisy but beats a random choice of r columns."""
    _p, res = mpi
    for out in res[case_greedylore_many_probes].values():
        assert out["chosen"] == out["true_top"]
        assert out["one_probe_captured"] > out["random_captured"] + 0.1


def test_error_feedback_identity_and_reset(mpi):
    """A_t = Q Q^T A_t + e_{t+1} to float rounding; e = 0 and output = exact average
    at SVD steps; every rank receives the average of what the ranks sent."""
    _p, res = mpi
    for out in res[case_greedylore_error_feedback].values():
        assert out["worst_identity"] < 1e-6 and out["reset_ok"] and out["sent_ok"]


def test_contractive_where_lazy_projection_is_not(mpi):
    """Prop. 2: a gradient orthogonal to the lazy subspace is lost entirely (error 1);
    GreedyLore re-selects columns and recovers it exactly. Prop. 3 / Lemma 2: over
    80 seeds the mean relative error is below 1 - r/m = 0.75."""
    _p, res = mpi
    for out in res[case_contractive].values():
        assert out["lazy_err"] == pytest.approx(1.0, abs=1e-6)
        assert out["greedy_err"] < 1e-10
        assert out["mean_err"] < out["bound"] - 0.05
        assert out["mean_err_independent"] < out["bound"] - 0.05
        assert out["worst_err"] <= 1.0 + 1e-6


def test_bytes_equal_formula(mpi):
    """Per step: m*probes + r*n words (two allreduces), m*n on SVD steps, dense when
    the rule says so; checked with == inside the case, spot-checked here."""
    p, res = mpi
    w = 2.0 * 4 * (p - 1) / p          # bytes per word of a ring allreduce, per rank
    for out in res[case_bytes].values():
        g = out["greedylore"]["(24, 40)"]   # warm-up 1, period 3, rank 4, probes 2
        assert g[0] == 24 * 40 * w and g[1] == 24 * 40 * w
        assert g[2] == (24 * 2 + 4 * 40) * w and g[3] == (24 * 2 + 4 * 40) * w
        assert g[4] == 24 * 40 * w
        assert out["greedylore"]["(40, 24)"] == g                         # transposed
        assert out["greedylore_p1"]["(24, 40)"][1] == (24 + 5 * 40) * w
        assert out["lazy_projection"]["(24, 40)"][2] == 4 * 40 * w
        assert out["powersgd"]["(24, 40)"][1] == (24 + 40) * 4 * w
        assert out["greedylore"]["(6, 6)"] == [36 * w] * 7
    # 30 words: P = 4 does not divide them; each rank counts its whole chunks, the mean is the formula
    per_rank = np.array([out["greedylore"]["(30,)"] for out in res[case_bytes].values()])
    assert np.array_equal(per_rank.mean(0), [30 * w] * 7)


def test_edge_shapes(mpi):
    """rank >= min(m, n) (compressed with min_compression_rate=0) is exact for all three
    methods, m > n included; small matrices and vectors go dense bit-for-bit."""
    _p, res = mpi
    for out in res[case_edge_shapes].values():
        assert out["tall_ok"]
        assert all(v < 1e-5 for k, v in out.items() if k != "tall_ok")


def test_nan_step_leaves_error_and_counter(mpi):
    """A NaN on one rank (nonfinite="skip", the NaN found by the fused first pass): the step is
    skipped everywhere with the error and step counter as they were; later steps unchanged."""
    _p, res = mpi
    assert all(res[case_nan_step].values())


def test_checkpoint_roundtrip(mpi):
    _p, res = mpi
    for out in res[case_checkpoint].values():
        assert all(out.values())


# ------------------------------------------------------ single process
def test_working_matrix_transposes_tall_matrices():
    a = np.zeros((7, 3))
    m, t = working_matrix(a)
    assert m.shape == (3, 7) and t
    m, t = working_matrix(a.T)
    assert m.shape == (3, 7) and not t


def test_left_singular_vectors_orthonormal_and_sorted():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((5, 9)).astype(np.float32)
    u = left_singular_vectors(g)
    assert u.shape == (5, 5) and u.dtype == np.float32
    assert np.allclose(u.T @ u, np.eye(5), atol=1e-5)
    energy = np.sum((u.T @ g) ** 2, axis=1)
    assert np.all(np.diff(energy) <= 1e-4)


def test_left_singular_vectors_span_the_svd_subspaces():
    """eigh of G G^T gives the SVD's U up to column signs: the projectors agree."""
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((30, 50)) * np.geomspace(5.0, 0.1, 30)[:, None]).astype(np.float64)
    u = left_singular_vectors(g)
    u_svd = np.linalg.svd(g)[0]
    assert np.allclose(np.abs(np.sum(u * u_svd, axis=0)), 1.0, atol=1e-8)
    for r in (1, 4, 17):
        assert np.allclose(u[:, :r] @ u[:, :r].T, u_svd[:, :r] @ u_svd[:, :r].T, atol=1e-8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("probes", [1, 3])
def test_add_and_probe_kernel(dtype, probes):
    rng = np.random.default_rng(4)
    m_mat = rng.standard_normal((7, 33)).astype(dtype)
    err = rng.standard_normal((7, 33)).astype(dtype)
    xi = rng.standard_normal((probes, 33)).astype(dtype)
    want_a = m_mat + err
    v = np.empty((7, probes), dtype=dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    dst = np.full_like(err, np.nan)              # into a second buffer: err is left as it was
    err_before = err.copy()
    add_and_probe(m_mat, err, xi, v, dst)
    assert np.array_equal(dst, want_a) and np.array_equal(err, err_before)
    assert np.allclose(v, want_a @ xi.T, rtol=tol, atol=tol)
    v2 = np.empty_like(v)
    add_and_probe(m_mat, err, xi, v2, err)       # in place
    assert np.array_equal(err, want_a) and np.allclose(v2, v, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("r", [1, 4, 5, 8, 9])
@pytest.mark.parametrize("probes", [1, 2])
def test_add_lowrank_and_probe_kernel(dtype, r, probes):
    """dst = M + base - Q C (the error kept unevaluated) and v = dst xi, against float64."""
    rng = np.random.default_rng(5)
    m, n = 9, 37
    m_mat, base = (rng.standard_normal((m, n)).astype(dtype) for _ in range(2))
    q = rng.standard_normal((m, r)).astype(dtype)
    c = rng.standard_normal((r, n)).astype(dtype)
    xi = rng.standard_normal((probes, n)).astype(dtype)
    qp, cp = pad_rank(q, c)
    assert qp.shape[1] % 4 == 0 and cp.shape[0] == qp.shape[1]
    assert np.array_equal(qp[:, :r], q) and np.array_equal(cp[:r], c) and not qp[:, r:].any() and not cp[r:].any()
    dst, v = np.full_like(base, np.nan), np.empty((m, probes), dtype=dtype)
    base_before = base.copy()
    add_lowrank_and_probe(m_mat, base, qp, cp, xi, v, dst)
    want = m_mat.astype(np.float64) + base - q.astype(np.float64) @ c
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert np.array_equal(base, base_before)
    assert np.allclose(dst, want, rtol=tol, atol=tol * r)
    assert np.allclose(v, want @ xi.T.astype(np.float64), rtol=tol, atol=tol * r * n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("r", [0, 1, 4, 8, 9])
@pytest.mark.parametrize("probes", [1, 3])
def test_first_pass_kernels_of_a_tall_tensor(dtype, r, probes):
    """The first pass in a tall tensor's own (row-major n x m) layout: dst_t = M^T + base^T
    (- (Q C)^T when the error is pending, r > 0) and v = A xi with A = dst_t^T, against float64;
    the same numbers as the working-orientation kernels give on the transposed arrays."""
    rng = np.random.default_rng(7)
    m, n = 6, 41                                  # working orientation m x n (m the short side)
    mat_t, base_t = (rng.standard_normal((n, m)).astype(dtype) for _ in range(2))
    xi = rng.standard_normal((probes, n)).astype(dtype)
    v, dst_t = np.empty((m, probes), dtype=dtype), np.full_like(base_t, np.nan)
    base_before = base_t.copy()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    if r == 0:
        add_and_probe_rows(mat_t, base_t, xi, v, dst_t)
        want_t = mat_t.astype(np.float64) + base_t
    else:
        q = rng.standard_normal((m, r)).astype(dtype)
        c = rng.standard_normal((r, n)).astype(dtype)
        qp, cp = pad_rank(q, c)
        add_lowrank_and_probe_rows(mat_t, base_t, np.ascontiguousarray(cp.T), np.ascontiguousarray(qp.T),
                                   xi, v, dst_t)
        want_t = mat_t.astype(np.float64) + base_t - (q.astype(np.float64) @ c).T
        v_work, dst_work = np.empty_like(v), np.empty((m, n), dtype=dtype)
        add_lowrank_and_probe(np.ascontiguousarray(mat_t.T), np.ascontiguousarray(base_t.T), qp, cp,
                              xi, v_work, dst_work)
        assert np.allclose(dst_work.T, dst_t, rtol=tol, atol=tol * r)
        assert np.allclose(v_work, v, rtol=tol, atol=tol * max(r, 1) * n)
    assert np.array_equal(base_t, base_before)
    assert np.allclose(dst_t, want_t, rtol=tol, atol=tol * max(r, 1))
    assert np.allclose(v, want_t.T @ xi.T.astype(np.float64), rtol=tol, atol=tol * max(r, 1) * n)
    if r == 0:                                    # in place, as the working-orientation kernel allows
        v2 = np.empty_like(v)
        add_and_probe_rows(mat_t, base_t, xi, v2, base_t)
        assert np.array_equal(base_t, dst_t) and np.allclose(v2, v, rtol=tol, atol=tol * n)


def test_pending_error_is_exact_and_materializes():
    """After a fused step the state holds A_i and (Q, C_i): the error they stand for is
    A_i - Q C_i (eq. 9b), materialize_error writes exactly that, and a step after
    materializing gives the same result as one from the unevaluated form."""
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()                       # one process: MPI.COMM_WORLD of size 1
    rng = np.random.default_rng(6)
    grads = [rng.standard_normal((12, 20)).astype(np.float32) for _ in range(4)]
    a, b = GreedyLore(rank=3, period=50, seed=2), GreedyLore(rank=3, period=50, seed=2)
    for g in grads[:3]:
        assert np.array_equal(a.allreduce(g, "w", comm), b.allreduce(g, "w", comm))
    st = a.state["w"]
    assert {"error_q", "error_c"} <= set(st)
    q, c_local = st["error_q"], st["error_c"]
    assert np.allclose(c_local, q.T @ st["error"], rtol=1e-5, atol=1e-5)     # C_i = Q^T A_i
    want = st["error"].astype(np.float64) - q.astype(np.float64) @ c_local
    got = current_error(st)
    assert np.allclose(got, want, atol=1e-6) and "error_q" in st               # current_error: no change
    e = materialize_error(st)
    assert "error_q" not in st and "error_c" not in st and e is st["error"]
    assert np.allclose(e, want, atol=1e-6)
    out_a, out_b = a.allreduce(grads[3], "w", comm), b.allreduce(grads[3], "w", comm)
    assert np.allclose(out_a, out_b, rtol=1e-5, atol=1e-6)
    assert np.allclose(current_error(a.state["w"]), current_error(b.state["w"]), atol=1e-5)


def test_pending_error_survives_a_change_to_the_unfused_path():
    """A float32 run whose state is then used by a float64 gradient (dtype mismatch: the
    unfused path) evaluates the pending error first instead of reading A_i as the error."""
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()                       # one process: MPI.COMM_WORLD of size 1
    rng = np.random.default_rng(7)
    meth = GreedyLore(rank=2, period=50, seed=1)
    for _ in range(3):
        meth.allreduce(rng.standard_normal((10, 16)).astype(np.float32), "w", comm)
    st = meth.state["w"]
    st.U = st.U.astype(np.float64)                # keep the subspace, change the dtype
    e_before = current_error(st).astype(np.float64)
    g = rng.standard_normal((10, 16))
    out = meth.allreduce(g, "w", comm)
    a = g + e_before
    q = st["U"][:, st["columns"]]
    assert np.allclose(out, q @ (q.T @ a), atol=1e-5)
    assert np.allclose(current_error(st), a - q @ (q.T @ a), atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("r", [1, 3, 4, 5, 9])
def test_reconstruct_and_subtract_kernel(dtype, r):
    """``out = q c`` and ``a -= q c_local`` in one sweep, against NumPy (every r mod 4)."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((11, r)).astype(dtype)
    c, c_local = (rng.standard_normal((r, 37)).astype(dtype) for _ in range(2))
    a = rng.standard_normal((11, 37)).astype(dtype)
    want_out, want_a = q @ c, a - q @ c_local
    out = np.full((11, 37), np.nan, dtype=dtype)
    reconstruct_and_subtract(q, c, c_local, out, a)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert np.allclose(out, want_out, rtol=tol, atol=tol)
    assert np.allclose(a, want_a, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 6, 9])
def test_reconstruct_and_subtract_low_rank(dtype, r):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((11, r)).astype(dtype)
    c = rng.standard_normal((r, 37)).astype(dtype)
    out = np.full((11, 37), np.nan, dtype=dtype)
    reconstruct(q, c, out)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert np.allclose(out, q @ c, rtol=tol, atol=tol)
    a = rng.standard_normal((11, 37)).astype(dtype)
    want = a - q @ c
    got = subtract_low_rank(a, q, c)
    assert got is a and np.allclose(a, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("r", [1, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 4, 11])
def test_project_kernel(dtype, r, m):
    """``project`` is ``q^T a`` (every row count mod 4, including fewer than four rows)."""
    rng = np.random.default_rng(6)
    a = rng.standard_normal((m, 37)).astype(dtype)
    q = rng.standard_normal((m, r)).astype(dtype)
    c = np.full((r, 37), np.nan, dtype=dtype)
    project(a, q, c)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert np.allclose(c, q.T.astype(np.float64) @ a.astype(np.float64), rtol=tol, atol=tol)


def test_probe_values_are_u_j_a_xi_j():
    rng = np.random.default_rng(1)
    u = np.linalg.qr(rng.standard_normal((4, 4)))[0]
    a = rng.standard_normal((4, 6))
    xi = rng.standard_normal((3, 4, 6))
    got = probe_values(u.T @ a, xi)
    want = np.array([[u[:, j] @ a @ xi[k, j] for k in range(3)] for j in range(4)])
    assert np.allclose(got, want)


def test_shared_probe_values_are_u_j_a_xi_without_forming_u_t_a():
    rng = np.random.default_rng(2)
    u = np.linalg.qr(rng.standard_normal((5, 5)))[0]
    a = rng.standard_normal((5, 7))
    xi = rng.standard_normal((3, 7))
    got = shared_probe_values(u, a, xi)
    want = np.array([[u[:, j] @ a @ xi[k] for k in range(3)] for j in range(5)])
    assert np.allclose(got, want)
    # = the paper's formula with xi_j = xi for every column
    assert np.allclose(got, probe_values(u.T @ a, np.broadcast_to(xi[:, None, :], (3, 5, 7))))


def test_shared_probes_draw_n_numbers_per_probe():
    m = GreedyLore(rank=2, probes=3)
    assert m.probes_for("w", 5, 40, 60, np.float32).shape == (3, 60)
    ind = GreedyLore(rank=2, probes=3, probe_mode="independent")
    assert ind.probes_for("w", 5, 40, 60, np.float32).shape == (3, 40, 60)
    with pytest.raises(ValueError, match="probe_mode"):
        GreedyLore(probe_mode="rademacher")


def test_top_indices_is_deterministic_with_ties():
    assert top_indices(np.array([1.0, 3.0, 3.0, 2.0, 3.0]), 2).tolist() == [1, 2]
    assert top_indices(np.array([0.0, 0.0, 0.0]), 2).tolist() == [0, 1]


def test_min_compression_rate_rule():
    assert should_compress(64, 64, 8, 2.0)              # 2*128*8 = 2048 < 4096
    assert not should_compress(16, 16, 8, 2.0)          # 2*32*8 = 512 > 256
    assert not should_compress(10, 128, 8, 2.0)         # 2*138*8 = 2208 > 1280
    assert should_compress(5, 12, 9, 0.0)               # rate 0 compresses everything


def test_schedule_counts_from_first_compressed_step():
    m = GreedyLore(period=3, warmup_steps=2)
    assert [s for s in range(1, 12) if m.is_svd_step(s)] == [3, 6, 9]


def test_expected_bytes_is_period_average():
    m = GreedyLore(rank=4, period=10)
    w = 2.0 * 4 * 3 / 4
    want = (9 * (32 + 4 * 64) + 32 * 64) / 10 * w
    assert m.expected_bytes((64, 32), 4) == pytest.approx(want)


@pytest.mark.parametrize("kwargs, words", [
    ({"rank": 0}, ["rank", "[1, inf]"]),
    ({"period": 0}, ["period"]),
    ({"probes": 0}, ["probes"]),
    ({"feedback": "ef21"}, ["feedback", "residual"]),
    ({"min_compression_rate": -1}, ["min_compression_rate"]),
    ({"rank": 2.5}, ["rank", "integer"]),
    ({"warmup_steps": -3}, ["warmup_steps"]),
])
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError) as info:
        hvdc.Compression.greedylore(**kwargs)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("kwargs,match", [({"rank": 0}, "rank must be an integer"),
                                          ({"period": -1}, "period must be an integer"),
                                          ({"feedback": "residual"}, "unknown parameter 'feedback'")])
def test_lazy_projection_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hvdc.Compression.lazy_projection(**kwargs)


def test_registered_with_layout_matrix():
    for name in ("greedylore", "powersgd", "lazy_projection"):
        meth = hvdc.Compression.by_name(name)
        assert meth.layout == "matrix" and meth.biased
    assert hvdc.Compression.greedylore().config()["feedback"] == "residual"


@pytest.mark.parametrize("shape, rank, rows", [
    ((24, 60), 3, (6, 12)),          # wide: Q[lo:hi] C
    ((60, 24), 3, (15, 30)),         # tall, transposed: (Q C[:, lo:hi])^T
    ((200, 64), 20, (150, 200)),     # tall above the tall kernel's rank (16): BLAS
    ((24, 60), 8, (20, 27)),         # wide above the kernel's rank (5): BLAS; past the last row
])
def test_kept_rows_are_the_rows_of_the_full_estimate(shape, rank, rows):
    """Method.keep_rows (FSDP2: a rank reads only its chunk of rows): over SVD and ordinary
    steps the kept rows are the same bits as without it, the error (which uses C_i) is the
    same, and on ordinary steps the other rows are not built (zero)."""
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()                       # one process: MPI.COMM_WORLD of size 1
    full, kept = GreedyLore(rank=rank, period=3, seed=4), GreedyLore(rank=rank, period=3, seed=4)
    kept.keep_rows({"w": rows})
    lo, hi = rows[0], min(rows[1], shape[0])
    for t in range(7):
        g = np.random.default_rng(t).standard_normal(shape).astype(np.float32)
        a, b = full.allreduce(g, "w", comm), kept.allreduce(g, "w", comm)
        assert np.array_equal(a[lo:hi], b[lo:hi]), (t, float(np.abs(a[lo:hi] - b[lo:hi]).max()))
        if t % 3:                               # ordinary steps (1, 4 are SVD steps: dense)
            assert not b[:lo].any() and not b[hi:].any(), t
            assert a[:lo].any() or a[hi:].any()
        assert np.array_equal(current_error(full.state["w"]), current_error(kept.state["w"]))
