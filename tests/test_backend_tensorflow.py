"""What only the TensorFlow / Keras backend promises; the agreement with the NumPy reference
(every layer, mask combination and dtype, gradients from tf.GradientTape against the
reference's finite differences) is tests/test_agreement.py's, through mha.harness, and the
error table tests/test_errors.py's.

Here: half precision and float lengths, the `training` argument, lazy Dense layers and Keras
variables, Keras conventions (get_config, functional, Sequential and subclassed models, .keras
files, fit), tf.function and jit_compile, cached decoding under XLA, LearnedPositionalEncoding's
trainable table, and Keras configured for another backend.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mha
from conftest import assert_agrees, backend_module
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


def test_no_value_is_read_from_a_tensor_on_a_gpu(TF, tf):
    # A read of a GPU tensor's values waits for the device: the lengths' value check and the
    # search for rows with no key skip it there, as in graphs. A stand-in for a GPU tensor
    # (there is none on the CPU) fails the test if anything reads it
    from tensorflow.python.types import core

    class OnAGpu(core.Tensor):
        device = "/job:localhost/replica:0/task:0/device:GPU:0"

        def __array__(self, *args, **kwargs):
            raise AssertionError("a value of a GPU tensor was read")

        numpy = __array__

    assert TF._check_valid_lens_values(OnAGpu()) is None
    assert TF._may_have_empty_rows(OnAGpu())
    # On the CPU both read: a negative length is refused, and a mask keeping a key in every
    # row has no empty row
    with pytest.raises(ValueError, match="non-negative"):
        TF._check_valid_lens_values(tf.constant([2, -1]))
    assert not TF._may_have_empty_rows(tf.constant([[True], [True]]))


def test_float16_matches_reference(TF):
    numpy_layer, tf_layer = make_pair(TF, "MultiHeadAttention", "float16")
    queries, keys, values = inputs("float16")
    valid_lens = np.array([0, 2, 9, 3])
    expected = numpy_layer(queries, keys, values, valid_lens, causal=True).astype(np.float64)
    output = TF.to_numpy(tf_layer(queries, keys, values, valid_lens, causal=True))
    np.testing.assert_allclose(output.astype(np.float64), expected, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# PositionalEncoding and the training argument


def test_positional_table_is_a_constant_not_a_weight(TF, tf):
    layer = TF.PositionalEncoding(7, max_len=50, dtype="float64")
    assert layer.weights == [] and isinstance(layer.P, tf.Tensor)
    assert TF.to_numpy(layer.P).shape == (1, 50, 7)


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
    assert_agrees(evaluation, numpy_layer(queries, keys, values), "float32")
    weights_before = TF.to_numpy(layer.attention_weights)
    training = TF.to_numpy(layer(queries, keys, values, training=True))
    assert not np.allclose(training, evaluation)
    # attention_weights are taken before dropout
    np.testing.assert_array_equal(TF.to_numpy(layer.attention_weights), weights_before)

    add_norm = TF.AddNorm(8, dropout=0.5)
    Y = np.random.default_rng(0).standard_normal((2, 50, 8)).astype(np.float32)
    assert not np.allclose(TF.to_numpy(add_norm(X, Y, training=True)), TF.to_numpy(add_norm(X, Y)))


def test_dropout_layers_outside_training_give_the_references_numbers(TF):
    X = np.random.default_rng(2).standard_normal((2, 9, 8))
    Y = np.random.default_rng(3).standard_normal((2, 9, 8))
    numpy_norm = reference.AddNorm(8, dtype="float64")
    add_norm = TF.AddNorm(8, dropout=0.5, dtype="float64")
    weights = mha.random_weights(numpy_norm, seed=4)
    mha.set_weights(numpy_norm, weights)
    mha.set_weights(add_norm, weights)
    numpy_encoding = reference.PositionalEncoding(8, max_len=20, dtype="float64")
    encoding = TF.PositionalEncoding(8, dropout=0.5, max_len=20, dtype="float64")
    for training in ({}, {"training": False}):
        output = TF.to_numpy(add_norm(X, Y, **training))
        assert_agrees(output, numpy_norm(X, Y), "float64")
        assert_agrees(TF.to_numpy(encoding(X, **training)), numpy_encoding(X), "float64")


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
    assert_agrees(
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
        "LearnedPositionalEncoding": TF.LearnedPositionalEncoding(7, 0.1, 30, dtype=dtype),
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
    assert_agrees(
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
    assert_agrees(expected, reference_output, "float32")
    path = tmp_path / "sequential.keras"
    model.save(path)
    np.testing.assert_array_equal(TF.to_numpy(keras.models.load_model(path)(X)), expected)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_keras_padding_mask_is_not_read_as_the_latent_layers_mask(TF, batch_size):
    # Keras passes the padding mask of a call's only tensor as its `mask` argument; the
    # latent layer takes X alone, and its mask is an attention mask, never read off X
    # (batch_size 4 = the number of positions: such a padding mask has a mask's shape)
    import keras

    config = dict(
        num_hiddens=8,
        num_heads=2,
        kv_lora_rank=4,
        qk_nope_head_dim=2,
        qk_rope_head_dim=2,
        v_head_dim=3,
    )
    numpy_attention = reference.MultiHeadLatentAttention(**config)
    attention = TF.MultiHeadLatentAttention(**config)
    weights = mha.random_weights(numpy_attention, seed=3)
    mha.set_weights(numpy_attention, weights)
    mha.set_weights(attention, weights)
    embedding = keras.layers.Embedding(10, 8, mask_zero=True)
    ids = np.array([[3, 4, 0, 0], [5, 6, 7, 0], [1, 2, 3, 4], [8, 0, 0, 0]])[:batch_size]
    X = embedding(ids)
    expected = numpy_attention(TF.to_numpy(X))
    assert_agrees(TF.to_numpy(attention(X)), expected, "float32")
    inputs = keras.Input((4,), dtype="int32")
    model = keras.Model(inputs, attention(embedding(inputs)))
    assert_agrees(TF.to_numpy(model(ids)), expected, "float32")


@pytest.mark.parametrize("policy", ["float64", "bfloat16", "mixed_bfloat16", "mixed_float16"])
def test_a_policy_of_another_dtype_is_refused_after_construction(TF, policy):
    # The layer's weights, sublayers and checks hold its dtype: a policy set afterwards would
    # change only the checks (a bfloat16 layer computing in float32, or raw MatMul errors)
    numpy_layer, layer = make_pair(TF, "MultiHeadAttention", "float32")
    queries, keys, values = inputs("float32")
    # The advice names the dtype the policy computes in: a mixed policy's, not float32
    advice = f"build a layer with dtype='{policy.removeprefix('mixed_')}'"
    for target in (layer, TF.PositionalEncoding(8), TF.AddNorm(8)):
        with pytest.raises(ValueError, match="dtype it was built with, float32") as raised:
            target.dtype_policy = policy
        assert advice in str(raised.value)
        assert target.dtype_policy.name == "float32"
        target.dtype_policy = "float32"
    expected = numpy_layer(queries, keys, values, causal=True)
    assert_agrees(TF.to_numpy(layer(queries, keys, values, causal=True)), expected, "float32")


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


def test_a_subclassed_models_training_flag_reaches_the_layers_after_mhas(TF, tf):
    # Keras takes an explicit training=None as the caller's and hands it on: the mha layer's
    # own None turned its dropout, and the Dropout after it in the same call, to inference
    import keras

    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.attention = TF.DotProductAttention(0.5)
            self.after = keras.layers.Dropout(0.5)

        def call(self, X):  # training not passed on, as Keras 3 lets a call do
            return self.after(self.attention(X, X, X))

    block = Block()
    X = np.ones((2, 6, D), np.float32)
    inference = block(X, training=False).numpy()
    trained = block(X, training=True).numpy()
    np.testing.assert_allclose(inference, 1.0, rtol=1e-6)  # uniform weights of equal values
    # Two dropouts of 0.5: each output is 0, or 1 scaled by 2 (after) times what survives
    assert (trained == 0).mean() > 0.3 and len(np.unique(trained.round(5))) > 2


def test_trainable_false_given_to_the_constructor_freezes_the_weights(TF, tf, tmp_path):
    # Keras's setter freezes the sublayers there are; the constructor's flag, and a .keras
    # file's, came before them: fit moved weights the layer said it did not train
    import keras

    X = np.random.default_rng(2).standard_normal((4, 3, D)).astype(np.float32)
    for made in ("constructor", "file"):
        layer = TF.MultiHeadAttention(
            8, 2, query_size=D, key_size=D, value_size=D, trainable=made != "constructor"
        )
        inputs = keras.Input((3, D))
        model = keras.Model(inputs, layer(inputs, inputs, inputs))
        if made == "file":
            layer.trainable = False
            model.save(tmp_path / "frozen.keras")
            model = keras.models.load_model(tmp_path / "frozen.keras")
            layer = model.layers[-1]
        before = mha.get_weights(layer)
        assert model.trainable_weights == []
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        model.fit(X, np.ones((4, 3, 8), np.float32), epochs=2, verbose=0)
        after = mha.get_weights(layer)
        assert all(np.array_equal(after[k], before[k]) for k in before), made


def test_sequential_hands_the_latent_layer_no_padding_mask(TF, tf):
    # Where a Sequential cannot trace a layer it calls each layer with the padding mask as
    # `mask`: read as the attention's (queries, keys) mask, it gave other numbers
    import keras

    class Untraced(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.supports_masking = True

        def compute_output_spec(self, x):
            raise NotImplementedError

        def call(self, x):
            return x

    sizes = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4}
    tokens = np.array([[3, 5, 0, 0], [2, 0, 0, 0], [1, 2, 3, 4], [7, 7, 7, 0]], "int32")
    embedding = keras.layers.Embedding(10, 16, mask_zero=True)
    layer = TF.MultiHeadLatentAttention(16, 2, **sizes)
    model = keras.Sequential([keras.Input((None,), dtype="int32"), embedding, Untraced(), layer])
    output = model(tokens).numpy()
    X = embedding(tokens).numpy()
    np.testing.assert_allclose(output, layer(X).numpy(), rtol=0, atol=1e-6)


def test_a_mixed_policy_as_dtype_is_refused_with_the_advice(TF, tf):
    import keras

    for policy in ("mixed_float16", keras.DTypePolicy("mixed_bfloat16")):
        with pytest.raises(ValueError, match="give the compute dtype"):
            TF.MultiHeadAttention(8, 2, dtype=policy)


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
    assert_agrees(
        TF.to_numpy(output), numpy_layer(queries, keys, values, valid_lens, **kwargs), "float32"
    )
    assert_agrees(TF.to_numpy(weights), numpy_layer.attention_weights, "float32")

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
    assert_agrees(
        TF.to_numpy(dynamic(queries, keys, values, valid_lens)),
        numpy_layer(queries, keys, values, valid_lens, causal=True),
        "float32",
    )


def test_the_function_traces_with_some_sizes_known_and_names_a_mismatch_of_the_others(TF, tf):
    # A signature that knows the queries' batch and head size and leaves the keys' free was
    # refused while tracing (None is not 2); sizes known only at run time that do not fit
    # (heads that do not divide, two head sizes) fail on mha's assertion, not in a product
    rng = np.random.default_rng(6)
    query, key, value = (
        rng.standard_normal(shape).astype(np.float32)
        for shape in ((2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 6))
    )
    spec = [tf.TensorSpec((2, 4, None, 8)), tf.TensorSpec((None, 2, None, 8)),
            tf.TensorSpec((None, 2, None, None))]  # fmt: skip
    traced = tf.function(TF.dot_product_attention, input_signature=spec)
    expected = reference.dot_product_attention(query, key, value)
    np.testing.assert_allclose(TF.to_numpy(traced(query, key, value)), expected, 1e-5, 1e-5)
    free = tf.function(TF.dot_product_attention, input_signature=[tf.TensorSpec([None] * 4)] * 3)
    for shapes in (((1, 3, 2, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
                   ((1, 2, 2, 4), (1, 2, 5, 3), (1, 2, 5, 4))):  # fmt: skip
        with pytest.raises(tf.errors.InvalidArgumentError, match="mha: the tensors of the call"):
            free(*(np.zeros(shape, np.float32) for shape in shapes))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_the_function_traces_with_every_size_unknown(TF, tf, jit_compile):
    # Batch, heads and positions all None in the signature, grouped heads at run time
    rng = np.random.default_rng(5)
    query = rng.standard_normal((2, 4, 3, 6)).astype(np.float32)
    key, value = rng.standard_normal((2, 2, 2, 5, 6)).astype(np.float32)
    valid_lens = np.array([[1, 5, 2], [0, 4, 3]], np.int32)
    spec = [tf.TensorSpec((None, None, None, 6))] * 3 + [tf.TensorSpec((None, None), tf.int32)]
    options = [
        {"causal": True, "alignment": "bottom_right"},
        {"window": (1, 0), "return_weights": True, "return_lse": True},
        {"causal": True, "empty_rows": "uniform", "return_weights": True},
    ]
    for kwargs in options:
        traced = tf.function(
            lambda q, k, v, n, kwargs=kwargs: TF.dot_product_attention(
                q, k, v, valid_lens=n, **kwargs
            ),
            input_signature=spec,
            jit_compile=jit_compile,
        )
        results = traced(query, key, value, valid_lens)
        expected = reference.dot_product_attention(
            query, key, value, valid_lens=valid_lens, **kwargs
        )
        for result, reference_result in zip(
            tf.nest.flatten(results), tf.nest.flatten(expected), strict=True
        ):
            # The log-sum-exp of a row with no key is -inf in both
            np.testing.assert_allclose(TF.to_numpy(result), reference_result, 1e-5, 1e-5)


def test_lengths_of_unknown_rank_are_refused_as_such(TF, tf):
    layer = TF.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS)
    spec = [tf.TensorSpec((None, None, NUM_HIDDENS)), tf.TensorSpec(None, tf.int32)]
    traced = tf.function(lambda X, n: layer(X, X, X, n), input_signature=spec)
    X = np.ones((2, 3, NUM_HIDDENS), np.float32)
    with pytest.raises(ValueError, match="valid_lens of unknown rank"):
        traced(X, np.array([1, 2], np.int32))


def test_grouped_rotary_sliding_attention_compiles_and_saves(TF, tf, tmp_path):
    import keras

    # Two key-value heads for four query heads, rotary embeddings and a sliding window
    options = {"num_heads": 4, "num_kv_heads": 2, "rope_theta": 10000.0, "sliding_window": 2}
    numpy_layer, layer = make_pair(TF, "MultiHeadAttention", "float32", **options)
    queries, keys, values = inputs("float32", K, K)
    valid_lens = np.array([0, 2, 5, 4], np.int32)
    expected = TF.to_numpy(layer(queries, keys, values, valid_lens, causal=True))
    assert_agrees(expected, numpy_layer(queries, keys, values, valid_lens, causal=True), "float32")

    # XLA compiles the rotation and the repeated heads to the eager numbers
    compiled = tf.function(lambda *args: layer(*args, causal=True), jit_compile=True)
    assert_agrees(TF.to_numpy(compiled(queries, keys, values, valid_lens)), expected, "float32")

    # A .keras file keeps the options and the weights
    symbols = [
        keras.Input((K, D)),
        keras.Input((K, D)),
        keras.Input((K, V)),
        keras.Input((), dtype="int32"),
    ]
    model = keras.Model(symbols, layer(*symbols, causal=True))
    path = tmp_path / "grouped.keras"
    model.save(path)
    loaded = keras.models.load_model(path).layers[-1]
    assert type(loaded) is TF.MultiHeadAttention
    assert loaded.get_config() == layer.get_config()
    assert TF.layer_config(loaded)["num_kv_heads"] == 2
    np.testing.assert_array_equal(
        TF.to_numpy(loaded(queries, keys, values, valid_lens, causal=True)), expected
    )

    # RotaryEmbedding alone: its config rebuilds the same layer
    rotary = TF.RotaryEmbedding(6, 500000.0, interleaved=True, dtype="float64", name="rope")
    clone = TF.RotaryEmbedding.from_config(rotary.get_config())
    assert TF.layer_config(clone) == TF.layer_config(rotary)
    assert clone.name == "rope"
    X = np.random.default_rng(3).standard_normal((B, 2, Q, 6))
    np.testing.assert_array_equal(TF.to_numpy(clone(X, offset=4)), TF.to_numpy(rotary(X, 4)))
    assert_agrees(
        TF.to_numpy(clone(X, offset=4)),
        reference.RotaryEmbedding(6, 500000.0, interleaved=True, dtype="float64")(X, 4),
        "float64",
    )


@pytest.mark.parametrize("reduce_retracing", [False, True], ids=["static", "dynamic"])
def test_cached_decoding_under_xla(TF, tf, reduce_retracing):
    # reduce_retracing traces the growing cache with an unknown number of positions, so the
    # offset of the masks and the rotation is a tensor; otherwise each length is a trace
    config = dict(
        num_hiddens=8,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        sliding_window=3,
        bias=True,
        query_size=D,
        key_size=D,
        value_size=D,
        dtype="float64",
    )
    weights = mha.random_weights("MultiHeadAttention", seed=5, **config)
    layer = TF.MultiHeadAttention(**config)
    mha.set_weights(layer, weights)
    full = reference.MultiHeadAttention(**config)
    mha.set_weights(full, weights)
    X = np.random.default_rng(4).standard_normal((2, 7, D))
    valid_lens = np.array([7, 6])
    expected = full(X, X, X, valid_lens, causal=True)

    @tf.function(jit_compile=True, reduce_retracing=reduce_retracing)
    def decode(x, lengths, cache):
        return layer(x, x, x, lengths, causal=True, cache=cache)

    # A prompt of 3 positions, then one position per call
    cache, outputs = mha.KVCache(), []
    for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):
        lengths = tf.constant(np.minimum(valid_lens, stop))
        output, cache = decode(tf.constant(X[:, start:stop]), lengths, cache)
        outputs.append(TF.to_numpy(output))
        # The cache is a KVCache of tensors holding the 2 key-value heads, not the 4 repeated
        assert type(cache) is mha.KVCache
        assert isinstance(cache.keys, tf.Tensor) and isinstance(cache.values, tf.Tensor)
        assert tuple(cache.keys.shape) == tuple(cache.values.shape) == (2, 2, stop, 2)
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, rtol=0, atol=1e-10)


def test_learned_positional_encoding_saves_and_trains(TF, tf, tmp_path):
    import keras

    # A functional model: Dense, then the learned table added; a .keras file keeps both
    inputs = keras.Input((5, 6))
    hidden = keras.layers.Dense(7)(inputs)
    encoding = TF.LearnedPositionalEncoding(7, 0.1, max_len=9, name="learned")
    model = keras.Model(inputs, encoding(hidden))
    assert [w.shape for w in encoding.trainable_weights] == [(9, 7)]
    X = np.random.default_rng(6).standard_normal((3, 5, 6)).astype(np.float32)
    expected = TF.to_numpy(model(X))
    P = mha.get_weights(encoding)["P"]
    dense = model.layers[1]
    assert_agrees(
        expected,
        X @ TF.to_numpy(dense.kernel) + TF.to_numpy(dense.bias) + P[None, :5],
        "float32",
    )
    path = tmp_path / "learned.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    again = loaded.get_layer("learned")
    assert type(again) is TF.LearnedPositionalEncoding
    assert again.get_config() == encoding.get_config()
    assert TF.layer_config(again) == TF.layer_config(encoding)
    np.testing.assert_array_equal(mha.get_weights(again)["P"], P)
    np.testing.assert_array_equal(TF.to_numpy(loaded(X)), expected)

    # P is trained: the rows of the positions seen get the gradient, the others none
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(encoding(tf.constant(np.ones((3, 5, 7), np.float32))))
    (gradient,) = tape.gradient(loss, encoding.trainable_weights)
    gradient = TF.to_numpy(tf.convert_to_tensor(gradient))
    np.testing.assert_array_equal(gradient[:5], np.full((5, 7), 3.0))
    np.testing.assert_array_equal(gradient[5:], 0.0)


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


# Sizes a tf.function's signature leaves unknown, as one that broadcasting would hide: each
# call's arguments beside queries and keys of shape (3, 7, 4), and the error's place
_BATCH, _LENGTH = (3, 7, 4), (3, 7)
UNKNOWN_SIZE_MISTAKES = {
    "one length for three examples": dict(valid_lens=np.array([2], np.int32)),
    "one length per example for seven queries": dict(valid_lens=np.full((3, 1), 2, np.int32)),
    "the lengths of one example for three": dict(valid_lens=np.full((1, 7), 2, np.int32)),
    "keys of one example for three": dict(keys=np.ones((1, 7, 4), np.float32)),
    "a head_mask of one example for three": dict(head_mask=np.ones((1, 2), np.float32)),
    "a head_mask of one head for two": dict(head_mask=np.ones((3, 1), np.float32)),
    "segment ids of one example for three": dict(segment_ids=np.zeros((1, 7), np.int32)),
    "a window of one query for seven": dict(window_mask=np.ones((1, 1, 7), bool)),
    "a window of one key for seven": dict(window_mask=np.ones((1, 7, 1), bool)),
    # As many elements as the right ones: a reshape alone would read them in another order
    "lengths of seven examples of three queries": dict(valid_lens=np.full((7, 3), 2, np.int32)),
    "segment ids of seven examples of three": dict(segment_ids=np.zeros((7, 3), np.int32)),
}


def _attend(layer, queries, arguments):
    """The layer's self-attention call over keys, with the other arguments by name."""
    keys = arguments["keys"]
    named = {key: arguments[key] for key in ("head_mask", "segment_ids", "window_mask")}
    return layer(queries, keys, keys, arguments["valid_lens"], **named)


