"""The JAX backend, with Flax NNX.

The NumPy reference (mha/backends/numpy.py) written with jax.numpy: the same definitions in
the same order, so that the two files read side by side. The layers are `flax.nnx.Module`s:
`module.train()` / `.eval()` decide dropout (a new layer trains, as in Flax), parameters and
dropout draw from the `rngs` a layer is given (`nnx.Rngs(0)` when none is), and every layer
runs under `nnx.jit`, and under jax.jit, jax.grad, jax.vmap and jax.export of a closure, with
the same numbers (a closure draws no dropout mask: there, train under `nnx.jit`). float32
products are computed in full float32 precision on every device.
The checks that need values (valid_lens are non-negative whole numbers) run when the call is
eager, as under TensorFlow's tf.function; shapes and dtypes are checked always.

`attention_weights` is a data attribute of the layer (MultiHeadAttention's reads its inner
attention's): after an eager call, and after a call under `nnx.jit`, which carries the layer's
new state out of the compiled function, it holds the weights of the last call. float64 needs
JAX's 64-bit mode (`jax.config.update("jax_enable_x64", True)`, or JAX_ENABLE_X64=1): without
it a float64 layer or array is an error, never float32 in disguise.

Shapes follow d2l, batch first: queries (batch_size, no. of queries, query_size),
keys (batch_size, no. of keys, key_size), values (batch_size, no. of keys, value_size).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha import function_checks, validation
from mha.adapter import Adapter
from mha.backends import jax_fused as fused
from mha.cache import KVCache, LatentCache
from mha.docstrings import documented
from mha.encoding import (
    alibi_slopes,
    frozen_rope_scaling,
    latent_attention_scale,
    rotary_angle_dtype,
    rotary_attention_factor,
    rotary_frequencies,
    rotary_frequencies_at,
    sinusoid_table,
)
from mha.masks import Masks, every_row_keeps_a_key, grouped_rows, is_causal_alone
from mha.tensors import in_machine_order
from mha.weights import canonical_parameters, read_config

__all__ = [
    "AddNorm",
    "AdditiveAttention",
    "DotProductAttention",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PositionalEncoding",
    "RotaryEmbedding",
    "dot_product_attention",
    "from_numpy",
    "masked_softmax",
    "to_numpy",
]


# ---------------------------------------------------------------------------------------------
# Conversion


def _require_x64(dtype: Any) -> None:
    if np.dtype(dtype) == np.float64 and not jax.config.jax_enable_x64:
        raise ValueError(
            "float64 needs JAX's 64-bit mode, which is off: without it JAX computes in "
            "float32. Turn it on before making arrays, with "
            'jax.config.update("jax_enable_x64", True) or JAX_ENABLE_X64=1'
        )


def to_numpy(x: Any) -> np.ndarray:
    """Return `x` as a numpy array (a copy on the host); bfloat16 stays ml_dtypes' bfloat16."""
    return np.asarray(x)


def _require_held_exactly(x: Any, name: str) -> None:
    """Without 64-bit mode JAX holds numpy's 64-bit integers as 32-bit ones, wrapping every
    value past their range into another number: such a value is an error."""
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "iu" or x.size == 0:
        return
    held = jax.dtypes.canonicalize_dtype(x.dtype)
    limits = np.iinfo(held)
    smallest, largest = x.min().item(), x.max().item()
    if smallest < limits.min or largest > limits.max:
        value = smallest if smallest < limits.min else largest
        raise ValueError(
            f"{name} holds {value}, past the range of {held.name}, in which JAX holds "
            f"{x.dtype.name} without its 64-bit mode: turn it on "
            '(jax.config.update("jax_enable_x64", True) or JAX_ENABLE_X64=1), or give values '
            f"that {held.name} holds (lengths past the last key may be clipped to it)"
        )


def from_numpy(array: Any) -> jax.Array:
    """Return `array` as a JAX array with numpy's dtype (float64 only in 64-bit mode; 64-bit
    integers without it only where 32 bits hold their values)."""
    array = in_machine_order(np.array(array))
    _require_x64(array.dtype)
    _require_held_exactly(array, "array")
    return jnp.asarray(array)


def to_device(x: Any, device: str) -> Any:
    """`x`, an array or a layer (its whole state), committed to the first device of the
    platform `device` names ("cpu", "gpu")."""
    target = jax.devices(device)[0]
    if isinstance(x, nnx.Module):
        nnx.update(x, jax.device_put(nnx.state(x), target))
        return x
    return jax.device_put(x, target)


# ---------------------------------------------------------------------------------------------
# Building blocks: Flax provides Dropout and LayerNorm; the dense layer here may be lazy

_DTYPES = {
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "float32": jnp.float32,
    "float64": jnp.float64,
}


def _checked_dtype(dtype: str) -> str:
    # A layer's dtype, refused where JAX would compute in float32 instead: at its making, and
    # at each call, 64-bit mode being a switch that may be turned off in between
    _require_x64(dtype)
    return dtype


def matmul_precision() -> jax.lax.Precision | None:
    """Full float32 precision on every device, as the reference computes: XLA's own default
    on a GPU is TF32. A precision the user sets with JAX's `jax.default_matmul_precision`
    (or its config option) is taken instead: None leaves the product to it."""
    chosen = jax.config.jax_default_matmul_precision
    return jax.lax.Precision.HIGHEST if chosen is None else None


def _summed_in(dtype: Any) -> Any:
    """float32 for half precision: its products summed in float32 and rounded once, as the
    reference and the kernels sum them (jax 0.7.1's CPU sums float16 ones in float16)."""
    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else None


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b at the layers' precision (_precision), half precision summed in float32."""
    summed_in = _summed_in(a.dtype)
    product = jnp.matmul(a, b, precision=matmul_precision(), preferred_element_type=summed_in)
    return product if summed_in is None else product.astype(a.dtype)


