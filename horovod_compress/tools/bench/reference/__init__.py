"""Reference data shipped with the package: step profiles and accuracy costs measured by the
project's benchmarks (written by ``python -m horovod_compress.tools.bench.choosing``), so that
``hvdc model`` works from any directory."""
