"""A config's numbers and flags, checked where they are read: a count, a size, a scalar or a
flag that is not one is an error naming the field, never rounded or passed on to fail
elsewhere; and the number and size of its heads, under the names configs give them."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = [
    "flag",
    "fraction",
    "head_size",
    "hidden_size",
    "is_whole",
    "num_heads",
    "positive_count",
    "positive_number",
]


def is_whole(value: Any) -> bool:
    """Whether a config's value is a whole number: an integer (numpy's too) or a float without
    a fraction (JSON's 4096.0); bools are the caller's to refuse."""
    if isinstance(value, numbers.Integral):
        return True
    return isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer()


def flag(config: Mapping[str, Any], field: str, default: bool = False) -> bool:
    """A true-or-false field of the config: `default` where it is absent, false where it is
    null (as transformers' `if config.field:` reads it), or an error naming the field: a
    "false" string or a 0 read as a flag would turn an option on or off silently."""
    value = config.get(field, default)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"the config's {field}={value!r} is not true or false")
    return value


def positive_count(field: str, value: Any) -> int:
    """A count or size the config gives (a window, a head size, features turned): a positive
    whole number (JSON's 4096.0 is 4096), or an error naming the field. A fraction or a bool
    would be rounded to another window silently."""
    if isinstance(value, bool) or not is_whole(value) or value <= 0:
        raise ValueError(
            f"the config's {field}={value!r} is not a positive whole number (a count or a size)"
        )
    return int(value)


def positive_number(field: str, value: Any) -> float:
    """A positive finite number the config gives (a scalar of the scores), or an error naming
    the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"the config's {field}={value!r} is not a positive finite number")
    return float(value)


def fraction(field: str, value: Any) -> float:
    """A fraction the config gives (of each head turned): a number in (0, 1], or an error
    naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"the config's {field}={value!r} is not a fraction in (0, 1]")
    return float(value)


def num_heads(config: Mapping[str, Any]) -> int | None:
    """The number of attention heads, under the names configs give it; None where the config
    does not tell it, or its encoder's and decoder's differ (the caller gives num_heads)."""
    keys = _HEAD_COUNTS
    if config.get("encoder_attention_heads") != config.get("decoder_attention_heads"):
        keys = keys[: keys.index("encoder_attention_heads")]
    # A list (heads per layer or stage) leaves it to the caller; another value that is not a
    # count is an error naming its field
    found = [(key, config[key]) for key in keys if config.get(key) is not None]
    counts = [(key, value) for key, value in found if not isinstance(value, (list, tuple))]
    return positive_count(*counts[0]) if counts else None


# The names of the number of heads: GPT-2's n_head, MPT's n_heads, T5's num_heads, XGLM's
# attention_heads, and BART's and Whisper's encoder_attention_heads and
# decoder_attention_heads where they agree
_HEAD_COUNTS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "attention_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
)
# The names of the hidden size: GPT-2's n_embd, BART's and T5's d_model, DistilBERT's dim,
# XLM's and FlauBERT's emb_dim
_HIDDEN_SIZES = ("hidden_size", "n_embd", "d_model", "dim", "emb_dim")


def head_size(config: Mapping[str, Any]) -> int | None:
    """The size of a head: head_dim, or the hidden size over the number of heads."""
    if config.get("head_dim") is not None:
        return positive_count("head_dim", config["head_dim"])
    heads, hidden = num_heads(config), hidden_size(config)
    if not heads or not hidden or hidden % heads:
        return None
    return hidden // heads


def hidden_size(config: Mapping[str, Any]) -> int | None:
    """The model's hidden size, under the names configs give it; None where not told."""
    found = (positive_count(key, config[key]) for key in _HIDDEN_SIZES if config.get(key))
    return next(found, None)
