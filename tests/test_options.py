"""The layer options beside the book's: out_bias, out_features and scale.

Each backend's layer is checked against the formula written out here in numpy (the agreement
matrix of mha.harness then holds the backends to each other on every mask path); the
canonical weights, files and converters follow the options.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import mha
from conftest import backend_module, backend_params
from mha import interop, weights


def softmax(scores):
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def formula(queries, keys, values, w, num_heads, scale):
    """softmax(scale * Q_h K_h^T) V_h per head, concatenated, times W_o, plus the biases."""
    q, k, v = (
        x @ w[f"W_{n}"] + w.get(f"b_{n}", 0)
        for x, n in ((queries, "q"), (keys, "k"), (values, "v"))
    )
    B, Q, n = q.shape

    def heads(x):
        return x.reshape(B, x.shape[1], num_heads, -1).transpose(0, 2, 1, 3)

    attention = softmax(heads(q) @ heads(k).transpose(0, 1, 3, 2) * scale) @ heads(v)
    return attention.transpose(0, 2, 1, 3).reshape(B, Q, n) @ w["W_o"] + w.get("b_o", 0)


OPTIONS = {
    "output bias alone": {"bias": False, "out_bias": True},
    "input biases alone": {"bias": True, "out_bias": False},
    "wider output": {"out_features": 11},
    "unscaled": {"scale": 1.0},
    "all at once": {"bias": True, "out_bias": False, "out_features": 3, "scale": 0.3},
}


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", backend_params())
def test_multihead_options_compute_the_formula(name, option, need_weights):
    module = backend_module(name)
    config = {"query_size": 5, "key_size": 6, "value_size": 7, **OPTIONS[option]}
    layer = module.MultiHeadAttention(8, 2, dtype="float64", **config)
    w = mha.random_weights(layer, seed=1)
    expected_names = {"W_q", "W_k", "W_v", "W_o"}
    if config.get("bias"):
        expected_names |= {"b_q", "b_k", "b_v"}
    if config.get("out_bias", config.get("bias")):
        expected_names.add("b_o")
    assert set(w) == expected_names
    assert w["W_o"].shape == (8, config.get("out_features", 8))
    mha.set_weights(layer, w)
    rng = np.random.default_rng(2)
    q, k, v = (
        rng.standard_normal((2, 3, 5)),
        rng.standard_normal((2, 4, 6)),
        rng.standard_normal((2, 4, 7)),
    )
    output = layer(*map(module.from_numpy, (q, k, v)), need_weights=need_weights)
    expected = formula(q, k, v, w, 2, config.get("scale", 1 / np.sqrt(4)))
    np.testing.assert_allclose(module.to_numpy(output), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", backend_params())
def test_dot_product_scale_is_the_factor_of_the_scores(name):
    module = backend_module(name)
    rng = np.random.default_rng(3)
    q, k, v = (
        rng.standard_normal((2, 3, 4)),
        rng.standard_normal((2, 5, 4)),
        rng.standard_normal((2, 5, 2)),
    )
    layer = module.DotProductAttention(scale=0.7, dtype="float64")
    output = module.to_numpy(layer(*map(module.from_numpy, (q, k, v))))
    np.testing.assert_allclose(output, softmax(0.7 * q @ k.transpose(0, 2, 1)) @ v, atol=1e-12)


def test_the_options_travel_in_checkpoints(tmp_path):
    numpy_backend = backend_module("numpy")
    layer = numpy_backend.MultiHeadAttention(
        8, 2, query_size=8, key_size=8, value_size=8, out_bias=True, out_features=5, scale=0.25
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=0))
    mha.save(layer, tmp_path / "a.safetensors")
    again = mha.load(tmp_path / "a.safetensors", backend="numpy")
    assert (again.out_bias, again.out_features, again.scale) == (True, 5, 0.25)
    for key, value in mha.get_weights(layer).items():
        np.testing.assert_array_equal(mha.get_weights(again)[key], value)


def test_a_checkpoint_written_before_the_options_loads_with_their_defaults(tmp_path):
    layer = backend_module("numpy").MultiHeadAttention(
        8, 2, bias=True, query_size=8, key_size=8, value_size=8
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=0))
    path = tmp_path / "old.safetensors"
    mha.save(layer, path)
    # Rewrite the header as earlier versions wrote it: no out_bias, out_features, scale
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    config = json.loads(header["__metadata__"]["config"])
    for key in ("out_bias", "out_features", "scale"):
        del config[key]
    header["__metadata__"]["config"] = json.dumps(config)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + size :])
    checkpoint = weights.read_checkpoint(path)
    assert {key: checkpoint.config[key] for key in ("out_bias", "out_features", "scale")} == {
        "out_bias": None,
        "out_features": None,
        "scale": None,
    }
    again = mha.load(path, backend="numpy")
    assert again.bias and again.out_bias is None


# Each file kind is written by its framework
_FRAMEWORK_OF_FILE = {"a.pt": "torch", "a.weights.h5": "tensorflow", "a.msgpack": "jax"}


@pytest.mark.parametrize("destination", list(_FRAMEWORK_OF_FILE))
@pytest.mark.parametrize("option", ["out_bias", "out_features", "scale", "sinks", "output_gate"])
def test_the_frameworks_layers_refuse_what_they_cannot_hold(option, destination, tmp_path):
    backend_module(_FRAMEWORK_OF_FILE[destination])
    value = {"out_bias": True, "out_features": 5, "scale": 0.5}.get(option, True)
    layer = backend_module("numpy").MultiHeadAttention(
        8, 2, query_size=8, key_size=8, value_size=8, **{option: value}
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=0))
    if destination == "a.pt":
        with pytest.raises(ValueError, match="has no equivalent of"):
            interop.torch_state_dict(mha.get_weights(layer)) if option != "scale" else (
                interop.write_file(tmp_path / "a.pt", mha.get_weights(layer), scale=value)
            )
    mha.save(layer, tmp_path / "a.safetensors")
    if option == "out_features" and destination != "a.pt":
        # Keras's output_shape and Flax's out_features hold another output size
        interop.convert(tmp_path / "a.safetensors", tmp_path / destination)
        again, config = interop.read_file(tmp_path / destination)
        assert config["out_features"] == 5 and again["W_o"].shape == (8, 5)
        return
    if option == "output_gate" and destination == "a.weights.h5":
        # Keras's gate (use_gate) is the output gate
        interop.convert(tmp_path / "a.safetensors", tmp_path / destination)
        again, config = interop.read_file(tmp_path / destination)
        assert config["output_gate"]
        np.testing.assert_array_equal(again["W_g"], mha.get_weights(layer)["W_g"])
        return
    with pytest.raises(ValueError, match="has no equivalent of"):
        interop.convert(tmp_path / "a.safetensors", tmp_path / destination)
    assert not (tmp_path / destination).exists()


def d2l_masked_softmax(X, valid_lens):
    """The book's masked_softmax (section 11.3), in numpy: masked scores become -1e6."""
    shape = X.shape
    if valid_lens.ndim == 1:
        valid_lens = np.repeat(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = X.reshape(-1, shape[-1]).copy()
    mask = np.arange(shape[-1])[None, :] < valid_lens[:, None]
    X[~mask] = -1e6
    e = np.exp(X - X.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).reshape(shape)


@pytest.mark.parametrize(
    "lengths", [np.array([0, 2, 5]), np.array([[0, 1], [3, 0], [5, 2]])], ids=["1d", "2d"]
)
@pytest.mark.parametrize("name", backend_params())
def test_uniform_empty_rows_give_the_books_numbers(name, lengths):
    module = backend_module(name)
    X = np.random.default_rng(4).standard_normal((3, 2, 5))
    got = module.masked_softmax(
        module.from_numpy(X), module.from_numpy(lengths), empty_rows="uniform"
    )
    expected = d2l_masked_softmax(X, lengths)
    np.testing.assert_allclose(module.to_numpy(got), expected, rtol=0, atol=1e-15)
    # A row of valid length 0: 1 / no. of keys everywhere; "zeros" keeps it at 0
    assert np.all(module.to_numpy(got)[0, 0] == 1 / 5)
    zeros = module.to_numpy(module.masked_softmax(module.from_numpy(X), module.from_numpy(lengths)))
    assert np.all(zeros[0, 0] == 0)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("name", backend_params())
def test_attn_bias_is_added_to_every_heads_scores(name, need_weights):
    # T5's relative position bias: one (Q, K) bias per head, unscaled scores
    module = backend_module(name)
    layer = module.MultiHeadAttention(
        8, 2, query_size=8, key_size=8, value_size=8, scale=1.0, dtype="float64"
    )
    w = mha.random_weights(layer, seed=5)
    mha.set_weights(layer, w)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 4, 8))
    bias = rng.standard_normal((1, 2, 4, 4))
    output = layer(
        *[module.from_numpy(x)] * 3, attn_bias=module.from_numpy(bias), need_weights=need_weights
    )
    q, k, v = (x @ w[f"W_{n}"] for n in "qkv")

    def heads(a):
        return a.reshape(2, 4, 2, 4).transpose(0, 2, 1, 3)

    weights = softmax(heads(q) @ heads(k).transpose(0, 1, 3, 2) + bias)
    expected = (weights @ heads(v)).transpose(0, 2, 1, 3).reshape(2, 4, 8) @ w["W_o"]
    np.testing.assert_allclose(module.to_numpy(output), expected, rtol=0, atol=1e-12)


