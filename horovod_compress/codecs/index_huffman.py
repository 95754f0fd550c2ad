"""``huffman`` index codec: Huffman-coded gaps between consecutive indices.

The sorted support s_0 < s_1 < ... < s_{r-1} becomes the gaps
delta_0 = s_0, delta_t = s_t - s_{t-1} - 1 >= 0 (delta encoding, as in
SketchML/SKCompress, which the paper casts as DeepReduce instances). Gaps span
[0, n), too many distinct values for a useful code table, so each gap is split
as JPEG and DEFLATE split magnitudes: its bit length c = bitlen(delta) (0..63,
the *class*, Huffman-coded) followed by the c - 1 bits below its leading one
(sent verbatim). At density 1 % the classes carry most of the entropy of the
geometric-like gaps: about 1.5 bytes per index against 4 for ``raw``.

Code lengths come from ``dahuffman`` (``HuffmanCodec.from_frequencies``, the
textbook greedy Huffman construction); the codes themselves are made
*canonical* (RFC 1951, section 3.2.2), so the table on the wire is just the
code length of each class that occurs. Encoding and decoding of the bit stream
run in Numba. Payload::

    varint number_of_classes | (u8 class, u8 code length) * number_of_classes | bit stream
"""
from __future__ import annotations

from collections import Counter

import numpy as np
from numba import njit

from .bitio import pack_fields
from .registry import IndexCodec, IndexEncoding
from .wire import ByteReader, ByteWriter, ContainerError

MAX_CODE_LENGTH = 63


def huffman_code_lengths(frequencies: dict[int, int]) -> dict[int, int]:
    """Optimal prefix-code lengths of ``frequencies`` (symbol -> count > 0), via dahuffman.

    dahuffman adds an end-of-stream symbol of its own; we drop it (our stream
    length is known), which leaves a valid prefix code (Kraft sum < 1).
    """
    from dahuffman import HuffmanCodec
    if not frequencies:
        return {}
    table = HuffmanCodec.from_frequencies(dict(frequencies)).get_code_table()
    lengths = {int(s): int(bits) for s, (bits, _value) in table.items()
               if isinstance(s, (int, np.integer))}
    if max(lengths.values()) > MAX_CODE_LENGTH:  # needs Fibonacci-like counts above 2**43
        raise ValueError(f"huffman: a code longer than {MAX_CODE_LENGTH} bits")
    return lengths


def canonical_codes(lengths: dict[int, int]) -> dict[int, int]:
    """Canonical Huffman codes (RFC 1951 3.2.2) for ``lengths`` (symbol -> length)."""
    code = 0
    prev = 0
    out = {}
    for sym, length in sorted(lengths.items(), key=lambda kv: (kv[1], kv[0])):
        code <<= length - prev
        out[sym] = code
        code += 1
        prev = length
    return out


def _kraft_ok(lengths: dict[int, int]) -> bool:
    return sum(2.0 ** -l for l in lengths.values()) <= 1.0 + 1e-12


@njit(cache=True)
def _gaps_and_classes(indices: np.ndarray) -> tuple:
    r = indices.size
    gaps = np.empty(r, np.int64)
    classes = np.empty(r, np.int64)
    prev = -1
    for t in range(r):
        g = indices[t] - prev - 1
        gaps[t] = g
        c = 0
        while (g >> c) > 0:
            c += 1
        classes[t] = c
        prev = indices[t]
    return gaps, classes


