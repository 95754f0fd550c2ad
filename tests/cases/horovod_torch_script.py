"""Run under horovodrun: our compressors (fp16 native, randk its exchange) in Horovod's optimizer."""
import json
import sys

import horovod.torch as hvd
import numpy as np
import torch

import horovod_compress as hvdc
import horovod_compress.torch as hvdc_torch

hvdc_torch.init()  # joins the Horovod job (the script imported horovod.torch)
assert hvdc_torch.horovod_active() and hvd.size() == hvdc_torch.size() and hvd.rank() == hvdc_torch.rank()
rank, size = hvd.rank(), hvd.size()
report = {}
for comp in (hvdc.Compression.fp16(), hvdc.Compression.randk(density=0.5, seed=7)):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    x = torch.from_numpy(np.random.default_rng(rank).standard_normal((4, 16)).astype(np.float32))
    opt.zero_grad()
    model(x).sum().backward()
    local = model.weight.grad.clone()  # Horovod averages in step()/synchronize()
    everyone = hvdc_torch.communicator().allgather(local.numpy())
    opt.synchronize()
    avg = model.weight.grad.numpy()
    true = everyone.mean(0)
    if comp.name == "fp16":
        assert np.allclose(avg, true, rtol=2e-3, atol=2e-3), (avg, true)
    else:  # randk: same indices on every rank, average there, zero elsewhere
        kept = avg != 0
        assert 0 < kept.sum() <= avg.size
        assert np.allclose(avg[kept], true[kept], rtol=1e-6, atol=1e-6)
        masks = hvdc_torch.communicator().allgather(kept.astype(np.uint8))
        assert (masks == masks[0]).all()
    with opt.skip_synchronize():
        opt.step()
    w = hvdc_torch.communicator().allgather(model.weight.detach().numpy())
    assert (w == w[0]).all()
    sel = avg != 0 if comp.name == "randk" else np.ones_like(avg, dtype=bool)
    report[comp.name] = float(np.abs(avg - true)[sel].max())
if rank == 0:
    json.dump(report, open(sys.argv[1], "w"))
