"""Run under horovodrun: Global-QSGD's linear 8-bit variant inside Horovod's own allreduce.

Writes a JSON report (rank 0) that tests/test_global_qsgd_horovod.py checks.
"""
import json
import sys
import warnings

import horovod.torch as hvd
import numpy as np
import torch

import horovod_compress as hvdc
import horovod_compress.torch as hvdc_torch

hvdc_torch.init()  # joins the Horovod job (the script imported horovod.torch)
rank, size = hvd.rank(), hvd.size()
comm = hvdc_torch.communicator()
report = {"size": size}

# 1. hvd.DistributedOptimizer(compression=global_qsgd(linear), op=hvd.Sum) on a small MLP
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
comp = hvdc.Compression.global_qsgd(dithering="linear", seed=3)
handed_to_horovod = []
_compress = comp.compress


def recording_compress(tensor):
    out, ctx = _compress(tensor)
    handed_to_horovod.append(str(out.dtype))
    return out, ctx


comp.compress = recording_compress  # Horovod calls self._compression.compress
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression=comp,
                               op=hvd.Sum)
x = torch.from_numpy(np.random.default_rng(rank).standard_normal((8, 16)).astype(np.float32))
opt.zero_grad()
model(x).square().sum().backward()
local = {n: p.grad.clone().numpy() for n, p in model.named_parameters()}
opt.synchronize()
s = 127 // size
worst, integral, nonzero_err = 0.0, True, False
for n, p in model.named_parameters():
    everyone = comm.allgather(local[n]).astype(np.float64)
    true = everyone.mean(0)
    norm = float(np.abs(everyone).max())            # global inf-norm of this tensor
    avg = p.grad.numpy().astype(np.float64)
    # every rank's rounding error is below one level, norm / s; so is the average's
    worst = max(worst, float(np.abs(avg - true).max() / (norm / s)))
    units = avg / (norm / (s * size))                # sum of integer levels
    integral &= bool(np.allclose(units, np.round(units), atol=1e-3))
    nonzero_err |= bool(np.abs(avg - true).max() > 0)
    grads = comm.allgather(p.grad.numpy())
    assert (grads == grads[0]).all(), n
report["worst_error_in_levels"] = worst
report["sum_of_integer_levels"] = integral
report["quantized"] = nonzero_err
report["dtypes_handed_to_horovod"] = sorted(set(handed_to_horovod))
with opt.skip_synchronize():
    opt.step()
w = comm.allgather(model[0].weight.detach().numpy())
report["weights_equal"] = bool((w == w[0]).all())

# 2. unbiased through Horovod: average over T seeds of compress -> hvd.allreduce(Sum) -> decompress
T, d = 200, 512
g = torch.from_numpy(np.random.default_rng(10 + rank).standard_normal(d).astype(np.float32))
true = comm.allgather(g.numpy()).astype(np.float64).mean(0)
outs = np.empty((T, d))
for k in range(T):
    c = hvdc.Compression.global_qsgd(dithering="linear", seed=k)
    q, ctx = c.compress(g)
    summed = hvd.allreduce(q, op=hvd.Sum, name=f"unbiased.{k}")
    outs[k] = c.decompress(summed, ctx).numpy()
mse = float(((outs - true) ** 2).sum(1).mean())
bias = outs.mean(0) - true
report["R"] = float((bias ** 2).sum() / (mse / T))

# 3. NaN on one rank: the dense sum goes through instead (same on every rank)
bad = g.clone()
if rank == 1:
    bad[5] = float("nan")
c = hvdc.Compression.global_qsgd(dithering="linear")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    q, ctx = c.compress(bad)
out = c.decompress(hvd.allreduce(q, op=hvd.Sum, name="nan"), ctx).numpy()
dense = comm.allreduce(bad.numpy(), op="avg")
report["nan_policy"] = bool(q.dtype == torch.float32 and np.allclose(out, dense, equal_nan=True))

# 4. the variants that need a custom reduction refuse, with the reason
refused = {}
for label, kw in {"exp8": {}, "exp4": {"bits": 4}, "lin4": {"dithering": "linear", "bits": 4},
                  "lin8_sparse": {"dithering": "linear", "sparse": True}}.items():
    try:
        hvdc.Compression.global_qsgd(**kw).compress(g)
        refused[label] = False
    except ValueError as exc:
        refused[label] = "Horovod" in str(exc)
report["refused"] = refused
if rank == 0:
    json.dump(report, open(sys.argv[1], "w"))
