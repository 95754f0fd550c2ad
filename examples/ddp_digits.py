"""PyTorch DDP with a horovod-compress comm hook: the digits MLP, no MPI needed.

Run on 2 local ranks (gloo on CPU; NCCL on GPUs works the same way)::

    torchrun --nproc-per-node 2 examples/ddp_digits.py --compression powersgd --param rank=4
    torchrun --nproc-per-node 2 examples/ddp_digits.py --compression oktopk --param density=0.02

The three lines that differ from a plain DDP script are marked ``# <- hvdc``.
Checkpoints carry the hook's state (residuals, subspaces, step counters) next
to the model and the optimizer; ``--resume`` continues from one bit for bit.
"""
from __future__ import annotations

import argparse
import ast
import os

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits

import horovod_compress as hvdc
from horovod_compress.torch import ddp as hvdc_ddp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compression", default="powersgd", help="any hvdc.Compression name")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--checkpoint", default="ddp_digits.pt")
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
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model = torch.nn.parallel.DistributedDataParallel(net)
    method = getattr(hvdc.Compression, args.compression)(**params)          # <- hvdc
    hook = hvdc_ddp.comm_hook(method, model=model)                          # <- hvdc
    model.register_comm_hook(hook.state, hook)                              # <- hvdc
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    start = 0
    if args.resume and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, weights_only=True)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        hook.state.load_state_dict(ckpt["hvdc"][rank])   # each rank its own residuals
        start = ckpt["epoch"]

    for epoch in range(start, args.epochs):
        order = torch.from_numpy(np.random.default_rng([epoch, rank]).permutation(len(ys)))
        for i in range(0, len(order) - 31, 32):
            idx = order[i:i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
        with torch.no_grad():
            acc = (net(x[test]).argmax(1) == y[test]).float().mean().item()
        hvdc_states = [None] * size     # the hook state differs per rank (error feedback)
        dist.all_gather_object(hvdc_states, hook.state.state_dict())
        if rank == 0:
            s = hook.state.statistics()
            print(f"epoch {epoch + 1}: test accuracy {acc:.3f}, sent {s['bytes_sent'] / 2**20:.2f} MiB "
                  f"per rank ({s['compression']:.1f}x less than dense DDP)", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                        "hvdc": hvdc_states, "epoch": epoch + 1}, args.checkpoint)
    dist.barrier()          # no rank leaves while another still works (gloo aborts on a closed peer)
    hook.state.close()      # <- hvdc: its process groups go now, not during Python's exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
