"""Argument checks, op scaling and the working-dtype rule shared by every front-end.

Horovod's ``DistributedOptimizer`` / ``DistributedGradientTape`` semantics,
on NumPy (or CuPy) arrays:

* ``gradient_predivide_factor`` f divides each gradient by f before the
  exchange and multiplies the average by f afterwards;
* ``op=Sum`` multiplies the average by the number of ranks P;
* a front-end may add one more factor on the result (``postscale``; the
  Keras ``backward_passes_per_step`` of Horovod's legacy optimizer sums the
  accumulated micro-batches).

The working dtype is the NumPy dtype a gradient has inside the core:
float16, float32 and float64 as they are, every other dtype -- bfloat16
(which has no NumPy dtype) and anything else a front-end lets through --
widened to float32. Results are converted back to the parameter's dtype by
the front-end; which dtypes it accepts is the front-end's rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..compressors.base import Method
from .ops import Average, Sum, op_name

#: The dtypes the core reduces as they are; every other one is widened to float32.
NATIVE_DTYPES = ("float16", "float32", "float64")


def working_dtype(name: str) -> str:
    """The NumPy dtype name a gradient of dtype ``name`` is reduced in (see the module doc).

    ``name`` is a framework dtype name (``"float32"``, ``"bfloat16"``; a
    ``"torch."`` prefix is ignored).
    """
    key = str(name).removeprefix("torch.")
    return key if key in NATIVE_DTYPES else "float32"


def check_method(method: Any, what: str = "compression",
                 error: type[Exception] = ValueError) -> "Method":
    """``method`` if it is a :class:`~horovod_compress.Method`; ``error`` naming ``what`` otherwise.

    Optimizers and reducers raise ``ValueError`` (a bad argument value), the
    DDP comm hook ``TypeError`` (as it always has).
    """
    if not isinstance(method, Method):
        raise error(f"{what} must be a hvdc.Compression.<method>(...) object, "
                    f"got {type(method).__name__}")
    return method


def check_backward_passes(backward_passes_per_step: Any) -> int:
    """``backward_passes_per_step`` as an int >= 1; ``ValueError`` otherwise."""
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    return int(backward_passes_per_step)


def check_bucket_bytes(bucket_bytes: Any) -> int:
    """``bucket_bytes`` as a positive int; ``ValueError`` otherwise."""
    if int(bucket_bytes) <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return int(bucket_bytes)


@dataclass
class Scaling:
    """The factors a front-end applies around the exchange (see the module doc).

    ``op`` is ``"average"`` or ``"sum"``, ``predivide`` the
    ``gradient_predivide_factor``, ``postscale`` an extra factor on results.
    """

    op: str = Average
    predivide: float = 1.0
    postscale: float = 1.0

    @classmethod
    def from_args(cls, op: Any = Average, gradient_predivide_factor: float = 1.0) -> "Scaling":
        """Checked factors from a front-end's arguments (``ValueError`` naming the bad one)."""
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        return cls(op_name(op), float(gradient_predivide_factor))

    def prescale(self, grad: Any) -> Any:
        """``grad / predivide`` in ``grad``'s dtype (``grad`` itself when the factor is 1)."""
        if self.predivide == 1.0:
            return grad
        return grad / grad.dtype.type(self.predivide)

    def factor(self, size: int) -> float:
        """The factor on an average over ``size`` ranks: ``predivide * (P if Sum) * postscale``."""
        return self.predivide * (size if self.op == Sum else 1) * self.postscale

    def apply(self, avg: Any, size: int) -> Any:
        """``avg`` times :meth:`factor` in ``avg``'s dtype (``avg`` itself when it is 1)."""
        scale = self.factor(size)
        return avg if scale == 1.0 else avg * avg.dtype.type(scale)
