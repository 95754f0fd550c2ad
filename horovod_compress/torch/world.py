"""Process-group state for the PyTorch front-end (see :mod:`horovod_compress.runtime.world`).

The communicator is shared with the other front-ends in the same process;
Horovod (``horovod.torch``) is joined when the script imported it.
"""
from ..runtime.world import FrontEndWorld

_WORLD = FrontEndWorld("horovod.torch")
init = _WORLD.init
communicator = _WORLD.communicator
rank = _WORLD.rank
size = _WORLD.size
local_rank = _WORLD.local_rank
horovod_active = _WORLD.horovod_active
