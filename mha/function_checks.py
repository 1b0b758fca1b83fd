"""The checks of a call of `dot_product_attention`, the attention function of every backend:
its tensors on (batch_size, heads, positions, head size), its masks broadcasting to the
scores (batch_size, heads, no. of queries, no. of keys) as numpy broadcasts (right-aligned, as
torch's F.scaled_dot_product_attention and ONNX's Attention take them), and its options.
"""

from __future__ import annotations

import numbers
from typing import Any

from mha.layer_args import (
    ALIGNMENTS,
    FLOAT_DTYPES,
    check_alignment,
    check_bool,
    check_empty_rows,
    check_held_in_dtype,
    check_position,
)
from mha.masks import segment_pair
from mha.tensors import broadcastable, describe, dtype_name, format_shape, shape_of
from mha.validation import check_segment_ids, check_valid_lens, require_framework, require_tensor

__all__ = [
    "ALIGNMENTS",
    "check_dot_product_attention_call",
    "first_position",
    "layer_first_position",
    "segment_pair",
    "window_sides",
]


def first_position(alignment: str | int | None, num_queries: int, num_keys: int) -> int:
    """The position among the keys of the first query, under `alignment` (ALIGNMENTS; None is
    "top_left", the function's default, as the layers' None is without a cache)."""
    if alignment is None or alignment == "top_left":
        return 0
    # A numpy integer as a Python int: positions past its range must not wrap
    return num_keys - num_queries if alignment == "bottom_right" else int(alignment)


def layer_first_position(
    alignment: str | int | None, num_queries: int, num_keys: int, cached: int = 0
) -> int:
    """The position among the keys of a layer call's first query: after the `cached` ones
    when alignment is None (the layers' default; 0 without a cache), else as the function
    places it. num_keys counts the cached keys."""
    if alignment is None:
        return cached
    return first_position(alignment, num_queries, num_keys)


def check_dot_product_attention_call(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any,
    bias: Any,
    scale: Any,
    causal: Any,
    alignment: Any,
    window: Any,
    valid_lens: Any,
    softcap: Any,
    empty_rows: Any,
    return_weights: Any,
    return_lse: Any,
    segment_ids: Any = None,
    tensor_type: Any = object,
) -> tuple[int, int, int, int, int]:
    """Check a call of dot_product_attention; returns (batch_size, heads, key-value heads,
    no. of queries, no. of keys)."""
    given = dict(query=query, key=key, value=value, mask=mask, bias=bias, valid_lens=valid_lens)
    if isinstance(segment_ids, tuple):
        given.update(zip(("query segment_ids", "key segment_ids"), segment_ids, strict=False))
    else:
        given["segment_ids"] = segment_ids
    require_framework(tensor_type, **given)
    sizes = _check_tensors(query, key, value)
    batch_size, num_heads, _, num_queries, num_keys = sizes
    target = (batch_size, num_heads, num_queries, num_keys)
    if mask is not None:
        _check_score_mask("mask", mask, target, ("bool",), "a boolean keep-mask (True = attend)")
    if bias is not None:
        what = f"added to the scores in the inputs' dtype {dtype_name(query)}"
        _check_score_mask("bias", bias, target, (dtype_name(query),), what)
    if valid_lens is not None:
        check_valid_lens(valid_lens, batch_size, num_queries)
    if segment_ids is not None:
        check_segment_ids(segment_ids, batch_size, num_queries, num_keys, alignment)
    for name, flag in (("causal", causal), ("return_weights", return_weights)):
        check_bool(name, flag)
    check_bool("return_lse", return_lse)
    if alignment is not None:
        check_alignment(alignment)
    window_sides(window)
    for name, number in (("scale", scale), ("softcap", softcap)):
        if number is not None and not _positive_number(number):
            raise ValueError(f"{name} must be a positive number or None. Received: {number!r}")
        check_held_in_dtype(name, number, dtype_name(query))
    check_empty_rows(empty_rows)
    return sizes


def _check_tensors(query: Any, key: Any, value: Any) -> tuple[int, int, int, int, int]:
    shapes = {}
    for name, x in (("query", query), ("key", key), ("value", value)):
        require_tensor(name, x)
        shapes[name] = shape_of(x)
        if len(shapes[name]) != 4:
            raise ValueError(
                f"{name} must have rank 4: (batch_size, heads, positions, head size). "
                f"Received: {describe(name, x)}"
            )
        if dtype_name(x) not in FLOAT_DTYPES or dtype_name(x) != dtype_name(query):
            received = describe("query", query)
            if name != "query":
                received += f", {describe(name, x)}"
            raise TypeError(
                f"query, key and value must share one floating dtype. Received: {received}"
            )
    (batch_size, heads, queries, d), k, v = shapes["query"], shapes["key"], shapes["value"]
    if 0 in (heads, k[1], queries, k[2]):
        raise ValueError(
            "query, key and value must each have at least one head and one position. "
            f"Received: query {format_shape(shapes['query'])}, key {format_shape(k)}, "
            f"value {format_shape(v)}"
        )
    fits = _agree(k[0], v[0], batch_size) and _agree(k[1], v[1]) and _agree(k[2], v[2])
    if not (fits and _agree(k[3], d)) or (None not in (heads, k[1]) and heads % k[1]):
        raise ValueError(
            "key and value must have query's batch size, one number of heads that divides "
            "query's, one number of positions (at least one), and key query's head size. "
            f"Received: query {format_shape(shapes['query'])}, key {format_shape(k)}, "
            f"value {format_shape(v)}"
        )
    return batch_size, heads, k[1], queries, k[2]


def _agree(*sizes) -> bool:
    """Whether the known sizes are one: a size unknown while tracing (None) is checked where
    the call runs. Compared with ==, never hashed: torch.export's symbolic sizes are not."""
    known = [size for size in sizes if size is not None]
    return all(size == known[0] for size in known[1:])


def _check_score_mask(name: str, x: Any, target, dtypes, what: str) -> None:
    require_tensor(name, x)
    if dtype_name(x) not in dtypes:
        raise TypeError(f"{name} must be {what}. Received: {describe(name, x)}")
    shape = shape_of(x)
    if not 1 <= len(shape) <= 4 or not broadcastable(shape, target[4 - len(shape) :]):
        raise ValueError(
            f"{name} must broadcast to the scores (batch_size, heads, no. of queries, no. of "
            f"keys) = {format_shape(target)}, its last axis against the keys. Received: "
            f"{describe(name, x)}"
        )


def window_sides(window: Any) -> tuple[int | None, int | None] | None:
    """(left, right) of a window: an int w keeps keys within w - 1 positions either side of
    the query, as the layers' sliding_window; a pair keeps p - left <= key <= p + right, None
    leaving that side open. None: no window."""
    if window is None:
        return None
    if _whole(window) and window >= 1:
        check_position("window", window)
        return int(window) - 1, int(window) - 1
    pair = isinstance(window, tuple) and len(window) == 2
    if pair and all(side is None or (_whole(side) and side >= 0) for side in window):
        for side in window:
            check_position("a side of window", side or 0)
        return tuple(None if side is None else int(side) for side in window)
    raise ValueError(
        "window must be a positive int (keys within window - 1 positions of the query), or a "
        f"pair (left, right) of non-negative ints or None. Received: window={window!r}"
    )


def _whole(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _positive_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and 0 < x < float("inf")
