"""Rotary embeddings as models ship them: scaled frequencies ("linear", "dynamic", "yarn",
"llama3", "longrope") and partial rotary, against transformers' own computation.

transformers computes its frequencies and angles in float32, whatever the model's dtype, and
mha in float64 for a float64 layer: the ports are compared at float32's tolerance, relative
to the output's scale. The frequencies themselves are compared with transformers'
`ROPE_INIT_FUNCTIONS` at float32's precision.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from test_porting import transformers

import mha
from conftest import backend_module, backend_params, framework_import
from mha import encoding, get_weights, porting, set_weights

torch = framework_import("torch", module_level=True)

# Lengths of 5 to 12 positions cross each original length below, so that "dynamic" and
# "longrope" take their long frequencies in the calls that run past it
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
    },
    # Betas of 0, which transformers reads as its defaults (32, 1)
    "yarn_zero_betas": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 0,
        "beta_slow": 0,
    },
    # gpt-oss's form: the ramp's ends not rounded
    "yarn_untruncated": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 8,
        "truncate": False,
    },
    # DeepSeek's form: the attention factor a ratio of two mscales
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 8,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    # Llama 4 Scout's form: no blend, the wavelengths past original / low_freq_factor divided
    "llama3_step": {
        "rope_type": "llama3",
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 16,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.2, 1.5, 2.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0],
        "original_max_position_embeddings": 8,
    },
}
HEAD = 8  # 4 pairs; a base of 100 spreads their wavelengths over llama3's and yarn's bands


def _llama(kind: str, seed: int = 3):
    """A tiny float64 Llama with the scaling `kind`, and its config."""
    T = transformers()
    rope = {**SCALINGS[kind], "rope_type": SCALINGS[kind]["rope_type"], "rope_theta": 100.0}
    config = T.LlamaConfig(
        hidden_size=4 * HEAD,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=16,
        num_hidden_layers=1,
        vocab_size=50,
        max_position_embeddings=8,
        rope_parameters=rope,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return config, T.LlamaModel(config).double().eval()


@pytest.mark.parametrize("kind", SCALINGS)
@pytest.mark.parametrize("length", [None, 6, 12])
def test_frequencies_and_attention_factor_are_transformers(kind, length):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config, _ = _llama(kind)
    rope_type = SCALINGS[kind]["rope_type"]
    expected, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=length)
    options = porting.options_from_config(config.to_dict())
    scaling = options["rope_scaling"]
    assert scaling["rope_type"] == rope_type
    got = encoding.rotary_frequencies(HEAD, 100.0, scaling)
    if length is not None:
        longer = encoding.rotary_frequencies_at(HEAD, 100.0, scaling, length)
        got = got if longer is None else longer
    np.testing.assert_allclose(got, expected.double().numpy(), rtol=2e-7)
    assert encoding.rotary_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
@pytest.mark.parametrize("length", [4, 8, 9, 12])
def test_frequencies_of_a_given_length_are_transformers(kind, length):
    # rotary_frequencies itself given a length below, at and past the pretrained length (8):
    # "dynamic" keeps its base up to it, "longrope" its short factors
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config, _ = _llama(kind)
    rope_type = SCALINGS[kind]["rope_type"]
    expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=length)
    scaling = porting.options_from_config(config.to_dict())["rope_scaling"]
    got = encoding.rotary_frequencies(HEAD, 100.0, scaling, length)
    np.testing.assert_allclose(got, expected.double().numpy(), rtol=2e-7)


@pytest.mark.parametrize(
    "extra, expected",
    [
        # Phi-3's sqrt(1 + ln(factor) / ln(original)): ln 4 / ln 8 = 2 / 3 by hand
        ({"factor": 4.0}, math.sqrt(5 / 3)),
        ({"factor": 64.0}, math.sqrt(3)),
        ({"factor": 0.5}, 1.0),
        ({"factor": 4.0, "attention_factor": 1.25}, 1.25),
    ],
    ids=["factor 4", "factor 64", "factor below 1", "attention_factor given"],
)
def test_longrope_attention_factor_from_its_factor_by_hand(extra, expected):
    scaling = {**SCALINGS["longrope"], **extra}  # original_max_position_embeddings 8
    assert encoding.rotary_attention_factor(scaling) == pytest.approx(expected, rel=1e-12)


def test_yarn_ramp_ends_at_the_last_pair_where_its_bound_passes_it():
    # A small base and a long pretrained length put yarn's upper correction bound past the
    # head's pairs: transformers clamps it to the head size - 1
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1000}
    config = transformers().LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=4000,
        rope_parameters={**yarn, "rope_theta": 10.0},
    )
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got = encoding.rotary_frequencies(16, 10.0, yarn)
    np.testing.assert_allclose(got, expected.double().numpy(), rtol=2e-7)
    assert encoding.rotary_attention_factor(yarn) == pytest.approx(factor, rel=1e-12)


def test_yarn_ramp_of_equal_untruncated_ends_is_transformers():
    # beta_fast == beta_slow, not truncated: both ends of the ramp at pair 0.995 (the
    # beta whose wavelength fits there, by the bound's formula), where transformers
    # widens the ramp by 0.001, so that pair 1 lies past it
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    beta = 20 / (2 * math.pi * 100.0 ** (2 * 0.995 / HEAD))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 20}
    yarn.update(beta_fast=beta, beta_slow=beta, truncate=False)
    config = transformers().LlamaConfig(
        hidden_size=4 * HEAD,
        num_attention_heads=4,
        max_position_embeddings=80,
        rope_parameters={**yarn, "rope_theta": 100.0},
    )
    expected, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got = encoding.rotary_frequencies(HEAD, 100.0, yarn)
    np.testing.assert_allclose(got, expected.double().numpy(), rtol=2e-7)


LONGROPE = {"short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0]}
# Where transformers takes the pretrained length of a scaled rotary embedding: the config's own
# beside one set of parameters wins over theirs (llama3, yarn, longrope; Phi-3's class writes
# 4096 where the config does not), while parameters per layer type keep each their own
PRETRAINED_LENGTHS = {
    "yarn_beside": ("llama", None, 8, {"rope_type": "yarn", "factor": 4.0}, 64),
    "llama3_beside": (
        "llama",
        None,
        64,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        16,
    ),
    "longrope_of_phi3_class": ("phi3", None, None, {"rope_type": "longrope", **LONGROPE}, 4),
    # YaRN whose factor is null: transformers takes max_position_embeddings over its length
    "yarn_of_null_factor": ("llama", None, None, {"rope_type": "yarn", "factor": None}, 4),
    # JSON's 8.0: a whole number, as transformers reads it
    "yarn_of_a_whole_float_length": (
        "llama",
        None,
        None,
        {"rope_type": "yarn", "factor": 4.0},
        8.0,
    ),
    "longrope_per_layer_type": (
        "gemma3_text",
        "full_attention",
        64,
        {"rope_type": "longrope", "factor": 4.0, **LONGROPE},
        4,
    ),
}


@pytest.mark.parametrize(
    ("model_type", "kind", "beside", "rope", "inside"),
    PRETRAINED_LENGTHS.values(),
    ids=PRETRAINED_LENGTHS,
)
def test_the_pretrained_length_is_transformers(model_type, kind, beside, rope, inside):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    T = transformers()
    rope = {**rope, "rope_theta": 100.0, "original_max_position_embeddings": inside}
    fields = {"hidden_size": 4 * HEAD, "num_attention_heads": 4, "head_dim": HEAD}
    fields.update(num_hidden_layers=2, max_position_embeddings=16, rope_parameters=rope)
    if beside is not None:
        fields["original_max_position_embeddings"] = beside
    if kind is not None:
        fields.update(sliding_window=4, layer_types=["sliding_attention", kind])
        fields["rope_parameters"] = {"sliding_attention": {"rope_theta": 10.0}, kind: rope}
    config = T.AutoConfig.for_model(model_type, **copy.deepcopy(fields))
    # 12 positions: past the parameters' own length or the one beside them, as the case is
    expected, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](
        config, "cpu", seq_len=12, layer_type=kind
    )
    scaling = porting.options_from_config({**fields, "model_type": model_type}, 1)["rope_scaling"]
    longer = encoding.rotary_frequencies_at(HEAD, 100.0, scaling, 12)
    got = encoding.rotary_frequencies(HEAD, 100.0, scaling) if longer is None else longer
    np.testing.assert_allclose(got, expected.double().numpy(), rtol=2e-7)
    assert encoding.rotary_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)


def test_a_yarn_per_layer_type_that_does_not_truncate_is_refused():
    # transformers reads truncate beside the layer types' parameters, so always truncates
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    config = {"model_type": "gemma3_text", "num_attention_heads": 4, "head_dim": HEAD}
    config.update(max_position_embeddings=16, layer_types=["full_attention"])
    for truncate, ports in ((False, False), (True, True), (None, True)):
        rope = yarn if truncate is None else {**yarn, "truncate": truncate}
        config["rope_parameters"] = {"full_attention": rope}
        if ports:
            assert porting.options_from_config(config, 0)["rope_scaling"]["rope_type"] == "yarn"
        else:
            with pytest.raises(ValueError, match=r"truncate=False, which transformers does not"):
                porting.options_from_config(config, 0)


# Model types whose config class nests an older flat rope_scaling per layer type, each with
# the fields that give it a sliding layer (0) and a full layer (1)
NESTS_PER_KIND = {
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    "gemma3n_text": {
        **{"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
        "num_kv_shared_layers": 0,
    },
    "olmo3": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    "modernbert": {"global_attn_every_n_layers": 2, "local_attention": 4, "pad_token_id": 0},
}
OLDER_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}


def _transformers_frequencies(config, kind):
    """The inverse frequencies and attention factor of a layer of `kind` as transformers
    resolves the config (ROPE_INIT_FUNCTIONS; the plain ones by the formula)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = config.rope_parameters[kind]
    if rope["rope_type"] == "default":
        return 1.0 / rope["rope_theta"] ** (np.arange(0, HEAD, 2) / HEAD), 1.0
    frequencies, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu", layer_type=kind)
    return frequencies.double().numpy(), factor


