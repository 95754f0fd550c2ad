"""``kernels.precompile``: which variants setup compiles (the run itself is setup's job)."""
from __future__ import annotations

from horovod_compress.compressors.registry import available
from horovod_compress.tools.precompile import _variants


def test_every_method_at_defaults_and_biased_ones_under_each_feedback():
    for name in available():
        assert _variants(name)[0] == {}
    assert _variants("none") == [{}]                      # unbiased: defaults only
    topk = [v.get("feedback") for v in _variants("topk")]
    assert {"residual", "ef21", "ef21m"} <= set(topk)
    assert len(_variants("greedylore")) >= 2               # its own feedback choices it accepts
