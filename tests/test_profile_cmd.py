"""``hvdc profile`` on a user's own model (a small torchvision-style CNN, not one of the project's
models), run from a directory outside the repository, then ``hvdc model --profile`` on it."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_compress.tools.testing import mpi_env

ROOT = Path(__file__).resolve().parents[1]

USER_MODEL = '''
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(32 * 16, 128), nn.ReLU(), nn.Linear(128, 10))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
'''


def _hvdc(args, cwd, timeout):
    env = mpi_env({"PYTHONPATH": str(ROOT)})
    return subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.mpi
def test_profile_a_user_model_and_predict_from_it(tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "my_cnn.py").write_text(USER_MODEL)
    proc = _hvdc(["profile", "--script", "my_cnn.py", "--np", "2", "--methods", "powersgd",
                  "--steps", "2", "--warm", "1", "--out", "my_profile.json"], work, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    profile = json.loads((work / "my_profile.json").read_text())
    run = profile["runs"][0]
    assert run["world_size"] == 2 and run["model"] == "my_cnn" and run["device"] == "cpu"
    assert set(run["methods"]) == {"none", "powersgd"}

    # dense sends one ring allreduce of the model's float32 gradient per step: 2 * 4n (P-1)/P bytes
    spec = importlib.util.spec_from_file_location("my_cnn", work / "my_cnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    n = sum(p.numel() for p in module.build_model().parameters())
    dense = run["methods"]["none"]["ops"]["allreduce"]
    assert dense["sent"] == pytest.approx(2 * 4 * n * (2 - 1) / 2)
    # PowerSGD sends far fewer bytes than dense on the same model; both took time to compute
    low_rank = sum(max(o["sent"], o["received"]) for o in run["methods"]["powersgd"]["ops"].values())
    assert 0 < low_rank < dense["sent"] / 2
    for m in run["methods"].values():
        assert m["compute_cpu_s"] > 0 and m["compress_cpu_s"] >= 0

    out = _hvdc(["model", "--profile", "my_profile.json", "--network", "1gbe", "--ranks", "4", "64"],
                work, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "measured at P=2 profile, model my_cnn on cpu" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "(1.00x)" in rows["none"] and "powersgd" in rows
    assert "Recommended" in text


def test_profile_script_errors_are_clear(tmp_path, monkeypatch, capsys):
    from horovod_compress.tools.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text("def build_model():\n    return None\n")
    for argv, words in [(["--script", "bad.py"], "must define batch"),
                        (["--script", "missing.py"], "no such file"),
                        (["--script", "bad.py", "--methods", "nope"], "unknown method 'nope'")]:
        with pytest.raises(SystemExit) as info:
            main(["profile", "--np", "1", *argv])
        assert info.value.code == 2 and words in capsys.readouterr().err, argv


def test_device_plumbing_moves_model_and_batches_and_keeps_wall_times(tmp_path):
    """What ``--device cuda`` changes, checked on PyTorch's ``meta`` device (no GPU here): the
    model and every batch go to the device, and the profile keeps wall times, not CPU times."""
    torch = pytest.importorskip("torch")
    from horovod_compress.tools.bench.profile_cmd import _kept
    from horovod_compress.tools.bench.workload import script_workload
    (tmp_path / "my_cnn.py").write_text(USER_MODEL)
    workload = script_workload(tmp_path / "my_cnn.py", device="meta")
    model = workload.model()
    assert all(p.device.type == "meta" for p in model.parameters())
    x, y = workload.step_batch(1, 3)
    assert x.device.type == y.device.type == "meta" and x.shape == (8, 3, 32, 32)
    assert workload.loss(model, x, y).device.type == "meta"
    summary = {"compute_s": 0.5, "compress_s": 0.25, "compute_cpu_s": 0.01, "compress_cpu_s": 0.02}
    assert _kept(summary, "cuda")["compute_cpu_s"] == 0.5 and _kept(summary, "cuda")["compress_cpu_s"] == 0.25
    assert _kept(summary, "cpu")["compute_cpu_s"] == 0.01 and _kept(summary, "cpu")["compress_cpu_s"] == 0.02
