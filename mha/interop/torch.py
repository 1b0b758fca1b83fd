"""torch.nn.MultiheadAttention <-> mha's MultiHeadAttention: weights, layers and masks.

Layout (n = num_hiddens = embed_dim): in_proj_weight (3n, n) = [W_q.T; W_k.T; W_v.T] when
kdim = vdim = embed_dim, else q_proj_weight (n, n), k_proj_weight (n, kdim), v_proj_weight
(n, vdim); in_proj_bias (3n,) = [b_q; b_k; b_v]; out_proj.weight (n, n) = W_o.T,
out_proj.bias = b_o. torch computes x @ weight.T + bias, hence the transposes.

torch is imported inside the functions that need it: importing this module imports none.
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
from mha.registry import load_backend
from mha.tensors import plain_dtype_name

__all__ = [
    "TORCH_WEIGHT_NAMES",
    "canonical_from_torch",
    "from_torch",
    "from_torch_masks",
    "to_torch",
    "to_torch_masks",
    "torch_state_dict",
]

# The names of a torch.nn.MultiheadAttention's state_dict that hold mha's weights
TORCH_WEIGHT_NAMES = (
    "in_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "in_proj_bias",
    "out_proj.weight",
    "out_proj.bias",
)


def torch_state_dict(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The `torch.nn.MultiheadAttention` state_dict of canonical weights, as numpy arrays.

    Packed `in_proj_weight` (3n, n) when every input size equals num_hiddens (torch packs
    exactly then), else `q_proj_weight`, `k_proj_weight`, `v_proj_weight`.

    Raises:
        ValueError: the query size differs from num_hiddens (torch's query size is embed_dim).
    """
    check_expressible(weights, None, "torch.nn.MultiheadAttention")
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
    arrays = {name: as_numpy(value) for name, value in state_dict.items()}
    _refuse_state(_name_problems(arrays))
    out = arrays["out_proj.weight"]
    if out.ndim != 2 or out.shape[0] != out.shape[1]:
        raise ValueError(f"out_proj.weight must be square (n, n). Received shape {out.shape}")
    _refuse_state(_shape_problems(arrays, out.shape[0]))
    if "in_proj_weight" in arrays:
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
        "num_hiddens": out.shape[0],
        "bias": bias,
        "query_size": out.shape[0],
        "key_size": W_k.shape[1],
        "value_size": W_v.shape[1],
        "dtype": validation.check_dtype(out.dtype.name),
    }
    return weights, config


