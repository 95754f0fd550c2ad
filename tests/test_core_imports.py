"""The core never imports a framework or a benchmark dependency (issue 18).

Every module outside the front-ends (``torch/``, ``tensorflow/``, ``keras/``)
and the benchmarks (``bench/``) must import, and a method must run, with
torch, TensorFlow, Keras, Horovod, tqdm, matplotlib and scikit-learn made
unimportable; ``hvdc methods`` must work the same way.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = ("torch", "tensorflow", "keras", "tf_keras", "horovod", "tqdm", "matplotlib",
               "sklearn")

    class _Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked by the test")
            return None

    sys.meta_path.insert(0, _Blocker())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=240)


def test_every_core_module_imports_without_frameworks() -> None:
    proc = _run("""
        import importlib, pkgutil
        import horovod_compress
        FRONT_ENDS = ("torch", "tensorflow", "keras", "tools.bench")
        failed, imported = [], 0
        for m in pkgutil.walk_packages(horovod_compress.__path__, "horovod_compress."):
            if any(m.name.startswith(f"horovod_compress.{f}.") or m.name == f"horovod_compress.{f}"
                   for f in FRONT_ENDS):
                continue
            try:
                importlib.import_module(m.name)
                imported += 1
            except Exception as exc:
                failed.append(f"{m.name}: {exc!r}")
        assert imported > 50, imported
        assert not failed, failed
        print("imported", imported)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_method_runs_and_the_cli_lists_methods_without_frameworks() -> None:
    proc = _run("""
        import numpy as np
        import horovod_compress as hvdc
        from horovod_compress.mpi_collectives import Communicator
        comm = Communicator()
        g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
        for name in ("topk", "global_qsgd", "powersgd", "deepreduce"):
            m = hvdc.Compression.by_name(name)
            out = m.allreduce(g.reshape(25, 40) if name == "powersgd" else g, name, comm)
            assert out.shape == (g.reshape(25, 40) if name == "powersgd" else g).shape
        from horovod_compress.tools.cli import main
        assert main(["methods"]) == 0
        loaded = sorted(k for k in sys.modules if k.split(".")[0] in BLOCKED)
        assert not loaded, loaded
    """)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "oktopk" in proc.stdout
