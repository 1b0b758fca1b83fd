"""Every argument and shape check, shared by all backends.

Each backend calls these first thing, before any framework operation, so a mistake raises the
same `ValueError` or `TypeError`, with the same message, whichever framework is in use.
Messages name the argument and echo what was received.

The checks read `.shape` and `.dtype` of any framework's tensor; they never convert a tensor to
numpy. The one check that needs values (valid_lens must be non-negative whole numbers) takes
the lengths as each backend reads them where they are in host memory: a few as a list of
Python numbers, more as a numpy array.

The checks of the constructors' arguments are `mha.layer_args`'s, those of a call's cache
`mha.cache`'s, and the reading of a tensor's shape and dtype `mha.tensors`'s; this module
names their public ones too, so that every check is `mha.validation.<name>`. The checks of
the calls are here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from mha.cache import KVCache, check_kv_cache, check_latent_cache
from mha.layer_args import (
    EMPTY_ROWS,
    FLOAT_DTYPES,
    check_alignment,
    check_backend_dtype,
    check_bool,
    check_dtype,
    check_empty_rows,
    check_layer_args,
)
from mha.masks import segment_pair
from mha.tensors import (
    LayerDtype,
    Shape,
    broadcastable,
    describe,
    dtype_name,
    format_shape,
    require_dtype,
    require_framework,
    require_tensor,
    same,
    shape_of,
)

__all__ = [
    "EMPTY_ROWS",
    "FLOAT_DTYPES",
    "check_add_norm_call",
    "check_attention_call",
    "check_backend_dtype",
    "check_dtype",
    "check_empty_rows",
    "check_kv_cache",
    "check_latent_attention_call",
    "check_latent_cache",
    "check_layer_args",
    "check_mask_dtype",
    "check_masked_softmax_call",
    "check_positional_encoding_call",
    "check_rotary_call",
    "check_valid_lens",
    "check_valid_lens_values",
    "dtype_name",
    "require_framework",
    "require_tensor",
    "shape_of",
]

INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


# ---------------------------------------------------------------------------------------------
# Call arguments


def _check_input(name: str, x: Any, dtype: LayerDtype) -> Shape:
    require_tensor(name, x)
    shape = shape_of(x)
    if len(shape) != 3:
        raise ValueError(
            f"{name} must have rank 3: (batch_size, sequence length, features). "
            f"Received: {describe(name, x)}"
        )
    require_dtype(name, x, dtype)
    return shape


def _check_size(name: str, x: Any, shape: Shape, size_name: str, size: int | None) -> None:
    if size is not None and not same(shape[-1], size):
        raise ValueError(
            f"The last axis of {name} must have size {size_name}={size}. "
            f"Received: {describe(name, x)}"
        )
    if size is None and shape[-1] == 0:  # a lazy layer takes its size from the first call
        raise ValueError(
            f"{size_name} must be a positive integer: the last axis of {name} has none. "
            f"Received: {describe(name, x)}"
        )


def check_valid_lens(valid_lens: Any, batch_size: int | None, num_queries: int | None) -> None:
    require_tensor("valid_lens", valid_lens)
    shape = shape_of(valid_lens)
    dtype = dtype_name(valid_lens)
    if dtype not in INTEGER_DTYPES and dtype not in FLOAT_DTYPES:
        raise TypeError(
            "valid_lens must hold integers (an integer or float dtype). "
            f"Received: {describe('valid_lens', valid_lens)}"
        )
    if not (
        (len(shape) == 1 and same(shape[0], batch_size))
        or (len(shape) == 2 and same(shape[0], batch_size) and same(shape[1], num_queries))
    ):
        raise ValueError(
            f"valid_lens must have shape (batch_size,) = ({batch_size},) or "
            f"(batch_size, no. of queries) = ({batch_size}, {num_queries}). "
            f"Received: {describe('valid_lens', valid_lens)}"
        )


# Up to this many lengths are read as Python numbers: between a call's other operations a
# short list is read faster than numpy's reductions start (one length per example, or per
# query of a few examples)
FEW_LENGTHS = 1024


def check_valid_lens_values(values: np.ndarray | list) -> Any:
    """Check the values of valid_lens, read by the backend into numpy or, up to FEW_LENGTHS of
    them, into a flat list of Python numbers: non-negative whole numbers (or infinity).
    Returns the smallest, None when there are none. Only an eager call has values; the
    backends skip this in traced ones."""
    if isinstance(values, np.ndarray):
        if values.size <= FEW_LENGTHS:
            values = values.ravel().tolist()
        else:
            return _check_many_lengths(values)
    if not values:
        return None
    # A list of one tensor's values holds one type: floats may be fractional
    whole = not isinstance(values[0], float)
    fractional = None if whole else next((v for v in values if not _is_whole(v)), None)
    return _checked_smallest(fractional, min(values))


def _check_many_lengths(values: np.ndarray) -> Any:
    fractional = None
    if values.dtype.kind not in "iub":
        found = values[values != np.floor(values)]
        fractional = found[0].item() if found.size else None
    return _checked_smallest(fractional, values.min().item())


def _checked_smallest(fractional: Any, smallest: Any) -> Any:
    if fractional is not None:
        raise ValueError(
            f"valid_lens must hold whole numbers. Received: valid_lens containing {fractional!r}"
        )
    if smallest < 0:
        raise ValueError(
            f"valid_lens must be non-negative. Received: valid_lens containing {smallest!r}"
        )
    return smallest


def _is_whole(number: float) -> bool:
    """Whether a length is a whole number or infinite, as numpy's x == floor(x) says."""
    return math.isinf(number) or number.is_integer()


