"""The rotary embedding a Hugging Face config gives a layer: its base, the part of each head
it turns, its scaling and its convention, as transformers reads the config, with the defaults
of each model type where the config does not write them. `mha.model_config` asks it for each
layer's rotary options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mha.config_defaults import DEFAULT_PARTIAL, DEFAULT_ROPE, DEFAULT_ROPE_BY_KIND, DEFAULT_THETA
from mha.config_values import fraction, positive_count, positive_number
from mha.encoding import ROPE_TYPES, check_query_scaling, check_rope_scaling
from mha.layer_kinds import rotates

__all__ = ["ROTARY", "TURNS_PART", "query_scaling", "rotary_options"]

# The rotary convention of each model type checked against transformers' own layer, which
# its config does not tell: "half" rotates features (i, i + d/2) as Llama, "pairs"
# (2i, 2i + 1) as GPT-J, "rope_interleave" as the config's field of that name says (pairs when
# True, its default)
ROTARY = {
    "apertus": "half",
    "apertus1p5_text": "half",  # Apertus 1.5's text model is Apertus's
    "arcee": "half",
    "aria_text": "half",
    "axk1": "rope_interleave",  # DeepSeek-V3's latent attention
    "cohere": "pairs",
    "cohere2": "pairs",
    "cohere2_moe": "pairs",
    "csm": "half",
    "cwm": "half",
    "deepseek_v2": "pairs",
    "deepseek_v3": "rope_interleave",
    "ernie4_5": "pairs",
    "ernie4_5_moe": "pairs",
    "esm": "half",  # ESM-2's, where position_embedding_type is "rotary"
    "esmc": "half",
    "eurobert": "half",
    "exaone": "half",  # EXAONE 3 and 3.5, Llama's layers in transformers
    "exaone4": "half",
    "exaone_moe": "half",
    "falcon": "half",
    "falcon_h1": "half",
    "flex_olmo": "half",
    "gemma": "half",
    "gemma2": "half",
    "gemma3_text": "half",
    "gemma3n_text": "half",
    "gemma4_text": "half",
    "embedding_gemma2_text": "half",
    "glm": "pairs",
    "glm4": "pairs",
    "glm4_moe": "half",
    "glm4_moe_lite": "rope_interleave",  # DeepSeek-V3's latent attention
    "gpt_neox": "half",
    "gpt_oss": "half",
    "gptj": "pairs",
    "granite": "half",
    "granite_docling_text": "half",
    "granitemoe": "half",
    "granitemoehybrid": "half",  # Granite 4.0's, where position_embedding_type is "rope"
    "granitemoeshared": "half",
    "granite_swa": "half",
    "granitemoe_swa": "half",
    "gte": "half",
    "helium": "pairs",
    "higgs_audio_v2": "half",
    "hunyuan_v1_dense": "half",
    "hunyuan_v1_moe": "half",
    "hy_v3": "half",
    "hyperclovax": "half",
    "internlm3": "half",
    "iquestcoder": "half",  # transformers builds Llama's modules
    "jais2": "half",
    "jina_embeddings_v3": "half",
    "kolibri1": "half",
    "lara_mini": "half",
    "lfm2": "half",
    "lfm2_moe": "half",
    "lfm3": "half",
    # Kimi K2's own config.json: transformers reads it as DeepSeek-V3's (Kimi K2.5's text_config)
    "kimi_k2": "rope_interleave",
    "llama": "half",
    "llama4_text": "pairs",  # complex products of (2i, 2i + 1)
    "mellum": "half",
    "minicpm3": "half",  # DeepSeek-V2's latent attention, Llama's rotary
    "minimax": "half",  # MiniMax-Text-01's full-attention layers
    "minimax_m2": "half",
    "ministral": "half",
    "ministral3": "half",
    "mistral": "half",
    "mistral4": "rope_interleave",  # DeepSeek-V3's latent attention
    "mixtral": "half",
    "molmo2_text": "half",
    "nanochat": "half",  # turned the other way: the port's reversed_rotary
    "nemotron": "half",
    "nomic_bert": "half",
    "olmo": "half",
    "olmo2": "half",
    "olmo3": "half",
    "olmo_hybrid": "half",  # its full-attention layers; rope_parameters' rope_theta null: none
    "olmoe": "half",
    "phi": "half",
    "phi3": "half",
    "phimoe": "half",
    "qwen2": "half",
    "qwen2_moe": "half",
    "qwen2_5_vl_text": "half",  # multimodal rotary, turning text as the plain one
    "qwen2_vl_text": "half",
    "qwen3": "half",
    "qwen3_moe": "half",
    "qwen3_next": "half",
    # Qwen3.5's text models (Qwen3-Next's attention); their multimodal rotary turns text as this
    "qwen3_5_moe_text": "half",
    "qwen3_5_text": "half",
    "qwen3_vl_moe_text": "half",
    "qwen3_vl_text": "half",
    "roformer": "pairs",
    "sarvam_mla": "rope_interleave",  # DeepSeek-V3's layers in transformers
    "sarvam_moe": "half",  # GLM-4.5's layers in transformers, the whole head rotated
    "seed_oss": "half",
    "smollm3": "half",
    "solar_open": "half",
    "stablelm": "half",
    "ultrabert": "half",  # an encoder: its windows reach sliding_window positions either side
    "starcoder2": "half",
    "vaultgemma": "half",
    "youtu": "rope_interleave",  # DeepSeek-V3's latent attention
}

# Model types whose code in transformers turns queries and keys (their modeling modules call
# a rotary embedding) by a rule mha has not checked, or beside what mha's layer holds: text,
# vision and audio models alike. A config of one is refused even where it writes no rotary
# field (transformers rotates with its defaults); tests/test_config_defaults.py holds the list
# to the installed transformers' code
UNCHECKED_ROTARY = frozenset(
    (
        "afmoe apertus1p5_vision_tokenizer axk2 bailing_hybrid bamba beam bitnet "
        "blt_global_transformer blt_local_decoder blt_local_encoder blt_patcher "
        "chameleon_vqgan clvp_decoder clvp_encoder codegen cohere_compass_text "
        "cohere_compass_vision cosmos3_edge_text cosmos3_edge_vision csm_depth_decoder_model "
        "dbrx deepseek_ocr2_encoder deepseek_ocr2_sam_vision_model deepseek_ocr2_text "
        "deepseek_v32 deepseek_v4 dia_decoder dia_encoder diffllama diffusion_gemma_text "
        "dinov3_vit doge dory dots1 dots3_note_audio_encoder dots3_note_text "
        "dots3_note_vision_encoder edgetam_video_mask_decoder edgetam_video_prompt_encoder "
        "efficientloftr emu3_text_model emu3_vqgan eomt_dinov3 "
        "ernie4_5_vl_moe_text ernie4_5_vl_moe_vision exaone4_5_vision flint gemma3n_audio "
        "gemma3n_vision gemma4_audio gemma4_unified_audio gemma4_unified_text "
        "gemma4_unified_vision gemma4_vision glm4v_moe_text glm4v_moe_vision glm4v_text "
        "glm4v_vision glm5_next_text glm5_next_vision glm_image_text glm_image_vision "
        "glm_image_vqmodel glm_moe_dsa glm_ocr_text glm_ocr_vision glmasr_encoder "
        "gpt_neox_japanese granite4_vision_text granite_docling_vision hrm_text "
        "hunyuan_vl_text hunyuan_vl_vision hy_v4 hy_v4_vl_text hy_v4_vl_vision "
        "idefics_perciever idefics_vision inkling2_text inkling2_vision jetmoe "
        "kimi_k25_vision laguna lasr_encoder lfm3_vl_vision llama4_vision_model longcat_flash "
        "mimi mimi_decoder mimi_encoder mimo_v2_flash minimax_m3_vl_text minimax_m3_vl_vision "
        "mistral_large4_text mlcd mlcd_vision_model mllama_text_model mllama_vision_model "
        "modernbert modernbert-decoder molmo2_adapter molmo2_vision moonshine "
        "moonshine_streaming_encoder moshi_depth muse_glimmer_assistant muse_glimmer_text "
        "muse_glimmer_vision muse_spark_audio muse_spark_text muse_spark_vision "
        "nemotron3_5_transcribe_asr_audio nemotron3_5_transcribe_word_timestamp "
        "nemotron3_diarization_audio neomme openai_privacy_filter paddleocr_vl_text "
        "paddleocr_vl_vision persimmon phi4_multimodal_audio phi4_multimodal_vision pixtral "
        "pocket_tts_audio_tokenizer pocket_tts_audio_tokenizer_decoder "
        "pocket_tts_audio_tokenizer_encoder qwen2_5_omni_audio_encoder qwen2_5_omni_bigvgan "
        "qwen2_5_omni_dit qwen2_5_omni_talker qwen2_5_omni_text qwen2_5_omni_vision_encoder "
        "qwen2_5_vl_vision qwen2_vl_vision qwen3_5_moe_vision qwen3_5_vision "
        "qwen3_omni_moe_audio_encoder qwen3_omni_moe_talker_code_predictor "
        "qwen3_omni_moe_talker_text qwen3_omni_moe_text qwen3_omni_moe_vision_encoder "
        "qwen3_vl_moe_vision qwen3_vl_vision qwen4_exp_text qwen4_exp_vision recurrent_gemma "
        "sam2_video_mask_decoder sam2_video_prompt_encoder sam3_detr_decoder "
        "sam3_detr_encoder sam3_geometry_encoder sam3_mask_decoder "
        "sam3_tracker_video_mask_decoder sam3_tracker_video_prompt_encoder sam3_vit_model "
        "sapiens2_head step3p5 step3p5_vision t5_gemma_module t5gemma2_decoder t5gemma2_text "
        "timesfm2_5 unlimited_ocr_sam_vision_model unlimited_ocr_text "
        "unlimited_ocr_vision_encoder video_llama_3_vision vjepa2 voxtral_realtime_encoder "
        "voxtral_realtime_text zamba2 zaya"
    ).split()
)

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
        "glm glm4 glm4_moe glm4_moe_lite gpt_neox minimax_m2 mistral4 nemotron phi phi3 "
        "qwen3_5_moe_text qwen3_5_text qwen3_next sarvam_moe stablelm"
    ).split()
)
# Model types among the others whose code fails on a fraction under any rotary embedding
_FAILS_ON_PART = frozenset({"solar_open"})
# Model types whose config names the base and the fraction rotated otherwise (Gemma 3 reads
# no fraction outside its rope_parameters, Gemma 4 neither a base)
_ROPE_FIELDS = {
    **{model_type: ("", "") for model_type in _THETA_IN_CODE},
    **{model_type: ("rope_theta", "") for model_type in _THETA_ALONE},
    "gpt_neox": ("rotary_emb_base", "rotary_pct"),
    "gemma3_text": ("rope_theta", ""),
    "gemma3n_text": ("rope_theta", ""),
    "gemma4_text": ("", ""),  # its rope_parameters alone (transformers reads no older field)
    "embedding_gemma2_text": ("", ""),
    "mellum": ("", ""),
    "olmo3": ("rope_theta", ""),
    "qwen2_5_vl_text": ("rope_theta", ""),
    "qwen2_vl_text": ("rope_theta", ""),
}
# Model types whose sliding layers take their base from another field, unscaled, where the
# config's rotary parameters are not per layer type: Gemma 3's and 3n's rope_local_base_freq;
# OLMo 3's sliding layers take transformers' default base whatever rope_theta says
_LOCAL_THETA = {
    "gemma3_text": ("rope_local_base_freq", 10_000.0),
    "gemma3n_text": ("rope_local_base_freq", 10_000.0),
    "olmo3": ("", 500_000.0),
}

# Model types whose rope_parameters turn the rotary embedding off with a rope_theta of null
# (OLMo Hybrid's released configs: its layers then add no positions)
_NULL_THETA_TURNS_NONE = frozenset({"olmo_hybrid"})

# Model types whose rope_scaling transformers nests per layer type without reading its
# older key 'type' (their rotary embedding stays the default one)
_LEGACY_TYPE_UNREAD = frozenset({"gemma3n_text", "olmo3"})
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
_ROTARY_WITH_WINDOW_ONLY = frozenset({"cohere2", "cohere2_moe", "lara_mini"})
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
    if model_type in _ROTARY_WITH_WINDOW_ONLY and not windowed:
        return {}
    no_rotary = model_type in _NO_ROTARY_ON_FULL_LAYERS and kind == "full_attention"
    if no_rotary and config.get("sliding_window") is not None:
        return {}
    convention = ROTARY[model_type]
    if convention == "rope_interleave":  # DeepSeek-V3, Kimi K2
        convention = "pairs" if config.get("rope_interleave", True) else "half"
    return {**rotary, "rope_interleaved": True} if convention == "pairs" else rotary


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
        "heads, and cannot run it"
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


def _layer_theta(config: Mapping[str, Any], layer: int | None) -> float | None:
    """The layer's base where the config gives one per layer (Granite SWA's layer_rope_theta,
    0 for a layer without rotary embedding, its scaling from rope_parameters); else None."""
    bases = config.get("layer_rope_theta")
    if bases is None:
        return None
    if not isinstance(bases, list) or layer is None or not 0 <= layer < len(bases):
        raise ValueError(f"the config's layer_rope_theta does not tell layer {layer}: {bases!r}")
    return float(bases[layer])


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
    rope = config.get("rope_parameters") or {}
    if not rope and not config.get("rope_scaling") and model_type in DEFAULT_ROPE_BY_KIND:
        rope = DEFAULT_ROPE_BY_KIND[model_type]
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
    if not isinstance(legacy, Mapping):
        raise ValueError(f"the config's rope_scaling is not a mapping: {legacy!r}")
    if legacy and rope:
        raise ValueError(
            f"the config gives both rope_parameters={dict(rope)} and rope_scaling="
            f"{dict(legacy)}; mha reads one"
        )
    if kind == "sliding_attention" and model_type in _LOCAL_THETA:
        return {}, "rope_parameters"
    named = (legacy.get("type"), legacy.get("rope_type"))
    if model_type in _DEEPSEEK_YARN and "deepseek_yarn" in named:
        # transformers reads Sarvam's older configs' DeepSeek YaRN as YaRN, by either name
        legacy = {key: value for key, value in legacy.items() if key != "type"}
        return {**legacy, "rope_type": "yarn"}, "rope_scaling"
    if model_type in _LEGACY_TYPE_UNREAD and legacy.get("type") not in (None, "default"):
        if "rope_type" not in legacy:
            raise ValueError(
                f"the config's rope_scaling names its type {legacy['type']!r} under 'type', "
                f"which transformers' code of model_type={model_type!r} does not read (it turns "
                "by the default rotary embedding): write it as rope_type"
            )
    if legacy:
        return legacy, "rope_scaling"
    if not rope and model_type in DEFAULT_ROPE:
        return DEFAULT_ROPE[model_type], f"transformers' default rope_parameters of {model_type}"
    return rope, "rope_parameters"


# What every rotary type's parameters may hold beside its own
_ROPE_COMMON = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# Model types whose rotary parameters also split the frequencies among the axes of images'
# positions (multimodal rotary): a text's positions are one on every axis, which turns as
# the plain rotary embedding, so mha reads the split and ports the text's attention
_MULTIMODAL_ROPE = frozenset(
    {"qwen2_5_vl_text", "qwen2_vl_text", "qwen3_5_moe_text", "qwen3_5_text"}
    | {"qwen3_vl_moe_text", "qwen3_vl_text"}
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


def query_scaling(config: Mapping[str, Any], kind: str | None) -> dict[str, Any] | None:
    """The layer's query_scaling: Ministral 3's and Mistral 4's llama_4_scaling_beta, over their
    rotary parameters' original_max_position_embeddings (transformers reads both there, and
    cannot run without them); None for other model types."""
    model_type = config.get("model_type")
    if model_type not in _QUERY_SCALING:
        return None
    rope, field = _rope_parameters(config, kind)
    scaling = {
        "beta": rope.get("llama_4_scaling_beta"),
        "original_max_position_embeddings": rope.get("original_max_position_embeddings"),
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
