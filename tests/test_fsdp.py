"""Every method as FSDP2's reduce-scatter, on real ``torchrun`` ranks (gloo, CPU).

One ``torchrun`` launch per world size (2 and 4 ranks) runs :func:`ranks_fsdp`
on an MLP whose three ``Linear`` layers and root are ``fully_shard``-ed (the
layer of 10 rows pads to 12 at P = 4, so padding rows are exercised):

* ``none`` against FSDP2's own reduce-scatter, gradient by gradient over 3
  steps: bit for bit at P = 2 (one addition per element, the same in any
  order); at P = 4 within float32 rounding of a different summation order
  (gloo's reduce-scatter and ours may fold the four ranks differently),
  with ``reshard_after_forward`` True and False;
* every method: each rank's shard equals the matching slice (flat methods:
  block r of P of the module's flat buffer; matrix methods: the local rows of
  each parameter) of the method's own ``allreduce`` replayed on the same
  gradients in the same order (Ok-Topk: its own ``reduce_scatter`` variant,
  whose NumPy reference is in tests/test_fsdp_reduce_scatter.py); bit for bit at P = 2, and at P = 4 too where
  both fold in the same order (flat methods on the torch communicator),
  within 1e-4 relative where a fused sum meets a sequential one (matrix
  methods); and the gradients FSDP hands the optimizer are those slices;
* bytes per rank per step of each method against FSDP2's dense
  reduce-scatter, N(P-1)/P per module buffer of N bytes (exact for the
  methods that reduce-scatter for real);
* ``MixedPrecisionPolicy(reduce_dtype=bfloat16 | float16)`` and a gradient
  divide factor; ranks configured differently raise on every rank; the state
  checkpointed with ``torch.distributed.checkpoint`` resumes bit for bit.

Two more launches: the digits MLP under FSDP2 with each method reaches the
accuracy it reaches under DDP (2 ranks), and an exception on one rank ends
the job.

This file is also the script the ranks run (``python tests/test_fsdp.py ENTRY OUT``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from horovod_compress.tools.testing import torchrun_command, torchrun_env

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return torchrun_env({"HVDC_ABORT_ON_EXCEPTION": "0"})


def torchrun(nprocs: int, entry: Callable[[Path], None], out: Path, timeout: float = 420,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run this file's ``entry`` on ``nprocs`` torchrun ranks (raises on a non-zero exit)."""
    cmd = torchrun_command(nprocs, __file__, entry.__name__, str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=env or _env(), cwd=ROOT)
    if proc.returncode != 0 and env is None:
        raise AssertionError(f"torchrun --nproc-per-node {nprocs} {entry.__name__} failed "
                             f"(exit {proc.returncode})\n--- stdout ---\n{proc.stdout[-6000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def written(out: Path, entry: Callable[[Path], None], nprocs: int) -> dict[int, dict]:
    return {r: json.loads((out / f"{entry.__name__}_rank{r}.json").read_text())
            for r in range(nprocs)}


def failures(per_rank: dict[int, dict]) -> dict[str, str]:
    bad = {}
    for r, res in sorted(per_rank.items()):
        assert res["checks"], f"rank {r}: no checks ran"
        bad.update({f"rank {r}: {k}": v for k, v in res["checks"].items() if v != "ok"})
    return bad


def _report(bad: dict[str, str]) -> str:
    return f"{len(bad)} failing check(s): {sorted(bad)}\n" + "\n".join(
        f"== {k}\n{v}" for k, v in sorted(bad.items())[:6])


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def fsdp_run(request, tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    out = tmp_path_factory.mktemp(f"fsdp{request.param}")
    torchrun(request.param, ranks_fsdp, out)
    return request.param, out


def test_every_method_as_fsdp_reduce_scatter(fsdp_run):
    """none equals FSDP2's reduce-scatter; every method's shard equals the slice of its own
    allreduce; mixed precision, divide factor, mismatch, DCP checkpoint (see the module doc)."""
    p, out = fsdp_run
    res = written(out, ranks_fsdp, p)
    bad = failures(res)
    assert not bad, _report(bad)


def test_fsdp_bytes_against_dense_reduce_scatter(fsdp_run):
    """Bytes per rank per step: none = FSDP2's dense reduce-scatter, fp16/bf16 = half of it
    (the reduce-scatter half of their 16-bit ring), every method equal on every rank."""
    p, out = fsdp_run
    res = written(out, ranks_fsdp, p)
    table = res[0]["bytes"]
    dense = res[0]["dense_bytes"]
    assert dense == pytest.approx(sum(n * 4 * (p - 1) / p for n in res[0]["buffer_numels"]))
    assert table["none"]["sent"] == pytest.approx(dense)
    for half in ("fp16", "bf16"):
        assert table[half]["sent"] == pytest.approx(dense / 2)
    for label, row in table.items():
        if row["formula"] is not None:
            # ring allreduces count this rank's whole chunks: within two elements a call
            assert row["sent"] == pytest.approx(row["formula"], abs=64), (label, row)
    for r in range(1, p):       # the volume model counts the same on every rank (to the ring's chunks)
        for label in table:
            if label not in ("topk", "gaussiank", "topk_dsa", "oktopk", "deepreduce", "qsgd",
                             "gtopk", "randk"):
                assert res[r]["bytes"][label]["sent"] == pytest.approx(table[label]["sent"], abs=64)


def test_fsdp_digits_reaches_ddp_accuracy(tmp_path):
    """The digits MLP (2 ranks, 8 epochs) under FSDP2 with each method reaches >= 85% test
    accuracy and the accuracy it reaches under DDP with the same method (within 5 points:
    FSDP2 selects per layer, see DIGITS_EPOCHS), and FSDP2 with ``none`` that of FSDP2's
    own reduce-scatter."""
    pytest.importorskip("torch.distributed.fsdp")
    torchrun(2, ranks_digits, tmp_path, timeout=600)
    bad = failures(written(tmp_path, ranks_digits, 2))
    assert not bad, _report(bad)


def test_exception_on_one_rank_ends_the_job(tmp_path):
    """Rank 1 raises after its first FSDP backward while rank 0 enters the next reduce-scatter:
    the job ends (non-zero exit) well before the hang guard, and rank 0 never finishes."""
    pytest.importorskip("torch.distributed.fsdp")
    t0 = time.monotonic()
    proc = torchrun(2, ranks_one_raises, tmp_path, timeout=180,
                    env=torchrun_env({"HVDC_ABORT_ON_EXCEPTION": "1"}))
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert time.monotonic() - t0 < 170
    assert not (tmp_path / "finished_rank0").exists()
    assert "raised on purpose" in proc.stderr + proc.stdout


def _run_example(args: list[str], timeout: float = 300) -> str:
    cmd = torchrun_command(2, "examples/fsdp_digits.py", *args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_fsdp_example_resumes_from_its_checkpoint(tmp_path):
    """examples/fsdp_digits.py on 2 ranks: 1 epoch, then --resume from its DCP checkpoint for
    1 more (Top-k, per-rank residuals; that such a resume is bit for bit is
    ``dcp_checkpoint_resumes_bit_for_bit`` of :func:`ranks_fsdp`). Two launches."""
    pytest.importorskip("torch.distributed.fsdp")
    common = ["--compression", "topk", "--param", "density=0.05", "--param", "warmup_steps=1",
              "--checkpoint", str(tmp_path / "ckpt")]
    first = _run_example([*common, "--epochs", "1"])
    assert "epoch 1: test accuracy" in first and "less than FSDP2's dense" in first, first
    resumed = _run_example([*common, "--epochs", "2", "--resume"])
    assert "epoch 1:" not in resumed and "epoch 2: test accuracy" in resumed, resumed
    sent = [float(ln.split("sent ")[1].split(" MiB")[0]) for ln in (first + resumed).splitlines()
            if ln.startswith("epoch")]
    assert sent[1] > sent[0] > 0, sent     # the statistics continue across the restore


def test_fsdp_bench_is_an_hvdc_bench_command():
    """``hvdc bench fsdp --help`` reaches the benchmark's own options (nothing is run)."""
    proc = subprocess.run([sys.executable, "-m", "horovod_compress.tools.cli", "bench", "fsdp", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "--variants" in proc.stdout and "--bandwidth" in proc.stdout


def test_fsdp_bench_page_and_plot(tmp_path):
    """The FSDP2 benchmark's variants, its page (speedups against FSDP2 dense, the exchange
    kind, bytes) and its plot, from a made-up result."""
    pytest.importorskip("matplotlib")
    from horovod_compress.tools.bench import fsdp_e2e
    from horovod_compress.tools.bench.ddp_e2e import ALL_HOOKS

    everything = fsdp_e2e.expand_variants("all").split(",")
    assert everything[0] == "fsdp_dense" and len(everything) == 1 + len(ALL_HOOKS)
    res = {"world_size": 4, "model": "tiny", "rank": 4, "threads": 1, "bandwidth": "1gbit",
           "hosts": 4, "date": "now", "steps_per_round": 1, "load": [1.0, 2.0], "cores": 2,
           "dense_bytes_per_step": 2 ** 20,
           "variants": {"fsdp_dense": {"median_s": 0.4, "p25_s": 0.39, "p75_s": 0.41, "steps": 3,
                                       "hook_median_s": None},
                        "hvdc_fp16": {"median_s": 0.2, "p25_s": 0.19, "p75_s": 0.21, "steps": 3,
                                      "hook_median_s": 0.1, "compression": 2.0,
                                      "bytes_sent_per_step": 2 ** 19,
                                      "real_reduce_scatter": True}}}
    page = fsdp_e2e.render(res)
    assert "| fsdp_dense | - | 400.0 | 390.0–410.0 | - | 1.00x | 1.00 | 1.0x | 3 |" in page, page
    assert "| hvdc_fp16 | reduce-scatter | 200.0 | 190.0–210.0 | 100.0 | 2.00x | 0.50 | 2.0x | 3 |" \
        in page, page
    assert "before / after: 1.00 / 2.00" in page and "shared with other jobs" in page
    assert fsdp_e2e.plot(res, tmp_path / "p.png", framework="FSDP2").stat().st_size > 1000


# ====================================================== on the ranks
METHODS = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "topk": ("topk", {"density": 0.05}),
    "randk": ("randk", {"density": 0.1}),
    "gaussiank": ("gaussiank", {"density": 0.05}),
    "topk_dsa": ("topk_dsa", {"density": 0.05}),
    "gtopk": ("gtopk", {"density": 0.05}),
    "oktopk": ("oktopk", {"density": 0.05, "warmup_steps": 1, "tau": 2, "tau_prime": 1}),
    "qsgd": ("qsgd", {}),
    "global_qsgd": ("global_qsgd", {}),
    "global_qsgd_lin8": ("global_qsgd", {"dithering": "linear", "bits": 8}),
    "deepreduce": ("deepreduce", {"sparsifier_params": {"density": 0.05}}),
    "arc_topk": ("arc_topk", {"rank": 2}),
    "powersgd": ("powersgd", {"rank": 2}),
    "greedylore": ("greedylore", {"rank": 2, "period": 2}),
    "lazy_projection": ("lazy_projection", {"rank": 2, "period": 2}),
    "randk_rows": ("randk_rows", {}),
    "topk_rows": ("topk_rows", {}),
}
STEPS = 3
# Bytes per rank of one module buffer of n float32 elements over p ranks where the method
# reduce-scatters for real: the ring's reduce-scatter half of its payload, N(P-1)/P, plus
# Global-QSGD's norm agreement (an allreduce of one float64, 2 * 8 (P-1)/P). Rand-K's
# alltoallv depends on where the shared indices fall (measured only).
RS_FORMULAS = {
    "none": lambda n, p: 4 * n * (p - 1) / p,
    "fp16": lambda n, p: 2 * n * (p - 1) / p,
    "bf16": lambda n, p: 2 * n * (p - 1) / p,
    "global_qsgd": lambda n, p: (2 * 8 + n) * (p - 1) / p,
    "global_qsgd_lin8": lambda n, p: (2 * 8 + n) * (p - 1) / p,
}
# Methods whose reduce-scatter is a variant of their own, not a block of their allreduce:
# Ok-Topk's keeps each block's whole split-and-reduce sum (no global re-selection; its
# NumPy reference is in tests/test_fsdp_reduce_scatter.py). The replay compares with it.
OWN_REDUCE_SCATTER = ("oktopk",)
# Upper bounds on bytes per rank of one module buffer of n float32 elements where the count
# depends on where the selection falls: Ok-Topk sends each selected entry outside its own
# block (8 bytes: int32 index, float32 value), at most local_guard * k of them.
RS_BOUNDS = {
    "oktopk": lambda method, n: 8 * method.local_guard * method.k_for(n),
}
# the digits check (as tests/test_ddp.py trains them; Rand-K unbiased at density 0.25)
DIGITS_METHODS = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "topk": ("topk", {"density": 0.05}),
    "randk": ("randk", {"density": 0.25, "unbiased": True}),
    "topk_dsa": ("topk_dsa", {"density": 0.05}),
    "oktopk": ("oktopk", {"density": 0.05, "warmup_steps": 1, "tau": 2, "tau_prime": 1}),
    "global_qsgd": ("global_qsgd", {}),
    "powersgd": ("powersgd", {"rank": 2}),
    "arc_topk": ("arc_topk", {"rank": 2}),
    "greedylore": ("greedylore", {"rank": 2, "period": 2}),
}
# FSDP2 reduces one module at a time, so a sparsifier selects per layer where DDP's single
# bucket selects over the whole model: the curves differ by a few points from epoch to epoch
# (measured, top-k 5%: DDP 0.889/0.942/0.869/0.944/0.950 in epochs 4-8, FSDP2
# 0.705/0.830/0.903/0.950/0.958) and meet by epoch 8.
DIGITS_EPOCHS = 8


def make(label, table=None, **override):
    import horovod_compress as hvdc
    name, params = (table or METHODS)[label]
    return getattr(hvdc.Compression, name)(**{**params, **override})


SECONDS: dict[str, float] = {}     # each check's wall seconds on this rank (reported)


def check(results, name, fn):
    t0 = time.perf_counter()
    try:
        fn()
        results[name] = "ok"
    except Exception:  # noqa: BLE001 - reported by name
        results[name] = traceback.format_exc(limit=8)[-3000:]
    SECONDS[name] = round(time.perf_counter() - t0, 2)


def _mlp(reshard=True, mp=None, seed=0):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(),
                              torch.nn.Linear(48, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    kw = {"reshard_after_forward": reshard, "mp_policy": mp or MixedPrecisionPolicy()}
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(net, **kw)
    return net


def _batch(rank, step, n=16):
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def _local_grads(model):
    return [p.grad.to_local().detach().clone() for p in model.parameters()]


def _train(model, steps, rank, start=0, opt=None, grads=None):
    """SGD with momentum on ``_batch``; ``grads`` (a list) gets each step's local gradients."""
    import torch
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if grads is not None:
            grads.append(_local_grads(model))
        opt.step()
    return opt


def _params_equal_everywhere(comm, model):
    import hashlib
    digest = hashlib.blake2b(b"".join(p.full_tensor().detach().numpy().tobytes()
                                      for p in model.parameters()), digest_size=16).digest()
    all_d = comm.allgather_object(digest)
    assert all(d == all_d[0] for d in all_d), "ranks hold different parameters"


def _compare(a, b, exact, what, rtol=1e-6):
    import torch
    if exact:
        assert torch.equal(a, b), f"{what}: max |diff| {float((a - b).abs().max()):.3g}"
    else:
        scale = max(float(a.abs().max()), 1e-30)
        assert float((a - b).abs().max()) <= rtol * scale, \
            f"{what}: max |diff| {float((a - b).abs().max()):.3g} > {rtol} * {scale:.3g}"


def _none_equals_fsdp(rank, size, reshard):
    """Our ``none`` against FSDP2's own reduce-scatter: every step's local gradients."""
    from horovod_compress.torch import fsdp as hvdc_fsdp
    ref, ours = [], []
    _train(_mlp(reshard), STEPS, rank, grads=ref)
    model = _mlp(reshard)
    hvdc_fsdp.register(model, make("none"))
    _train(model, STEPS, rank, grads=ours)
    for s, (gr, go) in enumerate(zip(ref, ours)):
        for j, (a, b) in enumerate(zip(gr, go)):
            # P = 2: one addition, bit for bit; P = 4: gloo's order of the four addends may
            # differ from ours, so float32 rounding of a different summation order
            _compare(a, b, size == 2, f"step {s} param {j}", rtol=4e-7 * size)


def _module_buffers(model, size):
    """Per module with parameters of its own: its parameters and their (rows per rank, row
    numel, rows) -- the layout of FSDP's flat buffer, computed here independently."""
    out = {}
    for name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False)]
        if not own:
            continue
        lay = []
        for p in own:
            rows = -(-p.shape[0] // size)
            rest = int(np.prod(p.shape[1:])) if p.dim() > 1 else 1
            lay.append((rows, rest, p.shape[0]))
        out[name] = (own, lay)
    return out


def _shard_equals_slice(label, rank, size, comm, bytes_table):
    """The method's shard = the slice of its own allreduce replayed on the recorded inputs;
    the optimizer's gradients = those slices; bytes of the last step against the formula."""
    import torch

    from horovod_compress.torch import fsdp as hvdc_fsdp
    method = make(label)
    model = _mlp()
    state = hvdc_fsdp.register(model, method, comm=comm)
    state.record = []
    grads = []
    opt = _train(model, STEPS - 1, rank)
    state.reset_statistics()
    first_of_last = len(state.record)
    _train(model, 1, rank, start=STEPS - 1, opt=opt, grads=grads)
    stats = state.statistics()
    _params_equal_everywhere(comm, model)
    assert state.iteration == STEPS, state.iteration
    flat = method.layout == "flat"
    numels = [sum(r * c for r, c, _ in lay) * size
              for _own, lay in _module_buffers(model, size).values()]
    formula = None
    real = bool(method.scatters and flat)
    if real and label in RS_FORMULAS:
        formula = sum(RS_FORMULAS[label](n, size) for n in numels)
    if label in RS_BOUNDS:
        assert 0 < stats["bytes_sent"] <= sum(RS_BOUNDS[label](method, n) for n in numels), stats
    elif not real and flat and all(method.expected_bytes((n,), size) is not None for n in numels):
        formula = sum(method.expected_bytes((n,), size) for n in numels)  # its allreduce
    bytes_table[label] = {"sent": stats["bytes_sent"], "received": stats["bytes_received"],
                          "dense": stats["dense_bytes"], "formula": formula,
                          "real_reduce_scatter": real}

    # replay: a fresh method of the same configuration, the same inputs in the same order
    replay = make(label)
    # beyond 2 ranks a sum folded in another order may round differently: Rand-K sums each
    # block in rank order, the allreduce in gloo's; matrix methods fuse their collectives
    exact = size == 2 or (flat and label != "randk")
    by_name = {}
    # matrix methods: only this rank's rows of each parameter are read (GreedyLore builds
    # only those, the others stay zero): compare those
    kept = {n: (rank * rows, min((rank + 1) * rows, dim0))
            for (own, lay) in _module_buffers(model, size).values()
            for q, (rows, _rest, dim0) in zip(own, lay)
            for n, p in model.named_parameters() if p is q}
    for i, (name, x, got) in enumerate(state.record):
        if label in OWN_REDUCE_SCATTER:     # its block is its reduce-scatter variant's
            want = replay.reduce_scatter(x, name, comm)
        elif flat:
            blk = x.size // size
            want = replay.allreduce(x, name, comm).reshape(-1)[rank * blk:(rank + 1) * blk]
        else:
            want = replay.allreduce(x, name, comm)
        mine = got
        if not flat and np.ndim(want):
            lo, hi = kept[name]
            mine, want = got[lo:hi], want[lo:hi]
        _compare(torch.from_numpy(np.ascontiguousarray(mine)),
                 torch.from_numpy(np.ascontiguousarray(want)), exact,
                 f"{label} record {i} ({name})", rtol=1e-4)
        if i >= first_of_last:
            by_name[name] = got
    # the gradients FSDP handed the optimizer in the last step are those slices
    params = dict(model.named_parameters())
    for (own, lay), key in zip(_module_buffers(model, size).values(),
                               _module_keys(model, size)):
        offset = 0
        for p, (rows, rest, dim0) in zip(own, lay):
            local = max(0, min(rows, dim0 - rank * rows))
            pname = next(n for n, q in params.items() if q is p)
            if flat:
                shard = np.asarray(by_name[key]).reshape(-1)
                mine = shard[offset:offset + rows * rest].reshape((rows,) + tuple(p.shape[1:]))
            else:
                mine = np.asarray(by_name[pname])[rank * rows:rank * rows + rows]
            offset += rows * rest
            j = list(params).index(pname)
            _compare(grads[-1][j], torch.from_numpy(np.ascontiguousarray(mine[:local])), True,
                     f"{label} gradient of {pname}")


def _module_keys(model, size):
    """The state key of each module's flat buffer, in :func:`_module_buffers`' order."""
    from horovod_compress.runtime.hook_buckets import flat_key
    keys = []
    for name, (_own, lay) in _module_buffers(model, size).items():
        mod = model.get_submodule(name)
        names = tuple(f"{name}.{n}" if name else n for n, _ in mod.named_parameters(recurse=False))
        keys.append(flat_key(names, sum(r * c for r, c, _ in lay) * size))
    return keys


def _mixed_precision(rank, size, dtype, comm):
    """reduce_dtype: the buffer FSDP hands over is in it; ours equals FSDP's own within that
    dtype's rounding of P additions."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from horovod_compress.torch import fsdp as hvdc_fsdp
    mp = MixedPrecisionPolicy(reduce_dtype=dtype)
    ref, ours = [], []
    _train(_mlp(mp=mp), 1, rank, grads=ref)
    model = _mlp(mp=mp)
    hvdc_fsdp.register(model, make("none"), comm=comm)
    _train(model, 1, rank, grads=ours)
    ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    for j, (a, b) in enumerate(zip(ref[0], ours[0])):
        _compare(a, b, False, f"reduce_dtype {dtype} param {j}", rtol=2 * size * ulp)


def _divide_factor(rank, size, comm):
    """set_gradient_divide_factor(1): FSDP asks for the sum; ours hands back P times the average."""
    from horovod_compress.torch import fsdp as hvdc_fsdp
    ref, ours = [], []
    _train(_mlp(), 1, rank, grads=ref)
    model = _mlp()
    for _n, mod in hvdc_fsdp.fsdp_modules(model):
        mod.set_gradient_divide_factor(1.0)
    hvdc_fsdp.register(model, make("none"), comm=comm)
    _train(model, 1, rank, grads=ours)
    for j, (a, b) in enumerate(zip(ref[0], ours[0])):
        _compare(a * size, b, False, f"divide factor 1, param {j}", rtol=1e-6)


def _mismatch_raises(rank, comm):
    """Ranks configured differently: the same TensorMismatchError on every rank."""
    from horovod_compress.mpi_collectives.consistency import TensorMismatchError
    from horovod_compress.torch import fsdp as hvdc_fsdp
    model = _mlp()
    hvdc_fsdp.register(model, make("topk", density=0.05 + 0.01 * rank), comm=comm)
    try:
        _train(model, 1, rank)
    except TensorMismatchError as exc:
        assert "density" in str(exc), str(exc)
        return
    raise AssertionError("no TensorMismatchError")


def _checkpoint(label, rank, comm, out):
    """4 steps straight = 2 steps, dcp.save, a fresh model and state, dcp.load, 2 steps."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from horovod_compress.torch import fsdp as hvdc_fsdp
    straight = _mlp()
    hvdc_fsdp.register(straight, make(label), comm=comm)
    _train(straight, 4, rank)

    first = _mlp()
    st1 = hvdc_fsdp.register(first, make(label), comm=comm)
    opt1 = _train(first, 2, rank)
    msd, osd = get_state_dict(first, opt1)
    path = out / f"dcp_{label}"
    dcp.save({"model": msd, "optim": osd, "hvdc": st1.stateful()}, checkpoint_id=str(path))

    second = _mlp(seed=1)       # other initial values: everything must come from the checkpoint
    st2 = hvdc_fsdp.register(second, make(label), comm=comm)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.05, momentum=0.9)
    msd2, osd2 = get_state_dict(second, opt2)
    sd = {"model": msd2, "optim": osd2, "hvdc": st2.stateful()}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(second, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert st2.iteration == 2, st2.iteration
    _train(second, 2, rank, start=2, opt=opt2)
    for (n, a), b in zip(straight.named_parameters(), second.parameters()):
        _compare(a.to_local(), b.to_local(), True, f"{label} {n} after the restore")


def _start_ranks():
    """One thread per rank, the gloo process group; ``(rank, world size)``."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _finish_ranks(out, entry, payload):
    """Write this rank's ``payload`` for ``entry``; leave the process group together."""
    import torch.distributed as dist
    (out / f"{entry.__name__}_rank{dist.get_rank()}.json").write_text(json.dumps(payload))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------ torchrun: every method
def ranks_fsdp(out: Path) -> None:
    import torch

    from horovod_compress.mpi_collectives import default_communicator
    from horovod_compress.torch import fsdp as hvdc_fsdp

    rank, size = _start_ranks()
    comm = default_communicator()
    checks, table = {}, {}
    for reshard in (True, False):
        check(checks, f"none_equals_fsdp[reshard_after_forward={reshard}]",
              lambda reshard=reshard: _none_equals_fsdp(rank, size, reshard))
    for label in METHODS:
        check(checks, f"shard_equals_slice[{label}]",
              lambda label=label: _shard_equals_slice(label, rank, size, comm, table))
    for dtype in (torch.bfloat16, torch.float16):
        check(checks, f"reduce_dtype[{dtype}]", lambda dtype=dtype: _mixed_precision(
            rank, size, dtype, comm))
    check(checks, "divide_factor", lambda: _divide_factor(rank, size, comm))
    check(checks, "mismatch_raises_everywhere", lambda: _mismatch_raises(rank, comm))
    for label in ("topk", "powersgd", "oktopk"):
        check(checks, f"dcp_checkpoint_resumes_bit_for_bit[{label}]",
              lambda label=label: _checkpoint(label, rank, comm, out))
    model = _mlp()
    numels = [sum(r * c for r, c, _ in lay) * size
              for _own, lay in _module_buffers(model, size).values()]
    _finish_ranks(out, ranks_fsdp, {
        "checks": checks, "bytes": table, "size": size, "buffer_numels": numels,
        "seconds": SECONDS, "dense_bytes": hvdc_fsdp.dense_reduce_scatter_bytes(model, size)})


# ------------------------------------------------------------ torchrun: digits
def ranks_digits(out: Path) -> None:
    """The digits MLP under FSDP2 and under DDP with each method: accuracy and bytes."""
    from horovod_compress.tools.bench.ddp_digits import train_ddp_digits
    from horovod_compress.tools.bench.fsdp_digits import train_fsdp_digits

    _start_ranks()
    checks, acc = {}, {}
    acc["fsdp_dense"] = train_fsdp_digits(None, epochs=DIGITS_EPOCHS)["test_accuracy"]
    for label in DIGITS_METHODS:
        def one(label=label):
            ddp = train_ddp_digits(make(label, DIGITS_METHODS), epochs=DIGITS_EPOCHS)
            fsdp = train_fsdp_digits(make(label, DIGITS_METHODS), epochs=DIGITS_EPOCHS)
            acc[label] = {"ddp": ddp["test_accuracy"], "fsdp": fsdp["test_accuracy"],
                          "fsdp_compression": fsdp["compression_ratio"]}
            assert fsdp["test_accuracy"] >= 0.85, acc[label]
            assert fsdp["test_accuracy"] >= ddp["test_accuracy"] - 0.05, acc[label]
            if label == "none":
                assert fsdp["test_accuracy"] >= acc["fsdp_dense"] - 0.01, acc
        check(checks, f"digits_fsdp_matches_ddp[{label}]", one)
    _finish_ranks(out, ranks_digits, {"checks": checks, "accuracy": acc})


# --------------------------------------------------- torchrun: one rank raises
def ranks_one_raises(out: Path) -> None:
    """Rank 1 raises after one step; rank 0 goes on into the next reduce-scatter."""
    from horovod_compress.torch import fsdp as hvdc_fsdp

    rank, _size = _start_ranks()
    model = _mlp()
    hvdc_fsdp.register(model, make("topk"))
    _train(model, 1, rank)
    if rank == 1:
        raise RuntimeError("raised on purpose on rank 1")
    _train(model, 1, rank, start=1)
    (out / f"finished_rank{rank}").write_text("1")


ENTRY_POINTS = (ranks_fsdp, ranks_digits, ranks_one_raises)


if __name__ == "__main__":
    _entry = {f.__name__: f for f in ENTRY_POINTS}[sys.argv[1]]
    _out = Path(sys.argv[2])
    _out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HVDC_ABORT_ON_EXCEPTION", "0")
    _entry(_out)
