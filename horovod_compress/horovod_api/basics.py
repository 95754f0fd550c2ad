"""Horovod's basic API on mpi4py, shared by the PyTorch, TensorFlow and Keras front-ends.

What ``horovod.common`` provides to ``horovod.torch``/``horovod.tensorflow``:
``init``/``shutdown``/``is_initialized``, the rank and size queries (global,
local = same node, cross = same local rank across nodes), the "built"/"enabled"
flags, reduction-op constants, process sets, handles of asynchronous calls,
and the dense Adasum reduction -- implemented here on the front-ends' shared
:class:`~horovod_compress.mpi_collectives.Communicator`, without Horovod.

Process sets (``ProcessSet``, ``add_process_set``, ``remove_process_set``,
``process_set=`` arguments) are MPI sub-communicators of the world:
``add_process_set`` is collective over every rank, as in Horovod.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

# Reduction ops. Average and Sum are the values our front-ends have always used
# (runtime.ops); Horovod's integer constants (Average=0 ... Product=5) are accepted too.
from ..mpi_collectives import timeline_file
from ..runtime.ops import Average, Sum
from .method_limits import HorovodAdapterError, is_stateless
from ..mpi_collectives.cuda_aware import cuda_aware_mpi

Adasum = "adasum"
Min = "min"
Max = "max"
Product = "product"
_HOROVOD_INT_OPS = {0: Average, 1: Sum, 2: Adasum, 3: Min, 4: Max, 5: Product}
_NAMES = {Average: Average, Sum: Sum, Adasum: Adasum, Min: Min, Max: Max, Product: Product,
          "avg": Average, "prod": Product}


class HorovodInternalError(RuntimeError):
    """Horovod's error type for a failed collective (ours raise it where Horovod would)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic interrupt; never raised here (the MPI world is fixed)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


def op_kind(op: Any, average: Any = None) -> str:
    """Normalise ``op`` (ours, Horovod's integers, names) and the deprecated ``average=`` flag."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Sum if average is False else Average
    if isinstance(op, (int, np.integer)) and not isinstance(op, bool):
        if int(op) in _HOROVOD_INT_OPS:
            return _HOROVOD_INT_OPS[int(op)]
    text = str(getattr(op, "name", op)).lower()
    if text in _NAMES:
        return _NAMES[text]
    raise ValueError(f"op must be Average, Sum, Adasum, Min, Max or Product, got {op!r}")


def handle_average_backwards_compatibility(op: Any, average: Any) -> Any:
    """Horovod's helper: the op that ``op``/``average`` ask for (ours: op names)."""
    return op_kind(op, average)


# ----------------------------------------------------------------------------- the world
class _State:
    def __init__(self) -> None:
        self.initialized = False
        self.local: Any = None     # mpi4py comm of this node
        self.cross: Any = None     # mpi4py comm of this local rank across nodes


_STATE = _State()
_WORLDS: dict[str, Any] = {}


def register_world(framework: str, world: Any) -> None:
    """Make ``world`` (a front-end's process-group state: ``init``, ``communicator``, ...) the one
    :func:`init` and the ranks use for ``framework``; each front-end registers its own on import,
    so this layer never imports a front-end."""
    _WORLDS[framework] = world


def _front_world(framework: str) -> Any:
    if framework not in _WORLDS:
        raise RuntimeError(f"no {framework!r} front-end registered: import "
                           f"horovod_compress.{framework} before calling its Horovod API")
    return _WORLDS[framework]


def init(framework: str, comm: Any = None, process_sets: Any = None, **options: Any) -> Any:
    """Horovod's ``init(comm=None, process_sets=None)`` for ``framework``'s front-end.

    ``comm``: an mpi4py communicator, or a list of world ranks (those ranks
    form the job; the others must not call). ``process_sets``: process sets to
    register now (``add_process_set`` for each), or ``"dynamic"`` (accepted:
    sets can always be added later). ``options`` go to the front-end's own
    ``init`` (``abort_on_exception=``, ``horovod=``).
    """
    if isinstance(comm, (list, tuple)):
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        group = world.Get_group().Incl([int(r) for r in comm])
        comm = world.Create_group(group, tag=7317)
    communicator = _front_world(framework).init(comm=comm, **options)
    if not _STATE.initialized or _STATE.local is None:
        _setup_topology(communicator)
    _STATE.initialized = True
    global_process_set._bind(list(range(communicator.size)), communicator, 0)
    if process_sets not in (None, "dynamic"):
        for ps in process_sets:
            add_process_set(ps)
    return communicator


