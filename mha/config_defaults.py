"""What transformers gives a config field that a model type's config.json does not write.

`options_from_config` reads a config as transformers does: a field the file leaves out takes
the default of the model type's config class (Gemma 2's query_pre_attn_scalar of 256 and its
soft cap of 50, Granite's attention_multiplier of 1, Mistral's window of 4096, OLMo 2's norm
eps of 1e-5). These are the class defaults of transformers 5.25 for the fields mha reads
(`tests/test_config_defaults.py` holds them to the installed transformers), and the
rotary embedding's of each rotary model type, which `mha.model_rope` reads (the family test
of `tests/test_families.py` holds those, from configs that write none).

A config class may take a field under another name (its `attribute_map`: Molmo 2's
`layer_norm_eps` is its `rms_norm_eps`, LFM3's `rms_norm_eps` its `norm_eps`); a config that
writes the other name is read under the class's own (`with_aliases`), the other name winning
where both are written, as in transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mha.config_values import positive_count

__all__ = [
    "ALIASES",
    "DEFAULTS",
    "DEFAULT_PARTIAL",
    "DEFAULT_ROPE",
    "DEFAULT_ROPE_BY_KIND",
    "DEFAULT_THETA",
    "FIELDS",
    "READ_NAMES",
    "with_aliases",
    "with_defaults",
]

# The fields whose defaults matter to a port: the head size (where a fraction of it turns),
# windows and which layers slide, norms' eps, score scales and soft caps, chunks and the
# queries' scaling, QK-norms, positions, the pretrained length beside the rotary parameters
FIELDS = (
    "head_dim",
    "sliding_window",
    "local_attention",
    "attention_window_size",
    "use_sliding_window",
    "max_window_layers",
    "sliding_window_pattern",
    "prefix_dense_sliding_window_pattern",
    "window_size",
    "num_kv_shared_layers",
    "rms_norm_eps",
    "norm_eps",
    "layer_norm_eps",
    "query_pre_attn_scalar",
    "attention_multiplier",
    "qk_scale_factor",
    "attn_logit_softcapping",
    "key_multiplier",
    "scale_attn_weights",
    "attention_chunk_size",
    "attn_scale",
    "floor_scale",
    "attn_temperature_tuning",
    "no_rope_layer_interval",
    "use_qk_norm",
    "qk_norm_type",
    "qk_layernorm",
    "attention_k_eq_v",
    "use_attention_gate",
    "use_bidirectional_attention",
    "position_embedding_type",
    "rope_interleave",
    "original_max_position_embeddings",
)

# The names a port reads beside FIELDS: head counts and sizes, the layers' kinds
READ_NAMES = (
    *FIELDS,
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "layer_types",
    "layers_block_type",
)

# model type -> {other name: the config class's own}, from its attribute_map, for the names
# of READ_NAMES
ALIASES: dict[str, dict[str, str]] = {
    **{
        model_type: {"num_attention_heads": "encoder_attention_heads", "hidden_size": "d_model"}
        for model_type in (
            "bart blenderbot blenderbot-small m2m_100 marian mbart mvp pegasus plbart".split()
        )
    },
    **{
        model_type: {"hidden_size": "n_embd", "num_attention_heads": "n_head"}
        for model_type in "gpt-sw3 gpt2 gptj imagegpt openai-gpt".split()
    },
    "bloom": {"num_attention_heads": "n_head"},
    "distilbert": {"hidden_size": "dim", "num_attention_heads": "n_heads"},
    "exaone": {"layer_norm_epsilon": "rms_norm_eps"},
    "falcon_h1": {"layer_types": "layers_block_type"},
    "flaubert": {"hidden_size": "emb_dim", "num_attention_heads": "n_heads"},
    "glm4_moe_lite": {"head_dim": "qk_rope_head_dim"},
    "gpt_neo": {"num_attention_heads": "num_heads"},
    "granitemoehybrid": {"layers_block_type": "layer_types"},
    "lfm3": {"rms_norm_eps": "norm_eps"},
    "molmo2_text": {"layer_norm_eps": "rms_norm_eps"},
    "mpt": {"num_attention_heads": "n_heads", "hidden_size": "d_model"},
    "nemotron_h": {"layer_types": "layers_block_type"},
    "recurrent_gemma": {
        "sliding_window": "attention_window_size",
        "layer_types": "layers_block_type",
    },
    "t5": {"hidden_size": "d_model", "num_attention_heads": "num_heads", "head_dim": "d_kv"},
    "whisper": {
        "num_key_value_heads": "encoder_attention_heads",
        "num_attention_heads": "encoder_attention_heads",
        "hidden_size": "d_model",
    },
    "xglm": {"num_attention_heads": "attention_heads", "hidden_size": "d_model"},
    "xlm": {"hidden_size": "emb_dim", "num_attention_heads": "n_heads"},
}

# model type -> {field: transformers' default}, for those of FIELDS its config class has
DEFAULTS: dict[str, dict[str, Any]] = {
    "afmoe": {"head_dim": 128, "sliding_window": 1024, "rms_norm_eps": 1e-05},
    "apertus": {"rms_norm_eps": 1e-05},
    "apertus1p5_text": {"rms_norm_eps": 1e-05},
    "arcee": {"rms_norm_eps": 1e-05},
    "aria_text": {"rms_norm_eps": 1e-06},
    "axk1": {"rms_norm_eps": 1e-06, "rope_interleave": True},
    "cohere": {"layer_norm_eps": 1e-05, "use_qk_norm": False},
    "cohere2": {"sliding_window": 4096, "layer_norm_eps": 1e-05},
    "cohere2_moe": {
        "head_dim": 128,
        "sliding_window": 4096,
        "sliding_window_pattern": 4,
        "prefix_dense_sliding_window_pattern": 1,
        "layer_norm_eps": 1e-05,
    },
    "cohere_compass_text": {"sliding_window": 4096, "layer_norm_eps": 1e-05},
    "csm": {"rms_norm_eps": 1e-05},
    "cwm": {"head_dim": 128, "sliding_window": 8192, "rms_norm_eps": 1e-05},
    "deepseek_v2": {"rms_norm_eps": 1e-06},
    "deepseek_v3": {"rms_norm_eps": 1e-06, "rope_interleave": True},
    "ernie4_5": {"head_dim": 128, "rms_norm_eps": 1e-05},
    "ernie4_5_moe": {"rms_norm_eps": 1e-05},
    "esm": {"layer_norm_eps": 1e-12, "position_embedding_type": "absolute"},
    "eurobert": {"rms_norm_eps": 1e-05},
    "exaone": {"rms_norm_eps": 1e-05},
    "exaone4": {"sliding_window": 4096, "sliding_window_pattern": 4, "rms_norm_eps": 1e-05},
    "exaone_moe": {"sliding_window": 4096, "sliding_window_pattern": 4, "rms_norm_eps": 1e-05},
    "falcon_h1": {"rms_norm_eps": 1e-05, "key_multiplier": 1.0},
    "flex_olmo": {"rms_norm_eps": 1e-06},
    "flint": {"head_dim": 128, "sliding_window": 513, "rms_norm_eps": 1e-06},
    "gemma": {"head_dim": 256, "rms_norm_eps": 1e-06},
    "gemma2": {
        "head_dim": 256,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-06,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": {
        "head_dim": 256,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-06,
        "query_pre_attn_scalar": 256,
        "use_bidirectional_attention": False,
    },
    "gemma3n_text": {
        "head_dim": 256,
        "sliding_window": 512,
        "num_kv_shared_layers": 15,
        "rms_norm_eps": 1e-06,
    },
    "dots1": {"sliding_window": 4096, "max_window_layers": 62, "rms_norm_eps": 1e-06},
    "embedding_gemma2_text": {"head_dim": 256, "sliding_window": 512, "rms_norm_eps": 1e-06},
    "gemma4_text": {
        "head_dim": 256,
        "sliding_window": 512,
        "num_kv_shared_layers": 0,
        "rms_norm_eps": 1e-06,
        "attention_k_eq_v": False,
    },
    "glm": {"head_dim": 128, "rms_norm_eps": 1.5625e-07},
    "glm4": {"head_dim": 128, "rms_norm_eps": 1.5625e-07},
    "glm4_moe": {"rms_norm_eps": 1e-05, "use_qk_norm": False},
    "glm4v_moe_text": {"rms_norm_eps": 1e-05},
    "glm4v_text": {"rms_norm_eps": 1e-05},
    "glm_image_text": {"rms_norm_eps": 1e-05},
    "glm_ocr_text": {"rms_norm_eps": 1e-05},
    "glm4_moe_lite": {"rms_norm_eps": 1e-05, "rope_interleave": True},
    "gpt2": {"scale_attn_weights": True},
    "gpt_neo": {"window_size": 256},
    "gpt_neox": {"layer_norm_eps": 1e-05},
    "gpt_oss": {"head_dim": 64, "sliding_window": 128, "rms_norm_eps": 1e-05},
    "granite": {"rms_norm_eps": 1e-06, "attention_multiplier": 1.0},
    "granite_docling_text": {"rms_norm_eps": 1e-05, "attention_multiplier": 0.015625},
    "granite_swa": {"sliding_window": 128, "rms_norm_eps": 1e-05, "attention_multiplier": 1.0},
    "granitemoe": {"rms_norm_eps": 1e-06, "attention_multiplier": 1.0},
    "granitemoe_swa": {"sliding_window": 128, "rms_norm_eps": 1e-06, "attention_multiplier": 1.0},
    "granitemoehybrid": {"rms_norm_eps": 1e-06, "attention_multiplier": 1.0},
    "granitemoeshared": {"rms_norm_eps": 1e-06, "attention_multiplier": 1.0},
    "gte": {"layer_norm_eps": 1e-12},
    "helium": {"head_dim": 128, "rms_norm_eps": 1e-08},
    "higgs_audio_v2": {"head_dim": 128, "rms_norm_eps": 1e-05},
    "hunyuan_v1_dense": {"rms_norm_eps": 1e-05},
    "hunyuan_v1_moe": {"rms_norm_eps": 1e-05},
    "hy_v3": {"head_dim": 128, "rms_norm_eps": 1e-05},
    "hyperclovax": {"rms_norm_eps": 1e-06},
    "internlm3": {"head_dim": 128, "rms_norm_eps": 1e-05},
    "iquestcoder": {"head_dim": 128, "rms_norm_eps": 1e-05},
    "jais2": {"layer_norm_eps": 1e-05},
    "jina_embeddings_v3": {"layer_norm_eps": 1e-05},
    "kolibri1": {"head_dim": 128, "sliding_window": 513, "rms_norm_eps": 1e-06},
    "lara_mini": {"head_dim": 128, "sliding_window": 512, "rms_norm_eps": 1e-06},
    "lfm2": {"norm_eps": 1e-05},
    "lfm2_moe": {"norm_eps": 1e-05},
    "lfm3": {"head_dim": 128, "sliding_window": 256, "norm_eps": 1e-05, "use_attention_gate": True},
    "llama": {"rms_norm_eps": 1e-06},
    "llama4_text": {
        "head_dim": 128,
        "rms_norm_eps": 1e-05,
        "attention_chunk_size": 8192,
        "attn_scale": 0.1,
        "floor_scale": 8192,
        "attn_temperature_tuning": True,
        "no_rope_layer_interval": 4,
        "use_qk_norm": True,
    },
    "mellum": {"head_dim": 128, "sliding_window": 1024, "rms_norm_eps": 1e-06},
    "minicpm3": {"rms_norm_eps": 1e-05},
    "minicpm5_moe": {"head_dim": 128, "rms_norm_eps": 1e-06},
    "minimax_m2": {"head_dim": 128, "rms_norm_eps": 1e-06},
    "minimax_m3_vl_text": {"head_dim": 128, "rms_norm_eps": 1e-06},
    "minimax": {"rms_norm_eps": 1e-05},
    "ministral": {"sliding_window": 4096, "rms_norm_eps": 1e-06},
    "ministral3": {"head_dim": 128, "rms_norm_eps": 1e-05},
    "mistral": {"sliding_window": 4096, "rms_norm_eps": 1e-06},
    "mistral4": {"rms_norm_eps": 1e-06, "rope_interleave": True},
    "mixtral": {"rms_norm_eps": 1e-05},
    "modernbert": {"local_attention": 128, "norm_eps": 1e-05},
    "modernbert-decoder": {"local_attention": 128, "norm_eps": 1e-05},
    "molmo2_text": {"head_dim": 128, "rms_norm_eps": 1e-06, "qk_norm_type": "qwen3"},
    "muse_glimmer_text": {
        "head_dim": 128,
        "sliding_window": 2048,
        "rms_norm_eps": 1e-05,
        "qk_scale_factor": 3.87,
    },
    "nanochat": {"rms_norm_eps": 1e-06},
    "nemotron": {"norm_eps": 1e-05},
    "nomic_bert": {"layer_norm_eps": 1e-12},
    "olmo2": {"rms_norm_eps": 1e-05},
    "olmo3": {"sliding_window": 4096, "rms_norm_eps": 1e-05},
    "openai_privacy_filter": {"head_dim": 64, "sliding_window": 128, "rms_norm_eps": 1e-05},
    "olmo_hybrid": {"rms_norm_eps": 1e-06},
    "olmoe": {"rms_norm_eps": 1e-05},
    "param2moe": {"head_dim": 64, "rms_norm_eps": 1e-06, "use_qk_norm": True},
    "phi": {"layer_norm_eps": 1e-05, "qk_layernorm": False},
    "phi3": {"rms_norm_eps": 1e-05, "original_max_position_embeddings": 4096},
    "phimoe": {"rms_norm_eps": 1e-05},
    "qwen2": {
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
    },
    "qwen2_moe": {
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
    },
    "qwen2_5_vl_text": {
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 80,
        "rms_norm_eps": 1e-05,
    },
    "qwen2_vl_text": {
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 80,
        "rms_norm_eps": 1e-05,
    },
    "qwen3": {
        "head_dim": 128,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
    },
    "qwen3_5_moe_text": {"head_dim": 256, "rms_norm_eps": 1e-06},
    "qwen3_5_text": {"head_dim": 256, "rms_norm_eps": 1e-06},
    "qwen3_moe": {"sliding_window": 4096, "use_sliding_window": False, "rms_norm_eps": 1e-06},
    "qwen3_next": {"head_dim": 256, "rms_norm_eps": 1e-06},
    "qwen3_vl_moe_text": {"rms_norm_eps": 1e-06},
    "qwen3_vl_text": {"head_dim": 128, "rms_norm_eps": 1e-06},
    "recurrent_gemma": {"attention_window_size": 2048, "rms_norm_eps": 1e-06},
    "roformer": {"layer_norm_eps": 1e-12},
    "sarvam_mla": {"rms_norm_eps": 1e-06, "rope_interleave": True},
    "sarvam_moe": {"head_dim": 64, "rms_norm_eps": 1e-06, "use_qk_norm": True},
    "seed_oss": {"head_dim": 128, "rms_norm_eps": 1e-06},
    "smollm3": {"use_sliding_window": False, "rms_norm_eps": 1e-06, "no_rope_layer_interval": 4},
    "solar_open": {"head_dim": 128, "rms_norm_eps": 1e-05},
    "stablelm": {"layer_norm_eps": 1e-05, "qk_layernorm": False},
    "ultrabert": {"sliding_window": 128, "rms_norm_eps": 1e-06},
    "vaultgemma": {
        "head_dim": 256,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-06,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
    },
    "youtu": {"rms_norm_eps": 1e-06, "rope_interleave": True},
}


# What transformers gives a rotary model type whose config does not write its rotary
# embedding: the base (10000 where not listed), the fraction of each head rotated (all where
# not listed), and the scaling; GPT-J's base is fixed in its code
DEFAULT_THETA = {
    "apertus": 12_000_000.0,
    "apertus1p5_text": 12_000_000.0,
    "cohere": 500_000.0,
    "csm": 500_000.0,
    "cwm": 1_000_000.0,
    "ernie4_5": 500_000.0,
    "ernie4_5_moe": 500_000.0,
    "exaone": 500_000.0,
    "flex_olmo": 500_000.0,
    "gemma3_text": 1_000_000.0,
    "gemma3n_text": 1_000_000.0,
    "gpt_oss": 150_000.0,
    "openai_privacy_filter": 150_000.0,
    "gte": 160_000.0,
    "helium": 100_000.0,
    "hy_v3": 11_158_840.0,
    "jina_embeddings_v3": 20_000.0,
    "lfm2": 1_000_000.0,
    "lfm2_moe": 1_000_000.0,
    "llama4_text": 500_000.0,
    "minimax": 1_000_000.0,
    "minicpm5_moe": 5_000_000.0,
    "minimax_m2": 5_000_000.0,
    "minimax_m3_vl_text": 5_000_000.0,
    "mixtral": 1_000_000.0,
    "modernbert": 160_000.0,  # its global_rope_theta's; local_rope_theta's 10,000
    "modernbert-decoder": 160_000.0,
    "nomic_bert": 1_000.0,
    "olmo3": 500_000.0,
    "param2moe": 500_000.0,
    "phimoe": 1_000_000.0,
    "qwen3_vl_moe_text": 500_000.0,
    "qwen3_vl_text": 500_000.0,
    "qwen2_5_vl_text": 1_000_000.0,
    "qwen2_vl_text": 1_000_000.0,
    "sarvam_moe": 8_000_000.0,
    "smollm3": 2_000_000.0,
    "solar_open": 1_000_000.0,
}
DEFAULT_PARTIAL = {
    "glm": 0.5,
    "glm4": 0.5,
    "glm4_moe": 0.5,
    "glm4v_moe_text": 0.5,
    "recurrent_gemma": 0.5,
    "gpt_neox": 0.25,
    "nemotron": 0.5,
    "phi": 0.5,
    "qwen3_next": 0.25,
    "qwen3_5_moe_text": 0.25,
    "qwen3_5_text": 0.25,
    "stablelm": 0.25,
}
DEFAULT_ROPE = {
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
DEFAULT_ROPE["apertus1p5_text"] = DEFAULT_ROPE["apertus"]
# OpenAI's privacy filter: gpt-oss's attention as an encoder
DEFAULT_ROPE["openai_privacy_filter"] = DEFAULT_ROPE["gpt_oss"]
# Higgs Audio v2's language model: Llama 3.2's rotary scaling
DEFAULT_ROPE["higgs_audio_v2"] = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 1024,
    "low_freq_factor": 0.125,
    "high_freq_factor": 0.5,
}
# Ministral 3's and Mistral 4's: YaRN, and the queries' scaling by position beside it
DEFAULT_ROPE["ministral3"] = {
    "rope_type": "yarn",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}
DEFAULT_ROPE["mistral4"] = {
    **DEFAULT_ROPE["ministral3"],
    "rope_theta": 10_000.0,
    "factor": 128.0,
    "original_max_position_embeddings": 8192,
    # of the whole head, nope + rope: 0.5 x (64 + 64), the rotary part, with the defaults
    "partial_rotary_factor": 0.5,
}
DEFAULT_ROPE["cwm"] = {
    "rope_type": "llama3",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}
# Gemma 4's and LFM3's, one per layer type: their full layers turn a quarter (LFM3: a half)
# of each head proportionally
DEFAULT_ROPE_BY_KIND = {
    "gemma4_text": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    }
}
DEFAULT_ROPE_BY_KIND["lfm3"] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {**DEFAULT_ROPE_BY_KIND["gemma4_text"]["full_attention"]},
}
DEFAULT_ROPE_BY_KIND["lfm3"]["full_attention"]["partial_rotary_factor"] = 0.5
# UltraBERT's: a base per layer type
DEFAULT_ROPE_BY_KIND["ultrabert"] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 2_560_000.0},
}
# EmbeddingGemma 2's: a base per layer type
DEFAULT_ROPE_BY_KIND["embedding_gemma2_text"] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
# Mellum's: a base per layer type
DEFAULT_ROPE_BY_KIND["mellum"] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
}


def with_aliases(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with each field written under another name of its model type's (ALIASES)
    under the config class's own; the other name wins where both are written."""
    aliases = ALIASES.get(config.get("model_type"), {})
    own = {key: value for key, value in config.items() if key not in aliases}
    return {**own, **{aliases[key]: value for key, value in config.items() if key in aliases}}


# Model types whose window is half their local_attention where sliding_window is not written
# (ModernBERT's config gives it so, and its decoder's)
_HALF_LOCAL_ATTENTION = frozenset({"modernbert", "modernbert-decoder"})
# Model types whose config class's own name of the window is another (RecurrentGemma's)
_WINDOW_FIELD = {"recurrent_gemma": "attention_window_size"}


def with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with transformers' default of each field it does not write (its model
    type's); a field written as null stays null. The window of ModernBERT is half its
    local_attention where sliding_window is not written, RecurrentGemma's its
    attention_window_size (sliding_window's other name there)."""
    found = {**DEFAULTS.get(config.get("model_type"), {}), **config}
    if found.get("model_type") in _HALF_LOCAL_ATTENTION and found.get("sliding_window") is None:
        found["sliding_window"] = positive_count("local_attention", found["local_attention"]) // 2
    if found.get("model_type") in _WINDOW_FIELD:
        found["sliding_window"] = found.get(_WINDOW_FIELD[found["model_type"]])
    return found
