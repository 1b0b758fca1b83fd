"""The TensorFlow / Keras 3 backend.

The layers are `keras.layers.Layer` subclasses used through `tf.keras` (Keras 3) on TensorFlow
tensors, holding the numbers of the NumPy reference. Read it side by side with
`mha/backends/numpy.py`: the same sections in the same order, the same names.

Keras habits that differ from the reference:
- The `training` call argument decides dropout, as in every Keras layer.
- The checks of `mha.validation` run in `__call__`, before Keras's own `__call__`, which
  would otherwise rewrap their messages; `call` holds the computation.
- The value check of valid_lens (non-negative whole numbers) needs values: it runs when
  executing eagerly and is skipped inside `tf.function` / `jit_compile` and while building a
  functional model, where values are symbolic. Shapes and dtypes are checked everywhere.
- Projections are `keras.layers.Dense` sub-layers, whose kernel (in, out) is the canonical
  layout; they are built at construction when their input size is given, else in `build`.
- `need_weights=False` takes the same path (no fused kernel), so the numbers are the same.
- `attention_weights` holds the tensor of the last call; inside a `tf.function` that is a
  symbolic tensor of the traced graph.

Shapes follow d2l, batch first: queries (batch_size, no. of queries, query_size),
keys (batch_size, no. of keys, key_size), values (batch_size, no. of keys, value_size).
"""

from __future__ import annotations

import contextlib
import numbers
import os
import threading
from typing import Any

import numpy as np

from mha import function_checks, traced_sizes, validation
from mha.adapter import Adapter
from mha.cache import KVCache, LatentCache
from mha.docstrings import documented
from mha.encoding import (
    alibi_slopes,
    dynamic_frequencies,
    frozen_rope_scaling,
    latent_attention_scale,
    rotary_angle_dtype,
    rotary_attention_factor,
    rotary_frequencies,
    rotary_frequencies_at,
    sinusoid_table,
)
from mha.masks import Masks, grouped_rows
from mha.registry import load_triton_before_tensorflow
from mha.weights import canonical_parameters, read_config

_KERAS_BACKEND = os.environ.get("KERAS_BACKEND", "").strip().lower()
if _KERAS_BACKEND not in ("", "tensorflow"):
    raise ImportError(
        "the mha tensorflow backend needs Keras on TensorFlow, but Keras is configured for "
        f"another backend. Received: KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}; unset it "
        "or set KERAS_BACKEND=tensorflow before importing Keras"
    )

load_triton_before_tensorflow()  # or torch's first compile after this import ends the process
import tensorflow as tf  # noqa: E402

keras = tf.keras
if keras.backend.backend() != "tensorflow":  # configured in ~/.keras/keras.json
    raise ImportError(
        "the mha tensorflow backend needs Keras on TensorFlow, but Keras is configured for "
        f"another backend. Received: keras.backend.backend()={keras.backend.backend()!r}"
    )

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
    """Return `x` (a TensorFlow tensor, Keras variable or array) as a numpy array."""
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


def from_numpy(array: Any) -> tf.Tensor:
    """Return `array` as this backend's tensor (a tf.Tensor of the same dtype)."""
    return tf.convert_to_tensor(np.asarray(array))


# ---------------------------------------------------------------------------------------------
# Building blocks that the frameworks provide and numpy does not


def _given(training) -> dict:
    """training for Layer.__call__ where the caller gave it: Keras takes an explicit None as
    the caller's, and would hand None to the layers called after it in the enclosing call."""
    return {} if training is None else {"training": training}


def _keep_scalings(layer, **scalings) -> None:
    """Set each scaling as it is frozen: Keras would wrap a dict in a TrackedDict, which can
    change (and would write a changed scaling to files the layer does not compute)."""
    for name, scaling in scalings.items():
        object.__setattr__(layer, name, frozen_rope_scaling(scaling))


def _dims(x: tf.Tensor) -> list:
    """The shape of x, each size static when known and a scalar tensor when not."""
    dynamic = tf.shape(x)
    return [dynamic[i] if size is None else size for i, size in enumerate(x.shape)]


def _projection(num_hiddens: int, bias: bool, in_features: int | None, dtype: str):
    """y = x @ kernel + bias with kernel (in_features, num_hiddens); lazy in_features.

    Uniform in +-1/sqrt(in_features) as torch.nn.Linear (and the numpy reference) draw the
    kernel; the bias starts at zero, as Keras does.
    """
    dense = keras.layers.Dense(
        num_hiddens, use_bias=bias, dtype=dtype,
        kernel_initializer=keras.initializers.VarianceScaling(1.0 / 3, "fan_in", "uniform"),
    )
    if in_features is not None:
        dense.build((None, in_features))
    return dense


# Held while a lazy layer builds its projections at its first call
_INITIALIZING = threading.Lock()


def _build_lazily(dense, shape) -> None:
    """Build `dense` for inputs of `shape` (None: not known) unless it is built: once, when
    first calls come from several threads (each would add its own variables)."""
    if shape is None or dense.built:
        return
    with _INITIALIZING:
        if not dense.built:
            dense.build((None, shape[-1]))


def _in_features(dense) -> int | None:
    return int(dense.kernel.shape[0]) if dense.built else None


def _apply_dense(dense, X: tf.Tensor) -> tf.Tensor:
    """dense(X) for a built Dense sub-layer of a layer's `call`: x @ kernel + bias.

    The Dense layers hold the weights (serialization, canonical names); calling their kernels
    directly skips Keras's per-call `Layer.__call__` (argument binding, name scope, autocast,
    masks) and Dense's tensordot (shape reads and two reshapes) when executing eagerly, with
    the same numbers: one 2-D matrix product over all positions.
    """
    out_shape = [*_dims(X)[:-1], dense.units]
    y = tf.matmul(tf.reshape(X, [-1, dense.kernel.shape[0]]), dense.kernel)
    if dense.use_bias:
        y = y + dense.bias
    return tf.reshape(y, out_shape)


# keras.layers.Layer's keyword arguments (and those it takes for Keras 2's models)
_KERAS_ARGUMENTS = frozenset({
    "dtype", "name", "trainable", "autocast", "activity_regularizer", "input_shape",
    "input_dim", "batch_input_shape", "batch_size", "weights",
})


class Layer(keras.layers.Layer):
    """keras.layers.Layer whose dtype is the one it was built with: its weights, sublayers
    and checks hold it, so a new `dtype_policy` computing or storing in another dtype is
    refused rather than half applied. Its keyword arguments beside mha's are Keras's own: any
    other is a TypeError, as the other backends' signatures give it."""

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - _KERAS_ARGUMENTS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.__init__() got an unexpected keyword argument "
                f"{unknown[0]!r}"
            )
        super().__init__(**kwargs)

    def __setattr__(self, name, value):
        # A sublayer made after Layer.__init__(trainable=False) is frozen as the layer is
        # (Keras's setter freezes the sublayers there are; a .keras file's layer is made so)
        if isinstance(value, keras.layers.Layer) and not getattr(self, "_trainable", True):
            value.trainable = False
        super().__setattr__(name, value)

    @property
    def dtype_policy(self):
        return keras.layers.Layer.dtype_policy.fget(self)

    @dtype_policy.setter
    def dtype_policy(self, value) -> None:
        before = self.dtype_policy
        keras.layers.Layer.dtype_policy.fset(self, value)
        dtypes = (self.compute_dtype, self.variable_dtype)
        if dtypes != (before.compute_dtype, before.variable_dtype):
            keras.layers.Layer.dtype_policy.fset(self, before)
            # The advice names the dtype the policy computes in (a mixed policy's, not float32)
            raise ValueError(
                f"{type(self).__name__} computes in the dtype it was built with, "
                f"{before.variable_dtype}: build a layer with dtype={dtypes[0]!r} and load "
                f"these weights into it (mha.set_weights). Received: dtype_policy={value!r}"
            )


class Sinks(Layer):
    """Each head's sink logit, the layer's `bias` (zeros at first)."""

    def __init__(self, num_heads: int, dtype: str, **kwargs):
        super().__init__(dtype=dtype, **kwargs)
        self.bias = self.add_weight(shape=(num_heads,), initializer="zeros", name="bias")
        self.built = True


def _rms_normalized(X: tf.Tensor, eps: float) -> tf.Tensor:
    """X's last axis scaled to a mean square of 1 (float32 sums for half)."""
    x = tf.cast(X, tf.float64 if X.dtype == tf.float64 else tf.float32)
    x = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + eps)
    return tf.cast(x, X.dtype)


class RMSNorm(Layer):
    """Scale the last axis to a mean square of 1, then by gamma (float32 sums for half)."""

    def __init__(self, num_hiddens: int, eps: float, dtype: str, **kwargs):
        super().__init__(dtype=dtype, **kwargs)
        self.eps = eps
        self.gamma = self.add_weight(shape=(num_hiddens,), initializer="ones", name="gamma")
        self.built = True

    def call(self, X: tf.Tensor) -> tf.Tensor:
        return self.gamma * _rms_normalized(X, self.eps)


class HeadLayerNorm(Layer):
    """Each head's features of X (batch_size, num_heads, n, head size) to mean 0 and mean
    square 1, then scaled by that head's row of gamma (num_heads, head size): StableLM's
    layer norm per head, without a shift (float32 sums for half)."""

    def __init__(self, num_heads: int, head_size: int, eps: float, dtype: str, **kwargs):
        super().__init__(dtype=dtype, **kwargs)
        self.eps = eps
        self.gamma = self.add_weight(shape=(num_heads, head_size), initializer="ones",
                                     name="gamma")
        self.built = True

    def call(self, X: tf.Tensor) -> tf.Tensor:
        x = tf.cast(X, tf.float64 if X.dtype == tf.float64 else tf.float32)
        x = x - tf.reduce_mean(x, axis=-1, keepdims=True)
        x = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + self.eps)
        return self.gamma[:, None, :] * tf.cast(x, X.dtype)


