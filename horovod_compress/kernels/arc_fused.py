"""ARC-Top-K's fused CPU passes (Numba): EF21M, sketch, NaN/Inf test in one read; O(K n); one copy.

ARC-Top-K (Chen et al., Algorithm 1) under its default feedback EF21M
(eqs. (11a)-(11c), :mod:`horovod_compress.feedback.ef21`) needs, per step
and m x n tensor, the sketch ``d V / sqrt(r)`` of the compressed input
``d = h' - g`` (h' the new momentum tracker), the K selected rows of ``d``,
the trackers' update and a fresh copy of ``G`` for the optimizer. As
NumPy/BLAS passes this read and wrote arrays of the gradient's size about a
dozen times (and BLAS's ``d @ V`` with a C-ordered n x r ``V`` runs 4x below
memory speed); here it is three kernels:

* :func:`sketch_pass` -- (11a) with ``d = h' - g`` in registers (never
  stored), the sketch rows ``d_p . V / sqrt(r)`` and whether ``x`` is finite,
  row by row: one read of ``x``, ``h``, ``g`` and one write of ``h'``. ``h'``
  goes to a second buffer (the caller swaps the two after the step's NaN/Inf
  agreement, so a step the ranks reject leaves ``h`` as it was) with
  streaming stores. ``feedback="ef21"`` (``d = x - g``) and ``"none"``
  (``d = x``) run the same loop without ``h``.
* :func:`take_rows` -- on the K selected rows only: the message
  ``d[I, :] = h'[I, :] - g[I, :]`` and EF21's (11b) ``g[I, :] += d[I, :]`` in
  the same read (``c_i`` is zero elsewhere, so no other entry of ``g``
  changes).
* :func:`apply_rows_copy` -- (11c) ``G[I, :] += sum / P`` on the K rows and
  the result (a copy of the new ``G``) written in one pass over ``G``, with
  streaming stores.

Streaming (non-temporal) stores: the two m x n arrays written whole, ``h'``
and the result, are written with ``!nontemporal`` 32-byte vector stores
(:func:`stream_copy`; ``vmovntps`` on x86), which skip the read-for-ownership
a plain store makes and do not evict the arrays the next pass reads. With
the step's ~96 MB of arrays out of cache (2000 x 2000 float32) a 16 MB copy
takes 1.25 ms so against 2.2 ms with NumPy's ``copyto``; with everything in
cache both take 1.1 ms. A fence at the end of each kernel orders them before
any later load or store.

Numerics. ``h'`` gets exactly the bits of the NumPy expressions
``h *= 1 - eta; h += eta * x`` (each product rounded, then the sum; no
fused multiply-add: the kernel's only fast-math flag is ``reassoc``, which
has nothing to reassociate in a two-term sum), the message and the ``g``,
``G`` updates the bits of ``h' - g``, ``g + c`` and ``G + sum / P``. The
sketch products are float sums in the gradient's dtype whose order is the
vectoriser's (``reassoc``), like any BLAS GEMM's: the sketch is not
bit-identical to ``d @ V``, which no test or rank needs (every rank receives
the same allreduced sketch and selects from it). Off the selected rows ``g``
and ``G`` are not touched, where the dense ``g += c`` would add ``+0.0``:
the one difference is that a ``-0.0`` there stays ``-0.0``. The finiteness
test sums ``x_j - x_j`` (0 for a finite entry, NaN otherwise), which
``reassoc`` cannot fold away (that needs ``nnan``).

Every kernel takes float32 or float64 C-contiguous arrays (flat views for
the m x n matrices) and int64 row indices in ascending order.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: ``mode`` of :func:`sketch_pass`: d = x (no feedback), d = x - g (EF21), d = h' - g (EF21M).
MODE_PLAIN, MODE_EF21, MODE_EF21M = 0, 1, 2
#: Bytes per streaming store (one AVX register; two SSE stores elsewhere).
STREAM_BYTES = 32


# ------------------------------------------------------------ streaming stores
@intrinsic
def _stream32(typingctx, dst, di, src, si):
    """``dst[di:di+L] = src[si:si+L]`` (L = 32 bytes of the dtype) by one non-temporal vector store.

    ``dst[di]`` must be 32-byte aligned (the caller peels to it); ``src``
    may be unaligned.
    """
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
            and dst.dtype == src.dtype and isinstance(di, types.Integer)
            and isinstance(si, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        elem = context.get_data_type(signature.args[0].dtype)
        lanes = STREAM_BYTES // context.get_abi_sizeof(elem)
        vec = ir.VectorType(elem, lanes).as_pointer()
        dst_arr = context.make_array(signature.args[0])(context, builder, args[0])
        src_arr = context.make_array(signature.args[2])(context, builder, args[2])
        src_ptr = builder.bitcast(builder.gep(src_arr.data, [args[3]]), vec)
        dst_ptr = builder.bitcast(builder.gep(dst_arr.data, [args[1]]), vec)
        store = builder.store(builder.load(src_ptr, align=1), dst_ptr, align=STREAM_BYTES)
        hint = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        store.set_metadata("nontemporal", hint)
        return context.get_dummy_value()
    return types.void(dst, di, src, si), codegen


@intrinsic
def _store_fence(typingctx):
    """A full fence: orders the streaming stores before every later load and store."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@njit(cache=True, inline="always")
