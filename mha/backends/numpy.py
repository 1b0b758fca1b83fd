"""The NumPy reference backend.

Plain numpy, written to be read: every other backend is held to these numbers. The layers are
small Python classes with a `training` attribute (False by default), `train()` / `eval()`
methods and `forward` behind `__call__`, so that they read like the torch and Gluon code next
to them. Dropout draws from numpy's global generator: `np.random.seed(0)` makes it repeatable.

Shapes follow d2l, batch first: queries (batch_size, no. of queries, query_size),
keys (batch_size, no. of keys, key_size), values (batch_size, no. of keys, value_size).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from mha import function_checks, validation
from mha.adapter import Adapter
from mha.cache import KVCache, LatentCache
from mha.docstrings import documented
from mha.encoding import (
    alibi_slopes,
    frozen_rope_scaling,
    latent_attention_scale,
    query_scales,
    rotary_angle_dtype,
    rotary_attention_factor,
    rotary_frequencies,
    rotary_frequencies_at,
    sinusoid_table,
)
from mha.masks import Masks
from mha.tensors import in_machine_order
from mha.weights import read_config

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


def to_numpy(x: Any) -> np.ndarray:
    """Return `x` as a numpy array (the numpy backend's tensors already are)."""
    return np.asarray(x)


def from_numpy(array: Any) -> np.ndarray:
    """Return `array` as this backend's tensor (a numpy array)."""
    return in_machine_order(np.asarray(array))


# ---------------------------------------------------------------------------------------------
# Building blocks that the frameworks provide and numpy does not


class Module:
    """The little of torch.nn.Module the reference needs: a training flag, __call__, and
    `dtype`, checked against the dtypes numpy computes in.

    Setting `training` (or calling `train()` / `eval()`) sets it on every sub-layer too.
    """

    def __init__(self):
        self._training = False

    @property
    def dtype(self) -> str:
        return self._dtype

    @dtype.setter
    def dtype(self, name: str) -> None:
        # numpy has no bfloat16 arithmetic
        self._dtype = validation.check_backend_dtype(name, "numpy")

    @property
    def training(self) -> bool:
        return self._training

    @training.setter
    def training(self, mode: bool) -> None:
        self._training = bool(mode)
        for child in vars(self).values():
            if isinstance(child, Module):
                child.training = mode

    def train(self, mode: bool = True) -> Module:
        self.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def __call__(self, *args, **kwargs):
        with np.errstate(under="ignore"):  # see _underflow_ignored
            return self.forward(*args, **kwargs)


def _underflow_ignored(function: Callable) -> Callable:
    """`function`, its results below the dtype's smallest number rounding to it or to 0, as in
    every framework: not an error whatever np.seterr says (float16's products meet it at
    ordinary inputs). A new np.errstate each call: one entered twice at once restores wrongly."""

    @functools.wraps(function)
    def ignoring_underflow(*args, **kwargs):
        with np.errstate(under="ignore"):
            return function(*args, **kwargs)

    return ignoring_underflow


# Held while a lazy layer draws its weights at its first call
_INITIALIZING = threading.Lock()


class Linear(Module):
    """y = x @ weight + bias, with weight (in_features, out_features); lazy in_features."""

    def __init__(self, out_features: int, bias: bool, in_features: int | None, dtype: str):
        super().__init__()
        self.out_features, self.dtype = out_features, dtype
        self.in_features = None
        self.weight = self.bias = None
        self.use_bias = bias
        if in_features is not None:
            self.initialize(in_features)

    @_underflow_ignored  # a draw near 0 is a float16 subnormal
    def initialize(self, in_features: int) -> None:
        """Create weight and bias, uniform in +-1/sqrt(in_features) as torch.nn.Linear does."""
        bound = 1.0 / math.sqrt(in_features)
        shape = (in_features, self.out_features)
        self.in_features = in_features
        weight = np.random.uniform(-bound, bound, shape).astype(self.dtype)
        if self.use_bias:
            self.bias = np.random.uniform(-bound, bound, self.out_features).astype(self.dtype)
        self.weight = weight  # last: a weight there means the bias is there too

    def forward(self, X: np.ndarray) -> np.ndarray:
        if self.weight is None:
            with _INITIALIZING:  # first calls from several threads: one draw of the weights
                if self.weight is None:
                    self.initialize(X.shape[-1])
        # One (rows x in) @ (in x out) product over every leading axis: numpy would otherwise
        # loop over the batch, one smaller product per example. Padding rows may hold inf,
        # whose NaN products the masks keep out, so they do not warn
        with np.errstate(invalid="ignore"):
            Y = X.reshape(-1, X.shape[-1]) @ self.weight
        Y = Y.reshape(*X.shape[:-1], self.out_features)
        if self.bias is not None:
            Y += self.bias
        return Y


class Dropout(Module):
    """Zero each entry with probability p and scale the rest by 1 / (1 - p), when training."""

    def __init__(self, p: float):
        super().__init__()
        self.p = float(p)

    def forward(self, X: np.ndarray) -> np.ndarray:
        if not self.training or self.p == 0.0:
            return X
        if self.p >= 1.0:  # every entry dropped: zeros, as torch's and Flax's, not 0 / 0
            return np.zeros_like(X)
        keep = np.random.random_sample(X.shape) >= self.p
        return (X * keep / (1.0 - self.p)).astype(X.dtype)


class Embedding(Module):
    """A table of vectors, one row per index (torch.nn.Embedding), drawn from N(0, 1)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: str):
        super().__init__()
        with np.errstate(under="ignore"):  # see _underflow_ignored
            self.weight = np.random.standard_normal((num_embeddings, embedding_dim)).astype(dtype)

    def forward(self, indices: np.ndarray) -> np.ndarray:
        return self.weight[indices]


def _in_float32(X: np.ndarray) -> np.ndarray:
    """X in float32 if it is float16 (or ml_dtypes' bfloat16, which the attention function
    takes), else X itself: their sums and means are taken in float32 and rounded once after,
    as the frameworks' kernels take them."""
    return X.astype(np.float32) if X.dtype.name in ("float16", "bfloat16") else X


class LayerNorm(Module):
    """Normalize the last axis to mean 0 and variance 1, then scale by gamma, shift by beta."""

    def __init__(self, num_hiddens: int, eps: float, dtype: str):
        super().__init__()
        self.eps = eps
        self.gamma = np.ones(num_hiddens, dtype=dtype)
        self.beta = np.zeros(num_hiddens, dtype=dtype)

    def forward(self, X: np.ndarray) -> np.ndarray:
        # A float16 mean would move every centred entry by up to half its rounding step
        x = _in_float32(X)
        mean = x.mean(axis=-1, keepdims=True)
        variance = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        y = (x - mean) / np.sqrt(variance + x.dtype.type(self.eps)) * self.gamma + self.beta
        return y.astype(X.dtype, copy=False)


class Sinks(Module):
    """Each head's sink logit, the layer's `bias` (zeros at first)."""

    def __init__(self, num_heads: int, dtype: str):
        super().__init__()
        self.bias = np.zeros(num_heads, dtype=dtype)


def _rms_normalized(X: np.ndarray, eps: float) -> np.ndarray:
    """X's last axis scaled to a mean square of 1 (float32 sums for float16)."""
    x = _in_float32(X)
    x = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + x.dtype.type(eps))
    return x.astype(X.dtype, copy=False)


