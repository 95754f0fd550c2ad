#!/usr/bin/env bash
# Launch the PyTorch example with Horovod's launcher (horovodrun starts mpirun underneath).
#
#   bash examples/horovodrun.sh                      # 2 ranks on this machine, Top-k 5%
#   NP=8 HOSTS=node1:4,node2:4 bash examples/horovodrun.sh --compression oktopk --param density=0.01
#
# Extra arguments go to examples/pytorch_digits.py. horovod_compress.torch works
# under horovodrun as under mpirun: hvdc_torch.init() joins Horovod when the
# script imports horovod.torch, and otherwise uses the same MPI world.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NP="${NP:-2}"
HOSTS="${HOSTS:-localhost:$NP}"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--compression topk --param density=0.05)
# --mpi: use Open MPI (our Horovod build has no Gloo); --mpi-args passes flags through to mpirun.
exec horovodrun -np "$NP" -H "$HOSTS" --mpi ${HVDC_MPI_ARGS:+--mpi-args="$HVDC_MPI_ARGS"} \
  python examples/pytorch_digits.py "${args[@]}"
