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
from .wire import ContainerError



class _Codecs:
    """The registered codecs of one kind (``"index"`` or ``"value"``), by name and by wire id."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.classes: dict[str, type] = {}

    def register(self, cls: type) -> None:
        """Add ``cls`` under its ``name`` (its ``codec_id`` must be unique)."""
        for other in self.classes.values():
            if other.codec_id == cls.codec_id and other.name != cls.name:
                raise RuntimeError(f"{self.kind} codec id {cls.codec_id} used by {other.name!r} "
                                   f"and {cls.name!r}")
        self.classes[cls.name] = cls

    def names(self) -> list[str]:
        """Names of the registered codecs, in codec-id order."""
        return sorted(self.classes, key=lambda k: self.classes[k].codec_id)

    def by_id(self, codec_id: int) -> type:
        """The class with wire id ``codec_id``; ``ContainerError`` if unknown."""
        for cls in self.classes.values():
            if cls.codec_id == codec_id:
                return cls
        raise ContainerError(f"container: unknown {self.kind} codec id {codec_id}; known: "
                             f"{ {c.codec_id: c.name for c in self.classes.values()} }")

    def make(self, name: str, params: dict[str, Any]) -> Any:
        """A configured codec (``ValueError`` for an unknown name or parameter)."""
        if name not in self.classes:
            raise ValueError(f"deepreduce: {self.kind} must be one of {sorted(self.classes)}, "
                             f"got {name!r}")
        cls = self.classes[name]
        allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        for key in params:
            if key not in allowed:
                raise ValueError(f"deepreduce: {self.kind} codec {name!r} takes no parameter "
                                 f"{key!r}; it takes {allowed}")
        return cls(**params)


_INDEX = _Codecs("index")
_VALUE = _Codecs("value")


class _Registered:
    """Registration by class keywords: ``class X(IndexCodec, name="x", codec_id=7)``.

    A subclass given a ``name`` is registered in its base's table (``_codecs``);
    one without (an intermediate base class) is not.
    """

    _codecs: ClassVar[_Codecs]
    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = 0
    lossless: ClassVar[bool] = True

    def __init_subclass__(cls, name: str | None = None, codec_id: int | None = None,
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls.name, cls.codec_id = name, int(codec_id)
            cls._codecs.register(cls)


@dataclass
class IndexEncoding:
    """What an index codec produced: the bytes and what the receiver will decode."""

    payload: bytes
    slots: np.ndarray    # int64 positions the receiver fills, in value order
    sources: np.ndarray  # int64 positions whose values the sender transmits, same order


class IndexCodec(_Registered):
    """Base class of index codecs: ``class X(IndexCodec, name=..., codec_id=...)``; ``lossless``."""

    _codecs = _INDEX
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


class ValueCodec(_Registered):
    """Base class of value codecs: ``class X(ValueCodec, name=..., codec_id=...)``; ``lossless``."""

    _codecs = _VALUE
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


def index_codecs() -> list[str]:
    """Names of the registered index codecs, in codec-id order."""
    return _INDEX.names()


def value_codecs() -> list[str]:
    """Names of the registered value codecs, in codec-id order."""
    return _VALUE.names()


def index_codec_class(codec_id: int) -> type[IndexCodec]:
    """The index codec class with wire id ``codec_id``; ``ContainerError`` if unknown."""
    return _INDEX.by_id(codec_id)


def value_codec_class(codec_id: int) -> type[ValueCodec]:
    """The value codec class with wire id ``codec_id``; ``ContainerError`` if unknown."""
    return _VALUE.by_id(codec_id)


def make_index_codec(name: str, **params: Any) -> IndexCodec:
    """A configured index codec (``ValueError`` for an unknown name or parameter)."""
    return _INDEX.make(name, params)


def make_value_codec(name: str, **params: Any) -> ValueCodec:
    """A configured value codec (``ValueError`` for an unknown name or parameter)."""
    return _VALUE.make(name, params)
