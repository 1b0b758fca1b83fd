"""The tables of the cases `mha compare` runs (mha.cases.default_cases), beside the main mask
combinations: each option on a path that reads it, rows with no key, biases, the options of
today's decoders and multi-head latent attention. The test suite's matrix runs them too
(tests/agreement_cases.py); mha.cases names them all.
"""

from __future__ import annotations

# Grouped-query heads: two queries' heads to each key-value head, and one for them all
GQA = {"num_heads": 4, "num_kv_heads": 2}
MQA = {"num_heads": 4, "num_kv_heads": 1}

# The masks' alignments, their broadcasts, fewer keys than queries, the other head masks and
# dtypes of lengths, the ranks of scores and AddNorm's inputs, and the attention function:
# with the main combinations, every mask kind of mha.cases.MASKS at least once
SHAPE_CASES = (
    ("masked_softmax", ("rank_4", "valid_lens_2d"), {}),
    ("AddNorm", ("rank_2",), {"eps": 1e-3}),
    ("DotProductAttention", ("tall", "mask_keys", "causal", "bottom_right"), {}),
    ("AdditiveAttention", ("valid_lens_1d", "causal", "aligned_2", "lens_float"), {}),
    ("MultiHeadAttention", ("mask_1d", "head_mask_2d"), {}),
    ("MultiHeadAttention", ("mask_4d_batch", "window_bool", "head_mask_bool"), {}),
    ("MultiHeadAttention", ("tall", "valid_lens_2d", "lens_int32", "mask_keys", "causal"), {}),
    ("MultiHeadAttention", ("mask_4d_heads", "causal", "bottom_right", "no_weights"), {}),
    ("dot_product_attention", ("valid_lens_2d", "causal", "bottom_right"), GQA),
    ("dot_product_attention", ("mask_4d", "attn_bias_4d"), {"softcap": 2.0}),
)

# A row with no key taking uniform weights, and biases added to the scores, on each layer
UNIFORM = {"empty_rows": "uniform"}
EMPTY_ROWS_AND_BIAS_CASES = (
    ("masked_softmax", ("valid_lens_2d",), UNIFORM),
    ("DotProductAttention", ("valid_lens_1d",), UNIFORM),
    ("AdditiveAttention", ("mask_3d",), UNIFORM),
    ("MultiHeadAttention", ("valid_lens_1d",), UNIFORM),
    ("MultiHeadAttention", ("mask_4d", "no_weights"), UNIFORM),
    ("DotProductAttention", ("attn_bias",), {}),
    ("AdditiveAttention", ("valid_lens_1d", "attn_bias"), {}),
    ("MultiHeadAttention", ("valid_lens_1d", "attn_bias_4d"), {"scale": 1.0}),
    ("MultiHeadAttention", ("attn_bias", "no_weights"), {}),
)


# The layer options beside bias, each on a path that reads it (the fused path without weights)
OPTION_CASES = (
    (("valid_lens_1d",), {"out_bias": True}),
    (("causal",), {"bias": True, "out_bias": False, "out_features": 5}),
    (("valid_lens_1d",), {"scale": 1.0}),
    (("valid_lens_1d", "no_weights"), {"scale": 1.0, "out_features": 3}),
)


# Rotary embeddings as models ship them, scaled and partial, with sizes of their own (so that
# any --num-heads fits their rotated features). The original lengths are below
# the calls' (5 or 7 positions, 8 after RotaryEmbedding's offset), so that "dynamic" and
# "longrope" take their long frequencies; heads of 8 features (4 pairs) with a base of 100
# spread the wavelengths over llama3's and yarn's bands.
ROPE_SCALING_CASES = (
    (
        "MultiHeadAttention",
        ("self", "valid_lens_1d", "causal"),
        {
            "num_heads": 4,
            "num_kv_heads": 2,
            "num_hiddens": 32,
            "rope_theta": 100.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    (
        "MultiHeadAttention",
        ("valid_lens_2d",),
        {
            "num_heads": 2,
            "num_hiddens": 16,
            "rope_theta": 100.0,
            "rope_dim": 6,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 8,
                "beta_slow": 1,
            },
        },
    ),
    (
        "MultiHeadAttention",
        ("self", "causal", "no_weights"),
        {
            "num_heads": 2,
            "num_hiddens": 16,
            "rope_theta": 100.0,
            "rope_scaling": {
                "rope_type": "dynamic",
                "factor": 2.0,
                "original_max_position_embeddings": 4,
            },
        },
    ),
    (
        "MultiHeadAttention",
        ("causal",),
        {
            "num_heads": 2,
            "num_hiddens": 16,
            "rope_theta": 100.0,
            "rope_dim": 4,
            "rope_interleaved": True,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.5],
                "long_factor": [2.0, 3.0],
                "original_max_position_embeddings": 4,
                "factor": 4.0,
            },
        },
    ),
    (
        "MultiHeadAttention",
        ("mask_3d", "no_weights"),
        {
            "rope_theta": 10000.0,
            "num_heads": 2,
            "num_hiddens": 16,
            "rope_dim": 2,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
    # Gemma 4's full layers: the first 2 of 4 pairs at the whole head's frequencies, halved
    (
        "MultiHeadAttention",
        ("self", "valid_lens_1d", "causal"),
        {
            "rope_theta": 100.0,
            "num_heads": 2,
            "num_hiddens": 16,
            "rope_scaling": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "factor": 2.0,
            },
        },
    ),
    (
        "RotaryEmbedding",
        ("offset",),
        {
            "num_hiddens": 8,
            "rotary_dim": 6,
            "theta": 100.0,
            "scaling": {
                "rope_type": "dynamic",
                "factor": 3.0,
                "original_max_position_embeddings": 5,
            },
        },
    ),
    (
        "RotaryEmbedding",
        ("offset",),
        {
            "num_hiddens": 8,
            "rotary_dim": 4,
            "interleaved": True,
            "scaling": {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 8,
                "attention_factor": 1.5,
                "truncate": False,
            },
        },
    ),
)


