"""The TensorFlow / Keras backend against the NumPy reference.

Every layer and mask combination under shared weights (float32 and float64), gradients from
tf.GradientTape against central finite differences of the reference, Keras conventions
(.keras files, Sequential and functional models, jit_compile), and the error table.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mha
from conftest import backend_module
from mha.backends import numpy as reference

pytestmark = pytest.mark.tensorflow

B, Q, K, D, V = 4, 3, 5, 6, 7
NUM_HIDDENS, NUM_HEADS = 8, 2


@pytest.fixture(scope="module")
def TF():
    return backend_module("tensorflow")


@pytest.fixture(scope="module")
def tf(TF):
    import tensorflow

    return tensorflow


def assert_close(actual, expected, dtype):
    """float64 within 1e-10 absolute; float32 within 1e-5 of the output's scale."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all()
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    tolerance = 1e-10 if dtype == "float64" else 1e-5 * scale
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance)


# ---------------------------------------------------------------------------------------------
# Layers built the same in both backends


CONFIGS = {
    "DotProductAttention": {},
    "AdditiveAttention": {"num_hiddens": 5, "query_size": D, "key_size": D},
    "MultiHeadAttention": {
        "num_hiddens": NUM_HIDDENS,
        "num_heads": NUM_HEADS,
        "query_size": D,
        "key_size": D,
        "value_size": V,
    },
}


def make_pair(TF, class_name, dtype, seed=0, **config):
    """(numpy layer, tensorflow layer) with the same canonical weights."""
    config = {**CONFIGS.get(class_name, {}), **config}
    numpy_layer = getattr(reference, class_name)(**config, dtype=dtype)
    tf_layer = getattr(TF, class_name)(**config, dtype=dtype)
    weights = mha.random_weights(class_name, seed=seed, dtype=dtype, **config)
    if weights:
        mha.set_weights(numpy_layer, weights)
        mha.set_weights(tf_layer, weights)
    return numpy_layer, tf_layer


def inputs(dtype, num_queries=Q, num_keys=K, seed=1):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, num_queries, D)).astype(dtype),
        rng.standard_normal((B, num_keys, D)).astype(dtype),
        rng.standard_normal((B, num_keys, V)).astype(dtype),
    )


def mask_cases(num_queries, num_keys, dtype, multihead):
    """name -> (valid_lens, keyword arguments) as numpy arrays."""
    rng = np.random.default_rng(2)
    keep3 = rng.random((B, num_queries, num_keys)) < 0.6
    additive = rng.standard_normal((2, num_queries, num_keys)).astype(dtype)
    additive[rng.random(additive.shape) < 0.3] = -np.inf
    additive[0, 0, :] = -np.inf  # one fully blocked row
    cases = {
        "none": (None, {}),
        "valid_lens_1d": (np.array([0, 2, num_keys + 4, 1]), {}),
        "valid_lens_2d": (rng.integers(0, num_keys + 2, (B, num_queries)), {}),
        "valid_lens_float": (np.array([3.0, 0.0, 1.0, 100.0], dtype=dtype), {}),
        "mask_1d": (None, {"mask": np.array([True, False] * num_keys)[:num_keys]}),
        "mask_2d": (None, {"mask": keep3[0]}),
        "mask_3d": (None, {"mask": keep3}),
        "mask_3d_broadcast": (None, {"mask": keep3[:, :1, :]}),
        "causal": (None, {"causal": True}),
        "window_bool": (None, {"window_mask": keep3[:2]}),
        "window_additive": (None, {"window_mask": additive}),
        "fully_masked_rows": (None, {"mask": np.zeros((B, num_queries, num_keys), bool)}),
        "combined": (
            np.array([1, 0, 4, 9]),
            {
                "mask": keep3[:, :1, :] | np.eye(num_queries, num_keys, dtype=bool),
                "causal": True,
                "window_mask": additive,
            },
        ),
    }
    if multihead:
        keep4 = rng.random((B, NUM_HEADS, num_queries, num_keys)) < 0.6
        head_mask = np.array([1.0, 0.0], dtype=dtype)
        cases.update(
            {
                "mask_4d": (None, {"mask": keep4}),
                "mask_4d_broadcast": (None, {"mask": keep4[:1, :, :1, :]}),
                "mask_4d_batch_only": (None, {"mask": keep4[:, :1]}),
                "head_mask_1d": (None, {"head_mask": head_mask}),
                "head_mask_2d": (None, {"head_mask": rng.random((B, NUM_HEADS)).astype(dtype)}),
                "head_mask_bool": (None, {"head_mask": np.array([False, True])}),
                "need_weights_false": (np.array([0, 2, 3, 9]), {"need_weights": False}),
                "combined_heads": (
                    np.array([2, 0, 4, 9]),
                    {
                        "mask": keep4,
                        "causal": True,
                        "window_mask": additive,
                        "head_mask": head_mask,
                    },
                ),
            }
        )
    return cases


