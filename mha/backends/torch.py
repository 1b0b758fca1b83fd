"""The PyTorch backend.

The NumPy reference (mha/backends/numpy.py) written with torch ops: the same definitions in
the same order, so that the two files read side by side. The layers are `torch.nn.Module`s:
`module.train()` / `.eval()` decide dropout, `.to(device, dtype)` moves and casts them, and no
tensor is created on the CPU when the inputs live elsewhere. Inputs are never modified in place.

Shapes follow d2l, batch first: queries (batch_size, no. of queries, query_size),
keys (batch_size, no. of keys, key_size), values (batch_size, no. of keys, value_size).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch
import torch.utils._pytree
from torch import nn
from torch.nn.parameter import is_lazy

from mha import function_checks, validation
from mha.adapter import Adapter
from mha.backends import torch_fused as fused
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
from mha.masks import Masks, every_row_keeps_a_key, grouped_rows, is_causal_alone
from mha.tensors import in_machine_order, plain_dtype_name
from mha.weights import canonical_parameters, numpy_dtype, read_config

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


def _name_the_caches_for_saved_programs() -> None:
    """torch.export.save writes a program's input tree by its classes' names, and
    torch.export.load reads them with its weights_only unpickler: mha's caches get a name and
    a place among the classes it takes, so a program called with a cache saves and loads."""
    register = getattr(torch.utils._pytree, "_register_namedtuple", None)  # torch has no other
    for cache in (KVCache, LatentCache) if register is not None else ():
        try:
            register(cache, serialized_type_name=f"mha.cache.{cache.__name__}")
        except ValueError:  # named already: this module imported again
            pass
    torch.serialization.add_safe_globals([KVCache, LatentCache])


_name_the_caches_for_saved_programs()


# ---------------------------------------------------------------------------------------------
# Conversion


def to_numpy(x: Any) -> np.ndarray:
    """Return `x` as a numpy array: detached, on the CPU (sharing memory with a CPU tensor).

    numpy has no bfloat16: a bfloat16 tensor comes back as an array of ml_dtypes' bfloat16,
    as TensorFlow hands it out, bit for bit.
    """
    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return x.numpy()


def from_numpy(array: Any) -> torch.Tensor:
    """Return `array` as a CPU torch tensor with numpy's dtype (a copy); an array of
    ml_dtypes' bfloat16 becomes a torch.bfloat16 tensor, bit for bit."""
    array = in_machine_order(np.array(array))
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_device(x: Any, device: str) -> Any:
    """`x`, a tensor or a layer, on `device`: "cpu", or "gpu" for CUDA's current device."""
    return x.to("cuda" if device == "gpu" else device)


# ---------------------------------------------------------------------------------------------
# Building blocks: torch.nn provides Linear, Dropout and LayerNorm; the layers add a dtype

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def _continued(cached: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """A cache's tensor, then this call's, along the positions (dim). torch's cat fails on
    one half dtype beside the other inside autocast: the cache's dtype is named instead."""
    if cached.dtype != new.dtype and {cached.dtype, new.dtype} == {torch.float16, torch.bfloat16}:
        raise TypeError(
            f"the cache holds {plain_dtype_name(cached.dtype)} where this call computes in "
            f"{plain_dtype_name(new.dtype)} (torch.autocast): continue a cache in the dtype "
            "it began in"
        )
    return torch.cat([cached, new], dim=dim)


class Module(nn.Module):
    """torch.nn.Module with `dtype`, the plain name of the layer's float dtype.

    `dtype` is read from an empty non-persistent buffer that `.to(dtype)`, `.double()` and
    `.half()` convert along with the parameters, so the calls check inputs against the dtype
    the layer has now, and `mha.get_weights` / `set_weights` use it too.
    """

    def __init__(self):
        super().__init__()
        # load_state_dict(assign=True) puts the file's tensors in place of the parameters
        self.register_load_state_dict_post_hook(_follow_assigned)

    @property
    def dtype(self) -> str:
        # Read from nn.Module's table of buffers: every call checks its inputs' dtype
        return validation.dtype_name(self._buffers["_dtype_marker"])

    @dtype.setter
    def dtype(self, name: str) -> None:
        marker = torch.empty(0, dtype=_TORCH_DTYPES[name])
        self.register_buffer("_dtype_marker", marker, persistent=False)

    def call_dtype(self, X: Any) -> str | tuple[str, str]:
        """The dtype of a call's floating inputs, caches and masks: the layer's, and inside
        torch.autocast for the layer's device also the dtype autocast computes in, which the
        layers before it then give (autocast leaves a float64 layer as it is). A layer made on
        the meta device and called on other inputs `X` first leaves it (_leave_meta)."""
        marker = self._buffers["_dtype_marker"]
        if marker.is_meta and not getattr(X, "is_meta", True):
            self._leave_meta(X.device)
            marker = self._buffers["_dtype_marker"]
        dtype, device = plain_dtype_name(marker.dtype), marker.device.type
        if dtype == "float64" or not fused.autocasting(device):
            return dtype
        autocast = plain_dtype_name(torch.get_autocast_dtype(device))
        return dtype if autocast == dtype else (dtype, autocast)

    def _leave_meta(self, device: torch.device) -> None:
        """A layer made on the meta device, called on `device`'s inputs: its weights must be
        loaded (torch would compute with no numbers); its dtype marker and constants, which no
        state_dict holds (a layer without weights has nothing else), are made there."""
        if any(parameter.is_meta for parameter in self.parameters()):
            raise ValueError(
                f"{type(self).__name__}'s weights are on the meta device, which holds no "
                f"numbers: load them first (load_state_dict(..., assign=True), or "
                f"to_empty(device=...) and set_weights) before calling it on {device} inputs"
            )
        self._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)

    def __getstate__(self) -> dict[str, Any]:
        # The last call's attention_weights are copied (and pickled) detached: copy.deepcopy
        # refuses a tensor that is not a leaf of its graph
        state = super().__getstate__()
        if isinstance(state.get("attention_weights"), torch.Tensor):
            state["attention_weights"] = state["attention_weights"].detach()
        return state

    def constants(self) -> dict[str, torch.Tensor]:
        """The layer's constant buffers (tables, slopes) by name, computed again in float64
        and cast to the layer's dtype, on the CPU; none here."""
        return {}

    def placed(self, value: torch.Tensor | None) -> torch.Tensor | None:
        """A constant on the device the layer was made on (torch's default device then, as
        its parameters and dtype marker are)."""
        return None if value is None else value.to(self._buffers["_dtype_marker"].device)

    def _apply(self, fn, recurse=True):
        # .to(dtype) would cast a constant from its current dtype (float32 values in a float64
        # table), and .to_empty leaves it unset (non-persistent buffers are in no state_dict):
        # compute each again, on the device its buffer is on now
        super()._apply(fn, recurse)
        for name, value in self.constants().items():
            if self._buffers[name] is not None:
                self._buffers[name] = value.to(self._buffers[name].device)
        return self


