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
    q_proj, k_proj, v_proj, dense                          Phi (1.5, 2)
        q, k, v, o (no biases, unscaled scores: scale=1)       T5
    one fused Linear, qkv.weight (3n, in) = [q; k; v], and proj    timm's Attention
    qkv_proj (q's rows, then k's and v's) and o_proj                 Phi-3
    query_key_value, each group of heads' q rows, then its k and v, and dense
                                                   GPT-NeoX, BLOOM, Falcon
    Wqkv (3n, in) = [q; k; v] and out_proj                            MPT
    GPT-2's Conv1D, stored (in, out): c_attn.weight (in, 3n) = [q, k, v], c_proj
    kernels per head (Keras and Flax): query/kernel (in, heads, head size), its bias
        (heads, head size), likewise key and value; attention_output/kernel (Keras) or
        out/kernel (Flax) (heads, head size, out)
    torch.nn.MultiheadAttention: in_proj_weight or q/k/v_proj_weight, out_proj
    q_proj or q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm,
        kv_b_proj; o_proj: multi-head latent attention, a MultiHeadLatentAttention
        (mha.latent_layout)                     DeepSeek-V2 and V3, Kimi K2

Names under the prefix that are outside the attention's numbers (BERT's LayerNorm after the
residual, ESM's of the input before it, T5's relative position bias table that the caller
gives as attn_bias, GPT-2's causal-mask buffers) are reported as left out. Any other tensor
there (Qwen3's q_norm, gpt-oss's sinks) is an error naming it: porting without it would give
other numbers. A prefix that matches no layout, or more than one, is an error that lists the
names found there and the prefixes where a layout is found.

The layouts themselves, and the reading of each one's matrices, are `mha.layouts`; the
options of a Hugging Face config, `mha.model_config`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from mha import latent_layout, validation
from mha.config import get_backend
from mha.interop.common import weight_array
from mha.layer_args import check_dtype
from mha.layouts import (
    LAYOUTS,
    Layout,
    find_attention,
    flatten,
    layout_names,
    matches,
    num_kv_heads,
    under,
    weights_and_config,
)
from mha.model_config import options_from_config
from mha.model_shapes import check_heads, shapes_given
from mha.options import untold
from mha.port_adjustments import (
    CENTERED,
    HALVES_SWAPPED,
    INV_FREQS,
    UNIT_QK_NORMS,
    centered_projections,
    halves_swapped,
    head_gate,
    split_gate,
    unit_qk_norms,
    use_inv_freq,
    use_local_chunks,
)
from mha.position_bias import alibi_bias, falcon_alibi_bias, t5_position_bias
from mha.refused_models import what_it_is
from mha.registry import load_backend
from mha.shared_layers import (
    KEYS_AS_VALUES,
    KEYS_VALUES_ELSEWHERE,
    VALUES_FROM_KEYS,
    keys_values_elsewhere,
    keys_values_note,
    values_are_keys,
    with_keys_values_of,
    with_values_from_keys,
)
from mha.stored import read_lazily
from mha.weights import (
    LAYER_CLASSES,
    OPTION_DEFAULTS,
    build_layer,
    check_untold_options,
    in_dtype,
    set_weights,
)

__all__ = [
    "LAYOUTS",
    "Port",
    "alibi_bias",
    "canonical_from_state_dict",
    "falcon_alibi_bias",
    "find_attention",
    "from_state_dict",
    "options_from_config",
    "t5_position_bias",
]


class Port(NamedTuple):
    """What was imported: canonical weights and config, the layout, the names of the source
    under the prefix that were used and that were left out, and notes on what the port
    added that the source does not hold, each exact (a zero bias)."""

    weights: dict[str, np.ndarray]
    config: dict[str, Any]
    layout: str
    used: list[str]
    left_out: list[str]
    notes: tuple[str, ...] = ()
    layer: str = "MultiHeadAttention"  # or "MultiHeadLatentAttention"


def canonical_from_state_dict(
    state: Mapping[str, Any] | str | os.PathLike,
    prefix: str = "",
    *,
    num_heads: int | None = None,
    scale: float | None = None,
    qk_norm_offset: float = 0.0,
    output_gate: bool = False,
    without_positions: bool = False,
    values_from_keys: bool = False,
    weightless_qk_norm: bool = False,
    reversed_rotary: bool = False,
    centered_qk_norm: bool = False,
    keys_values_of: int | str | None = None,
    dtype: str | None = None,
    **options: Any,
) -> Port:
    """Canonical MultiHeadAttention weights and config of the attention layer under `prefix`
    (MultiHeadLatentAttention's for DeepSeek-V3's layout: `Port.layer`; mha.latent_layout).

    Args:
        state: a state_dict (name -> tensor or array), Flax's params, or `read_lazily`'s path.
        prefix: the attention module's path, e.g. "encoder.layer.0.attention"; "" for all.
        num_heads: the number of heads; needed except for kernels per head, which tell it.
        scale: the score scale, where the model's is not its layout's (GPT-2's by layer).
        qk_norm_offset: what the source's QK-norms add to their weights before scaling
            (Gemma's scale by 1 + weight: 1.0); the canonical q_norm and k_norm hold the sum.
        output_gate: the heads' output is gated: q_proj's (q_gate_proj's) rows split into W_q
            and W_g (Qwen3-Next, MiniCPM5), or LFM3's g_proj or AFMoE's gate_proj, if there.
        without_positions: no rotary embedding or ALiBi in a layout whose models all add
            them (GPT-NeoX, BLOOM, MPT, Phi-3): none, or attn_bias=alibi_bias(...) at calls.
        values_from_keys: the layer has no v_proj, its values being the key projection's
            output before any norm (Gemma 4's full layers, attention_k_eq_v): W_v is W_k.
        weightless_qk_norm: qk_norm="head"/"head_after_rotary" norms with no weight (Llama
            4's and nanochat's): scales of ones.
        reversed_rotary: the source turns each head's pairs (i, i + d/2) by minus their angle
            (nanochat's rotate_half): each head's query and key halves are swapped.
        centered_qk_norm: the QK-norms are layer norms of the projection (ESM C): W_q and W_k
            centered over their outputs, whose qk_norm="projection" gives the same numbers.
        keys_values_of: the layer reuses the keys and values of another (Gemma 3n's and 4's
            last num_kv_shared_layers): k_proj, v_proj and k_norm that layer's (its index in
            the prefix's one number, or its prefix); call with its input as keys and values.
        dtype: the weights' dtype in the port (default: the source's); qk_norm_offset is
            added in it (1 + a bfloat16 weight, exact in float32, not rounded to bfloat16).
        **options: the layer's options that weights do not tell: rope_theta, sliding_window,
            ... (`options_from_config` reads them from a Hugging Face config); head_size,
            num_kv_heads, query_size: what the weights must have (mha.model_shapes).

    Raises:
        ValueError: no layout or several under the prefix, weights that do not fit or have
            other heads, tensors mha cannot hold (each listed), sparse attention, positions.
    """
    port = {name: value for name, value in locals().items() if name in _MHA_PORT_OPTIONS}
    dtype = None if dtype is None else check_dtype(dtype)
    return _in_dtype(_port(state, prefix, num_heads, options, port, dtype), dtype)


def _port(state, prefix: str, num_heads, options, port: dict[str, Any], dtype) -> Port:
    """canonical_from_state_dict's Port, its weights in the source's dtype (QK-norms' sums in
    `dtype` where given)."""
    state = flatten(state if isinstance(state, Mapping) else read_lazily(state))
    where = f"under {prefix!r}" if prefix.strip("./") else "in the state"
    names, taken = with_keys_values_of(
        under(state, prefix), lambda other: under(state, other), port["keys_values_of"],
        prefix, where,
    )  # fmt: skip
    names, copied = with_values_from_keys(names, port["values_from_keys"], where)
    latent_layout.refuse_sparse(names, where)
    if latent_layout.matches(names):
        return _latent_port(names, num_heads, options, where, port)
    port = {**port, "dtype": dtype}  # of the sums of qk_norm_offset
    return _mha_port(state, names, (*taken, *copied), prefix, num_heads, options, where, port)


def _in_dtype(port: Port, dtype: str | None) -> Port:
    """The port with its weights and config in `dtype` (None: as they are, of one dtype)."""
    if dtype is None:
        dtypes = {name: w.dtype.name for name, w in port.weights.items()}
        if len(set(dtypes.values())) > 1:  # gpt-oss's float32 sinks beside bfloat16, say
            listed = ", ".join(f"{name} {kind}" for name, kind in dtypes.items())
            raise ValueError(
                f"the layer's weights are of several dtypes ({listed}): give dtype= to "
                "hold them in one (mha convert: --dtype)"
            )
        return port
    weights = {name: in_dtype(name, w, dtype) for name, w in port.weights.items()}
    return port._replace(weights=weights, config={**port.config, "dtype": dtype})


def _mha_port(state, names, copied, prefix: str, num_heads, options, where: str, port) -> Port:
    """The Port of MultiHeadAttention's layouts: the weights read and rewritten as the port
    options say (port), the config checked; copied: the names values_from_keys copied."""
    shapes = shapes_given(options)  # the config's heads, which the weights must have
    use_local_chunks(options, prefix)  # CANINE's initial character encoder's
    layout = _only_layout(state, names, prefix, where)  # a wrong prefix named before options
    _refuse_latent_options(options, layout, where)
    check_untold_options(options)
    weights, config, used, left_out, notes = _read_port(
        layout, names, num_heads, where, options.get("qk_norm"), port
    )
    check_heads(config, shapes, where)
    config = _checked_config(layout, config, options, port["scale"])
    _check_positions(layout, config, port["without_positions"], where)
    use_inv_freq(names, config, where, used, left_out)
    if port["reversed_rotary"]:  # nanochat: its halves swapped turn mha's way to the same scores
        weights = halves_swapped(weights, config, where)
        notes += (HALVES_SWAPPED,)
    if port["centered_qk_norm"]:  # ESM C: a layer norm is the RMSNorm of the centered values
        weights = centered_projections(weights, config, where)
        notes += (CENTERED,)
    used = sorted(set(used) - set(copied))  # the names under the prefix alone
    if port["keys_values_of"] is not None:  # Gemma 3n's and 4's KV-shared layers
        notes += (keys_values_note(prefix, port["keys_values_of"]),)
    notes += (VALUES_FROM_KEYS,) if port["values_from_keys"] else ()
    return Port(weights, config, layout.name, used, left_out, notes)


def _refuse_latent_options(options: Mapping[str, Any], layout: Layout, where: str) -> None:
    """Options of latent attention alone (a DeepSeek-V3 config's) beside other weights."""
    latent = (set(options) - set(untold())) & set(untold("MultiHeadLatentAttention"))
    if latent:
        raise ValueError(
            f"{', '.join(sorted(latent))} {'is' if len(latent) == 1 else 'are'} of multi-head "
            f"latent attention (a config of DeepSeek-V2's or V3's), but the weights {where} "
            f"are of the {layout.name} layout"
        )


def _read_port(layout: Layout, names, num_heads, where: str, qk_norm, port: dict[str, Any]):
    """The weights and the config the weights tell of a layer of `layout`, the names used and
    left out, and the notes on what the port added; port: the port options."""
    output_gate, weightless = port["output_gate"], port["weightless_qk_norm"]
    qk_norm_offset = port["qk_norm_offset"]
    if layout.gated and not output_gate:  # MiniCPM5's q_gate_proj
        raise ValueError(
            f"the {layout.name} weights {where} hold each head's queries and the gate of its "
            "output in one projection: give output_gate=True (mha convert: --config with the "
            "model's config.json)"
        )
    used = layout_names(layout, names)
    # Norms without weights read none: a q_norm.weight there is refused by name
    extra = _beside_projections(layout, names, None if weightless else qk_norm, output_gate, where)
    beside = [name for held in extra.values() for name in _names_of(held)]
    left_out = _left_out(layout, set(names) - set(used) - set(beside), where)
    split = output_gate and "W_g" not in extra  # Qwen3-Next's gate rows in q_proj
    weights, config = _read_layer(layout, names, used, num_heads, split, where)
    weights.update(_beside_weights(names, extra, qk_norm_offset, where, port["dtype"]))
    config["sinks"], config["output_gate"] = "sinks" in extra, "W_g" in weights
    config["num_heads"] = _heads(layout, config.get("num_heads"), num_heads, where)
    if "W_g" in extra:  # LFM3's gate of each head, or AFMoE's of each feature
        weights["W_g"] = head_gate(weights["W_g"], config, where, extra["W_g"])
        if config["bias"]:  # the projections' biases, none of the gate's: a zero one (exact)
            weights["b_g"] = np.zeros(weights["W_g"].shape[1], weights["W_g"].dtype)
            gate = extra["W_g"].removesuffix(".weight")
            config["zero_biases"] = [*config.get("zero_biases", ()), gate]
    kv_hiddens = config.pop("kv_hiddens", config["num_hiddens"])
    notes = _notes(config.pop("zero_biases", ()), qk_norm_offset if "q_norm" in extra else 0)
    if kv_hiddens != config["num_hiddens"]:
        config["num_kv_heads"] = num_kv_heads(layout, config, kv_hiddens)
    if weightless:  # Llama 4's norms: scales of 1
        weights.update(unit_qk_norms(qk_norm, weights["W_q"], config["num_heads"]))
        notes += (UNIT_QK_NORMS,)
    return weights, config, used + beside, left_out, notes


def _checked_config(layout: Layout, told, options, scale: float | None) -> dict[str, Any]:
    """MultiHeadAttention's whole config: what the weights told, the options given, the
    defaults of the rest; checked."""
    config = {**OPTION_DEFAULTS, "dropout": 0.0, **told, **options}
    config["scale"] = layout.scale if scale is None else scale
    config = {key: config[key] for key in LAYER_CLASSES["MultiHeadAttention"]}
    validation.check_layer_args("MultiHeadAttention", config)
    return config


# The port options of MultiHeadAttention's layouts, and their defaults
_MHA_PORT_OPTIONS = {
    "scale": None,
    "qk_norm_offset": 0.0,
    "output_gate": False,
    "without_positions": False,
    "values_from_keys": False,
    "weightless_qk_norm": False,
    "reversed_rotary": False,
    "centered_qk_norm": False,
    "keys_values_of": None,
}


def _latent_port(names, num_heads, options, where: str, port: dict[str, Any]) -> Port:
    """The Port of DeepSeek-V3's latent attention, which takes none of the port options of
    MultiHeadAttention's layouts."""
    changed = sorted(key for key, value in port.items() if value != _MHA_PORT_OPTIONS[key])
    if changed:
        raise ValueError(
            f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} MultiHeadAttention's; "
            f"the attention {where} is multi-head latent attention ({latent_layout.NAME})"
        )
    weights, config, used = latent_layout.read(names, num_heads, options, where)
    return Port(weights, config, latent_layout.NAME, used, [], (), "MultiHeadLatentAttention")


