"""Importers: one attention layer out of a whole model's weights, in the layouts people port.

A model's `state_dict` (or safetensors file, or Flax parameters) holds its attention layers
among everything else. `from_state_dict(state, prefix, num_heads=...)` finds the layer under
`prefix`, recognizes its layout from the names there, and builds an mha MultiHeadAttention
holding the same weights in any backend:

    >>> import mha, transformers
    >>> bert = transformers.BertModel(transformers.BertConfig())
    >>> layer = mha.porting.from_state_dict(
    ...     bert.state_dict(), "encoder.layer.0.attention", num_heads=12, backend="jax")

The layouts (q, k, v, o: the query, key, value and output projections; n = num_hiddens):

    separate Linear layers, weight (out, in) and bias:
        self.query, self.key, self.value, output.dense         HF BERT, RoBERTa
        attention.query, attention.key, attention.value,
            output.dense                                       HF ViT
        q_proj, k_proj, v_proj, o_proj                         Llama, Mistral, Qwen
        q_proj, k_proj, v_proj, out_proj                       BART, OPT, Whisper
        q, k, v, o (no biases, unscaled scores: scale=1)       T5
    one fused Linear, qkv.weight (3n, in) = [q; k; v], and proj    timm's Attention
    GPT-2's Conv1D, stored (in, out): c_attn.weight (in, 3n) = [q, k, v], c_proj
    kernels per head (Keras and Flax): query/kernel (in, heads, head size), its bias
        (heads, head size), likewise key and value; attention_output/kernel (Keras) or
        out/kernel (Flax) (heads, head size, out)
    torch.nn.MultiheadAttention: in_proj_weight or q/k/v_proj_weight, out_proj

Names under the prefix that are outside the attention's numbers (BERT's LayerNorm after the
residual, T5's relative position bias table that the caller gives as attn_bias, GPT-2's
causal-mask buffers) are reported as left out. Any other tensor there (Qwen3's q_norm,
gpt-oss's sinks) is an error naming it: porting without it would give other numbers. A prefix
that matches no layout, or more than one, is an error that lists the names found there and
the prefixes where a layout is found.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from mha import validation
from mha.config import get_backend
from mha.files import read_bytes
from mha.interop.common import as_numpy
from mha.interop.torch import TORCH_WEIGHT_NAMES, canonical_from_torch
from mha.registry import load_backend
from mha.weights import (
    LAYER_CLASSES,
    OPTION_DEFAULTS,
    build_layer,
    check_untold_options,
    set_weights,
)

__all__ = [
    "LAYOUTS",
    "Port",
    "canonical_from_state_dict",
    "find_attention",
    "from_state_dict",
    "options_from_config",
    "t5_position_bias",
]


class Layout(NamedTuple):
    """How one family of models keeps an attention layer's weights."""

    name: str
    kind: str  # "linear", "fused", "conv1d", "heads" or "torch"
    paths: Mapping[str, str]  # role (q, k, v, o, or qkv) -> module path under the prefix
    scale: float | None = None  # None: 1 / sqrt(head size)
    # Names under the prefix that are not part of the layer's numbers (a name ending in "."
    # stands for every name it begins) -> why
    outside: Mapping[str, str] = MappingProxyType({})


_ADD_NORM = "the layer norm after the residual, outside the attention"
_CAUSAL = "GPT-2's causal-mask buffer: give causal=True"


