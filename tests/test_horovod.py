"""Horovod interplay (needs the Horovod build from scripts/setup.sh), started with horovodrun -np 2.

Our compressors inside Horovod's own ``DistributedOptimizer`` (fp16 reduced by
Horovod itself, randk through its own exchange), and ``hvdc train`` under
horovodrun. This file is also the script the horovodrun ranks run (``python
tests/test_horovod.py ENTRY OUT``, ENTRY the name of one of :data:`ENTRY_POINTS`).
"""
import json
import sys

import pytest

from horovod_compress.tools.testing import run_horovodrun, same_on_all_ranks
from horovod_compress.tools.testing_plugin import needs_horovod


pytestmark = [pytest.mark.horovod, pytest.mark.mpi,
              needs_horovod]


def horovodrun(args, tmp_path, timeout=600):
    proc = run_horovodrun(2, args, cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return proc.stdout


def test_our_compressors_inside_horovods_optimizer(tmp_path):
    out = tmp_path / "report.json"
    horovodrun([sys.executable, __file__, ranks_inside_horovods_optimizer.__name__, str(out)],
               tmp_path)
    report = json.loads(out.read_text())
    assert set(report) == {"fp16", "randk"}
    assert report["randk"] < 1e-6


def test_demo_runs_under_horovodrun(tmp_path):
    stdout = horovodrun([sys.executable, "-m", "horovod_compress.tools.cli", "train", "--compression",
                         "topk", "--epochs", "2", "--out", str(tmp_path / "demo")], tmp_path)
    assert "| topk |" in stdout
    assert (tmp_path / "demo" / "results.json").exists()
    assert json.loads((tmp_path / "demo" / "results.json").read_text())[0]["world_size"] == 2


# ------------------------------------------------------------ on the horovodrun ranks
def ranks_inside_horovods_optimizer(out: str) -> None:
    """Our compressors (fp16 native, randk its exchange) in Horovod's optimizer; rank 0 writes
    ``{method: max |average - true mean|}`` (over randk's kept entries) to ``out``."""
    import horovod.torch as hvd
    import numpy as np
    import torch

    import horovod_compress as hvdc
    import horovod_compress.torch as hvdc_torch

    hvdc_torch.init()  # joins the Horovod job (this file imported horovod.torch)
    assert hvdc_torch.horovod_active() and hvd.size() == hvdc_torch.size() and \
        hvd.rank() == hvdc_torch.rank()
    rank = hvd.rank()
    comm = hvdc_torch.communicator()
    report = {}
    for comp in (hvdc.Compression.fp16(), hvdc.Compression.randk(density=0.5, seed=7)):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=comp)
        x = torch.from_numpy(np.random.default_rng(rank).standard_normal((4, 16)).astype(np.float32))
        opt.zero_grad()
        model(x).sum().backward()
        local = model.weight.grad.clone()  # Horovod averages in step()/synchronize()
        everyone = comm.allgather(local.numpy())
        opt.synchronize()
        avg = model.weight.grad.numpy()
        true = everyone.mean(0)
        if comp.name == "fp16":
            assert np.allclose(avg, true, rtol=2e-3, atol=2e-3), (avg, true)
        else:  # randk: same indices on every rank, average there, zero elsewhere
            kept = avg != 0
            assert 0 < kept.sum() <= avg.size
            assert np.allclose(avg[kept], true[kept], rtol=1e-6, atol=1e-6)
            assert same_on_all_ranks(comm, kept.astype(np.uint8))
        with opt.skip_synchronize():
            opt.step()
        assert same_on_all_ranks(comm, model.weight.detach().numpy())
        sel = avg != 0 if comp.name == "randk" else np.ones_like(avg, dtype=bool)
        report[comp.name] = float(np.abs(avg - true)[sel].max())
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)


# What ``python tests/test_horovod.py ENTRY OUT`` runs on horovodrun ranks.
ENTRY_POINTS = (ranks_inside_horovods_optimizer,)


if __name__ == "__main__":
    {f.__name__: f for f in ENTRY_POINTS}[sys.argv[1]](*sys.argv[2:])
