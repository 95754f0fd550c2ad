"""``hvdc bench tf_bridge``: what the TensorFlow <-> NumPy bridge costs per step.

The TensorFlow front-end hands gradients to the framework-independent
exchange through :func:`horovod_compress.tensorflow.bridge.numpy_call`:
``tensor.numpy()`` eagerly, one ``tf.numpy_function`` op inside
``tf.function``. This benchmark times one gradient exchange (method ``none``,
so the work below the bridge is a plain allreduce) four ways, in the same run:

* ``numpy``    -- the reducer's NumPy side fed NumPy arrays (the baseline: no TF);
* ``eager``    -- ``GradientReducer.reduce`` on eager tensors;
* ``graph``    -- the same inside ``tf.function`` (the ``numpy_function`` op);
* ``py_function`` -- the alternative bridge, ``tf.py_function``, for comparison;
* ``graph_floor`` -- the graph step without any exchange.

The bridge's cost is ``eager - numpy`` and ``graph - graph_floor - numpy``. Model shapes: the digits
MLP (6 tensors, 25 k floats), 100 small tensors (many-tensor overhead) and
8 tensors of 1 M floats (copy bandwidth). Results go to
``benchmarks/tf_bridge_np<P>.md`` and ``.png``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .report_files import save_figure

SHAPES: dict[str, list[tuple[int, ...]]] = {
    "digits MLP (6 tensors, 25k)": [(64, 128), (128,), (128, 128), (128,), (128, 10), (10,)],
    "100 tensors x 1k": [(1000,)] * 100,
    "8 tensors x 1M": [(1024, 1024)] * 8,
}


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tf_bridge", help="cost of the TensorFlow <-> NumPy bridge per step",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks (default 2; 1 isolates the bridge)")
    p.add_argument("--repeats", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--out", default="benchmarks", help="folder for tf_bridge_np<P>.md/.png")
    p.set_defaults(func=run)


def _time(fn: Callable[[], Any], repeats: int, comm: Any) -> float:
    """Median seconds per call (after two warm-up calls), ranks started together."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(shapes: list[tuple[int, ...]], comm: Any, repeats: int) -> dict[str, float]:
    """Seconds per exchange of ``shapes`` through each bridge (see module doc).

    The graph variants read the gradients from variables and sum the results
    inside the ``tf.function`` (no arguments cross the call, as in a training
    step); ``graph_floor`` is that function with the exchange replaced by the
    identity, so a graph variant's bridge cost is ``graph - graph_floor - numpy``.
    """
    import tensorflow as tf

    from ...compressors.registry import create
    from ...tensorflow.reducer import GradientReducer
    from ...tensorflow.tensors import to_wire, wire_dtype

    rng = np.random.default_rng(comm.rank)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    variables = [tf.Variable(a, name=f"v{i}") for i, a in enumerate(arrays)]
    grads = [tf.constant(a) for a in arrays]
    reducer = GradientReducer(create("none"), comm, overlap=False)
    reducer.reduce(grads, variables)  # build the exchange outside the timings
    vset = reducer.variable_sets()[0]

    def via_py_function(g: list) -> list:
        def run(*ts: Any) -> list:
            return reducer._reduce_arrays(vset, [np.asarray(t) for t in ts])
        outs = tf.py_function(run, [to_wire(x) for x in g], [wire_dtype(v.dtype) for v in variables])
        return [tf.ensure_shape(o, v.shape) for o, v in zip(outs, variables)]

    def step(exchange: Callable[[list], list]) -> Any:
        @tf.function
        def fn() -> tf.Tensor:
            outs = exchange([tf.identity(v) for v in variables])
            return tf.add_n([tf.reduce_sum(o) for o in outs])
        return fn

    graph = step(lambda g: reducer.reduce(g, variables))
    py_graph = step(via_py_function)
    floor = step(lambda g: g)
    return {
        "numpy": _time(lambda: reducer._reduce_arrays(vset, list(arrays)), repeats, comm),
        "eager": _time(lambda: reducer.reduce(grads, variables), repeats, comm),
        "graph_floor": _time(floor, repeats, comm),
        "graph": _time(graph, repeats, comm),
        "py_function": _time(py_graph, repeats, comm),
    }


def run(args: argparse.Namespace) -> int:
    from .launch import relaunch, under_mpi_launcher
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.np > 1 and not under_mpi_launcher():
        return relaunch(args.np, "horovod_compress.tools.cli", sys.argv[1:])
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    from ...mpi_collectives import Communicator
    comm = Communicator()
    rows = []
    for label, shapes in SHAPES.items():
        res = measure(shapes, comm, args.repeats)
        n = int(sum(np.prod(s) for s in shapes))
        rows.append({"model": label, "tensors": len(shapes), "floats": n, **res})
        if comm.rank == 0:
            print(f"{label:30s} " + "  ".join(f"{k} {v * 1e6:9.1f} us" for k, v in res.items()),
                  flush=True)
    if comm.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table = format_table(rows, comm.size, tf.__version__)
        stem = out / f"tf_bridge_np{comm.size}"
        stem.with_suffix(".md").write_text(table + "\n")
        plot(rows, stem.with_suffix(".png"), comm.size)
        print("\n" + table + f"\nwrote {stem}.md and {stem}.png")
    return 0


def format_table(rows: list[dict[str, Any]], world: int, tf_version: str) -> str:
    head = (f"TensorFlow {tf_version}, {world} rank(s), method `none`, median of timed steps "
            "(microseconds). Bridge cost = eager - numpy, and graph - graph floor - numpy "
            "(graph floor: the same tf.function without the exchange).\n\n"
            "| model | NumPy exchange | eager | graph floor | tf.function + numpy_function | "
            "tf.function + py_function | eager bridge cost | numpy_function bridge cost | "
            "py_function bridge cost |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        us = {k: r[k] * 1e6 for k in ("numpy", "eager", "graph_floor", "graph", "py_function")}
        lines.append(f"| {r['model']} | {us['numpy']:.0f} | {us['eager']:.0f} | "
                     f"{us['graph_floor']:.0f} | {us['graph']:.0f} | {us['py_function']:.0f} | "
                     f"{us['eager'] - us['numpy']:+.0f} | "
                     f"{us['graph'] - us['graph_floor'] - us['numpy']:+.0f} | "
                     f"{us['py_function'] - us['graph_floor'] - us['numpy']:+.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, world: int) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kinds = ["numpy", "eager", "graph_floor", "graph", "py_function"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.16
    for j, kind in enumerate(kinds):
        ax.bar([i + (j - 2) * width for i in range(len(rows))],
               [r[kind] * 1e3 for r in rows], width, label=kind)
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows], fontsize=8)
    ax.set_ylabel("ms per exchange (median)")
    ax.set_yscale("log")
    ax.set_title(f"TensorFlow <-> NumPy bridge, method none, {world} rank(s)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    return save_figure(fig, path)