def _all_cases():
    params = []
    for class_name in CONFIGS:
        multihead = class_name == "MultiHeadAttention"
        for shape_name, num_queries, num_keys in (("QneK", Q, K), ("QeqK", K, K), ("QgtK", K, Q)):
            names = mask_cases(num_queries, num_keys, "float64", multihead)
            for case in names:
                if shape_name != "QneK" and case not in ("causal", "combined", "none"):
                    continue
                params.append((class_name, shape_name, num_queries, num_keys, case))
    return params


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "class_name,shape_name,num_queries,num_keys,case",
    _all_cases(),
    ids=[f"{c[0]}-{c[1]}-{c[4]}" for c in _all_cases()],
)
def test_attention_matches_reference(
    TF, class_name, shape_name, num_queries, num_keys, case, dtype
):
    numpy_layer, tf_layer = make_pair(TF, class_name, dtype)
    queries, keys, values = inputs(dtype, num_queries, num_keys)
    multihead = class_name == "MultiHeadAttention"
    valid_lens, kwargs = mask_cases(num_queries, num_keys, dtype, multihead)[case]
    expected = numpy_layer(queries, keys, values, valid_lens, **kwargs)
    tf_kwargs = {k: TF.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    tf_valid_lens = None if valid_lens is None else TF.from_numpy(valid_lens)
    output = tf_layer(
        TF.from_numpy(queries),
        TF.from_numpy(keys),
        TF.from_numpy(values),
        tf_valid_lens,
        **tf_kwargs,
    )
    assert_close(TF.to_numpy(output), expected, dtype)
    if kwargs.get("need_weights", True):
        assert_close(TF.to_numpy(tf_layer.attention_weights), numpy_layer.attention_weights, dtype)
        expected_shape = (
            (B, NUM_HEADS, num_queries, num_keys) if multihead else (B, num_queries, num_keys)
        )
        assert tuple(tf_layer.attention_weights.shape) == expected_shape
    else:
        assert tf_layer.attention_weights is None


def test_fully_masked_rows_are_zero(TF):
    # Independent of the reference: a row with no attended key gives zero weights and output
    _, layer = make_pair(TF, "MultiHeadAttention", "float64", bias=True)
    queries, keys, values = inputs("float64")
    output = layer(queries, keys, values, np.array([0, 1, 0, 2]))
    weights = TF.to_numpy(layer.attention_weights)
    assert (weights[[0, 2]] == 0).all()
    np.testing.assert_array_equal(
        TF.to_numpy(output)[[0, 2]], np.broadcast_to(TF.to_numpy(layer.W_o.bias), (2, Q, 8))
    )
    assert (weights[1, :, :, 1:] == 0).all()
    np.testing.assert_allclose(weights[1, :, :, 0], 1.0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_masked_rows(TF, tf, dtype):
    layer = TF.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, dtype=dtype)
    queries, keys, values = (tf.cast(100 * x, dtype) for x in inputs("float32"))
    output = layer(queries, keys, values, np.array([0, 1, 2, 9]), causal=True)
    assert output.dtype.name == dtype
    assert np.isfinite(TF.to_numpy(tf.cast(output, "float32"))).all()
    weights = TF.to_numpy(tf.cast(layer.attention_weights, "float32"))
    assert (weights[0] == 0).all()


def test_float_valid_lens_keep_their_precision(TF):
    # 3001 is not a float16 number: the lengths must not be cast to the layer's dtype
    num_keys = 3002
    layer = TF.DotProductAttention(dtype="float16")
    keys = np.zeros((1, num_keys, 2), np.float16)
    layer(np.zeros((1, 1, 2), np.float16), keys, keys, np.array([3001.0], np.float32))
    weights = TF.to_numpy(layer.attention_weights).astype(np.float32)
    assert weights[0, 0, 3000] > 0 and weights[0, 0, 3001] == 0


def test_float16_matches_reference(TF):
    numpy_layer, tf_layer = make_pair(TF, "MultiHeadAttention", "float16")
    queries, keys, values = inputs("float16")
    valid_lens = np.array([0, 2, 9, 3])
    expected = numpy_layer(queries, keys, values, valid_lens, causal=True).astype(np.float64)
    output = TF.to_numpy(tf_layer(queries, keys, values, valid_lens, causal=True))
    np.testing.assert_allclose(output.astype(np.float64), expected, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# masked_softmax


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "shape,valid_lens",
    [
        ((B, K), None),
        ((B, K), np.array([0, 1, 5, 9])),
        ((B, Q, K), np.array([0, 1, 5, 9])),
        ((B, Q, K), np.array([[0, 1, 2], [3, 4, 5], [9, 0, 1], [2, 2, 2]])),
        ((B, 2, Q, K), np.array([0, 1, 5, 9])),
        ((B, 2, Q, K), np.array([[0, 1, 2], [3, 4, 5], [9, 0, 1], [2, 2, 2]])),
        ((B, Q, K), np.array([0.0, 2.0, 3.0, 1e9])),
        ((B, Q, K), np.array([1, 2, 3, 4], dtype=np.uint8)),
    ],
)
def test_masked_softmax_matches_reference(TF, shape, valid_lens, dtype):
    X = np.random.default_rng(3).standard_normal(shape).astype(dtype)
    expected = reference.masked_softmax(X, valid_lens)
    tf_valid_lens = None if valid_lens is None else TF.from_numpy(valid_lens)
    assert_close(TF.to_numpy(TF.masked_softmax(TF.from_numpy(X), tf_valid_lens)), expected, dtype)


def test_masked_softmax_large_logits_and_gradients(TF, tf):
    X = tf.constant([[[1e4, -1e4, 0.0, 5e3]]] * 2, dtype=tf.float32)
    valid_lens = tf.constant([3, 0])
    with tf.GradientTape() as tape:
        tape.watch(X)
        Y = TF.masked_softmax(X, valid_lens)
        loss = tf.reduce_sum(Y * tf.constant([1.0, 2.0, 3.0, 4.0]))
    gradient = TF.to_numpy(tape.gradient(loss, X))
    np.testing.assert_array_equal(TF.to_numpy(Y), [[[1, 0, 0, 0]], [[0, 0, 0, 0]]])
    assert np.isfinite(gradient).all()
    assert (gradient[1] == 0).all()


# ---------------------------------------------------------------------------------------------
# PositionalEncoding and AddNorm


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("num_hiddens", [6, 7])
def test_positional_encoding_matches_reference(TF, tf, dtype, num_hiddens):
    numpy_layer = reference.PositionalEncoding(num_hiddens, max_len=50, dtype=dtype)
    tf_layer = TF.PositionalEncoding(num_hiddens, max_len=50, dtype=dtype)
    X = np.random.default_rng(4).standard_normal((2, 9, num_hiddens)).astype(dtype)
    assert_close(TF.to_numpy(tf_layer(TF.from_numpy(X))), numpy_layer(X), dtype)
    # P is a constant, not a weight, and holds the formula of docs/design.md
    assert tf_layer.weights == [] and isinstance(tf_layer.P, tf.Tensor)
    i, j = 7, 2
    P = TF.to_numpy(tf_layer.P)
    np.testing.assert_allclose(
        P[0, i, 2 * j], np.sin(i / 10000 ** (2 * j / num_hiddens)), atol=1e-6
    )
    np.testing.assert_allclose(
        P[0, i, 2 * j + 1], np.cos(i / 10000 ** (2 * j / num_hiddens)), atol=1e-6
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 6), (2, 2, 3, 6)])
def test_add_norm_matches_reference(TF, dtype, shape):
    numpy_layer, tf_layer = make_pair(TF, "AddNorm", dtype, num_hiddens=6, eps=1e-3)
    rng = np.random.default_rng(5)
    X, Y = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    assert_close(
        TF.to_numpy(tf_layer(TF.from_numpy(X), TF.from_numpy(Y))), numpy_layer(X, Y), dtype
    )
    assert tf_layer.ln.epsilon == 1e-3


