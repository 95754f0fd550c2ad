"""``arc_topk`` -- ARC-Top-K: all-reduce compatible top-K rows (Chen et al., Algorithm 1).

Each tensor is viewed as a matrix G_i in R^{m x n} (2-D weights as they are,
conv kernels (out, in, kh, kw) as (out, in*kh*kw); paper eq. (3), Sec. VI).
With K = ceil(mu * m) rows (mu = ``ratio``) and sketch rank r = ``rank``:

1. V in R^{n x r}, vec(V) ~ N(0, I_nr), drawn from the shared seed
   (base seed, tensor name, step) -- every rank gets the same V, no message;
2. P = (1/N) sum_i G_i V / sqrt(r)          one allreduce of m*r words;
3. Sigma = diag(P P^T); I = argtop_K(Sigma)  (eq. 4; E[Sigma_p] = ||avg row p||^2, eq. 6);
4. [G]_{I,:} = (1/N) sum_i [G_i]_{I,:}       one allreduce of K*n words (eq. 5),
   no index is sent because I is the same on every rank;
5. the result is zero outside the rows I.

``_reduce`` returns ``(C(g), C_local(g_i))``: the averaged rows and this
rank's own rows [G_i]_{I,:}, the two outputs of Algorithm 1.

Proposition 2: E ||C(g) - g||^2 <= (1 - K/m) ||g||^2 for the *averaged*
gradient g (contractive), unlike the average of local Top-K (Proposition 1).
Hence the default feedback is ``ef21m`` (eqs. 11a-c) with its momentum
``eta`` (see :mod:`horovod_compress.feedback.ef21`).

Volume per rank and step (ring allreduce, both allreduces):
    2 (m r + K n) (P-1)/P words  ~  the paper's 2Kn + 2mr (Table I).

Defined behaviour at the edges (the paper compresses "only two-dimensional
tensors" and leaves the rest open; we decide as follows):

* 0-D / 1-D tensors (biases, norms) are sent dense (one allreduce of N words);
* ``dense_fallback=True`` (default): a tensor is sent dense whenever ARC would
  move at least as many words as a dense allreduce, m*r + K*n >= m*n. This
  covers K = m (e.g. a 1 x n tensor, or ratio = 1) and a sketch rank r >= n
  (the sketch alone is as large as the tensor). With ``dense_fallback=False``
  the protocol above runs on every 2-D view regardless of cost (the paper's toy
  examples, experiments);
* m < 1/ratio gives K = ceil(ratio*m) = 1: one row is kept;
* ties in Sigma are broken by the lower row index
  (:func:`~horovod_compress.kernels.rows.top_rows`), so the selection is a
  function of the allreduced sketch alone and identical on every rank.

The paper starts compressing after 1000 dense iterations; pass
``warmup_steps=1000`` for that (default 0, as for every method here).

Cost on CPU (2000 x 2000 float32, P = 1, one thread, default
parameters: K = 400 rows, r = 4, EF21M). Under EF21 / EF21M a NumPy
gradient takes :meth:`ArcTopK._reduce_ef21`, three compiled passes
(:mod:`horovod_compress.kernels.arc_fused`): (11a), the local sketch and the
NaN/Inf test in one read of x, h, g (``h'`` streamed to a second buffer, so
the call's NaN/Inf agreement waits for this pass and the gradient is not
read again for it); the K rows of ``d`` with (11b) on them; (11c) on the K
rows with the optimizer's copy of G, streamed. Measured per step, median of
25 (hot memcpy of the gradient 1.1 ms), before -> after, ms::

    NaN/Inf test of x (BLAS dot)             1.1  -> in the sketch pass
    draw V (8000 normals, Philox)            0.25 -> 0.2
    (11a) + d = h' - g (d stored)            4.5  -> }
    sketch d V (BLAS, C-ordered V)           2.1  -> } 3.6-4.4 fused
    gather d[I] / take_rows + (11b) rows I   0.3  -> 1.0
    allreduces (P = 1: MPI's copies)         0.5  -> 0.3
    scatter into np.zeros + local rows       3.1  -> --
    (11b), (11c), G's copy (every entry)     4.8  -> 1.9-2.6 (rows I + copy)
    whole step                               15.6-17.7 -> 7.2-8.9

V is drawn as before (the same Philox stream and bits on every rank): at
0.2 ms, 2-3% of the step, a cheaper generator would not pay for a change of
the shared draw.

The floor, and why the step cannot reach 3 memcpys: EF21M alone must read
x, read and write h (eq. 11a changes every entry), read g (``d = h' - g``
enters the sketch in every row, and V is fresh each step, so no part of
``g V`` carries over) and read G and write the optimizer's fresh copy of it:
six streams of the gradient's size, three memcpys, before ARC-Top-K does
anything; the K = 0.2 m selected rows add about 0.6 memcpy (their ``h'``,
``g`` read, message and ``g`` written, the sum read, ``G`` written). So
~3.6 memcpys = 4 ms is the floor with EF21M, ~1.8x below the measured step.
The rest of the gap is DRAM: the step's arrays (x, h, h', g, G, the result:
96 MB) do not stay in cache, and the hot memcpy that is the yardstick does
(a 16 MB copy with that working set takes 2.2 ms with NumPy, 1.25 ms with
streaming stores); each pass here runs at 16-25 GB/s, one core's memory
bandwidth. Without feedback (``feedback="none"``, :meth:`ArcTopK._reduce`)
the sketch and the NaN/Inf test share one read of x as well; the step
(3.3 ms, 5.8 before) is then mostly the zeroed m x n result the rows are
scattered into.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels import dispatch
from ..kernels.arc_fused import apply_rows_copy, padded_sketch, sketch_pass, take_rows
from ..kernels.arrays import as_module_array, get_array_module, to_host
from ..kernels.feedback import fusable
from ..kernels.rows import matrix_shape, top_rows
from ..kernels.scatter import row_local
from .base import Method, TensorState
from .state import RowState
from ..params import check_int
from .registry import register
from .row_common import check_ratio, rows_from_ratio
from ..mpi_collectives.accounting import allreduce_volume
from ..feedback import Feedback
from ..feedback.ef21 import EF21M
from ..mpi_collectives.shared_window import use_shared_window, window_allreduce_sum, window_message


@dataclass(frozen=True)
class ArcPlan:
    """What ARC-Top-K does with one tensor shape: dense, or sketch + K rows of an m x n view."""

    size: int          # total number of elements
    m: int = 0         # rows of the 2-D view (0 if dense)
    n: int = 0         # columns of the 2-D view
    k: int = 0         # rows kept
    r: int = 0         # sketch rank

    @property
    def dense(self) -> bool:
        return self.k == 0

    @property
    def words(self) -> int:
        """Words this rank contributes to allreduces per step (sketch + rows, or the tensor)."""
        return self.size if self.dense else self.m * self.r + self.k * self.n


@register
class ArcTopK(Method):
    """ARC-Top-K: shared Gaussian sketch + allreduce of the top-K rows (no indices sent)."""

    name = "arc_topk"
    state_class = RowState
    layout = "matrix"
    biased = True
    default_feedback = "ef21m"
    gpu_native = True

    def __init__(self, *, ratio: float = 0.2, rank: int = 4, dense_fallback: bool = True,
                 feedback: str | None = None, warmup_steps: int = 0, seed: int = 0,
                 **feedback_params: Any) -> None:
        self.ratio = check_ratio(self.name, ratio)
        self.rank = check_int(self.name, "rank", rank, 1, 2**20)
        if not isinstance(dense_fallback, (bool, np.bool_)):
            raise ValueError(f"{self.name}: dense_fallback must be True or False, "
                             f"got {dense_fallback!r}")
        self.dense_fallback = bool(dense_fallback)
        super().__init__(feedback=feedback, warmup_steps=warmup_steps, seed=seed,
                         **feedback_params)

    def params(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "rank": self.rank, "dense_fallback": self.dense_fallback,
                **self.feedback.params()}

    # ------------------------------------------------------------- the math
    def plan(self, shape: tuple[int, ...]) -> ArcPlan:
        """The 2-D view, K and r used for a tensor of ``shape`` (see the module docstring)."""
        size = int(np.prod(shape, dtype=np.int64))
        view = matrix_shape(tuple(shape))
        if view is None or size == 0:
            return ArcPlan(size)
        m, n = view
        k = rows_from_ratio(self.ratio, m)
        r = self.rank
        if self.dense_fallback and m * r + k * n >= m * n:
            return ArcPlan(size)
        return ArcPlan(size, m, n, k, r)

    def sketch_matrix(self, name: str, step: int, n: int, r: int,
                      dtype: np.dtype = np.dtype(np.float32)) -> np.ndarray:
        """V / sqrt(r): the n x r shared Gaussian of tensor ``name`` at ``step``, pre-scaled.

        Drawn from ``rng(seed, name, step, "arc_sketch")``: identical on every
        rank without a message (Algorithm 1, lines 1 and 3).
        """
        v = self.rng(name, step, "arc_sketch").standard_normal((n, r), dtype=np.float64)
        v *= 1.0 / math.sqrt(r)
        return v.astype(dtype, copy=False)

    @staticmethod
    def select_rows(sketch_avg: np.ndarray, k: int) -> np.ndarray:
        """I = argtop_K(diag(P P^T)) (eq. 4), ascending, ties to the lower index (a host array).

        The m row norms are computed where the sketch lives; the choice of K
        of them is made on the host (m values, not m x n).
        """
        return top_rows(to_host(dispatch.call("row_sq_norms", sketch_avg)), k)

    def _host_fused(self, x: Any) -> bool:
        """Whether ``x`` takes the compiled CPU path (:mod:`~horovod_compress.kernels.arc_fused`):
        a C-contiguous NumPy float32/float64 array that is not sent dense."""
        return (type(x) is np.ndarray and x.dtype in (np.float32, np.float64)
                and x.flags.c_contiguous and not self.plan(x.shape).dense)

    def _defers_finite_check(self, x: Any, name: str, comm: Any) -> bool:
        """Host arrays under no feedback, EF21 or EF21M: the sketch pass reads ``x`` anyway and
        reports whether it is finite, so :meth:`Method.allreduce` does not read it once more.

        Every path then passes the gate before its first collective: :meth:`_reduce`
        and :meth:`_reduce_ef21` after their sketch pass, or at once where they do
        not fuse. EF21M's pass writes ``h'`` to a second buffer, swapped in only
        after the gate, so a step the ranks reject keeps every tracker as it was.
        """
        if not self._host_fused(x):
            return False
        if type(self.feedback) is Feedback:
            return True
        # EF21M: only once its trackers exist and fit x, since a tracker that does not fit is
        # re-created (zeroed) before the sketch pass -- a change of state the gate could not undo
        # if the ranks then disagree (a new shape on one rank: TensorMismatchError)
        st = self.state.get(name)
        return isinstance(self.feedback, EF21M) and st is not None and self.feedback.trackers_fit(st, x)

    def _local_sketch(self, g: Any, name: str, step: int, plan: ArcPlan) -> tuple[Any, bool | None]:
        """This rank's m x r sketch ``G_i V / sqrt(r)`` of the m x n view ``g``, and whether ``g``
        is finite (``None``: not tested).

        NumPy float32/float64: one compiled pass over ``g``
        (:func:`~horovod_compress.kernels.arc_fused.sketch_pass`); CuPy: a GEMM.
        """
        v = self.sketch_matrix(name, step, plan.n, plan.r, g.dtype)
        if type(g) is np.ndarray and g.dtype in (np.float32, np.float64):
            sk = np.empty((plan.m, plan.r), g.dtype)
            return sk, sketch_pass(g, None, None, None, padded_sketch(v), sk)
        return g @ as_module_array(v, get_array_module(g)), None

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray | None]:
        plan = self.plan(x.shape)
        if plan.dense:
            self._pass_finite_gate()
            state.rows = None
            with comm.phase("arc_dense"):
                return comm.allreduce(x, op="avg"), x
        xp = get_array_module(x)
        g = xp.ascontiguousarray(x).reshape(plan.m, plan.n)
        local_sketch, finite = self._local_sketch(g, name, state.t, plan)
        self._pass_finite_gate(finite)                        # a no-op unless the call deferred it
        with comm.phase("arc_sketch"):
            sketch = comm.allreduce(local_sketch, op="avg")   # m x r words
        rows = self.select_rows(sketch, plan.k)
        rows_x = as_module_array(rows, xp)                    # on the gradient's device
        own = dispatch.call("gather_rows", g, rows_x)
        with comm.phase("arc_rows"):
            avg_rows = comm.allreduce(own, op="avg")          # K x n words, no indices
        state.rows = rows.astype(np.int32)                 # diagnostics (same on every rank)
        avg = dispatch.call("scatter_rows", avg_rows, rows_x, plan.m).reshape(x.shape)
        if not self.feedback.uses_local:                      # e.g. feedback="none": not read
            return avg, None
        local = (row_local(self, name, own, rows, plan.m) if xp is np else
                 dispatch.call("scatter_rows", own, rows_x, plan.m)).reshape(x.shape)
        return avg, local

    def _reduce_ef21(self, x: np.ndarray, h: np.ndarray | None, g: np.ndarray,
                     big_g: np.ndarray, eta: float | None, name: str, comm: Any,
                     state: TensorState) -> np.ndarray | None:
        """EF21M's step (eqs. 11a-11c) fused with Algorithm 1; returns the new ``G`` (a fresh copy).

        :class:`~horovod_compress.feedback.ef21.EF21M` calls this instead of
        forming ``d = h' - g`` and calling :meth:`_reduce` (``h``/``eta`` None:
        EF21, ``d = x - g``). Three compiled passes
        (:mod:`horovod_compress.kernels.arc_fused`): (11a) into a second buffer
        with the local sketch of ``d`` and the NaN/Inf test of ``x`` (``d`` is
        never stored); after the call's NaN/Inf agreement (the new ``h`` is
        swapped in only then), the sketch allreduce and the selection, the K
        rows of ``d`` into the message with (11b) on those rows; after the
        rows allreduce, (11c) on those rows and the optimizer's copy of ``G``
        in one pass. Same collectives, bytes and phases as :meth:`_reduce`;
        the trackers get the bits of the unfused path (see the kernels' module
        docstring for the sketch sums). ``None`` for inputs the kernels do not
        take (a dense plan, CuPy arrays, mixed dtypes, non-contiguous arrays):
        nothing is touched, and the call's deferred agreement, if any, is
        passed here, before EF21M's own passes write anything. The second
        ``h`` buffer (per tensor, not checkpointed) takes the place of the
        ``d = h - g`` buffer EF21M keeps for other methods: the same memory.
        """
        arrays = (x, g, big_g) if h is None else (x, h, g, big_g)
        if not (self._host_fused(x) and fusable(*arrays)):
            self._pass_finite_gate()
            return None
        plan = self.plan(x.shape)
        v = self.sketch_matrix(name, state.t, plan.n, plan.r, x.dtype)
        local_sketch = np.empty((plan.m, plan.r), x.dtype)
        h_new = None
        if h is not None:
            spares = self.scratch.spare_h
            h_new = spares.get(name)
            if (h_new is None or h_new.shape != h.shape or h_new.dtype != h.dtype
                    or np.may_share_memory(h_new, h)):
                h_new = np.empty_like(h)
        finite = sketch_pass(x, h, g, eta, padded_sketch(v), local_sketch, h_new)
        self._pass_finite_gate(finite)        # raises if any rank is not finite: nothing kept
        if h is not None:                     # (11a) takes effect: the old h is next step's buffer
            state.feedback.h, spares[name] = h_new, h
            h = h_new
        with comm.phase("arc_sketch"):
            sketch = comm.allreduce(local_sketch, op="avg")   # m x r words
        rows = self.select_rows(sketch, plan.k)
        msg = self._rows_message(name, comm, plan.k, plan.n, x.dtype)
        take_rows(x if h is None else h, g, rows, msg)        # d[I, :], and (11b) on rows I
        with comm.phase("arc_rows"):
            total = self._rows_sum(msg, name, comm)           # K x n words, no indices
        state.rows = rows.astype(np.int32)                 # diagnostics (same on every rank)
        total = np.ascontiguousarray(total, dtype=x.dtype).reshape(plan.k, plan.n)
        return apply_rows_copy(big_g, rows, total, comm.size).reshape(x.shape)

    #: Row messages of at least this many bytes take the shared-memory window when every rank
    #: shares one node (:meth:`_rows_sum`).
    window_min_bytes: int = 1 << 16

    def _rows_window(self, comm: Any, nbytes: int) -> bool:
        """Whether the rows' sum goes through the shared-memory window: every rank shares this
        node (:func:`~horovod_compress.mpi_collectives.shared_window.use_shared_window`) and
        the message has at least :attr:`window_min_bytes`."""
        return nbytes >= self.window_min_bytes and use_shared_window(comm)

    def _rows_message(self, name: str, comm: Any, k: int, n: int, dtype: Any) -> np.ndarray:
        """The K x n buffer the rows' message is gathered into: this rank's segment of the
        window when :meth:`_rows_window` (nothing is copied in), else a reused scratch buffer."""
        if self._rows_window(comm, k * n * np.dtype(dtype).itemsize):
            msg = window_message(comm, f"arc_rows:{name}", (k, n), dtype)
            if msg is not None:
                return msg
        return self._scratch_buffers(name, 1, k * n, dtype)[0].reshape(k, n)

    def _rows_sum(self, msg: np.ndarray, name: str, comm: Any) -> np.ndarray:
        """sum_i [G_i]_{I,:} (eq. 5): MPI's allreduce, or -- when :meth:`_rows_window` --
        the same sum read from the other ranks' messages in place
        (:func:`~horovod_compress.mpi_collectives.shared_window.window_allreduce_sum`; at
        P = 2 the same bits, the same bytes accounted); the result is then the window's own
        array, read before this call returns."""
        if type(msg) is np.ndarray and self._rows_window(comm, msg.nbytes):
            return window_allreduce_sum(comm, f"arc_rows:{name}", msg)
        return comm.allreduce(msg, op="sum")

    def expected_bytes(self, shape: tuple[int, ...], world_size: int,
                       itemsize: int = 4) -> float:
        """2 (m r + K n) (P-1)/P words (two ring allreduces), or 2 N (P-1)/P when dense."""
        words = self.plan(tuple(shape)).words
        return allreduce_volume(words * itemsize, world_size)


__all__ = ["ArcPlan", "ArcTopK"]
