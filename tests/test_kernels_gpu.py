"""Every GPU kernel against its CPU kernel, under Numba's CUDA simulator (no GPU needed).

Every ``check_*`` function takes ``to_dev`` (NumPy -> device array) and
``to_host`` (device array -> NumPy), runs a GPU kernel and the CPU kernel on
the same data and asserts equal results: bit-identical to the CPU kernels'
(the randomized kernels share the counter-based generator), with 1e-12
relative tolerance only for the two float reductions whose summation order
differs by design (Gaussian threshold, row norms). Sizes are small but span
several blocks and several scan tiles of the simulator's launch shape
(TPB=32, ITEMS=16, 3 blocks).

``NUMBA_ENABLE_CUDASIM=1`` must be set before Numba is imported, so the
checks run in one subprocess started here: this file run as a script
(``python tests/test_kernels_gpu.py [check_name ...]``) turns the simulator
on, runs the checks with Numba device arrays and prints a JSON object
``{check: "ok" | traceback}``; each check is reported as its own test.
tests/test_kernels_gpu_cupy.py runs the same checks with CuPy arrays on a
real device.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402


# ------------------------------------------------------------------ helpers of the checks
def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _eq(a, b, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), \
        f"{what}: {int((a != b).sum())} of {a.size} differ; first {np.flatnonzero(a != b)[:5]}"


# ------------------------------------------------------------------ selection
def check_select_by_threshold(to_dev, to_host):
    from horovod_compress.kernels import selection as cpu
    from horovod_compress.kernels.gpu import selection as gpu
    x = _rng(0).standard_normal(2000).astype(np.float32)
    x[::7] = 0.0
    for thr in (1.9, 0.0, 10.0):
        i1, v1 = cpu.select_by_threshold(x, thr)
        i2, v2 = gpu.select_by_threshold(to_dev(x), thr)
        _eq(to_host(i2), i1, f"indices thr={thr}")
        _eq(to_host(v2), v1, f"values thr={thr}")
        assert gpu.count_at_least(to_dev(x), thr) == cpu.count_at_least(x, thr) == i1.size
    assert cpu.count_at_least(x, 0.0) == 2000 - 286  # zeros are never selected
    x64 = _rng(1).standard_normal(300)
    i1, v1 = cpu.select_by_threshold(x64, 1.0)
    i2, v2 = gpu.select_by_threshold(to_dev(x64), 1.0)
    _eq(to_host(i2), i1, "float64 indices")
    _eq(to_host(v2), v1, "float64 values")
    x16 = x[:200].astype(np.float16)
    i1, v1 = cpu.select_by_threshold(x16, 1.0)
    i2, v2 = gpu.select_by_threshold(to_dev(x16), 1.0)
    _eq(to_host(i2), i1, "float16 indices")
    _eq(to_host(v2), v1, "float16 values widened to float32")


def check_kth_largest_abs(to_dev, to_host):
    from horovod_compress.kernels import selection as cpu
    from horovod_compress.kernels.gpu import selection as gpu
    x = _rng(2).standard_normal(1500).astype(np.float32)
    d = to_dev(x)
    for k in (1, 37):
        a, b = cpu.kth_largest_abs(x, k), gpu.kth_largest_abs(d, k)
        assert a == b == np.sort(np.abs(x))[-k], (k, a, b)
    ties = np.round(x * 2) / 2  # few distinct magnitudes: ties everywhere
    a, b = cpu.kth_largest_abs(ties, 400), gpu.kth_largest_abs(to_dev(ties), 400)
    assert a == b == np.sort(np.abs(ties))[-400], (a, b)
    assert gpu.kth_largest_abs(d, 0) == math.inf and gpu.kth_largest_abs(d, 1501) == 0.0
    x64 = _rng(3).standard_normal(200)
    a, b = cpu.kth_largest_abs(x64, 9), gpu.kth_largest_abs(to_dev(x64), 9)
    assert a == b == np.sort(np.abs(x64))[-9], (a, b)


def check_gaussian_threshold(to_dev, to_host):
    from horovod_compress.kernels import selection as cpu
    from horovod_compress.kernels.gpu import selection as gpu
    x = (_rng(4).standard_normal(1200) * 0.3 + 0.05).astype(np.float32)
    for density in (0.01, 0.5):
        a, b = cpu.gaussian_threshold(x, density), gpu.gaussian_threshold(to_dev(x), density)
        assert abs(a - b) <= 1e-12 * abs(a), (density, a, b)
    try:
        gpu.gaussian_threshold(to_dev(x), 0.0)
    except ValueError as e:
        assert "density" in str(e)
    else:
        raise AssertionError("density=0 must raise ValueError")


def check_coo_sum(to_dev, to_host):
    from horovod_compress.kernels import selection as cpu
    from horovod_compress.kernels.gpu import selection as gpu
    rng = _rng(5)
    # four "ranks" selecting from [0, 400): many duplicates, values of mixed scale
    idx = np.concatenate([np.sort(rng.choice(400, 150, replace=False)) for _ in range(4)])
    val = (rng.standard_normal(600) * 10.0 ** rng.integers(-8, 8, 600)).astype(np.float32)
    a = cpu.coo_sum(idx, val)
    b = gpu.coo_sum(to_dev(idx), to_dev(val))
    _eq(to_host(b[0]), a[0], "coo indices")
    _eq(to_host(b[1]), a[1], "coo sums (same float64 additions in input order)")
    far = np.array([5, 10**9, 5, 3, 10**9], np.int64)  # sparse range: host path
    fv = np.arange(5, dtype=np.float64)
    a = cpu.coo_sum(far, fv)
    b = gpu.coo_sum(to_dev(far), to_dev(fv))
    _eq(to_host(b[0]), a[0], "far indices")
    _eq(to_host(b[1]), a[1], "far sums")
    e = gpu.coo_sum(to_dev(np.empty(0, np.int64)), to_dev(np.empty(0, np.float32)))
    assert e[0].size == 0 and e[1].size == 0


# ------------------------------------------------------------------ quantize
def _awkward(n: int, seed: int) -> np.ndarray:
    x = _rng(seed).standard_normal(n).astype(np.float32)
    x[:6] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-30]
    return x


def check_linear_quantize(to_dev, to_host):
    from horovod_compress.kernels import quantize as cpu
    from horovod_compress.kernels.gpu import quantize as gpu
    x = _awkward(1000, 6)
    norm = float(np.linalg.norm(x[6:]))
    for levels, scale, key in ((127, 1.0 / norm, 12345), (7, 1.0 / norm, 2**63 + 11),
                               (3, 100.0 / norm, 7)):  # the last one clips above the top level
        q1 = cpu.linear_quantize(x, scale, levels, key)
        q2 = gpu.linear_quantize(to_dev(x), scale, levels, key)
        _eq(to_host(q2), q1, f"levels={levels}")
        _eq(to_host(gpu.linear_dequantize(to_dev(q1), scale / levels)),
            cpu.linear_dequantize(q1, scale / levels), "dequantize float32")
        _eq(to_host(gpu.linear_dequantize(to_dev(q1), 0.1, np.float64)),
            cpu.linear_dequantize(q1, 0.1, np.float64), "dequantize float64")
    assert np.any(np.abs(q1) == 3)


def check_exp_quantize(to_dev, to_host):
    from horovod_compress.kernels import quantize as cpu
    from horovod_compress.kernels.gpu import quantize as gpu
    x = _awkward(1000, 7)
    x[6:40] = 0.9  # above 1/2 after scaling by 1: saturates to e = 1
    for bits, scale in ((8, 1.0), (4, 1.0), (4, 0.02), (8, 1e-30)):
        c1 = cpu.exp_quantize(x, scale, bits, 99)
        c2 = gpu.exp_quantize(to_dev(x), scale, bits, 99)
        _eq(to_host(c2), c1, f"codes bits={bits} scale={scale}")
    # Global-QSGD's 8-bit word layout: the host's exp8_quantize, at scales where the 16-bit draw
    # decides almost every element and where the whole word must (tiny values, above 1/2)
    from horovod_compress.kernels import qsgd_fused
    for scale in (1.0, 0.02, 1e-30):
        _eq(to_host(gpu.exp8_quantize(to_dev(x), scale, 99)), qsgd_fused.exp8_quantize(x, scale, 99),
            f"exp8 codes scale={scale}")
    codes8 = np.arange(256, dtype=np.uint8)
    _eq(to_host(gpu.exp_dequantize(to_dev(codes8), 3.0, 8)), cpu.exp_dequantize(codes8, 3.0, 8), "deq8")
    codes4 = np.arange(16, dtype=np.uint8)
    _eq(to_host(gpu.exp_dequantize(to_dev(codes4), 0.5, 4, np.float64)),
        cpu.exp_dequantize(codes4, 0.5, 4, np.float64), "deq4")


def check_nibbles(to_dev, to_host):
    from horovod_compress.kernels import quantize as cpu
    from horovod_compress.kernels.gpu import quantize as gpu
    rng = _rng(8)
    levels = rng.integers(-7, 8, 777).astype(np.int8)  # odd length
    p1 = cpu.pack_nibbles(levels)
    p2 = gpu.pack_nibbles(to_dev(levels))
    _eq(to_host(p2), p1, "pack signed")
    _eq(to_host(gpu.unpack_nibbles(to_dev(p1), 777, signed=True)), cpu.unpack_nibbles(p1, 777, True),
        "unpack signed")
    codes = rng.integers(0, 16, 600).astype(np.uint8)
    pc = cpu.pack_nibbles(codes)
    _eq(to_host(gpu.pack_nibbles(to_dev(codes))), pc, "pack codes")
    _eq(to_host(gpu.unpack_nibbles(to_dev(pc), 599)), cpu.unpack_nibbles(pc, 599), "unpack codes")
    a = cpu.pack_nibbles(rng.integers(-4, 4, 500).astype(np.int8))
    b = cpu.pack_nibbles(rng.integers(-4, 4, 500).astype(np.int8))
    o1 = np.empty_like(a)
    cpu.nibble_add_into(a, b, o1)
    da, db = to_dev(a), to_dev(b)
    gpu.nibble_add_into(da, db, db)  # aliasing out with b, as MPI's inout buffer
    _eq(to_host(db), o1, "nibble add")


def check_exp_reduce(to_dev, to_host):
    from horovod_compress.kernels import exp_reduce as cpu
    from horovod_compress.kernels.gpu import exp_reduce as gpu
    rng = _rng(9)
    n = 1500
    a = rng.integers(0, 256, n).astype(np.uint8)
    b = rng.integers(0, 256, n).astype(np.uint8)
    a[:200] = 1  # e = 1, same sign: the rounded sum can hit 1 and saturate
    b[:200] = 2
    # 8-bit words are lane_word(key, counter + i): counter 1000 starts on a stream word,
    # 1003 mid-word (the CPU kernel's two-word path); random bytes give redo lanes too
    for bits, counter in ((8, 1000), (8, 1003), (4, 1000)):
        r1, s1 = cpu.exp_reduce_packed(a, b, bits, key=77, counter=counter)
        r2, s2 = gpu.exp_reduce_packed(to_dev(a), to_dev(b), bits, key=77, counter=counter)
        _eq(to_host(r2), r1, f"exp_reduce_packed bits={bits} counter={counter}")
        assert s1 == s2 > 0, (bits, s1, s2)  # 1/2 + 1/4 rounds up to 1 half of the time
    words = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    words[:10] = [0, 1, 2**63, 2**64 - 1, 2**62, 2**61, 3, 2**40, 2**63 - 1, 2**32]
    c4 = rng.integers(0, 16, n).astype(np.uint8)
    d4 = rng.integers(0, 16, n).astype(np.uint8)
    for bits, (x, y) in ((8, (a, b)), (4, (c4, d4))):
        _eq(to_host(gpu.exp_reduce_codes(to_dev(x), to_dev(y), to_dev(words), bits)),
            cpu.exp_reduce_codes(x, y, words, bits), f"exp_reduce_codes bits={bits}")
    db = to_dev(b)
    s_alias = gpu.exp_reduce8_into(to_dev(a), db, db, 5, 0)
    o = np.empty_like(b)
    assert s_alias == cpu.exp_reduce8_into(a, b, o, np.uint64(5), np.uint64(0))
    _eq(to_host(db), o, "exp_reduce8_into with out aliasing b")
    db = to_dev(b)
    s4 = gpu.exp_reduce4_into(to_dev(a), db, db, 6, 3)
    assert s4 == cpu.exp_reduce4_into(a, b, o, np.uint64(6), np.uint64(3))
    _eq(to_host(db), o, "exp_reduce4_into with out aliasing b")


def check_random_streams(to_dev, to_host):
    from horovod_compress.kernels import quantize as cpu
    from horovod_compress.kernels.gpu import rng as gpu
    like = to_dev(np.zeros(1, np.uint8))
    key = 0xDEADBEEFCAFEF00D
    _eq(to_host(gpu.random_words(key, 2**40, 300, like)),
        cpu.random_words(np.uint64(key), np.uint64(2**40), 300), "words")
    _eq(to_host(gpu.random_uniforms(key, 5, 300, like)),
        cpu.random_uniforms(np.uint64(key), np.uint64(5), 300), "uniforms")


# ---------------------------------------------------------------------- bloom
def check_bloom(to_dev, to_host):
    from horovod_compress.kernels import bloom as cpu
    from horovod_compress.kernels.gpu import bloom as gpu
    rng = _rng(10)
    n = 1500
    idx = np.sort(rng.choice(n, 60, replace=False)).astype(np.int64)
    m, h, seed = 1001, 3, np.uint64(424242)  # m not a multiple of 8 or 32
    _eq(to_host(gpu.bloom_positions(to_dev(idx), m, h, seed)), cpu.bloom_positions(idx, m, h, seed),
        "positions")
    f1 = cpu.bloom_insert(idx, m, h, seed)
    f2 = gpu.bloom_insert(to_dev(idx), m, h, seed)
    _eq(to_host(f2), f1, "filter bytes")
    p1 = cpu.bloom_query_range(f1, m, h, seed, n)
    p2 = gpu.bloom_query_range(to_dev(f1), m, h, seed, n)
    _eq(to_host(p2), p1, "positives")
    assert np.all(np.isin(idx, p1)) and p1.size > idx.size  # no false negatives, some false positives


# ------------------------------------------------------------------------ rle
def check_rle(to_dev, to_host):
    from horovod_compress.kernels import rle as cpu
    from horovod_compress.kernels.gpu import rle as gpu
    rng = _rng(11)
    n = 3000
    bitmap = np.repeat(rng.random(300) < 0.3, rng.integers(1, 20, 300))[:n]
    bitmap[0] = bitmap[-1] = True
    cases = [np.flatnonzero(bitmap), np.flatnonzero(bitmap[:n]) [1:-1], np.arange(n), np.array([7]),
             np.empty(0, np.int64)]
    for idx in cases:
        idx = idx.astype(np.int64)
        r1 = cpu.runs_from_sorted_indices(idx, n)
        r2 = gpu.runs_from_sorted_indices(to_dev(idx), n)
        _eq(to_host(r2), r1, f"runs of {idx.size} indices")
        i1, s1 = cpu.indices_from_runs(r1, n)
        i2, s2 = gpu.indices_from_runs(to_dev(r1), n)
        assert s1 == s2 == cpu.OK
        _eq(to_host(i2), i1, "indices from runs")
        _eq(i1, idx, "round trip")
    bad = [np.array([1, 2], np.int64), np.array([3, 0, 2997], np.int64), np.array([3, 5, 2991], np.int64),
           np.array([-1, 5, 2996], np.int64), np.array([2**62, 1, 2], np.int64),
           np.array([0, 2**62, 2**62, 1, 0], np.int64)]
    for r in bad:
        _, s1 = cpu.indices_from_runs(r, n)
        i2, s2 = gpu.indices_from_runs(to_dev(r), n)
        assert s1 == s2 == cpu.INVALID and i2.size == 0, (r, s1, s2)
    vals = np.array([0, 1, 127, 128, 300, 2**14, 2**35 + 5, 2**62, 2**63 - 1] + list(rng.integers(0, 2**20, 200)),
                    np.int64)
    e1 = cpu.varint_encode(vals)
    _eq(to_host(gpu.varint_encode(to_dev(vals))), e1, "varint encode")
    for buf, count in ((e1, vals.size), (e1, 5), (e1[:-1], vals.size), (e1[:13], vals.size),
                       (np.full(12, 0x80, np.uint8), 1), (np.full(5, 0x80, np.uint8), 1),
                       (np.concatenate([e1[:4], np.full(11, 0xFF, np.uint8), [1]]).astype(np.uint8), 6),
                       (np.empty(0, np.uint8), 0), (np.empty(0, np.uint8), 2)):
        v1, u1, s1 = cpu.varint_decode(buf, count)
        v2, u2, s2 = gpu.varint_decode(to_dev(buf), count)
        assert (u1, s1) == (u2, s2), (count, buf.size, (u1, s1), (u2, s2))
        _eq(to_host(v2), v1, f"varint decode count={count} size={buf.size}")


# ----------------------------------------------------------------------- rows
def check_rows(to_dev, to_host):
    from horovod_compress.kernels import rows as cpu
    from horovod_compress.kernels.gpu import rows as gpu
    rng = _rng(12)
    mat = rng.standard_normal((40, 23)).astype(np.float32)
    rows = np.array([0, 3, 4, 17, 39], np.int64)
    g = gpu.gather_rows(to_dev(mat), to_dev(rows))
    _eq(to_host(g), cpu.gather_rows(mat, rows), "gather")
    _eq(to_host(gpu.scatter_rows(g, to_dev(rows), 40)), cpu.scatter_rows(mat[rows], rows, 40), "scatter")
    out = to_dev(np.full((40, 23), 5.0, np.float32))
    gpu.scatter_rows(g, to_dev(rows), 40, out=out)
    _eq(to_host(out), cpu.scatter_rows(mat[rows], rows, 40), "scatter into out (zeroed first)")
    s1 = cpu.row_sq_norms(mat)
    s2 = to_host(gpu.row_sq_norms(to_dev(mat)))
    assert s2.dtype == s1.dtype and np.allclose(s2, s1, rtol=1e-6, atol=0), np.abs(s2 - s1).max()


# ------------------------------------------------------------------- dispatch
def check_dispatch_routes_device_arrays(to_dev, to_host):
    from horovod_compress.kernels import dispatch, selection
    x = _rng(13).standard_normal(700).astype(np.float32)
    d = to_dev(x)
    assert dispatch.device_of(d, 1.0) == "gpu" and dispatch.is_gpu_array(d)
    idx, val = dispatch.select_by_threshold(d, 1.5)
    assert dispatch.is_gpu_array(idx) and dispatch.is_gpu_array(val)  # results stay on the device
    i1, v1 = selection.select_by_threshold(x, 1.5)
    _eq(to_host(idx), i1, "dispatched indices")
    _eq(to_host(val), v1, "dispatched values")
    q = dispatch.call("linear_quantize", d, 0.1, 7, 3)
    assert dispatch.is_gpu_array(q)
    try:
        dispatch.call("coo_sum", np.arange(3), d[:3])
    except ValueError as e:
        assert "mix" in str(e)
    else:
        raise AssertionError("mixing host and device arrays must raise")


# Every check, in file order (what the simulator run and the CuPy tests run).
CHECKS = [f for name, f in dict(globals()).items() if name.startswith("check_")]


def _main(names: list[str]) -> None:
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # uint64 wrap-around in simulated threads
    sys.setswitchinterval(1e-4)  # simulated threads hand over the GIL at every barrier: keep that fast
    from numba import cuda
    results = {}
    by_name = {check.__name__: check for check in CHECKS}
    for name in names or by_name:
        t0 = time.perf_counter()
        try:
            by_name[name](cuda.to_device, lambda a: a.copy_to_host())
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 - report every failure, keep going
            results[name] = traceback.format_exc()
        sys.stderr.write(f"{name}: {time.perf_counter() - t0:.1f} s\n")
    print(json.dumps(results))


# ------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def simulator_results() -> dict[str, str]:
    from horovod_compress.tools.testing import simulator_check_results
    return simulator_check_results(__file__, timeout=600)


@pytest.mark.parametrize("check", CHECKS)
def test_gpu_kernel_matches_cpu_under_simulator(simulator_results: dict[str, str], check) -> None:
    assert check.__name__ in simulator_results, f"{check.__name__} did not run"
    assert simulator_results[check.__name__] == "ok", simulator_results[check.__name__]


def test_every_dispatchable_gpu_kernel_is_checked() -> None:
    """A kernel registered with a GPU version must be called by some simulator check."""
    from horovod_compress.kernels import dispatch
    source = Path(__file__).read_text()
    missing = [name for name in dispatch.registered()
               if dispatch.has_gpu(name) and f"gpu.{name}(" not in source and f"dispatch.{name}(" not in source]
    assert not missing, f"GPU kernels without a simulator check: {missing}"


if __name__ == "__main__":
    _main(sys.argv[1:])
