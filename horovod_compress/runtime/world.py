"""Process-wide MPI state shared by the front-ends: ``init``, ``rank``, ``size``.

One :class:`~horovod_compress.mpi_collectives.Communicator` per process,
whichever front-end (PyTorch, TensorFlow, Keras) initialises it first, so
there is one byte count per rank whatever framework sends. ``init()`` starts
MPI through mpi4py (``MPI.COMM_WORLD``, or a communicator you pass) and, when
the script also uses Horovod (it imported the framework's Horovod module),
initialises Horovod on the same communicator so ``hvd.*`` calls and ours can
be mixed in one script. Under ``horovodrun`` (which starts ``mpirun``)
everything works unchanged: the ranks are an ordinary MPI world.

``init()`` also installs :func:`install_abort_on_exception` (unless
``abort_on_exception=False`` or the environment sets
``HVDC_ABORT_ON_EXCEPTION=0``): an uncaught exception on any rank, in the
main thread or in a thread such as the communication thread, prints the rank
and the error and calls ``MPI_Abort`` on ``COMM_WORLD``, so the other ranks,
which would otherwise wait forever inside a collective, end at once and the
job exits non-zero (docs/failures.md).
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

_COMM: Any = None

ABORT_ENV = "HVDC_ABORT_ON_EXCEPTION"
_HOOKS: dict[str, Any] = {}   # the hooks we replaced, while ours are installed


def abort_on_exception_enabled() -> bool:
    """Whether the environment allows the abort hook (``HVDC_ABORT_ON_EXCEPTION`` not 0/false/no/off)."""
    return os.environ.get(ABORT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _abort_world(where: str, exc_type: type, exc: BaseException | None) -> None:
    """Print which rank failed and why, then ``MPI_Abort`` the whole job (never returns)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    try:
        sys.stderr.write(f"[hvdc] rank {rank} of {size}: uncaught {exc_type.__name__} {where}: "
                         f"{exc}\n[hvdc] rank {rank}: aborting every rank (MPI_Abort); "
                         f"set {ABORT_ENV}=0 to disable\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        world.Abort(1)


def _excepthook(exc_type: type, exc: BaseException, tb: Any) -> None:
    previous = _HOOKS.get("sys") or sys.__excepthook__
    try:
        previous(exc_type, exc, tb)
    except Exception:  # noqa: BLE001 - the abort below must happen whatever the old hook does
        traceback.print_exception(exc_type, exc, tb)
    _abort_world("in the main thread", exc_type, exc)


def _threading_excepthook(args: Any) -> None:
    previous = _HOOKS.get("threading") or threading.__excepthook__
    try:
        previous(args)
    except Exception:  # noqa: BLE001
        traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    _abort_world(f"in thread {name!r}", args.exc_type, args.exc_value)


def install_abort_on_exception(force: bool = False) -> bool:
    """Make an uncaught exception on this rank abort every rank (``MPI_Abort``).

    Installs ``sys.excepthook`` and ``threading.excepthook`` hooks that first
    run the hooks they replace (the usual traceback), then print
    ``[hvdc] rank R of P: uncaught <Error> ...`` and call
    ``MPI.COMM_WORLD.Abort(1)``. Without it, one failing rank leaves the
    others waiting in a collective forever. Nothing is installed in a world of
    one process, or when ``HVDC_ABORT_ON_EXCEPTION=0`` (unless ``force``).
    Idempotent; returns whether the hooks are installed.
    """
    if _HOOKS:
        return True
    if not force and not abort_on_exception_enabled():
        return False
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() == 1 and not force:
        return False
    _HOOKS["sys"] = sys.excepthook
    _HOOKS["threading"] = threading.excepthook
    sys.excepthook = _excepthook
    threading.excepthook = _threading_excepthook
    return True


def uninstall_abort_on_exception() -> None:
    """Put back the exception hooks :func:`install_abort_on_exception` replaced."""
    if not _HOOKS:
        return
    if sys.excepthook is _excepthook:
        sys.excepthook = _HOOKS["sys"]
    if threading.excepthook is _threading_excepthook:
        threading.excepthook = _HOOKS["threading"]
    _HOOKS.clear()


def abort_on_exception_installed() -> bool:
    """Whether the abort hooks are installed."""
    return bool(_HOOKS)

_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                    "HOROVOD_LOCAL_RANK", "LOCAL_RANK")


class FrontEndWorld:
    """``init``/``rank``/``size`` of one front-end; ``horovod_module`` is the Horovod it may join."""

    def __init__(self, horovod_module: str) -> None:
        self.horovod_module = horovod_module
        self.horovod: Any = None

    def init(self, comm: Any = None, horovod: bool | None = None,
             abort_on_exception: bool | None = None) -> Any:
        """Initialise (idempotent) and return the :class:`Communicator` used by default.

        ``comm``: an mpi4py communicator (default ``MPI.COMM_WORLD``).
        ``horovod``: also call ``hvd.init(comm)`` on the same communicator;
        default: when the script has imported the framework's Horovod module.
        ``abort_on_exception``: install :func:`install_abort_on_exception`
        (an uncaught exception on any rank aborts the job instead of hanging
        it); default on unless ``HVDC_ABORT_ON_EXCEPTION=0``; ``False``
        removes the hooks if an earlier ``init`` installed them.
        """
        global _COMM
        from ..mpi_collectives import Communicator
        if comm is not None:
            _COMM = Communicator(comm)
        elif _COMM is None:
            _COMM = Communicator()
        if abort_on_exception is None:
            install_abort_on_exception()
        elif abort_on_exception:
            install_abort_on_exception(force=True)
        else:
            uninstall_abort_on_exception()
        if horovod is None:
            horovod = self.horovod_module in sys.modules
        if horovod and self.horovod is None:
            import importlib
            hvd = importlib.import_module(self.horovod_module)
            if not hvd.is_initialized():
                hvd.init(comm=_COMM.comm)
            self.horovod = hvd
        return _COMM

    def communicator(self) -> Any:
        """The communicator ``init()`` created (calls ``init()`` if needed)."""
        return _COMM if _COMM is not None else self.init()

    def rank(self) -> int:
        """This process's rank in the default communicator (initialises it if needed)."""
        return self.communicator().rank

    def size(self) -> int:
        """Number of ranks in the default communicator (initialises it if needed)."""
        return self.communicator().size

    @staticmethod
    def local_rank() -> int:
        """Rank within this node (from the launcher's environment; 0 if unknown)."""
        for key in _LOCAL_RANK_VARS:
            if key in os.environ:
                return int(os.environ[key])
        return 0

    def horovod_active(self) -> bool:
        """Whether Horovod was initialised alongside."""
        return self.horovod is not None
