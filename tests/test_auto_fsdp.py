"""``Compression.auto()`` as FSDP2's reduce-scatter (``fsdp.register``) on ``torchrun`` ranks (gloo, P = 2).

This file is also the script the ranks run (``python tests/test_auto_fsdp.py OUT``).
``auto`` is a flat method, so each module's flat buffer is averaged by the chosen
candidate and each rank keeps its slice (the allreduce + slice path of flat methods).
A synthetic link (``measure_hook``: every collective ``alpha + bytes / rate``, a fixed
compression time per method) makes the choice deterministic:

* a fast link: ``auto`` chooses dense on every module, and the gradients FSDP hands
  the optimizer equal those of ``fsdp.register(model, Compression.none())`` bit for
  bit, step by step (the same sums in the same order);
* a slow link: ``auto`` chooses Top-k on every module that is large enough, every
  rank the same, and three training steps run with finite gradients.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from horovod_compress.tools.testing import torchrun_command, torchrun_env

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
FAST, SLOW = 1e12, 1e6


def _link(rate: float):
    def hook(kind: str, seconds: float, nbytes: float) -> float:
        if kind.startswith("compress:"):
            return {"none": 1e-3, "topk": 2e-3}[kind.split(":")[1]]
        return 1e-5 + nbytes / rate
    return hook


def _grads_of_run(rank: int, method) -> list[list[float]]:
    """Each step's local gradient shards (flattened) under ``fsdp.register(model, method)``."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from horovod_compress.torch import fsdp as hvdc_fsdp
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    hvdc_fsdp.register(net, method)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    grads = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        grads.append(torch.cat([p.grad.to_local().reshape(-1) for p in net.parameters()]).tolist())
        opt.step()
    return grads


def rank_main(out: Path) -> None:
    import torch
    import torch.distributed as dist

    import horovod_compress as hvdc
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def auto(rate: float):
        return hvdc.Compression.auto(candidates=["none", "topk"], dry_runs=1, probe_repeats=1,
                                     min_numel=1024, measure_hook=_link(rate))
    dense = _grads_of_run(rank, hvdc.Compression.none())
    fast = auto(FAST)
    fast_grads = _grads_of_run(rank, fast)
    slow = auto(SLOW)
    slow_grads = _grads_of_run(rank, slow)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "dense_equals_fast": dense == fast_grads,
        "fast": sorted((b, d["chosen"]) for b, d in fast.decisions().items()),
        "slow": sorted((b, d["chosen"]) for b, d in slow.decisions().items()),
        "slow_finite": bool(torch.isfinite(torch.tensor(slow_grads)).all()),
        "slow_differs": slow_grads != dense}))
    dist.barrier()
    dist.destroy_process_group()


def test_auto_as_fsdp_reduce_scatter():
    pytest.importorskip("torch.distributed.fsdp")
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(torchrun_command(2, __file__, tmp), capture_output=True, text=True,
                              timeout=600, env=torchrun_env({"HVDC_ABORT_ON_EXCEPTION": "0"}), cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    first = per_rank[0]
    assert first["fast"] and {c for _, c in first["fast"]} == {"none"}, first["fast"]
    # the two Linear modules' buffers (64x128+128, 128x10+10 values) are above min_numel
    assert [c for _, c in first["slow"]].count("topk") >= 1, first["slow"]
    for r in per_rank:
        assert r["fast"] == first["fast"] and r["slow"] == first["slow"]   # one decision everywhere
        assert r["dense_equals_fast"], "auto's dense choice differs from Compression.none()"
        assert r["slow_finite"] and r["slow_differs"]


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
