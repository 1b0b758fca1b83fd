"""The arguments, call arguments and results of the public layers, written once.

Every backend's `masked_softmax` and layers take the same arguments and give the same results,
so their docstrings share these sections: a backend's own docstring says what the object is
and what its framework adds, and `@documented` appends the shared part, so that `help()`
shows the whole contract in every backend. The "Args" of a layer are its options' docs in
mha.options.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import TypeVar

from mha import options

T = TypeVar("T")


def _args(layer: str) -> str:
    """The "Args" section of `layer`: each option's one-line doc, wrapped."""
    lines = ["Args:"]
    for option in options.layer_options(layer):
        doc = option.doc.get(layer, option.doc.get("*"))
        lines += textwrap.wrap(
            f"{option.name}: {doc}",
            width=92,
            initial_indent="    ",
            subsequent_indent="        ",
            break_on_hyphens=False,
        )
    return "\n".join(lines)


SECTIONS = {
    "masked_softmax": """
Args:
    X: scores of shape (batch_size, ..., no. of queries, no. of keys).
    valid_lens: None, (batch_size,) or (batch_size, no. of queries); integers, or floats
        holding integers. A length larger than the number of keys keeps every key.
    empty_rows: "zeros" (default): a row with valid_len 0 is all 0; "uniform": it is
        1 / no. of keys everywhere, as d2l's -1e6 fill gives.

Returns:
    An array of X's shape: masked entries are exactly 0, a row with valid_len 0 as
    empty_rows says, every other row sums to 1.
""",
    "DotProductAttention": f"""
{_args("DotProductAttention")}

Call arguments:
    queries: (batch_size, no. of queries, d).
    keys: (batch_size, no. of keys, d).
    values: (batch_size, no. of keys, value_size).
    valid_lens: None, (batch_size,) or (batch_size, no. of queries).
    mask: boolean keep-mask broadcastable to (batch_size, no. of queries, no. of keys).
    causal: query i attends to keys j <= i.
    window_mask: (num_windows, no. of queries, no. of keys), boolean or additive.
    alignment: where the masks put query i when queries and keys differ in number:
        None (default; at i, after the cached positions with a cache), "top_left" (at i),
        "bottom_right" (at i + no. of keys - no. of queries) or an int n (at n + i). It
        moves causal, a sliding window, chunks and ALiBi, not rotary positions.
    segment_ids: packed sequences: integers (batch_size, positions), as many queries as keys,
        or a pair (query ids (batch_size, no. of queries), key ids (batch_size, no. of
        keys)); a query attends to the keys of its own segment only, the masks reading a
        position's index among its segment's (a pair takes no "bottom_right" alignment).
    attn_bias: added to the scores (a relative position bias, ALiBi), of the layer's
        dtype, broadcastable to (batch_size, no. of queries, no. of keys); its -inf entries
        exclude their key exactly, as a float window_mask's do.

Returns:
    (batch_size, no. of queries, value_size); `attention_weights` holds
    (batch_size, no. of queries, no. of keys).
""",
    "AdditiveAttention": f"""
{_args("AdditiveAttention")}

Call arguments: as DotProductAttention; queries and keys may differ in size.

Returns:
    (batch_size, no. of queries, value_size); `attention_weights` holds
    (batch_size, no. of queries, no. of keys).
""",
    "MultiHeadAttention": f"""
Queries, keys and values are projected to num_hiddens, split into num_heads contiguous
blocks of num_hiddens / num_heads columns, attended per head, concatenated and projected
by W_o.

{_args("MultiHeadAttention")}

Call arguments:
    queries, keys, values, valid_lens, causal, window_mask, alignment: as
        DotProductAttention.
    segment_ids: as DotProductAttention; rotary positions restart at each segment (a
        position's index among its segment's), and there is no cache.
    mask: boolean keep-mask; 1-D to 3-D applies to every head, 4-D is read as
        (batch_size, num_heads, no. of queries, no. of keys), each axis broadcastable.
    attn_bias: added to the scores, of the layer's dtype; as `mask`, 1-D to 3-D applies
        to every head and 4-D is per head (T5's relative bias: (1, num_heads, Q, K)); its
        -inf entries exclude their key exactly.
    head_mask: (num_heads,) or (batch_size, num_heads), of the layer's dtype or boolean;
        multiplies each head's output.
    need_weights: when False, `attention_weights` is None.
    cache: None, or an `mha.KVCache` for decoding self-attention: `KVCache()` at the first
        call, then the cache the previous call returned; this call's keys and values are
        appended as new positions (never pass a cross-attention layer's memory). This call's
        queries and keys take the positions after the cached ones (rotary embeddings, `causal`
        and a sliding window count from there), and valid_lens and masks cover the cached
        keys and this call's.

Returns:
    (batch_size, no. of queries, out_features), and with a cache `(output, cache)`, the cache
    holding every key and value so far, (batch_size, num_kv_heads, positions, head size)
    each; `attention_weights` holds (batch_size, num_heads, no. of queries, no. of keys).
""",
    "MultiHeadLatentAttention": f"""
Self-attention over X. Each position is compressed to a latent c = RMSNorm(X W_kva[:, :r]),
r = kv_lora_rank, from which W_kvb makes each head's key part without rotary embeddings and
its value; the key's rotary part, rotate(X W_kva[:, r:]), is one for every head. Queries come
from W_q, or with q_lora_rank from W_qb(RMSNorm(X W_qa)); their rotary part is rotated too.
The scores' factor is 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times a yarn scaling's
mscale of its mscale_all_dim squared, where it gives one. Canonical weights: W_q
(num_hiddens, num_heads (nope + rope)), or W_qa (num_hiddens, q_lora_rank), q_norm
(q_lora_rank,) and W_qb (q_lora_rank, num_heads (nope + rope)); W_kva (num_hiddens,
kv_lora_rank + rope), kv_norm (kv_lora_rank,), W_kvb (kv_lora_rank, num_heads (nope + v)),
W_o (num_heads v, num_hiddens); with bias=True also b_qa, b_kva and b_o.

{_args("MultiHeadLatentAttention")}

Call arguments:
    X: (batch_size, no. of steps, num_hiddens).
    valid_lens, mask, causal, window_mask, attn_bias, need_weights: as MultiHeadAttention's,
        the keys being X's positions (after the cached ones with a cache).
    cache: None, or an `mha.LatentCache` for decoding: `LatentCache()` at the first
        call, then the cache the previous call returned. It keeps each position's latent
        and rotary key, not the expanded keys and values; this call's positions follow the
        cached ones.
    absorbed: compute with W_kvb folded into the queries and the output (every head attends
        over the latent, as MLA decodes); the same numbers as the expanded form, to rounding.

Returns:
    (batch_size, no. of steps, num_hiddens), and with a cache `(output, cache)`, the cache
    holding latent (batch_size, positions, kv_lora_rank) and rotary_keys (batch_size, 1,
    positions, qk_rope_head_dim); `attention_weights` holds (batch_size, num_heads, no. of
    queries, no. of keys).
""",
    "PositionalEncoding": f"""
{_args("PositionalEncoding")}

Call arguments:
    X: (batch_size, no. of steps <= max_len, num_hiddens).

Returns:
    X + P[:, :no. of steps, :], of X's shape. `P` (1, max_len, num_hiddens) is computed in
    float64 and cast once to the layer's dtype; it is not a weight.
""",
    "LearnedPositionalEncoding": f"""
The book's exercise "design a learnable positional encoding": P is a weight of shape
(max_len, num_hiddens) (canonical name "P"), row i added to the inputs at position i, as
BERT's and GPT-2's position embeddings; the framework's Embedding layer holds it.

{_args("LearnedPositionalEncoding")}

Call arguments:
    X: (batch_size, no. of steps <= max_len, num_hiddens).

Returns:
    X + P[:no. of steps], of X's shape.
""",
    "RotaryEmbedding": f"""
Rotates each pair of features of the row at position p by the angle p * theta^(-2i / d),
d being num_hiddens and i the pair's index, so that the dot product of a rotated query and
a rotated key depends on their positions only through p_query - p_key.

{_args("RotaryEmbedding")}

Call arguments:
    X: (..., no. of positions, num_hiddens), e.g. (batch_size, num_heads, n, head size).
    offset: the position of X's first row (a cache's length when decoding); default 0.

Returns:
    X rotated, of X's shape. The angles are computed in float32 (float64 in a float64 layer),
    as Hugging Face and Keras compute them, and their cosines and sines cast to the layer's
    dtype; there is no weight.
""",
    "AddNorm": f"""
{_args("AddNorm")}

Call arguments:
    X, Y: the same shape (..., num_hiddens).

Returns:
    The normalized sum, of X's shape.
""",
}


def documented(obj: T) -> T:
    """Append the shared sections of `obj`'s name to its own docstring."""
    own = inspect.cleandoc(obj.__doc__ or "")
    obj.__doc__ = f"{own}\n{SECTIONS[obj.__name__]}"
    return obj
