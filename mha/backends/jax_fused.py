"""JAX's fused attention for DotProductAttention.attend, apart from the layers a learner reads:
cuDNN's kernel (jax.nn.dot_product_attention(implementation="cudnn")) on a GPU, for the calls
it computes with mha's numbers, and mha's own steps everywhere else.

cuDNN adds a boolean mask to the scores as a large negative number, so a NaN or inf at a
masked key would reach the row; and it gives a row with no kept key the softmax of its
scores. It is taken only where neither can happen by construction, without reading a value:
the causal mask alone (its own, applied by position), or a mask that is the same for every
query and head (key padding, valid_lens), whose masked keys are zeroed first and whose rows
with no key are zeroed after. float16 and bfloat16 only (cuDNN's); no weights, log-sum-exp,
bias, soft cap, sinks or dropout; one head size for keys and values, a multiple of 8 up to 128.
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
        and queries.shape[-1] % 8 == 0
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
    batch_size, num_queries = queries.shape[0], queries.shape[-2]
    mask = attended = None
    if keep is not None and not causal_alone:
        # Shape of keep: (batch_size or 1, 1, 1, no. of keys)
        keep = keep.reshape((1,) * (4 - keep.ndim) + keep.shape)
        keys = jnp.where(keep[:, :, 0, :, None], keys, jnp.zeros((), keys.dtype))
        mask = jnp.broadcast_to(keep, (batch_size, 1, num_queries, keep.shape[-1]))
        attended = keep.any(axis=-1, keepdims=True)
    # jax.nn.dot_product_attention takes (batch, positions, heads, head size)
    output = jax.nn.dot_product_attention(
        *(jnp.swapaxes(x, 1, 2) for x in (queries, keys, values)),
        mask=mask,
        scale=1.0,
        is_causal=causal_alone,
        implementation="cudnn",
    )
    output = jnp.swapaxes(output, 1, 2)
    return output if attended is None else jnp.where(attended, output, jnp.zeros((), output.dtype))