class RMSNorm(Module):
    """Scale the last axis to a mean square of 1, then by gamma (float32 sums for float16)."""

    def __init__(self, num_hiddens: int, eps: float, dtype: str):
        super().__init__()
        self.eps = eps
        self.gamma = np.ones(num_hiddens, dtype=dtype)

    def forward(self, X: np.ndarray) -> np.ndarray:
        return self.gamma * _rms_normalized(X, self.eps)


class HeadLayerNorm(Module):
    """Each head's features of X (batch_size, num_heads, n, head size) to mean 0 and mean
    square 1, then scaled by that head's row of gamma (num_heads, head size): StableLM's
    layer norm per head, without a shift (float32 sums for float16)."""

    def __init__(self, num_heads: int, head_size: int, eps: float, dtype: str):
        super().__init__()
        self.eps = eps
        self.gamma = np.ones((num_heads, head_size), dtype=dtype)

    def forward(self, X: np.ndarray) -> np.ndarray:
        x = _in_float32(X)
        x = x - x.mean(axis=-1, keepdims=True)
        x = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + x.dtype.type(self.eps))
        return self.gamma[:, None, :] * x.astype(X.dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# Masks

# The tensors a layer of this backend takes; another framework's is a TypeError
_TENSOR_TYPES = np.ndarray


def _check_valid_lens_values(valid_lens: np.ndarray | None) -> None:
    # The one check that needs values: non-negative whole numbers
    if valid_lens is not None:
        validation.check_valid_lens_values(valid_lens)


def _length_mask(valid_lens: np.ndarray, num_keys: int) -> np.ndarray:
    """Keep keys j < valid_len: shape (batch_size, 1, no. of keys) for 1-D valid_lens,
    (batch_size, no. of queries, no. of keys) for 2-D."""
    # Shape of lengths: (batch_size, 1 or no. of queries, 1)
    lengths = valid_lens[:, None, None] if valid_lens.ndim == 1 else valid_lens[:, :, None]
    return np.arange(num_keys) < lengths


class _Masks(Masks):
    """mha.masks' rules in numpy, for the scores of one call."""

    def length_mask(self, valid_lens):
        return _length_mask(valid_lens, self.num_keys)

    def causal_mask(self):
        return np.tri(self.num_queries, self.num_keys, k=self.offset, dtype=bool)

    def band_mask(self, width):
        # Shape of distances: (Q, K), query i being at position offset + i
        queries = np.arange(self.num_queries)[:, None] + self.offset
        return np.abs(queries - np.arange(self.num_keys)[None, :]) < width

    def chunk_mask(self, size):
        queries = (np.arange(self.num_queries)[:, None] + self.offset) // size
        return queries == np.arange(self.num_keys)[None, :] // size

    def distances(self, like, packed=None):
        if packed is not None:
            return packed.astype(like.dtype)
        queries = np.arange(self.num_queries)[:, None] + self.offset
        return (np.arange(self.num_keys)[None, :] - queries).astype(like.dtype)

    def windows(self, window_mask):
        return np.tile(window_mask, (self.batch_size // window_mask.shape[0], 1, 1))

    def is_bool(self, windows):
        return windows.dtype == np.bool_

    def segment_positions(self, segment_ids):
        # Shape of same: (batch_size, n, n); of earlier: (n, n), key j before query i
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        earlier = np.tri(segment_ids.shape[1], k=-1, dtype=bool)
        return (same & earlier).sum(axis=-1)

    def zeros_where(self, blocked, x):
        return np.where(blocked, x.dtype.type(0), x)

    def cast_like(self, x, like):
        return x.astype(like.dtype)

    def widened(self, x):
        return _in_float32(x)

    def expand_dims(self, x, axis):
        return np.expand_dims(x, axis)


# ---------------------------------------------------------------------------------------------
# Masked softmax


def _softmax(scores: np.ndarray, keep: np.ndarray | None, empty_rows: str = "zeros") -> np.ndarray:
    """Softmax over the last axis on the kept entries (keep broadcastable to scores, or None
    for all); masked entries are exactly 0, and rows with no kept entry 0 or, with
    empty_rows="uniform", 1 / no. of keys. The caller's scores are never written."""
    # A float16 sum of a long row's exponentials passes 65504 (inf, every weight 0)
    dtype, scores = scores.dtype, _in_float32(scores)
    if keep is not None:
        # exp(-inf) = 0: masked entries get exactly 0 weight
        scores = np.where(keep, scores, scores.dtype.type(-np.inf))
    # Subtracting the row maximum keeps exp from overflowing: a row's largest entry becomes 1
    row_max = scores.max(axis=-1, keepdims=True)
    if keep is not None:
        # A row with no kept entry has maximum -inf, and -inf - (-inf) is NaN: any finite
        # shift works. A kept +inf, or kept entries all -inf, give NaN, as softmax does
        row_max = np.where(keep.any(axis=-1, keepdims=True), row_max, scores.dtype.type(0))
    # A row whose maximum is +inf or -inf is undefined: inf - inf gives its NaN, unwarned; a
    # score far below its row's maximum underflows to weight 0, as it should (np.seterr aside)
    with np.errstate(invalid="ignore", under="ignore"):
        weights = np.exp(scores - row_max)
        total = weights.sum(axis=-1, keepdims=True)
        if keep is not None:
            # A row with no kept entry sums to 0: dividing by 1 leaves its zeros, not NaN
            total[total == 0] = 1
        weights = weights / total
        if keep is not None and empty_rows == "uniform":
            # A row with no kept entry weighs every entry alike, as a fill of equal scores does
            uniform = weights.dtype.type(1 / weights.shape[-1])
            weights = np.where(keep.any(axis=-1, keepdims=True), weights, uniform)
        return weights.astype(dtype, copy=False)


def _einsum(subscripts: str, *operands: np.ndarray) -> np.ndarray:
    """np.einsum, float16 in float32 rounded once: np.einsum sums float16 products in float16,
    past float16's agreement over the 512 latent features of DeepSeek's absorbed form."""
    dtype = operands[0].dtype
    return np.einsum(subscripts, *map(_in_float32, operands)).astype(dtype, copy=False)


def _sigmoid(X: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-X)), written as exp(-log(1 + exp(-X))) so that no exp overflows."""
    return np.exp(-np.logaddexp(X.dtype.type(0), -X))


@documented
@_underflow_ignored
def masked_softmax(X: np.ndarray, valid_lens: np.ndarray | None = None, *,
                   empty_rows: str = "zeros") -> np.ndarray:
    """Softmax over the last axis of X, keeping only the first valid_lens keys of each row."""
    validation.check_masked_softmax_call(X, valid_lens, tensor_type=_TENSOR_TYPES,
                                         empty_rows=empty_rows)
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


def _with_sinks(scores: np.ndarray, keep: np.ndarray | None, sinks: np.ndarray):
    """The scores and keep with one more key at the end, each head's sink (sinks broadcastable
    to the scores' rows), which every row keeps."""
    rows = (*scores.shape[:-1], 1)
    column = np.broadcast_to(sinks, rows).astype(scores.dtype)
    if keep is not None:
        keep = np.broadcast_to(keep, scores.shape)
        keep = np.concatenate([keep, np.ones(rows, dtype=bool)], axis=-1)
    return np.concatenate([scores, column], axis=-1), keep


def _attention_pool(scores, values, keep, bias, dropout, need_weights=True,
                    empty_rows="zeros", sinks=None):
    """Weights = masked softmax of (scores + bias); output = dropout(weights) @ values."""
    if bias is not None:
        scores = scores + bias
    if sinks is not None:
        # gpt-oss: each head's sink joins every row's softmax as a key; its weight is dropped
        scores, keep = _with_sinks(scores, keep, sinks)
    weights = _softmax(scores, keep, empty_rows)
    if sinks is not None:
        weights = weights[..., :-1]
    output = (dropout(weights) @ values).astype(values.dtype, copy=False)
    return output, weights if need_weights else None


# ---------------------------------------------------------------------------------------------
# The attention function

# The function drops no weights: dropout is the layers'
_NO_DROPOUT = Dropout(0.0)


@_underflow_ignored
def dot_product_attention(query, key, value, *, mask=None, bias=None, scale=None, causal=False,
                          alignment="top_left", window=None, valid_lens=None, softcap=None,
                          empty_rows="zeros", return_weights=False, return_lse=False,
                          segment_ids=None):
    """Attention of one call on (batch_size, heads, positions, head size), as kernels and
    ONNX's Attention compute it (docs/attention-function.md has every argument):
        scores = (query * scale) @ key.swapaxes(-1, -2)    # key heads repeated to query's
        scores = softcap * np.tanh(scores / softcap)
        scores = np.where(keep, scores + bias, -np.inf)     # keep: every mask's kept keys
        output = softmax(scores, axis=-1) @ value

    mask (True = attend) and bias broadcast to the scores (batch_size, heads, Q, K) as numpy
    broadcasts; causal and window (w, or (left, right)) keep keys by a query's position: its
    index ("top_left"), its index + K - Q ("bottom_right") or its index + n (alignment=n).
    valid_lens (batch_size,) or (batch_size, Q) keep each row's first keys; segment_ids
    (batch_size, positions), or a pair for the queries and the keys, keep each query's own
    segment, causal and window then reading positions within each segment. A row with no
    kept key gives zeros (empty_rows="uniform": equal weights).
    Returns the output (batch_size, heads, Q, value's head size), then the weights with
    return_weights and each row's log-sum-exp of its kept scores with return_lse.
    """
    sizes = function_checks.check_dot_product_attention_call(
        query, key, value, mask=mask, bias=bias, scale=scale, causal=causal,
        alignment=alignment, window=window, valid_lens=valid_lens, softcap=softcap,
        empty_rows=empty_rows, return_weights=return_weights, return_lse=return_lse,
        segment_ids=segment_ids, tensor_type=_TENSOR_TYPES,
    )
    _check_valid_lens_values(valid_lens)
    batch_size, num_heads, num_kv_heads, num_queries, num_keys = sizes
    offset = function_checks.first_position(alignment, num_queries, num_keys)
    masks = _Masks(batch_size, num_queries, num_keys, offset)
    keep, bias = masks.function_masks(valid_lens, mask, causal,
                                      function_checks.window_sides(window), bias, segment_ids)
    # What the layers compute too, without dropout
    output, weights, lse = _attention(query, key, value, keep, bias, _NO_DROPOUT, scale=scale,
                                      softcap=softcap, empty_rows=empty_rows,
                                      need_weights=return_weights, lse=return_lse,
                                      group=num_heads // num_kv_heads)
    if not (return_weights or return_lse):
        return output
    return (output, *(x for x in (weights, lse) if x is not None))


def _attention(queries, keys, values, keep, bias, dropout, *, scale=None, softcap=None,
               empty_rows="zeros", need_weights=True, sinks=None, lse=False, group=1):
    """Attention on prepared inputs with any leading axes (no checks): what
    dot_product_attention and every layer's DotProductAttention.attend compute.

    queries (..., Q, d); keys (..., K, d) and values (..., K, v), with a head (axis -3) for
    every `group` heads of the queries; keep and bias broadcastable to the scores (..., Q, K),
    or None; sinks, each head's sink logit broadcastable to the scores' rows, or None. Returns
    (output, weights, lse): weights unless need_weights, and each row's log-sum-exp unless
    lse, are None.
    """
    if group > 1:
        # Query head h attends with key-value head h // group, as Llama's repeat_kv (torch,
        # TensorFlow and JAX fold the query heads instead, without the copies: the same
        # numbers, see masks.grouped_rows)
        keys, values = np.repeat(keys, group, axis=-3), np.repeat(values, group, axis=-3)
    d = queries.shape[-1]
    # Scaling the queries rather than the scores touches Q x d numbers instead of Q x K
    if scale is None:
        queries = queries / np.sqrt(queries.dtype.type(d))
    elif queries.dtype.itemsize == 2:
        # In float32, rounded once, as torch's: float16 holds a scale below 6.1e-5 in few bits
        queries = (queries.astype(np.float32) * np.float32(scale)).astype(queries.dtype)
    else:
        queries = queries * queries.dtype.type(scale)
    # Shape of scores: (..., no. of queries, no. of keys). A masked key may hold anything
    # (padding): its NaN or inf scores are replaced by the mask, so their arithmetic does
    # not warn
    # ml_dtypes' bfloat16 product is float32: rounded once to the inputs' dtype, as torch's
    with np.errstate(invalid="ignore"):
        scores = (queries @ np.swapaxes(keys, -1, -2)).astype(queries.dtype, copy=False)
    if softcap is not None:
        # Gemma 2's soft cap: the scores squashed into (-softcap, softcap), before the masks
        cap = scores.dtype.type(softcap)  # numpy's float64 would widen the scores
        scores = cap * np.tanh(scores / cap)
    output, weights = _attention_pool(scores, values, keep, bias, dropout, need_weights,
                                      empty_rows, sinks)
    if not lse:
        return output, weights, None
    return output, weights, _log_sum_exp(scores if bias is None else scores + bias, keep)


def _log_sum_exp(scores: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """log(sum(exp(score))) of each row's kept scores, shape (..., no. of queries); -inf for a
    row with none (float16 in float32, rounded once, as in _softmax)."""
    dtype, scores = scores.dtype, _in_float32(scores)
    if keep is not None:
        scores = np.where(keep, scores, scores.dtype.type(-np.inf))
    row_max = scores.max(axis=-1)
    # A row with no kept score has maximum -inf: shifting by 0 keeps its sum 0, its log -inf;
    # one with a kept +inf has maximum +inf, whose sum shifted by 0 is +inf, as its log
    shift = np.where(np.isfinite(row_max), row_max, scores.dtype.type(0))
    with np.errstate(divide="ignore", over="ignore"):
        lse = shift + np.log(np.exp(scores - shift[..., None]).sum(axis=-1))
    return lse.astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# Layers


@documented
class DotProductAttention(Module):
    """Scaled dot-product attention: softmax(Q K^T / sqrt(d)) V."""

    def __init__(self, dropout: float = 0.0, *, scale: float | None = None,
                 empty_rows: str = "zeros", sliding_window: int | None = None,
                 softcap: float | None = None, dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("DotProductAttention", locals())
        self.scale, self.empty_rows, self.sliding_window = scale, empty_rows, sliding_window
        self.softcap = softcap
        self.dropout = Dropout(dropout)
        self.attention_weights = None

    def forward(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                window_mask=None, attn_bias=None, alignment=None,
                segment_ids=None):
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=self.dtype,
            tensor_type=_TENSOR_TYPES, same_query_key_size=True,
        )
        _check_valid_lens_values(valid_lens)
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, attn_bias=attn_bias,
                                   sliding_window=self.sliding_window,
                                   segment_ids=segment_ids)
        return self.attend(queries, keys, values, keep, bias)

    def attend(self, queries, keys, values, keep=None, bias=None, need_weights=True,
               sinks=None, group=1):
        """Attention on prepared inputs with any leading axes (no checks), as the attention
        function computes it (_attention).

        queries (..., Q, d), keys (..., K, d), values (..., K, v); keep and bias as made by
        the mask helpers; sinks, each head's sink logit broadcastable to the scores' rows
        (num_heads, 1, 1), or None. MultiHeadAttention calls this with a head axis, keys and
        values with a head for every `group` heads of the queries.
        """
        output, self.attention_weights, _ = _attention(
            queries, keys, values, keep, bias, self.dropout, scale=self.scale,
            softcap=self.softcap, empty_rows=self.empty_rows, need_weights=need_weights,
            sinks=sinks, group=group,
        )
        return output


@documented
class AdditiveAttention(Module):
    """Additive attention: scores w_v^T tanh(W_q q + W_k k)."""

    def __init__(self, num_hiddens: int, dropout: float = 0.0, *, query_size: int | None = None,
                 key_size: int | None = None, empty_rows: str = "zeros",
                 sliding_window: int | None = None, dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("AdditiveAttention", locals())
        self.num_hiddens, self.empty_rows = num_hiddens, empty_rows
        self.sliding_window = sliding_window
        self.W_q = Linear(num_hiddens, False, query_size, self.dtype)
        self.W_k = Linear(num_hiddens, False, key_size, self.dtype)
        self.w_v = Linear(1, False, num_hiddens, self.dtype)
        self.dropout = Dropout(dropout)
        self.attention_weights = None

    def forward(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                window_mask=None, attn_bias=None, alignment=None,
                segment_ids=None):
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=self.dtype,
            tensor_type=_TENSOR_TYPES,
            sizes=(("queries", "query_size", self.W_q.in_features),
                   ("keys", "key_size", self.W_k.in_features)),
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
        features = np.tanh(queries[:, :, None, :] + keys[:, None, :, :])
        # w_v has one output; shape of scores: (batch_size, no. of queries, no. of keys)
        scores = self.w_v(features)[..., 0]
        output, self.attention_weights = _attention_pool(
            scores, values, keep, bias, self.dropout, empty_rows=self.empty_rows
        )
        return output


def _query_scales(scaling, queries, offset, positions=None):
    """query_scaling's factor of each of the heads' queries (batch_size, heads, n, d), in
    their dtype: 1 + beta * log(1 + floor((p + o) / L)) (mha.encoding.query_scales) at positions
    offset, ..., offset + n - 1, (n, 1), or at each packed row's `positions` (batch_size, n),
    (batch_size, 1, n, 1)."""
    # float64 for float64 queries, else float32 (mha.encoding.rotary_angle_dtype)
    angle_dtype = rotary_angle_dtype(queries.dtype.name)
    if positions is None:
        positions = np.arange(offset, offset + queries.shape[-2])
    else:
        positions = positions[:, None, :]
    scales = query_scales(positions.astype(angle_dtype), scaling)
    return scales[..., None].astype(queries.dtype)


@documented
class MultiHeadAttention(Module):
    """Multi-head attention: num_heads scaled dot-product attentions in parallel."""

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
                 value_norm: bool = False, dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("MultiHeadAttention", locals())
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bias
        self.out_bias, self.out_features, self.scale = out_bias, out_features, scale
        self.empty_rows, self.sliding_window = empty_rows, sliding_window
        self.attention_chunk_size, self.num_kv_heads = attention_chunk_size, num_kv_heads
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        self.rope_dim, self.rope_scaling = rope_dim, frozen_rope_scaling(rope_scaling)
        self.query_scaling, self.softcap = frozen_rope_scaling(query_scaling), softcap
        self.attention = DotProductAttention(dropout, scale=scale, empty_rows=empty_rows,
                                             softcap=softcap, dtype=self.dtype)
        # Keys and values have num_kv_heads heads of num_hiddens / num_heads features each
        head_size = num_hiddens // num_heads
        kv_hiddens = (num_kv_heads or num_heads) * head_size
        self.rotary = None if rope_theta is None else RotaryEmbedding(
            head_size, rope_theta, interleaved=rope_interleaved, rotary_dim=rope_dim,
            scaling=self.rope_scaling, dtype=self.dtype
        )
        self.W_q = Linear(num_hiddens, bias, query_size, self.dtype)
        self.W_k = Linear(kv_hiddens, bias, key_size, self.dtype)
        self.W_v = Linear(kv_hiddens, bias, value_size, self.dtype)
        self.W_o = Linear(out_features or num_hiddens, bias if out_bias is None else out_bias,
                          num_hiddens, self.dtype)
        # Each head's sink logit (gpt-oss)
        self.sinks = sinks
        if sinks:
            self.sink_logits = Sinks(num_heads, self.dtype)
        self.qk_norm, self.qk_norm_eps, self.value_norm = qk_norm, qk_norm_eps, value_norm
        self._make_qk_norms(head_size, kv_hiddens, self.dtype)
        # Qwen3-Next's gate of each feature of the heads' output, projected from the queries
        self.output_gate = output_gate
        if output_gate:
            self.W_g = Linear(num_hiddens, bias, query_size, self.dtype)
        # ALiBi's slope of each head (BLOOM, MPT): no weight, a constant of the head count
        self.alibi = alibi
        self.alibi_slopes = alibi_slopes(num_heads).astype(self.dtype).reshape(-1, 1, 1) \
            if alibi else None
        self.attention_weights = None

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

    def forward(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                window_mask=None, head_mask=None, need_weights=True, attn_bias=None,
                cache=None, alignment=None, segment_ids=None):
        num_kv_heads = self.num_kv_heads or self.num_heads
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, head_mask=head_mask, need_weights=need_weights,
            attn_bias=attn_bias, cache=cache, segment_ids=segment_ids,
            rope_scaling=self.rope_scaling, dtype=self.dtype, tensor_type=_TENSOR_TYPES,
            num_heads=self.num_heads, kv_heads=(num_kv_heads, self.num_hiddens // self.num_heads),
            sizes=(("queries", "query_size", self.W_q.in_features),
                   ("keys", "key_size", self.W_k.in_features),
                   ("values", "value_size", self.W_v.in_features)),
        )
        _check_valid_lens_values(valid_lens)
        # The positions before this call's: those in the cache
        cached = 0 if cache is None or cache.keys is None else cache.keys.shape[2]
        # The position of the first query, for the masks: after the cached ones unless
        # alignment places it
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys, cached)
        # Shape of keep and bias: broadcastable to
        # (batch_size, num_heads, no. of queries, no. of keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, multihead=True,
                                   attn_bias=attn_bias, sliding_window=self.sliding_window,
                                   alibi_slopes=self.alibi_slopes, segment_ids=segment_ids,
                                   attention_chunk_size=self.attention_chunk_size)
        # Shape after project: (batch_size, num_heads, no. of queries,
        # num_hiddens / num_heads); keys and values have num_kv_heads heads
        gates = self.W_g(queries) if self.output_gate else None
        queries, keys, values = self.project(queries, keys, values)
        queries, keys = self.at_positions(queries, keys, cached, masks, segment_ids)
        if cache is not None:
            # This call's keys and values follow those of the positions before it
            if cache.keys is not None:
                keys = np.concatenate([cache.keys, keys], axis=2)
                values = np.concatenate([cache.values, values], axis=2)
            cache = KVCache(keys, values)
        # Shape of output: (batch_size, num_heads, no. of queries, num_hiddens / num_heads)
        sinks = self.sink_logits.bias.reshape(-1, 1, 1) if self.sinks else None
        output = self.attention.attend(queries, keys, values, keep, bias, need_weights, sinks,
                                       self.num_heads // num_kv_heads)
        self.attention_weights = self.attention.attention_weights
        if head_mask is not None:
            # (num_heads,) -> (num_heads, 1, 1); (batch_size, num_heads) -> (B, num_heads, 1, 1)
            output = output * head_mask.astype(self.dtype).reshape((*head_mask.shape, 1, 1))
        # Shape of output_concat: (batch_size, no. of queries, num_hiddens)
        output_concat = self.transpose_output(output)
        if gates is not None:
            # Qwen3-Next: each feature of the heads' output scaled by its gate, in (0, 1)
            output_concat = output_concat * _sigmoid(gates)
        output = self.W_o(output_concat)
        return output if cache is None else (output, cache)

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

    def transpose_qkv(self, X: np.ndarray, num_heads: int | None = None) -> np.ndarray:
        """(batch_size, n, num_heads * head size) -> (batch_size, num_heads, n, head size),
        num_heads being the layer's unless given."""
        num_heads = num_heads or self.num_heads
        X = X.reshape(X.shape[0], X.shape[1], num_heads, self.num_hiddens // self.num_heads)
        return X.transpose(0, 2, 1, 3)

    def transpose_output(self, X: np.ndarray) -> np.ndarray:
        """Reverse transpose_qkv: -> (batch_size, n, num_hiddens)."""
        X = X.transpose(0, 2, 1, 3)
        return X.reshape(X.shape[0], X.shape[1], self.num_hiddens)


@documented
class MultiHeadLatentAttention(Module):
    """Multi-head latent attention (DeepSeek-V2 and V3, Kimi K2): keys and values come from
    one shared compressed latent per position, and each head's query and key are split into a
    part without rotary embeddings and a rotary part whose key every head shares
    (docs/latent-attention.md)."""

    def __init__(self, num_hiddens: int, num_heads: int, *, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 q_lora_rank: int | None = None, dropout: float = 0.0, bias: bool = False,
                 rope_theta: float = 10000.0, rope_interleaved: bool = True,
                 rope_scaling: dict | None = None, query_scaling: dict | None = None,
                 norm_eps: float = 1e-6, sliding_window: int | None = None,
                 empty_rows: str = "zeros", dtype: str = "float32"):
        super().__init__()
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
            self.W_q = Linear(num_heads * qk_head, False, num_hiddens, self.dtype)
        else:  # queries through a low-rank pair, normalized between
            self.W_qa = Linear(q_lora_rank, bias, num_hiddens, self.dtype)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps, self.dtype)
            self.W_qb = Linear(num_heads * qk_head, False, q_lora_rank, self.dtype)
        # One projection gives each position's latent and its shared rotary key
        self.W_kva = Linear(kv_lora_rank + qk_rope_head_dim, bias, num_hiddens, self.dtype)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps, self.dtype)
        self.W_kvb = Linear(num_heads * (qk_nope_head_dim + v_head_dim), False, kv_lora_rank,
                            self.dtype)
        self.W_o = Linear(num_hiddens, bias, num_heads * v_head_dim, self.dtype)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta, interleaved=rope_interleaved,
                                      scaling=self.rope_scaling, dtype=self.dtype)
        # 1 / sqrt(head size), times yarn's mscale twice when the rotary is scaled so
        self.scale = latent_attention_scale(qk_head, self.rope_scaling)
        self.dropout = Dropout(dropout)
        self.attention_weights = None

    def forward(self, X, valid_lens=None, *, mask=None, causal=False, window_mask=None,
                need_weights=True, attn_bias=None, cache=None, absorbed=False):
        validation.check_latent_attention_call(
            X, valid_lens, mask=mask, causal=causal, window_mask=window_mask,
            need_weights=need_weights, attn_bias=attn_bias, cache=cache, absorbed=absorbed,
            dtype=self.dtype, num_hiddens=self.num_hiddens, num_heads=self.num_heads,
            latent_sizes=(self.kv_lora_rank, self.qk_rope_head_dim), tensor_type=_TENSOR_TYPES,
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
                latent = np.concatenate([cache.latent, latent], axis=1)
                rotary_keys = np.concatenate([cache.rotary_keys, rotary_keys], axis=2)
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
        output, self.attention_weights, _ = _attention(
            queries, keys, values, keep, bias, self.dropout, scale=self.scale,
            empty_rows=self.empty_rows, need_weights=need_weights,
        )
        return output

    def attend_absorbed(self, queries, latent, rotary_keys, keep, bias, need_weights):
        """The same numbers with W_kvb folded into the queries and the output: q_nope k_nope =
        (q_nope W_uk^T) latent, so every head attends over one shared key, the latent and the
        rotary key, and its values are the latent, W_uv applied after (multi-query attention
        over the latent)."""
        # W_kvb per head: its key part W_uk (kv_lora_rank, H, nope), value part W_uv
        W = self.W_kvb.weight.reshape(self.kv_lora_rank, self.num_heads, -1)
        W_uk, W_uv = W[..., : self.qk_nope_head_dim], W[..., self.qk_nope_head_dim :]
        # Shape of absorbed: (batch_size, num_heads, no. of steps, kv_lora_rank)
        absorbed = _einsum("bhqn,rhn->bhqr", queries[..., : self.qk_nope_head_dim], W_uk)
        queries = np.concatenate([absorbed, queries[..., self.qk_nope_head_dim :]], axis=-1)
        keys = np.concatenate([latent[:, None], rotary_keys], axis=-1)
        output, self.attention_weights, _ = _attention(
            queries, keys, latent[:, None], keep, bias, self.dropout, scale=self.scale,
            empty_rows=self.empty_rows, need_weights=need_weights, group=self.num_heads,
        )
        # Shape of output: (batch_size, num_heads, no. of steps, v_head_dim)
        return _einsum("bhqr,rhv->bhqv", output, W_uv)

    def project_queries(self, X, offset=0):
        """Each head's query at positions offset, ..., its rotary part turned: (batch_size,
        num_heads, n, nope + rope)."""
        Q = self.W_q(X) if self.q_lora_rank is None else self.W_qb(self.q_norm(self.W_qa(X)))
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        Q = Q.reshape(*X.shape[:2], self.num_heads, qk_head).transpose(0, 2, 1, 3)
        rotated = self.rotary.rotate(Q[..., self.qk_nope_head_dim :], offset)
        return np.concatenate([Q[..., : self.qk_nope_head_dim], rotated], axis=-1)

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
        shared = np.broadcast_to(rotary_keys, (*keys_nope.shape[:-1], self.qk_rope_head_dim))
        return np.concatenate([keys_nope, shared], axis=-1), values


@documented
class PositionalEncoding(Module):
    """Add the sinusoidal positional encoding P to X, then dropout."""

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("PositionalEncoding", locals())
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.dropout = Dropout(dropout)
        with np.errstate(under="ignore"):  # see _underflow_ignored
            self.P = sinusoid_table(max_len, num_hiddens).astype(self.dtype)

    def forward(self, X: np.ndarray) -> np.ndarray:
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, self.dtype, tensor_type=_TENSOR_TYPES
        )
        X = X + self.P[:, : X.shape[1], :]
        return self.dropout(X)


@documented
class LearnedPositionalEncoding(Module):
    """Add a learned positional embedding to X, then dropout: P is a weight, one row per
    position, trained with the rest."""

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("LearnedPositionalEncoding", locals())
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.dropout = Dropout(dropout)
        self.embedding = Embedding(max_len, num_hiddens, self.dtype)

    def forward(self, X: np.ndarray) -> np.ndarray:
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, self.dtype, tensor_type=_TENSOR_TYPES
        )
        # Shape of P: (1, no. of steps, num_hiddens), the rows of positions 0, 1, ...
        P = self.embedding(np.arange(X.shape[1]))[None]
        return self.dropout(X + P)


