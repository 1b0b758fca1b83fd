"""A whole model's safetensors weights read as they are used (mha.stored): one file, the shards
of a Hugging Face index, or a folder holding either; ports from them, through Python and the
command line, against the same port of the weights held in memory."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

import mha
from conftest import backend_module, required_import
from mha import cli, porting, stored
from mha.checkpoints import read_checkpoint, write_safetensors
from mha.model_config import options_from_config
from mha.weights import numpy_dtype

pytestmark = pytest.mark.numpy

PREFIX = "model.layers.1.self_attn"
HIDDEN, HEADS = 16, 4


def llama_state(dtype="float32") -> dict[str, np.ndarray]:
    """Two layers of Llama's attention (q/k/v/o_proj, two key-value heads) and an embedding."""
    rng = np.random.default_rng(0)
    state = {"model.embed_tokens.weight": rng.standard_normal((10, HIDDEN))}
    for layer in range(2):
        for name, rows in (("q", HIDDEN), ("k", HIDDEN // 2), ("v", HIDDEN // 2), ("o", HIDDEN)):
            state[f"model.layers.{layer}.self_attn.{name}_proj.weight"] = rng.standard_normal(
                (rows, HIDDEN)
            )
    return {name: value.astype(numpy_dtype(dtype)) for name, value in state.items()}


def write_shards(folder, state, shards) -> str:
    """The state as transformers shards it: `shards` lists each shard's names; the index beside
    them maps each name to its file. Returns the index's path."""
    weight_map = {}
    for number, names in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(folder, file), {n: state[n] for n in names}, {})
        weight_map.update(dict.fromkeys(names, file))
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index, "w") as file:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, file)
    return index


def split_layer_one(state):
    """Three shards, layer 1's tensors spread over all of them."""
    names = sorted(state)
    return [names[0::3], names[1::3], names[2::3]]


def same_port(port, expected):
    assert port.layer == expected.layer and port.config == expected.config
    assert port.weights.keys() == expected.weights.keys()
    for name, value in expected.weights.items():
        assert port.weights[name].dtype == value.dtype
        np.testing.assert_array_equal(port.weights[name], value)


@pytest.mark.parametrize("given", ["index", "folder", "one file"])
def test_a_port_from_a_path_is_the_port_of_the_weights_in_memory(tmp_path, given):
    state = llama_state()
    expected = porting.canonical_from_state_dict(state, PREFIX, num_heads=HEADS)
    if given == "one file":
        path = tmp_path / "model.safetensors"
        write_safetensors(path, state, {})
    else:
        index = write_shards(tmp_path, state, split_layer_one(state))
        path = index if given == "index" else tmp_path
    same_port(porting.canonical_from_state_dict(path, PREFIX, num_heads=HEADS), expected)
    same_port(porting.canonical_from_state_dict(str(path), PREFIX, num_heads=HEADS), expected)


def test_a_port_reads_the_tensors_of_its_layer_alone(tmp_path, monkeypatch):
    state = llama_state()
    index = write_shards(tmp_path, state, split_layer_one(state))
    read = []
    array = stored.StoredTensor.__array__

    def counted(self, *args, **kwargs):
        read.append(self.entry.key)
        return array(self, *args, **kwargs)

    monkeypatch.setattr(stored.StoredTensor, "__array__", counted)
    porting.from_state_dict(index, PREFIX, num_heads=HEADS, backend="numpy")
    assert sorted(read) == sorted(name for name in state if name.startswith(PREFIX + "."))


def test_read_state_reads_every_tensor_of_the_shards(tmp_path):
    state = llama_state()
    index = write_shards(tmp_path, state, split_layer_one(state))
    for path in (index, tmp_path):
        read = mha.conversion.read_state(path)
        assert read.keys() == state.keys()
        for name, value in state.items():
            assert isinstance(read[name], np.ndarray)
            np.testing.assert_array_equal(read[name], value)
    lazily = mha.conversion.read_state(index, lazily=True)
    assert all(isinstance(x, stored.StoredTensor) for x in lazily.values())
    first = lazily["model.embed_tokens.weight"]
    assert (first.shape, first.dtype, first.ndim) == ((10, HIDDEN), np.dtype("float32"), 2)


