"""The frameworks' own attention functions, called with mha's names, for `mha.conformance`:
each adapter takes what its function can express and raises NotImplementedError for the rest,
naming it, so that the kit reports the case as not taken rather than wrong.

    from mha import conformance, conformance_adapters
    rows = conformance.run(conformance_adapters.torch_sdpa("math"), "torch")

`ADAPTERS` names them for `mha conform`: torch-sdpa (torch's choice of kernel), torch-sdpa-math,
torch-sdpa-efficient, torch-sdpa-flash, torch-sdpa-cudnn, torch-flex (FlexAttention), jax
(jax.nn.dot_product_attention; jax-cudnn, its cuDNN implementation, on a GPU) and keras
(keras.ops.dot_product_attention), with the framework whose tensors each takes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

__all__ = [
    "ADAPTERS",
    "jax_dot_product_attention",
    "keras_dot_product_attention",
    "torch_flex_attention",
    "torch_sdpa",
]


# mha's names of the options, and their defaults: what the kit passes
_OPTIONS = {
    "mask": None,
    "bias": None,
    "scale": None,
    "causal": False,
    "alignment": "top_left",
    "window": None,
    "valid_lens": None,
    "softcap": None,
    "segment_ids": None,
}


def _read(options: dict) -> SimpleNamespace:
    """The call's options, each defaulted; a name that is not mha's is a TypeError."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unknown options: {', '.join(unknown)}")
    return SimpleNamespace(**{**_OPTIONS, **options})


def _refuse(name: str, value: Any, taken: Any = None) -> None:
    if value is not None and value != taken:
        raise NotImplementedError(f"{name}={value!r} is not an argument of this function")