def _einsum(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum of two operands, as _matmul computes a product."""
    summed_in = _summed_in(a.dtype)
    product = jnp.einsum(subscripts, a, b, precision=matmul_precision(),
                         preferred_element_type=summed_in)
    return product if summed_in is None else product.astype(a.dtype)


def _set_if_allowed(module: nnx.Module, name: str, value: Any) -> bool:
    """Set an attribute of `module` where Flax lets it change: eagerly, and inside nnx.jit and
    nnx.grad, which carry the module in. Under jax.jit, jax.grad, jax.vmap or jax.export of a
    closure it cannot change, and keeps what it held; returns whether it was set."""
    try:
        setattr(module, name, value)
    except flax.errors.TraceContextError:
        return False
    return True


def _rngs(rngs: nnx.Rngs | None) -> nnx.Rngs:
    # The seeded default: layers made without rngs draw the same numbers every run
    return nnx.Rngs(0) if rngs is None else rngs


def _dropout(rate: float, rngs: nnx.Rngs) -> nnx.Dropout:
    """Flax's Dropout, drawing from rngs. At rate 0 it never draws and keeps no random stream,
    which nnx's transforms would carry in and out of every call; the stream is forked all the
    same, so that the weights drawn after it do not depend on the rate."""
    dropout = nnx.Dropout(rate, rngs=rngs)
    if rate == 0:
        dropout.rngs = None
    return dropout


_LAZY_UNDER_TRANSFORM = (
    "This layer's input sizes are not known yet: a lazy layer takes them at its first call, "
    "which cannot change the layer under jax.jit, jax.grad, jax.vmap or jax.export of a "
    "closure. Call it once eagerly (or under nnx.jit) first, or give its input sizes "
    "(query_size, key_size, value_size) when making it"
)


# Held while a lazy layer draws its weights at its first call
_INITIALIZING = threading.Lock()


class _Linear(nnx.Module):
    """y = x @ kernel + bias, kernel (in_features, out_features), uniform in
    +-1/sqrt(in_features) as torch.nn.Linear; in_features None: inferred at the first call."""

    def __init__(self, out_features: int, bias: bool, in_features: int | None, dtype: str,
                 rngs: nnx.Rngs):
        self.out_features, self.use_bias, self.dtype = out_features, bias, dtype
        self.in_features = None
        self.kernel = nnx.data(None)
        self.bias = nnx.data(None)
        # The key the parameters are drawn with, made now so that lazy layers are repeatable
        self.key = nnx.data(rngs.params())
        if in_features is not None:
            self.initialize(in_features)

    def initialize(self, in_features: int) -> None:
        bound = 1.0 / math.sqrt(in_features)
        kernel_key, bias_key = jax.random.split(self.key)
        dtype = _DTYPES[self.dtype]
        self.in_features = in_features
        kernel = nnx.Param(
            jax.random.uniform(kernel_key, (in_features, self.out_features), dtype, -bound, bound)
        )
        if self.use_bias:
            self.bias = nnx.Param(
                jax.random.uniform(bias_key, (self.out_features,), dtype, -bound, bound)
            )
        # Used once: a layer's state holds its parameters, and no key beside them
        self.key = None
        self.kernel = kernel  # last: a kernel there means the bias is there too

    def __call__(self, X: jax.Array) -> jax.Array:
        if self.kernel is None:
            with _INITIALIZING:  # first calls from several threads: one draw of the weights
                if self.kernel is None:
                    try:
                        self.initialize(X.shape[-1])
                    except flax.errors.TraceContextError:
                        raise ValueError(_LAZY_UNDER_TRANSFORM) from None
        # One 2-D product over all leading axes: the kernel's gradient is then X^T @ dY on the
        # flattened arrays, without the transposed copy of dY that a 3-D product's gradient makes
        leading = X.shape[:-1]
        Y = _matmul(X.reshape(math.prod(leading), X.shape[-1]), self.kernel[...])
        Y = Y.reshape(*leading, self.out_features)
        return Y if self.bias is None else Y + self.bias[...]


def _in_features(linear: _Linear) -> int | None:
    return linear.in_features


class _Sinks(nnx.Module):
    """Each head's sink logit, the layer's `bias` (zeros at first)."""

    def __init__(self, num_heads: int, dtype: str):
        self.bias = nnx.Param(jnp.zeros((num_heads,), _DTYPES[dtype]))


def _rms_normalized(X: jax.Array, eps: float) -> jax.Array:
    """X's last axis scaled to a mean square of 1 (float32 sums for half)."""
    x = X.astype(jnp.float64 if X.dtype == jnp.float64 else jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return x.astype(X.dtype)


class RMSNorm(nnx.Module):
    """Scale the last axis to a mean square of 1, then by scale (float32 sums for half)."""

    def __init__(self, num_hiddens: int, eps: float, dtype: str):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((num_hiddens,), _DTYPES[dtype]))

    def __call__(self, X: jax.Array) -> jax.Array:
        return self.scale[...] * _rms_normalized(X, self.eps)


class HeadLayerNorm(nnx.Module):
    """Each head's features of X (batch_size, num_heads, n, head size) to mean 0 and mean
    square 1, then scaled by that head's row of scale (num_heads, head size): StableLM's
    layer norm per head, without a shift (float32 sums for half)."""

    def __init__(self, num_heads: int, head_size: int, eps: float, dtype: str):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((num_heads, head_size), _DTYPES[dtype]))

    def __call__(self, X: jax.Array) -> jax.Array:
        x = X.astype(jnp.float64 if X.dtype == jnp.float64 else jnp.float32)
        x = x - jnp.mean(x, axis=-1, keepdims=True)
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return self.scale[...][:, None, :] * x.astype(X.dtype)


# ---------------------------------------------------------------------------------------------
# Masks

# The tensors a layer of this backend takes; another framework's is a TypeError
# numpy arrays are taken as jax.numpy takes them
_TENSOR_TYPES = (jax.Array, np.ndarray)


def _check_valid_lens_values(valid_lens: jax.Array | None) -> Any:
    """The one check that needs values: non-negative whole numbers. Returns the smallest
    length, None where the values were not read.

    It runs where the values are in host memory: a traced call (jit, grad of a jitted
    function) has none, and reading an array on a GPU or TPU would wait for the device."""
    if valid_lens is None or isinstance(valid_lens, jax.core.Tracer):
        return None
    if isinstance(valid_lens, np.ndarray) or _on_the_cpu(valid_lens):
        return validation.check_valid_lens_values(np.asarray(valid_lens))
    return None


def _on_the_cpu(x: jax.Array) -> bool:
    return all(device.platform == "cpu" for device in x.devices())


_INT32_MAX = 2**31 - 1
_FLOAT32_TOP = 2**31 - 128  # the largest float32 below 2**31: exact, and an int32


def _length_mask(valid_lens: jax.Array, num_keys: int) -> jax.Array:
    """Keep keys j < valid_len: shape (batch_size, 1, no. of keys) for 1-D valid_lens,
    (batch_size, no. of queries, no. of keys) for 2-D."""
    # Lengths past the last key keep every key: clipped first, so that any length of any
    # dtype (uint64 included) compares exactly as an int32. They are clipped to int32's
    # range, not to num_keys, which may be symbolic (jax.export) and which float16 or
    # bfloat16 would round; such lengths are exact in float32, where they are clipped
    # bfloat16 is a float that numpy does not class as one (its kind is "V")
    floating = jnp.issubdtype(valid_lens.dtype, jnp.floating)
    if floating:
        valid_lens = jnp.asarray(valid_lens)
        valid_lens = valid_lens.astype(jnp.promote_types(valid_lens.dtype, jnp.float32))
    top = _FLOAT32_TOP if floating else min(jnp.iinfo(valid_lens.dtype).max, _INT32_MAX)
    if isinstance(valid_lens, np.ndarray) and not floating:
        # numpy's lengths are clipped by numpy: without 64-bit mode JAX would hold 64-bit
        # ones as 32-bit ones first, wrapping those past 2**31 - 1
        valid_lens = np.minimum(valid_lens, top)
    lengths = jnp.minimum(valid_lens, top)
    # An unchecked (traced) fractional length keeps keys j < length, as torch's and TF's do
    lengths = (jnp.ceil(lengths) if floating else lengths).astype(jnp.int32)
    # Shape of lengths: (batch_size, 1 or no. of queries, 1)
    lengths = lengths[:, None, None] if lengths.ndim == 1 else lengths[:, :, None]
    return jnp.arange(num_keys, dtype=jnp.int32) < lengths


