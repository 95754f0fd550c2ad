"""Horovod interplay (needs the Horovod build from scripts/setup.sh), started with horovodrun -np 2."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CASES

from horovod_compress.testing import mpi_env

try:
    import horovod.torch  # noqa: F401
    HAVE_HOROVOD = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) is not None
except ImportError:
    HAVE_HOROVOD = False

pytestmark = [pytest.mark.horovod, pytest.mark.mpi,
              pytest.mark.skipif(not HAVE_HOROVOD, reason="Horovod is not built in this environment "
                                 "(scripts/setup.sh builds it; HVDC_SKIP_HOROVOD=1 skips it)")]


def horovodrun(args, tmp_path, timeout=600):
    exe = str(Path(sys.executable).parent / "horovodrun")
    env = mpi_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    env.pop("HVDC_LAUNCHED", None)
    proc = subprocess.run([exe, "-np", "2", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return proc.stdout


def test_our_compressors_inside_horovods_optimizer(tmp_path):
    out = tmp_path / "report.json"
    horovodrun([sys.executable, str(CASES / "horovod_torch_script.py"), str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert set(report) == {"fp16", "randk"}
    assert report["randk"] < 1e-6


def test_demo_runs_under_horovodrun(tmp_path):
    stdout = horovodrun([sys.executable, "-m", "horovod_compress.cli", "train", "--compression",
                         "topk", "--epochs", "2", "--out", str(tmp_path / "demo")], tmp_path)
    assert "| topk |" in stdout
    assert (tmp_path / "demo" / "results.json").exists()
    assert json.loads((tmp_path / "demo" / "results.json").read_text())[0]["world_size"] == 2