def check_mask_dtype(mask: Any) -> None:
    """mask: a boolean keep-mask (a float or integer one would be read one way or another)."""
    if dtype_name(mask) != "bool":
        raise TypeError(
            f"mask must be a boolean keep-mask (True = attend). Received: {describe('mask', mask)}"
        )


def _check_mask(mask: Any, target: Shape, allow_heads: bool) -> None:
    require_tensor("mask", mask)
    check_mask_dtype(mask)
    _check_broadcast("mask", mask, target, allow_heads)


def _check_attn_bias(attn_bias: Any, target: Shape, allow_heads: bool, dtype: LayerDtype) -> None:
    require_tensor("attn_bias", attn_bias)
    require_dtype("attn_bias", attn_bias, dtype, why=" (it is added to the scores)")
    _check_broadcast("attn_bias", attn_bias, target, allow_heads)


def _check_broadcast(name: str, tensor: Any, target: Shape, allow_heads: bool) -> None:
    shape = shape_of(tensor)
    per_example = (target[0], target[-2], target[-1])
    if allow_heads and len(shape) == 4:
        # Only a 4-D tensor has a head axis, so a batch axis is never read as a head axis
        fits = broadcastable(shape, target)
    else:
        fits = 1 <= len(shape) <= 3 and broadcastable(shape, per_example)
    if not fits:
        expected = f"(batch_size, no. of queries, no. of keys) = {format_shape(per_example)}"
        if allow_heads:
            expected += (
                ", or 4-D to (batch_size, num_heads, no. of queries, no. of keys) = "
                f"{format_shape(target)}"
            )
        raise ValueError(f"{name} must broadcast to {expected}. Received: {describe(name, tensor)}")


def _check_window_mask(window_mask: Any, batch_size, num_queries, num_keys, dtype) -> None:
    require_tensor("window_mask", window_mask)
    require_dtype("window_mask", window_mask, dtype, " (True = attend)", " (added to the scores)")
    shape = shape_of(window_mask)
    if len(shape) != 3 or not (same(shape[1], num_queries) and same(shape[2], num_keys)):
        raise ValueError(
            "window_mask must have shape (num_windows, no. of queries, no. of keys) = "
            f"(num_windows, {num_queries}, {num_keys}). "
            f"Received: {describe('window_mask', window_mask)}"
        )
    num_windows = shape[0]
    if num_windows is not None and (
        num_windows == 0 or (batch_size is not None and batch_size % num_windows != 0)
    ):
        raise ValueError(
            "batch_size must be a multiple of num_windows (the first axis of window_mask). "
            f"Received: batch_size={batch_size}, {describe('window_mask', window_mask)}"
        )


