"""DeepReduce as a compressed allreduce: exactness, byte counts, feedback, argument checks.

Paper: "DeepReduce: A Sparse-tensor Communication Framework for Distributed
Deep Learning" (NeurIPS 2021), Sections 3-5 (index and value codecs, Bloom
policies P0/P1/P2, polynomial fit), Algorithm 1.

The per-rank cases (``case_*``, run on 2 and 4 real ranks by ``run_cases``)
compute every reference from all ranks' inputs (gathered with the
communicator) or from containers encoded independently of the method's
``allreduce``; sums are formed in the same order as the method's (rank by
rank, float64, then cast), so lossless configurations compare bit for bit, and
byte counts are checked against the communicator's allgatherv volume model.
"""
from __future__ import annotations

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress import codecs
from horovod_compress.compressors.sparse_common import (
    k_from_density,
    scatter_sum,
    topk_indices,
)
from horovod_compress.tools.testing import run_cases, same_on_all_ranks

N = 3000


def _input(comm, seed: int = 100, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed + comm.rank).standard_normal(n).astype(np.float32)


def _sum_in_rank_order(n: int, parts: list[tuple[np.ndarray, np.ndarray]], size: int) -> np.ndarray:
    slots = np.concatenate([s for s, _ in parts])
    values = np.concatenate([v.astype(np.float64) for _, v in parts])
    return scatter_sum(n, slots, values, np.dtype(np.float32)) / np.float32(size)


def _allgatherv_bytes(sizes: np.ndarray, rank: int) -> tuple[float, float]:
    """The communicator's model: ring allgatherv of the containers + allgather of 8-byte counts."""
    p = sizes.size
    total = int(sizes.sum())
    sent = total - int(sizes[(rank + 1) % p]) + 8 * (p - 1)
    received = total - int(sizes[rank]) + 8 * (p - 1)
    return float(sent), float(received)


def case_lossless_equals_dense_reference(comm):
    """Lossless codecs: avg = (1/P) sum_j Topk(x_j) exactly; bytes = the allgatherv model."""
    x = _input(comm)
    all_x = comm.allgather(x)
    density = 0.02
    k = k_from_density("topk", density, N)
    parts = []
    for j in range(comm.size):
        s = np.sort(topk_indices(all_x[j], k))
        parts.append((s, all_x[j][s]))
    ref = _sum_in_rank_order(N, parts, comm.size)
    configs = [dict(index=i, value=v) for i in ("raw", "bitmap", "rle", "huffman")
               for v in ("raw", "deflate")]
    configs.append(dict(index="bloom", policy="p0", fp_values="sparse", value="raw"))
    sizes_out = {}
    for cfg in configs:
        method = hvdc.Compression.deepreduce(density=density, feedback="none", **cfg)
        comm.reset_stats()
        out = method.allreduce(x, "w", comm)
        stats = comm.stats()
        np.testing.assert_array_equal(out, ref, err_msg=str(cfg))
        mine = method.state["w"]["container_bytes"]
        sizes = comm.allgather(np.array([mine], np.int64)).reshape(-1)
        sent, received = _allgatherv_bytes(sizes, comm.rank)
        assert stats["sent"] == sent and stats["received"] == received, (cfg, stats, sent)
        sizes_out[f"{cfg['index']}-{cfg['value']}"] = int(mine)
    # raw/raw: header (31 bytes for n = 3000, k = 60) + (1 + 4k) index + 4k value bytes
    assert sizes_out["raw-raw"] == 31 + (1 + 4 * k) + 4 * k, sizes_out["raw-raw"]
    return sizes_out


LOSSY = [dict(index="bloom", policy="p2", value="raw"),
         dict(index="bloom", policy="p0", value="raw"),
         dict(index="bloom", policy="p1", value="polyfit"),
         dict(index="bloom", policy="naive", value="raw"),
         dict(index="bloom", policy="p0", value="qsgd"),
         dict(index="huffman", value="dexp"),
         dict(index="raw", value="polyfit"),
         dict(index="rle", value="qsgd")]


