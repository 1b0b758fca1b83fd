"""A config that does not write layer_types: each layer gets the window of the kind that
transformers gives it (its config class's rule for the model type), not the window on every
layer. Checked against transformers' own configs, and by hand."""

from __future__ import annotations

import pytest

from conftest import required_import
from mha import porting
from mha.config_fields import READ_BY
from mha.rotary_types import ROTARY

pytestmark = pytest.mark.torch  # transformers' configs

LAYERS = 12
SMALL = {
    "num_hidden_layers": LAYERS,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "sliding_window": 8,
}
# What each model type's configs write that its rule reads (a period, a bound, a switch)
WRITTEN = {
    "cohere2": {"sliding_window_pattern": 3},
    "cohere2_moe": {"first_k_dense_replace": 2, "prefix_dense_sliding_window_pattern": 2},
    "gemma3_text": {"sliding_window_pattern": 4},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    # a rotary embedding per layer type, without which transformers cannot run it
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e4},
            "sliding_attention": None,
        }
    },
    "modernbert": {"global_attn_every_n_layers": 5},
    "modernbert-decoder": {"global_attn_every_n_layers": 4},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 5},
    "qwen2_moe": {"use_sliding_window": True, "max_window_layers": 7},
    "qwen3": {"use_sliding_window": True},  # max_window_layers' default, 28
    "qwen3_moe": {"use_sliding_window": True, "max_window_layers": 5},
    "qwen3_next": {"full_attention_interval": 3},
    "smollm3": {"use_sliding_window": True, "no_rope_layer_interval": 3},
}
# Model types whose configs have no window: a config that writes one is not theirs; latent
# attention's layers have none
NO_WINDOW = {
    "falcon_h1",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "llama4_text",
    "axk1",
    "deepseek_v2",
    "deepseek_v3",
}
NO_WINDOW |= {"glm4_moe_lite", "kimi_k2", "minicpm3", "mistral4", "sarvam_mla", "youtu"}
# MiniMax's model masks its full-attention layers with the window where the config has one
# (tests/test_config_fields.py holds it to the model)
FULL_LAYERS_SLIDE = {"minimax"}
# UltraBERT's, EmbeddingGemma 2's and ModernBERT's bidirectional masks keep the keys within
# the window either side, inclusive: mha's window, strictly within, one more (the family test
# holds it)
EITHER_SIDE = {"embedding_gemma2_text", "modernbert", "openai_privacy_filter", "ultrabert"}


def transformers_kinds(model_type: str, written: dict) -> list[str]:
    """The layer kinds transformers gives a config of the model type (its layer_types after
    its rules; every layer sliding where it has no layer_types and a window it keeps and its
    code reads: READ_BY, which tests/test_config_fields.py holds to the models)."""
    T = required_import("transformers")
    config = T.AutoConfig.for_model(model_type, **written)
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        read = model_type in READ_BY["sliding_window"]
        kind = "sliding_attention" if read and getattr(config, "sliding_window", None) else "full"
        return [kind] * LAYERS
    return list(kinds)


@pytest.mark.parametrize("model_type", sorted(set(ROTARY) - NO_WINDOW - {"falcon"}))
def test_each_layer_gets_the_window_of_the_kind_transformers_gives_it(model_type):
    written = {**SMALL, **WRITTEN.get(model_type, {})}
    kinds = transformers_kinds(model_type, written)
    raw = {"model_type": model_type, **written}  # the config.json, layer_types not written
    for layer, kind in enumerate(kinds):
        if kind not in ("full_attention", "sliding_attention", "full"):
            with pytest.raises(ValueError):  # linear attention, a convolution: not mha's layer
                porting.options_from_config(raw, layer)
            continue
        options = porting.options_from_config(raw, layer)
        windowed = options.get("sliding_window") == 8 + (model_type in EITHER_SIDE)
        slides = kind == "full_attention" and model_type in FULL_LAYERS_SLIDE
        assert windowed == (kind == "sliding_attention" or slides), (layer, kinds)


