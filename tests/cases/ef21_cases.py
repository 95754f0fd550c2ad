"""Per-rank cases for the EF21 / EF21M feedback (run by tests/test_ef21.py)."""
from __future__ import annotations

import numpy as np

import horovod_compress as hvdc


def _x(rank: int, step: int, shape=(12, 10)) -> np.ndarray:
    return np.random.default_rng(10_000 * step + rank).standard_normal(shape).astype(np.float32)


def _gather64(comm, a: np.ndarray) -> np.ndarray:
    return comm.allgather(np.ascontiguousarray(a, dtype=np.float64))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).ravel()


def case_ef21m_recursion(comm):
    """Eqs. (11a)-(11c) against a float64 reference, through 2 warm-up + 10 compressed steps.

    Rand-K with shared indices is the compressor, so the reference knows C_local
    exactly: c_i = mask_t * (h_i - g_i).
    """
    eta, warm, steps, shape = 0.3, 2, 12, (12, 10)
    method = hvdc.Compression.randk(density=0.25, feedback="ef21m", eta=eta,
                                    warmup_steps=warm, seed=4)
    n = int(np.prod(shape))
    h = g = big_g = None
    for t in range(1, steps + 1):
        x = _x(comm.rank, t, shape)
        out = method.allreduce(x, "w", comm)
        xs = _gather64(comm, x)
        if t <= warm:                              # dense step: exact average, trackers reset
            np.testing.assert_allclose(out, xs.mean(axis=0), rtol=1e-6, atol=1e-6)
            h = x.astype(np.float64)
            g = h.copy()
            big_g = xs.mean(axis=0)
        else:
            h = (1 - eta) * h + eta * x                                      # (11a)
            mask = np.zeros(n, bool)
            mask[method.indices("w", t, n)] = True
            c = np.where(mask.reshape(shape), h - g, 0.0)
            g = g + c                                                        # (11b)
            big_g = big_g + _gather64(comm, c).mean(axis=0)                  # (11c)
            np.testing.assert_allclose(out, big_g, rtol=1e-5, atol=1e-5)
        st = method.state["w"]
        np.testing.assert_allclose(st["fb_h"], h, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(st["fb_g"], g, rtol=1e-5, atol=1e-5)
        # G is the average of the per-rank trackers g_i, and the same bits everywhere.
        np.testing.assert_allclose(st["fb_G"], _gather64(comm, st["fb_g"]).mean(axis=0),
                                   rtol=1e-5, atol=1e-5)
        everyone = comm.allgather(_bits(out))
        assert all(np.array_equal(everyone[0], e) for e in everyone)
    return {"steps": steps}


def case_ef21_identity_compressor(comm):
    """With C = identity (randk at density 1), EF21 is exact and EF21M is the EMA of avg x."""
    ef21 = hvdc.Compression.randk(density=1.0, feedback="ef21")
    ef21m = hvdc.Compression.randk(density=1.0, feedback="ef21m", eta=0.25)
    ema = None
    for t in range(1, 8):
        x = _x(comm.rank, t)
        avg = _gather64(comm, x).mean(axis=0)
        np.testing.assert_allclose(ef21.allreduce(x, "w", comm), avg, rtol=1e-5, atol=1e-5)
        ema = 0.25 * avg if ema is None else 0.75 * ema + 0.25 * avg     # zero-initialised
        np.testing.assert_allclose(ef21m.allreduce(x, "w", comm), ema, rtol=1e-5, atol=1e-5)
    assert "fb_h" not in ef21.state["w"] and "fb_h" in ef21m.state["w"]
    return {}


def case_ef21m_any_biased_method(comm):
    """One parameter turns EF21M on for every biased method; G = avg_i g_i and is shared."""
    methods = {
        "topk": hvdc.Compression.topk(density=0.1, feedback="ef21m", eta=0.5),
        "randk": hvdc.Compression.randk(density=0.1, feedback="ef21m", eta=0.5),
        "arc_topk": hvdc.Compression.arc_topk(ratio=0.25, rank=2, eta=0.5),
        "randk_rows": hvdc.Compression.randk_rows(ratio=0.25, eta=0.5),
        "topk_rows": hvdc.Compression.topk_rows(ratio=0.25, eta=0.5),
        "arc_ef21": hvdc.Compression.arc_topk(ratio=0.25, rank=2, feedback="ef21"),
    }
    out = {}
    for label, method in methods.items():
        assert method.feedback.name in ("ef21m", "ef21")
        for t in range(1, 7):
            res = method.allreduce(_x(comm.rank, t, (16, 8)), "w", comm)
        st = method.state["w"]
        assert set(k for k in st if k.startswith("fb_")) == (
            {"fb_g", "fb_G"} if label == "arc_ef21" else {"fb_h", "fb_g", "fb_G"})
        mean_g = _gather64(comm, st["fb_g"]).mean(axis=0)
        np.testing.assert_allclose(st["fb_G"], mean_g, rtol=1e-5, atol=1e-5)
        everyone = comm.allgather(_bits(res))
        assert all(np.array_equal(everyone[0], e) for e in everyone), label
        out[label] = float(np.abs(res).sum())
    return out


def case_ef21_tracks_constant_gradient(comm):
    """Constant heterogeneous x_i whose big part cancels across ranks (Prop. 1 style).

    ARC-Top-K is contractive for the average, so EF21's G -> avg x geometrically
    (expected rate (1 - K/m) per step); without feedback the error stays at its
    one-shot level.
    """
    m, n = 20, 16
    rng = np.random.default_rng(3)
    a = rng.standard_normal((m, n))
    b = np.zeros((m, n))
    b[:10] = 20 * rng.standard_normal((10, n))
    x = (a + (-1.0 if comm.rank % 2 == 0 else 1.0) * b).astype(np.float32)
    avg = _gather64(comm, x).mean(axis=0)
    norm2 = float(np.sum(avg ** 2))
    ef = hvdc.Compression.arc_topk(ratio=0.2, rank=2, feedback="ef21", seed=1)
    plain = hvdc.Compression.arc_topk(ratio=0.2, rank=2, feedback="none", seed=1)
    errs_ef, errs_plain = [], []
    for _ in range(80):
        errs_ef.append(float(np.sum((ef.allreduce(x, "w", comm) - avg) ** 2)) / norm2)
        errs_plain.append(float(np.sum((plain.allreduce(x, "w", comm) - avg) ** 2)) / norm2)
    return {"ef21": errs_ef, "none": errs_plain}


def case_state_dict_resume(comm):
    """Trackers are method state: save after 5 steps, restore into a new object, same result."""
    def make():
        return hvdc.Compression.arc_topk(ratio=0.25, rank=2, eta=0.3, warmup_steps=2, seed=8)

    straight, first = make(), make()
    for t in range(1, 6):
        straight.allreduce(_x(comm.rank, t), "w", comm)
        first.allreduce(_x(comm.rank, t), "w", comm)
    sd = first.state_dict()
    assert {"fb_h", "fb_g", "fb_G", "t"} <= set(sd["state"]["w"])
    resumed = make()
    resumed.load_state_dict(sd)
    for t in range(6, 10):
        a = straight.allreduce(_x(comm.rank, t), "w", comm)
        b = resumed.allreduce(_x(comm.rank, t), "w", comm)
        assert np.array_equal(_bits(a), _bits(b))
    return {}
