"""The DeepReduce container: one self-describing, versioned, checksummed byte string.

DeepReduce ("DeepReduce: A Sparse-tensor Communication Framework for Distributed Deep Learning" (Kostopoulou et al., NeurIPS 2021),
Section 3, Figure 3) "combines in one
container the compressed index and value structures, the reordering
information and any required metadata". Ours is (all integers little-endian,
``varint`` = unsigned LEB128)::

    offset  field
    0       magic  b"DRDC"
    4       u8     format version (1)
    5       u8     index codec id          (registry: raw 1, bitmap 2, rle 3, huffman 4, bloom 5)
    6       u8     value codec id          (raw 1, deflate 2, qsgd 3, polyfit 4, dexp 5)
    7       u8     flags: bit 0 = the index section lists the slots in the value
                   section's order; bit 1 = a permutation section is present
    8       u8     value dtype code        (1 float16, 2 float32, 3 float64)
    9       u8     ndim, then ndim varints: the tensor's shape
            varint n_slots   -- (position, value) pairs the container decodes to
            varint r         -- entries the sparsifier selected (|S|)
            u64    seed      -- hash/selection seed of the index codec
            varint len, bytes -- index section
            varint len, bytes -- value section
            varint len, bytes -- permutation section (ceil(log2 n_slots) bits per entry)
    end-4   u32    CRC-32 (zlib.crc32) of every byte before it

Decoding checks the magic, the version and the checksum before anything else,
then parses with bounded readers, so a truncated, corrupted or foreign buffer
raises :class:`~horovod_compress.codecs.wire.ContainerError` (a ``ValueError``)
that says what is wrong -- never a crash, a hang, or a silently wrong tensor
(a random corruption passes CRC-32 with probability 2**-32).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .bitio import pack_permutation, unpack_permutation
from .registry import IndexCodec, ValueCodec, index_codec_class, value_codec_class
from .wire import ByteReader, ByteWriter, ContainerError
from .value_raw import RawValues

MAGIC = b"DRDC"
VERSION = 1
FLAG_INDEX_ORDER = 1
FLAG_PERMUTATION = 2
MAX_NDIM = 32
#: Largest tensor a container may describe when the caller gives no
#: ``expected_shape``: decoders allocate O(elements) (a Bloom index scans the
#: whole universe, 8 bytes per element), so untrusted bytes can make a
#: decoder allocate at most about 8 * 2**26 bytes = 512 MiB. Pass
#: ``expected_shape`` (DeepReduce does) or a larger ``max_elements`` for more.
DEFAULT_MAX_ELEMENTS = 2**26
_DTYPES = {1: np.dtype(np.float16), 2: np.dtype(np.float32), 3: np.dtype(np.float64)}
_DTYPE_CODES = {dt: code for code, dt in _DTYPES.items()}
_MIN_SIZE = len(MAGIC) + 6 + 8 + 4


@dataclass
class SparseTensor:
    """A decoded container: ``values`` belong at flat positions ``slots`` of ``shape``."""

    slots: np.ndarray
    values: np.ndarray
    shape: tuple[int, ...]
    selected: int
    index_codec: str
    value_codec: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def to_dense(self) -> np.ndarray:
        """The dense tensor (zeros except at ``slots``)."""
        out = np.zeros(self.size, dtype=self.values.dtype)
        out[self.slots] = self.values
        return out.reshape(self.shape)


@dataclass
class Encoded:
    """An encoded container and what the receiver will decode it to (for the sender)."""

    data: bytes
    slots: np.ndarray
    section_bytes: dict[str, int]
    value_codec: str
    #: the values handed to the value codec: ``source`` at the index codec's
    #: ``sources``, before a sorting codec's permutation (a raw value section holds
    #: exactly these, in ``slots`` order)
    values: np.ndarray | None = None


def _lossy_unsafe(values: np.ndarray) -> bool:
    """Lossy value codecs need finite values of moderate size (float32 parameters)."""
    return values.size > 0 and not (np.isfinite(values).all() and np.abs(values).max() < 1e30)


def encode(support: np.ndarray, source: np.ndarray, shape: Sequence[int],
           index_codec: IndexCodec, value_codec: ValueCodec, seed: int,
           support_values: np.ndarray | None = None) -> Encoded:
    """Encode the sparse tensor with support ``support`` and values read from ``source``.

    ``support``: strictly increasing int64 flat indices (the sparsifier's S).
    ``source``: the flat vector whose entries are sent (length prod(shape));
    for a policy that sends values of positions outside S (Bloom P0/P1/P2) the
    caller decides what ``source`` holds there. ``seed`` (< 2**64) drives the
    Bloom hashes and any random choice; it is stored in the container.
    A lossy value codec facing non-finite values is replaced by ``raw`` for
    this container (the header says so). ``support_values`` (optional):
    ``source[support]``, when the caller holds it already (a selection kernel
    wrote it); a lossless index codec sends exactly those values, so the
    gather from ``source`` is skipped. The bytes are the same either way.
    """
    shape = tuple(int(s) for s in shape)
    n = int(np.prod(shape, dtype=np.int64))
    src = np.asarray(source).reshape(-1)
    if src.size != n:
        raise ValueError(f"source has {src.size} entries, shape {shape} has {n}")
    if src.dtype not in _DTYPE_CODES:
        raise ValueError(f"values must be float16/32/64, got {src.dtype}")
    idx = np.ascontiguousarray(support, dtype=np.int64).reshape(-1)
    if idx.size and (idx[0] < 0 or idx[-1] >= n or np.any(np.diff(idx) <= 0)):
        raise ValueError("support must be strictly increasing indices inside the tensor")
    seed = int(seed) % 2**64
    enc = index_codec.encode(idx, n, seed)
    if support_values is not None and index_codec.lossless:
        values = np.asarray(support_values)
        if values.dtype != src.dtype or values.shape != idx.shape:
            raise ValueError(f"support_values must be {idx.size} values of {src.dtype}, "
                             f"got {values.shape} of {values.dtype}")
    else:
        values = src[enc.sources]
    if not value_codec.lossless and _lossy_unsafe(values):
        value_codec = RawValues()
    vpayload, order = value_codec.encode(values, seed)
    slots = enc.slots
    flags = 0
    ipayload, ppayload = enc.payload, b""
    if order is not None:
        slots = slots[order]
        if index_codec.carries_order:
            ipayload = index_codec.encode_in_order(slots, n)
            flags |= FLAG_INDEX_ORDER
        else:
            ppayload = pack_permutation(order)
            flags |= FLAG_PERMUTATION
    wr = ByteWriter().raw(MAGIC).u8(VERSION).u8(index_codec.codec_id).u8(value_codec.codec_id)
    wr.u8(flags).u8(_DTYPE_CODES[src.dtype]).u8(len(shape))
    for s in shape:
        wr.varint(s)
    wr.varint(len(enc.slots)).varint(idx.size).u64(seed)
    wr.blob(ipayload).blob(vpayload).blob(ppayload)
    body = wr.getvalue()
    data = body + zlib.crc32(body).to_bytes(4, "little")
    return Encoded(data, slots, {"header": len(data) - len(ipayload) - len(vpayload) - len(ppayload),
                                 "index": len(ipayload), "value": len(vpayload),
                                 "permutation": len(ppayload)}, value_codec.name, values)


def decode(data: bytes | bytearray | memoryview | np.ndarray,
           expected_shape: Sequence[int] | None = None,
           max_elements: int = DEFAULT_MAX_ELEMENTS) -> SparseTensor:
    """Decode a container; raises :class:`ContainerError` (a ``ValueError``) if malformed.

    Allocation is bounded before any decoder runs: ``expected_shape``
    (recommended; the caller knows what it receives) must match the header's
    shape, which then bounds every allocation; without it the tensor may have
    at most ``max_elements`` entries (default :data:`DEFAULT_MAX_ELEMENTS`).
    """
    if expected_shape is not None:
        expected_shape = tuple(int(s) for s in expected_shape)
        max_elements = int(np.prod(expected_shape, dtype=object)) if expected_shape else 1
    dim_limit = max(max_elements, *expected_shape) if expected_shape else max_elements
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise ContainerError(f"container must be bytes or a uint8 array, got {data.dtype}")
        data = data.tobytes()
    data = bytes(data)
    if len(data) < _MIN_SIZE:
        raise ContainerError(f"container: {len(data)} bytes is shorter than any container "
                             f"({_MIN_SIZE} bytes at least); truncated?")
    if data[:4] != MAGIC:
        raise ContainerError(f"container: bad magic {data[:4]!r} (expected {MAGIC!r}); "
                             "not a DeepReduce container")
    if data[4] != VERSION:
        raise ContainerError(f"container: format version {data[4]} is not supported "
                             f"(this build reads version {VERSION})")
    body, crc = data[:-4], int.from_bytes(data[-4:], "little")
    if zlib.crc32(body) != crc:
        raise ContainerError(f"container: checksum mismatch (stored {crc:#010x}, computed "
                             f"{zlib.crc32(body):#010x}); corrupted or truncated")
    rd = ByteReader(body, "container")
    rd.take(5, "magic and version")
    icls = index_codec_class(rd.u8("index codec"))
    vcls = value_codec_class(rd.u8("value codec"))
    flags = rd.u8("flags")
    if flags & ~(FLAG_INDEX_ORDER | FLAG_PERMUTATION) or flags == FLAG_INDEX_ORDER | FLAG_PERMUTATION:
        raise rd.fail(f"invalid flags {flags:#x}")
    code = rd.u8("dtype")
    if code not in _DTYPES:
        raise rd.fail(f"unknown value dtype code {code}")
    dtype = _DTYPES[code]
    ndim = rd.u8("ndim")
    if ndim > MAX_NDIM:
        raise rd.fail(f"ndim {ndim} above {MAX_NDIM}")
    shape = tuple(rd.varint("shape", limit=dim_limit) for _ in range(ndim))
    n = int(np.prod(shape, dtype=object)) if shape else 1
    if expected_shape is not None and expected_shape != shape:
        raise ContainerError(f"container: holds a tensor of shape {shape}, expected "
                             f"{tuple(expected_shape)}")
    if n > max_elements:
        raise ContainerError(f"container: {n} elements exceeds the limit {max_elements}")
    n_slots = rd.varint("slot count", limit=n)
    selected = rd.varint("selected count", limit=n)
    seed = rd.u64("seed")
    ipayload = rd.blob("index section")
    vpayload = rd.blob("value section")
    ppayload = rd.blob("permutation section")
    rd.expect_end()
    if flags & FLAG_INDEX_ORDER and not icls.carries_order:
        raise ContainerError(f"container: index codec {icls.name!r} cannot carry the value order")
    if bool(flags & (FLAG_INDEX_ORDER | FLAG_PERMUTATION)) != vcls.sorts:
        raise ContainerError(f"container: flags {flags:#x} do not fit value codec {vcls.name!r}")
    if not flags & FLAG_PERMUTATION and ppayload:
        raise ContainerError("container: permutation section present but not flagged")
    if icls.lossless and n_slots != selected:
        raise ContainerError(f"container: lossless index codec with {n_slots} slots "
                             f"for {selected} selected entries")
    slots = icls.decode(ipayload, n, n_slots, seed)
    if slots.size != n_slots:
        raise ContainerError(f"container: index section gives {slots.size} slots, "
                             f"header says {n_slots}")
    values = vcls.decode(vpayload, n_slots, dtype)
    if flags & FLAG_PERMUTATION:
        slots = slots[unpack_permutation(ppayload, n_slots)]
    return SparseTensor(slots, values, shape, selected, icls.name, vcls.name)

