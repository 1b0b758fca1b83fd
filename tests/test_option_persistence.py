"""A layer's options through what keeps or copies it: `mha convert` between checkpoints keeps
every option (the layer read back computes the source's numbers), a framework's file names
what it does not hold, a layer with a rotary or query scaling copies and pickles, and an option
no file could write (numpy's float32) is refused when the layer is built."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import mha
from conftest import backend_module, backend_params
from mha import conversion
from mha.weights import UNTOLD_OPTIONS, layer_info

YARN = {
    "rope_type": "yarn",
    "factor": 2.0,
    "original_max_position_embeddings": 4,
    "beta_fast": 8.0,
    "beta_slow": 2.0,
}
QUERY_SCALING = {"beta": 0.5, "original_max_position_embeddings": 2, "position_offset": 1}
SIZES = {"num_hiddens": 16, "num_heads": 4, "query_size": 5, "key_size": 7, "value_size": 3}
# Each untold option away from its default in one of these; a value norm reads qk_norm_eps
# with no QK-norm beside it
CONFIGS = {
    "value norm alone": {"value_norm": True, "qk_norm_eps": 0.5},
    "rotary and more": {
        "bias": True,
        "out_bias": False,
        "out_features": 6,
        "scale": 0.3,
        "sliding_window": 3,
        "attention_chunk_size": 4,
        "num_kv_heads": 2,
        "rope_theta": 500.0,
        "rope_interleaved": True,
        "rope_dim": 2,
        "rope_scaling": YARN,
        "query_scaling": QUERY_SCALING,
        "softcap": 5.0,
        "sinks": True,
        "qk_norm": "head",
        "qk_norm_eps": 1e-2,
        "output_gate": True,
        "alibi": True,
        "value_norm": True,
    },
    "uniform rows": {"empty_rows": "uniform", "qk_norm": "projection", "qk_norm_eps": 0.2},
}


def test_every_untold_option_is_set_by_a_config_below():
    # An option added to the layer is added here, or the conversion test does not see it
    assert set(UNTOLD_OPTIONS) <= set().union(*CONFIGS.values())


def call(layer):
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((2, 6, size)) for size in (5, 7, 3)]
    return layer(*inputs, np.array([3, 6]), causal=True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_converting_a_checkpoint_keeps_every_option(tmp_path, name):
    # mha convert rebuilt the layer from the options it read: a value norm's eps was dropped
    # where no QK-norm was there, and the layer read back computed other numbers
    N = backend_module("numpy")
    layer = N.MultiHeadAttention(**SIZES, **CONFIGS[name], dtype="float64")
    mha.set_weights(layer, mha.random_weights(layer, seed=0))
    source, destination = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    mha.save(layer, source)
    reported = conversion.convert(source, destination)
    again = mha.load(destination, backend="numpy")
    expected = mha.load(source, backend="numpy")
    for key, value in CONFIGS[name].items():
        assert getattr(again, key) == getattr(expected, key) == value, key
    assert not reported.get("notes") and reported["qk_norm_eps"] == again.qk_norm_eps
    np.testing.assert_array_equal(call(again), call(layer))


@pytest.mark.torch
def test_a_framework_file_names_the_options_it_does_not_hold(tmp_path, capsys):
    # A torch state_dict keeps weights alone: the result and the command line say what the
    # file gives back (no dropout, zeros for a row with no key), not what the source held
    backend_module("torch")
    N = backend_module("numpy")
    square = {**SIZES, "query_size": 16, "key_size": 16, "value_size": 16}
    layer = N.MultiHeadAttention(**square, dropout=0.25, empty_rows="uniform", dtype="float64")
    source = tmp_path / "a.safetensors"
    mha.save(layer, source)
    reported = conversion.convert(source, tmp_path / "a.pt", num_heads=4)
    assert reported["dropout"] == 0.0 and reported["empty_rows"] == "zeros"
    (note,) = reported["notes"]
    assert "does not hold dropout=0.25, empty_rows='uniform'" in note
    assert note.endswith("read back, dropout=0.0, empty_rows='zeros'")
    assert mha.cli.main(["convert", str(source), str(tmp_path / "b.pt")]) == 0
    out = capsys.readouterr().out
    assert "dropout=0.0," in out and "note: " in out and "dropout=0.25" not in out.split("\n")[1]


@pytest.mark.parametrize("name", backend_params())
def test_a_layer_with_a_scaling_copies_and_pickles(name):
    # A scaling is a dict that cannot change: pickle and deepcopy set its items one by one,
    # which it refused, so a torch.save of the whole module wrote a file no load could read
    module = backend_module(name)
    options = {"rope_theta": 100.0, "rope_scaling": YARN, "query_scaling": QUERY_SCALING}
    sizes = {"query_size": 16, "key_size": 16, "value_size": 16}
    layer = module.MultiHeadAttention(16, 4, dtype="float64", **sizes, **options)
    mha.set_weights(layer, mha.random_weights(layer, seed=0))
    if hasattr(layer, "eval"):
        layer.eval()
    x = module.from_numpy(np.random.default_rng(2).standard_normal((2, 5, 16)))
    expected = module.to_numpy(layer(x, x, x, causal=True))
    for again in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert again.rope_scaling == YARN and again.query_scaling == QUERY_SCALING
        with pytest.raises(TypeError, match="cannot change"):
            again.rope_scaling["factor"] = 3.0
        np.testing.assert_array_equal(module.to_numpy(again(x, x, x, causal=True)), expected)


@pytest.mark.parametrize("option", ["scale", "softcap", "rope_theta", "qk_norm_eps", "dropout"])
def test_numpy_float32_options_are_refused_by_name(tmp_path, option):
    # Taken before, then mha.save failed inside json ("float32 is not JSON serializable"):
    # refused when the layer is built, as numpy's integers are for sizes; a float64 is a float
    N = backend_module("numpy")
    with pytest.raises(TypeError, match=f"{option} must be a Python number .*float32"):
        N.MultiHeadAttention(**SIZES, **{option: np.float32(0.25)})
    layer = N.MultiHeadAttention(**SIZES, **{option: np.float64(0.25)})
    mha.save(layer, tmp_path / "a.safetensors")
    assert layer_info(mha.load(tmp_path / "a.safetensors", backend="numpy"))[2][option] == 0.25
