"""Our equivalent of Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py (synthetic data, Keras 3).

Same flow: init, GPU pinning, repeated shuffled dataset, a Keras Sequential
CNN, Adam with lr scaled by hvd.size(), ``hvd.DistributedOptimizer(opt,
backward_passes_per_step=1, average_aggregated_gradients=True)``, the
callbacks BroadcastGlobalVariablesCallback, MetricAverageCallback,
LearningRateWarmupCallback, a ModelCheckpoint on rank 0 only, steps per
epoch divided by hvd.size(). Keras 3 has no ``experimental_run_tf_function``
argument, so compile() omits it. ``--compression NAME``: a horovod_compress
method (uncalled). Horovod 0.28's own Keras layer does not run on Keras 3.
"""
import argparse
import os
import sys

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--steps", type=int, default=8)
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

tf.keras.utils.set_random_seed(hvd.rank())   # different weights: the broadcast must fix them
mnist_model = tf.keras.Sequential([
    tf.keras.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(32, activation="relu"),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation="softmax"),
])
scaled_lr = 0.001 * hvd.size()
opt = tf.keras.optimizers.Adam(scaled_lr)
compression = hvd.Compression.none
if args.compression:
    import horovod_compress as hvdc
    compression = getattr(hvdc.Compression, args.compression)
opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True,
                               compression=compression)
mnist_model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                    metrics=["accuracy"])
callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1, verbose=1),
]
if hvd.rank() == 0 and args.checkpoint_dir:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.weights.h5"),
        save_weights_only=True))
verbose = 1 if hvd.rank() == 0 else 0
history = mnist_model.fit(dataset, steps_per_epoch=args.steps // hvd.size(), callbacks=callbacks,
                          epochs=args.epochs, verbose=verbose)
_report.write(hvd.rank(), [np.asarray(v) for v in mnist_model.get_weights()],
              loss=float(history.history["loss"][-1]),
              lr=float(history.history.get("lr", [float("nan")])[-1]))