@documented
class RotaryEmbedding(Module):
    """Rotary position embeddings (RoPE): each pair of features turned by an angle that grows
    with the position."""

    def __init__(self, num_hiddens: int, theta: float = 10000.0, *, interleaved: bool = False,
                 rotary_dim: int | None = None, scaling: dict | None = None,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("RotaryEmbedding", locals())
        self.num_hiddens, self.theta, self.interleaved = num_hiddens, theta, interleaved
        self.rotary_dim, self.scaling = rotary_dim, frozen_rope_scaling(scaling)
        # The first `rotated` features turn, in pairs; the others pass (partial rotary)
        self.rotated = rotary_dim or num_hiddens
        # Shape of frequencies: (rotated / 2,), one angle per position for each pair
        angle_dtype = rotary_angle_dtype(self.dtype)
        self.frequencies = rotary_frequencies(self.rotated, theta, self.scaling).astype(angle_dtype)
        # The factor of the cosines and sines: a yarn or longrope scaling's, else 1
        self.attention_factor = rotary_attention_factor(self.scaling)

    def forward(self, X: np.ndarray, offset: int = 0) -> np.ndarray:
        validation.check_rotary_call(
            X, offset, self.num_hiddens, self.dtype, tensor_type=_TENSOR_TYPES
        )
        return self.rotate(X, offset)

    def rotate(self, X: np.ndarray, offset: int = 0, length=None, positions=None) -> np.ndarray:
        """X (..., n, num_hiddens) at positions offset, ..., offset + n - 1, rotated (no
        checks). `length`, the sequence's (offset + n when None), picks the frequencies of a
        dynamic or longrope scaling. `positions` (batch_size, n), each row's own (packed
        sequences, X (batch_size, heads, n, num_hiddens)), replace offset's. MultiHeadAttention
        calls this on each head's queries and keys."""
        # Shape of angles, cos and sin: (n, rotated / 2), or (batch_size, 1, n, rotated / 2)
        n = X.shape[-2]
        if positions is None:
            # Whole positions, each rounded once (a float32 arange steps by its first two's
            # difference, 2 past 2**24, and drifts)
            positions = np.arange(offset, offset + n).astype(self.frequencies.dtype)
        else:
            # Packed sequences: each row's own positions, (batch_size, 1, n) against the heads
            positions = positions[:, None, :].astype(self.frequencies.dtype)
        frequencies = self.frequencies_at(offset + n if length is None else length)
        angles = positions[..., None] * frequencies
        cos = (np.cos(angles) * self.attention_factor).astype(X.dtype)
        sin = (np.sin(angles) * self.attention_factor).astype(X.dtype)
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
            Y = np.stack([y1, y2], axis=-1).reshape(X.shape)
        else:
            Y = np.concatenate([y1, y2], axis=-1)
        return Y if rest.shape[-1] == 0 else np.concatenate([Y, rest], axis=-1)

    def frequencies_at(self, length: int) -> np.ndarray:
        """The frequencies of a call over positions 0, ..., length - 1: the layer's, or those
        a dynamic or longrope scaling gives a sequence longer than it was trained on."""
        longer = rotary_frequencies_at(self.rotated, self.theta, self.scaling, length)
        return self.frequencies if longer is None else longer.astype(self.frequencies.dtype)


@documented
class AddNorm(Module):
    """The residual step after attention: LayerNorm(X + dropout(Y)) over the last axis."""

    def __init__(self, num_hiddens: int, dropout: float = 0.0, *, eps: float = 1e-5,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("AddNorm", locals())
        self.num_hiddens, self.eps = num_hiddens, eps
        self.dropout = Dropout(dropout)
        self.ln = LayerNorm(num_hiddens, eps, self.dtype)

    def forward(self, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
        validation.check_add_norm_call(
            X, Y, self.num_hiddens, self.dtype, tensor_type=_TENSOR_TYPES
        )
        return self.ln(self.dropout(Y) + X)


# ---------------------------------------------------------------------------------------------
# Canonical weights (used by mha.get_weights / mha.set_weights; see mha/weights.py)


def layer_config(layer: Module) -> dict[str, Any]:
    """The constructor arguments of `layer`, with sizes inferred so far."""
    return read_config(layer, lambda linear: linear.in_features, lambda dropout: dropout.p)


# How this backend keeps each kind of parameter of mha.weights.weight_places: the attribute,
# and whether it holds the canonical array transposed (Linear keeps W as (in, out))
PARAMETERS = {"kernel": ("weight", False), "bias": ("bias", False),
              "scale": ("gamma", False), "shift": ("beta", False), "table": ("weight", False)}


def read_parameter(parameter: np.ndarray, transposed: bool) -> np.ndarray:
    """A fresh numpy copy of a parameter, in the canonical layout."""
    return (parameter.T if transposed else parameter).copy()


def write_parameter(sublayer: Module, kind: str, value: np.ndarray) -> None:
    """Copy a canonical array into the sub-layer's parameter of that kind; a kernel also
    gives a lazy Linear its input size."""
    name, transposed = PARAMETERS[kind]
    if kind == "kernel":
        sublayer.in_features = value.shape[0]
    setattr(sublayer, name, (value.T if transposed else value).copy())


# What mha's glue needs beside the layers. NumPy has no autograd, so there is no
# value_and_gradients: mha.harness differentiates the reference by central differences.
ADAPTER = Adapter(
    to_numpy, from_numpy, layer_config, PARAMETERS, read_parameter, write_parameter,
    without_gradients=contextlib.nullcontext,
)