def case_lossy_within_the_codecs_bounds(comm):
    """Lossy codecs: the mean every rank receives against a reference from all ranks' inputs
    alone (:func:`_check_the_mean_independently`); each rank's own container against its input
    (:func:`_check_against_the_input`), and residual = x - D(c_i) for its decoded container."""
    x = _input(comm, 200)
    all_x = np.stack(comm.allgather(x)).astype(np.float64)
    density, fpr = 0.01, 0.01
    k = k_from_density("topk", density, N)
    for cfg in LOSSY:
        method = hvdc.Compression.deepreduce(density=density, fpr=fpr, **cfg)
        out = method.allreduce(x, "w", comm)
        assert same_on_all_ranks(comm, out), "ranks disagree on the result"
        _check_the_mean_independently(out, all_x, k, fpr, cfg)
        twin = hvdc.Compression.deepreduce(density=density, fpr=fpr, **cfg)
        mine = codecs.decode(twin.encode(x, "w", 1, comm.rank).data, expected_shape=(N,))
        np.testing.assert_array_equal(method.state["w"]["fb_residual"], x - mine.to_dense())
        if cfg.get("policy") in ("p1", "p2", "naive"):
            assert mine.slots.size == k
        assert method.state["w"]["selected"] == k
        _check_against_the_input(mine, x, k, cfg)
    return True


def _value_bounds(all_x: np.ndarray, top: np.ndarray, extra: float, cfg: dict) -> np.ndarray:
    """Each rank's worst error on a value it sends, from first principles: 0 for raw values;
    curve fits: fit_tol max|v| (DeepReduce, Kostopoulou et al. 2021, Section 5 and Lemma 1,
    fit_tol = 0.01 by default); QSGD: one level, ||v||_2 / 127 (Alistarh et al. 2017, Section
    3.1, eq. 1), with ||v||_2 of the top-k values plus up to ``extra`` false positives, which
    are no larger than the k-th largest |x|."""
    v = np.where(top, np.abs(all_x), 0.0)
    if cfg["value"] == "raw":
        return np.zeros(len(all_x))
    if cfg["value"] in ("polyfit", "dexp"):
        return 0.01 * v.max(axis=1)
    kth = np.where(top, np.abs(all_x), np.inf).min(axis=1)
    return np.sqrt(np.square(v).sum(axis=1) + extra * kth ** 2) / 127


def _check_the_mean_independently(out: np.ndarray, all_x: np.ndarray, k: int, fpr: float,
                                  cfg: dict) -> None:
    """An oracle that runs none of the codecs: P * out against the ranks' inputs x_j (P x n).

    T_j is NumPy's top-k set of x_j (the paper's sparsifier) and truth = sum_j x_j[T_j].
    A lossless index codec sends exactly T_j: |P out - truth| <= sum of the value bounds of
    the ranks that hold the entry (:func:`_value_bounds`). A Bloom filter of false-positive
    rate fpr adds about fpr (n - k) positives per rank (DeepReduce, Section 4: h =
    ceil(log2(1/fpr)) hashes, h k / ln 2 bits); we allow that many plus six standard
    deviations. P0 sends every positive, so P out - truth is a sum, over a subset of ranks, of
    their values off T_j; P1/P2 send k of the positives, so every entry of P out is a sum of
    some ranks' values and at most P k entries are non-zero (Algorithm 1). The naive policy
    misplaces values on purpose (the paper's negative example): only its count is bounded."""
    size, n = all_x.shape
    got = out.astype(np.float64) * size
    top = np.zeros_like(all_x, dtype=bool)
    for j, row in enumerate(all_x):
        top[j, np.argsort(-np.abs(row), kind="stable")[:k]] = True
    truth = np.where(top, all_x, 0.0).sum(axis=0)
    false_pos = fpr * (n - k)
    budget = false_pos + 6 * np.sqrt(false_pos) + 1               # per rank
    bound = _value_bounds(all_x, top, budget if cfg["index"] == "bloom" else 0.0, cfg)
    slack = 1e-6 * np.abs(all_x).max() * size                     # float32 rounding of the mean
    assert np.count_nonzero(got) <= size * (k + budget), cfg
    if cfg["index"] != "bloom":
        assert not got[~top.any(axis=0)].any(), cfg               # nothing off the top-k sets
        allowed = (top * bound[:, None]).sum(axis=0) * (1 + 1e-5) + slack
        assert (np.abs(got - truth) <= allowed).all(), (cfg, np.abs(got - truth).max())
        return
    if cfg["policy"] == "naive":
        return
    subsets = np.array([[(c >> j) & 1 for j in range(size)] for c in range(2 ** size)], float)
    if cfg["policy"] == "p0":     # every positive: T_j plus a subset of ranks' false positives
        candidates = truth + subsets @ np.where(top, 0.0, all_x)
    else:                         # k of the positives: any subset of ranks' values
        candidates = subsets @ all_x
    miss = np.abs(candidates - got).min(axis=0)
    allowed = bound.sum() * (1 + 1e-5) + slack
    assert (miss <= allowed).all(), (cfg, miss.max(), allowed)
    changed = np.count_nonzero(np.abs(got - truth) > allowed)
    assert changed <= size * budget * (1 if cfg["policy"] == "p0" else 2), (cfg, changed)


