"""Name -> method registry behind ``hvdc.Compression``.

Each module in :mod:`horovod_compress.compressors` decorates its method class
with :func:`register`; ``Compression.<name>(**params)`` and
``Compression.by_name(name, **params)`` build instances. Unknown names and
unknown or out-of-range parameters raise ``ValueError`` naming them.
"""
from __future__ import annotations

import inspect
from typing import Any

_METHODS: dict[str, type] = {}


class UnknownMethodError(ValueError, AttributeError):
    """An unknown method name (a ``ValueError``; also an ``AttributeError`` for ``getattr``)."""


def register(cls: type) -> type:
    """Class decorator: expose ``cls`` as ``Compression.<cls.name>``."""
    _METHODS[cls.name] = cls
    return cls


def available() -> list[str]:
    """Registered method names, in the order DESIGN.md lists them where known."""
    order = ["none", "fp16", "bf16", "topk", "randk", "gaussiank", "topk_dsa", "gtopk",
             "oktopk", "qsgd", "global_qsgd", "arc_topk", "powersgd", "greedylore",
             "deepreduce"]
    known = [n for n in order if n in _METHODS]
    return known + sorted(n for n in _METHODS if n not in order)


def method_class(name: str) -> type:
    if name not in _METHODS:
        raise UnknownMethodError(f"unknown compression method {name!r}; available: {available()}")
    return _METHODS[name]


def parameter_names(name: str) -> list[str]:
    """The named parameters of method ``name``, in the order its constructor declares them."""
    sig = inspect.signature(method_class(name).__init__)
    return [p for p in sig.parameters if p != "self" and
            sig.parameters[p].kind in (inspect.Parameter.KEYWORD_ONLY,
                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def create(name: str, *args: Any, **params: Any) -> Any:
    """Build method ``name`` with ``params``; every error is a ``ValueError``.

    Positional ``args`` map to the method's parameters in the order its
    constructor declares them (``Compression.topk(0.01)`` is
    ``Compression.topk(density=0.01)``); more positionals than parameters, or
    a parameter given twice, is a ``ValueError`` naming the method and its
    parameters. ``nonfinite=`` (the NaN/Inf policy) is accepted by every method.
    """
    cls = method_class(name)
    if args:
        names = parameter_names(name)
        if len(args) > len(names):
            raise ValueError(f"{name}: takes at most {len(names)} positional arguments "
                             f"({', '.join(names)}), got {len(args)}")
        for key, value in zip(names, args):
            if key in params:
                raise ValueError(f"{name}: parameter {key!r} given both by position and by "
                                 f"name (parameters in order: {', '.join(names)})")
            params[key] = value
    nonfinite = params.pop("nonfinite", None)
    sig = inspect.signature(cls.__init__)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    allowed = [p for p in sig.parameters if p not in ("self",) and
               sig.parameters[p].kind in (inspect.Parameter.KEYWORD_ONLY,
                                          inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if not accepts_any:
        for key in params:
            if key not in allowed:
                raise ValueError(f"{name}: unknown parameter {key!r}; allowed: {sorted(allowed)}")
    try:
        method = cls(**params)
    except TypeError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if nonfinite is not None:
        method.set_nonfinite(nonfinite)
    return method


class _CompressionMeta(type):
    def __getattr__(cls, item: str) -> Any:
        if item.startswith("_"):
            raise AttributeError(item)
        if item not in _METHODS:
            raise UnknownMethodError(f"unknown compression method {item!r}; available: {available()}")

        def factory(*args: Any, **params: Any) -> Any:
            return create(item, *args, **params)

        factory.__name__ = item
        factory.__doc__ = _METHODS[item].__doc__
        return factory

    def __dir__(cls) -> list[str]:
        return sorted(set(super().__dir__()) | set(_METHODS))


class Compression(metaclass=_CompressionMeta):
    """Every method by name: ``Compression.oktopk(density=0.01)``.

    ``Compression.by_name("topk", density=0.01)`` does the same from a string;
    ``Compression.available()`` lists the names.
    """

    @staticmethod
    def by_name(name: str, *args: Any, **params: Any) -> Any:
        """``Compression.by_name("topk", density=0.01)``; positionals as in :func:`create`."""
        return create(name, *args, **params)

    @staticmethod
    def available() -> list[str]:
        return available()
