"""``powersgd`` -- rank-r PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019).

GreedyLore's main baseline (*Greedy Low-Rank Gradient Compression for
Distributed Learning with Convergence Guarantees*, Section V-E, Tables II-V). Per tensor,
viewed as a matrix ``M_i`` of shape ``(rows, cols) = (shape[0], prod(shape[1:]))``,
with ``r = min(rank, rows, cols)`` (PowerSGD's Algorithm 1, one power-iteration
step per training step):

1. ``Q`` (cols x r): the previous step's ``Q`` (warm start) or a standard
   normal draw; orthogonalized.
2. ``P = allreduce_sum(M_i Q)``  (rows x r words); ``P = orth(P)``.
3. ``Q = allreduce_avg(M_i^T P)``  (cols x r words).
4. every rank receives ``P Q^T``, i.e. ``P P^T avg(M_i)``.

Error feedback (default ``residual``): ``M_i = g_i + e_i`` and
``e_i = M_i - P Q^T`` with the *aggregated* approximation, as the PowerSGD
paper's reference code and ``torch.distributed``'s ``powerSGD_hook`` do
(``local`` returned to the feedback scheme is therefore the average estimate).
Bytes per rank per step of a compressed tensor: ``2 (rows + cols) r w (P-1)/P``
(two ring allreduces of r(rows+cols) words of w bytes); tensors the
min-compression-rate rule leaves dense cost ``2 N w (P-1)/P``
(:mod:`.lowrank_common`).

Matching PyTorch exactly (``q_init="torch"``). ``powerSGD_hook`` draws its
initial ``Q`` as follows, and this implementation can reproduce it:
``PowerSGDState.rng = np.random.RandomState(random_seed)``; whenever a bucket
needs fresh ``Q`` (its first compressed step with ``warm_start=True``, every
step with ``warm_start=False``) it calls ``torch.manual_seed(rng.randint(1_000_000_000))``
inside ``torch.random.fork_rng`` and fills each ``Q`` with
``torch.randn(1, cols, r)``; the draw happens even for buckets with nothing to
compress. A warm-started ``Q`` (the averaged ``Q`` of the last step) is
re-orthogonalized before use; ``start_powerSGD_iter`` dense steps come first
(``warmup_steps`` here); ``min_compression_rate`` (default 2) and
``orthogonalization_epsilon`` (default 0) mean the same as there. With
``q_init="torch"``, ``seed`` = ``random_seed`` and one tensor per DDP bucket,
the outputs equal the hook's within float rounding (tests/test_powersgd.py).
That mode uses torch only as a random number generator, which the PyTorch
front-end supplies: importing :mod:`horovod_compress.torch` registers it in
:data:`Q_SOURCES` (this module, like the whole core, never imports torch);
the default ``q_init="shared"`` draws ``Q`` from this package's shared seed
(``Method.rng``) with NumPy alone.

A DDP bucket at once (:meth:`PowerSGD.allreduce_many`, what the DDP comm
hook calls): the same computation for every tensor of the bucket, with the
collectives of each step fused across the bucket -- all ``M_i Q`` and the
tensors sent dense in one allreduce, all ``M_i^T P`` in the next -- as the
paper's Section 4 and ``powerSGD_hook`` pack them; no collective and no
thread per tensor. Both paths run the same kernels, so they agree bit for bit
on 2 ranks.

Cost on CPU. A step touches the ``m x n`` matrix in three passes
(:mod:`horovod_compress.kernels.powersgd`), the fewest the algorithm allows:
``M^T P`` needs ``P = orth(sum_i M_i Q)``, so a collective separates it from
``M Q``, and the estimate needs the averaged ``Q``, so another separates it
from ``M^T P``. (1) ``M = g + e`` (EF14, written once, into the feedback's
spare buffer) fused with ``M Q``; (2) ``M^T P``; (3) the estimate ``P Q^T``
(a new array: the caller keeps it) and the new error ``M - P Q^T`` in one
write of each. The NaN/Inf agreement takes finiteness from ``M Q``
(:meth:`PowerSGD._defers_finite_check`), so the gradient is not read once more
for it; ``Q`` and ``P`` are orthogonalized in place
(:func:`~horovod_compress.compressors.lowrank_common.orthogonalize`, LAPACK's QR in place). One call at P = 1, 2000 x 2000 float32,
rank 8, one thread, median of 90 calls in three runs alternating with the
previous code (memcpy of the gradient 1.1 ms): before, 8.6 ms -- finite check
0.6, EF14's ``np.add`` and ``np.subtract`` 3.1, ``M Q`` 1.6, ``M^T P`` 1.45
(BLAS on the transposed view), ``P Q^T`` 1.45 (BLAS into a new array),
``np.linalg.qr`` twice 0.25, the rest 0.1; after, 5.6 ms (5.1x the memcpy) --
pass 1 2.45, pass 2 1.05, pass 3 1.8, orthogonalizations 0.1, the rest 0.25.
The traffic floor is 3 memcpys (144 MB moved against 48); of the 2.3 ms
above it, 1.25 ms are the arithmetic of ``M Q`` and ``M^T P`` that memory
does not hide (docs/methods/greedylore.md, "PowerSGD: cost on CPU"). A DDP
bucket (:meth:`PowerSGD.allreduce_many`) still reads each gradient once for
its NaN/Inf check: its agreement round comes before any work.

Deviation: the hook's error for a tensor sent dense is ``x_i - avg`` (it
subtracts the averaged bucket); here a dense tensor leaves no error. Both give
the same averages (those errors sum to zero over ranks).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..kernels.arrays import is_gpu_array
from ..kernels.powersgd import add_and_project, fits, low_rank_product, project, project_t
from ..mpi_collectives.lockstep import Lockstep, fused_allreduce, fused_check_allgather
from ..mpi_collectives import world as _world
from ..mpi_collectives.consistency import (
    NEW_SIGNATURE,
    NONFINITE,
    TensorMismatchError,
    check_comm,
    describe_signatures,
    signature_digest,
)
from .base import _MAX_SIGNATURES, Method, TensorState, _finite, _move_state
from .state import SubspaceState
from .lowrank_common import (
    check_bool,
    check_min_rate,
    check_rank,
    compressed_matrix,
    dense_bytes,
    effective_rank,
    matrix_shape,
    orthogonalize,
    should_compress,
)
from ..params import check_choice, check_float
from .registry import register
from ..feedback import Feedback
from ..feedback.residual import ResidualFeedback


#: ``q_init`` sources beyond ``"shared"``: name -> ``draw(seed, cols, r, dtype)``
#: returning a (cols x r) standard-normal array. :mod:`horovod_compress.torch`
#: registers ``"torch"`` (``torch.manual_seed(seed); torch.randn(1, cols, r)``).
_BATCHED_FEEDBACK = ("none", "residual")


class _Job:
    """One tensor's PowerSGD step between its messages (``mat is None``: sent dense)."""

    __slots__ = ("x", "name", "state", "mat", "send", "p", "finite")

    def __init__(self, x: np.ndarray, name: str, state: TensorState) -> None:
        self.x, self.name, self.state = x, name, state
        self.mat: np.ndarray | None = None
        self.send: np.ndarray | None = None
        self.p: np.ndarray | None = None
        self.finite: bool | None = None