@pytest.mark.parametrize("model_type", NESTS_PER_KIND)
@pytest.mark.parametrize(
    "given",
    [
        {"rope_scaling": OLDER_YARN, "original_max_position_embeddings": 64},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0},
                "sliding_attention": {"rope_type": "linear", "factor": 3.0, "rope_theta": 10.0},
            },
            "rope_scaling": OLDER_YARN,
        },
        {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
    ],
    ids=["yarn_and_a_length_beside", "linear", "nested_and_rope_scaling", "full_alone"],
)
def test_an_older_rope_scaling_is_nested_per_layer_type_as_transformers_does(model_type, given):
    # Its class merges it into the full layers' parameters (ModernBERT's into both), which
    # then keep their own pretrained length, and fills the layer types the config leaves out
    # with the default embedding (ModernBERT's class cannot: a KeyError)
    nested = given.get("rope_parameters")
    if model_type == "modernbert" and nested and "sliding_attention" not in nested:
        given = {**given, "rope_parameters": {**nested, "sliding_attention": {}}}
    T = transformers()
    fields = {"hidden_size": 4 * HEAD, "num_attention_heads": 4, "head_dim": HEAD}
    fields.update(num_hidden_layers=2, max_position_embeddings=16, rope_theta=100.0)
    fields.update(NESTS_PER_KIND[model_type], **copy.deepcopy(given))
    config = T.AutoConfig.for_model(model_type, **copy.deepcopy(fields))
    for layer, kind in enumerate(("sliding_attention", "full_attention")):
        if model_type == "modernbert":
            kind = ("full_attention", "sliding_attention")[layer]
        expected, factor = _transformers_frequencies(config, kind)
        options = porting.options_from_config({**fields, "model_type": model_type}, layer)
        scaling = options.get("rope_scaling")
        got = encoding.rotary_frequencies(HEAD, options["rope_theta"], scaling)
        np.testing.assert_allclose(got, expected, rtol=2e-7, err_msg=kind)
        assert encoding.rotary_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize(
    ("model_type", "given", "message"),
    [
        ("olmo3", {"rope_scaling": {**OLDER_YARN, "truncate": False}}, "truncate=False"),
        ("gemma3_text", {"rope_scaling": {"type": "linear", "factor": 4.0}}, "under 'type'"),
        ("modernbert", {"rope_scaling": {"type": "linear", "factor": 4.0}}, "under 'type'"),
        ("gemma3_text", {"rope_parameters": {"rope_type": "linear", "factor": 4.0}}, "per layer"),
    ],
    ids=["older_yarn_that_does_not_truncate", "type_key", "type_key_both_kinds", "flat"],
)
def test_what_a_class_of_parameters_per_layer_type_does_not_read_is_refused(
    model_type, given, message
):
    # transformers truncates, turns by the default embedding, or ignores the flat parameters
    config = {"model_type": model_type, "num_attention_heads": 4, "head_dim": HEAD}
    config.update(max_position_embeddings=16, rope_theta=100.0, num_hidden_layers=2)
    config.update(NESTS_PER_KIND[model_type], **given)
    with pytest.raises(ValueError, match=message):
        porting.options_from_config(config, 1 if model_type != "modernbert" else 0)


