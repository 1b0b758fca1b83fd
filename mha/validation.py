"""Every argument and shape check, shared by all backends.

Each backend calls these first thing, before any framework operation, so a mistake raises the
same `ValueError` or `TypeError`, with the same message, whichever framework is in use.
Messages name the argument and echo what was received.

The checks read `.shape` and `.dtype` of any framework's tensor; they never convert a tensor to
numpy. The one check that needs values (valid_lens must be non-negative whole numbers) takes
the smallest value and a sample non-integer, which each backend computes with its own ops.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mha import options

__all__ = [
    "EMPTY_ROWS",
    "FLOAT_DTYPES",
    "check_add_norm_call",
    "check_attention_call",
    "check_backend_dtype",
    "check_dtype",
    "check_empty_rows",
    "check_layer_args",
    "check_masked_softmax_call",
    "check_positional_encoding_call",
    "check_rotary_call",
    "check_valid_lens_values",
    "dtype_name",
    "shape_of",
]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# The float dtypes each backend computes in: numpy and MXNet 1.9 have no bfloat16 arithmetic
BACKEND_DTYPES = {
    "numpy": ("float16", "float32", "float64"),
    "torch": FLOAT_DTYPES,
    "tensorflow": FLOAT_DTYPES,
    "mxnet": ("float16", "float32", "float64"),
    "jax": FLOAT_DTYPES,
}
INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")

Shape = tuple[int | None, ...]


# ---------------------------------------------------------------------------------------------
# Reading any framework's tensor


def shape_of(x: Any) -> Shape:
    """The shape of a numpy array or framework tensor as a tuple; unknown sizes are None, and
    symbolic sizes (torch.export's dynamic shapes, jax.export's symbolic shapes) stay symbolic."""
    shape = x.shape
    if isinstance(shape, tuple) and all(type(d) is int for d in shape):
        # numpy, torch.Size, MXNet: plain ints already (checks run on every call)
        return tuple(shape)
    if hasattr(shape, "as_list"):  # tf.TensorShape, possibly with unknown dimensions
        return tuple(shape.as_list()) if shape.rank is not None else ()
    return tuple(_size(d) for d in shape)


def _size(d: Any) -> Any:
    if d is None or type(d).__name__ in _SYMBOLIC_SIZES:
        # Symbolic sizes stay symbolic: int() would pin torch's program to the example, and
        # JAX's refuses to become a constant
        return d
    return int(d)


# torch.export's size with dynamic shapes, and jax.export's with a symbolic shape
_SYMBOLIC_SIZES = ("SymInt", "_DimExpr")


def dtype_name(x: Any) -> str:
    """The dtype of a numpy array or framework tensor as a plain name, e.g. "float32"."""
    return _plain_dtype_name(x.dtype)


def _plain_dtype_name(dtype: Any) -> str:
    names = _DTYPE_NAMES.setdefault(type(dtype), {})
    try:
        return names[dtype]
    except (KeyError, TypeError):  # TypeError: not hashable
        name = _read_dtype_name(dtype)
    try:
        names[dtype] = name
    except TypeError:
        pass
    return name


# Names already read, by type of dtype object, then by dtype object: reading one parses its
# text, on every call. One table per type: torch.compile traces a lookup in a table of torch
# dtypes, but not in one that also holds another framework's (TensorFlow's DType has a hash
# that it cannot trace), and the checks run inside compiled torch code
_DTYPE_NAMES: dict[type, dict[Any, str]] = {}


def _read_dtype_name(dtype: Any) -> str:
    name = getattr(dtype, "name", None)  # numpy dtype, tf.DType
    if isinstance(name, str):
        return name
    text = str(dtype)  # torch.float32, <class 'numpy.float32'> (mxnet)
    if text.startswith("<class '"):
        text = text[len("<class '") : -2]
    return text.rsplit(".", 1)[-1]


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _describe(name: str, x: Any) -> str:
    return f"{name} with shape {_format_shape(shape_of(x))} and dtype {dtype_name(x)}"


def _format_shape(shape: Shape) -> str:
    if len(shape) == 1:
        return f"({shape[0]},)"
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


def _require_tensor(name: str, x: Any) -> None:
    if not _is_tensor(x):
        raise TypeError(
            f"{name} must be an array or tensor of the layer's framework. "
            f"Received: {name} of type {type(x).__name__}"
        )


def _require_framework(tensor_type: Any, **tensors: Any) -> None:
    """Each given tensor is one of the layer's framework (`tensor_type`): another framework's
    tensor is a TypeError here rather than an internal error in the first operation."""
    for name, x in tensors.items():
        if x is not None and _is_tensor(x) and not isinstance(x, tensor_type):
            raise TypeError(
                f"{name} must be an array or tensor of the layer's framework. "
                f"Received: {name} of type {type(x).__module__}.{type(x).__qualname__}"
            )


def _same(a: int | None, b: int | None) -> bool:
    """Sizes agree, or one of them is not known yet (symbolic shapes)."""
    return a is None or b is None or a == b


def _broadcastable(shape: Shape, target: Shape) -> bool:
    """`shape` broadcasts to `target` (right-aligned, each size equal or 1)."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or _same(s, t) for s, t in zip(shape[::-1], target[::-1], strict=False))