# ---------------------------------------------------------------------------------------------
# Masks

# The tensors a layer of this backend takes; another framework's is a TypeError
# numpy arrays are taken as Keras layers take them
_TENSOR_TYPES = (tf.Tensor, tf.Variable, keras.Variable, keras.KerasTensor, np.ndarray)


def _on_a_device(x) -> bool:
    """Whether x is a tensor on a device other than the CPU, whose values a read would wait
    for the device to compute."""
    return tf.is_tensor(x) and "CPU" not in x.device.upper()


def _check_valid_lens_values(valid_lens) -> None:
    # The one check that needs values: non-negative whole numbers. Values exist only when
    # executing eagerly; in tf.function graphs and functional models they are symbolic. On a
    # GPU it is skipped, as in graphs: no call waits for the device
    if valid_lens is None or not tf.executing_eagerly():
        return
    if isinstance(valid_lens, keras.KerasTensor) or tf.is_symbolic_tensor(valid_lens):
        return
    if _on_a_device(valid_lens):
        return
    validation.check_valid_lens_values(np.asarray(tf.convert_to_tensor(valid_lens)))


def _shared_sizes(queries, keys, values, valid_lens, *, function=False, **named):
    """A traced graph may leave sizes unknown, which mha.validation cannot check and which
    broadcasting would hide (one length for every example). There the sizes the call's
    tensors share (mha.traced_sizes; the attention function's where `function`) are asserted,
    for an error that names the rule, and tied by reshaping each tensor to them, which holds
    where assertions are dropped (XLA, LiteRT). Returns the function that gives each tensor's
    tied one (itself where nothing is tied)."""
    if tf.executing_eagerly():  # every size known, and checked: nothing on the eager path
        return lambda x: x
    sizes_of = traced_sizes.function_sizes if function else traced_sizes.shared_sizes
    return _tie(sizes_of(queries, keys, values, valid_lens, **named))


def _tie(shapes: list) -> Any:
    """_shared_sizes's assertion and reshapes of (tensor, its sizes by name) pairs."""
    if all(not tf.is_tensor(x) or x.shape.is_fully_defined() for x, _ in shapes):
        return lambda x: x
    # TensorFlow 1's name returns the assertion (TensorFlow 2's returns None in a graph)
    asserted = tf.compat.v1.debugging.assert_shapes(shapes, message=traced_sizes.MESSAGE)
    sizes, tied = {}, {}
    for x, names in shapes:
        if not tf.is_tensor(x):
            continue
        shape = tf.shape(x)
        sizes.update({name: shape[i] for i, name in enumerate(names) if isinstance(name, str)
                      and name not in sizes})
        target = tf.stack([shape[i] if name is None else sizes.get(name, name)
                           for i, name in enumerate(names)])
        # The assertion's message first (None where the shapes left it nothing to check); one
        # tensor given twice (self-attention's queries and keys) is tied to both its sizes
        with tf.control_dependencies([] if asserted is None else [asserted]):
            tied[id(x)] = tf.reshape(tied.get(id(x), x), _unless_differing(shape, target))
        # The sizes known while tracing, which the target hides, and those the names fix
        known = zip(x.shape, names, strict=True)
        tied[id(x)].set_shape([n if isinstance(n, int) else d for d, n in known])
    return lambda x: tied.get(id(x), x)


def _with_keys(window_mask: tf.Tensor, num_keys) -> tf.Tensor:
    """window_mask (windows, Q, its keys) asserted to have the call's keys, the cached ones
    included, and tied to them as _tie ties the shared sizes."""
    shape = tf.shape(window_mask)
    fits = tf.debugging.assert_equal(shape[-1], num_keys, message=traced_sizes.MESSAGE)
    with tf.control_dependencies([] if fits is None else [fits]):
        target = tf.stack([shape[0], shape[1], num_keys])
        tied = tf.reshape(window_mask, _unless_differing(shape, target))
    tied.set_shape(window_mask.shape)
    return tied