# Where XLA drops the assertions, the reshapes that tie the sizes refuse a size that differs
XLA_REFUSAL = "must be non-negative, not -2|Input to reshape"


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("mistake", UNKNOWN_SIZE_MISTAKES)
def test_a_graph_of_unknown_sizes_checks_them_where_it_runs(TF, tf, mistake, jit_compile):
    # mha.validation cannot check a size the trace leaves unknown; eagerly each of these is
    # its ValueError, and in the graph an assertion of the shapes (backends.md), under XLA
    # the reshapes' refusal
    rng = np.random.default_rng(0)
    layer = TF.MultiHeadAttention(8, 2, query_size=4, key_size=4, value_size=4)
    expected_layer = reference.MultiHeadAttention(8, 2, query_size=4, key_size=4, value_size=4)
    mha.set_weights(expected_layer, mha.get_weights(layer))
    mistaken = UNKNOWN_SIZE_MISTAKES[mistake]
    per_query = mistaken.get("valid_lens", np.zeros(1)).ndim == 2  # the signature's rank
    good = {
        "keys": rng.standard_normal(_BATCH).astype(np.float32),
        "valid_lens": np.array([[2] * 7, [7] * 7, [4] * 7] if per_query else [2, 7, 4], np.int32),
        "head_mask": np.ones((3, 2), np.float32),
        "segment_ids": np.ones(_LENGTH, np.int32),
        "window_mask": np.tril(np.ones((1, 7, 7), bool)),
    }
    spec = {name: tf.TensorSpec([None] * value.ndim, value.dtype) for name, value in good.items()}
    attend = tf.function(
        lambda queries, arguments: _attend(layer, queries, arguments),
        input_signature=[tf.TensorSpec([None, None, 4], tf.float32), spec],
        jit_compile=jit_compile,
    )
    queries = rng.standard_normal(_BATCH).astype(np.float32)
    output = attend(tf.constant(queries), {k: tf.constant(v) for k, v in good.items()})
    expected = _attend(expected_layer, queries, good)
    np.testing.assert_allclose(output.numpy(), expected, rtol=1e-5, atol=1e-5)
    given = {k: tf.constant(v) for k, v in {**good, **mistaken}.items()}
    with pytest.raises(ValueError):
        _attend(layer, tf.constant(queries), given)
    message = XLA_REFUSAL if jit_compile else "mha: the tensors of the call disagree"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        attend(tf.constant(queries), given)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_masked_softmax_checks_the_sizes_a_graph_left_unknown(TF, tf, jit_compile):
    # As the layers: one length for three examples, or one per example for two queries, would
    # broadcast; in a graph they fail on the assertion, under XLA on the tie's reshape
    rng = np.random.default_rng(1)
    X = rng.standard_normal((3, 2, 4)).astype(np.float32)
    spec = [tf.TensorSpec((None, None, None)), tf.TensorSpec((None, None), tf.int32)]
    softmax = tf.function(TF.masked_softmax, input_signature=spec, jit_compile=jit_compile)
    valid_lens = np.array([[1, 4], [2, 3], [0, 4]], np.int32)
    expected = reference.masked_softmax(X.astype(np.float64), valid_lens)
    np.testing.assert_allclose(softmax(X, valid_lens).numpy(), expected, rtol=1e-6, atol=1e-6)
    message = XLA_REFUSAL if jit_compile else "mha: the tensors of the call disagree"
    for mistaken in (valid_lens[:1], valid_lens[:, :1], valid_lens.reshape(2, 3)):
        with pytest.raises(ValueError):
            TF.masked_softmax(X, mistaken)
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            softmax(X, mistaken)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("max_len", [1, 3])
@pytest.mark.parametrize("name", ["PositionalEncoding", "LearnedPositionalEncoding"])
def test_an_encoding_traced_for_any_length_refuses_one_past_max_len(
    TF, tf, name, max_len, jit_compile
):
    # Known only where the graph runs: a table of one row broadcast over every position, and
    # XLA's gather repeated the last row; the rows run short of the positions instead
    encoding = getattr(TF, name)(4, max_len=max_len)
    expected_encoding = getattr(reference, name)(4, max_len=max_len)
    mha.set_weights(expected_encoding, mha.get_weights(encoding))
    spec = [tf.TensorSpec((None, None, 4))]
    X = np.random.default_rng(2).standard_normal((2, max_len + 2, 4)).astype(np.float32)
    expected = expected_encoding(X[:, :max_len])
    message = "Input to reshape" if jit_compile else "X is longer than max_len"
    for _ in range(1 if jit_compile else 20):  # the graph's order may vary from trace to trace
        traced = tf.function(lambda X: encoding(X), input_signature=spec, jit_compile=jit_compile)
        np.testing.assert_allclose(traced(X[:, :max_len]).numpy(), expected, rtol=1e-6, atol=1e-6)
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            traced(X)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("name", ["PositionalEncoding", "LearnedPositionalEncoding"])
def test_an_encoding_traced_for_any_features_refuses_another_number(TF, tf, name, jit_compile):
    # With the features unknown, an X of one feature took every column of the table
    encoding = getattr(TF, name)(6)
    expected_encoding = getattr(reference, name)(6)
    mha.set_weights(expected_encoding, mha.get_weights(encoding))
    spec = [tf.TensorSpec((None, None, None))]
    traced = tf.function(lambda X: encoding(X), input_signature=spec, jit_compile=jit_compile)
    X = np.random.default_rng(6).standard_normal((2, 3, 6)).astype(np.float32)
    np.testing.assert_allclose(traced(X).numpy(), expected_encoding(X), rtol=1e-6, atol=1e-6)
    message = XLA_REFUSAL if jit_compile else "mha: the tensors of the call disagree"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        traced(X[..., :1])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_dot_product_attention_traced_for_any_features_ties_the_queries_to_the_keys(
    TF, tf, jit_compile
):
    # Under XLA queries of one feature were read against keys of five, a number each
    layer = TF.DotProductAttention()
    spec = [tf.TensorSpec((None, None, None))] * 3
    traced = tf.function(lambda q, k, v: layer(q, k, v), input_signature=spec,
                         jit_compile=jit_compile)  # fmt: skip
    rng = np.random.default_rng(7)
    queries, keys, values = (rng.standard_normal((2, n, 5)).astype(np.float32) for n in (3, 4, 4))
    expected = reference.DotProductAttention()(queries, keys, values)
    np.testing.assert_allclose(traced(queries, keys, values).numpy(), expected, rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    message = XLA_REFUSAL if jit_compile else "mha: the tensors of the call disagree"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        traced(queries[..., :1], keys, values)


LATENT_SIZES = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4}


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("name, wrong", [
    ("MultiHeadAttention", 0), ("MultiHeadAttention", 1), ("MultiHeadAttention", 2),
    ("AdditiveAttention", 0), ("AdditiveAttention", 1), ("MultiHeadLatentAttention", 0),
])  # fmt: skip
def test_a_layer_traced_for_any_features_refuses_another_number(TF, tf, name, wrong,
                                                                 jit_compile):  # fmt: skip
    # A graph of unknown features gave TensorFlow's MatMul or reshape error, naming no input
    arguments = {"MultiHeadAttention": (8, 2), "AdditiveAttention": (8,),
                 "MultiHeadLatentAttention": (8, 2)}[name]  # fmt: skip
    named = LATENT_SIZES if name == "MultiHeadLatentAttention" else {}
    layer = getattr(TF, name)(*arguments, **named)
    rng = np.random.default_rng(8)
    tensors = [rng.standard_normal((2, n, 6)).astype(np.float32) for n in (3, 4, 4)]
    if name == "MultiHeadLatentAttention":
        tensors = [rng.standard_normal((2, 3, 8)).astype(np.float32)]
    layer(*tensors)  # built with the features it takes
    expected_layer = getattr(reference, name)(*arguments, **named)
    mha.set_weights(expected_layer, mha.get_weights(layer))
    spec = [tf.TensorSpec((None, None, None))] * len(tensors)
    traced = tf.function(lambda *given: layer(*given), input_signature=spec,
                         jit_compile=jit_compile)  # fmt: skip
    np.testing.assert_allclose(traced(*tensors).numpy(), expected_layer(*tensors), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    tensors[wrong] = tensors[wrong][..., :5]
    message = XLA_REFUSAL if jit_compile else "mha: the tensors of the call disagree"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        traced(*tensors)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_add_norm_traced_for_any_size_refuses_a_y_of_another_shape(TF, tf, jit_compile):
    # Y of one example for three broadcast over X in a graph of unknown sizes
    layer = TF.AddNorm(4)
    spec = [tf.TensorSpec((None, None, 4))] * 2
    traced = tf.function(lambda X, Y: layer(X, Y), input_signature=spec, jit_compile=jit_compile)
    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    expected_layer = reference.AddNorm(4)
    mha.set_weights(expected_layer, mha.get_weights(layer))
    np.testing.assert_allclose(traced(X, Y).numpy(), expected_layer(X, Y), rtol=1e-5, atol=1e-5)
    message = XLA_REFUSAL if jit_compile else "mha: the tensors of the call disagree"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        traced(X, Y[:1])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_add_norm_traced_with_its_last_axis_unknown_normalises_num_hiddens(TF, tf, jit_compile):
    # Keras's LayerNormalization needs the last axis known (a TypeError without it); the
    # tie fixes it to num_hiddens, and refuses another
    layer = TF.AddNorm(4)
    spec = [tf.TensorSpec((None, None, None))] * 2
    traced = tf.function(lambda X, Y: layer(X, Y), input_signature=spec, jit_compile=jit_compile)
    X, Y = np.random.default_rng(5).standard_normal((2, 2, 3, 4)).astype(np.float32)
    Z = X + Y  # the formula, gamma 1 and beta 0 as built
    expected = (Z - Z.mean(-1, keepdims=True)) / np.sqrt(Z.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(traced(X, Y).numpy(), expected, rtol=1e-5, atol=1e-5)
    message = XLA_REFUSAL if jit_compile else "mha: the tensors of the call disagree"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        traced(np.ones((2, 3, 5), np.float32), np.ones((2, 3, 5), np.float32))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_tensor_given_twice_is_tied_to_both_its_sizes(TF, tf, jit_compile):
    # The queries given as the keys too, and one tensor of segment ids for the queries and the
    # keys: each was tied to its first sizes alone, and under XLA a value of one head for two,
    # or ids of one query for five keys, passed (attending every key)
    spec = [tf.TensorSpec([None] * 4)] * 2
    function = tf.function(lambda x, v: TF.dot_product_attention(x, x, v), input_signature=spec,
                           jit_compile=jit_compile)  # fmt: skip
    x = np.random.default_rng(4).standard_normal((1, 2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(
        function(x, x).numpy(), reference.dot_product_attention(x, x, x), rtol=1e-5, atol=1e-6
    )
    message = XLA_REFUSAL if jit_compile else "mha: the tensors of the call disagree"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        function(x, x[:, :1])
    layer = TF.DotProductAttention()
    spec = [tf.TensorSpec((None, None, 4)), tf.TensorSpec((None, None, 4)),
            tf.TensorSpec((None, None), tf.int32)]  # fmt: skip
    packed = tf.function(lambda q, k, ids: layer(q, k, k, segment_ids=ids), input_signature=spec,
                         jit_compile=jit_compile)  # fmt: skip
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        packed(x[0, :, :1], x[0, :, :3], np.zeros((2, 1), np.int32))


# The attention function's tensors, (batch_size, heads, positions, head size): each mistake
# beside a query (3, 4, 7, 2) and a key and value (3, 2, 7, 2)
FUNCTION_MISTAKES = {
    "one length for three examples": dict(valid_lens=np.array([2], np.int32)),
    "keys and values of one example for three": dict(
        key=np.ones((1, 2, 7, 2), np.float32), value=np.ones((1, 2, 7, 2), np.float32)
    ),
    "values of eight positions for keys of seven": dict(value=np.ones((3, 2, 8, 2), np.float32)),
    "values of one head for keys of two": dict(value=np.ones((3, 1, 7, 2), np.float32)),
    "values of one head of fourteen for two of seven": dict(
        value=np.ones((3, 1, 14, 2), np.float32)
    ),
    "key-value heads that do not divide the query's": dict(
        key=np.ones((3, 3, 7, 2), np.float32), value=np.ones((3, 3, 7, 2), np.float32)
    ),
}


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("mistake", FUNCTION_MISTAKES)
def test_the_attention_function_ties_the_sizes_a_graph_left_unknown(TF, tf, mistake, jit_compile):
    # As the layers: asserted, and tied by reshapes where XLA drops the assertion (there, values
    # of another length would otherwise be read as the keys' number, silently)
    rng = np.random.default_rng(0)
    good = {
        "query": rng.standard_normal((3, 4, 7, 2)).astype(np.float32),
        "key": rng.standard_normal((3, 2, 7, 2)).astype(np.float32),
        "value": rng.standard_normal((3, 2, 7, 2)).astype(np.float32),
        "valid_lens": np.array([2, 7, 4], np.int32),
    }
    spec = {name: tf.TensorSpec([None] * value.ndim, value.dtype) for name, value in good.items()}
    attend = tf.function(
        lambda arguments: TF.dot_product_attention(**arguments),
        input_signature=[spec],
        jit_compile=jit_compile,
    )
    output = attend({k: tf.constant(v) for k, v in good.items()})
    expected = reference.dot_product_attention(**{k: v.astype(np.float64) if k != "valid_lens"
                                                  else v for k, v in good.items()})  # fmt: skip
    np.testing.assert_allclose(output.numpy(), expected, rtol=1e-5, atol=1e-5)
    given = {**good, **FUNCTION_MISTAKES[mistake]}
    with pytest.raises(ValueError):
        TF.dot_product_attention(**given)
    message = XLA_REFUSAL if jit_compile else "mha: the tensors of the call disagree"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        attend({k: tf.constant(v) for k, v in given.items()})


def test_a_latent_cache_of_another_batch_is_named_in_a_graph_of_unknown_sizes(TF, tf):
    # The LatentCache is tied as a KVCache is: a cache of one example for three is the mha
    # message where the graph runs, not the concatenation's error; a cache that fits agrees
    # with the eager call
    layer = TF.MultiHeadLatentAttention(
        8, 2, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2
    )
    rng = np.random.default_rng(0)
    X = rng.standard_normal((3, 2, 8)).astype(np.float32)
    cache = mha.LatentCache(*(rng.standard_normal(shape).astype(np.float32)
                              for shape in ((3, 4, 4), (3, 1, 4, 2))))  # fmt: skip
    spec = [tf.TensorSpec([None, None, 8], tf.float32),
            mha.LatentCache(tf.TensorSpec([None, None, 4], tf.float32),
                            tf.TensorSpec([None, 1, None, 2], tf.float32))]  # fmt: skip
    attend = tf.function(lambda X, cache: layer(X, causal=True, cache=cache)[0],
                         input_signature=spec)  # fmt: skip
    expected = layer(X, causal=True, cache=cache)[0]
    np.testing.assert_allclose(attend(X, cache).numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)
    one = mha.LatentCache(*(x[:1] for x in cache))
    with pytest.raises(ValueError):
        layer(X, causal=True, cache=one)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="mha: the tensors of the call disagree"
    ):
        attend(X, one)
