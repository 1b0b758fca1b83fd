"""The layers, configs and masks that every export test takes out of Python: torch.export
and ONNX (test_export_torch.py), TensorFlow's SavedModel, .keras and LiteRT
(test_export_tensorflow.py), and jax.export (test_export_jax.py). Each draw of inputs holds a
query that attends to no key.
"""

from __future__ import annotations

import numpy as np

import mha

HEADS, HEAD_SIZE = 4, 2

LAYERS = {
    "DotProductAttention": {},
    "AdditiveAttention": {"num_hiddens": 8, "query_size": 6, "key_size": 6},
    "MultiHeadAttention": {
        "num_hiddens": HEADS * HEAD_SIZE,
        "num_heads": HEADS,
        "bias": True,
        "query_size": 6,
        "key_size": 6,
        "value_size": 7,
    },
}
# Llama's attention: 4 query heads sharing 2 key-value heads, rotary embeddings
GROUPED = {"num_kv_heads": 2, "rope_theta": 10000.0}

# The masks of every attention layer, and what MultiHeadAttention adds: id -> (config, kinds)
ATTENTION_MASKS = [
    ["valid_lens_1d"],
    ["valid_lens_2d"],
    ["mask_3d"],
    ["causal", "valid_lens_1d"],
    ["window_float"],
    ["window_bool"],
    ["attn_bias"],
]
MULTIHEAD_CASES = {
    "mask_4d": ({}, ["mask_4d"]),
    "attn_bias_4d": ({}, ["attn_bias_4d"]),
    "head_mask_1d": ({}, ["valid_lens_1d", "head_mask_1d"]),
    "head_mask_2d": ({}, ["mask_3d", "head_mask_2d"]),
    "no_weights+valid_lens_1d": ({}, ["valid_lens_1d", "no_weights"]),
    "no_weights+mask_3d": ({}, ["mask_3d", "no_weights"]),
    "no_weights+window_float": ({}, ["window_float", "no_weights"]),
    "sliding_window": ({"sliding_window": 2}, ["valid_lens_2d"]),
    "grouped_rotary": (GROUPED, ["causal", "valid_lens_1d"]),
    # Every query head on one key-value head: a group (4) other than the key-value heads (1),
    # whose per-head mask follows the queries into one head of 4 x Q rows
    "one_kv_head+mask_4d": ({"num_kv_heads": 1}, ["mask_4d", "head_mask_1d"]),
    "grouped_rotary+no_weights": (GROUPED, ["causal", "valid_lens_1d", "no_weights"]),
    "empty_cache": ({}, ["causal", "valid_lens_1d", "empty_cache"]),
    "cache": (GROUPED, ["causal", "valid_lens_1d", "cache"]),
    "cache+no_weights": (GROUPED, ["causal", "valid_lens_1d", "cache", "no_weights"]),
    "uniform_empty_rows": ({"empty_rows": "uniform"}, ["valid_lens_2d"]),
    # Norms of queries and keys, each head's (Qwen3; Hunyuan's after the rotary embedding,
    # here after a cache) and StableLM's per-head layer norm
    "qk_norm": ({**GROUPED, "qk_norm": "head"}, ["causal", "valid_lens_1d"]),
    "qk_layer_norm_per_head": ({"qk_norm": "layer_norm_per_head"}, ["valid_lens_2d"]),
    "qk_norm_after_rotary": (
        {**GROUPED, "qk_norm": "head_after_rotary"},
        ["causal", "valid_lens_1d", "cache"],
    ),
    # Ministral 3's queries scaled by their positions, after a cache; Gemma 4's normalized
    # values and proportional rotary
    "query_scaling+cache": (
        {**GROUPED, "query_scaling": {"beta": 0.5, "original_max_position_embeddings": 2}},
        ["causal", "valid_lens_1d", "cache"],
    ),
    "value_norm+proportional": (
        {
            "qk_norm": "head",
            "value_norm": True,
            "rope_theta": 100.0,
            "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
        },
        ["causal", "valid_lens_1d"],
    ),
    # Llama 4's rotary layers after a cache (chunks of 2 positions, pairs turned), and its
    # other layers' queries scaled from position 1
    "chunks+cache": (
        {**GROUPED, "attention_chunk_size": 2, "rope_interleaved": True, "qk_norm": "head"},
        ["causal", "valid_lens_1d", "cache"],
    ),
    "query_scaling_offset": (
        {
            "query_scaling": {
                "beta": 0.5,
                "original_max_position_embeddings": 2,
                "position_offset": 1,
            }
        },
        ["causal", "valid_lens_1d"],
    ),
    # gpt-oss's sink of each head, with grouped heads and a window after a cache
    "sinks+cache": (
        {**GROUPED, "sinks": True, "sliding_window": 2},
        ["causal", "valid_lens_1d", "cache"],
    ),
}
# masked_softmax: id -> (shapes of X for (batch, queries, keys), mask kinds, empty_rows)
SOFTMAX_CASES = {
    "no_lens": (lambda B, Q, K: [(B, Q, K)], [], "zeros"),
    "valid_lens_1d": (lambda B, Q, K: [(B, Q, K)], ["valid_lens_1d"], "zeros"),
    "valid_lens_2d": (lambda B, Q, K: [(B, Q, K)], ["valid_lens_2d"], "zeros"),
    "heads+valid_lens_2d": (lambda B, Q, K: [(B, HEADS, Q, K)], ["valid_lens_2d"], "zeros"),
    "uniform_empty_rows": (lambda B, Q, K: [(B, Q, K)], ["valid_lens_1d"], "uniform"),
}
# The other layers: id -> (class name, config, no. of inputs, call keywords)
OTHER_CASES = {
    "PositionalEncoding": ("PositionalEncoding", {"num_hiddens": 8, "max_len": 10}, 1, {}),
    "LearnedPositionalEncoding": (
        "LearnedPositionalEncoding",
        {"num_hiddens": 8, "max_len": 10},
        1,
        {},
    ),
    "RotaryEmbedding": ("RotaryEmbedding", {"num_hiddens": 8, "theta": 500.0}, 1, {"offset": 3}),
    "RotaryEmbedding-interleaved": (
        "RotaryEmbedding",
        {"num_hiddens": 8, "interleaved": True},
        1,
        {"offset": 3},
    ),
    "AddNorm": ("AddNorm", {"num_hiddens": 8}, 2, {}),
}


