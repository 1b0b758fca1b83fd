"""Flax's multi-head attention <-> mha's MultiHeadAttention: nnx.MultiHeadAttention, and the
parameters of Linen's MultiHeadDotProductAttention.

Layout: Keras's (see `mha.interop.keras`), nested: {"query": {"kernel": (query_size, h, p),
"bias": (h, p)}, "key": ..., "value": ..., "out": {"kernel": (h, p, n), "bias": (n,)}}, the
same in NNX and Linen.

Flax is imported inside the functions that need it: importing this module imports none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mha import validation
from mha.config import get_backend
from mha.interop.common import (
    as_numpy,
    check_expressible,
    keep_mask,
    layer_from_weights,
    multihead_config,
    refuse_overrides,
    set_training,
    training_of,
)
from mha.interop.keras import KERAS_PROJECTIONS, keras_weights
from mha.registry import load_backend

__all__ = [
    "FLAX_PROJECTIONS",
    "canonical_from_flax",
    "flax_params",
    "from_flax",
    "from_flax_masks",
    "to_flax",
    "to_flax_masks",
]

# Projection ("q", "k", "v", "o") -> its entry in Flax's parameters
FLAX_PROJECTIONS = {"q": "query", "k": "key", "v": "value", "o": "out"}


def flax_params(weights: Mapping[str, np.ndarray], num_heads: int) -> dict[str, dict]:
    """Canonical weights as the parameters of Flax's multi-head attention, the same in NNX's
    MultiHeadAttention and Linen's MultiHeadDotProductAttention (Keras's layout, nested).

    Returns:
        {"query": {"kernel": (query_size, num_heads, p), "bias": (num_heads, p)}, "key": ...,
        "value": ..., "out": {"kernel": (num_heads, p, num_hiddens), "bias": (num_hiddens,)}},
        p = num_hiddens / num_heads; biases only when the weights have them. Linen's
        `module.apply({"params": flax_params(...)}, ...)` takes it as it is.
    """
    # Flax's layer has no gate, which Keras's layout would carry
    check_expressible(weights, None, "Flax's multi-head attention", True, has=("num_kv_heads",))
    flat = keras_weights(weights, num_heads)
    params: dict[str, dict] = {}
    for k, keras_name in KERAS_PROJECTIONS.items():
        for variable in ("kernel", "bias"):
            if f"{keras_name}/{variable}" in flat:
                params.setdefault(FLAX_PROJECTIONS[k], {})[variable] = flat[
                    f"{keras_name}/{variable}"
                ]
    return params


def canonical_from_flax(
    source: Any,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Canonical weights and config (num_heads included) of Flax's multi-head attention.

    Args:
        source: a `flax.nnx.MultiHeadAttention`, or the parameters of one or of Linen's
            `MultiHeadDotProductAttention` (a nested dict, "params" at the top or not).

    Raises:
        ValueError: parameters that are not those of Flax's multi-head attention, or a layer
            with no mha equivalent (an output size other than num_heads * head size, a value
            head size other than the key's, normalize_qk, an attention_fn, dot_general or
            promote_dtype of its own, dropout with broadcast_dropout=True, Flax's default).
            A layer in decode mode ports: its weights are those of any other call; what its
            cache holds is not carried (mha's KVCache, filled by calling the layer on the
            positions so far, continues it).
    """
    kernels, biases = _kernels_and_biases(_flax_params_of(source))
    _refuse_flax_shapes(kernels, biases)
    num_heads, head_size = kernels["q"].shape[1:]
    num_hiddens = num_heads * head_size
    weights = {f"W_{k}": kernels[k].reshape(kernels[k].shape[0], -1) for k in "qkv"}
    out_features = kernels["o"].shape[-1]
    weights["W_o"] = kernels["o"].reshape(num_hiddens, out_features)
    for k in biases:
        weights[f"b_{k}"] = biases[k].reshape(-1)
    weights = {name: np.ascontiguousarray(value) for name, value in weights.items()}
    num_kv_heads = kernels["k"].shape[1]
    config = {
        "num_hiddens": num_hiddens,
        "num_heads": num_heads,
        "dropout": float(getattr(source, "dropout_rate", 0.0)),
        "bias": bool(biases),
        "query_size": weights["W_q"].shape[0],
        "key_size": weights["W_k"].shape[0],
        "value_size": weights["W_v"].shape[0],
        "dtype": validation.check_dtype(weights["W_o"].dtype.name),
        "out_features": None if out_features == num_hiddens else out_features,
        "num_kv_heads": None if num_kv_heads == num_heads else num_kv_heads,
    }
    return weights, config


