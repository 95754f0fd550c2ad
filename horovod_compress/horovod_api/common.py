"""The names of Horovod's basic API that every front-end exports unchanged.

``from ..horovod_api.common import *`` in the PyTorch, TensorFlow and Keras
front-ends: the reduction ops, process sets, ``is_initialized``, the
"built"/"enabled" flags and the timeline (start_timeline/stop_timeline), all from
:mod:`horovod_compress.horovod_api.basics`.
"""
from .basics import (  # noqa: F401 - re-exported
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    check_extension,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    is_initialized,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    remove_process_set,
    rocm_built,
    start_timeline,
    stop_timeline,
)

__all__ = [_name for _name in dir() if not _name.startswith("_")]