def _unless_differing(shape: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
    """target, or where any size of shape differs from it every size -2, which no reshape
    takes: where the assertions are dropped (XLA, LiteRT) a reshape alone checks only the
    number of elements, and would read (3, 2) lengths as (2, 3) ones."""
    differs = tf.minimum(tf.reduce_max(tf.abs(shape - target)), 1)
    return target - differs * (target + 2)


def _length_mask(valid_lens: tf.Tensor, num_keys) -> tf.Tensor:
    """Keep keys j < valid_len: shape (batch_size, 1, no. of keys) for 1-D valid_lens,
    (batch_size, no. of queries, no. of keys) for 2-D."""
    # Compared in 64 bits: int64 for the integers that fit it, float64 for floats and uint64
    # (exact to 2**53, far past any number of keys; as int64, 2**64 - 1 would be -1)
    wide = valid_lens.dtype.is_floating or valid_lens.dtype == tf.uint64
    compare_dtype = tf.float64 if wide else tf.int64
    # Shape of lengths: (batch_size, 1 or no. of queries, 1). New axes come from expand_dims
    # (LiteRT's builtin EXPAND_DIMS), not from indexing with None: that StridedSlice has a
    # LiteRT builtin only while at most one size is unknown, and a model exported with unknown
    # batch and sequence sizes would need Flex ops, which the LiteRT interpreter does not run
    lengths = tf.cast(valid_lens, compare_dtype)
    if lengths.shape.rank == 1:
        lengths = tf.expand_dims(lengths, 1)
    lengths = tf.expand_dims(lengths, 2)
    return tf.range(num_keys, dtype=compare_dtype) < lengths


class _Masks(Masks):
    """mha.masks' rules in TensorFlow, for the scores of one call; sizes may be tensors."""

    def length_mask(self, valid_lens):
        return _length_mask(valid_lens, self.num_keys)

    def causal_mask(self):
        return self.query_positions() >= self.key_positions()

    def band_mask(self, width):
        # Shape of distances: (Q, K), query i being at position offset + i. Two comparisons,
        # not tf.abs: LiteRT's builtin ops have no int64 Abs
        distances = self.query_positions() - self.key_positions()
        return (distances < width) & (-distances < width)

    def chunk_mask(self, size):
        # int32 where the positions fit it (LiteRT's builtin ops have no int64 FloorDiv); a
        # tensor offset counts cached keys, far below 2**30
        small = size < 2**31 and not (isinstance(self.offset, numbers.Integral)
                                      and abs(self.offset) >= 2**30)
        dtype = tf.int32 if small else tf.int64
        queries = tf.range(self.num_queries, dtype=dtype)[:, None] + tf.cast(self.offset, dtype)
        return queries // size == tf.range(self.num_keys, dtype=dtype)[None, :] // size

    def distances(self, like, packed=None):
        if packed is not None:
            return tf.cast(packed, like.dtype)
        return tf.cast(self.key_positions() - self.query_positions(), like.dtype)

    def query_positions(self):
        """(Q, 1): query i at position offset + i, the offset maybe a scalar tensor. int64:
        an offset, window or chunk size past int32's range must not wrap."""
        queries = tf.range(self.num_queries, dtype=tf.int64)[:, None]
        return queries + tf.cast(self.offset, tf.int64)

    def key_positions(self):
        """(1, K): key j at position j."""
        return tf.range(self.num_keys, dtype=tf.int64)[None, :]

    def windows(self, window_mask):
        if not tf.executing_eagerly():  # a key axis a graph left unknown: not broadcast
            window_mask = _with_keys(window_mask, self.num_keys)
        return tf.tile(window_mask, [self.batch_size // tf.shape(window_mask)[0], 1, 1])

    def is_bool(self, windows):
        return windows.dtype == tf.bool

    def same_segment(self, segments):
        # tf.equal takes one dtype: query and key ids may differ in theirs
        # expand_dims, not [:, :, None]: see _length_mask
        queries, keys = (tf.cast(ids, tf.int64) for ids in segments)
        return tf.expand_dims(queries, -1) == tf.expand_dims(keys, -2)

    def segment_positions(self, segment_ids):
        # Shape of same: (batch_size, n, n); of earlier: (n, n), key j before query i
        same = tf.expand_dims(segment_ids, -1) == tf.expand_dims(segment_ids, -2)
        positions = tf.range(tf.shape(segment_ids)[1])
        earlier = tf.expand_dims(positions, 0) < tf.expand_dims(positions, 1)
        return tf.reduce_sum(tf.cast(same & earlier, tf.int32), axis=-1)

    def zeros_where(self, blocked, x):
        return tf.where(blocked, tf.zeros_like(x), x)

    def cast_like(self, x, like):
        return tf.cast(x, like.dtype)

    def widened(self, x):
        return tf.cast(x, tf.float32) if x.dtype in (tf.float16, tf.bfloat16) else x

    def packed_distances(self, segment_ids):
        # In int64, as query_positions: an offset past int32's range must not wrap
        queries, keys = (tf.cast(x, tf.int64) for x in self.packed_positions(segment_ids))
        queries = tf.expand_dims(queries, -1) + tf.cast(self.offset, tf.int64)
        return tf.expand_dims(keys, -2) - queries

    def isneginf(self, x):
        # Below the dtype's lowest finite number is -inf exactly (NaN is neither). Not
        # x == -inf: LiteRT's converter stores a constant -inf as that lowest number, so the
        # -inf entries of a window or attn_bias would go unseen and reach the softmax
        return x < tf.constant(x.dtype.min, x.dtype)

    def expand_dims(self, x, axis):
        return tf.expand_dims(x, axis)


# ---------------------------------------------------------------------------------------------
# Masked softmax


def _softmax(scores: tf.Tensor, keep: tf.Tensor | None, empty_rows: str = "zeros") -> tf.Tensor:
    """Softmax over the last axis on the kept entries; masked entries are exactly 0, and rows
    with no kept entry 0 or, with empty_rows="uniform", 1 / no. of keys. tf.nn.softmax
    subtracts the row maximum, so logits of 1e4 stay finite.

    Written with TensorFlow's fused softmax on the scores with -inf at masked entries, rather
    than the reference's steps (four fewer passes over the scores): a row with no kept key
    would be all -inf, NaN in softmax, so its scores become 0 (finite values and gradients,
    uniform weights) and it is zeroed after unless empty_rows says uniform. The fill replaces
    a masked score rather than being added to it, so a masked key holding NaN or inf stays
    out. Gradients: exp(-inf) = 0 gives masked entries a gradient of exactly 0, and the
    zeroed rows get 0, so no NaN flows back.
    """
    if keep is None:
        return _float_softmax(scores)
    # Shape of attended and fill: keep's, with 1 key; small, as keep broadcasts over heads
    attended = tf.reduce_any(keep, axis=-1, keepdims=True)
    # Masked scores become -inf, and those of a row with no kept key 0 (finite, zeroed after)
    fill = tf.where(attended, tf.constant(-np.inf, scores.dtype), tf.zeros([], scores.dtype))
    weights = _float_softmax(tf.where(keep, scores, fill))
    if empty_rows == "uniform" or not _may_have_empty_rows(attended):
        return weights
    return weights * tf.cast(attended, weights.dtype)


def _float_softmax(scores: tf.Tensor) -> tf.Tensor:
    """tf.nn.softmax over the last axis; float16 and bfloat16 in float32, rounded once, as
    the reference: a float16 sum of a long row's exponentials passes 65504 (inf, every weight
    0), and bfloat16's steps of its exponentials and sum put weights several steps off."""
    if scores.dtype not in (tf.float16, tf.bfloat16):
        return tf.nn.softmax(scores, axis=-1)
    return tf.cast(tf.nn.softmax(tf.cast(scores, tf.float32), axis=-1), scores.dtype)


def _einsum(subscripts: str, *operands: tf.Tensor) -> tf.Tensor:
    """tf.einsum, float16 in float32 rounded once: tf.einsum sums float16 products in float16,
    past float16's agreement over the 512 latent features of DeepSeek's absorbed form."""
    dtype = operands[0].dtype
    if dtype != tf.float16:
        return tf.einsum(subscripts, *operands)
    return tf.cast(tf.einsum(subscripts, *(tf.cast(x, tf.float32) for x in operands)), dtype)


def _may_have_empty_rows(attended: tf.Tensor) -> bool:
    # Zeroing the rows with no kept key, a pass over the weights, changes none when none is
    return (
        not tf.executing_eagerly()  # a graph: no values to read
        or _on_a_device(attended)  # a read would wait for the device
        or not bool(tf.reduce_all(attended))  # one read of a small tensor
    )


@documented
def masked_softmax(X: tf.Tensor, valid_lens: tf.Tensor | None = None, *,
                   empty_rows: str = "zeros") -> tf.Tensor:
    """Softmax over the last axis of X, keeping only the first valid_lens keys of each row."""
    validation.check_masked_softmax_call(X, valid_lens, tensor_type=_TENSOR_TYPES,
                                         empty_rows=empty_rows)
    _check_valid_lens_values(valid_lens)
    X = tf.convert_to_tensor(X)
    if valid_lens is None:
        return _softmax(X, None)
    valid_lens = tf.convert_to_tensor(valid_lens)
    if not tf.executing_eagerly():  # sizes a graph left unknown, as _shared_sizes ties them
        tie = _tie(traced_sizes.softmax_sizes(X, valid_lens))
        X, valid_lens = tie(X), tie(valid_lens)
    # Shape of keep: (batch_size, 1 or no. of queries, no. of keys), then one axis per
    # middle axis of X so that it broadcasts against X
    keep = _length_mask(valid_lens, _dims(X)[-1])
    if X.shape.rank == 2:
        keep = keep[:, 0, :]
    for _ in range(X.shape.rank - 3):
        keep = tf.expand_dims(keep, 1)  # not keep[:, None]: see _length_mask
    return _softmax(X, keep, empty_rows)


def _with_sinks(scores: tf.Tensor, keep: tf.Tensor | None, sinks: tf.Tensor):
    """The scores and keep with one more key at the end, each head's sink (sinks broadcastable
    to the scores' rows), which every row keeps."""
    rows = tf.concat([tf.shape(scores)[:-1], [1]], axis=0)
    column = tf.broadcast_to(tf.cast(sinks, scores.dtype), rows)
    if keep is not None:
        keep = tf.broadcast_to(keep, tf.shape(scores))
        keep = tf.concat([keep, tf.ones(rows, dtype=tf.bool)], axis=-1)
    return tf.concat([scores, column], axis=-1), keep


def _attention_pool(scores, values, keep, bias, dropout, training, need_weights=True,
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
    return tf.matmul(dropout(weights, training=training), values), (
        weights if need_weights else None
    )


def _is_stored_cache(cache, queries) -> bool:
    """Whether `cache` is a KVCache as a .keras file keeps it: a list of two symbolic tensors,
    or of two Nones, that rebuilding the model passes with symbolic queries. Anything else
    stays the checks' to judge."""
    return (type(cache) is list and len(cache) == 2 and isinstance(queries, keras.KerasTensor)
            and all(x is None or isinstance(x, keras.KerasTensor) for x in cache))


def _as_tensors(*arguments):
    # numpy arrays become tensors (after the checks, which read shapes and dtypes only)
    return [tf.convert_to_tensor(x) if isinstance(x, np.ndarray) else x for x in arguments]


def _tied_segments(tie, segment_ids):
    # segment_ids, one tensor or a pair, as _shared_sizes ties them
    return tuple(map(tie, segment_ids)) if isinstance(segment_ids, tuple) else tie(segment_ids)


def _tied_cache(tie, cache):
    return None if cache is None else type(cache)(*map(tie, cache))


def _as_int(alignment):
    # Keras makes a numpy integer argument a tensor, which the alignment's names do not equal
    return int(alignment) if isinstance(alignment, np.integer) else alignment


def _as_segments(segment_ids):
    # segment_ids, one tensor or a pair, as _as_tensors makes them
    if isinstance(segment_ids, tuple):
        return tuple(_as_tensors(*segment_ids))
    return _as_tensors(segment_ids)[0]


# ---------------------------------------------------------------------------------------------
# The attention function


def dot_product_attention(query, key, value, *, mask=None, bias=None, scale=None, causal=False,
                          alignment="top_left", window=None, valid_lens=None, softcap=None,
                          empty_rows="zeros", return_weights=False, return_lse=False,
                          segment_ids=None):
    """Attention of one call on (batch_size, heads, positions, head size): the NumPy
    reference's dot_product_attention (mha.backends.numpy, whose docstring has the
    arguments), in TensorFlow."""
    function_checks.check_dot_product_attention_call(
        query, key, value, mask=mask, bias=bias, scale=scale, causal=causal,
        alignment=alignment, window=window, valid_lens=valid_lens, softcap=softcap,
        empty_rows=empty_rows, return_weights=return_weights, return_lse=return_lse,
        segment_ids=segment_ids, tensor_type=_TENSOR_TYPES,
    )
    _check_valid_lens_values(valid_lens)
    query, key, value, mask, bias, valid_lens = (
        None if x is None else tf.convert_to_tensor(x)
        for x in (query, key, value, mask, bias, valid_lens)
    )
    segment_ids = _as_segments(segment_ids)
    tie = _shared_sizes(query, key, value, valid_lens, segment_ids=segment_ids, function=True)
    query, key, value, valid_lens = map(tie, (query, key, value, valid_lens))
    segment_ids = _tied_segments(tie, segment_ids)
    # The sizes, each a scalar tensor where it is unknown while tracing
    batch_size, num_heads, num_queries = _dims(query)[:3]
    num_kv_heads, num_keys = _dims(key)[1:3]
    offset = function_checks.first_position(alignment, num_queries, num_keys)
    masks = _Masks(batch_size, num_queries, num_keys, offset)
    keep, bias = masks.function_masks(valid_lens, mask, causal,
                                      function_checks.window_sides(window), bias, segment_ids)
    # What the layers compute too, without dropout
    output, weights, lse = _attention(query, key, value, keep, bias, _no_dropout, scale=scale,
                                      softcap=softcap, empty_rows=empty_rows,
                                      need_weights=return_weights, lse=return_lse,
                                      group=_group(num_heads, num_kv_heads))
    if not (return_weights or return_lse):
        return output
    return (output, *(x for x in (weights, lse) if x is not None))


def _group(num_heads, num_kv_heads):
    """The query heads of each key-value head; where a graph left either number unknown, the
    assertion that one divides the other, as validation checks it eagerly, and where
    assertions are dropped (XLA, LiteRT) a group of -2 then, which the queries' reshape
    refuses."""
    if not (tf.is_tensor(num_heads) or tf.is_tensor(num_kv_heads)):
        return num_heads // num_kv_heads
    divides = tf.debugging.assert_equal(num_heads % num_kv_heads, 0, message=traced_sizes.MESSAGE)
    with tf.control_dependencies([] if divides is None else [divides]):
        group, remainder = num_heads // num_kv_heads, tf.minimum(num_heads % num_kv_heads, 1)
        return tf.identity(group - remainder * (group + 2))


def _grouped(x, heads, rows, group: int):
    """x (the queries, or a mask broadcastable to the scores or to their rows) with each
    key-value head's `group` query heads as one head of group x rows query rows."""
    sizes = None if x is None else grouped_rows(_dims(x), heads, rows, group)
    return x if sizes is None else tf.reshape(tf.broadcast_to(x, sizes[0]), sizes[1])


def _no_dropout(weights: tf.Tensor, training=None) -> tf.Tensor:
    """The function drops no weights: dropout is the layers'."""
    return weights


def _attention(queries, keys, values, keep, bias, dropout, *, training=None, scale=None,
               softcap=None, empty_rows="zeros", need_weights=True, sinks=None, lse=False,
               group=1):
    """Attention on prepared inputs with any leading axes (no checks): what
    dot_product_attention and every layer's DotProductAttention.attend compute.

    queries (..., Q, d); keys (..., K, d) and values (..., K, v), with a head (axis -3) for
    every `group` heads of the queries; keep and bias broadcastable to the scores (..., Q, K),
    or None; sinks, each head's sink logit broadcastable to the scores' rows, or None;
    training decides dropout. Returns (output, weights, lse): weights unless need_weights,
    and each row's log-sum-exp unless lse, are None.
    """
    if not isinstance(group, int) or group > 1:
        # Each key-value head's `group` query heads as one head of group x Q query rows: the
        # keys and values are read as they are (see masks.grouped_rows); a group unknown
        # while tracing (a tensor) takes this path, which is right for one head a group too
        heads, rows = _dims(queries)[-3:-1]
        queries, keep, bias, sinks = (_grouped(x, heads, rows, group)
                                      for x in (queries, keep, bias, sinks))
        output, weights, row_lse = _attention(
            queries, keys, values, keep, bias, dropout, training=training, scale=scale,
            softcap=softcap, empty_rows=empty_rows, need_weights=need_weights, sinks=sinks,
            lse=lse)
        # Back to each query head: (..., heads, Q, v or K), and the rows' (..., heads, Q)
        output, weights = (
            None if x is None else tf.reshape(x, [*_dims(x)[:-3], heads, rows, _dims(x)[-1]])
            for x in (output, weights))
        return output, weights, None if row_lse is None else tf.reshape(
            row_lse, [*_dims(row_lse)[:-2], heads, rows])
    d = _dims(queries)[-1]
    # The queries are scaled rather than the scores: Q x d numbers instead of Q x K
    if scale is None:
        queries = queries / tf.sqrt(tf.cast(d, queries.dtype))
    elif queries.dtype.size == 2:
        # In float32, rounded once, as torch's: float16 holds a scale below 6.1e-5 in few bits
        queries = tf.cast(tf.cast(queries, tf.float32) * scale, queries.dtype)
    else:
        queries = queries * tf.constant(scale, queries.dtype)
    # Shape of scores: (..., no. of queries, no. of keys)
    scores = tf.matmul(queries, keys, transpose_b=True)
    if softcap is not None:
        # Gemma 2's soft cap: the scores squashed into (-softcap, softcap), before the masks
        scores = softcap * tf.tanh(scores / softcap)
    output, weights = _attention_pool(scores, values, keep, bias, dropout, training,
                                      need_weights, empty_rows, sinks)
    if not lse:
        return output, weights, None
    return output, weights, _log_sum_exp(scores if bias is None else scores + bias, keep)


def _log_sum_exp(scores: tf.Tensor, keep: tf.Tensor | None) -> tf.Tensor:
    """log(sum(exp(score))) of each row's kept scores, shape (..., no. of queries); -inf for a
    row with none (tf.reduce_logsumexp gives it; float16 in float32, rounded once)."""
    if keep is not None:
        scores = tf.where(keep, scores, tf.constant(-np.inf, scores.dtype))
    if scores.dtype != tf.float16:
        return tf.reduce_logsumexp(scores, axis=-1)
    return tf.cast(tf.reduce_logsumexp(tf.cast(scores, tf.float32), axis=-1), tf.float16)


# ---------------------------------------------------------------------------------------------
# Layers


class _AttentionLayer(Layer):
    """Keras reads a call argument named `mask` as its padding mask; ours is an attention
    keep-mask of shape (batch_size, no. of queries, no. of keys), so no mask is attached to
    the output (and Keras does not warn that one is dropped). Keras's autocast is off: the
    checks require the layer's dtype already, and casting float valid_lens to float16 would
    round lengths above 2048."""

    def __init__(self, **kwargs):
        super().__init__(**{"autocast": False, **kwargs})
        self.supports_masking = True
        # Sequential and Keras's wrappers hand a layer whose call has a `mask` their padding
        # mask there: ours is an attention mask, given by the caller alone
        self._call_has_mask_arg = False

    def compute_mask(self, inputs, previous_mask=None):
        return None


@documented
@keras.utils.register_keras_serializable(package="mha")
class DotProductAttention(_AttentionLayer):
    """Scaled dot-product attention: softmax(Q K^T / sqrt(d)) V.

    A Keras layer: `**kwargs` go to keras.layers.Layer (name, trainable), and the
    call's `training` decides dropout.
    """

    def __init__(self, dropout: float = 0.0, *, scale: float | None = None,
                 empty_rows: str = "zeros", sliding_window: int | None = None,
                 softcap: float | None = None, dtype: str = "float32", **kwargs):
        dtype = validation.check_layer_args("DotProductAttention", locals())
        super().__init__(dtype=dtype, **kwargs)
        self.scale, self.empty_rows, self.sliding_window = scale, empty_rows, sliding_window
        self.softcap = softcap
        self.dropout = keras.layers.Dropout(dropout, dtype=dtype)
        self.attention_weights = None
        self.built = True  # no weights

    def __call__(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                 window_mask=None, attn_bias=None, alignment=None, segment_ids=None,
                 training=None):
        validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=self.dtype,
            tensor_type=_TENSOR_TYPES, same_query_key_size=True,
        )
        _check_valid_lens_values(valid_lens)
        queries, keys, values, valid_lens, mask, window_mask, attn_bias = _as_tensors(
            queries, keys, values, valid_lens, mask, window_mask, attn_bias
        )
        segment_ids = _as_segments(segment_ids)
        tie = _shared_sizes(queries, keys, values, valid_lens, segment_ids=segment_ids,
                            window_mask=window_mask,
                            features=(traced_sizes.HEAD_SIZE, traced_sizes.HEAD_SIZE, None))
        queries, keys, values, valid_lens, window_mask = map(
            tie, (queries, keys, values, valid_lens, window_mask))
        segment_ids = _tied_segments(tie, segment_ids)
        return super().__call__(queries, keys, values, valid_lens, mask=mask, causal=causal,
                                window_mask=window_mask, attn_bias=attn_bias,
                                alignment=_as_int(alignment), segment_ids=segment_ids,
                                **_given(training))

    def call(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
             window_mask=None, attn_bias=None, alignment=None, segment_ids=None,
                 training=None):
        batch_size, num_queries, _ = _dims(queries)
        num_keys = _dims(keys)[1]
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, attn_bias=attn_bias,
                                   sliding_window=self.sliding_window,
                                   segment_ids=segment_ids)
        return self.attend(queries, keys, values, keep, bias, training=training)

    def attend(self, queries, keys, values, keep=None, bias=None, need_weights=True,
               training=None, sinks=None, group=1):
        """Attention on prepared inputs with any leading axes (no checks), as the attention
        function computes it (_attention).

        queries (..., Q, d), keys (..., K, d), values (..., K, v); keep and bias as made by
        the mask helpers; sinks, each head's sink logit broadcastable to the scores' rows
        (num_heads, 1, 1), or None. MultiHeadAttention calls this with a head axis, keys and
        values with a head for every `group` heads of the queries.
        """
        output, self.attention_weights, _ = _attention(
            queries, keys, values, keep, bias, self.dropout, training=training,
            scale=self.scale, softcap=self.softcap, empty_rows=self.empty_rows,
            need_weights=need_weights, sinks=sinks, group=group,
        )
        return output

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **layer_config(self)}


@documented
@keras.utils.register_keras_serializable(package="mha")
class AdditiveAttention(_AttentionLayer):
    """Additive attention: scores w_v^T tanh(W_q q + W_k k).

    A Keras layer: `**kwargs` go to keras.layers.Layer (name, trainable), and the
    call's `training` decides dropout.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, *, query_size: int | None = None,
                 key_size: int | None = None, empty_rows: str = "zeros",
                 sliding_window: int | None = None, dtype: str = "float32", **kwargs):
        dtype = validation.check_layer_args("AdditiveAttention", locals())
        super().__init__(dtype=dtype, **kwargs)
        self.num_hiddens, self.empty_rows = num_hiddens, empty_rows
        self.sliding_window = sliding_window
        self.W_q = _projection(num_hiddens, False, query_size, dtype)
        self.W_k = _projection(num_hiddens, False, key_size, dtype)
        self.w_v = _projection(1, False, num_hiddens, dtype)
        self.dropout = keras.layers.Dropout(dropout, dtype=dtype)
        self.attention_weights = None
        self.built = self.W_q.built and self.W_k.built

    def build(self, queries_shape=None, keys_shape=None):
        # The projections whose input sizes the constructor did not know (d2l's lazy layers)
        for dense, shape in ((self.W_q, queries_shape), (self.W_k, keys_shape)):
            _build_lazily(dense, shape)

    def __call__(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                 window_mask=None, attn_bias=None, alignment=None, segment_ids=None,
                 training=None):
        validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=self.dtype,
            tensor_type=_TENSOR_TYPES,
            sizes=(("queries", "query_size", _in_features(self.W_q)),
                   ("keys", "key_size", _in_features(self.W_k))),
        )
        _check_valid_lens_values(valid_lens)
        queries, keys, values, valid_lens, mask, window_mask, attn_bias = _as_tensors(
            queries, keys, values, valid_lens, mask, window_mask, attn_bias
        )
        segment_ids = _as_segments(segment_ids)
        tie = _shared_sizes(queries, keys, values, valid_lens, segment_ids=segment_ids,
                            window_mask=window_mask,
                            features=(_in_features(self.W_q), _in_features(self.W_k), None))
        queries, keys, values, valid_lens, window_mask = map(
            tie, (queries, keys, values, valid_lens, window_mask))
        segment_ids = _tied_segments(tie, segment_ids)
        return super().__call__(queries, keys, values, valid_lens, mask=mask, causal=causal,
                                window_mask=window_mask, attn_bias=attn_bias,
                                alignment=_as_int(alignment), segment_ids=segment_ids,
                                **_given(training))

    def call(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
             window_mask=None, attn_bias=None, alignment=None, segment_ids=None,
                 training=None):
        batch_size, num_queries, _ = _dims(queries)
        num_keys = _dims(keys)[1]
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, attn_bias=attn_bias,
                                   sliding_window=self.sliding_window,
                                   segment_ids=segment_ids)
        queries, keys = self.W_q(queries), self.W_k(keys)
        # After adding axes (by expand_dims, not indexing with None: see _length_mask):
        # queries (batch_size, no. of queries, 1, num_hiddens) and keys
        # (batch_size, 1, no. of keys, num_hiddens); their sum broadcasts to
        # (batch_size, no. of queries, no. of keys, num_hiddens)
        features = tf.tanh(tf.expand_dims(queries, 2) + tf.expand_dims(keys, 1))
        # w_v has one output; shape of scores: (batch_size, no. of queries, no. of keys)
        scores = self.w_v(features)[..., 0]
        output, self.attention_weights = _attention_pool(
            scores, values, keep, bias, self.dropout, training, empty_rows=self.empty_rows
        )
        return output

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **layer_config(self)}


def _query_scales(scaling, queries, offset, positions=None):
    """query_scaling's factor of each of the heads' queries (batch_size, heads, n, d), in
    their dtype: 1 + beta * log(1 + floor((p + o) / L)) (mha.encoding.query_scales) at positions
    offset, ..., offset + n - 1, (n, 1), or at each packed row's `positions` (batch_size, n),
    (batch_size, 1, n, 1). The offset is an int, or a scalar tensor while tracing."""
    # float64 for float64 queries, else float32 (mha.encoding.rotary_angle_dtype)
    angle_dtype = tf.float64 if queries.dtype == tf.float64 else tf.float32
    if positions is None:
        positions = tf.range(offset, offset + _dims(queries)[-2])
    else:
        positions = tf.expand_dims(positions, 1)  # see _length_mask: not positions[:, None]
    length = scaling["original_max_position_embeddings"]
    shifted = tf.cast(positions, angle_dtype) + scaling.get("position_offset", 0)
    steps = tf.floor(shifted / length)
    factor = 1 + scaling["beta"] * tf.math.log1p(steps)
    return tf.cast(tf.expand_dims(factor, -1), queries.dtype)


@documented
@keras.utils.register_keras_serializable(package="mha")
class MultiHeadAttention(_AttentionLayer):
    """Multi-head attention: num_heads scaled dot-product attentions in parallel.

    A Keras layer: `**kwargs` go to keras.layers.Layer (name, trainable), and the
    call's `training` decides dropout.
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
                 **kwargs):
        dtype = validation.check_layer_args("MultiHeadAttention", locals())
        super().__init__(dtype=dtype, **kwargs)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bias
        self.out_bias, self.out_features, self.scale = out_bias, out_features, scale
        self.empty_rows, self.sliding_window = empty_rows, sliding_window
        self.attention_chunk_size, self.num_kv_heads = attention_chunk_size, num_kv_heads
        self.rope_theta, self.rope_interleaved = rope_theta, rope_interleaved
        self.rope_dim, self.softcap = rope_dim, softcap
        _keep_scalings(self, rope_scaling=rope_scaling, query_scaling=query_scaling)
        self.attention = DotProductAttention(dropout, scale=scale, empty_rows=empty_rows,
                                             softcap=softcap, dtype=dtype)
        # Keys and values have num_kv_heads heads of num_hiddens / num_heads features each
        head_size = num_hiddens // num_heads
        kv_hiddens = (num_kv_heads or num_heads) * head_size
        self.rotary = None if rope_theta is None else RotaryEmbedding(
            head_size, rope_theta, interleaved=rope_interleaved, rotary_dim=rope_dim,
            scaling=self.rope_scaling, dtype=dtype
        )
        self.W_q = _projection(num_hiddens, bias, query_size, dtype)
        self.W_k = _projection(kv_hiddens, bias, key_size, dtype)
        self.W_v = _projection(kv_hiddens, bias, value_size, dtype)
        self.W_o = _projection(out_features or num_hiddens,
                               bias if out_bias is None else out_bias, num_hiddens, dtype)
        # Each head's sink logit (gpt-oss)
        self.sinks = sinks
        if sinks:
            self.sink_logits = Sinks(num_heads, dtype)
        self.qk_norm, self.qk_norm_eps, self.value_norm = qk_norm, qk_norm_eps, value_norm
        self._make_qk_norms(head_size, kv_hiddens, dtype)
        # Qwen3-Next's gate of each feature of the heads' output, projected from the queries
        self.output_gate = output_gate
        if output_gate:
            self.W_g = _projection(num_hiddens, bias, query_size, dtype)
        # ALiBi's slope of each head (BLOOM, MPT): no weight, a constant of the head count
        self.alibi = alibi
        self.alibi_slopes = alibi_slopes(num_heads).astype(dtype).reshape(-1, 1, 1) \
            if alibi else None
        self.attention_weights = None
        self.built = self.W_q.built and self.W_k.built and self.W_v.built

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

    def build(self, queries_shape=None, keys_shape=None, values_shape=None):
        # The projections whose input sizes the constructor did not know (d2l's lazy layers)
        gate = ((self.W_g, queries_shape),) if self.output_gate else ()
        for dense, shape in ((self.W_q, queries_shape), (self.W_k, keys_shape),
                             (self.W_v, values_shape), *gate):
            _build_lazily(dense, shape)

    def __call__(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                 window_mask=None, head_mask=None, need_weights=True, attn_bias=None,
                 cache=None, alignment=None, segment_ids=None, training=None):
        num_kv_heads = self.num_kv_heads or self.num_heads
        if _is_stored_cache(cache, queries):
            # A .keras file stores the KVCache as a list, which its loading calls this with
            cache = KVCache(*cache)
        validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, head_mask=head_mask, need_weights=need_weights,
            attn_bias=attn_bias, cache=cache, segment_ids=segment_ids,
            rope_scaling=self.rope_scaling, dtype=self.dtype, tensor_type=_TENSOR_TYPES,
            num_heads=self.num_heads, kv_heads=(num_kv_heads, self.num_hiddens // self.num_heads),
            sizes=(("queries", "query_size", _in_features(self.W_q)),
                   ("keys", "key_size", _in_features(self.W_k)),
                   ("values", "value_size", _in_features(self.W_v))),
        )
        _check_valid_lens_values(valid_lens)
        queries, keys, values, valid_lens, mask, window_mask, head_mask, attn_bias = _as_tensors(
            queries, keys, values, valid_lens, mask, window_mask, head_mask, attn_bias
        )
        if cache is not None:
            # A KVCache of tensors (numpy arrays converted), as the call returns it
            cache = KVCache(*_as_tensors(*cache))
        segment_ids = _as_segments(segment_ids)
        tie = _shared_sizes(queries, keys, values, valid_lens, head_mask=head_mask,
                            num_heads=self.num_heads, segment_ids=segment_ids, cache=cache,
                            kv_heads=(num_kv_heads, self.num_hiddens // self.num_heads),
                            window_mask=window_mask, features=tuple(map(
                                _in_features, (self.W_q, self.W_k, self.W_v))))
        queries, keys, values, valid_lens, head_mask, window_mask = map(
            tie, (queries, keys, values, valid_lens, head_mask, window_mask))
        segment_ids, cache = _tied_segments(tie, segment_ids), _tied_cache(tie, cache)
        return super().__call__(queries, keys, values, valid_lens, mask=mask, causal=causal,
                                window_mask=window_mask, head_mask=head_mask,
                                need_weights=need_weights, attn_bias=attn_bias, cache=cache,
                                alignment=_as_int(alignment), segment_ids=segment_ids,
                                **_given(training))

    def call(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
             window_mask=None, head_mask=None, need_weights=True, attn_bias=None,
             cache=None, alignment=None, segment_ids=None, training=None):
        num_kv_heads = self.num_kv_heads or self.num_heads
        batch_size, num_queries, _ = _dims(queries)
        # The positions before this call's: those in the cache (a scalar tensor when the
        # cached length is unknown while tracing)
        cached = 0 if cache is None or cache.keys is None else _dims(cache.keys)[2]
        num_keys = cached + _dims(keys)[1]
        # The position of the first query, for the masks: after the cached ones unless
        # alignment places it
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys, cached)
        # Shape of keep and bias: broadcastable to
        # (batch_size, num_heads, no. of queries, no. of keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset)
        slopes = None if self.alibi_slopes is None else tf.constant(self.alibi_slopes)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, multihead=True,
                                   attn_bias=attn_bias, sliding_window=self.sliding_window,
                                   alibi_slopes=slopes, segment_ids=segment_ids,
                                   attention_chunk_size=self.attention_chunk_size)
        # Shape after project: (batch_size, num_heads, no. of queries,
        # num_hiddens / num_heads); keys and values have num_kv_heads heads
        gates = _apply_dense(self.W_g, queries) if self.output_gate else None
        queries, keys, values = self.project(queries, keys, values)
        queries, keys = self.at_positions(queries, keys, cached, masks, segment_ids)
        if cache is not None:
            # This call's keys and values follow those of the positions before it
            if cache.keys is not None:
                keys = tf.concat([cache.keys, keys], axis=2)
                values = tf.concat([cache.values, values], axis=2)
            cache = KVCache(keys, values)
        # Shape of output: (batch_size, num_heads, no. of queries, num_hiddens / num_heads)
        sinks = tf.reshape(self.sink_logits.bias, [-1, 1, 1]) if self.sinks else None
        output = self.attention.attend(queries, keys, values, keep, bias, need_weights,
                                       training=training, sinks=sinks,
                                       group=self.num_heads // num_kv_heads)
        self.attention_weights = self.attention.attention_weights
        if head_mask is not None:
            # (num_heads,) -> (num_heads, 1, 1); (batch_size, num_heads) -> (B, num_heads, 1, 1),
            # the sizes the output's: a converter that folds the tie's reshape into this one
            # (LiteRT's) then keeps the batch it ties
            sizes = tf.concat([tf.shape(output)[2 - head_mask.shape.rank : 2], [1, 1]], 0)
            output = output * tf.reshape(tf.cast(head_mask, output.dtype), sizes)
        # Shape of output_concat: (batch_size, no. of queries, num_hiddens)
        output_concat = self.transpose_output(output)
        if gates is not None:
            # Qwen3-Next: each feature of the heads' output scaled by its gate, in (0, 1)
            output_concat = output_concat * tf.sigmoid(gates)
        output = _apply_dense(self.W_o, output_concat)
        return output if cache is None else (output, cache)

    def at_positions(self, queries, keys, cached, masks, segment_ids):
        """Each head's queries and keys at their positions cached, cached + 1, ... (packed
        sequences restart them at each segment): turned by the rotary embedding, normalized
        where qk_norm is "head_after_rotary", and the queries scaled by query_scaling."""
        query_positions, key_positions = masks.packed_positions(segment_ids)
        if self.rotary is not None:
            # The sequence, whose length may choose the frequencies, runs to the last key
            length = cached + _dims(keys)[-2]
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
        # The projections call the Dense kernels directly (see _apply_dense)
        queries, keys = _apply_dense(self.W_q, queries), _apply_dense(self.W_k, keys)
        if self.qk_norm == "projection":
            # OLMo 2: the whole projection of each position normalized
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries = self.transpose_qkv(queries)
        keys = self.transpose_qkv(keys, num_kv_heads)
        values = self.transpose_qkv(_apply_dense(self.W_v, values), num_kv_heads)
        if self.qk_norm in ("head", "layer_norm_per_head"):
            # Qwen3: each head's features normalized, by one scale the heads share; StableLM:
            # centered too, by a scale of each head's own
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.value_norm:  # Gemma 4: each head's values to a mean square of 1, no weight
            values = _rms_normalized(values, self.qk_norm_eps)
        return queries, keys, values

    def transpose_qkv(self, X: tf.Tensor, num_heads: int | None = None) -> tf.Tensor:
        """(batch_size, n, num_heads * head size) -> (batch_size, num_heads, n, head size),
        num_heads being the layer's unless given."""
        num_heads = num_heads or self.num_heads
        batch_size, n, _ = _dims(X)
        X = tf.reshape(X, [batch_size, n, num_heads, self.num_hiddens // self.num_heads])
        return tf.transpose(X, [0, 2, 1, 3])

    def transpose_output(self, X: tf.Tensor) -> tf.Tensor:
        """Reverse transpose_qkv: -> (batch_size, n, num_hiddens)."""
        X = tf.transpose(X, [0, 2, 1, 3])
        batch_size, n, _, _ = _dims(X)
        return tf.reshape(X, [batch_size, n, self.num_hiddens])

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **layer_config(self)}


@documented
@keras.utils.register_keras_serializable(package="mha")
class MultiHeadLatentAttention(_AttentionLayer):
    """Multi-head latent attention (DeepSeek-V2 and V3, Kimi K2): the NumPy reference's
    MultiHeadLatentAttention (mha.backends.numpy), in TensorFlow.

    A Keras layer: `**kwargs` go to keras.layers.Layer (name, trainable), and the
    call's `training` decides dropout.
    """

    def __init__(self, num_hiddens: int, num_heads: int, *, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 q_lora_rank: int | None = None, dropout: float = 0.0, bias: bool = False,
                 rope_theta: float = 10000.0, rope_interleaved: bool = True,
                 rope_scaling: dict | None = None, query_scaling: dict | None = None,
                 norm_eps: float = 1e-6, sliding_window: int | None = None,
                 empty_rows: str = "zeros", dtype: str = "float32", **kwargs):
        dtype = validation.check_layer_args("MultiHeadLatentAttention", locals())
        super().__init__(dtype=dtype, **kwargs)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bias
        self.empty_rows, self.sliding_window = empty_rows, sliding_window
        self.kv_lora_rank, self.q_lora_rank, self.norm_eps = kv_lora_rank, q_lora_rank, norm_eps
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.rope_theta = v_head_dim, rope_theta
        self.rope_interleaved = rope_interleaved
        _keep_scalings(self, rope_scaling=rope_scaling, query_scaling=query_scaling)
        qk_head = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.W_q = _projection(num_heads * qk_head, False, num_hiddens, dtype)
        else:  # queries through a low-rank pair, normalized between
            self.W_qa = _projection(q_lora_rank, bias, num_hiddens, dtype)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps, dtype)
            self.W_qb = _projection(num_heads * qk_head, False, q_lora_rank, dtype)
        # One projection gives each position's latent and its shared rotary key
        self.W_kva = _projection(kv_lora_rank + qk_rope_head_dim, bias, num_hiddens, dtype)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps, dtype)
        self.W_kvb = _projection(num_heads * (qk_nope_head_dim + v_head_dim), False,
                                 kv_lora_rank, dtype)
        self.W_o = _projection(num_hiddens, bias, num_heads * v_head_dim, dtype)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta, interleaved=rope_interleaved,
                                      scaling=self.rope_scaling, dtype=dtype)
        # 1 / sqrt(head size), times yarn's mscale twice when the rotary is scaled so
        self.scale = latent_attention_scale(qk_head, self.rope_scaling)
        self.dropout = keras.layers.Dropout(dropout, dtype=dtype)
        self.attention_weights = None
        self.built = True

    def __call__(self, X, valid_lens=None, *, mask=None, causal=False, window_mask=None,
                 need_weights=True, attn_bias=None, cache=None, absorbed=False, training=None):
        validation.check_latent_attention_call(
            X, valid_lens, mask=mask, causal=causal, window_mask=window_mask,
            need_weights=need_weights, attn_bias=attn_bias, cache=cache, absorbed=absorbed,
            dtype=self.dtype, num_hiddens=self.num_hiddens, num_heads=self.num_heads,
            latent_sizes=(self.kv_lora_rank, self.qk_rope_head_dim), tensor_type=_TENSOR_TYPES,
        )
        _check_valid_lens_values(valid_lens)
        X, valid_lens, mask, window_mask, attn_bias = _as_tensors(
            X, valid_lens, mask, window_mask, attn_bias
        )
        if cache is not None:
            # A LatentCache of tensors (numpy arrays converted), as the call returns it
            cache = LatentCache(*_as_tensors(*cache))
        tie = _shared_sizes(X, X, X, valid_lens, window_mask=window_mask, cache=cache,
                            features=(self.num_hiddens,) * 3)
        X, valid_lens, window_mask = map(tie, (X, valid_lens, window_mask))
        cache = _tied_cache(tie, cache)
        if mask is None and isinstance(X, tf.Tensor):
            # Keras gives `mask` the padding mask that the call's only tensor carries
            # (Embedding(mask_zero=True)); a new tensor carries none, as no mha mask is read
            # off an input
            X = tf.identity(X)
        return super().__call__(X, valid_lens, mask=mask, causal=causal, window_mask=window_mask,
                                need_weights=need_weights, attn_bias=attn_bias, cache=cache,
                                absorbed=absorbed, **_given(training))

    def call(self, X, valid_lens=None, *, mask=None, causal=False, window_mask=None,
             need_weights=True, attn_bias=None, cache=None, absorbed=False, training=None):
        batch_size, num_steps, _ = _dims(X)
        # The positions before this call's: those in the cache
        cached = 0 if cache is None or cache.latent is None else _dims(cache.latent)[1]
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
                latent = tf.concat([cache.latent, latent], axis=1)
                rotary_keys = tf.concat([cache.rotary_keys, rotary_keys], axis=2)
            cache = LatentCache(latent, rotary_keys)
        masks = _Masks(batch_size, num_steps, _dims(latent)[1], cached)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, multihead=True,
                                   attn_bias=attn_bias, sliding_window=self.sliding_window)
        attend = self.attend_absorbed if absorbed else self.attend_expanded
        output = attend(queries, latent, rotary_keys, keep, bias, need_weights, training)
        # Shape of output: (batch_size, no. of steps, num_heads * v_head_dim), sized
        # (not -1): the batch may be empty
        width = self.num_heads * self.v_head_dim
        output = tf.reshape(tf.transpose(output, [0, 2, 1, 3]), [batch_size, num_steps, width])
        output = _apply_dense(self.W_o, output)
        return output if cache is None else (output, cache)

    def attend_expanded(self, queries, latent, rotary_keys, keep, bias, need_weights, training):
        """Attention over each head's keys and values, expanded from the latent."""
        keys, values = self.expand(latent, rotary_keys)
        output, self.attention_weights, _ = _attention(
            queries, keys, values, keep, bias, self.dropout, training=training,
            scale=self.scale, empty_rows=self.empty_rows, need_weights=need_weights,
        )
        return output

    def attend_absorbed(self, queries, latent, rotary_keys, keep, bias, need_weights, training):
        """The same numbers with W_kvb folded into the queries and the output (multi-query
        attention over the latent; see the NumPy reference)."""
        # W_kvb per head: its key part W_uk (kv_lora_rank, H, nope), value part W_uv
        W = tf.reshape(self.W_kvb.kernel, [self.kv_lora_rank, self.num_heads, -1])
        W_uk, W_uv = W[..., : self.qk_nope_head_dim], W[..., self.qk_nope_head_dim :]
        # Shape of absorbed: (batch_size, num_heads, no. of steps, kv_lora_rank)
        absorbed = _einsum("bhqn,rhn->bhqr", queries[..., : self.qk_nope_head_dim], W_uk)
        queries = tf.concat([absorbed, queries[..., self.qk_nope_head_dim :]], axis=-1)
        latent = tf.expand_dims(latent, 1)  # see _length_mask: not latent[:, None]
        keys = tf.concat([latent, rotary_keys], axis=-1)
        output, self.attention_weights, _ = _attention(
            queries, keys, latent, keep, bias, self.dropout, training=training,
            scale=self.scale, empty_rows=self.empty_rows, need_weights=need_weights,
            group=self.num_heads,
        )
        # Shape of output: (batch_size, num_heads, no. of steps, v_head_dim)
        return _einsum("bhqr,rhv->bhqv", output, W_uv)

    def project_queries(self, X, offset=0):
        """Each head's query at positions offset, ..., its rotary part turned: (batch_size,
        num_heads, n, nope + rope)."""
        if self.q_lora_rank is None:
            Q = _apply_dense(self.W_q, X)
        else:
            Q = _apply_dense(self.W_qb, self.q_norm(_apply_dense(self.W_qa, X)))
        batch_size, num_steps, _ = _dims(X)
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        Q = tf.reshape(Q, [batch_size, num_steps, self.num_heads, qk_head])
        Q = tf.transpose(Q, [0, 2, 1, 3])
        rotated = self.rotary.rotate(Q[..., self.qk_nope_head_dim :], offset)
        return tf.concat([Q[..., : self.qk_nope_head_dim], rotated], axis=-1)

    def compress(self, X, offset=0):
        """(latent (batch_size, n, kv_lora_rank), normalized; the rotary key (batch_size, 1,
        n, rope) at positions offset, ..., turned): what a latent cache keeps."""
        compressed = _apply_dense(self.W_kva, X)
        latent = self.kv_norm(compressed[..., : self.kv_lora_rank])
        # expand_dims, not [:, None]: see _length_mask
        rotary_keys = self.rotary.rotate(
            tf.expand_dims(compressed[..., self.kv_lora_rank :], 1), offset
        )
        return latent, rotary_keys

    def expand(self, latent, rotary_keys):
        """Each head's keys (batch_size, num_heads, n, nope + rope) and values (batch_size,
        num_heads, n, v_head_dim) from the latent, the rotary key shared by the heads."""
        batch_size, num_steps, _ = _dims(latent)
        KV = _apply_dense(self.W_kvb, latent)
        kv_head = self.qk_nope_head_dim + self.v_head_dim
        KV = tf.reshape(KV, [batch_size, num_steps, self.num_heads, kv_head])
        KV = tf.transpose(KV, [0, 2, 1, 3])
        keys_nope, values = KV[..., : self.qk_nope_head_dim], KV[..., self.qk_nope_head_dim :]
        shared = tf.broadcast_to(rotary_keys, [*_dims(keys_nope)[:-1], self.qk_rope_head_dim])
        return tf.concat([keys_nope, shared], axis=-1), values

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **layer_config(self)}


