"""Fuzzing the DeepReduce container: truncated, corrupted and foreign buffers must raise.

A malformed container must raise ``ValueError`` (``ContainerError``) with a
clear message -- never crash the interpreter (the Numba kernels must not read
out of bounds), hang, or return a wrong tensor. Random corruption is caught by
the CRC-32; corruption *with a recomputed checksum* (a crafted container) must
still either raise ``ContainerError`` or decode to a structurally valid tensor.
"""
from __future__ import annotations

import itertools
import json
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from horovod_compress import codecs
from horovod_compress.codecs import ContainerError

N = 600
INDEX = [("raw", {}), ("bitmap", {}), ("rle", {}), ("huffman", {}),
         ("bloom", {"policy": "p0", "fpr": 0.05}), ("bloom", {"policy": "p1", "fpr": 0.05}),
         ("bloom", {"policy": "p2", "fpr": 0.05}), ("bloom", {"policy": "naive", "fpr": 0.05})]
VALUE = [("raw", {}), ("deflate", {}), ("qsgd", {"levels": 15, "bucket": 16}),
         ("polyfit", {"tol": 0.05}), ("dexp", {"tol": 0.05})]


def _containers() -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(0)
    dense = rng.standard_normal(N).astype(np.float32)
    support = np.sort(rng.choice(N, 30, replace=False))
    out = []
    for (iname, ip), (vname, vp) in itertools.product(INDEX, VALUE):
        enc = codecs.encode(support, dense, (N,), codecs.make_index_codec(iname, **ip),
                            codecs.make_value_codec(vname, **vp), 12345)
        out.append((f"{iname}{ip.get('policy', '')}-{vname}", enc.data))
    for support_case in (np.empty(0, np.int64), np.arange(N)):
        enc = codecs.encode(support_case, dense, (N,), codecs.make_index_codec("rle"),
                            codecs.make_value_codec("raw"), 1)
        out.append((f"rle-raw-{support_case.size}", enc.data))
    return out


CONTAINERS = _containers()
IDS = [name for name, _ in CONTAINERS]


def _with_crc(body: bytes) -> bytes:
    return body + zlib.crc32(body).to_bytes(4, "little")


def test_every_container_decodes() -> None:
    for name, data in CONTAINERS:
        dec = codecs.decode(data, expected_shape=(N,))
        assert dec.slots.size == dec.values.size, name


@pytest.mark.parametrize("name,data", CONTAINERS, ids=IDS)
def test_every_truncation_raises(name: str, data: bytes) -> None:
    for cut in range(len(data)):
        with pytest.raises(ContainerError, match="truncated|shorter|checksum|magic"):
            codecs.decode(data[:cut], expected_shape=(N,))


@pytest.mark.parametrize("name,data", CONTAINERS[::7], ids=IDS[::7])
def test_appended_bytes_raise(name: str, data: bytes) -> None:
    for tail in (b"\x00", b"garbage!", data):
        with pytest.raises(ContainerError):
            codecs.decode(data + tail, expected_shape=(N,))


@pytest.mark.parametrize("name,data", CONTAINERS, ids=IDS)
def test_every_single_byte_corruption_is_detected(name: str, data: bytes) -> None:
    rng = np.random.default_rng(len(data))
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= int(rng.integers(1, 256))
        with pytest.raises(ContainerError):
            codecs.decode(bytes(bad), expected_shape=(N,))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.sampled_from(range(len(CONTAINERS))), st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=2, max_size=6))
def test_random_multi_byte_corruption_is_detected(which: int, edits: list) -> None:
    data = bytearray(CONTAINERS[which][1])
    for pos, mask in edits:
        data[pos % len(data)] ^= mask
    if bytes(data) == CONTAINERS[which][1]:   # edits cancelled out
        return
    with pytest.raises(ContainerError):
        codecs.decode(bytes(data), expected_shape=(N,))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.binary(max_size=300))
def test_foreign_bytes_raise(blob: bytes) -> None:
    with pytest.raises(ContainerError):
        codecs.decode(blob, expected_shape=(N,))


def test_known_foreign_formats_raise_with_clear_messages() -> None:
    import io
    npy = io.BytesIO()
    np.save(npy, np.arange(40, dtype=np.float32))
    cases = {
        b"": "shorter than any container",
        b"\x89PNG\r\n\x1a\n" + bytes(40): "bad magic",
        json.dumps({"indices": [1, 2], "values": [0.5, 0.25]}).encode(): "bad magic",
        npy.getvalue(): "bad magic",
        b"DRDC" + bytes(30): "version 0 is not supported",
        b"DRDC\x01" + bytes(30): "checksum mismatch",
    }
    for blob, message in cases.items():
        with pytest.raises(ValueError, match=message):
            codecs.decode(blob, expected_shape=(N,))
    data = CONTAINERS[0][1]
    newer = bytearray(data[:-4])
    newer[4] = 2
    with pytest.raises(ContainerError, match="version 2 is not supported"):
        codecs.decode(_with_crc(bytes(newer)), expected_shape=(N,))


def test_crafted_header_fields_raise() -> None:
    body = bytearray(CONTAINERS[0][1][:-4])   # raw index, raw values
    for offset, value, message in [(5, 99, "unknown index codec id 99"),
                                   (6, 77, "unknown value codec id 77"),
                                   (7, 4, "invalid flags"),
                                   (7, 3, "invalid flags"),
                                   (7, 2, "do not fit value codec"),
                                   (8, 9, "unknown value dtype code 9"),
                                   (9, 200, "ndim 200")]:
        bad = bytearray(body)
        bad[offset] = value
        with pytest.raises(ContainerError, match=message):
            codecs.decode(_with_crc(bytes(bad)), expected_shape=(N,))
    with pytest.raises(ContainerError, match=r"shape \(600,\), expected \(601,\)"):
        codecs.decode(CONTAINERS[0][1], expected_shape=(601,))


def test_inputs_as_uint8_arrays() -> None:
    data = CONTAINERS[3][1]
    a = codecs.decode(np.frombuffer(data, np.uint8), expected_shape=(N,))
    b = codecs.decode(data, expected_shape=(N,))
    np.testing.assert_array_equal(a.to_dense(), b.to_dense())
    with pytest.raises(ContainerError, match="uint8"):
        codecs.decode(np.frombuffer(data[:len(data) // 4 * 4], np.float32))


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(CONTAINERS))), st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4))
def test_crafted_containers_with_valid_checksum_never_crash(which: int, edits: list) -> None:
    """Mutate the body and recompute the CRC: ContainerError, or a structurally valid tensor."""
    body = bytearray(CONTAINERS[which][1][:-4])
    for pos, value in edits:
        body[5 + pos % (len(body) - 5)] = value          # keep magic and version
    try:
        dec = codecs.decode(_with_crc(bytes(body)), expected_shape=(N,))
    except ContainerError as exc:
        assert str(exc)
        return
    assert dec.shape == (N,)
    assert dec.slots.dtype == np.int64 and dec.slots.size == dec.values.size
    assert dec.slots.size == 0 or (dec.slots.min() >= 0 and dec.slots.max() < N)
    assert dec.values.dtype in (np.float16, np.float32, np.float64)
    assert dec.to_dense().shape == (N,)