def _follow_assigned(module: nn.Module, incompatible_keys) -> None:
    """After load_state_dict: where assign=True gave the parameters another dtype or device
    (a layer built on the meta device, say), the dtype markers and constant buffers of the
    layers in `module`, which no state_dict holds, follow its first parameter."""
    parameter = next((p for p in module.parameters() if not is_lazy(p)), None)
    if parameter is None or not parameter.is_floating_point():
        return
    for layer in module.modules():
        marker = layer._buffers.get("_dtype_marker") if isinstance(layer, Module) else None
        if marker is None or (marker.dtype, marker.device) == (parameter.dtype, parameter.device):
            continue
        layer._buffers["_dtype_marker"] = torch.empty(0, dtype=parameter.dtype,
                                                      device=parameter.device)
        for name, value in layer.constants().items():
            if layer._buffers[name] is not None:
                layer._buffers[name] = value.to(parameter.device)


# Held while a lazy layer makes its parameters at its first call
_INITIALIZING = threading.Lock()


class _LazyLinear(nn.LazyLinear):
    """nn.LazyLinear whose parameters are made once when first calls come from several
    threads (nn.LazyLinear's hook would make them in each, and read them half made)."""

    cls_to_become = nn.Linear

    def _infer_parameters(self, module, args, kwargs=None):
        with _INITIALIZING:
            if type(self) is _LazyLinear:  # an nn.Linear once its parameters are made
                super()._infer_parameters(module, args, kwargs)


def _linear(out_features: int, bias: bool, in_features: int | None, dtype: str) -> nn.Module:
    """y = x W^T + b: a lazy nn.Linear when in_features is None (inferred at the first call)."""
    if in_features is None:
        return _LazyLinear(out_features, bias=bias, dtype=_TORCH_DTYPES[dtype])
    return nn.Linear(in_features, out_features, bias=bias, dtype=_TORCH_DTYPES[dtype])


def _in_features(linear: nn.Module) -> int | None:
    """The input size of a (lazy) linear layer, None while it is not known: nn.LazyLinear's
    in_features is 0 until its parameters are made, then theirs."""
    return linear.in_features or None


class Sinks(nn.Module):
    """Each head's sink logit, the layer's `bias` (zeros at first)."""

    def __init__(self, num_heads: int, dtype: str):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_heads, dtype=_TORCH_DTYPES[dtype]))


def _rms_normalized(X: torch.Tensor, eps: float) -> torch.Tensor:
    """X's last axis scaled to a mean square of 1 (float32 sums for half)."""
    x = X.to(torch.float64 if X.dtype == torch.float64 else torch.float32)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(X.dtype)


class RMSNorm(nn.Module):
    """Scale the last axis to a mean square of 1, then by weight (float32 sums for half)."""

    def __init__(self, num_hiddens: int, eps: float, dtype: str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_hiddens, dtype=_TORCH_DTYPES[dtype]))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return self.weight * _rms_normalized(X, self.eps)


class HeadLayerNorm(nn.Module):
    """Each head's features of X (batch_size, num_heads, n, head size) to mean 0 and mean
    square 1, then scaled by that head's row of weight (num_heads, head size): StableLM's
    layer norm per head, without a shift (float32 sums for half)."""

    def __init__(self, num_heads: int, head_size: int, eps: float, dtype: str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_heads, head_size, dtype=_TORCH_DTYPES[dtype]))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        x = X.to(torch.float64 if X.dtype == torch.float64 else torch.float32)
        x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight[:, None, :] * x.to(X.dtype)


# ---------------------------------------------------------------------------------------------
# Masks

# The tensors a layer of this backend takes; another framework's is a TypeError
_TENSOR_TYPES = torch.Tensor


def _strictly_traced() -> bool:
    """Whether torch.export traces with Dynamo (strict=True, and torch.onnx.export's retry):
    its sizes pass for ints, and a choice made on one would hold the program to the example's
    size (a guard, which an ONNX file does not keep)."""
    return torch.compiler.is_exporting() and torch.compiler.is_dynamo_compiling()


def _check_valid_lens_values(valid_lens: torch.Tensor | None) -> Any:
    """The one check that needs values: non-negative whole numbers. Returns the smallest
    length, None where the values were not read or a path may not hang on them.

    It runs where the values are in host memory, the CPU: elsewhere reading them would wait
    for the device (a meta tensor has none), and a tensor traced by torch.export or made
    under FakeTensorMode has none either, nor one torch.jit.trace records (its graph would
    keep the example's answer). A graph being compiled reads them, and keeps no path chosen
    by them."""
    if (valid_lens is None or valid_lens.device.type != "cpu" or torch.compiler.is_exporting()
            or torch.jit.is_tracing() or fused.functorch_wrapped(valid_lens)
            or isinstance(valid_lens, fused.FakeTensor)):
        return None
    compiling = torch.compiler.is_compiling()
    if valid_lens.numel() <= validation.FEW_LENGTHS and not compiling:
        # A few lengths as Python numbers: exact for every dtype, bfloat16 included
        flat = valid_lens if valid_lens.dim() == 1 else valid_lens.reshape(-1)
        return validation.check_valid_lens_values(flat.tolist())
    values = valid_lens.detach()
    # numpy has no bfloat16; float64 holds every float16 and bfloat16 exactly
    values = values.double() if values.is_floating_point() else values
    smallest = validation.check_valid_lens_values(values.numpy())
    return None if compiling else smallest


