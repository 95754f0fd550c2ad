"""Our equivalent of Horovod's examples/elastic/pytorch/pytorch_mnist_elastic.py (synthetic data).

hvd.elastic.TorchState(model, optimizer, epoch=, batch=), reset callbacks,
@hvd.elastic.run over epochs and batches with state.commit(), then a test
pass with metric averaging. Runs at a fixed world size (our front-end:
elastic membership changes are refused with a clear error).
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

parser = argparse.ArgumentParser(description="PyTorch MNIST Elastic Example (synthetic)")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=96)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--compression", default=None)
args = parser.parse_args()

hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)


def synthetic(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 28, 28, generator=g),
                                          torch.randint(0, 10, (n,), generator=g))


train_dataset = synthetic(args.samples, 0)
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                           sampler=train_sampler)
test_dataset = synthetic(args.samples // 2, 1)
test_sampler = torch.utils.data.distributed.DistributedSampler(
    test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=32, sampler=test_sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        return F.log_softmax(self.fc2(x), dim=1)


model = Net()
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
if args.compression:
    import horovod_compress as hvdc
    compression = getattr(hvdc.Compression, args.compression)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs + 1):
        state.model.train()
        train_sampler.set_epoch(state.epoch)
        steps_remaining = len(train_loader) - state.batch
        for state.batch, (data, target) in enumerate(train_loader):
            if state.batch >= steps_remaining:
                break
            state.optimizer.zero_grad()
            loss = F.nll_loss(state.model(data), target)
            loss.backward()
            state.optimizer.step()
            if hvd.rank() == 0:
                print(f"Train Epoch: {state.epoch} batch {state.batch}\tLoss: {loss.item():.6f}",
                      flush=True)
            state.commit()
        state.batch = 0


def test():
    model.eval()
    test_loss = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            test_loss += F.nll_loss(model(data), target, reduction="sum").item()
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    if hvd.rank() == 0:
        print(f"Test set: Average loss: {test_loss:.4f}", flush=True)
    return test_loss


optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
test_loss = test()
_report.write(hvd.rank(), [p.detach().numpy() for p in model.state_dict().values()],
              test_loss=test_loss, epoch=state.epoch)
