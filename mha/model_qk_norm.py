"""The QK-norm a Hugging Face config gives a layer, as each model type's code norms its queries
and keys: RMSNorms of each head or of the whole projection, StableLM's and Cohere's layer norms
of each head, Gemma's scales of 1 + weight, norms with no weight. `mha.model_config` asks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mha.config_values import flag

__all__ = ["LAYER_NORM_PER_HEAD", "QK_NORM_ALWAYS", "QK_NORM_FIELD", "qk_norm_options"]

# Model types whose attention normalizes queries and keys (RMSNorm, scaled by the weights
# q_norm and k_norm): over each head, or over the whole projection
_QK_NORM = {
    "afmoe": "head",
    "apertus": "head",
    "apertus1p5_text": "head",
    "dots1": "head",
    "exaone4": "head",
    "exaone_moe": "head",
    "flex_olmo": "projection",
    "flint": "head",
    "gemma3_text": "head",
    "gemma3n_text": "head",
    "gemma4_text": "head",
    "embedding_gemma2_text": "head",
    "hunyuan_v1_dense": "head_after_rotary",  # its query_layernorm and key_layernorm
    "hunyuan_v1_moe": "head_after_rotary",
    "hy_v3": "head",
    "kolibri1": "head",
    "lara_mini": "head",
    "lfm2": "head",
    "lfm2_moe": "head",
    "lfm3": "head",
    "mellum": "head",
    "minimax_m2": "projection",
    "minimax_m3_vl_text": "head",
    "molmo2_text": "head",  # its qk_norm_type says: "head" or "projection"
    "muse_glimmer_text": "head",  # with no weight
    "olmo2": "projection",
    "olmo3": "projection",
    "olmo_hybrid": "projection",
    "olmoe": "projection",
    "qwen3": "head",
    "qwen3_5_moe_text": "head",
    "qwen3_5_text": "head",
    "qwen3_moe": "head",
    "qwen3_next": "head",
    "qwen3_vl_moe_text": "head",
    "qwen3_vl_text": "head",
}

# Molmo 2's qk_norm_type names its QK-norms: Qwen3's of each head, or OLMo 2's of the projection
_MOLMO2_QK_NORMS = {"qwen3": "head", "olmo": "projection"}


def _qk_norm_kind(config: Mapping[str, Any]) -> str:
    """The qk_norm of the config's model type (Molmo 2's, from its qk_norm_type)."""
    model_type = config.get("model_type")
    if model_type != "molmo2_text":
        return _QK_NORM.get(model_type, "head")
    kind = config.get("qk_norm_type", "qwen3")
    if kind not in _MOLMO2_QK_NORMS:
        raise ValueError(
            f"the config's qk_norm_type={kind!r} is not a QK-norm mha knows: 'qwen3' or 'olmo'"
        )
    return _MOLMO2_QK_NORMS[kind]


# Model types whose configs write use_qk_norm, which transformers does not read: their norms
# are always there
QK_NORM_ALWAYS = frozenset({"hunyuan_v1_dense", "hunyuan_v1_moe", "minimax_m2"})

# Model types whose config's use_qk_norm adds _QK_NORM's "head" norms, and its default there
QK_NORM_FIELD = {"glm4_moe": False, "param2moe": True, "sarvam_moe": True}
# Model types whose field turns on a layer norm of each head, a scale of each head's own, no
# shift (qk_norm="layer_norm_per_head"), before the rotary embedding: StableLM's, Cohere's
LAYER_NORM_PER_HEAD = {"stablelm": "qk_layernorm", "cohere": "use_qk_norm"}

# Model types whose norms scale by offset + weight, not by the weight: Gemma's 1 + weight
_QK_NORM_OFFSET = {
    "gemma3_text": 1.0,
    "minimax_m3_vl_text": 1.0,
    "qwen3_5_moe_text": 1.0,
    "qwen3_5_text": 1.0,
    "qwen3_next": 1.0,
}

# Model types whose QK-norms of each head have no weight, before the rotary embedding (the
# port option weightless_qk_norm): Muse Glimmer's
_WEIGHTLESS_QK_NORM = frozenset({"muse_glimmer_text"})

# Model types whose config names the norms' eps otherwise, and transformers' default of it
_EPS_FIELD = {name: ("norm_eps", 1e-5) for name in ("lfm2", "lfm2_moe", "lfm3")}


def qk_norm_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The QK-norm of the config's model type: qk_norm, qk_norm_eps, and the port options
    qk_norm_offset (Gemma's norms) and weightless_qk_norm (Muse Glimmer's); {} for none."""
    model_type, found = config.get("model_type"), {}
    asked = model_type in QK_NORM_FIELD and flag(config, "use_qk_norm", QK_NORM_FIELD[model_type])
    if model_type in _QK_NORM or asked:  # RMSNorms of queries and keys, scaled by their weights
        found["qk_norm"] = _qk_norm_kind(config)
        field, default = _EPS_FIELD.get(model_type, ("rms_norm_eps", 1e-6))
        found["qk_norm_eps"] = float(config.get(field, default))
    per_head = model_type in LAYER_NORM_PER_HEAD and flag(config, LAYER_NORM_PER_HEAD[model_type])
    if per_head:  # a layer norm of each head
        found["qk_norm"] = "layer_norm_per_head"
        found["qk_norm_eps"] = float(config.get("layer_norm_eps", 1e-5))
    if model_type in _QK_NORM_OFFSET:
        found["qk_norm_offset"] = _QK_NORM_OFFSET[model_type]
    if model_type in _WEIGHTLESS_QK_NORM:
        found["weightless_qk_norm"] = True
    return found
