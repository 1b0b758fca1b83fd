"""The positional encodings' numbers, shared by every backend.

The sinusoidal table and the rotary frequencies are computed once in float64 with numpy; each
backend casts them and keeps them as non-trainable buffers or constants. The rotary
frequencies may be scaled as models ship them (`ROPE_TYPES`, with Hugging Face's
`rope_parameters` names and formulas); two kinds of scaling change with the length of the
sequence, and each call then asks `rotary_frequencies_at` for its own.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "ROPE_TYPES",
    "RopeScaling",
    "alibi_slopes",
    "check_query_scaling",
    "check_rope_scaling",
    "check_rope_scaling_size",
    "frozen_rope_scaling",
    "query_scales",
    "rotary_angle_dtype",
    "rotary_attention_factor",
    "rotary_frequencies",
    "rotary_frequencies_at",
    "sinusoid_table",
]


def sinusoid_table(max_len: int, num_hiddens: int) -> np.ndarray:
    """P of shape (1, max_len, num_hiddens), in float64.

    P[0, i, 2j] = sin(i / 10000^(2j / num_hiddens)) and
    P[0, i, 2j + 1] = cos(i / 10000^(2j / num_hiddens)). An odd num_hiddens works: its last
    column is a sine.
    """
    # Shape of positions: (max_len, 1); shape of angles: (max_len, ceil(num_hiddens / 2))
    positions = np.arange(max_len, dtype=np.float64).reshape(-1, 1)
    angles = positions / np.power(10000.0, np.arange(0, num_hiddens, 2) / num_hiddens)
    P = np.zeros((1, max_len, num_hiddens))
    P[0, :, 0::2] = np.sin(angles)
    P[0, :, 1::2] = np.cos(angles[:, : num_hiddens // 2])
    return P


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> np.ndarray:
    """ALiBi's slope of each head, (num_heads,) in float64: with n the power of 2 at or above
    num_heads, 2 ** (-max_bias * k / n) for k = 1 ... n, and where num_heads is not a power
    of 2 the even k first, then the odd ones, num_heads in all (BLOOM's and MPT's rule)."""
    n = 1 << (num_heads - 1).bit_length()  # the power of 2 at or above num_heads
    slopes = 2.0 ** (-max_bias * np.arange(1, n + 1) / n)
    if n != num_heads:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def rotary_frequencies(
    num_hiddens: int,
    theta: float,
    scaling: Mapping[str, Any] | None = None,
    length: int | None = None,
) -> np.ndarray:
    """The angle per position of each pair of features, of shape (num_hiddens / 2,), in
    float64: theta^(-2i / num_hiddens) for i = 0, ..., num_hiddens / 2 - 1, then scaled as
    `scaling` says (see ROPE_TYPES) for a sequence of `length` positions (None: one no longer
    than the original_max_position_embeddings it was trained on)."""
    exponents = np.arange(0, num_hiddens, 2) / num_hiddens
    frequencies = 1.0 / np.power(float(theta), exponents)
    if scaling is None:
        return frequencies
    rope_type, factor = scaling["rope_type"], scaling.get("factor")
    original = scaling.get("original_max_position_embeddings")
    if rope_type == "linear":
        # Positions divided by factor
        return frequencies / factor
    if rope_type == "dynamic":
        # NTK: a larger base once the sequence is longer than the original length
        length = max(length or original, original)
        return dynamic_frequencies(num_hiddens, theta, scaling, length, exponents)
    if rope_type == "longrope":
        # One factor per pair, the long ones beyond the original length
        long = length is not None and length > original
        return frequencies / np.asarray(scaling["long_factor" if long else "short_factor"], float)
    if rope_type == "llama3":
        return _llama3(frequencies, scaling)
    if rope_type == "proportional":
        # Gemma 4: the first pairs of a fraction of the head turn at the whole head's
        # frequencies, the others not at all (frequency 0)
        turning = int(scaling.get("partial_rotary_factor", 1.0) * num_hiddens // 2)
        frequencies[turning:] = 0.0
        return frequencies / scaling.get("factor", 1.0)
    return _yarn(frequencies, num_hiddens, theta, scaling)


def _llama3(frequencies: np.ndarray, scaling: Mapping[str, Any]) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
    original = scaling["original_max_position_embeddings"]
    wavelengths = 2 * math.pi / frequencies
    scaled = np.where(wavelengths > original / low, frequencies / factor, frequencies)
    if high == low:  # no blend between (Llama 4 Scout's): a step at original / low
        return scaled
    smooth = (original / wavelengths - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelengths >= original / high) & (wavelengths <= original / low)
    return np.where(medium, blended, scaled)


def _yarn(frequencies, num_hiddens: int, theta: float, scaling: Mapping[str, Any]):
    """YaRN: the low frequencies divided by factor, the high ones kept, a linear ramp over the
    pairs between, where beta_fast and beta_slow rotations fit in the original length."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def pair_of(rotations: float) -> float:
        # The pair whose wavelength fits `rotations` times in the original length
        return num_hiddens * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(scaling.get("beta_fast") or 32), pair_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, num_hiddens - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = np.clip((np.arange(num_hiddens // 2) - low) / (high - low), 0, 1)
    return frequencies / factor * ramp + frequencies * (1 - ramp)


def dynamic_frequencies(
    num_hiddens: int, theta: float, scaling: Mapping[str, Any], length: Any, exponents: Any
) -> Any:
    """A "dynamic" scaling's frequencies for a sequence of `length` positions, no fewer than
    its original ones; exponents: 2i / num_hiddens for each pair. Python's operators alone,
    so that a backend may give the length and exponents as its own tensors (a length that an
    exported program leaves free)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    base = theta * (factor * length / original - (factor - 1)) ** (num_hiddens / (num_hiddens - 2))
    return 1.0 / base**exponents


def rotary_frequencies_at(
    num_hiddens: int, theta: float, scaling: Mapping[str, Any] | None, length: int
) -> np.ndarray | None:
    """The frequencies of a call over positions up to `length` - 1 where they differ from the
    layer's own (`rotary_frequencies` without a length): "dynamic" and "longrope" beyond the
    original length; None where the layer's own hold."""
    if scaling is None or scaling["rope_type"] not in ("dynamic", "longrope"):
        return None
    if length <= scaling["original_max_position_embeddings"]:
        return None
    return rotary_frequencies(num_hiddens, theta, scaling, length)


def rotary_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """The factor of the cosines and sines, so of the scores twice over: "yarn"'s and
    "longrope"'s attention_factor (computed from factor where not given), else 1."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor", 1.0)  # longrope's is optional: no factor, no change
    if scaling["rope_type"] == "longrope":
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return _mscale(factor, scaling["mscale"]) / _mscale(factor, scaling["mscale_all_dim"])
    return _mscale(factor)


def _mscale(scale: float, weight: float = 1.0) -> float:
    """yarn's magnitude correction of a context `scale` times longer, weighted."""
    return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0


def rotary_angle_dtype(dtype: str) -> str:
    """The dtype rotary angles (position x frequency) are computed in: float64 for float64
    layers, else float32, as Hugging Face and Keras compute them; cosines and sines are then
    cast to the layer's dtype."""
    return "float64" if dtype == "float64" else "float32"


# The rotary scalings models ship, as Hugging Face's rope_parameters name them: each type's
# keys that must be given, and those that may be
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
    ),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
    "longrope": (
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        ("factor", "attention_factor"),
    ),
    "proportional": ((), ("factor", "partial_rotary_factor")),
}


class RopeScaling(dict):
    """A rotary scaling (or a query_scaling) as a layer keeps it: a dict (equal to the one
    given, written to files as it is) that cannot change and can be hashed; its lists are
    tuples."""

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.items())))

    def _frozen(self, *args, **kwargs):
        raise TypeError("a layer's scaling cannot change; build a layer with another")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _frozen
    __ior__ = _frozen

    def __reduce__(self):  # pickle and copy.deepcopy build it whole, not item by item
        return (RopeScaling, (dict(self),))


