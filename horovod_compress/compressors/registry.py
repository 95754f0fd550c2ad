"""Name -> method registry behind ``hvdc.Compression``.

Each module in :mod:`horovod_compress.compressors` decorates its method class
with :func:`register`; ``Compression.<name>(**params)`` and
``Compression.by_name(name, **params)`` build instances. Unknown names and
unknown or out-of-range parameters raise ``ValueError`` naming them.
"""
from __future__ import annotations

import difflib
import inspect
from typing import Any

from ..feedback import feedback_parameters
from .base import Method

_METHODS: dict[str, type] = {}


class UnknownMethodError(ValueError, AttributeError):
    """An unknown method name (a ``ValueError``; also an ``AttributeError`` for ``getattr``)."""


def register(cls: type) -> type:
    """Class decorator: expose ``cls`` as ``Compression.<cls.name>``."""
    _METHODS[cls.name] = cls
    return cls


def available() -> list[str]:
    """Registered method names, in the project's documented order (docs/choosing.md) where known."""
    order = ["none", "fp16", "bf16", "topk", "randk", "gaussiank", "topk_dsa", "gtopk",
             "oktopk", "qsgd", "global_qsgd", "arc_topk", "powersgd", "greedylore",
             "deepreduce"]
    known = [n for n in order if n in _METHODS]
    return known + sorted(n for n in _METHODS if n not in order)


def method_class(name: str) -> type:
    """The class registered under ``name`` (``UnknownMethodError`` otherwise)."""
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
                             f"({', '.join(names)}), got {len(args)}; pass parameters by name, "
                             f"e.g. Compression.{name}({names[0] + '=...' if names else ''})")
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
    if accepts_any:   # the extra keywords are the feedback scheme's parameters (eta, ...)
        allowed += feedback_parameters(params.get("feedback") or cls.default_feedback)
    for key in params:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{name}: unknown parameter {key!r}{hint}; allowed: {sorted(allowed)}")
    try:
        method = cls(**params)
    except TypeError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if nonfinite is not None:
        method.set_nonfinite(nonfinite)
    return method


def defaults(name: str) -> dict[str, Any]:
    """Every parameter of method ``name`` with the value a call without it uses.

    The constructors are the one source of truth: a parameter whose signature
    default is a placeholder (``feedback=None`` -> the class's
    ``default_feedback``; ``density=None`` of DeepReduce -> its sparsifier's)
    is read back from a method built with no arguments (:meth:`Method.config`),
    and the default feedback scheme's own parameters (``eta`` of ``ef21m``)
    are listed too. ``hvdc methods`` and the documentation's parameter table
    print this.
    """
    cls = method_class(name)
    built = create(name)
    config = built.config()
    nested = config.get("sparsifier_params") or {}
    out: dict[str, Any] = {}
    for param in inspect.signature(cls.__init__).parameters.values():
        if param.default is inspect.Parameter.empty or param.kind is param.VAR_KEYWORD:
            continue
        value = param.default
        if value is None:   # a placeholder: the value the method chose (not a nested dict)
            if isinstance(config.get(param.name), (str, int, float, bool)):
                value = config[param.name]
            elif param.name in nested:
                value = nested[param.name]
            elif isinstance(getattr(built, param.name, None), (str, int, float, bool)):
                value = getattr(built, param.name)
            elif isinstance(getattr(built, param.name, None), dict):   # auto's candidates: their names
                value = tuple(getattr(built, param.name))
        out[param.name] = value
    for key, value in built.feedback.params().items():
        out.setdefault(key, value)
    return out


class MethodFactory:
    """``Compression.<name>``: call it to build the method; or pass it uncalled, as Horovod users do.

    ``Compression.fp16(...)`` builds a method (positionals as in :func:`create`).
    Horovod scripts write ``compression=hvd.Compression.fp16`` without calling
    it: our front-ends accept the factory itself (:func:`as_method` builds the
    method with its paper's defaults), and so does Horovod's own optimizer,
    because the factory also answers ``compress``/``decompress`` with one
    default instance of the method it holds.
    """

    def __init__(self, name: str) -> None:
        self.__name__ = self.name = name
        self.__doc__ = _METHODS[name].__doc__
        self._default: Any = None

    def __call__(self, *args: Any, **params: Any) -> Any:
        return create(self.name, *args, **params)

    def default(self) -> Any:
        """The method with default parameters, built once per factory object."""
        if self._default is None:
            self._default = create(self.name)
        return self._default

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Horovod ``Compressor.compress`` with the default instance."""
        return self.default().compress(tensor)

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Horovod ``Compressor.decompress`` with the default instance."""
        return self.default().decompress(tensor, ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


_HOROVOD_COMPRESSORS = {"NoneCompressor": "none", "FP16Compressor": "fp16",
                        "BF16Compressor": "bf16"}


def as_method(obj: Any, default: str = "none") -> Any:
    """A method object from what a front-end's ``compression=`` received.

    Accepts a method (returned as is), ``None`` (``default``), an uncalled
    ``Compression.<name>`` factory (a new method with its defaults), and Horovod's
    own ``hvd.Compression.none/fp16/bf16`` compressor classes (mapped to ours).
    Anything else is a ``ValueError`` saying what is expected.
    """
    if obj is None:
        return create(default)
    if isinstance(obj, Method):
        return obj
    if isinstance(obj, MethodFactory):
        return obj()
    cls_name = getattr(obj, "__name__", type(obj).__name__)
    module = getattr(obj, "__module__", "") or ""
    if module.startswith("horovod.") and cls_name in _HOROVOD_COMPRESSORS:
        return create(_HOROVOD_COMPRESSORS[cls_name])
    raise ValueError("compression must be hvdc.Compression.<method>(...) (or the uncalled "
                     "Compression.<method>, or Horovod's Compression.none/fp16/bf16), "
                     f"got {obj!r}")


class _CompressionMeta(type):
    def __getattr__(cls, item: str) -> Any:
        if item.startswith("_"):
            raise AttributeError(item)
        if item not in _METHODS:
            raise UnknownMethodError(f"unknown compression method {item!r}; available: {available()}")
        return MethodFactory(item)

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
        """Registered method names."""
        return available()
