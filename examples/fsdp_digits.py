"""PyTorch FSDP2 (``fully_shard``) with a horovod-compress reduce-scatter: the digits MLP.

Run on 2 local ranks (gloo on CPU; NCCL on GPUs works the same way)::

    torchrun --nproc-per-node 2 examples/fsdp_digits.py --compression fp16
    torchrun --nproc-per-node 2 examples/fsdp_digits.py --compression powersgd --param rank=4

Each ``Linear`` and the root are sharded; the lines that differ from a plain
FSDP2 script are marked ``# <- hvdc``. Checkpoints go through
``torch.distributed.checkpoint`` with the method's state (residuals,
subspaces, step counters; one per rank) beside the model and the optimizer;
``--resume`` continues from one bit for bit.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sklearn.datasets import load_digits
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import horovod_compress as hvdc
from horovod_compress.torch import fsdp as hvdc_fsdp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compression", default="fp16", help="any hvdc.Compression name")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--checkpoint", default="fsdp_digits_ckpt", help="a directory (DCP)")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    params = {k: ast.literal_eval(v) if v[:1].isdigit() or v in ("True", "False") else v
              for k, v in (p.split("=", 1) for p in args.param)}

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    digits = load_digits()
    x = torch.from_numpy((digits.data / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    test, train = perm[:360], perm[360:]
    xs, ys = x[train][rank::size], y[train][rank::size]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    method = getattr(hvdc.Compression, args.compression)(**params)          # <- hvdc
    state = hvdc_fsdp.register(model, method)                               # <- hvdc
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    start = 0
    if args.resume and os.path.isdir(args.checkpoint):
        msd, osd = get_state_dict(model, opt)
        ckpt = {"model": msd, "optim": osd, "hvdc": state.stateful(), "epoch": 0}  # <- hvdc
        dcp.load(ckpt, checkpoint_id=args.checkpoint)
        set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"])
        start = int(ckpt["epoch"])

    for epoch in range(start, args.epochs):
        order = torch.from_numpy(np.random.default_rng([epoch, rank]).permutation(len(ys)))
        for i in range(0, len(order) - 31, 32):
            idx = order[i:i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
        with torch.no_grad():
            acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "hvdc": state.stateful(),   # <- hvdc
                  "epoch": epoch + 1}, checkpoint_id=args.checkpoint)
        if rank == 0:
            s = state.statistics()
            print(f"epoch {epoch + 1}: test accuracy {acc:.3f}, sent {s['bytes_sent'] / 2**20:.2f} MiB "
                  f"per rank ({s['compression']:.1f}x less than FSDP2's dense reduce-scatter)",
                  flush=True)
    full = b"".join(p.full_tensor().detach().numpy().tobytes() for p in model.parameters())
    if rank == 0:
        print(f"parameters digest {hashlib.blake2b(full, digest_size=8).hexdigest()}", flush=True)
    dist.barrier()          # no rank leaves while another still works (gloo aborts on a closed peer)
    state.close()           # <- hvdc: its process groups go now, not during Python's exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
