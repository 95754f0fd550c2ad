"""Horovod's public API in our front-ends (issue 16): every name, Horovod's signature.

Enumerates the public names of ``horovod.torch``, ``horovod.tensorflow``,
``horovod.tensorflow.keras`` (and their ``elastic``/``callbacks``
submodules) from the installed Horovod and fails naming each one our
matching module lacks, or whose parameters differ: Horovod's parameters must
be ours, in the same order and of the same kind; ours may add parameters
after them only with defaults. Names Horovod imports from other packages
(``os``, ``tf``, ``keras`` ...) and its compiled extension are not API.
Also: the uncalled ``Compression.fp16`` and positional method parameters.
Runs in one process (no communication).
"""
import importlib
import inspect
import types

import pytest

import horovod_compress as hvdc
from horovod_compress.tools.testing_plugin import import_horovod

hvd_torch = import_horovod("horovod.torch")

PAIRS = [("horovod.torch", "horovod_compress.torch"),
         ("horovod.torch.elastic", "horovod_compress.torch.elastic"),
         ("horovod.tensorflow", "horovod_compress.tensorflow"),
         ("horovod.tensorflow.elastic", "horovod_compress.tensorflow.elastic"),
         ("horovod.tensorflow.keras", "horovod_compress.keras"),
         ("horovod.tensorflow.keras.callbacks", "horovod_compress.keras.callbacks"),
         ("horovod.tensorflow.keras.elastic", "horovod_compress.keras.elastic")]
NOT_API = {"mpi_lib_v2"}   # Horovod's compiled extension


def public_names(module: types.ModuleType) -> list[str]:
    out = []
    for name in sorted(dir(module)):
        if name.startswith("_") or name in NOT_API:
            continue
        obj = getattr(module, name)
        if inspect.ismodule(obj) and not obj.__name__.startswith("horovod."):
            continue   # os, tf, keras, K, inspect, warnings, packaging.version
        if not inspect.ismodule(obj) and getattr(obj, "__module__", "") and \
                not str(getattr(obj, "__module__", "")).startswith("horovod") and \
                (inspect.isclass(obj) or inspect.isfunction(obj)) and \
                str(obj.__module__).split(".")[0] in ("tensorflow", "keras", "torch", "typing"):
            continue   # re-exported from a framework
        out.append(name)
    return out


