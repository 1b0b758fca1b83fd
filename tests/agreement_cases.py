"""The agreement matrix: the cases that tests/test_agreement.py runs on every backend, in
float32 and float64, against the float64 NumPy reference (docs/design.md, "Tests").

Every layer, every mask kind alone and the combinations, with as many keys as queries, with
fewer keys than queries and with more; every kind of valid_lens and boolean mask, and the
input ranks masked_softmax and AddNorm take. The cases are data: tuples of the names of
mha.cases.MASKS, each with the configs it runs under, which all_cases() turns into
mha.cases.Case objects. `mha compare` runs the shorter mha.cases.default_cases(), whose
tables (OPTION_CASES, SHAPE_CASES, EMPTY_ROWS_AND_BIAS_CASES, MODERN_CASES, LATENT_CASES,
CACHED_CASES) this matrix runs too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mha.cases import (
    CACHED_CASES,
    EMPTY_ROWS_AND_BIAS_CASES,
    GQA,
    LATENT,
    LATENT_CASES,
    MODERN_CASES,
    MQA,
    OPTION_CASES,
    ROPE,
    SHAPE_CASES,
    UNIFORM,
    Case,
)

# masked_softmax: lengths of every kind, and scores of rank 2 to 4
SOFTMAX = (
    (),
    ("valid_lens_1d",),
    ("valid_lens_2d",),
    ("square", "valid_lens_2d"),
    ("rank_2",),
    ("rank_2", "valid_lens_1d", "lens_float"),
    ("rank_4", "valid_lens_1d"),
    ("rank_4", "valid_lens_2d", "lens_int32"),
)

# Every attention layer: the main mask kinds alone, and combined
SINGLE = (
    (),
    ("valid_lens_1d",),
    ("valid_lens_2d",),
    ("mask_2d",),
    ("mask_3d",),
    ("causal",),
    ("square", "causal"),
    ("window_mask",),
    ("valid_lens_1d", "causal"),
    ("valid_lens_2d", "mask_3d", "window_mask"),
    ("square", "valid_lens_2d", "mask_2d", "causal", "window_mask"),
    ("self", "valid_lens_1d", "mask_3d"),
)

# Each layer once: the other mask kinds, dtypes of valid_lens, and more queries than keys
MORE = (
    ("mask_1d",),
    ("mask_keys",),
    ("window_bool",),
    ("valid_lens_1d", "lens_float"),
    ("valid_lens_2d", "lens_int32", "window_bool"),
    ("tall", "causal"),
    ("tall", "valid_lens_1d", "mask_keys", "causal", "window_mask"),
    ("causal", "bottom_right"),
    ("tall", "causal", "bottom_right"),
    ("valid_lens_1d", "causal", "aligned_2"),
)

# Multi-head attention, with and without biases: the masks of the head axis, the path without
# weights (the frameworks' fused kernels) and self-attention
MULTIHEAD = (
    *SINGLE,
    ("mask_4d",),
    ("head_mask",),
    ("no_weights",),
    ("valid_lens_2d", "no_weights"),
    ("square", "causal", "no_weights"),
    ("mask_4d", "window_mask", "no_weights"),
    ("valid_lens_1d", "mask_4d", "head_mask"),
    ("square", "valid_lens_2d", "mask_3d", "causal", "window_mask", "head_mask"),
    ("self",),
    ("self", "no_weights"),
    ("self", "valid_lens_1d", "no_weights"),
    ("self", "valid_lens_1d", "mask_4d"),
    ("self", "valid_lens_2d", "causal", "window_mask", "head_mask", "no_weights"),
    ("valid_lens_2d", "mask_4d", "causal", "window_mask", "head_mask", "no_weights"),
)

# The masks above on every path of multi-head attention (with and without weights), once
MULTIHEAD_MORE = (
    *MORE,
    ("mask_4d_heads",),
    ("mask_4d_batch",),
    ("head_mask_2d",),
    ("head_mask_bool",),
    ("mask_2d", "no_weights"),
    ("mask_keys", "window_mask", "no_weights"),
    ("valid_lens_1d", "lens_float", "window_bool", "no_weights"),
    ("tall", "causal", "no_weights"),
    ("valid_lens_2d", "mask_4d_batch", "causal", "window_bool", "head_mask_2d"),
    ("self", "mask_keys", "window_bool", "head_mask_bool", "no_weights"),
)

# From here on, (layer, masks, config). The scale of the scores, with and without weights
SCALES = (
    ("MultiHeadAttention", ("self", "causal", "no_weights"), {"scale": 0.5}),
    ("MultiHeadAttention", ("mask_4d", "window_mask"), {"scale": 2.0, "out_bias": True}),
    ("DotProductAttention", ("valid_lens_2d",), {"scale": 0.25}),
    ("DotProductAttention", ("mask_3d", "window_mask"), {"scale": 1.0}),
)

# Grouped-query attention, rotary embeddings and sliding windows beyond `mha compare`'s
MODERN_MORE = (
    ("MultiHeadAttention", ("tall", "causal"), {**MQA, **ROPE, "sliding_window": 2}),
    ("MultiHeadAttention", ("causal", "bottom_right"), {**GQA, **ROPE, "sliding_window": 2}),
    ("MultiHeadAttention", ("square", "causal", "aligned_2", "no_weights"), {"alibi": True}),
    ("MultiHeadAttention", ("self", "segments", "causal"), {**GQA, **ROPE}),
    ("MultiHeadAttention", ("square", "segments", "valid_lens_1d", "no_weights"), ROPE),
    ("DotProductAttention", ("square", "segments", "causal"), {}),
    ("AdditiveAttention", ("square", "segments"), {}),
    ("MultiHeadAttention", ("self", "valid_lens_2d", "no_weights"), {**GQA, **ROPE}),
    ("MultiHeadAttention", ("valid_lens_1d", "attn_bias"), {**GQA, "bias": True}),
    ("MultiHeadAttention", ("square",), {"rope_theta": 500000.0, "num_hiddens": 16}),
    ("DotProductAttention", ("square", "causal", "window_bool"), {"sliding_window": 1}),
    ("AdditiveAttention", ("tall", "valid_lens_2d"), {"sliding_window": 2}),
    ("RotaryEmbedding", (), {"num_hiddens": 2}),
)

# Uniform weights for a row with no key, and biases on the scores, beside the other masks
UNIFORM_AND_BIASES = (
    ("masked_softmax", ("rank_4", "valid_lens_1d"), UNIFORM),
    ("DotProductAttention", ("square", "causal", "window_mask"), UNIFORM),
    ("AdditiveAttention", ("valid_lens_2d", "window_bool"), UNIFORM),
    ("MultiHeadAttention", ("self", "valid_lens_2d", "causal", "no_weights"), UNIFORM),
    ("MultiHeadAttention", ("valid_lens_2d", "mask_4d", "head_mask"), UNIFORM),
    ("DotProductAttention", ("valid_lens_2d", "attn_bias", "window_mask"), UNIFORM),
    ("MultiHeadAttention", ("mask_4d", "attn_bias_4d", "causal", "no_weights"), {}),
    ("MultiHeadAttention", ("self", "attn_bias", "window_bool"), {"bias": True}),
)

# The attention function: its masks, alignments, grouped heads, windows, soft cap, packed
# segments and a row with no key, each with a value head size of its own (beside
# SHAPE_CASES' two)
FUNCTION = (
    ("dot_product_attention", (), {}),
    ("dot_product_attention", ("valid_lens_1d", "causal"), {"scale": 0.3}),
    ("dot_product_attention", ("mask_2d", "causal", "aligned_2"), {"window": (2, 1)}),
    ("dot_product_attention", ("square", "segments", "causal"), {**MQA, "window": 3}),
    ("dot_product_attention", ("tall", "causal", "bottom_right"), {"empty_rows": "uniform"}),
)

# The positional encoding and AddNorm, of every rank AddNorm takes
ENCODINGS_AND_NORMS = (
    ("PositionalEncoding", (), {}),
    ("PositionalEncoding", (), {"num_hiddens": 7}),  # odd: the last column a sine
    ("AddNorm", (), {}),
    ("AddNorm", ("rank_2",), {}),
    ("AddNorm", ("rank_4",), {"eps": 1e-3}),
)


# Multi-head latent attention beside mha compare's cases (LATENT_CASES): the other masks, a
# head per query, rows of queries without keys under a window, the absorbed form with each
LATENT_MORE = (
    (LATENT, ("mask_2d", "absorbed"), {"q_lora_rank": 6}),
    (LATENT, ("window_bool", "no_weights"), {}),
    (LATENT, ("valid_lens_2d", "lens_float", "causal", "absorbed"), {"num_heads": 4}),
    (LATENT, ("mask_4d_heads", "attn_bias"), {"bias": True, "sliding_window": 3}),
    (LATENT, ("mask_keys", "no_weights", "absorbed"), {"q_lora_rank": 6, "num_heads": 1}),
)

# Decoding with a cache beside CACHED_CASES: queries and keys of their own (more keys than
# queries: each call's halves differ), float lengths and head masks, chunks, ALiBi's
# distances without causal, a scaled rotary embedding, latent attention's plain form
CACHED_MORE = (
    ("MultiHeadAttention", ("valid_lens_1d", "lens_float", "cached"), {**MQA, **ROPE}),
    ("MultiHeadAttention", ("self", "causal", "no_weights", "cached"), {"attention_chunk_size": 2}),
    (
        "MultiHeadAttention",
        ("self", "valid_lens_1d", "cached"),
        {"num_heads": 6, "num_hiddens": 12, "alibi": True},
    ),
    (
        "MultiHeadAttention",
        ("square", "causal", "head_mask", "cached"),
        {
            "rope_theta": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "qk_norm": "head_after_rotary",
        },
    ),
    (LATENT, ("causal", "no_weights", "cached"), {"q_lora_rank": 6, "sliding_window": 2}),
)


def all_cases() -> list[Case]:
    """The full matrix the test suite runs, in a fixed order (see the module's docstring)."""
    attention = ("DotProductAttention", "AdditiveAttention")
    multihead = ("MultiHeadAttention",)
    options = [("MultiHeadAttention", masks, config) for masks, config in OPTION_CASES]
    return [
        *_cases(("masked_softmax",), SOFTMAX),
        *_cases(attention, (*SINGLE, *MORE)),
        *_cases(multihead, MULTIHEAD, {"bias": False}),
        *_cases(multihead, MULTIHEAD, {"bias": True}),
        *_cases(multihead, MULTIHEAD_MORE, {"bias": True}),
        *_rows(options, SCALES, SHAPE_CASES, EMPTY_ROWS_AND_BIAS_CASES, MODERN_CASES),
        *_rows(MODERN_MORE, UNIFORM_AND_BIASES, ENCODINGS_AND_NORMS, FUNCTION),
        *_rows(LATENT_CASES, LATENT_MORE, CACHED_CASES, CACHED_MORE),
    ]


def _cases(
    layers: Sequence[str],
    masks_table: Iterable[tuple[str, ...]],
    config: Mapping[str, Any] | None = None,
) -> list[Case]:
    """One case for each layer and each masks of the table (layer by layer), under `config`."""
    masks_table = tuple(masks_table)
    return [Case(layer, masks, dict(config or {})) for layer in layers for masks in masks_table]


def _rows(*tables: Iterable[tuple[str, tuple[str, ...], Mapping[str, Any]]]) -> list[Case]:
    """One case for each (layer, masks, config) row of the tables, in their order."""
    return [Case(layer, masks, config) for table in tables for layer, masks, config in table]
