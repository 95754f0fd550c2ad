"""PyTorch + horovod-compress: a small CNN (or MLP) on scikit-learn's digits, data-parallel on P ranks.

    mpirun -np 4 python examples/pytorch_digits.py --compression oktopk --param density=0.05
    srun -n 4 python examples/pytorch_digits.py --compression global_qsgd
    horovodrun -np 4 python examples/pytorch_digits.py --compression topk

What changes against a single-process PyTorch script: ``hvdc_torch.init()``,
the wrapped optimizer, the broadcast of rank 0's parameters, and each rank
training on its own shard. The data ships inside scikit-learn: no download.
At the end every rank holds the same parameters (checked); rank 0 prints the
test accuracy, bytes sent per step and the compression ratio against dense.
"""
from __future__ import annotations

import argparse
import ast
import os

import numpy as np
import torch

import horovod_compress as hvdc
import horovod_compress.torch as hvdc_torch
from horovod_compress.tools.bench.digits import load_digits_split


def make_model(kind: str) -> torch.nn.Module:
    """``cnn``: two 3x3 convolutions on the 8x8 image; ``mlp``: 64-128-128-10."""
    if kind == "cnn":
        return torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)),
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 10))
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def parse_param(pairs: list[str]) -> dict:
    """``["density=0.05"]`` -> ``{"density": 0.05}`` (values as Python literals when they parse)."""
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compression", default="topk", help="a hvdc.Compression method name")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="method parameter, e.g. density=0.05 (repeatable)")
    parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))   # the rank's share of the cores
    hvdc_torch.init()                           # MPI world (mpi4py); works under mpirun, srun, horovodrun
    rank, size = hvdc_torch.rank(), hvdc_torch.size()
    comm = hvdc_torch.communicator()            # the mpi4py communicator, with byte counts
    compression = hvdc.Compression.by_name(args.compression, **parse_param(args.param))

    data = load_digits_split(seed=0)
    x = torch.from_numpy(data.x_train[rank::size])   # this rank's shard
    y = torch.from_numpy(data.y_train[rank::size])
    steps = max(1, len(y) // args.batch_size)

    torch.manual_seed(rank)                # different init per rank: the broadcast fixes it
    model = make_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = hvdc_torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                          compression=compression)
    hvdc_torch.broadcast_parameters(model.state_dict(), root_rank=0)

    comm.reset_stats()
    for epoch in range(args.epochs):
        order = torch.from_numpy(np.random.default_rng([epoch, rank]).permutation(len(y)))
        model.train()
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = (model(torch.from_numpy(data.x_test)).argmax(1).numpy() == data.y_test).mean()
        if rank == 0:
            print(f"epoch {epoch + 1:3d}  test accuracy {acc:.4f}", flush=True)

    sent = comm.bytes_sent / (args.epochs * steps)   # read before the check below adds its own bytes
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert all((w == flat).all() for w in hvdc_torch.allgather_object(flat)), "ranks diverged"
    if rank == 0:
        n = flat.size
        dense = 2 * 4 * n * (size - 1) / size
        print(f"{compression!r} on {size} ranks: {n} parameters, "
              f"{sent / 1024:.1f} KiB sent per rank per step ({dense / max(sent, 1):.1f}x less than dense)")


if __name__ == "__main__":
    main()