def signature_problem(theirs: object, ours: object) -> str | None:
    """Why ``ours`` does not accept Horovod's parameters, or None."""
    try:
        ts = inspect.signature(theirs)
    except (TypeError, ValueError):
        return None
    try:
        os_ = inspect.signature(ours)
    except (TypeError, ValueError):
        return "ours has no signature"
    tp = [p for p in ts.parameters.values() if p.name != "self"]
    op = [p for p in os_.parameters.values() if p.name != "self"]
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in tp):
        return None   # Horovod forwards *args/**kwargs: anything is its signature
    tnamed = [p for p in tp if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    onamed = [p for p in op if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for i, p in enumerate(tnamed):
        if i >= len(onamed):
            if any(q.kind == q.VAR_KEYWORD for q in op) and p.kind != p.POSITIONAL_ONLY:
                continue
            return f"parameter {p.name!r} missing"
        q = onamed[i]
        if q.name != p.name:
            return f"parameter {i} is {q.name!r}, Horovod's is {p.name!r}"
        positional = (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        if (p.kind in positional) != (q.kind in positional):
            return f"parameter {p.name!r} is {q.kind.description}, Horovod's {p.kind.description}"
    for q in onamed[len(tnamed):]:
        if q.default is q.empty and q.kind != q.KEYWORD_ONLY:
            return f"our extra parameter {q.name!r} has no default"
        if q.default is q.empty:
            return f"our extra keyword parameter {q.name!r} has no default"
    if any(p.kind == p.VAR_POSITIONAL for p in tp) and not any(q.kind == q.VAR_POSITIONAL
                                                                for q in op):
        return "Horovod takes *args, ours does not"
    return None


def coverage() -> dict[str, dict]:
    result = {}
    for theirs_name, ours_name in PAIRS:
        theirs = importlib.import_module(theirs_name)
        ours = importlib.import_module(ours_name)
        names = public_names(theirs)
        missing, wrong = [], {}
        for name in names:
            if not hasattr(ours, name):
                missing.append(name)
                continue
            t, o = getattr(theirs, name), getattr(ours, name)
            if inspect.ismodule(t):
                if not inspect.ismodule(o):
                    wrong[name] = "Horovod's is a module, ours is not"
                continue
            if callable(t) and not callable(o):
                wrong[name] = "not callable"
                continue
            if inspect.isclass(t) and issubclass(t, BaseException):
                continue
            problem = signature_problem(t, o)
            if problem:
                wrong[name] = problem
        result[theirs_name] = {"names": len(names), "present": len(names) - len(missing),
                               "missing": missing, "signature": wrong}
    return result


@pytest.fixture(scope="module")
def report():
    import_horovod("horovod.tensorflow")
    return coverage()


@pytest.mark.parametrize("theirs", [t for t, _ in PAIRS])
def test_every_horovod_name_is_ours(report, theirs):
    r = report[theirs]
    print(f"{theirs}: {r['present']} of {r['names']} public names present")
    assert not r["missing"], f"{theirs}: missing in ours: {r['missing']}"


@pytest.mark.parametrize("theirs", [t for t, _ in PAIRS])
def test_signatures_match(report, theirs):
    r = report[theirs]
    assert not r["signature"], f"{theirs}: signatures differ: {r['signature']}"


def test_docs_names_table_is_horovods():
    """docs/horovod.md's table lists exactly the names enumerated here, per module."""
    import re
    from pathlib import Path
    import_horovod("horovod.tensorflow")
    text = (Path(__file__).parents[1] / "docs" / "horovod.md").read_text()
    table = text.split("<!-- names-table -->", 1)[1].split("<!-- /names-table -->", 1)[0]
    for theirs, _ in PAIRS:    # importing a submodule adds it to its parent's names
        importlib.import_module(theirs)
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `([\w.]+)` \((\d+)\) \| `([\w.]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), m.group(3), re.findall(r"`(\w+)`", m.group(4)))
    for theirs, ours in PAIRS:
        names = public_names(importlib.import_module(theirs))
        assert theirs in rows, f"docs/horovod.md: no row for {theirs}"
        count, doc_ours, doc_names = rows[theirs]
        assert (count, doc_ours, doc_names) == (len(names), ours, names), \
            f"docs/horovod.md's row for {theirs} is out of date: Horovod's names are {names}"


def test_uncalled_factories_and_horovod_compressors():
    from horovod_compress.compressors.registry import MethodFactory, as_method
    f = hvdc.Compression.fp16
    assert isinstance(f, MethodFactory)
    assert as_method(f).name == "fp16" and as_method(hvdc.Compression.none).name == "none"
    assert as_method(hvdc.Compression.topk).config() == hvdc.Compression.topk().config()
    assert as_method(hvd_torch.Compression.fp16).name == "fp16"
    assert as_method(hvd_torch.Compression.none).name == "none"
    with pytest.raises(ValueError, match="compression must be"):
        as_method(object())


def test_positional_parameters_accepted_or_refused_with_keyword_form():
    assert hvdc.Compression.topk(0.01).density == 0.01
    assert hvdc.Compression.by_name("topk", 0.02).density == 0.02
    assert hvdc.Compression.powersgd(4).config()["rank"] == 4
    with pytest.raises(ValueError, match=r"pass parameters by name, e\.g\. Compression\.topk\(density="):
        hvdc.Compression.topk(0.01, "residual", 0, 0, 1)
    with pytest.raises(ValueError, match="given both by position and by name"):
        hvdc.Compression.topk(0.01, density=0.02)


def test_elastic_launch_refused_with_clear_message(monkeypatch):
    from horovod_compress.torch import elastic
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(RuntimeError, match="fixed MPI world"):
        elastic.run(lambda state: None)(object())


def test_refused_names_say_why():
    import horovod_compress.tensorflow as hvdc_tf
    with pytest.raises(NotImplementedError, match="SyncBatchNormalization"):
        hvdc_tf.SyncBatchNormalization()
    with pytest.raises(RuntimeError, match="eager"):
        hvdc_tf.broadcast_global_variables(0)