def _check_positions(layout: Layout, config: Mapping[str, Any], without: bool, where: str):
    """The positions a layout's models all add inside the attention (rotary embeddings,
    ALiBi) are given, or said to be absent: the weights do not tell them."""
    given = [key for key in ("rope_theta", "alibi") if config[key]]
    if without and given:
        raise ValueError(
            f"without_positions=True and {given[0]}={config[given[0]]!r} contradict each other"
        )
    if layout.positions and not given and not without:
        raise ValueError(
            f"the layer {where} is {layout.name}, whose models add {layout.positions} "
            "inside the attention, which the weights do not hold: give the model's config "
            "(options_from_config, mha convert --config), or rope_theta= or alibi=True; "
            "without_positions=True (--without-positions) where the layer adds none or its "
            "biases come at each call as attn_bias"
        )


_ZERO_BIAS = "its bias is zero, which gives the same numbers"


def _notes(zero_biases, qk_norm_offset: float) -> tuple[str, ...]:
    """What the port added that the source does not hold, each exact."""
    notes = tuple(f"{path} has no bias: {_ZERO_BIAS}" for path in zero_biases)
    if qk_norm_offset:
        notes += (f"q_norm and k_norm hold {qk_norm_offset:g} + the source's norm weights",)
    return notes


def _read_layer(layout: Layout, names, used, num_heads, output_gate: bool, where: str):
    """The layout's canonical weights and config; with output_gate, the query projection's
    rows split into the queries (W_q) and the gate (W_g)."""
    arrays, gate = _read_arrays(names, used, where), {}
    if output_gate:
        arrays, gate = split_gate(layout, arrays, num_heads, where)
    weights, config = weights_and_config(layout, arrays, num_heads)
    return {**weights, **gate}, config


