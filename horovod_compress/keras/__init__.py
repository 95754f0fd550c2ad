"""Keras 3 front-end: ``import horovod_compress.keras as hvdc_keras``.

Mirrors ``horovod.keras`` (whose own layer does not work on Keras 3, see
docs/tensorflow.md): ``init``, ``rank``, ``size``, ``DistributedOptimizer``
and the callbacks ``BroadcastGlobalVariablesCallback``,
``MetricAverageCallback``, ``CompressionWarmupCallback``,
``CompressionStatsCallback``. Runs on the TensorFlow backend
(``KERAS_BACKEND=tensorflow``, Keras's default).
"""
import keras as _keras

if _keras.backend.backend() != "tensorflow":
    raise ImportError("horovod_compress.keras needs Keras's TensorFlow backend "
                      f"(KERAS_BACKEND=tensorflow); this process uses {_keras.backend.backend()!r}")

from ..compressors import Compression
from ..tensorflow.broadcast import broadcast_object, broadcast_variables
from ..tensorflow.reducer import Average, Sum
from ..tensorflow.world import communicator, init, local_rank, rank, size
from .callbacks import (
    BroadcastGlobalVariablesCallback,
    CompressionStatsCallback,
    CompressionWarmupCallback,
    MetricAverageCallback,
)
from .checkpoint import CompressionState
from .optimizer import DistributedOptimizer, reducer_of

__all__ = ["Average", "BroadcastGlobalVariablesCallback", "Compression", "CompressionState",
           "CompressionStatsCallback", "CompressionWarmupCallback", "DistributedOptimizer",
           "MetricAverageCallback", "Sum", "broadcast_object", "broadcast_variables",
           "communicator", "init", "local_rank", "rank", "reducer_of", "size"]
