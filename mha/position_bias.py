"""The position biases a ported layer is given at each call as attn_bias: T5's relative
position bias, and ALiBi's for the models whose port leaves it to the call (Falcon's, scaled
with the scores). `mha.porting` gives both.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha import validation
from mha.encoding import alibi_slopes
from mha.function_checks import first_position
from mha.interop.common import as_numpy
from mha.layer_args import check_alignment, check_positive_int
from mha.model_config import read_config

__all__ = ["alibi_bias", "falcon_alibi_bias", "t5_position_bias"]


def t5_position_bias(
    embedding: Any,
    num_queries: int,
    num_keys: int,
    *,
    bidirectional: bool = True,
    num_buckets: int | None = None,
    max_distance: int | None = None,
    alignment: str | int = "bottom_right",
    config: Mapping[str, Any] | str | os.PathLike | None = None,
) -> np.ndarray:
    """T5's relative position bias, the `attn_bias` of T5 attention ported to mha.

    T5 adds to the scores of head h a learned number per bucket of the distance from query i
    to key j: exact buckets for small distances, logarithmic ones up to max_distance, and with
    `bidirectional` (the encoder) separate buckets for keys after the query. The table of a
    stack's first layer (`relative_attention_bias.weight`) gives every layer of the stack its bias.

    Args:
        embedding: `relative_attention_bias.weight`, (num_buckets, num_heads).
        num_queries, num_keys: the call's lengths.
        bidirectional: False for a decoder's self-attention (its stack's `is_decoder`).
        num_buckets, max_distance: the config's `relative_attention_num_buckets` and
            `relative_attention_max_distance`; when neither they nor `config` are given,
            T5's defaults, 32 and 128.
        alignment: the queries' place among the keys' positions: "bottom_right" the last
            ones, as T5 places them under a cache (a decoding step's query at the last key's
            position); "top_left" from 0; an int n from n (T5's `past_seen_tokens`).
        config: the model's config (a dict, or a config.json), whose two fields give
            num_buckets and max_distance (T5's defaults where it writes none).

    Returns:
        (1, num_heads, num_queries, num_keys), in the embedding's dtype.
    """
    num_buckets, max_distance = _t5_sizes(num_buckets, max_distance, config)
    embedding = as_numpy(embedding)
    check_positive_int("num_queries", num_queries)
    check_positive_int("num_keys", num_keys)
    check_alignment(alignment)
    first_query = first_position(alignment, num_queries, num_keys)
    if embedding.ndim != 2 or embedding.shape[0] != num_buckets:
        raise ValueError(
            f"embedding must be (num_buckets, num_heads) = ({num_buckets}, num_heads): give "
            "num_buckets as the config's relative_attention_num_buckets. Received: embedding "
            f"of shape {embedding.shape}"
        )
    # Distance from query i to key j: j - i, negative for keys before the query
    queries = np.arange(first_query, first_query + num_queries)
    relative = np.arange(num_keys)[None, :] - queries[:, None]
    buckets = _t5_buckets(relative, bidirectional, num_buckets, max_distance)
    # (Q, K, num_heads) -> (1, num_heads, Q, K)
    return np.ascontiguousarray(embedding[buckets].transpose(2, 0, 1)[None])


def _t5_buckets(relative, bidirectional, num_buckets, max_distance) -> np.ndarray:
    """T5's bucket of each distance j - i (`relative`)."""
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0) * num_buckets
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    # Logarithmic buckets past max_exact, computed in float32 as T5 computes them
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.log(relative.astype(np.float32) / np.float32(max_exact))
        scaled = scaled / np.float32(math.log(max_distance / max_exact))
        large = max_exact + (scaled * np.float32(num_buckets - max_exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(relative < max_exact, relative, large)


def _t5_sizes(num_buckets, max_distance, config) -> tuple[int, int]:
    """num_buckets and max_distance as given, else from config, else T5's defaults; a value
    given that the config contradicts is an error (distances would fall in other buckets)."""
    if config is not None and not isinstance(config, Mapping):
        config = read_config(config)
    fields = (
        ("num_buckets", num_buckets, "relative_attention_num_buckets", 32),
        ("max_distance", max_distance, "relative_attention_max_distance", 128),
    )
    chosen = []
    for name, given, field, default in fields:
        written = None if config is None else config.get(field, default)
        if given is not None and written is not None and given != written:
            raise ValueError(
                f"{name}={given!r} differs from the config's {field}={written!r}: give one"
            )
        value = next(v for v in (given, written, default) if v is not None)
        check_positive_int(name, value)
        chosen.append(value)
    return chosen[0], chosen[1]


def alibi_bias(
    num_heads: int,
    num_queries: int,
    num_keys: int,
    *,
    max_bias: float = 8.0,
    dtype: str = "float32",
) -> np.ndarray:
    """ALiBi's position biases (BLOOM, MPT, Falcon with alibi), the `attn_bias` of a ported
    layer: head h adds slope_h * (j - i) to the score of query i and key j, a penalty that
    grows with the distance.

    The slopes are the ALiBi paper's: with n the power of 2 at or above num_heads,
    2 ** (-max_bias * k / n) for k = 1 ... n, and where num_heads is not a power of 2 the even
    k first, then the odd ones, num_heads in all (BLOOM's and MPT's rule; MPT's
    alibi_bias_max is max_bias). The queries are the last num_queries of the num_keys
    positions, as under a KV cache. BLOOM adds slope_h * j and MPT slope_h * (j - K + 1):
    each differs from this by a number per row, which the softmax does not see. Falcon's
    alibi, scaled with the scores and rounded to bfloat16, is `falcon_alibi_bias`.

    Returns:
        (1, num_heads, num_queries, num_keys), computed in float64 and given in `dtype`, the
        layer's (an attn_bias has the layer's dtype).
    """
    dtype = validation.check_dtype(dtype)
    check_positive_int("num_heads", num_heads)
    check_positive_int("num_queries", num_queries)
    if isinstance(num_keys, bool) or not isinstance(num_keys, int) or num_keys < num_queries:
        raise ValueError(
            f"num_keys must be an integer >= num_queries ({num_queries}). Received: "
            f"num_keys={num_keys!r}"
        )
    slopes = alibi_slopes(num_heads, max_bias)
    # Distance j - i of key j from query i, the queries being the last positions
    queries = np.arange(num_keys - num_queries, num_keys)
    relative = np.arange(num_keys)[None, :] - queries[:, None]
    return (slopes[:, None, None] * relative)[None].astype(dtype)


def falcon_alibi_bias(
    num_heads: int,
    num_keys: int,
    *,
    head_size: int,
    attention_mask: Any = None,
    dtype: str = "float32",
) -> np.ndarray:
    """Falcon's ALiBi biases (a config with alibi=True, Falcon-RW's), the `attn_bias` of its
    ported layer, as transformers' Falcon computes them: each head's slope (`alibi_bias`'s)
    times each key's position, both and their product rounded to bfloat16, then divided by
    sqrt(head_size) in `dtype`. The positions count from each row's first token
    where `attention_mask` (batch, num_keys; 1 = token) says, else from 0; adding slope * j
    instead of slope * (j - i) changes a row by a number the softmax does not see, but the
    roundings do change the numbers, so alibi_bias(...) / sqrt(head_size) is close to
    Falcon's, not equal.

    Returns:
        (batch or 1, num_heads, 1, num_keys) in `dtype`, the layer's.
    """
    dtype = validation.check_dtype(dtype)
    check_positive_int("num_heads", num_heads)
    check_positive_int("num_keys", num_keys)
    check_positive_int("head_size", head_size)
    if attention_mask is None:
        positions = np.arange(num_keys)[None]
    else:
        mask = as_numpy(attention_mask)
        if mask.ndim != 2 or mask.shape[1] != num_keys or not np.isin(mask, (0, 1)).all():
            raise ValueError(
                f"attention_mask must be (batch, num_keys={num_keys}) of 0 and 1. Received: "
                f"shape {mask.shape}"
            )
        mask = mask.astype(np.int64)
        positions = (np.cumsum(mask, axis=-1) - 1) * mask
    # torch's bfloat16 times integers: both rounded to bfloat16, their product exact in
    # float32 (8 significant bits each) and rounded once more
    slopes = _bfloat16_rounded(alibi_slopes(num_heads).astype(np.float32))
    positions = _bfloat16_rounded(positions.astype(np.float32))
    alibi = _bfloat16_rounded(slopes[None, :, None] * positions[:, None, :])
    alibi = alibi[:, :, None, :].astype(dtype)
    return alibi / np.asarray(math.sqrt(head_size), dtype)


def _bfloat16_rounded(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to the nearest bfloat16 (ties to even), as float32: the top 16 bits."""
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(
        0xFFFF0000
    )
    return bits.view(np.float32)
