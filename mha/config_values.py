"""A config's numbers, checked where they are read: a count, a size or a scalar that is not
one is an error naming the field, never rounded or passed on to fail elsewhere."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["is_whole", "positive_count", "positive_number"]


def is_whole(value: Any) -> bool:
    """Whether a config's value is a whole number: an integer (numpy's too) or a float without
    a fraction (JSON's 4096.0); bools are the caller's to refuse."""
    if isinstance(value, numbers.Integral):
        return True
    return isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer()


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
