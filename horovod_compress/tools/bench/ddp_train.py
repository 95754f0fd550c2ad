"""``hvdc train --launcher torchrun``: the digits demo under PyTorch DDP with our comm hooks.

Started as one process, it re-launches itself with ``torchrun --nproc-per-node
NP`` (``python -m torch.distributed.run``, a free port on 127.0.0.1); each
rank joins a gloo process group and trains :func:`.ddp_digits.train_ddp_digits`
once per method. No MPI is used. Rank 0 prints the same table as the mpirun
demo and writes ``results.json`` and ``accuracy_vs_bytes.png``.
"""
from __future__ import annotations

import os
import socket
import sys

_TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def under_torchrun() -> bool:
    """True inside a rank started by torchrun (torch.distributed.run)."""
    return any(k in os.environ for k in _TORCHRUN_ENV) and "LOCAL_RANK" in os.environ


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(nprocs: int, argv: list[str], module: str = "horovod_compress.tools.cli") -> list[str]:
    """``python -m torch.distributed.run`` on ``nprocs`` local ranks running ``python -m module argv``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", module, *argv]


def child_argv(argv: list[str]) -> list[str]:
    """``argv`` without ``--np N`` / ``--np=N``, for the ranks.

    torchrun parses every option-like word of its command line, the script's
    included, and takes ``--np`` for an abbreviation of its own
    ``--nproc-per-node`` (ambiguous with ``--nproc_per_node``: it refuses to
    start). The ranks do not need it: torchrun gives them their number.
    """
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--np":
            skip = True
        elif not word.startswith("--np="):
            out.append(word)
    return out


__all__ = ["child_argv", "torchrun_command", "under_torchrun"]
