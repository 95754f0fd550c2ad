"""The ``hvdc`` command.

Sub-commands come from modules: every module in :mod:`horovod_compress.bench`
that defines ``register(subparsers)`` adds its own (``hvdc train``,
``hvdc bench volume`` ...). ``hvdc bench <name>`` commands register under the
``bench`` group through ``register_bench(bench_subparsers)``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The ``hvdc`` argument parser, with every module's sub-commands registered."""
    parser = argparse.ArgumentParser(
        prog="hvdc", description="horovod-compress: compressed allreduce for data-parallel training")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = sub.add_parser("bench", help="benchmarks (see 'hvdc bench -h')")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    listing = sub.add_parser("methods", help="list the compression methods and their parameters")
    listing.set_defaults(func=_list_methods)
    from . import bench as bench_pkg
    for mod in pkgutil.iter_modules(bench_pkg.__path__):
        module = importlib.import_module(f"{bench_pkg.__name__}.{mod.name}")
        if hasattr(module, "register"):
            module.register(sub)
        if hasattr(module, "register_bench"):
            module.register_bench(bench_sub)
    return parser


def _list_methods(args: argparse.Namespace) -> int:
    import inspect

    from .compressors import registry
    for name in registry.available():
        cls = registry.method_class(name)
        sig = inspect.signature(cls.__init__)
        params = ", ".join(f"{p.name}={p.default!r}" for p in sig.parameters.values()
                           if p.default is not inspect.Parameter.empty)
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"{name:12s} {doc}\n{'':12s} ({params})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run a sub-command. A bad option value (``ValueError``) prints ``hvdc: error: ...`` and
    exits with 2, as argparse does for its own errors; ``HVDC_DEBUG=1`` shows the traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        if os.environ.get("HVDC_DEBUG", "") not in ("", "0"):
            raise
        parser.exit(2, f"hvdc: error: {exc} (HVDC_DEBUG=1 shows the traceback)\n")


if __name__ == "__main__":
    sys.exit(main())
