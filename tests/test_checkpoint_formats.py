"""Checkpoint formats: version-1 checkpoints (written before the state classes) keep loading.

``tests/data/checkpoints_v1/`` holds, for every method (``tests/scripts/method_runs.py``'s
variants), each of two ranks' ``state_dict()`` after 3 steps as the code before the state
classes wrote it, with the digests of the results of the 3 steps that run went on to take.
On 2 real MPI ranks a fresh method loads its rank's file and resumes: its results must be
those same bits, and its bytes the same counts. Without MPI: the version recorded, a newer
version refused with a message naming both, a field of another method or feedback scheme
refused by name, the same checkpoints through the torch and Keras encoders, and the state
classes' slots (a misspelt field is an error, not a new key).
"""
from __future__ import annotations

import importlib.util
import io
import pickle
import types
from pathlib import Path

import numpy as np
import pytest

import horovod_compress as hvdc
from horovod_compress.compressors.registry import create
from horovod_compress.compressors.state import STATE_FORMAT_VERSION
from horovod_compress.tools.testing import run_cases

HERE = Path(__file__).resolve().parent
V1 = HERE / "data" / "checkpoints_v1"


def _method_runs():
    """tests/scripts/method_runs.py as a module (the script that wrote the files)."""
    spec = importlib.util.spec_from_file_location("method_runs", HERE / "scripts" / "method_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records(rank: int | None = None) -> list[dict]:
    files = sorted(V1.glob("*.pkl" if rank is None else f"*.rank{rank}.pkl"))
    out = []
    for path in files:
        with open(path, "rb") as f:
            out.append(pickle.load(f))
    return out


def _params(rec: dict) -> dict:
    """The constructor's parameters of a record's method: for ``auto``, also the candidates its
    checkpoint holds, in their order (its default set has changed since: Gaussian-k then,
    DeepReduce now), as a user resuming such a checkpoint passes them."""
    params = dict(rec["params"])
    if rec["method"] == "auto":
        params["candidates"] = list(rec["state_dict"]["auto"]["inner"])
    return params


def _without_version(sd: dict) -> dict:
    """``sd`` minus the top-level ``format_version`` (and the same in auto's candidates)."""
    out = {k: v for k, v in sd.items() if k != "format_version"}
    if "auto" in out:
        out["auto"] = {**out["auto"], "inner": {lb: _without_version(s)
                                                for lb, s in out["auto"]["inner"].items()}}
    if "sparsifier_state" in out:
        out["sparsifier_state"] = _without_version(out["sparsifier_state"])
    return out


def _restricted(new, old):
    """``new`` with only the dict keys ``old`` has (recursively): a field added since version 1
    (``auto`` records more about each decision now) is left out of the comparison."""
    if isinstance(new, dict) and isinstance(old, dict):
        return {k: _restricted(new[k], old[k]) for k in old if k in new}
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        return [_restricted(a, b) for a, b in zip(new, old)]
    return new


def _same(a, b) -> bool:
    """Equal nested checkpoints: arrays by dtype, shape and bits."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    return type(a) is type(b) and (a == b or (a != a and b != b))


# ------------------------------------------------------------------ MPI
def case_v1_checkpoints_resume_bit_identical(comm):
    """Every method: load this rank's version-1 checkpoint, take the next steps, compare."""
    runs = _method_runs()
    records = _records(comm.rank)
    assert len(records) == len(runs.VARIANTS), "a variant lacks its checkpoint file"
    resumed = []
    for rec in records:
        assert rec["world_size"] == comm.size and rec["rank"] == comm.rank
        assert "format_version" not in rec["state_dict"]          # written before versions
        method = create(rec["method"], **_params(rec))
        method.load_state_dict(rec["state_dict"])
        # saving again gives the checkpoint it was loaded from, plus the version
        again = method.state_dict()
        assert again["format_version"] == STATE_FORMAT_VERSION
        again = _without_version(again)
        saved = rec["state_dict"]
        # a constructor parameter added since version 1 (Ok-Topk's p2p_gather_max_ranks) is
        # saved in ``config`` now; the parameters the old checkpoint has must match
        again["config"] = _restricted(again["config"], saved["config"])
        if rec["method"] == "auto":
            # auto's decisions gained fields (the old ones must match), and its ``config`` records
            # the constructor's parameters, whose defaults changed since (the drift band; Ok-Topk's
            # new p2p_gather_max_ranks in the candidates' descriptions)
            again = _restricted({k: v for k, v in again.items() if k != "config"}, saved)
            saved = {k: v for k, v in saved.items() if k != "config"}
        assert _same(again, saved), rec["variant"]
        got = [runs.step(method, comm, s) for s in range(rec["saved_after"] + 1,
                                                         rec["saved_after"] + 1 + len(rec["resumed"]))]
        assert got == rec["resumed"], rec["variant"]
        resumed.append(rec["variant"])
    return sorted(resumed)


@pytest.mark.mpi
def test_v1_checkpoints_resume_bit_identical():
    variants = run_cases(2, __file__, timeout=240)[case_v1_checkpoints_resume_bit_identical]
    assert variants[0] == variants[1] == sorted(v for v, _n, _p in _method_runs().VARIANTS)


# -------------------------------------------------------------- no MPI
def test_every_method_has_a_v1_checkpoint_of_every_registered_name():
    names = {rec["method"] for rec in _records(0)}
    assert names == set(hvdc.Compression.available())


def test_auto_checkpoint_of_other_candidates_is_refused_with_the_way_to_resume_it():
    """The version-1 ``auto`` checkpoint was saved with Gaussian-k among the default candidates;
    today's defaults have DeepReduce instead: refused, naming the candidates to pass."""
    rec = next(r for r in _records(0) if r["method"] == "auto")
    with pytest.raises(ValueError, match=r"auto: checkpoint holds candidates .*'gaussiank'.*"
                                         r"this auto has .*'deepreduce'.*; resume it with "
                                         r"Compression\.auto\(candidates=\['none', 'fp16', "
                                         r"'global_qsgd', 'topk', 'gaussiank', 'oktopk'\]\)"):
        create("auto", **rec["params"]).load_state_dict(rec["state_dict"])


def test_saved_version_and_newer_version_refused():
    method = hvdc.Compression.topk(0.1)
    rec = next(r for r in _records(0) if r["variant"] == "topk")
    method.load_state_dict(rec["state_dict"])
    sd = method.state_dict()
    assert sd["format_version"] == STATE_FORMAT_VERSION == 2
    newer = {**sd, "format_version": STATE_FORMAT_VERSION + 1}
    with pytest.raises(ValueError, match=r"topk: checkpoint format version 3 cannot be read here: "
                                         r"this version of horovod_compress reads format "
                                         r"versions 1 to 2"):
        hvdc.Compression.topk(0.1).load_state_dict(newer)
    with pytest.raises(ValueError, match="format version 'x'"):
        hvdc.Compression.topk(0.1).load_state_dict({**sd, "format_version": "x"})


def test_field_of_another_feedback_is_refused_by_name():
    rec = next(r for r in _records(0) if r["variant"] == "topk")      # EF14: fb_residual
    with pytest.raises(ValueError, match=r"topk: tensor 'w': checkpoint field 'fb_residual' is "
                                         r"not kept by TensorState with EF21State"):
        hvdc.Compression.topk(0.1, feedback="ef21").load_state_dict(rec["state_dict"])


def test_v1_checkpoints_through_the_torch_encoding():
    """What the torch optimizer, the DDP hook and FSDP save (``to_safe_state``, read with
    ``weights_only=True``) loads into the same state as the checkpoint itself."""
    torch = pytest.importorskip("torch")
    from horovod_compress.torch.optimizer import from_safe_state, to_safe_state
    for rec in _records(0):
        buf = io.BytesIO()
        torch.save({"hvdc": to_safe_state(rec["state_dict"])}, buf)
        buf.seek(0)
        via = create(rec["method"], **_params(rec))
        via.load_state_dict(from_safe_state(torch.load(buf, weights_only=True)["hvdc"]))
        direct = create(rec["method"], **_params(rec))
        direct.load_state_dict(rec["state_dict"])
        assert _same(via.state_dict(), direct.state_dict()), rec["variant"]


def test_v1_checkpoints_through_the_keras_encoding():
    """A Keras checkpoint's entry written by the old code (the same encoder over the old
    ``state_dict``) decodes and loads into the same state as the checkpoint itself."""
    pytest.importorskip("keras")
    from horovod_compress.keras.checkpoint import decode_state, encode_state
    for rec in _records(0):
        blob = encode_state(types.SimpleNamespace(state_dict=lambda rec=rec: rec["state_dict"]))
        via = create(rec["method"], **_params(rec))
        via.load_state_dict(decode_state(blob))
        direct = create(rec["method"], **_params(rec))
        direct.load_state_dict(rec["state_dict"])
        assert _same(via.state_dict(), direct.state_dict()), rec["variant"]


def test_state_classes_have_slots_and_name_every_field():
    """A fresh state of every method: no ``__dict__`` (a misspelt field raises), every field
    readable as an attribute and under its checkpoint key once set."""
    for name in hvdc.Compression.available():
        method = hvdc.Compression.by_name(name)
        st = method.new_state()
        assert not hasattr(st, "__dict__"), name
        with pytest.raises(AttributeError):
            st.not_a_field = 1
        assert dict(st) == {"t": 0}, name
        st.t = 4
        assert st["t"] == 4 and "t" in st and "fb_residual" not in st
