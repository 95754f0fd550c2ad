"""The unit every method implements: a *compressed allreduce*.

Given this rank's gradient ``g_i`` for tensor ``name`` and a communicator,
:meth:`Method.allreduce` returns the (approximate) average
``(1/P) sum_i g_i`` and updates the method's per-tensor state. Horovod's
compress/decompress pair is one special case of it (compress, dense allreduce,
decompress); Ok-Topk's split-reduce-balance-allgatherv is another.

A subclass implements :meth:`Method._reduce`, which maps an input ``x_i`` to
``(avg, local)``:

* ``avg``   -- what every rank receives, the method's estimate of avg_i x_i;
* ``local`` -- the dense vector this rank's contribution actually carried,
  ``C_i(x_i)`` (e.g. its own top-k entries). Error feedback needs it:
  EF14 keeps ``e_i = x_i - local``; EF21 tracks ``local`` as ``c_i``. A method
  may return ``None`` instead when ``self.feedback.uses_local`` is false (no
  feedback reads it) and building it would cost a pass over the gradient.

Error feedback (:mod:`horovod_compress.feedback`) wraps ``_reduce`` for biased
methods; warm-up steps run a dense allreduce. Per-tensor state (step counter,
residual, thresholds, subspaces ...) lives in ``self.state[name]``, an instance
of the method's ``state_class`` (:mod:`horovod_compress.compressors.state`),
and is what :meth:`state_dict` saves.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, ClassVar

import numpy as np
from greenlet import getcurrent as _current_task

from ..feedback import Feedback, make_feedback
from ..kernels.arrays import (
    as_module_array,
    get_array_module,
    is_cupy,
    is_gpu_array,
    to_device_like,
    to_host,
)
from ..mpi_collectives import timeline as _timeline
from ..mpi_collectives import world as _world
from ..mpi_collectives.consistency import NEW_SIGNATURE, NONFINITE, TensorMismatchError, agree, check_same_signature
from ..params import check_int
from .horovod_protocol import horovod_protocol
from .state import STATE_FORMAT_VERSION, MethodScratch, TensorState

NONFINITE_POLICIES = ("raise", "skip", "propagate")
NONFINITE_ENV = "HVDC_NONFINITE"
_MAX_SIGNATURES = 4096



def _task_id() -> int:
    """The running task: its greenlet (the lockstep runner runs several tensors' calls as greenlets
    of one thread) -- on a plain thread, that thread's main greenlet, one per thread."""
    return id(_current_task())

def check_format_version(sd: dict[str, Any], method: str) -> int:
    """The format version of checkpoint ``sd`` (1 when it has none); ``ValueError`` for one this
    version cannot read, naming the version found and the ones it reads."""
    version = sd.get("format_version", 1)
    if not isinstance(version, (int, np.integer)) or not 1 <= int(version) <= STATE_FORMAT_VERSION:
        raise ValueError(f"{method}: checkpoint format version {version!r} cannot be read here: "
                         f"this version of horovod_compress reads format versions 1 to "
                         f"{STATE_FORMAT_VERSION} (a newer checkpoint needs a newer "
                         f"horovod_compress)")
    return int(version)


class NonFiniteGradientError(FloatingPointError, ValueError):
    """A gradient held NaN/Inf under the ``nonfinite="raise"`` policy (raised on every rank)."""


def _finite(x: Any) -> bool:
    """Whether every entry of ``x`` is finite.

    Fast path: one dot product ``x . x`` (BLAS, no temporary), finite exactly
    when no entry is NaN/Inf unless the sum of squares overflows; only then
    (or when it is not finite) the exact element-wise test decides.
    """
    xp = get_array_module(x)
    if x.size == 0:
        return True
    v = x.reshape(-1)
    with np.errstate(all="ignore"):
        if bool(xp.isfinite(xp.dot(v, v))):
            return True
    return bool(xp.isfinite(x).all())   # NaN/Inf, or a sum of squares that overflowed


class _FiniteGate:
    """A deferred per-call agreement: the work-dtype gradient, the communicator, the signature."""

    __slots__ = ("x", "comm", "signature")

    def __init__(self, x: Any, comm: Any, signature: tuple) -> None:
        self.x, self.comm, self.signature = x, comm, signature


class _NonFiniteAgreed(Exception):
    """Raised by :meth:`Method._pass_finite_gate` when the ranks agreed that a gradient is not finite."""

    def __init__(self, bad_ranks: list[int]) -> None:
        super().__init__(bad_ranks)
        self.bad_ranks = bad_ranks


