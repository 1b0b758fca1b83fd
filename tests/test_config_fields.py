"""A config that writes fields its model type's code does not read ports as transformers runs
it: for every rotary model type, a tiny model whose config writes every field of
mha.config_fields.READ_BY (a window, Qwen2's rules of which layers slide, Gemma's scalar
and soft cap, Granite's multiplier, GPT-J's rotary_dim, layers without a rotary embedding or
with a base of their own, GPT-2's scales) and a fraction of each head turned,
each layer ported from the config as transformers writes it and as written, against the
model's own attention (its eager attention, which applies every field it reads)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import framework_import
from mha import porting
from mha.config_defaults import DEFAULTS
from mha.config_fields import PLAIN, READ_BY, UNREAD, UNREAD_WITHOUT_ROTARY, without_unread
from mha.rotary_types import ROTARY

torch = framework_import("torch", module_level=True)  # transformers' models are torch modules
pytestmark = pytest.mark.torch

from test_families import (  # noqa: E402  (after the skip: they build torch models)
    OWN_SIZES,
    SIZES,
    assert_each_layer_ports,
    tiny_model,
)

# A value of each field that changes a layer's numbers where the field is read: a window
# within the sequence, every layer past the first sliding (max_window_layers), scales
WRITTEN = {
    "sliding_window": 3,
    "max_window_layers": 1,
    "query_pre_attn_scalar": 3,
    "attn_logit_softcapping": 2.0,
    "attention_multiplier": 0.3,
    "rotary_dim": 2,
    "no_rope_layers": [0, 1, 1, 0],
    "layer_rope_theta": [100.0, 0, 500.0, 0],
    "scale_attn_weights": False,
    "scale_attn_by_inverse_layer_idx": True,
}
# Written where they are not read: their readers' own tests hold them (Llama 4's chunks in
# the family test, the sliding layers' rules in test_layer_kinds.py)
WRITTEN_UNREAD = {
    "attention_chunk_size": 3,
    "sliding_window_pattern": 2,
    "rope_scaling_layers": [0, 2],
}
# Model types that slide every layer whatever layer_types say, given one that says otherwise
SOME_FULL = ["full_attention", "sliding_attention"] * 2
# Latent attention whose rotary part transformers turns in part with the fraction (under its
# default rotary embedding or a scaled one), which mha's layer refuses, naming it
PART_OF_LATENT = frozenset({"glm4_moe_lite", "minicpm3", "youtu"})


@pytest.mark.parametrize("written", ["config.json", "as written"])
@pytest.mark.parametrize("use_sliding_window", [True, False])
@pytest.mark.parametrize("model_type", sorted(ROTARY))
def test_fields_a_model_type_does_not_read_leave_its_port_as_transformers_runs_it(
    model_type, use_sliding_window, written
):
    # Without a window, half of each head turned: the model types whose code turns whole
    # heads ignore it under their default rotary embedding, and fail on it under a scaled one
    # (written as True for the model types that read it: IQuest-Coder refuses it)
    changes = dict(WRITTEN)
    changes.update((k, v) for k, v in WRITTEN_UNREAD.items() if k in UNREAD[model_type])
    if not use_sliding_window:
        changes.update(use_sliding_window=False, partial_rotary_factor=0.5)
    elif model_type in READ_BY["use_sliding_window"]:
        changes["use_sliding_window"] = True
    if "layer_types" in UNREAD[model_type] and use_sliding_window:
        changes["layer_types"] = SOME_FULL
    try:
        config, model = tiny_model(model_type, attn_implementation="eager", **changes)
        model(input_ids=torch.tensor([[1, 2, 3]]))
    except (RuntimeError, ValueError) as error:  # transformers cannot run the config
        assert not use_sliding_window, error
        with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5"):
            porting.options_from_config(_written(model_type, changes), 0)
        return
    if written == "config.json":
        config_dict = {**config.to_dict(), "model_type": model_type}
    else:
        config_dict = _written(model_type, changes)
    if model_type in PART_OF_LATENT and not use_sliding_window:
        with pytest.raises(ValueError, match="rotates 2 of the 4 features of the rotary part"):
            assert_each_layer_ports(model_type, model, config, config_dict)
        return
    assert_each_layer_ports(model_type, model, config, config_dict)


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma3n_text", "olmo3"])
def test_a_top_level_fraction_beside_rotary_parameters_of_each_layer_type(model_type):
    # Their config classes copy a top-level partial_rotary_factor into each layer type's
    # parameters: under the full layers' YaRN it was not read (a whole head turned, where
    # transformers fails or broadcasts); now refused as the same fraction written nested is,
    # and under the sliding layers' default embedding ignored, as transformers' code does
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    yarn["original_max_position_embeddings"] = 4
    default = {"rope_type": "default", "rope_theta": 1e4}
    layers = {"full_attention": yarn, "sliding_attention": default}
    kinds = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    top = _written(model_type, {**kinds, "rope_parameters": layers, "partial_rotary_factor": 0.5})
    nested = {k: {**v, "partial_rotary_factor": 0.5} for k, v in layers.items()}
    for config in (top, {**top, "rope_parameters": nested}):
        with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5\) under a 'yarn'"):
            porting.options_from_config(config, 1)
        assert "rope_dim" not in porting.options_from_config(config, 0)


def _written(model_type: str, changes: dict) -> dict:
    sizes = {**SIZES, **OWN_SIZES.get(model_type, {}), **changes, "model_type": model_type}
    return {key: value for key, value in sizes.items() if value is not None}


# Written to a model type without a rotary embedding beside WRITTEN: a rotary embedding, the
# layers' kinds, and an attention mha's layer refuses, none of which its code reads
WRITTEN_WITHOUT_ROTARY = {
    "rope_theta": 100.0,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "partial_rotary_factor": 0.5,
    "rope_interleave": True,
    "layer_types": ["sliding_attention"] * 4,
    "use_qk_norm": True,
    "qk_layernorm": True,
    "clip_qkv": 0.1,
    "attn_temperature_tuning": True,
    "use_bidirectional_attention": True,
    "alibi": True,
    "rotary_value": True,
}
# The PLAIN model types whose attention is causal (the others' attends both ways)
CAUSAL_PLAIN = frozenset(
    (
        "biogpt bloom clip_text_model gpt-sw3 gpt2 gpt_neo imagegpt jamba mpt nemotron_h "
        "openai-gpt opt xglm"
    ).split()
)
# BART's sizes: its decoder's heads and layers as its encoder's
_HEADS_ALIKE = {
    "decoder_attention_heads": SIZES["num_attention_heads"],
    "decoder_layers": SIZES["num_hidden_layers"],
}
PLAIN_SIZES = {
    **dict.fromkeys(
        "bart blenderbot blenderbot-small m2m_100 marian mbart mvp pegasus plbart".split(),
        _HEADS_ALIKE,
    ),
    # GPT-Neo's layers global and local in turn, each local one within the last 3 positions
    "gpt_neo": {"attention_types": [[["global", "local"], 2]], "window_size": 3},
    # Jamba's every second layer attention (its default: one in 8, from the fifth)
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
}
# Model types whose config refuses a layer_types of sliding layers (Nemotron-H's names its
# kinds of layers, which it reads; Jamba's derives them) or whose model fails on one (GPT-Neo's)
NO_SLIDING_LAYER_TYPES = frozenset({"gpt_neo", "jamba", "nemotron_h"})


# PLAIN model types whose ports test_porting.py holds to their models (T5's position bias
# given at each call, Whisper's audio and ViT's images as inputs): their sizes and inputs
HELD_ELSEWHERE = {
    "t5": ({"d_kv": 8, "num_decoder_layers": 4}, "input_ids"),
    "whisper": (
        {"decoder_attention_heads": 4, "decoder_layers": 4, "max_source_positions": 8},
        "input_features",
    ),
    "vit": ({"image_size": 8, "patch_size": 2}, "pixel_values"),
}


@pytest.mark.parametrize("written", ["config.json", "as written"])
@pytest.mark.parametrize("model_type", sorted(PLAIN - HELD_ELSEWHERE.keys()))
def test_a_model_type_without_a_rotary_embedding_ports_as_transformers_runs_it(model_type, written):
    # A window, Qwen2's rules, scalars, GPT-2's scales (which GPT-2's code reads), a rotary
    # embedding and what mha refuses, in a config of BERT, GPT-2, BART, BLOOM, MPT, ...
    changes = {**WRITTEN, **WRITTEN_UNREAD, **WRITTEN_WITHOUT_ROTARY, "use_sliding_window": True}
    changes.update(PLAIN_SIZES.get(model_type, {}))
    if model_type in NO_SLIDING_LAYER_TYPES:
        del changes["layer_types"]
    config, model = tiny_model(model_type, attn_implementation="eager", **changes)
    if written == "config.json":
        config_dict = {**config.to_dict(), "model_type": model_type}
    else:
        config_dict = _written(model_type, changes)
    causal = model_type in CAUSAL_PLAIN
    assert_each_layer_ports(model_type, model, config, config_dict, causal=causal)


@pytest.mark.parametrize("model_type", sorted(HELD_ELSEWHERE))
def test_t5_whisper_and_vit_run_and_port_alike_with_fields_they_do_not_read(model_type):
    # The model's output and every layer's port options are those of its config without them
    sizes, inputs = HELD_ELSEWHERE[model_type]
    fields = {**WRITTEN, **WRITTEN_UNREAD, **WRITTEN_WITHOUT_ROTARY, "use_sliding_window": True}
    (plain, plain_model), (config, model) = (
        tiny_model(model_type, attn_implementation="eager", **sizes, **changes)
        for changes in ({}, fields)
    )
    generator = torch.Generator().manual_seed(0)
    if inputs == "input_ids":
        given = {
            "input_ids": torch.tensor([[5, 17, 3, 42]]),
            "decoder_input_ids": torch.tensor([[1, 2]]),
        }
    elif inputs == "input_features":
        features = torch.randn(1, plain.num_mel_bins, 16, generator=generator)
        given = {"input_features": features, "decoder_input_ids": torch.tensor([[1, 2]])}
    else:
        given = {"pixel_values": torch.randn(1, 3, 8, 8, generator=generator)}
    with torch.no_grad():
        assert torch.equal(model(**given)[0], plain_model(**given)[0])
    for before, after in (
        (plain.to_dict(), config.to_dict()),
        (_written(model_type, sizes), _written(model_type, {**sizes, **fields})),
    ):
        for layer in range(SIZES["num_hidden_layers"]):
            expected = porting.options_from_config({**before, "model_type": model_type}, layer)
            assert porting.options_from_config({**after, "model_type": model_type}, layer) == (
                expected
            )


def test_the_fields_read_by_a_few_are_the_fields_written():
    assert set(READ_BY) == set(WRITTEN) | set(WRITTEN_UNREAD) | {"use_sliding_window"}
    # transformers' configs write a rotary embedding's rope_parameters from rope_scaling
    assert UNREAD_WITHOUT_ROTARY == set(WRITTEN_WITHOUT_ROTARY) | {"rope_parameters"}
    assert not PLAIN & set(ROTARY)
    # A default of a field the model type's code does not read would be dropped then read
    for model_type, defaults in DEFAULTS.items():
        assert not set(defaults) & UNREAD.get(model_type, set()), model_type


def test_a_config_without_a_model_type_mha_has_checked_is_read_as_written():
    # A window in a Llama config is dropped; in a config of no model type, or of one mha has
    # not checked, it is read
    llama = {"model_type": "llama", "num_attention_heads": 4, "sliding_window": 3}
    assert "sliding_window" not in porting.options_from_config(llama)
    assert without_unread({**llama, "model_type": "mistral"}) == {**llama, "model_type": "mistral"}
    for other in ({}, {"model_type": "a_model_of_its_own"}):
        config = {**llama, **other} if other else {"num_attention_heads": 4, "sliding_window": 3}
        assert porting.options_from_config(config)["sliding_window"] == 3


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma3n_text", "olmo3", "modernbert"])
def test_an_older_rotary_type_their_code_does_not_read_is_refused(model_type):
    # transformers nests their rope_scaling per layer type and does not read its older key
    # 'type': the model runs unscaled, which mha will not guess was meant. Layer 3 is full
    full = {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    kinds = full if model_type == "gemma3_text" else {}
    scaled = {"rope_scaling": {"type": "linear", "factor": 2.0}, **kinds}
    (_, model), (_, plain) = tiny_model(model_type, **scaled), tiny_model(model_type, **kinds)
    ids = torch.tensor([[5, 17, 3, 42, 8, 29, 11]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids)[0], plain(input_ids=ids)[0])
    with pytest.raises(ValueError, match="under 'type', which transformers' code"):
        porting.options_from_config(_written(model_type, scaled), 3)
    written = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, **kinds}
    assert porting.options_from_config(_written(model_type, written), 3)["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 2.0,
    }


@pytest.mark.parametrize(
    ("model_type", "other"), [("molmo2_text", "layer_norm_eps"), ("lfm3", "rms_norm_eps")]
)
def test_a_qk_norm_eps_under_its_other_name_ports_as_transformers_runs_it(model_type, other):
    # Their config classes take the eps of their QK-norms under another name too (LFM3's
    # sizes write its own, norm_eps, which the other overrides)
    changes = {other: 0.3}
    config, model = tiny_model(model_type, attn_implementation="eager", **changes)
    assert_each_layer_ports(model_type, model, config, _written(model_type, changes))


@pytest.mark.parametrize("written", ["config.json", "as written"])
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
    ],
    ids=["linear", "yarn"],
)
def test_molmo2_scales_its_rotary_embedding_on_the_layers_it_names(rope, written):
    # rope_scaling_layers: the others turn by the same base, unscaled
    changes = {
        "rope_parameters": {**rope, "rope_theta": 100.0},
        "max_position_embeddings": 16,
        "rope_scaling_layers": [0, 2],
    }
    config, model = tiny_model("molmo2_text", attn_implementation="eager", **changes)
    if written == "config.json":
        config_dict = {**config.to_dict(), "model_type": "molmo2_text"}
    else:
        config_dict = _written("molmo2_text", changes)
    assert_each_layer_ports("molmo2_text", model, config, config_dict)
    options = [porting.options_from_config(config_dict, layer) for layer in range(4)]
    assert ["rope_scaling" in each for each in options] == [True, False, True, False]
    with pytest.raises(ValueError, match="give the layer's index"):
        porting.options_from_config(config_dict)
    # Without a count of layers, no index: whether the layer is scaled is not told
    with pytest.raises(ValueError, match="rope_scaling_layers does not tell layer None"):
        porting.options_from_config({**config_dict, "num_hidden_layers": None})


@pytest.mark.parametrize("written", ["config.json", "as written"])
@pytest.mark.parametrize("window", [4, 5])
def test_embeddinggemma_attends_both_ways_within_half_its_window(window, written):
    # Gemma 3 with use_bidirectional_attention: every layer attends both ways, the sliding
    # ones to |i - j| < sliding_window // 2 + 1 (transformers halves the written window)
    changes = {
        "use_bidirectional_attention": True,
        "sliding_window": window,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }
    config, model = tiny_model("gemma3_text", attn_implementation="eager", **changes)
    if written == "config.json":
        config_dict = {**config.to_dict(), "model_type": "gemma3_text"}
    else:
        config_dict = _written("gemma3_text", changes)
    assert porting.options_from_config(config_dict, 0)["sliding_window"] == 3
    assert_each_layer_ports("gemma3_text", model, config, config_dict, causal=False)


# Counts, sizes and scalars that are not: each refused naming its field, where int() would
# round a window of 2.5 positions to 2 (transformers' mask keeps 3) and a bool to 1
MISTRAL = {"model_type": "mistral", "num_attention_heads": 4, "hidden_size": 32}
MUSE_GLIMMER = {"model_type": "muse_glimmer_text", "num_attention_heads": 4, "num_hidden_layers": 1}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**MISTRAL, "sliding_window": 2.5}, "sliding_window=2.5 is not a positive whole"),
        ({**MISTRAL, "sliding_window": True}, "sliding_window=True is not a positive whole"),
        ({**MISTRAL, "sliding_window": "4096"}, "sliding_window='4096' is not a positive"),
        ({**MISTRAL, "sliding_window": 0}, "sliding_window=0 is not a positive whole"),
        ({**MISTRAL, "head_dim": 8.5}, "head_dim=8.5 is not a positive whole"),
        ({**MISTRAL, "rope_scaling": "linear"}, "rope_scaling is not a mapping: 'linear'"),
        # UltraBERT's older configs: a window and a base per layer, which transformers maps
        # to layer_types and rope_parameters, and mha asks for
        (
            {**MISTRAL, "model_type": "ultrabert", "rope_theta": [1e4, 1e6]},
            "rope_theta=.* is not a",
        ),
        (
            {**MISTRAL, "model_type": "ultrabert", "attention_windows": [128, 0]},
            "attention_windows=.* gives each layer's window",
        ),
        (
            {"model_type": "gptj", "n_head": 4, "n_embd": 32, "rotary_dim": 2.5},
            "rotary_dim=2.5 is not a positive whole",
        ),
        (
            {"model_type": "gpt_neo", "num_heads": 4, "attention_types": [[["local"], 1]]}
            | {"window_size": -1},
            "window_size=-1 is not a positive whole",
        ),
        (
            {"model_type": "gemma2", "num_attention_heads": 4, "query_pre_attn_scalar": 0},
            "query_pre_attn_scalar=0 is not a positive finite number",
        ),
        (
            {"model_type": "gemma2", "num_attention_heads": 4, "query_pre_attn_scalar": -1},
            "query_pre_attn_scalar=-1 is not a positive finite number",
        ),
        (
            {"model_type": "qwen2", "num_attention_heads": 4, "sliding_window": 4}
            | {"use_sliding_window": True, "max_window_layers": "2"},
            "max_window_layers='2' is not a count of layers",
        ),
        ({**MISTRAL, "num_attention_heads": "4"}, "num_attention_heads='4' is not a positive"),
        ({**MISTRAL, "num_attention_heads": 0}, "num_attention_heads=0 is not a positive whole"),
        (
            {**MISTRAL, "hidden_size": "32", "partial_rotary_factor": 0.5},
            "hidden_size='32' is not a positive whole",
        ),
        ({**MISTRAL, "rope_theta": 0}, "rope_theta=0 is not a positive finite number"),
        ({**MISTRAL, "rope_theta": float("nan")}, "rope_theta=nan is not a positive finite"),
        (
            {**MISTRAL, "model_type": "phi", "partial_rotary_factor": 1.5},
            r"partial_rotary_factor=1\.5 is not a fraction in \(0, 1\]",
        ),
        (
            {**MISTRAL, "model_type": "phi", "partial_rotary_factor": "0.5"},
            "partial_rotary_factor='0.5' is not a fraction",
        ),
        (
            {"model_type": "gemma2", "num_attention_heads": 4, "attn_logit_softcapping": 0},
            "attn_logit_softcapping=0 is not a positive finite number",
        ),
        (
            {"model_type": "granite", "num_attention_heads": 4, "attention_multiplier": "0.5"},
            "attention_multiplier='0.5' is not a positive finite number",
        ),
        # Muse Glimmer's queries times qk_scale_factor: a scale that needs the head size
        (
            {**MUSE_GLIMMER, "head_dim": None},
            "qk_scale_factor=3.87 scales the scores by the head size",
        ),
        (
            {**MUSE_GLIMMER, "qk_scale_factor": 0},
            "qk_scale_factor=0 is not a positive finite number",
        ),
    ],
    ids=lambda value: (
        "-".join(map(str, list(value.items())[-1])) if isinstance(value, dict) else None
    ),
)
def test_a_count_or_scalar_that_is_not_one_is_refused_naming_its_field(config, message):
    with pytest.raises(ValueError, match=message):
        porting.options_from_config(config, 0)


def test_whole_numbers_written_as_floats_are_read_as_whole():
    # JSON writers may write 4096.0: the same window as transformers' mask of 4096
    assert (
        porting.options_from_config({**MISTRAL, "sliding_window": 4096.0})["sliding_window"] == 4096
    )
    assert porting.options_from_config({**MISTRAL, "num_attention_heads": 4.0})["num_heads"] == 4
    qwen2 = {"model_type": "qwen2", "num_attention_heads": 4, "sliding_window": 4}
    config = {**qwen2, "use_sliding_window": True, "max_window_layers": 1.0}
    assert "sliding_window" not in porting.options_from_config(config, 0)
    assert porting.options_from_config(config, 1)["sliding_window"] == 4
    # A config built in Python may hold numpy's numbers: read as the numbers they are
    numbers = {
        "sliding_window": np.int64(8),
        "head_dim": np.int64(8),
        "rope_theta": np.float32(1e4),
    }
    options = porting.options_from_config({**MISTRAL, **numbers})
    assert options["sliding_window"] == 8 and type(options["sliding_window"]) is int
    assert options["rope_theta"] == 1e4


def test_a_scale_near_the_default_is_kept_as_written():
    # Granite's scores times attention_multiplier: 0.1251 is not 64 ** -0.5 = 0.125, by 0.08%
    granite = {"model_type": "granite", "num_attention_heads": 4, "hidden_size": 256}
    assert (
        porting.options_from_config({**granite, "attention_multiplier": 0.1251})["scale"] == 0.1251
    )
    assert "scale" not in porting.options_from_config({**granite, "attention_multiplier": 0.125})


@pytest.mark.parametrize("layer", [-1, 2])
def test_a_layer_index_outside_the_configs_layers_is_refused(layer):
    # Two layers are indices 0 and 1: -1 would read the last layer's type, 2 one past it
    config = {**MISTRAL, "num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2}
    assert porting.options_from_config(config, 1)["num_heads"] == 4
    with pytest.raises(ValueError, match=f"Received: layer={layer}"):
        porting.options_from_config(config, layer)
    # The count alone tells them, JSON's 2.0 as 2 (a count read as none let layer 2 through)
    for count in (2, 2.0):
        with pytest.raises(ValueError, match=f"Received: layer={layer}"):
            porting.options_from_config({**MISTRAL, "num_hidden_layers": count}, layer)


@pytest.mark.parametrize("written", ["config.json", "as written"])
@pytest.mark.parametrize(
    "changes",
    [
        {"global_rope_theta": 1000.0, "local_rope_theta": 50.0, "local_attention": 5},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "local_rope_theta": 50.0},
    ],
    ids=["bases", "scaled"],
)
@pytest.mark.parametrize("model_type", ["modernbert", "modernbert-decoder"])
def test_modernbert_reads_its_older_fields_as_transformers_does(model_type, changes, written):
    # Its released configs write a base per layer kind under these names, and local_attention,
    # whose half (rounded down) is the window; an older rope_scaling scales both kinds
    config, model = tiny_model(model_type, attn_implementation="eager", **changes)
    if written == "config.json":
        config_dict = {**config.to_dict(), "model_type": model_type}
    else:
        config_dict = _written(model_type, changes)
    window = (changes.get("local_attention", 4) // 2) + (model_type == "modernbert")
    assert porting.options_from_config(config_dict, 1)["sliding_window"] == window
    assert_each_layer_ports(model_type, model, config, config_dict)


@pytest.mark.parametrize("written", ["config.json", "as written"])
def test_cohere_compass_reads_its_rotary_embedding_per_layer_type_alone(written):
    # null for a type without one; the flat rope_theta and rope_type its released configs keep
    # beside them are not read, nor the split among images' axes (a text turns as the plain one)
    sliding = {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [1, 1, 2]}
    rope = {"sliding_attention": sliding, "full_attention": None}
    changes = {"rope_parameters": {**rope, "rope_theta": 5.0, "rope_type": "default"}}
    model_type = "cohere_compass_text"
    config, model = tiny_model(model_type, attn_implementation="eager", **changes)
    if written == "config.json":
        config_dict = {**config.to_dict(), "model_type": model_type}
    else:
        config_dict = _written(model_type, changes)
    assert "rope_theta" not in porting.options_from_config(config_dict, 1)
    assert_each_layer_ports(model_type, model, config, config_dict)
    # transformers cannot run it without its rotary embedding per layer type
    for flat in (None, {"rope_type": "default", "rope_theta": 100.0}):
        with pytest.raises(ValueError, match="give no rotary embedding for 'sliding_attention'"):
            porting.options_from_config({**config_dict, "rope_parameters": flat}, 0)


@pytest.mark.parametrize("written", ["config.json", "as written"])
def test_recurrent_gemma_reads_its_blocks_window_and_head_as_transformers_does(written):
    # block_types repeated over its layers (the recurrent ones are not attention), its window
    # under its other name (which wins), half of a head_dim of its own turned by default
    changes = {"block_types": ["attention", "recurrent"], "sliding_window": 2, "head_dim": 16}
    config, model = tiny_model("recurrent_gemma", attn_implementation="eager", **changes)
    if written == "config.json":
        config_dict = {**config.to_dict(), "model_type": "recurrent_gemma"}
    else:
        config_dict = _written("recurrent_gemma", changes)
    options = porting.options_from_config(config_dict, 2)
    assert (options["sliding_window"], options["rope_dim"]) == (2, 8)
    assert_each_layer_ports("recurrent_gemma", model, config, config_dict)
    with pytest.raises(ValueError, match="linear_attention"):
        porting.options_from_config(config_dict, 1)


@pytest.mark.parametrize("written", ["config.json", "as written"])
@pytest.mark.parametrize("layers", [5, 6])
def test_muse_glimmer_counts_its_full_layers_from_the_last(layers, written):
    # every fourth layer counted from the last is full and turns nothing (the default of its
    # layer_rope_theta), whatever the number of layers
    changes = {"num_hidden_layers": layers}
    config, model = tiny_model("muse_glimmer_text", attn_implementation="eager", **changes)
    if written == "config.json":
        config_dict = {**config.to_dict(), "model_type": "muse_glimmer_text"}
    else:
        config_dict = _written("muse_glimmer_text", changes)
    each = [porting.options_from_config(config_dict, i) for i in range(layers)]
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert [i for i, options in enumerate(each) if "sliding_window" not in options] == full
    assert [i for i, options in enumerate(each) if "rope_theta" not in options] == full
    assert_each_layer_ports("muse_glimmer_text", model, config, config_dict)


def test_smollm3_layers_its_attentions_window_differently_are_refused():
    # SmolLM3's config keeps sliding_window where use_sliding_window is false: its eager and
    # SDPA masks slide on the sliding layers, its attention modules (flash) do not
    kinds = ["sliding_attention", "full_attention"] * 2
    changes = {"layer_types": kinds, "sliding_window": 3, "use_sliding_window": False}
    config, model = tiny_model("smollm3", attn_implementation="eager", **changes)
    assert config.sliding_window == 3 and model.layers[0].self_attn.sliding_window is None
    ids = torch.tensor([[5, 17, 3, 42, 8, 29, 11]])
    every_full = {**changes, "layer_types": ["full_attention"] * 4}
    _, full = tiny_model("smollm3", attn_implementation="eager", **every_full)
    with torch.no_grad():  # the mask slides: not the model whose layers are all full
        assert not torch.allclose(model(input_ids=ids)[0], full(input_ids=ids)[0])
    with pytest.raises(ValueError, match="eager and SDPA attention window them"):
        porting.options_from_config(_written("smollm3", changes), 0)
    on = porting.options_from_config(
        _written("smollm3", {**changes, "use_sliding_window": True}), 0
    )
    assert on["sliding_window"] == 3