def test_dropout_follows_training_argument(TF, tf):
    X = np.ones((2, 50, 8), np.float32)
    encoding = TF.PositionalEncoding(8, dropout=0.5)
    expected = X + TF.to_numpy(encoding.P)[:, :50]
    np.testing.assert_allclose(TF.to_numpy(encoding(X)), expected, rtol=1e-6)
    np.testing.assert_allclose(TF.to_numpy(encoding(X, training=False)), expected, rtol=1e-6)
    dropped = TF.to_numpy(encoding(X, training=True))
    kept = dropped != 0
    assert 0.2 < kept.mean() < 0.8
    np.testing.assert_allclose(dropped[kept], (expected / 0.5)[kept], rtol=1e-6)

    numpy_layer, layer = make_pair(TF, "MultiHeadAttention", "float32", dropout=0.5)
    queries, keys, values = inputs("float32")
    evaluation = TF.to_numpy(layer(queries, keys, values))
    assert_close(evaluation, numpy_layer(queries, keys, values), "float32")
    weights_before = TF.to_numpy(layer.attention_weights)
    training = TF.to_numpy(layer(queries, keys, values, training=True))
    assert not np.allclose(training, evaluation)
    # attention_weights are taken before dropout
    np.testing.assert_array_equal(TF.to_numpy(layer.attention_weights), weights_before)

    add_norm = TF.AddNorm(8, dropout=0.5)
    Y = np.random.default_rng(0).standard_normal((2, 50, 8)).astype(np.float32)
    assert not np.allclose(TF.to_numpy(add_norm(X, Y, training=True)), TF.to_numpy(add_norm(X, Y)))