def _check_head_mask(head_mask: Any, batch_size, num_heads: int, dtype: LayerDtype) -> None:
    require_tensor("head_mask", head_mask)
    require_dtype("head_mask", head_mask, dtype, boolean="")
    shape = shape_of(head_mask)
    if not (
        (len(shape) == 1 and same(shape[0], num_heads))
        or (len(shape) == 2 and same(shape[0], batch_size) and same(shape[1], num_heads))
    ):
        raise ValueError(
            f"head_mask must have shape (num_heads,) = ({num_heads},) or "
            f"(batch_size, num_heads) = ({batch_size}, {num_heads}). "
            f"Received: {describe('head_mask', head_mask)}"
        )


def check_attention_call(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    mask: Any = None,
    causal: Any = False,
    window_mask: Any = None,
    head_mask: Any = None,
    need_weights: Any = True,
    attn_bias: Any = None,
    cache: Any = None,
    alignment: Any = None,
    segment_ids: Any = None,
    rope_scaling: Any = None,
    dtype: LayerDtype,
    sizes: Sequence[tuple[str, str, int | None]] = (),
    same_query_key_size: bool = False,
    num_heads: int | None = None,
    kv_heads: tuple[int, int] | None = None,
    tensor_type: Any = object,
    sizes_known: bool = True,
) -> tuple[int | None, int | None, int | None]:
    """Check the call of an attention layer; returns (batch_size, no. of queries, no. of keys),
    the keys counting the cached ones.

    Args:
        dtype: the layer's dtype, or the dtypes the call takes, the layer's first
            (tensors.require_dtype).
        sizes: (argument, size name, size) triples, e.g. ("queries", "query_size", 4): the
            last axis of the argument must have that size when it is known.
        same_query_key_size: queries and keys must share their last axis (dot product).
        num_heads: set for multi-head attention; allows 4-D masks and `head_mask`.
        kv_heads: (num_kv_heads, head size) of multi-head attention, for its `cache`.
        tensor_type: the type (or types) of the layer's framework's tensors.
        sizes_known: False where a program is traced whose sizes pass for ints (torch.export
            with strict=True): a size is then not known to be the example's.
    """
    given = dict(queries=queries, keys=keys, values=values, valid_lens=valid_lens, mask=mask)
    given.update(window_mask=window_mask, head_mask=head_mask, attn_bias=attn_bias)
    require_framework(tensor_type, **given, **_other_tensors(segment_ids, cache))
    q_shape, k_shape, v_shape = _check_inputs(queries, keys, values, dtype, same_query_key_size)
    batch_size, num_queries, num_keys = q_shape[0], q_shape[1], k_shape[1]
    tensors = {"queries": (queries, q_shape), "keys": (keys, k_shape), "values": (values, v_shape)}
    for argument, size_name, size in sizes:
        _check_size(argument, *tensors[argument], size_name, size)
    if cache is not None:
        if kv_heads is None:
            raise TypeError("cache is only accepted by MultiHeadAttention")
        num_keys = _add(num_keys, check_kv_cache(cache, batch_size, *kv_heads, dtype))
    if valid_lens is not None:
        check_valid_lens(valid_lens, batch_size, num_queries)
    _check_flags(causal, need_weights, alignment)
    scores = (batch_size, num_queries, num_keys)
    if segment_ids is not None:
        _check_packing(segment_ids, cache, rope_scaling, scores, alignment, sizes_known)
    _check_masks(mask, attn_bias, window_mask, head_mask, dtype, num_heads, scores)
    return batch_size, num_queries, num_keys


