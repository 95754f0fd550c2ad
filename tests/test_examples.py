"""Every example in examples/ runs, at a small size (2 ranks, 1 epoch).

The Slurm batch script cannot run here: it is checked for syntax (``bash -n``)
and its ``srun`` line is run with ``mpirun -np 2`` in place of ``srun`` and its
options, with the script's arguments replaced by small ones.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_compress.tools.testing import mpi_env, mpirun_command
from horovod_compress.tools.testing_plugin import needs_horovod

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SMALL = ["--epochs", "1"]

pytestmark = pytest.mark.mpi


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: int = 300) -> str:
    env = env or mpi_env()
    env.pop("HVDC_LAUNCHED", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    # Keras' progress bar can leave ANSI colour resets in piped output (seen in CI)
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)


def test_pytorch_example_cnn_two_ranks():
    out = _run(mpirun_command(2) + [sys.executable, "examples/pytorch_digits.py", "--model", "cnn",
                                    "--compression", "oktopk", "--param", "density=0.05", *SMALL])
    assert "epoch   1  test accuracy" in out and "KiB sent per rank per step" in out


def test_tf_gradient_tape_example_graph_mode():
    out = _run(mpirun_command(2) + [sys.executable, "examples/tf_gradient_tape.py", "--graph",
                                    "--compression", "topk", "--param", "density=0.1", *SMALL])
    assert "epoch   1  test accuracy" in out


def test_keras_example():
    # no dense warm-up epoch, so the one epoch run here is compressed
    out = _run(mpirun_command(2) + [sys.executable, "examples/keras_digits.py", "--compression", "topk",
                                    "--density", "0.1", "--warmup-epochs", "0", *SMALL])
    assert "on 2 ranks" in out
    row = re.search(r"^\s*1\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", out, re.M)
    assert row, out
    assert float(row.group(3)) > 2, f"Top-k 10% should send several times less than dense: {row.group(0)}"


@pytest.mark.horovod
@needs_horovod
def test_horovodrun_example():
    bindir = str(Path(sys.executable).parent)
    env = mpi_env({"NP": "2", "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
                   "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    out = _run(["bash", "examples/horovodrun.sh", "--model", "mlp", "--compression", "topk", *SMALL], env=env)
    assert "on 2 ranks" in out


def _srun_line(script: Path) -> list[str]:
    """The script's ``srun`` command, continuation lines joined, split like the shell would."""
    text = script.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if re.match(r"\s*srun\s", line)]
    assert len(lines) == 1, f"expected one srun line in {script.name}, found {lines}"
    return shlex.split(lines[0])


def test_slurm_script_syntax_and_srun_line_under_mpirun():
    script = EXAMPLES / "slurm_daint.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "module load" in text
    words = _srun_line(script)
    assert words[0] == "srun"
    prog = next(i for i, w in enumerate(words) if w in ("python", "python3"))
    assert all(w.startswith("-") for w in words[1:prog]), f"srun options only before python: {words}"
    rest = [w for w in words[prog + 1:] if w != "$@"]
    assert "$@" in words, "the srun line passes the job's arguments through"
    out = _run(mpirun_command(2) + [sys.executable, *rest, "--model", "mlp", "--compression", "global_qsgd",
                                    *SMALL])
    assert "on 2 ranks" in out
