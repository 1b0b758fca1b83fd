"""The heads a model's config gives a layer, and the check that its weights have them.

transformers builds a layer's projections from its config: num_attention_heads heads of
head_dim features (hidden_size / num_attention_heads where the model type's code reads no
head_dim), num_key_value_heads of them for the keys and values; weights of other shapes do
not load. A port takes the number of heads from the config and the rest from the weights, so
the config of another model (Llama-3-70B's beside 8B's weights: 64 heads) would split the
same rows into other heads without an error (Gemma-2-9B's beside 27B's: as many rows, heads of
twice the size, inputs of another size). `options_from_config` gives the head size, the number
of key-value heads and the input size of the layer (`head_shapes`: head_size, num_kv_heads,
query_size, the hidden size) for the model types mha has checked, and a port refuses weights
without them (`check_heads`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mha.config_fields import PLAIN
from mha.config_values import head_size, hidden_size, num_heads, positive_count
from mha.rotary_types import ROTARY

__all__ = ["SHAPE_OPTIONS", "check_heads", "head_shapes", "refuse_latent", "shapes_given"]

# The port options that say what heads the weights must have
SHAPE_OPTIONS = ("head_size", "num_kv_heads", "query_size")

# Model types whose code sizes each head hidden_size / num_attention_heads whatever a head_dim
# says (some read one for their rotary embedding alone): the PLAIN ones but T5 (its d_kv),
# ViT and those with grouped heads (Jamba's, Nemotron-H's), and a few rotary ones
_HEAD_FROM_HIDDEN = (PLAIN - {"jamba", "nemotron_h", "t5", "vit"}) | frozenset(
    (
        "esm falcon glm4v_text gpt_neox gptj modernbert modernbert-decoder qwen2_5_vl_text "
        "qwen2_vl_text roformer stablelm"
    ).split()
)
# Model types whose keys and values have a head for each query head whatever a
# num_key_value_heads says (Falcon's count them by num_kv_heads and multi_query)
_KV_HEAD_EACH = (PLAIN - {"jamba", "nemotron_h"}) | frozenset(
    (
        "esm gpt_neox gptj gte jina_embeddings_v3 modernbert modernbert-decoder nomic_bert roformer"
    ).split()
)

# Model types whose full-attention layers have heads of their own size and count (Gemma 4's
# and EmbeddingGemma 2's): the field that gates the count (None: always), the count's default
_GLOBAL_HEADS = {
    "gemma4_text": ("attention_k_eq_v", None),
    "embedding_gemma2_text": (None, 1),
}


def head_shapes(config: Mapping[str, Any], kind: str | None, layer: int | None) -> dict[str, int]:
    """head_size, num_kv_heads and query_size of the layer of a config read as transformers
    reads it (aliases, defaults, fields its code does not read left out), where the model type
    is one mha has checked and the config tells them; {} otherwise."""
    model_type = config.get("model_type")
    if model_type not in ROTARY.keys() | PLAIN or num_heads(config) is None:
        return {}
    head, kv_heads = head_size(config), config.get("num_key_value_heads")
    if model_type == "t5":  # inner_dim = num_heads * d_kv, whatever d_model is
        head = config.get("d_kv")
    elif model_type in _HEAD_FROM_HIDDEN:
        head = head_size({key: value for key, value in config.items() if key != "head_dim"})
    if model_type in _KV_HEAD_EACH:
        kv_heads = num_heads(config)
    if model_type == "falcon":
        kv_heads = _falcon_kv_heads(config)
    if model_type in _GLOBAL_HEADS and kind == "full_attention":
        head, kv_heads = _global_heads(config, layer, head, kv_heads)
    found = {"head_size": head, "num_kv_heads": kv_heads, "query_size": hidden_size(config)}
    return {key: positive_count(key, value) for key, value in found.items() if value is not None}


def _falcon_kv_heads(config: Mapping[str, Any]) -> int:
    """Falcon's key-value heads: num_kv_heads (its default: a head each) in its new decoder
    architecture or without multi_query, one with multi_query (Falcon-7B's)."""
    if config.get("new_decoder_architecture") or not config.get("multi_query", True):
        return config.get("num_kv_heads") or num_heads(config)
    return 1


def _global_heads(config: Mapping[str, Any], layer: int | None, head, kv_heads):
    """(head size, key-value heads) of Gemma 4's full-attention layer: its per_layer_config
    (as transformers writes a config: what it leaves out, or a layer it leaves out, the other
    layers'), or the global_head_dim (512 where not written) and num_global_key_value_heads the
    config's class builds it from."""
    per_layer = config.get("per_layer_config")
    if isinstance(per_layer, Mapping):  # a layer it leaves out has the others' heads
        # Its keys are the layers' indices, written padded with zeros ("05" beside "11")
        own = next((value for key, value in per_layer.items() if _index(key) == layer), {})
        own = own if isinstance(own, Mapping) else {}
        return own.get("head_dim", head), own.get("num_key_value_heads", kv_heads)
    gate, default = _GLOBAL_HEADS[config["model_type"]]
    count = config.get("num_global_key_value_heads", default)
    if gate is not None and not config.get(gate):
        count = None
    return config.get("global_head_dim", 512), kv_heads if count is None else count


def _index(key: Any) -> int | None:
    """A per_layer_config key's layer index ("05": 5); None for another key."""
    return int(key) if isinstance(key, (int, str)) and str(key).isdecimal() else None


def shapes_given(options: dict[str, Any]) -> dict[str, Any]:
    """The SHAPE_OPTIONS taken out of a port's options."""
    return {key: options.pop(key) for key in SHAPE_OPTIONS if key in options}


def check_heads(told: Mapping[str, Any], given: Mapping[str, Any], where: str) -> None:
    """Refuse weights whose heads (told: num_hiddens, num_heads, num_kv_heads, query_size) are
    not those given (SHAPE_OPTIONS: a config's, from options_from_config)."""
    if "kv_lora_rank" in told:  # a latent layer's file
        refuse_latent(given, where)
    given = {key: positive_count(key, value) for key, value in given.items()}
    heads = told["num_heads"]
    found = {
        "head_size": told["num_hiddens"] / heads,
        "num_kv_heads": told.get("num_kv_heads") or heads,
        "query_size": told.get("query_size") or told["num_hiddens"],
    }
    if all(found[key] == value for key, value in given.items()):
        return
    raise ValueError(
        f"the weights {where} do not have the config's heads: split into num_heads={heads}, "
        f"they hold heads of {found['head_size']:g} features, {found['num_kv_heads']} "
        f"key-value heads and inputs of {found['query_size']} features, where the config gives "
        + ", ".join(f"{key}={value}" for key, value in given.items())
        + " (is it another model's, or another part's?)"
    )


def refuse_latent(given: Mapping[str, Any], where: str) -> None:
    """Refuse a config's heads (SHAPE_OPTIONS) beside latent attention's weights."""
    if any(key in given for key in SHAPE_OPTIONS):
        raise ValueError(
            f"the weights {where} are latent attention's, whose heads no head_size, "
            "num_kv_heads or query_size tells: the config giving them is another model's"
        )
