"""Bounded byte reading and writing for the DeepReduce container and its sections.

Every decoder reads through a :class:`ByteReader`, which refuses to read past
the end of its buffer and turns every malformed field into a
:class:`ContainerError` (a ``ValueError``) that says what was being read and
where. Integers are little-endian; ``varint`` is unsigned LEB128 (at most 9
bytes, values below 2**63).
"""
from __future__ import annotations

import struct

import numpy as np


class ContainerError(ValueError):
    """A DeepReduce container (or one of its sections) is malformed."""


class ByteWriter:
    """Append-only byte buffer with the field types of the container."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def u8(self, value: int) -> "ByteWriter":
        """Append one unsigned byte (0..255)."""
        if not 0 <= value < 256:
            raise ValueError(f"u8 field out of range: {value}")
        self._parts.append(bytes((value,)))
        return self

    def u64(self, value: int) -> "ByteWriter":
        """Append a little-endian unsigned 64-bit integer."""
        self._parts.append(struct.pack("<Q", value))
        return self

    def varint(self, value: int) -> "ByteWriter":
        """Append an unsigned LEB128 integer (below 2**63)."""
        value = int(value)
        if not 0 <= value < 2**63:
            raise ValueError(f"varint field out of range: {value}")
        out = bytearray()
        while value >= 128:
            out.append((value & 127) | 128)
            value >>= 7
        out.append(value)
        self._parts.append(bytes(out))
        return self

    def raw(self, data: bytes | bytearray | memoryview | np.ndarray) -> "ByteWriter":
        """Append bytes (an array's raw, C-ordered bytes) without a length prefix."""
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).tobytes()
        self._parts.append(bytes(data))
        return self

    def blob(self, data: bytes | bytearray | memoryview | np.ndarray) -> "ByteWriter":
        """A length-prefixed (varint) byte string."""
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).tobytes()
        self.varint(len(data))
        return self.raw(data)

    def getvalue(self) -> bytes:
        """Everything written so far, as one ``bytes``."""
        return b"".join(self._parts)


class ByteReader:
    """Reads fields from ``data``; every overrun or bad value raises :class:`ContainerError`."""

    def __init__(self, data: bytes | bytearray | memoryview | np.ndarray, what: str) -> None:
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).view(np.uint8).reshape(-1).tobytes()
        self.data = bytes(data)
        self.pos = 0
        self.what = what

    @property
    def remaining(self) -> int:
        """Bytes left to read."""
        return len(self.data) - self.pos

    def fail(self, message: str) -> ContainerError:
        """A :class:`ContainerError` with ``message``, what is being read and the position."""
        return ContainerError(f"{self.what}: {message} (at byte {self.pos} of {len(self.data)})")

    def take(self, n: int, field: str = "field") -> bytes:
        """The next ``n`` bytes; ``ContainerError`` naming ``field`` if fewer are left."""
        if n < 0 or n > self.remaining:
            raise self.fail(f"truncated: {field} needs {n} bytes, {self.remaining} left")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self, field: str = "u8") -> int:
        """The next unsigned byte."""
        return self.take(1, field)[0]

    def u64(self, field: str = "u64") -> int:
        """The next little-endian unsigned 64-bit integer."""
        return struct.unpack("<Q", self.take(8, field))[0]

    def varint(self, field: str = "varint", limit: int | None = None) -> int:
        """An unsigned LEB128 integer, optionally checked to be ``<= limit``."""
        value = 0
        for shift in range(0, 63, 7):
            byte = self.take(1, field)[0]
            value |= (byte & 127) << shift
            if byte < 128:
                break
        else:
            raise self.fail(f"{field}: varint longer than 9 bytes")
        if limit is not None and value > limit:
            raise self.fail(f"{field} = {value} exceeds its limit {limit}")
        return value

    def blob(self, field: str = "blob") -> bytes:
        """A length-prefixed (varint) byte string; the length is checked against what is left."""
        return self.take(self.varint(f"{field} length", self.remaining), field)

    def array(self, count: int, dtype: np.dtype | str, field: str = "array") -> np.ndarray:
        """``count`` items of ``dtype`` (little-endian), copied into a new array."""
        dt = np.dtype(dtype).newbyteorder("<")
        data = self.take(count * dt.itemsize, field)
        with np.errstate(invalid="ignore"):  # signalling NaNs are data, not an error here
            return np.frombuffer(data, dtype=dt).astype(dt.newbyteorder("="), copy=True)

    def rest(self) -> bytes:
        """All bytes left."""
        return self.take(self.remaining, "rest")

    def expect_end(self) -> None:
        """``ContainerError`` unless every byte has been read."""
        if self.remaining:
            raise self.fail(f"{self.remaining} unexpected trailing bytes")
