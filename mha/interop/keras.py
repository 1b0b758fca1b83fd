"""keras.layers.MultiHeadAttention and GroupQueryAttention <-> mha's MultiHeadAttention.

Layout (n = num_hiddens, h = num_heads, p = n / h): query/kernel (query_size, h, p) = W_q
reshaped, query/bias (h, p); likewise key and value; attention_output/kernel (h, p, n) = W_o
reshaped, its bias (n,). key_dim = value_dim = p, output_shape = n. GroupQueryAttention holds
the same kernels, its keys and values with num_kv_heads heads. A layer built with
use_gate=True also holds gate/kernel (query_size, h, p) = W_g reshaped and gate/bias (h, p):
sigmoid(query @ W_g + b_g) times the heads' output before W_o, mha's output_gate.

Keras (TensorFlow's tf.keras, Keras 3) is imported inside the functions that need it:
importing this module imports none.
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
    options_of,
    refuse_overrides,
)
from mha.registry import load_backend, load_triton_before_tensorflow

__all__ = [
    "KERAS_DENSE",
    "KERAS_GATE",
    "KERAS_PROJECTIONS",
    "canonical_from_keras",
    "from_keras",
    "from_keras_masks",
    "keras_dense",
    "keras_weights",
    "to_keras",
    "to_keras_masks",
]

# Projection ("q", "k", "v", "o") -> the name of its weights in Keras's variable paths
KERAS_PROJECTIONS = {"q": "query", "k": "key", "v": "value", "o": "attention_output"}
# Projection -> the name of its EinsumDense sub-layer, the Keras layer's attribute `_<name>`
KERAS_DENSE = {"q": "query_dense", "k": "key_dense", "v": "value_dense", "o": "output_dense"}
# use_gate's EinsumDense: "gate" in the variable paths, the attribute `_gate_dense` of both
# layers (and its name in both layers' files)
KERAS_GATE = "gate"
# The methods that compute a Keras layer's output (those a subclass may override)
_KERAS_COMPUTING = (
    "call",
    "_build_attention",
    "_compute_attention",
    "_compute_attention_mask",
    "_compute_causal_mask",
    "_compute_sliding_window_mask",
    "_masked_softmax",
)
# Subclasses whose call, without a cache, computes what MultiHeadAttention's does (no gate)
_KERAS_CACHED = frozenset(
    f"{package}.src.layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention"
    for package in ("keras_hub", "keras_nlp")
)


def keras_weights(weights: Mapping[str, np.ndarray], num_heads: int) -> dict[str, np.ndarray]:
    """Canonical weights in the layout of Keras's MultiHeadAttention and GroupQueryAttention
    EinsumDense sub-layers.

    Returns:
        {"query/kernel": (query_size, num_heads, p), "query/bias": (num_heads, p), "key/...",
        "value/...", "attention_output/kernel": (num_heads, p, num_hiddens),
        "attention_output/bias": (num_hiddens,)}, p = num_hiddens / num_heads; keys and
        values have num_kv_heads heads where W_k and W_v have fewer columns; "gate/kernel"
        and "gate/bias" (use_gate) where the weights have W_g and b_g; biases only when the
        weights have them. The names are Keras's variable paths below the layer.
    """
    check_expressible(
        weights, None, "keras.layers.MultiHeadAttention", True, has=("num_kv_heads", "output_gate")
    )
    num_hiddens, out_features = np.shape(weights["W_o"])
    if num_hiddens % num_heads:
        raise ValueError(
            "num_hiddens must be divisible by num_heads. "
            f"Received: num_hiddens={num_hiddens}, num_heads={num_heads}"
        )
    head_size = num_hiddens // num_heads
    result = {}
    names = {**KERAS_PROJECTIONS, "g": KERAS_GATE}
    for k in "qkvg" if "W_g" in weights else "qkv":
        name = names[k]
        W = np.asarray(weights[f"W_{k}"])
        result[f"{name}/kernel"] = W.reshape(W.shape[0], -1, head_size)
        if f"b_{k}" in weights:
            result[f"{name}/bias"] = np.asarray(weights[f"b_{k}"]).reshape(-1, head_size)
    result["attention_output/kernel"] = np.asarray(weights["W_o"]).reshape(
        num_heads, head_size, out_features
    )
    if "b_o" in weights:
        result["attention_output/bias"] = np.asarray(weights["b_o"])
    return {name: np.ascontiguousarray(value) for name, value in result.items()}


def keras_dense(layer: Any, k: str) -> Any:
    """The EinsumDense sub-layer of projection k ("q", "k", "v", "o", or "g", the gate) of a
    Keras layer (GroupQueryAttention has no public names for them; MultiHeadAttention's are
    these)."""
    return getattr(layer, f"_{KERAS_GATE}_dense" if k == "g" else f"_{KERAS_DENSE[k]}")


def _has_gate(layer: Any) -> bool:
    """Whether a Keras layer was built with use_gate=True: MultiHeadAttention keeps the flag
    as `_use_gate`, GroupQueryAttention as `use_gate` (older releases have neither)."""
    return bool(getattr(layer, "_use_gate", False) or getattr(layer, "use_gate", False))


def canonical_from_keras(layer: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Canonical weights and config (num_heads included) of a built Keras MultiHeadAttention
    or GroupQueryAttention (whose key-value heads become num_kv_heads); a sliding window
    becomes sliding_window.

    Raises:
        ValueError: the layer is not built, or its configuration has no mha equivalent
            (value_dim != key_dim, attention_axes other than the sequence axis, projections
            quantized by Keras), or its class overrides a method that computes the output
            (it may compute other numbers). A gate (use_gate=True) becomes W_g and b_g,
            which give the layer output_gate.
    """
    sizes = _keras_sizes(layer)
    num_heads, key_dim = sizes["num_heads"], sizes["key_dim"]
    _refuse_keras_subclass(layer, sizes["grouped"])
    projections = "qkvog" if _has_gate(layer) else "qkvo"
    _refuse_quantized(layer, projections)
    kernels = {k: as_numpy(keras_dense(layer, k).kernel) for k in projections}
    _refuse_keras_layer(layer, sizes, kernels)
    output = kernels["o"]
    num_hiddens, out_features = num_heads * key_dim, output.shape[2]
    # The gate, like the queries' projection, gives each head's features: mha's output_gate
    weights = {
        f"W_{k}": kernels[k].reshape(kernels[k].shape[0], -1) for k in projections if k != "o"
    }
    weights["W_o"] = output.reshape(num_hiddens, out_features)
    if layer.use_bias:
        for k in projections:
            weights[f"b_{k}"] = as_numpy(keras_dense(layer, k).bias).reshape(-1)
    weights = {name: np.ascontiguousarray(value) for name, value in weights.items()}
    config = {
        "num_hiddens": num_hiddens,
        "num_heads": num_heads,
        "dropout": float(layer.dropout),
        "bias": bool(layer.use_bias),
        "query_size": weights["W_q"].shape[0],
        "key_size": weights["W_k"].shape[0],
        "value_size": weights["W_v"].shape[0],
        "dtype": validation.check_dtype(weights["W_o"].dtype.name),
        "out_features": None if out_features == num_hiddens else out_features,
        "num_kv_heads": None if sizes["num_kv_heads"] == num_heads else sizes["num_kv_heads"],
        "sliding_window": sizes["sliding_window"],
        "output_gate": "W_g" in weights,
    }
    return weights, config


