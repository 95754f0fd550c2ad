"""DeepReduce's sparse-tensor codecs.

"DeepReduce: A Sparse-tensor Communication Framework for Distributed Deep Learning" (Kostopoulou et al., NeurIPS 2021).

A sparse tensor is split into its support (indices) and values; an *index
codec* and a *value codec* compress them independently, and
:mod:`.container` packs both, with the reordering information and a header,
into one versioned, checksummed byte string.

Index codecs: ``raw`` (:mod:`.index_raw`), ``bitmap`` and ``rle``
(:mod:`.index_bitmap`), ``huffman`` (:mod:`.index_huffman`), ``bloom`` with
policies naive/p0/p1/p2 (:mod:`.index_bloom`). Value codecs: ``raw``
(:mod:`.value_raw`), ``deflate`` (:mod:`.value_deflate`), ``qsgd``
(:mod:`.value_qsgd`), ``polyfit`` and ``dexp`` (:mod:`.value_curvefit`).
"""
from . import (  # noqa: F401  (registration)  # noqa: F401
                       index_bitmap,
                       index_bloom,
                       index_huffman,
                       index_raw,
                       value_curvefit,
                       value_deflate,
                       value_qsgd,
                       value_raw,
)
from .container import Encoded, SparseTensor, decode, encode
from .registry import (
                       IndexCodec,
                       ValueCodec,
                       index_codecs,
                       make_index_codec,
                       make_value_codec,
                       value_codecs,
)
from .wire import ContainerError

__all__ = ["ContainerError", "Encoded", "IndexCodec", "SparseTensor", "ValueCodec", "decode",
           "encode", "index_codecs", "make_index_codec", "make_value_codec", "value_codecs"]
