"""Digits MLP at P ranks: the foundation methods against the dense run (real data, real ranks)."""
import horovod_compress as hvdc
from horovod_compress.bench.digits import train_digits

EPOCHS = 40
# The settings the suite checks; each within 2 points of dense test accuracy.
METHODS = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "topk": {"density": 0.01},
    "randk": {"density": 0.25, "unbiased": True},
}


def case_train_all(comm):
    out = {}
    for name, params in METHODS.items():
        r = train_digits(hvdc.Compression.by_name(name, **params), comm, epochs=EPOCHS, seed=0)
        digests = comm.allgather_object(r["params_digest"])
        assert len(set(digests)) == 1, f"{name}: ranks ended with different parameters"
        out[name] = {k: r[k] for k in ("test_accuracy", "bytes_sent_per_step",
                                       "dense_bytes_per_step", "compression_ratio")}
    return out
