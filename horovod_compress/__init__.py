"""horovod-compress: published gradient compressors as a Horovod/MPI plugin.

``hvdc.Compression.<method>(**params)`` builds a method; every method is a
*compressed allreduce* usable on NumPy arrays (``method.allreduce(grad, name,
comm)``) and through the PyTorch (:mod:`horovod_compress.torch`) and
TensorFlow/Keras front-ends. Importing this package does not start MPI;
``Communicator`` (which does) is imported on first use.
"""
from typing import Any

from .compressors import Compression, Method

__version__ = "0.1.0"
__all__ = ["Compression", "Communicator", "Method", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Communicator":
        from .mpi_collectives import Communicator
        return Communicator
    raise AttributeError(name)
