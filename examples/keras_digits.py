"""Keras 3 + horovod-compress: an MLP on scikit-learn's digits, trained on P ranks with model.fit.

    mpirun -np 4 python examples/keras_digits.py --compression topk --density 0.1
    hvdc train --np 4 --framework tensorflow --compression topk     # the same workload

What changes against single-process Keras: ``hvdc_keras.init()``, the wrapped
optimizer, the callbacks, and each rank training on its own shard. Every
rank ends with identical weights; rank 0 prints the per-epoch statistics the
stats callback put into ``History``.
"""
from __future__ import annotations

import argparse

import keras
import numpy as np

import horovod_compress as hvdc
import horovod_compress.keras as hvdc_keras
from horovod_compress.tools.bench.digits import load_digits_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compression", default="topk", help="a hvdc.Compression method name")
    parser.add_argument("--density", type=float, default=None,
                        help="density for sparsifiers (default: the method's own)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup-epochs", type=int, default=1,
                        help="epochs with a dense exchange before compressing")
    args = parser.parse_args()

    hvdc_keras.init()                       # MPI world (mpi4py); works under mpirun, srun, horovodrun
    rank, size = hvdc_keras.rank(), hvdc_keras.size()
    params = {"density": args.density} if args.density is not None else {}
    compression = hvdc.Compression.by_name(args.compression, **params)

    data = load_digits_split(seed=0)
    steps = (len(data.y_train) // size) // args.batch_size
    x = data.x_train[rank::size][:steps * args.batch_size]  # this rank's shard
    y = data.y_train[rank::size][:steps * args.batch_size]

    keras.utils.set_random_seed(rank)  # different init per rank: the broadcast fixes it
    model = keras.Sequential([keras.Input(shape=(64,)),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = hvdc_keras.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=0.05, momentum=0.9), compression=compression)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    history = model.fit(
        x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
        validation_data=(data.x_test, data.y_test),
        callbacks=[hvdc_keras.BroadcastGlobalVariablesCallback(root_rank=0),
                   hvdc_keras.CompressionWarmupCallback(epochs=args.warmup_epochs),
                   hvdc_keras.CompressionStatsCallback(error_every=10),
                   hvdc_keras.MetricAverageCallback()])

    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    gathered = hvdc_keras.communicator().allgather_object(weights)
    assert all((w == weights).all() for w in gathered), "ranks diverged"
    if rank == 0:
        h = history.history
        print(f"{compression!r} on {size} ranks")
        print("epoch  val_acc  KiB sent  ratio  rel. error")
        for e in range(args.epochs):
            print(f"{e + 1:5d}  {h['val_accuracy'][e]:.4f}  {h['hvdc_bytes_sent'][e] / 1024:8.1f}  "
                  f"{h['hvdc_compression_ratio'][e]:5.1f}  {h['hvdc_compression_error'][e]:.3f}")


if __name__ == "__main__":
    main()
