"""PyTorch front-end: ``import horovod_compress.torch as hvd`` in place of ``import horovod.torch as hvd``.

Every public name of ``horovod.torch`` 0.28 is here with Horovod's
parameters (:mod:`.horovod_api`; the table is in docs/horovod.md), plus ours:
``communicator()`` (the mpi4py :class:`~horovod_compress.mpi_collectives.Communicator`
with byte counts), ``horovod_active()``, ``broadcast_object(..., comm=)``.
``DistributedOptimizer`` takes any ``Compression.<method>`` (called, or
uncalled as in ``hvd.Compression.fp16``).
"""
import sys as _sys

from ..compressors import Compression
from . import elastic, optimizer
from . import rng as _rng  # noqa: F401  (registers powersgd's q_init="torch" generator)
from ..horovod_api.common import *  # noqa: F403 - Horovod's names every front-end shares
from .horovod_api import (
    DistributedOptimizer,
    HorovodInternalError,
    SyncBatchNorm,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    cross_rank,
    cross_size,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    join,
    local_rank,
    local_size,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    shutdown,
    size,
    sparse_allreduce_async,
    synchronize,
)
from .world import communicator, horovod_active

# Horovod's submodules of horovod.torch, for scripts that reach them as attributes
# (hvd.mpi_ops.allreduce, hvd.compression.Compression ...): the API module.
from . import horovod_api as mpi_ops  # noqa: E402
compression = functions = sync_batch_norm = mpi_ops
for _name in ("mpi_ops", "compression", "functions", "sync_batch_norm"):
    _sys.modules.setdefault(f"{__name__}.{_name}", mpi_ops)

__all__ = [n for n in dir() if not n.startswith("_") and n != "horovod_api"]