LAYOUTS = (
    Layout(
        "HF BERT/RoBERTa",
        "linear",
        {"q": "self.query", "k": "self.key", "v": "self.value", "o": "output.dense"},
        outside={"output.LayerNorm.weight": _ADD_NORM, "output.LayerNorm.bias": _ADD_NORM},
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
        "q/k/v_proj and out_proj (BART, OPT, Whisper)",
        "linear",
        {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"},
    ),
    Layout(
        "T5",
        "linear",
        {"q": "q", "k": "k", "v": "v", "o": "o"},
        scale=1.0,
        outside={"relative_attention_bias.weight": "give attn_bias=t5_position_bias(...)"},
    ),
    Layout("fused qkv and proj (timm)", "fused", {"qkv": "qkv", "o": "proj"}),
    Layout(
        "GPT-2 Conv1D (c_attn, c_proj)",
        "conv1d",
        {"qkv": "c_attn", "o": "c_proj"},
        outside={"bias": _CAUSAL, "masked_bias": _CAUSAL},
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
_MARK = {"linear": "weight", "fused": "weight", "conv1d": "weight", "heads": "kernel"}


class Port(NamedTuple):
    """What was imported: canonical weights and config, the layout, and the names of the
    source under the prefix that were used and that were left out."""

    weights: dict[str, np.ndarray]
    config: dict[str, Any]
    layout: str
    used: list[str]
    left_out: list[str]


def flatten(state: Mapping[str, Any], separator: str = ".") -> dict[str, Any]:
    """A flat name -> array dict of a state_dict or of nested parameters (Flax), with "/"
    (Keras's paths) read as ".". Flax's top-level "params" collection is dropped."""
    if set(state) == {"params"} and isinstance(state["params"], Mapping):
        state = state["params"]
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk(f"{prefix}{separator}{key}" if prefix else str(key), inner)
        else:
            flat[prefix.replace("/", separator)] = value

    walk("", state)
    return flat


def _under(state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    prefix = prefix.replace("/", ".").strip(".")
    if not prefix:
        return dict(state)
    start = prefix + "."
    return {name[len(start) :]: value for name, value in state.items() if name.startswith(start)}


def _matches(layout: Layout, names: Iterable[str]) -> bool:
    names = set(names)
    if layout.kind == "torch":
        return "out_proj.weight" in names and (
            "in_proj_weight" in names or "q_proj_weight" in names
        )
    return all(f"{path}.{_MARK[layout.kind]}" in names for path in layout.paths.values())


def _layout_names(layout: Layout, names: Iterable[str]) -> list[str]:
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
                    if (prefix, layout.name) not in seen and _matches(
                        layout, _under(state, prefix)
                    ):
                        seen.add((prefix, layout.name))
                        found.append((prefix, layout.name))
    return found


def canonical_from_state_dict(
    state: Mapping[str, Any],
    prefix: str = "",
    *,
    num_heads: int | None = None,
    scale: float | None = None,
    **options: Any,
) -> Port:
    """Canonical MultiHeadAttention weights and config of the attention layer under `prefix`.

    Args:
        state: a state_dict (name -> tensor of any framework, or numpy array), or nested
            parameters (Flax).
        prefix: the attention module's path, e.g. "encoder.layer.0.attention"; "" when the
            state holds the attention layer alone.
        num_heads: the number of heads; needed except for kernels per head, which tell it.
        scale: the score scale, when the model's differs from its layout's (for example
            GPT-2 with scale_attn_by_inverse_layer_idx: 1 / (sqrt(head size) * (index + 1))).
        **options: the layer's options that weights do not tell: rope_theta,
            rope_interleaved, sliding_window (see `options_from_config` for a Hugging Face
            config). Key and value projections with fewer outputs than the query's give
            num_kv_heads (grouped-query attention).

    Raises:
        ValueError: no layout, or more than one, under the prefix (the names found there and
            the prefixes where a layout is found are listed); weights that do not fit mha's
            MultiHeadAttention, or tensors under the prefix that take part in the attention
            and mha cannot hold, such as q_norm or sinks (every problem is listed).
    """
    check_untold_options(options)
    state = flatten(state)
    names = _under(state, prefix)
    where = f"under {prefix!r}" if prefix.strip("./") else "in the state"
    layout = _only_layout(state, names, prefix, where)
    used = _layout_names(layout, names)
    left_out = _left_out(layout, set(names) - set(used), where)
    weights, config = _weights_and_config(layout, _read_arrays(names, used, where))
    config["num_heads"] = _heads(layout, config.get("num_heads"), num_heads, where)
    kv_hiddens = config.pop("kv_hiddens", config["num_hiddens"])
    if kv_hiddens != config["num_hiddens"]:
        config["num_kv_heads"] = _num_kv_heads(layout, config, kv_hiddens)
    config = {**OPTION_DEFAULTS, "dropout": 0.0, **config, **options}
    config["scale"] = layout.scale if scale is None else scale

    config = {key: config[key] for key in LAYER_CLASSES["MultiHeadAttention"]}
    validation.check_layer_args("MultiHeadAttention", config)
    if _INV_FREQ in left_out:
        _check_inv_freq(names[_INV_FREQ], config, where)
        left_out.remove(_INV_FREQ)
        used.append(_INV_FREQ)
    return Port(weights, config, layout.name, sorted(used), left_out)


def _only_layout(state, names: Mapping[str, Any], prefix: str, where: str) -> Layout:
    """The one layout the names under the prefix match; else an error listing what is there."""
    layouts = [layout for layout in LAYOUTS if _matches(layout, names)]
    if len(layouts) == 1:
        return layouts[0]
    listed = ", ".join(sorted(names)[:24]) + (" ..." if len(names) > 24 else "")
    elsewhere = find_attention(state)
    hint = (
        "; attention layers were found under "
        + ", ".join(f"{p!r} ({name})" for p, name in elsewhere[:6])
        + (f" and {len(elsewhere) - 6} more" if len(elsewhere) > 6 else "")
        if elsewhere
        else "; no attention layer of a known layout was found anywhere"
    )
    which = (
        "no known attention layout"
        if not layouts
        else "more than one layout: " + ", ".join(layout.name for layout in layouts)
    )
    raise ValueError(
        f"{which} {where}. Found: {listed or 'nothing'}{hint}. "
        "Known layouts: " + "; ".join(layout.name for layout in LAYOUTS)
    )


# Hugging Face's rotary frequencies, kept under the attention by older checkpoints
_INV_FREQ = "rotary_emb.inv_freq"


def _left_out(layout: Layout, rest: set[str], where: str) -> list[str]:
    """The names outside the layout that are outside the attention's numbers too; any other
    is an error naming it, since porting without it would give other numbers."""
    refused = sorted(name for name in rest if not _is_outside(layout, name) and name != _INV_FREQ)
    if refused:
        raise ValueError(
            f"the attention {where} holds what mha's MultiHeadAttention cannot represent: "
            + ", ".join(f"{name} ({_what_it_is(name)})" for name in refused)
            + "; porting without them would give other numbers"
        )
    return sorted(rest)


def _is_outside(layout: Layout, name: str) -> bool:
    return any(
        name == known or (known.endswith(".") and name.startswith(known))
        for known in layout.outside
    )


def _what_it_is(name: str) -> str:
    module = name.rsplit(".", 1)[0] if "." in name else name
    if "norm" in module.lower():
        return "a norm inside the attention: QK-norm"
    if module.split(".")[-1] == "sinks":
        return "attention sinks: a learned logit per head in each softmax"
    return "a tensor beside the projections"


def _read_arrays(names: Mapping[str, Any], used: list[str], where: str) -> dict[str, np.ndarray]:
    """The layout's tensors as numpy arrays of a float dtype mha reads."""
    arrays = {}
    for name in used:
        try:
            arrays[name] = as_numpy(names[name])
        except Exception as error:  # sparse, quantized or data-less tensors, foreign objects
            raise ValueError(f"{name} {where} cannot be read as an array: {error}") from None
        if arrays[name].dtype.name not in validation.FLOAT_DTYPES:
            raise ValueError(
                f"{name} {where} holds {arrays[name].dtype.name} numbers; mha "
                f"reads weights of {', '.join(validation.FLOAT_DTYPES)}"
            )
    return arrays


def _weights_and_config(layout: Layout, arrays):
    """Canonical weights and the config the weights tell, of one layout's arrays."""
    if layout.kind == "torch":
        return canonical_from_torch(arrays)
    matrices, heads = _READERS[layout.kind](layout, arrays)
    return _config(layout, matrices, heads)


def _heads(layout: Layout, told: int | None, given: int | None, where: str) -> int:
    """The number of heads: the kernels' (told), or the caller's (given); they must agree."""
    if told is not None and given is not None and given != told:
        raise ValueError(
            f"the {layout.name} kernels {where} have {told} heads. Received: num_heads={given}"
        )
    if told is None and given is None:
        raise ValueError(
            f"the {layout.name} weights {where} do not tell the number of heads: give num_heads"
        )
    return told if told is not None else given


def _check_inv_freq(inv_freq: Any, config: Mapping[str, Any], where: str) -> None:
    """A checkpoint's rotary frequencies are those of the layer's rope_theta: a layer without
    rotary embeddings, or with scaled or partial ones, would give other numbers."""
    theta = config["rope_theta"]
    if theta is None:
        raise ValueError(
            f"{_INV_FREQ} {where} says the layer rotates its queries and keys: give rope_theta "
            "(or the model's config to options_from_config)"
        )
    head = config["num_hiddens"] // config["num_heads"]
    expected = 1.0 / theta ** (np.arange(0, head, 2, dtype=np.float64) / head)
    found = as_numpy(inv_freq)
    # Kept in the model's dtype: half precision rounds the frequencies to 3 digits
    rtol = 1e-2 if found.dtype.itemsize < 4 else 1e-6
    found = np.asarray(found, dtype=np.float64).reshape(-1)
    if found.shape != expected.shape or not np.allclose(found, expected, rtol=rtol, atol=0):
        raise ValueError(
            f"{_INV_FREQ} {where} holds other frequencies than the plain ones of "
            f"rope_theta={theta} over heads of {head} features (a scaled or partial rotary "
            "embedding); mha's rotary embedding has the plain frequencies only"
        )


def from_state_dict(
    state: Mapping[str, Any],
    prefix: str = "",
    *,
    num_heads: int | None = None,
    scale: float | None = None,
    backend: str | None = None,
    **options: Any,
) -> Any:
    """An mha MultiHeadAttention in `backend` (default: the current one) holding the
    attention layer under `prefix`; see `canonical_from_state_dict` for the arguments."""
    port = canonical_from_state_dict(state, prefix, num_heads=num_heads, scale=scale, **options)
    module = load_backend(backend if backend is not None else get_backend())
    layer = build_layer(module, "MultiHeadAttention", port.config)
    set_weights(layer, port.weights)
    return layer


def _num_kv_heads(layout: Layout, config: Mapping[str, Any], kv_hiddens: int) -> int:
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


def options_from_config(
    config: Mapping[str, Any] | str | os.PathLike, layer: int | None = None
) -> dict[str, Any]:
    """num_heads and the port options of a Hugging Face config (a dict, or a config.json):
    num_attention_heads, the rotary base (rope_theta, or transformers 5's rope_parameters,
    also per layer type), the sliding window of the layer's type (layer_types), and the score
    scale where the config changes it (query_pre_attn_scalar, attention_multiplier, GPT-2's
    scale_attn_weights and scale_attn_by_inverse_layer_idx).

    Args:
        config: the config of the model the layer belongs to (a text model's, not a
            multimodal model's that nests it).
        layer: the layer's index in the model; needed where the config's layers differ
            (Gemma 2 and 3, gpt-oss: sliding and full attention).

    Raises:
        ValueError: anything of the config that changes the attention's numbers and mha's
            layer cannot hold (a scaled or partial rotary embedding, soft-capped scores,
            QK-norm, ...), each naming the field and its value; layers that differ and no
            `layer`; an unreadable file.
    """
    if not isinstance(config, Mapping):
        config = _read_json(config)
    _refuse_config(config)
    count = _num_layers(config)
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer is the index of a layer, >= 0. Received: layer={layer!r}")
        if count is not None and layer >= count:
            raise ValueError(f"the config has {count} layers. Received: layer={layer}")
        return _options_of_layer(config, layer)
    if count is None:
        return _options_of_layer(config, None)
    each = [_options_of_layer(config, i) for i in range(count)]
    other = next((i for i, options in enumerate(each) if options != each[0]), None)
    if other is not None:
        fields = [key for key in _PER_LAYER if config.get(key) not in (None, False)]
        raise ValueError(
            f"the config's layers differ ({', '.join(fields)}): layer 0 gets {each[0]}, "
            f"layer {other} {each[other]}; give the layer's index (layer=, --layer)"
        )
    return each[0]


# The fields that make one layer's options differ from another's
_PER_LAYER = (
    "layer_types",
    "no_rope_layers",
    "max_window_layers",
    "scale_attn_by_inverse_layer_idx",
)

# Config fields whose values change the attention's numbers in ways mha's layer cannot
# represent: field -> (the values that leave the attention plain, what the field does)
_UNSUPPORTED = {
    "attn_logit_softcapping": ((None,), "soft-caps the scores (tanh)"),
    "use_qk_norm": ((None, False), "normalizes each head's queries and keys (QK-norm)"),
    "qk_layernorm": ((None, False), "normalizes each head's queries and keys (QK-norm)"),
    "clip_qkv": ((None,), "clips the projections' outputs"),
    "attention_chunk_size": ((None,), "attends within chunks of the sequence"),
    "attn_temperature_tuning": ((None, False), "scales the queries by their position"),
    "use_bidirectional_attention": ((None, False), "attends both ways, with windows of its own"),
    "rotary_dim": ((None,), "rotates part of each head, with pairs of its own"),
    "rotary_pct": ((None, 1.0), "rotates part of each head"),
    "partial_rotary_factor": ((None, 1.0), "rotates part of each head"),
    "alibi": ((None, False), "adds ALiBi's position biases"),
}


def _refuse_config(config: Mapping[str, Any]) -> None:
    """Refuse every field mha's layer cannot represent, and configs that nest the model's."""
    nested = [
        key
        for key, value in config.items()
        if isinstance(value, Mapping) and "num_attention_heads" in value
    ]
    if nested and config.get("num_attention_heads", config.get("n_head")) is None:
        raise ValueError(
            f"the config nests the configs of its models ({', '.join(nested)}): give the one "
            f"the layer belongs to, e.g. config[{nested[0]!r}]"
        )
    problems = [
        f"{key}={config[key]!r} {what}"
        for key, (plain, what) in _UNSUPPORTED.items()
        if key in config and config[key] not in plain
    ]
    if problems:
        raise ValueError(
            "the config's attention does what mha's MultiHeadAttention cannot represent: "
            + "; ".join(problems)
        )


def _num_layers(config: Mapping[str, Any]) -> int | None:
    """The number of layers the config describes, where it tells it."""
    for key in ("layer_types", "no_rope_layers"):
        if config.get(key) is not None:
            if not isinstance(config[key], list):
                raise ValueError(f"the config's {key} is not a list: {config[key]!r}")
            return len(config[key]) or None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int) and 0 < config[key] <= _MAX_LAYERS:
            return config[key]
    return None


# The rotary convention of each model type checked against transformers' own layer, which
# its config does not tell: "half" rotates features (i, i + d/2) as Llama, "pairs"
# (2i, 2i + 1) as GPT-J
_ROTARY = {
    "apertus": "half",
    "arcee": "half",
    "cohere": "pairs",
    "cohere2": "pairs",
    "ernie4_5": "pairs",
    "gemma": "half",
    "gemma2": "half",
    "gemma3_text": "half",
    "glm": "pairs",
    "glm4": "pairs",
    "gpt_oss": "half",
    "granite": "half",
    "granitemoe": "half",
    "helium": "pairs",
    "llama": "half",
    "ministral": "half",
    "mistral": "half",
    "mixtral": "half",
    "nemotron": "half",
    "olmo": "half",
    "olmo2": "half",
    "phi": "half",
    "qwen2": "half",
    "qwen2_moe": "half",
    "qwen3": "half",
    "qwen3_moe": "half",
    "seed_oss": "half",
    "smollm3": "half",
    "stablelm": "half",
    "starcoder2": "half",
    "vaultgemma": "half",
}

# Model types whose layers without a sliding window have no rotary embedding
_ROTARY_WITH_WINDOW_ONLY = frozenset({"cohere2"})

_MAX_LAYERS = 4096  # far more than any model has; bounds the work on a config


def _options_of_layer(config: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """The options of the layer of this index (None: where the config tells no layers)."""
    found: dict[str, Any] = {}
    heads = config.get("num_attention_heads", config.get("n_head"))
    if heads is not None:
        found["num_heads"] = int(heads)
    kind = _attention_kind(config, layer)
    window = config.get("sliding_window")
    if window is not None and config.get("use_sliding_window", True) and kind != "full_attention":
        found["sliding_window"] = int(window)
    theta = _rope_theta(config, kind, layer)
    model_type = config.get("model_type")
    if theta is not None and model_type is not None:
        if model_type not in _ROTARY:
            raise ValueError(
                f"the config's model_type={model_type!r} has a rotary embedding whose "
                "convention mha does not know (the config does not tell it): give rope_theta "
                "and rope_interleaved yourself. Known: " + ", ".join(sorted(_ROTARY))
            )
        if model_type in _ROTARY_WITH_WINDOW_ONLY and "sliding_window" not in found:
            theta = None
    if theta is not None:
        found["rope_theta"] = theta
        if _ROTARY.get(model_type) == "pairs":
            found["rope_interleaved"] = True
    scale = _scale(config, layer)
    if scale is not None:
        found["scale"] = scale
    return found


def _attention_kind(config: Mapping[str, Any], layer: int | None) -> str | None:
    """The layer's type, full_attention or sliding_attention, as layer_types (or Qwen2's
    max_window_layers) says; None where the config does not tell the layers apart."""
    types = config.get("layer_types") or None
    if types is None:
        sliding = config.get("sliding_window") is not None and config.get(
            "use_sliding_window", True
        )
        if sliding and config.get("sliding_window_pattern") is not None:
            raise ValueError(
                f"the config's sliding_window_pattern={config['sliding_window_pattern']!r} "
                "picks the sliding layers, and mha reads which from layer_types only"
            )
        if not sliding or config.get("max_window_layers") is None:
            return None
        if layer is None:
            raise ValueError(
                f"the config's max_window_layers={config['max_window_layers']!r} makes the "
                "layers from that index on slide: give the config's num_hidden_layers and "
                "the layer's index"
            )
        # transformers' rule where layer_types is not written
        return "sliding_attention" if layer >= config["max_window_layers"] else "full_attention"
    kind = types[layer]
    if kind not in ("full_attention", "sliding_attention"):
        raise ValueError(
            f"layer {layer} of the config is {kind!r} (layer_types); mha's layer is "
            "'full_attention' or 'sliding_attention'"
        )
    return kind


def _rope_theta(config: Mapping[str, Any], kind: str | None, layer: int | None) -> float | None:
    """The plain rotary embedding's base of the layer, or None where it has none; any other
    rotary embedding is an error naming its field."""
    no_rope = config.get("no_rope_layers")
    if no_rope is not None and (layer is None or layer >= len(no_rope)):
        raise ValueError(f"the config's no_rope_layers does not tell layer {layer}: {no_rope}")
    if no_rope is not None and not no_rope[layer]:
        return None  # SmolLM3's and Llama 4's layers without rotary embeddings
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"the config's rope_parameters is not a mapping: {rope!r}")
    field = "rope_parameters"
    if rope and all(isinstance(value, Mapping) for value in rope.values()):
        # Gemma 3: one rotary embedding per layer type
        if kind not in rope:
            which = "no layer_types" if kind is None else f"{kind!r} layers (layer_types)"
            raise ValueError(
                f"the config's rope_parameters are per layer type ({', '.join(rope)}), and "
                f"it has {which}"
            )
        rope, field = rope[kind], f"rope_parameters[{kind!r}]"
    for name, value in ((field, rope), ("rope_scaling", config.get("rope_scaling") or {})):
        rope_type = value.get("rope_type", value.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"the config's rotary embedding is {rope_type!r} ({name}={dict(value)}); mha's "
                "has the default frequencies only (rope_type 'default')"
            )
        factor = value.get("partial_rotary_factor", 1.0)
        if factor not in (None, 1.0):
            raise ValueError(
                f"the config rotates part of each head ({name}['partial_rotary_factor']="
                f"{factor!r}); mha's rotary embedding rotates all of it"
            )
    theta = rope.get("rope_theta", config.get("rope_theta"))
    return None if theta is None else float(theta)


def _scale(config: Mapping[str, Any], layer: int | None) -> float | None:
    """The score scale the config gives the layer, or None where it is 1 / sqrt(head size)."""
    head = _head_size(config)
    scale = None
    if config.get("query_pre_attn_scalar") is not None:  # Gemma 2 and 3
        scale = float(config["query_pre_attn_scalar"]) ** -0.5
    if config.get("attention_multiplier") is not None:  # Granite
        scale = float(config["attention_multiplier"])
    if config.get("scale_attn_weights") is False:  # GPT-2
        scale = 1.0
    if config.get("scale_attn_by_inverse_layer_idx"):
        if layer is None or (scale is None and head is None):
            raise ValueError(
                "the config's scale_attn_by_inverse_layer_idx=True scales each layer's scores "
                "by its index: give the layer's index and the config's sizes"
            )
        scale = (head**-0.5 if scale is None else scale) / (layer + 1)
    if scale is not None and head is not None and math.isclose(scale, head**-0.5, rel_tol=1e-12):
        return None
    return scale


def _head_size(config: Mapping[str, Any]) -> int | None:
    """The size of a head: head_dim, or the hidden size over the number of heads."""
    if config.get("head_dim") is not None:
        return int(config["head_dim"])
    heads = config.get("num_attention_heads", config.get("n_head"))
    hidden = next(
        (config[key] for key in ("hidden_size", "n_embd", "d_model") if config.get(key)), None
    )
    if not heads or not hidden or hidden % heads:
        return None
    return hidden // heads


def _read_json(path: str | os.PathLike) -> dict[str, Any]:
    try:
        value = json.loads(read_bytes(path, _MAX_CONFIG_BYTES))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the config {os.fspath(path)}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"the config {os.fspath(path)} is not a JSON object")
    return value


_MAX_CONFIG_BYTES = 1 << 20  # a model config is a few KiB


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


def _read_conv1d(layout: Layout, arrays):
    # GPT-2's Conv1D keeps weight (in, out): x @ weight + bias
    return {
        **_split(layout, "qkv", *_matrices(layout, arrays, "qkv", False)),
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
    "conv1d": _read_conv1d,
    "heads": _read_heads,
}


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
    has_bias = {k: matrices[k][1] is not None for k in "qkv"}
    if len(set(has_bias.values())) > 1:
        problems.append(
            "biases on " + ", ".join(k for k in "qkv" if has_bias[k]) + " only; "
            "mha's q, k and v projections have biases together or not at all"
        )
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
    bias, out_bias = has_bias["q"], matrices["o"][1] is not None
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
    }
    return weights, config


def t5_position_bias(
    embedding: Any,
    num_queries: int,
    num_keys: int,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> np.ndarray:
    """T5's relative position bias, the `attn_bias` of T5 attention ported to mha.

    T5 adds to the scores of head h a learned number per bucket of the distance from query i
    to key j: exact buckets for small distances, logarithmic ones up to max_distance, and with
    `bidirectional` (the encoder) separate buckets for keys after the query. The decoder's
    self-attention is not bidirectional. The layer that holds `relative_attention_bias.weight`
    (T5's first layer of a stack) computes it for every layer of that stack.

    Args:
        embedding: `relative_attention_bias.weight`, (num_buckets, num_heads).
        num_queries, num_keys: the call's lengths.
        bidirectional, num_buckets, max_distance: T5's config (`is_decoder` is not
            bidirectional; `relative_attention_num_buckets`, `relative_attention_max_distance`).

    Returns:
        (1, num_heads, num_queries, num_keys), in the embedding's dtype.
    """
    embedding = as_numpy(embedding)
    # Distance from query i to key j: j - i, negative for keys before the query
    relative = np.arange(num_keys)[None, :] - np.arange(num_queries)[:, None]
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0) * num_buckets
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    # Logarithmic buckets past max_exact, computed in float32 as T5 computes them
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.log(relative.astype(np.float32) / np.float32(max_exact))
        scaled = scaled / np.float32(math.log(max_distance / max_exact))
        large = max_exact + (scaled * np.float32(num_buckets - max_exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    buckets += np.where(relative < max_exact, relative, large)
    # (Q, K, num_heads) -> (1, num_heads, Q, K)
    return np.ascontiguousarray(embedding[buckets].transpose(2, 0, 1)[None])