class _Masks(Masks):
    """mha.masks' rules in jax.numpy, for the scores of one call."""

    def length_mask(self, valid_lens):
        return _length_mask(valid_lens, self.num_keys)

    def causal_mask(self):
        # Not jnp.tri: some JAX releases count its diagonal in int32 even in 64-bit mode
        return self.query_positions() >= self.key_positions()

    def band_mask(self, width):
        # Shape of distances: (Q, K), query i being at position offset + i
        return jnp.abs(self.query_positions(width) - self.key_positions()) < width

    def chunk_mask(self, size):
        return self.query_positions(size) // size == self.key_positions() // size

    def distances(self, like, packed=None):
        if packed is not None:
            return packed.astype(like.dtype)
        return (self.key_positions() - self.query_positions()).astype(like.dtype)

    def query_positions(self, size: Any = 0):
        """(Q, 1): query i at position offset + i; `size`, a window or chunk size compared
        with them (see require_int32)."""
        self.require_int32(size)
        return jnp.arange(self.num_queries)[:, None] + self.offset

    def key_positions(self):
        """(1, K): key j at position j."""
        return jnp.arange(self.num_keys)[None, :]

    def require_int32(self, size: Any = 0, *, packed: bool = False) -> None:
        """Without 64-bit mode JAX counts positions in int32: an offset (alignment), window or
        chunk size whose positions pass its range is an error, not a wrapped number (packed:
        a size compared with positions within segments, which must fit it alone)."""
        if jax.config.jax_enable_x64:
            return
        known = sum(n for n in (self.num_queries, self.num_keys) if isinstance(n, int))
        for name, value, reach in (("the first query's position", self.offset, known),
                                   ("a side of a window, or a chunk size,", size,
                                    0 if packed else known)):  # fmt: skip
            if isinstance(value, int) and abs(value) + reach > _INT32_MAX:
                raise ValueError(
                    f"{name} is {value}: with {known} queries and keys its positions pass "
                    "int32's range, in which JAX counts them without its 64-bit mode. Turn it "
                    'on (jax.config.update("jax_enable_x64", True) or JAX_ENABLE_X64=1), or '
                    "give sizes of at most the positions there are"
                )

    def windows(self, window_mask):
        return jnp.tile(window_mask, (self.batch_size // window_mask.shape[0], 1, 1))

    def is_bool(self, windows):
        return windows.dtype == jnp.bool_

    def same_segment(self, segments):
        # numpy's ids that JAX would wrap into another id (no 64-bit mode) are refused
        for ids in segments:
            _require_held_exactly(ids, "segment_ids")
        return super().same_segment(segments)

    def segment_positions(self, segment_ids):
        # Shape of same: (batch_size, n, n); of earlier: (n, n), key j before query i
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        earlier = jnp.tri(segment_ids.shape[1], k=-1, dtype=bool)
        return (same & earlier).sum(axis=-1)

    def zeros_where(self, blocked, x):
        return jnp.where(blocked, jnp.zeros((), x.dtype), x)

    def cast_like(self, x, like):
        return x.astype(like.dtype)

    def widened(self, x):
        return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x

    def expand_dims(self, x, axis):
        return jnp.expand_dims(x, axis)


# ---------------------------------------------------------------------------------------------
# Masked softmax


def _softmax(scores: jax.Array, keep: jax.Array | None, empty_rows: str = "zeros",
             rows_kept: bool = False) -> jax.Array:
    """Softmax over the last axis on the kept entries; masked entries are exactly 0, and rows
    with no kept entry 0 or, with empty_rows="uniform", 1 / no. of keys. jax.nn.softmax
    subtracts the row maximum, so logits of 1e4 stay finite. A row with no kept key would be
    all -inf, NaN in softmax: its scores become 0 (finite values and gradients, uniform
    weights) and it is zeroed after unless empty_rows says uniform. Whatever a masked score
    holds (NaN included) is replaced, so it reaches neither the weights nor the gradients.
    rows_kept: every row of keep is known to keep a key (masks.every_row_keeps_a_key), so
    none is looked for."""
    if keep is None:
        return _float_softmax(scores)
    if rows_kept:
        return _float_softmax(jnp.where(keep, scores, jnp.asarray(-jnp.inf, scores.dtype)))
    # Shape of attended and fill: keep's, with 1 key
    attended = keep.any(axis=-1, keepdims=True)
    # Masked scores become -inf, and those of a row with no kept key 0 (finite, zeroed after)
    fill = jnp.where(attended, -jnp.inf, 0).astype(scores.dtype)
    weights = _float_softmax(jnp.where(keep, scores, fill))
    if empty_rows == "uniform":
        return weights
    return jnp.where(attended, weights, jnp.zeros((), weights.dtype))


def _float_softmax(scores: jax.Array) -> jax.Array:
    """jax.nn.softmax over the last axis; float16 and bfloat16 in float32, rounded once, as
    the reference: a float16 sum of a long row's exponentials passes 65504 (inf, every weight
    0), and bfloat16's steps of its exponentials and sum put weights several steps off."""
    if scores.dtype not in (jnp.float16, jnp.bfloat16):
        return jax.nn.softmax(scores, axis=-1)
    return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(scores.dtype)


@documented
def masked_softmax(X: jax.Array, valid_lens: jax.Array | None = None, *,
                   empty_rows: str = "zeros") -> jax.Array:
    """Softmax over the last axis of X, keeping only the first valid_lens keys of each row."""
    validation.check_masked_softmax_call(X, valid_lens, tensor_type=_TENSOR_TYPES,
                                         empty_rows=empty_rows)
    _require_x64(X.dtype)  # a numpy float64 X would be computed in float32
    _check_valid_lens_values(valid_lens)
    if valid_lens is None:
        return _softmax(X, None)
    # Shape of keep: (batch_size, 1 or no. of queries, no. of keys), then one axis per
    # middle axis of X so that it broadcasts against X
    keep = _length_mask(valid_lens, X.shape[-1])
    if X.ndim == 2:
        keep = keep[:, 0, :]
    keep = keep.reshape(keep.shape[:1] + (1,) * (X.ndim - 3) + keep.shape[1:])
    return _softmax(X, keep, empty_rows)


def _with_sinks(scores: jax.Array, keep: jax.Array | None, sinks: jax.Array):
    """The scores and keep with one more key at the end, each head's sink (sinks broadcastable
    to the scores' rows), which every row keeps."""
    rows = (*scores.shape[:-1], 1)
    column = jnp.broadcast_to(sinks, rows).astype(scores.dtype)
    if keep is not None:
        keep = jnp.broadcast_to(keep, scores.shape)
        keep = jnp.concatenate([keep, jnp.ones(rows, dtype=bool)], axis=-1)
    return jnp.concatenate([scores, column], axis=-1), keep


def _attention_pool(scores, values, keep, bias, dropout, need_weights=True,
                    empty_rows="zeros", sinks=None, rows_kept=False):
    """Weights = masked softmax of (scores + bias); output = dropout(weights) @ values."""
    if bias is not None:
        scores = scores + bias
    if sinks is not None:
        # gpt-oss: each head's sink joins every row's softmax as a key; its weight is dropped
        scores, keep = _with_sinks(scores, keep, sinks)
    weights = _softmax(scores, keep, empty_rows, rows_kept)
    if sinks is not None:
        weights = weights[..., :-1]
    return _matmul(dropout(weights), values), weights if need_weights else None


# ---------------------------------------------------------------------------------------------
# The attention function


def dot_product_attention(query, key, value, *, mask=None, bias=None, scale=None, causal=False,
                          alignment="top_left", window=None, valid_lens=None, softcap=None,
                          empty_rows="zeros", return_weights=False, return_lse=False,
                          segment_ids=None):
    """Attention of one call on (batch_size, heads, positions, head size): the NumPy
    reference's dot_product_attention (mha.backends.numpy, whose docstring has the
    arguments), in JAX."""
    sizes = function_checks.check_dot_product_attention_call(
        query, key, value, mask=mask, bias=bias, scale=scale, causal=causal,
        alignment=alignment, window=window, valid_lens=valid_lens, softcap=softcap,
        empty_rows=empty_rows, return_weights=return_weights, return_lse=return_lse,
        segment_ids=segment_ids, tensor_type=_TENSOR_TYPES,
    )
    _require_x64(query.dtype)  # numpy float64 inputs would be computed in float32
    smallest = _check_valid_lens_values(valid_lens)
    batch_size, num_heads, num_kv_heads, num_queries, num_keys = sizes
    offset = function_checks.first_position(alignment, num_queries, num_keys)
    masks = _Masks(batch_size, num_queries, num_keys, offset)
    # The causal mask alone, top-left aligned: the kernels' own causal mask where they have it
    alone = is_causal_alone(causal, offset, window, mask, bias, valid_lens, segment_ids)
    rows_kept = every_row_keeps_a_key(valid_lens, smallest, causal, offset, window, mask, bias,
                                      segment_ids)
    keep, bias = masks.function_masks(valid_lens, mask, causal,
                                      function_checks.window_sides(window), bias, segment_ids)
    # What the layers compute too, without dropout
    output, weights, lse = _attention(query, key, value, keep, bias, _no_dropout, scale=scale,
                                      softcap=softcap, empty_rows=empty_rows,
                                      need_weights=return_weights, lse=return_lse,
                                      group=num_heads // num_kv_heads, causal_alone=alone,
                                      rows_kept=rows_kept)
    if not (return_weights or return_lse):
        return output
    return (output, *(x for x in (weights, lse) if x is not None))


def _no_dropout(weights: jax.Array) -> jax.Array:
    """The function drops no weights: dropout is the layers'."""
    return weights


def _may_drop(dropout) -> bool:
    """Whether `dropout` may drop a weight in this call (a layer's, training, rate above 0)."""
    return dropout is not _no_dropout and dropout.rate > 0 and not dropout.deterministic


def _scaled(queries: jax.Array, scale: float | None) -> jax.Array:
    """The queries times the scale (1 / sqrt(d) by default), by a Python float (weak in JAX),
    where numpy's float64 would widen float32 queries in 64-bit mode; a half dtype's in
    float32, rounded once, as torch's: float16 holds a scale below 6.1e-5 in few bits."""
    if scale is None:
        return queries / math.sqrt(queries.shape[-1])
    if queries.dtype.itemsize == 2:
        return (queries.astype(jnp.float32) * float(scale)).astype(queries.dtype)
    return queries * float(scale)


def _divided(x: jax.Array, divisor: float) -> jax.Array:
    """x / divisor rounded once, as the reference: XLA turns a half-precision division by a
    constant into a product by its rounded reciprocal (a third of float16's quotients off)."""
    if x.dtype not in (jnp.float16, jnp.bfloat16):
        return x / divisor
    return (x.astype(jnp.float32) / divisor).astype(x.dtype)


def _attention(queries, keys, values, keep, bias, dropout, *, scale=None, softcap=None,
               empty_rows="zeros", need_weights=True, sinks=None, lse=False, group=1,
               causal_alone=False, rows_kept=False, fuse=True):
    """Attention on prepared inputs with any leading axes (no checks): what
    dot_product_attention and every layer's DotProductAttention.attend compute.

    queries (..., Q, d); keys (..., K, d) and values (..., K, v), with a head (axis -3) for
    every `group` heads of the queries; keep and bias broadcastable to the scores (..., Q, K),
    or None; sinks, each head's sink logit broadcastable to the scores' rows, or None;
    causal_alone: keep is the top-left causal mask and nothing else; rows_kept: every row of
    keep is known to keep a key (masks.every_row_keeps_a_key). Returns (output, weights, lse):
    weights unless need_weights, and each row's log-sum-exp unless lse, are None. With
    `fuse`, cuDNN's kernel computes the same numbers on a GPU where it can (jax_fused).
    """
    fusable = fuse and fused.may_fuse(
        queries, values, keep, causal_alone=causal_alone, empty_rows=empty_rows,
        others=need_weights or lse or any(x is not None for x in (bias, softcap, sinks)),
        dropping=_may_drop(dropout),
    )
    if group > 1 and not fusable:
        # Each key-value head's `group` query heads as one head of group x Q query rows: the
        # keys and values are read as they are (see masks.grouped_rows); cuDNN pairs them
        heads, rows = queries.shape[-3], queries.shape[-2]
        queries, keep, bias, sinks = (_grouped(x, heads, rows, group)
                                      for x in (queries, keep, bias, sinks))
        output, weights, row_lse = _attention(
            queries, keys, values, keep, bias, dropout, scale=scale, softcap=softcap,
            empty_rows=empty_rows, need_weights=need_weights, sinks=sinks, lse=lse,
            rows_kept=rows_kept, fuse=fuse)
        # Back to each query head: (..., heads, Q, v or K), and the rows' (..., heads, Q)
        output, weights = (None if x is None else x.reshape(*x.shape[:-3], heads, rows, x.shape[-1])
                           for x in (output, weights))
        return output, weights, None if row_lse is None else row_lse.reshape(
            *row_lse.shape[:-2], heads, rows)
    if fusable:
        scaled = _scaled(queries, scale)

        def unfused(queries, keys, values):  # the steps below, on any other device
            return _attention(queries, keys, values, keep, None, dropout, scale=1.0,
                              need_weights=False, group=group, rows_kept=rows_kept,
                              fuse=False)[0]

        output = fused.attend(scaled, keys, values, keep, causal_alone=causal_alone,
                              unfused=unfused)
        return output, None, None
    # The queries are scaled rather than the scores: Q x d numbers instead of Q x K
    queries = _scaled(queries, scale)
    # Shape of scores: (..., no. of queries, no. of keys)
    scores = _matmul(queries, jnp.swapaxes(keys, -1, -2))
    if softcap is not None:
        # Gemma 2's soft cap: the scores squashed into (-softcap, softcap), before the masks
        scores = float(softcap) * jnp.tanh(_divided(scores, float(softcap)))
    output, weights = _attention_pool(scores, values, keep, bias, dropout, need_weights,
                                      empty_rows, sinks, rows_kept)
    if not lse:
        return output, weights, None
    return output, weights, _log_sum_exp(scores if bias is None else scores + bias, keep)


def _grouped(x, heads: int, rows: int, group: int):
    """x (the queries, or a mask broadcastable to the scores or to their rows) with each
    key-value head's `group` query heads as one head of group x rows query rows."""
    sizes = None if x is None else grouped_rows(x.shape, heads, rows, group)
    return x if sizes is None else jnp.broadcast_to(x, sizes[0]).reshape(sizes[1])


def _log_sum_exp(scores: jax.Array, keep: jax.Array | None) -> jax.Array:
    """log(sum(exp(score))) of each row's kept scores, shape (..., no. of queries); -inf for a
    row with none (jax.nn.logsumexp gives it; float16 in float32, rounded once)."""
    if keep is not None:
        scores = jnp.where(keep, scores, jnp.asarray(-jnp.inf, scores.dtype))
    if scores.dtype != jnp.float16:
        return jax.nn.logsumexp(scores, axis=-1)
    return jax.nn.logsumexp(scores.astype(jnp.float32), axis=-1).astype(jnp.float16)


# ---------------------------------------------------------------------------------------------
# Layers


@documented
class DotProductAttention(nnx.Module):
    """Scaled dot-product attention: softmax(Q K^T / sqrt(d)) V.

    `rngs` (keyword) gives dropout its random stream; nnx.Rngs(0) when None.
    """

    def __init__(self, dropout: float = 0.0, *, scale: float | None = None,
                 empty_rows: str = "zeros", sliding_window: int | None = None,
                 softcap: float | None = None, dtype: str = "float32",
                 rngs: nnx.Rngs | None = None):
        self.dtype = _checked_dtype(
            validation.check_layer_args("DotProductAttention", locals())
        )
        self.scale, self.empty_rows, self.sliding_window = scale, empty_rows, sliding_window
        self.softcap = softcap
        self.dropout = _dropout(dropout, _rngs(rngs))
        self.attention_weights = nnx.data(None)

    def __call__(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                 window_mask=None, attn_bias=None, alignment=None,
                segment_ids=None):
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=_checked_dtype(self.dtype),
            tensor_type=_TENSOR_TYPES, same_query_key_size=True,
        )
        smallest = _check_valid_lens_values(valid_lens)
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, attn_bias=attn_bias,
                                   sliding_window=self.sliding_window,
                                   segment_ids=segment_ids)
        rows_kept = every_row_keeps_a_key(valid_lens, smallest, causal, offset, mask,
                                          window_mask, attn_bias, self.sliding_window,
                                          segment_ids)
        return self.attend(queries, keys, values, keep, bias, rows_kept=rows_kept)

    def attend(self, queries, keys, values, keep=None, bias=None, need_weights=True,
               sinks=None, group=1, causal_alone=False, rows_kept=False):
        """Attention on prepared inputs with any leading axes (no checks), as the attention
        function computes it (_attention).

        queries (..., Q, d), keys (..., K, d), values (..., K, v); keep and bias as made by
        _Masks.combine; sinks, each head's sink logit broadcastable to the scores' rows
        (num_heads, 1, 1), or None; causal_alone: keep is the causal mask alone, top-left;
        rows_kept: every row of keep is known to keep a key.
        MultiHeadAttention calls this with a head axis, keys and values with a head for every
        `group` heads of the queries.
        """
        output, weights, _ = _attention(
            queries, keys, values, keep, bias, self.dropout, scale=self.scale,
            softcap=self.softcap, empty_rows=self.empty_rows, need_weights=need_weights,
            sinks=sinks, group=group, causal_alone=causal_alone, rows_kept=rows_kept,
        )
        _set_if_allowed(self, "attention_weights", weights)
        return output


