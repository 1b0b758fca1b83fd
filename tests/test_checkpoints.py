"""mha.save / mha.load: checkpoints that move between backends, and bad files refused."""

import json
import pickle

import numpy as np
import pytest

import mha
from conftest import backend_module, backend_params
from mha import harness
from mha.weights import write_safetensors

CONFIG = {
    "num_hiddens": 8,
    "num_heads": 2,
    "dropout": 0.0,
    "bias": True,
    "query_size": 6,
    "key_size": 5,
    "value_size": 4,
    "dtype": "float32",
    "out_bias": None,
    "out_features": None,
    "scale": None,
    "empty_rows": "zeros",
    "sliding_window": None,
    "attention_chunk_size": None,
    "num_kv_heads": None,
    "rope_theta": None,
    "rope_interleaved": False,
    "rope_dim": None,
    "rope_scaling": None,
    "query_scaling": None,
    "softcap": None,
    "sinks": False,
    "qk_norm": None,
    "qk_norm_eps": 1e-06,
    "output_gate": False,
    "alibi": False,
    "value_norm": False,
}


def inputs(rng):
    return (
        rng.standard_normal((2, 3, 6)).astype("float32"),
        rng.standard_normal((2, 4, 5)).astype("float32"),
        rng.standard_normal((2, 4, 4)).astype("float32"),
        np.array([2, 4]),
    )


def run(module, layer, arrays):
    output = layer(*(module.from_numpy(x) for x in arrays))
    return module.to_numpy(output), module.to_numpy(layer.attention_weights)


@pytest.mark.parametrize("target", backend_params())
@pytest.mark.parametrize("source", backend_params())
def test_save_in_one_backend_load_in_another(tmp_path, source, target):
    saving, loading = backend_module(source), backend_module(target)
    layer = saving.MultiHeadAttention(
        CONFIG["num_hiddens"],
        CONFIG["num_heads"],
        bias=True,
        query_size=6,
        key_size=5,
        value_size=4,
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=11))
    path = tmp_path / "attention.safetensors"
    mha.save(layer, path)
    loaded = mha.load(path, backend=target)
    assert isinstance(loaded, loading.MultiHeadAttention)
    assert loading.layer_config(loaded) == CONFIG
    saved_weights, loaded_weights = mha.get_weights(layer), mha.get_weights(loaded)
    assert all(np.array_equal(saved_weights[k], loaded_weights[k]) for k in saved_weights)
    arrays = inputs(np.random.default_rng(0))
    (output, weights), (other_output, other_weights) = (
        run(saving, layer, arrays),
        run(loading, loaded, arrays),
    )
    assert harness.difference(other_output, output, relative=True) <= 1e-5
    assert harness.difference(other_weights, weights, relative=True) <= 1e-5


def test_load_uses_the_current_backend_and_every_class(tmp_path):
    numpy_backend = backend_module("numpy")
    layers = {
        "DotProductAttention": numpy_backend.DotProductAttention(0.1, dtype="float64"),
        "AdditiveAttention": numpy_backend.AdditiveAttention(4, query_size=3, key_size=2),
        "PositionalEncoding": numpy_backend.PositionalEncoding(6, max_len=50),
        "AddNorm": numpy_backend.AddNorm(5, eps=1e-3),
    }
    for name, layer in layers.items():
        if mha.weights.weight_shapes(name, numpy_backend.layer_config(layer)):
            mha.set_weights(layer, mha.random_weights(layer, seed=1))
        path = tmp_path / f"{name}.safetensors"
        mha.save(layer, path)
        with mha.use_backend("numpy"):
            loaded = mha.load(path)
        assert type(loaded) is type(layer)
        assert numpy_backend.layer_config(loaded) == numpy_backend.layer_config(layer)
        original, again = mha.get_weights(layer), mha.get_weights(loaded)
        assert original.keys() == again.keys()
        assert all(np.array_equal(original[k], again[k]) for k in original)


