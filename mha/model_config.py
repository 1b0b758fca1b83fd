"""The port options of a Hugging Face config: num_heads, the rotary embedding, the sliding
window and the score scale of a layer, read from the model's config (a dict or config.json).

`mha.porting.options_from_config` is this module's `options_from_config`. Anything of the
config that changes the attention's numbers and mha's layer cannot hold is an error naming
the field.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from mha.encoding import ROPE_TYPES, check_rope_scaling
from mha.files import read_bytes

__all__ = ["options_from_config"]


def options_from_config(
    config: Mapping[str, Any] | str | os.PathLike, layer: int | None = None
) -> dict[str, Any]:
    """num_heads and the port options of a Hugging Face config (a dict, or a config.json):
    num_attention_heads, the rotary embedding (rope_theta, or transformers 5's
    rope_parameters, also per layer type, with its scaling and partial_rotary_factor;
    transformers' defaults of the model type for what the config does not write), the
    sliding window of the layer's type (layer_types), the score scale where the config
    changes it (query_pre_attn_scalar, attention_multiplier, GPT-2's scale_attn_weights and
    scale_attn_by_inverse_layer_idx, MPT's softmax_scale), Gemma 2's soft cap
    (attn_logit_softcapping), the QK-norm of Qwen3, OLMo 2, Gemma 3 and Qwen3-Next (qk_norm,
    qk_norm_eps, and qk_norm_offset=1.0 for the norms that scale by 1 + weight: a port
    option, not a layer's), Qwen3-Next's output gate (output_gate=True: the port splits the
    query projection), and BLOOM's and MPT's ALiBi (alibi=True), which their model type tells.

    Args:
        config: the config of the model the layer belongs to (a text model's, not a
            multimodal model's that nests it).
        layer: the layer's index in the model; needed where the config's layers differ
            (Gemma 2 and 3, gpt-oss: sliding and full attention).

    Raises:
        ValueError: anything of the config that changes the attention's numbers and mha's
            layer cannot hold (QK-norm, clipped projections, Falcon's ALiBi, ...), each naming the
            field and its value; layers that differ and no
            `layer`; an unreadable file.
    """
    if not isinstance(config, Mapping):
        config = _read_json(config)
    _refuse_config(config)
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
    "no_rope_layers",
    "max_window_layers",
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
}

# Model types whose attention adds ALiBi's position biases, which their configs do not say:
# the layer's alibi option
_ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})

# MPT's attn_config fields whose values change the attention in ways mha's layer cannot
# represent: field -> (the value that leaves it as transformers' MPT computes, what it does).
# transformers adds ALiBi's biases with a max_bias of 8 whatever alibi and alibi_bias_max say
_MPT_UNSUPPORTED = {
    "clip_qkv": (None, "clips the projections' outputs"),
    "qk_ln": (False, "normalizes the queries and keys (QK-norm)"),
    "prefix_lm": (False, "attends both ways over a prefix"),
    "attn_uses_sequence_id": (False, "keeps packed sequences apart"),
    "alibi": (True, "turns ALiBi off, which transformers' MPT adds nonetheless"),
    "alibi_bias_max": (8, "changes ALiBi's slopes, which transformers' MPT does not"),
}

# Model types whose weights a port would misread without an error, and why
_MISREAD_MODEL_TYPES = {
    "chatglm": "keeps q, k and v in blocks under query_key_value, where GPT-NeoX keeps those "
    "of each head, and rotates by a rule its config names rope_ratio",
}


def _refuse_config(config: Mapping[str, Any]) -> None:
    """Refuse every field mha's layer cannot represent, and configs that nest the model's."""
    nested = [
        key
        for key, value in config.items()
        if isinstance(value, Mapping) and "num_attention_heads" in value
    ]
    if nested and _num_heads(config) is None:
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
            for key, (plain, what) in _MPT_UNSUPPORTED.items()
            if attention.get(key, plain) not in (plain, None)
        ]
    if config.get("model_type") in _MISREAD_MODEL_TYPES:
        model_type = config["model_type"]
        problems.append(f"model_type={model_type!r} {_MISREAD_MODEL_TYPES[model_type]}")
    if any("ALiBi's position biases" in problem for problem in problems):
        problems.append(
            "(Falcon's ALiBi, scaled with the scores: port with from_state_dict(..., "
            "num_heads=) and give each call attn_bias=mha.porting.alibi_bias(num_heads, "
            "num_queries, num_keys) / sqrt(head size))"
        )
    if problems:
        raise ValueError(
            "the config's attention does what mha's MultiHeadAttention cannot represent: "
            + "; ".join(problems)
        )


def _held(config: Mapping[str, Any], key: str) -> bool:
    """Whether mha holds what the field does for the config's model type."""
    return key == "qk_layernorm" and config.get("model_type") == "stablelm"


def _num_layers(config: Mapping[str, Any]) -> int | None:
    """The number of layers the config describes, where it tells it."""
    for key in ("layer_types", "no_rope_layers"):
        if config.get(key) is not None:
            if not isinstance(config[key], list):
                raise ValueError(f"the config's {key} is not a list: {config[key]!r}")
            return len(config[key]) or None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int) and 0 < config[key] <= _MAX_LAYERS:
            return config[key]
    return None


# The rotary convention of each model type checked against transformers' own layer, which
# its config does not tell: "half" rotates features (i, i + d/2) as Llama, "pairs"
# (2i, 2i + 1) as GPT-J
_ROTARY = {
    "apertus": "half",
    "arcee": "half",
    "cohere": "pairs",
    "cohere2": "pairs",
    "csm": "half",
    "ernie4_5": "pairs",
    "ernie4_5_moe": "pairs",
    "exaone4": "half",
    "falcon": "half",
    "flex_olmo": "half",
    "gemma": "half",
    "gemma2": "half",
    "gemma3_text": "half",
    "glm": "pairs",
    "glm4": "pairs",
    "glm4_moe": "half",
    "gpt_neox": "half",
    "gpt_oss": "half",
    "gptj": "pairs",
    "granite": "half",
    "granitemoe": "half",
    "helium": "pairs",
    "llama": "half",
    "ministral": "half",
    "mistral": "half",
    "mixtral": "half",
    "nemotron": "half",
    "olmo": "half",
    "olmo2": "half",
    "olmo3": "half",
    "olmoe": "half",
    "phi": "half",
    "phi3": "half",
    "phimoe": "half",
    "qwen2": "half",
    "qwen2_moe": "half",
    "qwen3": "half",
    "qwen3_moe": "half",
    "qwen3_next": "half",
    "seed_oss": "half",
    "smollm3": "half",
    "stablelm": "half",
    "starcoder2": "half",
    "vaultgemma": "half",
}

# Model types whose attention normalizes queries and keys (RMSNorm, scaled by the weights
# q_norm and k_norm): over each head, or over the whole projection
_QK_NORM = {
    "apertus": "head",
    "exaone4": "head",
    "flex_olmo": "projection",
    "gemma3_text": "head",
    "olmo2": "projection",
    "olmo3": "projection",
    "olmoe": "projection",
    "qwen3": "head",
    "qwen3_moe": "head",
    "qwen3_next": "head",
}

# Model types whose norms scale by offset + weight, not by the weight: Gemma's 1 + weight
_QK_NORM_OFFSET = {"gemma3_text": 1.0, "qwen3_next": 1.0}

# Model types whose query projection also gives a gate of the heads' output
_OUTPUT_GATE = frozenset({"qwen3_next"})

# What transformers gives a rotary model type whose config does not write its rotary
# embedding: the base (10000 where not listed), the fraction of each head rotated (all where
# not listed), and the scaling; GPT-J's base is fixed in its code
_DEFAULT_THETA = {
    "apertus": 12_000_000.0,
    "cohere": 500_000.0,
    "csm": 500_000.0,
    "ernie4_5": 500_000.0,
    "ernie4_5_moe": 500_000.0,
    "flex_olmo": 500_000.0,
    "gemma3_text": 1_000_000.0,
    "gpt_oss": 150_000.0,
    "helium": 100_000.0,
    "mixtral": 1_000_000.0,
    "olmo3": 500_000.0,
    "phimoe": 1_000_000.0,
    "smollm3": 2_000_000.0,
}
_DEFAULT_PARTIAL = {
    "glm": 0.5,
    "glm4": 0.5,
    "glm4_moe": 0.5,
    "gpt_neox": 0.25,
    "nemotron": 0.5,
    "phi": 0.5,
    "qwen3_next": 0.25,
    "stablelm": 0.25,
}
_DEFAULT_ROPE = {
    "apertus": {
        "rope_type": "llama3",
        "rope_theta": 12_000_000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    "gpt_oss": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}
# Model types whose config names the base and the fraction rotated otherwise (Gemma 3 reads
# no fraction outside its rope_parameters)
_ROPE_FIELDS = {
    "gpt_neox": ("rotary_emb_base", "rotary_pct"),
    "gemma3_text": ("rope_theta", ""),
    "olmo3": ("rope_theta", ""),
}
# Model types whose sliding layers take their base from another field, unscaled, where the
# config's rotary parameters are not per layer type: Gemma 3's rope_local_base_freq; OLMo 3's
# sliding layers take transformers' default base whatever rope_theta says
_LOCAL_THETA = {"gemma3_text": ("rope_local_base_freq", 10_000.0), "olmo3": ("", 500_000.0)}

# Model types whose layers without a sliding window have no rotary embedding
_ROTARY_WITH_WINDOW_ONLY = frozenset({"cohere2"})
# Model types whose full-attention layers have none where the config has a sliding window
_NO_ROTARY_ON_FULL_LAYERS = frozenset({"exaone4"})

_MAX_LAYERS = 4096  # far more than any model has; bounds the work on a config


def _options_of_layer(config: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """The options of the layer of this index (None: where the config tells no layers)."""
    found: dict[str, Any] = {}
    heads = _num_heads(config)
    if heads is not None:
        found["num_heads"] = heads
    kind = _attention_kind(config, layer)
    window = config.get("sliding_window")
    if window is not None and config.get("use_sliding_window", True) and kind != "full_attention":
        found["sliding_window"] = int(window)
    rotary = _rotary(config, kind, layer)
    model_type = config.get("model_type")
    if rotary and model_type is not None:
        if model_type not in _ROTARY:
            raise ValueError(
                f"the config's model_type={model_type!r} has a rotary embedding whose "
                "convention mha does not know (the config does not tell it): give rope_theta "
                "and rope_interleaved yourself. Known: " + ", ".join(sorted(_ROTARY))
            )
        if model_type in _ROTARY_WITH_WINDOW_ONLY and "sliding_window" not in found:
            rotary = {}
        if model_type in _NO_ROTARY_ON_FULL_LAYERS and window is not None:
            rotary = {} if kind == "full_attention" else rotary
    if rotary:
        found.update(rotary)
        if _ROTARY.get(model_type) == "pairs":
            found["rope_interleaved"] = True
    scale = _scale(config, layer)
    if scale is not None:
        found["scale"] = scale
    if config.get("attn_logit_softcapping") is not None:  # Gemma 2
        found["softcap"] = float(config["attn_logit_softcapping"])
    if model_type in _QK_NORM:  # RMSNorms of queries and keys, scaled by their weights
        found["qk_norm"] = _QK_NORM[model_type]
        found["qk_norm_eps"] = float(config.get("rms_norm_eps", 1e-6))
    if model_type == "stablelm" and config.get("qk_layernorm"):  # a layer norm of each head
        found["qk_norm"] = "layer_norm_per_head"
        found["qk_norm_eps"] = float(config.get("layer_norm_eps", 1e-5))
    if model_type in _QK_NORM_OFFSET:
        found["qk_norm_offset"] = _QK_NORM_OFFSET[model_type]
    if model_type in _OUTPUT_GATE:  # a port option: the query projection holds the gate
        found["output_gate"] = True
    if model_type in _ALIBI_MODEL_TYPES:  # BLOOM, MPT
        found["alibi"] = True
    return found


def _attention_kind(config: Mapping[str, Any], layer: int | None) -> str | None:
    """The layer's type, full_attention or sliding_attention, as layer_types (or Qwen2's
    max_window_layers) says; None where the config does not tell the layers apart."""
    types = config.get("layer_types") or None
    if types is None:
        sliding = config.get("sliding_window") is not None and config.get(
            "use_sliding_window", True
        )
        if sliding and config.get("sliding_window_pattern") is not None:
            raise ValueError(
                f"the config's sliding_window_pattern={config['sliding_window_pattern']!r} "
                "picks the sliding layers, and mha reads which from layer_types only"
            )
        if not sliding or config.get("max_window_layers") is None:
            return None
        if layer is None:
            raise ValueError(
                f"the config's max_window_layers={config['max_window_layers']!r} makes the "
                "layers from that index on slide: give the config's num_hidden_layers and "
                "the layer's index"
            )
        # transformers' rule where layer_types is not written
        return "sliding_attention" if layer >= config["max_window_layers"] else "full_attention"
    kind = types[layer]
    if kind not in ("full_attention", "sliding_attention"):
        raise ValueError(
            f"layer {layer} of the config is {kind!r} (layer_types); mha's layer is "
            "'full_attention' or 'sliding_attention'"
        )
    return kind


def _rotary(config: Mapping[str, Any], kind: str | None, layer: int | None) -> dict[str, Any]:
    """The layer's rotary options: rope_theta, and rope_dim and rope_scaling where the config
    rotates part of each head or scales the frequencies; {} where the layer has no rotary
    embedding. A rotary embedding mha cannot hold is an error naming its field."""
    no_rope = config.get("no_rope_layers")
    if no_rope is not None and (layer is None or layer >= len(no_rope)):
        raise ValueError(f"the config's no_rope_layers does not tell layer {layer}: {no_rope}")
    if no_rope is not None and not no_rope[layer]:
        return {}  # SmolLM3's and Llama 4's layers without rotary embeddings
    rope, field = _rope_parameters(config, kind)
    model_type = config.get("model_type")
    fields = _ROPE_FIELDS.get(model_type, ("rope_theta", "partial_rotary_factor"))
    base_field, partial_field = fields
    default_theta = _DEFAULT_THETA.get(model_type, 10_000.0)
    if kind == "sliding_attention" and model_type in _LOCAL_THETA:
        base_field, default_theta = _LOCAL_THETA[model_type]
    theta = rope.get("rope_theta", config.get(base_field))
    if theta is None and model_type in _ROTARY:
        theta = default_theta
    partial = rope.get("partial_rotary_factor", config.get(partial_field))
    partial = _DEFAULT_PARTIAL.get(model_type) if partial is None else partial
    scaling = _rope_scaling(config, rope, field)
    if theta is None:
        if scaling is not None or partial not in (None, 1.0) or config.get("rotary_dim"):
            raise ValueError(
                f"the config shapes a rotary embedding ({field}={dict(rope)}) and gives no "
                "rope_theta: give the model's rope_theta"
            )
        return {}
    found: dict[str, Any] = {"rope_theta": float(theta)}
    if partial not in (None, 1.0):
        head = _head_size(config)
        if head is None:
            where = (
                f"{field}['partial_rotary_factor']"
                if "partial_rotary_factor" in rope
                else ("partial_rotary_factor")
            )
            raise ValueError(
                f"the config rotates part of each head ({where}={partial!r}) and does not tell "
                "the head size (head_dim, hidden_size)"
            )
        found["rope_dim"] = int(head * partial)  # transformers' rounding
    if config.get("rotary_dim") is not None and config["rotary_dim"] != _head_size(config):
        found["rope_dim"] = int(config["rotary_dim"])  # GPT-J's count of rotated features
    if scaling is not None:
        found["rope_scaling"] = scaling
    return found


def _rope_parameters(config: Mapping[str, Any], kind: str | None) -> tuple[Mapping, str]:
    """The rotary parameters that apply to a layer of `kind`, and the field they are in:
    rope_parameters (per layer type where they are) or rope_scaling, else the model type's
    defaults. Gemma 3's sliding layers take none of a flat rope_scaling."""
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"the config's rope_parameters is not a mapping: {rope!r}")
    if rope and all(isinstance(value, Mapping) for value in rope.values()):
        # Gemma 3: one rotary embedding per layer type
        if kind not in rope:
            which = "no layer_types" if kind is None else f"{kind!r} layers (layer_types)"
            raise ValueError(
                f"the config's rope_parameters are per layer type ({', '.join(rope)}), and "
                f"it has {which}"
            )
        return rope[kind], f"rope_parameters[{kind!r}]"
    legacy = config.get("rope_scaling") or {}
    if legacy and rope:
        raise ValueError(
            f"the config gives both rope_parameters={dict(rope)} and rope_scaling="
            f"{dict(legacy)}; mha reads one"
        )
    model_type = config.get("model_type")
    if kind == "sliding_attention" and model_type in _LOCAL_THETA:
        return {}, "rope_parameters"
    if legacy:
        return legacy, "rope_scaling"
    if not rope and model_type in _DEFAULT_ROPE:
        return _DEFAULT_ROPE[model_type], f"transformers' default rope_parameters of {model_type}"
    return rope, "rope_parameters"


# What every rotary type's parameters may hold beside its own
_ROPE_COMMON = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _rope_scaling(config: Mapping[str, Any], rope: Mapping, field: str) -> dict | None:
    """mha's rope_scaling of the config's rotary parameters (None for the plain frequencies),
    with the lengths and factor transformers takes from the config where they are not given.
    A parameter the type does not take is an error: Ministral 3's llama_4_scaling_beta, for
    one, scales the queries by their position."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" and rope_type not in ROPE_TYPES:
        raise ValueError(
            f"the config's rotary embedding is {rope_type!r} ({field}={dict(rope)}); mha's "
            f"takes 'default' and {', '.join(map(repr, ROPE_TYPES))}"
        )
    taken = set(_ROPE_COMMON).union(*ROPE_TYPES.get(rope_type, ((), ())))
    unknown = sorted(set(rope) - taken)
    if unknown:
        raise ValueError(
            f"the config's {field} gives {', '.join(unknown)}, which a {rope_type!r} rotary "
            f"embedding does not take and mha does not compute ({field}={dict(rope)})"
        )
    if rope_type == "default":
        return None
    longest = config.get("max_position_embeddings")
    original = rope.get("original_max_position_embeddings", longest)
    if rope_type == "longrope":  # Phi-3 keeps the pretrained length beside the parameters
        original = config.get("original_max_position_embeddings", original)
    if rope_type == "dynamic":  # transformers scales from max_position_embeddings
        original = longest
    required, optional = ROPE_TYPES[rope_type]
    scaling = {"rope_type": rope_type}
    scaling |= {key: rope[key] for key in (*required, *optional) if rope.get(key) is not None}
    if "original_max_position_embeddings" in required:
        scaling["original_max_position_embeddings"] = original
    if rope_type in ("yarn", "longrope") and rope.get("factor") is None and longest and original:
        scaling["factor"] = longest / original
    try:
        check_rope_scaling(field, scaling)
    except (TypeError, ValueError) as error:
        raise ValueError(f"the config's rotary scaling: {error}") from None
    return scaling


def _scale(config: Mapping[str, Any], layer: int | None) -> float | None:
    """The score scale the config gives the layer, or None where it is 1 / sqrt(head size)."""
    head = _head_size(config)
    scale = None
    if config.get("query_pre_attn_scalar") is not None:  # Gemma 2 and 3
        scale = float(config["query_pre_attn_scalar"]) ** -0.5
    if config.get("attention_multiplier") is not None:  # Granite
        scale = float(config["attention_multiplier"])
    if config.get("scale_attn_weights") is False:  # GPT-2
        scale = 1.0
    if (config.get("attn_config") or {}).get("softmax_scale") is not None:  # MPT
        scale = float(config["attn_config"]["softmax_scale"])
    if config.get("scale_attn_by_inverse_layer_idx"):
        if layer is None or (scale is None and head is None):
            raise ValueError(
                "the config's scale_attn_by_inverse_layer_idx=True scales each layer's scores "
                "by its index: give the layer's index and the config's sizes"
            )
        scale = (head**-0.5 if scale is None else scale) / (layer + 1)
    if scale is not None and head is not None and math.isclose(scale, head**-0.5, rel_tol=1e-12):
        return None
    return scale


def _num_heads(config: Mapping[str, Any]) -> int | None:
    """The number of attention heads, under the names configs give it; None where the config
    does not tell it, or its encoder's and decoder's differ (the caller gives num_heads)."""
    keys = _HEAD_COUNTS
    if config.get("encoder_attention_heads") != config.get("decoder_attention_heads"):
        keys = keys[: keys.index("encoder_attention_heads")]
    found = [config.get(key) for key in keys]
    whole = [value for value in found if isinstance(value, int) and not isinstance(value, bool)]
    return whole[0] if whole else None


# The names of the number of heads: GPT-2's n_head, MPT's n_heads, T5's num_heads, and BART's
# and Whisper's encoder_attention_heads and decoder_attention_heads where they agree
_HEAD_COUNTS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
)


def _head_size(config: Mapping[str, Any]) -> int | None:
    """The size of a head: head_dim, or the hidden size over the number of heads."""
    if config.get("head_dim") is not None:
        return int(config["head_dim"])
    heads = _num_heads(config)
    hidden = next(
        (config[key] for key in ("hidden_size", "n_embd", "d_model") if config.get(key)), None
    )
    if not heads or not hidden or hidden % heads:
        return None
    return hidden // heads


def _read_json(path: str | os.PathLike) -> dict[str, Any]:
    try:
        value = json.loads(read_bytes(path, _MAX_CONFIG_BYTES))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the config {os.fspath(path)}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"the config {os.fspath(path)} is not a JSON object")
    return value


_MAX_CONFIG_BYTES = 1 << 20  # a model config is a few KiB
