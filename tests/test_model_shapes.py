"""A port takes the number of heads from the model's config and the rest from the weights;
`options_from_config` gives the heads the config builds (head_size, num_kv_heads), and a port
refuses weights without them (mha.model_shapes), as transformers refuses to load them.

For every model type mha has checked, a tiny model whose config writes a head_dim twice
hidden_size / num_attention_heads and fewer key-value heads than heads, which some model
types' code reads and others' does not: each layer ports with its own config, and with the
config of twice the heads, each layer is refused where transformers cannot load the weights
and gives the numbers of transformers' model where it can.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import framework_import
from mha import cli, porting
from mha.config_fields import PLAIN
from mha.rotary_types import ROTARY

torch = framework_import("torch", module_level=True)  # transformers' models are torch modules
pytestmark = pytest.mark.torch

from test_config_fields import CAUSAL_PLAIN, HELD_ELSEWHERE, PLAIN_SIZES  # noqa: E402
from test_families import (  # noqa: E402
    OWN_SIZES,
    assert_each_layer_ports,
    attention_layers,
    tiny_model,
)

# Heads of 16 features where the code reads head_dim (T5's d_kv), of 32 / 4 where it does not
# (Falcon's config has no head_dim to write); SIZES gives 2 key-value heads of 4
OTHER_HEAD = {"t5": {"d_kv": 16, "head_dim": None}, "falcon": {}}
# Multi-head latent attention's model types: its heads are its own (test_latent_attention.py)
LATENT = frozenset(model_type for model_type, sizes in OWN_SIZES.items() if "kv_lora_rank" in sizes)
# Model types whose own model fails on a head_dim other than hidden_size / num_attention_heads
# (their rotary embedding sizes heads otherwise than their projections): the head_dim they
# are given is that
SAME_HEAD = frozenset(
    (
        "esm esmc glm4v_moe_text glm4v_text glm_image_text glm_ocr_text helium modernbert "
        "modernbert-decoder olmoe qwen2_5_vl_text qwen2_vl_text stablelm"
    ).split()
)
CHECKED = sorted((ROTARY.keys() | PLAIN) - LATENT)
# The refusal (LFM3's: its gate of each head, read first)
REFUSED = r"do not have the config's heads|not one gate row for each of 8 heads"


def _model(model_type: str, heads: int = 4):
    """A tiny model of the type with `heads` heads (its decoder's too), of OTHER_HEAD."""
    sizes = {**PLAIN_SIZES.get(model_type, {}), **HELD_ELSEWHERE.get(model_type, ({},))[0]}
    if model_type not in SAME_HEAD:
        sizes.update(OTHER_HEAD.get(model_type, {"head_dim": 16}))
    sizes["num_attention_heads"] = heads
    if "decoder_attention_heads" in sizes:  # BART's and Whisper's: both as many
        sizes["decoder_attention_heads"] = heads
    if model_type == "whisper":  # its config reads num_key_value_heads as the encoder's heads
        sizes["num_key_value_heads"] = None
    return tiny_model(model_type, attn_implementation="eager", **sizes)


def _causal(model_type: str) -> bool | None:
    return model_type in CAUSAL_PLAIN if model_type in PLAIN else None  # None: the family's


def _written(model_type: str, config) -> dict:
    return {**config.to_dict(), "model_type": model_type}


@pytest.mark.parametrize("model_type", CHECKED)
def test_each_layer_ports_with_the_heads_its_code_builds(model_type):
    config, model = _model(model_type)
    for layer in attention_layers(model, config):  # the check is in force on each
        options = porting.options_from_config(_written(model_type, config), layer)
        assert {"head_size", "num_kv_heads", "query_size"} <= options.keys(), layer
    if model_type not in HELD_ELSEWHERE:
        causal = _causal(model_type)
        assert_each_layer_ports(model_type, model, config, _written(model_type, config), causal)
        return
    # T5's, Whisper's and ViT's inputs are their own (test_porting.py holds their numbers): the
    # port splits each layer into the heads of the model's own modules
    for prefix, _ in porting.find_attention(model.state_dict()):
        layer = int(next(part for part in prefix.split(".") if part.isdigit()))
        options = porting.options_from_config(_written(model_type, config), layer)
        given = {} if "num_heads" in options else {"num_heads": 4}  # Whisper's: not told
        port = porting.canonical_from_state_dict(model.state_dict(), prefix, **given, **options)
        module = model.get_submodule(prefix)
        heads = next(
            getattr(module, name)
            for name in ("n_heads", "num_heads", "num_attention_heads")
            if hasattr(module, name)
        )
        assert port.config["num_heads"] == heads, prefix


@pytest.mark.parametrize("model_type", CHECKED)
def test_a_config_of_twice_the_heads_ports_only_where_transformers_loads_the_weights(model_type):
    # transformers refuses a checkpoint whose tensors' shapes are not its model's: where the
    # attention's differ, the port is refused; where they do not (the model type derives
    # head size and key-value heads from the heads), it gives transformers' numbers
    _, model = _model(model_type)
    other_config, other = _model(model_type, heads=8)
    state, own = model.state_dict(), other.state_dict()
    differ = {name for name in state if name in own and state[name].shape != own[name].shape}
    other.load_state_dict({k: v for k, v in state.items() if k not in differ}, strict=False)
    written = _written(model_type, other_config)
    layers = attention_layers(other, other_config)
    refused = {layer for layer, (prefix, _) in layers.items() if f"{prefix}." in _prefixes(differ)}
    for layer in refused:
        options = porting.options_from_config(written, layer)
        with pytest.raises(ValueError, match=REFUSED):
            porting.canonical_from_state_dict(state, layers[layer][0], **options)
    if refused:
        assert refused == layers.keys()
    elif model_type != "whisper":  # Whisper's inputs are its own: test_porting.py
        assert_each_layer_ports(model_type, other, other_config, written, _causal(model_type))


def _prefixes(names: set[str]) -> set[str]:
    """Every prefix ending in "." of the names."""
    return {name[: i + 1] for name in names for i, char in enumerate(name) if char == "."}


def _llama_state(hidden: int, heads: int, kv_heads: int, head: int) -> dict:
    rng = np.random.default_rng(0)
    shapes = {
        "q_proj": (heads * head, hidden),
        "k_proj": (kv_heads * head, hidden),
        "v_proj": (kv_heads * head, hidden),
        "o_proj": (hidden, heads * head),
    }
    return {
        f"model.layers.0.self_attn.{name}.weight": rng.standard_normal(shape).astype(np.float32)
        for name, shape in shapes.items()
    }


# Llama-3-8B's heads in small (hidden 64: 8 heads of 8, 2 key-value heads), and a config of
# 70B's (twice the hidden size and heads, as many key-value heads)
EIGHT_B = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rope_theta": 500000.0,
}
SEVENTY_B = {**EIGHT_B, "hidden_size": 128, "num_attention_heads": 16}