# Grouped-query attention, rotary embeddings and sliding windows, each on the paths with and
# without weights; 4 query heads share 2 or 1 key-value heads
ROPE = {"rope_theta": 10000.0}
QUERY_SCALING = {"beta": 0.5, "original_max_position_embeddings": 2}
MODERN_CASES = (
    ("MultiHeadAttention", ("valid_lens_1d",), GQA),
    ("MultiHeadAttention", ("causal", "no_weights"), {**MQA, "bias": True}),
    ("MultiHeadAttention", ("valid_lens_2d",), ROPE),
    ("MultiHeadAttention", ("self", "causal", "no_weights"), {**ROPE, "rope_interleaved": True}),
    # Llama: grouped-query attention with rotary embeddings, causal, with padding
    ("MultiHeadAttention", ("self", "valid_lens_1d", "causal"), {**GQA, **ROPE}),
    # Qwen2's projection biases, which the rotary embedding turns (a key bias added after it
    # would change the scores), on the fused path with lengths of each query; and beside
    # each head's QK-norm, with weights
    (
        "MultiHeadAttention",
        ("self", "valid_lens_2d", "causal", "no_weights"),
        {**GQA, **ROPE, "bias": True},
    ),
    ("MultiHeadAttention", ("valid_lens_1d",), {**ROPE, "bias": True, "qk_norm": "head"}),
    ("MultiHeadAttention", ("square", "causal"), {"sliding_window": 2}),
    ("MultiHeadAttention", ("mask_3d", "no_weights"), {**GQA, "sliding_window": 3}),
    ("DotProductAttention", ("valid_lens_1d",), {"sliding_window": 2}),
    ("AdditiveAttention", ("causal",), {"sliding_window": 3}),
    ("RotaryEmbedding", (), {}),
    ("RotaryEmbedding", ("offset",), {"interleaved": True, "theta": 100.0}),
    ("LearnedPositionalEncoding", (), {"max_len": 9}),
    *ROPE_SCALING_CASES,
    # Soft-capped scores (Gemma 2), on the paths that would otherwise take the fused kernels
    ("DotProductAttention", ("valid_lens_1d",), {"softcap": 1.0}),
    ("MultiHeadAttention", ("causal", "no_weights"), {"softcap": 0.5}),
    ("MultiHeadAttention", ("mask_3d", "attn_bias"), {**GQA, "softcap": 2.0}),
    # Attention sinks (gpt-oss): rows with no key give all their weight to the sink
    ("MultiHeadAttention", ("valid_lens_1d",), {"sinks": True}),
    ("MultiHeadAttention", ("self", "causal", "no_weights"), {**GQA, "sinks": True}),
    ("MultiHeadAttention", ("mask_3d", "attn_bias"), {"sinks": True, "sliding_window": 3}),
    # QK-norm: each head's (Qwen3, with rotary embeddings) or the whole projection's (OLMo 2)
    ("MultiHeadAttention", ("self", "valid_lens_1d", "causal"), {**GQA, **ROPE, "qk_norm": "head"}),
    (
        "MultiHeadAttention",
        ("mask_3d", "no_weights"),
        {**GQA, "qk_norm": "projection", "qk_norm_eps": 1e-5},
    ),
    # Hunyuan's: each head's, after the rotary embedding
    (
        "MultiHeadAttention",
        ("self", "valid_lens_1d", "causal"),
        {**GQA, **ROPE, "qk_norm": "head_after_rotary"},
    ),
    # StableLM's layer norm of each head's queries and keys, a scale of each head's own
    (
        "MultiHeadAttention",
        ("valid_lens_1d", "causal"),
        {**GQA, "num_hiddens": 32, "qk_norm": "layer_norm_per_head", "qk_norm_eps": 1e-3},
    ),
    # An output gate (Qwen3-Next) of the heads' output, with padding, and on the fused paths
    ("MultiHeadAttention", ("valid_lens_1d",), {"output_gate": True, "bias": True}),
    ("MultiHeadAttention", ("self", "causal", "no_weights"), {**GQA, "output_gate": True}),
    # ALiBi's biases of each head (BLOOM, MPT): 6 heads, where the slopes' order matters, with
    # padding; and causal alone, which torch's is_causal kernel would take without them
    (
        "MultiHeadAttention",
        ("self", "valid_lens_1d", "causal"),
        {"num_heads": 6, "num_hiddens": 12, "alibi": True},
    ),
    ("MultiHeadAttention", ("causal", "no_weights"), {**GQA, "alibi": True}),
    # Ministral 3's queries scaled by their positions, past every 2 here; with padding, and
    # causal alone (the fused kernels) without a rotary embedding
    (
        "MultiHeadAttention",
        ("self", "valid_lens_1d", "causal"),
        {**GQA, **ROPE, "query_scaling": QUERY_SCALING},
    ),
    ("MultiHeadAttention", ("causal", "no_weights"), {"query_scaling": QUERY_SCALING}),
    # Gemma 4's values normalized beside its queries and keys; and on the fused paths
    (
        "MultiHeadAttention",
        ("valid_lens_1d", "causal"),
        {**GQA, "qk_norm": "head", "value_norm": True, "qk_norm_eps": 1e-3},
    ),
    ("MultiHeadAttention", ("self", "causal", "no_weights"), {"value_norm": True}),
    # Llama 4's rotary layers: chunks of positions, QK-norm, pairs turned, with padding; on
    # the fused paths; in packed rows, whose chunks start at each segment. Its NoPE layers:
    # the queries scaled from position 1
    (
        "MultiHeadAttention",
        ("self", "valid_lens_1d", "causal"),
        {**GQA, **ROPE, "rope_interleaved": True, "qk_norm": "head", "attention_chunk_size": 2},
    ),
    ("MultiHeadAttention", ("causal", "no_weights"), {**GQA, "attention_chunk_size": 3}),
    ("MultiHeadAttention", ("square", "segments", "causal"), {"attention_chunk_size": 2}),
    (
        "MultiHeadAttention",
        ("causal", "no_weights"),
        {"query_scaling": {**QUERY_SCALING, "position_offset": 1}},
    ),
)


