"""Each layer's kind as transformers reads a Hugging Face config: full or sliding attention
(or another mixer, which is not mha's layer), and whether it turns its queries and keys.

A config's `layer_types` names each layer's kind. Where a config does not write them (Gemma
2's configs, Gemma 3's and Cohere 2's older ones), transformers gives each model type's own
rule, and so does this module: a port reads the window and the rotary embedding of the layer
transformers runs. Likewise SmolLM3's and Llama 4's layers without a rotary embedding where
no_rope_layers is not written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mha.config_values import flag, is_whole

__all__ = ["last_layer", "layer_kind", "rotates", "uses_window"]

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"

# Model types whose every p-th layer is full, counting from 1 ((i + 1) % p == 0), where
# layer_types is not written: the field that gives p, its default, the others' kind
_EVERY_PTH_FULL = {
    "afmoe": ("global_attn_every_n_layers", 4, SLIDING),
    "cohere2": ("sliding_window_pattern", 4, SLIDING),
    "cohere2_moe": ("sliding_window_pattern", 4, SLIDING),  # past first_k_dense_replace
    "exaone4": ("sliding_window_pattern", 4, SLIDING),
    "exaone_moe": ("sliding_window_pattern", 4, SLIDING),
    "gemma2": ("", 2, SLIDING),
    "gemma3_text": ("sliding_window_pattern", 6, SLIDING),
    "gemma3n_text": ("", 5, SLIDING),
    "gemma4_text": ("", 6, SLIDING),
    "embedding_gemma2_text": ("sliding_window_pattern", 6, SLIDING),
    "gpt_oss": ("", 2, SLIDING),
    "ultrabert": ("", 3, SLIDING),
    "kolibri1": ("", 5, SLIDING),
    "olmo3": ("", 4, SLIDING),
    "olmo_hybrid": ("", 4, LINEAR),
    "qwen3_5_moe_text": ("full_attention_interval", 4, LINEAR),
    "qwen3_5_text": ("full_attention_interval", 4, LINEAR),
    "qwen3_next": ("full_attention_interval", 4, LINEAR),
    "vaultgemma": ("", 2, SLIDING),
}
# Model types whose first layer of every p is full (i % p == 0), the others sliding: the
# field that gives p, its default
_FIRST_OF_P_FULL = {
    "cwm": ("", 4),
    "granite_swa": ("", 4),
    "granitemoe_swa": ("", 4),
    "modernbert": ("global_attn_every_n_layers", 3),
    "modernbert-decoder": ("global_attn_every_n_layers", 3),
}
# Model types whose layers repeat a pattern
_PATTERN = {
    "granitemoehybrid": (LINEAR,),
    "lara_mini": (LINEAR, SLIDING, LINEAR, FULL, SLIDING),
    "mellum": (FULL,),
    "minimax": (FULL, LINEAR),
}
# Model types whose first two layers and every fourth from the second are full, and the last
# (Flint's), where layer_types is not written
_FLINT_RULE = frozenset({"flint"})
# Model types whose every fourth layer counted from the last is full, the others sliding
# (Muse Glimmer's), where layer_types is not written
_FULL_FROM_LAST = frozenset({"muse_glimmer_text"})
# Model types whose layers' kinds cycle through block_types (RecurrentGemma's: its "recurrent"
# blocks are not attention, the others slide), and its default
_BLOCK_TYPES = {"recurrent_gemma": ("recurrent", "recurrent", "attention")}
# transformers' names of layer kinds that older configs name otherwise (Granite 4.0's)
_LEGACY = {"mamba": LINEAR, "attention": FULL}
# Model types whose every layer is full where layer_types is not written (Cohere Compass's
# text model: its rotary embedding is per layer type)
_ALL_FULL = frozenset({"cohere_compass_text"})
# Model types whose last layer is full whatever layer_types says
_LAST_FULL = frozenset({"embedding_gemma2_text", "gemma4_text"})


# Model types whose every no_rope_layer_interval-th layer has no rotary embedding where
# no_rope_layers is not written (Llama 4's: nor where it is empty)
_NO_ROPE_EVERY = {"llama4_text": True, "smollm3": False}


def rotates(config: Mapping[str, Any], layer: int | None) -> bool | None:
    """Whether the layer has a rotary embedding as no_rope_layers says (SmolLM3's, Llama 4's),
    or transformers' default of it; None where the config does not tell."""
    no_rope = config.get("no_rope_layers")
    model_type = config.get("model_type")
    if model_type in _NO_ROPE_EVERY and (
        no_rope is None or (not no_rope and _NO_ROPE_EVERY[model_type])
    ):
        interval = config.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"the config's no_rope_layer_interval={interval!r} is not a count")
        if layer is None:
            raise ValueError(
                f"the config's layers differ (every {interval}th without a rotary embedding, "
                "transformers' default where no_rope_layers is not written): give the layer's "
                "index"
            )
        no_rope = [int((i + 1) % interval != 0) for i in range(layer + 1)]
    if no_rope is None:
        return None
    if layer is None or not 0 <= layer < len(no_rope):
        raise ValueError(f"the config's no_rope_layers does not tell layer {layer}: {no_rope}")
    return bool(no_rope[layer])