@documented
class AdditiveAttention(nnx.Module):
    """Additive attention: scores w_v^T tanh(W_q q + W_k k).

    `rngs` (keyword) gives the parameters and dropout their random streams; nnx.Rngs(0) when
    None.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, *, query_size: int | None = None,
                 key_size: int | None = None, empty_rows: str = "zeros",
                 sliding_window: int | None = None, dtype: str = "float32",
                 rngs: nnx.Rngs | None = None):
        self.dtype = _checked_dtype(
            validation.check_layer_args("AdditiveAttention", locals())
        )
        rngs = _rngs(rngs)
        self.num_hiddens, self.empty_rows = num_hiddens, empty_rows
        self.sliding_window = sliding_window
        self.W_q = _Linear(num_hiddens, False, query_size, self.dtype, rngs)
        self.W_k = _Linear(num_hiddens, False, key_size, self.dtype, rngs)
        self.w_v = _Linear(1, False, num_hiddens, self.dtype, rngs)
        self.dropout = _dropout(dropout, rngs)
        self.attention_weights = nnx.data(None)

    def __call__(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                 window_mask=None, attn_bias=None, alignment=None,
                segment_ids=None):
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=_checked_dtype(self.dtype),
            tensor_type=_TENSOR_TYPES,
            sizes=(("queries", "query_size", _in_features(self.W_q)),
                   ("keys", "key_size", _in_features(self.W_k))),
        )
        _check_valid_lens_values(valid_lens)
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, attn_bias=attn_bias,
                                   sliding_window=self.sliding_window,
                                   segment_ids=segment_ids)
        queries, keys = self.W_q(queries), self.W_k(keys)
        # After adding axes: queries (batch_size, no. of queries, 1, num_hiddens) and keys
        # (batch_size, 1, no. of keys, num_hiddens); their sum broadcasts to
        # (batch_size, no. of queries, no. of keys, num_hiddens)
        features = jnp.tanh(queries[:, :, None, :] + keys[:, None, :, :])
        # w_v has one output; shape of scores: (batch_size, no. of queries, no. of keys)
        scores = self.w_v(features)[..., 0]
        output, weights = _attention_pool(
            scores, values, keep, bias, self.dropout, empty_rows=self.empty_rows
        )
        _set_if_allowed(self, "attention_weights", weights)
        return output


def _query_scales(scaling, queries, offset, positions=None):
    """query_scaling's factor of each of the heads' queries (batch_size, heads, n, d), in
    their dtype: 1 + beta * log(1 + floor((p + o) / L)) (mha.encoding.query_scales) at positions
    offset, ..., offset + n - 1, (n, 1), or at each packed row's `positions` (batch_size, n),
    (batch_size, 1, n, 1)."""
    # float64 for float64 queries, else float32 (mha.encoding.rotary_angle_dtype)
    angle_dtype = jnp.float64 if queries.dtype == jnp.float64 else jnp.float32
    if positions is None:
        positions = jnp.arange(offset, offset + queries.shape[-2])
    else:
        positions = positions[:, None, :]
    # Python floats: a Python int past int32's range is an error to JAX without its 64-bit mode
    length = float(scaling["original_max_position_embeddings"])
    shifted = positions.astype(angle_dtype) + float(scaling.get("position_offset", 0))
    steps = jnp.floor(shifted / length)
    return (1 + scaling["beta"] * jnp.log1p(steps))[..., None].astype(queries.dtype)


@documented
class MultiHeadAttention(nnx.Module):
    """Multi-head attention: num_heads scaled dot-product attentions in parallel.

    `rngs` (keyword) gives the parameters and dropout their random streams; nnx.Rngs(0) when
    None. A `cache` (mha.KVCache, a pytree) passes in and out of nnx.jit; its length is part
    of its shape, so a jitted decoding loop traces once per cached length.
    """

    def __init__(self, num_hiddens: int, num_heads: int, dropout: float = 0.0,
                 bias: bool = False, *, query_size: int | None = None,
                 key_size: int | None = None, value_size: int | None = None,
                 out_bias: bool | None = None, out_features: int | None = None,
                 scale: float | None = None, empty_rows: str = "zeros",
                 sliding_window: int | None = None, attention_chunk_size: int | None = None,
                 num_kv_heads: int | None = None, rope_theta: float | None = None,
                 rope_interleaved: bool = False, rope_dim: int | None = None,
                 rope_scaling: dict | None = None, query_scaling: dict | None = None,
                 softcap: float | None = None, sinks: bool = False, qk_norm: str | None = None,
                 qk_norm_eps: float = 1e-6, output_gate: bool = False, alibi: bool = False,
                 value_norm: bool = False, dtype: str = "float32",
                 rngs: nnx.Rngs | None = None):
        self.dtype = _checked_dtype(
            validation.check_layer_args("MultiHeadAttention", locals())
        )
        rngs = _rngs(rngs)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bias
        self.out_bias, self.out_features, self.scale = out_bias, out_features, scale
        self.empty_rows, self.sliding_window = empty_rows, sliding_window
        self.attention_chunk_size, self.num_kv_heads = attention_chunk_size, num_kv_heads
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        self.rope_dim, self.rope_scaling = rope_dim, frozen_rope_scaling(rope_scaling)
        self.query_scaling, self.softcap = frozen_rope_scaling(query_scaling), softcap
        self.attention = DotProductAttention(dropout, scale=scale, empty_rows=empty_rows,
                                             softcap=softcap, dtype=self.dtype, rngs=rngs)
        # Keys and values have num_kv_heads heads of num_hiddens / num_heads features each
        head_size = num_hiddens // num_heads
        kv_hiddens = (num_kv_heads or num_heads) * head_size
        self.rotary = None if rope_theta is None else RotaryEmbedding(
            head_size, rope_theta, interleaved=rope_interleaved, rotary_dim=rope_dim,
            scaling=self.rope_scaling, dtype=self.dtype
        )
        self.W_q = _Linear(num_hiddens, bias, query_size, self.dtype, rngs)
        self.W_k = _Linear(kv_hiddens, bias, key_size, self.dtype, rngs)
        self.W_v = _Linear(kv_hiddens, bias, value_size, self.dtype, rngs)
        self.W_o = _Linear(out_features or num_hiddens, bias if out_bias is None else out_bias,
                           num_hiddens, self.dtype, rngs)
        # Each head's sink logit (gpt-oss)
        self.sinks = sinks
        if sinks:
            self.sink_logits = _Sinks(num_heads, self.dtype)
        self.qk_norm, self.qk_norm_eps, self.value_norm = qk_norm, qk_norm_eps, value_norm
        self._make_qk_norms(head_size, kv_hiddens, self.dtype)
        # Qwen3-Next's gate of each feature of the heads' output, projected from the queries
        self.output_gate = output_gate
        if output_gate:
            self.W_g = _Linear(num_hiddens, bias, query_size, self.dtype, rngs)
        # ALiBi's slope of each head (BLOOM, MPT): no weight, a constant of the head count
        self.alibi = alibi

    def _make_qk_norms(self, head_size: int, kv_hiddens: int, dtype: str) -> None:
        """The norms of queries and keys: RMSNorms over each head or the whole projection, or
        a layer norm of each head (StableLM: a scale for each head)."""
        eps = self.qk_norm_eps
        if self.qk_norm == "layer_norm_per_head":
            self.q_norm = HeadLayerNorm(self.num_heads, head_size, eps, dtype)
            self.k_norm = HeadLayerNorm(kv_hiddens // head_size, head_size, eps, dtype)
        elif self.qk_norm is not None:
            whole = self.qk_norm == "projection"
            sizes = (self.num_hiddens, kv_hiddens) if whole else (head_size,) * 2
            self.q_norm = RMSNorm(sizes[0], eps, dtype)
            self.k_norm = RMSNorm(sizes[1], eps, dtype)

    def __call__(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                 window_mask=None, head_mask=None, need_weights=True, attn_bias=None,
                 cache=None, alignment=None, segment_ids=None):
        num_kv_heads = self.num_kv_heads or self.num_heads
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, head_mask=head_mask, need_weights=need_weights,
            attn_bias=attn_bias, cache=cache, segment_ids=segment_ids,
            rope_scaling=self.rope_scaling, dtype=_checked_dtype(self.dtype),
            tensor_type=_TENSOR_TYPES,
            num_heads=self.num_heads, kv_heads=(num_kv_heads, self.num_hiddens // self.num_heads),
            sizes=(("queries", "query_size", _in_features(self.W_q)),
                   ("keys", "key_size", _in_features(self.W_k)),
                   ("values", "value_size", _in_features(self.W_v))),
        )
        smallest = _check_valid_lens_values(valid_lens)
        # The positions before this call's: those in the cache (a static size, even under jit)
        cached = 0 if cache is None or cache.keys is None else cache.keys.shape[2]
        # The position of the first query, for the masks: after the cached ones unless
        # alignment places it
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys, cached)
        # Shape of keep and bias: broadcastable to
        # (batch_size, num_heads, no. of queries, no. of keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset)
        slopes = _alibi_slopes(self.num_heads, self.dtype) if self.alibi else None
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, multihead=True,
                                   attn_bias=attn_bias, sliding_window=self.sliding_window,
                                   alibi_slopes=slopes, segment_ids=segment_ids,
                                   attention_chunk_size=self.attention_chunk_size)
        # Shape after project: (batch_size, num_heads, no. of queries,
        # num_hiddens / num_heads); keys and values have num_kv_heads heads
        gates = self.W_g(queries) if self.output_gate else None
        queries, keys, values = self.project(queries, keys, values)
        queries, keys = self.at_positions(queries, keys, cached, masks, segment_ids)
        if cache is not None:
            # This call's keys and values follow those of the positions before it
            if cache.keys is not None:
                keys = jnp.concatenate([cache.keys, keys], axis=2)
                values = jnp.concatenate([cache.values, values], axis=2)
            cache = KVCache(keys, values)
        # mha's causal mask alone, nothing cached: cuDNN's own causal mask where it applies
        others = (mask, window_mask, attn_bias, self.sliding_window, segment_ids,
                  self.attention_chunk_size)
        alone = is_causal_alone(causal, offset, valid_lens, slopes, *others)
        # No row of keep without a key, known from the lengths' values: none is looked for
        rows_kept = every_row_keeps_a_key(valid_lens, smallest, causal, offset, *others)
        # Shape of output: (batch_size, num_heads, no. of queries, num_hiddens / num_heads)
        sinks = self.sink_logits.bias[...].reshape(-1, 1, 1) if self.sinks else None
        output = self.attention.attend(queries, keys, values, keep, bias, need_weights, sinks,
                                       self.num_heads // num_kv_heads, alone, rows_kept)
        if head_mask is not None:
            # (num_heads,) -> (num_heads, 1, 1); (batch_size, num_heads) -> (B, num_heads, 1, 1)
            output = output * head_mask.astype(output.dtype).reshape((*head_mask.shape, 1, 1))
        # Shape of output_concat: (batch_size, no. of queries, num_hiddens)
        output_concat = self.transpose_output(output)
        output = self.W_o(output_concat if gates is None else output_concat * jax.nn.sigmoid(gates))
        return output if cache is None else (output, cache)

    # The weights are held once, by self.attention: nnx.jit carries one array out, not a copy
    @property
    def attention_weights(self) -> jax.Array | None:
        return self.attention.attention_weights

    @attention_weights.setter
    def attention_weights(self, weights: jax.Array | None) -> None:
        self.attention.attention_weights = weights

    def at_positions(self, queries, keys, cached, masks, segment_ids):
        """Each head's queries and keys at their positions cached, cached + 1, ... (packed
        sequences restart them at each segment): turned by the rotary embedding, normalized
        where qk_norm is "head_after_rotary", and the queries scaled by query_scaling."""
        query_positions, key_positions = masks.packed_positions(segment_ids)
        if self.rotary is not None:
            # The sequence, whose length may choose the frequencies, runs to the last key
            length = cached + keys.shape[-2]
            queries = self.rotary.rotate(queries, cached, length, query_positions)
            keys = self.rotary.rotate(keys, cached, length, key_positions)
        if self.qk_norm == "head_after_rotary":  # Hunyuan: the turned features normalized
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.query_scaling is not None:
            # Ministral 3: each query scaled by its position, past every L positions
            queries = queries * _query_scales(self.query_scaling, queries, cached,
                                              query_positions)
        return queries, keys

    def project(self, queries, keys, values):
        """Each head's queries, keys and values: projected, and where qk_norm says, queries
        and keys normalized (over the whole projection, or over each head); values too where
        value_norm says."""
        num_kv_heads = self.num_kv_heads or self.num_heads
        queries, keys = self.W_q(queries), self.W_k(keys)
        if self.qk_norm == "projection":
            # OLMo 2: the whole projection of each position normalized
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries = self.transpose_qkv(queries)
        keys = self.transpose_qkv(keys, num_kv_heads)
        values = self.transpose_qkv(self.W_v(values), num_kv_heads)
        if self.qk_norm in ("head", "layer_norm_per_head"):
            # Qwen3: each head's features normalized, by one scale the heads share; StableLM:
            # centered too, by a scale of each head's own
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.value_norm:  # Gemma 4: each head's values to a mean square of 1, no weight
            values = _rms_normalized(values, self.qk_norm_eps)
        return queries, keys, values

    def transpose_qkv(self, X: jax.Array, num_heads: int | None = None) -> jax.Array:
        """(batch_size, n, num_heads * head size) -> (batch_size, num_heads, n, head size),
        num_heads being the layer's unless given."""
        num_heads = num_heads or self.num_heads
        X = X.reshape(X.shape[0], X.shape[1], num_heads, self.num_hiddens // self.num_heads)
        return X.transpose(0, 2, 1, 3)

    def transpose_output(self, X: jax.Array) -> jax.Array:
        """Reverse transpose_qkv: -> (batch_size, n, num_hiddens)."""
        X = X.transpose(0, 2, 1, 3)
        return X.reshape(X.shape[0], X.shape[1], self.num_hiddens)


@documented
class MultiHeadLatentAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2 and V3, Kimi K2): the NumPy reference's
    MultiHeadLatentAttention (mha.backends.numpy), in JAX (Flax NNX)."""

    def __init__(self, num_hiddens: int, num_heads: int, *, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 q_lora_rank: int | None = None, dropout: float = 0.0, bias: bool = False,
                 rope_theta: float = 10000.0, rope_interleaved: bool = True,
                 rope_scaling: dict | None = None, query_scaling: dict | None = None,
                 norm_eps: float = 1e-6, sliding_window: int | None = None,
                 empty_rows: str = "zeros", dtype: str = "float32",
                 rngs: nnx.Rngs | None = None):
        rngs = _rngs(rngs)
        self.dtype = validation.check_layer_args("MultiHeadLatentAttention", locals())
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bias
        self.empty_rows, self.sliding_window = empty_rows, sliding_window
        self.kv_lora_rank, self.q_lora_rank, self.norm_eps = kv_lora_rank, q_lora_rank, norm_eps
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.rope_theta = v_head_dim, rope_theta
        self.rope_interleaved = rope_interleaved
        self.rope_scaling = frozen_rope_scaling(rope_scaling)
        self.query_scaling = frozen_rope_scaling(query_scaling)
        qk_head = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.W_q = _Linear(num_heads * qk_head, False, num_hiddens, self.dtype, rngs)
        else:  # queries through a low-rank pair, normalized between
            self.W_qa = _Linear(q_lora_rank, bias, num_hiddens, self.dtype, rngs)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps, self.dtype)
            self.W_qb = _Linear(num_heads * qk_head, False, q_lora_rank, self.dtype, rngs)
        # One projection gives each position's latent and its shared rotary key
        self.W_kva = _Linear(kv_lora_rank + qk_rope_head_dim, bias, num_hiddens, self.dtype, rngs)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps, self.dtype)
        self.W_kvb = _Linear(num_heads * (qk_nope_head_dim + v_head_dim), False, kv_lora_rank,
                             self.dtype, rngs)
        self.W_o = _Linear(num_hiddens, bias, num_heads * v_head_dim, self.dtype, rngs)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta, interleaved=rope_interleaved,
                                      scaling=self.rope_scaling, dtype=self.dtype)
        # 1 / sqrt(head size), times yarn's mscale twice when the rotary is scaled so
        self.scale = latent_attention_scale(qk_head, self.rope_scaling)
        self.dropout = _dropout(dropout, rngs)
        self.attention_weights = nnx.data(None)

    def __call__(self, X, valid_lens=None, *, mask=None, causal=False, window_mask=None,
                 need_weights=True, attn_bias=None, cache=None, absorbed=False):
        validation.check_latent_attention_call(
            X, valid_lens, mask=mask, causal=causal, window_mask=window_mask,
            need_weights=need_weights, attn_bias=attn_bias, cache=cache, absorbed=absorbed,
            dtype=_checked_dtype(self.dtype), num_hiddens=self.num_hiddens,
            num_heads=self.num_heads, latent_sizes=(self.kv_lora_rank, self.qk_rope_head_dim),
            tensor_type=_TENSOR_TYPES,
        )
        _check_valid_lens_values(valid_lens)
        batch_size, num_steps = X.shape[0], X.shape[1]
        # The positions before this call's: those in the cache
        cached = 0 if cache is None or cache.latent is None else cache.latent.shape[1]
        # Shape of queries: (batch_size, num_heads, no. of steps, nope + rope)
        queries = self.project_queries(X, cached)
        if self.query_scaling is not None:
            # Mistral 4: each query scaled by its position, past every L positions
            queries = queries * _query_scales(self.query_scaling, queries, cached)
        # Shape of latent: (batch_size, no. of steps, kv_lora_rank); of rotary_keys:
        # (batch_size, 1, no. of steps, rope), one rotary key for every head
        latent, rotary_keys = self.compress(X, cached)
        if cache is not None:
            # This call's latents and rotary keys follow those of the positions before it
            if cache.latent is not None:
                latent = jnp.concatenate([cache.latent, latent], axis=1)
                rotary_keys = jnp.concatenate([cache.rotary_keys, rotary_keys], axis=2)
            cache = LatentCache(latent, rotary_keys)
        masks = _Masks(batch_size, num_steps, latent.shape[1], cached)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, multihead=True,
                                   attn_bias=attn_bias, sliding_window=self.sliding_window)
        attend = self.attend_absorbed if absorbed else self.attend_expanded
        output = attend(queries, latent, rotary_keys, keep, bias, need_weights)
        # Shape of output: (batch_size, no. of steps, num_heads * v_head_dim), sized
        # (not -1): the batch may be empty
        width = self.num_heads * self.v_head_dim
        output = self.W_o(output.transpose(0, 2, 1, 3).reshape(batch_size, num_steps, width))
        return output if cache is None else (output, cache)

    def attend_expanded(self, queries, latent, rotary_keys, keep, bias, need_weights):
        """Attention over each head's keys and values, expanded from the latent."""
        keys, values = self.expand(latent, rotary_keys)
        output, weights, _ = _attention(
            queries, keys, values, keep, bias, self.dropout, scale=self.scale,
            empty_rows=self.empty_rows, need_weights=need_weights,
        )
        _set_if_allowed(self, "attention_weights", weights)
        return output

    def attend_absorbed(self, queries, latent, rotary_keys, keep, bias, need_weights):
        """The same numbers with W_kvb folded into the queries and the output (multi-query
        attention over the latent; see the NumPy reference)."""
        # W_kvb per head: its key part W_uk (kv_lora_rank, H, nope), value part W_uv
        W = self.W_kvb.kernel[...].reshape(self.kv_lora_rank, self.num_heads, -1)
        W_uk, W_uv = W[..., : self.qk_nope_head_dim], W[..., self.qk_nope_head_dim :]
        # Shape of absorbed: (batch_size, num_heads, no. of steps, kv_lora_rank)
        absorbed = _einsum("bhqn,rhn->bhqr", queries[..., : self.qk_nope_head_dim], W_uk)
        queries = jnp.concatenate([absorbed, queries[..., self.qk_nope_head_dim :]], axis=-1)
        keys = jnp.concatenate([latent[:, None], rotary_keys], axis=-1)
        output, weights, _ = _attention(
            queries, keys, latent[:, None], keep, bias, self.dropout, scale=self.scale,
            empty_rows=self.empty_rows, need_weights=need_weights, group=self.num_heads,
        )
        _set_if_allowed(self, "attention_weights", weights)
        # Shape of output: (batch_size, num_heads, no. of steps, v_head_dim)
        return _einsum("bhqr,rhv->bhqv", output, W_uv)

    def project_queries(self, X, offset=0):
        """Each head's query at positions offset, ..., its rotary part turned: (batch_size,
        num_heads, n, nope + rope)."""
        Q = self.W_q(X) if self.q_lora_rank is None else self.W_qb(self.q_norm(self.W_qa(X)))
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        Q = Q.reshape(*X.shape[:2], self.num_heads, qk_head).transpose(0, 2, 1, 3)
        rotated = self.rotary.rotate(Q[..., self.qk_nope_head_dim :], offset)
        return jnp.concatenate([Q[..., : self.qk_nope_head_dim], rotated], axis=-1)

    def compress(self, X, offset=0):
        """(latent (batch_size, n, kv_lora_rank), normalized; the rotary key (batch_size, 1,
        n, rope) at positions offset, ..., turned): what a latent cache keeps."""
        compressed = self.W_kva(X)
        latent = self.kv_norm(compressed[..., : self.kv_lora_rank])
        rotary_keys = self.rotary.rotate(compressed[:, None, :, self.kv_lora_rank :], offset)
        return latent, rotary_keys

    def expand(self, latent, rotary_keys):
        """Each head's keys (batch_size, num_heads, n, nope + rope) and values (batch_size,
        num_heads, n, v_head_dim) from the latent, the rotary key shared by the heads."""
        kv_head = self.qk_nope_head_dim + self.v_head_dim
        KV = self.W_kvb(latent).reshape(*latent.shape[:2], self.num_heads, kv_head)
        KV = KV.transpose(0, 2, 1, 3)
        keys_nope, values = KV[..., : self.qk_nope_head_dim], KV[..., self.qk_nope_head_dim :]
        shared = jnp.broadcast_to(rotary_keys, (*keys_nope.shape[:-1], self.qk_rope_head_dim))
        return jnp.concatenate([keys_nope, shared], axis=-1), values


