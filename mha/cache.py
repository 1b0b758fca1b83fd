"""The key-value cache of incremental decoding, the same in every backend.

A decoder generating one position at a time would project and attend the keys and values of
every earlier position again at each step. `MultiHeadAttention(..., cache=KVCache())` keeps
them instead: the call returns (output, cache), the cache now holding this call's keys and
values after those of the calls before, and the next call continues from it. Its numbers are
those of full causal attention over the whole sequence (a "dynamic" or "longrope" rope_scaling
up to its original length only: past it each call's frequencies follow that call's length, and
cached keys keep theirs, as in transformers). MultiHeadLatentAttention keeps a
`LatentCache` instead. The checks that a call's cache fits its layer, which mha.validation
makes, are here too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mha.tensors import LayerDtype, describe, require_dtype, require_tensor, same, shape_of

__all__ = ["KVCache", "LatentCache", "check_kv_cache", "check_latent_cache"]


class KVCache(NamedTuple):
    """The keys and values of the positions seen so far, as MultiHeadAttention made them
    (projected, and rotated with rope_theta): each (batch_size, num_kv_heads, no. of
    positions, head size), tensors of the layer's framework. `KVCache()`, both None, is the
    cache before the first call. A cache belongs to the layer that made it: its shapes, dtype
    and framework are checked, but not the weights or rotary angles that made its keys.

    A NamedTuple, so that it passes through torch.compile, tf.function, jax.jit (a pytree)
    and Gluon's hybridized calls as two tensors.
    """

    keys: Any = None
    values: Any = None


class LatentCache(NamedTuple):
    """What multi-head latent attention keeps of the positions seen so far: each position's
    compressed latent (batch_size, no. of positions, kv_lora_rank) and its rotary key, shared
    by the heads (batch_size, 1, no. of positions, rope head size), not the expanded keys and
    values. `LatentCache()`, both None, is the cache before the first call."""

    latent: Any = None
    rotary_keys: Any = None


# The checks of a call's cache, which mha.validation makes


def check_kv_cache(cache: Any, batch_size, num_kv_heads: int, head_size: int, dtype: LayerDtype):
    """The number of cached positions of a KVCache that fits the call and the layer."""
    if not isinstance(cache, KVCache):
        raise TypeError(
            "cache must be an mha.KVCache: KVCache() before the first call, then the cache the "
            f"previous call returned. Received: cache of type {type(cache).__name__}"
        )
    shape = (batch_size, num_kv_heads, None, head_size)
    described = (
        f"(batch_size, num_kv_heads, no. of positions, head size) = ({batch_size}, "
        f"{num_kv_heads}, positions, {head_size})"
    )
    return _cached_positions(
        cache, {"keys": (shape, described), "values": (shape, described)}, dtype
    )


def check_latent_cache(cache: Any, batch_size, kv_lora_rank: int, rope: int, dtype: LayerDtype):
    """The number of cached positions of a LatentCache that fits the call and the layer."""
    if not isinstance(cache, LatentCache):
        raise TypeError(
            "cache must be an mha.LatentCache: LatentCache() before the first call, then "
            f"the cache the previous call returned. Received: cache of type "
            f"{type(cache).__name__}"
        )
    expected = {
        "latent": (
            (batch_size, None, kv_lora_rank),
            f"(batch_size, no. of positions, kv_lora_rank) = ({batch_size}, positions, "
            f"{kv_lora_rank})",
        ),
        "rotary_keys": (
            (batch_size, 1, None, rope),
            f"(batch_size, 1, no. of positions, qk_rope_head_dim) = ({batch_size}, 1, "
            f"positions, {rope})",
        ),
    }
    return _cached_positions(cache, expected, dtype)


def _cached_positions(cache: Any, expected: dict[str, tuple[tuple, str]], dtype: LayerDtype):
    """The positions a cache holds: field -> (its shape, None at the positions' axis, and that
    shape in words); each field a tensor of that shape and the layer's dtype, or all None."""
    tensors = {field: getattr(cache, field) for field in expected}
    if all(tensor is None for tensor in tensors.values()):
        return 0
    positions = []
    for field, (shape, described) in expected.items():
        name, tensor = f"cache.{field}", tensors[field]
        require_tensor(name, tensor)
        require_dtype(name, tensor, dtype)
        actual = shape_of(tensor)
        if len(actual) != len(shape) or not all(map(same, actual, shape)):
            raise ValueError(
                f"{name} must have shape {described}. Received: {describe(name, tensor)}"
            )
        positions.append(actual[shape.index(None)])
    if not same(positions[0], positions[1]):
        raise ValueError(
            f"{' and '.join(f'cache.{field}' for field in expected)} must hold the same "
            "positions. Received: "
            + ", ".join(describe(f"cache.{field}", t) for field, t in tensors.items())
        )
    return positions[0]