# ---------------------------------------------------------------------------------------------
# Gradients: tf.GradientTape against central finite differences of the reference (float64)


def _finite_differences(function, arrays, step=1e-6):
    """d function() / d each array, by central differences (arrays are perturbed in place)."""
    gradients = []
    for array in arrays:
        gradient = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            original = array[index]
            array[index] = original + step
            plus = function()
            array[index] = original - step
            minus = function()
            array[index] = original
            gradient[index] = (plus - minus) / (2 * step)
        gradients.append(gradient)
    return gradients


GRADIENT_CASES = [
    ("MultiHeadAttention", {"bias": True}, np.array([0, 2, 9, 1]), {"causal": True}),
    (
        "MultiHeadAttention",
        {},
        None,
        {
            "mask": np.array([[True, False, True, True, False]] * Q),
            "head_mask": np.array([0.5, 2.0]),
        },
    ),
    ("AdditiveAttention", {}, np.array([[0, 1, 2], [5, 0, 3], [1, 1, 1], [9, 9, 0]]), {}),
    ("DotProductAttention", {}, np.array([0, 3, 0, 2]), {"causal": True}),
]


@pytest.mark.parametrize(
    "class_name,config,valid_lens,kwargs",
    GRADIENT_CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(GRADIENT_CASES)],
)
def test_gradients_match_finite_differences(TF, tf, class_name, config, valid_lens, kwargs):
    dtype = "float64"
    numpy_layer, tf_layer = make_pair(TF, class_name, dtype, **config)
    queries, keys, values = inputs(dtype)
    rng = np.random.default_rng(6)
    probe_shape = numpy_layer(queries, keys, values, valid_lens, **kwargs).shape
    probe = rng.standard_normal(probe_shape)
    weights = mha.get_weights(numpy_layer)

    def loss():
        mha.set_weights(numpy_layer, weights)
        return float((numpy_layer(queries, keys, values, valid_lens, **kwargs) * probe).sum())

    names = sorted(weights)
    expected = _finite_differences(loss, [queries, keys, values] + [weights[n] for n in names])

    variables = {name: _variable(tf_layer, name) for name in names}
    tensors = [tf.constant(x) for x in (queries, keys, values)]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        output = tf_layer(*tensors, valid_lens, **kwargs)
        tf_loss = tf.reduce_sum(output * probe)
    gradients = tape.gradient(tf_loss, tensors + [variables[n] for n in names])
    for name, gradient, finite in zip(
        ["queries", "keys", "values", *names], gradients, expected, strict=True
    ):
        gradient = TF.to_numpy(tf.convert_to_tensor(gradient))
        assert np.isfinite(gradient).all(), name
        np.testing.assert_allclose(gradient, finite, atol=1e-7, err_msg=name)
    if valid_lens is not None and valid_lens.ndim == 1:
        # Examples with valid_len 0 attend nothing: zero gradients, finite and exact
        empty = valid_lens == 0
        for gradient in gradients[:3]:
            assert (TF.to_numpy(gradient)[empty] == 0).all()