@documented
class PositionalEncoding(nnx.Module):
    """Add the sinusoidal positional encoding P to X, then dropout.

    P is a constant of the layer's sizes and dtype, not part of its state; `rngs` (keyword)
    gives dropout its random stream, nnx.Rngs(0) when None.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32", rngs: nnx.Rngs | None = None):
        self.dtype = _checked_dtype(
            validation.check_layer_args("PositionalEncoding", locals())
        )
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.dropout = _dropout(dropout, _rngs(rngs))

    @property
    def P(self) -> jax.Array:
        return jnp.asarray(_table(self.max_len, self.num_hiddens, self.dtype))

    def __call__(self, X: jax.Array) -> jax.Array:
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, _checked_dtype(self.dtype),
            tensor_type=_TENSOR_TYPES,
        )
        X = X + _table(self.max_len, self.num_hiddens, self.dtype)[:, : X.shape[1], :]
        return self.dropout(X)


@functools.cache
def _table(max_len: int, num_hiddens: int, dtype: str) -> np.ndarray:
    # Computed in float64 and cast once, per size and dtype. Held in host memory, as are
    # _alibi_slopes' and _frequencies': a jitted program takes such a constant from the host,
    # where one on a GPU would be read back to the host to build it
    return sinusoid_table(max_len, num_hiddens).astype(dtype)


@documented
class LearnedPositionalEncoding(nnx.Module):
    """Add a learned positional embedding to X, then dropout: P is a weight, one row per
    position, trained with the rest.

    flax.nnx.Embed holds P as its `embedding` parameter, drawn with Flax's default initializer;
    `rngs` (keyword) gives it and dropout their random streams, nnx.Rngs(0) when None.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32", rngs: nnx.Rngs | None = None):
        self.dtype = _checked_dtype(
            validation.check_layer_args("LearnedPositionalEncoding", locals())
        )
        rngs = _rngs(rngs)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.dropout = _dropout(dropout, rngs)
        self.embedding = nnx.Embed(max_len, num_hiddens, dtype=_DTYPES[self.dtype],
                                   param_dtype=_DTYPES[self.dtype], rngs=rngs)

    def __call__(self, X: jax.Array) -> jax.Array:
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, _checked_dtype(self.dtype),
            tensor_type=_TENSOR_TYPES,
        )
        # Shape of P: (1, no. of steps, num_hiddens), the rows of positions 0, 1, ...
        P = self.embedding(jnp.arange(X.shape[1]))[None]
        return self.dropout(X + P)