def _other_tensors(segment_ids: Any, cache: Any) -> dict[str, Any]:
    """The tensors of a layer call's segment_ids and cache, by name."""
    given = {}
    if segment_ids is not None:
        names = ("query segment_ids", "key segment_ids")
        given.update(zip(names, segment_pair(segment_ids), strict=False))
    if isinstance(cache, KVCache):
        given.update({"cache.keys": cache.keys, "cache.values": cache.values})
    return given


def check_segment_ids(segment_ids: Any, batch_size, num_queries, num_keys, alignment=None) -> None:
    """segment_ids: integers (batch_size, positions), where there are as many queries as keys,
    or a pair (query ids (batch_size, no. of queries), key ids (batch_size, no. of keys)),
    whose sequences' positions `alignment` places unless it is "bottom_right"."""
    if (
        isinstance(segment_ids, tuple)
        and isinstance(alignment, str)
        and alignment == "bottom_right"
    ):
        raise ValueError(
            "alignment='bottom_right' cannot be given with a pair of segment_ids: each packed "
            "sequence counts its queries' and its keys' positions from its own first, and only "
            "its own lengths could place its last query beside its last key. Give 'top_left' "
            "or the position of each sequence's first query (an int)"
        )
    pair = segment_pair(segment_ids)
    if len(pair) != 2:
        raise ValueError(
            "segment_ids must be a tensor (batch_size, positions) or a pair (query segment "
            f"ids (batch_size, no. of queries), key segment ids (batch_size, no. of keys)). "
            f"Received: a tuple of {len(pair)}"
        )
    for name, ids, positions in zip(
        ("queries", "keys"), pair, (num_queries, num_keys), strict=True
    ):
        require_tensor("segment_ids", ids)
        if dtype_name(ids) not in INTEGER_DTYPES or not _shape_is(ids, (batch_size, positions)):
            raise ValueError(
                f"segment_ids of the {name} must be integers of shape (batch_size, no. of "
                f"{name}) = ({batch_size}, {positions}); one tensor stands for both only where "
                f"there are as many queries as keys. Received: {describe('segment_ids', ids)}"
            )


def _shape_is(x: Any, shape: tuple) -> bool:
    """Whether x has `shape`, a size unknown while tracing matching any."""
    actual = shape_of(x)
    return len(actual) == len(shape) and all(map(same, actual, shape))


def _check_packing(segment_ids, cache, rope_scaling, scores, alignment, sizes_known):
    """A layer's segment_ids: well formed, without a cache (whose keys' segments are not
    known), and with rotary frequencies that do not depend on the row's length. scores:
    (batch_size, no. of queries, no. of keys)."""
    batch_size, num_queries, num_keys = scores
    if cache is not None:
        raise ValueError(
            "segment_ids cannot be given with a cache: packed sequences are attended whole"
        )
    check_segment_ids(segment_ids, batch_size, num_queries, num_keys, alignment)
    scaling_type = None if rope_scaling is None else rope_scaling.get("rope_type")
    original = (
        None if rope_scaling is None else rope_scaling.get("original_max_position_embeddings")
    )
    known = sizes_known and isinstance(num_keys, int)
    longer = known and original is not None and num_keys > original
    if scaling_type in ("dynamic", "longrope") and (longer or not known):
        received = f"{num_keys} keys" if known else "rows of a length a traced program leaves free"
        raise ValueError(
            f"segment_ids with a {scaling_type!r} rope_scaling need rows of at most its "
            f"original_max_position_embeddings ({original}) positions: beyond, the frequencies "
            f"follow the row's length, not each sequence's. Received: {received}"
        )


def _check_flags(causal: Any, need_weights: Any, alignment: Any) -> None:
    check_bool("causal", causal)
    check_bool("need_weights", need_weights)
    if alignment is not None:
        check_alignment(alignment)


