"""The tooling, above the library: the ``hvdc`` command line, benchmarks, the emulated cluster,
the MPI test harness and Numba precompilation. The library never imports this package
(an import-linter contract in ``pyproject.toml``); it ships in the wheel for ``hvdc``."""