def test_parameters_per_layer_type_beside_a_rope_scaling_are_refused_elsewhere():
    # Outside the classes that nest it, transformers takes a rope_scaling over the config's
    # rope_parameters whole (or, Gemma 4's, ignores it): mha reads neither silently
    nested = {"sliding_attention": {"rope_theta": 10.0}, "full_attention": {"rope_theta": 1e4}}
    config = {"model_type": "ultrabert", "num_attention_heads": 4, "head_dim": HEAD}
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    config.update(rope_parameters=nested, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="gives both rope_parameters"):
        porting.options_from_config(config, 1)
    del config["rope_scaling"]
    assert porting.options_from_config(config, 1)["rope_theta"] == 1e4


QUERY_SCALED = {
    "ministral3": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2},
    "mistral4": {
        **{"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2},
        **{"q_lora_rank": 8, "kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4},
        **{"v_head_dim": 6, "moe_intermediate_size": 4, "n_routed_experts": 2, "n_group": 1},
        **{"num_experts_per_tok": 1, "first_k_dense_replace": 1, "topk_group": 1},
    },
}


@pytest.mark.parametrize("model_type", QUERY_SCALED)
def test_the_query_scaling_takes_the_pretrained_length_the_rotary_embedding_takes(model_type):
    # A length beside the YaRN parameters wins over theirs when transformers builds the
    # model, for the queries' scale as for the frequencies
    T = transformers()
    rope = {**OLDER_YARN, "rope_theta": 100.0, "llama_4_scaling_beta": 0.5}
    fields = {"num_hidden_layers": 1, "max_position_embeddings": 32, "rope_parameters": rope}
    fields.update(QUERY_SCALED[model_type], intermediate_size=8, vocab_size=30, pad_token_id=0)
    fields["original_max_position_embeddings"] = 4
    config = T.AutoConfig.for_model(model_type, **copy.deepcopy(fields))
    T.AutoModel.from_config(config)
    length = config.rope_parameters["original_max_position_embeddings"]
    options = porting.options_from_config({**fields, "model_type": model_type}, 0)
    assert options["query_scaling"]["original_max_position_embeddings"] == length == 4
    assert options["rope_scaling"]["original_max_position_embeddings"] == length


def _outputs(model, ids, padding=None, **call):
    """The attention input and output of layer 0 in a run of the whole model."""
    seen = {}
    attention = model.layers[0].self_attn

    def take_input(module, args, kwargs):
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).numpy()

    def take_output(module, args, output):
        seen["y"] = output[0].numpy()

    handles = [
        attention.register_forward_pre_hook(take_input, with_kwargs=True),
        attention.register_forward_hook(take_output),
    ]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=padding, **call)
    for handle in handles:
        handle.remove()
    return seen["x"], seen["y"]