def _setup_topology(communicator: Any) -> None:
    from mpi4py import MPI
    raw = communicator.comm
    _STATE.local = raw.Split_type(MPI.COMM_TYPE_SHARED, key=raw.Get_rank())
    _STATE.cross = raw.Split(color=_STATE.local.Get_rank(), key=raw.Get_rank())


def communicator(framework: str = "torch") -> Any:
    """The front-ends' shared communicator (``init`` first if needed)."""
    comm = _front_world(framework).communicator()
    if global_process_set.process_set_id == 0 and global_process_set.ranks is None:
        _STATE.initialized = True
        global_process_set._bind(list(range(comm.size)), comm, 0)
    return comm


def _topology(framework: str, which: str) -> Any:
    """The node-local (``which="local"``) or cross-node (``"cross"``) mpi4py communicator.

    Made on first use (collective: ``init`` makes them on every rank).
    """
    comm = communicator(framework)
    if _STATE.local is None:
        _setup_topology(comm)
    return getattr(_STATE, which)


def shutdown(framework: str = "torch") -> None:
    """Mark the front-end uninitialised (MPI itself is finalised by mpi4py at exit)."""
    _STATE.initialized = False


def is_initialized() -> bool:
    """Whether ``init()`` ran (and ``shutdown()`` did not since)."""
    return _STATE.initialized


def rank(framework: str = "torch") -> int:
    """This process's rank in the world."""
    return communicator(framework).rank


def size(framework: str = "torch") -> int:
    """The number of processes in the world."""
    return communicator(framework).size


def local_rank(framework: str = "torch") -> int:
    """This process's rank among the processes of its node."""
    return _topology(framework, "local").Get_rank()


def local_size(framework: str = "torch") -> int:
    """The number of processes on this node."""
    return _topology(framework, "local").Get_size()


def cross_rank(framework: str = "torch") -> int:
    """This node's index among the nodes (the rank among processes with this local rank)."""
    return _topology(framework, "cross").Get_rank()


def cross_size(framework: str = "torch") -> int:
    """The number of nodes (processes with this local rank)."""
    return _topology(framework, "cross").Get_size()


def is_homogeneous(framework: str = "torch") -> bool:
    """Whether every node runs the same number of ranks."""
    comm = communicator(framework)
    sizes = comm.comm.allgather(local_size(framework))
    return len(set(sizes)) == 1


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE``."""
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """Collectives run on MPI (always, here)."""
    return True


def mpi_built() -> bool:
    """Collectives run on MPI (mpi4py): True."""
    return True


def gloo_enabled() -> bool:
    """Gloo is not used: False."""
    return False


def gloo_built() -> bool:
    """Gloo is not used: False."""
    return False


def nccl_built() -> int:
    """NCCL is not used by these collectives: 0 (GPU buffers go through MPI)."""
    return 0


def ddl_built() -> bool:
    """IBM DDL is not used: False."""
    return False


def ccl_built() -> bool:
    """oneCCL is not used: False."""
    return False


def cuda_built() -> bool:
    """Whether GPU buffers go through MPI without staging (CUDA-aware MPI)."""
    try:
        return bool(cuda_aware_mpi())
    except Exception:  # noqa: BLE001
        return False


def rocm_built() -> bool:
    """ROCm builds are not used: False."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's ``start_timeline``: record every rank's phases into ``file_path`` (collective).

    Chrome trace-event JSON, one process per rank, written merged by rank 0
    at :func:`stop_timeline` or exit (docs/timeline.md); ``HOROVOD_TIMELINE``
    starts the same at the first exchange. ``mark_cycles`` (Horovod's
    background-loop cycles) has no counterpart: there is no background loop.
    """
    timeline_file.start_timeline(communicator(), file_path)


def stop_timeline() -> None:
    """Horovod's ``stop_timeline``: stop recording and write the file on rank 0 (collective)."""
    timeline_file.stop_timeline()


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: Any) -> None:
    """Horovod checks its compiled extension here; ours has none to check."""
    return None


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Adasum needs it)."""
    num_rank = int(num_rank)
    return num_rank > 0 and (num_rank & (num_rank - 1)) == 0


def split_list(l: Sequence[Any], n: int) -> list[list[Any]]:  # noqa: E741 - Horovod's name
    """Horovod's helper: ``l`` in ``n`` contiguous parts of near-equal length."""
    n = max(1, int(n))
    k, m = divmod(len(l), n)
    return [list(l[i * k + min(i, m):(i + 1) * k + min(i + 1, m)]) for i in range(n)]


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Horovod's helper: whether version ``ver`` >= ``target``."""
    from packaging import version
    return version.parse(str(ver)) >= version.parse(str(target))


