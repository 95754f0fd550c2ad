"""``hvdc bench qsgd`` -- Global-QSGD's compute costs against memcpy and MPI_SUM, in one run.

Measured on rank 0, for N float32 elements (best of ``--repeat`` runs after
a warm-up), all in the same process so the baselines share the machine state:

* baselines: ``memcpy`` of N float32 (``np.copyto``) and ``MPI_SUM`` of N
  float32 (``MPI.SUM.Reduce_local``: the reduction an allreduce applies, without
  the network) -- the paper's gamma is 4N / t(MPI_SUM);
* quantize + dequantize of each variant (exp8, exp4, lin8, lin4): local norm,
  stochastic rounding, packing; then unpacking and dequantizing -- with the
  kernels ``global_qsgd`` runs on NumPy arrays (exp8: the 16-bit-draw quantizer
  ``qsgd_fused.exp8_quantize_range`` and ``exp8_dequantize_range``; the others:
  ``kernels.quantize``'s);
* the reduction operator each variant's allreduce applies to its N-element
  payload and another rank's (the codes of a second gradient, so exponents differ
  as they do between ranks): Algorithm 2 as ``MPI.Op.Create`` operator (exp8, exp4), int8
  ``MPI_SUM`` (lin8), the packed-nibble sum operator (lin4), via ``Reduce_local``;
  for exp8 also the kernel the pipelined ring calls directly on each segment
  (``exp_reduce8_lanes_range``: Algorithm 2 on 8 byte lanes per word, row
  "exp8, ring kernel"), which is what the method runs on payloads >= 64 KiB.

Each is reported as a time ratio to memcpy and to MPI_SUM, plus the paper's
performance-model inputs: omega = gamma / gamma_hat = rho * t(op) / t(MPI_SUM),
delta = t(quantize + dequantize) / (4N) seconds per gradient byte, rho = 4 or 8.

With ``--np P`` (default 2) the ranks also time whole allreduces: a float32
``MPI_Allreduce`` against ``global_qsgd.allreduce`` end to end (norm, quantize,
reduce, dequantize). On a shared-memory machine with few cores this mostly
measures compute, so read it next to ``hvdc bench qsgd-model``.

Writes ``qsgd.md``, ``qsgd.json`` and ``qsgd.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .idle_barrier import idle_barrier
from .launch import relaunch, under_mpi_launcher
from .machine import platform_summary
from .report_files import save_figure, write_report

VARIANTS = {
    "exp8": {"dithering": "exponential", "bits": 8},
    "exp4": {"dithering": "exponential", "bits": 4},
    "lin8": {"dithering": "linear", "bits": 8},
    "lin4": {"dithering": "linear", "bits": 4},
}


def best_time(fn: Callable[[], Any], repeat: int) -> float:
    """Shortest wall time of ``fn()`` over ``repeat`` runs, after one warm-up run.

    The minimum, not the median: on a shared machine other processes only ever
    add time, and baselines and variants are treated alike.
    """
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(min(times))


def _variant_kernels(name: str, x: np.ndarray, world_size: int) -> dict[str, Callable[[], Any]]:
    """Closures for quantize, dequantize and the payload reduction of variant ``name``."""
    from mpi4py import MPI

    from ...compressors.global_qsgd import exp_shift, linear_levels
    from ...kernels.quantize import (
        abs_max,
        exp_dequantize,
        exp_quantize,
        linear_dequantize,
        linear_quantize,
        pack_nibbles,
        unpack_nibbles,
    )
    from ...kernels.qsgd_fused import exp8_dequantize_range, exp8_quantize_range
    from ...mpi_collectives.reduce_ops import exp_sum_op, nibble_sum_op, reduce_stream
    n = x.size
    bits = VARIANTS[name]["bits"]
    key = 12345
    other_x = np.random.default_rng(1).standard_normal(n).astype(x.dtype)   # another rank's
    if VARIANTS[name]["dithering"] == "exponential":
        c = exp_shift(bits, world_size, 16 if bits == 8 else 0)

        def codes_of(v: np.ndarray, k: int) -> np.ndarray:
            scale = 2.0 ** -c / abs_max(v)
            if bits == 4:
                return pack_nibbles(exp_quantize(v, scale, bits, k))
            codes = np.empty(n, dtype=np.uint8)   # the method's 8-bit kernel (16-bit draws)
            exp8_quantize_range(v, scale, np.uint64(k), codes, 0, n)
            return codes

        def quantize() -> np.ndarray:
            return codes_of(x, key)

        payload = quantize()

        def dequantize() -> np.ndarray:
            if bits == 4:
                return exp_dequantize(unpack_nibbles(payload, n), 2.0 ** c, bits)
            out = np.empty(n, dtype=np.float32)
            exp8_dequantize_range(payload, 2.0 ** c, out, 0, n)
            return out

        other = codes_of(other_x, key + 1)
        op = exp_sum_op(bits)

        def reduce() -> None:
            inout = other.copy()
            with reduce_stream(7):
                op.Reduce_local(payload, inout)

        if bits == 8:   # what the pipelined ring runs on each received segment (no MPI.Op)
            from ...kernels.exp_reduce import exp_reduce8_lanes_range
            ring_out = np.empty_like(other)

            def reduce_ring() -> None:
                exp_reduce8_lanes_range(payload, other, ring_out, np.uint64(7), 0, payload.size)
    else:
        s = linear_levels(bits, world_size)

        def levels_of(v: np.ndarray, k: int) -> np.ndarray:
            q = linear_quantize(v, 1.0 / abs_max(v), s, k)
            return q if bits == 8 else pack_nibbles(q)

        def quantize() -> np.ndarray:
            return levels_of(x, key)

        payload = quantize()

        def dequantize() -> np.ndarray:
            q = payload if bits == 8 else unpack_nibbles(payload, n, signed=True)
            return linear_dequantize(q, 1.0 / s)

        other = levels_of(other_x, key + 1)
        op = MPI.SUM if bits == 8 else nibble_sum_op()

        def reduce() -> None:
            inout = other.copy()
            op.Reduce_local(payload, inout)
    out = {"quantize": quantize, "dequantize": dequantize, "reduce": reduce,
           "payload_bytes": payload.nbytes, "copy_bytes": other.nbytes}
    if VARIANTS[name]["dithering"] == "exponential" and bits == 8:
        out["reduce_ring"] = reduce_ring
    return out


def local_measurements(n: int, repeat: int, world_size: int) -> dict[str, Any]:
    """Rank-local timings of one size: baselines, every variant's kernels and operator."""
    from mpi4py import MPI
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    dst = np.empty_like(x)
    t_memcpy = best_time(lambda: np.copyto(dst, x), repeat)
    acc = x.copy()
    t_sum = best_time(lambda: MPI.SUM.Reduce_local(x, acc), repeat)
    # the operators' timings include copying the inout buffer; subtract it for both sides
    row: dict[str, Any] = {"n": n, "memcpy_s": t_memcpy, "mpi_sum_float32_s": t_sum,
                           "gamma_float32_sum": 4.0 * n / t_sum, "variants": {}}
    for name in VARIANTS:
        k = _variant_kernels(name, x, world_size)
        t_q = best_time(k["quantize"], repeat)
        t_d = best_time(k["dequantize"], repeat)
        buf = np.empty(k["copy_bytes"], np.uint8)
        t_copy = best_time(lambda: buf.copy(), repeat)
        t_op = max(best_time(k["reduce"], repeat) - t_copy, 1e-9)
        rho = 4.0 * n / k["payload_bytes"]
        row["variants"][name] = {
            "quantize_s": t_q, "dequantize_s": t_d, "reduce_op_s": t_op,
            "payload_bytes": k["payload_bytes"], "rho": rho,
            "qd_over_memcpy": (t_q + t_d) / t_memcpy, "qd_over_mpi_sum": (t_q + t_d) / t_sum,
            "op_over_memcpy": t_op / t_memcpy, "op_over_mpi_sum": t_op / t_sum,
            "omega": rho * t_op / t_sum, "delta": (t_q + t_d) / (4.0 * n),
            "qd_melem_per_s": n / (t_q + t_d) / 1e6, "op_melem_per_s": n / t_op / 1e6,
        }
        if "reduce_ring" in k:   # the ring's direct kernel: no callback, no inout copy
            t_ring = best_time(k["reduce_ring"], repeat)
            row["variants"][name].update({
                "ring_op_s": t_ring, "ring_op_over_memcpy": t_ring / t_memcpy,
                "ring_op_over_mpi_sum": t_ring / t_sum, "ring_omega": rho * t_ring / t_sum})
    return row


