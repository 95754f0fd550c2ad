"""``Compression.auto()`` as a DDP comm hook on ``torchrun`` ranks (gloo, no MPI), P = 2 and 4.

This file is also the script the ranks run (``python tests/test_auto_ddp.py OUT``):
a small MLP under ``DistributedDataParallel`` with ``comm_hook(Compression.auto(...))``
trains a few steps, saving the hook's and the model's state after its decisions; a
second model resumes from that state; each rank writes ``OUT/rank<r>.json`` with its
decisions, a digest of its parameters and the resumed run's. The test checks that every rank took the same decisions,
holds the same parameters, and that the resumed run's parameters equal the
straight run's bit for bit.
"""
from __future__ import annotations

import sys

if __name__ == "__main__":
    class _BlockMPI:      # the DDP path must not need MPI
        def find_spec(self, name, path=None, target=None):  # noqa: ARG002
            if name == "mpi4py" or name.startswith("mpi4py."):
                raise ImportError("mpi4py is blocked in the DDP tests")
            return None

    sys.meta_path.insert(0, _BlockMPI())

import hashlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from horovod_compress.tools.testing import torchrun_command, torchrun_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, SPLIT = 6, 3


def _train(rank: int, steps: range, hook_state: dict | None, model_state: dict | None,
           save_after: int | None = None):
    """(parameter digest, decisions, (hook state, model state) after step ``save_after``) of
    ``steps`` DDP steps."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import horovod_compress as hvdc
    from horovod_compress.torch import ddp as hvdc_ddp
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    if model_state is not None:
        net.load_state_dict(model_state)
    model = DistributedDataParallel(net)
    method = hvdc.Compression.auto(candidates=["none", "fp16", "topk"], dry_runs=1, probe_repeats=1,
                                   min_numel=1024)
    hook = hvdc_ddp.comm_hook(method, model=model)
    model.register_comm_hook(hook.state, hook)
    if hook_state is not None:
        hook.state.load_state_dict(hook_state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    saved = None
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step == save_after:
            saved = (hook.state.state_dict(), {k: v.clone() for k, v in net.state_dict().items()})
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()
    digest = hashlib.sha256(flat.tobytes()).hexdigest()
    decisions = sorted((b, d["chosen"]) for b, d in method.decisions().items())
    shown = hook.state.statistics()["decisions"]          # what the hook's statistics report
    assert sorted((b, d["chosen"]) for b, d in shown.items()) == decisions
    hook.state.close()
    return digest, decisions, saved


def rank_main(out: Path) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    straight, decisions, (hook_sd, model_sd) = _train(rank, range(STEPS), None, None, SPLIT - 1)
    resumed, resumed_decisions, _ = _train(rank, range(SPLIT, STEPS), hook_sd, model_sd)
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"straight": straight, "resumed": resumed, "decisions": decisions,
         "resumed_decisions": resumed_decisions}))
    dist.destroy_process_group()


@pytest.mark.parametrize("nprocs", [2, 4])
def test_auto_as_ddp_hook_same_everywhere_and_resumes(tmp_path, nprocs):
    pytest.importorskip("torch.distributed")
    cmd = torchrun_command(nprocs, __file__, str(tmp_path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=torchrun_env({"HVDC_ABORT_ON_EXCEPTION": "0"}), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nprocs)]
    first = per_rank[0]
    assert first["decisions"], "no bucket decided"
    for r in per_rank:
        assert r["decisions"] == first["decisions"]           # one decision on every rank
        assert r["straight"] == first["straight"]             # the same parameters
    for r in per_rank:      # resumed from the hook state saved after step SPLIT: the same bits
        assert r["resumed_decisions"] == r["decisions"]
        assert r["resumed"] == r["straight"]


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