def _keras_sizes(layer: Any) -> dict[str, Any]:
    """The heads, head sizes and sliding window of a built Keras MultiHeadAttention or
    GroupQueryAttention ("grouped" tells which), by the names mha's converters use."""
    tf = _tensorflow()
    grouped = isinstance(layer, tf.keras.layers.GroupQueryAttention)
    if not grouped and not isinstance(layer, tf.keras.layers.MultiHeadAttention):
        raise TypeError(
            "Expected a keras.layers.MultiHeadAttention or GroupQueryAttention. "
            f"Received: {type(layer).__qualname__}"
        )
    if not layer.built:
        raise ValueError(
            f"The Keras {type(layer).__name__} is not built, so it has no weights yet: call it "
            "once or call layer.build(query_shape, value_shape, key_shape)"
        )
    if grouped:
        return {
            "grouped": True,
            "num_heads": layer.num_query_heads,
            "key_dim": layer.head_dim,
            "value_dim": layer.head_dim,
            "num_kv_heads": layer.num_key_value_heads,
            "sliding_window": layer.sliding_window,
        }
    return {
        "grouped": False,
        "num_heads": layer.num_heads,
        "key_dim": layer.key_dim,
        "value_dim": layer.value_dim if layer.value_dim is not None else layer.key_dim,
        "num_kv_heads": None,
        "sliding_window": getattr(layer, "_sliding_window", None),
    }


