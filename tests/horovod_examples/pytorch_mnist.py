"""Our equivalent of Horovod's examples/pytorch/pytorch_mnist.py (synthetic MNIST-shaped data).

The same structure and Horovod calls: init, DistributedSampler over
hvd.size()/hvd.rank(), lr scaled by hvd.size() (hvd.local_size() for GPU
Adasum), broadcast_parameters/broadcast_optimizer_state,
Compression.fp16/none, DistributedOptimizer(named_parameters, compression,
op=Adasum/Average, gradient_predivide_factor), metric averaging with
hvd.allreduce(name=). ``--compression NAME`` picks a horovod_compress method
instead (passed uncalled, as hvd.Compression.fp16 is).
"""
import argparse
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

parser = argparse.ArgumentParser(description="PyTorch MNIST Example (synthetic data)")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--test-batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=128)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=2)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--compression", default=None, help="a horovod_compress method name")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 28, 28, generator=g),
                                          torch.randint(0, 10, (n,), generator=g))


def main(args):
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_dataset = synthetic(args.samples, 0)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_dataset = synthetic(args.samples // 2, 1)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    if args.compression:
        import horovod_compress as hvdc
        compression = getattr(hvdc.Compression, args.compression)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    def metric_average(val, name):
        return hvd.allreduce(torch.tensor(val), name=name).item()

    loss = None
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]"
                      f"\tLoss: {loss.item():.6f}", flush=True)
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.view_as(pred)).float().sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100 * test_accuracy:.2f}%",
                  flush=True)
    _report.write(hvd.rank(), [p.detach().numpy() for p in model.state_dict().values()],
                  loss=float(loss.item()), test_loss=test_loss)


if __name__ == "__main__":
    main(parser.parse_args())
