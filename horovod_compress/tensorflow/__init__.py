"""TensorFlow front-end: ``import horovod_compress.tensorflow as hvd`` in place of ``horovod.tensorflow``.

Every public name of ``horovod.tensorflow`` 0.28 is here with Horovod's
parameters (:mod:`.horovod_api`; the table is in docs/horovod.md), plus ours:
``communicator()``, ``horovod_active()``, ``GradientReducer``/``ExchangeStats``
(the exchange behind the tape, with byte counts). Every
``hvdc.Compression.*`` method works through the framework-independent exchange
the PyTorch front-end uses (:mod:`horovod_compress.runtime`), eagerly and
inside ``tf.function``. ``hvd.keras`` is :mod:`horovod_compress.keras`,
``hvd.elastic`` :mod:`.elastic`.
"""
import sys as _sys
from typing import Any as _Any

from ..compressors import Compression
from ..horovod_api.basics import HorovodInternalError
from ..horovod_api.common import *  # noqa: F403 - Horovod's names every front-end shares
# The submodule first: importing it later (Keras' callbacks do) would rebind the package
# attribute ``broadcast`` from Horovod's function below to the module.
from . import broadcast as _broadcast_module  # noqa: F401
from .horovod_api import (
    DistributedGradientTape,
    DistributedOptimizer,
    LocalGradientAggregationHelper,
    PartialDistributedGradientTape,
    SyncBatchNormalization,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    check_num_rank_power_of_2,
    cross_rank,
    cross_size,
    gpu_available,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    handle_average_backwards_compatibility,
    init,
    is_homogeneous,
    join,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    process_set_included_op,
    rank,
    rank_op,
    reducescatter,
    refs_to_vars,
    shutdown,
    size,
    size_op,
    split_list,
    vars_to_refs,
)
from .reducer import ExchangeStats, GradientReducer
from .world import communicator, horovod_active

# Horovod's submodules of horovod.tensorflow reached as attributes: the API module.
from . import horovod_api as mpi_ops  # noqa: E402
compression = functions = gradient_aggregation = gradient_aggregation_eager = \
    sync_batch_norm = util = mpi_ops
for _name in ("mpi_ops", "compression", "functions", "gradient_aggregation",
              "gradient_aggregation_eager", "sync_batch_norm", "util"):
    _sys.modules.setdefault(f"{__name__}.{_name}", mpi_ops)


def __getattr__(name: str) -> _Any:
    # hvd.elastic and hvd.keras load on first use (keras imports Keras). Not
    # ``from . import elastic``: its fromlist handling calls hasattr(), which
    # re-enters this function before the submodule is imported.
    import importlib
    if name == "elastic":
        return importlib.import_module(f"{__name__}.elastic")
    if name == "keras":
        return importlib.import_module("horovod_compress.keras")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [n for n in dir() if not n.startswith("_") and n != "horovod_api"] + ["elastic",
                                                                                 "keras"]
