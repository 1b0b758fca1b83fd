"""How the harness calls a case's layer (or masked_softmax, or the attention function) on
its tensors: the same code in every backend and in the NumPy reference, so that a row
compares one call with another (mha.harness runs it; mha.golden records and verifies it).

A "cached" case (mha.cases.MASKS) runs as decoding does: the first half of the positions
with an empty cache, then the rest with the cache that call returned; its output and
weights are the second call's, which read the cached keys, values and positions (at sizes
of one position, one call with an empty cache).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mha.cache import KVCache, LatentCache
from mha.cases import DIFFERENTIABLE, FUNCTION_SIZES, Case
from mha.tensors import shape_of

__all__ = ["call_layer"]


# The keyword arguments of an attention layer's call that a case may give
_CALL_OPTIONS = (
    "mask",
    "causal",
    "alignment",
    "window_mask",
    "head_mask",
    "need_weights",
    "attn_bias",
    "segment_ids",
)
# ... and MultiHeadLatentAttention's
_LATENT_CALL_OPTIONS = ("mask", "causal", "window_mask", "need_weights", "attn_bias", "absorbed")


# The attention function's arguments a case's inputs give, by the inputs' names
_FUNCTION_ARGUMENTS = {
    "mask": "mask",
    "attn_bias": "bias",
    "causal": "causal",
    "alignment": "alignment",
    "valid_lens": "valid_lens",
    "segment_ids": "segment_ids",
}

# What each call takes beside its inputs (DIFFERENTIABLE's); the attention layers', the keys
# and values that self-attention leaves out and their options (and a cache, "cached")
_CALL_TAKES = {
    "PositionalEncoding": (),
    "LearnedPositionalEncoding": (),
    "AddNorm": (),
    "masked_softmax": ("valid_lens",),
    "RotaryEmbedding": ("offset",),
    "MultiHeadAttention": ("keys", "values", "valid_lens", *_CALL_OPTIONS, "cached"),
    "MultiHeadLatentAttention": ("valid_lens", *_LATENT_CALL_OPTIONS, "cached"),
    "dot_product_attention": ("key", "value", *_FUNCTION_ARGUMENTS),
}


def _check_taken(case: Case, tensors: Mapping[str, Any]) -> None:
    """Every input and option of `case` is an argument of its call: none is left out, so that
    no row agrees on a mask or option that never reached a backend."""
    attention = ("keys", "values", "valid_lens", *_CALL_OPTIONS)
    takes = {*DIFFERENTIABLE[case.layer], *_CALL_TAKES.get(case.layer, attention)}
    unused = sorted(set(tensors) - takes)
    if case.layer == "masked_softmax":
        unused += sorted(set(case.config) - {"empty_rows"})
    if unused:
        raise ValueError(f"case {case.id}: {case.layer}'s call takes no {', '.join(unused)}")


def call_layer(module: Any, case: Case, layer: Any, tensors: Mapping[str, Any]) -> Any:
    """Call `layer` (or the backend's masked_softmax) on the case's tensors."""
    _check_taken(case, tensors)
    if case.layer == "masked_softmax":
        options = {key: case.config[key] for key in ("empty_rows",) if key in case.config}
        return module.masked_softmax(tensors["X"], tensors.get("valid_lens"), **options)
    if case.layer in ("PositionalEncoding", "LearnedPositionalEncoding"):
        return layer(tensors["X"])
    if case.layer == "RotaryEmbedding":
        return layer(tensors["X"], **({"offset": tensors["offset"]} if "offset" in tensors else {}))
    if case.layer == "AddNorm":
        return layer(tensors["X"], tensors["Y"])
    if case.layer == "dot_product_attention":
        return _call_function(module, case, tensors)
    if case.layer == "MultiHeadLatentAttention":
        arguments = {key: tensors[key] for key in _LATENT_CALL_OPTIONS if key in tensors}
        inputs, cache = (tensors["X"],), LatentCache()
    else:
        arguments = {key: tensors[key] for key in _CALL_OPTIONS if key in tensors}
        queries = tensors["queries"]
        inputs = (queries, tensors.get("keys", queries), tensors.get("values", queries))
        cache = KVCache()
    if tensors.get("cached", False):
        return _decoded(layer, inputs, tensors.get("valid_lens"), cache, arguments)
    return layer(*inputs, tensors.get("valid_lens"), **arguments)


def _decoded(layer: Any, inputs, valid_lens, cache, arguments) -> Any:
    """The output of the second of two calls: the first half of each input's positions with
    an empty cache, then the rest with the cache the first call returned (one position: one
    call, with the empty cache)."""
    split = min(shape_of(x)[1] for x in inputs) // 2
    if split == 0:
        return layer(*inputs, valid_lens, cache=cache, **arguments)[0]
    # One slice of each tensor: self-attention's one tensor stays one (its fast paths)
    parts = (slice(split), slice(split, None))
    first, rest = ({id(x): x[:, part] for x in inputs} for part in parts)
    _, cache = layer(*(first[id(x)] for x in inputs), valid_lens, cache=cache, **arguments)
    output, _ = layer(*(rest[id(x)] for x in inputs), valid_lens, cache=cache, **arguments)
    return output


def _call_function(module: Any, case: Case, tensors: Mapping[str, Any]) -> Any:
    """The backend's dot_product_attention on the case's tensors and options (its config
    less the sizes of its inputs)."""
    arguments = {name: tensors[key] for key, name in _FUNCTION_ARGUMENTS.items() if key in tensors}
    options = {k: v for k, v in case.config.items() if k not in FUNCTION_SIZES}
    query, key, value = (tensors[name] for name in ("query", "key", "value"))
    return module.dot_product_attention(query, key, value, **arguments, **options)