def _with_features(X: tf.Tensor, num_hiddens: int) -> tf.Tensor:
    """X tied to num_hiddens features where a graph left them unknown: the table's rows
    would broadcast over an X of one feature."""
    if tf.executing_eagerly():
        return X
    return _tie([(X, (None,) * (X.shape.rank - 1) + (num_hiddens,))])(X)


def _rows_for(P: tf.Tensor, steps, max_len: int) -> tf.Tensor:
    """A position table's first rows P (1, at most max_len, num_hiddens) for `steps`
    positions. Where a graph left their number unknown, it is asserted, and P reshaped to
    it where assertions are dropped (XLA): past max_len the rows run short and the reshape
    fails, where one row would broadcast over every position and XLA's gather would repeat
    the last."""
    if not tf.is_tensor(steps):  # known, and checked against max_len
        return P
    fits = tf.debugging.assert_less_equal(
        steps, max_len, message=f"mha: X is longer than max_len={max_len}: build the layer "
        "with a larger max_len")  # fmt: skip
    with tf.control_dependencies([] if fits is None else [fits]):
        # The rows themselves wait for the assertion: TensorFlow's graph optimizer may drop
        # the reshape before a broadcasting add, and with it the order
        return tf.reshape(tf.identity(P), tf.stack([1, steps, _dims(P)[-1]]))


