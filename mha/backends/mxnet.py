"""The MXNet Gluon backend.

Gluon `HybridBlock`s on MXNet 1.9.1's numpy interface (`mx.np` / `mx.npx`), held to the
numbers of the NumPy reference. Every block is decorated with `mxnet.util.use_np`, so numpy
semantics hold inside the blocks only: this module never calls `npx.set_np()`, and the caller's
`mx.util.is_np_array()` is the same after using it. Inputs are `mx.np.ndarray`s.

The training flag is Gluon's: dropout acts inside `autograd.record(train_mode=True)` (the
default of `record()`) and nowhere else. Layers are initialized when they are built (weights
uniform in +-1/sqrt(in_features) as in the reference, biases zero), so they run without a call
to `initialize()`; `initialize(force_reinit=True)` draws new weights. Sizes given as None are
inferred at the first call, or from the first weights loaded with `mha.set_weights`.

Hybridization: call arguments are keywords (Gluon 1.x blocks take positional ones only), so
each block's `forward` checks them on the NDArrays, notes the call's structure (which masks are
given, their rank and kind), and passes them on positionally; None is a valid input of a
hybridized Gluon block. A hybridized block traces its graph again when a call's structure
differs from the previous call's (as Gluon does when a block changes), and a layer takes one
call at a time, so that threads sharing it each get their own masks and result; a graph
does not depend on batch size or sequence lengths (alignment="bottom_right" places the queries
by them: a graph traced so is not exported). A KVCache's keys and values are inputs and
outputs of MultiHeadAttention's graph (a LatentCache's latents and rotary keys of
MultiHeadLatentAttention's), their number of positions the offset counted in it: one graph
serves every decoding step after the first. Two limits:
the blocks cannot be traced inside a hybridized parent block's graph (their checks and masks
need concrete arrays: hybridize the mha block itself, or put it in a `gluon.Block`), and a
hybridized block checks valid_lens values before running the graph, as the imperative one does.

float16: MXNet 1.9.1 has float16 matmul and FullyConnected on GPU only, so the attention
layers run in float16 on a GPU context (on the CPU they raise a ValueError); AddNorm,
PositionalEncoding, LearnedPositionalEncoding and RotaryEmbedding run on CPU too.

Shapes follow d2l, batch first: queries (batch_size, no. of queries, query_size),
keys (batch_size, no. of keys, key_size), values (batch_size, no. of keys, value_size).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, NamedTuple

import numpy

# MXNet 1.9.1 reads numpy.bool, which numpy 1.24 removed (vars: hasattr would warn)
if "bool" not in vars(numpy):
    numpy.bool = numpy.bool_

import mxnet as mx
from mxnet.gluon import nn

from mha import function_checks, validation
from mha.adapter import Adapter
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
from mha.masks import Masks, every_row_keeps_a_key
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


def to_numpy(x: Any) -> numpy.ndarray:
    """Return `x` (an MXNet array, or an array numpy reads) as a numpy array."""
    # mx.np.ndarray is a subclass of the legacy NDArray: both copy to the host
    if isinstance(x, mx.nd.NDArray):
        return x.asnumpy()
    return numpy.asarray(x)


def from_numpy(array: Any) -> mx.np.ndarray:
    """Return `array` as an `mx.np.ndarray` of the same dtype, on the current context.

    Raises:
        TypeError: a dtype MXNet 1.9 has no arrays of (int16, uint16, uint32, uint64).
    """
    array = numpy.asarray(array)
    if array.dtype.name not in _MXNET_DTYPES:
        raise TypeError(
            f"MXNet has no {array.dtype.name} arrays; convert to one of "
            f"{', '.join(_MXNET_DTYPES)} first"
        )
    return mx.np.array(array, dtype=array.dtype)


# The dtypes of MXNet 1.9's numpy arrays
_MXNET_DTYPES = ("bool", "int8", "uint8", "int32", "int64", "float16", "float32", "float64")


# ---------------------------------------------------------------------------------------------
# Building blocks that numpy lacks and Gluon 1.x lacks too


class _LinearInit(mx.init.Initializer):
    """Dense weights uniform in +-1/sqrt(in_features), as torch.nn.Linear and the reference.

    Drawn in float32 and cast, which also works for float16 (Gluon's Uniform does not).
    """

    def _init_weight(self, _, arr):
        # Gluon's Dense weight is (out_features, in_features)
        bound = 1.0 / math.sqrt(arr.shape[1])
        arr[:] = mx.np.random.uniform(-bound, bound, arr.shape, ctx=arr.ctx).astype(arr.dtype)


class _InFloat32(mx.init.Initializer):
    """Another initializer's weights drawn in float32 and cast: under numpy semantics Gluon's
    initializers fill float32 arrays only."""

    def __init__(self, initializer: mx.init.Initializer):
        super().__init__()
        self.initializer = initializer

    def _init_weight(self, name, arr):
        drawn = mx.np.zeros(arr.shape, dtype="float32", ctx=arr.ctx)
        self.initializer._init_weight(name, drawn)
        arr[:] = drawn.astype(arr.dtype)


class _Call(NamedTuple):
    """What a call's graph depends on besides the tensors' sizes; a new value retraces."""

    dtype: str
    d: int | None = None  # feature size of queries and keys, for the 1/sqrt(d) scale
    valid_lens_ndim: int | None = None
    mask_ndim: int | None = None
    causal: bool = False
    num_windows: int | None = None
    window_is_bool: bool = True
    head_mask_ndim: int | None = None
    need_weights: bool = True
    attn_bias_ndim: int | None = None
    empty_rows: str = "zeros"  # the layer's: the fast paths a row with no key allows
    sliding_window: int | None = None  # the layer's: the width of its band of keys
    attention_chunk_size: int | None = None  # the layer's: its chunks of positions
    cache: bool = False  # a KVCache is given: the graph returns its keys and values too
    cached: bool = False  # it holds positions: graph inputs, their number this call's offset
    sinks: bool = False  # the layer's: each head's sink joins the softmax (see _with_sinks)
    # The position of the first query for the masks, where the call's alignment places it;
    # None: after the cached positions (a graph input), as the layers do by default
    first_position: int | None = None
    # That position follows the call's sizes (alignment="bottom_right": K - Q), which an
    # exported graph would hold as this call's (see Layer.export)
    sized_position: bool = False
    # A position of the masks passes float32's whole numbers: they are counted in float64
    far_positions: bool = False
    segments: bool = False  # segment_ids are given: graph inputs of query and key ids
    # Autograd records the call: masks take the forms whose backward is cheap (see _softmax)
    recording: bool = False
    # Every row of keep keeps a key, known from the lengths' values in an imperative call
    # (masks.every_row_keeps_a_key): none is looked for
    rows_kept: bool = False
    absorbed: bool = False  # MultiHeadLatentAttention's up-projections folded (its absorbed form)


def _segment_inputs(segment_ids) -> tuple:
    """The graph's inputs of segment_ids: (query ids, key ids), or (None, None)."""
    return (None, None) if segment_ids is None else function_checks.segment_pair(segment_ids)


def _first_position(alignment, num_queries: int, num_keys: int, cached: int = 0) -> dict:
    """_call_structure's first_position of a layer call (the position of its first query for
    its masks: None, after the `cached` ones, unless `alignment` places it; num_keys counts the
    cached keys), sized_position (whether it follows the call's sizes) and far_positions."""
    first = function_checks.layer_first_position(alignment, num_queries, num_keys, cached)
    far = _far(first, num_queries, num_keys)
    if alignment is None:
        return {"first_position": None, "far_positions": far}
    return {"first_position": first, "sized_position": alignment == "bottom_right",
            "far_positions": far}


def _far(first: int, num_queries: int, num_keys: int, reach: int = 0) -> bool:
    """Whether a position of a call's masks passes float32's whole numbers (2**24): its
    queries' (first, ..., first + num_queries - 1, shifted by up to `reach`, a window's
    side) or its keys'. Any of them, not the first alone: the queries may straddle it."""
    last = first + num_queries - 1
    return max(abs(first) + reach, abs(last) + reach, num_keys - 1) >= 2**24


def _call_structure(dtype, d=None, valid_lens=None, mask=None, causal=False, window_mask=None,
                    head_mask=None, need_weights=True, attn_bias=None,
                    empty_rows="zeros", sliding_window=None, cache=None, offset=0,
                    sinks=False, first_position=None, segment_ids=None,
                    attention_chunk_size=None, sized_position=False, rows_kept=False,
                    far_positions=False) -> _Call:
    return _Call(
        dtype=dtype,
        d=d,
        valid_lens_ndim=None if valid_lens is None else valid_lens.ndim,
        mask_ndim=None if mask is None else mask.ndim,
        causal=causal,
        num_windows=None if window_mask is None else window_mask.shape[0],
        window_is_bool=window_mask is None or validation.dtype_name(window_mask) == "bool",
        head_mask_ndim=None if head_mask is None else head_mask.ndim,
        need_weights=need_weights,
        attn_bias_ndim=None if attn_bias is None else attn_bias.ndim,
        empty_rows=empty_rows,
        sliding_window=sliding_window,
        attention_chunk_size=attention_chunk_size,
        cache=cache is not None,
        cached=offset > 0,
        sinks=sinks,
        first_position=first_position,
        sized_position=sized_position,
        far_positions=far_positions,
        segments=segment_ids is not None,
        recording=mx.autograd.is_recording(),
        rows_kept=rows_kept,
    )


@mx.util.use_np
class Layer(nn.HybridBlock):
    """A HybridBlock called with keyword arguments, whose graph follows the call's structure.

    Subclasses define `forward(...)` with the public call signature: it checks the arguments
    and hands them positionally to `_run`, which runs HybridBlock's own forward (imperative,
    or the cached graph when hybridized) and so `hybrid_forward(F, ...)`. `dtype` is checked
    against the dtypes MXNet computes in.
    """

    def __init__(self):
        super().__init__()
        self._structure = None
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        # A lock neither copies nor pickles: a copy makes its own
        return {name: value for name, value in self.__dict__.items() if name != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    @property
    def dtype(self) -> str:
        return self._dtype

    @dtype.setter
    def dtype(self, name: str) -> None:
        # MXNet 1.9 has no bfloat16 arithmetic
        self._dtype = validation.check_backend_dtype(name, "mxnet")

    def cast(self, dtype) -> None:
        """Block.cast, which the layer's dtype follows, its constant arrays (tables, slopes)
        computed again from float64, as a layer built in that dtype holds them."""
        name = dtype if isinstance(dtype, str) else numpy.dtype(dtype).name
        name = validation.check_backend_dtype(name, "mxnet")
        super().cast(name)
        self.dtype = name
        for attribute, value in self.constants().items():
            setattr(self, attribute, value)

    def constants(self) -> dict[str, Any]:
        """The layer's constant arrays by name, in its dtype; none here."""
        return {}

    def __call__(self, *args, **kwargs):
        # Block.__call__ takes positional arguments only
        for hook in self._forward_pre_hooks.values():
            hook(self, args)
        out = self.forward(*args, **kwargs)
        for hook in self._forward_hooks.values():
            hook(self, args, out)
        return out

    def _require_ndarrays(self, *tensors) -> None:
        if any(isinstance(t, mx.sym.Symbol) for t in tensors):
            raise TypeError(
                f"{type(self).__name__} cannot be traced inside another block's hybridized "
                "graph: its checks and masks need concrete arrays. Hybridize the mha layer "
                "itself, or call it from a gluon.Block"
            )

    def export(self, path, epoch=0, remove_amp_cast=True):
        """HybridBlock.export, refused where the traced call placed its queries by its sizes
        (alignment="bottom_right"): the exported graph would hold that call's position for
        every other number of queries and keys."""
        if self._structure is not None and self._structure.sized_position:
            raise ValueError(
                'this graph was traced with alignment="bottom_right", whose first query '
                "follows the numbers of queries and keys: an exported graph would keep the "
                "traced call's. Trace it with an int alignment (the number of keys before the "
                "queries) or without one to export"
            )
        return super().export(path, epoch, remove_amp_cast)

    def _rows_kept(self, valid_lens, smallest, causal, offset, *others) -> bool:
        """masks.every_row_keeps_a_key for an imperative call; a hybridized graph, whose
        structure follows no values, looks for empty rows."""
        return not self._active and every_row_keeps_a_key(valid_lens, smallest, causal, offset,
                                                          *others)

    def _run(self, call: _Call, *inputs):
        # hybrid_forward reads the call's structure from the layer: one call at a time, and a
        # hybridized layer traces its graph again when the structure differs from the last
        with self._lock:
            if call != self._structure:
                self._clear_cached_op()
                self._structure = call
            return nn.HybridBlock.forward(self, *inputs)


@mx.util.use_np
class LayerNorm(nn.LayerNorm):
    """Gluon's LayerNorm (same parameters gamma and beta) with eps in the data's dtype.

    npx.layer_norm rounds eps to float32, an error near 1e-10 in float64 outputs, so the
    normalization is written out as in the reference (float16 in float32).
    """

    def hybrid_forward(self, F, data, gamma, beta):
        half = _dtype_of(self.gamma) == "float16"
        if half:
            data, gamma, beta = (x.astype("float32") for x in (data, gamma, beta))
        mean = data.mean(axis=-1, keepdims=True)
        variance = F.np.square(data - mean).mean(axis=-1, keepdims=True)
        normalized = (data - mean) / F.np.sqrt(variance + self._epsilon) * gamma + beta
        return normalized.astype("float16") if half else normalized


@mx.util.use_np
class Sinks(nn.HybridBlock):
    """Each head's sink logit, the layer's `bias` (zeros at first). Called on any array of the
    graph, it gives the logits as (num_heads, 1, 1), broadcastable to the scores' rows."""

    def __init__(self, num_heads: int, dtype: str):
        super().__init__()
        self.bias = self.params.get("bias", shape=(num_heads,), init=mx.init.Zero(), dtype=dtype)

    def hybrid_forward(self, F, X, bias):
        return F.np.reshape(bias, (-1, 1, 1))


def _dtype_of(parameter) -> str:
    """The name of a Parameter's dtype, which Block.cast changes."""
    return numpy.dtype(parameter.dtype).name


def _rms_normalized(F, X, eps: float, dtype: str):
    """X's last axis scaled to a mean square of 1 (float32 sums for float16)."""
    x = X.astype("float32") if dtype == "float16" else X
    x = x / F.np.sqrt(F.np.square(x).mean(axis=-1, keepdims=True) + eps)
    return x.astype(dtype)


@mx.util.use_np
class RMSNorm(nn.HybridBlock):
    """Scale the last axis to a mean square of 1, then by gamma (float32 sums for float16)."""

    def __init__(self, num_hiddens: int, eps: float, dtype: str):
        super().__init__()
        self.eps = eps
        self.gamma = self.params.get("gamma", shape=(num_hiddens,), init=mx.init.One(),
                                     dtype=dtype)

    def hybrid_forward(self, F, X, gamma):
        return gamma * _rms_normalized(F, X, self.eps, _dtype_of(self.gamma))


@mx.util.use_np
class HeadLayerNorm(nn.HybridBlock):
    """Each head's features of X (batch_size, num_heads, n, head size) to mean 0 and mean
    square 1, then scaled by that head's row of gamma (num_heads, head size): StableLM's
    layer norm per head, without a shift (float32 sums for float16)."""

    def __init__(self, num_heads: int, head_size: int, eps: float, dtype: str):
        super().__init__()
        self.eps = eps
        self.gamma = self.params.get("gamma", shape=(num_heads, head_size), init=mx.init.One(),
                                     dtype=dtype)

    def hybrid_forward(self, F, X, gamma):
        dtype = _dtype_of(self.gamma)
        x = X.astype("float32") if dtype == "float16" else X
        x = x - x.mean(axis=-1, keepdims=True)
        x = x / F.np.sqrt(F.np.square(x).mean(axis=-1, keepdims=True) + self.eps)
        return F.np.expand_dims(gamma, 1) * x.astype(dtype)


def _dense(num_hiddens: int, bias: bool, in_features: int | None, dtype: str) -> nn.Dense:
    """y = x @ W^T + b over the last axis; in_features None defers it to the first input."""
    return nn.Dense(num_hiddens, use_bias=bias, flatten=False, in_units=in_features or 0,
                    dtype=dtype)


def _in_features(dense: nn.Dense) -> int | None:
    # Gluon's Dense weight is (out_features, in_features); unknown sizes read -1 or 0
    in_features = dense.weight.shape[1]
    return int(in_features) if in_features > 0 else None


def _empty(like, *shape):
    # MXNet 1.9's kernels crash on an empty batch (a segfault, or a failure in a later
    # operation): the empty result is made directly, on the input's context
    return mx.np.zeros(shape, dtype=like.dtype, ctx=like.ctx)


def _check_float16_context(dtype: str, queries: mx.np.ndarray, name: str = "queries") -> None:
    # MXNet 1.9.1 multiplies float16 matrices on a GPU only: on the CPU its engine fails, and
    # the failure surfaces in the caller's next operation
    if dtype == "float16" and queries.ctx.device_type != "gpu":
        raise ValueError(
            "float16 attention layers of the mxnet backend run on a GPU context only: MXNet "
            "1.9.1 has no float16 matrix product on the CPU. Use float32, or inputs on "
            f"mx.gpu(). Received: {name} on {queries.ctx}"
        )


def _widened(dtype: str) -> str:
    """float32 for float16 (MXNet has no bfloat16), else the dtype itself."""
    return "float32" if dtype == "float16" else dtype


def _position_dtype(dtype: str) -> str:
    # Positions are counted in the layer's dtype, except float16 that is exact to 2048 only
    return "float32" if dtype == "float16" else dtype


def _positions(F, x, axis: int, dtype: str, far: bool = False):
    """0, 1, ..., n - 1 along `axis` of x (of the layer's `dtype`), with no reference to x's
    values or sizes: in the position dtype, or in float64 where they pass 2**24 (`far`)."""
    if far and dtype != "float64":  # arange_like counts in x's dtype: each whole number exact
        x = x.astype("float64")
    elif dtype == "float16":
        x = x.astype("float32")
    return F.npx.arange_like(x, axis=axis)


def _offset_positions(F, x, offset, dtype: str, far: bool):
    """offset, ..., offset + n - 1 along axis -2 of x, in the rotary angles' dtype: past 2**24
    (`far`, offset then in float64) counted in float64 and rounded once, as the reference."""
    positions = _positions(F, x, -2, dtype, far) + offset
    return positions.astype(rotary_angle_dtype(dtype)) if far else positions


# ---------------------------------------------------------------------------------------------
# Masks

# The tensors a layer of this backend takes; another framework's is a TypeError
_TENSOR_TYPES = mx.np.ndarray


def _check_valid_lens_values(valid_lens: mx.np.ndarray | None) -> Any:
    """The one check that needs values: non-negative whole numbers. Returns the smallest
    length, None where the values were not read.

    It reads values from NDArrays only; symbols (a graph being traced) have none."""
    if isinstance(valid_lens, mx.np.ndarray):
        return validation.check_valid_lens_values(valid_lens.asnumpy())
    return None


def _length_mask(F, valid_lens, ndim: int, key_positions, dtype: str):
    """Keep keys j < valid_len: shape (batch_size, 1, no. of keys) for 1-D valid_lens,
    (batch_size, no. of queries, no. of keys) for 2-D (`ndim`, known while tracing too)."""
    # Shape of lengths: (batch_size, 1 or no. of queries, 1)
    lengths = F.np.expand_dims(valid_lens, -1)
    lengths = F.np.expand_dims(lengths, -1) if ndim == 1 else lengths
    return key_positions < lengths.astype(_position_dtype(dtype))


class _Masks(Masks):
    """mha.masks' rules in MXNet. F is mx.nd, or mx.sym while a graph is traced, which knows
    no sizes: positions are made from the inputs (so they live on their context), and ranks
    and dtypes are read from the call's structure.

    queries (batch_size, ..., no. of queries, d) and keys (batch_size, ..., no. of keys, d),
    every key, cached ones included; offset: the number of cached keys, 0 or a (1,) array."""

    def __init__(self, F, queries, keys, call: _Call, attn_bias=None, offset=0):
        self.F, self.queries, self.keys, self.call = F, queries, keys, call
        self.attn_bias, self.offset = attn_bias, offset

    @functools.cached_property
    def query_positions(self):
        # Query i is at position offset + i; a cache's offset is counted in the same dtype
        call = self.call
        return _positions(self.F, self.queries, -2, call.dtype, call.far_positions) + self.offset

    @functools.cached_property
    def key_positions(self):
        return _positions(self.F, self.keys, -2, self.call.dtype, self.call.far_positions)

    @functools.cached_property
    def position_dtype(self):
        # float64 where a position passes float32's whole numbers (2**24; _far)
        return "float64" if self.call.far_positions else _position_dtype(self.call.dtype)

    def length_mask(self, valid_lens):
        ndim, dtype = self.call.valid_lens_ndim, self.position_dtype
        return _length_mask(self.F, valid_lens, ndim, self.key_positions, dtype)

    def causal_mask(self):
        return self.F.np.expand_dims(self.query_positions, -1) >= self.key_positions

    def band_mask(self, width):
        # Shape of distances: (Q, K), query i being at position offset + i
        distances = self.F.np.expand_dims(self.query_positions, -1) - self.key_positions
        return self.F.np.abs(distances) < width

    def chunk_mask(self, size):
        queries = self.chunk_of(self.F.np.expand_dims(self.query_positions, -1), size)
        return queries == self.chunk_of(self.key_positions, size)

    def chunk_of(self, positions, size):
        # Positions are floats here (float32 or float64, whole numbers), or packed segments'
        # ints; float64, whose quotients round down to the right chunk up to 2**53
        return self.F.np.floor(positions.astype("float64") / size)

    def distances(self, like, packed=None):
        # A traced graph knows no dtypes: the call's is the scores', float32 for float16
        if packed is None:
            packed = self.key_positions - self.F.np.expand_dims(self.query_positions, -1)
        return packed.astype(_widened(self.call.dtype))

    def windows(self, window_mask):
        batch_positions = _positions(self.F, self.queries, 0, self.call.dtype)
        window_index = self.F.np.mod(batch_positions, self.call.num_windows).astype("int32")
        return self.F.np.take(window_mask, window_index, axis=0)

    def rank(self, mask):
        # The user's keep-mask or attn_bias (never the same tensor: one bool, one float)
        return self.call.attn_bias_ndim if mask is self.attn_bias else self.call.mask_ndim

    def is_bool(self, windows):
        return self.call.window_is_bool

    def same_segment(self, segments):
        # np.equal takes one dtype: query and key ids may differ in theirs
        queries, keys = (ids.astype("int64") for ids in segments)
        return self.F.np.equal(self.F.np.expand_dims(queries, -1), self.F.np.expand_dims(keys, -2))

    def segment_positions(self, segment_ids):
        # Shape of same: (batch_size, n, n); of earlier: (n, n), key j before query i
        same = self.same_segment((segment_ids, segment_ids)).astype("int32")
        positions = _positions(self.F, segment_ids.astype("float32"), -1, "float32")
        earlier = self.F.np.expand_dims(positions, 0) < self.F.np.expand_dims(positions, -1)
        # int64: an offset (alignment) added to them past int32's range must not wrap
        return (same * earlier.astype("int32")).sum(axis=-1).astype("int64")

    def isneginf(self, x):
        return self.F.np.isneginf(x)

    def zeros_where(self, blocked, x):
        return self.F.np.where(blocked, self.F.np.zeros_like(x), x)

    def cast_like(self, x, like):
        # A traced graph knows no dtypes: the call's is the scores'
        return x.astype(self.call.dtype)

    def widened(self, x):
        return x.astype(_widened(self.call.dtype))

    def both(self, a, b):
        # MXNet 1.9 has no logical_and for bool
        return (a * b) != 0

    def negate(self, a):
        return self.F.np.logical_not(a)

    def expand_dims(self, x, axis):
        return self.F.np.expand_dims(x, axis)

    def shifted(self, by):
        # New masks: a copy would keep the positions cached at the old offset
        return _Masks(self.F, self.queries, self.keys, self.call, self.attn_bias, self.offset + by)


def _attention_masks(F, queries, keys, valid_lens, mask, window_mask, attn_bias, call: _Call,
                     multihead: bool = False, num_heads: int = 1, offset=0, alibi_slopes=None,
                     segments=(None, None)):
    """(keep, bias) of mha.masks for the call; queries and keys as `_Masks` takes them.

    When autograd records the call and valid_lens is the only mask (see `_by_lengths`), keep
    is instead a `_Lengths`: the lengths, one per row of the scores, for MXNet's fused length-masked
    softmax, whose backward is cheaper than that of an added mask (see `_softmax`).
    """
    if alibi_slopes is None and _by_lengths(valid_lens, call):
        # Shape of lengths: (batch_size, no. of queries), or with multihead
        # (batch_size, num_heads, no. of queries)
        far, dtype = call.far_positions, "float64" if call.far_positions else call.dtype
        key_positions = _positions(F, keys, -2, call.dtype, far)
        query_positions = _positions(F, queries, -2, call.dtype, far)
        lengths = _row_lengths(F, valid_lens, call.valid_lens_ndim, key_positions,
                               query_positions, dtype)
        if multihead:
            lengths = F.np.repeat(F.np.expand_dims(lengths, 1), num_heads, axis=1)
        return _Lengths(lengths), None
    if call.first_position is not None:
        offset = call.first_position  # the alignment's, not the cache's
    masks = _Masks(F, queries, keys, call, attn_bias, offset)
    return masks.combine(valid_lens, mask, call.causal, window_mask, multihead, attn_bias,
                         sliding_window=call.sliding_window, alibi_slopes=alibi_slopes,
                         segment_ids=segments if call.segments else None,
                         attention_chunk_size=call.attention_chunk_size)


def _by_lengths(valid_lens, call: _Call) -> bool:
    # Length masking in npx.softmax gives the weights and gradients of the keep mask
    return (
        valid_lens is not None  # lengths to mask by
        and call.recording  # a backward follows, cheaper than that of where() over the scores
        and call.mask_ndim is None  # no other mask to combine with the lengths
        # Lengths count the cached keys too; causal, like the band, moves with their offset
        and not call.causal
        and call.num_windows is None
        and call.sliding_window is None  # a band of keys is another mask
        and call.attention_chunk_size is None  # so are chunks
        and call.attn_bias_ndim is None  # its -inf entries are a mask, and it adds to the scores
        and call.empty_rows == "zeros"  # npx.softmax makes a row of length 0 all 0, not uniform
        and not call.sinks  # the sinks' column follows the keys, past every length
        and not call.segments  # a query keeps its segment's keys only
    )


class _Lengths(NamedTuple):
    """Keep keys j < length: int32 lengths of the shape of the scores without the key axis,
    each at most the number of keys."""

    lengths: Any


def _row_lengths(F, valid_lens, ndim: int, key_positions, query_positions, dtype: str):
    """valid_lens (batch_size,) or (batch_size, no. of queries) -> (batch_size, no. of queries)
    int32 lengths, clipped to the number of keys (npx.softmax reads past the row otherwise)."""
    # Shape of lengths: (batch_size, 1 or no. of queries), then broadcast over the queries
    lengths = F.np.expand_dims(valid_lens, -1) if ndim == 1 else valid_lens
    lengths = lengths.astype(_position_dtype(dtype))
    lengths = lengths + F.np.zeros_like(query_positions)
    # The number of keys, as an array: the graph does not depend on sizes
    num_keys = F.np.sum(F.np.ones_like(key_positions), keepdims=True)
    return F.np.minimum(lengths, num_keys).astype("int32")


# ---------------------------------------------------------------------------------------------
# Masked softmax


def _softmax(F, scores, keep, dtype: str, recording: bool = False, in_place: bool = False,
             empty_rows: str = "zeros", rows_kept: bool = False):
    """Softmax over the last axis on the kept entries; masked entries are exactly 0, and rows
    with no kept entry 0 or, with empty_rows="uniform", 1 / no. of keys. npx.softmax subtracts
    the row maximum, so logits of 1e4 stay finite.

    Written with MXNet's fused softmax on the scores with -inf at masked entries, rather than
    the reference's steps: a row with no kept key would be all -inf, NaN in softmax, so its
    scores become 0 (finite values and gradients, uniform weights) and it is zeroed after
    unless empty_rows says uniform. The fill replaces what a masked score held (one where()
    over the scores), so a masked key holding NaN or inf stays out. With `recording` and
    valid_lens alone (see `_by_lengths`), `_attention_masks` gives `_Lengths` for MXNet's
    length-masked softmax, whose backward is cheaper. `in_place` writes the weights over
    `scores`, a fresh array of the caller's, when run imperatively without recording: MXNet
    does not pool CPU memory, so every new (..., Q, K) array is fresh pages. rows_kept: every
    row of keep is known to keep a key (masks.every_row_keeps_a_key), so none is looked for.
    float16 is computed in float32 and rounded once: npx.softmax sums float16 in float16.
    """
    if dtype == "float16":
        return _softmax(F, scores.astype("float32"), keep, "float32", recording,
                        empty_rows=empty_rows, rows_kept=rows_kept).astype("float16")
    in_place = in_place and _imperative(scores, recording)
    if keep is None:
        # In place, the weights are written over the scores
        return F.npx.softmax(scores, axis=-1, **({"out": scores} if in_place else {}))
    if isinstance(keep, _Lengths):
        # Entries at or past a row's length are exactly 0, with gradient 0, and a row of
        # length 0 is all 0 with gradient 0
        return F.npx.softmax(scores, keep.lengths, axis=-1, use_length=True)
    if rows_kept:
        # -inf as an array: with a number, MXNet 1.9.1's where() gives the kept scores no gradient
        fill = F.np.full((1,) * scores.ndim, -numpy.inf, dtype=dtype, ctx=scores.ctx)
        scores = F.np.where(keep, scores, fill)
        return F.npx.softmax(scores, axis=-1, **({"out": scores} if in_place else {}))
    # Shape of attended and fill: keep's, with 1 key; attended is 1 or 0 in the dtype (MXNet
    # 1.9.1 has no any() for bool)
    attended = keep.astype(dtype).max(axis=-1, keepdims=True)
    # log(0) = -inf where a row keeps a key, log(1) = 0 where it keeps none
    fill = F.np.log(1 - attended)
    scores = F.np.where(keep, scores, fill)
    weights = F.npx.softmax(scores, axis=-1, **({"out": scores} if in_place else {}))
    if empty_rows == "uniform" or not _may_have_empty_rows(attended):
        return weights
    # The weights are finite: a product by 0 or 1 zeroes the empty rows exactly
    if in_place:
        weights *= attended
        return weights
    return weights * attended


def _imperative(scores, recording: bool) -> bool:
    # Writing over the scores is safe: they are the caller's fresh array, read by nothing after
    return (
        isinstance(scores, mx.np.ndarray)  # arrays, not a graph being traced
        and not recording  # autograd keeps the operators' inputs for the backward
    )


def _may_have_empty_rows(attended) -> bool:
    # Zeroing the rows with no kept key, a pass over the weights, changes none when none is
    return (
        not isinstance(attended, mx.np.ndarray)  # a graph being traced: no values to read
        or (attended.size > 0 and attended.min().item() == 0)  # one read of a small array
    )


@documented
@mx.util.use_np
def masked_softmax(X: mx.np.ndarray, valid_lens: mx.np.ndarray | None = None, *,
                   empty_rows: str = "zeros") -> mx.np.ndarray:
    """Softmax over the last axis of X, keeping only the first valid_lens keys of each row."""
    validation.check_masked_softmax_call(X, valid_lens, tensor_type=_TENSOR_TYPES,
                                         empty_rows=empty_rows)
    _check_valid_lens_values(valid_lens)
    F, dtype = mx.nd, numpy.dtype(X.dtype).name
    recording = mx.autograd.is_recording()
    # An empty X has no row to mask: MXNet's broadcast of an empty mask aborts the process
    if valid_lens is None or X.size == 0:
        return _softmax(F, X, None, dtype, recording)
    # Shape of keep: (batch_size, 1 or no. of queries, no. of keys), then one axis per
    # middle axis of X so that it broadcasts against X
    key_positions = mx.np.arange(X.shape[-1], dtype=_position_dtype(dtype), ctx=X.ctx)
    keep = _length_mask(F, valid_lens, valid_lens.ndim, key_positions, dtype)
    if X.ndim == 2:
        keep = keep[:, 0, :]
    keep = keep.reshape(keep.shape[:1] + (1,) * (X.ndim - 3) + keep.shape[1:])
    return _softmax(F, X, keep, dtype, recording, empty_rows=empty_rows)


def _with_sinks(F, scores, keep, sinks):
    """The scores and keep with one more key at the end, each head's sink (sinks broadcastable
    to the scores' rows), which every row keeps. A traced graph knows no shapes: the column
    and keep take the scores' by arithmetic broadcasting."""
    first = F.np.take(scores, F.np.zeros((1,), dtype="int32"), axis=-1)
    column = F.np.zeros_like(first) + sinks
    if keep is not None:
        keep = F.np.where(keep, F.np.ones_like(scores), F.np.zeros_like(scores)) != 0
        keep = F.np.concatenate([keep, F.np.ones_like(column) != 0], axis=-1)
    return F.np.concatenate([scores, column], axis=-1), keep


def _attention_pool(F, scores, values, keep, bias, dropout, call: _Call, sinks=None):
    """Weights = masked softmax of (scores + bias); output = dropout(weights) @ values."""
    # The scores are the caller's own fresh array: masks may be added in place
    if bias is not None and _imperative(scores, call.recording):
        scores += bias
    elif bias is not None:
        scores = scores + bias
    if sinks is not None:
        # gpt-oss: each head's sink joins every row's softmax as a key; its weight is dropped
        keys = F.npx.arange_like(scores, axis=-1).astype("int32")
        scores, keep = _with_sinks(F, scores, keep, sinks)
    weights = _softmax(F, scores, keep, call.dtype, call.recording, in_place=True,
                       empty_rows=call.empty_rows, rows_kept=call.rows_kept)
    if sinks is not None:
        weights = F.np.take(weights, keys, axis=-1)
    # Gluon's Dropout copies its input when its rate is 0: a pass over the weights, skipped
    dropped = weights if _rate(dropout) == 0 else dropout(weights)
    return F.npx.batch_dot(dropped, values), weights if call.need_weights else None


# ---------------------------------------------------------------------------------------------
# The attention function

# The function drops no weights: dropout is the layers'
_NO_DROPOUT = nn.Dropout(0.0)


@mx.util.use_np
def dot_product_attention(query, key, value, *, mask=None, bias=None, scale=None, causal=False,
                          alignment="top_left", window=None, valid_lens=None, softcap=None,
                          empty_rows="zeros", return_weights=False, return_lse=False,
                          segment_ids=None):
    """Attention of one call on (batch_size, heads, positions, head size): the NumPy
    reference's dot_product_attention (mha.backends.numpy, whose docstring has the
    arguments), in MXNet, on arrays."""
    sizes = function_checks.check_dot_product_attention_call(
        query, key, value, mask=mask, bias=bias, scale=scale, causal=causal,
        alignment=alignment, window=window, valid_lens=valid_lens, softcap=softcap,
        empty_rows=empty_rows, return_weights=return_weights, return_lse=return_lse,
        segment_ids=segment_ids, tensor_type=_TENSOR_TYPES,
    )
    smallest = _check_valid_lens_values(valid_lens)
    batch_size, num_heads, num_kv_heads, num_queries, num_keys = sizes
    F, dtype = mx.nd, numpy.dtype(query.dtype).name
    _check_float16_context(dtype, query, "query")
    if batch_size == 0:
        return _empty_function_result(query, value, num_keys, return_weights, return_lse)
    offset = function_checks.first_position(alignment, num_queries, num_keys)
    rows_kept = every_row_keeps_a_key(valid_lens, smallest, causal, offset, window, mask, bias,
                                      segment_ids)
    sides = function_checks.window_sides(window) or ()
    far = _far(offset, num_queries, num_keys, max((side or 0 for side in sides), default=0))
    call = _call_structure(dtype, d=query.shape[-1], valid_lens=valid_lens,
                           need_weights=return_weights, empty_rows=empty_rows,
                           rows_kept=rows_kept, far_positions=far)
    masks = _Masks(F, query, key, call, offset=offset)
    keep, bias = masks.function_masks(valid_lens, mask, causal,
                                      function_checks.window_sides(window), bias, segment_ids)
    # What the layers compute too, without dropout, the heads paired here, where the sizes
    # are known (an empty head has nothing to repeat)
    key, value = (_repeated_heads(x, num_heads // num_kv_heads) for x in (key, value))
    output, weights, lse = _attention(F, query, key, value, call, keep, bias, _NO_DROPOUT,
                                      scale=scale, softcap=softcap, lse=return_lse)
    if not (return_weights or return_lse):
        return output
    return (output, *(x for x in (weights, lse) if x is not None))


def _empty_function_result(query, value, num_keys: int, return_weights: bool, return_lse: bool):
    """dot_product_attention's results for a batch of 0, made directly (as _empty's)."""
    _, num_heads, num_queries, _ = query.shape
    output = _empty(query, 0, num_heads, num_queries, value.shape[-1])
    weights = _empty(query, 0, num_heads, num_queries, num_keys) if return_weights else None
    lse = _empty(query, 0, num_heads, num_queries) if return_lse else None
    if not (return_weights or return_lse):
        return output
    return (output, *(x for x in (weights, lse) if x is not None))


def _repeated_heads(x, group: int):
    """Each head of x (batch, heads, K, size) `group` times in a row, as Llama's repeat_kv:
    MXNet's np.repeat of an empty array fails in its engine, at a later call."""
    if group == 1:
        return x
    if x.size == 0:
        return mx.np.zeros((x.shape[0], x.shape[1] * group, *x.shape[2:]), x.dtype, ctx=x.ctx)
    return mx.np.repeat(x, group, axis=1)


def _attention(F, queries, keys, values, call: _Call, keep, bias, dropout, *, scale=None,
               softcap=None, sinks=None, lse=False, group=1):
    """Attention on prepared inputs with any leading axes (no checks): what
    dot_product_attention and every layer's DotProductAttention.attend compute.

    queries (..., Q, d); keys (..., K, d) and values (..., K, v), with a head (axis -3) for
    every `group` heads of the queries; keep and bias broadcastable to the scores (..., Q, K),
    or None; `call` gives d, the dtype, need_weights, empty_rows and whether autograd records;
    sinks, each head's sink logit broadcastable to the scores' rows, or None. Returns
    (output, weights, lse): weights unless call.need_weights, and each row's log-sum-exp
    unless lse, are None.
    """
    if group > 1:
        # Query head h attends with key-value head h // group, as Llama's repeat_kv (a
        # hybridized graph knows no sizes to fold the query heads by, as torch's does)
        keys, values = F.np.repeat(keys, group, axis=-3), F.np.repeat(values, group, axis=-3)
    # Scaling the queries rather than the scores touches Q x d numbers instead of Q x K
    if scale is None:
        queries = queries / math.sqrt(call.d)
    elif call.dtype == "float16":
        # In float32, rounded once, as torch's: float16 holds a scale below 6.1e-5 in few bits
        queries = (queries.astype("float32") * scale).astype("float16")
    else:
        queries = queries * scale
    # Shape of scores: (..., no. of queries, no. of keys). npx.batch_dot is MXNet's batched
    # GEMM, faster than np.matmul on 4-D arrays and free of its transposed copy of keys
    scores = F.npx.batch_dot(queries, keys, transpose_b=True)
    if softcap is not None:
        # Gemma 2's soft cap: the scores squashed into (-softcap, softcap), before the masks
        scores = softcap * F.np.tanh(scores / softcap)
    # The pool may write over the scores: the log-sum-exp reads them first
    row_lse = _log_sum_exp(F, scores if bias is None else scores + bias, keep) if lse else None
    output, weights = _attention_pool(F, scores, values, keep, bias, dropout, call, sinks)
    return output, weights, row_lse


def _log_sum_exp(F, scores, keep):
    """log(sum(exp(score))) of each row's kept scores, shape (..., no. of queries); -inf for a
    row with none."""
    if keep is not None:
        scores = F.np.where(keep, scores, F.np.full_like(scores, -numpy.inf))
    row_max = scores.max(axis=-1)
    if F is not mx.sym and scores.size == 0:  # an empty batch: MXNet's sum of it fails later
        return row_max
    # A row with no kept score has maximum -inf: shifting by 0 keeps its sum 0, its log -inf
    shift = F.np.where(F.np.isneginf(row_max), F.np.zeros_like(row_max), row_max)
    lse = shift + F.np.log(F.np.exp(scores - F.np.expand_dims(shift, -1)).sum(axis=-1))
    # A row with a kept +inf: +inf (MXNet's sum of a row holding +inf is NaN)
    return F.np.where(F.np.isposinf(row_max), row_max, lse)


# ---------------------------------------------------------------------------------------------
# Layers


@documented
@mx.util.use_np
class DotProductAttention(Layer):
    """Scaled dot-product attention: softmax(Q K^T / sqrt(d)) V."""

    def __init__(self, dropout: float = 0.0, *, scale: float | None = None,
                 empty_rows: str = "zeros", sliding_window: int | None = None,
                 softcap: float | None = None, dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("DotProductAttention", locals())
        self.scale, self.empty_rows, self.sliding_window = scale, empty_rows, sliding_window
        self.softcap = softcap
        self.dropout = nn.Dropout(dropout)
        self.attention_weights = None

    def forward(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                window_mask=None, attn_bias=None, alignment=None,
                segment_ids=None):
        self._require_ndarrays(queries, keys, values, valid_lens, mask, window_mask, attn_bias)
        _, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=self.dtype,
            tensor_type=_TENSOR_TYPES, same_query_key_size=True,
        )
        smallest = _check_valid_lens_values(valid_lens)
        _check_float16_context(self.dtype, queries)
        if queries.shape[0] == 0:
            self.attention_weights = _empty(queries, 0, queries.shape[1], keys.shape[1])
            return _empty(queries, 0, queries.shape[1], values.shape[2])
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys)
        rows_kept = self._rows_kept(valid_lens, smallest, causal, offset, mask, window_mask,
                                    attn_bias, self.sliding_window, segment_ids)
        call = _call_structure(self.dtype, queries.shape[-1], valid_lens, mask, causal,
                               window_mask, attn_bias=attn_bias, empty_rows=self.empty_rows,
                               sliding_window=self.sliding_window,
                               **_first_position(alignment, num_queries, num_keys),
                               segment_ids=segment_ids, rows_kept=rows_kept)
        output, self.attention_weights = self._run(
            call, queries, keys, values, valid_lens, mask, window_mask, attn_bias,
            *_segment_inputs(segment_ids)
        )
        return output

    def hybrid_forward(self, F, queries, keys, values, valid_lens, mask, window_mask,
                       attn_bias, query_segments, key_segments):
        keep, bias = _attention_masks(F, queries, keys, valid_lens, mask, window_mask,
                                      attn_bias, self._structure,
                                      segments=(query_segments, key_segments))
        return self.attend(F, queries, keys, values, self._structure, keep, bias)

    def attend(self, F, queries, keys, values, call: _Call, keep=None, bias=None, sinks=None,
               group=1):
        """Attention on prepared inputs with any leading axes (no checks), as the attention
        function computes it (_attention).

        queries (..., Q, d), keys (..., K, d), values (..., K, v); keep and bias as made by
        the mask helpers; `call` gives d, the dtype, need_weights and whether autograd
        records; sinks, each head's sink logit broadcastable to the scores' rows (num_heads,
        1, 1), or None. MultiHeadAttention calls this with a head axis, keys and values with a
        head for every `group` heads of the queries. Returns (output, weights), weights None
        unless call.need_weights.
        """
        output, weights, _ = _attention(F, queries, keys, values, call, keep, bias, self.dropout,
                                        scale=self.scale, softcap=self.softcap, sinks=sinks,
                                        group=group)
        return output, weights


@documented
@mx.util.use_np
class AdditiveAttention(Layer):
    """Additive attention: scores w_v^T tanh(W_q q + W_k k)."""

    def __init__(self, num_hiddens: int, dropout: float = 0.0, *, query_size: int | None = None,
                 key_size: int | None = None, empty_rows: str = "zeros",
                 sliding_window: int | None = None, dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("AdditiveAttention", locals())
        self.num_hiddens, self.empty_rows = num_hiddens, empty_rows
        self.sliding_window = sliding_window
        self.W_q = _dense(num_hiddens, False, query_size, self.dtype)
        self.W_k = _dense(num_hiddens, False, key_size, self.dtype)
        self.w_v = _dense(1, False, num_hiddens, self.dtype)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights = None
        self.initialize(_LinearInit())

    def forward(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                window_mask=None, attn_bias=None, alignment=None,
                segment_ids=None):
        self._require_ndarrays(queries, keys, values, valid_lens, mask, window_mask, attn_bias)
        _, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=self.dtype,
            tensor_type=_TENSOR_TYPES,
            sizes=(("queries", "query_size", _in_features(self.W_q)),
                   ("keys", "key_size", _in_features(self.W_k))),
        )
        _check_valid_lens_values(valid_lens)
        _check_float16_context(self.dtype, queries)
        if queries.shape[0] == 0:
            self.attention_weights = _empty(queries, 0, queries.shape[1], keys.shape[1])
            return _empty(queries, 0, queries.shape[1], values.shape[2])
        call = _call_structure(self.dtype, None, valid_lens, mask, causal, window_mask,
                               attn_bias=attn_bias, empty_rows=self.empty_rows,
                               sliding_window=self.sliding_window,
                               **_first_position(alignment, num_queries, num_keys),
                               segment_ids=segment_ids)
        output, self.attention_weights = self._run(
            call, queries, keys, values, valid_lens, mask, window_mask, attn_bias,
            *_segment_inputs(segment_ids)
        )
        return output

    def hybrid_forward(self, F, queries, keys, values, valid_lens, mask, window_mask,
                       attn_bias, query_segments, key_segments):
        keep, bias = _attention_masks(F, queries, keys, valid_lens, mask, window_mask,
                                      attn_bias, self._structure,
                                      segments=(query_segments, key_segments))
        queries, keys = self.W_q(queries), self.W_k(keys)
        # After adding axes: queries (batch_size, no. of queries, 1, num_hiddens) and keys
        # (batch_size, 1, no. of keys, num_hiddens); their sum broadcasts to
        # (batch_size, no. of queries, no. of keys, num_hiddens)
        features = F.np.tanh(F.np.expand_dims(queries, 2) + F.np.expand_dims(keys, 1))
        # w_v has one output; shape of scores: (batch_size, no. of queries, no. of keys)
        scores = F.np.squeeze(self.w_v(features), axis=-1)
        return _attention_pool(F, scores, values, keep, bias, self.dropout, self._structure)


def _query_scales(F, scaling, queries, offset, dtype, positions=None, far=False):
    """query_scaling's factor of each of the heads' queries (batch_size, heads, n, d), in
    the layer's dtype: 1 + beta * log(1 + floor((p + o) / L)) (mha.encoding.query_scales) at
    positions offset, ..., offset + n - 1, (n, 1), or at each packed row's `positions`
    (batch_size, n), (batch_size, 1, n, 1); counted in float32 for float16."""
    if positions is None:
        positions = F.np.expand_dims(_offset_positions(F, queries, offset, dtype, far), -1)
    else:
        positions = F.np.expand_dims(F.np.expand_dims(positions, 1), -1)
        positions = positions.astype(rotary_angle_dtype(dtype))
    shifted = positions + scaling.get("position_offset", 0)
    steps = F.np.floor(shifted / scaling["original_max_position_embeddings"])
    return (1 + scaling["beta"] * F.np.log1p(steps)).astype(dtype)


@documented
@mx.util.use_np
class MultiHeadAttention(Layer):
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
        self.W_q = _dense(num_hiddens, bias, query_size, self.dtype)
        self.W_k = _dense(kv_hiddens, bias, key_size, self.dtype)
        self.W_v = _dense(kv_hiddens, bias, value_size, self.dtype)
        self.W_o = _dense(out_features or num_hiddens, bias if out_bias is None else out_bias,
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
            self.W_g = _dense(num_hiddens, bias, query_size, self.dtype)
        # ALiBi's slope of each head (BLOOM, MPT): no weight, a constant of the head count,
        # a plain array that reaches a traced graph as an input, as the rotary frequencies
        self.alibi = alibi
        self.alibi_slopes = self.constants().get("alibi_slopes")
        self.attention_weights = None
        self.initialize(_LinearInit())

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

    def constants(self) -> dict[str, Any]:
        if not self.alibi:
            return {}
        slopes = alibi_slopes(self.num_heads).astype(self.dtype).reshape(-1, 1, 1)
        return {"alibi_slopes": from_numpy(slopes)}

    def forward(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                window_mask=None, head_mask=None, need_weights=True, attn_bias=None,
                cache=None, alignment=None, segment_ids=None):
        self._require_ndarrays(queries, keys, values, valid_lens, mask, window_mask, head_mask,
                               attn_bias)
        num_kv_heads = self.num_kv_heads or self.num_heads
        head_size = self.num_hiddens // self.num_heads
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, head_mask=head_mask, need_weights=need_weights,
            attn_bias=attn_bias, cache=cache, segment_ids=segment_ids,
            rope_scaling=self.rope_scaling, dtype=self.dtype, tensor_type=_TENSOR_TYPES,
            num_heads=self.num_heads, kv_heads=(num_kv_heads, head_size),
            sizes=(("queries", "query_size", _in_features(self.W_q)),
                   ("keys", "key_size", _in_features(self.W_k)),
                   ("values", "value_size", _in_features(self.W_v))),
        )
        smallest = _check_valid_lens_values(valid_lens)
        _check_float16_context(self.dtype, queries)
        # The positions before this call's: those in the cache
        offset = 0 if cache is None or cache.keys is None else cache.keys.shape[2]
        if batch_size == 0:
            shape = (0, self.num_heads, num_queries, num_keys)
            weights = _empty(queries, *shape) if need_weights else None
            self.attention_weights = self.attention.attention_weights = weights
            output = _empty(queries, 0, num_queries, self.out_features or self.num_hiddens)
            if cache is not None:
                cache = KVCache(*[_empty(queries, 0, num_kv_heads, num_keys, head_size)] * 2)
            return output if cache is None else (output, cache)
        rows_kept = self._rows_kept(
            valid_lens, smallest, causal,
            function_checks.layer_first_position(alignment, num_queries, num_keys, offset),
            mask, window_mask, attn_bias, self.sliding_window, segment_ids,
            self.attention_chunk_size)
        call = _call_structure(self.dtype, head_size, valid_lens, mask, causal, window_mask,
                               head_mask, need_weights, attn_bias, self.empty_rows,
                               self.sliding_window, cache, offset, self.sinks,
                               segment_ids=segment_ids,
                               attention_chunk_size=self.attention_chunk_size,
                               **_first_position(alignment, num_queries, num_keys, offset),
                               rows_kept=rows_kept)
        # The rotary frequencies reach a traced graph as an input, on the queries' context
        frequencies = None
        if self.rotary is not None:
            # The sequence, whose length may choose them, runs to the last key
            frequencies = self.rotary.frequencies_at(offset + keys.shape[1], queries.ctx)
        slopes = None if self.alibi_slopes is None else self.alibi_slopes.as_in_context(
            queries.ctx)
        # So do the cached keys and values, so that one graph serves every decoding step
        cached = (cache.keys, cache.values) if call.cached else (None, None)
        outputs = self._run(call, queries, keys, values, valid_lens, mask, window_mask,
                            head_mask, attn_bias, frequencies, slopes, *cached,
                            *_segment_inputs(segment_ids))
        # The graph's outputs: output, then the weights and the cache's keys and values
        output, *outputs = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
        weights = outputs.pop(0) if need_weights else None
        self.attention_weights = self.attention.attention_weights = weights
        if cache is not None:
            cache = KVCache(*outputs)
        return output if cache is None else (output, cache)

    def hybrid_forward(self, F, queries, keys, values, valid_lens, mask, window_mask,
                       head_mask, attn_bias, frequencies, alibi_slopes, cached_keys,
                       cached_values, query_segments, key_segments):
        call = self._structure
        # The positions before this call's, counted in the graph: a (1,) array, or 0
        offset = 0
        if call.cached:
            cached_positions = _positions(F, cached_keys, 2, self.dtype, call.far_positions)
            offset = F.np.sum(F.np.ones_like(cached_positions), keepdims=True)
        # Shape after transpose_qkv: (batch_size, num_heads, no. of queries,
        # num_hiddens / num_heads); keys and values have num_kv_heads heads
        num_kv_heads = self.num_kv_heads or self.num_heads
        gates = self.W_g(queries) if self.output_gate else None
        queries, keys, values = self.project(F, queries, keys, values)
        # The positions of queries and keys: offset, offset + 1, ...; packed sequences
        # restart them at each segment
        positions = _Masks(F, queries, keys, call).packed_positions(
            (query_segments, key_segments) if call.segments else None)
        queries, keys = self.at_positions(F, queries, keys, offset, frequencies, positions)
        if call.cached:
            # This call's keys and values follow those of the positions before it
            keys = F.np.concatenate([cached_keys, keys], axis=2)
            values = F.np.concatenate([cached_values, values], axis=2)
        # Shape of keep and bias: broadcastable to
        # (batch_size, num_heads, no. of queries, no. of keys); made here, the graph knowing
        # the number of keys, cached ones included, from the keys alone
        keep, bias = _attention_masks(F, queries, keys, valid_lens, mask, window_mask,
                                      attn_bias, call, multihead=True, num_heads=self.num_heads,
                                      offset=offset, alibi_slopes=alibi_slopes,
                                      segments=(query_segments, key_segments))
        # The cache holds num_kv_heads heads, before they are repeated
        cache = (keys, values) if call.cache else ()
        # Shape of output: (batch_size, num_heads, no. of queries, num_hiddens / num_heads)
        sinks = self.sink_logits(queries) if self.sinks else None
        output, weights = self.attention.attend(F, queries, keys, values, call, keep, bias,
                                                sinks, self.num_heads // num_kv_heads)
        if head_mask is not None:
            # (num_heads,) -> (num_heads, 1, 1); (batch_size, num_heads) -> (B, num_heads, 1, 1)
            head_mask = F.np.expand_dims(F.np.expand_dims(head_mask.astype(self.dtype), -1), -1)
            output = output * head_mask
        # Shape of output_concat: (batch_size, no. of queries, num_hiddens)
        output_concat = self.transpose_output(F, output)
        if gates is not None:
            # Qwen3-Next: each feature of the heads' output scaled by its gate, in (0, 1)
            output_concat = output_concat * F.npx.sigmoid(gates)
        output = self.W_o(output_concat)
        outputs = ((output, weights) if call.need_weights else (output,)) + cache
        return outputs if len(outputs) > 1 else output

    def at_positions(self, F, queries, keys, offset, frequencies, positions):
        """Each head's queries and keys at their positions offset, offset + 1, ... (packed
        sequences: `positions`, each row's own): turned by the rotary embedding, normalized
        where qk_norm is "head_after_rotary", and the queries scaled by query_scaling."""
        far = self._structure.far_positions
        if self.rotary is not None:
            queries = self.rotary.rotate(F, queries, offset, frequencies=frequencies,
                                         positions=positions[0], far=far)
            keys = self.rotary.rotate(F, keys, offset, frequencies=frequencies,
                                      positions=positions[1], far=far)
        if self.qk_norm == "head_after_rotary":  # Hunyuan: the turned features normalized
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.query_scaling is not None:
            # Ministral 3: each query scaled by its position, past every L positions
            queries = queries * _query_scales(F, self.query_scaling, queries, offset,
                                              self.dtype, positions[0], far)
        return queries, keys

    def project(self, F, queries, keys, values):
        """Each head's queries, keys and values: projected, and where qk_norm says, queries
        and keys normalized (over the whole projection, or over each head); values too where
        value_norm says."""
        num_kv_heads = self.num_kv_heads or self.num_heads
        queries, keys = self.W_q(queries), self.W_k(keys)
        if self.qk_norm == "projection":
            # OLMo 2: the whole projection of each position normalized
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries = self.transpose_qkv(F, queries)
        keys = self.transpose_qkv(F, keys, num_kv_heads)
        values = self.transpose_qkv(F, self.W_v(values), num_kv_heads)
        if self.qk_norm in ("head", "layer_norm_per_head"):
            # Qwen3: each head's features normalized, by one scale the heads share; StableLM:
            # centered too, by a scale of each head's own
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.value_norm:  # Gemma 4: each head's values to a mean square of 1, no weight
            values = _rms_normalized(F, values, self.qk_norm_eps, self.dtype)
        return queries, keys, values

    def transpose_qkv(self, F, X, num_heads=None):
        """(batch_size, n, num_heads * head size) -> (batch_size, num_heads, n, head size),
        num_heads being the layer's unless given."""
        num_heads = num_heads or self.num_heads
        X = F.npx.reshape(X, (-2, -2, num_heads, self.num_hiddens // self.num_heads))
        return F.np.transpose(X, (0, 2, 1, 3))

    def transpose_output(self, F, X):
        """Reverse transpose_qkv: -> (batch_size, n, num_hiddens)."""
        X = F.np.transpose(X, (0, 2, 1, 3))
        return F.npx.reshape(X, (-2, -2, self.num_hiddens))


@documented
@mx.util.use_np
class MultiHeadLatentAttention(Layer):
    """Multi-head latent attention (DeepSeek-V2 and V3, Kimi K2): the NumPy reference's
    MultiHeadLatentAttention (mha.backends.numpy), in MXNet. A LatentCache's latent and rotary
    keys are inputs and outputs of its graph, as MultiHeadAttention's KVCache."""

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
            self.W_q = _dense(num_heads * qk_head, False, num_hiddens, self.dtype)
        else:  # queries through a low-rank pair, normalized between
            self.W_qa = _dense(q_lora_rank, bias, num_hiddens, self.dtype)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps, self.dtype)
            self.W_qb = _dense(num_heads * qk_head, False, q_lora_rank, self.dtype)
        # One projection gives each position's latent and its shared rotary key
        self.W_kva = _dense(kv_lora_rank + qk_rope_head_dim, bias, num_hiddens, self.dtype)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps, self.dtype)
        self.W_kvb = _dense(num_heads * (qk_nope_head_dim + v_head_dim), False, kv_lora_rank,
                            self.dtype)
        self.W_o = _dense(num_hiddens, bias, num_heads * v_head_dim, self.dtype)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta, interleaved=rope_interleaved,
                                      scaling=self.rope_scaling, dtype=self.dtype)
        # 1 / sqrt(head size), times yarn's mscale twice when the rotary is scaled so
        self.scale = latent_attention_scale(qk_head, self.rope_scaling)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights = None
        self.initialize(_LinearInit())

    def forward(self, X, valid_lens=None, *, mask=None, causal=False, window_mask=None,
                need_weights=True, attn_bias=None, cache=None, absorbed=False):
        self._require_ndarrays(X, valid_lens, mask, window_mask, attn_bias)
        validation.check_latent_attention_call(
            X, valid_lens, mask=mask, causal=causal, window_mask=window_mask,
            need_weights=need_weights, attn_bias=attn_bias, cache=cache, absorbed=absorbed,
            dtype=self.dtype, num_hiddens=self.num_hiddens, num_heads=self.num_heads,
            latent_sizes=(self.kv_lora_rank, self.qk_rope_head_dim), tensor_type=_TENSOR_TYPES,
        )
        _check_valid_lens_values(valid_lens)
        _check_float16_context(self.dtype, X, "X")
        # The positions before this call's: those in the cache
        offset = 0 if cache is None or cache.latent is None else cache.latent.shape[1]
        if X.shape[0] == 0:
            return self.empty_batch(X, offset, need_weights, cache)
        call = _call_structure(self.dtype, valid_lens=valid_lens, mask=mask, causal=causal,
                               window_mask=window_mask, need_weights=need_weights,
                               attn_bias=attn_bias, empty_rows=self.empty_rows,
                               sliding_window=self.sliding_window, cache=cache, offset=offset,
                               far_positions=_far(offset, X.shape[1], offset + X.shape[1]))
        # The rotary frequencies, and the cached latents and rotary keys, reach a traced
        # graph as inputs, so that one graph serves every decoding step
        frequencies = self.rotary.frequencies_at(offset + X.shape[1], X.ctx)
        cached = (cache.latent, cache.rotary_keys) if call.cached else (None, None)
        outputs = self._run(call._replace(absorbed=absorbed), X, valid_lens, mask, window_mask,
                            attn_bias, frequencies, *cached)
        # The graph's outputs: output, then the weights and the cache's latents and rotary keys
        output, *outputs = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
        self.attention_weights = outputs.pop(0) if need_weights else None
        return output if cache is None else (output, LatentCache(*outputs))

    def hybrid_forward(self, F, X, valid_lens, mask, window_mask, attn_bias, frequencies,
                       cached_latent, cached_rotary_keys):
        call = self._structure
        # The positions before this call's, counted in the graph: a (1,) array, or 0
        offset = 0
        if call.cached:
            cached_positions = _positions(F, cached_latent, 1, self.dtype, call.far_positions)
            offset = F.np.sum(F.np.ones_like(cached_positions), keepdims=True)
        # Shape of queries: (batch_size, num_heads, no. of steps, nope + rope)
        queries = self.project_queries(F, X, offset, frequencies)
        if self.query_scaling is not None:
            # Mistral 4: each query scaled by its position, past every L positions
            queries = queries * _query_scales(F, self.query_scaling, queries, offset, self.dtype,
                                              far=call.far_positions)
        # Shape of latent: (batch_size, no. of steps, kv_lora_rank); of rotary_keys:
        # (batch_size, 1, no. of steps, rope), one rotary key for every head
        latent, rotary_keys = self.compress(F, X, offset, frequencies)
        if call.cached:
            # This call's latents and rotary keys follow those of the positions before it
            latent = F.np.concatenate([cached_latent, latent], axis=1)
            rotary_keys = F.np.concatenate([cached_rotary_keys, rotary_keys], axis=2)
        cache = (latent, rotary_keys) if call.cache else ()
        keep, bias = _attention_masks(F, queries, F.np.expand_dims(latent, 1), valid_lens, mask,
                                      window_mask, attn_bias, call, multihead=True,
                                      num_heads=self.num_heads, offset=offset)
        attend = self.attend_absorbed if call.absorbed else self.attend_expanded
        output, weights = attend(F, queries, latent, rotary_keys, keep, bias, call)
        # Shape of output: (batch_size, no. of steps, num_heads * v_head_dim)
        output = F.npx.reshape(F.np.transpose(output, (0, 2, 1, 3)),
                               (-2, -2, self.num_heads * self.v_head_dim))
        output = self.W_o(output)
        outputs = ((output, weights) if call.need_weights else (output,)) + cache
        return outputs if len(outputs) > 1 else output

    def attend_expanded(self, F, queries, latent, rotary_keys, keep, bias, call):
        """Attention over each head's keys and values, expanded from the latent."""
        keys, values = self.expand(F, latent, rotary_keys)
        output, weights, _ = _attention(F, queries, keys, values, call, keep, bias,
                                        self.dropout, scale=self.scale)
        return output, weights

    def attend_absorbed(self, F, queries, latent, rotary_keys, keep, bias, call):
        """The same numbers with W_kvb folded into the queries and the output (multi-query
        attention over the latent; see the NumPy reference)."""
        # W_kvb per head (Gluon keeps it (out, in)): its key part W_uk (kv_lora_rank, H,
        # nope), value part W_uv; read from the graph's parameters when it is traced
        W = self.W_kvb.weight.var() if F is mx.sym else self.W_kvb.weight.data(latent.ctx)
        W = F.npx.reshape(F.np.transpose(W), (self.kv_lora_rank, self.num_heads, -1))
        W_uk, W_uv = F.np.split(W, [self.qk_nope_head_dim], axis=-1)
        # Shape of absorbed: (batch_size, num_heads, no. of steps, kv_lora_rank)
        nope, rope = F.np.split(queries, [self.qk_nope_head_dim], axis=-1)
        queries = F.np.concatenate([F.np.einsum("bhqn,rhn->bhqr", nope, W_uk), rope], axis=-1)
        latent = F.np.expand_dims(latent, 1)
        keys = F.np.concatenate([latent, rotary_keys], axis=-1)
        output, weights, _ = _attention(F, queries, keys, latent, call, keep, bias, self.dropout,
                                        scale=self.scale, group=self.num_heads)
        # Shape of output: (batch_size, num_heads, no. of steps, v_head_dim)
        return F.np.einsum("bhqr,rhv->bhqv", output, W_uv), weights

    def project_queries(self, F, X, offset, frequencies):
        """Each head's query at positions offset, ..., its rotary part turned: (batch_size,
        num_heads, n, nope + rope)."""
        Q = self.W_q(X) if self.q_lora_rank is None else self.W_qb(self.q_norm(self.W_qa(X)))
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        Q = F.np.transpose(F.npx.reshape(Q, (-2, -2, self.num_heads, qk_head)), (0, 2, 1, 3))
        nope, rope = F.np.split(Q, [self.qk_nope_head_dim], axis=-1)
        rotated = self.rotary.rotate(F, rope, offset, frequencies=frequencies,
                                     far=self._structure.far_positions)
        return F.np.concatenate([nope, rotated], axis=-1)

    def compress(self, F, X, offset, frequencies):
        """(latent (batch_size, n, kv_lora_rank), normalized; the rotary key (batch_size, 1,
        n, rope) at positions offset, ..., turned): what a latent cache keeps."""
        latent, rope = F.np.split(self.W_kva(X), [self.kv_lora_rank], axis=-1)
        rotary_keys = self.rotary.rotate(F, F.np.expand_dims(rope, 1), offset,
                                         frequencies=frequencies,
                                         far=self._structure.far_positions)
        return self.kv_norm(latent), rotary_keys

    def expand(self, F, latent, rotary_keys):
        """Each head's keys (batch_size, num_heads, n, nope + rope) and values (batch_size,
        num_heads, n, v_head_dim) from the latent, the rotary key shared by the heads."""
        kv_head = self.qk_nope_head_dim + self.v_head_dim
        KV = F.npx.reshape(self.W_kvb(latent), (-2, -2, self.num_heads, kv_head))
        keys_nope, values = F.np.split(F.np.transpose(KV, (0, 2, 1, 3)),
                                       [self.qk_nope_head_dim], axis=-1)
        shared = F.np.repeat(rotary_keys, self.num_heads, axis=1)
        return F.np.concatenate([keys_nope, shared], axis=-1), values

    def empty_batch(self, X, offset, need_weights, cache):
        """The result of a call on an empty batch, made directly (see _empty)."""
        steps, positions = X.shape[1], offset + X.shape[1]
        weights = _empty(X, 0, self.num_heads, steps, positions) if need_weights else None
        self.attention_weights, output = weights, _empty(X, 0, steps, self.num_hiddens)
        if cache is None:
            return output
        return output, LatentCache(_empty(X, 0, positions, self.kv_lora_rank),
                                   _empty(X, 0, 1, positions, self.qk_rope_head_dim))


@documented
@mx.util.use_np
class PositionalEncoding(Layer):
    """Add the sinusoidal positional encoding P to X, then dropout.

    P is a plain array, not a Parameter: it reaches a hybridized graph as an input,
    sliced to X's length and on X's context.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("PositionalEncoding", locals())
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.dropout = nn.Dropout(dropout)
        self.P = self.constants()["P"]

    def constants(self) -> dict[str, Any]:
        return {"P": from_numpy(sinusoid_table(self.max_len, self.num_hiddens).astype(self.dtype))}

    def forward(self, X):
        self._require_ndarrays(X)
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, self.dtype, tensor_type=_TENSOR_TYPES
        )
        P = self.P[:, : X.shape[1], :].as_in_context(X.ctx)
        return self._run(_call_structure(self.dtype), X, P)

    def hybrid_forward(self, F, X, P):
        return self.dropout(X + P)


@documented
@mx.util.use_np
class LearnedPositionalEncoding(Layer):
    """Add a learned positional embedding to X, then dropout: P is a weight, one row per
    position, trained with the rest.

    P is the weight of a Gluon Embedding, drawn by Gluon's default initializer (uniform in
    +-0.07): the rows of positions 0, 1, ... are looked up in the graph, positions made
    from X.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("LearnedPositionalEncoding", locals())
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.dropout = nn.Dropout(dropout)
        self.embedding = nn.Embedding(max_len, num_hiddens, dtype=self.dtype)
        self.initialize(_InFloat32(mx.init.Uniform()))

    def forward(self, X):
        self._require_ndarrays(X)
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, self.dtype, tensor_type=_TENSOR_TYPES
        )
        return self._run(_call_structure(self.dtype), X)

    def hybrid_forward(self, F, X):
        # Shape of P: (1, no. of steps, num_hiddens), the rows of positions 0, 1, ...
        P = F.np.expand_dims(self.embedding(_positions(F, X, 1, self.dtype)), 0)
        return self.dropout(X + P)


@documented
@mx.util.use_np
class RotaryEmbedding(Layer):
    """Rotary position embeddings (RoPE): each pair of features turned by an angle that grows
    with the position.

    The frequencies are a plain array, not a Parameter: they reach a hybridized graph as an
    input, on X's context, and so does the offset, so that a graph serves every offset.
    """

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
        self.frequencies = self.constants()["frequencies"]
        # The factor of the cosines and sines: a yarn or longrope scaling's, else 1
        self.attention_factor = rotary_attention_factor(self.scaling)

    def constants(self) -> dict[str, Any]:
        # In float64 for a float64 layer, else float32 (mha.encoding.rotary_angle_dtype)
        frequencies = rotary_frequencies(self.rotated, self.theta, self.scaling)
        return {"frequencies": from_numpy(frequencies.astype(rotary_angle_dtype(self.dtype)))}

    def forward(self, X, offset=0):
        self._require_ndarrays(X)
        validation.check_rotary_call(
            X, offset, self.num_hiddens, self.dtype, tensor_type=_TENSOR_TYPES
        )
        frequencies = self.frequencies_at(offset + X.shape[-2], X.ctx)
        # Shape of offset: (1,), in the angles' dtype, or float64 past 2**24 (_far)
        far = _far(offset, X.shape[-2], 0)
        dtype = "float64" if far else frequencies.dtype
        offset = mx.np.full((1,), offset, dtype=dtype, ctx=X.ctx)
        return self._run(_call_structure(self.dtype, far_positions=far), X, offset, frequencies)

    def hybrid_forward(self, F, X, offset, frequencies):
        return self.rotate(F, X, offset, frequencies=frequencies,
                           far=self._structure.far_positions)

    def frequencies_at(self, length: int, ctx):
        """The frequencies of a call over positions 0, ..., length - 1, on `ctx`: the layer's,
        or those a dynamic or longrope scaling gives a sequence longer than it was trained on."""
        longer = rotary_frequencies_at(self.rotated, self.theta, self.scaling, length)
        if longer is None:
            return self.frequencies.as_in_context(ctx)
        return mx.np.array(longer, dtype=self.frequencies.dtype, ctx=ctx)

    def rotate(self, F, X, offset=0, *, frequencies, positions=None, far=False):
        """X (..., n, num_hiddens) at positions offset, ..., offset + n - 1, rotated (no
        checks). MultiHeadAttention calls this on each head's queries and keys.
        frequencies: those of the call (frequencies_at), on X's context (an input of the graph
        being traced); positions (batch_size, n), each row's own (packed sequences, X
        (batch_size, heads, n, num_hiddens)), replace offset's; far: a position passes 2**24
        (the offset is then in float64)."""
        # Shape of angles, cos and sin: (n, rotated / 2); positions are counted in the
        # angles' dtype (float32 for float16)
        if positions is None:
            positions = _offset_positions(F, X, offset, self.dtype, far)
        else:
            # Packed sequences: each row's own positions, (batch_size, 1, n) against the heads
            positions = F.np.expand_dims(positions, 1).astype(rotary_angle_dtype(self.dtype))
        angles = F.np.expand_dims(positions, -1) * F.np.expand_dims(frequencies, 0)
        cos = (F.np.cos(angles) * self.attention_factor).astype(self.dtype)
        sin = (F.np.sin(angles) * self.attention_factor).astype(self.dtype)
        # The features that turn; shape of X: (..., n, rotated)
        partial = self.rotated < self.num_hiddens
        if partial:
            X, rest = F.np.split(X, [self.rotated], axis=-1)
        # The two features of each pair; shape of x1 and x2: (..., n, rotated / 2). A
        # traced graph's indexing takes no Ellipsis and knows no rank, so X[..., 0::2] is read
        # from pairs (..., n, rotated / 2, 2): the codes, read from the right, split the
        # last axis (-6) into (rotated / 2, 2) and copy every other axis (-4)
        if self.interleaved:
            pairs = F.npx.reshape(X, (-4, -1, 2, -6), reverse=True)
            x1, x2 = (F.np.squeeze(x, axis=-1) for x in F.np.split(pairs, 2, axis=-1))
        else:
            x1, x2 = F.np.split(X, 2, axis=-1)
        # Each pair turned by its angle: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if self.interleaved:
            Y = F.npx.reshape_like(F.np.stack([y1, y2], axis=-1), X)
        else:
            Y = F.np.concatenate([y1, y2], axis=-1)
        return F.np.concatenate([Y, rest], axis=-1) if partial else Y


@documented
@mx.util.use_np
class AddNorm(Layer):
    """The residual step after attention: LayerNorm(X + dropout(Y)) over the last axis."""

    def __init__(self, num_hiddens: int, dropout: float = 0.0, *, eps: float = 1e-5,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("AddNorm", locals())
        self.num_hiddens, self.eps = num_hiddens, eps
        self.dropout = nn.Dropout(dropout)
        self.ln = LayerNorm(epsilon=eps, in_channels=num_hiddens)
        self.ln.cast(self.dtype)
        self.initialize(_LinearInit())

    def forward(self, X, Y):
        self._require_ndarrays(X, Y)
        validation.check_add_norm_call(
            X, Y, self.num_hiddens, self.dtype, tensor_type=_TENSOR_TYPES
        )
        if X.size == 0:
            return _empty(X, *X.shape)
        return self._run(_call_structure(self.dtype), X, Y)

    def hybrid_forward(self, F, X, Y):
        return self.ln(self.dropout(Y) + X)


# ---------------------------------------------------------------------------------------------
# Canonical weights (used by mha.get_weights / mha.set_weights; see mha/weights.py)


def _rate(dropout: nn.Dropout) -> float:
    return dropout._rate


def layer_config(layer: Layer) -> dict[str, Any]:
    """The constructor arguments of `layer`, with sizes inferred so far."""
    return read_config(layer, _in_features, _rate)


# How this backend keeps each kind of parameter of mha.weights.weight_places: the attribute,
# and whether it holds the canonical array transposed (Dense keeps W as (out, in))
PARAMETERS = {"kernel": ("weight", True), "bias": ("bias", False),
              "scale": ("gamma", False), "shift": ("beta", False), "table": ("weight", False)}


def read_parameter(parameter, transposed: bool) -> numpy.ndarray:
    """A fresh numpy copy of a Gluon Parameter (its first copy, wherever it lives), in the
    canonical layout."""
    value = parameter.list_data()[0].asnumpy()
    return (value.T if transposed else value).copy()


@mx.util.use_np
def write_parameter(sublayer: nn.HybridBlock, kind: str, value: numpy.ndarray) -> None:
    """Copy a canonical array into the sub-layer's Parameter of that kind. set_data on a
    deferred Parameter fixes its shape; its deferred initialization is finished here so that
    the weights can be read back at once."""
    name, transposed = PARAMETERS[kind]
    parameter = getattr(sublayer, name)
    parameter.set_data(from_numpy(numpy.ascontiguousarray(value.T if transposed else value)))
    parameter._finish_deferred_init()


def without_gradients():
    """A context in which calls record no gradients, as inference runs them. Used by
    mha.harness, which checks the forward there too: some paths run only there.
    Calls outside autograd.record record nothing; pause() says so."""
    return mx.autograd.pause()


@mx.util.use_np
def value_and_gradients(function, tensors, wrt, layer, cotangent):
    """Run `function(tensors)` and differentiate sum(output * cotangent) with autograd.

    Returns:
        (output, input gradients keyed by the names in `wrt`, weight gradients keyed by
        canonical names in the canonical layout), all numpy arrays. Used by mha.harness.
    """
    tensors = dict(tensors)
    for name in wrt:
        tensors[name] = tensors[name].copy()
        tensors[name].attach_grad()
    # Parameters have grad_req "write": backward overwrites their gradients
    parameters = {} if layer is None else canonical_parameters(layer, PARAMETERS)
    with mx.autograd.record(train_mode=False):
        output = function(tensors)
        loss = (output * cotangent).sum()
    loss.backward()
    input_gradients = {name: tensors[name].grad.asnumpy() for name in wrt}
    weight_gradients = {
        name: value.list_grad()[0].asnumpy().T.copy() if transposed
        else value.list_grad()[0].asnumpy()
        for name, (value, transposed) in parameters.items()
    }
    return to_numpy(output), input_gradients, weight_gradients


# What mha's glue needs beside the layers
ADAPTER = Adapter(
    to_numpy, from_numpy, layer_config, PARAMETERS, read_parameter, write_parameter,
    without_gradients, value_and_gradients,
)