@pytest.mark.parametrize("name", backend_params())
@pytest.mark.parametrize("kind", SCALINGS)
def test_a_scaled_llama_ports_in_one_line(name, kind):
    # Causal with right padding, 12 positions: past every original length
    config, model = _llama(kind)
    ids = torch.randint(3, 50, (2, 12))
    padding = torch.tensor([[1] * 12, [1] * 9 + [0] * 3])
    x, expected = _outputs(model, ids, padding)
    module = backend_module(name)
    options = porting.options_from_config(config.to_dict())
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend=name, **options
    )
    X, lengths = module.from_numpy(x), module.from_numpy(np.array([12, 9]))
    output = module.to_numpy(layer(X, X, X, lengths, causal=True))
    scale = np.max(np.abs(expected))
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_batch_padded_on_the_left_in_every_row_ports_without_its_shared_padding(kind):
    # generate's positions count from each row's first token, and transformers chooses the
    # frequencies from the largest, here the 7 tokens of row 0, short of the original 8;
    # mha chooses them from the call's positions, 12 with the columns every row pads, 7
    # without them (porting.md, "Left padding")
    config, model = _llama(kind)
    padding = np.array([[0] * 5 + [1] * 7, [0] * 7 + [1] * 5])
    positions = np.maximum(np.cumsum(padding, axis=-1) - 1, 0)
    x, expected = _outputs(
        model,
        torch.randint(3, 50, (2, 12)),
        torch.tensor(padding),
        position_ids=torch.tensor(positions),
    )
    options = porting.options_from_config(config.to_dict())
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend="numpy", **options
    )
    kept, atol = padding.astype(bool), 1e-6 * np.max(np.abs(expected))
    whole = layer(x, x, x, causal=True, mask=kept[:, None])
    assert np.max(np.abs(whole - expected)[kept]) > 100 * atol  # the long frequencies
    start = int(np.argmax(kept.any(axis=0)))  # the first column with a token
    x, kept = x[:, start:], kept[:, start:]
    output = layer(x, x, x, causal=True, mask=kept[:, None])
    np.testing.assert_allclose(output[kept], expected[:, start:][kept], rtol=0, atol=atol)