# Model types whose config keeps sliding_window where use_sliding_window is false: their
# masks (eager, SDPA) still slide on the layers layer_types name sliding, their flash
# attention does not
_MASKS_READ_LAYER_TYPES = frozenset({"smollm3"})


def uses_window(config: Mapping[str, Any], kind: str | None = None) -> bool:
    """Whether the config's window applies (to the layers of the sliding kind), as its
    use_sliding_window says (transformers' default of it filled in: mha.config_defaults).
    A sliding layer (`kind`) that transformers' attentions window differently is an error."""
    on = flag(config, "use_sliding_window", True)
    split = config.get("model_type") in _MASKS_READ_LAYER_TYPES and config.get("layer_types")
    if not on and split and kind == SLIDING and config.get("sliding_window") is not None:
        raise ValueError(
            f"the config's layer_types name sliding_attention layers, with sliding_window="
            f"{config['sliding_window']!r} and use_sliding_window false: transformers' eager "
            "and SDPA attention window them (their masks read layer_types) where its flash "
            "attention does not: write use_sliding_window true, or those layers as "
            "full_attention"
        )
    return on


def layer_kind(config: Mapping[str, Any], layer: int | None) -> str | None:
    """The layer's kind as transformers reads the config: layer_types, else the model type's
    rule (or Qwen2's max_window_layers); None where every layer is alike."""
    model_type = config.get("model_type")
    types = config.get("layer_types") or config.get("layers_block_type") or None  # Granite 4.0
    if types is not None:
        types = [_LEGACY.get(kind, kind) for kind in types]
        if model_type in _LAST_FULL and layer == len(types) - 1:
            return FULL
        return types[layer] if layer is not None else None
    if model_type in _ALL_FULL:
        return FULL
    rule = _rule(config)
    if rule is None:
        return None
    if layer is None:
        raise ValueError(
            f"the config's layers differ ({rule[0]}, transformers' rule of model_type="
            f"{model_type!r} where layer_types is not written): give the layer's index"
        )
    if model_type in _LAST_FULL | _FLINT_RULE:  # whatever the rule gives it
        if layer == last_layer(config, f"last layer is full whatever {rule[0]} says, and its"):
            return FULL
    return rule[1](layer)


def last_layer(config: Mapping[str, Any], what: str) -> int:
    """The index of the config's last layer, which a rule of `what` counts from; an error where
    num_hidden_layers does not tell it."""
    count = config.get("num_hidden_layers")
    if isinstance(count, bool) or not is_whole(count) or count < 1:
        raise ValueError(
            f"the config's {what} num_hidden_layers={count!r} does not tell which it is: give "
            "layer_types"
        )
    return int(count) - 1


