"""``hvdc bench kernels-gpu``: every GPU kernel against a device memcpy, its CPU kernel and a library call.

For each kernel with a GPU implementation and each size n (default 1M and
25M elements), with the same inputs as ``hvdc bench kernels``, one run measures:

* the GPU kernel on CuPy arrays (best of ``--repeat`` calls after a warm-up
  call that pays the compilation; every call ends with a device
  synchronisation, so the time includes the launches and any small
  device-to-host copies the kernel makes);
* a device-to-device copy of the kernel's input bytes (``cupy.copyto``) --
  the speed of light of a kernel that reads its input once;
* the CPU kernel on the same data in host memory, whose output the GPU
  kernel's must equal (bit for bit; the two float reductions, which sum in
  another order, within 1e-9 (float64) and 1e-6 (float32) relative);
* a library call where there is one: ``torch.topk`` on the device for the
  selections, and for the exponential reduce a float32 ``cupy.add`` of n
  elements -- what MPI's SUM does to the dense vector Global-QSGD replaces.

It needs CuPy and a CUDA device. Under ``NUMBA_ENABLE_CUDASIM=1`` it runs on
the simulator's device arrays instead, so the benchmark itself can be checked
without a GPU; the report then says that its timings mean nothing.
Writes ``benchmarks/kernels_gpu.md`` and ``.json`` beside it.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .kernels import KEY, _fmt_ratio, _machine, add_kernel_bench_options, checked_args, size_tables


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels-gpu", help="GPU kernel speed vs device memcpy, the CPU kernel and library calls",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_bench_options(p, repeat=10, out="benchmarks/kernels_gpu.md")
    p.set_defaults(func=run)


# ------------------------------------------------------------------ device
class Device:
    """The array kind the run uses: CuPy on a CUDA device, or the Numba simulator's arrays."""

    def __init__(self) -> None:
        from numba import config
        self.simulator = bool(config.ENABLE_CUDASIM)
        self.cupy: Any = None
        if self.simulator:
            self.name = "Numba CUDA simulator (timings are meaningless)"
            return
        try:
            import cupy
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001 - ImportError, or a CUDA driver error
            raise SystemExit(
                f"hvdc bench kernels-gpu needs CuPy and a CUDA device ({type(exc).__name__}: {exc}); "
                "install CuPy (pip install cupy-cuda12x) on a GPU machine. To check the benchmark "
                "itself without a GPU, run it with NUMBA_ENABLE_CUDASIM=1 and tiny --sizes") from None
        if count < 1:
            raise SystemExit("hvdc bench kernels-gpu: CuPy sees no CUDA device")
        self.cupy = cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    def put(self, a: Any) -> Any:
        """A device copy of a NumPy array (other values pass through)."""
        if not isinstance(a, np.ndarray):
            return a
        if self.cupy is not None:
            return self.cupy.asarray(a)
        from numba import cuda
        return cuda.to_device(a)

    def sync(self) -> None:
        from numba import cuda
        if self.cupy is not None:
            self.cupy.cuda.get_current_stream().synchronize()
        cuda.synchronize()

    def copier(self, nbytes: int) -> Callable[[], None]:
        """A device-to-device copy of ``nbytes`` bytes."""
        src = self.put(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8))
        dst = self.put(np.empty(nbytes, np.uint8))
        if self.cupy is not None:
            return lambda: self.cupy.copyto(dst, src)
        return lambda: dst.copy_to_device(src)


def _to_host(x: Any) -> Any:
    from ...kernels.arrays import is_gpu_array, to_host
    if isinstance(x, tuple):
        return tuple(_to_host(v) for v in x)
    return to_host(x) if is_gpu_array(x) else x


def _same(a: Any, b: Any, rtol: float) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y, rtol) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        return bool(np.array_equal(a, b) if rtol == 0 else np.allclose(a, b, rtol=rtol, atol=0))
    return a == b if rtol == 0 else abs(float(a) - float(b)) <= rtol * abs(float(b))


