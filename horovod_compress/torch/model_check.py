"""Check, before ``DistributedDataParallel`` wraps a model, that every rank built the same one.

DDP's constructor verifies parameter shapes across ranks, but on a mismatch
(one rank's layer one unit wider, an extra layer on one rank) PyTorch 2.13
raises on the ranks that see the difference and lets the others go on into
the broadcast of the parameters, where they wait forever (seen with gloo and
``torchrun --nproc-per-node 2``). :func:`check_same_model` runs the project's
own cross-rank check (:func:`~horovod_compress.mpi_collectives.consistency.check_same_tensors`:
one allgather of a 16-byte digest of every parameter's and buffer's name,
shape and dtype) and raises the same
:class:`~horovod_compress.mpi_collectives.consistency.TensorMismatchError`, naming the
first differing tensor, on every rank.
"""
from __future__ import annotations

from typing import Any

import torch

from ..runtime.buckets import TensorSpec
from ..mpi_collectives.consistency import check_same_tensors
from ..mpi_collectives.torch_dist import TorchCommunicator


def model_specs(module: torch.nn.Module) -> list[TensorSpec]:
    """``(name, shape, dtype)`` of every parameter and buffer of ``module``, in registration order."""
    named = [(f"param:{n}", t) for n, t in module.named_parameters()]
    named += [(f"buffer:{n}", t) for n, t in module.named_buffers()]
    return [TensorSpec(n, tuple(int(s) for s in t.shape), str(t.dtype).replace("torch.", ""))
            for n, t in named]


def check_same_model(module: torch.nn.Module, comm: Any = None) -> None:
    """Raise :class:`~horovod_compress.mpi_collectives.consistency.TensorMismatchError` on every rank unless all built the same model.

    Call it on every rank before ``DistributedDataParallel(module)``. ``comm``
    is a communicator (default: a
    :class:`~horovod_compress.mpi_collectives.torch_dist.TorchCommunicator` on
    the default process group, built here -- a collective call). Costs one
    16-byte allgather when the models agree.
    """
    if comm is None:
        comm = TorchCommunicator()
    check_same_tensors(comm, model_specs(module))


__all__ = ["check_same_model", "model_specs"]