def _put(out: Any, avg: Any) -> Any:
    """``avg`` written into ``out`` (unless it already is ``out``); returns ``out``."""
    if avg is not out:
        out[...] = avg.reshape(out.shape)
    return out


Q_SOURCES: dict[str, Callable[[int, int, int, np.dtype], np.ndarray]] = {}


def register_q_source(name: str, draw: Callable[[int, int, int, np.dtype], np.ndarray]) -> None:
    """Make ``draw(seed, cols, r, dtype)`` the generator behind ``q_init=name``."""
    Q_SOURCES[name] = draw


#: Up to this rank the three m x n passes run in :mod:`horovod_compress.kernels.powersgd`
#: (``M = g + e`` with ``M Q``, ``M^T P``, ``P Q^T`` with the new error); above it
#: ``np.add``, BLAS's GEMMs and ``np.subtract``. Measured in step order (2000 x 2000
#: float32, one thread, fastest of 40): r = 12 5.8 ms for the kernels against 7.5 ms;
#: r = 16 7.2 against 7.7 ms, but ``M^T P`` alone already slower (1.6-1.9 against 1.5
#: ms); r = 24 9.4 against 8.9 ms. The rule depends on the rank alone, so the
#: per-tensor and bucket paths pick the same arithmetic.
KERNEL_MAX_RANK = 12