# ---------------------------------------------------------------------------------------------
# Constructor arguments


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")


def _check_optional_positive_int(name: str, value: Any) -> None:
    if value is not None:
        _check_positive_int(name, value)


def _check_dropout(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (0.0 <= float(value) < 1.0)
    ):
        raise ValueError(f"{name} must be a number in [0, 1). Received: {name}={value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False. Received: {name}={value!r}")


def _check_optional_bool(name: str, value: Any) -> None:
    if value is not None:
        _check_bool(name, value)


def _check_positive_number(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name} must be a positive number. Received: {name}={value!r}")


def _check_optional_positive_number(name: str, value: Any) -> None:
    if value is not None:
        _check_positive_number(name, value)


def _check_scale(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be None or a number. Received: {name}={value!r} of type "
            f"{type(value).__name__}"
        )
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite. Received: {name}={value!r}")


def check_dtype(dtype: Any) -> str:
    """Return the dtype's plain name; accepts a name or any framework's dtype object."""
    name = dtype if isinstance(dtype, str) or dtype is None else _plain_dtype_name(dtype)
    if name not in FLOAT_DTYPES:
        raise ValueError(
            f"dtype must be one of {', '.join(FLOAT_DTYPES)}. Received: dtype={dtype!r}"
        )
    return name


def check_backend_dtype(dtype: str, backend: str) -> str:
    """Return `dtype`, a name check_dtype accepted, when `backend` computes in it."""
    supported = BACKEND_DTYPES[backend]
    if dtype not in supported:
        others = [name for name, dtypes in BACKEND_DTYPES.items() if dtype in dtypes]
        others = ", ".join(others[:-1]) + " and " + others[-1] if len(others) > 1 else others[0]
        raise ValueError(
            f"dtype must be one of {', '.join(supported)} in the {backend} backend "
            f"({dtype} computes in {others}). Received: dtype={dtype!r}"
        )
    return dtype


EMPTY_ROWS = ("zeros", "uniform")


def check_empty_rows(empty_rows: Any) -> None:
    """What a query with no key gets: "zeros" (weights and output 0) or "uniform" (weights
    1 / no. of keys over every key, as a fill of equal large negative scores gives)."""
    if not isinstance(empty_rows, str) or empty_rows not in EMPTY_ROWS:
        raise ValueError(
            f"empty_rows must be one of {', '.join(map(repr, EMPTY_ROWS))}. "
            f"Received: empty_rows={empty_rows!r}"
        )


# The check of each kind of value an option takes (mha.options.Option.check)
_VALUE_CHECKS = {
    "positive integer": _check_positive_int,
    "optional positive integer": _check_optional_positive_int,
    "dropout": _check_dropout,
    "boolean": _check_bool,
    "optional boolean": _check_optional_bool,
    "positive number": _check_positive_number,
    "optional positive number": _check_optional_positive_number,
    "scale": _check_scale,
    "empty_rows": lambda name, value: check_empty_rows(value),
    "dtype": lambda name, value: check_dtype(value),
}


def _heads_divide(arguments: Mapping[str, Any]) -> None:
    num_hiddens, num_heads = arguments["num_hiddens"], arguments["num_heads"]
    if num_hiddens % num_heads != 0:
        raise ValueError(
            "num_hiddens must be divisible by num_heads. "
            f"Received: num_hiddens={num_hiddens}, num_heads={num_heads}"
        )


