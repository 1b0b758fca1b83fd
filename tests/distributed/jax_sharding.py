"""mha's JAX (Flax NNX) MultiHeadAttention trained data-parallel over two host devices.

    python tests/distributed/jax_sharding.py

makes the CPU two XLA devices (before JAX is imported), shards the batch over a one-axis mesh
with the parameters replicated, and compares the jitted gradient and one SGD step with the
unsharded ones on a single device. Prints one JSON line. Run with JAX_ENABLE_X64=1: float64.
"""

from __future__ import annotations

import json
import os

# Read once, when JAX creates its CPU backend: set before jax is imported
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"]
).strip()

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mha.backends.jax import MultiHeadAttention

BATCH_SIZE, STEPS, FEATURES = 8, 5, 8
LEARNING_RATE = 0.1


class Model(nnx.Module):
    """Causal grouped-query self-attention with rotary positions, and a linear read-out."""

    def __init__(self, rngs):
        self.attention = MultiHeadAttention(
            16, 4, bias=True, query_size=FEATURES, key_size=FEATURES, value_size=FEATURES,
            num_kv_heads=2, rope_theta=10000.0, dtype="float64", rngs=rngs,
        )  # fmt: skip
        self.head = nnx.Linear(16, 1, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, X, valid_lens):
        Y = self.attention(X, X, X, valid_lens, causal=True, need_weights=False)
        return self.head(Y)[..., 0]


def data():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((BATCH_SIZE, STEPS, FEATURES))
    target = rng.standard_normal((BATCH_SIZE, STEPS))
    valid_lens = np.array([5, 3, 1, 4, 2, 5, 4, 3])
    return X, valid_lens, target


def largest_difference(tree, expected):
    differences = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), tree, expected)
    return max(jax.tree.leaves(differences))


def main():
    model = Model(nnx.Rngs(0))
    # The parameters are differentiated; the rest (dropout's random streams) passes through
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, X, valid_lens, target):
        model = nnx.merge(graphdef, params, rest)
        return jnp.mean((model(X, valid_lens) - target) ** 2)

    def sgd_step(params, X, valid_lens, target):
        gradients = jax.grad(loss_fn)(params, X, valid_lens, target)
        return gradients, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, gradients)

    X, valid_lens, target = data()
    # The reference: one device, nothing sharded
    expected, expected_params = jax.jit(sgd_step)(params, X, valid_lens, target)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    sharded = [jax.device_put(a, batch) for a in (X, valid_lens, target)]
    params = jax.device_put(params, replicated)
    step = jax.jit(sgd_step)
    gradients, new_params = step(params, *sharded)
    hlo = step.lower(params, *sharded).compile().as_text()

    result = {
        "devices": len(jax.devices()),
        "input_devices": [len(a.sharding.device_set) for a in sharded],
        "input_shards": [[list(s.data.shape) for s in a.addressable_shards] for a in sharded],
        "params_replicated": all(
            p.sharding.is_fully_replicated and len(p.sharding.device_set) == 2
            for p in jax.tree.leaves(params)
        ),
        "gradients_replicated": all(
            g.sharding.is_fully_replicated and len(g.sharding.device_set) == 2
            for g in jax.tree.leaves(gradients)
        ),
        # The two halves' gradients are summed across the devices by the compiled program
        "all_reduce": "all-reduce" in hlo,
        "dtype": str(jax.tree.leaves(gradients)[0].dtype),
        "gradients": largest_difference(gradients, expected),
        "weights": largest_difference(new_params, expected_params),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
