"""What the converters of every framework share.

An mha MultiHeadAttention's config and weights as a converter reads them (`multihead_config`),
the options a framework's layer or file cannot hold (`check_expressible`), a layer built from
canonical weights (`layer_from_weights`), any framework's array as numpy (`as_numpy`), and
mha's masks as one keep-mask (`keep_mask`), by the rules every layer follows: `mha.masks` for
which masks there are and where the head axis goes, `mha.validation` for the lengths.

Importing this module imports no framework.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha import validation
from mha.config import get_backend
from mha.masks import Masks
from mha.options import layer_defaults
from mha.registry import load_backend
from mha.weights import UNTOLD_OPTIONS, check_untold_options, get_weights, layer_info, set_weights

__all__ = [
    "as_numpy",
    "check_expressible",
    "keep_mask",
    "layer_from_weights",
    "multihead_config",
    "options_of",
    "refuse_overrides",
    "set_training",
    "training_of",
]


def as_numpy(x: Any) -> np.ndarray:
    """A numpy copy of a numpy, torch, TensorFlow or MXNet array (bfloat16 as ml_dtypes')."""
    if hasattr(x, "asnumpy"):  # MXNet
        return x.asnumpy()
    if hasattr(x, "detach"):  # torch
        if getattr(x, "is_meta", False):
            raise ValueError(
                "a tensor on the meta device holds no values (a module made under "
                "torch.device('meta')): load or materialize its weights first"
            )
        return load_backend("torch").to_numpy(x).copy()
    if hasattr(x, "numpy"):  # TensorFlow tensors and Keras variables
        return np.array(x.numpy())
    x = np.array(x)
    # A file's arrays may be big-endian (msgpack keeps numpy's byte order): the same numbers
    # in this machine's order, which every framework takes
    return x.astype(x.dtype.newbyteorder("=")) if x.dtype.byteorder not in "=|" else x


def weight_array(name: str, tensor: Any, where: str) -> np.ndarray:
    """A checkpoint's tensor as a numpy array of a float dtype mha reads, or a ValueError
    naming it (FP8, quantized, sparse or data-less tensors, foreign objects)."""
    try:
        array = as_numpy(tensor)
    except Exception as error:
        raise ValueError(f"{name} {where} cannot be read as an array: {error}") from None
    if array.dtype.name not in validation.FLOAT_DTYPES:
        raise ValueError(
            f"{name} {where} holds {array.dtype.name} numbers; mha "
            f"reads weights of {', '.join(validation.FLOAT_DTYPES)}"
        )
    return array


def refuse_overrides(
    layer: Any, base: type, methods: tuple[str, ...], equivalent: frozenset[str] = frozenset()
) -> None:
    """Raise ValueError where the class of `layer`, a `base`, overrides one of `methods`, the
    ones that compute base's output: mha converts what `base` computes, and a subclass may
    compute other numbers from the same weights (rotary positions, relative scores).
    `equivalent`: the qualified names of subclasses known to compute base's numbers."""
    cls = type(layer)
    if f"{cls.__module__}.{cls.__qualname__}" in equivalent:
        return
    overridden = [
        name for name in methods if getattr(cls, name, None) is not getattr(base, name, None)
    ]
    if overridden:
        name = f"{base.__module__.split('.')[0]}'s {base.__name__}"
        raise ValueError(
            f"{cls.__qualname__} overrides {', '.join(overridden)} of {name}, so it may "
            f"compute other numbers from the same weights; mha converts only what {name} "
            f"computes. Copy the weights into a {base.__name__} to convert them as such"
        )


def multihead_config(
    layer: Any, target: str, other_sizes: bool = False, has: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The config and weights of an mha MultiHeadAttention that `target` can hold; `has`
    names the options of mha's that target has too ("num_kv_heads", "sliding_window")."""
    _, class_name, config = layer_info(layer)
    if class_name != "MultiHeadAttention":
        raise TypeError(
            f"Expected an mha MultiHeadAttention, which {target} holds. Received: an mha "
            f"{class_name}, which has no counterpart there"
        )
    weights = get_weights(layer)
    check_expressible(weights, config["scale"], target, other_sizes, options_of(config), has)
    return config, weights


def options_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The untold options of a MultiHeadAttention config that are set (not their defaults);
    the eps of a layer with neither a QK-norm nor a value norm, which would read it, is not."""
    defaults = layer_defaults("MultiHeadAttention")
    unread = config.get("qk_norm") is None and not config.get("value_norm")
    return {
        key: config[key]
        for key in UNTOLD_OPTIONS
        if config.get(key, defaults[key]) not in (None, False, defaults[key])
        and not (key == "qk_norm_eps" and unread)
    }


def check_expressible(
    weights: Mapping[str, np.ndarray],
    scale: float | None,
    target: str,
    other_sizes: bool = False,
    options: Mapping[str, Any] | None = None,
    has: tuple[str, ...] = (),
) -> None:
    """Raise ValueError where `target` (a framework's layer, or its file) cannot hold what
    mha's options add: a score scale, an output bias apart from the others, unless
    `other_sizes` (Keras's output_shape, Flax's out_features) another output size, rotary
    embeddings, and unless `has` names them, fewer key-value heads, a sliding window and an
    output gate."""
    problems = []
    if scale is not None:
        problems.append(f"a score scale of its own (scale={scale!r})")
    if ("b_q" in weights) != ("b_o" in weights):
        problems.append("an output bias without input biases, or the other way round")
    W_o = np.shape(weights["W_o"])
    if W_o[0] != W_o[1] and not other_sizes:
        problems.append(f"an output size other than num_hiddens (W_o {W_o})")
    if np.shape(weights["W_k"])[1] != W_o[0] and "num_kv_heads" not in has:
        problems.append("fewer key-value heads than query heads (grouped-query attention)")
    if "sinks" in weights:
        problems.append("attention sinks (sinks)")
    if "W_g" in weights and "output_gate" not in has:
        problems.append("an output gate (W_g)")
    for key, value in (options or {}).items():
        if key == "sliding_window" and "sliding_window" in has:
            continue
        if key == "empty_rows":  # a row with no key takes the framework's own convention
            continue
        if value not in (None, False):
            problems.append(f"{key}={value!r}")
    if problems:
        raise ValueError(f"{target} has no equivalent of " + "; ".join(problems))


def layer_from_weights(
    weights: Mapping[str, np.ndarray],
    num_heads: int,
    *,
    backend: str | None = None,
    dropout: float = 0.0,
    scale: float | None = None,
    training: bool | None = None,
    **options: Any,
) -> Any:
    """An mha MultiHeadAttention in `backend` (default: the current one) holding `weights`.

    The config is read off the canonical weights: num_hiddens, out_features and the input
    sizes from the shapes, bias from the presence of b_q, out_bias from that of b_o,
    output_gate from that of W_g, sinks from that of sinks, num_kv_heads from W_k's columns
    (fewer than W_q's: grouped-query attention), dtype from W_q's dtype. `options` are the
    layer's untold options (mha.weights.UNTOLD_OPTIONS).

    Args:
        weights: canonical weights (W_q, W_k, W_v, W_o and optionally b_q, b_k, b_v, b_o,
            W_g, b_g and sinks).
        num_heads: the number of heads (weights cannot tell it).
        backend: an mha backend name; None is the current backend.
        dropout: the new layer's dropout rate.
        scale: the score scale (weights cannot tell it); None is 1 / sqrt(head size).
        training: the new layer's mode (`set_training`); None leaves its backend's default.
    """
    shapes = _projection_shapes(weights)
    check_untold_options(options)
    module = load_backend(backend if backend is not None else get_backend())
    num_hiddens, out_features = shapes["W_o"]
    bias, out_bias = "b_q" in weights, "b_o" in weights
    layer = module.MultiHeadAttention(
        num_hiddens,
        num_heads,
        dropout,
        bias,
        query_size=shapes["W_q"][0],
        key_size=shapes["W_k"][0],
        value_size=shapes["W_v"][0],
        out_bias=None if out_bias == bias else out_bias,
        out_features=None if out_features == num_hiddens else out_features,
        scale=scale,
        num_kv_heads=_num_kv_heads(num_hiddens, shapes["W_k"][1], num_heads),
        output_gate="W_g" in weights,
        sinks="sinks" in weights,
        dtype=validation.check_dtype(np.asarray(weights["W_q"]).dtype.name),
        **options,
    )
    set_weights(layer, {name: np.asarray(value) for name, value in weights.items()})
    return set_training(layer, training)


def training_of(layer: Any) -> bool | None:
    """Whether `layer` drops attention weights when called without a mode: torch modules and
    mha's NumPy layers say it by `training`, Flax NNX modules (mha's JAX layers among them) by
    their `deterministic`; Keras and Gluon take the mode at each call, and say None, as does a
    Flax module that leaves it to the call (deterministic None)."""
    if isinstance(getattr(layer, "training", None), bool):
        return layer.training
    nnx = sys.modules.get("flax.nnx")  # an NNX module means Flax was imported
    if nnx is None or not isinstance(layer, nnx.Module):
        return None
    modules = nnx.iter_modules(layer) if hasattr(nnx, "iter_modules") else layer.iter_modules()
    modes = {getattr(module, "deterministic", None) for _, module in modules} - {None}
    return None if len(modes) != 1 else not modes.pop()


def set_training(layer: Any, training: bool | None) -> Any:
    """`layer` (a torch module, an mha layer, a Flax NNX module) in training mode or not, as
    its framework sets it; unchanged where `training` is None or the layer keeps no mode."""
    if training is None or not hasattr(layer, "train") or not hasattr(layer, "eval"):
        return layer
    if training:
        layer.train()
    else:
        layer.eval()
    return layer


def _projection_shapes(weights: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """The shapes of the weights, after checking that the four projections are matrices."""
    missing = [name for name in ("W_q", "W_k", "W_v", "W_o") if name not in weights]
    if missing:
        raise ValueError(f"MultiHeadAttention weights need {', '.join(missing)}")
    shapes = {name: np.shape(value) for name, value in weights.items()}
    if any(len(shapes[name]) != 2 for name in ("W_q", "W_k", "W_v", "W_o")):
        described = ", ".join(f"{name} {shapes[name]}" for name in ("W_q", "W_k", "W_v", "W_o"))
        raise ValueError(f"MultiHeadAttention weights must be matrices. Received: {described}")
    return shapes


def _num_kv_heads(num_hiddens: int, kv_hiddens: int, num_heads: int) -> int | None:
    """The key-value heads that W_k's columns tell (None: as many as the query heads)."""
    if kv_hiddens == num_hiddens:
        return None
    head = num_hiddens // num_heads if num_hiddens % num_heads == 0 else 0
    num_kv_heads = kv_hiddens // head if head and kv_hiddens % head == 0 else None
    if num_kv_heads is None or num_heads % num_kv_heads:
        raise ValueError(
            f"W_k has {kv_hiddens} columns and W_q {num_hiddens}: with num_heads="
            f"{num_heads}, that is not a number of key-value heads dividing the query heads"
        )
    return num_kv_heads


# ---------------------------------------------------------------------------------------------
# Masks


class _KeepMasks(Masks):
    """mha.masks' rules on numpy arrays, for the masks a converter translates (valid_lens, a
    keep-mask, causal): the array operations are those of the numpy backend's masks."""

    def length_mask(self, valid_lens):
        # Shape of lengths: (batch_size, 1 or no. of queries, 1)
        lengths = valid_lens[:, None, None] if valid_lens.ndim == 1 else valid_lens[:, :, None]
        return np.arange(self.num_keys) < lengths

    def causal_mask(self):
        return np.tri(self.num_queries, self.num_keys, k=self.offset, dtype=bool)

    def expand_dims(self, x, axis):
        return np.expand_dims(x, axis)


def keep_mask(
    valid_lens: Any, mask: Any, causal: bool, num_queries: int, num_keys: int
) -> np.ndarray | None:
    """mha's masks combined into one keep-mask broadcastable to (B, num_heads, Q, K), True =
    attend, as a MultiHeadAttention call combines them; None when no mask is given.

    Lengths are checked as every layer checks them (non-negative whole numbers), with the
    layers' messages.
    """
    lengths = None
    if valid_lens is not None:
        lengths = as_numpy(valid_lens)
        if lengths.ndim not in (1, 2):
            raise ValueError(
                "valid_lens must have shape (batch_size,) or (batch_size, no. of queries). "
                f"Received: valid_lens of shape {lengths.shape}"
            )
        validation.check_valid_lens_values(lengths)
    given = None
    if mask is not None:
        given = as_numpy(mask)
        validation.check_mask_dtype(given)  # as the layers: an additive mask would invert
        if given.ndim > 4:
            raise ValueError(f"mask must have at most 4 axes. Received shape {given.shape}")
    batch_size = 1 if lengths is None else lengths.shape[0]
    rules = _KeepMasks(batch_size, num_queries, num_keys)
    keep, _ = rules.combine(lengths, given, causal, None, multihead=True)
    return keep