def _kv_heads_divide(arguments: Mapping[str, Any]) -> None:
    num_heads, num_kv_heads = arguments["num_heads"], arguments["num_kv_heads"]
    if num_kv_heads is not None and num_heads % num_kv_heads != 0:
        raise ValueError(
            "num_heads must be a multiple of num_kv_heads (each key-value head serves a group "
            f"of query heads). Received: num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )


def _rotary_heads_even(arguments: Mapping[str, Any]) -> None:
    num_hiddens, num_heads = arguments["num_hiddens"], arguments["num_heads"]
    if arguments["rope_theta"] is not None and (num_hiddens // num_heads) % 2 != 0:
        raise ValueError(
            "rotary embeddings rotate pairs of features: the head size num_hiddens / "
            "num_heads must be even. "
            f"Received: num_hiddens={num_hiddens}, num_heads={num_heads}"
        )


def _rotary_size_even(arguments: Mapping[str, Any]) -> None:
    if arguments["num_hiddens"] % 2 != 0:
        raise ValueError(
            "num_hiddens must be even: rotary embeddings rotate pairs of features. "
            f"Received: num_hiddens={arguments['num_hiddens']}"
        )


# Rules between a layer's options, checked once each option holds a value of its kind
_LAYER_RULES = {
    "MultiHeadAttention": (_heads_divide, _kv_heads_divide, _rotary_heads_even),
    "RotaryEmbedding": (_rotary_size_even,),
}


def check_layer_args(layer: str, arguments: Mapping[str, Any]) -> str:
    """Check the constructor arguments of `layer`, each of its options (mha.options) and the
    rules between them; returns the dtype name.

    Args:
        layer: the layer's class name, e.g. "MultiHeadAttention".
        arguments: a mapping holding every option of the layer, such as the constructor's
            `locals()` or a layer config (other entries are not read).
    """
    for option in options.layer_options(layer):
        _VALUE_CHECKS[option.check](option.name, arguments[option.name])
    for rule in _LAYER_RULES.get(layer, ()):
        rule(arguments)
    return check_dtype(arguments["dtype"])


# ---------------------------------------------------------------------------------------------
# Call arguments


def _check_input(name: str, x: Any, dtype: str) -> Shape:
    _require_tensor(name, x)
    shape = shape_of(x)
    if len(shape) != 3:
        raise ValueError(
            f"{name} must have rank 3: (batch_size, sequence length, features). "
            f"Received: {_describe(name, x)}"
        )
    if dtype_name(x) != dtype:
        raise TypeError(
            f"{name} must have the layer's dtype {dtype}. Received: {_describe(name, x)}"
        )
    return shape


def _check_size(name: str, x: Any, shape: Shape, size_name: str, size: int | None) -> None:
    if size is not None and not _same(shape[-1], size):
        raise ValueError(
            f"The last axis of {name} must have size {size_name}={size}. "
            f"Received: {_describe(name, x)}"
        )


def _check_valid_lens(valid_lens: Any, batch_size: int | None, num_queries: int | None) -> None:
    _require_tensor("valid_lens", valid_lens)
    shape = shape_of(valid_lens)
    dtype = dtype_name(valid_lens)
    if dtype not in INTEGER_DTYPES and dtype not in FLOAT_DTYPES:
        raise TypeError(
            "valid_lens must hold integers (an integer or float dtype). "
            f"Received: {_describe('valid_lens', valid_lens)}"
        )
    if not (
        (len(shape) == 1 and _same(shape[0], batch_size))
        or (len(shape) == 2 and _same(shape[0], batch_size) and _same(shape[1], num_queries))
    ):
        raise ValueError(
            f"valid_lens must have shape (batch_size,) = ({batch_size},) or "
            f"(batch_size, no. of queries) = ({batch_size}, {num_queries}). "
            f"Received: {_describe('valid_lens', valid_lens)}"
        )


def check_valid_lens_values(values: np.ndarray) -> None:
    """Check the values of valid_lens, read into numpy by the backend: non-negative whole
    numbers. Only an eager call has values; the backends skip this in traced ones."""
    if values.size == 0:
        return
    if values.dtype.kind not in "iub":
        fractional = values != np.floor(values)
        if fractional.any():
            raise ValueError(
                "valid_lens must hold whole numbers. Received: valid_lens containing "
                f"{values[fractional][0].item()!r}"
            )
    smallest = values.min().item()
    if smallest < 0:
        raise ValueError(
            f"valid_lens must be non-negative. Received: valid_lens containing {smallest!r}"
        )


def _check_mask(mask: Any, target: Shape, allow_heads: bool) -> None:
    _require_tensor("mask", mask)
    if dtype_name(mask) != "bool":
        raise TypeError(
            f"mask must be a boolean keep-mask (True = attend). Received: {_describe('mask', mask)}"
        )
    _check_broadcast("mask", mask, target, allow_heads)


def _check_attn_bias(attn_bias: Any, target: Shape, allow_heads: bool, dtype: str) -> None:
    _require_tensor("attn_bias", attn_bias)
    if dtype_name(attn_bias) != dtype:
        raise TypeError(
            f"attn_bias must have the layer's dtype {dtype} (it is added to the scores). "
            f"Received: {_describe('attn_bias', attn_bias)}"
        )
    _check_broadcast("attn_bias", attn_bias, target, allow_heads)


def _check_broadcast(name: str, tensor: Any, target: Shape, allow_heads: bool) -> None:
    shape = shape_of(tensor)
    per_example = (target[0], target[-2], target[-1])
    if allow_heads and len(shape) == 4:
        # Only a 4-D tensor has a head axis, so a batch axis is never read as a head axis
        fits = _broadcastable(shape, target)
    else:
        fits = 1 <= len(shape) <= 3 and _broadcastable(shape, per_example)
    if not fits:
        expected = f"(batch_size, no. of queries, no. of keys) = {_format_shape(per_example)}"
        if allow_heads:
            expected += (
                ", or 4-D to (batch_size, num_heads, no. of queries, no. of keys) = "
                f"{_format_shape(target)}"
            )
        raise ValueError(
            f"{name} must broadcast to {expected}. Received: {_describe(name, tensor)}"
        )


def _check_window_mask(window_mask: Any, batch_size, num_queries, num_keys, dtype: str) -> None:
    _require_tensor("window_mask", window_mask)
    if dtype_name(window_mask) not in ("bool", dtype):
        raise TypeError(
            f"window_mask must be boolean (True = attend) or have the layer's dtype {dtype} "
            f"(added to the scores). Received: {_describe('window_mask', window_mask)}"
        )
    shape = shape_of(window_mask)
    if len(shape) != 3 or not (_same(shape[1], num_queries) and _same(shape[2], num_keys)):
        raise ValueError(
            "window_mask must have shape (num_windows, no. of queries, no. of keys) = "
            f"(num_windows, {num_queries}, {num_keys}). "
            f"Received: {_describe('window_mask', window_mask)}"
        )
    num_windows = shape[0]
    if num_windows is not None and (
        num_windows == 0 or (batch_size is not None and batch_size % num_windows != 0)
    ):
        raise ValueError(
            "batch_size must be a multiple of num_windows (the first axis of window_mask). "
            f"Received: batch_size={batch_size}, {_describe('window_mask', window_mask)}"
        )


def _check_head_mask(head_mask: Any, batch_size, num_heads: int, dtype: str) -> None:
    _require_tensor("head_mask", head_mask)
    if dtype_name(head_mask) not in ("bool", dtype):
        raise TypeError(
            f"head_mask must be boolean or have the layer's dtype {dtype}. "
            f"Received: {_describe('head_mask', head_mask)}"
        )
    shape = shape_of(head_mask)
    if not (
        (len(shape) == 1 and _same(shape[0], num_heads))
        or (len(shape) == 2 and _same(shape[0], batch_size) and _same(shape[1], num_heads))
    ):
        raise ValueError(
            f"head_mask must have shape (num_heads,) = ({num_heads},) or "
            f"(batch_size, num_heads) = ({batch_size}, {num_heads}). "
            f"Received: {_describe('head_mask', head_mask)}"
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
    dtype: str,
    sizes: Sequence[tuple[str, str, int | None]] = (),
    same_query_key_size: bool = False,
    num_heads: int | None = None,
    kv_heads: tuple[int, int] | None = None,
    tensor_type: Any = object,
) -> tuple[int | None, int | None, int | None]:
    """Check the call of an attention layer; returns (batch_size, no. of queries, no. of keys),
    the keys counting the cached ones.

    Args:
        sizes: (argument, size name, size) triples, e.g. ("queries", "query_size", 4): the
            last axis of the argument must have that size when it is known.
        same_query_key_size: queries and keys must share their last axis (dot product).
        num_heads: set for multi-head attention; allows 4-D masks and `head_mask`.
        kv_heads: (num_kv_heads, head size) of multi-head attention, for its `cache`.
        tensor_type: the type (or types) of the layer's framework's tensors.
    """
    given = dict(queries=queries, keys=keys, values=values, valid_lens=valid_lens, mask=mask)
    given.update(window_mask=window_mask, head_mask=head_mask, attn_bias=attn_bias)
    if _is_cache(cache):
        given.update({"cache.keys": cache.keys, "cache.values": cache.values})
    _require_framework(tensor_type, **given)
    q_shape, k_shape, v_shape = _check_inputs(queries, keys, values, dtype, same_query_key_size)
    batch_size, num_queries, num_keys = q_shape[0], q_shape[1], k_shape[1]
    tensors = {"queries": (queries, q_shape), "keys": (keys, k_shape), "values": (values, v_shape)}
    for argument, size_name, size in sizes:
        _check_size(argument, *tensors[argument], size_name, size)
    if cache is not None:
        if kv_heads is None:
            raise TypeError("cache is only accepted by MultiHeadAttention")
        num_keys = _add(num_keys, _check_cache(cache, batch_size, *kv_heads, dtype))
    if valid_lens is not None:
        _check_valid_lens(valid_lens, batch_size, num_queries)
    _check_bool("causal", causal)
    _check_bool("need_weights", need_weights)
    _check_masks(
        mask,
        attn_bias,
        window_mask,
        head_mask,
        dtype,
        num_heads,
        (batch_size, num_queries, num_keys),
    )
    return batch_size, num_queries, num_keys


def _check_inputs(queries, keys, values, dtype: str, same_query_key_size: bool):
    """The shapes of queries, keys and values, which must fit together."""
    # Self-attention passes one tensor three times: it is checked once
    q_shape = _check_input("queries", queries, dtype)
    k_shape = q_shape if keys is queries else _check_input("keys", keys, dtype)
    v_shape = k_shape if values is keys else _check_input("values", values, dtype)
    batch_size, num_queries, num_keys = q_shape[0], q_shape[1], k_shape[1]
    if not (_same(batch_size, k_shape[0]) and _same(batch_size, v_shape[0])):
        raise ValueError(
            "queries, keys and values must have the same batch size. Received: "
            f"queries with shape {_format_shape(q_shape)}, keys with shape "
            f"{_format_shape(k_shape)}, values with shape {_format_shape(v_shape)}"
        )
    if not _same(num_keys, v_shape[1]):
        raise ValueError(
            "keys and values must have the same number of key-value pairs (axis 1). Received: "
            f"keys with shape {_format_shape(k_shape)}, values with shape "
            f"{_format_shape(v_shape)}"
        )
    if num_queries == 0 or num_keys == 0:
        raise ValueError(
            "queries and keys must each hold at least one position (axis 1). Received: "
            f"queries with shape {_format_shape(q_shape)}, keys with shape "
            f"{_format_shape(k_shape)}"
        )
    if same_query_key_size and not _same(q_shape[2], k_shape[2]):
        raise ValueError(
            "queries and keys must have the same feature size (last axis) for dot-product "
            f"scores. Received: queries with shape {_format_shape(q_shape)}, keys with shape "
            f"{_format_shape(k_shape)}"
        )
    return q_shape, k_shape, v_shape


def _check_masks(mask, attn_bias, window_mask, head_mask, dtype: str, num_heads, sizes) -> None:
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


def _is_cache(cache: Any) -> bool:
    from mha.cache import KVCache

    return isinstance(cache, KVCache)


def _check_cache(cache: Any, batch_size, num_kv_heads: int, head_size: int, dtype: str):
    """The number of cached positions of a KVCache that fits the call and the layer."""
    if not _is_cache(cache):
        raise TypeError(
            "cache must be an mha.KVCache: KVCache() before the first call, then the cache the "
            f"previous call returned. Received: cache of type {type(cache).__name__}"
        )
    if cache.keys is None and cache.values is None:
        return 0
    expected = (batch_size, num_kv_heads, None, head_size)
    shapes = []
    for name, tensor in (("cache.keys", cache.keys), ("cache.values", cache.values)):
        _require_tensor(name, tensor)
        if dtype_name(tensor) != dtype:
            raise TypeError(
                f"{name} must have the layer's dtype {dtype}. Received: {_describe(name, tensor)}"
            )
        shape = shape_of(tensor)
        if len(shape) != 4 or not all(map(_same, shape, expected)):
            raise ValueError(
                f"{name} must have shape (batch_size, num_kv_heads, no. of positions, head "
                f"size) = ({batch_size}, {num_kv_heads}, positions, {head_size}). "
                f"Received: {_describe(name, tensor)}"
            )
        shapes.append(shape)
    if not _same(shapes[0][2], shapes[1][2]):
        raise ValueError(
            "cache.keys and cache.values must hold the same positions. Received: "
            f"{_describe('cache.keys', cache.keys)}, {_describe('cache.values', cache.values)}"
        )
    return shapes[0][2]


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


def check_masked_softmax_call(
    X: Any, valid_lens: Any = None, *, tensor_type: Any = object, empty_rows: Any = "zeros"
) -> None:
    """Check masked_softmax(X, valid_lens): X (batch_size, ..., no. of queries, no. of keys)."""
    _require_framework(tensor_type, X=X, valid_lens=valid_lens)
    check_empty_rows(empty_rows)
    _require_tensor("X", X)
    shape = shape_of(X)
    if dtype_name(X) not in FLOAT_DTYPES:
        raise TypeError(f"X must have a floating dtype. Received: {_describe('X', X)}")
    if len(shape) < 2:
        raise ValueError(
            "X must have rank 2 or more: (batch_size, ..., no. of keys). "
            f"Received: {_describe('X', X)}"
        )
    if shape[-1] == 0:
        raise ValueError(
            "X must hold at least one key (last axis): a softmax over no keys is undefined. "
            f"Received: {_describe('X', X)}"
        )
    if valid_lens is None:
        return
    _require_tensor("valid_lens", valid_lens)
    if len(shape_of(valid_lens)) == 2 and len(shape) < 3:
        raise ValueError(
            "2-D valid_lens needs X of rank 3 or more: (batch_size, no. of queries, no. of "
            f"keys). Received: {_describe('X', X)}, {_describe('valid_lens', valid_lens)}"
        )
    _check_valid_lens(valid_lens, shape[0], shape[-2])


def check_positional_encoding_call(
    X: Any, num_hiddens: int, max_len: int, dtype: str, *, tensor_type: Any = object
) -> None:
    """Check PositionalEncoding's call: X (batch_size, no. of steps <= max_len, num_hiddens)."""
    _require_framework(tensor_type, X=X)
    shape = _check_input("X", X, dtype)
    _check_size("X", X, shape, "num_hiddens", num_hiddens)
    if shape[1] is not None and shape[1] > max_len:
        raise ValueError(
            f"X is longer than max_len={max_len}: build the layer with a larger max_len. "
            f"Received: {_describe('X', X)}"
        )


def check_rotary_call(
    X: Any, offset: Any, num_hiddens: int, dtype: str, *, tensor_type: Any = object
) -> None:
    """Check RotaryEmbedding's call: X (..., no. of positions, num_hiddens), offset the
    position of X's first row, a non-negative integer."""
    _require_framework(tensor_type, X=X)
    _require_tensor("X", X)
    shape = shape_of(X)
    if len(shape) < 2:
        raise ValueError(
            "X must have rank 2 or more: (..., no. of positions, num_hiddens). "
            f"Received: {_describe('X', X)}"
        )
    if dtype_name(X) != dtype:
        raise TypeError(f"X must have the layer's dtype {dtype}. Received: {_describe('X', X)}")
    _check_size("X", X, shape, "num_hiddens", num_hiddens)
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer. Received: offset={offset!r}")


def check_add_norm_call(
    X: Any, Y: Any, num_hiddens: int, dtype: str, *, tensor_type: Any = object
) -> None:
    """Check AddNorm's call: X and Y of the same shape, last axis num_hiddens."""
    _require_framework(tensor_type, X=X, Y=Y)
    for name, tensor in (("X", X), ("Y", Y)):
        _require_tensor(name, tensor)
        if dtype_name(tensor) != dtype:
            raise TypeError(
                f"{name} must have the layer's dtype {dtype}. Received: {_describe(name, tensor)}"
            )
        shape = shape_of(tensor)
        if len(shape) < 2:
            raise ValueError(
                f"{name} must have rank 2 or more, with num_hiddens last. "
                f"Received: {_describe(name, tensor)}"
            )
        _check_size(name, tensor, shape, "num_hiddens", num_hiddens)
    x_shape, y_shape = shape_of(X), shape_of(Y)
    if len(x_shape) != len(y_shape) or not all(map(_same, x_shape, y_shape)):
        raise ValueError(
            "X and Y must have the same shape. "
            f"Received: X with shape {_format_shape(x_shape)}, Y with shape "
            f"{_format_shape(y_shape)}"
        )
