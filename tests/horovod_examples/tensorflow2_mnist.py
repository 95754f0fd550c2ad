"""Our equivalent of Horovod's examples/tensorflow2/tensorflow2_mnist.py (synthetic data).

Same flow: init, GPU pinning by local_rank, a shuffled repeated dataset,
a ``tf.function`` training step with ``hvd.DistributedGradientTape``,
``hvd.broadcast_variables`` after the first batch, steps divided by
hvd.size(), a checkpoint on rank 0. The model is a ``tf.Module`` of plain
``tf.Variable``s trained by SGD: Horovod 0.28's own tape needs
``Variable.ref()``, which Keras 3 variables lack, and this script also runs
under Horovod. ``--compression NAME``: a horovod_compress method (uncalled).
"""
import argparse
import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--compression", default=None)
parser.add_argument("--checkpoint-dir", default=None)
args = parser.parse_args()

hvd.init()
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

g = np.random.default_rng(hvd.rank())
images = g.random((256, 28, 28, 1), dtype=np.float32)
labels = g.integers(0, 10, 256).astype(np.int64)
dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().shuffle(256).batch(16)


class Model(tf.Module):
    def __init__(self):
        super().__init__()
        init = np.random.default_rng(0)   # rank 0's values are broadcast anyway
        self.conv = tf.Variable(init.standard_normal((3, 3, 1, 8)).astype(np.float32) * 0.3,
                                name="conv")
        self.dense = tf.Variable(init.standard_normal((13 * 13 * 8, 10)).astype(np.float32)
                                 * 0.02, name="dense")
        self.bias = tf.Variable(np.zeros(10, np.float32), name="bias")

    def __call__(self, x):
        h = tf.nn.relu(tf.nn.conv2d(x, self.conv, strides=1, padding="VALID"))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        return tf.reshape(h, [tf.shape(h)[0], -1]) @ self.dense + self.bias


model = Model()
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
lr = 0.01 * hvd.size()
compression = hvd.Compression.none
if args.compression:
    import horovod_compress as hvdc
    compression = getattr(hvdc.Compression, args.compression)
checkpoint = tf.train.Checkpoint(model=model)


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss_value = loss_fn(labels, model(images))
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    grads = tape.gradient(loss_value, model.trainable_variables)
    for v, gr in zip(model.trainable_variables, grads):
        v.assign_sub(lr * gr)
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
    return loss_value


loss_value = None
for batch, (imgs, lbls) in enumerate(dataset.take(args.steps // hvd.size())):
    loss_value = training_step(imgs, lbls, batch == 0)
    if batch % 2 == 0 and hvd.local_rank() == 0:
        print(f"Step #{batch}\tLoss: {float(loss_value):.6f}", flush=True)
if hvd.rank() == 0 and args.checkpoint_dir:
    checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))
_report.write(hvd.rank(), [v.numpy() for v in model.variables], loss=float(loss_value))
