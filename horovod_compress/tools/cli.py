"""The ``hvdc`` command.

Sub-commands live in :mod:`horovod_compress.tools.bench` modules: a module that
defines ``register(subparsers)`` adds top-level commands (``hvdc train``), one
that defines ``register_bench(subparsers)`` adds ``hvdc bench <name>``
commands. Start-up imports none of them: :data:`COMMANDS` and
:data:`BENCH_COMMANDS` name each command's module and one-line help, ``hvdc -h``
lists them from there, and only the module of the command being run is
imported (so ``hvdc methods`` works without the benchmark extras, e.g.
matplotlib, installed). A test checks that the tables name every module's
commands.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import Sequence

#: Top-level commands: name -> (module in horovod_compress.tools.bench, help).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train the digits MLP on P ranks with a compression method"),
    "cluster": ("cluster", "emulated cluster: hosts in network namespaces with shaped links"),
    "model": ("model_cmd", "alpha-beta model: step time, speedup, break-even bandwidth per method"),
    "profile": ("profile_cmd", "profile your own training step for dense and candidate methods"),
    "timeline": ("timeline_view", "read a timeline file (HOROVOD_TIMELINE): Gantt chart or table per rank"),
}

#: ``hvdc bench <name>``: name -> (module in horovod_compress.tools.bench, help).
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "all": ("all", "run the whole suite, record machine/versions, regenerate the results pages"),
    "arc": ("arc", "ARC-Top-K: compression error and bytes on real gradients"),
    "compute": ("compute", "one compressed allreduce per method on shared memory at P = 1, 2, 4 vs memcpy and dense"),
    "convergence": ("convergence", "accuracy of every method at paper defaults"),
    "deepreduce": ("deepreduce", "DeepReduce: bytes of index/value codecs on Top-k of real gradients"),
    "ddp-e2e": ("ddp_e2e", "DDP dense vs every method's comm hook (and PyTorch's PowerSGD) on shaped links"),
    "e2e": ("e2e", "training steps of every method on an emulated cluster with shaped links"),
    "fsdp": ("fsdp_e2e", "FSDP2 dense vs every method's compressed reduce-scatter on shaped links"),
    "hot_path": ("hot_path", "ms of one compressed allreduce vs memcpy and dense"),
    "kernels": ("kernels", "kernel speed vs memcpy and vs the library calls they replace"),
    "kernels-gpu": ("kernels_gpu", "GPU kernel speed vs device memcpy, the CPU kernel and library calls"),
    "lowrank": ("lowrank", "GreedyLore vs PowerSGD vs lazy projection"),
    "oktopk-counts": ("oktopk_counts", "Ok-Topk's selected local/global counts vs k"),
    "overlap": ("overlap", "seconds per step with and without overlap"),
    "qsgd": ("qsgd", "Global-QSGD: quantize/dequantize and reduce-operator speed"),
    "qsgd-model": ("qsgd_model", "Global-QSGD performance model (eq. 10): when does it pay?"),
    "selection": ("selection", "top-k selection by a reused threshold vs torch.topk"),
    "tf_bridge": ("tf_bridge", "cost of the TensorFlow <-> NumPy bridge per step"),
    "tta": ("tta", "time to accuracy: a byte-level GPT on the stdlib's sources, every method"),
    "volume": ("volume", "bytes per rank per step of the sparse allreduces vs P"),
}


_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str | None) -> str | None:
    """``text`` (a docstring used as help) without reStructuredText markup.

    ``:mod:`horovod_compress.cost_model``` -> ``horovod_compress.cost_model``
    (``~a.b`` -> ``b``, ``title <target>`` -> ``title``) and ````x```` -> ``x``,
    so that ``hvdc <command> --help`` reads as plain text in a terminal.
    """
    if text is None:
        return None

    def role(m: re.Match) -> str:
        target = m.group(1).strip()
        return target.rsplit(".", 1)[-1] if m.group(0).split("`", 1)[1].startswith("~") else target
    return _LITERAL.sub(r"\1", _ROLE.sub(role, text))


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Strip reStructuredText markup from ``parser``'s description and its arguments' help."""
    parser.description = plain_text(parser.description)
    parser.epilog = plain_text(parser.epilog)
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = plain_text(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _plain_help(child)


def _bench_module(module: str) -> object:
    return importlib.import_module(f"horovod_compress.tools.bench.{module}")


def _chosen(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """The command (and, for ``bench``, the benchmark) named in ``argv``, if any."""
    words = [a for a in argv if not a.startswith("-")]
    command = words[0] if words else None
    bench = words[1] if command == "bench" and len(words) > 1 else None
    return command, bench


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``hvdc`` argument parser.

    Every command is listed with its help; only the command that ``argv``
    names gets its full parser, from its module (imported here). With
    ``argv=None`` no benchmark module is imported.
    """
    command, bench_name = _chosen(list(argv or []))
    parser = argparse.ArgumentParser(
        prog="hvdc", description="horovod-compress: compressed allreduce for data-parallel training")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = sub.add_parser("bench", help="benchmarks (see 'hvdc bench -h')")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    listing = sub.add_parser("methods", help="list the compression methods and their parameters")
    listing.set_defaults(func=_list_methods)
    for name, (module, text) in COMMANDS.items():
        if name == command:
            _bench_module(module).register(sub)  # type: ignore[attr-defined]
        else:
            sub.add_parser(name, help=text)
    for name, (module, text) in BENCH_COMMANDS.items():
        if command == "bench" and name == bench_name:
            _bench_module(module).register_bench(bench_sub)  # type: ignore[attr-defined]
        else:
            bench_sub.add_parser(name, help=text)
    _plain_help(parser)
    return parser


def _list_methods(args: argparse.Namespace) -> int:
    """Print every method, its one-line description and its parameters with their true defaults."""
    from ..compressors import registry
    names = registry.available()
    width = max(len(n) for n in names) + 2
    for name in names:
        doc = (plain_text(registry.method_class(name).__doc__) or "").strip().splitlines()
        params = ", ".join(f"{key}={value!r}" for key, value in registry.defaults(name).items())
        print(f"{name:<{width}}{doc[0] if doc else ''}\n{'':<{width}}({params})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run a sub-command. A bad option value (``ValueError``) prints ``hvdc: error: ...`` and
    exits with 2, as argparse does for its own errors; ``HVDC_DEBUG=1`` shows the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        if os.environ.get("HVDC_DEBUG", "") not in ("", "0"):
            raise
        parser.exit(2, f"hvdc: error: {exc} (HVDC_DEBUG=1 shows the traceback)\n")


if __name__ == "__main__":
    sys.exit(main())
