"""TensorFlow front-end: ``import horovod_compress.tensorflow as hvdc_tf``.

Mirrors ``horovod.tensorflow``: ``init``, ``rank``, ``size``, ``local_rank``,
``DistributedGradientTape``, ``broadcast_variables``, ``allreduce``,
``Average``/``Sum``. Every ``hvdc.Compression.*`` method works here through
the same framework-independent exchange the PyTorch front-end uses
(:mod:`horovod_compress.runtime`), eagerly and inside ``tf.function``.
"""
from ..compressors import Compression
from .broadcast import broadcast_object, broadcast_variables
from .collectives import allreduce
from .reducer import Average, ExchangeStats, GradientReducer, Sum
from .tape import DistributedGradientTape
from .world import communicator, horovod_active, init, local_rank, rank, size

__all__ = ["Average", "Compression", "DistributedGradientTape", "ExchangeStats",
           "GradientReducer", "Sum", "allreduce", "broadcast_object", "broadcast_variables",
           "communicator", "horovod_active", "init", "local_rank", "rank", "size"]