@documented
class RotaryEmbedding(nnx.Module):
    """Rotary position embeddings (RoPE): each pair of features turned by an angle that grows
    with the position.

    The frequencies are a constant of the layer's size, base and dtype, not part of its state;
    the layer has no weights and no randomness.
    """

    def __init__(self, num_hiddens: int, theta: float = 10000.0, *, interleaved: bool = False,
                 rotary_dim: int | None = None, scaling: dict | None = None,
                 dtype: str = "float32"):
        self.dtype = _checked_dtype(
            validation.check_layer_args("RotaryEmbedding", locals())
        )
        self.num_hiddens, self.theta, self.interleaved = num_hiddens, theta, interleaved
        self.rotary_dim, self.scaling = rotary_dim, frozen_rope_scaling(scaling)
        # The first `rotated` features turn, in pairs; the others pass (partial rotary)
        self.rotated = rotary_dim or num_hiddens
        # The factor of the cosines and sines: a yarn or longrope scaling's, else 1
        self.attention_factor = rotary_attention_factor(self.scaling)

    @property
    def frequencies(self) -> jax.Array:
        # Shape of frequencies: (rotated / 2,), one angle per position for each pair
        return jnp.asarray(_frequencies(self.rotated, self.theta, self.scaling, self.dtype))

    def __call__(self, X: jax.Array, offset: int = 0) -> jax.Array:
        validation.check_rotary_call(
            X, offset, self.num_hiddens, _checked_dtype(self.dtype), tensor_type=_TENSOR_TYPES
        )
        return self.rotate(X, offset)

    def rotate(self, X: jax.Array, offset: int = 0, length=None, positions=None) -> jax.Array:
        """X (..., n, num_hiddens) at positions offset, ..., offset + n - 1, rotated (no
        checks). `length`, the sequence's (offset + n when None), picks the frequencies of a
        dynamic or longrope scaling. `positions` (batch_size, n), each row's own (packed
        sequences, X (batch_size, heads, n, num_hiddens)), replace offset's. MultiHeadAttention
        calls this on each head's queries and keys."""
        # Shape of angles, cos and sin: (n, rotated / 2), or (batch_size, 1, n, rotated / 2)
        n = X.shape[-2]
        frequencies = self.frequencies_at(offset + n if length is None else length)
        if positions is None and isinstance(n, int) and offset + n - 1 <= _INT32_MAX:
            # Whole positions, each rounded once, as the reference's
            positions = jnp.arange(offset, offset + n).astype(frequencies.dtype)
        elif positions is None:
            # Without 64-bit mode JAX's integers stop at 2**31 - 1, and an exported length
            # (symbolic) bounds none: counted in the angles' dtype, 1 to 2 off past 2**24
            positions = jnp.arange(offset, offset + n, dtype=frequencies.dtype)
        else:
            # Packed sequences: each row's own positions, (batch_size, 1, n) against the heads
            positions = positions[:, None, :].astype(frequencies.dtype)
        angles = positions[..., None] * frequencies
        cos = (jnp.cos(angles) * self.attention_factor).astype(X.dtype)
        sin = (jnp.sin(angles) * self.attention_factor).astype(X.dtype)
        # The features that turn; shape of X: (..., n, rotated)
        X, rest = X[..., : self.rotated], X[..., self.rotated :]
        # The two features of each pair; shape of x1 and x2: (..., n, rotated / 2)
        half = self.rotated // 2
        if self.interleaved:
            x1, x2 = X[..., 0::2], X[..., 1::2]
        else:
            x1, x2 = X[..., :half], X[..., half:]
        # Each pair turned by its angle: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if self.interleaved:
            Y = jnp.stack([y1, y2], axis=-1).reshape(X.shape)
        else:
            Y = jnp.concatenate([y1, y2], axis=-1)
        return Y if rest.shape[-1] == 0 else jnp.concatenate([Y, rest], axis=-1)

    def frequencies_at(self, length: int) -> jax.Array:
        """The frequencies of a call over positions 0, ..., length - 1: the layer's, or those
        a dynamic or longrope scaling gives a sequence longer than it was trained on. A
        length jax.export leaves symbolic: longrope then picks in the program, and dynamic,
        whose frequencies change with every length, needs it known."""
        dtype = rotary_angle_dtype(self.dtype)
        if self.scaling is None or self.scaling["rope_type"] not in ("dynamic", "longrope"):
            return self.frequencies
        if isinstance(length, int):
            longer = rotary_frequencies_at(self.rotated, self.theta, self.scaling, length)
            return self.frequencies if longer is None else jnp.asarray(longer.astype(dtype))
        original = self.scaling["original_max_position_embeddings"]
        if self.scaling["rope_type"] == "longrope":
            longer = rotary_frequencies(self.rotated, self.theta, self.scaling, original + 1)
            # The last position, length - 1, past the original ones: from a size
            last = jnp.arange(length)[-1]
            return jnp.where(last >= original, jnp.asarray(longer.astype(dtype)), self.frequencies)
        raise ValueError(
            "a dynamic rotary scaling computes its frequencies from the sequence's length, "
            "which this exported program leaves symbolic: export with a static number of "
            "positions (and a cache of a static length)"
        )