def torch_sdpa(kernel: str | None = None) -> Callable:
    """torch.nn.functional.scaled_dot_product_attention, under torch's kernel `kernel` ("math",
    "efficient", "flash", "cudnn"; None: torch's choice). It takes one mask, boolean or
    additive, top-left causal, and grouped heads (enable_gqa); valid_lens become a boolean
    mask of keys, joining a boolean mask, and causal joins a mask or bias (is_causal alone
    takes none)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "math": SDPBackend.MATH,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }

    def attention(query, key, value, **options):
        o = _read(options)
        _refuse("segment_ids", None if o.segment_ids is None else "given")
        _refuse("window", o.window)
        _refuse("softcap", o.softcap)
        if o.causal:
            _refuse("alignment", o.alignment, "top_left")
        mask = o.mask
        if o.valid_lens is not None:  # (batch,) or (batch, Q): a mask of (batch, 1, Q or 1, K)
            lengths = o.valid_lens.reshape(o.valid_lens.shape[0], 1, -1, 1)
            kept = torch.arange(key.shape[-2], device=key.device) < lengths
            mask = kept if mask is None else mask & kept
        if mask is not None and o.bias is not None:
            raise NotImplementedError("a mask and a bias together: SDPA takes one attn_mask")
        attn_mask, causal = o.bias if mask is None else mask, o.causal
        if causal and attn_mask is not None:  # is_causal takes no attn_mask: causal joins it
            attn_mask = _with_causal(torch, attn_mask, query.shape[-2], key.shape[-2])
            causal = False
        within = sdpa_kernel(backends[kernel]) if kernel else contextlib.nullcontext()
        with within:
            return F.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=attn_mask,
                is_causal=causal,
                scale=o.scale,
                enable_gqa=key.shape[1] != query.shape[1],
            )

    return attention


def _with_causal(torch, attn_mask, queries: int, keys: int):
    """A boolean mask or additive bias with the keys after each query's index left out too."""
    below = torch.ones(queries, keys, dtype=torch.bool, device=attn_mask.device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & below
    return attn_mask.masked_fill(~below, float("-inf"))


def torch_flex_attention() -> Callable:
    """torch's FlexAttention (torch.nn.attention.flex_attention), eager: every mask as a
    mask_mod of the positions (a boolean mask, causal at any alignment, windows, lengths,
    packed segments, a bias's -inf entries) and the bias and soft cap as a score_mod, with
    grouped heads (enable_gqa). Outside torch.compile it runs its unfused implementation."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def attention(query, key, value, **options):
        o = _read(options)
        sizes = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        keep, score = _flex_mods(torch, o, sizes)
        block_mask = create_block_mask(keep, *sizes, device=query.device)
        return flex_attention(
            query,
            key,
            value,
            score_mod=score,
            block_mask=block_mask,
            scale=o.scale,
            enable_gqa=key.shape[1] != query.shape[1],
        )

    return attention


def _flex_mods(torch, o: SimpleNamespace, sizes: tuple[int, int, int, int]):
    """FlexAttention's (mask_mod, score_mod) of the call's options; sizes: (B, H, Q, K)."""
    from mha.function_checks import first_position, window_sides

    def whole(x):  # a mask or bias as (B, H, Q, K), broadcast as numpy broadcasts
        return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)).expand(*sizes)

    first = first_position(o.alignment, sizes[2], sizes[3])
    sides = window_sides(o.window) or (None, None)
    mask = None if o.mask is None else whole(o.mask)
    bias = None if o.bias is None else whole(o.bias)
    segments = o.segment_ids if isinstance(o.segment_ids, tuple) else (o.segment_ids,) * 2
    # Positions: each one's index among its segment's (the packed row's without segments)
    places = [None if ids is None else _places_in_segments(torch, ids) for ids in segments]

    def keep(b, h, q, k):
        # p: the query's position among the keys; j: the key's
        p = q + first if places[0] is None else places[0][b, q] + first
        j = k if places[1] is None else places[1][b, k]
        kept = k >= 0
        if mask is not None:
            kept = kept & mask[b, h, q, k]
        if bias is not None:
            kept = kept & (bias[b, h, q, k] != float("-inf"))
        if o.causal:
            kept = kept & (j <= p)
        if sides[0] is not None:
            kept = kept & (j >= p - sides[0])
        if sides[1] is not None:
            kept = kept & (j <= p + sides[1])
        if o.valid_lens is not None:
            lengths = o.valid_lens
            kept = kept & (k < (lengths[b] if lengths.dim() == 1 else lengths[b, q]))
        if o.segment_ids is not None:
            kept = kept & (segments[0][b, q] == segments[1][b, k])
        return kept

    def score(s, b, h, q, k):
        if o.softcap is not None:
            s = o.softcap * torch.tanh(s / o.softcap)
        return (
            s
            if bias is None
            else s + torch.where(torch.isinf(bias[b, h, q, k]), 0.0, bias[b, h, q, k]).to(s.dtype)
        )

    return keep, score


def _places_in_segments(torch, ids):
    """Each position's index among the earlier positions of its segment: ids (B, n) -> (B, n)."""
    same = ids[:, :, None] == ids[:, None, :]
    earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril(-1)
    return (same & earlier).sum(-1)


def jax_dot_product_attention(implementation: str | None = None) -> Callable:
    """jax.nn.dot_product_attention on (batch, positions, heads, head size): a bias and a mask,
    top-left causal, windows, lengths of the keys, grouped heads, one head size."""
    import jax
    import jax.numpy as jnp

    def attention(query, key, value, **options):
        o = _read(options)
        _refuse("segment_ids", None if o.segment_ids is None else "given")
        _refuse("softcap", o.softcap)
        if o.causal or o.window is not None:
            _refuse("alignment", o.alignment, "top_left")
        if value.shape[-1] != query.shape[-1]:
            raise NotImplementedError("a value head size of its own: it takes one head size")
        window = (o.window - 1, o.window - 1) if isinstance(o.window, int) else o.window
        if window is not None and None in window:
            raise NotImplementedError(f"window={window!r}: its sides are counts, not open")
        if o.valid_lens is not None and o.valid_lens.ndim != 1:
            raise NotImplementedError("valid_lens of each query: it takes one length a row")
        lengths = None if o.valid_lens is None else o.valid_lens.astype("int32")
        output = jax.nn.dot_product_attention(
            *(jnp.swapaxes(x, 1, 2) for x in (query, key, value)),
            bias=o.bias,
            mask=o.mask,
            scale=o.scale,
            is_causal=o.causal,
            local_window_size=window,
            key_value_seq_lengths=lengths,
            implementation=implementation,
        )
        return jnp.swapaxes(output, 1, 2)

    return attention


def keras_dot_product_attention() -> Callable:
    """keras.ops.dot_product_attention on (batch, positions, heads, head size): a bias and a
    mask, top-left causal, grouped heads, the soft cap (attn_logits_soft_cap) on JAX."""
    import keras

    def attention(query, key, value, **options):
        o = _read(options)
        _refuse("segment_ids", None if o.segment_ids is None else "given")
        _refuse("window", o.window)
        _refuse("valid_lens", None if o.valid_lens is None else "given")
        if o.causal:
            _refuse("alignment", o.alignment, "top_left")
        if o.softcap is not None and keras.backend.backend() != "jax":
            raise NotImplementedError("softcap: Keras takes attn_logits_soft_cap on JAX only")
        cap = {} if o.softcap is None else {"attn_logits_soft_cap": o.softcap}
        swap = keras.ops.swapaxes
        output = keras.ops.dot_product_attention(
            *(swap(x, 1, 2) for x in (query, key, value)),
            bias=o.bias,
            mask=o.mask,
            scale=o.scale,
            is_causal=o.causal,
            **cap,
        )
        return swap(output, 1, 2)

    return attention


# Name -> (the framework whose tensors the function takes, how to make it)
ADAPTERS: dict[str, tuple[str, Callable[[], Callable]]] = {
    "torch-sdpa": ("torch", torch_sdpa),
    "torch-sdpa-math": ("torch", lambda: torch_sdpa("math")),
    "torch-sdpa-efficient": ("torch", lambda: torch_sdpa("efficient")),
    "torch-sdpa-flash": ("torch", lambda: torch_sdpa("flash")),
    "torch-sdpa-cudnn": ("torch", lambda: torch_sdpa("cudnn")),
    "torch-flex": ("torch", torch_flex_attention),
    "jax": ("jax", jax_dot_product_attention),
    "jax-cudnn": ("jax", lambda: jax_dot_product_attention("cudnn")),
    "keras": ("tensorflow", keras_dot_product_attention),
}
