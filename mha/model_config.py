"""The port options of a Hugging Face config: num_heads, the rotary embedding, the sliding
window and the score scale of a layer, read from the model's config (a dict or config.json).

`mha.porting.options_from_config` is this module's `options_from_config`. Anything of the
config that changes the attention's numbers and mha's layer cannot hold is an error naming
the field.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from mha.config_defaults import with_aliases, with_defaults
from mha.config_fields import without_unread
from mha.config_values import (
    flag,
    head_size,
    is_whole,
    num_heads,
    positive_count,
    positive_number,
)
from mha.encoding import check_query_scaling
from mha.files import parse_json, read_bytes
from mha.layer_kinds import layer_kind, uses_window
from mha.model_qk_norm import LAYER_NORM_PER_HEAD, QK_NORM_ALWAYS, QK_NORM_FIELD, qk_norm_options
from mha.model_rope import query_scaling, rotary_options
from mha.model_shapes import head_shapes
from mha.port_adjustments import LOCAL_CHUNKS
from mha.refused_models import MISREAD_MODEL_TYPES, MPT_UNSUPPORTED, SPARSE_ATTENTION_TYPES

__all__ = ["options_from_config"]


def options_from_config(
    config: Mapping[str, Any] | str | os.PathLike | Any, layer: int | None = None
) -> dict[str, Any]:
    """num_heads and the port options of a Hugging Face config (dict, config.json, object):
    num_attention_heads, the heads it builds (head_size, num_kv_heads, query_size: port
    options the weights must have, mha.model_shapes), the rotary embedding (rope_theta, or
    transformers 5's rope_parameters, per layer type too, its scaling, partial_rotary_factor;
    transformers' defaults of the model type for what the config does not write), the
    sliding window of the layer's type (layer_types), the score scale where the config
    changes it (query_pre_attn_scalar, attention_multiplier, GPT-2's scale_attn_weights and
    scale_attn_by_inverse_layer_idx, MPT's softmax_scale), Gemma 2's soft cap
    (attn_logit_softcapping), the QK-norm of Qwen3, OLMo 2, Gemma 3, Qwen3-Next and GLM-4.5
    with use_qk_norm (qk_norm, qk_norm_eps, and qk_norm_offset=1.0 for the norms that scale
    by 1 + weight: a port option, not a layer's), Qwen3-Next's output gate (output_gate=True:
    the port splits the query projection), BLOOM's and MPT's ALiBi (alibi=True), which
    their model type tells, Ministral 3's and Mistral 4's queries scaled by their
    positions (query_scaling, from their rotary parameters' llama_4_scaling_beta), and
    Gemma 4's normalized values (value_norm), unscaled scores and values from the key
    projection (values_from_keys=True: a port option) where attention_k_eq_v says, Gemma 3n's
    and 4's KV-shared layers' source (keys_values_of: a port option),
    LFM3's gate of each head (output_gate=True, from g_proj), and Llama 4's chunks
    (attention_chunk_size), norms with no weight (weightless_qk_norm=True: a port option)
    and queries scaled from position 1 on its layers without a rotary embedding, and
    nanochat's (weightless_qk_norm=True, and reversed_rotary=True: a port option for its
    rotary embedding turned the other way), ESM C's projections' layer norms (qk_norm=
    "projection", port option centered_qk_norm), CANINE's local chunks (local_chunk_size)

    Args:
        config: the config of the model the layer belongs to (a text model's, not a
            multimodal model's that nests it).
        layer: the layer's index in the model; needed where the config's layers differ
            (Gemma 2 and 3, gpt-oss: sliding and full attention).

    Raises:
        ValueError: anything of the config that changes the attention's numbers and mha's
            layer cannot hold (QK-norm, clipped projections, Falcon's ALiBi, ...), each naming
            the field and its value; layers that differ and no `layer`; an unreadable file.
    """
    if not isinstance(config, Mapping):
        config = read_config(config)
    config = with_defaults(without_unread(with_aliases(config)))  # as transformers reads it
    _refuse_config(config)
    options = _options_of_config(config, layer)
    if not options and not config.get("model_type") and not _gives_a_port_anything(config):
        raise ValueError(
            "the config names no model_type and gives a port nothing (no number of heads, "
            "rotary embedding, window or other option, on any layer): it is not a model's "
            "config (a safetensors index or a tokenizer's, say). Give the model's "
            "config.json, or none"
        )
    return options


def _gives_a_port_anything(config: Mapping[str, Any]) -> bool:
    """Whether any layer of the config has options (layers that differ have some)."""
    try:
        return bool(_options_of_config(config, None))
    except ValueError:
        return True


def _options_of_config(config: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """options_from_config's options of a config read as transformers reads it."""
    count = _num_layers(config)
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer is the index of a layer, >= 0. Received: layer={layer!r}")
        if count is not None and layer >= count:
            raise ValueError(f"the config has {count} layers. Received: layer={layer}")
        return _options_of_layer(config, layer)
    if count is None:
        return _options_of_layer(config, None)
    each = [_options_of_layer(config, i) for i in range(count)]
    other = next((i for i, options in enumerate(each) if options != each[0]), None)
    if other is not None:
        fields = [key for key in _PER_LAYER if config.get(key) not in (None, False)]
        raise ValueError(
            f"the config's layers differ ({', '.join(fields)}): layer 0 gets {each[0]}, "
            f"layer {other} {each[other]}; give the layer's index (layer=, --layer)"
        )
    return each[0]


# The fields that make one layer's options differ from another's
_PER_LAYER = (
    "layer_types",
    "layers_block_type",
    "attention_types",
    "no_rope_layers",
    "max_window_layers",
    "layer_rope_theta",
    "rope_scaling_layers",
    "scale_attn_by_inverse_layer_idx",
)

# Config fields whose values change the attention's numbers in ways mha's layer cannot
# represent: field -> (the values that leave the attention plain, what the field does)
_UNSUPPORTED = {
    "use_qk_norm": ((None, False), "normalizes each head's queries and keys (QK-norm)"),
    "qk_layernorm": ((None, False), "normalizes each head's queries and keys (QK-norm)"),
    "clip_qkv": ((None,), "clips the projections' outputs"),
    "attention_chunk_size": ((None,), "attends within chunks of the sequence"),
    "attn_temperature_tuning": ((None, False), "scales the queries by their position"),
    "use_bidirectional_attention": ((None, False), "attends both ways, with windows of its own"),
    "alibi": ((None, False), "adds ALiBi's position biases"),
    "rotary_value": ((None, False), "turns the values by their positions too (RoFormer)"),
    "attention_windows": ((None,), "gives each layer's window (give layer_types, sliding_window)"),
}

# Model types whose attention adds position biases that the model computes outside the
# attention module and hands to it, which a port of the module cannot hold: model type ->
# {field: its default in transformers' config class}, each true (or non-empty) value adding
# biases
_BIASES_FROM_OUTSIDE = {
    "layoutlmv2": {"has_relative_attention_bias": True, "has_spatial_attention_bias": True},
    "layoutlmv3": {"has_relative_attention_bias": True, "has_spatial_attention_bias": True},
    "beit": {"use_relative_position_bias": False, "use_shared_relative_position_bias": False},
    "data2vec-vision": {
        "use_relative_position_bias": False,
        "use_shared_relative_position_bias": False,
    },
    # UDOP's encoder: biases of the order and of the boxes in place of T5's (its decoder's are
    # T5's)
    "udop": {"relative_bias_args": [{"type": "1d"}, {"type": "horizontal"}, {"type": "vertical"}]},
}

# Model types whose attention adds ALiBi's position biases, which their configs do not say:
# the layer's alibi option
_ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})


def _refuse_config(config: Mapping[str, Any]) -> None:
    """Refuse every field mha's layer cannot represent, and configs that nest the model's."""
    nested = [
        key
        for key, value in config.items()
        if isinstance(value, Mapping) and "num_attention_heads" in value
    ]
    if nested and num_heads(config) is None:
        raise ValueError(
            f"the config nests the configs of its models ({', '.join(nested)}): give the one "
            f"the layer belongs to, e.g. config[{nested[0]!r}]"
        )
    problems = [
        f"{key}={config[key]!r} {what}"
        for key, (plain, what) in _UNSUPPORTED.items()
        if key in config and config[key] not in plain and not _held(config, key)
    ]
    if config.get("model_type") == "mpt":
        attention = config.get("attn_config") or {}
        problems += [
            f"attn_config['{key}']={attention[key]!r} {what}"
            for key, (plain, what) in MPT_UNSUPPORTED.items()
            if attention.get(key, plain) not in (plain, None)
        ]
    if config.get("model_type") == "bloom" and _bloom_slices_its_output(config):
        problems.append(
            f"slow_but_exact=True with pretraining_tp={config['pretraining_tp']!r} leaves the "
            "output projection's bias out (transformers' BLOOM sums its slices without it; "
            "with slow_but_exact=False, as BLOOM's released configs have it, it adds the bias)"
        )
    if config.get("model_type") in MISREAD_MODEL_TYPES:
        model_type = config["model_type"]
        problems.append(f"model_type={model_type!r} {MISREAD_MODEL_TYPES[model_type]}")
    if config.get("model_type") in SPARSE_ATTENTION_TYPES:
        default, full, what = SPARSE_ATTENTION_TYPES[config["model_type"]]
        attention_type = config.get("attention_type", default)
        if attention_type != full:
            problems.append(f"attention_type={attention_type!r} {what}")
    problems += _biases_from_outside(config)
    if any("ALiBi's position biases" in problem for problem in problems):
        problems.append(
            "(Falcon's ALiBi, scaled with the scores: port with from_state_dict(..., "
            "num_heads=) and give each call attn_bias=mha.porting.falcon_alibi_bias(num_heads, "
            "num_keys, head_size=...))"
        )
    if problems:
        raise ValueError(
            "the config's attention does what mha's MultiHeadAttention cannot represent: "
            + "; ".join(problems)
        )


def _biases_from_outside(config: Mapping[str, Any]) -> list[str]:
    """What the config adds to the scores from outside the attention module
    (_BIASES_FROM_OUTSIDE), each naming its field."""
    fields = _BIASES_FROM_OUTSIDE.get(config.get("model_type"), {})
    return [
        f"{key}={config.get(key, default)!r} adds position biases that the model computes "
        "outside the attention module, which a port of the module does not hold (port with "
        "from_state_dict(..., num_heads=) and give each call attn_bias)"
        for key, default in fields.items()
        if config.get(key, default)
    ]


def _bloom_slices_its_output(config: Mapping[str, Any]) -> bool:
    tp = config.get("pretraining_tp", 1)
    return bool(config.get("slow_but_exact")) and isinstance(tp, int) and tp > 1


def _held(config: Mapping[str, Any], key: str) -> bool:
    """Whether mha holds what the field does for the config's model type."""
    model_type = config.get("model_type")
    if key in _LLAMA4_FIELDS and model_type in _LLAMA4:  # its QK-norm, chunks, queries' scaling
        return True
    if LAYER_NORM_PER_HEAD.get(model_type) == key:
        return True
    if key == "use_qk_norm":  # MiniMax-M2's and Hunyuan's write it; their norms are always there
        return model_type in QK_NORM_FIELD or model_type in QK_NORM_ALWAYS
    if key == "use_bidirectional_attention":  # Gemma 4's images, not its text
        return (model_type in _GEMMA4 and config[key] == "vision") or _both_ways(config)
    return False


# Model types that attend both ways where use_bidirectional_attention says, their sliding
# layers within sliding_window // 2 + 1 positions either side (Gemma 3's: EmbeddingGemma)
_BOTH_WAYS = frozenset({"gemma3_text"})


def _both_ways(config: Mapping[str, Any]) -> bool:
    """Whether the config's layers attend both ways (their ports are called without causal)."""
    return config.get("model_type") in _BOTH_WAYS and flag(config, "use_bidirectional_attention")


def _num_layers(config: Mapping[str, Any]) -> int | None:
    """The number of layers the config describes, where it tells it."""
    for key in ("layer_types", "layers_block_type", "no_rope_layers"):
        if config.get(key) is not None:
            if not isinstance(config[key], list):
                raise ValueError(f"the config's {key} is not a list: {config[key]!r}")
            return len(config[key]) or None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = config.get(key)
        if not isinstance(value, bool) and is_whole(value) and 0 < value <= _MAX_LAYERS:
            return int(value)
    return None


# Model types whose bidirectional windows keep the keys within sliding_window positions of
# the query either side, inclusive (UltraBERT's mask, ModernBERT's)
_WINDOW_EITHER_SIDE = frozenset(
    {"embedding_gemma2_text", "modernbert", "openai_privacy_filter", "ultrabert"}
)

# Model types whose full-attention layers slide where the config has a window (MiniMax's,
# beside its linear-attention layers)
_FULL_LAYERS_SLIDE = frozenset({"minimax"})

# Model types whose heads' output is gated: by rows of the query projection (Qwen3-Next's,
# MiniCPM5's q_gate_proj) or by gate_proj (AFMoE's, a gate per feature); LFM3's g_proj gives
# one per head where its use_attention_gate says (transformers' default: on)
_OUTPUT_GATE = frozenset(
    {"afmoe", "minicpm5_moe", "muse_glimmer_text", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next"}
)
_HEAD_GATE = {"lfm3": "use_attention_gate"}

# Model types whose values are normalized with no weight (value_norm), their scores unscaled
# (the QK-norms set their size), and whose full layers take their values from the key
# projection where the config's attention_k_eq_v says (a port option: values_from_keys):
# Gemma 3n's and 4's, and EmbeddingGemma 2's
_GEMMA4 = frozenset({"embedding_gemma2_text", "gemma3n_text", "gemma4_text"})

# Llama 4's text model: chunked attention, QK-norms with no weight after the rotary embedding
# on its rotary layers, the queries scaled by their positions on the others
_LLAMA4 = frozenset({"llama4_text"})
_LLAMA4_FIELDS = ("use_qk_norm", "attention_chunk_size", "attn_temperature_tuning")
# Model types whose QK-norms have no weight and follow a rotary embedding turned the other way
# (rotate_half giving (x2, -x1)): the port options weightless_qk_norm and reversed_rotary
_REVERSED_ROTARY = frozenset({"nanochat"})

_MAX_LAYERS = 4096  # far more than any model has; bounds the work on a config


def _options_of_layer(config: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """The options of the layer of this index (None: where the config tells no layers)."""
    if config.get("model_type") in _LATENT_MODEL_TYPES:
        return _latent_options(config, layer)
    found: dict[str, Any] = {}
    heads = num_heads(config)
    kind = _attention_kind(config, layer)
    if heads is not None:  # and the heads the weights must have: a port option
        found.update(num_heads=heads, **head_shapes(config, kind, layer))
    window = config.get("sliding_window")
    if config.get("model_type") == "gpt_neo":
        window, kind = _gpt_neo_window(config, layer)
    slides = kind != "full_attention" or config.get("model_type") in _FULL_LAYERS_SLIDE
    if window is not None and uses_window(config, kind) and slides:
        found["sliding_window"] = positive_count("sliding_window", window)
        if config.get("model_type") in _WINDOW_EITHER_SIDE:  # |i - j| <= w: mha's < w + 1
            found["sliding_window"] += 1
        if _both_ways(config):  # EmbeddingGemma: |i - j| < w // 2 + 1
            found["sliding_window"] = found["sliding_window"] // 2 + 1
    windowed = "sliding_window" in found
    found.update(rotary_options(config, kind, layer, windowed, head_size(config)))
    scaling = query_scaling(config, kind)
    if scaling is not None:  # Ministral 3: the queries scaled by their positions
        found["query_scaling"] = scaling
    model_type = config.get("model_type")
    scale = _scale(config, layer)
    if scale is not None:
        found["scale"] = scale
    if config.get("attn_logit_softcapping") is not None:  # Gemma 2
        found["softcap"] = positive_number(
            "attn_logit_softcapping", config["attn_logit_softcapping"]
        )
    found.update(qk_norm_options(config))
    if model_type in _OUTPUT_GATE:  # a port option: the query projection holds the gate
        found["output_gate"] = True
    if model_type in _HEAD_GATE and flag(config, _HEAD_GATE[model_type], True):
        found["output_gate"] = True  # LFM3: g_proj, one gate per head
    if model_type in _ALIBI_MODEL_TYPES:  # BLOOM, MPT
        found["alibi"] = True
    if model_type in _GEMMA4:
        found.update(_gemma4_options(config, kind, layer))
    if model_type in _LLAMA4:
        found.update(_llama4_options(config, kind, "rope_theta" in found))
    if model_type in _REVERSED_ROTARY:  # nanochat
        found.update(qk_norm="head_after_rotary", weightless_qk_norm=True, reversed_rotary=True)
        found["qk_norm_eps"] = float(config.get("rms_norm_eps", 1e-6))
    if model_type == "esmc":  # layer norms of the projection, torch's eps: a port option
        found.update(qk_norm="projection", qk_norm_eps=1e-5, centered_qk_norm=True)
    if model_type == "canine":  # its initial character encoder's chunks: a port option
        stride = config.get("local_transformer_stride", 128)
        found[LOCAL_CHUNKS] = positive_count("local_transformer_stride", stride)
    return found


def _llama4_options(config: Mapping[str, Any], kind: str | None, rotary: bool):
    """Llama 4's options beside Llama's: its rotary layers' chunks (chunked_attention in
    layer_types, or, where it is not written, every rotary layer while attention_chunk_size is
    set, as transformers reads it) and their QK-norms with no weight (use_qk_norm); its other
    layers' queries scaled by their positions from 1 (attn_temperature_tuning)."""
    found: dict[str, Any] = {}
    chunk = config.get("attention_chunk_size", 8192)
    if kind == "chunked_attention" or (kind is None and rotary and chunk is not None):
        found["attention_chunk_size"] = positive_count("attention_chunk_size", chunk)
    if rotary and flag(config, "use_qk_norm", True):
        found.update(qk_norm="head_after_rotary", weightless_qk_norm=True)
        found["qk_norm_eps"] = float(config.get("rms_norm_eps", 1e-5))
    if not rotary and flag(config, "attn_temperature_tuning", True):
        beta, length = config.get("attn_scale", 0.1), config.get("floor_scale", 8192)
        scaling = {"beta": beta, "original_max_position_embeddings": length, "position_offset": 1}
        try:
            check_query_scaling("query_scaling", scaling)
        except ValueError:
            raise ValueError(
                "llama4_text's layers without a rotary embedding scale their queries by their "
                "positions (attn_temperature_tuning), by attn_scale and floor_scale: they must "
                f"be a number >= 0 and a positive integer. Received: attn_scale={beta!r}, "
                f"floor_scale={length!r}"
            ) from None
        found["query_scaling"] = scaling
    return found


def _gemma4_options(config: Mapping[str, Any], kind: str | None, layer: int | None):
    """Gemma 3n's and 4's options beside Gemma 3's: their values normalized, their scores
    unscaled, Gemma 4's full layers' values from the key projection (attention_k_eq_v), and
    their last num_kv_shared_layers layers' keys and values those of the last earlier layer of
    their kind (keys_values_of, a port option)."""
    found: dict[str, Any] = {"value_norm": True, "scale": 1.0}
    if flag(config, "attention_k_eq_v") and kind == "full_attention":
        found["values_from_keys"] = True
    shared, count = config.get("num_kv_shared_layers") or 0, _num_layers(config)
    if not shared:
        return found
    if count is not None and shared >= count:
        raise ValueError(
            f"the config's num_kv_shared_layers={shared} leaves none of its {count} layers keys "
            "and values of its own (transformers gives a Gemma 3n config that does not write "
            "it 15)"
        )
    if count is None or layer is None:
        raise ValueError(
            f"the config's last {shared} layers (num_kv_shared_layers) attend over the keys "
            "and values of an earlier layer: give the config's number of layers and the "
            "layer's index"
        )
    first = count - shared
    if layer >= first:
        kinds = [_attention_kind(config, i) for i in range(first)]
        if kind not in kinds:
            raise ValueError(f"the config has no {kind} layer before its shared layers")
        found["keys_values_of"] = first - 1 - kinds[::-1].index(kind)
    return found


# Model types whose attention is multi-head latent attention (mha.MultiHeadLatentAttention):
# DeepSeek-V2's or V3's modules in transformers (transformers reads a kimi_k2 config as V3's)
_LATENT_MODEL_TYPES = frozenset(
    {
        "axk1",
        "deepseek_v2",
        "deepseek_v3",
        "glm4_moe_lite",
        "kimi_k2",
        "minicpm3",
        "mistral4",
        "sarvam_mla",
        "youtu",
    }
)


def _latent_options(config: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """num_heads and the options of a latent attention layer that its weights do not tell:
    the rotary embedding of each head's rotary part (pairs in DeepSeek-V2, rope_interleave's
    convention in V3), the RMSNorms' eps (1e-6 whatever rms_norm_eps says, as transformers'
    modules). Every one is given, the layer's defaults being DeepSeek-V3's."""
    # The rotary part's size: transformers' default where the config does not write it
    rope = config.get("qk_rope_head_dim", 64)
    # Mistral 4's rotary parameters give the part rotated as a fraction of the whole head (its
    # config class's default nope part: 64)
    head = rope
    if config.get("model_type") == "mistral4":
        head += config.get("qk_nope_head_dim", 64)
    rotary = rotary_options(config, None, layer, False, head, latent=True)
    rotated = rotary.pop("rope_dim", rope) if "rope_theta" in rotary else "none"
    if rotated != rope:
        raise ValueError(
            f"the config's latent attention rotates {rotated} of the {rope} features of the "
            "rotary part of each head; mha's MultiHeadLatentAttention rotates all of it"
        )
    found = {"num_heads": num_heads(config), "rope_theta": rotary["rope_theta"]}
    found["rope_interleaved"] = rotary.get("rope_interleaved", False)
    if "rope_scaling" in rotary:
        found["rope_scaling"] = rotary["rope_scaling"]
    scaling = query_scaling(config, None)
    if scaling is not None:  # Mistral 4: the queries scaled by their positions
        found["query_scaling"] = scaling
    # transformers' (and DeepSeek's) latent norms take RMSNorm's default, not rms_norm_eps
    found["norm_eps"] = 1e-6
    return found


def _gpt_neo_window(config: Mapping[str, Any], layer: int | None) -> tuple[int | None, str]:
    """GPT-Neo's window and layer type: attention_types, [[kinds, repeats], ...], makes its
    layers global or local, a local one attending to the last window_size positions."""
    kinds = [
        kind for kinds, repeats in config.get("attention_types") or () for kind in kinds * repeats
    ]
    if len(set(kinds)) > 1 and layer is None:
        raise ValueError(
            f"the config's attention_types={config['attention_types']!r} makes some layers "
            "local: give the layer's index"
        )
    kind = kinds[layer % len(kinds)] if kinds and layer is not None else (kinds or ["global"])[0]
    if kind == "local":
        return positive_count("window_size", config.get("window_size", 256)), "sliding_attention"
    return None, "full_attention"


def _attention_kind(config: Mapping[str, Any], layer: int | None) -> str | None:
    """The layer's type, full_attention or sliding_attention, as transformers reads the config
    (mha.layer_kinds); None where the config does not tell the layers apart."""
    kind = layer_kind(config, layer)
    kinds = ("full_attention", "sliding_attention")
    if config.get("model_type") in _LLAMA4:
        kinds += ("chunked_attention",)
    if kind is not None and kind not in kinds:
        raise ValueError(
            f"layer {layer} of the config is {kind!r} (layer_types, or transformers' rule where "
            "it is not written); mha's layer is " + " or ".join(repr(each) for each in kinds)
        )
    return kind


def _scale(config: Mapping[str, Any], layer: int | None) -> float | None:
    """The score scale the config gives the layer, or None where it is 1 / sqrt(head size)."""
    head = head_size(config)
    scale = None
    if config.get("query_pre_attn_scalar") is not None:  # Gemma 2 and 3
        scale = positive_number("query_pre_attn_scalar", config["query_pre_attn_scalar"]) ** -0.5
    if config.get("attention_multiplier") is not None:  # Granite
        scale = positive_number("attention_multiplier", config["attention_multiplier"])
    if config.get("model_type") == "falcon_h1":  # its keys times key_multiplier
        multiplier = positive_number("key_multiplier", config.get("key_multiplier", 1.0))
        if head is None and multiplier != 1.0:
            raise ValueError(
                f"the config's key_multiplier={multiplier!r} scales the scores by the head "
                "size, which it does not tell (head_dim, hidden_size)"
            )
        scale = None if head is None else head**-0.5 * multiplier
    if not flag(config, "scale_attn_weights", True):  # GPT-2
        scale = 1.0
    if (config.get("attn_config") or {}).get("softmax_scale") is not None:  # MPT
        scale = positive_number("softmax_scale", config["attn_config"]["softmax_scale"])
    if config.get("model_type") == "gpt_neo":  # its scores are not scaled
        scale = 1.0
    if config.get("model_type") == "muse_glimmer_text":  # its queries times qk_scale_factor
        factor = positive_number("qk_scale_factor", config["qk_scale_factor"])
        if head is None:
            raise ValueError(
                f"the config's qk_scale_factor={factor!r} scales the scores by the head size, "
                "which it does not tell (head_dim, hidden_size)"
            )
        scale = factor * head**-0.5
    if flag(config, "scale_attn_by_inverse_layer_idx"):
        if layer is None or (scale is None and head is None):
            raise ValueError(
                "the config's scale_attn_by_inverse_layer_idx=True scales each layer's scores "
                "by its index: give the layer's index and the config's sizes"
            )
        scale = (head**-0.5 if scale is None else scale) / (layer + 1)
    if scale is not None and head is not None and math.isclose(scale, head**-0.5, rel_tol=1e-12):
        return None
    return scale


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A config.json's object, its size checked before it is read (or the dict of
    transformers' config object)."""
    if callable(getattr(path, "to_dict", None)):  # a PretrainedConfig: every field it holds
        return path.to_dict()
    try:
        value = parse_json(read_bytes(path, _MAX_CONFIG_BYTES))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the config {os.fspath(path)}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"the config {os.fspath(path)} is not a JSON object")
    return value


_MAX_CONFIG_BYTES = 1 << 20  # a model config is a few KiB
