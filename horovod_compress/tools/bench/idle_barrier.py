"""A barrier for ranks that wait while rank 0 times something alone."""
from __future__ import annotations

import time
from typing import Any


def idle_barrier(comm: Any, poll_s: float) -> None:
    """Barrier on ``comm`` (a Communicator) that sleeps ``poll_s`` between tests instead of spinning,
    so the waiting ranks leave rank 0's core free for its timings."""
    req = comm.comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


__all__ = ["idle_barrier"]
