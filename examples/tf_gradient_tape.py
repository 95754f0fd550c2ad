"""TensorFlow + horovod-compress: a custom training loop with ``tf.GradientTape`` on P ranks.

    mpirun -np 4 python examples/tf_gradient_tape.py --compression oktopk --param density=0.05
    srun -n 4 python examples/tf_gradient_tape.py --compression global_qsgd

The tape is wrapped by ``hvdc_tf.DistributedGradientTape``: ``tape.gradient``
returns the compressed average over ranks, eagerly or inside ``tf.function``
(``--graph``). Rank 0's initial weights are broadcast first; every rank ends
with identical weights (checked).
"""
from __future__ import annotations

import argparse
import ast
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod_compress as hvdc  # noqa: E402
import horovod_compress.tensorflow as hvdc_tf  # noqa: E402
from horovod_compress.tools.bench.digits import load_digits_split  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compression", default="topk", help="a hvdc.Compression method name")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="method parameter, e.g. density=0.05 (repeatable)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--graph", action="store_true", help="run the step inside tf.function")
    args = parser.parse_args()

    tf.config.threading.set_intra_op_parallelism_threads(1)   # one core per rank
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvdc_tf.init()                            # MPI world (mpi4py); works under mpirun, srun, horovodrun
    rank, size = hvdc_tf.rank(), hvdc_tf.size()
    comm = hvdc_tf.communicator()             # the mpi4py communicator, with byte counts
    params = {}
    for pair in args.param:
        key, _, value = pair.partition("=")
        try:
            params[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[key] = value
    compression = hvdc.Compression.by_name(args.compression, **params)

    data = load_digits_split(seed=0)
    x, y = data.x_train[rank::size], data.y_train[rank::size]
    steps = max(1, len(y) // args.batch_size)

    tf.random.set_seed(rank)             # different init per rank: the broadcast fixes it
    model = tf.keras.Sequential([tf.keras.Input(shape=(64,)),
                                 tf.keras.layers.Dense(128, activation="relu"),
                                 tf.keras.layers.Dense(128, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    opt = tf.keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hvdc_tf.broadcast_variables(model.trainable_variables, root_rank=0)

    def train_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvdc_tf.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step_fn = tf.function(train_step) if args.graph else train_step
    comm.reset_stats()
    for epoch in range(args.epochs):
        order = np.random.default_rng([epoch, rank]).permutation(len(y))
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            step_fn(tf.constant(x[idx]), tf.constant(y[idx]))
        acc = float((model(data.x_test).numpy().argmax(1) == data.y_test).mean())
        if rank == 0:
            print(f"epoch {epoch + 1:3d}  test accuracy {acc:.4f}", flush=True)

    sent = comm.bytes_sent / (args.epochs * steps)   # read before the check below adds its own bytes
    flat = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    assert all((w == flat).all() for w in hvdc_tf.allgather_object(flat)), "ranks diverged"
    if rank == 0:
        print(f"{compression!r} on {size} ranks: {sent / 1024:.1f} KiB sent per rank per step")


if __name__ == "__main__":
    main()