def join(framework: str = "torch") -> int:
    """Wait for every rank; return the rank that arrived last.

    Unlike Horovod's ``join``, ranks that joined do not feed zeros into other
    ranks' later collectives: every rank must reach ``join()`` after the same
    collectives (an uneven number of batches per rank hangs instead).
    """
    comm = communicator(framework)
    arrival = np.array([time.time()], dtype=np.float64)
    times = comm.comm.allgather(float(arrival[0]))
    return int(np.argmax(times))


def barrier(process_set: Any = None, framework: str = "torch") -> None:
    """Wait until every rank of ``process_set`` reaches this call."""
    comm_for(process_set, framework).barrier()


# -------------------------------------------------------------------------- process sets
class ProcessSet:
    """Horovod's ``ProcessSet``: a subset of ranks with its own communicator.

    ``ProcessSet([0, 2])`` or ``ProcessSet(mpi4py_comm)``; register it with
    :func:`add_process_set` (collective) before use. ``size()``, ``rank()``
    and ``included()`` as in Horovod.
    """

    process_set_id: Any = None

    def __init__(self, ranks_or_comm: Any) -> None:
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_rank"):
            self.mpi_comm = ranks_or_comm
            self.ranks = None
        else:
            self.ranks = sorted(int(r) for r in ranks_or_comm)
        self.process_set_id = None
        self._comm: Any = None

    def _bind(self, ranks: list[int], comm: Any, ps_id: int) -> None:
        self.ranks, self._comm, self.process_set_id = list(ranks), comm, ps_id

    def size(self) -> int | None:
        """The number of ranks in the set (None before registration)."""
        return None if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This rank's index in the set (None outside it)."""
        if self._comm is None:
            return None
        return self._comm.rank

    def included(self) -> bool | None:
        """Whether this rank belongs to the set (None before registration)."""
        if self.ranks is None:
            return None
        from mpi4py import MPI
        return MPI.COMM_WORLD.Get_rank() in self.ranks if self.process_set_id != 0 \
            else True

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ProcessSet) and self.process_set_id == other.process_set_id \
            and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks or ())))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.ranks = None
global_process_set.process_set_id = 0
_SETS: dict[int, ProcessSet] = {}
_IDS = itertools.count(1)
_SET_LOCK = threading.Lock()


def add_process_set(process_set: Any, framework: str = "torch") -> ProcessSet:
    """Register a process set (collective over every rank, in the same order everywhere)."""
    from ..mpi_collectives import Communicator
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    world = communicator(framework)
    if ps.mpi_comm is not None:
        ranks = world.comm.allgather(world.rank if ps.mpi_comm != _null_comm() else -1)
        ps.ranks = sorted(r for r in ranks if r >= 0)
    if not ps.ranks or any(r < 0 or r >= world.size for r in ps.ranks):
        raise ValueError(f"process set ranks must be a non-empty subset of 0..{world.size - 1}, "
                         f"got {ps.ranks}")
    for other in _SETS.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} is already registered")
    group = world.comm.Get_group().Incl(ps.ranks)
    raw = world.comm.Create(group)
    with _SET_LOCK:
        ps_id = next(_IDS)
        _SETS[ps_id] = ps
    ps._bind(ps.ranks, Communicator(raw) if world.rank in ps.ranks else None, ps_id)
    return ps