def _variable(layer, name):
    """The Keras variable that holds canonical weight `name`."""
    if name in ("gamma", "beta"):
        return getattr(layer.ln, name)
    dense = getattr(layer, name if name in ("W_q", "W_k", "W_v", "W_o", "w_v") else "W_" + name[-1])
    return dense.kernel if name[0] in "Ww" else dense.bias


def test_add_norm_gradients_match_finite_differences(TF, tf):
    numpy_layer, tf_layer = make_pair(TF, "AddNorm", "float64", num_hiddens=5)
    rng = np.random.default_rng(7)
    X, Y, probe = (rng.standard_normal((2, 3, 5)) for _ in range(3))
    weights = mha.get_weights(numpy_layer)

    def loss():
        mha.set_weights(numpy_layer, weights)
        return float((numpy_layer(X, Y) * probe).sum())

    expected = _finite_differences(loss, [X, Y, weights["gamma"], weights["beta"]])
    tensors = [tf.constant(X), tf.constant(Y)]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        tf_loss = tf.reduce_sum(tf_layer(*tensors) * probe)
    gradients = tape.gradient(tf_loss, [*tensors, tf_layer.ln.gamma, tf_layer.ln.beta])
    for gradient, finite in zip(gradients, expected, strict=True):
        np.testing.assert_allclose(TF.to_numpy(tf.convert_to_tensor(gradient)), finite, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Lazy sizes and canonical weights


def test_lazy_layer_weights_and_config(TF):
    layer = TF.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, bias=True)
    assert TF.layer_config(layer)["query_size"] is None
    numpy_layer = reference.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, bias=True)
    with pytest.raises(ValueError) as tf_error:
        mha.get_weights(layer)
    with pytest.raises(ValueError) as numpy_error:
        mha.get_weights(numpy_layer)
    assert str(tf_error.value) == str(numpy_error.value)
    # set_weights on a layer never called creates its weights from the shapes
    weights = mha.random_weights(
        "MultiHeadAttention",
        num_hiddens=8,
        num_heads=2,
        bias=True,
        query_size=D,
        key_size=4,
        value_size=V,
        seed=3,
    )
    mha.set_weights(layer, weights)
    mha.set_weights(numpy_layer, weights)
    config = TF.layer_config(layer)
    assert (config["query_size"], config["key_size"], config["value_size"]) == (D, 4, V)
    assert config == reference.layer_config(numpy_layer)
    for name, value in mha.get_weights(layer).items():
        np.testing.assert_array_equal(value, weights[name])
    rng = np.random.default_rng(0)
    queries, keys, values = (rng.standard_normal((2, 3, n)).astype(np.float32) for n in (D, 4, V))
    assert_close(
        TF.to_numpy(layer(queries, keys, values)), numpy_layer(queries, keys, values), "float32"
    )


def test_lazy_layer_infers_sizes_at_first_call(TF):
    layer = TF.AdditiveAttention(5)
    queries, keys, values = inputs("float32")
    layer(queries, keys[:, :, :4], values)
    assert TF.layer_config(layer)["query_size"] == D
    assert TF.layer_config(layer)["key_size"] == 4
    assert set(mha.get_weights(layer)) == {"W_q", "W_k", "w_v"}
    with pytest.raises(ValueError, match="key_size=4"):
        layer(queries, keys, values)


def test_backend_selection_gives_keras_layers(TF):
    import keras

    with mha.use_backend("tf"):
        layer = mha.MultiHeadAttention(8, 2)
    assert isinstance(layer, keras.layers.Layer)
    assert type(layer) is TF.MultiHeadAttention


def test_weights_are_trainable_variables(TF):
    layer = TF.MultiHeadAttention(8, 2, bias=True, query_size=3, key_size=3, value_size=3)
    assert len(layer.trainable_weights) == 8
    assert TF.PositionalEncoding(4).trainable_weights == []
    assert len(TF.AddNorm(4).trainable_weights) == 2