def test_the_config_of_a_larger_model_beside_the_weights_is_refused_naming_both():
    state, prefix = _llama_state(64, 8, 2, 8), "model.layers.0.self_attn"
    options = porting.options_from_config(EIGHT_B)
    assert options["head_size"] == 8 and options["num_kv_heads"] == 2
    assert porting.canonical_from_state_dict(state, prefix, **options).config["num_kv_heads"] == 2
    # 16 heads of the 64 rows would be heads of 4 with 4 key-value heads, which transformers
    # cannot load: heads of 128 / 16 = 8, 2 key-value heads
    options = porting.options_from_config(SEVENTY_B)
    message = (
        r"split into num_heads=16, they hold heads of 4 features, 4 key-value heads and inputs "
        r"of 64 features, where the config gives head_size=8, num_kv_heads=2, query_size=128"
    )
    with pytest.raises(ValueError, match=message):
        porting.from_state_dict(state, prefix, backend="numpy", **options)


def test_the_config_of_a_model_of_as_many_rows_and_other_inputs_is_refused():
    # Gemma-2-9B's and 27B's projections have as many rows (16 heads of 256, 32 of 128; 8 and
    # 16 key-value heads) from inputs of 3584 and 4608 features: in small, 4 heads of 8 from 24
    # beside a config of 2 heads of 16 from 16
    state, prefix = _llama_state(24, 4, 2, 8), "model.layers.0.self_attn"
    other = {**EIGHT_B, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1}
    other["head_dim"] = 16
    options = porting.options_from_config(other)
    assert (options["head_size"], options["num_kv_heads"], options["query_size"]) == (16, 1, 16)
    with pytest.raises(ValueError, match=r"inputs of 24 features, where .* query_size=16 "):
        porting.canonical_from_state_dict(state, prefix, **options)


