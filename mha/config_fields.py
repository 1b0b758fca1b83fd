"""Which of a config's fields transformers' code of each model type reads.

A config.json may write a field its model type's code never reads: a Llama config with a
`sliding_window` (copied from Mistral's), a Mistral one with `use_sliding_window: false` or
`max_window_layers` (copied from Qwen2's), a Qwen3-VL one with a window, a BERT or GPT-2 one
with a window, a score scale or a rotary base. transformers runs such a model as if the field
were not there, and so must a port: `options_from_config` drops the fields a model type's
code does not read (`without_unread`) before anything is read. The fields read by a few model
types are listed by their readers. Model types without a rotary embedding (`PLAIN`: BERT's,
GPT-2's, BART's, BLOOM's, ...) read none of the fields that shape a rotary embedding, a
window or an attention mha's layer refuses (`UNREAD_WITHOUT_ROTARY`). A config without a
model type, or of one outside the model types mha has checked (`ROTARY` and `PLAIN`), is read
as written. `tests/test_config_fields.py` holds every entry to transformers' models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mha.rotary_types import ROTARY

__all__ = ["PLAIN", "READ_BY", "UNREAD", "UNREAD_WITHOUT_ROTARY", "without_unread"]

# The model types whose code applies a sliding window from the config's sliding_window
_WINDOWED = frozenset(
    (
        "afmoe cohere2 cohere2_moe cohere_compass_text cwm dots1 embedding_gemma2_text exaone4 "
        "exaone_moe flint gemma2 gemma3_text gemma3n_text gemma4_text gpt_oss granite_swa "
        "granitemoe_swa kolibri1 lara_mini lfm3 mellum minimax ministral ministral3 mistral "
        "mixtral modernbert modernbert-decoder muse_glimmer_text olmo3 openai_privacy_filter "
        "phi3 phimoe qwen2 qwen2_5_vl_text qwen2_moe qwen2_vl_text qwen3 qwen3_moe "
        "recurrent_gemma smollm3 starcoder2 ultrabert vaultgemma"
    ).split()
)
# Qwen2's rules of which layers slide: use_sliding_window and max_window_layers
_QWEN2_RULES = frozenset({"qwen2", "qwen2_5_vl_text", "qwen2_moe", "qwen2_vl_text", "qwen3"})

# Model types without a rotary embedding whose code mha has checked: encoders under BERT's
# names, GPT-2's and GPT-1's, BART's, OPT's, BLOOM's, MPT's, Nemotron-H's and Jamba's attention,
# ...
PLAIN = frozenset(
    (
        "bart bert bert-generation biogpt blenderbot blenderbot-small bloom camembert canine "
        "clip_text_model data2vec-text distilbert dpr electra ernie flaubert gpt-sw3 gpt2 "
        "gpt_neo imagegpt jamba layoutlm m2m_100 marian markuplm mbart mpt mvp nemotron_h "
        "openai-gpt opt pegasus plbart rembert roberta "
        "roberta-prelayernorm roc_bert splinter t5 tapas tipsv2_text_model visual_bert vit "
        "whisper xglm xlm xlm-roberta"
    ).split()
)
# The model types whose code builds GPT-2's attention, which reads its scales
_GPT2 = frozenset({"gpt-sw3", "gpt2", "imagegpt"})

# field -> the model types whose code reads it
READ_BY: dict[str, frozenset[str]] = {
    "sliding_window": _WINDOWED,
    "use_sliding_window": _QWEN2_RULES | {"qwen3_moe", "smollm3"},
    "max_window_layers": _QWEN2_RULES | {"dots1"},  # dots.llm1's, without use_sliding_window
    "query_pre_attn_scalar": frozenset({"gemma2", "gemma3_text", "vaultgemma"}),
    "attn_logit_softcapping": frozenset({"gemma2", "vaultgemma"}),  # Gemma 3 passes none
    "attention_multiplier": frozenset(
        (
            "granite granite_docling_text granite_swa granitemoe granitemoe_swa "
            "granitemoehybrid granitemoeshared hyperclovax"
        ).split()
    ),
    "rotary_dim": frozenset({"gptj", "minimax_m2"}),  # GPT-J's count of features turned
    "no_rope_layers": frozenset({"llama4_text", "smollm3"}),
    "layer_rope_theta": frozenset({"granite_swa", "granitemoe_swa", "muse_glimmer_text"}),
    "rope_scaling_layers": frozenset({"molmo2_text"}),  # the layers a scaling applies to
    # Llama 4's chunks (Gemma 4's and EmbeddingGemma 2's configs read them too: refused there,
    # as elsewhere)
    "attention_chunk_size": frozenset({"embedding_gemma2_text", "gemma4_text", "llama4_text"}),
    # the older rule of which layers slide: every sliding_window_pattern-th layer full
    "sliding_window_pattern": frozenset(
        {"cohere2", "cohere2_moe", "embedding_gemma2_text", "exaone4", "exaone_moe", "gemma3_text"}
    ),
    # GPT-2's scales, read by the model types that build its attention
    "scale_attn_weights": _GPT2,
    "scale_attn_by_inverse_layer_idx": _GPT2,
}

# Fields read by most model types that a few do not: layer_types by the windowed ones that
# slide every layer (Mistral's), Cohere 2 MoE's rope_scaling beside its rope_parameters
_ALSO_UNREAD = {
    **{
        model_type: frozenset({"layer_types"})
        for model_type in "ministral3 mistral mixtral phi3 phimoe qwen3_moe starcoder2".split()
    },
    "cohere2_moe": frozenset({"rope_scaling"}),
}

# Fields no PLAIN model type's code reads beside those of READ_BY: a rotary embedding's, the
# layers' kinds, and those of an attention mha's layer refuses (mha.model_config)
UNREAD_WITHOUT_ROTARY = frozenset(
    (
        "rope_theta rope_scaling rope_parameters partial_rotary_factor rope_interleave "
        "layer_types use_qk_norm qk_layernorm clip_qkv attn_temperature_tuning "
        "use_bidirectional_attention alibi rotary_value"
    ).split()
)

# Nemotron-H's layer_types name its layers' kinds (attention, Mamba, MLP, MoE), which it reads
_KINDS_READ = {"nemotron_h": frozenset({"layer_types"})}

# model type -> the fields of READ_BY (and of _ALSO_UNREAD, UNREAD_WITHOUT_ROTARY) its code
# does not read
UNREAD: dict[str, frozenset[str]] = {
    model_type: frozenset(field for field, readers in READ_BY.items() if model_type not in readers)
    | _ALSO_UNREAD.get(model_type, frozenset())
    | (UNREAD_WITHOUT_ROTARY - _KINDS_READ.get(model_type, set()) if model_type in PLAIN else set())
    for model_type in ROTARY.keys() | PLAIN
}


def without_unread(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config without the fields its model type's code does not read (UNREAD)."""
    unread = UNREAD.get(config.get("model_type"), frozenset())
    return {key: value for key, value in config.items() if key not in unread}