@njit(cache=True)
def _decode_stream(buf: np.ndarray, count: int, n: int, first_code: np.ndarray,
                   count_per_len: np.ndarray, offset: np.ndarray, symbols: np.ndarray) -> tuple:
    """Canonical decoding of ``count`` (class, mantissa) pairs into indices.

    Returns ``(indices, bits_used, status)`` with status 0 = OK, 1 = truncated,
    2 = invalid code, 3 = index outside [0, n).
    """
    out = np.empty(count, np.int64)
    nbits = buf.size * 8
    pos = 0
    prev = np.int64(-1)
    maxlen = count_per_len.size - 1
    for t in range(count):
        code = np.int64(0)
        length = 0
        sym = -1
        while length < maxlen:
            if pos >= nbits:
                return out[:t], pos, 1
            code = (code << 1) | np.int64((buf[pos >> 3] >> (7 - (pos & 7))) & 1)
            pos += 1
            length += 1
            k = code - first_code[length]
            if 0 <= k < count_per_len[length]:
                sym = symbols[offset[length] + k]
                break
        if sym < 0:
            return out[:t], pos, 2
        gap = np.int64(0)
        if sym > 0:
            if pos + sym - 1 > nbits:
                return out[:t], pos, 1
            gap = np.int64(1)
            for _ in range(sym - 1):
                gap = (gap << 1) | np.int64((buf[pos >> 3] >> (7 - (pos & 7))) & 1)
                pos += 1
        if gap >= n - prev - 1:
            return out[:t], pos, 3
        prev = prev + gap + 1
        out[t] = prev
    return out, pos, 0


class HuffmanIndex(IndexCodec, name="huffman", codec_id=4):
    """Huffman-coded bit-length classes of the index gaps, plus the gaps' low bits."""

    def encode(self, indices: np.ndarray, n: int, seed: int) -> IndexEncoding:
        idx = np.ascontiguousarray(indices, dtype=np.int64)
        gaps, classes = _gaps_and_classes(idx)
        lengths = huffman_code_lengths(Counter(classes.tolist()))
        codes = canonical_codes(lengths)
        wr = ByteWriter().varint(len(lengths))
        for sym in sorted(lengths):
            wr.u8(sym).u8(lengths[sym])
        if idx.size:
            code_of = np.zeros(64, np.uint64)
            len_of = np.zeros(64, np.int64)
            for sym, code in codes.items():
                code_of[sym] = code
                len_of[sym] = lengths[sym]
            values = np.empty(2 * idx.size, np.uint64)
            widths = np.empty(2 * idx.size, np.int64)
            values[0::2] = code_of[classes]
            widths[0::2] = len_of[classes]
            values[1::2] = gaps.astype(np.uint64)  # pack_fields keeps the low (c - 1) bits
            widths[1::2] = np.maximum(classes - 1, 0)
            wr.raw(pack_fields(values, widths))
        return IndexEncoding(wr.getvalue(), idx, idx)

    @classmethod
    def decode(cls, payload: bytes, n: int, n_slots: int, seed: int) -> np.ndarray:
        rd = ByteReader(payload, "huffman index section")
        nsym = rd.varint("number of classes", limit=64)
        lengths: dict[int, int] = {}
        for _ in range(nsym):
            sym, length = rd.u8("class"), rd.u8("code length")
            if sym > 63 or not 1 <= length <= MAX_CODE_LENGTH or sym in lengths:
                raise rd.fail(f"bad code table entry (class {sym}, length {length})")
            lengths[sym] = length
        if not _kraft_ok(lengths):
            raise rd.fail("code lengths violate the Kraft inequality")
        if (n_slots == 0) != (nsym == 0):
            raise rd.fail(f"{nsym} classes for {n_slots} indices")
        body = np.frombuffer(rd.rest(), np.uint8)
        if n_slots == 0:
            if body.size:
                raise ContainerError("huffman index section: data after an empty table")
            return np.empty(0, np.int64)
        codes = canonical_codes(lengths)
        maxlen = max(lengths.values())
        count_per_len = np.zeros(maxlen + 1, np.int64)
        first_code = np.zeros(maxlen + 1, np.int64)
        offset = np.zeros(maxlen + 1, np.int64)
        ordered = sorted(lengths.items(), key=lambda kv: (kv[1], kv[0]))
        symbols = np.array([s for s, _ in ordered], np.int64)
        for pos, (sym, length) in enumerate(ordered):
            if count_per_len[length] == 0:
                first_code[length] = codes[sym]
                offset[length] = pos
            count_per_len[length] += 1
        idx, used, status = _decode_stream(body, n_slots, n, first_code, count_per_len,
                                           offset, symbols)
        if status:
            raise ContainerError("huffman index section: " + {
                1: "truncated bit stream", 2: "invalid code", 3: "index outside the tensor"}[status])
        if (used + 7) // 8 != body.size:
            raise ContainerError("huffman index section: unexpected trailing bytes")
        return idx
