#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -k oktopk       # extra arguments go to pytest
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONHASHSEED=0 TF_CPP_MIN_LOG_LEVEL=3
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