def _names_of(held: str | tuple[str, ...]) -> tuple[str, ...]:
    return held if isinstance(held, tuple) else (held,)


def _beside_weights(names, extra: dict, offset: float, where: str, dtype: str | None):
    """Canonical name -> array of the weights beside the projections, QK-norm's scales plus
    `offset` (Gemma's norms scale by 1 + weight, summed in `dtype`, or else the weights',
    as Gemma sums them in float32)."""
    read = _read_arrays(names, [name for held in extra.values() for name in _names_of(held)], where)
    # A tuple of names is one row of the weight each (StableLM's norm of each head)
    weights = {
        canonical: np.stack([read[name] for name in held])
        if isinstance(held, tuple)
        else read[held]
        for canonical, held in extra.items()
    }
    for name in ("q_norm", "k_norm"):
        if offset and name in weights:
            norm = weights[name] if dtype is None else in_dtype(name, weights[name], dtype)
            weights[name] = norm + norm.dtype.type(offset)
    return weights


def _only_layout(state, names: Mapping[str, Any], prefix: str, where: str) -> Layout:
    """The one layout the names under the prefix match; else an error listing what is there."""
    layouts = [layout for layout in LAYOUTS if matches(layout, names)]
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
    if values_are_keys(names):
        hint += "; its q_proj, k_proj and o_proj without v_proj are " + KEYS_AS_VALUES
    if keys_values_elsewhere(names):
        hint += "; it holds " + KEYS_VALUES_ELSEWHERE
    raise ValueError(
        f"{which} {where}. Found: {listed or 'nothing'}{hint}. "
        "Known layouts: " + "; ".join(layout.name for layout in LAYOUTS)
    )


