#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -k oktopk       # extra arguments go to pytest
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONHASHSEED=0 TF_CPP_MIN_LOG_LEVEL=3
# Two pytest workers on a 2-core machine (at most 4 anywhere, HVDC_TEST_WORKERS to change; 1 runs
# serially): a test file runs whole in one worker (--dist loadfile: its module-scoped MPI jobs once),
# so one worker's single-threaded work (imports, Numba's CUDA simulator, one-rank tests) overlaps the
# other's MPI jobs. Every MPI job is still under its timeout (scaled by the workers, testing.run_cases).
cores="$(nproc)"
workers="${HVDC_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
if [ "$workers" -gt 1 ]; then dist=(-n "$workers" --dist loadfile); else dist=(); fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "${dist[@]}" "$@"
