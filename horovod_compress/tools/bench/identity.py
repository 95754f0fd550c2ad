"""Every method's results and byte counts on fixed inputs, as one JSON file: a behaviour fingerprint.

``python -m horovod_compress.tools.bench.identity --np 2 4 --out FILE`` launches
``mpirun -np P`` for each P; every rank builds each registered method with its
default parameters (``Compression.by_name(name)``), feeds it the same seeded
gradients for a few steps (three tensors: a vector, a matrix and a short
vector, so the low-rank and row methods see a matrix and error feedback and
warm-up counters carry state from step to step) through
``Method.allreduce(grad, name, comm)`` on the real MPI
:class:`~horovod_compress.mpi_collectives.Communicator`, and records per step
and tensor the SHA-256 of the result's bytes on every rank, the result's sum,
and the bytes this rank sent and received (the communicator's volume model);
after the last step, a SHA-256 of the method's ``state_dict()`` (what a
checkpoint stores; not for :data:`TIMED_STATE`'s methods, whose state holds
measured seconds).

Two files written from two versions of the code compare equal exactly when
every method returns the same bits, moves the same bytes and checkpoints the
same state: the check that a change meant to move code (not change it) did
not change behaviour. The gradients depend only on (seed, rank, step, tensor).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ... import mpi_collectives
from ...compressors import Compression
from ...compressors.registry import available
from ..testing import mpi_env, mpirun_command
from .launch import worker_entry

SHAPES = [(1000,), (64, 48), (7,)]
STEPS = 4
SEED = 1234
#: Methods whose ``state_dict()`` holds wall-clock measurements (``auto``'s timed candidates):
#: their results and bytes are compared, their state is not (it differs from run to run).
TIMED_STATE = {"auto": "its state holds the seconds it measured for each candidate"}


def gradient(shape: tuple[int, ...], rank: int, step: int, tensor: int) -> np.ndarray:
    """The fixed float32 gradient of ``tensor`` on ``rank`` at ``step`` (a function of these only)."""
    rng = np.random.default_rng([SEED, rank, step, tensor])
    return rng.standard_normal(shape).astype(np.float32)


def _digest(obj: Any, h: "hashlib._Hash") -> None:
    """Feed a canonical encoding of a nested state (dicts, lists, arrays, scalars) into ``h``."""
    if isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _digest(obj[key], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for item in obj:
            _digest(item, h)
        h.update(b"]")
    elif isinstance(obj, np.ndarray) or hasattr(obj, "__array__"):
        arr = np.ascontiguousarray(np.asarray(obj))
        h.update(f"{arr.dtype.str}{arr.shape}".encode())
        h.update(arr.tobytes())
    else:
        h.update(repr(obj).encode())


def state_digest(state: Any) -> str:
    """SHA-256 of a method's ``state_dict()`` (:func:`_digest`'s canonical encoding)."""
    h = hashlib.sha256()
    _digest(state, h)
    return h.hexdigest()


def method_record(name: str, comm: Any) -> dict[str, Any]:
    """The fingerprint of method ``name`` on ``comm``: per step and tensor, every rank's result
    hash and this step's bytes; the final ``state_dict`` hash of every rank."""
    method = Compression.by_name(name)
    steps = []
    for step in range(STEPS):
        tensors = []
        for tid, shape in enumerate(SHAPES):
            sent, received = comm.bytes_sent, comm.bytes_received
            out = np.asarray(method.allreduce(gradient(shape, comm.rank, step, tid), f"t{tid}", comm))
            sent, received = comm.bytes_sent - sent, comm.bytes_received - received
            digest = hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest()
            tensors.append({
                "dtype": out.dtype.str, "shape": list(out.shape),
                "sum": float(np.sum(out, dtype=np.float64)),
                "sha256_per_rank": comm.allgather_object(digest),
                "bytes_sent_per_rank": comm.allgather_object(sent),
                "bytes_received_per_rank": comm.allgather_object(received),
            })
        steps.append(tensors)
    state = TIMED_STATE.get(name) or comm.allgather_object(state_digest(method.state_dict()))
    return {"steps": steps, "state_sha256_per_rank": state}


def worker(args: argparse.Namespace) -> None:
    comm = mpi_collectives.Communicator()   # mpi4py (MPI_Init) only in the ranks
    names = args.methods or available()
    record = {"world_size": comm.size, "shapes": [list(s) for s in SHAPES], "steps": STEPS,
              "seed": SEED, "methods": {name: method_record(name, comm) for name in names}}
    if comm.rank == 0:
        Path(args.json).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def run(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.np:
            path = Path(tmp) / f"p{p}.json"
            cmd = mpirun_command(p) + [sys.executable, "-m", __spec__.name, "--worker", "--json", str(path),
                                       *(["--methods", *args.methods] if args.methods else [])]
            print(f"identity: P = {p}", file=sys.stderr, flush=True)
            rc = subprocess.call(cmd, env=mpi_env({"HVDC_LAUNCHED": "1"}), timeout=args.timeout)
            if rc != 0:
                print(f"identity: mpirun -np {p} exited with {rc}", file=sys.stderr)
                return rc
            out[str(p)] = json.loads(path.read_text())
    Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"identity: {len(next(iter(out.values()))['methods'])} methods x P = "
          f"{', '.join(map(str, args.np))} written to {args.out}", file=sys.stderr)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument("--out", default="identity.json", help="the JSON file to write")
    parser.add_argument("--methods", nargs="*", help="method names (default: every registered method)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mpirun (hang guard)")


def main(argv: list[str] | None = None) -> None:
    worker_entry(__doc__, add_arguments, worker, run, argv)


if __name__ == "__main__":
    main()
