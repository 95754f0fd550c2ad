"""Global-QSGD inside Horovod's own allreduce and DistributedOptimizer (horovodrun -np 2).

Every variant runs there as every compressed method does
(:mod:`horovod_compress.horovod_compat`): ``compress`` runs Global-QSGD's own
exchange (its integer sum, custom reduction operator or allgather, on the
same MPI world) and hands Horovod a 2-element float64 placeholder whose
reduction tells the op's scale. So Horovod's optimizer gives exactly our own
optimizer's gradients (op Average, and P times them for Sum), the linear
8-bit average is within one level of the true mean and unbiased, a NaN is
refused on every rank (or propagated under ``nonfinite="propagate"``), and
``compress()`` called by hand outside Horovod is refused with what to use
instead.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_compress.testing import mpi_env

SCRIPT = Path(__file__).parent / "cases" / "global_qsgd_horovod_script.py"

try:
    import horovod.torch  # noqa: F401
    HAVE_HOROVOD = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) is not None
except ImportError:
    HAVE_HOROVOD = False

pytestmark = [pytest.mark.horovod, pytest.mark.mpi,
              pytest.mark.skipif(not HAVE_HOROVOD, reason="Horovod is not built in this environment")]


def test_linear_8bit_through_horovods_allreduce(tmp_path):
    out = tmp_path / "report.json"
    exe = str(Path(sys.executable).parent / "horovodrun")
    env = mpi_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    env.pop("HVDC_LAUNCHED", None)
    proc = subprocess.run([exe, "-np", "2", sys.executable, str(SCRIPT), str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["dtypes_handed_to_horovod"] == ["torch.float64(2,)"]   # the placeholder only
    assert r["equal_to_our_optimizer"] and r["grads_equal_on_ranks"] and r["weights_equal"]
    assert r["quantized"]
    assert r["worst_error_in_levels"] < 1.0                      # within one level of the true mean
    assert 0.7 < r["R"] < 1.4                                    # unbiased over 200 seeds
    assert r["nan_policy"]
    assert r["variants_exact"] == {"lin8": True, "exp8": True, "exp4": True, "lin4": True,
                                   "lin8_sparse": True}
    assert r["outside_horovod_refused"]