def test_save_writes_the_format_of_save_weights(tmp_path):
    layer = backend_module("numpy").MultiHeadAttention(4, 2, query_size=4, key_size=4, value_size=4)
    mha.save(layer, tmp_path / "a.safetensors")
    mha.save_weights(layer, tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    checkpoint = mha.weights.read_checkpoint(tmp_path / "a.safetensors")
    assert checkpoint.class_name == "MultiHeadAttention"
    assert checkpoint.metadata["backend"] == "numpy"


def write(path, tensors, class_name="MultiHeadAttention", config=None, **metadata):
    fields = {
        "format": "mha",
        "format_version": "1",
        "class": class_name,
        "config": json.dumps(CONFIG if config is None else config),
        "backend": "numpy",
    }
    fields.update(metadata)
    write_safetensors(path, tensors, fields)
    return path


def good_weights():
    return mha.random_weights("MultiHeadAttention", **CONFIG, seed=0)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncated", "truncated"),
        ("empty", "fewer than the 8-byte header"),
        ("json", "not a valid safetensors file"),
        ("no_metadata", "not one written by mha.save_weights"),
        ("unknown_class", "unknown layer class.*'Transformer'"),
        ("wrong_shape", "W_q has shape \\(6, 4\\)"),
        ("missing_weight", "missing b_o"),
        (
            "config_not_matching",
            "W_o has shape \\(8, 8\\) and dtype float32; expected shape \\(16, 16\\)",
        ),
        ("unknown_key", "unknown activation"),
        ("missing_key", "missing num_heads"),
        ("wrong_type", "num_heads must be a positive integer. Received: num_heads='2'"),
        ("wrong_bool", "bias must be True or False"),
        ("indivisible", "num_hiddens must be divisible by num_heads"),
        ("config_not_json", "corrupted config"),
        ("dtype", "expected dtype float32"),
    ],
)
def test_bad_files_raise_clear_value_errors(tmp_path, damage, message):
    path = tmp_path / "bad.safetensors"
    weights = good_weights()
    if damage in ("truncated", "empty"):
        write(path, weights)
        content = path.read_bytes()
        path.write_bytes(content[: len(content) - 17] if damage == "truncated" else b"abc")
    elif damage == "json":
        path.write_text(json.dumps({"W_q": [[1.0]]}))
    elif damage == "no_metadata":
        write_safetensors(path, weights, {})
    elif damage == "unknown_class":
        write(path, weights, class_name="Transformer")
    elif damage == "wrong_shape":
        write(path, {**weights, "W_q": np.zeros((6, 4), "float32")})
    elif damage == "missing_weight":
        write(path, {k: v for k, v in weights.items() if k != "b_o"})
    elif damage == "config_not_matching":
        write(path, weights, config={**CONFIG, "num_hiddens": 16})
    elif damage == "unknown_key":
        write(path, weights, config={**CONFIG, "activation": "relu"})
    elif damage == "missing_key":
        write(path, weights, config={k: v for k, v in CONFIG.items() if k != "num_heads"})
    elif damage == "wrong_type":
        write(path, weights, config={**CONFIG, "num_heads": "2"})
    elif damage == "wrong_bool":
        write(path, weights, config={**CONFIG, "bias": "yes"})
    elif damage == "indivisible":
        write(path, weights, config={**CONFIG, "num_heads": 3})
    elif damage == "config_not_json":
        write_safetensors(path, weights, {"format": "mha", "class": "AddNorm", "config": "{x"})
    elif damage == "dtype":
        write(path, {k: v.astype("float64") for k, v in weights.items()})
    with pytest.raises(ValueError, match=message):
        mha.load(path)


def test_pickle_files_are_never_executed(tmp_path):
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "attention.safetensors"
    path.write_bytes(pickle.dumps({"W_q": Payload()}))
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        mha.load(path)
    assert not marker.exists()