def _refuse_keras_subclass(layer: Any, grouped: bool) -> None:
    """Raise ValueError where a subclass's own methods may compute other numbers than
    Keras's layer (keras_hub's cached layer computes the same, but applies no gate)."""
    tf = _tensorflow()
    layers = tf.keras.layers
    base = layers.GroupQueryAttention if grouped else layers.MultiHeadAttention
    equivalent = frozenset() if _has_gate(layer) else _KERAS_CACHED
    refuse_overrides(layer, base, _KERAS_COMPUTING, equivalent)


def _refuse_quantized(layer: Any, projections: str) -> None:
    """Raise ValueError where Keras quantized the layer's projections (`Model.quantize`):
    they multiply by float8 or integer weights, not by the float kernels mha would read."""
    modes = {getattr(keras_dense(layer, k), "quantization_mode", None) for k in projections}
    modes.discard(None)
    if modes:
        raise ValueError(
            f"This keras.layers.{type(layer).__name__} is quantized (quantization_mode="
            f"{', '.join(map(repr, sorted(modes)))}): its projections compute with weights "
            "mha's layers do not hold. Convert the layer before quantizing it"
        )


def _refuse_keras_layer(
    layer: Any, sizes: Mapping[str, Any], kernels: Mapping[str, np.ndarray]
) -> None:
    """Raise ValueError listing what a Keras layer has that mha's MultiHeadAttention has not."""
    problems = []
    value_dim, key_dim = sizes["value_dim"], sizes["key_dim"]
    if value_dim != key_dim:
        problems.append(
            f"value_dim={value_dim} differs from key_dim={key_dim}; mha's heads have one size"
        )
    # The kernels are the same for inputs of any rank; the query projection's equation
    # ("abc,cde->abde" for (B, n, d)) tells the rank the layer was built for
    rank = len(keras_dense(layer, "q").equation.split(",")[0])
    if rank != 3:
        problems.append(f"it was built for inputs of rank {rank}; mha takes (B, n, d)")
    if not sizes["grouped"] and tuple(layer.attention_axes or (1,)) not in ((1,), (-2,)):
        problems.append(f"attention_axes={layer.attention_axes}; mha attends over axis 1")
    if kernels["o"].ndim != 3:
        problems.append(f"its output has the shape {kernels['o'].shape[2:]}; mha's has one axis")
    if problems:
        raise ValueError(
            f"This keras.layers.{type(layer).__name__} has no mha equivalent:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )


def to_keras(layer: Any) -> Any:
    """A built Keras layer computing what the mha `layer` does: a
    `keras.layers.MultiHeadAttention`, or a `GroupQueryAttention` when the layer has fewer
    key-value heads (num_kv_heads < num_heads).

    Args:
        layer: an mha MultiHeadAttention of any backend, with its weights created.

    Returns:
        MultiHeadAttention(num_heads, key_dim=value_dim=num_hiddens / num_heads,
        dropout, use_bias=bias, output_shape=out_features (num_hiddens unless set),
        sliding_window, dtype), or
        GroupQueryAttention(head_dim, num_heads, num_kv_heads, dropout, use_bias,
        sliding_window, dtype), built for the layer's input sizes. Keras takes
        `layer(query, value, key)` (value before key!) and gives per-head weights with
        `return_attention_scores=True`.

    An output gate (output_gate, W_g) becomes Keras's use_gate=True, in a Keras that has it.

    Raises:
        ValueError: what Keras's layers cannot hold (rotary embeddings, a score scale; for
            GroupQueryAttention an output size other than the query size, which it fixes).
    """
    has = ("num_kv_heads", "sliding_window") + (("output_gate",) if _keras_has_gate() else ())
    config, weights = multihead_config(layer, "keras.layers.MultiHeadAttention", True, has=has)
    builtin = _new_keras_layer(config, gate="W_g" in weights)
    builtin.build(
        (None, None, config["query_size"]),
        (None, None, config["value_size"]),
        (None, None, config["key_size"]),
    )
    names = {**KERAS_PROJECTIONS, "g": KERAS_GATE}
    for path, value in keras_weights(weights, config["num_heads"]).items():
        name, variable = path.split("/")
        k = next(k for k, projection in names.items() if projection == name)
        getattr(keras_dense(builtin, k), variable).assign(value)
    return builtin


def _keras_has_gate() -> bool:
    """Whether this Keras's attention layers take use_gate (older releases have no gate)."""
    import inspect

    tf = _tensorflow()
    return "use_gate" in inspect.signature(tf.keras.layers.MultiHeadAttention).parameters


def _new_keras_layer(config: Mapping[str, Any], gate: bool = False) -> Any:
    """An unbuilt Keras MultiHeadAttention, or GroupQueryAttention for fewer key-value heads,
    of an mha MultiHeadAttention's config; with use_gate=True where `gate`."""
    tf = _tensorflow()
    num_hiddens, num_heads = config["num_hiddens"], config["num_heads"]
    head_size = num_hiddens // num_heads
    out_features = config["out_features"] or num_hiddens
    num_kv_heads = config["num_kv_heads"] or num_heads
    gated = {"use_gate": True} if gate else {}
    if num_kv_heads == num_heads:
        return tf.keras.layers.MultiHeadAttention(
            num_heads,
            head_size,
            value_dim=head_size,
            dropout=config["dropout"],
            use_bias=config["bias"],
            output_shape=out_features,
            sliding_window=config["sliding_window"],
            dtype=config["dtype"],
            **gated,
        )
    if out_features != config["query_size"]:
        raise ValueError(
            "keras.layers.GroupQueryAttention's output has the query's size "
            f"({config['query_size']}); this layer's is {out_features}"
        )
    return tf.keras.layers.GroupQueryAttention(
        head_size,
        num_heads,
        num_kv_heads,
        dropout=config["dropout"],
        use_bias=config["bias"],
        sliding_window=config["sliding_window"],
        dtype=config["dtype"],
        **gated,
    )


def from_keras(layer: Any, *, backend: str | None = None) -> Any:
    """An mha MultiHeadAttention in `backend` (default: current) from a built Keras
    MultiHeadAttention or GroupQueryAttention. Keras's layer keeps no mode (its call runs in
    inference unless told), so the new layer starts in its framework's default (a torch or
    JAX layer in training): with a dropout rate above 0, set the mode before comparing.

    Raises:
        ValueError: see `canonical_from_keras`.
    """
    weights, config = canonical_from_keras(layer)
    return layer_from_weights(
        weights,
        config["num_heads"],
        backend=backend,
        dropout=config["dropout"],
        **options_of(config),
    )


def _tensorflow() -> Any:
    """TensorFlow, imported after torch's triton where that is installed (see
    mha.registry.load_triton_before_tensorflow)."""
    load_triton_before_tensorflow()
    import tensorflow as tf

    return tf


def to_keras_masks(
    valid_lens: Any = None,
    mask: Any = None,
    causal: bool = False,
    *,
    num_queries: int,
    num_keys: int,
) -> dict[str, Any]:
    """Keras MultiHeadAttention's mask arguments equivalent to mha's.

    Returns:
        A dict for `layer(query, value, key, **masks)`: `attention_mask`, a boolean numpy
        array (B or 1, Q, K) with True = attend (mha's convention), or (B or 1, heads, Q, K)
        for a mask that differs between heads (Keras's layers apply a 4-D one to each head),
        when valid_lens or mask is given, and `use_causal_mask`.

    Raises:
        ValueError: valid_lens that are not non-negative whole numbers, with the layers'
            message.
    """
    keep = keep_mask(valid_lens, mask, False, num_queries, num_keys)
    result: dict[str, Any] = {"use_causal_mask": bool(causal)}
    if keep is not None:
        # Shape of keep: (B or 1, 1 or heads, Q, K); one head's alone is (B or 1, Q, K)
        whole = np.broadcast_to(keep, (*keep.shape[:2], num_queries, num_keys))
        result["attention_mask"] = np.ascontiguousarray(
            whole[:, 0] if keep.shape[1] == 1 else whole
        )
    return result


def _refuse_heads_beside_input_masks(parts, query_mask, value_mask, key_mask) -> None:
    """Keras joins its (B, Q, K) mask of the inputs to a (B, heads, Q, K) attention_mask by
    broadcasting, the batch axis against the heads': unless B is 1, no join of mha's gives
    its numbers."""
    named = {"query_mask": query_mask, "value_mask": value_mask, "key_mask": key_mask}
    given = [name for name, mask in named.items() if mask is not None and len(as_numpy(mask)) != 1]
    if parts and parts[0].ndim == 4 and given:
        raise ValueError(
            f"a (B, heads, Q, K) attention_mask beside {' and '.join(given)} has no one "
            "meaning: Keras's layer joins the masks of its inputs, (B, Q, K), to it by "
            "broadcasting, the batch axis against the heads' (an error, or with as many "
            "examples as heads, example h's padding on head h of every example). Join them "
            "into the attention_mask, each example's, and give it alone. "
            f"Received: attention_mask of shape {parts[0].shape}"
        )


def from_keras_masks(
    attention_mask: Any = None,
    use_causal_mask: bool = False,
    *,
    query_mask: Any = None,
    value_mask: Any = None,
    key_mask: Any = None,
    backend: str | None = None,
) -> dict[str, Any]:
    """mha's mask arguments equivalent to Keras MultiHeadAttention's.

    Keras also applies the masks its inputs carry (an `Embedding(mask_zero=True)`'s, read
    with `keras.ops.get_keras_mask`) and its query_mask, value_mask and key_mask: give them
    here, as Keras joins them with attention_mask, or they are left out. Keras 3's
    MultiHeadAttention drops a query_mask argument for the mask its query carries. Beside a
    (B, heads, Q, K) attention_mask they are refused unless of one example: Keras
    broadcasts their batch axis against its heads.

    Args:
        attention_mask: (B, Q, K), or (B, heads, Q, K), True (or nonzero) = attend.
        use_causal_mask: Keras's causal flag (top-left aligned, as mha's `causal`).
        query_mask: (B, Q), the queries that attend (a query left out attends to no key).
        value_mask, key_mask: (B, K), the keys attended to.
        backend: the mha backend whose tensors to return (default: current).

    Returns:
        {"mask": keep-mask (B, Q, K) or (B, heads, Q, K) as the backend's tensor, "causal": bool}.
    """
    result: dict[str, Any] = {"causal": bool(use_causal_mask)}
    # Keras casts each: nonzero attends; a query's mask is (B, Q, 1), a key's (B, 1, K)
    parts = [as_numpy(attention_mask).astype(bool)] if attention_mask is not None else []
    _refuse_heads_beside_input_masks(parts, query_mask, value_mask, key_mask)
    if query_mask is not None:
        parts.append(as_numpy(query_mask).astype(bool)[:, :, None])
    parts += [as_numpy(m).astype(bool)[:, None, :] for m in (value_mask, key_mask) if m is not None]
    if parts:
        keep = parts[0]
        for part in parts[1:]:
            keep = keep & part
        module = load_backend(backend if backend is not None else get_backend())
        result["mask"] = module.from_numpy(np.ascontiguousarray(keep))
    return result
