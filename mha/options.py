"""Every constructor option of the layers, declared once.

An `Option` says what the option is called, its default, the kind of value it takes, its line
in the argument docs, which layers take it, whether it was added beyond the book's arguments,
and whether the weights tell it. From `OPTIONS` derive: the checks of
`mha.validation.check_layer_args`, the configs (every option is stored in files), defaults and
untold options of `mha.weights`, the "Args" sections of `mha.docstrings`, and so the options a
port or a conversion is given and the converters refuse by name where the target cannot hold
them (`mha.interop.common.check_expressible`, which reads what the weights tell off the
weights). The backends keep their explicit keyword signatures, which the book reads;
tests/test_option_spec.py holds them to this table.

Adding an option: one `Option` here, its keyword and its computation in each backend's layer,
and tests (docs/adding-a-backend.md, "Adding an option").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mha.registry import PUBLIC_NAMES

__all__ = [
    "LAYERS",
    "OPTIONS",
    "REQUIRED",
    "Option",
    "added_defaults",
    "layer_defaults",
    "layer_options",
    "untold",
]

# The layers that take options: the classes every backend exports, in the order the docs list them
LAYERS = tuple(name for name in PUBLIC_NAMES if name[0].isupper())

# The default of an option that must be given (num_hiddens, num_heads, ...)
REQUIRED = object()


# ---------------------------------------------------------------------------------------------
# The table


@dataclasses.dataclass(frozen=True)
class Option:
    """One constructor option of the layers.

    Attributes:
        name: the keyword, the same in every backend and in files.
        default: its default (REQUIRED when it must be given).
        check: the kind of value it takes, which mha.validation checks ("positive integer",
            "optional positive integer", "dropout", "boolean", "optional boolean", "positive
            number", "optional positive number", "scale", "empty_rows", "dtype", "rope
            scaling", "query scaling", "qk_norm": the keys of layer_args._VALUE_CHECKS).
        doc: its line in the argument docs, by layer ("*" for every layer that takes it).
        layers: the layers that take it.
        added: an option beyond the book's arguments: a file written before it existed, and
            another framework's layer, which has none, take its default.
        told: whether the layer's weights tell its value (sizes, bias, heads of keys and
            values); an untold one is given to a port or a conversion.
        defaults: the layers whose default differs from `default`, and theirs.
    """

    name: str
    default: Any
    check: str
    doc: Mapping[str, str]
    layers: tuple[str, ...]
    added: bool = False
    told: bool = True
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def default_for(self, layer: str) -> Any:
        """The option's default in `layer`."""
        return self.defaults.get(layer, self.default)


_MHA = ("MultiHeadAttention",)
_MLA = ("MultiHeadLatentAttention",)
_HEADS = (*_MHA, *_MLA)
_ATTENTION = ("DotProductAttention", "AdditiveAttention", *_HEADS)
_SIZED = tuple(layer for layer in LAYERS if layer != "DotProductAttention")
_DROPOUT = tuple(layer for layer in LAYERS if layer != "RotaryEmbedding")
_ENCODINGS = ("PositionalEncoding", "LearnedPositionalEncoding")

_INPUT_SIZE_DOC = "input size; None infers it at the first call."

