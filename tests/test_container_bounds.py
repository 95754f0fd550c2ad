"""Untrusted DeepReduce containers: decoding bounds allocation by the caller's shape or a maximum."""
import zlib

import numpy as np
import pytest

from horovod_compress.codecs import container
from horovod_compress.codecs.registry import make_index_codec, make_value_codec
from horovod_compress.codecs.wire import ByteWriter


def _bloom_container(n=1000):
    rng = np.random.default_rng(0)
    src = rng.standard_normal(n).astype(np.float32)
    support = np.sort(rng.choice(n, 20, replace=False)).astype(np.int64)
    enc = container.encode(support, src, (n,), make_index_codec("bloom"),
                           make_value_codec("raw"), seed=3)
    return enc.data, n


def _claim_shape(data, n, claimed):
    """Rewrite a 1-D container's shape and fix its checksum (a crafted, 'valid' container)."""
    old = ByteWriter().varint(n).getvalue()
    body = data[:-4]
    assert body[10:10 + len(old)] == old
    body = body[:10] + ByteWriter().varint(claimed).getvalue() + body[10 + len(old):]
    return body + zlib.crc32(body).to_bytes(4, "little")


def test_crafted_huge_shape_is_refused_before_allocating():
    data, n = _bloom_container()
    assert container.decode(data).shape == (n,)
    assert container.decode(data, expected_shape=(n,)).to_dense().shape == (n,)
    evil = _claim_shape(data, n, 2**31)
    with pytest.raises(container.ContainerError, match="limit|shape"):
        container.decode(evil)                                   # default maximum
    with pytest.raises(container.ContainerError, match="shape"):
        container.decode(evil, expected_shape=(n,))              # the caller's shape bounds it
    assert container.DEFAULT_MAX_ELEMENTS * 8 <= 2**29


def test_expected_shape_is_the_bound():
    data, n = _bloom_container()
    with pytest.raises(container.ContainerError, match="limit"):
        container.decode(data, max_elements=n - 1)
    assert container.decode(data, expected_shape=(n,), max_elements=n - 1).shape == (n,)