@pytest.mark.torch
@pytest.mark.parametrize(
    "option",
    [
        {"alibi": True},
        {"query_scaling": {"beta": 0.1, "original_max_position_embeddings": 4}},
        {"value_norm": True},
        {"attention_chunk_size": 4},
    ],
    ids=["alibi", "query_scaling", "value_norm", "attention_chunk_size"],
)
def test_the_converters_refuse_options_without_weights(tmp_path, option):
    # ALiBi, the queries' scaling by position and the values' norm are config, no weight: the
    # converters read them off mha's layer and mha's files, and the frameworks' layers have
    # none of them
    for framework in ("torch", "tensorflow", "jax"):  # each writes its file kind
        backend_module(framework)
    layer = backend_module("numpy").MultiHeadAttention(
        8, 2, query_size=8, key_size=8, value_size=8, **option
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=0))
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"{name}="):
        interop.to_torch(layer)
    mha.save(layer, tmp_path / "a.safetensors")
    for destination in ("a.pt", "a.weights.h5", "a.msgpack"):
        with pytest.raises(ValueError, match=f"{name}="):
            interop.convert(tmp_path / "a.safetensors", tmp_path / destination)
        assert not (tmp_path / destination).exists()


def test_an_mha_file_converted_keeps_uniform_empty_rows(tmp_path):
    # What a row with no key gets is no weight: mha's checkpoints keep it through a convert,
    # and a framework's file takes that framework's convention (docs/weights-and-files.md)
    backend_module("torch")  # writes the .pt file
    N = backend_module("numpy")
    layer = N.MultiHeadAttention(
        8, 2, query_size=8, key_size=8, value_size=8, empty_rows="uniform", dtype="float64"
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=0))
    mha.save(layer, tmp_path / "a.safetensors")
    config = interop.convert(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert config["empty_rows"] == "uniform"
    converted = mha.load(tmp_path / "b.safetensors", backend="numpy")
    x = np.random.default_rng(1).standard_normal((2, 3, 8))
    lengths = np.array([0, 2])  # the first example's rows have no key
    np.testing.assert_array_equal(converted(x, x, x, lengths), layer(x, x, x, lengths))
    interop.convert(tmp_path / "a.safetensors", tmp_path / "a.pt")