# ------------------------------------------------------------------ cases
@dataclass
class GpuCase:
    """One GPU kernel at one size: its dispatch name and host arguments."""

    label: str
    kernel: str
    input_bytes: int
    args: tuple
    into: int | None = None          # index of the output argument a ``*_into`` kernel writes
    pick: Callable[[Any], Any] = lambda r: r   # the part of the return value to compare
    rtol: float = 0.0
    library: Callable[[tuple], Callable[[], Any]] | None = None   # device args -> timed call
    library_label: str = ""
    note: str = ""


def build_cases(n: int, density: float, device: Device) -> list[GpuCase]:
    """The GPU kernels with the inputs of ``hvdc bench kernels`` (same generator seeds)."""
    from ...kernels import bloom, quantize, rle, selection
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    k = max(1, int(density * n))
    thr = selection.kth_largest_abs(x, k)
    scale = 1.0 / float(np.linalg.norm(x.astype(np.float64)))
    torch = _torch_on_device(device)

    def topk(dargs: tuple) -> Callable[[], Any]:
        t = torch.from_dlpack(dargs[0])
        return lambda: torch.topk(t.abs(), k, sorted=False)

    def dense_add(dargs: tuple) -> Callable[[], Any]:
        a32, b32 = device.put(x), device.put(x[::-1].copy())
        out = device.cupy.empty_like(a32)
        return lambda: device.cupy.add(a32, b32, out=out)

    lib_topk = topk if torch is not None else None
    lib_add = dense_add if device.cupy is not None else None
    cases = [
        GpuCase("select_by_threshold", "select_by_threshold", x.nbytes, (x, thr),
                library=lib_topk, library_label=f"torch.topk(k={k}) on the device", note=f"density {density:g}"),
        GpuCase("count_at_least", "count_at_least", x.nbytes, (x, thr)),
        GpuCase("kth_largest_abs (exact)", "kth_largest_abs", x.nbytes, (x, k),
                library=lib_topk, library_label="torch.topk on the device"),
        GpuCase("gaussian_threshold (estimate)", "gaussian_threshold", x.nbytes, (x, density), rtol=1e-9),
    ]
    ranks = 8
    coo_idx = np.concatenate([np.sort(rng.choice(n, k, replace=False)) for _ in range(ranks)])
    coo_val = rng.standard_normal(coo_idx.size).astype(np.float32)
    cases.append(GpuCase("coo_sum", "coo_sum", coo_idx.nbytes + coo_val.nbytes, (coo_idx, coo_val),
                         note=f"{ranks} ranks x k={k} COO entries"))
    q8 = quantize.linear_quantize(x, scale, 127, KEY)
    codes = quantize.exp_quantize(x, scale / 4, 8, KEY)
    nib = (codes & 15).astype(np.uint8)
    packed = quantize.pack_nibbles(nib)
    pa = quantize.pack_nibbles(rng.integers(-4, 4, n).astype(np.int8))
    pb = quantize.pack_nibbles(rng.integers(-4, 4, n).astype(np.int8))
    c1 = quantize.exp_quantize(x, scale / 8, 8, KEY)
    c2 = quantize.exp_quantize(x[::-1].copy(), scale / 8, 8, KEY + 1)
    p1 = quantize.pack_nibbles(quantize.exp_quantize(x, scale / 8, 4, KEY))
    p2 = quantize.pack_nibbles(quantize.exp_quantize(x[::-1].copy(), scale / 8, 4, KEY + 1))
    cases += [
        GpuCase("linear_quantize (s=127)", "linear_quantize", x.nbytes, (x, scale, 127, KEY)),
        GpuCase("linear_dequantize", "linear_dequantize", q8.nbytes, (q8, scale / 127)),
        GpuCase("exp_quantize (8-bit)", "exp_quantize", x.nbytes, (x, scale, 8, KEY)),
        GpuCase("exp_dequantize (8-bit)", "exp_dequantize", codes.nbytes, (codes, scale, 8)),
        GpuCase("pack_nibbles", "pack_nibbles", nib.nbytes, (nib,)),
        GpuCase("unpack_nibbles", "unpack_nibbles", packed.nbytes, (packed, 2 * packed.size)),
        GpuCase("nibble_add (4-bit sum)", "nibble_add_into", pa.nbytes + pb.nbytes,
                (pa, pb, np.empty_like(pa)), into=2, note="n nibbles per operand"),
        GpuCase("exp_reduce (8-bit)", "exp_reduce8_into", c1.nbytes + c2.nbytes,
                (c1, c2, np.empty_like(c1), np.uint64(KEY), np.uint64(0)), into=2, library=lib_add,
                library_label=f"cupy.add float32, {n} elements"),
        GpuCase("exp_reduce (4-bit packed)", "exp_reduce4_into", p1.nbytes + p2.nbytes,
                (p1, p2, np.empty_like(p1), np.uint64(KEY), np.uint64(0)), into=2, library=lib_add,
                library_label=f"cupy.add float32, {n} elements", note="n codes, 2 per byte"),
    ]
    seed = np.uint64(1234567)
    sel_idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    m_bits, h = 10 * k, 4
    filt = bloom.bloom_insert(sel_idx, m_bits, h, np.uint64(seed))
    runs = rle.runs_from_sorted_indices(sel_idx, n)
    enc = rle.varint_encode(runs)
    cases += [
        GpuCase("bloom_insert", "bloom_insert", sel_idx.nbytes, (sel_idx, m_bits, h, seed),
                note=f"k={k} indices, m={m_bits} bits, h={h}"),
        GpuCase("bloom_query_range", "bloom_query_range", 8 * n, (filt, m_bits, h, seed, n),
                note="tests every i < n; input = n int64 indices"),
        GpuCase("runs_from_sorted_indices", "runs_from_sorted_indices", sel_idx.nbytes, (sel_idx, n)),
        GpuCase("indices_from_runs", "indices_from_runs", runs.nbytes, (runs, n), pick=lambda r: r[0]),
        GpuCase("varint_encode", "varint_encode", runs.nbytes, (runs,)),
        GpuCase("varint_decode", "varint_decode", enc.nbytes, (enc, runs.size), pick=lambda r: r[0]),
    ]
    cols = 1024
    mat = np.ascontiguousarray(x[: (n // cols) * cols].reshape(-1, cols))
    nrows = mat.shape[0]
    if nrows >= 2:
        chosen = np.sort(rng.choice(nrows, max(1, nrows // 10), replace=False)).astype(np.int64)
        block = np.ascontiguousarray(mat[chosen])
        cases += [
            GpuCase("gather_rows (10% rows)", "gather_rows", block.nbytes, (mat, chosen),
                    note=f"{nrows} x {cols} float32"),
            GpuCase("scatter_rows (10% rows)", "scatter_rows", mat.nbytes, (block, chosen, nrows),
                    note="writes the dense m x n output"),
            GpuCase("row_sq_norms", "row_sq_norms", mat.nbytes, (mat,), rtol=1e-6,
                    note="float32 sums in another order: equal to 1e-6"),
        ]
    return cases


def _torch_on_device(device: Device) -> Any:
    if device.cupy is None:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# ------------------------------------------------------------------ timing
@dataclass
class GpuResult:
    name: str
    n: int
    input_bytes: int
    gpu_s: float
    memcpy_s: float
    cpu_s: float
    same_as_cpu: bool
    library_s: float | None = None
    library_label: str = ""
    note: str = ""


def measure(n: int, case: GpuCase, device: Device, repeat: int) -> GpuResult:
    """Time the GPU kernel and a device copy (interleaved), the CPU kernel and the library call."""
    from ...kernels import dispatch
    gpu = dispatch.implementation(case.kernel, "gpu")
    cpu = dispatch.implementation(case.kernel, "cpu")
    dargs = tuple(device.put(a) for a in case.args)
    copy = device.copier(case.input_bytes)

    def on_gpu() -> Any:
        r = gpu(*dargs)
        device.sync()
        return r

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        device.sync()
        return time.perf_counter() - t0

    ret = on_gpu()                                    # warm-up: compiles the kernels
    got = _to_host(case.pick(dargs[case.into] if case.into is not None else ret))
    host_args = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in case.args)
    cret = cpu(*host_args)
    want = case.pick(host_args[case.into] if case.into is not None else cret)
    lib = case.library(dargs) if case.library is not None else None
    if lib is not None:
        lib()
    best = {"gpu": math.inf, "memcpy": math.inf, "cpu": math.inf, "lib": math.inf}
    copy()
    for r in range(repeat):
        best["gpu"] = min(best["gpu"], timed(on_gpu))
        best["memcpy"] = min(best["memcpy"], timed(copy))
        if r < 3:
            t0 = time.perf_counter()
            cpu(*host_args)
            best["cpu"] = min(best["cpu"], time.perf_counter() - t0)
            if lib is not None:
                best["lib"] = min(best["lib"], timed(lib))
    return GpuResult(case.label, n, case.input_bytes, best["gpu"], best["memcpy"], best["cpu"],
                     _same(got, want, case.rtol), best["lib"] if lib is not None else None,
                     case.library_label, case.note)


# ------------------------------------------------------------------ report
def write_markdown(results: list[GpuResult], path: Path, meta: dict[str, Any]) -> None:
    lines = ["# GPU kernel benchmark (`hvdc bench kernels-gpu`)", "",
             f"Device: {meta['device']}. {meta['note']}".rstrip(), "",
             f"Best of {meta['repeat']} synchronised calls after a warm-up call, kernel and device copy "
             f"interleaved; CPU kernel and library in the first 3 rounds ({meta['date']}).", "",
             "* **x memcpy** = GPU kernel time / device-to-device copy of its input bytes (1.0 = speed of light).",
             "* **x CPU** = CPU kernel time (host, same data) / GPU kernel time; **same** = identical output.",
             "* **x lib** = library time / GPU kernel time (> 1: the kernel is faster).", ""]
    lines += size_tables(results, "GPU ms", "x CPU", _table_row)
    path.write_text("\n".join(lines))


def _table_row(r: GpuResult) -> str:
    gbs = r.input_bytes / r.gpu_s / 1e9 if r.gpu_s > 0 else math.inf
    lib = (r.library_s / r.gpu_s) if r.library_s else None
    return (f"| {r.name} | {r.input_bytes / 1e6:.1f} | {r.gpu_s * 1e3:.3f} | {gbs:.1f} | "
            f"{_fmt_ratio(r.gpu_s / r.memcpy_s)} | {_fmt_ratio(r.cpu_s / r.gpu_s)} | "
            f"{'yes' if r.same_as_cpu else '**NO**'} | {r.library_label or '–'} | {_fmt_ratio(lib)} | {r.note} |")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm
    sizes, only = checked_args(args)
    device = Device()
    results: list[GpuResult] = []
    with tqdm(total=0, unit="kernel", desc="bench kernels-gpu") as bar:
        for n in sizes:
            cases = [c for c in build_cases(n, args.density, device)
                     if not only or c.kernel in only or c.label in only]
            bar.total += len(cases)
            bar.refresh()
            for case in cases:
                bar.set_postfix_str(f"{case.label} n={n:,}")
                results.append(measure(n, case, device, args.repeat))
                bar.update(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": device.name, "host": _machine(), "note": args.note, "repeat": args.repeat,
            "date": time.strftime("%Y-%m-%d"), "simulator": device.simulator}
    write_markdown(results, out, meta)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "results": [r.__dict__ for r in results]}, indent=1))
    bad = [f"{r.name} n={r.n}" for r in results if not r.same_as_cpu]
    print(f"wrote {out} and {out.with_suffix('.json')}" + (f"; GPU != CPU for {bad}" if bad else ""))
    return 1 if bad else 0


__all__ = ["Device", "GpuCase", "build_cases", "measure", "register_bench", "run"]
