"""Our equivalent of Horovod's examples/tensorflow2/tensorflow2_synthetic_benchmark.py (small model).

Same flow: init, synthetic batch, ``tf.function`` benchmark step with
``hvd.DistributedGradientTape(tape, compression=...)``, variables broadcast
after the first batch, warm-up, timeit iterations, img/sec. The model is a
``tf.Module`` of plain ``tf.Variable``s (Horovod 0.28's tape needs
``Variable.ref()``). ``--fp16-allreduce`` as in Horovod; ``--compression
NAME`` picks a horovod_compress method.
"""
import argparse
import os
import sys
import timeit

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--num-warmup-batches", type=int, default=1)
parser.add_argument("--num-batches-per-iter", type=int, default=2)
parser.add_argument("--num-iters", type=int, default=2)
parser.add_argument("--compression", default=None)
args = parser.parse_args()

hvd.init()


class Model(tf.Module):
    def __init__(self):
        super().__init__()
        g = np.random.default_rng(hvd.rank())   # different on purpose: the broadcast fixes it
        self.w1 = tf.Variable(g.standard_normal((3, 3, 3, 8)).astype(np.float32) * 0.2, name="w1")
        self.w2 = tf.Variable(g.standard_normal((8, 10)).astype(np.float32) * 0.2, name="w2")

    def __call__(self, x):
        h = tf.nn.relu(tf.nn.conv2d(x, self.w1, strides=2, padding="SAME"))
        return tf.reduce_mean(h, axis=[1, 2]) @ self.w2


model = Model()
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
if args.compression:
    import horovod_compress as hvdc
    compression = getattr(hvdc.Compression, args.compression)
data = tf.random.uniform([args.batch_size, 32, 32, 3], seed=1)
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=10, dtype=tf.int64, seed=2)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def benchmark_step(first_batch):
    with tf.GradientTape() as tape:
        loss = loss_fn(target, model(data))
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    gradients = tape.gradient(loss, model.trainable_variables)
    for v, g in zip(model.trainable_variables, gradients):
        v.assign_sub(0.01 * g)
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log(f"Batch size: {args.batch_size}, Number of CPUs: {hvd.size()}")
benchmark_step(first_batch=True)
timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
    img_secs.append(img_sec)
log(f"Img/sec per CPU: {np.mean(img_secs):.1f}")
_report.write(hvd.rank(), [v.numpy() for v in model.variables], img_sec=float(np.mean(img_secs)))
