"""``python -m horovod_compress.tools.bench.ddp_e2e``: DDP training steps on the emulated 1 Gbit cluster.

Compares, in one run and on the same shaped links, PyTorch
``DistributedDataParallel`` training steps with

* DDP's own dense allreduce (``ddp_dense``),
* DDP + PyTorch's ``powerSGD_hook`` (``torch_powerSGD_hook``: same rank, warm
  start, error feedback; one bucket at a time, as our hooks run, since on
  gloo it can deadlock otherwise),
* DDP + our hooks (``hvdc_<method>``, ``horovod_compress.torch.ddp.comm_hook``;
  ``hvdc_powersgd`` by default, ``--variants all`` for every method, each
  with its default parameters and one dense warm-up step; PowerSGD with
  ``--rank`` and two, as PyTorch's hook).

One process per emulated host (network namespace, ``hvdc cluster``'s links,
tbf-shaped full duplex), rendezvous ``env://`` on host 0's address, gloo
over the hosts' ``eth0``. The variants share each worker process and are
run in alternating rounds, so drifts of the machine hit all of them alike;
every step starts with a barrier; the reported step time is the median over
rounds of the slowest rank's step, and beside it the median time the
slowest rank spent inside the comm hook. Needs root (network namespaces).
Writes ``benchmarks/ddp_e2e.md``, ``.json`` and ``.png`` (``--out``); the
cluster's name and subnet are options, so runs beside other clusters do not
collide.

    sudo .venv/bin/python -m horovod_compress.tools.bench.ddp_e2e --hosts 2 --bandwidth 1gbit
    sudo .venv/bin/python -m horovod_compress.tools.bench.ddp_e2e --variants all --cluster hvdcddp --subnet 10.213.7
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .report_files import write_report

VARIANTS = ("ddp_dense", "torch_powerSGD_hook", "hvdc_powersgd")


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


def parse_variant(v: str, rank: int) -> tuple[str, dict[str, Any]]:
    """``"hvdc_topk"`` / ``'hvdc_topk:{"density": 0.01}'`` -> ``("topk", params)``.

    Our hooks get ``warmup_steps=1`` (DDP's first iteration, a single bucket,
    runs dense; PyTorch's hook needs the same) unless given; PowerSGD's rank
    is ``rank`` (the ``--rank`` shared with PyTorch's hook) unless given.
    """
    import inspect

    from horovod_compress.compressors.registry import method_class

    name, _, raw = v.partition(":")
    params = json.loads(raw) if raw else {}
    method = name[len("hvdc_"):]
    if "warmup_steps" in inspect.signature(method_class(method).__init__).parameters:
        params.setdefault("warmup_steps", 2 if method == "powersgd" else 1)
    if method == "powersgd":
        params.setdefault("rank", rank)
    return method, params


def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import horovod_compress as hvdc
    from horovod_compress.tools.bench.e2e_models import build_model, synthetic_batch
    from horovod_compress.torch import ddp as hvdc_ddp

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    variants = split_variants(args.variants)
    models, opts, hook_seconds, states = {}, {}, {}, {}
    for v in variants:
        torch.manual_seed(0)
        net = _with_loss_forward(build_model(args.model))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        clock = [0.0]
        if v == "torch_powerSGD_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            # one bucket at a time, as our hook runs: on gloo, powerSGD_hook can deadlock with
            # several buckets in flight (hvdc_ddp.one_bucket_at_a_time)
            ddp.register_comm_hook(ps.PowerSGDState(process_group=None,
                                                    matrix_approximation_rank=args.rank,
                                                    start_powerSGD_iter=2),
                                   _timed(hvdc_ddp.one_bucket_at_a_time(ps.powerSGD_hook), clock))
        elif v.startswith("hvdc_"):
            name, params = parse_variant(v, args.rank)
            hook = hvdc_ddp.comm_hook(getattr(hvdc.Compression, name)(**params), model=ddp)
            ddp.register_comm_hook(hook.state, _timed(hook, clock))
            states[v] = hook.state
        elif v != "ddp_dense":
            raise ValueError(f"unknown variant {v!r}")
        models[v] = ddp
        hook_seconds[v] = clock
        opts[v] = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times: dict[str, list[float]] = {v: [] for v in variants}
    in_hook: dict[str, list[float]] = {v: [] for v in variants}
    step_no = {v: 0 for v in variants}

    def one_step(v: str) -> tuple[float, float]:
        ddp, opt = models[v], opts[v]
        x, y = synthetic_batch(args.model, rank, step_no[v])
        step_no[v] += 1
        dist.barrier()
        h0 = hook_seconds[v][0]
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x, y).backward()     # through DDP's forward: its reducer (and the hook) runs
        opt.step()
        return time.perf_counter() - t0, hook_seconds[v][0] - h0

    for v in variants:                     # warm-up: dense first step + bucket rebuild + first compressed
        for _ in range(args.warmup):
            one_step(v)
    for v, st in states.items():
        st.reset_statistics()
    for _ in range(args.rounds):
        for v in variants:
            for _ in range(args.steps):
                t = torch.tensor(one_step(v), dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[v].append(float(t[0]))
                in_hook[v].append(float(t[1]))
    if rank == 0:
        out = {"world_size": size, "model": args.model, "rank": args.rank,
               "threads": torch.get_num_threads(), "variants": {}}
        for v, ts in times.items():
            entry = {"median_s": float(np.median(ts)), "p25_s": float(np.percentile(ts, 25)),
                     "p75_s": float(np.percentile(ts, 75)), "steps": len(ts),
                     "hook_median_s": float(np.median(in_hook[v])) if v != "ddp_dense" else None,
                     "step_s": [round(t, 6) for t in ts], "hook_s": [round(t, 6) for t in in_hook[v]]}
            if v in states:
                stats = states[v].statistics()
                entry.update(params=states[v].method.config(),
                             compression=stats["compression"],
                             bytes_sent_per_step=stats["bytes_sent"] / len(ts))
            out["variants"][v] = entry
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _timed(hook: Any, clock: list[float]) -> Any:
    """``hook`` with its wall time added to ``clock[0]`` (no annotations: DDP inspects them)."""
    def timed(state, bucket):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        try:
            return hook(state, bucket)
        finally:
            clock[0] += time.perf_counter() - t0

    timed.__qualname__ = getattr(hook, "__qualname__", "hook")
    return timed


def split_variants(spec: str) -> list[str]:
    """Comma-separated variants; commas inside ``{...}`` parameters do not split (as ``hvdc bench e2e``'s methods)."""
    from .e2e import split_specs
    return split_specs(spec)


def run_on_cluster(args: argparse.Namespace, module: str,
                   render_page: Callable[[dict[str, Any]], str],
                   plot_page: Callable[[dict[str, Any], Path], Any]) -> int:
    """Start ``python -m <module> --worker`` once per emulated host as a gloo job over the
    hosts' links (``args``: hosts, bandwidth, cluster, subnet, port, timeout, and the
    workers' model, rank, steps, rounds, warmup, variants); write rank 0's results with the
    run's provenance (bandwidth, load average before and after, cores, command, date) to
    ``args.out`` (.md by ``render_page``, .json, .png by ``plot_page``). The exit status."""
    from horovod_compress.tools.cluster import ClusterSpec, EmulatedCluster
    from horovod_compress.tools.cluster.launch import threads_per_rank

    spec = ClusterSpec(hosts=args.hosts, bandwidth=args.bandwidth, name=args.cluster,
                       subnet=args.subnet)
    tmp_json = Path("/tmp") / f"hvdc_{module.rsplit('.', 1)[-1]}_{os.getpid()}.json"
    threads = threads_per_rank(args.hosts)
    argv_used = sys.argv[1:]
    load0 = os.getloadavg()[0]
    with EmulatedCluster(spec):
        env = dict(os.environ)
        env.update(MASTER_ADDR=spec.address(0), MASTER_PORT=str(args.port), WORLD_SIZE=str(args.hosts),
                   GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS=str(threads),
                   NUMBA_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                   MKL_NUM_THREADS=str(threads), HVDC_COMM_BACKEND="torch", PYTHONHASHSEED="0")
        procs = []
        for i in range(args.hosts):
            e = dict(env, RANK=str(i), LOCAL_RANK="0")
            cmd = ["ip", "netns", "exec", spec.host(i), sys.executable, "-m", module,
                   "--worker", "--json", str(tmp_json), "--model", args.model,
                   "--rank", str(args.rank), "--steps", str(args.steps),
                   "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                   "--variants", args.variants]
            procs.append(subprocess.Popen(cmd, env=e))
        codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        print(f"workers failed: exit codes {codes}", file=sys.stderr)
        return 1
    res = json.loads(tmp_json.read_text())
    tmp_json.unlink()
    res.update(bandwidth=args.bandwidth, hosts=args.hosts, load=[load0, os.getloadavg()[0]],
               cores=os.cpu_count(), command=(  # as typed: through the CLI or the module
                   "hvdc " if argv_used[:1] == ["bench"] else f"python -m {module} ")
               + " ".join(argv_used),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               steps_per_round=args.steps, rounds=args.rounds)
    out = Path(args.out)
    write_report(out.parent, out.stem, res, render_page, plot_page)
    return 0


def _run(args: argparse.Namespace) -> int:
    return run_on_cluster(args, "horovod_compress.tools.bench.ddp_e2e", render, plot)


def _label(v: str) -> str:
    return v.replace("hvdc_", "ours: ").replace("torch_powerSGD_hook", "PyTorch powerSGD_hook")


def render(res: dict[str, Any]) -> str:
    """The markdown page of a run: step times, time inside the hook, ratios to DDP and to PyTorch's hook."""
    variants = res["variants"]
    dense = variants.get("ddp_dense", {}).get("median_s")
    theirs = variants.get("torch_powerSGD_hook", {}).get("median_s")
    rows = []
    for v, r in variants.items():
        speed = f"{dense / r['median_s']:.2f}x" if dense else "-"
        vs = f"{r['median_s'] / theirs:.2f}" if theirs else "-"
        hook = r.get("hook_median_s")
        comp = r.get("compression")
        rows.append(f"| {v} | {1e3 * r['median_s']:.1f} | {1e3 * r['p25_s']:.1f}–{1e3 * r['p75_s']:.1f} "
                    f"| {'-' if hook is None else f'{1e3 * hook:.1f}'} | {speed} | {vs} "
                    f"| {'-' if comp is None else f'{comp:.1f}x'} | {r['steps']} |")
    load = res.get("load")
    load_txt = (f" Load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f} "
                f"on {res.get('cores', '?')} cores." if load else "")
    return (f"# DDP on the emulated cluster: dense vs comm hooks\n\n"
            f"Measured {res['date']} by `{res.get('command', 'python -m horovod_compress.tools.bench.ddp_e2e')}` "
            f"(one run): {res['hosts']} hosts (one rank each, {res['threads']} thread(s)), links "
            f"{res['bandwidth']} full duplex (tbf), gloo over TCP; model `{res['model']}`; PowerSGD rank "
            f"{res['rank']} (both PowerSGD hooks: warm start, error feedback, two dense steps first; "
            f"PyTorch's hook finished one bucket at a time, as ours are). Step = forward + backward "
            f"(with the hook) + SGD update, every step started by a barrier; the slowest rank's time; "
            f"variants alternate in rounds of {res.get('steps_per_round', '?')} steps.{load_txt}\n\n"
            "| variant | median step (ms) | p25–p75 (ms) | in hook (ms, median) | speedup vs DDP dense "
            "| step / PyTorch hook's | compression (bytes vs dense) | steps |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")


def plot(res: dict[str, Any], path: Path, *, framework: str = "DDP",
         inside: str = "inside the comm hook") -> Path:
    """Bar chart: median step time per variant, the part spent inside the hook (``inside``) shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["variants"])
    step = [1e3 * res["variants"][v]["median_s"] for v in names]
    hook = [1e3 * (res["variants"][v].get("hook_median_s") or 0.0) for v in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(names) + 2), 4.2))
    x = range(len(names))
    ax.bar(x, step, color="#9ecae1", label="step (median)")
    ax.bar(x, hook, color="#3182bd", label=f"{inside} (median)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([_label(v) for v in names], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title(f"{framework}, {res['hosts']} hosts at {res['bandwidth']}, {res['model']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


ALL_HOOKS = ("none", "fp16", "bf16", "topk", "randk", "gaussiank", "topk_dsa", "gtopk", "oktopk",
             "qsgd", "global_qsgd", "deepreduce", "arc_topk", "powersgd", "greedylore",
             "lazy_projection", "randk_rows", "topk_rows")


def expand_variants(spec: str) -> str:
    """``all`` -> DDP dense, PyTorch's PowerSGD hook and every method's hook (ours), in that order."""
    if spec != "all":
        return spec
    return ",".join(["ddp_dense", "torch_powerSGD_hook", "hvdc_powersgd",
                     *(f"hvdc_{m}" for m in ALL_HOOKS if m != "powersgd")])


def _add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--cluster", default="hvdcddp", help="emulated cluster name (namespaces <name>-h<i>)")
    ap.add_argument("--subnet", default="10.214.0", help="first three octets of the hosts' /24")
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank (both hooks)")
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated: ddp_dense, torch_powerSGD_hook, hvdc_<method>[:{json params}]; "
                         "'all' = every method's hook")
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--out", default="benchmarks/ddp_e2e.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or, with ``--worker``, one rank of it); the exit status."""
    args.variants = expand_variants(args.variants)
    if args.worker:
        _worker(args)
        return 0
    return _run(args)


def register_bench(sub: argparse._SubParsersAction) -> None:
    """``hvdc bench ddp-e2e``: DDP dense vs every comm hook on the emulated cluster."""
    p = sub.add_parser("ddp-e2e", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="DDP dense vs PyTorch's PowerSGD hook vs every method's hook on shaped links")
    _add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(ap)
    sys.exit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