def _left_out(layout: Layout, rest: set[str], where: str) -> list[str]:
    """The names outside the layout that are outside the attention's numbers too; any other
    is an error naming it, since porting without it would give other numbers."""
    refused = sorted(
        name for name in rest if not _is_outside(layout, name) and name not in INV_FREQS
    )
    if refused:
        raise ValueError(
            f"the attention {where} holds what mha's MultiHeadAttention cannot represent: "
            + ", ".join(f"{name} ({what_it_is(name)})" for name in refused)
            + "; porting without them would give other numbers"
        )
    return sorted(rest)


def _is_outside(layout: Layout, name: str) -> bool:
    return _outside_reason(layout, name) is not None


def _outside_reason(layout: Layout, name: str) -> str | None:
    """Why the layout's models keep `name` outside the attention's numbers; None: they do not."""
    return next(
        (
            why
            for known, why in layout.outside.items()
            if name == known or (known.endswith(".") and name.startswith(known))
        ),
        None,
    )


def described_left_out(layout_name: str, left_out: list[str]) -> str:
    """The names a port left out, each group with why ("a, b (why); c (why)")."""
    layout = next((layout for layout in LAYOUTS if layout.name == layout_name), None)
    groups: dict[str | None, list[str]] = {}
    for name in left_out:
        groups.setdefault(layout and _outside_reason(layout, name), []).append(name)
    return "; ".join(
        ", ".join(names) + (f" ({why})" if why else "") for why, names in groups.items()
    )