def _rule(config: Mapping[str, Any]):
    """(what the rule says, the kind of a layer by its index), or None: no rule."""
    model_type = config.get("model_type")
    if model_type in _EVERY_PTH_FULL:
        field, default, others = _EVERY_PTH_FULL[model_type]
        period = _period(config, field, default)
        dense = int(config.get("first_k_dense_replace") or 0) if model_type == "cohere2_moe" else 0
        dense_period = int(config.get("prefix_dense_sliding_window_pattern", 1))

        def kind(i: int) -> str:
            if i < dense:  # Cohere 2 MoE's dense layers' pattern of their own
                return SLIDING if (i + 1) % dense_period else FULL
            return others if (i - dense + 1) % period else FULL

        return f"a full layer every {period}", kind
    if model_type in _FIRST_OF_P_FULL:
        period = _period(config, *_FIRST_OF_P_FULL[model_type])
        return (
            f"a full layer every {period} from the first",
            lambda i: SLIDING if i % period else FULL,
        )
    if model_type in _BLOCK_TYPES:
        blocks = config.get("block_types") or _BLOCK_TYPES[model_type]
        if not isinstance(blocks, (list, tuple)) or not all(isinstance(b, str) for b in blocks):
            raise ValueError(f"the config's block_types is not a list of names: {blocks!r}")
        return (
            f"block_types={list(blocks)}, repeated",
            lambda i: LINEAR if blocks[i % len(blocks)] == "recurrent" else SLIDING,
        )
    if model_type in _FULL_FROM_LAST:
        last = last_layer(config, "layers' kinds count from its last layer, and its")
        return (
            "every fourth layer full, counted from the last",
            lambda i: FULL if (last - i) % 4 == 0 else SLIDING,
        )
    if model_type in _FLINT_RULE:
        return (
            "the first two layers, every fourth from the second and the last full",
            lambda i: FULL if i < 2 or i % 4 == 1 else SLIDING,
        )
    if model_type in _PATTERN:
        pattern = _PATTERN[model_type]
        return f"the pattern {', '.join(pattern)}", lambda i: pattern[i % len(pattern)]
    if config.get("sliding_window_pattern") is not None:
        raise ValueError(
            f"the config's sliding_window_pattern={config['sliding_window_pattern']!r} picks "
            f"the sliding layers by a rule mha does not know for model_type={model_type!r}: "
            "give its layer_types"
        )
    return _qwen_rule(config)


def _qwen_rule(config: Mapping[str, Any]):
    """The rules of Qwen2-MoE, Qwen3-MoE and SmolLM3, and max_window_layers' (Qwen2's, and
    of any other config that writes it); None where the config has none."""
    model_type = config.get("model_type")
    bound = config.get("max_window_layers")
    if model_type == "qwen3_moe" or config.get("sliding_window") is None or not uses_window(config):
        return None  # Qwen3-MoE: every layer, whatever max_window_layers says
    if model_type == "smollm3":
        return (
            "the layers without rotary embeddings sliding",
            lambda i: FULL if rotates(config, i) else SLIDING,
        )
    if bound is None:
        return None
    if isinstance(bound, bool) or not is_whole(bound) or bound < 0:
        raise ValueError(f"the config's max_window_layers={bound!r} is not a count of layers")
    if model_type == "qwen2_moe":
        return (
            f"every other layer below max_window_layers={bound} sliding",
            lambda i: SLIDING if (i + 1) % 2 and i < bound else FULL,
        )
    return (
        f"the layers from max_window_layers={bound} on sliding",
        lambda i: SLIDING if i >= bound else FULL,
    )


def _period(config: Mapping[str, Any], field: str, default: int) -> int:
    """The period of a rule, from its field where the model type reads one."""
    period = config.get(field, default) if field else default
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(
            f"the config's {field}={period!r} is not a count of layers: give its layer_types"
        )
    return period