def attention_shapes(B, Q, K):
    """Shapes of queries, keys and values for the layers of LAYERS."""
    return [(B, Q, 6), (B, K, 6), (B, K, 7)]


def masks(kinds, rng, empty, sizes):
    """The mask arguments of one draw of `sizes` (batch size, no. of queries, no. of keys,
    cached positions), as numpy arrays: in example `empty`, query 1 attends to no key (every
    query, for 1-D valid_lens; every example, for the shared boolean window)."""
    B, Q, K, cached = sizes
    kwargs = {}
    for kind in kinds:
        if kind == "valid_lens_1d":
            kwargs["valid_lens"] = rng.integers(1, K + 1, B)
            kwargs["valid_lens"][empty] = 0
        elif kind == "valid_lens_2d":
            kwargs["valid_lens"] = rng.integers(1, K + 1, (B, Q))
            kwargs["valid_lens"][empty, 1] = 0
        elif kind in ("mask_3d", "mask_4d"):
            shape = (B, Q, K) if kind == "mask_3d" else (B, HEADS, Q, K)
            kwargs["mask"] = rng.random(shape) < 0.7
            kwargs["mask"][empty, ..., 1, :] = False
        elif kind == "causal":
            kwargs["causal"] = True
        elif kind == "window_float":
            window = rng.standard_normal((B, Q, K)).astype(np.float32)
            window[rng.random(window.shape) < 0.2] = -np.inf
            window[empty, 1] = -np.inf
            kwargs["window_mask"] = window
        elif kind == "window_bool":
            # One window shared by the batch
            kwargs["window_mask"] = rng.random((1, Q, K)) < 0.7
            kwargs["window_mask"][0, 1 + empty] = False
        elif kind in ("attn_bias", "attn_bias_4d"):
            shape = (B, Q, K) if kind == "attn_bias" else (B, HEADS, Q, K)
            bias = rng.standard_normal(shape).astype(np.float32)
            bias[empty, ..., 1, :] = -np.inf
            kwargs["attn_bias"] = bias
        elif kind in ("head_mask_1d", "head_mask_2d"):
            shape = (HEADS,) if kind == "head_mask_1d" else (B, HEADS)
            kwargs["head_mask"] = rng.random(shape).astype(np.float32)
        elif kind == "no_weights":
            kwargs["need_weights"] = False
        elif kind == "empty_cache":
            kwargs["cache"] = mha.KVCache()
        elif kind == "cache":
            # Keys and values of the cached positions, with GROUPED's 2 key-value heads
            shape = (B, GROUPED["num_kv_heads"], cached, HEAD_SIZE)
            kwargs["cache"] = mha.KVCache(
                *(rng.standard_normal(shape).astype(np.float32) for _ in range(2))
            )
        else:
            raise AssertionError(kind)
    return kwargs


def draws(shapes, kinds, sizes):
    """Two draws of (args, kwargs), one of each of `sizes`: numpy float32 inputs of the shapes
    that `shapes` gives for (batch, queries, keys) and the masks of `kinds`, the first with
    its row of no key in example 0, the second in example 1."""
    result = []
    for seed, each in enumerate(sizes):
        rng = np.random.default_rng(seed)
        args = tuple(rng.standard_normal(shape).astype(np.float32) for shape in shapes(*each[:3]))
        result.append((args, masks(kinds, rng, seed, each)))
    return result
