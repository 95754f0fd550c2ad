#!/usr/bin/env bash
# Set everything up (idempotent) and run the main demo: the digits MLP on 4 MPI ranks,
# every compression method side by side; a table on stdout, a plot in results/demo/.
#   bash scripts/demo.sh                         # all methods
#   bash scripts/demo.sh --compression oktopk    # extra arguments go to `hvdc train`
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec .venv/bin/hvdc train --np 4 --compression all --out results/demo "$@"
