"""Every method inside Horovod's own optimizers, on 2 real ranks (horovodrun -np 2), issue 16.

One launch per framework runs every check (tests/scripts/horovod_methods_torch.py,
horovod_methods_tf.py) and writes a JSON report; each check is a test here, so
a failure names the method, the op and what differed. Zero silent wrong
results: Horovod's ``DistributedOptimizer`` (PyTorch) and
``DistributedGradientTape`` (TensorFlow, inside ``tf.function``) with any
method, op Average or Sum, give exactly the method's own result (none/fp16/bf16:
the dense average); what cannot be honoured is refused with a clear error.

The method's own result is not an independent reference, so every compressed
method is also checked in both frameworks against what its paper says it must
deliver, rebuilt in NumPy from every rank's local gradients
(tests/scripts/method_oracles.py: ``torch_oracle[...]``, ``tf_oracle[...]``),
and Horovod's PyTorch optimizer trains scikit-learn's digits with Top-k,
Global-QSGD and PowerSGD to within 3 points of dense training
(``case_digits_training_against_dense``).
"""
import json
import sys
from pathlib import Path

import pytest

import horovod_compress as hvdc
from horovod_compress.tools.testing import find_cases, run_horovodrun
from horovod_compress.tools.testing_plugin import import_horovod, needs_horovod

SCRIPTS = Path(__file__).parent / "scripts"
TORCH_SCRIPT = SCRIPTS / "horovod_methods_torch.py"
TF_SCRIPT = SCRIPTS / "horovod_methods_tf.py"


pytestmark = [pytest.mark.horovod, pytest.mark.mpi,
              needs_horovod]

METHODS = hvdc.Compression.available()
# each method x op, then the scripts' case_* checks (found by name)
# the methods Horovod does not reduce itself, each also against a NumPy oracle of its paper
# (tests/scripts/method_oracles.py); auto has none of its own (it runs one of the others)
ORACLE_METHODS = [m for m in METHODS if m not in ("none", "fp16", "bf16", "auto")]
# and, in PyTorch, with their residual error feedback (method_oracles.RESIDUAL_PARAMS)
TORCH_ORACLES = [f"torch_oracle[{m}]" for m in ORACLE_METHODS] + \
    [f"torch_oracle[{m}+residual]" for m in ("topk", "topk_dsa")]
TORCH_CHECKS = [f"torch_optimizer[{m}-{op}]" for m in METHODS for op in ("Average", "Sum")] + \
    TORCH_ORACLES + find_cases(TORCH_SCRIPT)
TF_CHECKS = [f"tf_tape[{m}-{op}]" for m in METHODS for op in ("Average", "Sum")] + \
    [f"tf_oracle[{m}]" for m in ORACLE_METHODS] + find_cases(TF_SCRIPT)


def horovodrun(script: Path, out: Path, timeout: int = 900, nprocs: int = 2,
               extra_env: dict | None = None) -> None:
    proc = run_horovodrun(nprocs, [sys.executable, str(script), str(out)], cwd=out.parent,
                          timeout=timeout, extra_env=extra_env)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-6000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def torch_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("hvd_torch") / "report.json"
    horovodrun(TORCH_SCRIPT, out)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def torch_oracle_report_4(tmp_path_factory):
    """The PyTorch oracle checks alone, on 4 ranks (gTopk's tree has two levels there)."""
    out = tmp_path_factory.mktemp("hvd_torch4") / "report.json"
    horovodrun(TORCH_SCRIPT, out, nprocs=4, extra_env={"HVDC_ORACLES_ONLY": "1"})
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tf_report(tmp_path_factory):
    import_horovod("horovod.tensorflow")
    out = tmp_path_factory.mktemp("hvd_tf") / "report.json"
    horovodrun(TF_SCRIPT, out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("check", TORCH_CHECKS)
def test_torch(torch_report, check):
    assert check in torch_report, f"check {check} did not run"
    assert torch_report[check] == "ok", torch_report[check]


@pytest.mark.parametrize("check", TF_CHECKS)
def test_tensorflow(tf_report, check):
    assert check in tf_report, f"check {check} did not run"
    assert tf_report[check] == "ok", tf_report[check]


@pytest.mark.parametrize("check", TORCH_ORACLES)
def test_torch_oracle_on_4_ranks(torch_oracle_report_4, check):
    assert set(torch_oracle_report_4) == set(TORCH_ORACLES)
    assert torch_oracle_report_4[check] == "ok", torch_oracle_report_4[check]
