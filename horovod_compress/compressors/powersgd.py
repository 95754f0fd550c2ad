"""``powersgd`` -- rank-r PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019).

GreedyLore's main baseline (papers/greedylore.txt, Tables II-V). Per tensor,
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

Deviation: the hook's error for a tensor sent dense is ``x_i - avg`` (it
subtracts the averaged bucket); here a dense tensor leaves no error. Both give
the same averages (those errors sum to zero over ranks).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .base import Method, TensorState
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


#: ``q_init`` sources beyond ``"shared"``: name -> ``draw(seed, cols, r, dtype)``
#: returning a (cols x r) standard-normal array. :mod:`horovod_compress.torch`
#: registers ``"torch"`` (``torch.manual_seed(seed); torch.randn(1, cols, r)``).
Q_SOURCES: dict[str, Callable[[int, int, int, np.dtype], np.ndarray]] = {}


def register_q_source(name: str, draw: Callable[[int, int, int, np.dtype], np.ndarray]) -> None:
    """Make ``draw(seed, cols, r, dtype)`` the generator behind ``q_init=name``."""
    Q_SOURCES[name] = draw


@register
class PowerSGD(Method):
    """Rank-r PowerSGD with warm start and error feedback."""

    name = "powersgd"
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

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        mat = compressed_matrix(x, self.rank, self.min_compression_rate)
        fresh = not self.warm_start or "Q" not in state
        if mat is None:
            if self.q_init == "torch" and fresh:
                self._torch_rng.randint(1_000_000_000)  # the hook draws for every bucket
                if self.warm_start:
                    state["Q"] = np.zeros((0, 0), dtype=x.dtype)
            avg = comm.allreduce(x, op="avg")
            return avg, x
        rows, cols = mat.shape
        r = effective_rank(rows, cols, self.rank)
        q = None if fresh else state["Q"]
        if q is None or q.shape != (cols, r) or q.dtype != mat.dtype:
            q = self.initial_q(name, state.t, cols, r, mat.dtype)
        else:
            q = q.copy()
        orthogonalize(q, self.orthogonalization_epsilon)
        with comm.phase("powersgd.P"):
            p = comm.allreduce(mat @ q, op="sum")
        orthogonalize(p, self.orthogonalization_epsilon)
        with comm.phase("powersgd.Q"):
            q = comm.allreduce(mat.T @ p, op="avg")
        if self.warm_start:
            state["Q"] = q
        avg = (p @ q.T).reshape(x.shape)
        return avg, avg

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
