"""DeepReduce as a compressed allreduce: exactness, byte counts, feedback, convergence.

The multi-rank cases live in tests/cases/deepreduce_cases.py; they compare the
method with dense references built from every rank's input, with containers
encoded independently, and with the communicator's allgatherv volume model.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.testing import run_cases

CASES = Path(__file__).parent / "cases" / "deepreduce_cases.py"
FAST = ["case_lossless_equals_dense_reference", "case_lossy_sum_of_decoded_containers",
        "case_inherently_sparse", "case_generic_sparsifier",
        "case_multistep_feedback_and_checkpoint", "case_p2_polyfit_volume"]


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_deepreduce_on_mpi_ranks(nprocs: int) -> None:
    res = run_cases(nprocs, CASES, FAST)
    sizes = res["case_lossless_equals_dense_reference"][0]
    # index codecs on 60 scattered indices of n = 3000: every compressed one beats raw
    assert sizes["huffman-raw"] < sizes["rle-raw"] < sizes["raw-raw"] < sizes["bitmap-raw"]
    for rank in range(nprocs):
        vol = res["case_p2_polyfit_volume"][rank]
        # Bytes relative to Top-k's (index, value) pairs (identical for every P: both are
        # (P - 1) containers): P0 ~0.78, P2 ~0.74, P2 + polyfit ~0.45 measured.
        assert vol["p0"] < 0.85 and vol["p2"] < 0.8 and vol["p2_polyfit"] < 0.6, vol


# ------------------------------------------------------------- in-process
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