def test_the_rules_by_hand():
    # Gemma 2's config.json writes no layer_types: its even layers slide, its odd ones do not
    gemma2 = {"model_type": "gemma2", **SMALL}
    assert [porting.options_from_config(gemma2, i).get("sliding_window") for i in range(4)] == [
        8,
        None,
        8,
        None,
    ]
    # Gemma 3's older configs: every sliding_window_pattern-th layer full, the others turned
    # by rope_local_base_freq
    gemma3 = {"model_type": "gemma3_text", **SMALL, "sliding_window_pattern": 3}
    gemma3 |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4}
    bases = [porting.options_from_config(gemma3, i)["rope_theta"] for i in range(6)]
    assert bases == [1e4, 1e4, 1e6, 1e4, 1e4, 1e6]
    # Qwen2's window is off unless use_sliding_window says; on, from max_window_layers
    qwen2 = {"model_type": "qwen2", **SMALL, "max_window_layers": 2}
    assert "sliding_window" not in porting.options_from_config(qwen2, 3)
    qwen2["use_sliding_window"] = True
    assert [porting.options_from_config(qwen2, i).get("sliding_window") for i in range(4)] == [
        None,
        None,
        8,
        8,
    ]
    # Gemma 4's last layer is full whatever layer_types says
    gemma4 = {"model_type": "gemma4_text", **SMALL, "num_hidden_layers": 2}
    gemma4["layer_types"] = ["sliding_attention", "sliding_attention"]
    assert "sliding_window" not in porting.options_from_config(gemma4, 1)
    # A rule needs the layer's index; a pattern that is not a count is refused
    with pytest.raises(
        ValueError, match=r"layers differ \(a full layer every 2, transformers. rule"
    ):
        porting.options_from_config({**gemma2, "num_hidden_layers": None})
    with pytest.raises(ValueError, match="sliding_window_pattern='LLLG' is not a count"):
        porting.options_from_config(
            {"model_type": "exaone4", **SMALL, "sliding_window_pattern": "LLLG"}, 0
        )


@pytest.mark.parametrize("model_type", ["llama4_text", "smollm3"])
@pytest.mark.parametrize("written", [{}, {"no_rope_layer_interval": 3}, {"no_rope_layers": []}])
def test_layers_without_rotary_embeddings_where_no_rope_layers_is_not_written(model_type, written):
    # SmolLM3's and Llama 4's every no_rope_layer_interval-th layer turns nothing, as
    # transformers makes no_rope_layers (Llama 4's where the list is empty too)
    if model_type == "smollm3" and written == {"no_rope_layers": []}:
        written = {"no_rope_layers": [1] * LAYERS}  # SmolLM3 reads an empty list as it is
    T = required_import("transformers")
    small = {key: value for key, value in SMALL.items() if key != "sliding_window"}
    config = T.AutoConfig.for_model(model_type, **small, **written)
    raw = {"model_type": model_type, **small, **written}
    for layer, turned in enumerate(config.no_rope_layers):
        options = porting.options_from_config(raw, layer)
        assert ("rope_theta" in options) == bool(turned), (layer, config.no_rope_layers)
    if not all(config.no_rope_layers):
        with pytest.raises(ValueError, match="layers differ"):
            porting.options_from_config({**raw, "num_hidden_layers": None})


@pytest.mark.parametrize("layers", [4, 8, 12])
@pytest.mark.parametrize("model_type", ["embedding_gemma2_text", "gemma4_text"])
def test_the_last_layer_is_full_whatever_the_rule_says(model_type, layers):
    # Without layer_types every sixth layer is full, and transformers makes the last one full
    written = {**SMALL, "num_hidden_layers": layers}
    kinds = transformers_kinds(model_type, written)
    assert kinds[-1] == "full_attention"
    raw = {"model_type": model_type, **written}
    windows = [porting.options_from_config(raw, i).get("sliding_window") for i in range(layers)]
    assert [window is None for window in windows] == [k == "full_attention" for k in kinds]
    with pytest.raises(ValueError, match="does not tell which it is"):
        porting.options_from_config({k: v for k, v in raw.items() if k != "num_hidden_layers"}, 0)
