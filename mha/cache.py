"""The key-value cache of incremental decoding, the same in every backend.

A decoder generating one position at a time would project and attend the keys and values of
every earlier position again at each step. `MultiHeadAttention(..., cache=KVCache())` keeps
them instead: the call returns (output, cache), the cache now holding this call's keys and
values after those of the calls before, and the next call continues from it. Its numbers are
those of full causal attention over the whole sequence.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["KVCache", "LatentCache"]


class KVCache(NamedTuple):
    """The keys and values of the positions seen so far, as MultiHeadAttention made them
    (projected, and rotated with rope_theta): each (batch_size, num_kv_heads, no. of
    positions, head size), tensors of the layer's framework. `KVCache()`, both None, is the
    cache before the first call.

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
