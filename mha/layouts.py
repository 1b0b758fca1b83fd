"""The layouts attention layers are kept in, and the readers of each layout's matrices.

`mha.porting` finds a layout under a prefix of a model's weights and ports it; this module
says what each layout is: the names of its modules (`LAYOUTS`), which of them mark it
(`find_attention`), and how its weights read as mha's canonical q, k, v, o matrices and the
config they tell.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from mha import latent_layout, validation
from mha.interop.torch import TORCH_WEIGHT_NAMES, canonical_from_torch
from mha.shared_layers import (
    KEYS_AS_VALUES,
    KEYS_VALUES_ELSEWHERE,
    keys_values_elsewhere,
    values_are_keys,
)

__all__ = [
    "LAYOUTS",
    "Layout",
    "find_attention",
    "flatten",
    "layout_names",
    "matches",
    "num_kv_heads",
    "under",
    "weights_and_config",
]


class Layout(NamedTuple):
    """How one family of models keeps an attention layer's weights."""

    name: str
    kind: str  # "linear", "fused", "fused_grouped", "conv1d", "conv1d_cross", "heads", "torch"
    paths: Mapping[str, str]  # role (q, k, v, o, or qkv) -> module path under the prefix
    scale: float | None = None  # None: 1 / sqrt(head size)
    # Names under the prefix that are not part of the layer's numbers (a name ending in "."
    # stands for every name it begins) -> why
    outside: Mapping[str, str] = MappingProxyType({})
    # The positions that every model of the layout adds inside the attention, which the
    # weights do not hold ("" where some add none)
    positions: str = ""
    biases: bool = True  # whether the layout's models have biases (T5's have none)
    # Whether the query projection holds each head's gate of its output beside its queries
    gated: bool = False
    # Names whose presence under the prefix marks another layout (GPT-2's cross-attention)
    excludes: tuple[str, ...] = ()


_ADD_NORM = "the layer norm after the residual, outside the attention"
_PRE_NORM = (
    "the layer norm of the attention's input (ESM's, RoBERTa-PreLayerNorm's): give the layer "
    "the normed input"
)
_CAUSAL = "GPT-2's causal-mask buffer: give causal=True"


