#!/usr/bin/env bash
# One idempotent setup for horovod-compress on a fresh Debian 12 machine.
#
#   scripts/setup.sh            # Open MPI (if missing), .venv, pinned deps, Horovod 0.28.1,
#                               # and the Numba kernels compiled once into their cache
#   HVDC_SKIP_HOROVOD=1 scripts/setup.sh   # everything except the Horovod build
#   HVDC_SKIP_MPICH=1 scripts/setup.sh     # without MPICH, the second MPI the tests run on
#
# A second run finishes in seconds: each step checks a stamp first.
# The Horovod wheel is built once per (torch, tensorflow) pair and cached in
# ${HVDC_CACHE:-~/.cache/horovod-compress}, so fresh clones (CI) reuse it.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
cache="${HVDC_CACHE:-$HOME/.cache/horovod-compress}"
mkdir -p "$cache"
log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# 1. Open MPI from Debian, only when mpirun is missing.
if ! command -v mpirun >/dev/null 2>&1; then
  log "installing Open MPI (Debian packages)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null
fi

# 1b. iproute2 (ip, tc), only when missing: the emulated cluster's network namespaces and
#     shaped links (hvdc cluster, tests/test_cluster.py) need both.
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
  log "installing iproute2 (ip, tc: the emulated cluster)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq iproute2 >/dev/null
fi

# 1c. MPICH from Debian, the second MPI implementation the tests run on (scripts/test.sh), only
#     when missing. Without the -dev package: Open MPI stays the default mpirun, mpicc and libmpi.so.
if [ "${HVDC_SKIP_MPICH:-0}" != 1 ] && ! command -v mpiexec.mpich >/dev/null 2>&1; then
  log "installing MPICH (Debian packages; Open MPI stays the default)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends mpich >/dev/null
fi

# 1d. Chromium (Debian), only when missing: the documentation test renders the key pages
#     headless at 1400 px (scripts/screenshots.sh). HVDC_SKIP_BROWSER=1 leaves it out, and the
#     docs test then skips its screenshots instead of failing.
if [ "${HVDC_SKIP_BROWSER:-0}" != 1 ] && ! command -v chromium >/dev/null 2>&1; then
  log "installing Chromium (Debian package: the docs' screenshot test)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi

# 2. The virtual environment.
if [ ! -x "$venv/bin/python" ]; then
  log "creating .venv"
  if ! python3 -m venv "$venv" 2>/dev/null; then
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq python3-venv python3-dev >/dev/null
    python3 -m venv "$venv"
  fi
fi
py="$venv/bin/python"
# (this machine's pip config names local indexes that may be absent: hide those warnings)
pip() { "$py" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v 'is ignored: it is neither' >&2); }

# 3. Pinned dependencies (torch pinned: a plain 'torch' pulls a multi-GB CUDA build).
req="$root/scripts/requirements.txt"
stamp="$venv/.hvdc-deps-$(sha1sum "$req" pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  log "installing pinned dependencies (scripts/requirements.txt)"
  pip install --upgrade pip wheel setuptools packaging
  pip install -r "$req"
  pip install --no-deps -e "$root"
  rm -f "$venv"/.hvdc-deps-*; touch "$stamp"
fi

# 3b. mpi4py's wheel loads MPICH's ABI module when told to (horovod_compress/tools/mpi_launcher.py sets
#     MPI4PY_LIBMPI for MPICH runs); that module links to libmpi.so.12, which Debian's MPICH calls
#     libmpich.so.12: one link in the venv, on LD_LIBRARY_PATH for MPICH ranks only.
if [ "${HVDC_SKIP_MPICH:-0}" != 1 ] && [ ! -e "$venv/mpich-abi/libmpi.so.12" ]; then
  libmpich=$(/sbin/ldconfig -p | awk '/libmpich\.so\.12 /{lib=$NF} END{print lib}')
  if [ -n "$libmpich" ]; then
    mkdir -p "$venv/mpich-abi" && ln -sf "$libmpich" "$venv/mpich-abi/libmpi.so.12"
  else
    log "MPICH's libmpich.so.12 not found: MPICH runs will fail (HVDC_SKIP_MPICH=1 to skip MPICH)"
  fi
