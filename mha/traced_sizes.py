"""The sizes an attention call's tensors share, for graphs that leave some unknown.

`mha.validation` checks every size it knows before the first framework operation. A traced
graph may leave some unknown (TensorFlow's `tf.function` with an input signature of `None`
sizes, or relaxed by `reduce_retracing`), and there broadcasting would hide a mistake: one
length given for every example of a batch, keys of one example for three queries. A
backend whose graphs leave sizes unknown asserts these where the graph runs, and reshapes
each tensor to them, which holds where a converter drops assertions; shapes, never values.
"""

from __future__ import annotations

from typing import Any

from mha.cache import KVCache, LatentCache
from mha.masks import segment_pair
from mha.tensors import shape_of

__all__ = ["MESSAGE", "function_sizes", "shared_sizes", "softmax_sizes"]

# The names of the sizes the tensors share; an int is a size of its own, None any size
BATCH, QUERIES, KEYS, CACHED = "batch_size", "no. of queries", "no. of keys", "cached positions"
KV_HEADS = "no. of key-value heads"
HEAD_SIZE = "head size of the queries and keys"
# What an assertion's message says first (TensorFlow escapes an apostrophe there)
MESSAGE = (
    "mha: the tensors of the call disagree on a size that the traced graph left unknown "
    "(queries or masked_softmax's X, keys, values, valid_lens, head_mask, segment_ids and a "
    "cache share batch_size; "
    "valid_lens, the segment ids of the queries and a window_mask share the no. of queries; "
    "the attention function's query and key (DotProductAttention's queries and keys) share "
    "a head size, and key-value heads divide "
    "the query heads; a layer's queries, keys and values (X) have the features its "
    "projections take; AddNorm's X and Y share every size, num_hiddens last, as an "
    "encoding's X has num_hiddens features; a window_mask "
    "has the call's keys, the cached ones included)"
)


def shared_sizes(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    head_mask: Any = None,
    num_heads: int | None = None,
    segment_ids: Any = None,
    cache: Any = None,
    kv_heads: tuple[int, int] | None = None,
    window_mask: Any = None,
    features: tuple = (None, None, None),
) -> list[tuple[Any, tuple]]:
    """(tensor, its sizes by name) of each of the call's tensors whose sizes another's fix,
    as `mha.validation.check_attention_call` checks them: queries (batch_size, no. of queries,
    features), keys and values (batch_size, no. of keys, features), valid_lens (batch_size,)
    or (batch_size, no. of queries), head_mask (num_heads,) or (batch_size, num_heads),
    segment_ids of the queries and of the keys, a KVCache's keys and values (batch_size,
    num_kv_heads, cached positions, head size) or a LatentCache's tensors, a window_mask's
    queries (its windows divide the batch, its keys count the cached ones too). Masks and
    attn_bias broadcast, which the framework's own operations check. features: the
    queries', keys' and values' last sizes, each an int (what a projection takes), a name
    (the head size DotProductAttention's queries and keys share) or None (any)."""
    query_features, key_features, value_features = features
    found = [(queries, (BATCH, QUERIES, query_features))]
    found += [(keys, (BATCH, KEYS, key_features)), (values, (BATCH, KEYS, value_features))]
    if valid_lens is not None:
        found.append((valid_lens, (BATCH, QUERIES)[: len(shape_of(valid_lens))]))
    if head_mask is not None:
        per_example = len(shape_of(head_mask)) == 2
        found.append((head_mask, (BATCH, num_heads) if per_example else (num_heads,)))
    if segment_ids is not None:
        query_ids, key_ids = segment_pair(segment_ids)
        found += [(query_ids, (BATCH, QUERIES)), (key_ids, (BATCH, KEYS))]
    if isinstance(cache, KVCache) and cache.keys is not None and kv_heads is not None:
        cached = (BATCH, kv_heads[0], CACHED, kv_heads[1])
        found += [(cache.keys, cached), (cache.values, cached)]
    if isinstance(cache, LatentCache) and cache.latent is not None:
        found += [
            (cache.latent, (BATCH, CACHED, None)),
            (cache.rotary_keys, (BATCH, 1, CACHED, None)),
        ]
    if window_mask is not None:
        found.append((window_mask, (None, QUERIES, None)))
    return found


def function_sizes(query: Any, key: Any, value: Any, valid_lens: Any = None, *,
                   segment_ids: Any = None) -> list[tuple[Any, tuple]]:  # fmt: skip
    """What `shared_sizes` gives for the attention function's tensors, (batch_size, heads,
    positions, head size): the keys' and values' heads and positions agree too, and the
    queries' and keys' head sizes (a value head's may differ)."""
    found = [(query, (BATCH, None, QUERIES, HEAD_SIZE))]
    found += [(key, (BATCH, KV_HEADS, KEYS, HEAD_SIZE)), (value, (BATCH, KV_HEADS, KEYS, None))]
    if valid_lens is not None:
        found.append((valid_lens, (BATCH, QUERIES)[: len(shape_of(valid_lens))]))
    if segment_ids is not None:
        query_ids, key_ids = segment_pair(segment_ids)
        found += [(query_ids, (BATCH, QUERIES)), (key_ids, (BATCH, KEYS))]
    return found


def softmax_sizes(X: Any, valid_lens: Any) -> list[tuple[Any, tuple]]:
    """What `shared_sizes` gives for masked_softmax's: X (batch_size, ..., no. of queries, no.
    of keys), or (batch_size, no. of keys), and valid_lens (batch_size,) or (batch_size, no.
    of queries)."""
    rank = len(shape_of(X))
    names = (BATCH, None) if rank == 2 else (BATCH, *[None] * (rank - 3), QUERIES, None)
    return [(X, names), (valid_lens, (BATCH, QUERIES)[: len(shape_of(valid_lens))])]
