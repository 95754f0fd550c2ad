"""Global-QSGD inside Horovod's own allreduce and DistributedOptimizer (horovodrun -np 2).

Every variant runs there as every compressed method does
(:mod:`horovod_compress.horovod_compat`): ``compress`` runs Global-QSGD's own
exchange (its integer sum, custom reduction operator or allgather, on the
same MPI world) and hands Horovod a 2-element float64 placeholder whose
reduction tells the op's scale. So Horovod's optimizer gives exactly our own
optimizer's gradients (op Average, and P times them for Sum), the linear
8-bit average is within one level of the true mean, the linear and the
exponential average unbiased over 200 seeds (Section 5.1, Lemma 2), a NaN is
refused on every rank (or propagated under ``nonfinite="propagate"``), and
``compress()`` called by hand outside Horovod is refused with what to use
instead.

This file is also the script the horovodrun ranks run (``python
tests/test_global_qsgd_horovod.py ENTRY OUT``, ENTRY the name of one of
:data:`ENTRY_POINTS`). The variants are those of "Global-QSGD: Allreduce-Compatible
Quantization for Distributed Learning with Theoretical Guarantees" (Xin et al.,
2023): linear and exponential dithering, 8 and 4 bits.
"""
import json
import sys

import pytest

from horovod_compress.tools.testing import run_horovodrun, same_on_all_ranks
from horovod_compress.tools.testing_plugin import needs_horovod


pytestmark = [pytest.mark.horovod, pytest.mark.mpi,
              needs_horovod]


