"""Our equivalent of Horovod's examples/pytorch/pytorch_synthetic_benchmark.py (a small CNN).

Same flow: init, fixed synthetic batch, broadcast_parameters and
broadcast_optimizer_state, DistributedOptimizer with Compression.fp16/none
(or ``--compression NAME`` of horovod_compress, uncalled) and op
Adasum/Average, warm-up, timeit iterations, img/sec averaged over ranks.
"""
import argparse
import os
import sys
import timeit

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark (small)")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--num-warmup-batches", type=int, default=1)
parser.add_argument("--num-batches-per-iter", type=int, default=2)
parser.add_argument("--num-iters", type=int, default=2)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--compression", default=None)
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(), torch.nn.Linear(16, 10))
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
if args.compression:
    import horovod_compress as hvdc
    compression = getattr(hvdc.Compression, args.compression)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, 32, 32)
target = torch.LongTensor(args.batch_size).random_() % 10


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log(f"Model: small CNN, Batch size: {args.batch_size}, Number of CPUs: {hvd.size()}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
    img_secs.append(img_sec)
img_sec_mean = np.mean(img_secs)
total = hvd.allreduce(torch.tensor(img_sec_mean), op=hvd.Sum, name="img_sec").item()
log(f"Total img/sec on {hvd.size()} CPU(s): {total:.1f}")
_report.write(hvd.rank(), [p.detach().numpy() for p in model.state_dict().values()],
              img_sec=float(total))
