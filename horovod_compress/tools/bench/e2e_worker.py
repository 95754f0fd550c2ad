"""One rank of ``hvdc bench e2e``: probe the links, then time training steps per method.

Run under mpirun (the launcher in :mod:`.e2e` starts it inside the emulated
cluster). Rank 0 prints one ``HVDC-PROGRESS <label>`` line per finished item
for the launcher's progress bar and writes the JSON result.

A step is timed with ``overlap=False`` so its parts add up: buckets are
reduced inside the backward pass, in the hooks, so

    step = forward + backward + exchange + optimizer update
    exchange (method.allreduce, wall)  = compression + MPI time
    MPI time (Communicator.timings)    = wait + communication
    wait (timings' "agree" op)         = the calls' 1-byte agreement, where a rank
                                         waits for peers still computing

and compute = step - exchange. An allreduce a method runs as the pipelined
point-to-point ring of ``reduce_ops`` is counted as an allreduce, as always;
the worker also records its share (``transport.ring``: calls, bytes, and the
wall and CPU time of the method's work the ring ran between its progress
calls), so the model can price those bytes at the point-to-point probe's rate.
The link probes run before each round of the methods and after the last (their
samples pooled: :func:`merge_probes`), and time each large message after a burst
of CPU work that leaves the links idle, as a step's exchange meets them, and the interleaved probe
times tiny allreduces between CPU bursts of several lengths (mean, median,
90th percentile per call). The same parts are also taken in thread CPU
time (``time.process_time``: the lockstep workers of a matrix method's group
included): with more ranks than cores a rank's wall time
includes waiting for the CPU, and its MPI time waiting for peers that wait
for the CPU; CPU time is what the work itself costs. All ranks start each step together (a
barrier), so the MPI time measures the exchange, not the previous step's skew.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from ...cost_model import ONE_WAY
from .e2e_calls import PROBE_REPEATS, RING_OP, RingTransport, parse_spec, split_specs
from .e2e_models import build_model
from .workload import Workload, named_workload

PROBE_SMALL = 8
PROBE_LARGE = 16 * 1024 * 1024
#: Further message sizes each collective is probed at (bytes of the whole message, as
#: ``PROBE_LARGE``): the rate a link reaches depends on the message (MPI's algorithm, TCP's
#: window against the token bucket), and the methods' calls range from kilobytes to megabytes
PROBE_SIZES = (512 * 1024, 1024 * 1024, 2 * 1024 * 1024, 4 * 1024 * 1024)
#: CPU seconds of work before each large probe call: the links sit idle as during a step's
#: forward and backward pass, so the probe meets them as a step's exchange does
PROBE_IDLE_CPU_S = 0.05
#: CPU seconds of work between the interleaved probe's tiny allreduces: from below the methods'
#: spacing of calls (PowerSGD's 72 calls, ~1.5 ms apart) to a step's first call, which follows
#: the forward pass and the backward pass up to the first full bucket (0.06-0.3 s of CPU on this
#: testbed's models): with more ranks than cores the ranks drift further apart the longer they compute
INTERLEAVED_WORK_S = (5e-5, 5e-4, 2e-3, 8e-3, 3.2e-2, 1.28e-1)
#: CPU seconds of work each spacing of the interleaved probe runs at most (fewer calls for the
#: long spacings, at least :data:`INTERLEAVED_MIN_CALLS`)
INTERLEAVED_BUDGET_S = 1.6
INTERLEAVED_MIN_CALLS = 8


def _cpu_burst(seconds: float, data: np.ndarray) -> float:
    """Sort chunks of ``data`` until this thread has used ``seconds`` of CPU; returns the CPU time used."""
    c0 = time.thread_time()
    while time.thread_time() - c0 < seconds:
        float(np.sort(data).sum())
    return time.thread_time() - c0


def _timed(comm: Any, fn: Any, repeats: int, before: Any = None) -> tuple[list[float], list[float]]:
    """Wall time of ``fn()``, all ranks starting together: (each repeat's slowest rank's time,
    each repeat's mean over ranks).

    ``before()`` runs before each repeat's barrier (e.g. a burst of CPU work that leaves the links idle).
    The mean over ranks is the statistic a step's measured communication time takes (each rank's
    time in MPI, averaged over ranks), so the model is fitted to it: in a ring allgather the ranks
    finish one after another, and at P = 4 on 100 Mbit the slowest took 0.40 s against a mean of
    0.30 s for 0.92 MB per rank, the mean being what Top-k's own allgather of that size spent."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    own = np.array(times)
    slowest = comm.allreduce(own, "max")
    mean = comm.allreduce(own, "sum") / comm.size
    return [float(t) for t in slowest], [float(t) for t in mean]