def _check_inputs(queries, keys, values, dtype: LayerDtype, same_query_key_size: bool):
    """The shapes of queries, keys and values, which must fit together."""
    # Self-attention passes one tensor three times: it is checked once
    q_shape = _check_input("queries", queries, dtype)
    k_shape = q_shape if keys is queries else _check_input("keys", keys, dtype)
    v_shape = k_shape if values is keys else _check_input("values", values, dtype)
    batch_size, num_queries, num_keys = q_shape[0], q_shape[1], k_shape[1]
    if not (same(batch_size, k_shape[0]) and same(batch_size, v_shape[0])):
        raise ValueError(
            "queries, keys and values must have the same batch size. Received: "
            f"queries with shape {format_shape(q_shape)}, keys with shape "
            f"{format_shape(k_shape)}, values with shape {format_shape(v_shape)}"
        )
    if not same(num_keys, v_shape[1]):
        raise ValueError(
            "keys and values must have the same number of key-value pairs (axis 1). Received: "
            f"keys with shape {format_shape(k_shape)}, values with shape "
            f"{format_shape(v_shape)}"
        )
    if num_queries == 0 or num_keys == 0:
        raise ValueError(
            "queries and keys must each hold at least one position (axis 1). Received: "
            f"queries with shape {format_shape(q_shape)}, keys with shape "
            f"{format_shape(k_shape)}"
        )
    if same_query_key_size and not same(q_shape[2], k_shape[2]):
        raise ValueError(
            "queries and keys must have the same feature size (last axis) for dot-product "
            f"scores. Received: queries with shape {format_shape(q_shape)}, keys with shape "
            f"{format_shape(k_shape)}"
        )
    return q_shape, k_shape, v_shape


def _check_masks(mask, attn_bias, window_mask, head_mask, dtype, num_heads, sizes) -> None:
    """The masks of a call of (batch_size, no. of queries, no. of keys) = sizes."""
    batch_size, num_queries, num_keys = sizes
    if num_heads is None:
        target = (batch_size, num_queries, num_keys)
    else:
        target = (batch_size, num_heads, num_queries, num_keys)
    if mask is not None:
        _check_mask(mask, target, allow_heads=num_heads is not None)
    if attn_bias is not None:
        _check_attn_bias(attn_bias, target, num_heads is not None, dtype)
    if window_mask is not None:
        _check_window_mask(window_mask, batch_size, num_queries, num_keys, dtype)
    if head_mask is not None:
        if num_heads is None:
            raise TypeError("head_mask is only accepted by MultiHeadAttention")
        _check_head_mask(head_mask, batch_size, num_heads, dtype)


def check_latent_attention_call(
    X: Any,
    valid_lens: Any = None,
    *,
    mask: Any = None,
    causal: Any = False,
    window_mask: Any = None,
    need_weights: Any = True,
    attn_bias: Any = None,
    cache: Any = None,
    absorbed: Any = False,
    dtype: LayerDtype,
    num_hiddens: int,
    num_heads: int,
    latent_sizes: tuple[int, int],
    tensor_type: Any = object,
) -> tuple[int | None, int | None, int | None]:
    """Check the call of MultiHeadLatentAttention; returns (batch_size, no. of queries, no.
    of keys), the keys counting the cached ones. `latent_sizes`: (kv_lora_rank,
    qk_rope_head_dim), the sizes of what its cache keeps."""
    given = dict(X=X, valid_lens=valid_lens, mask=mask, window_mask=window_mask)
    cached = (
        {}
        if cache is None
        else {f"cache.{f}": getattr(cache, f, None) for f in ("latent", "rotary_keys")}
    )
    require_framework(tensor_type, **given, attn_bias=attn_bias, **cached)
    shape = _check_input("X", X, dtype)
    _check_size("X", X, shape, "num_hiddens", num_hiddens)
    batch_size, num_queries = shape[0], shape[1]
    if num_queries == 0:
        raise ValueError(
            f"X must hold at least one position (axis 1). Received: {describe('X', X)}"
        )
    num_keys = num_queries
    if cache is not None:
        num_keys = _add(num_keys, check_latent_cache(cache, batch_size, *latent_sizes, dtype))
    if valid_lens is not None:
        check_valid_lens(valid_lens, batch_size, num_queries)
    _check_flags(causal, need_weights, None)
    check_bool("absorbed", absorbed)
    scores = (batch_size, num_queries, num_keys)
    _check_masks(mask, attn_bias, window_mask, None, dtype, num_heads, scores)
    return batch_size, num_queries, num_keys


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