def frozen_rope_scaling(scaling: Mapping[str, Any] | None) -> RopeScaling | None:
    """`scaling` (a mapping check_rope_scaling or check_query_scaling accepted) as the layer
    keeps it: numpy's numbers as Python's (equal, and written to files as they are)."""
    if scaling is None:
        return None
    return RopeScaling(
        (key, tuple(map(float, value)) if _is_list(value) else _plain(value))
        for key, value in scaling.items()
    )


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def check_rope_scaling(name: str, scaling: Any) -> None:
    """A ValueError unless `scaling` is None or a mapping with a rope_type of ROPE_TYPES and
    that type's keys, each holding a value of its kind (a TypeError for a mapping's type)."""
    if scaling is None:
        return
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"{name} must be None or a mapping such as {{'rope_type': 'linear', 'factor': "
            f"2.0}}. Received: {name}={scaling!r}"
        )
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{name} must be a mapping whose rope_type is one of "
            f"{', '.join(map(repr, ROPE_TYPES))}. Received: {name}={dict(scaling)!r}"
        )
    required, optional = ROPE_TYPES[rope_type]
    missing = [key for key in required if key not in scaling]
    unknown = [key for key in scaling if key not in ("rope_type", *required, *optional)]
    if missing or unknown:
        raise ValueError(
            f"{name} must hold {', '.join(required)} for rope_type {rope_type!r}"
            + (f" (and optionally {', '.join(optional)})" if optional else "")
            + (f"; missing: {', '.join(missing)}" if missing else "")
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            + f". Received: {name}={dict(scaling)!r}"
        )
    for key, value in scaling.items():
        if key != "rope_type" and not _ROPE_VALUE_CHECKS.get(key, _positive)(value):
            raise ValueError(
                f"{name} must give {key} {_ROPE_VALUE_KINDS.get(key, 'a positive number')}. "
                f"Received: {name}={dict(scaling)!r}"
            )
    if rope_type == "llama3" and scaling["high_freq_factor"] < scaling["low_freq_factor"]:
        raise ValueError(
            f"{name} must give high_freq_factor a number at or above its low_freq_factor. "
            f"Received: {name}={dict(scaling)!r}"
        )


