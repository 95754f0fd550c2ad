"""Our equivalent of Horovod's examples/adasum/adasum_small_model.py.

Fits a quadratic (or cubic) polynomial's coefficients from one random point
per rank and step, reducing the gradient with hvd.allreduce(op=Average or
op=Adasum); stops after two zero-gradient steps. ``--compression NAME``
reduces with a horovod_compress method instead (op Average or Sum).
"""
import argparse
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402


def sq(x):
    return 1.0 * x * x - 20.0 * x + 50.0


def qu(x):
    return 10.0 * x * x * x + 5.0 * x * x - 20.0 * x - 5.0


class Net(torch.nn.Module):
    def __init__(self, mode="square"):
        super().__init__()
        self.mode = 0 if mode == "square" else 1
        self.param = torch.nn.Parameter(torch.FloatTensor([1.0, -1.0] if self.mode == 0
                                                          else [1.0, -1.0, 1.0]))

    def forward(self, x):
        if self.mode == 0:
            return x * x + self.param[0] * x + self.param[1]
        return 10 * x * x * x + self.param[0] * x * x + self.param[1] * x + self.param[2]


def train(args):
    hvd.init()
    net = Net(args.mode)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.learning_rate)
    compression = None
    if args.compression:
        import horovod_compress as hvdc
        compression = getattr(hvdc.Compression, args.compression)()
    np.random.seed(1 + hvd.rank())
    torch.manual_seed(1234)
    prev_zero = False
    step = 0
    for step in range(1, args.num_steps + 1):
        features = torch.Tensor(np.random.rand(1) * 2 * args.x_max - args.x_max)
        labels = sq(features) if args.mode == "square" else qu(features)
        optimizer.zero_grad()
        loss = torch.nn.MSELoss()(net(features), labels)
        loss.backward()
        op = hvd.Adasum if args.op == "Adasum" else hvd.Average
        if compression is not None:
            net.param.grad.data = hvd.allreduce(net.param.grad.data, op=op, name="param.grad",
                                                compression=compression)
        else:
            net.param.grad.data = hvd.allreduce(net.param.grad.data, op=op)
        optimizer.step()
        if net.param.grad.data[0].item() == 0 and net.param.grad.data[1].item() == 0:
            if prev_zero:
                break
            prev_zero = True
        else:
            prev_zero = False
    if hvd.rank() == 0:
        print(args.x_max, args.op, args.learning_rate, hvd.size(), step, flush=True)
    _report.write(hvd.rank(), [net.param.detach().numpy()], steps=step,
                  param=net.param.detach().tolist())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", type=str, default="square", choices=["square", "cubic"])
    parser.add_argument("--op", type=str, default="Average", choices=["Average", "Adasum"])
    parser.add_argument("--learning_rate", type=float, default=0.1)
    parser.add_argument("--x_max", type=float, default=1.0)
    parser.add_argument("--num_steps", type=int, default=50)
    parser.add_argument("--compression", default=None)
    train(parser.parse_args())
