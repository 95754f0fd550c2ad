"""Keras 3 front-end: ``import horovod_compress.keras as hvd`` in place of ``horovod.tensorflow.keras``.

Every public name of ``horovod.tensorflow.keras`` 0.28 is here with
Horovod's parameters (:mod:`.horovod_api`, ``hvd.callbacks``,
``hvd.elastic``; the table is in docs/horovod.md) -- Horovod's own Keras layer
does not run on Keras 3 (see docs/tensorflow.md). Ours add:
``CompressionWarmupCallback``, ``CompressionStatsCallback``,
``CompressionState``, ``reducer_of``, ``broadcast_variables``,
``broadcast_object``, ``communicator``. Runs on the TensorFlow backend
(``KERAS_BACKEND=tensorflow``, Keras's default).
"""
import keras as _keras

if _keras.backend.backend() != "tensorflow":
    raise ImportError("horovod_compress.keras needs Keras's TensorFlow backend "
                      f"(KERAS_BACKEND=tensorflow); this process uses {_keras.backend.backend()!r}")

from ..compressors import Compression
from ..tensorflow.horovod_api import broadcast_object, broadcast_variables
from ..tensorflow.world import communicator
from . import callbacks, elastic
from .callbacks import (
    BroadcastGlobalVariablesCallback,
    CompressionStatsCallback,
    CompressionWarmupCallback,
    MetricAverageCallback,
)
from .checkpoint import CompressionState
from ..horovod_api.common import *  # noqa: F403 - Horovod's names every front-end shares
from .horovod_api import (
    DistributedOptimizer,
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    cross_rank,
    cross_size,
    init,
    is_version_greater_equal_than,
    load_model,
    local_rank,
    local_size,
    rank,
    reducescatter,
    shutdown,
    size,
)
from .optimizer import reducer_of

__all__ = [n for n in dir() if not n.startswith("_") and n != "horovod_api"]
