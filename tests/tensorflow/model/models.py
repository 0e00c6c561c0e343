"""Models of the DistributedModel tests, each built on any base class (a DistributedModel or plain keras.Model).

The same ``call()`` (with its ``smp.partition`` blocks) runs distributed and, on a plain
``keras.Model``, as the one-process reference: a block is only a name scope there.
"""

from __future__ import annotations

from typing import Any

import keras
import smp.tensorflow as smp
import tensorflow as tf

VOCAB, DIM, SEQ = 20, 8, 3


def mlp(base: type, pp: int) -> type:
    """Dense -> relu -> Dense -> tanh -> Dense, one layer group per partition (the last ones on pp - 1)."""

    class MLP(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.d1 = keras.layers.Dense(16, activation="relu")
            self.d2 = keras.layers.Dense(12, activation="tanh")
            self.d3 = keras.layers.Dense(4)

        def call(self, x: Any) -> Any:
            with smp.partition(0):
                h = self.d1(x)
            with smp.partition(min(1, pp - 1)):
                h = self.d2(h)
            with smp.partition(pp - 1):
                return self.d3(h)

    return MLP


class _Block(keras.layers.Layer):
    """Single-head self-attention + MLP with residuals and layer norms (a tiny transformer block)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # No bias on q/k/v: the key bias has an exact zero gradient (softmax ignores a constant per
        # query), and Adam would turn its rounding noise into steps of the learning rate.
        self.qkv = keras.layers.Dense(3 * DIM, use_bias=False)
        self.proj = keras.layers.Dense(DIM)
        self.ln1 = keras.layers.LayerNormalization()
        self.ln2 = keras.layers.LayerNormalization()
        self.ff = keras.layers.Dense(DIM, activation="gelu")

    def call(self, x: Any) -> Any:
        q, k, v = tf.split(self.qkv(self.ln1(x)), 3, axis=-1)
        att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / DIM ** 0.5, axis=-1)
        x = x + self.proj(tf.matmul(att, v))
        return x + self.ff(self.ln2(x))


def tied_lm(base: type, pp: int) -> type:
    """Embedding tied to the output head, a skip connection and a layer used twice.

    pp=2: emb on 0 -> block on 1 -> norm + the shared ``mix`` layer on 0 -> ``mix`` again, the
    skip from partition 0's embedding, and the tied head on 1: the cut is crossed 0 -> 1 -> 0 -> 1.
    pp=3: emb on 0 -> block on 1 -> block2 on 2 -> tied head back on 0, ``mix`` on 1 and 2.
    """

    class TiedLM(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.emb = keras.layers.Embedding(VOCAB, DIM)
            self.block = _Block(name="block")
            self.block2 = _Block(name="block2")
            self.mix = keras.layers.Dense(DIM, activation="tanh")
            self.norm = keras.layers.LayerNormalization()

        def call(self, x: Any) -> Any:
            with smp.partition(0):
                e = self.emb(x)
            with smp.partition(1):
                h = self.block(e)
            if pp == 2:
                with smp.partition(0):
                    h = self.mix(self.norm(h))
                with smp.partition(1):
                    h = self.mix(h) + e                      # the layer again; skip from partition 0
                    return tf.matmul(h, self.emb.embeddings, transpose_b=True)
            with smp.partition(2):
                h = self.block2(self.mix(h)) + e
            with smp.partition(1):
                h = self.mix(h)
            with smp.partition(0):
                return tf.matmul(self.norm(h), self.emb.embeddings, transpose_b=True)

    return TiedLM


def bn_dropout(base: type, pp: int) -> type:
    """Dense -> BatchNormalization -> Dropout on partition 0, Dense on the last partition."""

    class BNDrop(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            # No bias before BatchNormalization: its exact gradient is 0, so Adam would amplify rounding noise.
            self.d1 = keras.layers.Dense(16, use_bias=False)
            self.bn = keras.layers.BatchNormalization()
            self.drop = keras.layers.Dropout(0.5, seed=7)
            self.d2 = keras.layers.Dense(4)

        def call(self, x: Any, training: bool = False) -> Any:
            with smp.partition(0):
                h = self.drop(self.bn(self.d1(x), training=training), training=training)
            with smp.partition(pp - 1):
                return self.d2(h)

    return BNDrop


def cnn(base: type, pp: int) -> type:
    """An MNIST-shaped CNN (smaller images): Conv2D -> MaxPooling2D on partition 0, Conv2D -> Flatten -> Dense on the last."""

    class CNN(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = keras.layers.Conv2D(4, 3, activation="relu")
            self.pool = keras.layers.MaxPooling2D(2)
            self.conv2 = keras.layers.Conv2D(8, 3, activation="relu")
            self.flat = keras.layers.Flatten()
            self.head = keras.layers.Dense(4)

        def call(self, x: Any) -> Any:
            with smp.partition(0):
                h = self.pool(self.conv1(x))
            with smp.partition(pp - 1):
                return self.head(self.flat(self.conv2(h)))

    return CNN


MODELS = {"mlp": mlp, "tied_lm": tied_lm, "bn_dropout": bn_dropout, "cnn": cnn}