def check_masked_softmax_call(
    X: Any, valid_lens: Any = None, *, tensor_type: Any = object, empty_rows: Any = "zeros"
) -> None:
    """Check masked_softmax(X, valid_lens): X (batch_size, ..., no. of queries, no. of keys)."""
    require_framework(tensor_type, X=X, valid_lens=valid_lens)
    check_empty_rows(empty_rows)
    require_tensor("X", X)
    shape = shape_of(X)
    if dtype_name(X) not in FLOAT_DTYPES:
        raise TypeError(f"X must have a floating dtype. Received: {describe('X', X)}")
    if len(shape) < 2:
        raise ValueError(
            "X must have rank 2 or more: (batch_size, ..., no. of keys). "
            f"Received: {describe('X', X)}"
        )
    if shape[-1] == 0:
        raise ValueError(
            "X must hold at least one key (last axis): a softmax over no keys is undefined. "
            f"Received: {describe('X', X)}"
        )
    if valid_lens is None:
        return
    require_tensor("valid_lens", valid_lens)
    if len(shape_of(valid_lens)) == 2 and len(shape) < 3:
        raise ValueError(
            "2-D valid_lens needs X of rank 3 or more: (batch_size, no. of queries, no. of "
            f"keys). Received: {describe('X', X)}, {describe('valid_lens', valid_lens)}"
        )
    check_valid_lens(valid_lens, shape[0], shape[-2])


def check_positional_encoding_call(
    X: Any, num_hiddens: int, max_len: int, dtype: LayerDtype, *, tensor_type: Any = object
) -> None:
    """Check PositionalEncoding's call: X (batch_size, no. of steps <= max_len, num_hiddens)."""
    require_framework(tensor_type, X=X)
    shape = _check_input("X", X, dtype)
    _check_size("X", X, shape, "num_hiddens", num_hiddens)
    if shape[1] is not None and shape[1] > max_len:
        raise ValueError(
            f"X is longer than max_len={max_len}: build the layer with a larger max_len. "
            f"Received: {describe('X', X)}"
        )


def check_rotary_call(
    X: Any, offset: Any, num_hiddens: int, dtype: LayerDtype, *, tensor_type: Any = object
) -> None:
    """Check RotaryEmbedding's call: X (..., no. of positions, num_hiddens), offset the
    position of X's first row, a non-negative integer."""
    require_framework(tensor_type, X=X)
    require_tensor("X", X)
    shape = shape_of(X)
    if len(shape) < 2:
        raise ValueError(
            "X must have rank 2 or more: (..., no. of positions, num_hiddens). "
            f"Received: {describe('X', X)}"
        )
    require_dtype("X", X, dtype)
    _check_size("X", X, shape, "num_hiddens", num_hiddens)
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer. Received: offset={offset!r}")


def check_add_norm_call(
    X: Any, Y: Any, num_hiddens: int, dtype: LayerDtype, *, tensor_type: Any = object
) -> None:
    """Check AddNorm's call: X and Y of the same shape, last axis num_hiddens."""
    require_framework(tensor_type, X=X, Y=Y)
    for name, tensor in (("X", X), ("Y", Y)):
        require_tensor(name, tensor)
        require_dtype(name, tensor, dtype)
        shape = shape_of(tensor)
        if len(shape) < 2:
            raise ValueError(
                f"{name} must have rank 2 or more, with num_hiddens last. "
                f"Received: {describe(name, tensor)}"
            )
        _check_size(name, tensor, shape, "num_hiddens", num_hiddens)
    x_shape, y_shape = shape_of(X), shape_of(Y)
    if len(x_shape) != len(y_shape) or not all(map(same, x_shape, y_shape)):
        raise ValueError(
            "X and Y must have the same shape. "
            f"Received: X with shape {format_shape(x_shape)}, Y with shape "
            f"{format_shape(y_shape)}"
        )