def _kernels_and_biases(
    params: Any,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The kernels and biases of Flax parameters by projection ("q", "k", "v", "o"), as
    numpy arrays, after checking that the parameters are those of multi-head attention."""
    found = sorted(params, key=str) if isinstance(params, Mapping) else type(params).__name__
    if not isinstance(params, Mapping) or set(params) != set(FLAX_PROJECTIONS.values()):
        why = ""
        if isinstance(params, Mapping) and {"query_ln", "key_ln"} & set(params):
            why = "; query_ln and key_ln are normalize_qk=True's norms, which mha cannot express"
        raise ValueError(
            "Expected Flax multi-head attention parameters: query, key, value and out, each "
            f"with a kernel (and a bias). Found: {found}{why}"
        )
    kernels, biases = {}, {}
    for k, name in FLAX_PROJECTIONS.items():
        entry = params[name]
        if not isinstance(entry, Mapping) or not {"kernel"} <= set(entry) <= {"kernel", "bias"}:
            got = sorted(entry, key=str) if isinstance(entry, Mapping) else type(entry).__name__
            raise ValueError(f"Flax parameters {name!r} must hold kernel (and bias). Found: {got}")
        kernels[k] = as_numpy(entry["kernel"])
        if "bias" in entry:
            biases[k] = as_numpy(entry["bias"])
    return kernels, biases


def _refuse_flax_shapes(
    kernels: Mapping[str, np.ndarray], biases: Mapping[str, np.ndarray]
) -> None:
    """Raise ValueError where Flax's kernels and biases do not make mha's multi-head
    attention: each problem is listed."""
    if any(kernels[k].ndim != 3 for k in "qkvo"):
        shapes = ", ".join(f"{FLAX_PROJECTIONS[k]} {kernels[k].shape}" for k in "qkvo")
        raise ValueError(
            "Flax multi-head attention kernels are (in, heads, head size) and out (heads, head "
            f"size, out). Found: {shapes}"
        )
    problems = []
    num_heads, head_size = kernels["q"].shape[1:]
    # Keys and values may have fewer heads (num_kv_heads), dividing the query heads
    num_kv_heads = kernels["k"].shape[1]
    if (
        kernels["v"].shape[1:] != kernels["k"].shape[1:]
        or kernels["k"].shape[2] != head_size
        or num_heads % num_kv_heads
    ):
        problems.append(
            "query, key and value have heads or head sizes that do not fit together: "
            + ", ".join(f"{FLAX_PROJECTIONS[k]} {kernels[k].shape[1:]}" for k in "qkv")
        )
    if kernels["o"].shape[:2] != (num_heads, head_size):
        problems.append(
            f"out kernel {kernels['o'].shape}: expected (num_heads, head size, out) = "
            f"({num_heads}, {head_size}, out)"
        )
    if biases and set(biases) != set("qkvo"):
        problems.append(f"biases on {sorted(FLAX_PROJECTIONS[k] for k in biases)} only")
    problems += _bias_and_dtype_problems(kernels, biases)
    if problems:
        raise ValueError(
            "This Flax multi-head attention has no mha equivalent:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )


def _bias_and_dtype_problems(
    kernels: Mapping[str, np.ndarray], biases: Mapping[str, np.ndarray]
) -> list[str]:
    """Biases shaped as Flax's (heads, head size) and (out,), and one float dtype for all."""
    problems = []
    for k, bias in biases.items():
        expected = kernels[k].shape[2:] if k == "o" else kernels[k].shape[1:]
        if bias.shape != expected:
            problems.append(f"{FLAX_PROJECTIONS[k]} bias {bias.shape}: expected {expected}")
    dtypes = sorted({array.dtype.name for array in (*kernels.values(), *biases.values())})
    if len(dtypes) != 1 or dtypes[0] not in validation.FLOAT_DTYPES:
        problems.append(
            f"arrays of {', '.join(dtypes)}: expected one of {', '.join(validation.FLOAT_DTYPES)}"
        )
    return problems


def _flax_params_of(source: Any) -> Any:
    """The nested parameters of an nnx.MultiHeadAttention, or `source` itself (a dict)."""
    if isinstance(source, Mapping):
        return source["params"] if set(source) == {"params"} else source
    from flax import nnx

    if not isinstance(source, nnx.MultiHeadAttention):
        raise TypeError(
            "Expected a flax.nnx.MultiHeadAttention or a dict of its parameters. Received: "
            f"{type(source).__qualname__}"
        )
    refuse_overrides(source, nnx.MultiHeadAttention, ("__call__",))
    unsupported = []
    if source.normalize_qk:
        unsupported.append("normalize_qk=True (mha does not normalize queries and keys)")
    if source.broadcast_dropout and source.dropout_rate > 0:
        unsupported.append(
            f"broadcast_dropout=True with dropout_rate={source.dropout_rate} (one dropout mask "
            "for every example and head; mha draws one for each weight): set "
            "broadcast_dropout=False, or dropout_rate=0.0 for inference, before converting"
        )
    unsupported += _own_functions(source)
    if unsupported:
        raise ValueError(
            "This flax.nnx.MultiHeadAttention has no mha equivalent:\n"
            + "\n".join(f"  - {problem}" for problem in unsupported)
        )
    params = {}
    for name in FLAX_PROJECTIONS.values():
        dense = getattr(source, name)
        params[name] = {"kernel": dense.kernel[...]}
        if getattr(dense, "bias", None) is not None:
            params[name]["bias"] = dense.bias[...]
    return params


# The functions an nnx.MultiHeadAttention computes with, which its user may replace: mha's
# layer computes what Flax's defaults do, and nothing else
_FLAX_FUNCTIONS = (
    "attention_fn",
    "qkv_dot_general",
    "out_dot_general",
    "qkv_dot_general_cls",
    "out_dot_general_cls",
    "qkv_promote_dtype",
    "out_promote_dtype",
)


def _own_functions(source: Any) -> list[str]:
    """The functions of an nnx.MultiHeadAttention that are not Flax's defaults, described."""
    import inspect

    from flax import nnx

    defaults = inspect.signature(nnx.MultiHeadAttention.__init__).parameters
    return [
        f"{name}={getattr(getattr(source, name), '__name__', type(getattr(source, name)).__name__)}"
        " (mha computes what Flax's default does)"
        for name in _FLAX_FUNCTIONS
        if name in defaults
        and getattr(source, name, None) not in (defaults[name].default, _at_full_precision)
    ]


def _at_full_precision(*args: Any, **kwargs: Any) -> Any:
    """Flax's default attention_fn with its products at full float32 precision: its fast path
    (jax.nn.dot_product_attention) takes no precision of the module's."""
    import jax
    from flax import nnx

    with jax.default_matmul_precision("highest"):
        return nnx.dot_product_attention(*args, **kwargs)


def to_flax(layer: Any, *, rngs: Any = None) -> Any:
    """A `flax.nnx.MultiHeadAttention` computing what the mha `layer` does.

    Args:
        layer: an mha MultiHeadAttention of any backend, with its weights created.
        rngs: the new module's `nnx.Rngs` (its dropout stream); nnx.Rngs(0) when None.

    Returns:
        MultiHeadAttention(num_heads, in_features=query_size, qkv_features=num_hiddens,
        out_features (num_hiddens unless set), in_kv_features=key_size, use_bias=bias,
        dropout_rate, broadcast_dropout=False, dtype, precision) holding the layer's weights,
        in the layer's mode where its backend keeps one (`training_of`: torch's, NumPy's and
        JAX's layers; otherwise Flax's deterministic=None, which each call then gives), its
        products at mha's precision (full float32, or `jax_default_matmul_precision` where set
        when it is made; Flax's default is TF32 on a GPU). Flax takes `module(query, key,
        value, mask=...)` with mask True = attend (see `to_flax_masks`).

    Raises:
        ValueError: key_size differs from value_size (Flax has one size for both); fewer
            key-value heads where the installed Flax has no num_kv_heads.
    """
    import inspect

    from flax import nnx

    # Flax's num_kv_heads (grouped-query attention) came with Flax 0.12.1
    grouped = "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters
    has = ("num_kv_heads",) if grouped else ()
    config, weights = multihead_config(layer, "Flax's multi-head attention", True, has)
    kv = {"num_kv_heads": config["num_kv_heads"]} if config["num_kv_heads"] else {}
    if config["key_size"] != config["value_size"]:
        raise ValueError(
            "flax.nnx.MultiHeadAttention has one input size for keys and values "
            f"(in_kv_features). Received: key_size={config['key_size']}, "
            f"value_size={config['value_size']}"
        )
    dtype, precision = config["dtype"], load_backend("jax").matmul_precision()
    full = {} if precision is None else {"attention_fn": _at_full_precision}
    module = nnx.MultiHeadAttention(
        config["num_heads"],
        config["query_size"],
        qkv_features=config["num_hiddens"],
        out_features=config["out_features"] or config["num_hiddens"],
        in_kv_features=config["key_size"],
        dtype=dtype,
        param_dtype=dtype,
        dropout_rate=config["dropout"],
        broadcast_dropout=False,  # mha draws a dropout mask for each weight, not each row
        use_bias=config["bias"],
        decode=False,
        precision=precision,  # the mha layer's products'
        rngs=nnx.Rngs(0) if rngs is None else rngs,
        **kv,
        **full,
    )
    for name, variables in flax_params(weights, config["num_heads"]).items():
        dense = getattr(module, name)
        for variable, value in variables.items():
            getattr(dense, variable)[...] = load_backend("jax").from_numpy(value)
    return set_training(module, training_of(layer))


def from_flax(source: Any, *, backend: str | None = None) -> Any:
    """An mha MultiHeadAttention in `backend` (default: current) from Flax's multi-head
    attention: an `nnx.MultiHeadAttention`, or the parameters of one or of Linen's
    `MultiHeadDotProductAttention` (the number of heads is read from the kernels' shapes).
    An nnx module's mode (`deterministic`) goes to the layer where its backend keeps one.

    Raises:
        ValueError: see `canonical_from_flax`.
    """
    weights, config = canonical_from_flax(source)
    return layer_from_weights(
        weights,
        config["num_heads"],
        backend=backend,
        dropout=config["dropout"],
        training=training_of(source),
    )


def to_flax_masks(
    valid_lens: Any = None,
    mask: Any = None,
    causal: bool = False,
    *,
    num_queries: int,
    num_keys: int,
) -> dict[str, Any]:
    """Flax's `mask` argument equivalent to mha's masks: {"mask": a boolean numpy array
    (B or 1, num_heads or 1, Q, K), True = attend}, or {} when no mask is given.

    Flax gives a query with no key to attend the mean of the values, mha gives zeros: compare
    the two only on rows with a key.

    Raises:
        ValueError: valid_lens that are not non-negative whole numbers, with the layers'
            message; a mask of more than 4 axes.
    """
    keep = keep_mask(valid_lens, mask, causal, num_queries, num_keys)
    return {} if keep is None else {"mask": np.ascontiguousarray(keep)}


def from_flax_masks(mask: Any = None, *, backend: str | None = None) -> dict[str, Any]:
    """mha's mask argument equivalent to Flax's: {"mask": a boolean keep-mask of 4 axes, as
    the backend's tensor}, or {} when no mask is given.

    Flax reads a mask's last axes as [..., num_heads, Q, K]: one of 3 axes is (heads, Q, K),
    which mha's layers would read as (batch, Q, K); it gets its batch axis here. A float mask
    (`nnx.make_attention_mask`'s and `make_causal_mask`'s 0 and 1) attends where nonzero, as
    Flax's `where` reads it.

    Raises:
        ValueError: a mask of fewer than 2 or more than 4 axes.
    """
    if mask is None:
        return {}
    keep = as_numpy(mask).astype(bool)
    if not 2 <= keep.ndim <= 4:
        raise ValueError(
            "Flax's mask is (Q, K), (heads, Q, K) or (batch, heads, Q, K). "
            f"Received: a mask of shape {keep.shape}"
        )
    keep = keep.reshape((1,) * (4 - keep.ndim) + keep.shape)
    module = load_backend(backend if backend is not None else get_backend())
    return {"mask": module.from_numpy(np.ascontiguousarray(keep))}