@documented
@keras.utils.register_keras_serializable(package="mha")
class PositionalEncoding(Layer):
    """Add the sinusoidal positional encoding P to X, then dropout.

    A Keras layer: `**kwargs` go to keras.layers.Layer (name, trainable), and the
    call's `training` decides dropout.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32", **kwargs):
        dtype = validation.check_layer_args("PositionalEncoding", locals())
        super().__init__(dtype=dtype, **kwargs)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.supports_masking = True  # a Keras padding mask on X passes through
        self.dropout = keras.layers.Dropout(dropout, dtype=dtype)
        self.P = tf.cast(tf.constant(sinusoid_table(max_len, num_hiddens)), dtype)
        self.built = True  # P is a constant, not a weight

    def __call__(self, X, training=None):
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, self.dtype, tensor_type=_TENSOR_TYPES
        )
        (X,) = _as_tensors(X)
        return super().__call__(X, **_given(training))

    def call(self, X: tf.Tensor, training=None) -> tf.Tensor:
        X = _with_features(X, self.num_hiddens)
        steps = _dims(X)[1]
        X = X + _rows_for(self.P[:, :steps, :], steps, self.max_len)
        return self.dropout(X, training=training)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **layer_config(self)}


@documented
@keras.utils.register_keras_serializable(package="mha")
class LearnedPositionalEncoding(Layer):
    """Add a learned positional embedding to X, then dropout: P is a weight, one row per
    position, trained with the rest.

    A Keras layer: `**kwargs` go to keras.layers.Layer (name, trainable), and the
    call's `training` decides dropout. P is the table of a keras.layers.Embedding, with
    Keras's initializer (uniform in +-0.05).
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32", **kwargs):
        dtype = validation.check_layer_args("LearnedPositionalEncoding", locals())
        super().__init__(dtype=dtype, **kwargs)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.supports_masking = True  # a Keras padding mask on X passes through
        self.dropout = keras.layers.Dropout(dropout, dtype=dtype)
        # Built now: P exists before the first call, for set_weights and .keras files
        self.embedding = keras.layers.Embedding(max_len, num_hiddens, dtype=dtype)
        self.embedding.build()
        self.built = True

    def __call__(self, X, training=None):
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, self.dtype, tensor_type=_TENSOR_TYPES
        )
        (X,) = _as_tensors(X)
        return super().__call__(X, **_given(training))

    def call(self, X: tf.Tensor, training=None) -> tf.Tensor:
        # Shape of P: (1, no. of steps, num_hiddens), the rows of positions 0, 1, ...
        X = _with_features(X, self.num_hiddens)
        steps = _dims(X)[1]
        taken = tf.minimum(steps, self.max_len) if tf.is_tensor(steps) else steps
        P = _rows_for(self.embedding(tf.range(taken))[None], steps, self.max_len)
        return self.dropout(X + P, training=training)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **layer_config(self)}