def allreduce_measurements(comm: Any, n: int, repeat: int) -> dict[str, Any]:
    """Whole allreduces on all ranks: float32 MPI_Allreduce vs global_qsgd end to end."""
    from mpi4py import MPI

    from ...compressors.registry import create
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    out = np.empty_like(x)

    def timed(fn: Callable[[], Any]) -> float:
        """Best over ``repeat`` runs of the slowest rank's time (each run starts at a barrier)."""
        fn()
        best = float("inf")
        for _ in range(repeat):
            comm.comm.Barrier()
            t0 = time.perf_counter()
            fn()
            best = min(best, comm.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        return best

    row: dict[str, Any] = {"n": n, "world_size": comm.size,
                           "mpi_allreduce_float32_s": timed(
                               lambda: comm.comm.Allreduce(x, out, op=MPI.SUM)),
                           "variants": {}}
    for name, kw in VARIANTS.items():
        try:
            method = create("global_qsgd", **kw)
            method.plan(comm.size)
        except ValueError as exc:  # e.g. linear 4-bit beyond 7 ranks
            row["variants"][name] = {"error": str(exc)}
            continue
        t = timed(lambda: method.allreduce(x, "bench", comm))
        row["variants"][name] = {"seconds": t, "over_float32": t / row["mpi_allreduce_float32_s"]}
    return row


def format_report(res: dict[str, Any]) -> str:
    lines = ["# Global-QSGD compute costs (`hvdc bench qsgd`)", "",
             f"Machine: {res['machine']}; {res['world_size']} rank(s); best of "
             f"{res['repeat']} runs. Ratios are times relative to a float32 memcpy and to a "
             "float32 MPI_SUM (`Reduce_local`) of the same element count, measured in the same run. "
             "omega = rho t(op) / t(MPI_SUM) and delta = t(q+dq) / 4N are the inputs of the "
             "paper's performance model (`hvdc bench qsgd-model`).", ""]
    for row in res["local"]:
        n = row["n"]
        lines += [f"## N = {n:,} elements", "",
                  f"memcpy {row['memcpy_s'] * 1e3:.3f} ms, MPI_SUM float32 "
                  f"{row['mpi_sum_float32_s'] * 1e3:.3f} ms "
                  f"(gamma = {row['gamma_float32_sum'] / 1e9:.2f} GB/s)", "",
                  "| variant | quantize (ms) | dequantize (ms) | q+dq / memcpy | q+dq / MPI_SUM "
                  "| reduce op (ms) | op / memcpy | op / MPI_SUM | omega | delta (ns/B) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, v in row["variants"].items():
            lines.append(
                f"| {name} | {v['quantize_s'] * 1e3:.3f} | {v['dequantize_s'] * 1e3:.3f} | "
                f"{v['qd_over_memcpy']:.1f}x | {v['qd_over_mpi_sum']:.1f}x | "
                f"{v['reduce_op_s'] * 1e3:.3f} | {v['op_over_memcpy']:.1f}x | "
                f"{v['op_over_mpi_sum']:.2f}x | {v['omega']:.1f} | {v['delta'] * 1e9:.2f} |")
            if "ring_op_s" in v:
                lines.append(
                    f"| {name}, ring kernel | | | | | {v['ring_op_s'] * 1e3:.3f} | "
                    f"{v['ring_op_over_memcpy']:.1f}x | {v['ring_op_over_mpi_sum']:.2f}x | "
                    f"{v['ring_omega']:.1f} | |")
        lines.append("")
    if res.get("allreduce"):
        lines += ["## Whole allreduce (all ranks)", "",
                  "| N | ranks | float32 MPI_Allreduce (ms) | "
                  + " | ".join(f"{v} (ms, x float32)" for v in VARIANTS) + " |",
                  "|---:|---:|---:|" + "---:|" * len(VARIANTS)]
        for row in res["allreduce"]:
            cells = []
            for name in VARIANTS:
                v = row["variants"][name]
                cells.append("n/a" if "error" in v else
                             f"{v['seconds'] * 1e3:.3f} ({v['over_float32']:.1f}x)")
            lines.append(f"| {row['n']:,} | {row['world_size']} | "
                         f"{row['mpi_allreduce_float32_s'] * 1e3:.3f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    row = max(res["local"], key=lambda r: r["n"])
    names = list(row["variants"])
    cols = [("qd_over_memcpy", "quantize+dequantize / memcpy"),
            ("qd_over_mpi_sum", "quantize+dequantize / MPI_SUM"),
            ("op_over_memcpy", "reduction op / memcpy"),
            ("op_over_mpi_sum", "reduction op / MPI_SUM")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(cols)
    for j, (key, label) in enumerate(cols):
        vals = [row["variants"][nm][key] for nm in names]
        ax.bar(np.arange(len(names)) + (j - len(cols) / 2 + 0.5) * width, vals, width, label=label)
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("time ratio (log)")
    ax.set_title(f"Global-QSGD kernels, N = {row['n']:,} float32 elements")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    if args.np > 1 and not under_mpi_launcher():
        return relaunch(args.np, "horovod_compress.tools.cli", sys.argv[1:])
    from ...mpi_collectives import Communicator
    comm = Communicator()
    res: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "func"},
                           "machine": platform_summary(),
                           "world_size": comm.size, "repeat": args.repeat, "local": [],
                           "allreduce": []}
    if comm.rank == 0:
        res["local"] = [local_measurements(n, args.repeat, max(comm.size, 2)) for n in args.sizes]
    idle_barrier(comm, 0.002)
    if comm.size > 1:
        res["allreduce"] = [allreduce_measurements(comm, n, args.repeat) for n in args.sizes]
    if comm.rank != 0:
        return 0
    write_report(Path(args.out), "qsgd", res, format_report, plot)
    return 0


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("qsgd", help="Global-QSGD: quantize/dequantize and reduce-operator speed "
                                    "vs memcpy and MPI_SUM",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks for the whole-allreduce timing (default 2)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20],
                   help="element counts (default 65536 1048576)")
    p.add_argument("--repeat", type=int, default=7, help="timed runs per measurement (default 7)")
    p.add_argument("--out", default="benchmarks", help="folder for qsgd.md/json/png")
    p.set_defaults(func=run)


__all__ = ["allreduce_measurements", "local_measurements", "best_time", "register_bench", "run"]
