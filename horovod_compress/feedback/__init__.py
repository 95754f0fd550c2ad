"""Error feedback for biased methods: ``none``, ``residual`` (EF14), and more.

Every module in this package registers its scheme on import; this file imports
them all, so a new scheme is one new module.
"""
import importlib
import pkgutil

from .base import (ALIASES, Feedback, available_feedback, feedback_parameters, make_feedback,
                   register_feedback)

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base":
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["ALIASES", "Feedback", "available_feedback", "feedback_parameters", "make_feedback",
           "register_feedback"]