def check_rope_scaling_size(name: str, scaling: Mapping[str, Any] | None, rotated: int) -> None:
    """The rules between a rope scaling and the number of features it rotates."""
    if scaling is None:
        return
    pairs = rotated // 2
    for key in ("short_factor", "long_factor"):
        if key in scaling and len(scaling[key]) != pairs:
            raise ValueError(
                f"{name} must give {key} one factor per pair of rotated features, {pairs}. "
                f"Received: {len(scaling[key])} factors"
            )
    if scaling["rope_type"] == "dynamic" and rotated <= 2:
        raise ValueError(
            f"{name} of rope_type 'dynamic' must rotate more than 2 features. Received: {rotated}"
        )


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return _number(value) and math.isfinite(value) and value > 0


def _factors(value: Any) -> bool:
    return _is_list(value) and all(_positive(x) for x in np.asarray(value, object).ravel())


_ROPE_VALUE_CHECKS = {
    "original_max_position_embeddings": lambda v: _positive(v) and isinstance(v, numbers.Integral),
    "partial_rotary_factor": lambda v: _positive(v) and v <= 1,
    "mscale": lambda v: _number(v) and math.isfinite(v) and v >= 0,
    "mscale_all_dim": lambda v: _number(v) and math.isfinite(v) and v >= 0,
    # 0 reads as the default (32, 1), as transformers reads `beta_fast or 32`
    "beta_fast": lambda v: _number(v) and math.isfinite(v) and v >= 0,
    "beta_slow": lambda v: _number(v) and math.isfinite(v) and v >= 0,
    "truncate": lambda v: isinstance(v, bool),
    "short_factor": _factors,
    "long_factor": _factors,
}
_ROPE_VALUE_KINDS = {
    "original_max_position_embeddings": "a positive integer",
    "partial_rotary_factor": "a number in (0, 1]",
    "mscale": "a number >= 0",
    "mscale_all_dim": "a number >= 0",
    "beta_fast": "a number >= 0 (0: the default, 32)",
    "beta_slow": "a number >= 0 (0: the default, 1)",
    "truncate": "True or False",
    "short_factor": "a list of positive numbers",
    "long_factor": "a list of positive numbers",
}


def latent_attention_scale(head_size: int, scaling: Mapping[str, Any] | None) -> float:
    """The softmax scale of multi-head latent attention: 1 / sqrt(head size), times yarn's
    mscale(factor, mscale_all_dim) squared when the rotary is scaled (DeepSeek-V3's)."""
    scale = head_size**-0.5
    if scaling is None or not scaling.get("mscale_all_dim"):
        return scale
    return scale * _mscale(scaling.get("factor", 1.0), scaling["mscale_all_dim"]) ** 2


def query_scales(positions: np.ndarray, scaling: Mapping[str, Any]) -> np.ndarray:
    """The factor of each query by its position p (query_scaling, Ministral 3's
    llama_4_scaling_beta): 1 + beta * log(1 + floor((p + o) / L)), L the scaling's
    original_max_position_embeddings and o its position_offset (0 unless given; Llama 4's
    is 1); 1 within the first L positions, then larger by beta * log 2, beta * log 3, ...
    past each further L, so the scores sharpen with distance."""
    shifted = positions + scaling.get("position_offset", 0)
    steps = np.floor(shifted / scaling["original_max_position_embeddings"])
    return 1 + scaling["beta"] * np.log1p(steps)


# The keys of query_scaling, each with its check and the kind it takes; position_offset may
# be left out (0)
_QUERY_SCALING = {
    "beta": (lambda v: _number(v) and math.isfinite(v) and v >= 0, "a number >= 0"),
    "original_max_position_embeddings": (
        _ROPE_VALUE_CHECKS["original_max_position_embeddings"],
        "a positive integer",
    ),
    "position_offset": (
        lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0,
        "an optional integer >= 0",
    ),
}


def check_query_scaling(name: str, scaling: Any) -> None:
    """A ValueError unless `scaling` is None or a mapping of beta (>= 0) and
    original_max_position_embeddings (a positive integer), and optionally position_offset
    (an integer >= 0), nothing else; a TypeError for another type."""
    if scaling is None:
        return
    example = "{'beta': 0.1, 'original_max_position_embeddings': 16384}"
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"{name} must be None or a mapping such as {example}. Received: {name}={scaling!r}"
        )
    wrong = sorted((set(scaling) ^ set(_QUERY_SCALING)) - {"position_offset"})
    bad = [
        key
        for key, (good, _) in _QUERY_SCALING.items()
        if key in scaling and not good(scaling[key])
    ]
    if wrong or bad:
        kinds = ", ".join(f"{key} {kind}" for key, (_, kind) in _QUERY_SCALING.items())
        raise ValueError(
            f"{name} must hold {kinds}, as {example}. Received: {name}={dict(scaling)!r}"
        )
