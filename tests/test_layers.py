"""The layer rule (docs/architecture.md): import-linter's contracts hold, and one file cycle at most.

``lint-imports`` reads the contracts in ``pyproject.toml`` ([tool.importlinter]): the
layers from ``params``/``units`` up to ``tools``, PyTorch and Keras independent, the
library never importing the tooling, with the one listed exception (TensorFlow's
Horovod API reaching its Keras layer). The file cycles are counted on grimp's graph
(:mod:`horovod_compress.tools.import_graph`): only the TensorFlow/Keras pair may remain.

The rule is shown to bite: a copy of the package with one deliberate upward import
(the kernels importing the runtime, the codecs importing the tooling) fails
``lint-imports`` with the contract's name and the offending line.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_compress.tools import import_graph

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
ALLOWED_CYCLE = ["horovod_compress.keras.horovod_api", "horovod_compress.tensorflow.horovod_api"]


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: import-linter is a test dependency "
                    "(scripts/requirements.txt); run scripts/setup.sh")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd), "COLUMNS": "200"}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(cwd / "pyproject.toml")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold() -> None:
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout, proc.stdout


def test_at_most_the_tensorflow_keras_cycle_is_left() -> None:
    cycles = import_graph.file_cycles(import_graph.build_graph())
    assert cycles in ([], [ALLOWED_CYCLE]), cycles


def test_every_function_level_import_has_a_reason() -> None:
    """An import of the package's own modules inside a function defers something: a framework,
    MPI's start, or the command line's start-up time. One that defers nothing belongs at the top."""
    idle = [f"{i.path}:{i.line} imports {i.target}" for i in import_graph.function_level_imports()
            if i.reason.startswith("none")]
    assert not idle, "imports that could move to the top of their module:\n" + "\n".join(idle)


@pytest.mark.parametrize("file, line, contract", [
    ("kernels/arrays.py", "from ..runtime import buckets as _upward  # noqa: F401",
     "Each layer imports only its own folder and the layers below it"),
    ("codecs/wire.py", "from ..tools import testing as _upward  # noqa: F401",
     "The library never imports the tooling"),
])
def test_an_upward_import_breaks_the_contract(tmp_path: Path, file: str, line: str,
                                              contract: str) -> None:
    shutil.copytree(ROOT / "horovod_compress", tmp_path / "horovod_compress",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "horovod_compress" / file
    target.write_text(target.read_text() + "\n" + line + "\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0, proc.stdout
    broken = " ".join(proc.stdout[proc.stdout.index("Broken contracts"):].split())
    assert contract in broken, broken
    assert f"horovod_compress.{file[:-3].replace('/', '.')} -> " in broken, broken


def test_a_method_reaches_the_horovod_adapter_it_does_not_import() -> None:
    """``compressors/`` never imports the adapter (it sits above the front-ends); importing any
    part of the package registers it, so ``Method.compress``/``decompress`` find it, and neither
    torch nor TensorFlow is imported until a tensor of theirs arrives."""
    code = ("import sys\n"
            "from horovod_compress.compressors import Compression\n"
            "from horovod_compress.compressors.horovod_protocol import horovod_protocol\n"
            "found = horovod_protocol('compress'), horovod_protocol('decompress')\n"
            "loaded = sorted({'torch', 'tensorflow'} & set(sys.modules))\n"
            "import horovod_compress.horovod_compat as adapter\n"
            "assert found == (adapter.compress, adapter.decompress), found\n"
            "print('frameworks loaded:', loaded)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "frameworks loaded: []" in proc.stdout, proc.stdout
