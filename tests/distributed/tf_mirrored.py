"""mha's tensorflow MultiHeadAttention trained under tf.distribute.MirroredStrategy.

    python tests/distributed/tf_mirrored.py

splits the one CPU into two logical devices (before TensorFlow initializes them), mirrors a
float64 Keras model over both, and compares with a single-device step on the full batch from
the same weights: the gradients all-reduced from the replicas' halves of the batch, then the
weights after one SGD step of model.fit. Prints one JSON line.
"""

from __future__ import annotations

import json

import numpy as np
import tensorflow as tf

# Before anything asks TensorFlow for a device: the logical devices are fixed at that point
(_cpu,) = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from mha.backends.tensorflow import MultiHeadAttention  # noqa: E402

BATCH_SIZE, STEPS, FEATURES = 8, 5, 8


class Model(keras.Model):
    """Causal grouped-query self-attention with rotary positions, and a linear read-out."""

    def __init__(self):
        super().__init__(dtype="float64")
        self.attention = MultiHeadAttention(
            16, 4, bias=True, query_size=FEATURES, key_size=FEATURES, value_size=FEATURES,
            num_kv_heads=2, rope_theta=10000.0, dtype="float64",
        )  # fmt: skip
        self.head = keras.layers.Dense(1, dtype="float64")

    def call(self, inputs):
        X, valid_lens = inputs
        Y = self.attention(X, X, X, valid_lens, causal=True, need_weights=False)
        return tf.squeeze(self.head(Y), -1)


def data():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((BATCH_SIZE, STEPS, FEATURES))
    target = rng.standard_normal((BATCH_SIZE, STEPS))
    valid_lens = np.array([5, 3, 1, 4, 2, 5, 4, 3])
    return X, valid_lens, target


def build(model, X, valid_lens):
    model((X[:1], valid_lens[:1]))  # creates the read-out's variables
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def largest_difference(tensors, expected):
    pairs = zip(tensors, expected, strict=True)
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in pairs)


def main():
    X, valid_lens, target = data()
    dataset = tf.data.Dataset.from_tensor_slices(((X, valid_lens), target)).batch(BATCH_SIZE)

    keras.utils.set_random_seed(0)
    single = build(Model(), X, valid_lens)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = build(Model(), X, valid_lens)
    model.set_weights(single.get_weights())

    # The single-device gradient of the mean squared error over the full batch
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(target, single((X, valid_lens)))
        loss = tf.reduce_mean(loss)
    expected = tape.gradient(loss, single.trainable_variables)

    @tf.function
    def replica_step(inputs, target):
        with tf.GradientTape() as tape:
            per_example = keras.losses.mean_squared_error(target, model(inputs))
            # Each replica's sum over its half, divided by the global batch size: the
            # all-reduced sum is the full batch's mean
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH_SIZE)
        gradients = tape.gradient(loss, model.trainable_variables)
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, gradients), tf.shape(target)[0]

    inputs, targets = next(iter(strategy.experimental_distribute_dataset(dataset)))
    gradients, local_batch = strategy.run(replica_step, args=(inputs, targets))
    replicas = strategy.experimental_local_results(gradients)
    result = {
        "replicas": strategy.num_replicas_in_sync,
        "devices": [t.device for t in strategy.experimental_local_results(targets)],
        "local_batch": [int(n) for n in strategy.experimental_local_results(local_batch)],
        "gradients": [largest_difference(g, expected) for g in replicas],
        "mirrored": [type(v.value).__name__ for v in model.trainable_variables],
    }

    # One step of model.fit on the full batch: the strategy splits it over the replicas
    initial = single.get_weights()
    single.fit(dataset, epochs=1, shuffle=False, verbose=0)
    model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    expected = single.get_weights()
    # Every replica's copy of every variable
    copies = [strategy.experimental_local_results(v.value) for v in model.weights]
    result["weights"] = [largest_difference(c, expected) for c in zip(*copies, strict=True)]
    result["moved"] = largest_difference(expected, initial)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
