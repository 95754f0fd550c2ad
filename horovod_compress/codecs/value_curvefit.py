"""Curve-fitting value codecs: ``polyfit`` (piecewise polynomial) and ``dexp`` (double exponential).

DeepReduce's value compressor ("DeepReduce: A Sparse-tensor Communication Framework for Distributed Deep Learning" (Kostopoulou et al., NeurIPS 2021),
Section 5): sort the r
values in descending order; the sorted curve is smooth, so a few curve
parameters replace the values, and the permutation from the original to the
sorted order travels separately (the container sends it in ceil(log2 r) bits
per value, or lets ``raw`` indices carry it for free, Section 5.1).

Segmentation (Section 5, "Piece-wise approximation"). The sorted values are
split at the sign changes (positives, zeros, negatives are fitted apart, as
the paper does for the positive and the negative half). A part y_1..y_L gets
an initial number of segments from Lemma 1's bound ||s - C_S||_inf <= 2M/p^2,
M = |(y_1 - y_2) - (y_{L-1} - y_L)|, i.e. p = ceil(sqrt(2M / eps)); segments
are made by repeatedly splitting the segment whose largest squared distance to
the chord joining its end points is the largest, at that point.

Error bound (a guarantee here, not only a heuristic). With
eps = ``tol * max_i |v_i|``, every decoded value satisfies

    |decoded_i - v_i| <= eps.

Each segment is fitted, its parameters are rounded to float32 and evaluated
exactly as the decoder will; a segment that misses eps is split again at its
chord point, and a short segment (where parameters would cost as much as
values) is sent verbatim instead. The paper's fits are the same least-squares
fits; it picks p from the heuristic only, without checking the bound.

* ``polyfit``: least squares per segment in the Chebyshev basis on x in
  [-1, 1] (``numpy.polynomial.chebyshev.chebfit``; the same polynomial as
  NumPy's ``polyfit`` that the paper's CPU version uses, better conditioned
  with float32 coefficients), degree 5 by default (6 coefficients, as in the
  paper's experiments).
* ``dexp``: y = a e^(b x) + c e^(d x) on x in [0, 1] (4 parameters), fitted with
  variable projection: the rates (b, d) on a grid over [-30, 30]^2 with
  (a, c) by linear least squares for each pair, then a Levenberg-Marquardt
  refinement (``scipy.optimize.curve_fit`` with the analytic Jacobian; a
  result with |b| or |d| > 30 is rejected).

Payload::

    varint segments | per segment: varint length | u8 kind | parameters
    kind 0..63 (polyfit): Chebyshev degree, (kind + 1) float32 coefficients
    kind 0     (dexp):    4 float32 parameters a, b, c, d
    kind 255:             length values verbatim in the tensor's dtype
"""
from __future__ import annotations

import heapq
import math
import warnings
from typing import Any, ClassVar

import numpy as np

from ..params import check_float, check_int
from .registry import ValueCodec
from .wire import ByteReader, ByteWriter

RAW_SEGMENT = 255
MAX_DEGREE = 63
DEXP_RATE_BOUND = 30.0


def sorted_descending(values: np.ndarray) -> np.ndarray:
    """The permutation that sorts ``values`` in descending order (stable)."""
    return np.argsort(-np.asarray(values, dtype=np.float64), kind="stable")