def _move_state(state: TensorState, xp: Any) -> None:
    """Put the float arrays of a tensor's state on ``xp``'s device (after a restore, or a device change).

    Only floating-point arrays (residuals, trackers) follow the gradient;
    integer arrays (selected rows, diagnostics) stay where they are.
    """
    for owner, attr, value in list(state.present_fields()):
        on_gpu = is_gpu_array(value)
        if (on_gpu or isinstance(value, np.ndarray)) and np.dtype(value.dtype).kind == "f" \
                and on_gpu != (xp is not np):
            setattr(owner, attr, as_module_array(value, xp))


class Method:
    """Base class of every compression method (a compressed allreduce).

    Class attributes a subclass sets:

    * ``name`` -- the registry name (``hvdc.Compression.<name>``);
    * ``layout`` -- ``"flat"`` (runs on fused 1-D buckets) or ``"matrix"``
      (runs per tensor, on its 2-D view);
    * ``biased`` -- whether error feedback applies by default;
    * ``default_feedback`` -- the feedback used when the caller gives none;
    * ``horovod_compatible`` -- Horovod's own allreduce performs the method
      (a cast around it: none, fp16). Every method plugs into
      ``hvd.DistributedOptimizer``/``DistributedGradientTape``/``hvd.allreduce``
      through :meth:`compress`/:meth:`decompress`
      (:mod:`horovod_compress.horovod_compat`); the others run their own
      exchange there and hand Horovod a placeholder;
    * ``gpu_native`` -- ``_reduce`` is written against the array module of
      its input (``xp = get_array_module(x)``) and the kernel dispatcher, so a
      CuPy gradient is compressed on the GPU end to end. Other methods accept
      GPU arrays too: :meth:`allreduce` copies them to the host, runs there,
      and copies the result back (counted in ``device_calls["staged"]``).
    """

    name: ClassVar[str] = "base"
    layout: ClassVar[str] = "flat"
    biased: ClassVar[bool] = False
    default_feedback: ClassVar[str] = "none"
    horovod_compatible: ClassVar[bool] = False
    gpu_native: ClassVar[bool] = False
    #: whether ``_reduce`` runs a real reduce-scatter under :meth:`reduce_scatter` (it then moves
    #: only what a rank's block needs; the others reduce everything and keep a slice)
    scatters: ClassVar[bool] = False
    #: the class of ``self.state[name]`` (:mod:`horovod_compress.compressors.state`)
    state_class: ClassVar[type[TensorState]] = TensorState

    def __init__(self, *, feedback: str | None = None, warmup_steps: int = 0,
                 seed: int = 0, nonfinite: str | None = None, **feedback_params: Any) -> None:
        self.warmup_steps = check_int(self.name, "warmup_steps", warmup_steps, 0)
        self.seed = check_int(self.name, "seed", seed, 0, 2**63 - 1)
        self.nonfinite: str = "raise"
        self.set_nonfinite(nonfinite)
        self._signatures: set[tuple] = set()
        self._finite_gates: dict[int, _FiniteGate] = {}   # deferred agreements, per thread
        self.skipped_steps: int = 0
        self.last_step_skipped: bool = False
        self.feedback: Feedback = make_feedback(
            self.name, feedback if feedback is not None else self.default_feedback,
            **feedback_params)
        self.state: dict[str, TensorState] = {}
        #: work buffers reused across calls (never checkpointed)
        self.scratch = MethodScratch()
        self.device_calls: dict[str, int] = {"native": 0, "staged": 0}

    # --------------------------------------------------------------- public
    def allreduce(self, grad: np.ndarray, name: str, comm: Any) -> np.ndarray:
        """Return the (approximate) average of ``grad`` over ranks.

        ``grad`` is this rank's gradient (any shape; float16/bfloat16 inputs
        are computed in float32 and returned in their own dtype). ``name``
        identifies the tensor (or fused bucket) whose state is used, and must
        be the same on every rank. ``comm`` is a
        :class:`~horovod_compress.mpi_collectives.Communicator`.

        The first call on a communicator of more than one rank installs the
        abort-on-exception hooks (:func:`~horovod_compress.mpi_collectives.world.ensure_abort_on_exception`,
        off with ``HVDC_ABORT_ON_EXCEPTION=0``).
        """
        _world.ensure_abort_on_exception(comm)   # once per process; a flag test afterwards
        _world.ensure_env_timeline(comm)         # HOROVOD_TIMELINE: likewise
        rec = _timeline.recorder
        if rec is None:
            return self._allreduce(grad, name, comm)
        with rec.span(self.name, "method", tensor=name, numel=int(np.size(grad))):
            return self._allreduce(grad, name, comm)

    def _allreduce(self, grad: Any, name: str, comm: Any) -> Any:
        """:meth:`allreduce`'s work (the timeline, when one records, wraps it in a span)."""
        if is_gpu_array(grad):
            if not (self.gpu_native and is_cupy(grad)):
                self.device_calls["staged"] += 1
                return to_device_like(self.allreduce(to_host(grad), name, comm), grad)
            self.device_calls["native"] += 1
        else:
            grad = np.asarray(grad)
        in_dtype = np.dtype(grad.dtype)
        x = grad.astype(self._work_dtype(in_dtype), copy=False)
        signature = self._signature(grad, in_dtype, name)
        self.last_step_skipped = False
        prev = self.state.get(name)
        dense_step = (prev.t if prev is not None else 0) + 1 <= self.warmup_steps
        if not dense_step and self._defers_finite_check(x, name, comm):
            # the method's first pass reports finiteness and calls _pass_finite_gate
            # before its first collective (the agreement still precedes every payload)
            self._gates()[_task_id()] = _FiniteGate(x, comm, signature)
        else:
            bad_ranks = self._agree_step(comm, signature, _finite(x))
            if bad_ranks:
                return self._nonfinite_step(x, grad, in_dtype, name, comm, bad_ranks)
        st = self.state.get(name)
        if st is None:
            st = self.state[name] = self.new_state()
        _move_state(st, get_array_module(x))
        st.t += 1
        if dense_step:
            out = self._dense_average(x, comm)
            self.feedback.on_dense_step(x, out, st)
        else:
            try:
                out = self.feedback.reduce(self, x, name, comm, st)
            except _NonFiniteAgreed as agreed:     # nothing exchanged, no state kept: undo the step
                self._undo_step(name, prev, st)
                return self._nonfinite_step(x, grad, in_dtype, name, comm, agreed.bad_ranks)
            except TensorMismatchError:
                # only the (deferred) agreement raises it, before any payload: the step did not
                # happen on any rank, so its counter (which keys shared randomness) goes back too
                self._undo_step(name, prev, st)
                raise
            finally:
                gate = self._gates().pop(_task_id(), None)
            if gate is not None:
                raise RuntimeError(f"{self.name}: _defers_finite_check promised a call of "
                                   f"_pass_finite_gate that did not come (tensor {name!r})")
        if out.shape != grad.shape:
            out = out.reshape(grad.shape)
        return out.astype(in_dtype, copy=False) if out.dtype != in_dtype else out

    def reduce_scatter(self, grad: Any, name: str, comm: Any) -> Any:
        """This rank's block of the method's average: :meth:`allreduce` cut into P equal blocks.

        ``grad`` (its size a multiple of ``comm.size``) is read as a flat
        vector; rank j returns block j of what :meth:`allreduce` would return
        for it (flat, in ``grad``'s dtype), with the same state updates,
        checks, warm-up and NaN/Inf policy. Methods with :attr:`scatters` run
        a real reduce-scatter in :meth:`_reduce` (:meth:`_scatter_block` tells
        them which block; they return an average that is right on that block
        only, moving only its share of the bytes); the others reduce the
        whole vector and keep the slice. Every method's dense warm-up steps
        run the communicator's reduce-scatter (:meth:`_dense_average`). One method's block is a variant of
        its own rather than the block of its allreduce: Ok-Topk's
        split-and-reduce over the P blocks without the global re-selection
        (:mod:`horovod_compress.mpi_collectives.oktopk_reduce_scatter`). Sharded data parallelism needs it:
        PyTorch FSDP hands each module's gradients to a reduce-scatter
        ("PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
        Zhao et al., VLDB 2023, Section 3.2).
        """
        p = comm.size
        size = int(np.prod(grad.shape))
        if size % p:
            raise ValueError(f"{self.name}: reduce_scatter of tensor {name!r} needs a size that "
                             f"is a multiple of the {p} ranks, got {size}")
        block = size // p
        if p == 1:
            return self.allreduce(grad, name, comm).reshape(-1)
        self.__dict__["_scattering"] = True
        try:
            out = self.allreduce(grad, name, comm)
        finally:
            self.__dict__["_scattering"] = False
        return out.reshape(-1)[comm.rank * block:(comm.rank + 1) * block]

    def _scatter_block(self, x: Any, comm: Any) -> tuple[int, int] | None:
        """Inside :meth:`reduce_scatter` of a method with :attr:`scatters`: ``(lo, hi)``, the
        flat range of ``x`` this rank's result must hold (``None`` in a plain allreduce)."""
        return self._wanted_block(x, comm) if self.scatters else None

    def _wanted_block(self, x: Any, comm: Any) -> tuple[int, int] | None:
        """Inside :meth:`reduce_scatter` of any method: ``(lo, hi)`` as :meth:`_scatter_block`
        (the dense warm-up steps of every method use it, :meth:`_dense_average`)."""
        if not self.__dict__.get("_scattering") or comm.size == 1:
            return None
        block = x.size // comm.size
        return comm.rank * block, (comm.rank + 1) * block

    def _dense_average(self, x: Any, comm: Any) -> Any:
        """A dense (warm-up) step's exact average over ranks.

        Inside :meth:`reduce_scatter`, when the feedback keeps nothing of the
        average (its ``on_dense_step`` is the base no-op: not EF21/EF21M,
        whose tracker ``G`` is the whole average), only this rank's block is
        right (the others zero): the communicator's dense reduce-scatter,
        ``N(P-1)/P`` bytes for N instead of the allreduce's ``2N(P-1)/P``.
        """
        block = self._wanted_block(x, comm)
        if block is None or type(self.feedback).on_dense_step is not Feedback.on_dense_step:
            return comm.allreduce(x, op="avg")
        out = get_array_module(x).zeros(x.shape, dtype=x.dtype)
        out.reshape(-1)[block[0]:block[1]] = comm.reduce_scatter(x.reshape(-1), op="avg")
        return out

    def keep_rows(self, rows: "dict[str, tuple[int, int]] | None") -> None:
        """Tell a matrix method which rows of each tensor's result the caller reads.

        ``rows[name] = (lo, hi)``: only rows ``[lo, hi)`` of the first
        dimension of tensor ``name``'s average are used (sharded training:
        FSDP2 keeps this rank's chunk of rows). A method that can (GreedyLore)
        then builds only those rows and leaves the others zero; every other
        output, its state and error feedback are unchanged. ``None``: every row
        (the default)."""
        self._kept_rows = dict(rows) if rows else {}

    def kept_rows(self, name: str) -> tuple[int, int] | None:
        """The rows ``[lo, hi)`` of tensor ``name`` the caller reads (:meth:`keep_rows`), or ``None``."""
        return getattr(self, "_kept_rows", {}).get(name)

    def _undo_step(self, name: str, prev: "TensorState | None", st: "TensorState") -> None:
        """Forget the step counted for ``name`` (its first call: the whole state) when the
        call's deferred agreement stopped it before any payload."""
        if prev is None:
            self.state.pop(name, None)
        else:
            st.t -= 1

    def _agree_step(self, comm: Any, signature: tuple, finite: bool) -> list[int]:
        """The per-call agreement: one 1-byte allgather of (not finite, new signature) flags,
        the signature check when any rank's is new; returns the ranks whose gradient is not finite."""
        flags = agree(comm, (NONFINITE if not finite else 0)
                      | (NEW_SIGNATURE if signature not in self._signatures else 0))
        if (flags & NEW_SIGNATURE).any():
            check_same_signature(comm, signature)
            if len(self._signatures) >= _MAX_SIGNATURES:
                self._signatures.clear()
            self._signatures.add(signature)
        return [int(r) for r in np.flatnonzero(flags & NONFINITE)]

    def _defers_finite_check(self, x: Any, name: str, comm: Any) -> bool:
        """Whether this call's finiteness test and agreement wait for the method's first pass.

        ``True`` promises that every path of this call's ``feedback.reduce`` ->
        ``_reduce`` calls :meth:`_pass_finite_gate` exactly once, after its
        local work and before its first collective, so the agreement (and the
        NaN/Inf policy, and the signature check) still precede every payload,
        and a method whose pass reads ``x`` anyway can report finiteness from it
        instead of :func:`_finite` reading the gradient once more. The method
        must not change the tensor's state before the gate (a rejected step --
        NaN/Inf, or a :class:`TensorMismatchError` -- only has its step counter
        undone), so e.g. a method whose trackers would be re-created for a new
        shape defers only when they fit. Default: no.
        """
        return False

    def _pass_finite_gate(self, finite: bool | None = None) -> None:
        """The deferred agreement of :meth:`allreduce` (see :meth:`_defers_finite_check`).

        ``finite``: whether this rank's gradient is finite, as the method's
        pass found; ``None`` tests the gradient here (:func:`_finite`). A no-op
        when the call did not defer. Raises a private exception, caught by
        :meth:`allreduce`, when any rank is not finite: the step then goes to
        the NaN/Inf policy with the tensor's state as it was.
        """
        gate = self._gates().pop(_task_id(), None)
        if gate is None:
            return
        if finite is None:
            finite = _finite(gate.x)
        bad_ranks = self._agree_step(gate.comm, gate.signature, bool(finite))
        if bad_ranks:
            raise _NonFiniteAgreed(bad_ranks)

    def _finite_gate_pending(self) -> bool:
        """Whether this task's current call deferred its agreement and has not passed the gate."""
        return _task_id() in self._gates()

    def _gates(self) -> dict[int, "_FiniteGate"]:
        """The pending deferred agreements by task (the lockstep runner calls one method from
        several greenlets, one at a time; an instance restored without ``__init__`` has none)."""
        gates = self.__dict__.get("_finite_gates")
        if gates is None:
            gates = self.__dict__["_finite_gates"] = {}
        return gates

    def _signature(self, grad: Any, in_dtype: np.dtype, name: str) -> tuple:
        """This call's (name, shape, dtype, method config): what ranks must agree on.

        Every call begins with one 1-byte allgather (``mpi_collectives.consistency.agree``)
        in which each rank says whether its gradient is finite and whether this
        signature is new to it; if any rank has a new one, every rank joins one
        16-byte digest allgather of its signature, and a mismatch raises the
        same :class:`TensorMismatchError` on every rank, naming the tensor and
        what differs. Names are part of it: shared randomness is keyed by name.
        """
        return (name, tuple(int(s) for s in grad.shape), in_dtype.str,
                tuple(sorted((k, repr(v)) for k, v in self.config().items())))

    def _nonfinite_step(self, x: Any, grad: Any, in_dtype: np.dtype, name: str, comm: Any,
                        bad_ranks: list[int]) -> Any:
        """A step where some rank's gradient holds NaN/Inf: apply ``self.nonfinite`` everywhere.

        The tensor's state (step counter, residuals, trackers) is left as it
        was under every policy, so feedback never keeps a non-finite value.
        """
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"{self.name}: the gradient of tensor {name!r} holds NaN/Inf on rank"
                f"{'s' if len(bad_ranks) > 1 else ''} {', '.join(map(str, bad_ranks))} "
                f"(policy nonfinite='raise'; use nonfinite='skip' to drop such steps or "
                f"'propagate' to hand them to a loss scaler)")
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            self.last_step_skipped = True
            xp = get_array_module(x)
            return xp.zeros(grad.shape, dtype=in_dtype)
        out = comm.allreduce(x, op="avg")   # propagate: the non-finite average, equal everywhere
        if out.shape != grad.shape:
            out = out.reshape(grad.shape)
        return out.astype(in_dtype, copy=False) if out.dtype != in_dtype else out

    def set_nonfinite(self, policy: str | None) -> None:
        """Set the NaN/Inf policy: ``"raise"`` (default), ``"skip"`` or ``"propagate"``.

        ``None`` takes ``HVDC_NONFINITE`` from the environment (default
        ``"raise"``). The policy is part of the cross-rank signature check,
        so ranks with different policies get a mismatch error (docs/failures.md).
        """
        if policy is None:
            policy = os.environ.get(NONFINITE_ENV, "raise")
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"{self.name}: nonfinite must be one of {list(NONFINITE_POLICIES)}, "
                             f"got {policy!r}")
        self.nonfinite = policy

    def expected_bytes(self, shape: tuple[int, ...], world_size: int,
                       itemsize: int = 4) -> float | None:
        """Bytes this method should send per rank per step for a tensor of ``shape``.

        Returns ``None`` where the count depends on the data (e.g. fill-in);
        benchmarks compare the measured count with this formula.
        """
        return None

    def config(self) -> dict[str, Any]:
        """The constructor arguments that define this method (for logs and checkpoints)."""
        cfg = {"name": self.name, "seed": self.seed, "warmup_steps": self.warmup_steps,
               "feedback": self.feedback.name, **self.feedback.params(), **self.params()}
        if self.nonfinite != "raise":
            cfg["nonfinite"] = self.nonfinite
        return cfg

    def params(self) -> dict[str, Any]:
        """Method-specific hyperparameters; subclasses extend."""
        return {}

    def local_support(self, name: str, local: Any) -> Any:
        """Flat indices outside which ``local`` (from the last ``_reduce`` of ``name``) is zero.

        Sparsifiers build ``local`` in a reused buffer
        (:func:`~horovod_compress.compressors.sparse_common.sparse_local`) and
        know where it is nonzero, so error feedback can update its residual
        in O(k) rather than O(n). ``None`` (the default) means: treat
        ``local`` as dense.
        """
        scratch = self.scratch.local.get(name)
        return None if scratch is None else scratch.support_of(local)

    # ------------------------------------------- Horovod's Compressor protocol
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Horovod ``Compressor.compress`` (torch or TF tensor): see :mod:`horovod_compress.horovod_compat`."""
        return horovod_protocol("compress")(self, tensor)

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Horovod ``Compressor.decompress``: the method's result as Horovod's reduction would scale it."""
        return horovod_protocol("decompress")(self, tensor, ctx)

    # --------------------------------------------------------- subclass API
    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        """Compressed allreduce of ``x``: return ``(avg over ranks, local contribution)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _reduce")

    @staticmethod
    def _work_dtype(dtype: np.dtype) -> np.dtype:
        return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)

    def _scratch_buffers(self, name: str, count: int, n: int, dtype: Any) -> list[np.ndarray]:
        """``count`` buffers of ``n`` items of ``dtype`` for tensor ``name``, reused across calls.

        For work arrays consumed within one call (a ring's own message, result and
        partial sums): a fresh buffer would cost a page fault per 4 KiB each step.
        Not checkpointed.
        """
        bufs = self.scratch.call
        got = bufs.get(name)
        if got is None or len(got) != count or got[0].size != n or got[0].dtype != dtype:
            got = [np.empty(n, dtype=dtype) for _ in range(count)]
            bufs[name] = got
        return got

    def rng(self, name: str, step: int, purpose: str = "") -> np.random.Generator:
        """A generator every rank derives identically from (seed, name, step, purpose).

        This is how shared randomness is had without a message: the "synchronized
        random seed across all nodes" of the GreedyLore paper (*Greedy Low-Rank
        Gradient Compression for Distributed Learning with Convergence
        Guarantees*, Section V-C) and of ARC-Top-K (*An All-Reduce Compatible
        Top-K Compressor for Communication-Efficient Distributed Learning*,
        Algorithm 1).
        """
        digest = hashlib.blake2b(f"{self.seed}|{name}|{step}|{purpose}".encode(),
                                 digest_size=16).digest()
        return np.random.Generator(np.random.Philox(int.from_bytes(digest, "little")))

    def local_rng(self, name: str, step: int, rank: int, purpose: str = "") -> np.random.Generator:
        """A generator private to ``rank`` (stochastic rounding), still reproducible."""
        return self.rng(name, step, f"{purpose}|rank{rank}")

    # ---------------------------------------------------------- checkpoints
    def new_state(self) -> TensorState:
        """A fresh state for a tensor: the method's ``state_class`` with its feedback's memory."""
        return self.state_class(self.feedback.new_state())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: format version, config and per-tensor state (NumPy copies).

        ``state`` maps each tensor to ``{field key: value}``
        (:meth:`TensorState.to_dict <horovod_compress.compressors.state.TensorState.to_dict>`).
        """
        return {
            "format_version": STATE_FORMAT_VERSION,
            "config": self.config(),
            "state": {n: {k: (np.array(to_host(v), copy=True)
                              if isinstance(v, np.ndarray) or is_gpu_array(v) else v)
                          for k, v in st.to_dict().items()} for n, st in self.state.items()},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; refuses a checkpoint of another method.

        Reads format versions 1 (saved before the version was recorded: the same keys) up to
        :data:`~horovod_compress.compressors.state.STATE_FORMAT_VERSION`; a newer one raises
        ``ValueError`` naming both.
        """
        cfg = sd.get("config", {})
        if cfg.get("name") != self.name:
            raise ValueError(f"checkpoint holds compressor state of {cfg.get('name')!r}, "
                             f"not {self.name!r}")
        check_format_version(sd, self.name)
        self.state = self._restore_states(sd.get("state", {}))

    def _restore_states(self, saved: dict[str, dict[str, Any]]) -> dict[str, TensorState]:
        """Each tensor's state from a checkpoint's ``{tensor: {field key: value}}`` (copies)."""
        return {n: self.new_state().restore(
                    {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v)
                     for k, v in st.items()}, where=f"{self.name}: tensor {n!r}: ")
                for n, st in saved.items()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"Compression.{self.name}({args})"