@pytest.mark.parametrize("name", backend_params())
@pytest.mark.parametrize("kind", ["dynamic", "longrope", "yarn"])
def test_cached_decoding_is_transformers_own(name, kind):
    # A prompt of 5 positions, then one position per step up to 12: "dynamic" and "longrope"
    # change their frequencies once past 8, and the cached keys keep the ones they were
    # turned with, in transformers as in mha
    T = transformers()
    config, model = _llama(kind)
    ids = torch.randint(3, 50, (2, 12))
    module = backend_module(name)
    options = porting.options_from_config(config.to_dict())
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend=name, **options
    )
    cache, past = module.KVCache(), T.DynamicCache(config=config)
    for start, stop in [(0, 5), *((t, t + 1) for t in range(5, 12))]:
        with torch.no_grad():
            x, expected = _outputs(model, ids[:, start:stop], past_key_values=past)
        X = module.from_numpy(x)
        output, cache = layer(X, X, X, causal=True, cache=cache)
        scale = np.max(np.abs(expected))
        np.testing.assert_allclose(module.to_numpy(output), expected, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("name", backend_params())
def test_stablelm_rotates_a_quarter_of_each_head(name):
    # transformers 5 keeps partial_rotary_factor in rope_parameters: 0.25 of heads of 16
    T = transformers()
    config = T.StableLmConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        num_hidden_layers=1,
        vocab_size=50,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(4)
    model = T.StableLmModel(config).double().eval()
    options = porting.options_from_config(config.to_dict())
    assert options["rope_dim"] == 4 and "rope_interleaved" not in options
    x, expected = _outputs(model, torch.randint(3, 50, (2, 7)))
    module = backend_module(name)
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend=name, **options
    )
    X = module.from_numpy(x)
    output = module.to_numpy(layer(X, X, X, causal=True))
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6 * np.max(np.abs(expected)))


