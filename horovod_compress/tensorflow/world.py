"""Process-group state of the TensorFlow front-end: :class:`horovod_compress.mpi_collectives.world.FrontEndWorld`."""
import sys

from ..horovod_api.basics import register_world
from ..mpi_collectives.world import FrontEndWorld

_WORLD = FrontEndWorld("horovod.tensorflow")   # its communicator is shared with the other front-ends
init, communicator, rank, size, local_rank, horovod_active = (
    _WORLD.init, _WORLD.communicator, _WORLD.rank, _WORLD.size, _WORLD.local_rank,
    _WORLD.horovod_active)
register_world("tensorflow", sys.modules[__name__])   # the Horovod API layer reaches this world through the registry
