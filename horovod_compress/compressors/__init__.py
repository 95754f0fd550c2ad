"""One module per method; each registers itself with :mod:`.registry` on import."""
import importlib
import pkgutil

from .base import Method, TensorState
from .registry import Compression, available, create, register

_SKIP = {"base", "registry", "params"}
for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in _SKIP and not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["Compression", "Method", "TensorState", "available", "create", "register"]