@functools.cache
def _alibi_slopes(num_heads: int, dtype: str) -> np.ndarray:
    # (num_heads, 1, 1), computed in float64 and cast once, in host memory as _table's
    return alibi_slopes(num_heads).astype(dtype).reshape(-1, 1, 1)


@functools.cache
def _frequencies(num_hiddens: int, theta: float, scaling, dtype: str) -> np.ndarray:
    # Computed in float64 and cast once to the angles' dtype (float64 for float64 layers, else
    # float32), in host memory as _table's
    return rotary_frequencies(num_hiddens, theta, scaling).astype(rotary_angle_dtype(dtype))


@documented
class AddNorm(nnx.Module):
    """The residual step after attention: LayerNorm(X + dropout(Y)) over the last axis.

    `rngs` (keyword) gives dropout its random stream; nnx.Rngs(0) when None.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, *, eps: float = 1e-5,
                 dtype: str = "float32", rngs: nnx.Rngs | None = None):
        self.dtype = _checked_dtype(
            validation.check_layer_args("AddNorm", locals())
        )
        rngs = _rngs(rngs)
        self.num_hiddens, self.eps = num_hiddens, eps
        self.dropout = _dropout(dropout, rngs)
        # Flax's fast variance, E[x^2] - E[x]^2, loses digits that the reference keeps
        self.ln = nnx.LayerNorm(num_hiddens, epsilon=eps, dtype=_DTYPES[self.dtype],
                                param_dtype=_DTYPES[self.dtype], use_fast_variance=False,
                                rngs=rngs)

    def __call__(self, X: jax.Array, Y: jax.Array) -> jax.Array:
        validation.check_add_norm_call(
            X, Y, self.num_hiddens, _checked_dtype(self.dtype), tensor_type=_TENSOR_TYPES
        )
        return self.ln(self.dropout(Y) + X)


# ---------------------------------------------------------------------------------------------
# Canonical weights (used by mha.get_weights / mha.set_weights; see mha/weights.py)


def layer_config(layer: nnx.Module) -> dict[str, Any]:
    """The constructor arguments of `layer`, with sizes inferred so far."""
    return read_config(layer, _in_features, lambda dropout: dropout.rate)


# How this backend keeps each kind of parameter of mha.weights.weight_places: the attribute,
# and whether it holds the canonical array transposed (_Linear keeps the kernel as (in, out))
PARAMETERS = {
    "kernel": ("kernel", False),
    "bias": ("bias", False),
    "scale": ("scale", False),
    "shift": ("bias", False),
    "table": ("embedding", False),
}


def read_parameter(parameter: nnx.Param, transposed: bool) -> np.ndarray:
    """A fresh numpy copy of a parameter, in the canonical layout."""
    value = np.array(parameter[...])
    return value.T.copy() if transposed else value


def write_parameter(sublayer: nnx.Module, kind: str, value: np.ndarray) -> None:
    """Set the sub-layer's parameter of that kind to a canonical array, making a lazy
    _Linear's parameters first. The parameter stays the same nnx.Param object."""
    name, transposed = PARAMETERS[kind]
    if kind == "kernel" and _in_features(sublayer) is None:
        sublayer.initialize(value.shape[0])
    parameter = getattr(sublayer, name)
    # A copy: on the CPU jnp.asarray may wrap the caller's array, which the layer would share
    parameter[...] = jnp.array(value.T if transposed else value, parameter[...].dtype, copy=True)


