"""``hvdc bench fsdp``: FSDP2 training steps on the emulated cluster, dense vs every method.

Compares, in one run and on the same shaped links, PyTorch FSDP2
(``fully_shard`` on every Transformer layer, the embedding, the output head
and the root) training steps with

* FSDP2's own reduce-scatter (``fsdp_dense``),
* FSDP2 + our compressed reduce-scatter (``hvdc_<method>``,
  :func:`horovod_compress.torch.fsdp.register`, every ``FSDPModule``): by
  default the methods that reduce-scatter for real and a few that fall back
  to their allreduce (``--variants all``: every method), each with its
  default parameters and one dense warm-up step (PowerSGD with ``--rank``
  and two).

One process per emulated host (network namespace, ``hvdc cluster``'s links,
tbf-shaped full duplex), gloo over the hosts' ``eth0``
(:func:`~.ddp_e2e.run_on_cluster`, as ``hvdc bench ddp-e2e``). The variants
share each worker process and run in alternating rounds; every step starts
with a barrier; the reported step is the median over rounds of the slowest
rank's step, and beside it the median time the slowest rank spent inside our
reduce-scatters. Needs root (network namespaces). Writes
``benchmarks/fsdp_e2e.md``, ``.json`` and ``.png`` (``--out``).

    sudo .venv/bin/hvdc bench fsdp --hosts 4 --bandwidth 1gbit --cluster hvdcfsdp --subnet 10.215.3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .ddp_e2e import ALL_HOOKS, parse_variant, plot, run_on_cluster, split_variants

VARIANTS = ("fsdp_dense", "hvdc_none", "hvdc_fp16", "hvdc_global_qsgd", "hvdc_randk",
            "hvdc_topk_dsa", "hvdc_topk", "hvdc_oktopk", "hvdc_powersgd")


def shard(model: Any) -> Any:
    """``fully_shard`` every Transformer layer, embedding and ``Linear`` not inside one, then the root."""
    import torch
    from torch.distributed.fsdp import fully_shard

    units = (torch.nn.TransformerEncoderLayer, torch.nn.Embedding, torch.nn.Linear)
    chosen: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, units) and not any(name.startswith(c + ".") for c in chosen):
            chosen.append(name)
            fully_shard(mod)
    fully_shard(model)
    return model


def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import horovod_compress as hvdc
    from horovod_compress.tools.bench.ddp_e2e import _with_loss_forward
    from horovod_compress.tools.bench.e2e_models import build_model, synthetic_batch
    from horovod_compress.torch import fsdp as hvdc_fsdp

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    variants = split_variants(args.variants)
    models, opts, states = {}, {}, {}
    for v in variants:
        torch.manual_seed(0)
        net = shard(_with_loss_forward(build_model(args.model)))
        if v.startswith("hvdc_"):
            name, params = parse_variant(v, args.rank)
            states[v] = hvdc_fsdp.register(net, getattr(hvdc.Compression, name)(**params))
        elif v != "fsdp_dense":
            raise ValueError(f"unknown variant {v!r}")
        models[v] = net
        opts[v] = torch.optim.SGD(net.parameters(), lr=0.01)
    dense_bytes = hvdc_fsdp.dense_reduce_scatter_bytes(models[variants[0]], size)
    times: dict[str, list[float]] = {v: [] for v in variants}
    inside: dict[str, list[float]] = {v: [] for v in variants}
    step_no = {v: 0 for v in variants}

    def one_step(v: str) -> tuple[float, float]:
        net, opt = models[v], opts[v]
        x, y = synthetic_batch(args.model, rank, step_no[v])
        step_no[v] += 1
        st = states.get(v)
        s0 = st.seconds if st is not None else 0.0
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        net(x, y).backward()
        opt.step()
        return time.perf_counter() - t0, (st.seconds - s0) if st is not None else 0.0

    for v in variants:
        for _ in range(args.warmup):
            one_step(v)
    for st in states.values():
        st.reset_statistics()
    for _ in range(args.rounds):
        for v in variants:
            for _ in range(args.steps):
                t = torch.tensor(one_step(v), dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[v].append(float(t[0]))
                inside[v].append(float(t[1]))
    if rank == 0:
        out = {"world_size": size, "model": args.model, "rank": args.rank,
               "threads": torch.get_num_threads(), "dense_bytes_per_step": dense_bytes,
               "variants": {}}
        for v, ts in times.items():
            entry = {"median_s": float(np.median(ts)), "p25_s": float(np.percentile(ts, 25)),
                     "p75_s": float(np.percentile(ts, 75)), "steps": len(ts),
                     "hook_median_s": float(np.median(inside[v])) if v in states else None,
                     "step_s": [round(t, 6) for t in ts]}
            if v in states:
                stats = states[v].statistics()
                method = states[v].method
                entry.update(params=method.config(), compression=stats["compression"],
                             bytes_sent_per_step=stats["bytes_sent"] / len(ts),
                             layout=method.layout,
                             real_reduce_scatter=bool(method.scatters and method.layout == "flat"))
            out["variants"][v] = entry
        Path(args.json).write_text(json.dumps(out, indent=1))
    for st in states.values():
        st.close()
    dist.barrier()
    dist.destroy_process_group()


def render(res: dict[str, Any]) -> str:
    """The markdown page of a run: step times, time inside our reduce-scatters, speedups, bytes."""
    variants = res["variants"]
    dense = variants.get("fsdp_dense", {}).get("median_s")
    rows = []
    for v, r in variants.items():
        speed = f"{dense / r['median_s']:.2f}x" if dense else "-"
        hook = r.get("hook_median_s")
        comp = r.get("compression")
        kind = ("-" if v == "fsdp_dense" else "reduce-scatter" if r.get("real_reduce_scatter")
                else "per parameter" if r.get("layout") == "matrix" else "allreduce + slice")
        sent = r.get("bytes_sent_per_step", res.get("dense_bytes_per_step"))
        rows.append(f"| {v} | {kind} | {1e3 * r['median_s']:.1f} | {1e3 * r['p25_s']:.1f}–"
                    f"{1e3 * r['p75_s']:.1f} | {'-' if hook is None else f'{1e3 * hook:.1f}'} "
                    f"| {speed} | {sent / 2**20:.2f} | {'1.0x' if comp is None else f'{comp:.1f}x'} "
                    f"| {r['steps']} |")
    load = res.get("load")
    load_txt = (f" Load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f} on "
                f"{res.get('cores', '?')} cores, shared with other jobs; with more ranks than "
                f"cores the ranks also compete for CPU, so close orderings are noise." if load
                else "")
    return (f"# FSDP2 on the emulated cluster at P = {res['hosts']}: dense vs compressed reduce-scatter\n\n"
            f"Measured {res['date']} by `{res.get('command', 'hvdc bench fsdp')}` (one run): "
            f"{res['hosts']} hosts (one rank each, {res['threads']} thread(s)), links "
            f"{res['bandwidth']} full duplex (tbf), gloo over TCP; model `{res['model']}` with "
            f"`fully_shard` on every Transformer layer, the embedding, the head and the root. "
            f"Step = forward + backward (with the reduce-scatters) + SGD update, every step "
            f"started by a barrier; the slowest rank's time; variants alternate in rounds of "
            f"{res.get('steps_per_round', '?')} steps. Bytes: sent per rank per step under the "
            f"volume model; FSDP2's own reduce-scatter counted as N(P-1)/P.{load_txt}\n\n"
            "| variant | exchange | median step (ms) | p25–p75 (ms) | in our reduce-scatter "
            "(ms, median) | speedup vs FSDP2 dense | MiB sent per step | compression | steps |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")


def expand_variants(spec: str) -> str:
    """``all`` -> FSDP2 dense and every method's reduce-scatter."""
    if spec != "all":
        return spec
    return ",".join(["fsdp_dense", *(f"hvdc_{m}" for m in ALL_HOOKS)])


def _add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--cluster", default="hvdcfsdp", help="emulated cluster name (namespaces <name>-h<i>)")
    ap.add_argument("--subnet", default="10.215.3", help="first three octets of the hosts' /24")
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    ap.add_argument("--steps", type=int, default=1, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated: fsdp_dense, hvdc_<method>[:{json params}]; 'all' = every method")
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--out", default="benchmarks/fsdp_e2e.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); the exit status."""
    args.variants = expand_variants(args.variants)
    if args.worker:
        _worker(args)
        return 0
    return run_on_cluster(
        args, "horovod_compress.tools.bench.fsdp_e2e", render,
        lambda res, path: plot(res, path, framework="FSDP2", inside="inside our reduce-scatters"))


def register_bench(sub: argparse._SubParsersAction) -> None:
    """``hvdc bench fsdp``: FSDP2 dense vs every method's reduce-scatter on the emulated cluster."""
    p = sub.add_parser("fsdp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="FSDP2 dense vs every method's compressed reduce-scatter on shaped links")
    _add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> None:
    """``python -m horovod_compress.tools.bench.fsdp_e2e``: parse the options and run."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(ap)
    sys.exit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