def _ring_probe(comm: Any, nbytes: int) -> Any:
    """One call of the pipelined point-to-point ring (``reduce_ops.ring_reduce_once_items``)
    over ``nbytes`` of 16-bit items, with the methods' segmenting between hosts
    (``reduce_ops.NETWORK_RING_PIECES``) and a byte-wise add as the reduction: the transport
    fp16/bf16 and Global-QSGD run their allreduce on, timed as such."""
    from ...mpi_collectives.reduce_ops import NETWORK_RING_PIECES, ring_reduce_once_items
    segment, slice_ = NETWORK_RING_PIECES
    own = np.ones(nbytes, np.uint8)
    result, partial, mine = (np.empty(nbytes, np.uint8) for _ in range(3))

    def produce(lo: int, hi: int) -> None:
        """The payload is ``own`` as allocated: nothing to compute before a block is sent."""

    def reduce(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int) -> int:
        np.add(a[lo:hi], b[lo:hi], out=out[lo:hi])
        return 0

    def run() -> None:
        ring_reduce_once_items(comm, nbytes // 2, 2, produce, own, reduce, None,
                               segment_bytes=segment, slice_bytes=slice_,
                               result=result, scratch=(partial, mine))
    return run


def probe_links(comm: Any, repeats: int, passes: int = 1) -> dict[str, Any]:
    """One pass of the probes: small- and large-message times of each collective the methods use,
    and its bytes per rank; ``size_samples``: the same call at the message sizes of :data:`PROBE_SIZES`.

    Every time is kept as ``repeats`` samples (``small`` ones ``3 * repeats``) of the slowest rank's
    time and of the mean over ranks (see :func:`_timed`); :func:`merge_probes` turns one or more
    passes into the medians the model is fitted to. ``passes`` (how many this run makes) divides
    the interleaved probe's CPU budget among them."""
    p, rank = comm.size, comm.rank
    out: dict[str, Any] = {}
    small = np.zeros(PROBE_SMALL // 4, np.float32)

    def volume(fn: Any) -> float:
        comm.reset_stats()
        fn()
        st = comm.stats()
        return max(st["sent"], st["received"])

    work = np.random.default_rng(rank).standard_normal(50_000).astype(np.float32)

    def idle() -> None:
        _cpu_burst(PROBE_IDLE_CPU_S, work)
    dest, src = (rank + 1) % p, (rank - 1) % p

    def shift(buf: np.ndarray) -> None:
        req = comm.isend(buf, dest, tag=7)
        comm.recv(src, tag=7, dtype=np.float32)
        req.wait()
    pair = rank ^ 1                    # ranks 0->1, 2->3, ...: one direction of each pair's link busy
    ack = np.zeros(1, np.uint8)

    def oneway(buf: np.ndarray) -> None:
        """``buf`` from the even rank of each pair to the odd one, which answers with one byte once
        it has all of it: both ranks' time is the one-way wire time (a sender alone would return
        once its message is in the socket buffers)."""
        if pair >= p:
            return
        if rank % 2 == 0:
            req = comm.isend(buf, pair, tag=8)
            comm.recv(pair, tag=9, dtype=np.uint8)
            req.wait()
        else:
            comm.recv(pair, tag=8, dtype=np.float32)
            comm.isend(ack, pair, tag=9).wait()
    # each collective the methods call (allgather and broadcast have algorithms of their own in
    # Open MPI, so they get their own probe), and point to point: a ring shift of the large
    # buffer (every link busy both ways), which is also the pipelined ring's transport, and a
    # one-way transfer (gTop-k's tree levels: the reverse direction carries only TCP's ACKs,
    # which a busy reverse direction queues behind its own data in the shaper)
    def calls(size: int) -> dict[str, Any]:
        """Each probed operation's call moving a message of ``size`` bytes."""
        whole = np.ones(size // 4, np.float32)
        part = np.ones(size // 4 // p, np.float32)
        return {
            "allreduce": lambda: comm.allreduce(whole),
            "allgatherv": lambda: comm.allgatherv(part),
            "allgather": lambda: comm.allgather(part),
            "alltoallv": lambda: comm.alltoallv([part] * p),
            "broadcast": lambda: comm.broadcast(whole),
            "p2p": lambda: shift(whole),
            ONE_WAY: lambda: oneway(whole),
            "ring": _ring_probe(comm, size),
        }
    tiny = {
        "allreduce": lambda: comm.allreduce(small),
        "allgatherv": lambda: comm.allgatherv(small),
        "allgather": lambda: comm.allgather(small),
        "alltoallv": lambda: comm.alltoallv([small] * p),
        "broadcast": lambda: comm.broadcast(small),
        "p2p": lambda: shift(small),
        ONE_WAY: lambda: oneway(small),
        "ring": lambda: shift(small),     # the ring's rounds are point-to-point messages
    }
    by_size = {size: calls(size) for size in (PROBE_LARGE, *PROBE_SIZES)}
    for op, f_small in tiny.items():
        f_large = by_size[PROBE_LARGE][op]
        nbytes = volume(f_large) if op not in ("p2p", ONE_WAY) else float(PROBE_LARGE)
        small_slowest, small_mean = _timed(comm, f_small, repeats * 3)
        large_slowest, large_mean = _timed(comm, f_large, repeats, before=idle)
        sizes = []
        for size in PROBE_SIZES:
            f = by_size[size][op]
            moved = volume(f) if op not in ("p2p", ONE_WAY) else float(size)
            slowest, mean = _timed(comm, f, repeats, before=idle)
            sizes.append({"bytes": moved, "slowest_s": slowest, "rank_mean_s": mean})
        out[op] = {"large_bytes": nbytes, "idle_cpu_s": PROBE_IDLE_CPU_S,
                   "small_samples_s": small_slowest, "small_rank_samples_s": small_mean,
                   "large_samples_s": large_slowest, "large_rank_samples_s": large_mean,
                   "size_samples": sizes}
    out["interleaved"] = probe_interleaved(comm, repeats * 10, budget_s=INTERLEAVED_BUDGET_S / passes)
    comm.reset_stats()
    return out


def probe_passes(rounds: int) -> int:
    """How many times a run probes its links: before each round of the methods and after the last,
    so the probes sample the links across the whole time the methods were measured in."""
    return rounds + 1


def merge_probes(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One probe table from several passes of :func:`probe_links`: every statistic is the median
    of all passes' samples pooled (the interleaved probe's: the mean over passes).

    The links of a shared machine have slow phases (at P = 2, 1 Gbit one run's probes carried
    0.51 Gbit/s point to point where the dense steps minutes later carried 0.91); a median over
    samples taken before, between and after the methods' rounds is the link those rounds met,
    where one pass is whatever phase it fell in. The fields are those one pass has always had:
    ``small_s``/``large_s``/``sizes`` (slowest rank) and ``small_rank_mean_s``/
    ``large_rank_mean_s``/``sizes_rank_mean`` (mean over ranks; the model is fitted to these),
    ``large_samples_s`` and ``large_rank_samples_s`` (every pass's samples)."""
    if not passes:
        raise ValueError("merge_probes needs at least one probe pass")
    out: dict[str, Any] = {}
    for op in passes[0]:
        if op == "interleaved":
            continue
        raw = [pp[op] for pp in passes]
        pool = {key: [t for r in raw for t in r[key]]
                for key in ("small_samples_s", "small_rank_samples_s", "large_samples_s", "large_rank_samples_s")}
        sizes, sizes_mean = [], []
        for i, first in enumerate(raw[0]["size_samples"]):
            moved = float(np.median([r["size_samples"][i]["bytes"] for r in raw]))
            sizes.append([moved, float(np.median([t for r in raw for t in r["size_samples"][i]["slowest_s"]]))])
            sizes_mean.append([moved, float(np.median([t for r in raw for t in r["size_samples"][i]["rank_mean_s"]]))])
        out[op] = {"small_s": float(np.median(pool["small_samples_s"])),
                   "large_s": float(np.median(pool["large_samples_s"])),
                   "large_bytes": float(np.median([r["large_bytes"] for r in raw])),
                   "large_samples_s": pool["large_samples_s"],
                   "large_rank_samples_s": pool["large_rank_samples_s"],
                   "idle_cpu_s": raw[0]["idle_cpu_s"], "sizes": sizes,
                   "small_rank_mean_s": float(np.median(pool["small_rank_samples_s"])),
                   "large_rank_mean_s": float(np.median(pool["large_rank_samples_s"])),
                   "sizes_rank_mean": sizes_mean}
    curves = [pp["interleaved"]["curve"] for pp in passes]
    curve = [{key: float(np.mean([c[i][key] for c in curves])) for key in curves[0][i]}
             for i in range(len(curves[0]))]
    out["interleaved"] = {"call_s": curve[0]["call_median_s"], "call_mean_s": curve[0]["call_mean_s"],
                          "curve": curve}
    return out


def probe_interleaved(comm: Any, iterations: int, work_s: tuple[float, ...] = INTERLEAVED_WORK_S,
                      budget_s: float = INTERLEAVED_BUDGET_S) -> dict[str, Any]:
    """Tiny allreduces between bursts of CPU work, as a training step issues its calls.

    For each CPU work length in ``work_s`` (seconds of this thread's CPU, so
    the same work whatever the core share): the mean over ranks of the mean,
    median and 90th percentile of the time one such allreduce takes. With more
    ranks than cores it is dominated by waiting for peers the scheduler has
    not run yet, not by the wire; a step's communication time is a sum over
    calls, so the model takes the mean at the method's own spacing of calls.
    ``call_s`` (median at the shortest work) is kept for earlier readers.
    """
    data = np.random.default_rng(comm.rank).standard_normal(12_500).astype(np.float32)
    small = np.zeros(2, np.float32)
    curve = []
    for w in work_s:
        calls, cpu = [], []
        comm.barrier()
        for _ in range(min(iterations, max(INTERLEAVED_MIN_CALLS, int(budget_s / w)))):
            cpu.append(_cpu_burst(w, data))
            t0 = time.perf_counter()
            comm.allreduce(small)
            calls.append(time.perf_counter() - t0)
        local = np.array([np.mean(calls), np.median(calls), np.percentile(calls, 90), np.mean(cpu)])
        mean, median, p90, work = (comm.allreduce(local, "sum") / comm.size).tolist()
        curve.append({"work_s": work, "call_mean_s": mean, "call_median_s": median, "call_p90_s": p90})
    return {"call_s": curve[0]["call_median_s"], "call_mean_s": curve[0]["call_mean_s"], "curve": curve}


def memcpy_seconds(n: int, repeats: int = 5) -> float:
    """Median time to copy ``n`` float32 values (the floor for touching a gradient once)."""
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


class _ExchangeClock:
    """Adds up the wall and CPU time of the method's own calls in the exchange.

    Overlap is off, so buckets are reduced on the training thread. A flat
    bucket's call is ``method.allreduce`` (the engine's copy of the gradients
    into the bucket stays outside, in compute, as before); a matrix method's
    group is one ``exchange.per_tensor.reduce``, whose tensors' calls run
    interleaved (lockstep greenlets, or one ``allreduce_many``), so the group
    is timed as a whole and the calls inside it are not timed again. CPU time
    is the process's (``time.process_time``).
    """

    def __init__(self, exchange: Any, method: Any) -> None:
        self.wall = self.cpu = 0.0
        self._depth = 0

        def clocked(inner: Any, nested: bool) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                if nested and self._depth:
                    return inner(*args, **kwargs)
                self._depth += 1
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    return inner(*args, **kwargs)
                finally:
                    self._depth -= 1
                    self.wall += time.perf_counter() - t0
                    self.cpu += time.process_time() - c0
            return timed
        exchange.per_tensor.reduce = clocked(exchange.per_tensor.reduce, nested=False)
        method.allreduce = clocked(method.allreduce, nested=True)

    def reset(self) -> None:
        self.wall = self.cpu = 0.0

def measure_method(name: str, params: dict[str, Any], model_name: str | Workload, comm: Any, steps: int,
                   warm: int, seed: int, first_batch: int = 0,
                   timeline_path: str | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """Train ``warm + steps`` steps with a fresh method ``name`` and model; (the method, one record
    per measured step). The batches are those of steps ``first_batch``, ``first_batch + 1``, ...
    ``model_name``: one of the benchmark models, or a :class:`~.workload.Workload`.
    ``timeline_path``: write the measured steps' timeline there (rank 0)."""
    import torch

    from ...compressors.registry import create
    from ...torch.optimizer import DistributedOptimizer
    method = create(name, **params)
    if getattr(method, "warmup_steps", 0) and "warmup_steps" not in params:
        # warm-up steps are dense steps (the dense column): measure the method itself
        method = create(name, **{**params, "warmup_steps": 0})
    for inner in getattr(method, "candidates", {}).values():
        # auto's candidates too: Ok-Topk's 32 dense warm-up steps would otherwise be every
        # measured step of an auto that chose it, and its row would time dense
        if getattr(inner, "warmup_steps", 0):
            inner.warmup_steps = 0
    workload = model_name if isinstance(model_name, Workload) else named_workload(model_name)
    torch.manual_seed(seed)
    model = workload.model()
    base = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt = DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=method,
                               overlap=False, comm=comm)
    clock = _ExchangeClock(opt.exchange, method)
    ring = RingTransport()
    records: list[dict[str, Any]] = []
    with ring.installed():
        _steps(comm, model, workload, opt, clock, ring, warm, steps, records, first_batch,
               timeline_path)
    opt.close()
    return method, records


def _steps(comm: Any, model: Any, workload: Workload, opt: Any, clock: "_ExchangeClock", ring: RingTransport,
           warm: int, steps: int, records: list[dict[str, Any]], first_batch: int = 0,
           timeline_path: str | None = None) -> None:
    """Run ``warm + steps`` training steps; append the measured ones' parts to ``records``; the
    measured ones recorded as a timeline into ``timeline_path`` when given."""
    from ...mpi_collectives import timeline
    rec = None
    for step in range(warm + steps):
        x, y = workload.step_batch(comm.rank, first_batch + step)
        comm.barrier()
        comm.reset_stats()
        clock.reset()
        ring.reset()
        if timeline_path is not None and step == warm:
            rec = timeline.start()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = workload.loss(model, x, y)
        loss.backward()
        opt.step()
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        if rec is not None and step == warm + steps - 1:
            timeline.stop()
        timings = comm.timings()
        mpi, mpi_cpu = timings["total"], timings["cpu_total"]
        # the calls' agreement (mpi_collectives/consistency.py) is where a rank waits for peers still
        # computing: neither the method's compression nor its payload's communication
        wait = timings["by_op"].get("agree", 0.0)
        wait_cpu = timings["cpu_by_op"].get("agree", 0.0)
        st = comm.stats()
        work = np.array([total - mpi])                   # this rank's compute + compression wall time
        imbalance = float(comm.allgather(work).max() - work[0])
        if step >= warm:
            ex = clock.wall
            records.append({"step_s": total, "compute_s": total - ex, "exchange_s": ex,
                            "comm_s": mpi - wait, "wait_s": wait, "wait_cpu_s": wait_cpu,
                            "compress_s": max(ex - mpi, 0.0), "imbalance_s": imbalance,
                            "compute_cpu_s": cpu - clock.cpu,
                            "compress_cpu_s": max(clock.cpu - mpi_cpu, 0.0),
                            "comm_cpu_s": mpi_cpu - wait_cpu,
                            "sent": st["sent"], "received": st["received"],
                            "ops": {k: v for k, v in st["by_op"].items()}, "ring": ring.as_dict()})
    if rec is not None:
        from ...mpi_collectives.timeline_file import write_trace
        trace = timeline.gather_trace(comm, rec, {"model": workload.name, "steps": "the measured ones"})
        if trace is not None:
            write_trace(trace, timeline_path)


def method_specs(text: str) -> list[tuple[str, dict[str, Any], str]]:
    """``--methods`` as (name, parameters, the report's label) per item; a parameter may be a
    JSON object with commas of its own (``auto:{"steps_factors":{"topk":1,"oktopk":1}}``)."""
    return [parse_spec(spec) for spec in split_specs(text)]


def _summary(method: Any, comm: Any, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each part: the mean over ranks of the median over steps; the step: the slowest rank; ops and
    the pipelined ring's share (``transport``): rank 0's means over steps."""
    summary: dict[str, Any] = {"params": method.config(), "steps_measured": len(records)}
    if callable(getattr(method, "decisions", None)):     # auto: what each bucket runs (same on every rank)
        summary["decisions"] = {b: {k: d.get(k) for k in ("chosen", "predicted_ms", "runner_up",
                                                          "runner_up_ms", "reason", "step",
                                                          "candidates")}
                                for b, d in method.decisions().items()}
    for key in ("compute_s", "exchange_s", "comm_s", "compress_s", "compute_cpu_s", "compress_cpu_s",
                "comm_cpu_s", "wait_s", "wait_cpu_s", "imbalance_s", "sent", "received"):
        local = float(np.median([r[key] for r in records]))
        summary[key] = float(comm.allreduce(np.array([local]), "sum")[0]) / comm.size
    local_step = float(np.median([r["step_s"] for r in records]))
    summary["step_s"] = float(comm.allreduce(np.array([local_step]), "max")[0])
    summary["step_mean_s"] = float(comm.allreduce(np.array([np.mean([r["step_s"] for r in records])]),
                                                  "max")[0])
    ops: dict[str, dict[str, float]] = {}
    for r in records:
        for op, v in r["ops"].items():
            acc = ops.setdefault(op, {"calls": 0.0, "sent": 0.0, "received": 0.0})
            for k in acc:
                acc[k] += v[k] / len(records)
    summary["ops"] = ops
    # the allreduce bytes (already in ops) that crossed the links as the pipelined p2p ring, and the
    # wall time of the method's work the ring ran between its progress calls (median step, mean over ranks)
    ring = {k: float(np.mean([r["ring"][k] for r in records])) for k in ("calls", "sent", "received")}
    local = np.array([np.median([r["ring"][k] for r in records]) for k in ("work_s", "work_cpu_s")])
    ring["work_s"], ring["work_cpu_s"] = (comm.allreduce(local, "sum") / comm.size).tolist()
    if ring["calls"] > 0:
        summary["transport"] = {RING_OP: {"of": "allreduce", **ring}}
    return summary


def main(argv: list[str] | None = None) -> None:
    """Run :func:`_main`; a rank that fails writes its traceback to ``<json>.rank<r>.err`` first.

    Open MPI may drop the stderr of a remote rank that aborts (the project's
    excepthook calls ``MPI_Abort``), so the launcher reads these files to say why a run failed."""
    parser = _parser()
    args = parser.parse_args(argv)
    run_leaving_traceback(_main, args)


def run_leaving_traceback(fn: Any, args: argparse.Namespace) -> None:
    """``fn(args)``; if it raises, this rank's traceback goes to ``<args.json>.rank<r>.err`` first."""
    try:
        fn(args)
    except BaseException:
        import traceback
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "x"))
        try:
            with open(f"{args.json}.rank{rank}.err", "w") as fh:
                traceback.print_exc(file=fh)
        except OSError:
            pass
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one rank of hvdc bench e2e")
    parser.add_argument("--methods", required=True, help="comma-separated; name or name:json-params")
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warm", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every method this many times, the methods interleaved "
                             "(round 1: A B C, round 2: A B C, ...), each time --warm + --steps steps")
    parser.add_argument("--probe-repeats", type=int, default=PROBE_REPEATS,
                        help="samples of each probe in all, spread over the passes (one before each round, "
                             "one after the last)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True)
    parser.add_argument("--timeline", default=None, metavar="PREFIX",
                        help="write each method's measured steps (first round) as a timeline to PREFIX_<method>.json")
    return parser


def _main(args: argparse.Namespace) -> None:
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from ...mpi_collectives import Communicator
    comm = Communicator()
    rank0 = comm.rank == 0
    comm.barrier()
    if rank0:                    # every rank is up: the launcher's start watchdog stands down
        print("HVDC-STARTED", flush=True)

    def progress(label: str) -> None:
        if rank0:
            print(f"HVDC-PROGRESS {label}", flush=True)

    result: dict[str, Any] = {"world_size": comm.size, "model": args.model,
                              "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                              else os.cpu_count(),
                              "threads_per_rank": torch.get_num_threads(), "methods": {}}
    n_passes = probe_passes(args.rounds)
    per_pass = max(1, -(-args.probe_repeats // n_passes))
    probes: list[dict[str, Any]] = []

    def probe() -> None:
        probes.append(probe_links(comm, per_pass, n_passes))
        progress(f"probe ({len(probes)}/{n_passes})")
    model = build_model(args.model)
    result["parameters"] = int(sum(p.numel() for p in model.parameters()))
    result["tensors"] = int(sum(1 for _ in model.parameters()))
    result["memcpy_s"] = memcpy_seconds(result["parameters"])
    del model
    specs = method_specs(args.methods)
    # Rounds interleave the methods, so a phase in which the shared machine runs slower falls on
    # every method alike instead of on whichever was being measured then; each round builds the
    # method afresh (its untimed steps settle it again) on the next batches.
    records: dict[str, list[dict[str, Any]]] = {label: [] for _, _, label in specs}
    methods: dict[str, Any] = {}
    for rnd in range(args.rounds):
        probe()
        for name, params, label in specs:
            if label in result["methods"]:          # failed in an earlier round
                continue
            try:
                trace = (None if args.timeline is None or rnd > 0 else
                         f"{args.timeline}_{''.join(c if c.isalnum() or c in '-_' else '_' for c in label)}.json")
                methods[label], got = measure_method(name, params, args.model, comm, args.steps, args.warm,
                                                     args.seed, first_batch=rnd * (args.warm + args.steps),
                                                     timeline_path=trace)
                records[label] += got
            except Exception as exc:  # noqa: BLE001 - every rank raises the same; record and go on
                if rank0:
                    print(f"[e2e] {label} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                result["methods"][label] = {"error": f"{type(exc).__name__}: {exc}"}
                comm.barrier()
            progress(label if args.rounds == 1 else f"{label} ({rnd + 1}/{args.rounds})")
    probe()
    result["probe"] = merge_probes(probes)
    result["probe_passes"] = len(probes)
    for _, _, label in specs:
        if label not in result["methods"]:
            result["methods"][label] = _summary(methods[label], comm, records[label])
    result["rounds"] = args.rounds
    if rank0:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
