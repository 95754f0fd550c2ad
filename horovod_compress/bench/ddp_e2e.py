"""``python -m horovod_compress.bench.ddp_e2e``: DDP training steps on the emulated 1 Gbit cluster.

Compares, in one run and on the same shaped links, PyTorch
``DistributedDataParallel`` training steps with

* DDP's own dense allreduce,
* DDP + our PowerSGD hook (``horovod_compress.torch.ddp.comm_hook``),
* DDP + PyTorch's ``powerSGD_hook`` (same rank, warm start, error feedback; one
  bucket at a time, as our hook runs, since on gloo it can deadlock otherwise),

and optionally other methods' hooks. One process per emulated host (network
namespace, ``hvdc cluster``'s links, tbf-shaped full duplex), rendezvous
``env://`` on host 0's address, gloo over the hosts' ``eth0``. The variants
share each worker process and are run in alternating rounds, so drifts of
the machine hit all of them alike; every step starts with a barrier; the
reported step time is the median over rounds of the slowest rank's step.
Needs root (network namespaces). Writes ``benchmarks/ddp_e2e.md`` and ``.json``.

    sudo .venv/bin/python -m horovod_compress.bench.ddp_e2e --hosts 2 --bandwidth 1gbit
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("ddp_dense", "hvdc_powersgd", "torch_powerSGD_hook")


def _with_loss_forward(model: Any) -> Any:
    """``model`` wrapped so that ``forward(x, y)`` is ``model.loss(x, y)``.

    DDP synchronises gradients (and calls the comm hook) only for a backward
    that follows *its own* forward, which arms its reducer; calling
    ``ddp.module.loss`` directly would train without any communication.
    """
    import torch

    class LossOf(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.model = inner

        def forward(self, x: Any, y: Any) -> Any:
            return self.model.loss(x, y)

    return LossOf(model)


def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import horovod_compress as hvdc
    from horovod_compress.bench.e2e_models import build_model, synthetic_batch
    from horovod_compress.torch import ddp as hvdc_ddp

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    variants = args.variants.split(",")
    models, opts = {}, {}
    for v in variants:
        torch.manual_seed(0)
        net = _with_loss_forward(build_model(args.model))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        if v == "hvdc_powersgd":
            method = hvdc.Compression.powersgd(rank=args.rank, warmup_steps=2)
            hook = hvdc_ddp.comm_hook(method, model=ddp)
            ddp.register_comm_hook(hook.state, hook)
        elif v == "torch_powerSGD_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            # one bucket at a time, as our hook runs: on gloo, powerSGD_hook can deadlock with
            # several buckets in flight (hvdc_ddp.one_bucket_at_a_time)
            ddp.register_comm_hook(ps.PowerSGDState(process_group=None,
                                                    matrix_approximation_rank=args.rank,
                                                    start_powerSGD_iter=2),
                                   hvdc_ddp.one_bucket_at_a_time(ps.powerSGD_hook))
        elif v.startswith("hvdc_"):
            method = getattr(hvdc.Compression, v[5:])(warmup_steps=1)
            hook = hvdc_ddp.comm_hook(method, model=ddp)
            ddp.register_comm_hook(hook.state, hook)
        elif v != "ddp_dense":
            raise ValueError(f"unknown variant {v!r}")
        models[v] = ddp
        opts[v] = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times: dict[str, list[float]] = {v: [] for v in variants}
    step_no = {v: 0 for v in variants}

    def one_step(v: str) -> float:
        ddp, opt = models[v], opts[v]
        x, y = synthetic_batch(args.model, rank, step_no[v])
        step_no[v] += 1
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x, y).backward()     # through DDP's forward: its reducer (and the hook) runs
        opt.step()
        return time.perf_counter() - t0

    for v in variants:                     # warm-up: dense first step + bucket rebuild + first compressed
        for _ in range(args.warmup):
            one_step(v)
    for _ in range(args.rounds):
        for v in variants:
            for _ in range(args.steps):
                t = torch.tensor([one_step(v)], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[v].append(float(t[0]))
    if rank == 0:
        out = {"world_size": size, "model": args.model, "rank": args.rank,
               "threads": torch.get_num_threads(),
               "variants": {v: {"median_s": float(np.median(ts)), "p25_s": float(np.percentile(ts, 25)),
                                "p75_s": float(np.percentile(ts, 75)), "steps": len(ts)}
                            for v, ts in times.items()}}
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    from horovod_compress.cluster import ClusterSpec, EmulatedCluster
    from horovod_compress.cluster.launch import threads_per_rank

    spec = ClusterSpec(hosts=args.hosts, bandwidth=args.bandwidth, name=args.cluster,
                       subnet=args.subnet)
    out_json = Path(args.out).with_suffix(".json")
    tmp_json = Path("/tmp") / f"hvdc_ddp_e2e_{os.getpid()}.json"
    threads = threads_per_rank(args.hosts)
    with EmulatedCluster(spec):
        env = dict(os.environ)
        env.update(MASTER_ADDR=spec.address(0), MASTER_PORT=str(args.port), WORLD_SIZE=str(args.hosts),
                   GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS=str(threads),
                   NUMBA_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                   MKL_NUM_THREADS=str(threads), HVDC_COMM_BACKEND="torch", PYTHONHASHSEED="0")
        procs = []
        for i in range(args.hosts):
            e = dict(env, RANK=str(i), LOCAL_RANK="0")
            cmd = ["ip", "netns", "exec", spec.host(i), sys.executable, "-m",
                   "horovod_compress.bench.ddp_e2e", "--worker", "--json", str(tmp_json),
                   "--model", args.model, "--rank", str(args.rank), "--steps", str(args.steps),
                   "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                   "--variants", args.variants]
            procs.append(subprocess.Popen(cmd, env=e))
        codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        print(f"workers failed: exit codes {codes}", file=sys.stderr)
        return 1
    res = json.loads(tmp_json.read_text())
    res.update(bandwidth=args.bandwidth, hosts=args.hosts, date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                             time.gmtime()))
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=1))
    Path(args.out).write_text(render(res))
    print(render(res))
    return 0


def render(res: dict[str, Any]) -> str:
    dense = res["variants"].get("ddp_dense", {}).get("median_s")
    rows = []
    for v, r in res["variants"].items():
        speed = f"{dense / r['median_s']:.2f}x" if dense else "-"
        rows.append(f"| {v} | {1e3 * r['median_s']:.1f} | {1e3 * r['p25_s']:.1f}–{1e3 * r['p75_s']:.1f} "
                    f"| {speed} | {r['steps']} |")
    return (f"# DDP on the emulated cluster: dense vs PowerSGD hooks\n\n"
            f"Measured {res['date']} by `python -m horovod_compress.bench.ddp_e2e` (one run): "
            f"{res['hosts']} hosts (one rank each, {res['threads']} thread(s)), links {res['bandwidth']} "
            f"full duplex (tbf), gloo over TCP; model `{res['model']}`; PowerSGD rank {res['rank']} "
            f"(both hooks: warm start, error feedback, one dense step first). Step = forward + "
            f"backward (with the hook) + SGD update, every step started by a barrier; the slowest "
            f"rank's time; variants alternate in rounds.\n\n"
            "| variant | median step (ms) | p25–p75 (ms) | speedup vs DDP dense | steps |\n"
            "|---|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--cluster", default="hvdcddp", help="emulated cluster name (namespaces <name>-h<i>)")
    ap.add_argument("--subnet", default="10.214.0")
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank (both hooks)")
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--out", default="benchmarks/ddp_e2e.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
    else:
        sys.exit(_run(args))


if __name__ == "__main__":
    main()
