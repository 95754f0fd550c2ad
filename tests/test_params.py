"""Argument validation happens before any communication and names the argument."""
import numpy as np
import pytest

import horovod_compress as hvdc


@pytest.mark.parametrize("call, words", [
    (lambda: hvdc.Compression.by_name("nope"), ["nope", "available"]),
    (lambda: hvdc.Compression.nope(), ["nope"]),
    (lambda: hvdc.Compression.topk(density=0), ["density", "(0.0, 1.0]"]),
    (lambda: hvdc.Compression.topk(density=1.5), ["density"]),
    (lambda: hvdc.Compression.topk(density="a lot"), ["density", "number"]),
    (lambda: hvdc.Compression.randk(density=-1), ["density"]),
    (lambda: hvdc.Compression.randk(unbiased="yes"), ["unbiased"]),
    (lambda: hvdc.Compression.topk(dens=0.1), ["dens"]),
    (lambda: hvdc.Compression.topk(feedback="magic"), ["feedback", "magic"]),
    (lambda: hvdc.Compression.topk(warmup_steps=-1), ["warmup_steps"]),
    (lambda: hvdc.Compression.none(seed=1.5), ["seed"]),
    (lambda: hvdc.Compression.fp16(density=0.1), ["density"]),
])
def test_bad_arguments_raise_value_error(call, words):
    with pytest.raises(ValueError) as info:
        call()
    for w in words:
        assert w in str(info.value)


def test_unknown_method_is_also_attribute_error():
    with pytest.raises(AttributeError):
        getattr(hvdc.Compression, "nope")


def test_available_lists_foundation_methods():
    names = hvdc.Compression.available()
    for n in ("none", "fp16", "bf16", "topk", "randk"):
        assert n in names


def test_bf16_conversion_rounds_to_nearest_even():
    from horovod_compress.kernels.halfprec import (
        bf16_bits_to_float32,
        float32_to_bf16_bits,
    )
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 0.0, np.inf, np.nan], np.float32)
    back = bf16_bits_to_float32(float32_to_bf16_bits(x))
    assert back[0] == 1.0 and back[1] == 1.0  # tie -> even
    assert back[2] == 1.0 + 2 ** -6  # tie -> even (up)
    assert back[3] == -2.5 and back[4] == 0.0 and np.isinf(back[5]) and np.isnan(back[6])


def test_single_process_methods_are_identity_for_dense():
    from horovod_compress.mpi_collectives import Communicator
    comm = Communicator()
    g = np.arange(10, dtype=np.float32)
    assert np.array_equal(hvdc.Compression.none().allreduce(g, "x", comm), g)
    out = hvdc.Compression.topk(density=0.2, feedback="none").allreduce(g, "x", comm)
    assert np.array_equal(np.flatnonzero(out), [8, 9])