def _stream(dst, di, src, si, count):
    """``dst[di:di+count] = src[si:si+count]``: plain stores up to 32-byte alignment of the
    destination, streaming 32-byte stores for the bulk, plain stores for the tail."""
    size = dst.itemsize
    lanes = STREAM_BYTES // size
    addr = dst.ctypes.data + di * size
    i = 0
    while i < count and (addr + i * size) % STREAM_BYTES != 0:
        dst[di + i] = src[si + i]
        i += 1
    while i + lanes <= count:
        _stream32(dst, di + i, src, si + i)
        i += lanes
    while i < count:
        dst[di + i] = src[si + i]
        i += 1


@njit(cache=True)
def _stream_copy(dst, src):
    _stream(dst, 0, src, 0, dst.size)
    _store_fence()


def stream_copy(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    """``dst[...] = src`` (same dtype and size, C-contiguous), by streaming stores; ``dst``."""
    _stream_copy(dst.reshape(-1), src.reshape(-1))
    return dst


# ------------------------------------------------------------------ the sketch
@njit(cache=True, fastmath={"reassoc"})
def _sketch_pass(x, h, hout, g, keep, eta, zero, vt, sk, buf, mode):
    """Row by row: ``d`` in registers, ``sk[p, :r] = d_p . vt[:r]``, (11a) into ``hout`` (mode 2).

    ``vt`` holds V^T / sqrt(r) zero-padded to a multiple of 4 rows: the
    first 4 sketch columns are summed in the pass that reads the row from
    memory, any further group of 4 (r > 4) over the same row again, from
    cache. Mode 2 writes the row of ``h'`` to ``buf`` (L1), then streams it
    to ``hout``. Returns the sum of ``x_j - x_j`` (0 iff ``x`` is finite).
    """
    m, r = sk.shape
    n = vt.shape[1]
    groups = vt.shape[0] // 4
    z = zero
    for p in range(m):
        base = p * n
        s0 = zero
        s1 = zero
        s2 = zero
        s3 = zero
        if mode == 2:
            for c in range(n):
                xv = x[base + c]
                hv = h[base + c] * keep + eta * xv
                buf[c] = hv
                dv = hv - g[base + c]
                z += xv - xv
                s0 += dv * vt[0, c]
                s1 += dv * vt[1, c]
                s2 += dv * vt[2, c]
                s3 += dv * vt[3, c]
            _stream(hout, base, buf, 0, n)
        elif mode == 1:
            for c in range(n):
                xv = x[base + c]
                dv = xv - g[base + c]
                z += xv - xv
                s0 += dv * vt[0, c]
                s1 += dv * vt[1, c]
                s2 += dv * vt[2, c]
                s3 += dv * vt[3, c]
        else:
            for c in range(n):
                dv = x[base + c]
                z += dv - dv
                s0 += dv * vt[0, c]
                s1 += dv * vt[1, c]
                s2 += dv * vt[2, c]
                s3 += dv * vt[3, c]
        _store4(sk, p, 0, r, s0, s1, s2, s3)
        for q in range(1, groups):
            j = 4 * q
            s0 = zero
            s1 = zero
            s2 = zero
            s3 = zero
            if mode == 2:                  # h' from buf, g from cache
                for c in range(n):
                    dv = buf[c] - g[base + c]
                    s0 += dv * vt[j, c]
                    s1 += dv * vt[j + 1, c]
                    s2 += dv * vt[j + 2, c]
                    s3 += dv * vt[j + 3, c]
            elif mode == 1:
                for c in range(n):
                    dv = x[base + c] - g[base + c]
                    s0 += dv * vt[j, c]
                    s1 += dv * vt[j + 1, c]
                    s2 += dv * vt[j + 2, c]
                    s3 += dv * vt[j + 3, c]
            else:
                for c in range(n):
                    dv = x[base + c]
                    s0 += dv * vt[j, c]
                    s1 += dv * vt[j + 1, c]
                    s2 += dv * vt[j + 2, c]
                    s3 += dv * vt[j + 3, c]
            _store4(sk, p, j, r, s0, s1, s2, s3)
    _store_fence()
    return z


@njit(cache=True, inline="always")
def _store4(sk, p, j, r, s0, s1, s2, s3):
    """``sk[p, j:j+4] = s0..s3``, the columns below ``r`` only (the rest is V's zero padding)."""
    if j < r:
        sk[p, j] = s0
    if j + 1 < r:
        sk[p, j + 1] = s1
    if j + 2 < r:
        sk[p, j + 2] = s2
    if j + 3 < r:
        sk[p, j + 3] = s3


def padded_sketch(v: np.ndarray) -> np.ndarray:
    """``V`` (n x r, already scaled by 1/sqrt(r)) as the r4 x n matrix :func:`sketch_pass` reads:
    ``V^T`` with zero rows up to a multiple of 4 (r4 = 4 ceil(r / 4))."""
    n, r = v.shape
    vt = np.zeros((max(4, -(-r // 4) * 4), n), dtype=v.dtype)
    vt[:r] = v.T
    return vt


def sketch_pass(x: np.ndarray, h: np.ndarray | None, g: np.ndarray | None, eta: float | None,
                vt: np.ndarray, sk: np.ndarray, h_out: np.ndarray | None = None) -> bool:
    """The local sketch ``sk = d V / sqrt(r)`` (m x r) of ``d``; returns whether ``x`` is finite.

    ``x`` is the m x n gradient (any C-contiguous shape of m n elements),
    ``vt`` the output of :func:`padded_sketch`, ``sk`` an m x r buffer.
    ``d`` is ``h' - g`` with ``h' = (1 - eta) h + eta x`` written to
    ``h_out`` (``h``, ``eta`` and ``h_out`` given: EF21M; ``h`` itself is
    only read, ``h_out`` may not overlap it), ``x - g`` (``g`` only: EF21)
    or ``x`` (neither: no feedback). One read of every array given, one
    write of ``h_out``; ``d`` is not stored.
    """
    m, r = sk.shape
    n = vt.shape[1]
    if x.size != m * n or vt.shape[0] < r or vt.shape[0] % 4:
        raise ValueError(f"sketch_pass: x of {x.size} elements, vt {vt.shape}, sk {sk.shape} "
                         f"do not fit an m x n view with r <= padded rows (a multiple of 4)")
    t = x.dtype.type
    flat = x.reshape(-1)
    if h is not None:
        if h_out is None or np.may_share_memory(h_out, h):
            raise ValueError("sketch_pass: EF21M needs an h_out that does not overlap h")
        mode, hf, of, gf = MODE_EF21M, h.reshape(-1), h_out.reshape(-1), g.reshape(-1)
        buf = np.empty(n, dtype=x.dtype)
    else:
        mode, hf, of = (MODE_EF21 if g is not None else MODE_PLAIN), flat, flat
        gf = flat if g is None else g.reshape(-1)
        buf = flat[:0]
    e = 1.0 if eta is None else float(eta)
    z = _sketch_pass(flat, hf, of, gf, t(1.0 - e), t(e), t(0), vt, sk, buf, mode)
    return bool(z == 0)


# ---------------------------------------------------------------- the rows
@njit(cache=True)
def _take_rows(a, g, rows, msg, n, update):
    for j in range(rows.size):
        src = rows[j] * n
        dst = j * n
        if update:
            for c in range(n):
                gv = g[src + c]
                dv = a[src + c] - gv
                msg[dst + c] = dv
                g[src + c] = gv + dv
        else:
            for c in range(n):
                msg[dst + c] = a[src + c]


def take_rows(a: np.ndarray, g: np.ndarray | None, rows: np.ndarray, msg: np.ndarray) -> np.ndarray:
    """The K x n message ``msg = (a - g)[rows, :]`` and ``g[rows, :] += msg`` (EF21's (11b) on
    the only rows where ``c_i`` is nonzero), in one read of those rows.

    ``a`` is ``h'`` (EF21M) or ``x`` (EF21); with ``g`` None the message is
    ``a[rows, :]`` and nothing is updated (no feedback). ``a`` and ``g`` are
    C-contiguous with ``msg.shape[1]`` columns per row. Returns ``msg``.
    """
    n = msg.shape[1]
    af = a.reshape(-1)
    _take_rows(af, af if g is None else g.reshape(-1), rows, msg.reshape(-1), n, g is not None)
    return msg


@njit(cache=True)
def _apply_rows_copy(big_g, rows, total, size, out, buf, n):
    prev = 0                                  # first row not yet written to out
    for j in range(rows.size):
        p = rows[j]
        _stream(out, prev * n, big_g, prev * n, (p - prev) * n)    # rows off I: a copy
        base = p * n
        src = j * n
        for c in range(n):
            v = big_g[base + c] + total[src + c] / size
            big_g[base + c] = v
            buf[c] = v
        _stream(out, base, buf, 0, n)
        prev = p + 1
    _stream(out, prev * n, big_g, prev * n, big_g.size - prev * n)
    _store_fence()


def apply_rows_copy(big_g: np.ndarray, rows: np.ndarray, total: np.ndarray, size: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """EF21's (11c) ``G[rows, :] += total / size`` and ``out = G`` (the optimizer's copy), one pass.

    ``total`` is the K x n allreduced *sum* of the messages; ``total / size``
    is rounded in the gradient's dtype first (the bits of
    ``Communicator.allreduce(op="avg")``), then added. ``rows`` ascending.
    Returns ``out`` (a fresh array like ``G`` when not given).
    """
    if out is None:
        out = np.empty_like(big_g)
    n = total.shape[1]
    _apply_rows_copy(big_g.reshape(-1), rows, total.reshape(-1), big_g.dtype.type(size),
                     out.reshape(-1), np.empty(n, big_g.dtype), n)
    return out


__all__ = ["MODE_EF21", "MODE_EF21M", "MODE_PLAIN", "STREAM_BYTES", "apply_rows_copy",
           "padded_sketch", "sketch_pass", "stream_copy", "take_rows"]
