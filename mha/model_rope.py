"""The rotary embedding a Hugging Face config gives a layer: its base, the part of each head
it turns, its scaling and its convention, as transformers reads the config, with the defaults
of each model type where the config does not write them. `mha.model_config` asks it for each
layer's rotary options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mha.config_defaults import DEFAULT_PARTIAL, DEFAULT_ROPE, DEFAULT_ROPE_BY_KIND, DEFAULT_THETA
from mha.config_values import flag, fraction, is_whole, positive_count, positive_number
from mha.encoding import ROPE_TYPES, check_query_scaling, check_rope_scaling
from mha.layer_kinds import last_layer, rotates
from mha.rotary_types import ROTARY, UNCHECKED_ROTARY

__all__ = ["ROTARY", "TURNS_PART", "query_scaling", "rotary_options"]

# Model types whose base is 10000 in transformers' code, which reads no rotary field of the
# config (GPT-J's rotary_dim aside)
_THETA_IN_CODE = frozenset({"gptj", "roformer"})
# Model types whose code reads the base alone (rope_theta): no scaling, no fraction rotated
_THETA_ALONE = frozenset({"esm"})
# Model types whose code turns the part of each head partial_rotary_factor gives (GPT-NeoX's
# rotary_pct); the others' turns the whole head whatever the fraction under the default
# rotary embedding, and fails on one under a scaled embedding
TURNS_PART = frozenset(
    (
        "glm glm4 glm4_moe glm4_moe_lite glm4v_moe_text glm4v_text glm_image_text glm_ocr_text "
        "gpt_neox minimax_m2 minimax_m3_vl_text mistral4 nemotron param2moe phi phi3 "
        "qwen3_5_moe_text qwen3_5_text qwen3_next recurrent_gemma sarvam_moe stablelm"
    ).split()
)
# Model types among the others whose code fails on a fraction under any rotary embedding
_FAILS_ON_PART = frozenset({"solar_open"})
# Model types whose config names the base and the fraction rotated otherwise (Gemma 4 reads
# neither outside its rope_parameters; Gemma 3's, 3n's and OLMo 3's config classes copy a
# top-level fraction into each layer type's parameters)
_ROPE_FIELDS = {
    **{model_type: ("", "") for model_type in _THETA_IN_CODE},
    **{model_type: ("rope_theta", "") for model_type in _THETA_ALONE},
    "gpt_neox": ("rotary_emb_base", "rotary_pct"),
    "gemma3_text": ("rope_theta", "partial_rotary_factor"),
    "gemma3n_text": ("rope_theta", "partial_rotary_factor"),
    "gemma4_text": ("", ""),  # its rope_parameters alone (transformers reads no older field)
    "embedding_gemma2_text": ("", ""),
    "mellum": ("", ""),
    "modernbert": ("global_rope_theta", ""),
    "modernbert-decoder": ("global_rope_theta", ""),
    "olmo3": ("rope_theta", "partial_rotary_factor"),
    "qwen2_5_vl_text": ("rope_theta", ""),
    "qwen2_vl_text": ("rope_theta", ""),
}
# Model types whose sliding layers take their base from another field, where the config's
# rotary parameters are not per layer type: Gemma 3's and 3n's rope_local_base_freq (unscaled),
# ModernBERT's local_rope_theta (and rope_scaling, as its full layers: _LOCAL_SCALED); OLMo
# 3's sliding layers take transformers' default base whatever rope_theta says
_LOCAL_SCALED = frozenset({"modernbert", "modernbert-decoder"})
_LOCAL_THETA = {
    "gemma3_text": ("rope_local_base_freq", 10_000.0),
    "gemma3n_text": ("rope_local_base_freq", 10_000.0),
    "olmo3": ("", 500_000.0),
    "modernbert": ("local_rope_theta", 10_000.0),
    "modernbert-decoder": ("local_rope_theta", 10_000.0),
}

# Model types whose rope_parameters turn the rotary embedding off with a rope_theta of null
# (OLMo Hybrid's released configs: its layers then add no positions)
_NULL_THETA_TURNS_NONE = frozenset({"olmo_hybrid"})

# Model types whose rotary parameters are one per layer type alone, null for a type without a
# rotary embedding (Cohere Compass's text model: its flat keys beside them are not read)
_ROPE_BY_KIND_ONLY = frozenset({"cohere_compass_text"})

# Model types whose config class keeps rotary parameters per layer type alone: it nests an
# older flat rope_scaling into the full layers' (ModernBERT's into both types': _LOCAL_SCALED)
# over {"rope_type": "default"}, so reads no older key 'type', and from then on reads them as
# parameters per layer type (no truncate, no top-level original length); it reads no flat
# rope_parameters, and fills a layer type the config leaves out with the default embedding
_NESTS_PER_KIND = frozenset(_LOCAL_THETA)
# Model types whose older configs name YaRN 'deepseek_yarn' (rope_scaling's type)
_DEEPSEEK_YARN = frozenset({"sarvam_mla"})

# Model types whose cross-attention layers turn their queries and keys otherwise than their
# self-attention layers (RoFormer's not at all), which a layer's index does not tell apart
_SELF_ATTENTION_ONLY = frozenset({"esm", "roformer"})
# Model types whose config's position_embedding_type says whether they rotate (ESM-1b's
# "absolute" positions are added to the embeddings; Granite 4.0's "nope" adds none)
# (its name of the rotary type, the types without rotation, the first the default; None:
# any other type is without rotation, as Granite 4.0's code reads it)
_POSITION_TYPES = {"esm": ("rotary", ("absolute",)), "granitemoehybrid": ("rope", None)}
# Model types whose layers without a sliding window have no rotary embedding
_ROTARY_WITH_WINDOW_ONLY = frozenset({"afmoe", "cohere2", "cohere2_moe", "flint", "lara_mini"})
# Model types whose dense layers (mlp_layer_types' "dense", or the first first_k_dense_replace)
# rotate without a window too where the dense layers' own pattern is 1: Cohere 2 MoE's
# force_rope
_ROTARY_ON_DENSE = frozenset({"cohere2_moe"})
# Model types whose full-attention layers have none where the config has a sliding window
_NO_ROTARY_ON_FULL_LAYERS = frozenset({"exaone4", "exaone_moe", "kolibri1"})


def rotary_options(
    config: Mapping[str, Any],
    kind: str | None,
    layer: int | None,
    windowed: bool,
    head: int | None,
    latent: bool = False,
) -> dict[str, Any]:
    """The rotary options of the layer of this index and type (rope_theta, and rope_dim,
    rope_scaling and rope_interleaved where they apply); {} where it has no rotary embedding.
    windowed: whether the layer has a sliding window; head: the head size, where the config
    tells it (the rotary part's, for a latent attention layer: latent). A rotary embedding of
    a model type whose convention mha does not know is an error: the config does not tell
    it."""
    model_type = config.get("model_type")
    if model_type in _POSITION_TYPES and not _rotates(config, *_POSITION_TYPES[model_type]):
        return {}
    rotary = _rotary(config, kind, layer, head, latent)
    if model_type is None or not (rotary or model_type in UNCHECKED_ROTARY):
        return rotary
    if model_type not in ROTARY:  # UNCHECKED_ROTARY's rotate whatever their configs write
        raise ValueError(
            f"the config's model_type={model_type!r} has a rotary embedding whose "
            "convention mha does not know (the config does not tell it): give rope_theta "
            "and rope_interleaved yourself. Known: " + ", ".join(sorted(ROTARY))
        )
    if model_type in _SELF_ATTENTION_ONLY and config.get("add_cross_attention"):
        raise ValueError(
            f"the config's model_type={model_type!r} turns the cross-attention's queries and "
            "keys otherwise than the self-attention's, and the config has both "
            "(add_cross_attention): give rope_theta and rope_interleaved for a self-attention "
            "layer yourself"
        )
    if model_type in _ROTARY_WITH_WINDOW_ONLY and not (windowed or _turns_dense(config, layer)):
        return {}
    no_rotary = model_type in _NO_ROTARY_ON_FULL_LAYERS and kind == "full_attention"
    if no_rotary and config.get("sliding_window") is not None:
        return {}
    convention = ROTARY[model_type]
    if convention == "rope_interleave":  # DeepSeek-V3, Kimi K2
        convention = "pairs" if flag(config, "rope_interleave", True) else "half"
    return {**rotary, "rope_interleaved": True} if convention == "pairs" else rotary


def _turns_dense(config: Mapping[str, Any], layer: int | None) -> bool:
    """Whether the layer is one of Cohere 2 MoE's dense layers that turn without a window:
    its dense layers' pattern (prefix_dense_sliding_window_pattern) 1, all of them full."""
    if config.get("model_type") not in _ROTARY_ON_DENSE or layer is None:
        return False
    if config.get("prefix_dense_sliding_window_pattern", 1) != 1:
        return False
    kinds = config.get("mlp_layer_types")  # transformers' own, written beside its layer_types
    if kinds is None:
        dense = config.get("first_k_dense_replace") or 0
        return dense != 0 and layer < positive_count("first_k_dense_replace", dense)
    if not isinstance(kinds, (list, tuple)) or not 0 <= layer < len(kinds):
        raise ValueError(f"the config's mlp_layer_types does not tell layer {layer}: {kinds!r}")
    return kinds[layer] == "dense"


def _rotates(config: Mapping[str, Any], rotary: str, unturned: tuple[str, ...] | None) -> bool:
    """Whether the config's position_embedding_type is the rotary one; a type but it and those
    without rotation (unturned; the first is the default) is an error naming it."""
    kind = config.get("position_embedding_type")
    if unturned is None:
        return kind == rotary
    kind = kind or unturned[0]
    if kind != rotary and kind not in unturned:
        raise ValueError(
            f"the config's position_embedding_type={kind!r} adds position biases mha's layer "
            f"does not hold; it holds {', '.join(map(repr, unturned))} and {rotary!r}"
        )
    return kind == rotary


def _fraction(config: Mapping[str, Any], written: Any) -> Any:
    """The fraction of each head turned: as written, else the model type's default."""
    if written is None:
        return DEFAULT_PARTIAL.get(config.get("model_type"))
    return fraction("partial_rotary_factor", written)


def _turned(config: Mapping[str, Any], partial: Any, scaling: dict | None, latent: bool) -> Any:
    """The fraction of each head the layer turns as transformers' code of the model type
    reads it: a model type whose code turns whole heads (not in TURNS_PART) ignores the
    config's under its default rotary embedding, and cannot run one under a scaled one."""
    model_type = config.get("model_type")
    if scaling is not None and scaling["rope_type"] == "proportional":
        return None  # proportional's own fraction: the whole head turns, part of it at 0
    if model_type not in ROTARY or model_type in TURNS_PART or partial in (None, 1.0):
        return partial
    if scaling is None and model_type not in _FAILS_ON_PART:
        return None
    if latent:  # transformers turns part of the rotary features, which mha's layer refuses
        return partial
    how = "its default" if scaling is None else f"a {scaling['rope_type']!r}"
    raise ValueError(
        f"the config turns part of each head (partial_rotary_factor={partial!r}) under {how} "
        f"rotary embedding; transformers' code of model_type={model_type!r} turns whole "
        "heads, and cannot run it (a part of one frequency it broadcasts over the head)"
    )


def _rotary(
    config: Mapping[str, Any],
    kind: str | None,
    layer: int | None,
    head: int | None,
    latent: bool = False,
) -> dict[str, Any]:
    """The layer's rotary options: rope_theta, and rope_dim and rope_scaling where the config
    rotates part of each head or scales the frequencies; {} where the layer has no rotary
    embedding. A rotary embedding mha cannot hold is an error naming its field."""
    if rotates(config, layer) is False:
        return {}  # SmolLM3's and Llama 4's layers without rotary embeddings
    layer_theta = _layer_theta(config, layer)
    if layer_theta == 0:
        return {}  # Granite SWA's layers without rotary embeddings
    rope, field = _rope_parameters(config, kind)
    if rope is None:
        return {}  # Cohere Compass's layers of a kind without a rotary embedding
    rope = _fixed_alpha(config, rope, head)
    model_type = config.get("model_type")
    if model_type in _NULL_THETA_TURNS_NONE and "rope_theta" in rope and rope["rope_theta"] is None:
        return {}
    fields = _ROPE_FIELDS.get(model_type, ("rope_theta", "partial_rotary_factor"))
    base_field, partial_field = fields
    default_theta = DEFAULT_THETA.get(model_type, 10_000.0)
    if kind == "sliding_attention" and model_type in _LOCAL_THETA:
        base_field, default_theta = _LOCAL_THETA[model_type]
    theta = rope.get("rope_theta", config.get(base_field)) if layer_theta is None else layer_theta
    if theta is None and model_type in ROTARY:
        theta = default_theta
    scaling = _rope_scaling(config, rope, field)
    if scaling is not None and not _scaled_layer(config, layer):
        scaling = None  # Molmo 2's layers outside rope_scaling_layers: the base, unscaled
    partial = _fraction(config, rope.get("partial_rotary_factor", config.get(partial_field)))
    partial = _turned(config, partial, scaling, latent)
    if theta is None:
        if scaling is not None or partial not in (None, 1.0) or config.get("rotary_dim"):
            raise ValueError(
                f"the config shapes a rotary embedding ({field}={dict(rope)}) and gives no "
                "rope_theta: give the model's rope_theta"
            )
        return {}
    found: dict[str, Any] = {"rope_theta": positive_number("rope_theta", theta)}
    if partial not in (None, 1.0):
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
    if partial is None and config.get("rotary_dim") not in (None, head):
        found["rope_dim"] = positive_count("rotary_dim", config["rotary_dim"])  # GPT-J's
    if scaling is not None:
        found["rope_scaling"] = scaling
    return found


# Model types whose "dynamic" rotary embedding with an alpha is NTK scaling by that fixed
# alpha (Hunyuan's; transformers' ntk_alpha): whatever the sequence's length, the base is
# stretched to rope_theta * alpha ** (d / (d - 2)), the rest of the parameters unread
_FIXED_ALPHA = frozenset({"hunyuan_v1_dense", "hunyuan_v1_moe"})


def _fixed_alpha(config: Mapping[str, Any], rope: Mapping, head: int | None) -> Mapping:
    """The rotary parameters as mha reads them: Hunyuan's fixed NTK alpha as the plain rotary
    embedding at the base it stretches to; others as they are."""
    named = rope.get("rope_type", rope.get("type"))
    if config.get("model_type") not in _FIXED_ALPHA or named != "dynamic" or not rope.get("alpha"):
        return rope
    if head is None or head <= 2:
        raise ValueError(
            f"the config stretches its rotary base by alpha={rope['alpha']!r}, by the head size "
            "(head_dim), which it does not tell"
        )
    theta = rope.get("rope_theta", config.get("rope_theta", 10_000.0))
    return {"rope_type": "default", "rope_theta": theta * rope["alpha"] ** (head / (head - 2))}


def _scaled_layer(config: Mapping[str, Any], layer: int | None) -> bool:
    """Whether the layer takes the config's scaled rotary embedding: Molmo 2's take it on the
    layers of rope_scaling_layers (on every layer where it is not written)."""
    layers = config.get("rope_scaling_layers")
    if layers is None:
        return True
    if not isinstance(layers, (list, tuple)) or layer is None:
        raise ValueError(
            f"the config's rope_scaling_layers does not tell layer {layer}: {layers!r}"
        )
    return layer in layers


# Model types whose layer_rope_theta says which layers turn alone (0: none), each by the
# config's base; where it is not written, every fourth layer counted from the last has none
_LAYER_THETA_SWITCHES = frozenset({"muse_glimmer_text"})


def _layer_theta(config: Mapping[str, Any], layer: int | None) -> float | None:
    """The layer's base where the config gives one per layer (Granite SWA's layer_rope_theta,
    0 for a layer without rotary embedding, its scaling from rope_parameters); else None.
    Muse Glimmer's: 0 for none, else None (the config's base)."""
    bases = config.get("layer_rope_theta")
    switches = config.get("model_type") in _LAYER_THETA_SWITCHES
    if bases is None and switches and layer is not None:
        last = last_layer(config, "layers without a rotary embedding count from its last, and its")
        return 0.0 if (last - layer) % 4 == 0 else None
    if bases is None:
        return None
    if not isinstance(bases, list) or layer is None or not 0 <= layer < len(bases):
        raise ValueError(f"the config's layer_rope_theta does not tell layer {layer}: {bases!r}")
    base = positive_number("layer_rope_theta", bases[layer]) if bases[layer] else 0.0
    return (None if base else 0.0) if switches else base


def _rope_parameters(config: Mapping[str, Any], kind: str | None) -> tuple[Mapping, str]:
    """The rotary parameters that apply to a layer of `kind`, and the field they are in:
    rope_parameters (per layer type where they are) or rope_scaling, else the model type's
    defaults. Gemma 3's sliding layers take none of a flat rope_scaling."""
    model_type = config.get("model_type")
    if isinstance(config.get("rope_theta"), (list, tuple)):  # UltraBERT's older configs
        raise ValueError(
            f"the config's rope_theta={config['rope_theta']!r} is not a number (a base per "
            "layer): give rope_parameters per layer type"
        )
    if model_type in _THETA_IN_CODE | _THETA_ALONE:
        return {}, f"{model_type}'s code"
    if model_type in _ROPE_BY_KIND_ONLY:
        return _kind_rope(config, kind)
    rope = config.get("rope_parameters") or {}
    if not rope and not config.get("rope_scaling") and model_type in DEFAULT_ROPE_BY_KIND:
        rope = DEFAULT_ROPE_BY_KIND[model_type]
    if not isinstance(rope, Mapping):
        raise ValueError(f"the config's rope_parameters is not a mapping: {rope!r}")
    legacy = config.get("rope_scaling") or {}
    if not isinstance(legacy, Mapping):
        raise ValueError(f"the config's rope_scaling is not a mapping: {legacy!r}")
    if model_type in _NESTS_PER_KIND:
        rope, legacy = _nested_per_kind(config, rope, legacy), {}
    if legacy and rope:
        raise ValueError(
            f"the config gives both rope_parameters={dict(rope)} and rope_scaling="
            f"{dict(legacy)}; mha reads one"
        )
    if rope and all(isinstance(value, Mapping) for value in rope.values()):
        # Gemma 3: one rotary embedding per layer type
        if kind not in rope:
            which = "no layer_types" if kind is None else f"{kind!r} layers (layer_types)"
            raise ValueError(
                f"the config's rope_parameters are per layer type ({', '.join(rope)}), and "
                f"it has {which}"
            )
        merged = config.get("rope_scaling") and kind in _nested_into(model_type)
        return rope[kind], f"rope_parameters[{kind!r}]" + (" (with rope_scaling)" if merged else "")
    named = (legacy.get("type"), legacy.get("rope_type"))
    if model_type in _DEEPSEEK_YARN and "deepseek_yarn" in named:
        # transformers reads Sarvam's older configs' DeepSeek YaRN as YaRN, by either name
        legacy = {key: value for key, value in legacy.items() if key != "type"}
        return {**legacy, "rope_type": "yarn"}, "rope_scaling"
    if legacy:
        return legacy, "rope_scaling"
    if not rope and model_type in DEFAULT_ROPE:
        return DEFAULT_ROPE[model_type], f"transformers' default rope_parameters of {model_type}"
    return rope, "rope_parameters"


def _nested_per_kind(config: Mapping[str, Any], rope: Mapping, legacy: Mapping) -> dict:
    """The rotary parameters per layer type of a _NESTS_PER_KIND model type, as its config
    class makes them: the config's, a flat rope_scaling nested in (an error where its type is
    under 'type', which is not read), {"rope_type": "default"} for a type left out. Flat
    rope_parameters, which the class does not read, are an error."""
    model_type = config.get("model_type")
    flat = sorted(key for key, value in rope.items() if not isinstance(value, Mapping))
    if flat:
        raise ValueError(
            f"the config's rope_parameters give {', '.join(flat)} for every layer, which "
            f"transformers' config of model_type={model_type!r} does not read (it reads them "
            "per layer type, full_attention and sliding_attention, and turns by the default "
            f"rotary embedding): give them per layer type ({dict(rope)})"
        )
    nested = {kind: dict(rope.get(kind) or {"rope_type": "default"}) for kind in _KINDS}
    for kind in _nested_into(model_type):
        nested[kind].update(legacy)
        unread = legacy.get("type") not in (None, "default") and "rope_type" not in legacy
        if unread and nested[kind].get("rope_type") == "default":
            raise ValueError(
                f"the config's rope_scaling names its type {legacy['type']!r} under 'type', "
                f"which transformers' code of model_type={model_type!r} does not read (it turns "
                "by the default rotary embedding): write it as rope_type"
            )
    return {**rope, **nested}


_KINDS = ("full_attention", "sliding_attention")


def _nested_into(model_type: str | None) -> tuple[str, ...]:
    """The layer types a _NESTS_PER_KIND model type's flat rope_scaling is nested into."""
    return _KINDS if model_type in _LOCAL_SCALED else _KINDS[:1]


def _kind_rope(config: Mapping[str, Any], kind: str | None) -> tuple[Mapping | None, str]:
    """The rotary parameters of the layer type, None for none (_ROPE_BY_KIND_ONLY's); an
    error where the config gives none for it, which transformers cannot run."""
    rope = config.get("rope_parameters")
    if config.get("rope_scaling") is not None:
        raise ValueError(
            f"the config's rope_scaling is not read by model_type={config.get('model_type')!r}"
            " (its rope_parameters are per layer type): give them there"
        )
    entry = rope.get(kind, ...) if isinstance(rope, Mapping) else ...
    if entry is not None and not isinstance(entry, Mapping):
        raise ValueError(
            f"the config's rope_parameters give no rotary embedding for {kind!r} layers (one "
            f"per layer type, null for none), which transformers needs: {rope!r}"
        )
    return entry, f"rope_parameters[{kind!r}]"


# What every rotary type's parameters may hold beside its own
_ROPE_COMMON = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# Model types whose rotary parameters also split the frequencies among the axes of images'
# positions (multimodal rotary): a text's positions are one on every axis, which turns as
# the plain rotary embedding, so mha reads the split and ports the text's attention
_MULTIMODAL_ROPE = frozenset(
    {"qwen2_5_vl_text", "qwen2_vl_text", "qwen3_5_moe_text", "qwen3_5_text"}
    | {"qwen3_vl_moe_text", "qwen3_vl_text"}
    | {"glm4v_moe_text", "glm4v_text", "glm_image_text", "glm_ocr_text", "cohere_compass_text"}
)
# Model types whose older configs name that rotary type "mrope": transformers reads "default"
_MROPE_IS_DEFAULT = frozenset({"qwen2_5_vl_text", "qwen2_vl_text"})
_MULTIMODAL_FIELDS = ("mrope_section", "mrope_interleaved")
# Model types whose rotary parameters also scale the queries by their positions (Llama 4's
# rule, in Ministral 3 and Mistral 4): mha's query_scaling, over the parameters'
# original_max_position_embeddings whatever the rotary type. transformers reads no
# max_position_embeddings among them (its YaRN takes the config's own)
_QUERY_SCALING = frozenset({"ministral3", "mistral4"})
_QUERY_SCALING_FIELDS = (
    "llama_4_scaling_beta",
    "original_max_position_embeddings",
    "max_position_embeddings",
)


def _rope_scaling(config: Mapping[str, Any], rope: Mapping, field: str) -> dict | None:
    """mha's rope_scaling of the config's rotary parameters (None for the plain frequencies),
    with the lengths and factor transformers takes from the config where they are not given.
    A parameter the type does not take is an error (Ministral 3's llama_4_scaling_beta, which
    scales the queries by their position, is read by query_scaling for its model types)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "mrope" and config.get("model_type") in _MROPE_IS_DEFAULT:
        rope_type = "default"
    if rope_type != "default" and rope_type not in ROPE_TYPES:
        raise ValueError(
            f"the config's rotary embedding is {rope_type!r} ({field}={dict(rope)}); mha's "
            f"takes 'default' and {', '.join(map(repr, ROPE_TYPES))}"
        )
    taken = set(_ROPE_COMMON).union(*ROPE_TYPES.get(rope_type, ((), ())))
    if config.get("model_type") in _MULTIMODAL_ROPE:
        taken |= set(_MULTIMODAL_FIELDS)
    if config.get("model_type") in _QUERY_SCALING:
        taken |= set(_QUERY_SCALING_FIELDS)
    unknown = sorted(set(rope) - taken)
    if unknown:
        raise ValueError(
            f"the config's {field} gives {', '.join(unknown)}, which mha's {rope_type!r} rotary "
            f"embedding has no parameter for: the numbers they change it does not compute "
            f"({field}={dict(rope)})"
        )
    if rope_type == "default":
        return None
    _refuse_unread_truncate(rope, rope_type, field, field.startswith("rope_parameters["))
    longest = config.get("max_position_embeddings")
    original = rope.get("original_max_position_embeddings", longest)
    if rope_type in _PRETRAINED_LENGTH:
        original = _pretrained_length(config, rope, field)
    if rope_type == "dynamic":  # transformers scales from max_position_embeddings
        original = longest
    required, optional = ROPE_TYPES[rope_type]
    scaling = {"rope_type": rope_type}
    scaling |= {key: rope[key] for key in (*required, *optional) if rope.get(key) is not None}
    if "original_max_position_embeddings" in required:
        scaling["original_max_position_embeddings"] = _whole(original)
    if rope_type == "yarn" and "factor" not in rope:  # transformers' validation requires it
        raise ValueError(
            f"the config's {field} has no 'factor', which YaRN needs ({field}={dict(rope)})"
        )
    if rope_type in ("yarn", "longrope") and rope.get("factor") is None and longest and original:
        scaling["factor"] = longest / original
    try:
        check_rope_scaling(field, scaling)
    except (TypeError, ValueError) as error:
        raise ValueError(f"the config's rotary scaling: {error}") from None
    return scaling


# The rotary types whose parameters transformers gives a pretrained length where they lack one
_PRETRAINED_LENGTH = ("llama3", "yarn", "longrope")


def _pretrained_length(config: Mapping[str, Any], rope: Mapping, field: str) -> Any:
    """original_max_position_embeddings as transformers sets it in one set of parameters of a
    _PRETRAINED_LENGTH type: the config's own beside them wins (Phi-3's class writes 4096),
    then theirs, then max_position_embeddings; parameters per layer type keep theirs."""
    original = rope.get("original_max_position_embeddings", config.get("max_position_embeddings"))
    if field.startswith("rope_parameters["):
        return original
    return config.get("original_max_position_embeddings", original)


def _whole(value: Any) -> Any:
    """A length JSON wrote as a whole float (8192.0) as the integer; others as they are (the
    scaling's checks refuse them by name)."""
    return int(value) if is_whole(value) and not isinstance(value, bool) else value


def _refuse_unread_truncate(rope: Mapping, rope_type: str, field: str, per_type: bool) -> None:
    """Raise ValueError for a YaRN of one layer type that does not truncate: transformers
    reads `truncate` beside the layer types' parameters, not among them, so truncates."""
    if per_type and rope_type == "yarn" and rope.get("truncate", True) is False:
        raise ValueError(
            f"the config's {field} gives truncate=False, which transformers does not read "
            "from rotary parameters per layer type (it truncates the correction range): "
            "leave truncate out to port what transformers computes"
        )


def query_scaling(config: Mapping[str, Any], kind: str | None) -> dict[str, Any] | None:
    """The layer's query_scaling: Ministral 3's and Mistral 4's llama_4_scaling_beta, over their
    rotary parameters' original_max_position_embeddings (transformers reads both there, and
    cannot run without them); None for other model types."""
    model_type = config.get("model_type")
    if model_type not in _QUERY_SCALING:
        return None
    rope, field = _rope_parameters(config, kind)
    original = rope.get("original_max_position_embeddings")
    if rope.get("rope_type", rope.get("type")) in _PRETRAINED_LENGTH:
        original = _pretrained_length(config, rope, field)  # as the rotary embedding's
    scaling = {
        "beta": rope.get("llama_4_scaling_beta"),
        "original_max_position_embeddings": _whole(original),
    }
    try:
        check_query_scaling(field, scaling)
    except ValueError:
        raise ValueError(
            f"{model_type}'s attention scales its queries by their positions, by the "
            f"llama_4_scaling_beta and original_max_position_embeddings of its {field}: they "
            f"must be a number >= 0 and a positive integer ({field}={dict(rope)})"
        ) from None
    return scaling
