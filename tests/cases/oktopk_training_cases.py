"""Per-rank MPI case: the digits MLP trained through the PyTorch DistributedOptimizer,
dense vs Ok-Topk (run by tests/test_oktopk_training.py)."""
from __future__ import annotations

import horovod_compress as hvdc
from horovod_compress.bench.digits import train_digits

EPOCHS = 30


def case_digits_dense_vs_oktopk(comm):
    dense = train_digits(hvdc.Compression.none(), comm, epochs=EPOCHS, seed=0)
    method = hvdc.Compression.oktopk(density=0.02)
    ok = train_digits(method, comm, epochs=EPOCHS, seed=0)
    state = next(iter(method.state.values()))
    for key in ("local_th", "global_th", "boundaries", "fb_residual"):
        assert key in state, key
    return {"dense": dense["test_accuracy"], "oktopk": ok["test_accuracy"],
            "dense_bytes": dense["bytes_sent_per_step"], "oktopk_bytes": ok["bytes_sent_per_step"],
            "steps": ok["steps"], "digest": ok["params_digest"],
            "warmup": method.warmup_steps, "n": int(state["fb_residual"].size)}