def _null_comm() -> Any:
    from mpi4py import MPI
    return MPI.COMM_NULL


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set``; ``False`` for the global set or an unknown one."""
    if process_set.process_set_id in (None, 0) or process_set.process_set_id not in _SETS:
        return False
    with _SET_LOCK:
        _SETS.pop(process_set.process_set_id, None)
    comm = process_set._comm
    if comm is not None:
        try:
            comm.comm.Free()
        except Exception:  # noqa: BLE001
            pass
    process_set.process_set_id, process_set._comm = None, None
    return True


def comm_for(process_set: Any, framework: str = "torch") -> Any:
    """Our Communicator for ``process_set`` (``None`` or the global set: the world)."""
    if process_set is None or process_set is global_process_set or \
            getattr(process_set, "process_set_id", None) == 0:
        return communicator(framework)
    if not isinstance(process_set, ProcessSet):
        # Horovod's own ProcessSet object (mixed scripts): map by ranks.
        ranks = sorted(getattr(process_set, "ranks", None) or [])
        match = next((ps for ps in _SETS.values() if ps.ranks == ranks), None)
        if match is None:
            raise ValueError(f"process set {process_set!r} is not registered with "
                             "horovod_compress (add_process_set)")
        process_set = match
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: call add_process_set() first")
    if process_set._comm is None:
        raise ValueError(f"rank {communicator(framework).rank} is not in {process_set}")
    return process_set._comm


def root_in(process_set: Any, root_rank: int, framework: str = "torch") -> int:
    """A world rank ``root_rank`` as an index in ``process_set``'s communicator."""
    comm = comm_for(process_set, framework)
    ranks = getattr(process_set, "ranks", None)
    if process_set is None or getattr(process_set, "process_set_id", 0) == 0 or ranks is None:
        if not 0 <= int(root_rank) < comm.size:
            raise ValueError(f"root_rank must be in [0, {comm.size - 1}], got {root_rank}")
        return int(root_rank)
    if int(root_rank) not in ranks:
        raise ValueError(f"root_rank {root_rank} is not in {process_set}")
    return ranks.index(int(root_rank))


# ------------------------------------------------------------------ one front-end's calls
def _front_end_query(fn: Callable[[str], Any]) -> Callable[..., Any]:
    """``fn(framework)`` as a method of :class:`FrontEndCalls`, with ``fn``'s name, docstring and
    return type (what a front-end's ``hvd.rank()`` and the like show)."""
    def query(self: FrontEndCalls) -> Any:
        return fn(self.framework)

    query.__name__ = fn.__name__
    query.__qualname__ = f"FrontEndCalls.{fn.__name__}"
    query.__doc__ = fn.__doc__
    query.__annotations__ = {"return": fn.__annotations__.get("return", "Any")}
    return query


class FrontEndCalls:
    """Horovod's world calls bound to one front-end (``framework``: ``"torch"`` or ``"tensorflow"``).

    The PyTorch and TensorFlow APIs re-export the bound methods of
    :meth:`world` as their module functions (``hvd.init``, ``hvd.rank``, ...),
    so both front-ends run the same code with their own framework's world.
    """

    def __init__(self, framework: str) -> None:
        self.framework = framework

    def world(self) -> tuple[Any, ...]:
        """``(init, shutdown, rank, size, local_rank, local_size, cross_rank, cross_size,
        is_homogeneous, barrier)``, bound to this front-end."""
        return (self.init, self.shutdown, self.rank, self.size, self.local_rank,
                self.local_size, self.cross_rank, self.cross_size, self.is_homogeneous,
                self.barrier)

    def init(self, comm: Any = None, process_sets: Any = None, **options: Any) -> None:
        """Start (idempotent): MPI through mpi4py, or ``comm`` (a communicator or a list of ranks).

        ``options`` go to the front-end's ``world.init`` (``abort_on_exception=``,
        ``horovod=``).
        """
        init(self.framework, comm=comm, process_sets=process_sets, **options)

    shutdown = _front_end_query(shutdown)
    rank = _front_end_query(rank)
    size = _front_end_query(size)
    local_rank = _front_end_query(local_rank)
    local_size = _front_end_query(local_size)
    cross_rank = _front_end_query(cross_rank)
    cross_size = _front_end_query(cross_size)
    is_homogeneous = _front_end_query(is_homogeneous)

    def barrier(self, process_set: Any = global_process_set) -> None:
        """Wait until every rank of ``process_set`` reaches this call."""
        barrier(process_set, self.framework)

    def comm(self, process_set: Any) -> Any:
        """Our Communicator for ``process_set`` (:func:`comm_for`)."""
        return comm_for(process_set, self.framework)

    def broadcast_object(self, obj: Any, root_rank: int, process_set: Any, comm: Any) -> Any:
        """Any picklable ``obj`` from world rank ``root_rank`` of ``process_set`` (or of ``comm``)."""
        if comm is not None:
            return comm.broadcast_object(obj, root=root_rank)
        return self.comm(process_set).broadcast_object(
            obj, root=root_in(process_set, root_rank, self.framework))


