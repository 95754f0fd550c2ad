"""``hvdc bench qsgd-model`` -- Global-QSGD's performance model (paper, section 7, equation 10).

Tree allreduce of S bytes over n workers (depth 2 log2 n; Thakur et al.):

    T_dense = 2 log2(n) alpha + 2 log2(n) S / beta + log2(n) S / gamma

with alpha the latency (s), beta the bandwidth (bytes/s) and gamma the speed of
the float32 reduction (bytes/s). Global-QSGD sends S_hat = S / rho bytes
(rho = 4 at 8 bits, 8 at 4 bits), reduces them at gamma_hat = gamma / omega,
and quantizes + dequantizes at delta seconds per byte of gradient:

    T_gqsgd = 2 log2(n) alpha + 2 log2(n) S_hat / beta + log2(n) S_hat / gamma_hat + delta S

Speed-up condition (appendix A.5, generalised to delta >= 0): T_gqsgd < T_dense iff

    2 (1 - 1/rho) / beta > delta / log2(n) + (omega - rho) / (rho gamma) =: A

so it holds for every bandwidth when A <= 0, and otherwise for
beta < beta* = 2 (rho - 1) / (rho A). With delta = 0 this is equation 10,
beta < 2 gamma (rho - 1) / (omega - rho) = 6 gamma / (omega - 4) at rho = 4 --
the paper's example: omega = 79 gives beta < 0.08 gamma.

The calculator takes alpha, beta, n, S and either measured speeds
(``--from benchmarks/qsgd.json``, written by ``hvdc bench qsgd``) or given
ones (``--gamma``, ``--omega``, ``--delta``), and says whether and how much
Global-QSGD speeds up the allreduce.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _log2n(n: int) -> float:
    if n < 2:
        raise ValueError(f"workers must be >= 2 for an allreduce to cost anything, got {n}")
    return math.log2(n)


def dense_allreduce_time(n: int, size: float, alpha: float, beta: float, gamma: float) -> float:
    """2 log2(n) alpha + 2 log2(n) S / beta + log2(n) S / gamma (seconds)."""
    lg = _log2n(n)
    return 2 * lg * alpha + 2 * lg * size / beta + lg * size / gamma


def gqsgd_allreduce_time(n: int, size: float, alpha: float, beta: float, gamma: float,
                         omega: float, rho: float, delta: float = 0.0) -> float:
    """2 log2(n) alpha + 2 log2(n) S/(rho beta) + log2(n) S omega/(rho gamma) + delta S (seconds)."""
    lg = _log2n(n)
    s_hat = size / rho
    return 2 * lg * alpha + 2 * lg * s_hat / beta + lg * s_hat * omega / gamma + delta * size


def bandwidth_threshold(gamma: float, omega: float, rho: float, delta: float = 0.0,
                        n: int | None = None) -> float:
    """beta* (bytes/s): Global-QSGD is faster iff beta < beta*; ``math.inf`` = at any bandwidth.

    Equation 10 for delta = 0: beta* = 2 gamma (rho - 1) / (omega - rho) when
    omega > rho, infinite otherwise. With delta > 0 (quantization not hidden)
    the worker count n enters through delta / log2(n).
    """
    if rho <= 1:
        raise ValueError(f"rho must be > 1 (compression), got {rho}")
    a = (omega - rho) / (rho * gamma)
    if delta:
        if n is None:
            raise ValueError("n is needed when delta > 0")
        a += delta / _log2n(n)
    if a <= 0:
        return math.inf
    return 2 * (rho - 1) / (rho * a)


@dataclass
class ModelResult:
    beta: float
    dense: float
    gqsgd: float

    @property
    def speedup(self) -> float:
        return self.dense / self.gqsgd


def evaluate(n: int, size: float, alpha: float, betas: list[float], gamma: float, omega: float,
             rho: float, delta: float) -> list[ModelResult]:
    """Dense and Global-QSGD allreduce times for each bandwidth in ``betas``."""
    return [ModelResult(b, dense_allreduce_time(n, size, alpha, b, gamma),
                        gqsgd_allreduce_time(n, size, alpha, b, gamma, omega, rho, delta))
            for b in betas]


def measured_speeds(path: Path, variant: str) -> dict[str, float]:
    """gamma, omega, delta, rho of ``variant`` from ``hvdc bench qsgd``'s JSON (largest size)."""
    res = json.loads(Path(path).read_text())
    row = max(res["local"], key=lambda r: r["n"])
    v = row["variants"][variant]
    return {"gamma": row["gamma_float32_sum"], "omega": v["omega"], "delta": v["delta"],
            "rho": v["rho"], "n_elements": row["n"], "source": str(path)}