# In the order configs and files list them: each layer's options are these, less the options
# it does not take. A doc is one line, keyed by layer ("*": every other layer).
OPTIONS: tuple[Option, ...] = (
    Option(
        "num_hiddens",
        REQUIRED,
        "positive integer",
        {
            "AdditiveAttention": "size of the hidden layer that queries and keys are projected to.",
            "MultiHeadAttention": "size of the projections and of the output.",
            "MultiHeadLatentAttention": "size of the input X and of the output (hidden_size).",
            "PositionalEncoding": "feature size of X (odd sizes work).",
            "LearnedPositionalEncoding": "feature size of X.",
            "RotaryEmbedding": "feature size d of X; must be even.",
            "AddNorm": "size of the last axis.",
        },
        _SIZED,
    ),
    Option(
        "num_heads",
        REQUIRED,
        "positive integer",
        {
            "*": "number of heads; must divide num_hiddens.",
            "MultiHeadLatentAttention": "number of heads (num_attention_heads).",
        },
        _HEADS,
    ),
    Option(
        "dropout",
        0.0,
        "dropout",
        {
            "*": "dropout rate on the attention weights (when training).",
            "PositionalEncoding": "dropout rate on X + P (when training).",
            "LearnedPositionalEncoding": "dropout rate on X + P (when training).",
            "AddNorm": "dropout rate on Y (when training).",
        },
        _DROPOUT,
    ),
    Option(
        "bias",
        False,
        "boolean",
        {
            "*": "whether the query, key and value projections have biases.",
            "MultiHeadLatentAttention": "whether W_qa, W_kva and W_o have biases "
            "(attention_bias); W_q, W_qb and W_kvb have none, as DeepSeek's.",
        },
        _HEADS,
    ),
    Option(
        "query_size",
        None,
        "optional positive integer",
        {"*": _INPUT_SIZE_DOC},
        ("AdditiveAttention", "MultiHeadAttention"),
    ),
    Option(
        "key_size",
        None,
        "optional positive integer",
        {"*": _INPUT_SIZE_DOC},
        ("AdditiveAttention", "MultiHeadAttention"),
    ),
    Option("value_size", None, "optional positive integer", {"*": _INPUT_SIZE_DOC}, _MHA),
    Option(
        "q_lora_rank",
        None,
        "optional positive integer",
        {
            "*": "None (default) projects the queries with one W_q; a rank r projects them "
            "through W_qa (num_hiddens, r), an RMSNorm and W_qb (r, heads' query size)."
        },
        _MLA,
    ),
    Option(
        "kv_lora_rank",
        REQUIRED,
        "positive integer",
        {"*": "size of each position's compressed latent, from which keys and values come."},
        _MLA,
    ),
    Option(
        "qk_nope_head_dim",
        REQUIRED,
        "positive integer",
        {"*": "size of the part of each head's query and key without rotary embeddings."},
        _MLA,
    ),
    Option(
        "qk_rope_head_dim",
        REQUIRED,
        "positive integer",
        {
            "*": "size of the rotary part of each head's query and key (even); one rotary key "
            "per position serves every head."
        },
        _MLA,
    ),
    Option(
        "v_head_dim",
        REQUIRED,
        "positive integer",
        {"*": "size of each head's value."},
        _MLA,
    ),
    Option(
        "norm_eps",
        1e-6,
        "positive number",
        {
            "*": "added to the mean square in the RMSNorms of the latent and the low-rank query "
            "(rms_norm_eps)."
        },
        _MLA,
        told=False,
    ),
    Option(
        "max_len",
        1000,
        "positive integer",
        {
            "PositionalEncoding": "the longest sequence the layer accepts.",
            "LearnedPositionalEncoding": "the longest sequence the layer accepts (the rows of P).",
        },
        _ENCODINGS,
    ),
    Option(
        "theta",
        10000.0,
        "positive number",
        {"*": "the base of the frequencies (10000.0, as Llama 2 and RoFormer)."},
        ("RotaryEmbedding",),
    ),
    Option(
        "interleaved",
        False,
        "boolean",
        {
            "*": "False (default) pairs feature i with feature i + d / 2 (Hugging Face's "
            "convention); True pairs features 2i and 2i + 1 (GPT-J, Meta's original Llama)."
        },
        ("RotaryEmbedding",),
    ),
    Option(
        "eps",
        1e-5,
        "positive number",
        {"*": "added to the variance; the same in every backend."},
        ("AddNorm",),
    ),
    Option(
        "dtype",
        "float32",
        "dtype",
        {
            "*": '"float32" (default), "float64", "float16", or "bfloat16" where the framework '
            "computes in it (torch, TensorFlow and JAX)."
        },
        LAYERS,
    ),
    Option(
        "out_bias",
        None,
        "optional boolean",
        {"*": "whether the output projection W_o has a bias; None follows `bias`."},
        _MHA,
        added=True,
    ),
    Option(
        "out_features",
        None,
        "optional positive integer",
        {"*": "the output size, W_o being (num_hiddens, out_features); None is num_hiddens."},
        _MHA,
        added=True,
    ),
    Option(
        "scale",
        None,
        "scale",
        {
            "*": "the factor of the scores; None is 1 / sqrt(d).",
            "MultiHeadAttention": "the factor of the scores; None is "
            "1 / sqrt(num_hiddens / num_heads).",
        },
        ("DotProductAttention", "MultiHeadAttention"),
        added=True,
    ),
    Option(
        "empty_rows",
        "zeros",
        "empty_rows",
        {
            "*": 'what a query with no key to attend gets: "zeros" (default; weights and '
            'attention output 0) or "uniform" (weights 1 / no. of keys over every key, as '
            "d2l, Keras's default path, JAX and Flax give)."
        },
        _ATTENTION,
        added=True,
        told=False,
    ),
    Option(
        "sliding_window",
        None,
        "optional positive integer",
        {
            "*": "None (default), or keep only the keys within sliding_window - 1 positions of "
            "the query, |i - j| < sliding_window (query i beside key i, as Keras's symmetric "
            "band); with causal=True, the last sliding_window keys up to the query, as "
            "Mistral's."
        },
        _ATTENTION,
        told=False,
        added=True,
    ),
    Option(
        "attention_chunk_size",
        None,
        "optional positive integer",
        {
            "*": "None (default), or keep only the keys in the query's chunk of positions, "
            "(offset + i) // attention_chunk_size == j // attention_chunk_size, chunks counted "
            "from the first position (from each segment's with segment_ids); with "
            "causal=True, the keys up to the query in its chunk, as Llama 4's rotary layers."
        },
        _MHA,
        told=False,
        added=True,
    ),
    Option(
        "num_kv_heads",
        None,
        "optional positive integer",
        {
            "*": "the number of key and value heads (grouped-query attention; 1 is multi-query "
            "attention); None is num_heads. Query head h attends with key-value head "
            "h // (num_heads / num_kv_heads), as Llama and Keras's GroupQueryAttention group "
            "them; W_k and W_v have num_kv_heads * num_hiddens / num_heads columns."
        },
        _MHA,
        added=True,
    ),
    Option(
        "rope_theta",
        None,
        "optional positive number",
        {
            "*": "the base of rotary position embeddings applied to each head's queries and keys "
            "(10000.0 in Llama 2, 500000.0 in Llama 3); None (default) applies none. Queries "
            "and keys take positions 0, 1, ... along their axis.",
            "MultiHeadLatentAttention": "the base of the rotary embeddings of the rotary parts "
            "(10000.0, the default, in DeepSeek-V3); the layer needs one.",
        },
        _HEADS,
        told=False,
        added=True,
        defaults={"MultiHeadLatentAttention": 10000.0},
    ),
    Option(
        "rope_interleaved",
        False,
        "boolean",
        {
            "*": "False (default) rotates feature i with feature i + head size / 2 (Hugging "
            "Face's convention); True rotates pairs (2i, 2i + 1) (GPT-J, Meta's original "
            "Llama), with rope_theta.",
            "MultiHeadLatentAttention": "True (default) rotates pairs (2i, 2i + 1) of the "
            "rotary parts (DeepSeek's rope_interleave); False rotates feature i with feature "
            "i + qk_rope_head_dim / 2.",
        },
        _HEADS,
        told=False,
        added=True,
        defaults={"MultiHeadLatentAttention": True},
    ),
    Option(
        "rope_dim",
        None,
        "optional positive integer",
        {
            "*": "None (default) rotates every feature of each head; an even number rotates "
            "that many first features of each head, in the pairing rope_interleaved says, and "
            "passes the others (partial rotary: GPT-NeoX, Phi, StableLM, GPT-J); not with a "
            "'proportional' rope_scaling, which turns its own fraction of the whole head."
        },
        _MHA,
        told=False,
        added=True,
    ),
    Option(
        "rope_scaling",
        None,
        "rope scaling",
        {
            "*": "None (default), or the rotary frequencies' scaling as Hugging Face's "
            "rope_parameters give it: a mapping of rope_type ('linear', 'dynamic', 'yarn', "
            "'llama3', 'longrope', 'proportional') and that type's numbers "
            "(mha.encoding.ROPE_TYPES).",
            "MultiHeadLatentAttention": "None (default), or the rotary frequencies' scaling "
            "as MultiHeadAttention's; a yarn scaling with mscale_all_dim also multiplies the "
            "scores' factor by its mscale squared, as DeepSeek-V3's.",
        },
        _HEADS,
        told=False,
        added=True,
    ),
    Option(
        "query_scaling",
        None,
        "query scaling",
        {
            "*": "None (default), or {'beta': b, 'original_max_position_embeddings': L}, and "
            "optionally 'position_offset': o (default 0): each query at position p (its "
            "rotary position, after the cached ones) multiplied by "
            "1 + b * log(1 + floor((p + o) / L)) after its rotary embedding, so that the "
            "scores sharpen past every L positions (Ministral 3's and Mistral 4's "
            "llama_4_scaling_beta; Llama 4's attn_temperature_tuning, o = 1; "
            "mha.encoding.query_scales).",
        },
        _HEADS,
        told=False,
        added=True,
    ),
    Option(
        "softcap",
        None,
        "optional positive number",
        {
            "*": "None (default), or squash the scaled scores into (-softcap, softcap) as "
            "softcap * tanh(scores / softcap), before the masks and attn_bias (Gemma 2's "
            "attn_logit_softcapping)."
        },
        ("DotProductAttention", "MultiHeadAttention"),
        told=False,
        added=True,
    ),
    Option(
        "sinks",
        False,
        "boolean",
        {
            "*": "whether each head has a sink: a learned logit (the weight sinks, one per "
            "head) that joins every row's softmax as a key with a zero value, so that a row's "
            "weights sum to less than 1 (gpt-oss)."
        },
        _MHA,
        added=True,
    ),
    Option(
        "qk_norm",
        None,
        "qk_norm",
        {
            "*": 'None (default), "head", "head_after_rotary", "projection" or '
            '"layer_norm_per_head": a norm of the queries and of the keys after their '
            "projections, before the rotary embedding, scaled by learned weights q_norm and "
            'k_norm: an RMSNorm over each head\'s features ("head", one scale of the head size '
            'shared by the heads: Qwen3; "head_after_rotary", the same after the rotary '
            'embedding: Hunyuan) or over the whole projection ("projection": OLMo 2), or a '
            "layer norm of each head's features with a scale of each head's own and no shift "
            '("layer_norm_per_head": StableLM).'
        },
        _MHA,
        told=False,
        added=True,
    ),
    Option(
        "qk_norm_eps",
        1e-6,
        "positive number",
        {"*": "added to the mean square in qk_norm (the models' rms_norm_eps)."},
        _MHA,
        told=False,
        added=True,
    ),
    Option(
        "value_norm",
        False,
        "boolean",
        {
            "*": "whether each head's values are normalized after their projection, scaled to "
            "a mean square of 1 with no weight, by qk_norm_eps (Gemma 4's v_norm)."
        },
        _MHA,
        told=False,
        added=True,
    ),
    Option(
        "output_gate",
        False,
        "boolean",
        {
            "*": "whether the heads' output is gated before W_o: each feature multiplied by "
            "sigmoid(queries @ W_g + b_g), a projection of the queries as wide as the heads' "
            "output (Qwen3-Next)."
        },
        _MHA,
        added=True,
    ),
    Option(
        "alibi",
        False,
        "boolean",
        {
            "*": "whether head h adds ALiBi's bias slope_h * (j - i) to the score of query i "
            "and key j, query i at position i after the cached keys, with the ALiBi paper's "
            "slopes (mha.encoding.alibi_slopes; BLOOM, MPT), after softcap as attn_bias."
        },
        _MHA,
        told=False,
        added=True,
    ),
    Option(
        "rotary_dim",
        None,
        "optional positive integer",
        {
            "*": "None (default) rotates every feature; an even number rotates that many "
            "first features and passes the others (partial rotary)."
        },
        ("RotaryEmbedding",),
        added=True,
    ),
    Option(
        "scaling",
        None,
        "rope scaling",
        {
            "*": "None (default), or the frequencies' scaling: a mapping of rope_type "
            "('linear', 'dynamic', 'yarn', 'llama3', 'longrope', 'proportional') and that "
            "type's numbers, named as in Hugging Face's rope_parameters "
            "(mha.encoding.ROPE_TYPES)."
        },
        ("RotaryEmbedding",),
        added=True,
    ),
)


def layer_options(layer: str) -> tuple[Option, ...]:
    """The options `layer` takes, in the order its config lists them."""
    return tuple(option for option in OPTIONS if layer in option.layers)


def layer_defaults(layer: str) -> dict[str, Any]:
    """The defaults of `layer`'s options that have one."""
    defaults = {o.name: o.default_for(layer) for o in layer_options(layer)}
    return {name: default for name, default in defaults.items() if default is not REQUIRED}


def added_defaults(layer: str) -> dict[str, Any]:
    """The defaults of `layer`'s options beyond the book's arguments, which a file written
    before they existed takes."""
    return {o.name: o.default_for(layer) for o in layer_options(layer) if o.added}


def untold(layer: str = "MultiHeadAttention") -> tuple[str, ...]:
    """The options of `layer` that its weights do not tell."""
    return tuple(option.name for option in layer_options(layer) if not option.told)
