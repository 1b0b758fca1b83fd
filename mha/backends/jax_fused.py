"""JAX's fused attention for DotProductAttention.attend, apart from the layers a learner reads:
cuDNN's kernel (jax.nn.dot_product_attention(implementation="cudnn")) on a GPU, for the calls
it computes with mha's numbers, and mha's own steps everywhere else.

cuDNN adds a boolean mask to the scores as a large negative number, so a NaN or inf at a
masked key would reach the row; and it gives a row with no kept key the softmax of its
scores. It is taken only where neither can happen by construction, without reading a value:
the causal mask alone (its own, applied by position), or a mask that is the same for every
query and head (key padding, valid_lens), whose masked keys are zeroed first and whose rows
with no key are zeroed after. Such a mask that keeps a prefix of the keys (valid_lens, right
padding) reaches the kernel as its sequence lengths, which it reads instead of a mask of
every score; which of the two is decided on the device (jax.lax.cond), without a host read.
float16 and bfloat16 only (cuDNN's); no weights, log-sum-exp, bias, soft cap, sinks or
dropout; one head size for keys and values, a multiple of 8 up to 128; key-value heads
fewer than the query heads are the kernel's to pair.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["attend", "may_fuse"]


def may_fuse(
    queries, values, keep, *, causal_alone: bool, others: bool, dropping: bool, empty_rows: str
) -> bool:
    """Whether cuDNN's kernel may compute the call on a GPU, from what is known when tracing:
    `others`, whether anything but keep and scale is asked (weights, lse, bias, soft cap,
    sinks); `dropping`, whether dropout may drop."""
    if keep is not None and not causal_alone:
        # Only a mask that is the same for every head and query: (batch_size or 1, 1, 1, K)
        shape = (1,) * (4 - keep.ndim) + keep.shape
        if keep.ndim > 4 or shape[1:3] != (1, 1):
            return False
    return (
        not others
        and not dropping
        and empty_rows == "zeros"
        and queries.ndim == 4
        and queries.dtype in (jnp.float16, jnp.bfloat16)
        and queries.shape[-1] == values.shape[-1]
        # cuDNN's head sizes on every GPU it runs on (Hopper's 256 left to mha's own steps)
        and 0 < queries.shape[-1] and queries.shape[-1] % 8 == 0
        and queries.shape[-1] <= 128
    )


def attend(queries, keys, values, keep, *, causal_alone: bool, unfused: Callable):
    """The output (batch, heads, Q, v) of scaled queries: cuDNN's on a GPU, `unfused(queries,
    keys, values)` (mha's own steps) on other devices, or everywhere when cuDNN cannot take
    the call here (no GPU or cuDNN, a head size it lacks: JAX refuses it while tracing)."""

    def cudnn(queries, keys, values):
        return _cudnn(queries, keys, values, keep, causal_alone)

    try:
        return jax.lax.platform_dependent(queries, keys, values, cuda=cudnn, default=unfused)
    except Exception:  # cuDNN refused the call while tracing: mha's own steps compute it
        return unfused(queries, keys, values)


def _cudnn(queries, keys, values, keep, causal_alone: bool):
    """cuDNN's attention on (batch, heads, positions, head size): its causal mask, or keep
    (the same for every query and head) with the keys it masks zeroed and empty rows zeroed."""
    if keep is None or causal_alone:
        return _kernel(queries, keys, values, is_causal=causal_alone)
    # Shape of keep: (batch_size or 1, 1, 1, no. of keys)
    keep = keep.reshape((1,) * (4 - keep.ndim) + keep.shape)
    keys = jnp.where(keep[:, :, 0, :, None], keys, jnp.zeros((), keys.dtype))
    batch_size, num_queries = queries.shape[0], queries.shape[-2]
    lengths, prefix = _prefix_lengths(keep)
    # A row with no key reads key 0 (its output is zeroed after): no row of the kernel is empty
    lengths = jnp.broadcast_to(jnp.maximum(lengths, 1), (batch_size,))

    def by_lengths(queries, keys, values):
        every_query = jnp.full((batch_size,), num_queries, jnp.int32)
        return _kernel(queries, keys, values, query_seq_lengths=every_query,
                       key_value_seq_lengths=lengths)

    def by_mask(queries, keys, values):
        mask = jnp.broadcast_to(keep, (batch_size, 1, num_queries, keep.shape[-1]))
        return _kernel(queries, keys, values, mask=mask)

    output = jax.lax.cond(prefix, by_lengths, by_mask, queries, keys, values)
    attended = keep.any(axis=-1, keepdims=True)
    return jnp.where(attended, output, jnp.zeros((), output.dtype))


def _prefix_lengths(keep):
    """(lengths, prefix) of keep (batch_size or 1, 1, 1, K): each row's number of kept keys,
    int32 (batch_size or 1,), and whether every row keeps exactly its first `length` keys, a
    boolean array on the device."""
    lengths = keep.sum(axis=-1, dtype=jnp.int32).reshape(-1)
    first = jnp.arange(keep.shape[-1]) < lengths[:, None, None, None]
    return lengths, jnp.all(keep == first)


def _kernel(queries, keys, values, **masks):
    """jax.nn.dot_product_attention's cuDNN kernel on scaled queries (batch, heads, Q, d),
    which it takes as (batch, positions, heads, head size)."""
    output = jax.nn.dot_product_attention(
        *(jnp.swapaxes(x, 1, 2) for x in (queries, keys, values)),
        scale=1.0,
        implementation="cudnn",
        **masks,
    )
    return jnp.swapaxes(output, 1, 2)