def test_an_index_at_odds_with_its_shards_is_refused(tmp_path):
    state = llama_state()
    index = write_shards(tmp_path, state, split_layer_one(state))
    original = json.loads(open(index).read())

    def refused(weight_map, match):
        with open(index, "w") as file:
            json.dump({**original, "weight_map": weight_map}, file)
        with pytest.raises(ValueError, match=match):
            stored.read_lazily(index)

    first, second = sorted(set(original["weight_map"].values()))[:2]
    name = next(n for n, file in original["weight_map"].items() if file == first)
    refused({**original["weight_map"], name: second}, f"places '{name}' in {second}, which does")
    refused({**original["weight_map"], name: "../" + first}, "not a file beside it")
    refused({**original["weight_map"], "missing.weight": first}, "'missing.weight' in")
    refused([], "no weight_map of names to files")
    # One tensor in two shards: either could be the weight
    with open(index, "w") as file:
        json.dump(original, file)
    write_safetensors(tmp_path / second, {name: state[name]}, {})
    with pytest.raises(ValueError, match=f"'{name}' is in two shards"):
        stored.read_lazily(index)
    write_safetensors(tmp_path / "model.safetensors", state, {})
    with pytest.raises(ValueError, match=r"holds both model\.safetensors\.index\.json and"):
        stored.read_lazily(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds neither model\.safetensors\.index\.json nor"):
        stored.read_lazily(tmp_path / "empty")
    # A shard the index names and the folder lacks is named, whatever it holds
    os.remove(tmp_path / "model.safetensors")
    os.remove(tmp_path / first)
    with pytest.raises(FileNotFoundError, match=f"names the shard {first}, which is not beside"):
        stored.read_lazily(index)


def test_a_file_rewritten_after_its_header_was_read_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    state = llama_state()
    write_safetensors(path, state, {})
    tensors = stored.read_lazily(path)
    key, value = f"{PREFIX}.k_proj.weight", f"{PREFIX}.v_proj.weight"
    # The same names, shapes and size, two tensors' numbers swapped: the header's entries
    # would read the other's
    write_safetensors(path, {**state, key: state[value], value: state[key]}, {})
    with pytest.raises(ValueError, match="changed after its header was read"):
        np.asarray(tensors[key])
    write_safetensors(path, {"x": np.zeros(3, "float32")}, {})
    with pytest.raises(ValueError, match="changed after its header was read"):
        np.asarray(tensors[f"{PREFIX}.q_proj.weight"])
    # A FIFO there now would wait for a writer: refused before it is opened
    tensors = stored.read_lazily(path)
    os.remove(path)
    os.mkfifo(path)
    with pytest.raises(ValueError, match="not a regular file"):
        np.asarray(tensors["x"])


def test_paths_given_every_way_and_the_mistakes_named(tmp_path):
    state = llama_state()
    index = write_shards(tmp_path, state, split_layer_one(state))
    expected = porting.canonical_from_state_dict(state, PREFIX, num_heads=HEADS)
    for path in (os.fsencode(index), os.fsencode(tmp_path), f"{tmp_path}{os.sep}"):
        same_port(porting.canonical_from_state_dict(path, PREFIX, num_heads=HEADS), expected)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        stored.read_lazily(tmp_path / "nothing.safetensors")
    (tmp_path / "config.json").touch()
    with pytest.raises(ValueError, match=r"read other files with mha\.conversion\.read_state"):
        stored.read_lazily(tmp_path / "config.json")
    with open(index, "w") as file:
        json.dump({"weight_map": {}}, file)
    with pytest.raises(ValueError, match="weight_map is empty"):
        stored.read_lazily(index)


def test_a_bfloat16_port_widens_to_the_dtype_asked_for(tmp_path):
    """bfloat16 weights into the numpy backend, which computes none: refused as they are;
    with dtype="float32" each weight is the same number (widening is exact), and the layer
    computes as the float32 layer of those numbers."""
    state = llama_state("bfloat16")
    path = tmp_path / "model.safetensors"
    write_safetensors(path, state, {})
    with pytest.raises(ValueError, match="numpy backend"):
        porting.from_state_dict(path, PREFIX, num_heads=HEADS, backend="numpy")
    layer = porting.from_state_dict(path, PREFIX, num_heads=HEADS, backend="numpy", dtype="float32")
    as_object = porting.from_state_dict(path, PREFIX, num_heads=HEADS, backend="numpy",
                                        dtype=np.dtype("float64"))  # fmt: skip
    assert as_object.dtype == "float64"
    wide = {name: value.astype("float32") for name, value in state.items()}
    expected = porting.from_state_dict(wide, PREFIX, num_heads=HEADS, backend="numpy")
    assert layer.dtype == expected.dtype == "float32"
    X = np.random.default_rng(1).standard_normal((2, 3, HIDDEN)).astype("float32")
    np.testing.assert_array_equal(layer(X, X, X), expected(X, X, X))
    for name, value in mha.get_weights(layer).items():
        assert np.array_equal(value, mha.get_weights(expected)[name])
    # The same layer converted to an mha checkpoint, in bfloat16, loads so too
    checkpoint = tmp_path / "layer.safetensors"
    mha.conversion.convert(path, checkpoint, prefix=PREFIX, num_heads=HEADS)
    with pytest.raises(ValueError, match="numpy backend"):
        mha.load(checkpoint, backend="numpy")
    loaded = mha.load(checkpoint, backend="numpy", dtype="float32")
    assert loaded.dtype == "float32"
    np.testing.assert_array_equal(loaded(X, X, X), expected(X, X, X))


def test_loading_into_a_narrower_dtype_refuses_a_weight_it_would_make_inf(tmp_path):
    # A float32 file's weight of 1e5 read into float16 (largest 65504) was inf, silently
    layer = backend_module("numpy").MultiHeadAttention(8, 2, query_size=8, key_size=8,
                                                       value_size=8)  # fmt: skip
    weights = mha.get_weights(layer)
    weights["W_v"][1, 2] = 1e5
    mha.set_weights(layer, weights)
    mha.save(layer, tmp_path / "layer.safetensors")
    with pytest.raises(ValueError, match="W_v holds 100000, past float16's largest number"):
        mha.load(tmp_path / "layer.safetensors", backend="numpy", dtype="float16")
    loaded = mha.load(tmp_path / "layer.safetensors", backend="numpy", dtype="float64")
    assert mha.get_weights(loaded)["W_v"][1, 2] == 1e5


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main([str(a) for a in argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_the_command_line_ports_a_layer_of_a_sharded_model(tmp_path):
    state = llama_state()
    index = write_shards(tmp_path, state, split_layer_one(state))
    destination = tmp_path / "layer1.safetensors"
    code, out, err = run("convert", index, destination, "--prefix", PREFIX, "--num-heads", HEADS)
    assert (code, err) == (0, "")
    expected = porting.canonical_from_state_dict(state, PREFIX, num_heads=HEADS)
    for name, value in read_checkpoint(destination).weights.items():
        np.testing.assert_array_equal(value, expected.weights[name])
    code, out, err = run("inspect", tmp_path, "--prefix", PREFIX, "--num-heads", HEADS)
    assert code == 0 and "q/k/v/o_proj" in out
    # Without --prefix, a folder or an index is a usage error; one shard alone, a hint
    assert run("inspect", tmp_path)[0] == 2
    assert "give --prefix" in run("convert", index, destination)[2]
    shard = next(os.path.join(tmp_path, f) for f in os.listdir(tmp_path) if "-of-" in f)
    code, out, err = run("inspect", shard, "--prefix", PREFIX, "--num-heads", HEADS)
    assert code == 1 and "is one shard of a model: give its model.safetensors.index.json" in err


def test_a_layer_is_never_written_over_the_model_it_is_read_from(tmp_path):
    # The source file, or a shard or the index of a sharded one, named as the destination:
    # refused before anything is written, each file byte for byte as it was
    state = llama_state()
    whole = tmp_path / "whole" / "model.safetensors"
    whole.parent.mkdir()
    write_safetensors(whole, state, {})
    index = write_shards(tmp_path, state, split_layer_one(state))
    shard = os.path.join(tmp_path, "model-00002-of-00003.safetensors")
    cases = [(whole, whole), (whole.parent, whole), (index, shard), (tmp_path, shard)]
    cases.append((shard, shard))
    for source, destination in cases:
        before = open(destination, "rb").read()
        code, _, err = run("convert", source, destination, "--prefix", PREFIX, "--num-heads", 4)
        assert code == 1 and "the source being read" in err, (source, destination)
        assert open(destination, "rb").read() == before
    # Beside the model, a new file is written
    destination = tmp_path / "layer1.safetensors"
    code, _, err = run("convert", tmp_path, destination, "--prefix", PREFIX, "--num-heads", 4)
    assert code == 0, err


def test_a_config_beside_the_weights_is_given_or_said_to_be_left(tmp_path):
    # Llama's q/k/v/o_proj do not tell its rotary embedding, which its config.json beside
    # them does: without --config the port would compute without it, and is refused
    state = llama_state()
    write_safetensors(tmp_path / "model.safetensors", state, {})
    config = {"model_type": "llama", "num_attention_heads": HEADS, "hidden_size": HIDDEN}
    config.update(num_key_value_heads=2, rope_theta=100.0, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    destination = tmp_path / "layer1.safetensors"
    for source in (tmp_path, tmp_path / "model.safetensors"):
        code, _, err = run("convert", source, destination, "--prefix", PREFIX, "--num-heads", 4)
        assert code == 2 and "config.json lies beside the weights: give it as --config" in err
        assert not destination.exists()
    code, _, err = run("convert", tmp_path, destination, "--prefix", PREFIX, "--config",
                       tmp_path / "config.json")  # fmt: skip
    assert code == 0, err
    assert read_checkpoint(destination).config["rope_theta"] == 100.0
    code, _, err = run("inspect", tmp_path, "--prefix", PREFIX, "--num-heads", 4,
                       "--without-positions")  # fmt: skip
    assert code == 0, err


@pytest.mark.torch
def test_transformers_sharded_checkpoint_ports_as_its_state_dict(tmp_path):
    """A tiny Qwen3 saved by transformers in shards of 20 KB: each layer's port from the folder
    (options from the config object) is the port of the model's own state_dict."""
    torch = backend_module("torch").torch
    transformers = required_import("transformers")
    config = transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_hidden_layers=2, intermediate_size=64, vocab_size=100,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    state = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    for layer in range(2):
        options = options_from_config(model.config, layer)
        assert options == options_from_config(tmp_path / "config.json", layer)
        prefix = f"model.layers.{layer}.self_attn"
        same_port(
            porting.canonical_from_state_dict(tmp_path, prefix, **options),
            porting.canonical_from_state_dict(state, prefix, **options),
        )


def test_the_command_line_ports_in_the_dtype_asked_for(tmp_path):
    # --dtype: a bfloat16 model's layer written in float32, each weight the same number; a
    # model whose tensors differ in dtype (float32 sinks beside bfloat16 projections, as a
    # bfloat16 gpt-oss keeps them) is refused without it, naming them, and ported with it
    state = llama_state("bfloat16")
    state[f"{PREFIX}.sinks"] = np.zeros(HEADS, "float32")
    write_safetensors(tmp_path / "model.safetensors", state, {})
    destination = tmp_path / "layer.safetensors"
    arguments = ["convert", tmp_path, destination, "--prefix", PREFIX, "--num-heads", HEADS]
    code, _, err = run(*arguments)
    assert code == 1 and "of several dtypes" in err and "sinks float32" in err
    code, _, err = run(*arguments, "--dtype", "float32")
    assert code == 0, err
    written = read_checkpoint(destination).weights
    port = porting.canonical_from_state_dict(state, PREFIX, num_heads=HEADS, dtype="float32")
    for name, value in port.weights.items():
        assert written[name].dtype == np.float32
        np.testing.assert_array_equal(written[name], value)
    np.testing.assert_array_equal(
        written["W_q"], state[f"{PREFIX}.q_proj.weight"].astype(np.float32).T
    )
    code, _, err = run("convert", destination, tmp_path / "again.safetensors", "--dtype", "float32")
    assert code == 2 and "--dtype goes with --prefix" in err


def test_a_nested_config_beside_the_weights_is_given_by_its_part(tmp_path):
    # A multimodal model's config.json nests its text model's: --config-part names it
    state = llama_state()
    write_safetensors(tmp_path / "model.safetensors", state, {})
    text = {"model_type": "llama", "num_attention_heads": HEADS, "hidden_size": HIDDEN}
    text.update(num_key_value_heads=2, rope_theta=100.0, num_hidden_layers=2)
    vision = {"model_type": "siglip_vision_model", "num_attention_heads": 2, "hidden_size": 8}
    config = {"model_type": "llava", "text_config": text, "vision_config": vision}
    (tmp_path / "config.json").write_text(json.dumps(config))
    destination = tmp_path / "layer1.safetensors"
    arguments = ["convert", tmp_path, destination, "--prefix", PREFIX]
    code, _, err = run(*arguments, "--config", tmp_path / "config.json")
    assert code == 2 and "nests the configs" in err and "--config-part KEY" in err
    code, _, err = run(*arguments, "--config", tmp_path / "config.json", "--config-part", "text")
    assert code == 2 and "no part 'text'; its parts: text_config, vision_config" in err
    code, _, err = run(*arguments, "--config-part", "text_config", "--without-positions")
    assert code == 2 and "--config-part goes with --config" in err
    code, _, err = run(*arguments, "--config", tmp_path / "config.json",
                       "--config-part", "text_config")  # fmt: skip
    assert code == 0, err
    assert read_checkpoint(destination).config["rope_theta"] == 100.0