def test_partial_rotary_passes_the_other_features_as_they_are():
    # Worked by hand: features beyond rotary_dim pass; the first 4 turn as a rotary
    # embedding of 4 features does, in either pairing
    from mha.backends import numpy as N

    X = np.random.default_rng(0).standard_normal((2, 5, 10))
    for interleaved in (False, True):
        partial = N.RotaryEmbedding(
            10, 50.0, interleaved=interleaved, rotary_dim=4, dtype="float64"
        )
        whole = N.RotaryEmbedding(4, 50.0, interleaved=interleaved, dtype="float64")
        Y = partial(X, offset=2)
        np.testing.assert_array_equal(Y[..., 4:], X[..., 4:])
        np.testing.assert_allclose(Y[..., :4], whole(X[..., :4], offset=2), rtol=0, atol=0)


def test_a_scaling_is_checked_by_name():
    from mha.backends import numpy as N

    with pytest.raises(ValueError, match=r"rope_scaling must hold factor.*missing: factor"):
        N.MultiHeadAttention(8, 2, rope_theta=1e4, rope_scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match=r"unknown: rope_theta"):
        N.RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0})
    with pytest.raises(ValueError, match=r"rope_type is one of"):
        N.RotaryEmbedding(8, scaling={"rope_type": "ntk", "factor": 2.0})
    with pytest.raises(ValueError, match=r"long_factor one factor per pair .* 2\. Received: 3"):
        N.RotaryEmbedding(
            8,
            rotary_dim=4,
            scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.0],
                "long_factor": [1.0, 2.0, 3.0],
                "original_max_position_embeddings": 4,
            },
        )
    with pytest.raises(ValueError, match=r"give rope_theta too"):
        N.MultiHeadAttention(8, 2, rope_dim=2)
    with pytest.raises(ValueError, match=r"rope_dim must be even .* at most the head size, 4"):
        N.MultiHeadAttention(8, 2, rope_theta=1e4, rope_dim=6)


def test_unknown_rope_types_are_refused_by_name():
    config = {"num_attention_heads": 4, "hidden_size": 16}
    rope = {"rope_type": "mrope", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match=r"'mrope' \(rope_parameters="):
        porting.options_from_config({**config, "rope_parameters": rope})
    broken = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}
    with pytest.raises(ValueError, match=r"missing: low_freq_factor, high_freq_factor"):
        porting.options_from_config({**config, "rope_parameters": broken})


def test_a_yarn_without_a_factor_is_refused_as_transformers_refuses_it():
    # A null factor is max_position_embeddings over the pretrained length (above); an absent
    # one is an error of transformers' validation, not that length's ratio
    T = transformers()
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 4}
    fields = {"hidden_size": 4 * HEAD, "num_attention_heads": 4, "max_position_embeddings": 16}
    with pytest.raises(KeyError, match="factor"):
        T.AutoConfig.for_model("llama", **copy.deepcopy(fields), rope_parameters=rope)
    with pytest.raises(ValueError, match=r"has no 'factor', which YaRN needs"):
        porting.options_from_config({**fields, "model_type": "llama", "rope_parameters": rope})