# ---------------------------------------------------------------------------------------------
# Keras conventions


def _all_layers(TF, dtype="float32"):
    return {
        "DotProductAttention": TF.DotProductAttention(0.1, dtype=dtype),
        "AdditiveAttention": TF.AdditiveAttention(5, 0.1, query_size=D, key_size=D, dtype=dtype),
        "MultiHeadAttention": TF.MultiHeadAttention(8, 2, 0.1, True, query_size=D, dtype=dtype),
        "PositionalEncoding": TF.PositionalEncoding(7, 0.1, 30, dtype=dtype),
        "AddNorm": TF.AddNorm(7, 0.1, eps=1e-3, dtype=dtype),
    }


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_get_config_round_trip(TF, dtype):
    for class_name, layer in _all_layers(TF, dtype).items():
        config = layer.get_config()
        assert config["dtype"] == dtype
        clone = type(layer).from_config(config)
        assert TF.layer_config(clone) == TF.layer_config(layer), class_name
        assert clone.name == layer.name


def _functional_model(TF, tf):
    import keras

    queries = keras.Input((Q, D), name="queries")
    keys = keras.Input((K, D), name="keys")
    values = keras.Input((K, V), name="values")
    valid_lens = keras.Input((), dtype="int32", name="valid_lens")
    attention = TF.MultiHeadAttention(8, 2, bias=True, name="attention")
    hidden = attention(queries, keys, values, valid_lens, causal=True)
    hidden = TF.PositionalEncoding(8, max_len=20)(hidden)
    additive = TF.AdditiveAttention(4)(hidden, keys, values, valid_lens)
    dot = TF.DotProductAttention()(queries, keys, values, valid_lens)
    output = TF.AddNorm(V)(additive, dot)
    return keras.Model([queries, keys, values, valid_lens], output)


def test_functional_model_saves_and_loads(TF, tf, tmp_path):
    import keras

    model = _functional_model(TF, tf)
    queries, keys, values = inputs("float32")
    valid_lens = np.array([0, 2, 5, 3], np.int32)
    expected = TF.to_numpy(model([queries, keys, values, valid_lens]))
    assert np.isfinite(expected).all()
    # The layers of the model compute what a standalone reference computes
    attention = model.get_layer("attention")
    numpy_attention = reference.MultiHeadAttention(8, 2, bias=True)
    mha.set_weights(numpy_attention, mha.get_weights(attention))
    assert_close(
        TF.to_numpy(attention(queries, keys, values, valid_lens, causal=True)),
        numpy_attention(queries, keys, values, valid_lens, causal=True),
        "float32",
    )

    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(
        TF.to_numpy(loaded([queries, keys, values, valid_lens])), expected
    )
    for name, value in mha.get_weights(loaded.get_layer("attention")).items():
        np.testing.assert_array_equal(value, mha.get_weights(attention)[name])


def test_sequential_model_saves_and_loads(TF, tmp_path):
    import keras

    model = keras.Sequential(
        [
            keras.Input((9, 6)),
            keras.layers.Dense(7),
            TF.PositionalEncoding(7, max_len=12),
        ]
    )
    X = np.random.default_rng(8).standard_normal((2, 9, 6)).astype(np.float32)
    expected = TF.to_numpy(model(X))
    dense = model.layers[0]
    reference_output = reference.PositionalEncoding(7, max_len=12)(
        X @ TF.to_numpy(dense.kernel) + TF.to_numpy(dense.bias)
    )
    assert_close(expected, reference_output, "float32")
    path = tmp_path / "sequential.keras"
    model.save(path)
    np.testing.assert_array_equal(TF.to_numpy(keras.models.load_model(path)(X)), expected)


