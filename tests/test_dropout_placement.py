"""Where dropout falls while training, in every backend: on the attention weights, before they
weigh the values (not on the output), and in AddNorm on Y alone (not on X + Y). Each test
reads the placement off the numbers, whatever mask the dropout draws."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import backend_module, backend_params

BACKENDS = backend_params()
RATE = 0.5


def training(name: str, layer, *args):
    """The layer called as each framework trains (numpy: train(), as torch)."""
    if name == "tensorflow":
        return layer(*args, training=True)
    if name == "mxnet":
        import mxnet as mx

        with mx.autograd.record():
            return layer(*args)
    layer.train()
    return layer(*args)


@pytest.mark.parametrize("layer_name", ["DotProductAttention", "AdditiveAttention"])
@pytest.mark.parametrize("name", BACKENDS)
def test_dropout_falls_on_the_weights_before_they_weigh_the_values(name, layer_name):
    M = backend_module(name)
    rng = np.random.default_rng(0)
    queries, keys = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 6, 3))
    # Values: the identity beside a column of ones, so that the output shows each dropped
    # weight and, in its last column, their sum
    values = np.concatenate([np.eye(6), np.ones((6, 1))], axis=1)[None].repeat(2, axis=0)
    if layer_name == "DotProductAttention":
        layer = M.DotProductAttention(dropout=RATE)
    else:
        layer = M.AdditiveAttention(8, dropout=RATE, query_size=3, key_size=3)
    inputs = (M.from_numpy(x.astype("float32")) for x in (queries, keys, values))
    output = M.to_numpy(training(name, layer, *inputs)).astype("float64")
    weights = M.to_numpy(layer.attention_weights).astype("float64")  # before dropout
    dropped, total = output[..., :6], output[..., 6]
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    # Each weight is dropped (0) or kept and scaled by 1 / (1 - rate)
    kept = np.isclose(dropped, weights / (1 - RATE), rtol=1e-5, atol=1e-7)
    assert (kept | (dropped == 0)).all()
    assert (dropped == 0).any() and kept.any()
    # The output is those weights times the values: dropout of the output would drop this sum
    # as one, independently of the weights it sums
    np.testing.assert_allclose(total, dropped.sum(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", BACKENDS)
def test_add_norm_drops_y_alone(name):
    M = backend_module(name)
    rng = np.random.default_rng(1)
    X, Y = rng.standard_normal((2, 5, 8)), np.zeros((2, 5, 8))
    layer = M.AddNorm(8, dropout=RATE)
    output = M.to_numpy(training(name, layer, *(M.from_numpy(x.astype("float32")) for x in (X, Y))))
    # With Y = 0, LayerNorm(X + dropout(Y)) is LayerNorm(X) whatever is dropped (gamma 1, beta
    # 0 as made); a dropout of X + Y would zero some of X
    expected = (X - X.mean(-1, keepdims=True)) / np.sqrt(X.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