@register
class PowerSGD(Method):
    """Rank-r PowerSGD with warm start and error feedback."""

    name = "powersgd"
    state_class = SubspaceState
    layout = "matrix"
    biased = True
    default_feedback = "residual"

    def __init__(self, *, rank: int = 8, warm_start: bool = True,
                 min_compression_rate: float = 2.0, orthogonalization_epsilon: float = 0.0,
                 q_init: str = "shared", feedback: str | None = None, warmup_steps: int = 0,
                 seed: int = 0, **feedback_params: Any) -> None:
        self.rank = check_rank(self.name, rank)
        self.warm_start = check_bool(self.name, "warm_start", warm_start)
        self.min_compression_rate = check_min_rate(self.name, min_compression_rate)
        self.orthogonalization_epsilon = check_float(
            self.name, "orthogonalization_epsilon", orthogonalization_epsilon, 0.0)
        self.q_init = check_choice(self.name, "q_init", q_init, ["shared", "torch"])
        super().__init__(feedback=feedback, warmup_steps=warmup_steps, seed=seed,
                         **feedback_params)
        if self.q_init == "torch" and self.seed >= 2**32:
            raise ValueError(f"{self.name}: with q_init='torch' seed must be in [0, 2**32 - 1] "
                             f"(numpy RandomState), got {seed!r}")
        self._torch_rng = np.random.RandomState(self.seed % 2**32)

    def params(self) -> dict[str, Any]:
        return {"rank": self.rank, "warm_start": self.warm_start,
                "min_compression_rate": self.min_compression_rate,
                "orthogonalization_epsilon": self.orthogonalization_epsilon,
                "q_init": self.q_init, **self.feedback.params()}

    # ------------------------------------------------------------- the math
    def initial_q(self, name: str, step: int, cols: int, r: int, dtype: np.dtype) -> np.ndarray:
        """A fresh ``Q`` (cols x r), standard normal, the same on every rank (not orthogonal)."""
        if self.q_init == "torch":
            return self._torch_randn(cols, r, dtype)
        return self.rng(name, step, "powersgd-q").standard_normal((cols, r), dtype=dtype)

    def _torch_randn(self, cols: int, r: int, dtype: np.dtype) -> np.ndarray:
        draw = Q_SOURCES.get("torch")
        if draw is None:
            raise RuntimeError(f"{self.name}(q_init='torch') draws Q with PyTorch's generator; "
                               "import horovod_compress.torch first (the core does not import torch)")
        return draw(int(self._torch_rng.randint(1_000_000_000)), cols, r, dtype)

    def _start(self, x: np.ndarray, name: str, state: TensorState, e: np.ndarray | None = None,
               acc: np.ndarray | None = None) -> "_Job":
        """Algorithm 1 up to the first message: the matrix view, ``Q`` (orthogonalized), ``M Q``.

        Without ``e``, ``M`` is ``x``. With EF14's residual ``e`` (same shape
        and dtype as ``x``) and a buffer ``acc`` (which may be ``e`` itself),
        ``M = x + e`` is written into ``acc`` -- for a compressed matrix in the
        same pass as ``M Q`` (:func:`~horovod_compress.kernels.powersgd.add_and_project`)
        -- and the job's ``x`` is ``acc``. A tensor the min-compression-rate
        rule leaves dense gets a job with ``mat is None`` (it is averaged with
        one dense allreduce of ``job.x``).

        ``job.finite``: ``True`` when ``M Q`` came out finite, which a
        non-finite ``x`` cannot give (a NaN or infinity in a row of ``M``
        makes that row's products NaN or infinite, ``Q`` being finite), so the
        NaN/Inf check of the gradient need not read it again; ``None`` (test
        the gradient itself) otherwise, or where BLAS computed ``M Q``.
        """
        mat = compressed_matrix(x, self.rank, self.min_compression_rate)
        fresh = not self.warm_start or state.Q is None
        if mat is None:
            if e is not None:
                x = np.add(x, e, out=acc)
            job = _Job(x, name, state)
            if self.q_init == "torch" and fresh:
                self._torch_rng.randint(1_000_000_000)  # the hook draws for every bucket
                if self.warm_start:
                    state.Q = np.zeros((0, 0), dtype=x.dtype)
            return job
        rows, cols = mat.shape
        r = effective_rank(rows, cols, self.rank)
        q = None if fresh else state.Q
        if q is None or q.shape != (cols, r) or q.dtype != mat.dtype:
            q = self.initial_q(name, state.t, cols, r, mat.dtype)
        else:
            q = q.copy()
        orthogonalize(q, self.orthogonalization_epsilon)
        kernels = r <= KERNEL_MAX_RANK
        send = None
        if e is not None:
            if kernels and fits(mat, e, acc):
                send = add_and_project(mat, e.reshape(mat.shape), acc.reshape(mat.shape), q)
            else:
                np.add(x, e, out=acc)
            x, mat = acc, acc.reshape(mat.shape)
        job = _Job(x, name, state)
        if send is None:
            if kernels and fits(mat, q):
                send = project(mat, q)
            else:
                send = mat @ q
                kernels = False
        job.mat = mat
        job.send = send                     # P_i = M_i Q, summed over ranks next
        job.finite = True if kernels and bool(np.isfinite(send).all()) else None
        return job

    def _after_p(self, job: "_Job", p: np.ndarray) -> np.ndarray:
        """``P = orth(sum_i M_i Q)``; returns this rank's ``M_i^T P`` (averaged over ranks next)."""
        orthogonalize(p, self.orthogonalization_epsilon)
        job.p = p
        if p.shape[1] <= KERNEL_MAX_RANK and fits(job.mat, p):
            return project_t(job.mat, p)
        return job.mat.T @ p

    def _finish(self, job: "_Job", q: np.ndarray, out: np.ndarray | None = None,
                acc: np.ndarray | None = None) -> np.ndarray:
        """``Q = avg_i M_i^T P`` (kept for the warm start); the estimate ``P Q^T`` in ``x``'s shape.

        ``out`` (optional, C-contiguous, ``x``'s size and dtype) receives the
        estimate, else a new array does; ``acc`` (optional, the compressed
        ``M_i`` of error feedback) becomes the new error ``M_i - P Q^T`` in the
        same pass (:func:`~horovod_compress.kernels.powersgd.low_rank_product` up
        to rank :data:`KERNEL_MAX_RANK`, BLAS's GEMM and a subtraction above it;
        the rule depends on the rank alone, so both paths give the same bits).
        """
        if self.warm_start:
            job.state.Q = q
        shape = job.mat.shape
        if out is None:
            out = np.empty(shape, dtype=job.mat.dtype)
        target = out.reshape(shape)
        if (job.p.shape[1] <= KERNEL_MAX_RANK and fits(target, job.p, q)
                and (acc is None or fits(target, acc))):
            low_rank_product(job.p, q, target, None if acc is None else acc.reshape(shape))
        else:
            np.matmul(job.p, q.T, out=target)
            if acc is not None:
                np.subtract(acc, out.reshape(acc.shape), out=acc)
        return out.reshape(job.x.shape)

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        job = self._start(x, name, state)
        self._pass_finite_gate(job.finite)
        if job.mat is None:
            avg = comm.allreduce(x, op="avg")
            return avg, x
        avg = self._exchange(job, comm)
        return avg, avg

    def _exchange(self, job: "_Job", comm: Any, acc: np.ndarray | None = None) -> np.ndarray:
        """The two allreduces of a compressed tensor and the estimate (``acc``: as in :meth:`_finish`)."""
        with comm.phase("powersgd.P"):
            p = comm.allreduce(job.send, op="sum")
        q_local = self._after_p(job, p)
        with comm.phase("powersgd.Q"):
            q = comm.allreduce(q_local, op="avg")
        return self._finish(job, q, None, acc)

    def _defers_finite_check(self, x: Any, name: str, comm: Any) -> bool:
        """Whether the NaN/Inf check waits for ``M Q`` (:meth:`Method._defers_finite_check`).

        Yes for a NumPy float32/float64 matrix this call compresses, under no
        feedback or EF14, with ``q_init="shared"``: every path then goes through
        :meth:`_reduce` or :meth:`_reduce_residual`, which pass the gate after
        ``M Q`` and before the first message, with ``job.finite`` (so a finite
        gradient is not read once more for the check). Not with
        ``q_init="torch"``: a fresh ``Q`` advances the hook's shared random
        stream, which a step dropped for NaN/Inf must not do.
        """
        return (self.q_init == "shared" and type(x) is np.ndarray
                and x.dtype in (np.float32, np.float64)
                and type(self.feedback) in (Feedback, ResidualFeedback)
                and compressed_matrix(x, self.rank, self.min_compression_rate) is not None)

    def _reduce_residual(self, x: np.ndarray, e: np.ndarray, acc: np.ndarray, name: str,
                         comm: Any, state: TensorState) -> tuple[np.ndarray, None] | None:
        """EF14 (:class:`~horovod_compress.feedback.residual.ResidualFeedback`) in the step's passes.

        ``acc = x + e`` is written during ``M Q``'s pass over the rows, and the
        new error ``acc - P Q^T`` during the estimate's, so ``(avg, None)`` is
        returned (``acc`` holds the new residual). ``None`` (nothing written)
        for a tensor sent dense or arrays the kernels do not take; the
        feedback then adds ``x + e`` itself and calls :meth:`_reduce`.
        """
        if not (type(x) is np.ndarray and fits(x, e, acc) and x.shape == e.shape == acc.shape
                and compressed_matrix(x, self.rank, self.min_compression_rate) is not None):
            return None
        job = self._start(x, name, state, e=e, acc=acc)
        self._pass_finite_gate(job.finite)
        return self._exchange(job, comm, acc), None

    # ------------------------------------------------- a DDP bucket at once
    def can_reduce_many(self, arrays: Sequence[Any], comm: Any) -> bool:
        """Whether :meth:`allreduce_many` fuses ``arrays`` on ``comm`` (else it runs them one by one).

        Needs a communicator that accounts fused calls per original call
        (``Lockstep.supports``: either backend), more than one
        rank, host (NumPy) arrays and feedback ``none`` or ``residual``.
        """
        return (getattr(comm, "size", 1) > 1 and Lockstep.supports(comm)
                and self.feedback.name in _BATCHED_FEEDBACK
                and not any(is_gpu_array(a) for a in arrays))

    def allreduce_many(self, grads: Sequence[np.ndarray], names: Sequence[str], comm: Any,
                       out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """:meth:`Method.allreduce` of every ``(grads[k], names[k])``, with one fused collective per round.

        The same per-tensor computation as calling ``allreduce`` on each
        tensor in order -- Algorithm 1 of Vogels et al., "PowerSGD: Practical
        Low-Rank Gradient Compression for Distributed Optimization" (NeurIPS
        2019), with its error feedback, warm start and PyTorch's
        min-compression-rate rule; the same random draws in the same order,
        the same state and byte counts (per tensor and phase) -- but, as in
        that paper's Section 4 ("we pack all the P matrices of the layers into
        one buffer") and PyTorch's ``powerSGD_hook``, without a collective per
        tensor. Three rounds on one thread:

        1. one allgather of n bytes on the check group: for every tensor, each
           rank's "not finite" / "new signature" flag (``mpi_collectives.consistency``;
           then one allgather of the new signatures' 16-byte digests);
        2. one allreduce (sum) of every ``P_k = M_k Q_k`` concatenated with every
           tensor sent dense (warm-up steps, vectors, matrices the rule leaves
           dense; their averages are that sum divided by P);
        3. one allreduce of every ``M_k^T orth(P_k)``; then ``avg_k = P_k Q_k^T``.

        On 2 ranks the results equal the one-by-one calls bit for bit (every
        element is one addition either way); on more, a fused float sum may
        differ in the last bits. ``out``: arrays of the grads' shapes that
        receive the averages (the DDP bucket's gradient views; a compressed
        matrix's ``P Q^T`` is computed straight into it); then ``out[k]`` is
        returned. ``out[k]`` may be ``grads[k]`` itself. Falls back to one
        ``allreduce`` per tensor where :meth:`can_reduce_many` is false.
        """
        grads = [np.asarray(g) if not is_gpu_array(g) else g for g in grads]
        names = list(names)
        if len(grads) != len(names) or (out is not None and len(out) != len(grads)):
            raise ValueError(f"{self.name}: allreduce_many needs one name (and out array) per "
                             f"gradient, got {len(grads)} gradients, {len(names)} names"
                             + ("" if out is None else f", {len(out)} out arrays"))
        if not self.can_reduce_many(grads, comm):
            results = [self.allreduce(g, nm, comm) for g, nm in zip(grads, names)]
            return results if out is None else [_put(o, r) for o, r in zip(out, results)]
        if not getattr(_world, "_AUTO_DONE", True):
            _world.ensure_abort_on_exception(comm)
        n = len(grads)
        xs, sigs, flags = [], [], np.zeros(n, dtype=np.uint8)
        for k, (g, nm) in enumerate(zip(grads, names)):
            in_dtype = np.dtype(g.dtype)
            x = g.astype(self._work_dtype(in_dtype), copy=False)
            sig = self._signature(g, in_dtype, nm)
            flags[k] = ((NONFINITE if not _finite(x) else 0)
                        | (NEW_SIGNATURE if sig not in self._signatures else 0))
            xs.append(x)
            sigs.append(sig)
        # round 1: every tensor's agreement byte in one allgather (P x n)
        all_flags = fused_check_allgather(comm, [flags])[0]
        new = [k for k in range(n) if (all_flags[:, k] & NEW_SIGNATURE).any()]
        if new:
            digests = fused_check_allgather(comm, [signature_digest(sigs[k]) for k in new])
            for k, d in zip(new, digests):
                if not (d == d[0]).all():
                    raise TensorMismatchError(describe_signatures(
                        check_comm(comm).allgather(sigs[k])))
            for k in new:
                if len(self._signatures) >= _MAX_SIGNATURES:
                    self._signatures.clear()
                self._signatures.add(sigs[k])
        results: list[Any] = [None] * n
        jobs: list[tuple[int, str, Any, Any]] = []   # (k, kind, job or x, acc)
        first_error: BaseException | None = None
        skipped = False
        dense_phase = getattr(comm, "_phase", None)
        send_b: list[tuple[np.ndarray, str, str | None]] = []
        residual = self.feedback.name == "residual"
        for k in range(n):
            x, nm = xs[k], names[k]
            bad = all_flags[:, k] & NONFINITE
            skipped = False
            if bad.any():               # Method's NaN/Inf policy, on every rank alike
                self.last_step_skipped = False
                try:
                    results[k] = self._nonfinite_step(x, grads[k], np.dtype(grads[k].dtype), nm,
                                                      comm, [int(r) for r in np.flatnonzero(bad)])
                    skipped = self.last_step_skipped
                except Exception as exc:  # noqa: BLE001 - raised after the others, as in lockstep
                    if first_error is None:
                        first_error = exc
                continue
            st = self.state.get(nm)
            if st is None:
                st = self.state[nm] = self.new_state()
            _move_state(st, np)
            st.t += 1
            if st.t <= self.warmup_steps:
                jobs.append((k, "warm", x, None))
                send_b.append((x, "avg", dense_phase))
                continue
            e = self.feedback.memory(st).residual if residual else None
            if isinstance(e, np.ndarray) and e.shape == x.shape and e.dtype == x.dtype \
                    and e.flags.c_contiguous and e.flags.writeable:
                # EF: compress acc = x + e, written into e's buffer during M Q's pass
                job = self._start(x, nm, st, e=e, acc=e)
                acc = job.x
            else:
                if residual:
                    acc = x + e if e is not None and e.shape == x.shape else x.copy()
                else:
                    acc = x
                job = self._start(acc, nm, st)
            if job.mat is None:
                jobs.append((k, "dense", job, acc))
                send_b.append((acc, "avg", dense_phase))
            else:
                jobs.append((k, "lowrank", job, acc))
                send_b.append((job.send, "sum", "powersgd.P"))
        self.last_step_skipped = skipped
        # round 2: every P (sum) and every dense tensor (avg) in one allreduce
        got_b = fused_allreduce(comm, send_b)
        send_c, lowrank, inplace = [], [], set()
        for (k, kind, job, acc), got in zip(jobs, got_b):
            if kind == "warm":
                self.feedback.on_dense_step(job, got, self.state[names[k]])
                results[k] = got
            elif kind == "dense":
                if residual:            # local = acc: nothing left over
                    np.subtract(acc, acc, out=acc)
                    job.state.feedback.residual = acc
                results[k] = got
            else:
                send_c.append((self._after_p(job, got), "avg", "powersgd.Q"))
                lowrank.append((k, job, acc))
        # round 3: every M^T P in one allreduce (avg); the estimates P Q^T
        for (k, job, acc), q in zip(lowrank, fused_allreduce(comm, send_c)):
            target = out[k] if out is not None else None
            if target is not None and not (isinstance(target, np.ndarray) and target.dtype == q.dtype
                                           and target.flags.c_contiguous
                                           and target.size == job.x.size):
                target = None
            # the estimate P Q^T into the bucket and, with feedback, e = acc - P Q^T in one pass
            avg = self._finish(job, q, target, acc if residual else None)
            if target is not None:
                inplace.add(k)
            if residual:
                job.state.feedback.residual = acc
            results[k] = avg
        if first_error is not None:
            raise first_error
        final = []
        for k, (g, avg) in enumerate(zip(grads, results)):
            if k in inplace:
                final.append(out[k])
                continue
            if avg.shape != g.shape:
                avg = avg.reshape(g.shape)
            if avg.dtype != g.dtype:
                avg = avg.astype(g.dtype, copy=False)
            final.append(avg if out is None else _put(out[k], avg))
        return final

    # ------------------------------------------------------------- volume
    def expected_bytes(self, shape: tuple[int, ...], world_size: int,
                       itemsize: int = 4) -> float:
        ms = matrix_shape(tuple(shape))
        numel = int(np.prod(shape)) if len(shape) else 1
        if ms is None or numel == 0 or not should_compress(*ms, self.rank,
                                                           self.min_compression_rate):
            return dense_bytes(numel, world_size, itemsize)
        r = effective_rank(*ms, self.rank)
        return dense_bytes((ms[0] + ms[1]) * r, world_size, itemsize)

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        kind, keys, pos, has_gauss, cached = self._torch_rng.get_state()
        sd["torch_rng"] = {"keys": np.array(keys, copy=True), "pos": int(pos),
                           "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        rng = sd.get("torch_rng")
        if rng is not None:
            self._torch_rng.set_state(("MT19937", np.asarray(rng["keys"], dtype=np.uint32),
                                       int(rng["pos"]), int(rng["has_gauss"]),
                                       float(rng["cached_gaussian"])))
