"""Interoperability with the frameworks' own attention layers.

mha is the bridge between `torch.nn.MultiheadAttention` and `keras.layers.MultiHeadAttention`:
both hold the same computation as mha's `MultiHeadAttention` (project, split into contiguous
heads, scaled dot-product attention per head, concatenate, project), in other layouts. This
module converts the canonical weights (`W_q (query_size, num_hiddens)` ... `b_o`, see
`mha.weights`) to and from those layouts, builds one layer from another, and translates the
masks, so that the same inputs give the same outputs and attention weights.

    >>> import torch, mha
    >>> builtin = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    >>> layer = mha.interop.from_torch(builtin, backend="numpy")   # any mha backend
    >>> keras_layer = mha.interop.to_keras(layer)                   # keras MultiHeadAttention

Layouts (n = num_hiddens = embed_dim, h = num_heads, p = n / h):

    torch    in_proj_weight (3n, n) = [W_q.T; W_k.T; W_v.T] when kdim = vdim = embed_dim,
             else q_proj_weight (n, n), k_proj_weight (n, kdim), v_proj_weight (n, vdim);
             in_proj_bias (3n,) = [b_q; b_k; b_v]; out_proj.weight (n, n) = W_o.T,
             out_proj.bias = b_o. Torch computes x @ weight.T + bias, hence the transposes.
    keras    query/kernel (query_size, h, p) = W_q reshaped, query/bias (h, p); likewise key
             and value; attention_output/kernel (h, p, n) = W_o reshaped, its bias (n,).
             key_dim = value_dim = p, output_shape = n.

The reshapes are exact because mha's head i is the contiguous block of columns i*p .. (i+1)*p-1,
the same split torch makes and the per-head kernels of Keras hold. Both frameworks scale the
scores by 1/sqrt(p), as mha does.

What the built-in layers cannot express raises ValueError before anything is built:
- torch: the query size must equal embed_dim (mha's query_size = num_hiddens); `add_bias_kv`
  and `add_zero_attn` have no mha equivalent.
- keras: mha has one head size, so a Keras layer converts when value_dim = key_dim, with
  attention over axis 1 of rank-3 inputs, one output axis (output_shape other than
  num_heads * key_dim becomes out_features) and no sliding window.
- mha's options the built-in layers do not have (a score scale, an output bias apart from the
  others, and for torch another output size) are a ValueError naming them.

Masks (the mask helpers return keyword arguments ready for the target call):
- torch's boolean masks mean the opposite of mha's: True = NOT allowed. `to_torch_masks` turns
  valid_lens of shape (B,) into `key_padding_mask` (B, K) and everything else (valid_lens
  (B, Q), a keep-mask, causal) into `attn_mask` (Q, K) or (B * num_heads, Q, K), inverted.
- Keras's `attention_mask` (B, Q, K) means True = attend, as mha's mask does; `causal` becomes
  `use_causal_mask` (top-left aligned in both). Keras has no per-head mask.

Rows with no allowed key: mha gives all-zero weights and an all-zero attention output (the
layer output is b_o), or uniform weights with empty_rows="uniform". torch's layer gives NaN
with weights and zeros without; Keras 3 gives zero weights with return_attention_scores=True
and uniform ones on its default path (docs/porting.md has the table).

Frameworks are imported inside the functions that need them: importing this module imports
none.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha import options, validation
from mha.registry import BackendUnavailableError, load_backend
from mha.weights import (
    UNTOLD_OPTIONS,
    _layer_info,
    check_untold_options,
    get_weights,
    set_weights,
)

__all__ = [
    "FILE_KINDS",
    "canonical_from_flax",
    "canonical_from_keras",
    "canonical_from_torch",
    "convert",
    "file_kind",
    "flax_params",
    "from_flax",
    "from_keras",
    "from_keras_masks",
    "from_torch",
    "from_torch_masks",
    "keras_weights",
    "layer_from_weights",
    "read_file",
    "to_flax",
    "to_flax_masks",
    "to_keras",
    "to_keras_masks",
    "to_torch",
    "to_torch_masks",
    "torch_state_dict",
    "write_file",
]

_TORCH_WEIGHT_NAMES = (
    "in_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "in_proj_bias",
    "out_proj.weight",
    "out_proj.bias",
)
_KERAS_PROJECTIONS = {"q": "query", "k": "key", "v": "value", "o": "attention_output"}


def _as_numpy(x: Any) -> np.ndarray:
    """A numpy copy of a numpy, torch, TensorFlow or MXNet array (bfloat16 as ml_dtypes')."""
    if hasattr(x, "asnumpy"):  # MXNet
        return x.asnumpy()
    if hasattr(x, "detach"):  # torch
        return load_backend("torch").to_numpy(x).copy()
    if hasattr(x, "numpy"):  # TensorFlow tensors and Keras variables
        return np.array(x.numpy())
    return np.array(x)


def _multihead_config(
    layer: Any, target: str, other_sizes: bool = False, has: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The config and weights of an mha MultiHeadAttention that `target` can hold; `has`
    names the options of mha's that target has too ("num_kv_heads", "sliding_window")."""
    _, class_name, config = _layer_info(layer)
    if class_name != "MultiHeadAttention":
        raise TypeError(
            f"Expected an mha MultiHeadAttention. Received: an mha {class_name}; only "
            "multi-head attention has a built-in counterpart in torch and Keras"
        )
    weights = get_weights(layer)
    _plain(weights, config["scale"], target, other_sizes, _options_of(config), has)
    return config, weights


def _options_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a MultiHeadAttention config that are set (not their defaults)."""
    return {key: config[key] for key in UNTOLD_OPTIONS if config.get(key) not in (None, False)}


def layer_from_weights(
    weights: Mapping[str, np.ndarray],
    num_heads: int,
    *,
    backend: str | None = None,
    dropout: float = 0.0,
    scale: float | None = None,
    **options: Any,
) -> Any:
    """An mha MultiHeadAttention in `backend` (default: the current one) holding `weights`.

    The config is read off the canonical weights: num_hiddens, out_features and the input
    sizes from the shapes, bias from the presence of b_q, out_bias from that of b_o,
    num_kv_heads from W_k's columns (fewer than W_q's: grouped-query attention), dtype from
    W_q's dtype. `options` are the layer's rope_theta, rope_interleaved and sliding_window.

    Args:
        weights: canonical weights (W_q, W_k, W_v, W_o and optionally b_q, b_k, b_v, b_o).
        num_heads: the number of heads (weights cannot tell it).
        backend: an mha backend name; None is the current backend.
        dropout: the new layer's dropout rate.
        scale: the score scale (weights cannot tell it); None is 1 / sqrt(head size).
    """
    from mha.config import get_backend

    missing = [name for name in ("W_q", "W_k", "W_v", "W_o") if name not in weights]
    if missing:
        raise ValueError(f"MultiHeadAttention weights need {', '.join(missing)}")
    shapes = {name: np.shape(value) for name, value in weights.items()}
    if any(len(shapes[name]) != 2 for name in ("W_q", "W_k", "W_v", "W_o")):
        described = ", ".join(f"{name} {shapes[name]}" for name in ("W_q", "W_k", "W_v", "W_o"))
        raise ValueError(f"MultiHeadAttention weights must be matrices. Received: {described}")
    check_untold_options(options)
    module = load_backend(backend if backend is not None else get_backend())
    num_hiddens, out_features = shapes["W_o"]
    bias, out_bias = "b_q" in weights, "b_o" in weights
    kv_hiddens = shapes["W_k"][1]
    num_kv_heads = None
    if kv_hiddens != num_hiddens:
        head = num_hiddens // num_heads if num_hiddens % num_heads == 0 else 0
        num_kv_heads = kv_hiddens // head if head and kv_hiddens % head == 0 else None
        if num_kv_heads is None or num_heads % num_kv_heads:
            raise ValueError(
                f"W_k has {kv_hiddens} columns and W_q {num_hiddens}: with num_heads="
                f"{num_heads}, that is not a number of key-value heads dividing the query heads"
            )
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
        num_kv_heads=num_kv_heads,
        dtype=validation.check_dtype(np.asarray(weights["W_q"]).dtype.name),
        **options,
    )
    set_weights(layer, {name: np.asarray(value) for name, value in weights.items()})
    return layer


def _plain(
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
    embeddings, and unless `has` names them, fewer key-value heads and a sliding window."""
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
    for key, value in (options or {}).items():
        if key == "sliding_window" and "sliding_window" in has:
            continue
        if value not in (None, False):
            problems.append(f"{key}={value!r}")
    if problems:
        raise ValueError(f"{target} has no equivalent of " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention


def torch_state_dict(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The `torch.nn.MultiheadAttention` state_dict of canonical weights, as numpy arrays.

    Packed `in_proj_weight` (3n, n) when every input size equals num_hiddens (torch packs
    exactly then), else `q_proj_weight`, `k_proj_weight`, `v_proj_weight`.

    Raises:
        ValueError: the query size differs from num_hiddens (torch's query size is embed_dim).
    """
    _plain(weights, None, "torch.nn.MultiheadAttention")
    W_q, W_k, W_v, W_o = (np.asarray(weights[name]) for name in ("W_q", "W_k", "W_v", "W_o"))
    num_hiddens = W_o.shape[0]
    if W_q.shape[0] != num_hiddens:
        raise ValueError(
            "torch.nn.MultiheadAttention requires the query size to equal embed_dim "
            "(mha's num_hiddens): it has no query projection from another size. "
            f"Received: query_size={W_q.shape[0]}, num_hiddens={num_hiddens}"
        )
    state = {}
    if W_k.shape[0] == num_hiddens and W_v.shape[0] == num_hiddens:
        state["in_proj_weight"] = np.concatenate([W_q.T, W_k.T, W_v.T])
    else:
        state.update(q_proj_weight=W_q.T, k_proj_weight=W_k.T, v_proj_weight=W_v.T)
    if "b_q" in weights:
        state["in_proj_bias"] = np.concatenate([weights["b_q"], weights["b_k"], weights["b_v"]])
    state["out_proj.weight"] = W_o.T
    if "b_o" in weights:
        state["out_proj.bias"] = np.asarray(weights["b_o"])
    return {name: np.ascontiguousarray(value) for name, value in state.items()}


def canonical_from_torch(state_dict: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
    """Canonical weights and the config they imply, from a MultiheadAttention state_dict.

    Returns:
        (weights, config) with config holding num_hiddens, bias, query_size, key_size,
        value_size and dtype; num_heads is not in the weights and must come from elsewhere.

    Raises:
        ValueError: names or shapes that are not a MultiheadAttention's, or `bias_k`/`bias_v`
            (add_bias_kv), which mha cannot express. Every problem is listed.
    """
    arrays = {name: _as_numpy(value) for name, value in state_dict.items()}
    problems = []
    if "bias_k" in arrays or "bias_v" in arrays:
        problems.append("bias_k/bias_v (add_bias_kv=True) have no mha equivalent")
    unexpected = sorted(set(arrays) - set(_TORCH_WEIGHT_NAMES) - {"bias_k", "bias_v"})
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected)}")
    packed = "in_proj_weight" in arrays
    needed = ["out_proj.weight"] + (
        ["in_proj_weight"] if packed else ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    )
    missing = [name for name in needed if name not in arrays]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if problems:
        raise ValueError(
            "Not a torch.nn.MultiheadAttention state_dict that mha can convert:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )
    out = arrays["out_proj.weight"]
    if out.ndim != 2 or out.shape[0] != out.shape[1]:
        raise ValueError(f"out_proj.weight must be square (n, n). Received shape {out.shape}")
    n = out.shape[0]
    expected = {"out_proj.weight": (n, n), "in_proj_bias": (3 * n,), "out_proj.bias": (n,)}
    if packed:
        expected["in_proj_weight"] = (3 * n, n)
    else:
        expected["q_proj_weight"] = (n, n)
        for name in ("k_proj_weight", "v_proj_weight"):
            shape = arrays[name].shape
            expected[name] = (n, shape[1] if len(shape) == 2 else -1)
    for name, shape in expected.items():
        if name in arrays and arrays[name].shape != shape:
            problems.append(f"{name} has shape {arrays[name].shape}; expected {shape}")
    if ("in_proj_bias" in arrays) != ("out_proj.bias" in arrays):
        problems.append("in_proj_bias and out_proj.bias must be both present or both absent")
    dtypes = {value.dtype.name for value in arrays.values()}
    if len(dtypes) > 1:
        problems.append(f"the tensors have different dtypes: {', '.join(sorted(dtypes))}")
    if problems:
        raise ValueError(
            "Not a torch.nn.MultiheadAttention state_dict that mha can convert:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )
    if packed:
        W_q, W_k, W_v = np.split(arrays["in_proj_weight"], 3)
    else:
        W_q, W_k, W_v = (arrays[f"{k}_proj_weight"] for k in "qkv")
    weights = {"W_q": W_q.T, "W_k": W_k.T, "W_v": W_v.T, "W_o": out.T}
    bias = "in_proj_bias" in arrays
    if bias:
        b_q, b_k, b_v = np.split(arrays["in_proj_bias"], 3)
        weights.update(b_q=b_q, b_k=b_k, b_v=b_v, b_o=arrays["out_proj.bias"])
    weights = {name: np.ascontiguousarray(value) for name, value in weights.items()}
    config = {
        "num_hiddens": n,
        "bias": bias,
        "query_size": n,
        "key_size": W_k.shape[1],
        "value_size": W_v.shape[1],
        "dtype": validation.check_dtype(out.dtype.name),
    }
    return weights, config


def to_torch(layer: Any, *, batch_first: bool = True) -> Any:
    """A `torch.nn.MultiheadAttention` computing what the mha MultiHeadAttention `layer` does.

    Args:
        layer: an mha MultiHeadAttention of any backend, with its weights created.
        batch_first: the new module's input layout; True matches mha's (B, Q, d) shapes.

    Returns:
        nn.MultiheadAttention(embed_dim=num_hiddens, num_heads, dropout, bias, kdim=key_size,
        vdim=value_size, dtype=the layer's dtype), in training mode as every new module
        (call `.eval()` before comparing when dropout > 0). Call it with
        `need_weights=True, average_attn_weights=False` for per-head weights.

    Raises:
        ValueError: query_size differs from num_hiddens, which torch cannot express.
    """
    import torch

    config, weights = _multihead_config(layer, "torch.nn.MultiheadAttention")
    state = torch_state_dict(weights)  # raises for query_size != num_hiddens
    module = torch.nn.MultiheadAttention(
        config["num_hiddens"],
        config["num_heads"],
        dropout=config["dropout"],
        bias=config["bias"],
        kdim=config["key_size"],
        vdim=config["value_size"],
        batch_first=batch_first,
        dtype=getattr(torch, config["dtype"]),
    )
    from_numpy = load_backend("torch").from_numpy
    module.load_state_dict({name: from_numpy(value) for name, value in state.items()})
    return module


def from_torch(module: Any, *, backend: str | None = None) -> Any:
    """An mha MultiHeadAttention in `backend` (default: current) from a torch MultiheadAttention.

    The config is num_hiddens = query_size = embed_dim, key_size = kdim, value_size = vdim,
    num_heads, dropout, bias (torch's `bias` covers the four projections, as mha's does) and
    the dtype of the module's weights. `batch_first` only concerns torch's inputs.

    Raises:
        ValueError: the module uses add_bias_kv or add_zero_attn, which mha cannot express.
    """
    import torch

    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(
            f"Expected a torch.nn.MultiheadAttention. Received: {type(module).__qualname__}"
        )
    if module.add_zero_attn:
        raise ValueError(
            "torch.nn.MultiheadAttention with add_zero_attn=True has no mha equivalent"
        )
    weights, _ = canonical_from_torch(module.state_dict())
    return layer_from_weights(
        weights, module.num_heads, backend=backend, dropout=float(module.dropout)
    )


def _keep_mask(
    valid_lens: Any, mask: Any, causal: bool, num_queries: int, num_keys: int
) -> np.ndarray | None:
    """mha's masks combined into one keep-mask broadcastable to (B, num_heads, Q, K)."""
    keep = None

    def combine(current, new):
        return new if current is None else current & new

    if valid_lens is not None:
        lengths = _as_numpy(valid_lens)
        if lengths.ndim not in (1, 2):
            raise ValueError(
                "valid_lens must have shape (batch_size,) or (batch_size, no. of queries). "
                f"Received: valid_lens of shape {lengths.shape}"
            )
        if lengths.size and lengths.min() < 0:
            raise ValueError(f"valid_lens must not be negative. Received: {lengths.min()}")
        keys = np.arange(num_keys)
        if lengths.ndim == 1:
            keep = keys[None, None, None, :] < lengths[:, None, None, None]
        else:
            keep = keys[None, None, None, :] < lengths[:, None, :, None]
    if mask is not None:
        given = _as_numpy(mask).astype(bool)
        if given.ndim > 4:
            raise ValueError(f"mask must have at most 4 axes. Received shape {given.shape}")
        while given.ndim < 3:
            given = given[None]
        if given.ndim == 3:  # (B, Q, K) applies to every head
            given = given[:, None]
        keep = combine(keep, given)
    if causal:
        tril = np.arange(num_keys)[None, :] <= np.arange(num_queries)[:, None]
        keep = combine(keep, tril[None, None])
    return keep


def to_torch_masks(
    valid_lens: Any = None,
    mask: Any = None,
    causal: bool = False,
    *,
    num_heads: int,
    num_queries: int,
    num_keys: int,
) -> dict[str, Any]:
    """torch MultiheadAttention's mask arguments equivalent to mha's.

    Args:
        valid_lens, mask, causal: as mha's MultiHeadAttention call (numpy or framework arrays).
        num_heads, num_queries, num_keys: the sizes of the call.

    Returns:
        A dict for `module(query, key, value, **masks)`: `key_padding_mask` (B, K) for
        valid_lens of shape (B,), and `attn_mask` (Q, K) or (B * num_heads, Q, K) for the
        rest, both boolean torch tensors where True means NOT allowed (torch's convention, the
        inverse of mha's). Empty when no mask is given.
    """
    import torch

    result = {}
    lengths = None if valid_lens is None else _as_numpy(valid_lens)
    if lengths is not None and lengths.ndim == 1:
        padding = _keep_mask(lengths, None, False, num_queries, num_keys)
        result["key_padding_mask"] = torch.from_numpy(~padding[:, 0, 0, :])
        lengths = None
    keep = _keep_mask(lengths, mask, causal, num_queries, num_keys)
    if keep is not None:
        batch_size, heads = keep.shape[0], keep.shape[1]
        if heads not in (1, num_heads):
            raise ValueError(
                f"mask has {heads} heads on axis 1; expected 1 or num_heads={num_heads}"
            )
        if batch_size == 1 and heads == 1:
            attn_mask = keep[0, 0]
        else:
            full = np.broadcast_to(keep, (batch_size, num_heads, num_queries, num_keys))
            attn_mask = full.reshape(batch_size * num_heads, num_queries, num_keys)
        result["attn_mask"] = torch.from_numpy(np.ascontiguousarray(~attn_mask))
    return result


def from_torch_masks(
    key_padding_mask: Any = None,
    attn_mask: Any = None,
    *,
    num_heads: int,
    is_causal: bool = False,
    backend: str | None = None,
) -> dict[str, Any]:
    """mha's mask arguments equivalent to torch MultiheadAttention's.

    Args:
        key_padding_mask: (B, K), True (or nonzero) = ignore that key.
        attn_mask: (Q, K) or (B * num_heads, Q, K); boolean with True = not allowed, or a
            float mask holding only 0 (allowed) and -inf (not allowed), as
            `nn.Transformer.generate_square_subsequent_mask` makes.
        num_heads: the module's number of heads.
        is_causal: torch's causal flag.
        backend: the mha backend whose tensors to return (default: current).

    Returns:
        A dict for an mha call: `mask` (a keep-mask broadcastable to (B, num_heads, Q, K))
        when a mask is given, and `causal`.

    Raises:
        ValueError: a float attn_mask with other values (an additive bias mha cannot take).
    """
    from mha.config import get_backend

    keep = None
    if key_padding_mask is not None:
        padding = _as_numpy(key_padding_mask)
        if padding.ndim != 2:
            raise ValueError(
                f"key_padding_mask must have shape (B, K). Received shape {padding.shape}"
            )
        if padding.dtype.kind == "f":
            padding = _float_mask_to_bool(padding, "key_padding_mask")
        keep = ~padding.astype(bool)[:, None, None, :]
    if attn_mask is not None:
        forbidden = _as_numpy(attn_mask)
        if forbidden.dtype.kind == "f":
            forbidden = _float_mask_to_bool(forbidden, "attn_mask")
        forbidden = forbidden.astype(bool)
        if forbidden.ndim == 2:
            allowed = ~forbidden[None, None]
        elif forbidden.ndim == 3 and forbidden.shape[0] % num_heads == 0:
            allowed = ~forbidden.reshape(-1, num_heads, *forbidden.shape[1:])
        else:
            raise ValueError(
                "attn_mask must have shape (Q, K) or (B * num_heads, Q, K). "
                f"Received shape {forbidden.shape} with num_heads={num_heads}"
            )
        keep = allowed if keep is None else keep & allowed
    result: dict[str, Any] = {"causal": bool(is_causal)}
    if keep is not None:
        module = load_backend(backend if backend is not None else get_backend())
        result["mask"] = module.from_numpy(keep)
    return result


def _float_mask_to_bool(values: np.ndarray, name: str) -> np.ndarray:
    """A float torch mask of 0 and -inf as torch's boolean form (True = not allowed)."""
    forbidden = np.isneginf(values)
    if not np.all(forbidden | (values == 0)):
        raise ValueError(
            f"a float {name} converts only when it holds 0 (allowed) and -inf (not allowed); "
            "mha has no additive attention bias to carry other values"
        )
    return forbidden


# ---------------------------------------------------------------------------------------------
# keras.layers.MultiHeadAttention


def keras_weights(weights: Mapping[str, np.ndarray], num_heads: int) -> dict[str, np.ndarray]:
    """Canonical weights in the layout of Keras's MultiHeadAttention and GroupQueryAttention
    EinsumDense sub-layers.

    Returns:
        {"query/kernel": (query_size, num_heads, p), "query/bias": (num_heads, p), "key/...",
        "value/...", "attention_output/kernel": (num_heads, p, num_hiddens),
        "attention_output/bias": (num_hiddens,)}, p = num_hiddens / num_heads; keys and
        values have num_kv_heads heads where W_k and W_v have fewer columns; biases only when
        the weights have them. The names are Keras's variable paths below the layer.
    """
    _plain(weights, None, "keras.layers.MultiHeadAttention", True, has=("num_kv_heads",))
    num_hiddens, out_features = np.shape(weights["W_o"])
    if num_hiddens % num_heads:
        raise ValueError(
            "num_hiddens must be divisible by num_heads. "
            f"Received: num_hiddens={num_hiddens}, num_heads={num_heads}"
        )
    head_size = num_hiddens // num_heads
    result = {}
    for k in "qkv":
        name = _KERAS_PROJECTIONS[k]
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


_KERAS_DENSE = {"q": "query_dense", "k": "key_dense", "v": "value_dense", "o": "output_dense"}


def _keras_dense(layer: Any, k: str) -> Any:
    """The EinsumDense sub-layer of projection k ("q", "k", "v", "o") of a Keras layer
    (GroupQueryAttention has no public names for them; MultiHeadAttention's are these)."""
    return getattr(layer, f"_{_KERAS_DENSE[k]}")


def canonical_from_keras(layer: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Canonical weights and config (num_heads included) of a built Keras MultiHeadAttention
    or GroupQueryAttention (whose key-value heads become num_kv_heads); a sliding window
    becomes sliding_window.

    Raises:
        ValueError: the layer is not built, or its configuration has no mha equivalent
            (value_dim != key_dim, attention_axes other than the sequence axis, a gate).
    """
    import tensorflow as tf

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
        num_heads, key_dim, value_dim = layer.num_query_heads, layer.head_dim, layer.head_dim
        num_kv_heads, sliding_window = layer.num_key_value_heads, layer.sliding_window
    else:
        num_heads, key_dim = layer.num_heads, layer.key_dim
        value_dim = layer.value_dim if layer.value_dim is not None else key_dim
        num_kv_heads, sliding_window = None, getattr(layer, "_sliding_window", None)
    problems = []
    if value_dim != key_dim:
        problems.append(
            f"value_dim={value_dim} differs from key_dim={key_dim}; mha's heads have one size"
        )
    kernels = {k: _as_numpy(_keras_dense(layer, k).kernel) for k in "qkvo"}
    if kernels["q"].ndim != 3:
        problems.append(
            f"it was built for inputs of rank {kernels['q'].ndim + 0}; mha takes (B, n, d)"
        )
    if not grouped and tuple(layer.attention_axes or (1,)) not in ((1,), (-2,)):
        problems.append(f"attention_axes={layer.attention_axes}; mha attends over axis 1")
    if getattr(layer, "use_gate", False):
        problems.append("a gate (use_gate=True) has no mha equivalent")
    output = kernels["o"]
    if output.ndim != 3:
        problems.append(f"its output has the shape {output.shape[2:]}; mha's has one axis")
    if problems:
        raise ValueError(
            f"This keras.layers.{type(layer).__name__} has no mha equivalent:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )
    num_hiddens, out_features = num_heads * key_dim, output.shape[2]
    weights = {f"W_{k}": kernels[k].reshape(kernels[k].shape[0], -1) for k in "qkv"}
    weights["W_o"] = output.reshape(num_hiddens, out_features)
    if layer.use_bias:
        for k in "qkvo":
            weights[f"b_{k}"] = _as_numpy(_keras_dense(layer, k).bias).reshape(-1)
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
        "num_kv_heads": None if num_kv_heads == num_heads else num_kv_heads,
        "sliding_window": sliding_window,
    }
    return weights, config


def to_keras(layer: Any) -> Any:
    """A built Keras layer computing what the mha `layer` does: a
    `keras.layers.MultiHeadAttention`, or a `GroupQueryAttention` when the layer has fewer
    key-value heads (num_kv_heads < num_heads).

    Args:
        layer: an mha MultiHeadAttention of any backend, with its weights created.

    Returns:
        MultiHeadAttention(num_heads, key_dim=value_dim=num_hiddens / num_heads,
        dropout, use_bias=bias, output_shape=num_hiddens, sliding_window, dtype), or
        GroupQueryAttention(head_dim, num_heads, num_kv_heads, dropout, use_bias,
        sliding_window, dtype), built for the layer's input sizes. Keras takes
        `layer(query, value, key)` (value before key!) and gives per-head weights with
        `return_attention_scores=True`.

    Raises:
        ValueError: what Keras's layers cannot hold (rotary embeddings, a score scale; for
            GroupQueryAttention an output size other than the query size, which it fixes).
    """
    import tensorflow as tf

    config, weights = _multihead_config(
        layer, "keras.layers.MultiHeadAttention", True, has=("num_kv_heads", "sliding_window")
    )
    num_hiddens, num_heads = config["num_hiddens"], config["num_heads"]
    head_size = num_hiddens // num_heads
    out_features = config["out_features"] or num_hiddens
    num_kv_heads = config["num_kv_heads"] or num_heads
    if num_kv_heads != num_heads:
        if out_features != config["query_size"]:
            raise ValueError(
                "keras.layers.GroupQueryAttention's output has the query's size "
                f"({config['query_size']}); this layer's is {out_features}"
            )
        builtin = tf.keras.layers.GroupQueryAttention(
            head_size,
            num_heads,
            num_kv_heads,
            dropout=config["dropout"],
            use_bias=config["bias"],
            sliding_window=config["sliding_window"],
            dtype=config["dtype"],
        )
    else:
        builtin = tf.keras.layers.MultiHeadAttention(
            num_heads,
            head_size,
            value_dim=head_size,
            dropout=config["dropout"],
            use_bias=config["bias"],
            output_shape=out_features,
            sliding_window=config["sliding_window"],
            dtype=config["dtype"],
        )
    builtin.build(
        (None, None, config["query_size"]),
        (None, None, config["value_size"]),
        (None, None, config["key_size"]),
    )
    for path, value in keras_weights(weights, num_heads).items():
        name, variable = path.split("/")
        k = next(k for k, projection in _KERAS_PROJECTIONS.items() if projection == name)
        getattr(_keras_dense(builtin, k), variable).assign(value)
    return builtin


def from_keras(layer: Any, *, backend: str | None = None) -> Any:
    """An mha MultiHeadAttention in `backend` (default: current) from a built Keras
    MultiHeadAttention or GroupQueryAttention.

    Raises:
        ValueError: see `canonical_from_keras`.
    """
    weights, config = canonical_from_keras(layer)
    return layer_from_weights(
        weights,
        config["num_heads"],
        backend=backend,
        dropout=config["dropout"],
        **_options_of(config),
    )


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
        array (B or 1, Q, K) with True = attend (mha's convention), when valid_lens or mask is
        given, and `use_causal_mask`.

    Raises:
        ValueError: a per-head (4-D) mask, which Keras's attention_mask cannot hold.
    """
    keep = _keep_mask(valid_lens, mask, False, num_queries, num_keys)
    result: dict[str, Any] = {"use_causal_mask": bool(causal)}
    if keep is not None:
        if keep.shape[1] != 1:
            raise ValueError(
                "Keras MultiHeadAttention's attention_mask (B, Q, K) applies to every head; "
                f"a per-head mask cannot be translated. Received a mask with {keep.shape[1]} "
                "heads on axis 1"
            )
        result["attention_mask"] = np.ascontiguousarray(
            np.broadcast_to(keep[:, 0], (keep.shape[0], num_queries, num_keys))
        )
    return result


def from_keras_masks(
    attention_mask: Any = None, use_causal_mask: bool = False, *, backend: str | None = None
) -> dict[str, Any]:
    """mha's mask arguments equivalent to Keras MultiHeadAttention's.

    Args:
        attention_mask: (B, Q, K), True (or nonzero) = attend.
        use_causal_mask: Keras's causal flag (top-left aligned, as mha's `causal`).
        backend: the mha backend whose tensors to return (default: current).

    Returns:
        {"mask": keep-mask (B, Q, K) as the backend's tensor, "causal": bool}.
    """
    from mha.config import get_backend

    result: dict[str, Any] = {"causal": bool(use_causal_mask)}
    if attention_mask is not None:
        keep = _as_numpy(attention_mask)
        keep = keep > 0.5 if keep.dtype.kind == "f" else keep.astype(bool)  # Keras's rule
        module = load_backend(backend if backend is not None else get_backend())
        result["mask"] = module.from_numpy(keep)
    return result


# ---------------------------------------------------------------------------------------------
# Flax: nnx.MultiHeadAttention, and Linen's MultiHeadDotProductAttention parameters

_FLAX_PROJECTIONS = {"q": "query", "k": "key", "v": "value", "o": "out"}


def flax_params(weights: Mapping[str, np.ndarray], num_heads: int) -> dict[str, dict]:
    """Canonical weights as the parameters of Flax's multi-head attention, the same in NNX's
    MultiHeadAttention and Linen's MultiHeadDotProductAttention (Keras's layout, nested).

    Returns:
        {"query": {"kernel": (query_size, num_heads, p), "bias": (num_heads, p)}, "key": ...,
        "value": ..., "out": {"kernel": (num_heads, p, num_hiddens), "bias": (num_hiddens,)}},
        p = num_hiddens / num_heads; biases only when the weights have them. Linen's
        `module.apply({"params": flax_params(...)}, ...)` takes it as it is.
    """
    flat = keras_weights(weights, num_heads)
    params: dict[str, dict] = {}
    for k, keras_name in _KERAS_PROJECTIONS.items():
        for variable in ("kernel", "bias"):
            if f"{keras_name}/{variable}" in flat:
                params.setdefault(_FLAX_PROJECTIONS[k], {})[variable] = flat[
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
            head size other than the key's, normalize_qk, a decoding cache).
    """
    params, problems = _flax_params_of(source), []
    found = sorted(params) if isinstance(params, Mapping) else type(params).__name__
    if not isinstance(params, Mapping) or set(params) != set(_FLAX_PROJECTIONS.values()):
        raise ValueError(
            "Expected Flax multi-head attention parameters: query, key, value and out, each "
            f"with a kernel (and a bias). Found: {found}"
        )
    kernels, biases = {}, {}
    for k, name in _FLAX_PROJECTIONS.items():
        entry = params[name]
        if not isinstance(entry, Mapping) or not {"kernel"} <= set(entry) <= {"kernel", "bias"}:
            got = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
            raise ValueError(f"Flax parameters {name!r} must hold kernel (and bias). Found: {got}")
        kernels[k] = _as_numpy(entry["kernel"])
        if "bias" in entry:
            biases[k] = _as_numpy(entry["bias"])
    if any(kernels[k].ndim != 3 for k in "qkvo"):
        shapes = ", ".join(f"{_FLAX_PROJECTIONS[k]} {kernels[k].shape}" for k in "qkvo")
        raise ValueError(
            "Flax multi-head attention kernels are (in, heads, head size) and out (heads, head "
            f"size, out). Found: {shapes}"
        )
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
            + ", ".join(f"{_FLAX_PROJECTIONS[k]} {kernels[k].shape[1:]}" for k in "qkv")
        )
    num_hiddens = num_heads * head_size
    if kernels["o"].shape[:2] != (num_heads, head_size):
        problems.append(
            f"out kernel {kernels['o'].shape}: expected (num_heads, head size, out) = "
            f"({num_heads}, {head_size}, out)"
        )
    if biases and set(biases) != set("qkvo"):
        problems.append(f"biases on {sorted(_FLAX_PROJECTIONS[k] for k in biases)} only")
    if problems:
        raise ValueError(
            "This Flax multi-head attention has no mha equivalent:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )
    weights = {f"W_{k}": kernels[k].reshape(kernels[k].shape[0], -1) for k in "qkv"}
    out_features = kernels["o"].shape[-1]
    weights["W_o"] = kernels["o"].reshape(num_hiddens, out_features)
    for k in biases:
        weights[f"b_{k}"] = biases[k].reshape(-1)
    weights = {name: np.ascontiguousarray(value) for name, value in weights.items()}
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
    unsupported = []
    if source.normalize_qk:
        unsupported.append("normalize_qk=True (mha does not normalize queries and keys)")
    if getattr(source, "decode", False):
        unsupported.append("decode=True (mha has no decoding cache)")
    if unsupported:
        raise ValueError(
            "This flax.nnx.MultiHeadAttention has no mha equivalent:\n"
            + "\n".join(f"  - {problem}" for problem in unsupported)
        )
    params = {}
    for name in _FLAX_PROJECTIONS.values():
        dense = getattr(source, name)
        params[name] = {"kernel": dense.kernel[...]}
        if getattr(dense, "bias", None) is not None:
            params[name]["bias"] = dense.bias[...]
    return params


def to_flax(layer: Any, *, rngs: Any = None) -> Any:
    """A `flax.nnx.MultiHeadAttention` computing what the mha `layer` does.

    Args:
        layer: an mha MultiHeadAttention of any backend, with its weights created.
        rngs: the new module's `nnx.Rngs` (its dropout stream); nnx.Rngs(0) when None.

    Returns:
        MultiHeadAttention(num_heads, in_features=query_size, qkv_features=num_hiddens,
        out_features=num_hiddens, in_kv_features=key_size, use_bias=bias, dropout_rate,
        dtype) holding the layer's weights. Flax takes `module(query, key, value, mask=...)`
        with mask True = attend (see `to_flax_masks`).

    Raises:
        ValueError: key_size differs from value_size (Flax has one size for both); fewer
            key-value heads where the installed Flax has no num_kv_heads.
    """
    import inspect

    from flax import nnx

    # Flax's num_kv_heads (grouped-query attention) came with Flax 0.12.1
    grouped = "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters
    has = ("num_kv_heads",) if grouped else ()
    config, weights = _multihead_config(layer, "Flax's multi-head attention", True, has)
    kv = {"num_kv_heads": config["num_kv_heads"]} if config["num_kv_heads"] else {}
    if config["key_size"] != config["value_size"]:
        raise ValueError(
            "flax.nnx.MultiHeadAttention has one input size for keys and values "
            f"(in_kv_features). Received: key_size={config['key_size']}, "
            f"value_size={config['value_size']}"
        )
    dtype = config["dtype"]
    module = nnx.MultiHeadAttention(
        config["num_heads"],
        config["query_size"],
        qkv_features=config["num_hiddens"],
        out_features=config["out_features"] or config["num_hiddens"],
        in_kv_features=config["key_size"],
        dtype=dtype,
        param_dtype=dtype,
        dropout_rate=config["dropout"],
        use_bias=config["bias"],
        decode=False,
        rngs=nnx.Rngs(0) if rngs is None else rngs,
        **kv,
    )
    for name, variables in flax_params(weights, config["num_heads"]).items():
        dense = getattr(module, name)
        for variable, value in variables.items():
            getattr(dense, variable)[...] = load_backend("jax").from_numpy(value)
    return module


def from_flax(source: Any, *, backend: str | None = None) -> Any:
    """An mha MultiHeadAttention in `backend` (default: current) from Flax's multi-head
    attention: an `nnx.MultiHeadAttention`, or the parameters of one or of Linen's
    `MultiHeadDotProductAttention` (the number of heads is read from the kernels' shapes).

    Raises:
        ValueError: see `canonical_from_flax`.
    """
    weights, config = canonical_from_flax(source)
    return layer_from_weights(
        weights, config["num_heads"], backend=backend, dropout=config["dropout"]
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
    """
    keep = _keep_mask(valid_lens, mask, causal, num_queries, num_keys)
    return {} if keep is None else {"mask": np.ascontiguousarray(keep)}


# ---------------------------------------------------------------------------------------------
# Files: an mha checkpoint, a torch state_dict, a Keras weights file, Flax parameters

FILE_KINDS = {
    "mha": "mha checkpoint (.safetensors)",
    "torch": "torch.nn.MultiheadAttention state_dict (.pt, .pth)",
    "keras": "Keras MultiHeadAttention weights (.weights.h5)",
    "flax": "Flax multi-head attention parameters (.msgpack, flax.serialization)",
}
_SUFFIXES = {"mha": ".safetensors", "torch": ".pt", "keras": ".weights.h5", "flax": ".msgpack"}


def file_kind(path: str | os.PathLike) -> str:
    """ "mha", "torch", "keras" or "flax", from the file name's ending (see FILE_KINDS).

    Raises:
        ValueError: any other ending (a Keras file must end in .weights.h5, as Keras asks).
    """
    name = os.fspath(path).lower()
    if name.endswith(".safetensors"):
        return "mha"
    if name.endswith((".pt", ".pth")):
        return "torch"
    if name.endswith(".weights.h5"):
        return "keras"
    if name.endswith(".msgpack"):
        return "flax"
    raise ValueError(
        f"cannot tell the kind of {os.fspath(path)!r} from its name. Use "
        + ", ".join(FILE_KINDS.values())
    )


def read_file(
    path: str | os.PathLike, *, num_heads: int | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Canonical MultiHeadAttention weights and config from any file kind (see `file_kind`).

    Only data is read, never code: safetensors with numpy, the torch file with
    `torch.load(weights_only=True)` (which refuses anything but tensors and plain
    containers), the Keras file with h5py (to learn the sizes) and `keras.saving.load_weights`.

    Args:
        path: the file.
        num_heads: the number of heads; needed for a torch file, whose weights do not tell it;
            checked against the file for the other kinds.

    Returns:
        (weights, config) with config holding num_hiddens, num_heads (None when unknown),
        dropout, bias, query_size, key_size, value_size and dtype.

    Raises:
        ValueError: the file cannot be read, holds no MultiHeadAttention, or its number of
            heads differs from `num_heads`.
    """
    kind = file_kind(path)
    name = os.fspath(path)
    if kind == "mha":
        from mha.weights import read_checkpoint

        checkpoint = read_checkpoint(path)
        if checkpoint.class_name != "MultiHeadAttention":
            raise ValueError(
                f"{name} holds a {checkpoint.class_name}; only a MultiHeadAttention has a "
                "built-in counterpart in torch and Keras"
            )
        weights, config = checkpoint.weights, dict(checkpoint.config)
    elif kind == "torch":
        weights, config = canonical_from_torch(_load_torch_file(name))
        config.update(num_heads=None, dropout=0.0)
    elif kind == "flax":
        weights, config = canonical_from_flax(_load_flax_file(name))
    else:
        weights, config = canonical_from_keras(_load_keras_file(name))
    from mha.weights import OPTION_DEFAULTS

    config = {**OPTION_DEFAULTS, **config}
    if num_heads is not None:
        if config["num_heads"] is not None and config["num_heads"] != num_heads:
            raise ValueError(
                f"{name} holds a layer with num_heads={config['num_heads']}. "
                f"Received: num_heads={num_heads}"
            )
        given = {
            "num_hiddens": config["num_hiddens"],
            "num_heads": num_heads,
            "bias": config["bias"],
        }
        validation.check_layer_args(
            "MultiHeadAttention", {**options.layer_defaults("MultiHeadAttention"), **given}
        )
        config["num_heads"] = num_heads
    from mha.weights import LAYER_CLASSES

    return weights, {key: config[key] for key in LAYER_CLASSES["MultiHeadAttention"]}


def _load_torch_file(name: str, only_weights: bool = True) -> dict[str, Any]:
    """The state_dict of a torch file; with only_weights, every tensor must be a dense float
    one (a whole model's file also holds integer buffers: mha.porting checks what it uses)."""
    import torch

    try:
        state = torch.load(name, map_location="cpu", weights_only=True)
    except Exception as error:  # torch's restricted unpickler raises many kinds on bad bytes
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise ValueError(
            f"{name} is not a torch state_dict file that loads with weights_only=True "
            f"(nothing in it was executed): {message}"
        ) from None
    if not isinstance(state, Mapping) or not all(
        isinstance(value, torch.Tensor) for value in state.values()
    ):
        raise ValueError(
            f"{name} does not hold a state_dict (a dict of tensors). "
            f"Received: {type(state).__name__}"
        )
    for key, value in state.items() if only_weights else ():
        # Only plain dense float tensors are weights mha reads
        kind = (
            "a sparse"
            if value.layout != torch.strided
            else "a quantized"
            if value.is_quantized
            else "a meta (data-less)"
            if value.device.type == "meta"
            else None
        )
        if kind is None and value.dtype not in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
        ):
            kind = f"a {str(value.dtype).removeprefix('torch.')}"
        if kind is not None:
            raise ValueError(
                f"{name} holds {kind} tensor at {key!r}; mha reads dense float16, bfloat16, "
                "float32 and float64 weights"
            )
    return dict(state)


def _load_flax_file(name: str) -> Any:
    from flax import serialization

    with open(name, "rb") as file:
        content = file.read()
    try:
        params = serialization.msgpack_restore(content)
    except Exception as error:  # msgpack raises its own kinds for every way bytes can be wrong
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise ValueError(
            f"{name} is not a flax.serialization msgpack file: {type(error).__name__}: {message}"
        ) from None
    if not isinstance(params, Mapping):
        raise ValueError(
            f"{name} holds a {type(params).__name__}, not the parameters of a Flax layer (a map)"
        )
    return params


def _load_keras_file(name: str) -> Any:
    import h5py
    import keras  # Keras 3, the tf.keras of TensorFlow 2.16 and later
    import tensorflow as tf

    try:
        with h5py.File(name, "r") as file:
            # GroupQueryAttention's sub-layers are saved under their attribute names
            grouped = "_query_dense" in file
            paths = {k: f"_{dense}" if grouped else dense for k, dense in _KERAS_DENSE.items()}
            entries = [
                file[f"{path}/vars/{i}"]
                for path in paths.values()
                for i in (0, 1)
                if f"{path}/vars/{i}" in file
            ]
            if not all(isinstance(entry, h5py.Dataset) for entry in entries):
                raise ValueError("its weight entries are not arrays")
            # Every array is read whole: together they must fit in the file that holds them
            declared = sum(entry.size * entry.dtype.itemsize for entry in entries)
            if declared > os.path.getsize(name):
                raise ValueError(f"its arrays declare {declared} bytes, more than the file has")
            shapes = {k: tuple(file[f"{path}/vars/0"].shape) for k, path in paths.items()}
            query = file[f"{paths['q']}/vars/0"]
            # Keras stores bfloat16 as 2 raw bytes per number and names the dtype in an
            # attribute
            dtype = query.attrs.get("dtype", query.dtype.name)
            dtype = dtype.decode() if isinstance(dtype, bytes) else str(dtype)
            bias = f"{paths['q']}/vars/1" in file
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{name} is not a Keras MultiHeadAttention or GroupQueryAttention weights file (as "
            f"written by keras.saving.save_weights): {error}"
        ) from None
    if len(shapes["q"]) != 3 or len(shapes["v"]) != 3 or len(shapes["o"]) < 3:
        raise ValueError(
            f"{name} holds Keras MultiHeadAttention weights of a shape mha does not convert: "
            f"query kernel {shapes['q']}, value kernel {shapes['v']}, output kernel "
            f"{shapes['o']}"
        )
    num_heads, key_dim = shapes["q"][1:]
    if grouped:
        # GroupQueryAttention's output has the query's size
        layer = tf.keras.layers.GroupQueryAttention(
            key_dim, num_heads, shapes["k"][1], use_bias=bias, dtype=validation.check_dtype(dtype)
        )
    else:
        layer = tf.keras.layers.MultiHeadAttention(
            num_heads,
            key_dim,
            value_dim=shapes["v"][2],
            use_bias=bias,
            output_shape=shapes["o"][2:],
            dtype=validation.check_dtype(dtype),
        )
    layer.build(
        (None, None, shapes["q"][0]), (None, None, shapes["v"][0]), (None, None, shapes["k"][0])
    )
    try:
        keras.saving.load_weights(layer, name)
    except (ValueError, OSError, KeyError) as error:
        raise ValueError(f"{name} does not load into a Keras MultiHeadAttention: {error}") from None
    return layer


def write_file(
    path: str | os.PathLike,
    weights: Mapping[str, np.ndarray],
    *,
    num_heads: int | None = None,
    dropout: float = 0.0,
    scale: float | None = None,
    **options: Any,
) -> None:
    """Write canonical MultiHeadAttention weights as the file kind of `path`, atomically.

    An mha checkpoint holds the weights, class and config; a torch file the module's
    state_dict, saved with `torch.save`; a Keras file the layer's weights, as
    `keras.saving.save_weights` writes them; a Flax file the parameters (`flax_params`) as
    `flax.serialization.msgpack_serialize` writes them. num_heads is needed for every kind
    but torch's. The file is built in memory (the frameworks' writers never touch the disk),
    written beside `path` and read back as the same weights, bit for bit, before it replaces
    `path`: on any failure `path` is left as it was and nothing else is left beside it.
    `options` (the layer's rope_theta, rope_interleaved, sliding_window) are kept by an mha
    checkpoint only; fewer key-value heads go into mha and Keras files (GroupQueryAttention's
    weights).

    Raises:
        ValueError, TypeError: the kind cannot hold these weights, or they would not read back.
        OSError: the file could not be written (a framework's writer failed, a full disk, a
            file-size limit); `path` is left as it was.
    """
    from mha.files import write_atomically

    kind = file_kind(path)
    if kind != "torch" and num_heads is None:
        raise ValueError(f"writing {FILE_KINDS[kind]} needs num_heads")
    if kind != "mha":
        has = ("num_kv_heads",) if kind == "keras" else ()
        _plain(weights, scale, FILE_KINDS[kind], kind != "torch", options, has)
    try:
        content = _file_bytes(kind, weights, num_heads, dropout, scale, options)
    except (ValueError, TypeError):
        raise
    except Exception as error:  # the frameworks' writers raise their own kinds
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        name = os.fspath(path)
        raise OSError(f"writing {name} failed: {message}; {name} is left as it was") from error

    def check(temporary: str) -> None:
        again, _ = read_file(temporary, num_heads=num_heads)
        if not _same_weights(again, weights):
            raise ValueError(f"{os.fspath(path)} would not read back as the same weights")

    write_atomically(path, content, suffix=_SUFFIXES[kind], check=check)


def _file_bytes(
    kind: str,
    weights: Mapping[str, np.ndarray],
    num_heads: int | None,
    dropout: float,
    scale: float | None,
    options: Mapping[str, Any],
) -> bytes:
    """The content of a file of `kind` holding `weights`, built in memory."""
    import io

    if kind == "torch":
        import torch

        from_numpy = load_backend("torch").from_numpy
        state = torch_state_dict(weights)
        buffer = io.BytesIO()
        torch.save({key: from_numpy(value) for key, value in state.items()}, buffer)
        return buffer.getvalue()
    if kind == "flax":
        from flax import serialization

        return serialization.msgpack_serialize(flax_params(weights, num_heads))
    layer = layer_from_weights(
        weights,
        num_heads,
        backend=_carrier(weights),
        dropout=dropout,
        scale=scale,
        **{key: value for key, value in options.items() if value not in (None, False)},
    )
    if kind == "mha":
        from mha.weights import checkpoint_bytes

        return checkpoint_bytes(layer)
    return _keras_weights_bytes(to_keras(layer))


def _keras_weights_bytes(layer: Any) -> bytes:
    """The .weights.h5 file `keras.saving.save_weights(layer, path)` writes, built in memory.

    h5py crashes the process when the disk refuses a write while it closes a file, so the
    HDF5 file is made in a BytesIO with the store and walk `save_weights` itself uses (Keras 3
    has no public call that writes to memory); write_file reads the file back to check it.
    """
    import io

    try:
        from keras.src.saving import saving_lib

        buffer = io.BytesIO()
        store = saving_lib.H5IOStore(buffer, mode="w")
        try:
            # Positional: the names of a private function's parameters are no promise
            saving_lib._save_state(layer, store, None, "", set())
        finally:
            store.close()
        return buffer.getvalue()
    except (ImportError, AttributeError, TypeError):
        return _keras_weights_bytes_by_file(layer)


def _keras_weights_bytes_by_file(layer: Any) -> bytes:
    """The same bytes by Keras's public save_weights, for a Keras whose private store differs:
    written in a scratch folder of the system's, never beside the destination."""
    import tempfile

    import keras

    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "layer.weights.h5")
        keras.saving.save_weights(layer, path)
        with open(path, "rb") as file:
            return file.read()


def _same_weights(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    # Bit for bit: NaN equals the same NaN, and -0.0 differs from 0.0
    def bits(x):
        x = np.asarray(x)
        return x.shape, x.dtype, np.ascontiguousarray(x).tobytes()

    return set(a) == set(b) and all(bits(a[key]) == bits(b[key]) for key in a)


def _carrier(weights: Mapping[str, np.ndarray]) -> str:
    """The backend whose layer carries `weights` into a file: numpy, unless numpy does not
    compute in their dtype (bfloat16); then torch, or TensorFlow without torch."""
    dtype = np.asarray(weights.get("W_q", np.zeros(0, "float32"))).dtype.name
    if dtype in validation.BACKEND_DTYPES["numpy"]:
        return "numpy"
    for backend in ("torch", "tensorflow"):
        try:
            load_backend(backend)
        except BackendUnavailableError:
            continue
        return backend
    raise ValueError(f"writing {dtype} weights to a file needs torch or tensorflow installed")


def convert(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    num_heads: int | None = None,
    prefix: str | None = None,
    scale: float | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Convert a MultiHeadAttention file to another kind, and check it by reading it back.

    The kinds (see `file_kind`): an mha checkpoint (.safetensors), a torch
    nn.MultiheadAttention state_dict (.pt, .pth), Keras MultiHeadAttention weights
    (.weights.h5) and Flax multi-head attention parameters (.msgpack). The config is inferred
    from the weights; a torch file does not tell the number of heads, so `num_heads` is needed
    when converting one to another kind. The destination is replaced only once the new file
    reads back as the same weights, bit for bit; on any failure it is left as it was.

    With `prefix`, the source is a whole model's weights (a torch state_dict .pt/.pth, a
    safetensors file such as a Hugging Face model.safetensors, or Flax .msgpack parameters)
    and the attention layer under `prefix` is taken, in any layout `mha.porting` reads.
    `options` (rope_theta, rope_interleaved, sliding_window) set what weights do not tell;
    only an mha checkpoint keeps them.

    Example:
        >>> mha.interop.convert("attention.pt", "attention.weights.h5", num_heads=4)
        >>> mha.interop.convert("bert.pt", "layer0.safetensors", num_heads=12,
        ...                     prefix="bert.encoder.layer.0.attention")

    Returns:
        The config of the converted layer; with `prefix`, also "layout" (the layout found)
        and "left_out" (the names under the prefix that are not attention weights).

    Raises:
        ValueError: a file that cannot be read, a configuration the destination cannot express
            (e.g. a query size other than num_hiddens for torch), num_heads missing, or a
            destination that does not read back as the same weights.
    """
    extra = {}
    if prefix is not None:
        from mha import porting

        port = porting.canonical_from_state_dict(
            read_state(source), prefix, num_heads=num_heads, scale=scale, **options
        )
        weights, config = port.weights, port.config
        extra = {"layout": port.layout, "left_out": port.left_out}
    else:
        check_untold_options(options)
        weights, config = read_file(source, num_heads=num_heads)
        if scale is not None:
            config["scale"] = scale
        config.update(options)
    if config["num_heads"] is None and file_kind(destination) != "torch":
        raise ValueError(
            f"{os.fspath(source)} is a torch state_dict, which does not tell the number of "
            "heads: give num_heads"
        )
    write_file(
        destination,
        weights,
        num_heads=config["num_heads"],
        dropout=config["dropout"],
        scale=config["scale"],
        **_options_of(config),
    )
    return {**config, **extra}


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """Every array of a whole model's weights file, by name: a torch state_dict (.pt, .pth,
    loaded with weights_only=True), a safetensors file, or Flax parameters (.msgpack,
    flattened with "."). Only data is read, never code."""
    from mha.porting import flatten

    kind, name = file_kind(path), os.fspath(path)
    if kind == "torch":
        return _load_torch_file(name, only_weights=False)
    if kind == "flax":
        return flatten(_load_flax_file(name))
    if kind == "mha":
        from mha.weights import read_safetensors

        return read_safetensors(path)[0]
    raise ValueError(
        f"{name}: a whole model's weights are read from .pt, .pth, .safetensors or .msgpack files"
    )
