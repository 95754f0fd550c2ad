"""Every method on fixed seeded inputs: a fingerprint of its results, bytes and state, and checkpoints.

Run under ``mpirun -np P`` (any P) with ``PYTHONPATH`` naming the code under test::

    python tests/scripts/method_runs.py fingerprint OUT.json
    python tests/scripts/method_runs.py checkpoints DIR

``fingerprint`` runs each entry of :data:`VARIANTS` for :data:`STEPS` steps on two
tensors (a 16 x 12 matrix ``w`` and a 256-vector ``b``, inputs drawn from a seed
per step and rank) and writes (rank 0) for every step and tensor every rank's
SHA-256 of the result's bytes and its sent/received byte counts, and at the end
a digest of each tensor's saved state (``state_dict()``), field by field. Two
versions of the code behave the same on these inputs exactly when their
fingerprints are equal.

``checkpoints`` runs each variant for :data:`SAVE_AT` steps, pickles every
rank's ``state_dict()`` with the digests of the results of the
:data:`RESUME_STEPS` steps that follow (the run continued without a restore):
``DIR/<variant>.rank<r>.pkl``. tests/test_checkpoint_formats.py loads the files
kept in tests/data/ into fresh methods and checks the resumed run gives those
same results.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import warnings

import numpy as np
from mpi4py import MPI

from horovod_compress.compressors.registry import create
from horovod_compress.mpi_collectives import Communicator

#: (variant name, method name, parameters): every registered method, small sizes, short periods
VARIANTS: list[tuple[str, str, dict]] = [
    ("none", "none", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("topk", "topk", {"density": 0.05}),
    ("topk-ef21", "topk", {"density": 0.05, "feedback": "ef21"}),
    ("topk-ef21m", "topk", {"density": 0.05, "feedback": "ef21m", "eta": 0.2}),
    ("randk", "randk", {"density": 0.05}),
    ("gaussiank", "gaussiank", {"density": 0.05}),
    ("topk_dsa", "topk_dsa", {"density": 0.05}),
    ("gtopk", "gtopk", {"density": 0.05}),
    ("oktopk", "oktopk", {"density": 0.05, "warmup_steps": 1, "tau": 3, "tau_prime": 2}),
    ("qsgd", "qsgd", {"bits": 4}),
    ("qsgd-residual", "qsgd", {"bits": 4, "feedback": "residual"}),
    ("global_qsgd", "global_qsgd", {}),
    ("global_qsgd-sparse", "global_qsgd", {"bits": 4, "sparse": True}),
    ("arc_topk", "arc_topk", {"rank": 2, "ratio": 0.25}),
    ("powersgd", "powersgd", {"rank": 2}),
    ("greedylore", "greedylore", {"rank": 2, "period": 3}),
    ("deepreduce", "deepreduce", {"density": 0.05}),
    ("lazy_projection", "lazy_projection", {"rank": 2, "period": 3}),
    ("randk_rows", "randk_rows", {"ratio": 0.25}),
    ("topk_rows", "topk_rows", {"ratio": 0.25}),
    ("auto", "auto", {"dry_runs": 1, "probe_repeats": 1, "window": 2}),
]
STEPS = 6
SAVE_AT = 3
RESUME_STEPS = 3
SHAPES = {"w": (16, 12), "b": (256,)}


def inputs(step: int, rank: int) -> dict[str, np.ndarray]:
    """This rank's gradients at ``step`` (1-based): fixed by (step, rank), a few large entries."""
    rng = np.random.default_rng(10_000 + 97 * step + rank)
    out = {}
    for name, shape in SHAPES.items():
        x = rng.standard_normal(shape).astype(np.float32)
        x.reshape(-1)[rng.integers(0, x.size, 5)] *= 20
        out[name] = x
    return out


def digest(a: object) -> str:
    """SHA-256 of an array's dtype, shape and bytes (or of a scalar's repr)."""
    if isinstance(a, np.ndarray):
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]
    return repr(a)


def step(method, comm, s: int) -> dict[str, list]:
    """One step on both tensors: name -> [result digest, sent, received]."""
    got = {}
    for name, x in inputs(s, comm.rank).items():
        comm.reset_stats()
        out = method.allreduce(x, name, comm)
        st = comm.stats()
        got[name] = [digest(np.asarray(out)), int(st["sent"]), int(st["received"])]
    return got


def state_digest(method) -> dict[str, dict[str, str]]:
    """Tensor -> field -> digest of the saved state."""
    return {n: {k: digest(v) for k, v in sorted(st.items())}
            for n, st in sorted(method.state_dict()["state"].items())}


def fingerprint(comm, path: str) -> None:
    result = {}
    for variant, name, params in VARIANTS:
        method = create(name, **params)
        steps = [step(method, comm, s) for s in range(1, STEPS + 1)]
        mine = {"steps": steps, "state": state_digest(method)}
        result[variant] = MPI.COMM_WORLD.allgather(mine)
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump({"P": comm.size, "variants": result}, f, indent=1, sort_keys=True)


def checkpoints(comm, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    for variant, name, params in VARIANTS:
        method = create(name, **params)
        for s in range(1, SAVE_AT + 1):
            step(method, comm, s)
        saved = method.state_dict()
        resumed = [step(method, comm, s) for s in range(SAVE_AT + 1, SAVE_AT + RESUME_STEPS + 1)]
        record = {"variant": variant, "method": name, "params": params, "world_size": comm.size,
                  "rank": comm.rank, "saved_after": SAVE_AT, "state_dict": saved,
                  "resumed": resumed}
        with open(os.path.join(folder, f"{variant}.rank{comm.rank}.pkl"), "wb") as f:
            pickle.dump(record, f, protocol=4)


def main() -> None:
    warnings.simplefilter("ignore")
    mode, path = sys.argv[1], sys.argv[2]
    comm = Communicator()
    {"fingerprint": fingerprint, "checkpoints": checkpoints}[mode](comm, path)


if __name__ == "__main__":
    main()