def _beside_projections(layout, names, qk_norm: str | None, gate: bool, where: str):
    """Canonical name -> the name under the prefix of each weight beside the projections (a
    tuple of names: one row each): QK-norm's scales where qk_norm says, gpt-oss's sinks where
    they are, LFM3's gate projection g_proj (one row per head) or AFMoE's gate_proj (a row per
    feature) where output_gate says."""
    extra = _qk_norm_names(layout, names, qk_norm, where)
    if "sinks" in names:
        extra["sinks"] = "sinks"
    for gate_name in ("g_proj.weight", "gate_proj.weight"):
        if gate and gate_name in names:
            extra["W_g"] = gate_name
    return extra


# The scales of QK-norm's RMSNorms, beside the q/k/v/o_proj layout's projections; Hunyuan's
# and LFM2's under names of their own
_QK_NORMS = {"q_norm": "q_norm.weight", "k_norm": "k_norm.weight"}
_QK_NORMS_NAMED = (
    {"q_norm": "query_layernorm.weight", "k_norm": "key_layernorm.weight"},
    {"q_norm": "q_layernorm.weight", "k_norm": "k_layernorm.weight"},
)


def _qk_norm_names(
    layout: Layout, names: Mapping[str, Any], qk_norm: str | None, where: str
) -> dict[str, Any]:
    """Canonical name -> the name under the prefix of each QK-norm scale, where `qk_norm` says
    the layer has them ({} where it does not: any norm there is then refused by name)."""
    if qk_norm is None:
        return {}
    if qk_norm == "layer_norm_per_head":
        return {k: _per_head_norms(layout, names, k, where) for k in ("q_norm", "k_norm")}
    held = next((each for each in _QK_NORMS_NAMED if each["q_norm"] in names), _QK_NORMS)
    missing = [name for name in held.values() if name not in names]
    if layout.paths.get("q") != "q_proj" or missing:
        raise ValueError(
            f"qk_norm={qk_norm!r} reads q_norm.weight and k_norm.weight beside q_proj ... "
            f"o_proj; the {layout.name} weights {where} have "
            + (f"no {', '.join(missing)}" if missing else "another layout")
        )
    return dict(held)