def _attention_by_formula(x, w, num_heads, scale):
    """Multi-head self-attention by hand from canonical weights without biases."""
    q, k, v = (x @ w[f"W_{name}"] for name in "qkv")
    B, N, n = q.shape
    heads = [a.reshape(B, N, num_heads, -1).transpose(0, 2, 1, 3) for a in (q, k, v)]
    scores = heads[0] @ heads[1].transpose(0, 1, 3, 2) * scale
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ heads[2]).transpose(0, 2, 1, 3).reshape(B, N, n) @ w["W_o"]


def _scaled_checkpoint(tmp_path):
    """(path, weights) of a float64 MultiHeadAttention checkpoint saved with scale 0.5."""
    layer = backend_module("numpy").MultiHeadAttention(
        8, 2, scale=0.5, query_size=8, key_size=8, value_size=8, dtype="float64"
    )
    w = mha.random_weights(layer, seed=5)
    mha.set_weights(layer, w)
    mha.save(layer, tmp_path / "scaled.safetensors")
    return tmp_path / "scaled.safetensors", w


def test_a_checkpoint_keeps_its_scale_and_options(tmp_path):
    path, w = _scaled_checkpoint(tmp_path)
    assert mha.checkpoints.read_checkpoint(path).config["scale"] == 0.5
    x = np.random.default_rng(6).standard_normal((2, 4, 8))
    again = mha.load(path, backend="numpy")
    expected = _attention_by_formula(x, w, 2, 0.5)
    np.testing.assert_allclose(again(x, x, x), expected, rtol=0, atol=1e-12)
    options = {"rope_theta": 10000.0, "sliding_window": 3, "softcap": 30.0}
    other = backend_module("numpy").MultiHeadAttention(
        8, 2, **options, query_size=8, key_size=8, value_size=8, dtype="float64"
    )
    mha.set_weights(other, w)
    mha.save(other, tmp_path / "options.safetensors")
    config = mha.checkpoints.read_checkpoint(tmp_path / "options.safetensors").config
    assert {key: config[key] for key in options} == options


def test_load_weights_takes_a_file_of_the_same_scaling_written_as_lists(tmp_path):
    # JSON writes longrope's factors as lists where the layer holds tuples: the same setting;
    # another factor is still refused
    def layer(long_factor):
        scaling = {"rope_type": "longrope", "short_factor": [1.0, 1.5], "factor": 2.0}
        scaling.update(long_factor=long_factor, original_max_position_embeddings=4)
        return backend_module("numpy").MultiHeadAttention(
            8,
            2,
            rope_theta=100.0,
            rope_scaling=scaling,
            query_size=8,
            key_size=8,
            value_size=8,
            dtype="float64",
        )

    saved = layer([2.0, 3.0])
    w = mha.random_weights(saved, seed=2)
    mha.set_weights(saved, w)
    mha.save_weights(saved, tmp_path / "longrope.safetensors")
    same = layer([2.0, 3.0])
    mha.load_weights(same, tmp_path / "longrope.safetensors")
    x = np.random.default_rng(3).standard_normal((1, 4, 8))
    np.testing.assert_array_equal(same(x, x, x), saved(x, x, x))
    with pytest.raises(ValueError, match="the file was saved with rope_scaling="):
        mha.load_weights(layer([2.0, 4.0]), tmp_path / "longrope.safetensors")


def test_convert_keeps_a_checkpoints_scale_and_takes_the_one_given(tmp_path):
    path, w = _scaled_checkpoint(tmp_path)
    x = np.random.default_rng(3).standard_normal((2, 4, 8))
    for scale in (None, 0.125):  # None: the checkpoint's own
        destination = tmp_path / f"{scale}.safetensors"
        mha.interop.convert(path, destination, scale=scale)
        copy = mha.load(destination, backend="numpy")
        expected = _attention_by_formula(x, w, 2, scale or 0.5)
        np.testing.assert_allclose(copy(x, x, x), expected, rtol=0, atol=1e-12)
