"""``hvd.elastic`` for PyTorch on a fixed MPI world (see :mod:`horovod_compress.horovod_api.elastic`).

``TorchState(model, optimizer, **attrs)``, ``ElasticSampler`` and
``@run`` keep Horovod's meaning at a fixed world size: ``run`` broadcasts
the state from rank 0 and calls the training function; ``commit()`` keeps a
copy of the model and optimizer state that ``restore()`` returns to;
``ElasticSampler`` partitions a dataset over the ranks and skips the samples
already processed in the epoch (``record_batch``/``record_indices``).
"""
from __future__ import annotations

import copy
import math
import sys
from typing import Any, Callable

import numpy as np
import torch

from ..horovod_api import basics as hb
from ..horovod_api.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    refuse_elastic_launch,
)
from ..horovod_api.elastic import run_fn as _run_fn
from .horovod_api import broadcast_object, broadcast_optimizer_state, broadcast_parameters, rank
from .horovod_api import init as _init
from .horovod_api import shutdown as _shutdown


def init(*args: Any, **kwargs: Any) -> None:
    """Horovod's ``elastic.init``: the ordinary ``init`` on a fixed world."""
    refuse_elastic_launch()
    _init(*args, **kwargs)


def shutdown(*args: Any, **kwargs: Any) -> None:
    """Mark the front-end uninitialised (MPI is finalised by mpi4py at exit)."""
    _shutdown()


def _reset() -> None:
    """Nothing to re-initialise: the world never changes."""


def run_fn(func: Callable, reset: Callable) -> Callable:
    """Horovod's ``run_fn``: sync the state, then run ``func`` (``reset`` never runs here)."""
    return _run_fn(func, reset)


def run(func: Callable) -> Callable:
    """Decorator for the training function ``func(state, ...)`` (see the module docstring)."""
    return _run_fn(func, _reset)


class TorchState(ObjectState):
    """Model, optimizer and attributes synced from rank 0, saved by ``commit()``."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        object.__setattr__(self, "_handlers", {})
        self._handlers = {}
        if model is not None:
            self._handlers["model"] = model
        if optimizer is not None:
            self._handlers["optimizer"] = optimizer
        self.model, self.optimizer = model, optimizer
        self._saved_modules: dict[str, Any] = {}
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)
        self._save_modules()

    def _save_modules(self) -> None:
        self._saved_modules = {k: copy.deepcopy(v.state_dict()) for k, v in self._handlers.items()}

    def save(self) -> None:
        """Keep a copy of the state (what :meth:`restore` returns to)."""
        self._save_modules()
        super().save()

    def restore(self) -> None:
        """Return to the state of the last :meth:`save`/``commit()``."""
        for k, v in self._handlers.items():
            v.load_state_dict(self._saved_modules[k])
        super().restore()

    def sync(self) -> None:
        """Give every rank rank 0's state."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()
        self._save_modules()


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``ElasticSampler``: this rank's share of ``dataset``, minus processed samples.

    ``set_epoch(e)`` reshuffles (same permutation on every rank from
    ``seed + e``) and forgets processed indices; ``record_batch(i, size)``
    or ``record_indices(idx)`` mark samples done, so a restored state resumes
    the epoch where its last commit was.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new shuffle, no sample processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` of ``batch_size`` samples as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Any) -> None:
        """Mark the samples ``indices`` as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The sample indices of batch ``batch_idx``."""
        start = batch_idx * batch_size
        end = min(start + batch_size, len(self.indices))
        return self.indices[start:end]

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def state_dict(self) -> dict:
        """The epoch and the processed indices."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def reset(self) -> None:
        """Hook for subclasses after a reset (nothing here)."""
        self.num_replicas = hb.size("torch")
        self.rank = hb.rank("torch")
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        padded = self.remaining_indices + self.remaining_indices[:self.total_size
                                                                 - len(self.remaining_indices)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


# Horovod's submodules ``horovod.torch.elastic.sampler`` / ``.state``: this module.
sampler = state = sys.modules[__name__]

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "State",
           "TorchState", "init", "run", "run_fn", "sampler", "shutdown", "state"]
