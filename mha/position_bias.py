"""The position biases a ported layer is given at each call as attn_bias: T5's relative
position bias, and ALiBi's for the models whose port leaves it to the call (Falcon's, scaled
with the scores). `mha.porting` gives both.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mha import validation
from mha.encoding import alibi_slopes
from mha.function_checks import first_position
from mha.interop.common import as_numpy
from mha.layer_args import check_alignment, check_positive_int

__all__ = ["alibi_bias", "t5_position_bias"]


def t5_position_bias(
    embedding: Any,
    num_queries: int,
    num_keys: int,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
    alignment: str | int = "bottom_right",
) -> np.ndarray:
    """T5's relative position bias, the `attn_bias` of T5 attention ported to mha.

    T5 adds to the scores of head h a learned number per bucket of the distance from query i
    to key j: exact buckets for small distances, logarithmic ones up to max_distance, and with
    `bidirectional` (the encoder) separate buckets for keys after the query. The table of a
    stack's first layer (`relative_attention_bias.weight`) gives every layer of the stack its bias.

    Args:
        embedding: `relative_attention_bias.weight`, (num_buckets, num_heads).
        num_queries, num_keys: the call's lengths.
        bidirectional, num_buckets, max_distance: T5's config (`is_decoder` is not
            bidirectional; `relative_attention_num_buckets`, `relative_attention_max_distance`).
        alignment: the queries' place among the keys' positions: "bottom_right" the last
            ones, as T5 places them under a cache (a decoding step's query at the last key's
            position); "top_left" from 0; an int n from n (T5's `past_seen_tokens`).

    Returns:
        (1, num_heads, num_queries, num_keys), in the embedding's dtype.
    """
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
    buckets += np.where(relative < max_exact, relative, large)
    # (Q, K, num_heads) -> (1, num_heads, Q, K)
    return np.ascontiguousarray(embedding[buckets].transpose(2, 0, 1)[None])


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
    alibi is scaled with the scores: give attn_bias=alibi_bias(...) / sqrt(head size).

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
