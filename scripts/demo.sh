#!/usr/bin/env bash
# Set everything up (idempotent) and run the main demo:
#  1. the digits MLP on 4 MPI ranks, every compression method side by side: accuracy, bytes,
#     a table on stdout and a plot in results/demo/;
#  2. what it buys on a network: a 11.6M-parameter Transformer's training step on an emulated
#     4-host cluster with 1 Gbit links (needs root for network namespaces; skipped with the
#     reason otherwise), speedup over dense per method in results/demo/network.md.
#   bash scripts/demo.sh                         # both parts
#   bash scripts/demo.sh --compression oktopk    # extra arguments go to `hvdc train`
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
.venv/bin/hvdc train --np 4 --compression all --out results/demo "$@"
if reason=$(.venv/bin/python -c "from horovod_compress.tools.cluster import preflight; preflight('demo')" 2>&1); then
  .venv/bin/hvdc bench e2e --hosts 4 --bandwidths 1gbit --steps 2 \
    --methods none,fp16,topk,oktopk,global_qsgd,powersgd,greedylore,deepreduce \
    --out results/demo --name network
else
  echo "[demo] skipping the network part: $(echo "$reason" | tail -1)"
fi