def test_linear_8bit_through_horovods_allreduce(tmp_path):
    out = tmp_path / "report.json"
    proc = run_horovodrun(2, [sys.executable, __file__, ranks_global_qsgd_in_horovod.__name__, str(out)],
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["dtypes_handed_to_horovod"] == ["torch.float64(2,)"]   # the placeholder only
    assert r["equal_to_our_optimizer"] and r["grads_equal_on_ranks"] and r["weights_equal"]
    assert r["quantized"]
    assert r["worst_error_in_levels"] < 1.0                      # within one level of the true mean
    assert 0.7 < r["R"] < 1.4, r                                 # unbiased over 200 seeds
    assert 0.7 < r["R_exponential"] < 1.4, r   # exponential (Algorithm 2 in the reduction) too
    assert r["nan_policy"]
    assert r["variants_exact"] == {"lin8": True, "exp8": True, "exp4": True, "lin4": True,
                                   "lin8_sparse": True}
    assert r["outside_horovod_refused"]


# ------------------------------------------------------------ on the horovodrun ranks
def ranks_global_qsgd_in_horovod(report_path: str) -> None:
    """Global-QSGD inside Horovod's own allreduce and DistributedOptimizer; rank 0 writes the
    JSON report the test above checks to ``report_path``."""
    import horovod.torch as hvd
    import numpy as np
    import torch

    import horovod_compress as hvdc
    import horovod_compress.torch as hvdc_torch
    from horovod_compress.compressors.base import NonFiniteGradientError
    from horovod_compress.horovod_compat import HorovodAdapterError

    hvd.init()
    hvdc_torch.init()  # joins the Horovod job's MPI world
    rank, size = hvd.rank(), hvd.size()
    comm = hvdc_torch.communicator()
    report = {"size": size}


    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


    # 1. hvd.DistributedOptimizer(compression=global_qsgd(linear)): what Horovod is handed, the
    #    error against the true mean, and exactly our own optimizer's gradients (op Average and Sum)
    handed_to_horovod = []
    worst, equal_ours, equal_ranks, weights_equal, nonzero_err = 0.0, True, True, True, False
    for op in (hvd.Average, hvd.Sum):
        a, b = mlp(), mlp()
        comp = hvdc.Compression.global_qsgd(dithering="linear", seed=3)
        _compress = comp.compress

        def recording_compress(tensor, _compress=_compress):
            out, ctx = _compress(tensor)
            handed_to_horovod.append(f"{out.dtype}{tuple(out.shape)}")
            return out, ctx

        comp.compress = recording_compress  # Horovod calls self._compression.compress
        opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1),
                                         named_parameters=a.named_parameters(), compression=comp,
                                         op=op)
        opt_b = hvdc_torch.DistributedOptimizer(
            torch.optim.SGD(b.parameters(), lr=0.1), named_parameters=b.named_parameters(),
            compression=hvdc.Compression.global_qsgd(dithering="linear", seed=3), op=op)
        scale = size if op == hvd.Sum else 1
        for step in range(3):
            x = torch.from_numpy(np.random.default_rng(100 * step + rank)
                                 .standard_normal((8, 16)).astype(np.float32))
            local = None
            for opt, model in ((opt_a, a), (opt_b, b)):
                opt.zero_grad()
                model(x).square().sum().backward()
                if model is a:
                    local = {n: p.grad.clone().numpy() for n, p in model.named_parameters()}
                opt.synchronize()
            # every rank's rounding error is below one level, norm / s, with norm the inf-norm
            # over the fused bucket (at most the inf-norm over all gradients); so is the average's
            s = 127 // size
            everyone = {n: comm.allgather(g).astype(np.float64) for n, g in local.items()}
            norm = max(float(np.abs(e).max()) for e in everyone.values())
            for (n, p), q in zip(a.named_parameters(), b.parameters()):
                got = p.grad.numpy()
                equal_ours &= bool(np.array_equal(got, q.grad.numpy()))
                avg = got.astype(np.float64) / scale
                true = everyone[n].mean(0)
                worst = max(worst, float(np.abs(avg - true).max() / (norm / s)))
                nonzero_err |= bool(np.abs(avg - true).max() > 0)
                equal_ranks &= same_on_all_ranks(comm, got)
            for opt in (opt_a, opt_b):
                with opt.skip_synchronize():
                    opt.step()
        weights_equal &= same_on_all_ranks(comm, a[0].weight.detach().numpy())
        opt_b.close()
    report["dtypes_handed_to_horovod"] = sorted(set(handed_to_horovod))
    report["worst_error_in_levels"] = worst
    report["quantized"] = nonzero_err
    report["equal_to_our_optimizer"] = equal_ours
    report["grads_equal_on_ranks"] = equal_ranks
    report["weights_equal"] = weights_equal

    # 2. unbiased through Horovod: average over T seeds of hvd.allreduce(compression=global_qsgd)
    T, d = 200, 512
    g = torch.from_numpy(np.random.default_rng(10 + rank).standard_normal(d).astype(np.float32))
    true = comm.allgather(g.numpy()).astype(np.float64).mean(0)
    # R = ||mean over seeds - true||^2 / (MSE / T): about 1 (spread ~ sqrt(2/d)) when unbiased
    for dithering, key in (("linear", "R"), ("exponential", "R_exponential")):
        outs = np.empty((T, d))
        for k in range(T):
            c = hvdc.Compression.global_qsgd(dithering=dithering, seed=k)
            outs[k] = hvd.allreduce(g, name=f"unbiased.{dithering}.{k}", compression=c).numpy()
        mse = float(((outs - true) ** 2).sum(1).mean())
        bias = outs.mean(0) - true
        report[key] = float((bias ** 2).sum() / (mse / T))

    # 3. NaN on one rank: refused on every rank (default policy), or the dense average (propagate)
    bad = g.clone()
    if rank == 1:
        bad[5] = float("nan")
    try:
        hvd.allreduce(bad, name="nan.raise",
                      compression=hvdc.Compression.global_qsgd(dithering="linear"))
        raised = False
    except NonFiniteGradientError as exc:
        raised = "NaN" in str(exc)
    c = hvdc.Compression.global_qsgd(dithering="linear", nonfinite="propagate")
    out = hvd.allreduce(bad, name="nan.propagate", compression=c).numpy()
    dense = comm.allreduce(bad.numpy(), op="avg")
    report["nan_policy"] = bool(raised and np.allclose(out, dense, equal_nan=True)
                                and np.isnan(out[5]))

    # 4. every variant (custom reduction operators included) through hvd.allreduce: exactly the
    #    method's own result, times P for op=Sum
    variants = {"lin8": {"dithering": "linear"}, "exp8": {}, "exp4": {"bits": 4},
                "lin4": {"dithering": "linear", "bits": 4},
                "lin8_sparse": {"dithering": "linear", "sparse": True}}
    exact = {}
    for label, kw in variants.items():
        mine, ref = hvdc.Compression.global_qsgd(**kw), hvdc.Compression.global_qsgd(**kw)
        ok = True
        for step, op in enumerate((hvd.Average, hvd.Sum)):
            x = g * (step + 1)
            got = hvd.allreduce(x, name=f"variant.{label}", compression=mine, op=op).numpy()
            want = ref.allreduce(x.numpy(), f"variant.{label}", comm) * np.float32(
                size if op == hvd.Sum else 1)
            ok &= bool(np.array_equal(got, want))
        exact[label] = ok
    report["variants_exact"] = exact

    # 5. compress() called by hand, outside Horovod: refused, saying what to use instead
    try:
        hvdc.Compression.global_qsgd(dithering="linear").compress(g)
        report["outside_horovod_refused"] = False
    except HorovodAdapterError as exc:
        report["outside_horovod_refused"] = "outside Horovod" in str(exc)

    if rank == 0:
        with open(report_path, "w") as f:
            json.dump(report, f)
    comm.barrier()


# What ``python tests/test_global_qsgd_horovod.py ENTRY OUT`` runs on horovodrun ranks.
ENTRY_POINTS = (ranks_global_qsgd_in_horovod,)


if __name__ == "__main__":
    {f.__name__: f for f in ENTRY_POINTS}[sys.argv[1]](*sys.argv[2:])
