"""What a user sees of the ``hvdc`` command and of the constructors: true defaults, clear
errors for misspelt or mistyped parameters, help text without reStructuredText markup."""
from __future__ import annotations

import ast
import re

import pytest

import horovod_compress as hvdc
from horovod_compress.tools.cli import main, plain_text
from horovod_compress.compressors import registry


def _listed_methods(capsys) -> dict[str, dict]:
    """``hvdc methods`` parsed back: name -> {parameter: default}."""
    assert main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    out = {}
    for head, params in zip(lines[0::2], lines[1::2]):
        name = head.split()[0]
        call = ast.parse(f"f{params.strip()}", mode="eval").body
        out[name] = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    return out


def _actual(method, key):
    """The value ``method`` (built with no arguments) really uses for parameter ``key``."""
    if key == "feedback":
        if method.name == "greedylore":          # its feedback is part of the algorithm
            return "residual" if method.error_feedback else "none"
        return method.feedback.name
    if key in method.feedback.params():
        return getattr(method.feedback, key)
    if key == "density" and method.name == "deepreduce":
        return method._sparsifier.density
    if key == "nonfinite":
        return method.nonfinite
    value = getattr(method, key)
    return tuple(value) if isinstance(value, dict) else value      # auto's candidates, by name


def test_methods_lists_the_defaults_the_constructors_use(capsys):
    listed = _listed_methods(capsys)
    assert sorted(listed) == sorted(registry.available())
    for name, params in listed.items():
        built = registry.create(name)
        for key, value in params.items():
            if key == "sparsifier_params":
                continue                          # extra parameters for the sparsifier; none by default
            assert _actual(built, key) == value, (name, key)
    # the defaults a placeholder in the signature used to hide
    assert listed["topk"]["feedback"] == "residual" and listed["oktopk"]["feedback"] == "residual"
    assert listed["arc_topk"]["feedback"] == "ef21m" and listed["arc_topk"]["eta"] == 0.1
    assert listed["deepreduce"]["density"] == 0.01


def test_methods_table_is_aligned(capsys):
    assert main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    starts = {len(line) - len(line.lstrip()) for line in lines[1::2]}
    desc = {re.match(r"\S+\s+", line).end() for line in lines[0::2]}
    assert len(starts) == 1 and desc == starts, (starts, desc)


def test_ef14_is_the_residual_feedback():
    method = hvdc.Compression.topk(density=0.1, feedback="ef14")
    assert method.feedback.name == "residual"
    with pytest.raises(ValueError, match="ef14"):
        hvdc.Compression.topk(feedback="ef15")


def test_a_misspelt_parameter_lists_the_valid_names():
    with pytest.raises(ValueError) as info:
        hvdc.Compression.topk(densty=0.1)
    text = str(info.value)
    assert "densty" in text and "did you mean 'density'" in text
    assert "'density'" in text and "'feedback'" in text and "'warmup_steps'" in text
    # the default feedback's own parameters are valid names: eta of ef21m
    assert hvdc.Compression.arc_topk(eta=0.5).feedback.eta == 0.5
    with pytest.raises(ValueError, match="eta"):
        hvdc.Compression.topk(eta=0.5)           # residual feedback takes no eta


@pytest.mark.parametrize("call", [
    lambda: hvdc.Compression.oktopk(k=10.0),
    lambda: hvdc.Compression.powersgd(rank=4.0),
    lambda: hvdc.Compression.oktopk(tau=True),
])
def test_counts_must_be_integers(call):
    with pytest.raises(ValueError, match="must be an integer"):
        call()


def test_counts_accept_numpy_integers():
    import numpy as np
    assert hvdc.Compression.oktopk(k=np.int64(10)).k == 10


@pytest.mark.parametrize("argv", [["model", "--help"], ["cluster", "--help"], ["bench", "e2e", "--help"],
                                  ["bench", "convergence", "--help"], ["train", "--help"]])