@documented
@keras.utils.register_keras_serializable(package="mha")
class RotaryEmbedding(Layer):
    """Rotary position embeddings (RoPE): each pair of features turned by an angle that grows
    with the position.

    A Keras layer: `**kwargs` go to keras.layers.Layer (name, trainable); `offset` is a
    Python int. The call takes `training`, which a Keras model passes to each of its layers
    (in predict, fit and export), and nothing here depends on it.
    """

    def __init__(self, num_hiddens: int, theta: float = 10000.0, *, interleaved: bool = False,
                 rotary_dim: int | None = None, scaling: dict | None = None,
                 dtype: str = "float32", **kwargs):
        dtype = validation.check_layer_args("RotaryEmbedding", locals())
        super().__init__(dtype=dtype, **kwargs)
        self.num_hiddens, self.theta, self.interleaved = num_hiddens, theta, interleaved
        self.rotary_dim = rotary_dim
        _keep_scalings(self, scaling=scaling)
        self.supports_masking = True  # a Keras padding mask on X passes through
        # The first `rotated` features turn, in pairs; the others pass (partial rotary)
        self.rotated = rotary_dim or num_hiddens
        # Shape of frequencies: (rotated / 2,), one angle per position for each pair
        self.frequencies = tf.cast(
            tf.constant(rotary_frequencies(self.rotated, theta, self.scaling)),
            rotary_angle_dtype(dtype),
        )
        # The factor of the cosines and sines: a yarn or longrope scaling's, else 1
        self.attention_factor = rotary_attention_factor(self.scaling)
        self.built = True  # the frequencies are a constant, not a weight

    def __call__(self, X, offset=0, training=None):
        validation.check_rotary_call(
            X, offset, self.num_hiddens, self.dtype, tensor_type=_TENSOR_TYPES
        )
        (X,) = _as_tensors(X)
        return super().__call__(X, offset=offset, **_given(training))

    def call(self, X: tf.Tensor, offset: int = 0) -> tf.Tensor:
        return self.rotate(X, offset)

    def rotate(self, X: tf.Tensor, offset: int = 0, length=None, positions=None) -> tf.Tensor:
        """X (..., n, num_hiddens) at positions offset, ..., offset + n - 1, rotated (no
        checks). `length`, the sequence's (offset + n when None), picks the frequencies of a
        dynamic or longrope scaling. `positions` (batch_size, n), each row's own (packed
        sequences, X (batch_size, heads, n, num_hiddens)), replace offset's. MultiHeadAttention
        calls this on each head's queries and keys, the offset
        being the cached length: an int, or a scalar tensor when unknown while tracing."""
        # Shape of angles, cos and sin: (n, rotated / 2), or (batch_size, 1, n, rotated / 2)
        n = _dims(X)[-2]
        if positions is None:
            positions = tf.cast(tf.range(offset, offset + n), self.frequencies.dtype)
        else:
            # Packed sequences: each row's own positions, (batch_size, 1, n) against the heads
            positions = tf.cast(tf.expand_dims(positions, 1), self.frequencies.dtype)
        frequencies = self.frequencies_at(offset + n if length is None else length)
        # Shape of angles: (n, rotated / 2), or (batch_size, 1, n, rotated / 2)
        angles = tf.expand_dims(positions, -1) * frequencies
        cos = tf.cast(tf.cos(angles) * self.attention_factor, X.dtype)
        sin = tf.cast(tf.sin(angles) * self.attention_factor, X.dtype)
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
            # (..., n, rotated / 2, 2) -> (..., n, rotated), pairs side by side again
            Y = tf.reshape(tf.stack([y1, y2], axis=-1), _dims(X))
        else:
            Y = tf.concat([y1, y2], axis=-1)
        return Y if self.rotated == self.num_hiddens else tf.concat([Y, rest], axis=-1)

    def frequencies_at(self, length) -> tf.Tensor:
        """The frequencies of a call over positions 0, ..., length - 1: the layer's, or those
        a dynamic or longrope scaling gives a sequence longer than it was trained on. A
        traced graph may not know the length: the frequencies are then computed in the graph,
        from the length as a tensor."""
        if self.scaling is None or self.scaling["rope_type"] not in ("dynamic", "longrope"):
            return self.frequencies
        if isinstance(length, int):
            longer = rotary_frequencies_at(self.rotated, self.theta, self.scaling, length)
            dtype = self.frequencies.dtype
            return self.frequencies if longer is None else tf.constant(longer, dtype)
        original = self.scaling["original_max_position_embeddings"]
        if self.scaling["rope_type"] == "longrope":
            longer = rotary_frequencies(self.rotated, self.theta, self.scaling, original + 1)
            return tf.where(length > original, tf.constant(longer, self.frequencies.dtype),
                            self.frequencies)
        # Dynamic NTK in float64, as the reference computes it
        length = tf.maximum(tf.cast(length, tf.float64), float(original))
        exponents = tf.range(0, self.rotated, 2, dtype=tf.float64) / self.rotated
        frequencies = dynamic_frequencies(self.rotated, self.theta, self.scaling, length, exponents)
        return tf.cast(frequencies, self.frequencies.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **layer_config(self)}