# StableLM's layer norms of each head: q_layernorm.norms.0.weight, ... (likewise k_layernorm)
_PER_HEAD_NORMS = {"q_norm": "q_layernorm.norms", "k_norm": "k_layernorm.norms"}


def _per_head_norms(layout: Layout, names, canonical: str, where: str) -> tuple[str, ...] | str:
    """The names of the scales of the norms of each head, in the heads' order; or Cohere's one
    q_norm.weight (k_norm.weight) of a row per head."""
    if f"{canonical}.weight" in names and layout.paths.get("q") == "q_proj":
        return f"{canonical}.weight"
    module = _PER_HEAD_NORMS[canonical]
    count = sum(1 for name in names if name.startswith(module + ".") and name.endswith(".weight"))
    held = tuple(f"{module}.{head}.weight" for head in range(count))
    if not count or any(name not in names for name in held) or layout.paths.get("q") != "q_proj":
        raise ValueError(
            f"qk_norm='layer_norm_per_head' reads {module}.0.weight, {module}.1.weight, ... "
            f"beside q_proj ... o_proj; the {layout.name} weights {where} have "
            + ("another layout" if layout.paths.get("q") != "q_proj" else f"no {module}.0 ...")
        )
    return held


def _read_arrays(names: Mapping[str, Any], used: list[str], where: str) -> dict[str, np.ndarray]:
    """The layout's tensors as numpy arrays of a float dtype mha reads."""
    return {name: weight_array(name, names[name], where) for name in used}


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


def from_state_dict(
    state: Mapping[str, Any] | str | os.PathLike,
    prefix: str = "",
    *,
    num_heads: int | None = None,
    scale: float | None = None,
    backend: str | None = None,
    dtype: str | None = None,
    qk_norm_offset: float = 0.0,
    output_gate: bool = False,
    without_positions: bool = False,
    values_from_keys: bool = False,
    **options: Any,
) -> Any:
    """An mha MultiHeadAttention (or MultiHeadLatentAttention) in `backend` (default: the
    current one) holding the attention layer under `prefix`, in `dtype` (default: the
    weights'; bfloat16 weights widen to float32 exactly, for the backends without bfloat16);
    see `canonical_from_state_dict` for the other arguments."""
    port = canonical_from_state_dict(
        state,
        prefix,
        num_heads=num_heads,
        scale=scale,
        qk_norm_offset=qk_norm_offset,
        output_gate=output_gate,
        without_positions=without_positions,
        values_from_keys=values_from_keys,
        dtype=dtype,
        **options,
    )
    module = load_backend(backend if backend is not None else get_backend())
    layer = build_layer(module, port.layer, port.config)
    set_weights(layer, port.weights)
    return layer
