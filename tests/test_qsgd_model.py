"""Global-QSGD's performance model (section 7, equation 10) and the ``hvdc bench qsgd`` commands."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from horovod_compress.tools.bench.qsgd_model import (
    bandwidth_threshold,
    dense_allreduce_time,
    evaluate,
    gqsgd_allreduce_time,
    measured_speeds,
)
from horovod_compress.tools.testing import mpi_env


def test_equation_10_reproduces_the_papers_numbers():
    """omega_E = 79, rho = 4: speed-up iff beta < 6 gamma / 75 = 0.08 gamma (160 GB/s on an A100)."""
    gamma = 2e12
    star = bandwidth_threshold(gamma, omega=79, rho=4)
    assert star == pytest.approx(0.08 * gamma) and star == pytest.approx(6 * gamma / (79 - 4))
    assert 53.9e9 < star and 5.4e9 < star  # both of the paper's interconnects qualify
    # omega_L = 1 < rho: linear dithering speeds up at every bandwidth ("since beta > 0")
    assert math.isinf(bandwidth_threshold(gamma, omega=1, rho=4))
    assert math.isinf(bandwidth_threshold(gamma, omega=4, rho=4))
    # 4-bit: rho = 8 -> beta* = 2 gamma 7 / (omega - 8)
    assert bandwidth_threshold(gamma, omega=79, rho=8) == pytest.approx(14 * gamma / 71)


@pytest.mark.parametrize("delta,n", [(0.0, 16), (3e-9, 2), (3e-9, 64)])
def test_threshold_agrees_with_the_time_formulas(delta, n):
    """Just below beta* Global-QSGD is faster, just above it is slower (appendix A.5 algebra)."""
    gamma, omega, rho, size, alpha = 20e9, 50.0, 4.0, 25e6, 5e-6
    star = bandwidth_threshold(gamma, omega, rho, delta, n)
    assert math.isfinite(star) and star > 0
    for beta, faster in ((star * 0.99, True), (star * 1.01, False)):
        dense = dense_allreduce_time(n, size, alpha, beta, gamma)
        quant = gqsgd_allreduce_time(n, size, alpha, beta, gamma, omega, rho, delta)
        assert (quant < dense) == faster, (beta, dense, quant)
    # the terms themselves: log2(n) (2 alpha + 2 S / beta + S / gamma)
    lg = math.log2(n)
    assert dense_allreduce_time(n, size, alpha, 1e9, gamma) == pytest.approx(
        lg * (2 * alpha + 2 * size / 1e9 + size / gamma))
    assert gqsgd_allreduce_time(n, size, alpha, 1e9, gamma, omega, rho, delta) == pytest.approx(
        lg * (2 * alpha + 2 * size / rho / 1e9 + size / rho * omega / gamma) + delta * size)
    res = evaluate(n, size, alpha, [star / 10, star * 10], gamma, omega, rho, delta)
    assert res[0].speedup > 1 > res[1].speedup


def test_model_rejects_bad_inputs():
    with pytest.raises(ValueError, match="workers must be >= 2"):
        dense_allreduce_time(1, 1e6, 0, 1e9, 1e9)
    with pytest.raises(ValueError, match="rho must be > 1"):
        bandwidth_threshold(1e9, 10, 1.0)
    with pytest.raises(ValueError, match="n is needed when delta > 0"):
        bandwidth_threshold(1e9, 10, 4.0, delta=1e-9)  # n needed when delta > 0


def test_bench_and_model_commands(tmp_path):
    """``hvdc bench qsgd`` (one rank, tiny) writes its files; ``qsgd-model`` reads them back."""
    env = mpi_env()
    cmd = [sys.executable, "-m", "horovod_compress.tools.cli", "bench", "qsgd", "--np", "1",
           "--sizes", "8192", "--repeat", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((tmp_path / "qsgd.json").read_text())
    row = res["local"][0]
    assert row["n"] == 8192 and set(row["variants"]) == {"exp8", "exp4", "lin8", "lin4"}
    for name, v in row["variants"].items():
        assert v["rho"] == (4.0 if name.endswith("8") else 8.0)
        assert v["omega"] == pytest.approx(v["rho"] * v["reduce_op_s"] / row["mpi_sum_float32_s"])
        assert v["qd_over_memcpy"] > 0 and v["op_over_mpi_sum"] > 0
    assert (tmp_path / "qsgd.md").exists() and (tmp_path / "qsgd.png").stat().st_size > 0
    speeds = measured_speeds(tmp_path / "qsgd.json", "exp8")
    assert speeds["rho"] == 4.0 and speeds["gamma"] == row["gamma_float32_sum"]
    out = tmp_path / "model.md"
    proc = subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", "bench", "qsgd-model",
                           "--from", str(tmp_path / "qsgd.json"), "--workers", "8",
                           "--bandwidth", "1", "10", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the table against the paper's equations evaluated here (section 7: tree allreduce,
    # depth 2 log2 n), from the measured speeds and the command's defaults (S = 25 MB, alpha = 5 us)
    n, size, alpha = 8, 25e6, 5e-6
    g, omega, delta, rho = (speeds[k] for k in ("gamma", "omega", "delta", "rho"))
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
             for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line}
    lg = math.log2(n)
    for beta_gbs in ("1", "10"):
        beta = float(beta_gbs) * 1e9
        dense = 2 * lg * alpha + 2 * lg * size / beta + lg * size / g
        gqsgd = 2 * lg * alpha + 2 * lg * size / rho / beta + lg * size / rho * omega / g + delta * size
        assert table[beta_gbs] == [f"{dense * 1e3:.4g}", f"{gqsgd * 1e3:.4g}",
                                   f"{dense / gqsgd:.3g}x"], (beta_gbs, table[beta_gbs])
    proc = subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", "bench", "qsgd-model",
                           "--paper"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "beta < 160 GB/s = 0.08 gamma" in proc.stdout, proc.stdout
