"""DDP comm hooks and the torch.distributed communicator on real ranks (issue 17).

One ``torchrun`` launch per world size (2 and 4 ranks, gloo, mpi4py blocked
inside the ranks) runs tests/cases/ddp_cases.py's ``ddp`` mode: every method
as a DDP comm hook on a small MLP (records of every hook call's input and
output, byte counts), PyTorch's ``powerSGD_hook`` against ours, checkpoint
round trips, the communicator's primitives. One ``mpirun`` launch then feeds
the recorded inputs, in order, to the same methods on the mpi4py communicator
and compares outputs and byte counts. A third launch (2 ranks) trains the
digits MLP under DDP with each method. Each check is reported by name.
Last, examples/ddp_digits.py runs and resumes from its checkpoint bit for
bit, and ``hvdc train --launcher torchrun`` relaunches itself and trains.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_compress.testing import mpi_env, mpirun_command

CASES = Path(__file__).parent / "cases" / "ddp_cases.py"
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX_", "HVDC_LAUNCHED"))}
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONHASHSEED="0",
               HVDC_ABORT_ON_EXCEPTION="0", TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def torchrun(nprocs: int, mode: str, out: Path, timeout: float = 420) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(CASES), mode, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                          cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun -nproc-per-node {nprocs} {mode} failed "
                             f"(exit {proc.returncode})\n--- stdout ---\n{proc.stdout[-6000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")


def mpirun(nprocs: int, mode: str, out: Path, timeout: float = 300) -> None:
    cmd = mpirun_command(nprocs) + [sys.executable, str(CASES), mode, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=mpi_env({"HVDC_ABORT_ON_EXCEPTION": "0"}), cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"mpirun -np {nprocs} {mode} failed (exit {proc.returncode})\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")


def failures(out: Path, mode: str, nprocs: int) -> dict[str, str]:
    bad = {}
    for r in range(nprocs):
        checks = json.loads((out / f"{mode}_rank{r}.json").read_text())["checks"]
        assert checks, f"rank {r}: no checks ran"
        bad.update({f"rank {r}: {k}": v for k, v in checks.items() if v != "ok"})
    return bad


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def ddp_run(request, tmp_path_factory):
    pytest.importorskip("torch.distributed")
    out = tmp_path_factory.mktemp(f"ddp{request.param}")
    torchrun(request.param, "ddp", out)
    return request.param, out


def _report(bad: dict[str, str]) -> str:
    return f"{len(bad)} failing check(s): {sorted(bad)}\n" + "\n".join(
        f"== {k}\n{v}" for k, v in sorted(bad.items())[:6])


def test_every_method_as_ddp_hook(ddp_run):
    """Every method trains 4 DDP steps as a comm hook with identical parameters on every rank;
    PyTorch's powerSGD_hook equals ours; checkpoints round-trip bit for bit; primitives; no MPI."""
    p, out = ddp_run
    bad = failures(out, "ddp", p)
    assert not bad, _report(bad)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun for the reference")
def test_mpi_equals_ddp(ddp_run):
    """The hook calls' recorded inputs through the mpi4py communicator give the same averages
    (bit for bit on 2 ranks; on 4, where the sums' order differs: 1e-4 relative for float32
    sums, one ulp per addition for fp16/bf16 sums, and for Global-QSGD's stochastic exponential
    reduce the same distance to the exact average) and the same byte counts as the DDP run on
    torch.distributed."""
    p, out = ddp_run
    mpirun(p, "replay", out)
    bad = failures(out, "replay", p)
    assert not bad, _report(bad)


def test_digits_converges_with_every_hook(tmp_path):
    """The digits MLP under DDP (2 ranks, 8 epochs) reaches >= 85% test accuracy with every
    method's hook, within 8 points of DDP's own dense allreduce, and compresses (> 1.5x)."""
    torchrun(2, "digits", tmp_path, timeout=600)
    bad = failures(tmp_path, "digits", 2)
    assert not bad, _report(bad)