def _refuse_state(problems: list[str]) -> None:
    if problems:
        raise ValueError(
            "Not a torch.nn.MultiheadAttention state_dict that mha can convert:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )


def _name_problems(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """What is wrong with the names of a state_dict: add_bias_kv, others', missing ones."""
    problems = []
    if "bias_k" in arrays or "bias_v" in arrays:
        problems.append("bias_k/bias_v (add_bias_kv=True) have no mha equivalent")
    unexpected = set(arrays) - set(TORCH_WEIGHT_NAMES) - {"bias_k", "bias_v"}
    if unexpected:  # a file's keys may be anything: listed by their repr where not names
        listed = (key if isinstance(key, str) else repr(key) for key in unexpected)
        problems.append(f"unexpected {', '.join(sorted(listed))}")
    packed = "in_proj_weight" in arrays
    separate = sorted({"q_proj_weight", "k_proj_weight", "v_proj_weight"} & set(arrays))
    if packed and separate:
        problems.append(
            f"both in_proj_weight and {', '.join(separate)}: a MultiheadAttention holds one "
            "or the other, and which it computes with is not told"
        )
    needed = ["out_proj.weight"] + (
        ["in_proj_weight"] if packed else ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    )
    missing = [name for name in needed if name not in arrays]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    return problems


def _shape_problems(arrays: Mapping[str, np.ndarray], n: int) -> list[str]:
    """What is wrong with the shapes and dtypes of a state_dict whose out_proj is (n, n)."""
    problems = []
    expected = {"out_proj.weight": (n, n), "in_proj_bias": (3 * n,), "out_proj.bias": (n,)}
    if "in_proj_weight" in arrays:
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
    return problems


def to_torch(layer: Any, *, batch_first: bool = True) -> Any:
    """A `torch.nn.MultiheadAttention` computing what the mha MultiHeadAttention `layer` does.

    Args:
        layer: an mha MultiHeadAttention of any backend, with its weights created.
        batch_first: the new module's input layout; True matches mha's (B, Q, d) shapes.

    Returns:
        nn.MultiheadAttention(embed_dim=num_hiddens, num_heads, dropout, bias, kdim=key_size,
        vdim=value_size, dtype=the layer's dtype), in the layer's mode where its backend
        keeps one (`training_of`: torch's, NumPy's and JAX's layers), otherwise in training
        mode as every new module (call `.eval()` before comparing when dropout > 0). Call it with
        `need_weights=True, average_attn_weights=False` for per-head weights.

    Raises:
        ValueError: query_size differs from num_hiddens, which torch cannot express.
    """
    import torch

    config, weights = multihead_config(layer, "torch.nn.MultiheadAttention")
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
    return set_training(module, training_of(layer))


def from_torch(module: Any, *, backend: str | None = None) -> Any:
    """An mha MultiHeadAttention in `backend` (default: current) from a torch MultiheadAttention.

    The config is num_hiddens = query_size = embed_dim, key_size = kdim, value_size = vdim,
    num_heads, dropout, bias (torch's `bias` covers the four projections, as mha's does) and
    the dtype of the module's weights, and the module's mode (`.training`) where the backend's
    layers keep one (torch, NumPy, JAX). `batch_first` only concerns torch's inputs.

    Raises:
        ValueError: the module uses add_bias_kv or add_zero_attn, which mha cannot express,
            or its class overrides forward or it has forward hooks (pruning's among them) or
            parametrizations, which may compute other numbers.
    """
    import torch

    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(
            f"Expected a torch.nn.MultiheadAttention. Received: {type(module).__qualname__}"
        )
    refuse_overrides(module, torch.nn.MultiheadAttention, ("forward", "merge_masks"))
    _refuse_hooks(module)
    parametrized = [
        f"{path}.{name}".lstrip(".")
        for path, part in module.named_modules()
        if torch.nn.utils.parametrize.is_parametrized(part)
        for name in part.parametrizations
    ]
    if parametrized:
        raise ValueError(
            f"This torch.nn.MultiheadAttention computes {', '.join(sorted(parametrized))} by "
            "parametrizations; torch.nn.utils.parametrize.remove_parametrizations(module, "
            "name) keeps their values as its weights: convert it then"
        )
    if module.add_zero_attn:
        raise ValueError(
            "torch.nn.MultiheadAttention with add_zero_attn=True has no mha equivalent"
        )
    weights, _ = canonical_from_torch(module.state_dict())
    return layer_from_weights(
        weights,
        module.num_heads,
        backend=backend,
        dropout=float(module.dropout),
        training=module.training,
    )


def _refuse_hooks(module: Any) -> None:
    """Raise ValueError where forward hooks may change what the module computes (pruning's
    among them, which computes the weights from `*_orig` and a mask before each call)."""
    hooks = [
        hook
        for part in module.modules()  # out_proj's too (its weight_norm, its pruning)
        for hook in (*part._forward_pre_hooks.values(), *part._forward_hooks.values())
    ]
    if hooks:
        names = ", ".join(sorted({getattr(h, "__name__", type(h).__name__) for h in hooks}))
        raise ValueError(
            f"This torch.nn.MultiheadAttention has forward hooks ({names}), which may change "
            "what it computes from its weights; remove them (torch.nn.utils.prune.remove for "
            "pruning) before converting it"
        )


def to_torch_masks(
    valid_lens: Any = None,
    mask: Any = None,
    causal: bool = False,
    *,
    num_heads: int,
    num_queries: int,
    num_keys: int,
    batch_size: int | None = None,
    attn_bias: Any = None,
) -> dict[str, Any]:
    """torch MultiheadAttention's mask arguments equivalent to mha's.

    Args:
        valid_lens, mask, causal, attn_bias: as mha's MultiHeadAttention call (numpy or
            framework arrays).
        num_heads, num_queries, num_keys: the sizes of the call.
        batch_size: the call's batch size; needed only for a mask of one example that differs
            between heads, which torch takes as one mask per example and head.

    Returns:
        A dict for `module(query, key, value, **masks)`: `key_padding_mask` (B, K) for
        valid_lens of shape (B,), and `attn_mask` (Q, K) or (B * num_heads, Q, K) for the
        rest, both boolean torch tensors where True means NOT allowed (torch's convention, the
        inverse of mha's). With attn_bias, one float `attn_mask` of the bias's dtype instead,
        which torch adds to the scores: the bias where mha's masks keep a key, -inf where
        they do not. Empty when no mask is given.

    Raises:
        ValueError: valid_lens that are not non-negative whole numbers, with the layers'
            message; a mask of more than 4 axes or with a head axis of another size; a mask of
            one example that differs between heads without batch_size, or a batch_size that
            is not the mask's; an attn_bias that is not a float array of at most 4 axes.
    """
    import torch

    result = {}
    lengths = None if valid_lens is None else as_numpy(valid_lens)
    sizes = (batch_size, num_heads, num_queries, num_keys)
    if attn_bias is not None:
        added = _float_attn_mask(attn_bias, keep_mask(lengths, mask, causal, *sizes[2:]), sizes)
        return {"attn_mask": load_backend("torch").from_numpy(added)}
    if lengths is not None and lengths.ndim == 1:
        padding = keep_mask(lengths, None, False, num_queries, num_keys)
        result["key_padding_mask"] = torch.from_numpy(~padding[:, 0, 0, :])
        lengths = None
    keep = keep_mask(lengths, mask, causal, num_queries, num_keys)
    if keep is not None:
        keep = _attn_keep(keep, sizes)
        result["attn_mask"] = torch.from_numpy(np.ascontiguousarray(~keep))
    return result


def _float_attn_mask(attn_bias: Any, keep: np.ndarray | None, sizes: tuple) -> np.ndarray:
    """mha's attn_bias where keep keeps a key, -inf where it does not, as torch's float
    attn_mask of (Q, K) or (B * num_heads, Q, K); sizes: as _attn_keep's."""
    bias = as_numpy(attn_bias)
    if not _floating(bias) or bias.ndim > 4:
        raise ValueError(
            "attn_bias must be a float array of at most 4 axes, broadcastable to (B, "
            f"num_heads, Q, K). Received dtype {plain_dtype_name(bias.dtype)}, shape "
            f"{bias.shape}"
        )
    if bias.ndim < 4:  # as the layers broadcast it: (B, Q, K), without a head axis
        bias = bias.reshape((1,) * (3 - bias.ndim) + bias.shape)[:, None]
    if keep is not None:
        bias = np.where(keep, bias, np.array(-np.inf, bias.dtype))
    return np.ascontiguousarray(_attn_keep(bias, sizes))  # a boolean attn_mask's layouts


def _attn_keep(keep: np.ndarray, sizes: tuple[int | None, int, int, int]) -> np.ndarray:
    """keep (B or 1, heads or 1, Q or 1, K or 1), or a bias so shaped, as torch's attn_mask
    takes it: (Q, K) where it is the same for every example and head, else
    (B * num_heads, Q, K); sizes: the call's (batch_size or None, num_heads, Q, K)."""
    batch_size, num_heads, num_queries, num_keys = sizes
    examples, heads = keep.shape[:2]
    if heads not in (1, num_heads):
        raise ValueError(f"mask has {heads} heads on axis 1; expected 1 or num_heads={num_heads}")
    if examples == 1 and heads == 1:
        return np.broadcast_to(keep[0, 0], (num_queries, num_keys))
    if batch_size is not None and examples not in (1, batch_size):
        raise ValueError(f"mask has {examples} examples on axis 0; batch_size={batch_size}")
    if examples == 1 and batch_size is None:
        raise ValueError(
            "a mask of one example that differs between heads becomes torch's attn_mask of "
            "(batch_size * num_heads, Q, K): give batch_size"
        )
    examples = examples if batch_size is None else batch_size
    full = np.broadcast_to(keep, (examples, num_heads, num_queries, num_keys))
    return full.reshape(examples * num_heads, num_queries, num_keys)


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
        key_padding_mask: (B, K), boolean with True = ignore that key, or float (added to
            the scores).
        attn_mask: (Q, K) or (B * num_heads, Q, K); boolean with True = not allowed, or float
            (added to the scores: 0 and -inf as `nn.Transformer.generate_square_subsequent_mask`
            makes, or any bias).
        num_heads: the module's number of heads.
        is_causal: torch's hint that attn_mask is the top-left causal mask.
        backend: the mha backend whose tensors to return (default: current).

    Returns:
        A dict for an mha call: `causal`; `mask`, a keep-mask broadcastable to
        (B, num_heads, Q, K), from the boolean masks and the float ones holding only 0 and
        -inf; `attn_bias`, in the mask's dtype, from the float ones holding other numbers
        (their sum where both do), which torch adds to the scores as mha adds attn_bias.

    Raises:
        ValueError: a mask neither boolean nor float (torch takes no other), or of another
            shape; an attn_mask of (B * num_heads, Q, K) whose B is not key_padding_mask's;
            is_causal without attn_mask (torch refuses it, or on its fast path ignores it) or
            with one that is not the causal mask.
    """
    keep, bias = None, None
    if key_padding_mask is not None:
        padding = _torch_mask(key_padding_mask, "key_padding_mask")
        if padding.ndim != 2:
            raise ValueError(
                f"key_padding_mask must have shape (B, K). Received shape {padding.shape}"
            )
        keep, bias = _keep_or_bias(padding[:, None, None, :])
    if attn_mask is not None:
        batch = None if key_padding_mask is None else padding.shape[0]
        allowed, added = _keep_or_bias(_attn_mask(attn_mask, num_heads, batch))
        if is_causal:
            _check_causal(allowed)
            allowed = None  # mha's own causal mask, which its kernels take as is_causal
        keep, bias = _joined(keep, allowed, np.logical_and), _joined(bias, added, np.add)
    elif is_causal:
        raise ValueError(
            "is_causal is torch's hint that attn_mask is the causal mask: torch needs the "
            "attn_mask too (without one its fast path attends to every key). Give the causal "
            "attn_mask, or call mha with causal=True"
        )
    result: dict[str, Any] = {"causal": bool(is_causal)}
    module = load_backend(backend if backend is not None else get_backend())
    for name, value in (("mask", keep), ("attn_bias", bias)):
        if value is not None:
            result[name] = module.from_numpy(np.ascontiguousarray(value))
    return result


def _joined(a: np.ndarray | None, b: np.ndarray | None, join: Any) -> np.ndarray | None:
    """join(a, b), or the one of them that is given: torch combines its two masks so."""
    return b if a is None else a if b is None else join(a, b)


def _torch_mask(values: Any, name: str) -> np.ndarray:
    """A torch mask as numpy, refused unless boolean or float, as torch refuses it."""
    values = as_numpy(values)
    if values.dtype != np.bool_ and not _floating(values):
        raise ValueError(
            f"{name} must be boolean (True = not allowed) or float (added to the scores), as "
            f"torch takes it. Received dtype {plain_dtype_name(values.dtype)}"
        )
    return values


def _attn_mask(attn_mask: Any, num_heads: int, batch: int | None) -> np.ndarray:
    """torch's attn_mask (Q, K) or (B * num_heads, Q, K) as (1 or B, 1 or num_heads, Q, K);
    batch: B where key_padding_mask tells it."""
    values = _torch_mask(attn_mask, "attn_mask")
    if values.ndim == 2:
        return values[None, None]
    examples = values.shape[0] if values.ndim == 3 else 0
    if examples and examples % num_heads == 0 and batch in (None, examples // num_heads):
        return values.reshape(-1, num_heads, *values.shape[1:])
    expected = "B * num_heads" if batch is None else f"B * num_heads = {batch * num_heads}"
    raise ValueError(
        f"attn_mask must have shape (Q, K) or ({expected}, Q, K). "
        f"Received shape {values.shape} with num_heads={num_heads}"
    )


def _keep_or_bias(values: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A torch mask as mha's (keep, None), where it is boolean or only 0 and -inf, else
    (None, bias): torch adds a float mask to the scores."""
    if not _floating(values):
        return ~values, None
    exact = values.astype(np.float64)  # exact for every float dtype, bfloat16 included
    forbidden = np.isneginf(exact)
    if np.all(forbidden | (exact == 0)):
        return ~forbidden, None
    return None, values


def _check_causal(allowed: np.ndarray | None) -> None:
    """Raise ValueError unless torch's attn_mask, kept where `allowed` (None: a bias), is the
    top-left causal mask that its is_causal says it is."""
    if allowed is not None and (allowed == np.tril(np.ones(allowed.shape[-2:], bool))).all():
        return
    raise ValueError(
        "is_causal is torch's hint that attn_mask is the causal mask, and this attn_mask is "
        "not: torch would compute with one or the other depending on its path. Give "
        "is_causal=False to keep the attn_mask, or the causal mask as attn_mask"
    )


def _floating(values: np.ndarray) -> bool:
    # ml_dtypes' bfloat16 is a float that numpy does not class as one (its kind is "V")
    return plain_dtype_name(values.dtype) in validation.FLOAT_DTYPES