def test_help_has_no_restructuredtext_markup(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert len(text) > 200
    assert not re.search(r":[a-z]+:`|``", text), text


def test_plain_text_strips_roles_and_literals():
    assert plain_text(":mod:`horovod_compress.cost_model` and :func:`~a.b.c`") == \
        "horovod_compress.cost_model and c"
    assert plain_text(":class:`the base <a.Base>` of ``x``") == "the base of x"


@pytest.mark.mpi
@pytest.mark.parametrize("highlighting, escapes", [(None, False), ("", True)])
def test_no_stray_escape_codes_under_mpirun(highlighting, escapes):
    """Under mpirun each rank's stdout is a pseudo-terminal; Numba's error colouring (colorama)
    used to leave ESC[0m at the end of every rank's output. The control run (the user
    re-enabling Numba's colours) shows the check sees the escape codes when they are there."""
    import os
    import subprocess
    import sys

    from horovod_compress.tools.testing import mpi_env, mpirun_command
    env = mpi_env()
    env.pop("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", None)
    if highlighting is not None:
        env["NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING"] = highlighting
    cmd = mpirun_command(2) + (["-x", "NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING"] if highlighting is not None
                               else []) + [sys.executable, "-c",
                                           "import horovod_compress, numba.cpython.listobj; print('ok')"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("ok") == 2
    assert ("\x1b[" in proc.stdout) is escapes, repr(proc.stdout)


def test_docs_state_the_demo_step_time_in_the_unit_it_prints():
    """``hvdc train`` prints milliseconds per step; README and getting-started say so."""
    from pathlib import Path

    from horovod_compress.tools.bench.train import format_table
    row = {"method": "none", "config": {"name": "none"}, "test_accuracy": 0.9, "bytes_sent_per_step": 1024.0,
           "compression_ratio": 1.0, "seconds_per_step": 0.002}
    assert "ms/step" in format_table([row])
    root = Path(__file__).resolve().parents[1]
    for page in (root / "README.md", root / "docs" / "getting-started.md"):
        text = " ".join(page.read_text().split())
        assert "milliseconds per step" in text and " seconds per step" not in text, page.name


def test_no_placeholder_repository_url():
    """Pages do not ask users to clone a placeholder; pyproject names no URL that does not exist."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    assert not [p.name for p in pages if re.search(r"<this repository>|git clone <", p.read_text())]
    assert "[project.urls]" not in (root / "pyproject.toml").read_text()


def case_bytes_sent_counts_the_exchange(comm):
    """One training step after the initial broadcast: the optimizer's ``stats.bytes_sent`` is the
    gradient exchange alone (a dense ring allreduce of the gradient, 2·4n(P-1)/P), the
    communicator's ``bytes_sent`` everything, the broadcast included."""
    import torch

    import horovod_compress.torch as hvdc_torch
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 3)
    opt = hvdc_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(),
                                          compression=hvdc.Compression.none(), comm=comm)
    hvdc_torch.broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    after_broadcast = comm.bytes_sent
    opt.zero_grad()
    model(torch.ones(4, 10)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    return {"exchange": float(opt.stats.bytes_sent), "total": float(comm.bytes_sent),
            "broadcast": float(after_broadcast), "dense": 2 * 4 * n * (comm.size - 1) / comm.size,
            "by_op": comm.stats()["by_op"]}


@pytest.mark.mpi
def test_bytes_sent_of_the_exchange_excludes_the_initial_broadcast():
    from horovod_compress.tools.testing import run_cases
    results = run_cases(2, __file__, [case_bytes_sent_counts_the_exchange], timeout=300)
    for rank, r in results[case_bytes_sent_counts_the_exchange].items():
        assert r["exchange"] == pytest.approx(r["dense"]), (rank, r["by_op"])
        assert r["total"] >= r["exchange"] + r["broadcast"] - 1e-9, (rank, r)
    assert results[case_bytes_sent_counts_the_exchange][0]["broadcast"] > 0   # the root sent the weights
