"""PyTorch front-end: ``import horovod_compress.torch as hvdc_torch``.

Mirrors ``horovod.torch``: ``init``, ``rank``, ``size``, ``local_rank``,
``DistributedOptimizer``, ``broadcast_parameters``,
``broadcast_optimizer_state``, ``Average``/``Sum``.
"""
from ..compressors import Compression
from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .optimizer import Average, DistributedOptimizer, Sum
from .world import communicator, horovod_active, init, local_rank, rank, size

__all__ = ["Average", "Compression", "DistributedOptimizer", "Sum", "broadcast_object",
           "broadcast_optimizer_state", "broadcast_parameters", "communicator",
           "horovod_active", "init", "local_rank", "rank", "size"]