@documented
@keras.utils.register_keras_serializable(package="mha")
class AddNorm(Layer):
    """The residual step after attention: LayerNorm(X + dropout(Y)) over the last axis.

    A Keras layer: `**kwargs` go to keras.layers.Layer (name, trainable), and the
    call's `training` decides dropout.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, *, eps: float = 1e-5,
                 dtype: str = "float32", **kwargs):
        dtype = validation.check_layer_args("AddNorm", locals())
        super().__init__(dtype=dtype, **kwargs)
        self.num_hiddens, self.eps = num_hiddens, eps
        self.supports_masking = True  # a Keras padding mask on X passes through
        self.dropout = keras.layers.Dropout(dropout, dtype=dtype)
        # axis=-1 stays -1 after build: the same gamma and beta serve inputs of any rank
        self.ln = keras.layers.LayerNormalization(epsilon=eps, dtype=dtype)
        self.ln.build((None, num_hiddens))
        self.built = True

    def __call__(self, X, Y, training=None):
        validation.check_add_norm_call(
            X, Y, self.num_hiddens, self.dtype, tensor_type=_TENSOR_TYPES
        )
        X, Y = _as_tensors(X, Y)
        return super().__call__(X, Y, **_given(training))

    def call(self, X: tf.Tensor, Y: tf.Tensor, training=None) -> tf.Tensor:
        if not tf.executing_eagerly():  # sizes a graph left unknown: Y's are X's, not broadcast
            sizes = tuple(f"X's axis {axis}" for axis in range(X.shape.rank - 1))
            sizes += (self.num_hiddens,)  # which LayerNormalization needs known
            tie = _tie([(X, sizes), (Y, sizes)])
            X, Y = tie(X), tie(Y)
        Z = self.dropout(Y, training=training) + X
        # Keras's LayerNormalization adds beta - mean * gamma / std, where a row far from 0
        # with little spread keeps no bit of beta; its weights serve the reference's formula
        z = tf.cast(Z, tf.float64 if Z.dtype == tf.float64 else tf.float32)
        mean, variance = tf.nn.moments(z, axes=[-1], keepdims=True)
        gamma, beta = (tf.cast(w, z.dtype) for w in (self.ln.gamma, self.ln.beta))
        return tf.cast((z - mean) * tf.math.rsqrt(variance + self.eps) * gamma + beta, Z.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **layer_config(self)}


# ---------------------------------------------------------------------------------------------
# Canonical weights (used by mha.get_weights / mha.set_weights; see mha/weights.py)


def layer_config(layer: keras.layers.Layer) -> dict[str, Any]:
    """The constructor arguments of `layer`, with sizes inferred so far."""
    return read_config(layer, _in_features, lambda dropout: float(dropout.rate))


# How this backend keeps each kind of parameter of mha.weights.weight_places: the attribute,
# and whether it holds the canonical array transposed (Dense keeps its kernel as (in, out))
PARAMETERS = {"kernel": ("kernel", False), "bias": ("bias", False),
              "scale": ("gamma", False), "shift": ("beta", False),
              "table": ("embeddings", False)}


def read_parameter(parameter, transposed: bool) -> np.ndarray:
    """A fresh numpy copy of a parameter (a Keras variable), in the canonical layout."""
    value = parameter.numpy()
    return (value.T if transposed else value).copy()


def write_parameter(sublayer: keras.layers.Layer, kind: str, value: np.ndarray) -> None:
    """Copy a canonical array into the sub-layer's variable of that kind, building a Dense
    that is not built yet from the kernel's input size."""
    name, transposed = PARAMETERS[kind]
    if kind == "kernel" and not sublayer.built:
        sublayer.build((None, value.shape[0]))
    getattr(sublayer, name).assign(value.T if transposed else value)