GRAPH_SCALINGS = {
    "longrope": {**SCALINGS["longrope"], "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8},
}


@pytest.mark.tensorflow
@pytest.mark.parametrize("cached", [0, 3], ids=["no_cache", "cache"])
@pytest.mark.parametrize("scaling", GRAPH_SCALINGS.values(), ids=GRAPH_SCALINGS)
def test_a_keras_graph_of_unknown_length_computes_the_length_scaling_in_the_graph(scaling, cached):
    # A graph traced over any number of positions (and any cached length): longrope's factors
    # are chosen, dynamic's frequencies computed, in the graph from the length
    module = backend_module("tensorflow")
    tf = module.tf
    layer = module.MultiHeadAttention(32, 4, rope_theta=100.0, rope_scaling=scaling)
    reference = backend_module("numpy").MultiHeadAttention(
        32, 4, rope_theta=100.0, rope_scaling=scaling
    )
    X = np.random.default_rng(1).standard_normal((2, 12 + cached, 32)).astype("float32")
    layer(X[:, :3], X[:, :3], X[:, :3])
    set_weights(reference, get_weights(layer))
    spec, cache_spec = tf.TensorSpec([None, None, 32]), tf.TensorSpec([None, 4, None, 8])
    keys = values = np.zeros((2, 4, 0, 8), "float32")
    if cached:
        _, cache = reference(*[X[:, :cached]] * 3, causal=True, cache=mha.KVCache())
        keys, values = cache.keys.astype("float32"), cache.values.astype("float32")

    @tf.function(input_signature=[spec, cache_spec, cache_spec])
    def traced(x, keys, values):
        if not cached:
            return layer(x, x, x, causal=True)
        return layer(x, x, x, causal=True, cache=mha.KVCache(keys, values))[0]

    for n in (5, 12):  # below and past the original length, 8, with the cached positions
        x = X[:, cached : cached + n]
        expected = reference(x, x, x, causal=True, cache=mha.KVCache(keys, values))[0]
        np.testing.assert_allclose(traced(x, keys, values).numpy(), expected, rtol=0, atol=1e-5)


def test_mha_convert_ports_a_llama_3_1_layer_with_its_config(tmp_path, capsys):
    from safetensors.numpy import save_file

    from mha import cli, load

    config, model = _llama("llama3")
    save_file({k: v.numpy() for k, v in model.state_dict().items()}, tmp_path / "m.safetensors")
    config.to_json_file(tmp_path / "config.json")
    destination = tmp_path / "layer.safetensors"
    code = cli.main(
        [
            "convert",
            str(tmp_path / "m.safetensors"),
            str(destination),
            "--prefix",
            "layers.0.self_attn",
            "--config",
            str(tmp_path / "config.json"),
        ]
    )
    assert code == 0, capsys.readouterr()
    x, expected = _outputs(model, torch.randint(3, 50, (2, 12)))
    layer = load(destination, backend="numpy")
    assert layer.rope_scaling["rope_type"] == "llama3"
    output = layer(x, x, x, causal=True)
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6 * np.max(np.abs(expected)))


