"""Per-rank cases for DeviceCollectives (run with NUMBA_ENABLE_CUDASIM=1: Numba device arrays
are the simulator's, in host memory, so the CUDA-aware path can run on a CPU-only MPI).

Each case runs every collective on "GPU" arrays through one route (staged
through host memory, or direct to mpi4py as with CUDA-aware MPI), checks the
results against references computed from all ranks' data (every rank can
regenerate every other rank's data from its seed), checks that results stay
device arrays, and returns the byte counters so the test can compare the two
routes with the plain NumPy route.
"""
from __future__ import annotations

import numpy as np


def _data(rank: int, n: int = 37) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal(n).astype(np.float32)


def _run(comm, route: str) -> dict:
    from numba import cuda

    from horovod_compress.kernels.dispatch import is_gpu_array
    from horovod_compress.mpi_collectives.cuda_aware import DeviceCollectives

    p, rank = comm.size, comm.rank
    everyone = [_data(j) for j in range(p)]
    if route == "numpy":
        dc = DeviceCollectives(comm, cuda_aware=False)
        wrap, unwrap = (lambda a: a), (lambda a: a)
    else:
        dc = DeviceCollectives(comm, cuda_aware=(route == "direct"))
        wrap, unwrap = cuda.to_device, (lambda a: a.copy_to_host())
    comm.reset_stats()
    out = {}

    s = dc.allreduce(wrap(everyone[rank]), "sum")
    assert route == "numpy" or is_gpu_array(s)
    ref = everyone[0].copy()
    for j in range(1, p):
        ref += everyone[j]
    np.testing.assert_allclose(unwrap(s), ref, rtol=1e-6, atol=1e-6)
    a = dc.allreduce(wrap(everyone[rank]), "avg")
    np.testing.assert_allclose(unwrap(a), ref / np.float32(p), rtol=1e-6, atol=1e-6)

    g = dc.allgather(wrap(everyone[rank]))
    assert tuple(g.shape) == (p, 37)
    np.testing.assert_array_equal(unwrap(g), np.stack(everyone))

    mine = everyone[rank][: rank + 3]
    v, counts = dc.allgatherv(wrap(mine))
    np.testing.assert_array_equal(counts, [j + 3 for j in range(p)])
    np.testing.assert_array_equal(unwrap(v), np.concatenate([everyone[j][: j + 3] for j in range(p)]))

    b = dc.broadcast(wrap(everyone[rank].copy()), root=p - 1)
    np.testing.assert_array_equal(unwrap(b), everyone[p - 1])

    chunks = [wrap(np.full(j + 1, rank, np.float32)) for j in range(p)]
    got = dc.alltoallv(chunks)
    for j in range(p):
        np.testing.assert_array_equal(unwrap(got[j]), np.full(rank + 1, j, np.float32))

    if route != "numpy":  # a host chunk among device chunks: refused before any communication
        try:
            dc.alltoallv([wrap(np.zeros(1, np.float32))] + [np.zeros(1, np.float32)] * (p - 1))
        except ValueError as e:
            assert "mix" in str(e)
        else:
            raise AssertionError("mixing NumPy and GPU arrays must raise")

    out["stats"] = comm.stats()["by_op"]
    out["sent"] = comm.bytes_sent
    out["received"] = comm.bytes_received
    out["staged"] = dc.staged
    out["direct"] = dc.direct
    return out


def case_numpy_route(comm):
    return _run(comm, "numpy")


def case_staged_route(comm):
    return _run(comm, "staged")


def case_direct_route(comm):
    return _run(comm, "direct")
