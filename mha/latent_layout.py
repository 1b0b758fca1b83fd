"""DeepSeek-V3's attention layout (V2's and Kimi K2's too): multi-head latent attention's
modules under a prefix, read as mha.MultiHeadLatentAttention's canonical weights and the sizes
they tell.

    q_proj, or q_a_proj, q_a_layernorm, q_b_proj     W_q, or W_qa, q_norm, W_qb (queries)
    kv_a_proj_with_mqa, kv_a_layernorm               W_kva, kv_norm (latent and rotary key)
    kv_b_proj                                        W_kvb (each head's key part and value)
    o_proj                                           W_o

The Linear weights are (out, in), read transposed; with attention_bias, q_a_proj,
kv_a_proj_with_mqa and o_proj have biases (b_qa, b_kva, b_o). `mha.porting` reads a prefix
in this layout when its names hold kv_a_proj_with_mqa, kv_b_proj and o_proj.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from mha import validation
from mha.interop.common import weight_array
from mha.model_shapes import refuse_latent
from mha.options import layer_defaults, untold
from mha.weights import weight_shapes

__all__ = ["MARK", "NAME", "indexer", "matches", "read", "refuse_sparse"]

NAME = "DeepSeek-V3 latent attention (q_a_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj)"

# Module -> the canonical names of its weight and bias (a norm's weight is its scale)
_MODULES = {
    "q_proj": ("W_q", None),
    "q_a_proj": ("W_qa", "b_qa"),
    "q_a_layernorm": ("q_norm", None),
    "q_b_proj": ("W_qb", None),
    "kv_a_proj_with_mqa": ("W_kva", "b_kva"),
    "kv_a_layernorm": ("kv_norm", None),
    "kv_b_proj": ("W_kvb", None),
    "o_proj": ("W_o", "b_o"),
}
_MARKS = ("kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight")
MARK = _MARKS[0]  # the name find_attention looks for
_NORMS = ("q_a_layernorm", "kv_a_layernorm")


def matches(names: Iterable[str]) -> bool:
    """Whether `names` hold the modules that mark the layout, and no indexer (sparse)."""
    names = set(names)
    return set(_MARKS) <= names and not indexer(names)


def indexer(names: Iterable[str]) -> list[str]:
    """The names of DeepSeek-V3.2's indexer, which picks the keys each query attends to
    (sparse attention), where `names` hold the latent modules and one; else []."""
    names = set(names)
    if not set(_MARKS) <= names:
        return []
    return sorted(name for name in names if name.startswith("indexer."))


def refuse_sparse(names: Iterable[str], where: str) -> None:
    """An error naming the indexer where `names` hold DeepSeek-V3.2's sparse attention."""
    found = indexer(names)
    if found:
        raise ValueError(
            f"the attention {where} is DeepSeek-V3.2's sparse attention: its indexer ("
            + ", ".join(found)
            + ") picks the keys each query attends to, where mha's layers attend to every key "
            "the masks leave"
        )


def read(
    names: Mapping[str, Any], num_heads: int | None, options: Mapping[str, Any], where: str
) -> tuple[dict[str, np.ndarray], dict[str, Any], list[str]]:
    """(canonical weights, MultiHeadLatentAttention's config, the names read) of the layout
    under a prefix; `options` are the layer's options the weights do not tell, rope_theta
    among them (the model's config gives them: mha.porting.options_from_config)."""
    refuse_latent(options, where)
    unknown = sorted(set(options) - set(untold("MultiHeadLatentAttention")))
    if unknown:
        raise TypeError(
            f"unknown option {', '.join(unknown)} for latent attention; the options: "
            + ", ".join(untold("MultiHeadLatentAttention"))
        )
    if num_heads is None or "rope_theta" not in options:
        raise ValueError(
            f"the latent attention {where} needs num_heads and its rotary embedding "
            "(rope_theta, rope_interleaved, rope_scaling), which its weights do not tell: "
            "give them, or the model's config (mha.porting.options_from_config)"
        )
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive integer. Received: num_heads={num_heads!r}")
    weights, used = _weights(names, where)
    config = {**layer_defaults("MultiHeadLatentAttention"), "num_heads": num_heads}
    config.update(_sizes(weights, num_heads, where), **options)
    validation.check_layer_args("MultiHeadLatentAttention", config)
    return weights, config, used


def _weights(names: Mapping[str, Any], where: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """The canonical arrays of the modules under the prefix; anything else there is an error."""
    weights, used = {}, []
    for module, (weight, bias) in _MODULES.items():
        for name, canonical in ((f"{module}.weight", weight), (f"{module}.bias", bias)):
            if name in names and canonical is not None:
                array = weight_array(name, names[name], where)
                transposed = array.ndim == 2  # a Linear's (out, in); a norm's scale is 1-D
                weights[canonical] = np.ascontiguousarray(array.T if transposed else array)
                used.append(name)
    rest = sorted(set(names) - set(used))
    if rest:
        raise ValueError(
            f"the latent attention {where} holds {', '.join(rest)}, which mha's "
            "MultiHeadLatentAttention does not hold: porting without them would give other "
            "numbers"
        )
    return weights, sorted(used)


def _sizes(weights: Mapping[str, np.ndarray], num_heads: int, where: str) -> dict[str, Any]:
    """The sizes and bias the weights tell, every problem listed."""
    if ("W_q" in weights) == ("W_qa" in weights) or ("W_qa" in weights) != ("W_qb" in weights):
        raise ValueError(
            f"the latent attention {where} must have q_proj, or q_a_proj, q_a_layernorm and "
            f"q_b_proj. Received: {', '.join(sorted(weights))}"
        )
    if "kv_norm" not in weights:
        raise ValueError(f"the latent attention {where} has no kv_a_layernorm.weight")
    rank = weights["kv_norm"].shape[0]
    queries = weights.get("W_q", weights.get("W_qb"))
    rope = weights["W_kva"].shape[1] - rank
    num_hiddens, qk_head = weights["W_o"].shape[1], queries.shape[1] // num_heads
    biases = sorted(name for name in ("b_qa", "b_kva", "b_o") if name in weights)
    config = {
        "num_hiddens": num_hiddens,
        "kv_lora_rank": rank,
        "q_lora_rank": weights["W_qa"].shape[1] if "W_qa" in weights else None,
        "qk_nope_head_dim": qk_head - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": weights["W_o"].shape[0] // num_heads,
        "bias": bool(biases),
        "dtype": validation.check_dtype(weights["W_o"].dtype.name),
    }
    expected = weight_shapes("MultiHeadLatentAttention", {**config, "num_heads": num_heads})
    problems = [f"{name} missing" for name in expected if name not in weights]
    problems += [
        f"{name} has shape {weights[name].shape}; the others tell {shape}"
        for name, shape in expected.items()
        if name in weights and weights[name].shape != shape
    ]
    if rope <= 0 or qk_head <= rope or queries.shape[1] % num_heads:
        problems.append(f"no sizes fit {num_heads} heads: {_shapes(weights)}")
    dtypes = {array.dtype.name for array in weights.values()}
    if len(dtypes) > 1:
        problems.append(f"the tensors have different dtypes: {', '.join(sorted(dtypes))}")
    if problems:
        raise ValueError(
            f"The latent attention weights {where} do not fit mha's MultiHeadLatentAttention:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )
    return config


def _shapes(weights: Mapping[str, np.ndarray]) -> str:
    return ", ".join(f"{name} {tuple(array.shape)}" for name, array in weights.items())
