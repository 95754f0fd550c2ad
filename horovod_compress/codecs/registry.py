"""Codec registry: index codecs and value codecs by name and by wire id.

A DeepReduce container (:mod:`.container`) names its two codecs by a one-byte
id, so decoding needs no configuration: :func:`index_codec_class` /
:func:`value_codec_class` map the id back to the class whose ``decode``
reads the section. ``make_index_codec(name, **params)`` /
``make_value_codec(name, **params)`` build a configured encoder.

An index codec maps the sorted support S of a sparse vector of length n to
bytes, and says which positions the receiver will fill (``slots``) and where
their values come from (``sources``). For a lossless codec both are S; the
Bloom filter's policies differ (see :mod:`.bloom`). A value codec maps the
values (one per slot) to bytes; a *sorting* codec (curve fits) works on them
in descending order and returns that order, which the container transmits.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

_INDEX: dict[str, type["IndexCodec"]] = {}
_VALUE: dict[str, type["ValueCodec"]] = {}


@dataclass
class IndexEncoding:
    """What an index codec produced: the bytes and what the receiver will decode."""

    payload: bytes
    slots: np.ndarray    # int64 positions the receiver fills, in value order
    sources: np.ndarray  # int64 positions whose values the sender transmits, same order


class IndexCodec:
    """Base class of index codecs. Subclasses set ``name``, ``codec_id``, ``lossless``."""

    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = 0
    lossless: ClassVar[bool] = True
    carries_order: ClassVar[bool] = False  # can send slots in any order (raw)

    def encode(self, indices: np.ndarray, n: int, seed: int) -> IndexEncoding:
        """Encode strictly increasing int64 ``indices`` in ``[0, n)``."""
        raise NotImplementedError

    def encode_in_order(self, slots: np.ndarray, n: int) -> bytes:
        """Encode ``slots`` keeping their order (only codecs with ``carries_order``)."""
        raise NotImplementedError(f"index codec {self.name!r} cannot carry a value order")

    @classmethod
    def decode(cls, payload: bytes, n: int, n_slots: int, seed: int) -> np.ndarray:
        """The ``n_slots`` positions (int64) of the payload; ``ContainerError`` if malformed."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """The codec's parameters, as written into the method's ``config()`` (none by default)."""
        return {}


class ValueCodec:
    """Base class of value codecs. Subclasses set ``name``, ``codec_id``, ``lossless``."""

    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = 0
    lossless: ClassVar[bool] = True
    sorts: ClassVar[bool] = False  # encodes the values in descending order

    def encode(self, values: np.ndarray, seed: int) -> tuple[bytes, np.ndarray | None]:
        """``(payload, order)``: ``order`` is None, or the permutation the payload follows.

        A sorting codec encodes ``values[order]`` (descending); decoding gives
        those values back (approximately) in that order.
        """
        raise NotImplementedError

    @classmethod
    def decode(cls, payload: bytes, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` values of ``dtype`` in the payload's order; ``ContainerError`` if malformed."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """The codec's parameters, as written into the method's ``config()`` (none by default)."""
        return {}


def register_index_codec(cls: type[IndexCodec]) -> type[IndexCodec]:
    """Class decorator: register an index codec under its ``name`` (its ``codec_id`` must be unique)."""
    _check_unique(cls, _INDEX, "index")
    _INDEX[cls.name] = cls
    return cls


def register_value_codec(cls: type[ValueCodec]) -> type[ValueCodec]:
    """Class decorator: register a value codec under its ``name`` (its ``codec_id`` must be unique)."""
    _check_unique(cls, _VALUE, "value")
    _VALUE[cls.name] = cls
    return cls


def _check_unique(cls: type, table: dict[str, type], kind: str) -> None:
    for other in table.values():
        if other.codec_id == cls.codec_id and other.name != cls.name:
            raise RuntimeError(f"{kind} codec id {cls.codec_id} used by {other.name!r} and {cls.name!r}")


def index_codecs() -> list[str]:
    """Names of the registered index codecs, in codec-id order."""
    return sorted(_INDEX, key=lambda k: _INDEX[k].codec_id)


def value_codecs() -> list[str]:
    """Names of the registered value codecs, in codec-id order."""
    return sorted(_VALUE, key=lambda k: _VALUE[k].codec_id)


def index_codec_class(codec_id: int) -> type[IndexCodec]:
    """The index codec class with wire id ``codec_id``; ``ContainerError`` if unknown."""
    for cls in _INDEX.values():
        if cls.codec_id == codec_id:
            return cls
    from .wire import ContainerError
    raise ContainerError(f"container: unknown index codec id {codec_id}; known: "
                         f"{ {c.codec_id: c.name for c in _INDEX.values()} }")


def value_codec_class(codec_id: int) -> type[ValueCodec]:
    """The value codec class with wire id ``codec_id``; ``ContainerError`` if unknown."""
    for cls in _VALUE.values():
        if cls.codec_id == codec_id:
            return cls
    from .wire import ContainerError
    raise ContainerError(f"container: unknown value codec id {codec_id}; known: "
                         f"{ {c.codec_id: c.name for c in _VALUE.values()} }")


def _make(table: dict[str, type], kind: str, name: str, params: dict[str, Any]) -> Any:
    if name not in table:
        raise ValueError(f"deepreduce: {kind} must be one of {sorted(table)}, got {name!r}")
    cls = table[name]
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for key in params:
        if key not in allowed:
            raise ValueError(f"deepreduce: {kind} codec {name!r} takes no parameter {key!r}; "
                             f"it takes {allowed}")
    return cls(**params)


def make_index_codec(name: str, **params: Any) -> IndexCodec:
    """A configured index codec (``ValueError`` for an unknown name or parameter)."""
    return _make(_INDEX, "index", name, params)


def make_value_codec(name: str, **params: Any) -> ValueCodec:
    """A configured value codec (``ValueError`` for an unknown name or parameter)."""
    return _make(_VALUE, "value", name, params)