@pytest.mark.parametrize("name", backend_params())
def test_gpt_j_rotates_pairs_of_its_first_rotary_dim_features(name):
    # GPT-J turns pairs (2i, 2i + 1) of the first rotary_dim features, with a base its code
    # fixes at 10000 (its config has no rope_theta)
    T = transformers()
    config = T.GPTJConfig(
        n_embd=32, n_head=4, n_layer=1, rotary_dim=4, vocab_size=50, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(5)
    model = T.GPTJModel(config).double().eval()
    options = porting.options_from_config(config.to_dict())
    assert options == {
        "num_heads": 4,
        "head_size": 8,  # 32 / 4: GPT-J's code reads no head_dim
        "num_kv_heads": 4,
        "query_size": 32,
        "rope_theta": 10000.0,
        "rope_dim": 4,
        "rope_interleaved": True,
    }
    seen = {}
    attention = model.h[0].attn
    handles = [
        attention.register_forward_pre_hook(
            lambda m, args, kwargs: seen.update(x=(args[0] if args else kwargs["hidden_states"])),
            with_kwargs=True,
        ),
        attention.register_forward_hook(lambda m, args, output: seen.update(y=output[0])),
    ]
    with torch.no_grad():
        model(input_ids=torch.randint(1, 50, (2, 7)))
    for handle in handles:
        handle.remove()
    module = backend_module(name)
    layer = porting.from_state_dict(model.state_dict(), "h.0.attn", backend=name, **options)
    X = module.from_numpy(seen["x"].numpy())
    output = module.to_numpy(layer(X, X, X, causal=True))
    expected = seen["y"].numpy()
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6 * np.max(np.abs(expected)))


@pytest.mark.parametrize("length", [6, 12, 20])
def test_dynamic_scaling_ignores_a_written_pretrained_length(length):
    # transformers' "dynamic" stretches from max_position_embeddings, and does not read an
    # original_max_position_embeddings written among the rotary parameters
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head = 8
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100.0}
    rope["original_max_position_embeddings"] = 4
    fields = {"hidden_size": 4 * head, "num_attention_heads": 4, "head_dim": head}
    fields.update(num_hidden_layers=1, max_position_embeddings=16, rope_parameters=rope)
    config = transformers().AutoConfig.for_model("llama", **copy.deepcopy(fields))
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=length)
    scaling = porting.options_from_config({**fields, "model_type": "llama"})["rope_scaling"]
    longer = encoding.rotary_frequencies_at(head, 100.0, scaling, length)
    got = encoding.rotary_frequencies(head, 100.0, scaling) if longer is None else longer
    np.testing.assert_allclose(got, expected.double().numpy(), rtol=2e-7)


@pytest.mark.parametrize("name", backend_params())
@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_cross_attention_takes_its_frequencies_from_its_last_key(name, kind):
    # 3 queries against 12 keys, past the original 8: the keys' length picks the long
    # frequencies for both (porting.md), where the queries' 3 would pick the short ones.
    # Worked with transformers' own frequencies and rotation, the attention by hand
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config, model = _llama(kind)
    attention = model.layers[0].self_attn
    rng = np.random.default_rng(5)
    x_q, x_k = rng.standard_normal((2, 3, 4 * HEAD)), rng.standard_normal((2, 12, 4 * HEAD))
    frequencies, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=12)
    angles = torch.arange(12, dtype=torch.float64)[:, None] * frequencies.double()
    angles = torch.cat([angles, angles], dim=-1)[None]  # (1, 12, HEAD)
    cos, sin = torch.cos(angles) * factor, torch.sin(angles) * factor

    def heads(linear, x):  # (2, heads, positions, HEAD)
        return linear(torch.from_numpy(x)).view(2, x.shape[1], -1, HEAD).transpose(1, 2)

    with torch.no_grad():
        q, k, v = (
            heads(attention.q_proj, x_q),
            heads(attention.k_proj, x_k),
            heads(attention.v_proj, x_k),
        )
        q = apply_rotary_pos_emb(q, q, cos[:, :3], sin[:, :3])[0]
        k = apply_rotary_pos_emb(k, k, cos, sin)[1]
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # 2 queries each
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD), dim=-1)
        expected = attention.o_proj((weights @ v).transpose(1, 2).reshape(2, 3, -1)).numpy()
    module = backend_module(name)
    options = porting.options_from_config(config.to_dict())
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend=name, **options
    )
    K = module.from_numpy(x_k)
    output = module.to_numpy(layer(module.from_numpy(x_q), K, K))
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6 * np.max(np.abs(expected)))