def test_subclassed_model_trains(TF, tf):
    import keras

    class Block(keras.Model):
        def __init__(self):
            super().__init__()
            self.attention = TF.MultiHeadAttention(
                8, 2, 0.1, query_size=D, key_size=D, value_size=D
            )
            self.add_norm = TF.AddNorm(8)
            self.project = keras.layers.Dense(8)

        def call(self, X, training=None):
            return self.add_norm(
                self.project(X), self.attention(X, X, X, causal=True), training=training
            )

    model = Block()
    X = np.random.default_rng(9).standard_normal((8, 4, D)).astype(np.float32)
    model.compile(optimizer="sgd", loss="mse")
    before = mha.get_weights(model.attention)
    history = model.fit(X, np.zeros((8, 4, 8), np.float32), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert not np.array_equal(mha.get_weights(model.attention)["W_q"], before["W_q"])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_tf_function(TF, tf, jit_compile):
    numpy_layer, layer = make_pair(TF, "MultiHeadAttention", "float32", bias=True)
    queries, keys, values = inputs("float32", K, K)
    window_mask = np.where(np.random.default_rng(1).random((2, K, K)) < 0.3, -np.inf, 0.5)
    window_mask = window_mask.astype(np.float32)
    mask = np.random.default_rng(2).random((B, 2, 1, K)) < 0.7
    valid_lens = np.array([0, 2, 9, 4], np.int32)
    head_mask = np.array([1.0, 0.5], np.float32)

    @tf.function(jit_compile=jit_compile)
    def attend(queries, keys, values, valid_lens):
        output = layer(
            queries,
            keys,
            values,
            valid_lens,
            mask=mask,
            causal=True,
            window_mask=window_mask,
            head_mask=head_mask,
        )
        return output, layer.attention_weights

    output, weights = attend(queries, keys, values, valid_lens)
    kwargs = {"mask": mask, "causal": True, "window_mask": window_mask, "head_mask": head_mask}
    assert_close(
        TF.to_numpy(output), numpy_layer(queries, keys, values, valid_lens, **kwargs), "float32"
    )
    assert_close(TF.to_numpy(weights), numpy_layer.attention_weights, "float32")

    # Unknown batch and sequence sizes: shapes are checked on what is known
    spec = [
        tf.TensorSpec((None, None, D)),
        tf.TensorSpec((None, None, D)),
        tf.TensorSpec((None, None, V)),
        tf.TensorSpec((None,), tf.int32),
    ]
    dynamic = tf.function(
        lambda q, k, v, n: layer(q, k, v, n, causal=True),
        input_signature=spec,
        jit_compile=jit_compile,
    )
    queries, keys, values = inputs("float32")
    assert_close(
        TF.to_numpy(dynamic(queries, keys, values, valid_lens)),
        numpy_layer(queries, keys, values, valid_lens, causal=True),
        "float32",
    )


# ---------------------------------------------------------------------------------------------
# Errors: the same type and message as the reference


def _error_cases():
    f32 = np.zeros((B, Q, D), np.float32)
    keys = np.zeros((B, K, D), np.float32)
    values = np.zeros((B, K, V), np.float32)
    constructors = [
        ("MultiHeadAttention", (100, 3), {}),
        ("MultiHeadAttention", (8, 0), {}),
        ("MultiHeadAttention", (8, 2), {"bias": 1}),
        ("MultiHeadAttention", (8, 2), {"dtype": "int32"}),
        ("DotProductAttention", (1.5,), {}),
        ("AdditiveAttention", (4,), {"query_size": -1}),
        ("PositionalEncoding", (4,), {"max_len": 0}),
        ("AddNorm", (4,), {"eps": 0.0}),
    ]
    cases = [(f"new-{n}-{i}", n, a, k, None) for i, (n, a, k) in enumerate(constructors)]
    mh = ("MultiHeadAttention", (8, 2), {})
    calls = [
        (mh, (f32[0], keys, values), {}),
        (mh, (f32.astype(np.float64), keys, values), {}),
        (mh, (f32, keys[:2], values), {}),
        (mh, (f32, keys, values[:, :2]), {}),
        (mh, (f32, keys, values, np.array([1, -2, 0, 1])), {}),
        (mh, (f32, keys, values, np.array([1.0, 2.5, 0.0, 1.0])), {}),
        (mh, (f32, keys, values, np.array([1, 2])), {}),
        (mh, (f32, keys, values, np.zeros((B, Q), np.complex64)), {}),
        (mh, (f32, keys, values), {"mask": np.ones((Q, K), np.int32)}),
        (mh, (f32, keys, values), {"mask": np.ones((3, 2, Q, K), bool)}),
        (mh, (f32, keys, values), {"mask": np.ones((1, 1, 1, Q, K), bool)}),
        (mh, (f32, keys, values), {"causal": 1}),
        (mh, (f32, keys, values), {"need_weights": None}),
        (mh, (f32, keys, values), {"window_mask": np.ones((3, Q, K), bool)}),
        (mh, (f32, keys, values), {"window_mask": np.ones((2, K, Q), bool)}),
        (mh, (f32, keys, values), {"window_mask": np.ones((2, Q, K), np.float64)}),
        (mh, (f32, keys, values), {"head_mask": np.ones(3, np.float32)}),
        (mh, (f32, keys, values), {"head_mask": np.ones((2, 2), np.int64)}),
        (mh, ([[1.0]], keys, values), {}),
        (("MultiHeadAttention", (8, 2), {"query_size": 5}), (f32, keys, values), {}),
        (("DotProductAttention", (), {}), (f32, keys[:, :, :2], values), {}),
        (
            ("DotProductAttention", (), {}),
            (f32, keys, values),
            {"mask": np.ones((B, 2, Q, K), bool)},
        ),
        (("AdditiveAttention", (4,), {"key_size": 5}), (f32, keys, values), {}),
        (("PositionalEncoding", (D,), {"max_len": 2}), (f32,), {}),
        (("PositionalEncoding", (5,), {}), (f32,), {}),
        (("AddNorm", (D,), {}), (f32, f32[:, :2]), {}),
        (("AddNorm", (D,), {}), (f32, f32.astype(np.float64)), {}),
        (("AddNorm", (D,), {}), (f32[0, 0], f32[0, 0]), {}),
    ]
    for i, ((name, args, config), call_args, call_kwargs) in enumerate(calls):
        cases.append((f"call-{name}-{i}", name, args, config, (call_args, call_kwargs)))
    return cases


@pytest.mark.parametrize(
    "case,class_name,args,config,call", _error_cases(), ids=[c[0] for c in _error_cases()]
)
def test_errors_match_reference(TF, case, class_name, args, config, call):
    errors = []
    for backend in (reference, TF):
        with pytest.raises((ValueError, TypeError)) as error:
            layer = getattr(backend, class_name)(*args, **config)
            call_args, call_kwargs = call
            layer(*call_args, **call_kwargs)
        errors.append(error.value)
    assert type(errors[1]) is type(errors[0])
    assert str(errors[1]) == str(errors[0])


@pytest.mark.parametrize(
    "X,valid_lens",
    [
        (np.zeros((2, 3), np.int32), None),
        (np.zeros(3, np.float32), None),
        (np.zeros((2, 3), np.float32), np.zeros((2, 2), np.int32)),
        (np.zeros((2, 3, 4), np.float32), np.array([1, 2, 3])),
        (np.zeros((2, 3, 4), np.float32), np.array([1, -1])),
        (np.zeros((2, 3, 4), np.float32), np.array([1.5, 1.0])),
        ("scores", None),
    ],
)
def test_masked_softmax_errors_match_reference(TF, X, valid_lens):
    errors = []
    for backend in (reference, TF):
        with pytest.raises((ValueError, TypeError)) as error:
            backend.masked_softmax(X, valid_lens)
        errors.append(error.value)
    assert type(errors[1]) is type(errors[0]) and str(errors[1]) == str(errors[0])


def test_set_weights_errors_match_reference(TF):
    weights = mha.random_weights(
        "MultiHeadAttention", num_hiddens=8, num_heads=2, query_size=D, key_size=D, value_size=V
    )
    weights["W_o"] = weights["W_o"][:, :3]
    weights["W_x"] = weights.pop("W_v")
    errors = []
    for backend in (reference, TF):
        layer = backend.MultiHeadAttention(8, 2, query_size=D)
        with pytest.raises(ValueError) as error:
            mha.set_weights(layer, weights)
        errors.append(str(error.value))
    assert errors[0] == errors[1]
    assert "3 problems" in errors[1]


def test_keras_configured_for_another_backend(TF):
    # A fresh interpreter: Keras reads KERAS_BACKEND once, at its first import
    code = (
        "import mha\n"
        "try:\n"
        "    mha.set_backend('tensorflow'); mha.MultiHeadAttention\n"
        "except mha.BackendUnavailableError as error:\n"
        "    print(error)\n"
    )
    environment = {**os.environ, "KERAS_BACKEND": "jax"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "The mha backend 'tensorflow' is not available" in result.stdout
    assert "KERAS_BACKEND='jax'" in result.stdout
    assert "Traceback" not in result.stderr
