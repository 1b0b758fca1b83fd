"""The layers' constructor arguments: the check of each kind of option, the rules between
options, and the dtypes mha computes in.

`check_layer_args(layer, locals())` checks each option of `layer` (mha.options) by its kind
and then the rules between them. `mha.validation` names every public check here too, and it
is where the backends call them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha import options
from mha.encoding import (
    check_query_scaling,
    check_rope_scaling,
    check_rope_scaling_size,
    rotary_angle_dtype,
    rotary_frequencies,
)
from mha.tensors import plain_dtype_name

__all__ = [
    "BACKEND_DTYPES",
    "EMPTY_ROWS",
    "FLOAT_DTYPES",
    "check_backend_dtype",
    "check_bool",
    "check_dtype",
    "check_empty_rows",
    "check_held_in_dtype",
    "check_layer_args",
    "check_position",
    "check_positive_int",
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

# The largest finite number of each float dtype
LARGEST_FLOAT = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
}


# The smallest normal number of each float dtype
SMALLEST_NORMAL = {
    "float16": 6.103515625e-05,
    "bfloat16": 1.1754943508222875e-38,
    "float32": 1.1754943508222875e-38,
    "float64": 2.2250738585072014e-308,
}


# The largest soft cap of each float dtype: the quotient of a score by it falls below the
# smallest normal number, which XLA and TensorFlow flush to 0, only where the score is below
# the dtype's rounding of 1 (epsilon over the smallest normal float32, or float64, number)
LARGEST_SOFTCAP = {
    "float16": LARGEST_FLOAT["float16"],
    "bfloat16": 2.0**119,
    "float32": 2.0**103,
    "float64": 2.0**970,
}


def check_held_in_dtype(name: str, value: Any, dtype: str) -> None:
    """A number the scores are scaled by in `dtype` (scale, softcap) must be finite there:
    past its largest number it is infinity, and the scores NaN, in every backend but torch;
    below the smallest normal number XLA and TensorFlow flush it to 0 (a half dtype's scale
    multiplies in float32, as torch's; the soft cap divides the scores in their dtype). A
    soft cap past LARGEST_SOFTCAP would have them flush scores that count to 0."""
    if value is not None and value > LARGEST_FLOAT[dtype]:
        raise ValueError(
            f"{name} must be at most {LARGEST_FLOAT[dtype]:g}, the largest {dtype} number, "
            f"since the scores are scaled in {dtype}. Received: {name}={value!r}"
        )
    if name == "softcap" and value is not None and value > LARGEST_SOFTCAP[dtype]:
        raise ValueError(
            f"softcap must be at most {LARGEST_SOFTCAP[dtype]:g} in {dtype}: XLA and "
            f"TensorFlow flush to 0 a score divided by a larger cap where the quotient is not "
            f"a normal number, which would then be a score larger than {dtype}'s rounding of "
            f"1 (a cap this large leaves the scores as they are: give none). "
            f"Received: softcap={value!r}"
        )
    kind = "float32" if name == "scale" and dtype in ("float16", "bfloat16") else dtype
    if value is not None and value < SMALLEST_NORMAL[kind]:
        raise ValueError(
            f"{name} must be at least {SMALLEST_NORMAL[kind]:g}, the smallest normal {kind} "
            f"number, since the scores are scaled in {kind}, where XLA and TensorFlow flush a "
            f"smaller one to 0. Received: {name}={value!r}"
        )


# The layers' epsilons, each added to a mean square or variance
EPSILONS = ("eps", "qk_norm_eps", "norm_eps")


def check_eps_normal(name: str, value: float, dtype: str) -> None:
    """An epsilon is added to a mean square in float32 (float64 in a float64 layer), where
    XLA and TensorFlow flush a number below the smallest normal one to 0: a row of no spread
    would then be 0 / 0, NaN there and 0 in the other backends."""
    kind = "float64" if dtype == "float64" else "float32"
    if value < SMALLEST_NORMAL[kind]:
        raise ValueError(
            f"{name} must be at least {SMALLEST_NORMAL[kind]:g}, the smallest normal {kind} "
            f"number, since it is added in {kind}, where XLA and TensorFlow flush a smaller one "
            f"to 0 (a row of no spread would be NaN there). Received: {name}={value!r}"
        )


# Sizes, windows, chunks and positions are at most this: a sum of three of them stays exact in
# int64 and in float64 (MXNet counts positions there), so no backend wraps or rounds one
MAX_POSITION = 2**50


def check_position(name: str, value: int) -> None:
    """A size, window, chunk or position (an int) must be within MAX_POSITION."""
    if abs(value) > MAX_POSITION:
        raise ValueError(
            f"{name} must be at most 2**50 in magnitude: mha counts positions exactly, in "
            f"int64 and float64, only that far. Received: {name}={value!r}"
        )


def _positions_within(name: str, scaling: Any, check) -> None:
    """A rope or query scaling checked by `check`, its positions (the original length, an
    offset) within MAX_POSITION, past which a framework's integers overflow."""
    check(name, scaling)
    for key in ("original_max_position_embeddings", "position_offset"):
        if scaling is not None and key in scaling:
            check_position(f"{name}'s {key}", scaling[key])


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")
    check_position(name, value)
    if not isinstance(value, int):  # a layer keeps its sizes, and files and Keras take ints
        raise TypeError(
            f"{name} must be a Python int (int() converts numpy's integers). "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )


def _check_optional_positive_int(name: str, value: Any) -> None:
    if value is not None:
        check_positive_int(name, value)


def _check_python_number(name: str, value: Any) -> None:
    """A TypeError for a number of another kind (numpy's float32): a layer keeps it, and its
    config goes to JSON files, which take Python's numbers (and numpy's float64, a float)."""
    if not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a Python number (float() converts numpy's numbers). "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )


def _check_dropout(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (0.0 <= float(value) < 1.0)
    ):
        raise ValueError(f"{name} must be a number in [0, 1). Received: {name}={value!r}")
    _check_python_number(name, value)


def check_bool(name: str, value: Any) -> None:
    """A TypeError unless `value` is True or False."""
    if not isinstance(value, bool):
        received = repr(value)
        if received in ("True", "False"):  # numpy 1's bool, which prints as Python's
            received += f" of type {type(value).__module__}.{type(value).__qualname__}"
        raise TypeError(f"{name} must be True or False. Received: {name}={received}")


def _check_optional_bool(name: str, value: Any) -> None:
    if value is not None:
        check_bool(name, value)


def _check_positive_number(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name} must be a positive number. Received: {name}={value!r}")
    _check_python_number(name, value)


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
    if not (math.isfinite(value) and value > 0):  # as the attention function's scale
        raise ValueError(f"{name} must be a positive number or None. Received: {name}={value!r}")
    _check_python_number(name, value)


def check_dtype(dtype: Any) -> str:
    """Return the dtype's plain name; accepts a name or any framework's dtype object."""
    name = dtype if isinstance(dtype, str) or dtype is None else plain_dtype_name(dtype)
    if name not in FLOAT_DTYPES:
        # A mixed policy (Keras's "mixed_float16") computes in one dtype and stores in another
        advice = ""
        if "mixed" in str(name) or "mixed" in repr(dtype):
            advice = (
                ": a layer computes in the dtype its weights hold, so give the compute dtype "
                "(dtype='float16' for mixed_float16) and load the weights into it"
            )
        raise ValueError(
            f"dtype must be one of {', '.join(FLOAT_DTYPES)}{advice}. Received: dtype={dtype!r}"
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


# Where the causal diagonal and the windows' centres lie when queries and keys differ in
# number: query i at position i ("top_left", torch's is_causal) or at i + K - Q, the last query
# beside the last key ("bottom_right", FlashAttention's); an int n puts it at n + i (n cached
# keys before the queries, as ONNX's past_key)
ALIGNMENTS = ("top_left", "bottom_right")


def check_alignment(alignment: Any) -> None:
    """alignment: one of ALIGNMENTS or the position of the first query (an int)."""
    whole = isinstance(alignment, numbers.Integral) and not isinstance(alignment, bool)
    if not (whole or (isinstance(alignment, str) and alignment in ALIGNMENTS)):
        raise ValueError(
            "alignment must be 'top_left', 'bottom_right' or the position of the first query "
            f"(an int). Received: alignment={alignment!r}"
        )
    if whole:
        check_position("alignment", alignment)


QK_NORMS = ("head", "head_after_rotary", "projection", "layer_norm_per_head")


def _check_qk_norm(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or value not in QK_NORMS):
        choices = ", ".join(map(repr, QK_NORMS[:-1])) + f" or {QK_NORMS[-1]!r}"
        raise ValueError(f"{name} must be None, {choices}. Received: {name}={value!r}")


# The check of each kind of value an option takes (mha.options.Option.check)
_VALUE_CHECKS = {
    "positive integer": check_positive_int,
    "optional positive integer": _check_optional_positive_int,
    "dropout": _check_dropout,
    "boolean": check_bool,
    "optional boolean": _check_optional_bool,
    "positive number": _check_positive_number,
    "optional positive number": _check_optional_positive_number,
    "scale": _check_scale,
    "empty_rows": lambda name, value: check_empty_rows(value),
    "dtype": lambda name, value: check_dtype(value),
    "rope scaling": lambda name, value: _positions_within(name, value, check_rope_scaling),
    "query scaling": lambda name, value: _positions_within(name, value, check_query_scaling),
    "qk_norm": _check_qk_norm,
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
    rotary = arguments["rope_theta"] is not None
    if rotary and arguments["rope_dim"] is None and (num_hiddens // num_heads) % 2 != 0:
        raise ValueError(
            "rotary embeddings rotate pairs of features: the head size num_hiddens / "
            "num_heads must be even. "
            f"Received: num_hiddens={num_hiddens}, num_heads={num_heads}"
        )


def _sinks_take_empty_rows(arguments: Mapping[str, Any]) -> None:
    if arguments["sinks"] and arguments["empty_rows"] != "zeros":
        raise ValueError(
            "sinks take the whole weight of a row with no key, so that its weights are 0: "
            f"empty_rows must be 'zeros'. Received: empty_rows={arguments['empty_rows']!r}"
        )


def _rotary_options_need_theta(arguments: Mapping[str, Any]) -> None:
    given = [key for key in ("rope_dim", "rope_scaling") if arguments[key] is not None]
    given += ["rope_interleaved"] if arguments["rope_interleaved"] else []
    if given and arguments["rope_theta"] is None:
        raise ValueError(
            f"{' and '.join(given)} {'shape' if len(given) > 1 else 'shapes'} the rotary "
            "embedding that rope_theta turns on: give "
            f"rope_theta too. Received: rope_theta=None, "
            + ", ".join(f"{key}={arguments[key]!r}" for key in given)
        )


def _proportional_turns_whole_heads(part: str, scaling: str) -> Any:
    """The rule that a "proportional" scaling (Gemma 4's), which turns a fraction of the whole
    head at the whole head's frequencies, is given without a rotated part of its own."""

    def rule(arguments: Mapping[str, Any]) -> None:
        given = arguments[scaling]
        if given is not None and given["rope_type"] == "proportional" and arguments[part]:
            raise ValueError(
                f"a 'proportional' {scaling} turns its partial_rotary_factor of the whole head, "
                f"at the whole head's frequencies; {part} turns a part of its own: give one. "
                f"Received: {part}={arguments[part]!r}, {scaling}={dict(given)!r}"
            )

    return rule


def _rotated_part(name: str, rotated: int | None, size_name: str, size: int) -> None:
    if rotated is not None and (rotated % 2 != 0 or rotated > size):
        raise ValueError(
            f"{name} must be even (rotary embeddings rotate pairs of features) and at most "
            f"{size_name}, {size}. Received: {name}={rotated}"
        )


def _rope_dim_in_head(arguments: Mapping[str, Any]) -> None:
    head = arguments["num_hiddens"] // arguments["num_heads"]
    _rotated_part("rope_dim", arguments["rope_dim"], "the head size", head)
    check_rope_scaling_size(
        "rope_scaling", arguments["rope_scaling"], arguments["rope_dim"] or head
    )


def _rotary_size_even(arguments: Mapping[str, Any]) -> None:
    if arguments["num_hiddens"] % 2 != 0 and arguments["rotary_dim"] is None:
        raise ValueError(
            "num_hiddens must be even: rotary embeddings rotate pairs of features. "
            f"Received: num_hiddens={arguments['num_hiddens']}"
        )
    num_hiddens, rotary_dim = arguments["num_hiddens"], arguments["rotary_dim"]
    _rotated_part("rotary_dim", rotary_dim, "num_hiddens", num_hiddens)
    check_rope_scaling_size("scaling", arguments["scaling"], rotary_dim or num_hiddens)


def _latent_rotary(arguments: Mapping[str, Any]) -> None:
    if arguments["rope_theta"] is None:
        raise ValueError(
            "MultiHeadLatentAttention rotates the rotary part of each query and key: rope_theta "
            "must be a positive number. Received: rope_theta=None"
        )
    rope = arguments["qk_rope_head_dim"]
    if rope % 2 != 0:
        raise ValueError(
            "qk_rope_head_dim must be even: rotary embeddings rotate pairs of features. "
            f"Received: qk_rope_head_dim={rope}"
        )
    check_rope_scaling_size("rope_scaling", arguments["rope_scaling"], rope)


_LARGEST_CHECKED_ROTATION = 2**16


def _frequencies_held(layer: str, arguments: Mapping[str, Any], angle_dtype: str) -> None:
    """A rotary embedding's frequencies must be finite in the angles' dtype: a rope_theta far
    below 1, or a scaling's factor far below 1, passes float32's largest number there, and
    every backend's angles are then inf and its outputs NaN."""
    theta, scaling, rotated = {
        "MultiHeadAttention": lambda a: (a["rope_theta"], a["rope_scaling"],
                                         a["rope_dim"] or a["num_hiddens"] // a["num_heads"]),
        "MultiHeadLatentAttention": lambda a: (a["rope_theta"], a["rope_scaling"],
                                               a["qk_rope_head_dim"]),
        "RotaryEmbedding": lambda a: (a["theta"], a["scaling"],
                                      a["rotary_dim"] or a["num_hiddens"]),
    }.get(layer, lambda a: (None, None, None))(arguments)  # fmt: skip
    # The check builds the table, which a file's few bytes may not make large (its sizes are
    # checked after the arguments: mha.checkpoints); no model turns 2**16 features of a head
    if theta is None or rotated > _LARGEST_CHECKED_ROTATION:
        return
    with np.errstate(over="ignore"):
        frequencies = rotary_frequencies(rotated, theta, scaling).astype(angle_dtype)
    if not np.isfinite(frequencies).all():
        raise ValueError(
            f"the rotary embedding's frequencies (theta {theta!r}, scaling "
            f"{None if scaling is None else dict(scaling)!r}) pass the largest {angle_dtype} "
            "number, the angles' dtype: its angles would be inf and the outputs NaN"
        )


# Rules between a layer's options, checked once each option holds a value of its kind
_LAYER_RULES = {
    "MultiHeadAttention": (
        _heads_divide,
        _kv_heads_divide,
        _rotary_heads_even,
        _rotary_options_need_theta,
        _rope_dim_in_head,
        _proportional_turns_whole_heads("rope_dim", "rope_scaling"),
        _sinks_take_empty_rows,
    ),
    "MultiHeadLatentAttention": (_latent_rotary,),
    "RotaryEmbedding": (
        _rotary_size_even,
        _proportional_turns_whole_heads("rotary_dim", "scaling"),
    ),
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
    dtype = check_dtype(arguments["dtype"])
    for option in options.layer_options(layer):
        if option.name in ("scale", "softcap"):
            check_held_in_dtype(option.name, arguments[option.name], dtype)
        if option.name in EPSILONS:
            check_eps_normal(option.name, arguments[option.name], dtype)
    _frequencies_held(layer, arguments, rotary_angle_dtype(dtype))
    return dtype