def _run_torchrun_script(nprocs: int, args: list[str], timeout: float = 300) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_ddp_example_resumes_bit_for_bit(tmp_path):
    """examples/ddp_digits.py on 2 ranks: 2 epochs straight equal 1 epoch + --resume for 1 more
    (Top-k with per-rank error feedback; the checkpoint holds every rank's hook state)."""
    torch = pytest.importorskip("torch")
    common = ["examples/ddp_digits.py", "--compression", "topk", "--param", "density=0.05",
              "--param", "warmup_steps=1"]
    straight, split = tmp_path / "straight.pt", tmp_path / "split.pt"
    out = _run_torchrun_script(2, [*common, "--epochs", "2", "--checkpoint", str(straight)])
    assert "epoch 2: test accuracy" in out and "less than dense DDP" in out, out
    _run_torchrun_script(2, [*common, "--epochs", "1", "--checkpoint", str(split)])
    resumed = _run_torchrun_script(2, [*common, "--epochs", "2", "--checkpoint", str(split),
                                       "--resume"])
    assert "epoch 1:" not in resumed and "epoch 2:" in resumed, resumed
    a = torch.load(straight, weights_only=True)
    b = torch.load(split, weights_only=True)
    assert len(a["hvdc"]) == 2
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), f"{k} differs after resuming"
    # the same statistics line, too: bytes and calls continue across the restore
    assert out.splitlines()[-1] == resumed.splitlines()[-1], (out, resumed)


def test_hvdc_train_torchrun_launcher(tmp_path):
    """``hvdc train --np 2 --launcher torchrun`` relaunches itself under torchrun (whose parser
    must not see ``--np``) and trains the digits MLP with the method as a DDP hook."""
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "horovod_compress.cli", "train", "--np", "2", "--launcher",
           "torchrun", "--compression", "topk", "--param", "density=0.1", "--epochs", "1",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    res = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in res] == ["topk"] and res[0]["world_size"] == 2, res
    assert res[0]["launcher"] == "torchrun" and res[0]["compression_ratio"] > 2, res


def test_ddp_e2e_is_an_hvdc_bench_command():
    """``hvdc bench ddp-e2e --help`` reaches the benchmark's own options (nothing is run)."""
    proc = subprocess.run([sys.executable, "-m", "horovod_compress.cli", "bench", "ddp-e2e", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "--variants" in proc.stdout and "--bandwidth" in proc.stdout


def test_ddp_e2e_variants_and_page(tmp_path):
    """The DDP benchmark's variant syntax (``all``, ``hvdc_<method>:{json}``), its page and plot."""
    pytest.importorskip("matplotlib")
    from horovod_compress.bench import ddp_e2e

    everything = ddp_e2e.split_variants(ddp_e2e.expand_variants("all"))
    assert everything[:3] == ["ddp_dense", "torch_powerSGD_hook", "hvdc_powersgd"]
    assert len(everything) == 2 + len(ddp_e2e.ALL_HOOKS) and len(set(everything)) == len(everything)
    assert ddp_e2e.split_variants('ddp_dense,hvdc_topk:{"density": 0.01, "warmup_steps": 0}') == \
        ["ddp_dense", 'hvdc_topk:{"density": 0.01, "warmup_steps": 0}']
    assert ddp_e2e.parse_variant("hvdc_powersgd", 4) == ("powersgd", {"warmup_steps": 2, "rank": 4})
    assert ddp_e2e.parse_variant('hvdc_topk:{"density": 0.01}', 4) == \
        ("topk", {"density": 0.01, "warmup_steps": 1})
    assert ddp_e2e.parse_variant("hvdc_none", 4) == ("none", {})   # takes no warmup_steps
    res = {"world_size": 2, "model": "tiny", "rank": 4, "threads": 1, "bandwidth": "1gbit",
           "hosts": 2, "date": "now", "steps_per_round": 1, "load": [1.0, 2.0], "cores": 2,
           "variants": {"ddp_dense": {"median_s": 0.4, "p25_s": 0.39, "p75_s": 0.41, "steps": 3,
                                      "hook_median_s": None},
                        "torch_powerSGD_hook": {"median_s": 0.2, "p25_s": 0.19, "p75_s": 0.21,
                                                "steps": 3, "hook_median_s": 0.1},
                        "hvdc_powersgd": {"median_s": 0.16, "p25_s": 0.15, "p75_s": 0.17,
                                          "steps": 3, "hook_median_s": 0.08, "compression": 54.1}}}
    page = ddp_e2e.render(res)
    assert "| hvdc_powersgd | 160.0 | 150.0–170.0 | 80.0 | 2.50x | 0.80 | 54.1x | 3 |" in page, page
    assert "| ddp_dense | 400.0 | 390.0–410.0 | - | 1.00x | 2.00 | - | 3 |" in page, page
    assert "before / after: 1.00 / 2.00" in page
    assert ddp_e2e.plot(res, tmp_path / "p.png").stat().st_size > 1000