def test_heads_given_by_hand_are_checked_as_the_configs(tmp_path):
    state, prefix = _llama_state(64, 8, 2, 8), "model.layers.0.self_attn"
    layer = porting.from_state_dict(
        state, prefix, backend="numpy", num_heads=8, head_size=8, num_kv_heads=2, rope_theta=1e4
    )
    assert layer.num_kv_heads == 2
    with pytest.raises(ValueError, match=r"where the config gives num_kv_heads=1 \("):
        porting.from_state_dict(state, prefix, num_heads=8, num_kv_heads=1, rope_theta=1e4)
    for wrong in (0, 2.5, "8", True):
        with pytest.raises(ValueError, match="head_size"):
            porting.from_state_dict(state, prefix, num_heads=8, head_size=wrong, rope_theta=1e4)


def test_mha_convert_with_the_config_of_another_model_exits_1_and_writes_nothing(tmp_path, capsys):
    safetensors = pytest.importorskip("safetensors.numpy")
    source, destination = tmp_path / "model.safetensors", tmp_path / "layer.safetensors"
    safetensors.save_file(_llama_state(64, 8, 2, 8), str(source))
    (tmp_path / "config.json").write_text(json.dumps(SEVENTY_B))
    arguments = ["convert", str(source), str(destination), "--prefix", "model.layers.0.self_attn"]
    assert cli.main([*arguments, "--config", str(tmp_path / "config.json")]) == 1
    assert "do not have the config's heads" in capsys.readouterr().err
    assert not destination.exists()
    # The layer alone, converted, then converted again with a config of as many heads, twice
    # their size: refused too
    (tmp_path / "config.json").write_text(json.dumps(EIGHT_B))
    assert cli.main([*arguments, "--config", str(tmp_path / "config.json")]) == 0, (
        capsys.readouterr().err
    )
    (tmp_path / "config.json").write_text(json.dumps({**EIGHT_B, "hidden_size": 128}))
    again = ["convert", str(destination), str(tmp_path / "again.safetensors")]
    assert cli.main([*again, "--config", str(tmp_path / "config.json")]) == 1
    assert "do not have the config's heads" in capsys.readouterr().err
    assert not (tmp_path / "again.safetensors").exists()


def test_latent_attention_has_no_config_heads_and_refuses_another_models():
    # DeepSeek-V3's heads are the latent layer's own; a Llama config's heads beside its
    # weights say the config is another model's
    config, model = tiny_model("deepseek_v3")
    options = porting.options_from_config(_written("deepseek_v3", config), 1)
    assert "head_size" not in options and "num_kv_heads" not in options
    llama = porting.options_from_config({**EIGHT_B, "hidden_size": 32, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="latent attention's, whose heads no head_size"):
        porting.from_state_dict(model.state_dict(), "layers.1.self_attn", **llama)


def test_gemma4_saved_by_transformers_keeps_its_full_layers_heads(tmp_path):
    # transformers writes Gemma 4's full layers' heads as per_layer_config, its keys padded
    # with zeros ("05" beside "11"), where the released config.json writes global_head_dim
    # and num_global_key_value_heads
    kinds = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    config, model = tiny_model("gemma4_text", layer_types=kinds, num_hidden_layers=12)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert set(saved["per_layer_config"]) == {"05", "11"}
    state = model.state_dict()
    for layer in (4, 5, 11):
        options = porting.options_from_config(saved, layer)
        attention = model.layers[layer].self_attn
        assert options["head_size"] == attention.head_dim
        assert options["num_kv_heads"] * attention.head_dim == attention.k_proj.out_features
        porting.canonical_from_state_dict(state, f"layers.{layer}.self_attn", **options)
    # Full layers of the others' heads: transformers saves no entry for them
    same = {"global_head_dim": 8, "num_global_key_value_heads": 2, "attention_k_eq_v": False}
    config, model = tiny_model("gemma4_text", **same)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["per_layer_config"] == {}
    options = porting.options_from_config(saved, 1)
    assert (options["head_size"], options["num_kv_heads"]) == (8, 2)
    porting.canonical_from_state_dict(model.state_dict(), "layers.1.self_attn", **options)