def format_report(params: dict[str, Any], results: list[ModelResult], beta_star: float,
                  beta_star_eq10: float) -> str:
    g = params["gamma"]
    lines = [
        "# Global-QSGD performance model (paper section 7, equation 10)", "",
        f"n = {params['workers']} workers, S = {params['size'] / 1e6:g} MB, "
        f"alpha = {params['alpha'] * 1e6:g} us, gamma = {g / 1e9:.4g} GB/s (float32 reduction), "
        f"omega = gamma/gamma_hat = {params['omega']:.4g}, rho = {params['rho']:g}, "
        f"delta = {params['delta'] * 1e9:.4g} ns/byte (quantize + dequantize)"
        + (f"; speeds measured in {params['source']}" if params.get("source") else ""), "",
        "Equation 10 (delta = 0): Global-QSGD is faster for "
        + ("every bandwidth" if math.isinf(beta_star_eq10)
           else f"beta < {beta_star_eq10 / 1e9:.4g} GB/s = {beta_star_eq10 / g:.3g} gamma"),
        "With the measured delta: faster for "
        + ("every bandwidth" if math.isinf(beta_star) else f"beta < {beta_star / 1e9:.4g} GB/s"),
        "", "| bandwidth (GB/s) | dense allreduce (ms) | Global-QSGD (ms) | speed-up |",
        "|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.beta / 1e9:g} | {r.dense * 1e3:.4g} | {r.gqsgd * 1e3:.4g} | "
                     f"{r.speedup:.3g}x |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.paper:
        gamma, omega, rho, delta, source = 2e12, 79.0, 4.0, 0.0, "the paper (A100, omega_E = 79)"
        betas = [53.9e9, 5.4e9]
    else:
        speeds: dict[str, Any] = {}
        src = Path(args.from_json) if args.from_json else None
        if src is not None and src.exists():
            speeds = measured_speeds(src, args.variant)
        gamma = args.gamma * 1e9 if args.gamma is not None else speeds.get("gamma")
        omega = args.omega if args.omega is not None else speeds.get("omega")
        rho = args.rho if args.rho is not None else speeds.get("rho", 4.0)
        delta = args.delta * 1e-9 if args.delta is not None else speeds.get("delta", 0.0)
        if args.hide_quantization:
            delta = 0.0
        source = speeds.get("source", "")
        if gamma is None or omega is None:
            raise SystemExit("give --gamma and --omega, or --from a JSON written by 'hvdc bench qsgd'")
        betas = [b * 1e9 for b in args.bandwidth]
    params = {"workers": args.workers, "size": args.size * 1e6, "alpha": args.latency * 1e-6,
              "gamma": gamma, "omega": omega, "rho": rho, "delta": delta, "source": source}
    results = evaluate(args.workers, args.size * 1e6, args.latency * 1e-6, betas, gamma, omega,
                       rho, delta)
    star = bandwidth_threshold(gamma, omega, rho, delta, args.workers)
    star10 = bandwidth_threshold(gamma, omega, rho)
    report = format_report(params, results, star, star10)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
        print(f"wrote {args.out}")
    return 0


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("qsgd-model", help="Global-QSGD performance model (eq. 10): when does it pay?",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16, help="n (default 16)")
    p.add_argument("--size", type=float, default=25.0, help="gradient bucket S in MB (default 25)")
    p.add_argument("--latency", type=float, default=5.0, help="alpha in microseconds (default 5)")
    p.add_argument("--bandwidth", type=float, nargs="+",
                   default=[0.2, 1.25, 5.4, 12.5, 25.0, 53.9, 100.0],
                   help="beta values in GB/s (default: 1.6 Gb/s cloud .. NVLink)")
    p.add_argument("--from", dest="from_json", default="benchmarks/qsgd.json",
                   help="measured speeds from 'hvdc bench qsgd' (default benchmarks/qsgd.json)")
    p.add_argument("--variant", default="exp8", choices=["exp8", "exp4", "lin8", "lin4"],
                   help="which measured variant (default exp8)")
    p.add_argument("--gamma", type=float, help="float32 reduction speed in GB/s (overrides --from)")
    p.add_argument("--omega", type=float, help="gamma / gamma_hat (overrides --from)")
    p.add_argument("--rho", type=float, help="compression ratio S / S_hat (4 at 8 bits)")
    p.add_argument("--delta", type=float, help="quantize + dequantize time in ns per gradient byte")
    p.add_argument("--hide-quantization", action="store_true",
                   help="delta = 0, as the paper assumes (quantization overlapped)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's example: gamma = 2 TB/s, omega = 79, P2P 53.9 and SHM 5.4 GB/s")
    p.add_argument("--out", help="also write the report to this markdown file")
    p.set_defaults(func=run)


__all__ = ["bandwidth_threshold", "dense_allreduce_time", "evaluate", "gqsgd_allreduce_time",
           "measured_speeds", "register_bench"]
