"""The attention of model types that a port from their config would misread: what each
does beside mha's layer, by model type (and MPT's by its attn_config's fields), named in the
error `options_from_config` raises (mha.model_config); and what a tensor beside the
projections does, named in a port's error (mha.porting).
"""

from __future__ import annotations

__all__ = ["MISREAD_MODEL_TYPES", "MPT_UNSUPPORTED", "SPARSE_ATTENTION_TYPES", "what_it_is"]

# MPT's attn_config fields whose values change the attention in ways mha's layer cannot
# represent: field -> (the value that leaves it as transformers' MPT computes, what it does).
# transformers adds ALiBi's biases with a max_bias of 8 whatever alibi and alibi_bias_max say
MPT_UNSUPPORTED = {
    "clip_qkv": (None, "clips the projections' outputs"),
    "qk_ln": (False, "normalizes the queries and keys (QK-norm)"),
    "prefix_lm": (False, "attends both ways over a prefix"),
    "attn_uses_sequence_id": (False, "keeps packed sequences apart"),
    "alibi": (True, "turns ALiBi off, which transformers' MPT adds nonetheless"),
    "alibi_bias_max": (8, "changes ALiBi's slopes, which transformers' MPT does not"),
}

# Model types whose weights a port would misread without an error, and why; and those whose
# attention is another than their rotary embedding's convention would suggest
MISREAD_MODEL_TYPES = {
    "chatglm": "keeps q, k and v in blocks under query_key_value, where GPT-NeoX keeps those "
    "of each head, and rotates by a rule its config names rope_ratio",
    "yoso": "approximates softmax attention by hashing, under BERT's names",
    "mra": "approximates softmax attention at several resolutions, under BERT's names",
    "longt5": "attends within blocks of the sequence (local or transient-global), under T5's names",
    "mpnet": "adds a relative position bias to its scaled scores, under the names T5 keeps "
    "unscaled",
    "gpt_bigcode": "keeps q, k and v in a Linear c_attn (with multi_query one key-value head) "
    "under the names GPT-2 gives its Conv1D",
    "autoformer": "replaces attention with auto-correlation (the series' lags), under BART's names",
    "pegasus_x": "attends within blocks of the sequence and to global tokens in its encoder, "
    "under BART's names",
    "bros": "adds to its scores the products of its queries and an embedding of the tokens' "
    "boxes, which its model computes once and hands each layer, under BERT's names",
    "speecht5": "adds to its encoder's scores the products of its queries and relative position "
    "embeddings its encoder computes, under BART's names (its decoder's attention has none: "
    "port it with from_state_dict(..., num_heads=))",
    "diffllama": "subtracts a second softmax attention of each head's halves, weighted by "
    "learned lambdas, from the first (differential attention)",
    "doge": "adds to its scores a mask its values compute (A, dt_proj)",
    "bitnet": "norms the heads' output before its output projection (attn_sub_norm)",
    "dory": "norms its queries and keys to unit length, scales them by features (sqk) and "
    "norms and gates its output, as nGPT does",
    "laguna": "gates its heads' output by a softplus of a projection of its input (g_proj), "
    "where mha's gates are sigmoids",
    "zaya": "mixes its queries, keys and values with their neighbours' by convolutions",
    "beam": "scales its full layers' queries by a power of their position",
    "ergo": "computes its rotary angles in float64, where mha's float32 and half-precision "
    "layers compute them in float32 (the two part at long positions), and scales its full "
    "layers' scores by global_attention_scale",
    "lightglue": "turns its self-attention's queries and keys by angles that a learned "
    "projection of the keypoints computes (its cross-attention has none: port it with "
    "from_state_dict(..., num_heads=))",
    "sam2_hiera_det_model": "gives each stage its own number of heads "
    "(num_attention_heads_per_stage, not num_attention_heads) and max-pools the queries of a "
    "pooled stage's first block (port another block with from_state_dict(..., num_heads=) of "
    "its stage)",
    **dict.fromkeys(
        ("sam3_detr_decoder", "sam3_lite_text_detr_decoder"),
        "adds to its vision cross-attention's scores biases of the boxes' relative positions "
        "that its decoder computes (its self-attention and text cross-attention have none: "
        "port them with from_state_dict(..., num_heads=))",
    ),
}
# model type -> (its attention_type where the config does not write it, the one that is
# softmax attention over every key, what the others do): BigBird's blocks of the keys,
# Informer's ProbSparse attention, which attends with a sample of the queries
SPARSE_ATTENTION_TYPES = {
    "big_bird": ("block_sparse", "original_full", "attends to blocks of the keys"),
    "bigbird_pegasus": ("block_sparse", "original_full", "attends to blocks of the keys"),
    "informer": ("prob", "full", "attends with a sample of the queries (ProbSparse)"),
}


def what_it_is(name: str) -> str:
    """What a tensor beside an attention's projections does, which mha's layer does not hold
    (named in the error of a port that meets it, mha.porting)."""
    module = name.rsplit(".", 1)[0] if "." in name else name
    norm = next((part for part in module.lower().split(".") if "norm" in part), None)
    if norm is not None and norm.startswith(("q", "k")):  # q_norm, query_layernorm, ...
        return (
            "a norm inside the attention: QK-norm; give qk_norm (and qk_norm_offset=1.0 for "
            "Gemma's, which scale by 1 + weight), as options_from_config gives Qwen3, OLMo 2, "
            "Gemma 3, Qwen3-Next and StableLM"
        )
    if norm is not None:  # BitNet's attn_sub_norm, XLM-RoBERTa-XL's self_attn_layer_norm
        return "a norm inside the attention, not of its queries and keys (of its input or output)"
    if module.split(".")[-1] == "sinks":
        return "attention sinks: a learned logit per head in each softmax"
    if module == "g_proj":
        return "a gate of each head's output (LFM3's): give output_gate=True"
    if module == "gate_proj":
        return "a gate of each output feature (AFMoE's): give output_gate=True"
    return "a tensor beside the projections"