LAYOUTS = (
    Layout(
        "HF BERT/RoBERTa",
        "linear",
        {"q": "self.query", "k": "self.key", "v": "self.value", "o": "output.dense"},
        outside={
            "output.LayerNorm.weight": _ADD_NORM,
            "output.LayerNorm.bias": _ADD_NORM,
            "LayerNorm.weight": _PRE_NORM,
            "LayerNorm.bias": _PRE_NORM,
        },
    ),
    Layout(
        "HF ViT",
        "linear",
        {"q": "attention.query", "k": "attention.key", "v": "attention.value", "o": "output.dense"},
    ),
    Layout(
        "q/k/v/o_proj (Llama, Mistral, Qwen)",
        "linear",
        {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"},
    ),
    Layout(
        "q_gate_proj, k/v_proj and o_proj (MiniCPM5)",
        "linear",
        {"q": "q_gate_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"},
        positions="rotary embeddings",
        gated=True,
    ),
    Layout(
        "q/k/v_proj and out_proj (BART, OPT, Whisper)",
        "linear",
        {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"},
    ),
    Layout(
        "q/k/v_proj and dense (Phi)",
        "linear",
        {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "dense"},
        positions="rotary embeddings",
    ),
    Layout(
        "DistilBERT (q_lin, k_lin, v_lin, out_lin)",
        "linear",
        {"q": "q_lin", "k": "k_lin", "v": "v_lin", "o": "out_lin"},
    ),
    Layout(
        "fused qkv_proj and o_proj (Phi-3)",
        "fused_grouped",
        {"qkv": "qkv_proj", "o": "o_proj"},
        positions="rotary embeddings",
    ),
    Layout(
        "T5",
        "linear",
        {"q": "q", "k": "k", "v": "v", "o": "o"},
        scale=1.0,
        outside={"relative_attention_bias.weight": "give attn_bias=t5_position_bias(...)"},
        biases=False,  # MPNet's q, k, v, o have biases, and scaled scores: not this layout
    ),
    Layout(
        "fused query_key_value and dense (GPT-NeoX, Falcon, BLOOM)",
        "fused_per_group",
        {"qkv": "query_key_value", "o": "dense"},
        positions="rotary embeddings (GPT-NeoX, Falcon) or ALiBi (BLOOM)",
    ),
    Layout("fused qkv and proj (timm)", "fused", {"qkv": "qkv", "o": "proj"}),
    Layout(
        "q/k/v_proj and Wo (ModernBERT's decoder)",
        "linear",
        {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "Wo"},
        positions="rotary embeddings",
    ),
    Layout(
        "fused Wqkv and Wo (ModernBERT)",
        "fused",
        {"qkv": "Wqkv", "o": "Wo"},
        positions="rotary embeddings",
    ),
    Layout(
        "fused Wqkv and out_proj (MPT)",
        "fused",
        {"qkv": "Wqkv", "o": "out_proj"},
        positions="ALiBi",
    ),
    Layout(
        "GPT-2 Conv1D (c_attn, c_proj)",
        "conv1d",
        {"qkv": "c_attn", "o": "c_proj"},
        outside={"bias": _CAUSAL, "masked_bias": _CAUSAL},
        excludes=("q_attn.weight",),
    ),
    Layout(
        "GPT-2 Conv1D cross-attention (q_attn, c_attn, c_proj)",
        "conv1d_cross",
        {"q": "q_attn", "kv": "c_attn", "o": "c_proj"},
    ),
    Layout(
        "Keras MultiHeadAttention",
        "heads",
        {"q": "query", "k": "key", "v": "value", "o": "attention_output"},
    ),
    Layout(
        "Flax multi-head attention",
        "heads",
        {"q": "query", "k": "key", "v": "value", "o": "out"},
        outside={
            "rngs.": "Flax's random streams (dropout)",
            "cached_key": "Flax's decoding cache",
            "cached_value": "Flax's decoding cache",
            "cache_index": "Flax's decoding cache",
        },
    ),
    Layout("torch.nn.MultiheadAttention", "torch", {"o": "out_proj"}),
)

# The parameter that marks a module of each kind; its bias sits beside it
_MARK = {
    "linear": "weight",
    "fused": "weight",
    "fused_grouped": "weight",
    "fused_per_group": "weight",
    "conv1d": "weight",
    "conv1d_cross": "weight",
    "heads": "kernel",
}


def flatten(state: Mapping[str, Any], separator: str = ".") -> dict[str, Any]:
    """A flat name -> array dict of a state_dict or of nested parameters (Flax), with "/"
    (Keras's paths) read as ".". Flax's top-level "params" collection is dropped. Two
    names that become one ("a/b" and "a.b") are a ValueError: either could be the weight."""
    if set(state) == {"params"} and isinstance(state["params"], Mapping):
        state = state["params"]
    flat: dict[str, Any] = {}
    written: dict[str, str] = {}  # flat name -> the keys it was read under

    def walk(keys: tuple[str, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk((*keys, str(key)), inner)
            return
        name = separator.join(keys).replace("/", separator)
        path = "".join(f"[{key!r}]" for key in keys)
        if name in flat:
            raise ValueError(
                f"two tensors are both named {name!r} once '/' and nesting read as "
                f"{separator!r}: {written[name]} and {path}; keep one"
            )
        flat[name], written[name] = value, path

    walk((), state)
    return flat


def under(state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The names under `prefix` ("/" or "." separated), without it, and their values."""
    prefix = prefix.replace("/", ".").strip(".")
    if not prefix:
        return dict(state)
    start = prefix + "."
    return {name[len(start) :]: value for name, value in state.items() if name.startswith(start)}


def matches(layout: Layout, names: Iterable[str]) -> bool:
    """Whether `names` hold every module that marks the layout."""
    names = set(names)
    if layout.kind == "torch":
        return "out_proj.weight" in names and (
            "in_proj_weight" in names or "q_proj_weight" in names
        )
    if not layout.biases and any(f"{path}.bias" in names for path in layout.paths.values()):
        return False
    if any(name in names for name in layout.excludes):
        return False
    return all(f"{path}.{_MARK[layout.kind]}" in names for path in layout.paths.values())


def layout_names(layout: Layout, names: Iterable[str]) -> list[str]:
    """The names of the layout's parameters among `names`."""
    if layout.kind == "torch":
        wanted = set(TORCH_WEIGHT_NAMES)
    else:
        wanted = {
            f"{path}.{p}" for path in layout.paths.values() for p in (_MARK[layout.kind], "bias")
        }
    return [name for name in names if name in wanted]


def find_attention(state: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(prefix, layout name) of every attention layer found in a state_dict, in its order."""
    state = flatten(state)
    found, seen = [], set()
    for name in state:
        for layout in LAYOUTS:
            for path in layout.paths.values():
                tail = f"{path}.{_MARK.get(layout.kind, 'weight')}"
                if name == tail or name.endswith("." + tail):
                    prefix = name[: -len(tail)].rstrip(".")
                    if (prefix, layout.name) not in seen and matches(layout, under(state, prefix)):
                        seen.add((prefix, layout.name))
                        found.append((prefix, layout.name))
        tail = latent_layout.MARK
        if name == tail or name.endswith("." + tail):  # DeepSeek-V3's latent attention
            prefix = name[: -len(tail)].rstrip(".")
            if latent_layout.matches(under(state, prefix)):
                found.append((prefix, latent_layout.NAME))
        for tail, holds, layout_name in _SHARED:  # Gemma 3n's and 4's layers
            if name == tail or name.endswith("." + tail):
                prefix = name[: -len(tail)].rstrip(".")
                if holds(under(state, prefix)):
                    found.append((prefix, layout_name))
    return found


# The layers that hold part of their keys and values elsewhere: the name that marks them
_SHARED = (
    ("k_proj.weight", values_are_keys, KEYS_AS_VALUES),
    ("q_proj.weight", keys_values_elsewhere, KEYS_VALUES_ELSEWHERE),
)


def weights_and_config(layout: Layout, arrays, num_heads: int | None = None):
    """Canonical weights and the config the weights tell, of one layout's arrays; num_heads
    where the order of the rows depends on it (query_key_value)."""
    if layout.kind == "torch":
        return canonical_from_torch(arrays)
    if layout.kind == "fused_per_group":
        matrices, heads = _read_fused_per_group(layout, arrays, num_heads)
    else:
        matrices, heads = _READERS[layout.kind](layout, arrays)
    return _config(layout, matrices, heads)


def num_kv_heads(layout: Layout, config: Mapping[str, Any], kv_hiddens: int) -> int:
    """The number of key-value heads of projections with kv_hiddens outputs."""
    n, num_heads = config["num_hiddens"], config["num_heads"]
    head = n // num_heads if n % num_heads == 0 else None
    if head is None or kv_hiddens % head or num_heads % (kv_hiddens // head):
        raise _problem(
            layout,
            [
                f"the key and value projections have {kv_hiddens} outputs: with {num_heads} "
                f"heads of {n} / {num_heads} features, that is not a number of key-value "
                "heads dividing the query heads"
            ],
        )
    return kv_hiddens // head


def _problem(layout: Layout, problems: list[str]) -> ValueError:
    return ValueError(
        f"These {layout.name} weights do not fit mha's MultiHeadAttention:\n"
        + "\n".join(f"  - {problem}" for problem in problems)
    )


def _matrices(layout: Layout, arrays, role: str, transposed: bool):
    """(W (in, out), b or None) of one module, read as y = x @ W + b."""
    path = layout.paths[role]
    weight = arrays[f"{path}.weight"]
    if weight.ndim != 2:
        raise _problem(layout, [f"{path}.weight has shape {weight.shape}; expected a matrix"])
    bias = arrays.get(f"{path}.bias")
    return (weight.T if transposed else weight), bias


def _split(layout: Layout, role: str, W: np.ndarray, b: np.ndarray | None):
    """Three equal blocks of the columns of a fused q, k, v projection."""
    if W.shape[1] % 3:
        raise _problem(
            layout,
            [f"{layout.paths[role]} has {W.shape[1]} outputs, not 3 equal blocks for q, k and v"],
        )
    blocks = np.split(W, 3, axis=1)
    biases = [None] * 3 if b is None else np.split(b, 3)
    return {k: (blocks[i], biases[i]) for i, k in enumerate("qkv")}


def _read_linear(layout: Layout, arrays):
    # torch's Linear keeps weight (out, in)
    return {k: _matrices(layout, arrays, k, True) for k in "qkvo"}, None


def _read_fused(layout: Layout, arrays):
    return {
        **_split(layout, "qkv", *_matrices(layout, arrays, "qkv", True)),
        "o": _matrices(layout, arrays, "o", True),
    }, None


def _read_fused_grouped(layout: Layout, arrays):
    """Phi-3's qkv_proj: the rows of q, then of k and v, which may have fewer heads; q has as
    many outputs as the output projection has inputs."""
    W, b = _matrices(layout, arrays, "qkv", True)
    o = _matrices(layout, arrays, "o", True)
    n, rows = o[0].shape[0], W.shape[1]
    if rows <= n or (rows - n) % 2:
        raise _problem(
            layout,
            [
                f"{layout.paths['qkv']} has {rows} outputs; with {n} for the queries (the "
                "output projection's inputs), the rest is not two equal blocks for k and v"
            ],
        )
    kv = (rows - n) // 2
    cuts = [n, n + kv]
    blocks = np.split(W, cuts, axis=1)
    biases = [None] * 3 if b is None else np.split(b, cuts)
    return {**{k: (blocks[i], biases[i]) for i, k in enumerate("qkv")}, "o": o}, None


def _read_fused_per_group(layout: Layout, arrays, num_heads: int | None):
    """GPT-NeoX's, Falcon's and BLOOM's query_key_value: the rows of each key-value head's
    group in turn, its query heads, then its key head and its value head. One group per head
    gives each head's q, k, v in turn (GPT-NeoX, BLOOM); one group, Falcon's multi-query."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(
            f"the order of {layout.paths['qkv']}'s rows follows the heads: give num_heads "
            f"(a positive integer). Received: num_heads={num_heads!r}"
        )
    W, b = _matrices(layout, arrays, "qkv", True)
    o = _matrices(layout, arrays, "o", True)
    n, rows = o[0].shape[0], W.shape[1]
    head = n // num_heads if n % num_heads == 0 else 0
    groups = (rows // head - num_heads) // 2 if head and rows % head == 0 else 0
    if groups < 1 or rows != (num_heads + 2 * groups) * head or num_heads % groups:
        raise _problem(
            layout,
            [
                f"{layout.paths['qkv']} has {rows} outputs: with {num_heads} heads of the "
                f"output projection's {n} inputs, that is not q, k and v of groups of heads"
            ],
        )
    per_group = num_heads // groups

    def take(array, first, count):  # (..., rows) -> (..., count heads of each group)
        grouped = array.reshape(*array.shape[:-1], groups, per_group + 2, head)
        return grouped[..., first : first + count, :].reshape(*array.shape[:-1], -1)

    cuts = {"q": (0, per_group), "k": (per_group, 1), "v": (per_group + 1, 1)}
    matrices = {k: (take(W, *cut), None if b is None else take(b, *cut)) for k, cut in cuts.items()}
    return {**matrices, "o": o}, num_heads


def _read_conv1d(layout: Layout, arrays):
    # GPT-2's Conv1D keeps weight (in, out): x @ weight + bias
    return {
        **_split(layout, "qkv", *_matrices(layout, arrays, "qkv", False)),
        "o": _matrices(layout, arrays, "o", False),
    }, None


def _read_conv1d_cross(layout: Layout, arrays):
    # GPT-2's cross-attention: the queries from q_attn, the keys and values from c_attn's
    # two halves, applied to the encoder's states
    W, b = _matrices(layout, arrays, "kv", False)
    if W.shape[1] % 2:
        problem = f"{layout.paths['kv']} has {W.shape[1]} outputs, not 2 equal blocks for k and v"
        raise _problem(layout, [problem])
    blocks, biases = np.split(W, 2, axis=1), [None] * 2 if b is None else np.split(b, 2)
    return {
        "q": _matrices(layout, arrays, "q", False),
        "k": (blocks[0], biases[0]),
        "v": (blocks[1], biases[1]),
        "o": _matrices(layout, arrays, "o", False),
    }, None


def _read_heads(layout: Layout, arrays):
    kernels = {k: arrays[f"{layout.paths[k]}.kernel"] for k in "qkvo"}
    biases = {k: arrays.get(f"{layout.paths[k]}.bias") for k in "qkvo"}
    shapes = ", ".join(f"{layout.paths[k]} {kernels[k].shape}" for k in "qkvo")
    if any(kernels[k].ndim != 3 for k in "qkv") or kernels["o"].ndim < 3:
        raise _problem(
            layout,
            [
                "kernels are (in, heads, head size) and the output's (heads, "
                f"head size, out); found {shapes}"
            ],
        )
    heads = kernels["q"].shape[1]
    if kernels["o"].ndim > 3:
        raise _problem(layout, [f"an output of {kernels['o'].ndim - 2} axes; mha's has one"])
    weights = {}
    for k in "qkv":
        W, b = kernels[k], biases[k]
        weights[k] = (W.reshape(W.shape[0], -1), None if b is None else b.reshape(-1))
    W_o = kernels["o"]
    weights["o"] = (W_o.reshape(-1, W_o.shape[-1]), biases["o"])
    # Keys and values may have fewer heads (grouped-query attention), of the same size
    if (
        kernels["k"].shape[1:] != kernels["v"].shape[1:]
        or kernels["k"].shape[2] != kernels["q"].shape[2]
        or kernels["o"].shape[0] != heads
    ):
        raise _problem(layout, [f"the kernels' heads do not fit together: {shapes}"])
    return weights, heads


_READERS = {
    "linear": _read_linear,
    "fused": _read_fused,
    "fused_grouped": _read_fused_grouped,
    "conv1d": _read_conv1d,
    "conv1d_cross": _read_conv1d_cross,
    "heads": _read_heads,
}


def _zero_biases(matrices):
    """The (W, b) pairs with a zero bias for each of q, k and v that has none where another
    has one (Whisper's k_proj): the same numbers. Also the roles given one."""
    roles = [k for k in "qkv" if matrices[k][1] is None]
    if len(roles) == 3:
        return matrices, []
    zeros = {
        k: (matrices[k][0], np.zeros(matrices[k][0].shape[1], matrices[k][0].dtype)) for k in roles
    }
    return {**matrices, **zeros}, roles


def _config(layout: Layout, matrices, num_heads) -> dict[str, Any]:
    """mha's config of the (W, b) pairs of q, k, v, o; every problem is listed."""
    problems = []
    n = matrices["q"][0].shape[1]
    # Grouped-query attention: keys and values have fewer heads, of the queries' size
    kv = matrices["k"][0].shape[1]
    if matrices["v"][0].shape[1] != kv:
        problems.append(
            f"the key projection has {kv} outputs and the value's {matrices['v'][0].shape[1]}; "
            "mha's keys and values have the same number of heads"
        )
    if kv > n:
        problems.append(
            f"the key and value projections have {kv} outputs, more than the query's {n}"
        )
    if matrices["o"][0].shape[0] != n:
        problems.append(
            f"the output projection takes {matrices['o'][0].shape[0]} inputs; the heads give {n}"
        )
    matrices, zero_biases = _zero_biases(matrices)
    for k in "qkvo":
        W, b = matrices[k]
        if b is not None and b.shape != (W.shape[1],):
            problems.append(f"the {k} bias has shape {b.shape}; expected ({W.shape[1]},)")
    dtypes = {array.dtype.name for pair in matrices.values() for array in pair if array is not None}
    if len(dtypes) > 1:
        problems.append(f"the tensors have different dtypes: {', '.join(sorted(dtypes))}")
    if problems:
        raise _problem(layout, problems)
    weights = {f"W_{k}": np.ascontiguousarray(matrices[k][0]) for k in "qkvo"}
    weights.update(
        {
            f"b_{k}": np.ascontiguousarray(matrices[k][1])
            for k in "qkvo"
            if matrices[k][1] is not None
        }
    )
    bias, out_bias = matrices["q"][1] is not None, matrices["o"][1] is not None
    out_features = weights["W_o"].shape[1]
    config = {
        "num_hiddens": n,
        "num_heads": num_heads,
        "bias": bias,
        "query_size": weights["W_q"].shape[0],
        "key_size": weights["W_k"].shape[0],
        "value_size": weights["W_v"].shape[0],
        "dtype": validation.check_dtype(weights["W_q"].dtype.name),
        "out_bias": None if out_bias == bias else out_bias,
        "out_features": None if out_features == n else out_features,
        "kv_hiddens": kv,  # num_kv_heads once num_heads is known
        # The projections without a bias, given a zero one (exact: the port says so)
        "zero_biases": [layout.paths.get(k, k) for k in zero_biases],
    }
    return weights, config
