"""The SMP v1 TensorFlow 2 MNIST example with Horovod data parallelism (AWS's tf2 hvd script) on smp.

Model parallelism (2 partitions) times Horovod data parallelism: with 4 ranks, 2 pipelines of 2
stages each, and each stage's 2 replicas allreduce their gradients. Changed from the AWS script:
the import lines (``smdistributed.modelparallel.tensorflow`` -> ``smp.tensorflow``, and
``horovod.tensorflow`` -> ``smp.tensorflow.horovod``: Horovod's verbs over smp's DP group);
Keras 3's ``reset_state()`` for ``reset_states()`` and ``optimizer.variables`` (a property) for
``optimizer.variables()``; the data, which is
**synthetic** and MNIST-shaped (`synthetic_mnist` below, in place of
``tf.keras.datasets.mnist.load_data``: there is no network here); and flags to shorten the run
(``--epochs``, ``--steps``, ``--batch-size``, sizes of the synthetic sets) and to pass the config
(``--config``). Everything between the data and the training loop is the AWS script.

    mpiexec -n 4 python examples/tensorflow/tf2_mnist_hvd.py --epochs 2 --steps 20

Config: ``--config`` (a JSON object or the path of a JSON file), else SageMaker's
``SM_HP_MP_PARAMETERS`` environment variable (what ``smp.init()`` reads), else the AWS notebook's
``{"partitions": 2, "microbatches": 2, "pipeline": "interleaved", "optimize": "memory", "horovod": True}``.

Each epoch every rank prints one line with its loss and a checksum of the model's variables:
the replicas of a stage (same pp rank, other dp rank) train on other data but must hold equal
variables, since they apply the same allreduced gradients.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import smp.tensorflow as smp  # was: import smdistributed.modelparallel.tensorflow as smp
import smp.tensorflow.horovod as hvd  # was: import horovod.tensorflow as hvd
import tensorflow as tf
from tensorflow.keras.layers import Conv2D, Dense, Flatten

AWS_CONFIG = {"partitions": 2, "microbatches": 2, "pipeline": "interleaved", "optimize": "memory", "horovod": True}


# -- the data (not the AWS script: synthetic, MNIST-shaped) -----------------------------------
def synthetic_mnist(n_train: int, n_test: int, seed: int = 0) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """``load_data()``'s shapes and dtypes: uint8 images (N, 28, 28) and uint8 labels 0-9.

    Each class is a fixed random blob pattern; an image is its class's pattern with noise and a
    random shift of up to 2 pixels, so a small model learns it within a few dozen steps. The same
    seed gives the same data on every rank (as the download did).
    """
    rng = np.random.default_rng(seed)
    patterns = rng.random((10, 28, 28)) < 0.15

    def make(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, 10, n)
        shifts = rng.integers(-2, 3, (n, 2))
        images = np.stack([np.roll(patterns[c], tuple(s), axis=(0, 1)) for c, s in zip(labels, shifts)])
        noisy = images * 200 + rng.integers(0, 56, images.shape)
        return noisy.astype(np.uint8), labels.astype(np.uint8)

    return make(n_train), make(n_test)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="smp config: a JSON object or the path of a JSON file")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--steps", type=int, default=0, help="stop each epoch after this many batches (0: all)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--train-samples", type=int, default=8192)
    p.add_argument("--test-samples", type=int, default=1024)
    p.add_argument("--log-every", type=int, default=1, help="print the loss every this many steps (rank 0)")
    return p.parse_args()


def load_config(text: str | None) -> dict | None:
    if text is None:
        return None if os.environ.get("SM_HP_MP_PARAMETERS") else AWS_CONFIG
    if os.path.isfile(text):
        with open(text) as f:
            return json.load(f)
    return json.loads(text)


args = parse_args()
tf.random.set_seed(1234)

# SMP: Initialize
smp.init(load_config(args.config))

(x_train, y_train), (x_test, y_test) = synthetic_mnist(args.train_samples, args.test_samples)
x_train, x_test = x_train / 255.0, x_test / 255.0

# Add a channels dimension
x_train = x_train[..., tf.newaxis]
x_test = x_test[..., tf.newaxis]

# SMP: If needed, seed the shuffle with smp.dp_rank(), and drop_remainder
# in batching to make sure batch size is always divisible by number of microbatches
train_ds = (
    tf.data.Dataset.from_tensor_slices((x_train, y_train))
    .shuffle(10000, seed=smp.dp_rank())
    .batch(args.batch_size, drop_remainder=True)
)
test_ds = (
    tf.data.Dataset.from_tensor_slices((x_test, y_test))
    .shuffle(10000, seed=smp.dp_rank())
    .batch(args.batch_size, drop_remainder=True)
)


# SMP: Define smp.DistributedModel the same way as Keras sub-classing API
class MyModel(smp.DistributedModel):
    def __init__(self):
        super(MyModel, self).__init__()  # noqa: UP008 - the AWS script as published
        self.conv1 = Conv2D(32, 3, activation="relu")
        self.flatten = Flatten()
        self.dense1 = Dense(128)
        self.dense2 = Dense(10)

    def call(self, x):
        x = self.conv1(x)
        x = self.flatten(x)
        x = self.dense1(x)
        return self.dense2(x)


model = MyModel()

loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = tf.keras.optimizers.Adam()

train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
test_loss = tf.keras.metrics.Mean(name="test_loss")
test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")


# SMP: Define smp.step. Return any tensors needed outside
@smp.step
def get_grads(images, labels):
    predictions = model(images, training=True)
    loss = loss_object(labels, predictions)

    grads = optimizer.get_gradients(loss, model.trainable_variables)
    return grads, loss, predictions


@tf.function
def train_step(images, labels, first_batch):
    gradients, loss, predictions = get_grads(images, labels)

    # SMP: Accumulate the gradients across microbatches
    # Horovod: AllReduce the accumulated gradients
    gradients = [hvd.allreduce(g.accumulate()) for g in gradients]
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    # Horovod: Broadcast the variables after first batch
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(optimizer.variables, root_rank=0)  # Keras 3: a property (was variables())

    # SMP: Average the loss across microbatches
    train_accuracy(labels, predictions.merge())
    return loss.reduce_mean()


# SMP: Define the smp.step for evaluation. Optionally specify an input signature.
@smp.step
def test_step(images, labels):
    predictions = model(images, training=False)
    t_loss = loss_object(labels, predictions)
    test_loss(t_loss)
    test_accuracy(labels, predictions)


for epoch in range(args.epochs):
    # Reset the metrics at the start of the next epoch
    train_accuracy.reset_state()
    test_loss.reset_state()
    test_accuracy.reset_state()

    for batch, (images, labels) in enumerate(train_ds):
        if args.steps and batch >= args.steps:
            break
        loss = train_step(images, labels, tf.constant(batch == 0))
        if smp.rank() == 0 and batch % args.log_every == 0:
            print(f"epoch {epoch} step {batch} loss {float(loss):.6f} accuracy {float(train_accuracy.result()):.4f}",
                  flush=True)

    for test_images, test_labels in test_ds:
        test_step(test_images, test_labels)

    if smp.rank() == 0:
        print(
            "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}".format(  # noqa: UP032 - as AWS
                epoch + 1,
                float(loss),
                float(train_accuracy.result()) * 100,
                float(test_loss.result()),
                float(test_accuracy.result()) * 100,
            ),
            flush=True,
        )
    checksum = sum(float(np.sum(v.numpy(), dtype=np.float64)) for v in model.variables)
    print(f"rank {smp.rank()} pp_rank {smp.pp_rank()} dp_rank {smp.dp_rank()} epoch {epoch + 1} "
          f"loss {float(loss):.6f} checksum {checksum:.10e}", flush=True)
