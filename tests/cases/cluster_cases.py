"""Cases run on ranks that live on different emulated hosts (tests/test_cluster.py)."""
from __future__ import annotations

import os
import time

import numpy as np

import horovod_compress as hvdc


def topk_across_hosts(comm):
    """A compressed allreduce across two hosts equals its dense reference, and the traffic crossed the
    shaped link: 4 MB take at least what 100 Mbit allow."""
    rng = np.random.default_rng(100 + comm.rank)
    grads = [np.random.default_rng(100 + r).standard_normal(50_000).astype(np.float32)
             for r in range(comm.size)]
    x = grads[comm.rank]
    assert np.array_equal(x, rng.standard_normal(50_000).astype(np.float32))
    # density 1.0 keeps every element: TopkA must then equal the dense average exactly (up to fp32 sums)
    method = hvdc.Compression.topk(density=1.0)
    avg = method.allreduce(x, name="w", comm=comm)
    ref = np.mean(np.stack(grads), axis=0)
    np.testing.assert_allclose(avg, ref, rtol=1e-5, atol=1e-6)
    # a sparse one: the sum of each rank's exact top-k, averaged
    k = 500
    sparse = hvdc.Compression.topk(density=k / x.size).allreduce(x, name="s", comm=comm)
    expect = np.zeros_like(x)
    for g in grads:
        idx = np.argpartition(np.abs(g), -k)[-k:]
        expect[idx] += g[idx]
    np.testing.assert_allclose(sparse, expect / comm.size, rtol=1e-5, atol=1e-6)
    big = np.ones(1_000_000, np.float32)           # 4 MB: ring allreduce moves 4 MB each way at P = 2
    comm.barrier()
    t0 = time.perf_counter()
    out = comm.allreduce(big)
    seconds = time.perf_counter() - t0
    assert out[0] == comm.size
    return {"netns": os.readlink("/proc/self/ns/net"), "seconds": seconds}