def _length_mask(valid_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Keep keys j < valid_len: shape (batch_size, 1, no. of keys) for 1-D valid_lens,
    (batch_size, no. of queries, no. of keys) for 2-D."""
    # Float lengths and uint16 to uint64 (which torch cannot compare) are compared as float64,
    # exact to 2**53: in float16 or bfloat16 a key's position would be rounded to the length
    lengths = valid_lens
    if lengths.is_floating_point() or lengths.dtype in (torch.uint16, torch.uint32, torch.uint64):
        lengths = lengths.to(torch.float64)
    # Shape of lengths: (batch_size, 1 or no. of queries, 1)
    lengths = lengths.reshape(-1, 1, 1) if lengths.ndim == 1 else lengths.unsqueeze(-1)
    return torch.arange(num_keys, device=valid_lens.device) < lengths


class _Masks(Masks):
    """mha.masks' rules in torch, for the scores of one call, on the inputs' device."""

    def __init__(self, batch_size: int, num_queries: int, num_keys: int, offset: int = 0, *,
                 device: torch.device):
        super().__init__(batch_size, num_queries, num_keys, offset)
        self.device = device

    def length_mask(self, valid_lens):
        return _length_mask(valid_lens, self.num_keys)

    def causal_mask(self):
        ones = torch.ones(self.num_queries, self.num_keys, dtype=torch.bool, device=self.device)
        return ones.tril(diagonal=self.offset)

    def band_mask(self, width):
        # Shape of distances: (Q, K), query i being at position offset + i
        queries = torch.arange(self.num_queries, device=self.device)[:, None] + self.offset
        keys = torch.arange(self.num_keys, device=self.device)[None, :]
        return (queries - keys).abs() < width

    def chunk_mask(self, size):
        queries = torch.arange(self.num_queries, device=self.device)[:, None] + self.offset
        keys = torch.arange(self.num_keys, device=self.device)[None, :]
        return queries // size == keys // size

    def distances(self, like, packed=None):
        if packed is not None:
            return packed.to(like.dtype)
        queries = torch.arange(self.num_queries, device=self.device)[:, None] + self.offset
        keys = torch.arange(self.num_keys, device=self.device)[None, :]
        return (keys - queries).to(like.dtype)

    def windows(self, window_mask):
        return window_mask.repeat(self.batch_size // window_mask.shape[0], 1, 1)

    def is_bool(self, windows):
        return windows.dtype == torch.bool

    def segment_positions(self, segment_ids):
        # Shape of same: (batch_size, n, n); of earlier: (n, n), key j before query i
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        n = segment_ids.shape[1]
        earlier = torch.ones(n, n, dtype=torch.bool, device=segment_ids.device).tril(-1)
        return (same & earlier).sum(dim=-1)

    def zeros_where(self, blocked, x):
        return torch.where(blocked, 0.0, x)

    def cast_like(self, x, like):
        return x.to(like.dtype)

    def widened(self, x):
        return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x

    def expand_dims(self, x, axis):
        return x.unsqueeze(axis)


# ---------------------------------------------------------------------------------------------
# Masked softmax


def _softmax(scores: torch.Tensor, keep: torch.Tensor | None, in_place: bool = False,
             empty_rows: str = "zeros", rows_kept: bool = False) -> torch.Tensor:
    """Softmax over the last axis on the kept entries; masked entries are exactly 0, and rows
    with no kept entry 0 or, with empty_rows="uniform", 1 / no. of keys. torch.softmax
    subtracts the row maximum, so logits of 1e4 stay finite.

    `in_place` overwrites `scores`, a fresh tensor of the caller's: on the CPU a new
    (..., Q, K) tensor is fresh pages to fault in. The softmax itself is written over the
    scores only where autograd does not need them. rows_kept: every row of keep is known to
    keep a key (masks.every_row_keeps_a_key), so none is looked for.
    """
    attended = None
    if keep is not None:
        if not rows_kept:
            attended = keep.any(dim=-1, keepdim=True)
            attended = None if not fused.may_have_empty_rows(attended) else attended
        # exp(-inf) = 0: masked entries, and their gradients, are exactly 0. The -inf replaces
        # what a masked score held, so a masked key holding NaN or inf stays out
        fill = scores.masked_fill_ if in_place else scores.masked_fill
        scores = fill(~keep, float("-inf"))
        if attended is not None:
            # A row with no kept key, all -inf, would be NaN: a row of zeros, whose softmax
            # is uniform, zeroed after unless empty_rows says uniform
            scores = scores.masked_fill_(~attended, 0.0)
    # An out= argument needs the scores' own storage: not a graph's (Inductor fails on it)
    # nor torch.func's wrapped tensors; and autocast would not cast it (CUDA's softmax is
    # float32 there)
    own = not fused.building_a_graph() and not fused.functorch_wrapped(scores)
    autocasting = fused.autocasting(scores.device.type)
    if in_place and not scores.requires_grad and own and not autocasting:
        weights = torch.softmax(scores, dim=-1, out=scores)
    else:
        weights = torch.softmax(scores, dim=-1)
    if attended is None or empty_rows == "uniform":
        return weights
    return torch.where(attended, weights, 0.0)


@documented
def masked_softmax(X: torch.Tensor, valid_lens: torch.Tensor | None = None, *,
                   empty_rows: str = "zeros") -> torch.Tensor:
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
    return _softmax(X, keep, empty_rows=empty_rows)


def _with_sinks(scores: torch.Tensor, keep: torch.Tensor | None, sinks: torch.Tensor):
    """The scores and keep with one more key at the end, each head's sink (sinks broadcastable
    to the scores' rows), which every row keeps."""
    rows = (*scores.shape[:-1], 1)
    column = sinks.to(scores.dtype).expand(rows)
    if keep is not None:
        keep = keep.expand(scores.shape)
        keep = torch.cat([keep, keep.new_ones(rows)], dim=-1)
    return torch.cat([scores, column], dim=-1), keep


def _attention_pool(scores, values, keep, bias, dropout, need_weights=True, empty_rows="zeros",
                    sinks=None, rows_kept=False):
    """Weights = masked softmax of (scores + bias); output = dropout(weights) @ values."""
    if bias is not None:
        scores = scores + bias
    if sinks is not None:
        # gpt-oss: each head's sink joins every row's softmax as a key; its weight is dropped
        scores, keep = _with_sinks(scores, keep, sinks)
    # The scores are the caller's own fresh tensor: the softmax overwrites them
    weights = _softmax(scores, keep, in_place=True, empty_rows=empty_rows, rows_kept=rows_kept)
    if sinks is not None:
        weights = weights[..., :-1]
    # Values split into heads have rows num_hiddens apart, and torch's CPU product in bfloat16
    # and float16 is far slower on such rows than on contiguous ones
    return dropout(weights) @ values.contiguous(), weights if need_weights else None


# ---------------------------------------------------------------------------------------------
# The attention function

# The function drops no weights: dropout is the layers'
_NO_DROPOUT = nn.Dropout(0.0).eval()


def dot_product_attention(query, key, value, *, mask=None, bias=None, scale=None, causal=False,
                          alignment="top_left", window=None, valid_lens=None, softcap=None,
                          empty_rows="zeros", return_weights=False, return_lse=False,
                          segment_ids=None):
    """Attention of one call on (batch_size, heads, positions, head size): the NumPy
    reference's dot_product_attention (mha.backends.numpy, whose docstring has the
    arguments), in torch."""
    sizes = function_checks.check_dot_product_attention_call(
        query, key, value, mask=mask, bias=bias, scale=scale, causal=causal,
        alignment=alignment, window=window, valid_lens=valid_lens, softcap=softcap,
        empty_rows=empty_rows, return_weights=return_weights, return_lse=return_lse,
        segment_ids=segment_ids, tensor_type=_TENSOR_TYPES,
    )
    smallest = _check_valid_lens_values(valid_lens)
    batch_size, num_heads, num_kv_heads, num_queries, num_keys = sizes
    offset = function_checks.first_position(alignment, num_queries, num_keys)
    masks = _Masks(batch_size, num_queries, num_keys, offset, device=query.device)
    keep, bias = masks.function_masks(valid_lens, mask, causal,
                                      function_checks.window_sides(window), bias, segment_ids)
    # The fast paths read the masks' axes: each gets the scores' four
    keep, bias = (None if x is None else x.reshape((1,) * (4 - x.dim()) + x.shape)
                  for x in (keep, bias))
    # The causal mask alone, top-left aligned: the kernels' own is_causal where they have it
    alone = is_causal_alone(causal, offset, window, mask, bias, valid_lens, segment_ids)
    rows_kept = every_row_keeps_a_key(valid_lens, smallest, causal, offset, window, mask, bias,
                                      segment_ids)
    # What the layers compute too, without dropout
    output, weights, lse = _attention(query, key, value, keep, bias, _NO_DROPOUT, scale=scale,
                                      softcap=softcap, empty_rows=empty_rows,
                                      need_weights=return_weights, lse=return_lse,
                                      group=num_heads // num_kv_heads, causal_alone=alone,
                                      rows_kept=rows_kept)
    if not (return_weights or return_lse):
        return output
    return (output, *(x for x in (weights, lse) if x is not None))


def _attention(queries, keys, values, keep, bias, dropout, *, scale=None, softcap=None,
               empty_rows="zeros", need_weights=True, sinks=None, lse=False, group=1,
               causal_alone=False, rows_kept=False):
    """Attention on prepared inputs with any leading axes (no checks): what
    dot_product_attention and every layer's DotProductAttention.attend compute.

    queries (..., Q, d); keys (..., K, d) and values (..., K, v), with a head (axis -3) for
    every `group` heads of the queries; keep and bias broadcastable to the scores (..., Q, K),
    or None; sinks, each head's sink logit broadcastable to the scores' rows, or None; causal_alone:
    keep is the top-left causal mask and nothing else; rows_kept: every row of keep is known
    to keep a key (masks.every_row_keeps_a_key). Returns (output, weights, lse):
    weights unless need_weights, and each row's log-sum-exp unless lse, are None. torch's
    fused kernel or a product with the mask inside compute the same numbers where they can
    (torch_fused.choose_path).
    """
    if group > 1 and (lse or not fused.pairs_heads(
            queries, keys, values, keep, bias, need_weights, empty_rows, dropout, causal_alone,
            softcap, sinks is not None)):
        # Each key-value head's `group` query heads as one head of group x Q query rows: the
        # keys and values are read as they are (see masks.grouped_rows)
        heads, rows = queries.shape[-3], queries.shape[-2]
        queries, keep, bias, sinks = (_grouped(x, heads, rows, group)
                                      for x in (queries, keep, bias, sinks))
        output, weights, row_lse = _attention(
            queries, keys, values, keep, bias, dropout, scale=scale, softcap=softcap,
            empty_rows=empty_rows, need_weights=need_weights, sinks=sinks, lse=lse,
            rows_kept=rows_kept)
        # Back to each query head: (..., heads, Q, v or K), and the rows' (..., heads, Q)
        output, weights = (None if x is None else x.unflatten(-2, (group, rows)).flatten(-4, -3)
                           for x in (output, weights))
        return output, weights, None if row_lse is None else row_lse.unflatten(
            -1, (group, rows)).flatten(-3, -2)
    d = queries.shape[-1]
    # The queries are scaled rather than the scores: Q x d numbers instead of Q x K, and
    # no product overflows whose scaled score would not
    queries = queries / math.sqrt(d) if scale is None else queries * scale
    path = "scores" if lse else fused.choose_path(
        queries, keys, values, keep, bias, need_weights, empty_rows, dropout, causal_alone,
        softcap, sinks is not None)
    output = fused.attend(queries, keys, values, keep, bias, dropout, path, rows_kept)
    if output is not None:  # F.scaled_dot_product_attention computed it, without weights
        return output, None, None
    if path == "masked product":
        # The mask is added inside the product, as nn.MultiheadAttention does (baddbmm):
        # a pass over the scores fewer, forward and backward
        scores, attended = fused.masked_product(queries, keys, keep, rows_kept)
        output, weights = _attention_pool(scores, values, None, None, dropout)
        if attended is not None:
            output, weights = (torch.where(attended, x, 0.0) for x in (output, weights))
        return output, weights if need_weights else None, None
    # Shape of scores: (..., no. of queries, no. of keys)
    scores = queries @ keys.transpose(-1, -2)
    if softcap is not None:
        # Gemma 2's soft cap: the scores squashed into (-softcap, softcap), before the masks
        scores = softcap * torch.tanh(scores / softcap)
    # The pool writes its softmax over the scores: the log-sum-exp reads them first
    row_lse = _log_sum_exp(scores if bias is None else scores + bias, keep) if lse else None
    output, weights = _attention_pool(scores, values, keep, bias, dropout, need_weights,
                                      empty_rows, sinks, rows_kept)
    return output, weights, row_lse


def _grouped(x, heads: int, rows: int, group: int):
    """x (the queries, or a mask broadcastable to the scores or to their rows) with each
    key-value head's `group` query heads as one head of group x rows query rows."""
    sizes = None if x is None else grouped_rows(x.shape, heads, rows, group)
    if sizes is None:
        return x
    full, folded = sizes
    if isinstance(x.shape[-1], int):
        return x.expand(full).reshape(folded)
    # A mask over a number of keys left free by torch.export, which cannot prove that reshape
    # (nor the output's): each query head's rows joined
    return torch.cat(x.expand(full).unflatten(-3, (heads // group, group)).unbind(-3), dim=-2)


def _log_sum_exp(scores: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """log(sum(exp(score))) of each row's kept scores, shape (..., no. of queries); -inf for a
    row with none (torch.logsumexp gives it; float16 in float32, rounded once: its float16 sum
    of a long row's exponentials passes 65504)."""
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if scores.dtype != torch.float16:
        return torch.logsumexp(scores, dim=-1)
    return torch.logsumexp(scores.float(), dim=-1).half()


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
        self.dropout = nn.Dropout(dropout)
        self.attention_weights = None

    def forward(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                window_mask=None, attn_bias=None, alignment=None,
                segment_ids=None):
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=self.call_dtype(queries),
            tensor_type=_TENSOR_TYPES, same_query_key_size=True,
        )
        smallest = _check_valid_lens_values(valid_lens)
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset, device=queries.device)
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
        output, self.attention_weights, _ = _attention(
            queries, keys, values, keep, bias, self.dropout, scale=self.scale,
            softcap=self.softcap, empty_rows=self.empty_rows, need_weights=need_weights,
            sinks=sinks, group=group, causal_alone=causal_alone, rows_kept=rows_kept,
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
        self.W_q = _linear(num_hiddens, False, query_size, self.dtype)
        self.W_k = _linear(num_hiddens, False, key_size, self.dtype)
        self.w_v = _linear(1, False, num_hiddens, self.dtype)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights = None

    def forward(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                window_mask=None, attn_bias=None, alignment=None,
                segment_ids=None):
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, attn_bias=attn_bias, segment_ids=segment_ids,
            dtype=self.call_dtype(queries),
            tensor_type=_TENSOR_TYPES,
            sizes=(("queries", "query_size", _in_features(self.W_q)),
                   ("keys", "key_size", _in_features(self.W_k))),
        )
        _check_valid_lens_values(valid_lens)
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset, device=queries.device)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, attn_bias=attn_bias,
                                   sliding_window=self.sliding_window,
                                   segment_ids=segment_ids)
        queries, keys = self.W_q(queries), self.W_k(keys)
        # After adding axes: queries (batch_size, no. of queries, 1, num_hiddens) and keys
        # (batch_size, 1, no. of keys, num_hiddens); their sum broadcasts to
        # (batch_size, no. of queries, no. of keys, num_hiddens)
        features = torch.tanh(queries[:, :, None, :] + keys[:, None, :, :])
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
    angle_dtype = torch.float64 if queries.dtype == torch.float64 else torch.float32
    if positions is None:
        positions = torch.arange(offset, offset + queries.shape[-2], device=queries.device)
    else:
        positions = positions[:, None, :]
    shifted = positions.to(angle_dtype) + scaling.get("position_offset", 0)
    steps = torch.floor(shifted / scaling["original_max_position_embeddings"])
    return (1 + scaling["beta"] * torch.log1p(steps))[..., None].to(queries.dtype)


@documented
class MultiHeadAttention(Module):
    """Multi-head attention: num_heads scaled dot-product attentions in parallel.

    Without need_weights the attention runs in F.scaled_dot_product_attention where it can;
    each key-value head's group of query heads attends as one head of more query rows (see
    _attention), or, under the kernels' own causal mask, SDPA pairs them (enable_gqa).
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
        self.W_q = _linear(num_hiddens, bias, query_size, self.dtype)
        self.W_k = _linear(kv_hiddens, bias, key_size, self.dtype)
        self.W_v = _linear(kv_hiddens, bias, value_size, self.dtype)
        self.W_o = _linear(out_features or num_hiddens, bias if out_bias is None else out_bias,
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
            self.W_g = _linear(num_hiddens, bias, query_size, self.dtype)
        # ALiBi's slope of each head (BLOOM, MPT): no weight, a constant of the head count
        self.alibi = alibi
        self.register_buffer("alibi_slopes", self.placed(self.constants().get("alibi_slopes")),
                             persistent=False)
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

    def constants(self) -> dict[str, torch.Tensor]:
        # ALiBi's slope of each head, (num_heads, 1, 1), in float64 and cast
        if not self.alibi:
            return {}
        slopes = torch.from_numpy(alibi_slopes(self.num_heads)).to(_TORCH_DTYPES[self.dtype])
        return {"alibi_slopes": slopes.reshape(-1, 1, 1)}

    def forward(self, queries, keys, values, valid_lens=None, *, mask=None, causal=False,
                window_mask=None, head_mask=None, need_weights=True, attn_bias=None,
                cache=None, alignment=None, segment_ids=None):
        num_kv_heads = self.num_kv_heads or self.num_heads
        batch_size, num_queries, num_keys = validation.check_attention_call(
            queries, keys, values, valid_lens, mask=mask, causal=causal, alignment=alignment,
            window_mask=window_mask, head_mask=head_mask, need_weights=need_weights,
            attn_bias=attn_bias, cache=cache, segment_ids=segment_ids,
            rope_scaling=self.rope_scaling, dtype=self.call_dtype(queries),
            tensor_type=_TENSOR_TYPES,
            num_heads=self.num_heads, kv_heads=(num_kv_heads, self.num_hiddens // self.num_heads),
            sizes_known=not _strictly_traced(),
            sizes=(("queries", "query_size", _in_features(self.W_q)),
                   ("keys", "key_size", _in_features(self.W_k)),
                   ("values", "value_size", _in_features(self.W_v))),
        )
        smallest = _check_valid_lens_values(valid_lens)
        # The positions before this call's: those in the cache
        cached = 0 if cache is None or cache.keys is None else cache.keys.shape[2]
        # The position of the first query, for the masks: after the cached ones unless
        # alignment places it
        offset = function_checks.layer_first_position(alignment, num_queries, num_keys, cached)
        # Shape of keep and bias: broadcastable to
        # (batch_size, num_heads, no. of queries, no. of keys)
        masks = _Masks(batch_size, num_queries, num_keys, offset, device=queries.device)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, multihead=True,
                                   attn_bias=attn_bias, sliding_window=self.sliding_window,
                                   alibi_slopes=self.alibi_slopes, segment_ids=segment_ids,
                                   attention_chunk_size=self.attention_chunk_size)
        # Shape after project: (batch_size, num_heads, no. of queries,
        # num_hiddens / num_heads); keys and values have num_kv_heads heads
        gates = self.W_g(queries) if self.output_gate else None  # Qwen3-Next
        queries, keys, values = self.project(queries, keys, values)
        queries, keys = self.at_positions(queries, keys, cached, masks, segment_ids)
        if cache is not None:
            # This call's keys and values follow those of the positions before it
            if cache.keys is not None:
                keys = _continued(cache.keys, keys, dim=2)
                values = _continued(cache.values, values, dim=2)
            cache = KVCache(keys, values)
        # mha's causal mask alone, nothing cached: the kernels' own is_causal where they have it
        others = (mask, window_mask, attn_bias, self.sliding_window, segment_ids,
                  self.attention_chunk_size)
        alone = is_causal_alone(causal, offset, valid_lens, self.alibi_slopes, *others)
        # No row of keep without a key, known from the lengths' values: none is looked for
        rows_kept = every_row_keeps_a_key(valid_lens, smallest, causal, offset, *others)
        # Shape of output: (batch_size, num_heads, no. of queries, num_hiddens / num_heads)
        sinks = self.sink_logits.bias.reshape(-1, 1, 1) if self.sinks else None
        output = self.attention.attend(queries, keys, values, keep, bias, need_weights, sinks,
                                       self.num_heads // num_kv_heads, alone, rows_kept)
        self.attention_weights = self.attention.attention_weights
        if head_mask is not None:
            # (num_heads,) -> (num_heads, 1, 1); (batch_size, num_heads) -> (B, num_heads, 1, 1)
            output = output * head_mask.to(output.dtype).reshape((*head_mask.shape, 1, 1))
        # Shape of output_concat: (batch_size, no. of queries, num_hiddens)
        output_concat = self.transpose_output(output)
        output = self.W_o(output_concat if gates is None else output_concat * torch.sigmoid(gates))
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

    def transpose_qkv(self, X: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """(batch_size, n, num_heads * head size) -> (batch_size, num_heads, n, head size),
        num_heads being the layer's unless given."""
        num_heads = num_heads or self.num_heads
        X = X.reshape(X.shape[0], X.shape[1], num_heads, self.num_hiddens // self.num_heads)
        return X.permute(0, 2, 1, 3)

    def transpose_output(self, X: torch.Tensor) -> torch.Tensor:
        """Reverse transpose_qkv: -> (batch_size, n, num_hiddens)."""
        X = X.permute(0, 2, 1, 3)
        return X.reshape(X.shape[0], X.shape[1], self.num_hiddens)


@documented
class MultiHeadLatentAttention(Module):
    """Multi-head latent attention (DeepSeek-V2 and V3, Kimi K2): the NumPy reference's
    MultiHeadLatentAttention (mha.backends.numpy), in torch."""

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
            self.W_q = _linear(num_heads * qk_head, False, num_hiddens, self.dtype)
        else:  # queries through a low-rank pair, normalized between
            self.W_qa = _linear(q_lora_rank, bias, num_hiddens, self.dtype)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps, self.dtype)
            self.W_qb = _linear(num_heads * qk_head, False, q_lora_rank, self.dtype)
        # One projection gives each position's latent and its shared rotary key
        self.W_kva = _linear(kv_lora_rank + qk_rope_head_dim, bias, num_hiddens, self.dtype)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps, self.dtype)
        self.W_kvb = _linear(num_heads * (qk_nope_head_dim + v_head_dim), False, kv_lora_rank,
                             self.dtype)
        self.W_o = _linear(num_hiddens, bias, num_heads * v_head_dim, self.dtype)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta, interleaved=rope_interleaved,
                                      scaling=self.rope_scaling, dtype=self.dtype)
        # 1 / sqrt(head size), times yarn's mscale twice when the rotary is scaled so
        self.scale = latent_attention_scale(qk_head, self.rope_scaling)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights = None

    def forward(self, X, valid_lens=None, *, mask=None, causal=False, window_mask=None,
                need_weights=True, attn_bias=None, cache=None, absorbed=False):
        validation.check_latent_attention_call(
            X, valid_lens, mask=mask, causal=causal, window_mask=window_mask,
            need_weights=need_weights, attn_bias=attn_bias, cache=cache, absorbed=absorbed,
            dtype=self.call_dtype(X), num_hiddens=self.num_hiddens, num_heads=self.num_heads,
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
                latent = _continued(cache.latent, latent, dim=1)
                rotary_keys = _continued(cache.rotary_keys, rotary_keys, dim=2)
            cache = LatentCache(latent, rotary_keys)
        masks = _Masks(batch_size, num_steps, latent.shape[1], cached, device=X.device)
        keep, bias = masks.combine(valid_lens, mask, causal, window_mask, multihead=True,
                                   attn_bias=attn_bias, sliding_window=self.sliding_window)
        attend = self.attend_absorbed if absorbed else self.attend_expanded
        output = attend(queries, latent, rotary_keys, keep, bias, need_weights)
        # Shape of output: (batch_size, no. of steps, num_heads * v_head_dim), sized
        # (not -1): the batch may be empty
        width = self.num_heads * self.v_head_dim
        output = self.W_o(output.transpose(1, 2).reshape(batch_size, num_steps, width))
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
        """The same numbers with W_kvb folded into the queries and the output (multi-query
        attention over the latent; see the NumPy reference)."""
        # W_kvb per head: its key part W_uk (kv_lora_rank, H, nope), value part W_uv
        W = self.W_kvb.weight.T.reshape(self.kv_lora_rank, self.num_heads, -1)
        W_uk, W_uv = W[..., : self.qk_nope_head_dim], W[..., self.qk_nope_head_dim :]
        # Shape of absorbed: (batch_size, num_heads, no. of steps, kv_lora_rank)
        absorbed = torch.einsum("bhqn,rhn->bhqr", queries[..., : self.qk_nope_head_dim], W_uk)
        queries = torch.cat([absorbed, queries[..., self.qk_nope_head_dim :]], dim=-1)
        keys = torch.cat([latent[:, None], rotary_keys], dim=-1)
        output, self.attention_weights, _ = _attention(
            queries, keys, latent[:, None], keep, bias, self.dropout, scale=self.scale,
            empty_rows=self.empty_rows, need_weights=need_weights, group=self.num_heads,
        )
        # Shape of output: (batch_size, num_heads, no. of steps, v_head_dim)
        return torch.einsum("bhqr,rhv->bhqv", output, W_uv)

    def project_queries(self, X, offset=0):
        """Each head's query at positions offset, ..., its rotary part turned: (batch_size,
        num_heads, n, nope + rope)."""
        Q = self.W_q(X) if self.q_lora_rank is None else self.W_qb(self.q_norm(self.W_qa(X)))
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        Q = Q.reshape(*X.shape[:2], self.num_heads, qk_head).transpose(1, 2)
        rotated = self.rotary.rotate(Q[..., self.qk_nope_head_dim :], offset)
        return torch.cat([Q[..., : self.qk_nope_head_dim], rotated], dim=-1)

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
        KV = self.W_kvb(latent).reshape(*latent.shape[:2], self.num_heads, kv_head).transpose(1, 2)
        keys_nope, values = KV[..., : self.qk_nope_head_dim], KV[..., self.qk_nope_head_dim :]
        shared = rotary_keys.expand(*keys_nope.shape[:-1], self.qk_rope_head_dim)
        return torch.cat([keys_nope, shared], dim=-1), values


@documented
class PositionalEncoding(Module):
    """Add the sinusoidal positional encoding P to X, then dropout.

    P is a non-persistent buffer, cast again from float64 by `.to(dtype)`.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("PositionalEncoding", locals())
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("P", self.placed(self.constants()["P"]), persistent=False)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, self.call_dtype(X), tensor_type=_TENSOR_TYPES
        )
        X = X + self.P[:, : X.shape[1], :]
        return self.dropout(X)

    def constants(self) -> dict[str, torch.Tensor]:
        table = torch.from_numpy(sinusoid_table(self.max_len, self.num_hiddens))
        return {"P": table.to(_TORCH_DTYPES[self.dtype])}


@documented
class LearnedPositionalEncoding(Module):
    """Add a learned positional embedding to X, then dropout: P is a weight, one row per
    position, trained with the rest.

    P is the weight of an nn.Embedding, drawn from N(0, 1) as torch initializes one; it is in
    the state_dict as embedding.weight.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, *,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("LearnedPositionalEncoding", locals())
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.dropout = nn.Dropout(dropout)
        self.embedding = nn.Embedding(max_len, num_hiddens, dtype=_TORCH_DTYPES[self.dtype])

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        validation.check_positional_encoding_call(
            X, self.num_hiddens, self.max_len, self.call_dtype(X), tensor_type=_TENSOR_TYPES
        )
        # Shape of P: (1, no. of steps, num_hiddens), the rows of positions 0, 1, ...
        P = self.embedding(torch.arange(X.shape[1], device=X.device))[None]
        return self.dropout(X + P)


@documented
class RotaryEmbedding(Module):
    """Rotary position embeddings (RoPE): each pair of features turned by an angle that grows
    with the position.

    The frequencies are a non-persistent buffer, cast again from float64 by `.to(dtype)`.
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
        constants = {name: self.placed(value) for name, value in self.constants().items()}
        self.register_buffer("frequencies", constants["frequencies"], persistent=False)
        self.register_buffer("long_frequencies", constants.get("long_frequencies"),
                             persistent=False)
        # The factor of the cosines and sines: a yarn or longrope scaling's, else 1
        self.attention_factor = rotary_attention_factor(self.scaling)

    def forward(self, X: torch.Tensor, offset: int = 0) -> torch.Tensor:
        dtype = self.call_dtype(X)
        if isinstance(dtype, tuple) and dtype[0] != "float32":
            # torch's cat and stack fail on one half dtype inside the other's autocast
            raise TypeError(
                f"a {dtype[0]} RotaryEmbedding cannot run inside torch.autocast of {dtype[1]}: "
                f"build it in float32 (it then takes {dtype[1]} there) or call it outside"
            )
        validation.check_rotary_call(X, offset, self.num_hiddens, dtype, tensor_type=_TENSOR_TYPES)
        return self.rotate(X, offset)

    def rotate(self, X: torch.Tensor, offset: int = 0, length=None, positions=None) -> torch.Tensor:
        """X (..., n, num_hiddens) at positions offset, ..., offset + n - 1, rotated (no
        checks). `length`, the sequence's (offset + n when None), picks the frequencies of a
        dynamic or longrope scaling. `positions` (batch_size, n), each row's own (packed
        sequences, X (batch_size, heads, n, num_hiddens)), replace offset's. MultiHeadAttention
        calls this on each head's queries and keys."""
        # Shape of angles, cos and sin: (n, rotated / 2), or (batch_size, 1, n, rotated / 2)
        n = X.shape[-2]
        if positions is None:
            # Whole positions, each rounded once, as transformers' (int64, then the dtype)
            positions = torch.arange(offset, offset + n, device=X.device)
            positions = positions.to(self.frequencies.dtype)
        else:
            # Packed sequences: each row's own positions, (batch_size, 1, n) against the heads
            positions = positions[:, None, :].to(self.frequencies.dtype)
        frequencies = self.frequencies_at(offset + n if length is None else length)
        angles = positions[..., None] * frequencies
        cos = (angles.cos() * self.attention_factor).to(X.dtype)
        sin = (angles.sin() * self.attention_factor).to(X.dtype)
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
            Y = torch.stack([y1, y2], dim=-1).reshape(X.shape)
        else:
            Y = torch.cat([y1, y2], dim=-1)
        return Y if rest.shape[-1] == 0 else torch.cat([Y, rest], dim=-1)

    def frequencies_at(self, length: int) -> torch.Tensor:
        """The frequencies of a call over positions 0, ..., length - 1: the layer's, or those
        a dynamic or longrope scaling gives a sequence longer than it was trained on. A
        program being exported may leave the length free: the frequencies are then computed
        in the program, from the length as a tensor, as under torch.compile (where a free
        length passes for an int, and numpy traced with it keeps float32's precision)."""
        if isinstance(length, int) and not torch.compiler.is_compiling():
            return self._frequencies_of(
                rotary_frequencies_at(self.rotated, self.theta, self.scaling, length))
        if self.scaling is None or self.scaling["rope_type"] not in ("dynamic", "longrope"):
            return self.frequencies
        original, device = self.scaling["original_max_position_embeddings"], self.frequencies.device
        # The length as a tensor made from a size, not read from a value
        length = torch.arange(length, dtype=torch.float64, device=device)[-1] + 1
        if self.scaling["rope_type"] == "dynamic":
            pairs = torch.arange(0, self.rotated, 2, dtype=torch.float64, device=device)
            frequencies = dynamic_frequencies(self.rotated, self.theta, self.scaling,
                                              length.clamp(min=original), pairs / self.rotated)
            return frequencies.to(self.frequencies.dtype)
        return torch.where(length > original, self.long_frequencies, self.frequencies)

    def _frequencies_of(self, longer: np.ndarray | None) -> torch.Tensor:
        """A scaling's frequencies for a longer sequence on the layer's device, or the
        layer's own (None)."""
        if longer is None:
            return self.frequencies
        # Cast on the host, then copied without waiting for the device (a blocking copy syncs)
        longer = torch.from_numpy(longer).to(self.frequencies.dtype)
        return longer.to(self.frequencies.device, non_blocking=True)

    def constants(self) -> dict[str, torch.Tensor]:
        # In float64 for a float64 layer, else float32 (mha.encoding.rotary_angle_dtype)
        dtype = _TORCH_DTYPES[rotary_angle_dtype(self.dtype)]
        frequencies = torch.from_numpy(rotary_frequencies(self.rotated, self.theta, self.scaling))
        constants = {"frequencies": frequencies.to(dtype)}
        if self.scaling is not None and self.scaling["rope_type"] == "longrope":
            # Past the original length, for a compiled call (numpy traced there is float32)
            longer = self.scaling["original_max_position_embeddings"] + 1
            longer = rotary_frequencies(self.rotated, self.theta, self.scaling, longer)
            constants["long_frequencies"] = torch.from_numpy(longer).to(dtype)
        return constants


