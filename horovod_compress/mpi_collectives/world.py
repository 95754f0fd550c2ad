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
job exits non-zero (docs/failures.md). Under ``torchrun`` (a
``torch.distributed`` job, no MPI world) the same hooks print the same line
and end the failing rank with ``os._exit(1)``; torchrun's elastic agent then
stops every other rank. :meth:`Method.allreduce` installs the hooks at its
first call on a communicator of more than one rank, so the core API, the DDP
comm hooks and every front-end get them without an ``init()``.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

from .timeline_file import ensure_env_timeline  # noqa: F401 - also Method.allreduce's entry point

_COMM: Any = None

ABORT_ENV = "HVDC_ABORT_ON_EXCEPTION"
_HOOKS: dict[str, Any] = {}   # the hooks we replaced (and "launcher"), while ours are installed
_OPTED_OUT = False            # init(abort_on_exception=False) was called
# gloo's words when a peer's process ended: this rank's error is a consequence, not the cause
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
_SECONDARY_DELAY_S = 3.0


def abort_on_exception_enabled() -> bool:
    """Whether the environment allows the abort hook (``HVDC_ABORT_ON_EXCEPTION`` not 0/false/no/off)."""
    return os.environ.get(ABORT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _torch_rank_size() -> tuple[int, int]:
    """This rank and the world size of a torch.distributed job (its env:// variables if not initialised)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - fall back on the launcher's variables
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _abort_world(where: str, exc_type: type, exc: BaseException | None) -> None:
    """Print which rank failed and why, then end the whole job (never returns).

    MPI world: ``MPI_Abort`` on ``COMM_WORLD``. torch.distributed job: this
    rank exits at once with status 1 (no atexit handlers, no waiting for
    threads stuck in a collective) and torchrun's agent stops the others.
    """
    if _HOOKS.get("launcher") == "torch":
        rank, size = _torch_rank_size()
        secondary = any(s in str(exc) for s in _PEER_LOST)
        try:
            sys.stderr.write(
                f"[hvdc] rank {rank} of {size}: uncaught {exc_type.__name__} {where}: {exc}\n"
                + (f"[hvdc] rank {rank}: another rank ended first (see its [hvdc] line); "
                   if secondary else f"[hvdc] rank {rank}: ")
                + f"ending this rank (exit status 1); torchrun stops every other rank; "
                f"set {ABORT_ENV}=0 to disable\n")
            sys.stderr.flush()
            sys.stdout.flush()
            if secondary:
                # Let torchrun's agent (it polls every 0.1 s) see the rank that failed first, so
                # its "Root Cause" names that one: it stops this rank meanwhile.
                time.sleep(_SECONDARY_DELAY_S)
        finally:
            os._exit(1)
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


def install_abort_on_exception(force: bool = False, launcher: str = "mpi") -> bool:
    """Make an uncaught exception on this rank end every rank.

    Installs ``sys.excepthook`` and ``threading.excepthook`` hooks that first
    run the hooks they replace (the usual traceback), then print
    ``[hvdc] rank R of P: uncaught <Error> ...`` and end the job:
    ``launcher="mpi"`` calls ``MPI.COMM_WORLD.Abort(1)``; ``launcher="torch"``
    (a ``torchrun`` job: ``torch.distributed``, no MPI world) exits this rank
    with ``os._exit(1)``, and torchrun's agent stops the others. Without it,
    one failing rank leaves the others waiting in a collective forever (and
    under torchrun an exception in a thread does not end its process at all).
    Nothing is installed in a world of one process, or when
    ``HVDC_ABORT_ON_EXCEPTION=0`` (unless ``force``). Idempotent; returns
    whether the hooks are installed.
    """
    if launcher not in ("mpi", "torch"):
        raise ValueError(f"launcher must be 'mpi' or 'torch', got {launcher!r}")
    if _HOOKS:
        return True
    if not force and not abort_on_exception_enabled():
        return False
    if launcher == "torch":
        size = _torch_rank_size()[1]
    else:
        from mpi4py import MPI
        size = MPI.COMM_WORLD.Get_size()
    if size == 1 and not force:
        return False
    _HOOKS["launcher"] = launcher
    _HOOKS["sys"] = sys.excepthook
    _HOOKS["threading"] = threading.excepthook
    sys.excepthook = _excepthook
    threading.excepthook = _threading_excepthook
    return True


_AUTO_DONE = False


def ensure_abort_on_exception(comm: Any) -> None:
    """Install the abort hooks for ``comm``'s kind of job, once per process (``Method.allreduce``).

    A communicator of more than one rank whose ``backend`` is ``"torch"``
    (:class:`~horovod_compress.mpi_collectives.torch_dist.TorchCommunicator`,
    a torchrun job) gets ``launcher="torch"``; an mpi4py one ``"mpi"``.
    Respects ``HVDC_ABORT_ON_EXCEPTION=0`` and an earlier
    ``init(abort_on_exception=False)``. Never raises: a communicator
    stand-in (unit tests) simply gets nothing.
    """
    global _AUTO_DONE
    if _AUTO_DONE or getattr(comm, "size", 1) <= 1:
        return
    _AUTO_DONE = True
    if _OPTED_OUT:
        return
    backend = getattr(comm, "backend", None)
    try:
        if backend == "torch":
            install_abort_on_exception(launcher="torch")
        elif backend == "mpi" and "mpi4py.MPI" in sys.modules:
            install_abort_on_exception(launcher="mpi")
    except Exception:  # noqa: BLE001 - the hooks are a convenience, never a failure
        pass


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
        global _COMM, _OPTED_OUT
        from .communicator import Communicator
        if comm is not None:
            _COMM = Communicator(comm)
        elif _COMM is None:
            _COMM = Communicator()
        ensure_env_timeline(_COMM)
        if abort_on_exception is None:
            install_abort_on_exception()
        elif abort_on_exception:
            _OPTED_OUT = False
            install_abort_on_exception(force=True)
        else:
            _OPTED_OUT = True
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
