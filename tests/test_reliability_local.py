"""Issue 19 without MPI: positional method arguments, NaN policy argument, safe checkpoint state."""
import numpy as np
import pytest

import horovod_compress as hvdc


def test_positional_arguments_map_in_order():
    assert hvdc.Compression.topk(0.05).density == 0.05
    assert hvdc.Compression.by_name("topk", 0.02).density == 0.02
    assert hvdc.Compression.powersgd(4).rank == 4


@pytest.mark.parametrize("call,needle", [
    (lambda: hvdc.Compression.topk(0.1, density=0.2), "topk: parameter 'density' given both"),
    (lambda: hvdc.Compression.none(1, 2), "none: takes at most 1 positional"),
    (lambda: hvdc.Compression.by_name("topk", 0.1, "residual", 0, 0, 9), "topk: takes at most"),
    (lambda: hvdc.Compression.topk(2.0), "density"),
    (lambda: hvdc.Compression.none(nonfinite="ignore"), "nonfinite must be one of"),
])
def test_bad_arguments_are_value_errors_naming_the_method(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_nonfinite_policy_everywhere_and_in_config():
    for name in hvdc.Compression.available():
        m = hvdc.Compression.by_name(name, nonfinite="propagate")
        assert m.nonfinite == "propagate" and m.config()["nonfinite"] == "propagate"
        assert "nonfinite" not in hvdc.Compression.by_name(name).config()   # default: raise


def test_safe_state_roundtrip_exact():
    torch = pytest.importorskip("torch")
    import io

    from horovod_compress.torch.optimizer import from_safe_state, to_safe_state
    state = {"config": {"name": "x", "sparsifier_params": {"density": 0.1}, "k": None},
             "state": {"w": {"t": 3, "f16": np.arange(5, dtype=np.float16),
                             "u32": np.arange(6, dtype=np.uint32).reshape(2, 3),
                             "empty": np.zeros((0, 4)), "scalar": np.float32(2.5),
                             "i": np.int64(7), "tup": (np.ones(2), 1.5), "lst": [np.int8(1)],
                             "big": np.array([1, 2], dtype=">f8")}}}
    buf = io.BytesIO()
    torch.save(to_safe_state(state), buf)
    buf.seek(0)
    back = from_safe_state(torch.load(buf))        # weights_only=True by default
    w, w0 = back["state"]["w"], state["state"]["w"]
    assert back["config"] == state["config"] and w["t"] == 3
    for key in ("f16", "u32", "empty", "big"):
        assert w[key].dtype == w0[key].dtype and w[key].shape == w0[key].shape
        assert np.array_equal(w[key], w0[key])
    assert type(w["scalar"]) is np.float32 and w["scalar"] == 2.5
    assert type(w["i"]) is np.int64 and w["i"] == 7
    assert isinstance(w["tup"], tuple) and np.array_equal(w["tup"][0], np.ones(2))
    assert w["lst"][0] == 1 and type(w["lst"][0]) is np.int8


def test_keras_state_refuses_pickles(monkeypatch):
    pytest.importorskip("keras")
    import pickle

    from horovod_compress.keras.checkpoint import PICKLE_ENV, decode_state, encode_state
    m = hvdc.Compression.topk()
    legacy = np.frombuffer(pickle.dumps(m.state_dict()), dtype=np.uint8)
    monkeypatch.delenv(PICKLE_ENV, raising=False)
    with pytest.raises(ValueError, match=PICKLE_ENV):
        decode_state(legacy)
    monkeypatch.setenv(PICKLE_ENV, "1")
    assert decode_state(legacy)["config"] == m.config()
    blob = encode_state(m)
    with pytest.raises(ValueError, match="truncated"):
        decode_state(blob[:-1] if blob.size > 40 else blob[:20])
    assert decode_state(blob)["config"] == m.config()