def without_gradients():
    """A context in which calls record no gradients: JAX records none outside jax.grad."""
    return contextlib.nullcontext()


def value_and_gradients(function, tensors, wrt, layer, cotangent):
    """Run `function(tensors)` and differentiate sum(output * cotangent) with jax.grad, in
    one program under jax.jit.

    Flax modules are not mutated inside another trace: the differentiated function calls a
    layer merged inside it from the traced weights (`function(tensors, other=layer)`), as
    nnx.grad does. The layer itself is then called once more, eagerly, so that it keeps the
    concrete attention_weights of this call.

    Returns:
        (output, input gradients keyed by the names in `wrt`, weight gradients keyed by
        canonical names in the canonical layout), all numpy arrays. Used by mha.harness.
    """
    if layer is not None:
        graphdef, weights, rest = nnx.split(layer, nnx.Param, ...)
    else:
        weights, rest = {}, None
    # Every array is an argument of the program, as a training step's inputs are (a constant
    # would be folded into it); the options that are not arrays stay Python values
    arrays = {k: v for k, v in tensors.items() if k not in wrt and isinstance(v, jax.Array)}
    fixed = {k: v for k, v in tensors.items() if k not in wrt and k not in arrays}

    def loss(inputs, weights, arrays, rest, cotangent):
        arguments = {**fixed, **arrays, **inputs}
        if layer is None:
            output = function(arguments)
        else:
            output = function(arguments, other=nnx.merge(graphdef, weights, rest))
        return jnp.sum(output * cotangent), output

    # Under jax.jit, as a training step runs: one compiled program, where eager JAX compiles
    # each operation for each new shape (the call without gradients stays eager)
    (_, output), (input_gradients, weight_gradients) = jax.jit(jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True
    ))({name: tensors[name] for name in wrt}, weights, arrays, rest, cotangent)
    if layer is not None:
        function(tensors)
        # The gradients have the weights' structure: a layer holding them names them
        gradients = canonical_parameters(nnx.merge(graphdef, weight_gradients, rest), PARAMETERS)
        weight_gradients = {name: read_parameter(*held) for name, held in gradients.items()}
    return (
        to_numpy(output),
        {name: to_numpy(g) for name, g in input_gradients.items()},
        weight_gradients,
    )


# What mha's glue needs beside the layers
ADAPTER = Adapter(
    to_numpy, from_numpy, layer_config, PARAMETERS, read_parameter, write_parameter,
    without_gradients, value_and_gradients, to_device=to_device,
)
