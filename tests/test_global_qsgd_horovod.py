"""Which Global-QSGD variant goes through Horovod's own allreduce (horovodrun -np 2).

Only linear dithering at 8 bits: its levels are summed by a plain integer
allreduce, which Horovod performs itself (``op=hvd.Sum``; ``decompress``
divides by P). Horovod's PyTorch allreduce has no int8 type, so the levels
travel as seven biased byte lanes per int64 word (8/7 bytes per element; the
lanes cannot carry into each other). Exponential dithering needs Algorithm 2
as a custom reduction operator and 4-bit linear a nibble-wise sum; Horovod
offers neither, so their ``compress`` refuses with a ValueError that says why.
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
    assert r["dtypes_handed_to_horovod"] == ["torch.int64"]     # 7 byte lanes per word: 8/7 B/element
    assert r["sum_of_integer_levels"] and r["quantized"]
    assert r["worst_error_in_levels"] < 1.0                      # within one level of the true mean
    assert r["weights_equal"]
    assert 0.7 < r["R"] < 1.4                                    # unbiased over 200 seeds
    assert r["nan_policy"]
    assert r["refused"] == {"exp8": True, "exp4": True, "lin4": True, "lin8_sparse": True}
