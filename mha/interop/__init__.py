"""Interoperability with the frameworks' own attention layers.

mha is the bridge between `torch.nn.MultiheadAttention`, `keras.layers.MultiHeadAttention` and
Flax's `nnx.MultiHeadAttention`: they hold the same computation as mha's `MultiHeadAttention`
(project, split into contiguous heads, scaled dot-product attention per head, concatenate,
project), in other layouts. This package converts the canonical weights (`W_q (query_size,
num_hiddens)` ... `b_o`, see `mha.weights`) to and from those layouts, builds one layer from
another, and translates the masks, so that the same inputs give the same outputs and
attention weights.

    >>> import torch, mha
    >>> builtin = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    >>> layer = mha.interop.from_torch(builtin, backend="numpy")   # any mha backend
    >>> keras_layer = mha.interop.to_keras(layer)                   # keras MultiHeadAttention

One module per framework, each with its layout in its docstring: `mha.interop.torch`,
`mha.interop.keras`, `mha.interop.flax`; what they share is in `mha.interop.common`. Every
public name of theirs is here too, as `mha.interop.<name>`.

The reshapes are exact because mha's head i is the contiguous block of columns i*p .. (i+1)*p-1
(p = num_hiddens / num_heads), the same split torch makes and the per-head kernels of Keras
and Flax hold. The three frameworks scale the scores by 1/sqrt(p), as mha does.

What the built-in layers cannot express raises ValueError before anything is built:
- torch: the query size must equal embed_dim (mha's query_size = num_hiddens); `add_bias_kv`
  and `add_zero_attn` have no mha equivalent.
- keras: mha has one head size, so a Keras layer converts when value_dim = key_dim, with
  attention over axis 1 of rank-3 inputs, one output axis (output_shape other than
  num_heads * key_dim becomes out_features).
- mha's options the built-in layers do not have (a score scale, an output bias apart from the
  others, and for torch another output size) are a ValueError naming them.

Masks (the mask helpers return keyword arguments ready for the target call), built by the
rules of mha's layers (`mha.masks`), lengths refused with the layers' messages:
- torch's boolean masks mean the opposite of mha's: True = NOT allowed. `to_torch_masks` turns
  valid_lens of shape (B,) into `key_padding_mask` (B, K) and everything else (valid_lens
  (B, Q), a keep-mask, causal) into `attn_mask` (Q, K) or (B * num_heads, Q, K), inverted.
- Keras's `attention_mask` (B, Q, K), or (B, heads, Q, K) per head, means True = attend, as
  mha's mask does; `causal` becomes `use_causal_mask` (top-left aligned in both). Keras also
  applies the masks its inputs carry (`Embedding(mask_zero=True)`'s): `from_keras_masks` takes
  them as query_mask and value_mask.
- Flax's `mask` means True = attend too, over [..., heads, Q, K]: `from_flax_masks` gives a
  mask of 3 axes (heads, Q, K) its batch axis, which mha's layers would read as the batch.

Rows with no allowed key: mha gives all-zero weights and an all-zero attention output (the
layer output is b_o), or uniform weights with empty_rows="uniform". torch's layer gives NaN
with weights and zeros without; Keras 3 gives zero weights with return_attention_scores=True
and uniform ones on its default path (docs/porting.md has the table).

Files of these layers (FILE_KINDS, file_kind, read_file, write_file, convert, read_state) are
`mha.conversion`'s, which sits above this package and `mha.porting`; their old names here,
`mha.interop.convert` and the rest, still work: they are looked up in `mha.conversion` when
first asked for.

Frameworks are imported inside the functions that need them: importing this package imports
none.
"""

from __future__ import annotations

from typing import Any

from mha.interop.common import layer_from_weights
from mha.interop.flax import (
    canonical_from_flax,
    flax_params,
    from_flax,
    from_flax_masks,
    to_flax,
    to_flax_masks,
)
from mha.interop.keras import (
    canonical_from_keras,
    from_keras,
    from_keras_masks,
    keras_weights,
    to_keras,
    to_keras_masks,
)
from mha.interop.torch import (
    canonical_from_torch,
    from_torch,
    from_torch_masks,
    to_torch,
    to_torch_masks,
    torch_state_dict,
)

__all__ = [
    "FILE_KINDS",
    "canonical_from_flax",
    "canonical_from_keras",
    "canonical_from_torch",
    "convert",
    "file_kind",
    "flax_params",
    "from_flax",
    "from_flax_masks",
    "from_keras",
    "from_keras_masks",
    "from_torch",
    "from_torch_masks",
    "keras_weights",
    "layer_from_weights",
    "read_file",
    "to_flax",
    "to_flax_masks",
    "to_keras",
    "to_keras_masks",
    "to_torch",
    "to_torch_masks",
    "torch_state_dict",
    "write_file",
]

# Names that moved to mha.conversion, which imports this package: looked up there on first use
MOVED_TO_CONVERSION = (
    "FILE_KINDS",
    "convert",
    "file_kind",
    "read_file",
    "read_state",
    "write_file",
)


def __getattr__(name: str) -> Any:
    if name in MOVED_TO_CONVERSION:
        from mha import conversion

        return getattr(conversion, name)
    raise AttributeError(f"module 'mha.interop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(MOVED_TO_CONVERSION))