def sign_parts(y: np.ndarray) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the positive, zero and negative runs of descending ``y``."""
    npos = int(np.count_nonzero(y > 0))
    nneg = int(np.count_nonzero(y < 0))
    cuts = [0, npos, y.size - nneg, y.size]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def chord_split_point(y: np.ndarray) -> tuple[float, int]:
    """``(max squared distance, j)``: y's point farthest from the chord of its end points.

    Splitting after j gives segments ``y[:j + 1]`` and ``y[j + 1:]``.
    """
    L = y.size
    if L < 3:
        return 0.0, 0
    t = np.arange(L, dtype=np.float64)
    chord = y[0] + (y[-1] - y[0]) * t / (L - 1)
    d = np.square(chord[1:-1] - y[1:-1])
    j = int(np.argmax(d)) + 1
    return float(d[j - 1]), j


def lemma1_segments(y: np.ndarray, eps: float) -> int:
    """p = ceil(sqrt(2M / eps)), M = |(y_1 - y_2) - (y_{L-1} - y_L)| (Lemma 1 / Remark 5)."""
    if y.size < 4 or eps <= 0:
        return 1
    M = abs((y[0] - y[1]) - (y[-2] - y[-1]))
    return max(1, math.ceil(math.sqrt(2.0 * M / eps)))


def initial_segments(y: np.ndarray, start: int, p: int, min_len: int) -> list[tuple[int, int]]:
    """Split ``y`` into up to ``p`` segments by the chord rule (largest deviation first)."""
    heap: list[tuple[float, int, int, int]] = []
    done: list[tuple[int, int]] = []

    def push(a: int, b: int) -> None:
        dev, j = chord_split_point(y[a - start:b - start])
        if b - a >= 2 * min_len and dev > 0:
            heapq.heappush(heap, (-dev, a, b, j))
        else:
            done.append((a, b))

    push(start, start + y.size)
    while heap and len(heap) + len(done) < p:
        _, a, b, j = heapq.heappop(heap)
        push(a, a + j + 1)
        push(a + j + 1, b)
    done.extend((a, b) for _, a, b, _ in heap)
    return sorted(done)


class CurveFitValues(ValueCodec):
    """Shared machinery of the curve-fitting codecs (segmentation, bound, wire format)."""

    sorts: ClassVar[bool] = True
    lossless: ClassVar[bool] = False
    use_lemma1: ClassVar[bool] = True

    def __init__(self, tol: float = 0.01) -> None:
        self.tol = check_float("deepreduce", "fit_tol", tol, 1e-7, 1.0)

    def params(self) -> dict[str, Any]:
        return {"tol": self.tol}

    # -- model interface (subclasses) ---------------------------------------------------
    def min_fit_length(self) -> int:
        """Segments of at most this many values are sent verbatim (parameters cost as much)."""
        raise NotImplementedError

    def fit(self, y: np.ndarray) -> tuple[int, np.ndarray] | None:
        """``(kind, float32 parameters)`` for segment ``y``, or None if the fit failed."""
        raise NotImplementedError

    @classmethod
    def evaluate(cls, kind: int, params: np.ndarray, L: int) -> np.ndarray:
        """The model's L values (float64) -- the one function sender and receiver share."""
        raise NotImplementedError

    @classmethod
    def read_params(cls, rd: ByteReader, kind: int) -> np.ndarray:
        raise NotImplementedError

    # -- encoding ---------------------------------------------------------------------
    def segments(self, y: np.ndarray, dtype: np.dtype) -> list[tuple[int, int, int, np.ndarray]]:
        """``[(start, stop, kind, params)]`` covering descending ``y`` within the error bound."""
        eps = self.tol * float(np.max(np.abs(y))) if y.size else 0.0
        short = self.min_fit_length()
        out = []
        for a, b in sign_parts(y):
            p = lemma1_segments(y[a:b], eps) if self.use_lemma1 else 1
            work = initial_segments(y[a:b], a, min(p, max(1, (b - a) // (short + 1))), short + 1)
            while work:
                s0, s1 = work.pop()
                seg = y[s0:s1]
                if s1 - s0 <= short:
                    out.append((s0, s1, RAW_SEGMENT, seg.astype(dtype)))
                    continue
                fitted = self.fit(seg)
                if fitted is not None:
                    kind, prm = fitted
                    approx = self.evaluate(kind, prm, s1 - s0).astype(dtype)
                    if np.all(np.abs(approx.astype(np.float64) - seg) <= eps):
                        out.append((s0, s1, kind, prm))
                        continue
                if s1 - s0 <= 2 * short:
                    out.append((s0, s1, RAW_SEGMENT, seg.astype(dtype)))
                    continue
                _, j = chord_split_point(seg)
                j = min(max(j, short - 1), s1 - s0 - short - 1)  # both halves longer than short
                work.append((s0 + j + 1, s1))
                work.append((s0, s0 + j + 1))
        out.sort(key=lambda t: t[0])
        return out

    def encode(self, values: np.ndarray, seed: int) -> tuple[bytes, np.ndarray]:
        v = np.asarray(values)
        if not np.isfinite(v).all():
            raise ValueError(f"deepreduce: the {self.name} value codec cannot encode non-finite values")
        order = sorted_descending(v)
        y = v[order].astype(np.float64)
        segs = self.segments(y, v.dtype)
        wr = ByteWriter().varint(len(segs))
        for s0, s1, kind, prm in segs:
            wr.varint(s1 - s0).u8(kind)
            wr.raw(prm.astype(v.dtype.newbyteorder("<")) if kind == RAW_SEGMENT
                   else prm.astype("<f4"))
        return wr.getvalue(), order

    # -- decoding ---------------------------------------------------------------------
    @classmethod
    def decode(cls, payload: bytes, count: int, dtype: np.dtype) -> np.ndarray:
        rd = ByteReader(payload, f"{cls.name} value section")
        nseg = rd.varint("segment count", limit=count)
        out = np.empty(count, dtype=dtype)
        pos = 0
        for _ in range(nseg):
            L = rd.varint("segment length", limit=count - pos)
            if L < 1:
                raise rd.fail("empty segment")
            kind = rd.u8("segment kind")
            if kind == RAW_SEGMENT:
                out[pos:pos + L] = rd.array(L, dtype, "raw segment")
            else:
                prm = cls.read_params(rd, kind)
                if not np.isfinite(prm).all():
                    raise rd.fail("non-finite curve parameters")
                with np.errstate(over="ignore", invalid="ignore"):
                    vals = cls.evaluate(kind, prm, L).astype(dtype)
                if not np.isfinite(vals).all():
                    raise rd.fail("curve parameters evaluate to non-finite values")
                out[pos:pos + L] = vals
            pos += L
        if pos != count:
            raise rd.fail(f"segments cover {pos} values, expected {count}")
        rd.expect_end()
        return out


def _cheb_x(L: int) -> np.ndarray:
    return np.linspace(-1.0, 1.0, L) if L > 1 else np.zeros(1)


class PolyFitValues(CurveFitValues, name="polyfit", codec_id=4):
    """Piecewise least-squares polynomials of the sorted values (default degree 5)."""

    def __init__(self, degree: int = 5, tol: float = 0.01) -> None:
        super().__init__(tol)
        self.degree = check_int("deepreduce", "poly_degree", degree, 0, MAX_DEGREE)

    def params(self) -> dict[str, Any]:
        return {"degree": self.degree, "tol": self.tol}

    def min_fit_length(self) -> int:
        return self.degree + 1

    def fit(self, y: np.ndarray) -> tuple[int, np.ndarray] | None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            coef = np.polynomial.chebyshev.chebfit(_cheb_x(y.size), y, self.degree)
        if not np.isfinite(coef).all():
            return None
        return self.degree, coef.astype(np.float32)

    @classmethod
    def evaluate(cls, kind: int, params: np.ndarray, L: int) -> np.ndarray:
        return np.polynomial.chebyshev.chebval(_cheb_x(L), params.astype(np.float64))

    @classmethod
    def read_params(cls, rd: ByteReader, kind: int) -> np.ndarray:
        if kind > MAX_DEGREE:
            raise rd.fail(f"polynomial degree {kind} above {MAX_DEGREE}")
        return rd.array(kind + 1, "<f4", "coefficients")


def _dexp(x: np.ndarray, a: float, b: float, c: float, d: float) -> np.ndarray:
    return a * np.exp(b * x) + c * np.exp(d * x)


_RATE_GRID = np.linspace(-DEXP_RATE_BOUND, DEXP_RATE_BOUND, 41)


def _dexp_grid_start(x: np.ndarray, z: np.ndarray) -> tuple[float, float, float, float]:
    """Best (a, b, c, d) with (b, d) on a grid and (a, c) by linear least squares."""
    E = np.exp(np.outer(_RATE_GRID, x))                  # (G, L)
    gram = E @ E.T                                       # (G, G)
    rhs = E @ z                                          # (G,)
    gii = np.diag(gram)
    det = gii[:, None] * gii[None, :] - gram * gram
    with np.errstate(all="ignore"):
        a = (gii[None, :] * rhs[:, None] - gram * rhs[None, :]) / det
        c = (gii[:, None] * rhs[None, :] - gram * rhs[:, None]) / det
        explained = a * rhs[:, None] + c * rhs[None, :]
    ok = np.isfinite(explained) & (np.abs(det) > 1e-9 * gii[:, None] * gii[None, :])
    single = rhs * rhs / gii                              # one exponential (c = 0)
    explained = np.where(ok, explained, -np.inf)
    i, j = np.unravel_index(int(np.argmax(explained)), explained.shape)
    s = int(np.argmax(single))
    if single[s] >= explained[i, j]:
        return float(rhs[s] / gii[s]), float(_RATE_GRID[s]), 0.0, 0.0
    return float(a[i, j]), float(_RATE_GRID[i]), float(c[i, j]), float(_RATE_GRID[j])


def _dexp_jac(x: np.ndarray, a: float, b: float, c: float, d: float) -> np.ndarray:
    eb, ed = np.exp(b * x), np.exp(d * x)
    return np.stack([eb, a * x * eb, ed, c * x * ed], axis=1)


class DoubleExpValues(CurveFitValues, name="dexp", codec_id=5):
    """a e^(bx) + c e^(dx) per segment of the sorted values (4 parameters)."""

    use_lemma1 = False  # the paper fits the double exponential without segmentation

    def min_fit_length(self) -> int:
        return 4

    def fit(self, y: np.ndarray) -> tuple[int, np.ndarray] | None:
        """Variable projection: grid over the rates (b, d), linear (a, c), then LM refinement."""
        from scipy.optimize import curve_fit
        L = y.size
        x = np.linspace(0.0, 1.0, L)
        scale = float(np.max(np.abs(y)))
        if scale == 0.0:
            return 0, np.zeros(4, np.float32)
        z = y / scale
        start = _dexp_grid_start(x, z)
        candidates = [start]
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                prm, _ = curve_fit(_dexp, x, z, p0=start, jac=_dexp_jac, method="lm", maxfev=40)
            if np.isfinite(prm).all() and max(abs(prm[1]), abs(prm[3])) <= DEXP_RATE_BOUND:
                candidates.append(tuple(prm))
        except (RuntimeError, ValueError, np.linalg.LinAlgError):
            pass
        best, best_err = None, np.inf
        for a, b, c, d in candidates:
            prm = np.array([a * scale, b, c * scale, d], dtype=np.float32)
            if not np.isfinite(prm).all():
                continue
            with np.errstate(all="ignore"):
                err = float(np.max(np.abs(self.evaluate(0, prm, L) - y)))
            if err < best_err:
                best, best_err = prm, err
        return None if best is None else (0, best)

    @classmethod
    def evaluate(cls, kind: int, params: np.ndarray, L: int) -> np.ndarray:
        a, b, c, d = params.astype(np.float64)
        return _dexp(np.linspace(0.0, 1.0, L) if L > 1 else np.zeros(1), a, b, c, d)

    @classmethod
    def read_params(cls, rd: ByteReader, kind: int) -> np.ndarray:
        if kind != 0:
            raise rd.fail(f"unknown double-exponential segment kind {kind}")
        prm = rd.array(4, "<f4", "parameters")
        if np.isfinite(prm).all() and max(abs(prm[1]), abs(prm[3])) > DEXP_RATE_BOUND:
            raise rd.fail(f"exponential rates {prm[1]}, {prm[3]} outside +-{DEXP_RATE_BOUND}")
        return prm