def _check_against_the_input(mine, x: np.ndarray, k: int, cfg: dict) -> None:
    """An oracle independent of the codecs: this rank's decoded container against its input
    alone. The Top-k set is NumPy's (the k largest |x|); a lossless index codec gives exactly
    it, Bloom P0 a superset (its false positives), P1/P2/naive exactly k slots. Raw values (not
    under ``naive``, which shifts values onto false positives on purpose) are x at those slots;
    a lossy value codec stays within its guaranteed bound (DeepReduce, Kostopoulou et al. 2021,
    Section 5.1 and Lemma 1 for the curve fits: |v^ - v| <= fit_tol max|v|; QSGD, Alistarh et
    al. 2017, Section 3.1: |v^ - v| <= ||bucket||_2 / levels)."""
    top = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
    slots = np.asarray(mine.slots, np.int64)
    if cfg["index"] != "bloom":
        assert np.array_equal(np.sort(slots), top), cfg
    elif cfg["policy"] == "p0":
        assert np.isin(top, slots).all(), cfg
    values, truth = np.asarray(mine.values, np.float64), x[slots].astype(np.float64)
    if cfg["value"] == "raw":
        if cfg.get("policy") != "naive":
            np.testing.assert_array_equal(values, truth, err_msg=str(cfg))
    elif cfg["value"] in ("polyfit", "dexp"):
        bound = 0.01 * np.abs(truth).max()                  # fit_tol's default, 0.01
        assert np.abs(values - truth).max() <= bound * (1 + 1e-5), cfg
    else:                                                   # qsgd, 127 levels by default
        bound = np.linalg.norm(truth) / 127
        assert np.abs(values - truth).max() <= bound * (1 + 1e-5), cfg