# ---------------------------------------------------------------------------- handles
_HANDLES: dict[int, Any] = {}
_HANDLE_IDS = itertools.count(1)


def make_handle(result: Any) -> int:
    """A handle of an operation that already completed (ours run when called)."""
    h = next(_HANDLE_IDS)
    _HANDLES[h] = result
    return h


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` finished (always, once issued)."""
    if handle not in _HANDLES:
        raise ValueError(f"unknown handle {handle!r}")
    return True


def synchronize(handle: int) -> Any:
    """The result of the operation of ``handle`` (the handle is released)."""
    if handle not in _HANDLES:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)")
    return _HANDLES.pop(handle)


# ------------------------------------------------------------------------------ Adasum
def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two vectors: ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`` (Horovod's guards)."""
    dot = float(np.dot(a, b))
    na, nb = float(np.dot(a, a)), float(np.dot(b, b))
    ca = 1.0 - dot / (2.0 * na) if na >= 1e-18 else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb >= 1e-18 else 1.0
    return ca * a + cb * b


def adasum_allreduce(comm: Any, x: np.ndarray) -> np.ndarray:
    """Dense Adasum over ranks (Maleki et al.; Horovod's op=Adasum), same bits on every rank.

    Every rank gathers all vectors (float64) and combines them pairwise in a
    binary tree -- ranks (0,1), (2,3), ... then the pairs' results -- the
    order of Horovod's recursive halving; dot products over whole vectors.
    Needs a power-of-two number of ranks, as Horovod's CPU Adasum does.
    """
    p = comm.size
    if not check_num_rank_power_of_2(p):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    flat = np.ascontiguousarray(x, dtype=np.float64).reshape(-1)
    parts = list(comm.allgather(flat)) if p > 1 else [flat]
    while len(parts) > 1:
        parts = [adasum_pair(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0].reshape(np.shape(x)).astype(np.result_type(x), copy=False)


def reduce_dense(comm: Any, x: np.ndarray, kind: str) -> np.ndarray:
    """Uncompressed reduction of ``x`` with ``kind`` (every op Horovod has)."""
    if kind == Adasum:
        return adasum_allreduce(comm, x)
    if kind in (Average, Sum):
        out = comm.allreduce(x, op="sum")
        if kind == Average:
            if np.issubdtype(out.dtype, np.floating):
                out = out / out.dtype.type(comm.size)
            else:   # Horovod divides integers with truncation
                out = np.trunc(out / comm.size).astype(out.dtype)
        return out
    return comm.allreduce(x, op={Min: "min", Max: "max", Product: "prod"}[kind])


def reduce_with_method(method: Any, comm: Any, x: np.ndarray, kind: str, key: str | None,
                       ) -> np.ndarray:
    """``x`` reduced by ``kind`` with ``method`` (any method for Average/Sum; dense otherwise)."""
    if method.name == "none":
        return reduce_dense(comm, x, kind)
    if kind == Adasum and method.name in ("fp16", "bf16"):
        import ml_dtypes  # noqa: F401 - bf16 numpy type
        dtype = np.float16 if method.name == "fp16" else np.dtype("bfloat16")
        return adasum_allreduce(comm, np.asarray(x).astype(dtype).astype(np.float64)).astype(
            np.result_type(x))
    if kind not in (Average, Sum):
        raise HorovodAdapterError(
            f"{method.name}: op={kind} needs the exact values of every rank; compressed methods "
            "produce an average. Use op=Average or op=Sum with a method, or "
            f"compression=Compression.none with op={kind}")
    if not np.issubdtype(np.asarray(x).dtype, np.floating):
        raise HorovodAdapterError(f"{method.name} compresses floating-point tensors, got "
                                  f"{np.asarray(x).dtype}; use compression=Compression.none")
    if key is None:
        if not is_stateless(method):
            raise HorovodAdapterError(
                f"{method.name} keeps per-tensor state (residuals, thresholds or subspaces): "
                "pass name=... so every tensor keeps its own state")
        key = f"allreduce.noname{tuple(np.shape(x))}"
    avg = method.allreduce(x, key, comm)
    if kind == Sum:
        avg = avg * avg.dtype.type(comm.size)
    return avg


def _factor_like(factor: float, x: np.ndarray) -> np.ndarray:
    """``factor`` as a scalar of ``x``'s dtype when it is floating, else float64."""
    return np.asarray(factor, dtype=x.dtype if x.dtype.kind == "f" else np.float64)


def allreduce_scaled(method: Any, comm: Any, x: np.ndarray, kind: str, key: str | None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """Horovod's allreduce arithmetic: ``postscale * reduce_kind(prescale * x)``.

    The reduction is :func:`reduce_with_method`. Each factor multiplies in the
    operand's dtype when it is floating and in float64 otherwise (integer
    tensors are scaled in floating point and cast back by the front-end); a
    factor of 1 is skipped, so the operand is not copied.
    """
    if prescale_factor != 1.0:
        x = x * _factor_like(prescale_factor, x)
    out = reduce_with_method(method, comm, x, kind, key)
    if postscale_factor != 1.0:
        out = out * _factor_like(postscale_factor, out)
    return out


def require_uncompressed_reducescatter(method: Any) -> None:
    """Refuse a compression method for reducescatter (HorovodAdapterError naming the fix)."""
    if method.name != "none":
        raise HorovodAdapterError(f"{method.name}: reducescatter with a compression method is "
                                  "not supported; use compression=Compression.none")


def reducescatter_scaled(comm: Any, x: np.ndarray, kind: str, prescale_factor: float = 1.0,
                         postscale_factor: float = 1.0) -> np.ndarray:
    """``postscale * (this rank's rows of reduce_kind(prescale * x))`` (:func:`reducescatter_rows`).

    The factors multiply in the operand's own dtype (Horovod's reducescatter);
    a factor of 1 is skipped.
    """
    if prescale_factor != 1.0:
        x = x * x.dtype.type(prescale_factor)
    out = reducescatter_rows(comm, x, kind)
    if postscale_factor != 1.0:
        out = out * out.dtype.type(postscale_factor)
    return out


def reducescatter_rows(comm: Any, x: np.ndarray, kind: str) -> np.ndarray:
    """Horovod's reducescatter: reduce over ranks, rank r keeps its block of rows.

    Rows are split as evenly as possible, the first ``n % P`` ranks one more.
    """
    if kind not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=Average or op=Sum, got {kind}")
    if np.ndim(x) == 0:
        raise ValueError("reducescatter needs a tensor of rank >= 1")
    total = reduce_dense(comm, x, kind)
    n, p = x.shape[0], comm.size
    counts = [n // p + (1 if r < n % p else 0) for r in range(p)]
    start = sum(counts[:comm.rank])
    return np.ascontiguousarray(total[start:start + counts[comm.rank]])


def allgather_rows(comm: Any, x: np.ndarray) -> np.ndarray:
    """Concatenate every rank's ``x`` along the first dimension (which may differ)."""
    arr = np.ascontiguousarray(x)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    rows = comm.comm.allgather(arr.shape)
    if any(tuple(s[1:]) != tuple(arr.shape[1:]) for s in rows):
        raise ValueError(f"allgather: ranks' tensors differ beyond the first dimension: {rows}")
    flat, _ = comm.allgatherv(arr.reshape(-1))
    return flat.reshape((sum(s[0] for s in rows),) + tuple(arr.shape[1:]))


def alltoall_rows(comm: Any, x: np.ndarray, splits: Any) -> tuple[np.ndarray, np.ndarray]:
    """Send rows ``splits[j]`` to rank j; return (received rows, rows received from each rank)."""
    arr = np.ascontiguousarray(x)
    p = comm.size
    if splits is None:
        if arr.shape[0] % p:
            raise ValueError(f"alltoall without splits needs the first dimension ({arr.shape[0]}) "
                             f"divisible by the number of ranks ({p})")
        splits = [arr.shape[0] // p] * p
    splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    if len(splits) != p or sum(splits) != arr.shape[0]:
        raise ValueError(f"splits {splits} must have one entry per rank and sum to "
                         f"{arr.shape[0]}")
    row = int(np.prod(arr.shape[1:])) if arr.ndim > 1 else 1
    offs = np.concatenate([[0], np.cumsum(splits)])
    chunks = [arr[offs[j]:offs[j + 1]].reshape(-1) for j in range(p)]
    got = comm.alltoallv(chunks)
    recv = np.array([g.size // max(row, 1) for g in got], dtype=np.int32)
    out = np.concatenate(got) if got else np.empty(0, arr.dtype)
    return out.reshape((int(recv.sum()),) + tuple(arr.shape[1:])), recv
