"""A training workload to time: how to build the model, one rank's batch of a step, the loss.

``hvdc bench e2e`` times the project's own models (:func:`named_workload`);
``hvdc profile`` times the user's (:func:`script_workload`), read from a Python
file that defines

    def build_model() -> torch.nn.Module
    def batch(rank: int, step: int) -> tuple[inputs, targets]     # this rank's batch of ``step``
    def loss(model, inputs, targets) -> torch.Tensor               # optional: cross-entropy

The model and the batches are moved to ``device`` (``"cpu"``, ``"cuda"``,
``"cuda:1"`` ...).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .e2e_models import build_model, synthetic_batch


@dataclass
class Workload:
    """What one training step runs: ``loss(model, *batch(rank, step)).backward()``."""

    name: str
    build: Callable[[], Any]
    batch: Callable[[int, int], tuple[Any, Any]]
    loss: Callable[[Any, Any, Any], Any]
    device: str = "cpu"

    def model(self) -> Any:
        """A fresh model on :attr:`device` (seed torch first for the same weights on every rank)."""
        return self.build().to(self.device)

    def step_batch(self, rank: int, step: int) -> tuple[Any, Any]:
        """This rank's batch of ``step`` on :attr:`device`."""
        x, y = self.batch(rank, step)
        return _to(x, self.device), _to(y, self.device)


def _to(value: Any, device: str) -> Any:
    if hasattr(value, "to"):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def _default_loss(model: Any, x: Any, y: Any) -> Any:
    import torch
    return torch.nn.functional.cross_entropy(model(x), y)


def named_workload(model_name: str) -> Workload:
    """One of the project's benchmark models (``transformer``, ``matrix2000``, ``tiny``)."""
    return Workload(model_name, lambda: build_model(model_name),
                    lambda rank, step: synthetic_batch(model_name, rank, step),
                    lambda model, x, y: model.loss(x, y))


def script_workload(path: str | Path, device: str = "cpu") -> Workload:
    """The workload a user's Python file defines (see the module docstring)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--script {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"hvdc_user_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    missing = [name for name in ("build_model", "batch") if not callable(getattr(module, name, None))]
    if missing:
        raise ValueError(f"--script {path} must define {' and '.join(missing)} (see hvdc profile -h)")
    return Workload(file.stem, module.build_model, module.batch,
                    getattr(module, "loss", _default_loss), device)