def case_inherently_sparse(comm):
    """sparsifier='none': the non-zeros travel; lossless codecs give the exact mean."""
    rng = np.random.default_rng(300 + comm.rank)
    x = rng.standard_normal(N).astype(np.float32)
    x[rng.random(N) < 0.6] = 0.0                      # NCF-like: most entries are zero
    all_x = comm.allgather(x)
    parts = [(np.flatnonzero(all_x[j]), all_x[j][np.flatnonzero(all_x[j])])
             for j in range(comm.size)]
    ref = _sum_in_rank_order(N, parts, comm.size)
    nnz = int(np.count_nonzero(x))
    sizes = {}
    for cfg in (dict(index="bitmap"), dict(index="rle"),
                dict(index="bloom", policy="p0", fp_values="sparse", fpr=0.3)):
        method = hvdc.Compression.deepreduce(sparsifier="none", value="raw", **cfg)
        out = method.allreduce(x, "w", comm)
        np.testing.assert_array_equal(out, ref, err_msg=str(cfg))
        np.testing.assert_array_equal(method.state["w"]["fb_residual"], np.zeros(N, np.float32))
        sizes[cfg["index"]] = int(method.state["w"]["container_bytes"])
    # bitmap: n / 8 bytes of index whatever the density, 4 bytes per non-zero value
    value_len = 4 * nnz
    header = 4 + 4 + 1 + 1 + 2 + 2 * len(_varint(nnz)) + 8 + len(_varint(N // 8)) + \
        len(_varint(value_len)) + 1 + 4
    assert sizes["bitmap"] == header + N // 8 + value_len, sizes
    return sizes


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 128:
        out.append((v & 127) | 128)
        v >>= 7
    out.append(v)
    return bytes(out)


def case_generic_sparsifier(comm):
    """A method without ``select`` (Rand-K) runs on a one-rank communicator as the sparsifier."""
    x = _input(comm, 400)
    density = 0.05
    method = hvdc.Compression.deepreduce(sparsifier="randk", density=density, index="rle",
                                         value="raw", feedback="none", seed=7)
    comm.reset_stats()
    out = method.allreduce(x, "w", comm)
    stats = comm.stats()
    sizes = comm.allgather(np.array([method.state["w"]["container_bytes"]], np.int64)).reshape(-1)
    assert (stats["sent"], stats["received"]) == _allgatherv_bytes(sizes, comm.rank)
    randk = hvdc.Compression.randk(density=density, feedback="none", seed=7)
    idx = randk.indices("w", 1, N)                   # shared by every rank
    all_x = comm.allgather(x)
    ref = _sum_in_rank_order(N, [(idx, all_x[j][idx]) for j in range(comm.size)], comm.size)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_allclose(out, randk.allreduce(x, "w", comm), rtol=1e-6, atol=1e-7)
    sd = method.state_dict()
    assert sd["sparsifier_state"]["state"]["w"]["t"] == 1
    return {"sent": stats["sent"]}


def case_multistep_feedback_and_checkpoint(comm):
    """Residual feedback over steps with Bloom P2 + polyfit; a restored checkpoint continues identically."""
    cfg = dict(density=0.01, index="bloom", policy="p2", value="polyfit", fpr=0.001)
    method = hvdc.Compression.deepreduce(**cfg)
    rng = np.random.default_rng(500 + comm.rank)
    snapshot = None
    outs = []
    for t in range(1, 6):
        x = rng.standard_normal(N).astype(np.float32)
        e = method.state.get("w", {}).get("fb_residual", np.zeros(N, np.float32))
        acc = x + e
        twin = hvdc.Compression.deepreduce(**cfg)
        local = codecs.decode(twin.encode(acc, "w", t, comm.rank).data, (N,)).to_dense()
        if t == 4:
            snapshot = (method.state_dict(), x)
        out = method.allreduce(x, "w", comm)
        np.testing.assert_array_equal(method.state["w"]["fb_residual"], acc - local)
        assert method.state["w"]["t"] == t
        assert same_on_all_ranks(comm, out), "ranks disagree on the result"
        outs.append(out)
    restored = hvdc.Compression.deepreduce(**cfg)
    restored.load_state_dict(snapshot[0])
    np.testing.assert_array_equal(restored.allreduce(snapshot[1], "w", comm), outs[3])
    return True


def case_fused_residual_on_large_tensors(comm):
    """n >= 2**16: EF14's x + e fused with Top-k (and the O(k) residual update) gives the
    containers, mean and residual of the unfused definition, bit for bit, over steps;
    a NaN step under nonfinite='skip' leaves the state as it was."""
    n = 150_000
    configs = [dict(), dict(index="bloom", policy="p0", fpr=0.01),
               dict(index="bloom", policy="p2", fpr=0.01, value="polyfit"), dict(value="qsgd"),
               dict(fp_values="sparse", index="bloom", policy="p1", fpr=0.01)]
    rng = np.random.default_rng(700 + comm.rank)
    for cfg in configs:
        method = hvdc.Compression.deepreduce(density=0.01, nonfinite="skip", **cfg)
        for t in range(1, 4):
            x = rng.standard_normal(n).astype(np.float32)
            e = method.state.get("w", {}).get("fb_residual", np.zeros(n, np.float32))
            acc = x + e
            twin = hvdc.Compression.deepreduce(density=0.01, **cfg)
            data = twin.encode(acc, "w", t, comm.rank).data
            decoded = [codecs.decode(d, expected_shape=(n,)) for d in comm.allgather_object(data)]
            ref = _sum_in_rank_order(n, [(d.slots, d.values) for d in decoded], comm.size)
            out = method.allreduce(x, "w", comm)
            np.testing.assert_array_equal(out, ref, err_msg=str(cfg))
            np.testing.assert_array_equal(method.state["w"]["fb_residual"],
                                          acc - decoded[comm.rank].to_dense(), err_msg=str(cfg))
            assert method.state["w"]["container_bytes"] == len(data)
        before = method.state["w"]["fb_residual"].copy()
        bad = rng.standard_normal(n).astype(np.float32)
        if comm.rank == 0:
            bad[17] = np.nan
        out = method.allreduce(bad, "w", comm)
        assert method.last_step_skipped and not out.any()
        assert method.state["w"]["t"] == 3
        np.testing.assert_array_equal(method.state["w"]["fb_residual"], before)
    return True


def case_p2_polyfit_volume(comm):
    """Top-k 1 %: Bloom P2 + polyfit sends well under Top-k's (index, value) pairs."""
    n = 60_000
    x = _input(comm, 600, n)
    topk = hvdc.Compression.topk(density=0.01)
    comm.reset_stats()
    topk.allreduce(x, "v", comm)
    topk_sent = comm.bytes_sent
    out = {}
    for name, cfg in {"p0": dict(policy="p0", value="raw"), "p2": dict(policy="p2", value="raw"),
                      "p2_polyfit": dict(policy="p2", value="polyfit")}.items():
        method = hvdc.Compression.deepreduce(density=0.01, index="bloom", fpr=0.001, **cfg)
        comm.reset_stats()
        method.allreduce(x, "v", comm)
        out[name] = comm.bytes_sent / topk_sent
    return out


# ------------------------------------------------------------- tests
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_deepreduce_on_mpi_ranks(nprocs: int) -> None:
    res = run_cases(nprocs, __file__)
    sizes = res[case_lossless_equals_dense_reference][0]
    # index codecs on 60 scattered indices of n = 3000: every compressed one beats raw
    assert sizes["huffman-raw"] < sizes["rle-raw"] < sizes["raw-raw"] < sizes["bitmap-raw"]
    for rank in range(nprocs):
        vol = res[case_p2_polyfit_volume][rank]
        # Bytes relative to Top-k's (index, value) pairs (identical for every P: both are
        # (P - 1) containers): P0 ~0.78, P2 ~0.74, P2 + polyfit ~0.45 measured.
        assert vol["p0"] < 0.85 and vol["p2"] < 0.8 and vol["p2_polyfit"] < 0.6, vol
    # the other cases assert their references on every rank; each must have finished everywhere
    for case in (case_lossy_within_the_codecs_bounds, case_multistep_feedback_and_checkpoint,
                 case_fused_residual_on_large_tensors):
        assert res[case] == {rank: True for rank in range(nprocs)}, case
    sparse = res[case_inherently_sparse]
    assert set(sparse) == set(range(nprocs)) and all(set(v) == {"bitmap", "rle", "bloom"}
                                                     for v in sparse.values())
    assert all(r["sent"] > 0 for r in res[case_generic_sparsifier].values())


# ------------------------------------------------------------- in-process
def test_merge_sum_equals_the_float64_bincount_reference() -> None:
    """kernels.merge_sum: the mean of P (slot, value) lists, each position summed in float64 in
    list order, rounded once, divided by P in the output dtype -- the bits of np.bincount's
    float64 sum, cast, then divided; unsorted lists, repeated slots, float16/32/64 values,
    -0.0, and more lists than the merge takes (the bincount path)."""
    from horovod_compress.kernels.merge_sum import MERGE_MAX_PARTS, merge_sum
    rng = np.random.default_rng(21)
    for trial in range(120):
        n = int(rng.integers(1, 3000))
        p = int(rng.integers(1, MERGE_MAX_PARTS + 4))
        dtype = np.dtype([np.float32, np.float64][trial % 2])
        slots, values = [], []
        for j in range(p):
            r = int(rng.integers(0, min(n, 200) + 1))
            s = (rng.integers(0, n, r) if trial % 3 == 0
                 else np.sort(rng.choice(n, r, replace=False)))
            vtype = [np.float16, np.float32, np.float64][(trial + j) % 3]
            span = 4 if vtype == np.float16 else 20          # finite in every value dtype
            v = (rng.standard_normal(r) * 10.0 ** rng.integers(-span, span, r)).astype(vtype)
            if r and trial % 4 == 0:
                v[0] = -0.0
            slots.append(s)
            values.append(v)
        ref = scatter_sum(n, np.concatenate(slots).astype(np.int64),
                          np.concatenate([v.astype(np.float64) for v in values]), dtype)
        ref = ref / dtype.type(p)
        got = merge_sum(n, slots, values, dtype, p)
        assert got.dtype == dtype
        assert got.tobytes() == ref.tobytes(), (trial, n, p)


def test_registered_with_measured_defaults() -> None:
    """Default index codec: Huffman (smaller and ~100x cheaper to decode than Bloom P2 at
    n = 4M, measured, docs/methods/deepreduce.md); Bloom keeps the paper's fpr and P2."""
    assert "deepreduce" in hvdc.Compression.available()
    m = hvdc.Compression.deepreduce()
    cfg = m.config()
    assert cfg["sparsifier"] == "topk" and cfg["sparsifier_params"]["density"] == 0.01
    assert (cfg["index"], cfg["value"]) == ("huffman", "raw")
    bloom = hvdc.Compression.deepreduce(index="bloom").config()
    assert (bloom["policy"], bloom["fpr"]) == ("p2", 0.001)
    assert cfg["feedback"] == "residual" and m.biased
    poly = hvdc.Compression.deepreduce(value="polyfit").config()
    assert poly["poly_degree"] == 5 and poly["fit_tol"] == 0.01
    assert hvdc.Compression.deepreduce(value="qsgd").config()["qsgd_levels"] == 127


@pytest.mark.parametrize("kwargs,match", [
    (dict(index="zip"), "index must be one of"),
    (dict(value="lz4"), "value must be one of"),
    (dict(fpr=0.0), "fpr must be in"),
    (dict(fpr=1.0), "fpr must be in"),
    (dict(policy="p3"), "policy must be one of"),
    (dict(fp_values="both"), "fp_values must be one of"),
    (dict(poly_degree=64), "poly_degree"),
    (dict(fit_tol=0.0), "fit_tol"),
    (dict(qsgd_levels=0), "qsgd_levels"),
    (dict(qsgd_bucket=0), "qsgd_bucket"),
    (dict(deflate_level=0), "deflate_level"),
    (dict(sparsifier="nope"), "sparsifier must be 'none' or a registered method"),
    (dict(sparsifier="deepreduce"), "cannot be 'deepreduce'"),
    (dict(sparsifier=3), "sparsifier must be a method name"),
    (dict(sparsifier="none", density=0.1), "takes no parameters"),
    (dict(sparsifier_params=[("density", 0.1)]), "sparsifier_params must be a dict"),
    (dict(sparsifier_params={"feedback": "none"}), "give 'feedback' to deepreduce"),
    (dict(density=1.5), "density"),
    (dict(sparsifier_params={"bogus": 1}), "unknown parameter 'bogus'"),
])
def test_bad_arguments_raise_naming_them(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hvdc.Compression.deepreduce(**kwargs)


def test_encode_is_deterministic_and_decodes_to_local() -> None:
    """Same (seed, name, step, rank) -> the same container; other ranks' seeds differ."""
    from horovod_compress import codecs
    x = np.random.default_rng(0).standard_normal(4000).astype(np.float32)
    a = hvdc.Compression.deepreduce(value="polyfit", seed=3)
    b = hvdc.Compression.deepreduce(value="polyfit", seed=3)
    assert a.encode(x, "w", 1, 0).data == b.encode(x, "w", 1, 0).data
    assert a.encode(x, "w", 1, 0).data != a.encode(x, "w", 1, 1).data
    dec = codecs.decode(a.encode(x, "w", 1, 0).data, (4000,))
    assert dec.slots.size == 40 and dec.selected == 40
