"""horovod-compress: published gradient compressors as a Horovod/MPI plugin.

``hvdc.Compression.<method>(**params)`` builds a method; every method is a
*compressed allreduce* usable on NumPy arrays (``method.allreduce(grad, name,
comm)``) and through the PyTorch (:mod:`horovod_compress.torch`) and
TensorFlow/Keras front-ends. Importing this package does not start MPI;
``Communicator`` (which does) is imported on first use.
"""
import os
from typing import Any

# Numba colours its error messages with colorama when colorama is installed, and colorama's
# exit handler then writes ESC[0m to stdout whenever stdout is a terminal -- which it is in
# every rank under mpirun (a pseudo-terminal), so piped or logged output ended in stray
# escape codes. Set before any module of ours imports Numba; a value the user set is kept.
os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")

from .compressors import Compression, Method  # noqa: E402  (after the environment above)
from . import horovod_compat  # noqa: E402, F401  (registers Method.compress/decompress; no torch/TF import)

__version__ = "0.1.0"
__all__ = ["Compression", "Communicator", "Method", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Communicator":
        from .mpi_collectives import Communicator
        return Communicator
    raise AttributeError(name)
