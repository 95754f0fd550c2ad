"""Where ``Method.compress``/``decompress`` (Horovod's ``Compressor`` protocol) find their implementation.

The implementation works on torch and TensorFlow tensors inside Horovod's own
optimizers, so it lives above the front-ends, in the Horovod adapter
(:mod:`horovod_compress.horovod_compat`); the methods sit below them and must
not import it. The adapter registers its two functions here when it is
imported, and the package's ``__init__`` imports the adapter, so they are
registered whenever a method exists (the adapter itself imports neither
torch nor TensorFlow until a tensor of theirs arrives).
"""
from __future__ import annotations

from typing import Any, Callable

_IMPLEMENTATION: dict[str, Callable[..., Any]] = {}


def register_horovod_protocol(compress: Callable[..., Any], decompress: Callable[..., Any]) -> None:
    """Install ``compress(method, tensor) -> (tensor', ctx)`` and
    ``decompress(method, tensor, ctx) -> tensor`` as every method's Horovod protocol."""
    _IMPLEMENTATION["compress"] = compress
    _IMPLEMENTATION["decompress"] = decompress


def horovod_protocol(name: str) -> Callable[..., Any]:
    """The registered ``compress`` or ``decompress`` (a clear error if no adapter registered one)."""
    if name not in _IMPLEMENTATION:
        raise RuntimeError("no Horovod adapter registered: import horovod_compress (its __init__ "
                           "imports horovod_compress.horovod_compat, which registers it)")
    return _IMPLEMENTATION[name]