fi

# 4. Horovod 0.28.1 with PyTorch + TensorFlow ops, built from the PyPI sdist.
#    Fixes (see docs/horovod.md): C++14 -> C++17 for torch >= 2.1, and drop
#    xla_mpi_ops.cc whose XLA headers are not in the tensorflow wheel.
horovod_works() {
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$py" - <<'PY' >/dev/null 2>&1
import horovod.torch as ht, horovod.tensorflow as htf, torch
ht.init(); assert ht.allreduce(torch.ones(2)).sum().item() == 2.0
htf.init()
PY
}
# The tests skip what needs Horovod only when this marker says the build was skipped on
# purpose; otherwise a Horovod that does not import fails them.
if [ "${HVDC_SKIP_HOROVOD:-0}" = 1 ]; then touch "$venv/.hvdc-horovod-skipped"
else rm -f "$venv/.hvdc-horovod-skipped"; fi
if [ "${HVDC_SKIP_HOROVOD:-0}" != 1 ] && ! horovod_works; then
  key=$("$py" -c "import torch, tensorflow as tf, sys; print(f'torch{torch.__version__}-tf{tf.__version__}-py{sys.version_info[0]}{sys.version_info[1]}'.replace('+','_'))" 2>/dev/null)
  wheeldir="$cache/horovod-$key"
  if ! ls "$wheeldir"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod 0.28.1 against $key (about 4 minutes, once)"
    build=$(mktemp -d)
    pip download --no-deps --no-binary :all: horovod==0.28.1 -d "$build"
    tar -xzf "$build"/horovod-0.28.1.tar.gz -C "$build"
    src="$build/horovod-0.28.1"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    mkdir -p "$wheeldir"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 \
      HOROVOD_WITHOUT_GLOO=1 MAKEFLAGS="-j$(nproc)" \
      "$py" -m pip wheel --no-deps --no-build-isolation -w "$wheeldir" "$src" >"$cache/horovod-build.log" 2>&1 \
      || { log "Horovod build failed; see $cache/horovod-build.log"; tail -30 "$cache/horovod-build.log"; exit 1; }
    rm -rf "$build"
  fi
  log "installing Horovod from $wheeldir"
  pip install --no-deps --force-reinstall "$wheeldir"/horovod-*.whl
  pip install cloudpickle psutil pyyaml cffi
  horovod_works || { log "Horovod installed but hvd.init()/allreduce failed"; exit 1; }
fi
# 5. The Numba kernels, compiled once into their on-disk cache (next to the sources), so that
#    the first tests or benchmarks do not compile them in every MPI rank at once. A stamp keyed
#    by the sources' hash makes this a no-op until a source file changes.
stamp_dir="$root/horovod_compress/kernels/__pycache__"
sources_hash=$(find "$root/horovod_compress" -name '*.py' -print0 | sort -z | xargs -0 cat | sha256sum | cut -c1-16)
if [ ! -f "$stamp_dir/.precompiled-$sources_hash" ]; then
  log "compiling the Numba kernels once (three to four minutes on 2 cores)"
  # P = 1, then P = 2 for the kernels only more than one rank reaches (MPI reduction
  # operators, pipelined rings, shared-memory windows, merges of received messages)
  OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    "$py" -m horovod_compress.tools.precompile >/dev/null
  OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun -np 2 --oversubscribe "$py" -m horovod_compress.tools.precompile >/dev/null
  mkdir -p "$stamp_dir" && rm -f "$stamp_dir"/.precompiled-* && touch "$stamp_dir/.precompiled-$sources_hash"
fi
log "ready: $venv (source .venv/bin/activate)"
