"""``qsgd`` -- QSGD with local norms and an allgather: the baseline Global-QSGD replaces.

QSGD (Alistarh et al., 2017), as the Global-QSGD paper runs it (section 9,
"QSGD 8-bit"): every rank scales by its *own* norm, so quantized vectors of
different ranks live on different grids and cannot be summed inside an
allreduce (the paper's introduction). Each rank i sends

    (||x_i||_q as float32,  sign(x_i) * xi(|x_i| / ||x_i||_q, s))

with linear stochastic levels j/s, s = 2^(b-1) - 1 (8-bit: s = 127, signed
int8 levels; 4-bit: s = 7, two's-complement nibbles two per byte), through an
allgather; every rank then decodes all P messages and averages:

    avg = (1/P) sum_j ||x_j||_q / s * q_j          (unbiased, E[avg] = mean x_j)

Fixed-width levels are sent (no Elias coding), as in the Global-QSGD paper's
comparison. Volume per rank: an allgather of 4 + B bytes, (P-1)(4 + B) each
way, B = N (8-bit) or ceil(N/2) (4-bit) -- linear in P, unlike Global-QSGD's
2B(P-1)/P.

Special inputs: an all-zero gradient has norm 0 and sends zeros. A NaN/Inf on
any rank shows as a non-finite norm in the gathered messages, identical on all
ranks; the step is then redone as an uncompressed float allreduce (same result
as ``Compression.none``), counted in ``state.dense_fallback_steps``.
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from ..kernels import dispatch
from ..kernels.arrays import get_array_module
from ..kernels.quantize import abs_max, sum_squares
from .base import Method, TensorState
from .state import QuantizedState
from ..params import check_choice, check_int
from .registry import register


@register
class QSGD(Method):
    """QSGD: local-norm stochastic quantization + allgather (unbiased)."""

    name = "qsgd"
    state_class = QuantizedState
    biased = False
    default_feedback = "none"
    gpu_native = True

    def __init__(self, *, bits: int = 8, norm: str = "l2", feedback: str | None = None,
                 warmup_steps: int = 0, seed: int = 0, **feedback_params: Any) -> None:
        self.bits = check_choice(self.name, "bits", check_int(self.name, "bits", bits, 4, 8), [8, 4])
        self.norm = check_choice(self.name, "norm", norm, ["l2", "inf"])
        super().__init__(feedback=feedback, warmup_steps=warmup_steps, seed=seed, **feedback_params)

    @property
    def levels(self) -> int:
        """s = 2^(bits-1) - 1: 127 at 8 bits, 7 at 4 bits."""
        return (1 << (self.bits - 1)) - 1

    def params(self) -> dict[str, Any]:
        return {"bits": self.bits, "norm": self.norm, **self.feedback.params()}

    def payload_bytes(self, n: int) -> int:
        return n if self.bits == 8 else (n + 1) // 2

    def expected_bytes(self, shape: tuple[int, ...], world_size: int,
                       itemsize: int = 4) -> float:
        """Allgather of a float32 norm plus the levels: (P-1)(4 + B) bytes."""
        return float((world_size - 1) * (4 + self.payload_bytes(int(np.prod(shape)))))

    def local_norm(self, flat: np.ndarray) -> float:
        """||x_i||_q in float64; non-finite when x_i holds NaN/Inf (the receivers detect it)."""
        if flat.size == 0:
            return 0.0
        xp = get_array_module(flat)
        if xp is not np:  # on the GPU: one reduction, then a scalar to the host
            x64 = flat.astype(np.float64)
            return float(xp.abs(x64).max()) if self.norm == "inf" else math.sqrt(float(xp.dot(x64, x64)))
        x = np.ascontiguousarray(flat)
        return abs_max(x) if self.norm == "inf" else math.sqrt(sum_squares(x))

    def encode(self, flat: np.ndarray, key: np.uint64) -> tuple[np.ndarray, np.ndarray]:
        """(message bytes, int8 levels): float32 norm then levels (int8 or packed nibbles)."""
        exact = self.local_norm(flat)
        norm = np.float32(exact)
        if norm < exact:  # round up so |x| / norm <= 1 holds for the float32 sent
            norm = np.nextafter(norm, np.float32(np.inf))
        scale = 1.0 / float(norm) if math.isfinite(norm) and norm > 0 else 0.0
        xp = get_array_module(flat)
        q = dispatch.call("linear_quantize", flat, scale, self.levels, key)
        body = q.view(np.uint8) if self.bits == 8 else dispatch.call("pack_nibbles", q)
        head = xp.asarray(np.array([norm], dtype=np.float32).view(np.uint8))
        return xp.concatenate([head, body]), q

    def decode(self, message: np.ndarray, n: int) -> tuple[float, np.ndarray]:
        """(norm, int8 levels) of one message of :meth:`encode`."""
        xp = get_array_module(message)
        norm = float(xp.ascontiguousarray(message[:4]).view(np.float32)[0])
        body = message[4:]
        q = body.view(np.int8) if self.bits == 8 else dispatch.call(
            "unpack_nibbles", xp.ascontiguousarray(body), n, True)
        return norm, q

    def _reduce(self, x: np.ndarray, name: str, comm: Any,
                state: TensorState) -> tuple[np.ndarray, np.ndarray]:
        flat = x.reshape(-1)
        n = flat.size
        key = self.local_rng(name, state.t, comm.rank, "qsgd").integers(0, 2**64, dtype=np.uint64)
        message, q_own = self.encode(flat, key)
        with comm.phase("qsgd.allgather"):
            gathered = comm.allgather(message)  # (P, 4 + B) bytes
        decoded = [self.decode(gathered[j], n) for j in range(comm.size)]
        if not all(math.isfinite(norm) for norm, _ in decoded):
            state.dense_fallback_steps += 1
            warnings.warn("qsgd: a gradient holds NaN or Inf on some rank; this step runs as an "
                          "uncompressed allreduce (same result as Compression.none)",
                          RuntimeWarning, stacklevel=4)
            with comm.phase("qsgd.dense_fallback"):
                avg = comm.allreduce(flat, op="avg")
            return avg.reshape(x.shape), flat.copy().reshape(x.shape)
        s = self.levels
        total = get_array_module(flat).zeros(n, dtype=np.float64)
        for norm, q in decoded:
            total += q.astype(np.float64) * (norm / s)
        avg = (total / comm.size).astype(flat.dtype)
        own_norm = decoded[comm.rank][0]
        local = dispatch.call("linear_dequantize", q_own, own_norm / s, flat.dtype)
        return avg.reshape(x.shape), local.reshape(x.shape)