@documented
class AddNorm(Module):
    """The residual step after attention: LayerNorm(X + dropout(Y)) over the last axis."""

    def __init__(self, num_hiddens: int, dropout: float = 0.0, *, eps: float = 1e-5,
                 dtype: str = "float32"):
        super().__init__()
        self.dtype = validation.check_layer_args("AddNorm", locals())
        self.num_hiddens, self.eps = num_hiddens, eps
        self.dropout = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(num_hiddens, eps=eps, dtype=_TORCH_DTYPES[self.dtype])

    def forward(self, X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
        # torch's layer norm takes a half-precision input with weights of its dtype or of
        # float32: a float16 AddNorm takes no bfloat16 autocast's input, nor the reverse
        dtype = self.call_dtype(X)
        dtype = dtype if self.dtype == "float32" else self.dtype
        validation.check_add_norm_call(X, Y, self.num_hiddens, dtype, tensor_type=_TENSOR_TYPES)
        return self.ln(self.dropout(Y) + X)


# ---------------------------------------------------------------------------------------------
# Canonical weights (used by mha.get_weights / mha.set_weights; see mha/weights.py)


def layer_config(layer: Module) -> dict[str, Any]:
    """The constructor arguments of `layer`, with sizes inferred so far."""
    return read_config(layer, _in_features, lambda dropout: dropout.p)


# How this backend keeps each kind of parameter of mha.weights.weight_places: the attribute,
# and whether it holds the canonical array transposed (nn.Linear keeps W as (out, in))
PARAMETERS = {"kernel": ("weight", True), "bias": ("bias", False),
              "scale": ("weight", False), "shift": ("bias", False), "table": ("weight", False)}


def read_parameter(parameter: torch.Tensor, transposed: bool) -> np.ndarray:
    """A fresh numpy copy of a parameter, in the canonical layout."""
    value = to_numpy(parameter)
    return (value.T if transposed else value).copy()


def write_parameter(sublayer: nn.Module, kind: str, value: np.ndarray) -> None:
    """Copy a canonical array into the sub-layer's parameter of that kind, making a lazy
    nn.LazyLinear's parameters first. The parameter keeps its device and dtype and stays the
    same object (optimizers and hooks holding it see the new values)."""
    name, transposed = PARAMETERS[kind]
    if kind == "kernel" and _in_features(sublayer) is None:
        # Only the shape of this input is read
        sublayer.initialize_parameters(torch.empty(0, value.shape[0], device="meta"))
    with torch.no_grad():
        getattr(sublayer, name).copy_(from_numpy(value.T if transposed else value))


def without_gradients():
    """A context in which calls record no gradients, as inference runs them. Used by
    mha.harness, which checks the forward there too."""
    return torch.no_grad()


def value_and_gradients(function, tensors, wrt, layer, cotangent):
    """Run `function(tensors)` and differentiate sum(output * cotangent) with autograd.

    Returns:
        (output, input gradients keyed by the names in `wrt`, weight gradients keyed by
        canonical names in the canonical layout), all numpy arrays. Used by mha.harness.
    """
    tensors = dict(tensors)
    for name in wrt:
        tensors[name] = tensors[name].detach().clone().requires_grad_(True)
    parameters = {} if layer is None else canonical_parameters(layer, PARAMETERS)
    output = function(tensors)
    loss = (output * cotangent).sum()
    sources = [tensors[name] for name in wrt] + [value for value, _ in parameters.values()]
    gradients = torch.autograd.grad(loss, sources, allow_unused=True)
    gradients = [torch.zeros_like(s) if g is None else g
                 for s, g in zip(sources, gradients, strict=True)]
    input_gradients = {name: to_numpy(g) for name, g in zip(wrt, gradients, strict=False)}
    weight_gradients = {
        name: to_numpy(g).T.copy() if transposed else to_numpy(g)
        for (name, (_, transposed)), g in zip(parameters.items(), gradients[len(wrt):],
                                               strict=True)
    }
    return to_numpy(output), input_gradients, weight_gradients


# What mha's glue needs beside the layers
ADAPTER = Adapter(
    to_numpy, from_numpy, layer_config, PARAMETERS, read_parameter, write_parameter,
    without_gradients, value_and_gradients, to_device=to_device,
)