def without_gradients():
    """A context in which calls record no gradients, as inference runs them. Used by
    mha.harness, which checks the forward there too: some paths run only there.
    Eager calls outside a GradientTape record nothing."""
    return contextlib.nullcontext()


def value_and_gradients(function, tensors, wrt, layer, cotangent):
    """Run `function(tensors)` and differentiate sum(output * cotangent) with a GradientTape.

    Returns:
        (output, input gradients keyed by the names in `wrt`, weight gradients keyed by
        canonical names in the canonical layout), all numpy arrays. Used by mha.harness.
    """
    tensors = dict(tensors)
    parameters = {} if layer is None else canonical_parameters(layer, PARAMETERS)
    with tf.GradientTape() as tape:
        for name in wrt:
            tape.watch(tensors[name])
        output = function(tensors)
        loss = tf.reduce_sum(output * cotangent)
    sources = [tensors[name] for name in wrt] + [value for value, _ in parameters.values()]
    gradients = tape.gradient(loss, sources,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    gradients = [to_numpy(tf.convert_to_tensor(g)) for g in gradients]
    input_gradients = dict(zip(wrt, gradients, strict=False))
    weight_gradients = {
        name: g.T.copy() if transposed else g
        for (name, (_, transposed)), g in zip(parameters.items(), gradients[len(wrt):],
                                               strict=True)
    }
    return to_numpy(output), input_gradients, weight_gradients


# What mha's glue needs beside the layers
ADAPTER = Adapter(
    to_numpy, from_numpy, layer_config, PARAMETERS, read_parameter, write_parameter,
    without_gradients, value_and_gradients,
)