# Multi-head latent attention (DeepSeek-V2, V3): its sizes beside num_hiddens and num_heads,
# and its cases: low-rank queries, biases, the absorbed form, windows, yarn's scale
LATENT_SIZES = {"kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 3}
LATENT_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 4,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
LATENT = "MultiHeadLatentAttention"
LATENT_CASES = (
    (LATENT, (), {}),
    (LATENT, ("valid_lens_1d", "causal"), {"q_lora_rank": 6, "bias": True}),
    (LATENT, ("valid_lens_2d", "absorbed"), {"rope_theta": 500.0}),
    (LATENT, ("mask_4d", "window_mask"), {"q_lora_rank": 6}),
    (LATENT, ("causal", "no_weights", "absorbed"), {"sliding_window": 2}),
    (LATENT, ("valid_lens_1d", "attn_bias_4d"), {"rope_scaling": LATENT_YARN}),
    (LATENT, ("mask_3d",), {**UNIFORM, "rope_interleaved": False, "norm_eps": 1e-3}),
    # Mistral 4's queries scaled by their positions
    (LATENT, ("valid_lens_1d", "causal"), {"query_scaling": QUERY_SCALING}),
)


# Decoding with a cache (mha.case_calls): a prompt of the first positions, then the rest
# after it, on the paths and options whose positions the cache moves
CACHED_CASES = (
    ("MultiHeadAttention", ("self", "causal", "cached"), {"bias": True}),
    ("MultiHeadAttention", ("square", "valid_lens_1d", "causal", "cached"), {**GQA, **ROPE}),
    (
        "MultiHeadAttention",
        ("self", "causal", "no_weights", "cached"),
        {**GQA, **ROPE, "sliding_window": 2},
    ),
    (
        "MultiHeadAttention",
        ("self", "causal", "cached"),
        {"rope_theta": 100.0, "sinks": True, "softcap": 2.0, "qk_norm": "head"},
    ),
    (LATENT, ("valid_lens_1d", "causal", "absorbed", "cached"), {"rope_theta": 500.0}),
)
