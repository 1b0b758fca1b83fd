"""The error table: every bad input raises the same exception, with the same message, in every
backend. tests/test_errors.py runs every entry of ERRORS on every backend; the NumPy backend's
exception is the expected one, and tests/test_validation.py spells out its messages.

Each entry is data (an ErrorCase: the layer to build, the call to make or the weights to set),
grouped in tables by what goes wrong; `raised` makes one on a backend and returns what it
raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha.cache import KVCache
from mha.options import OPTIONS
from mha.registry import load_backend
from mha.weights import random_weights, set_weights

# (class name, args, kwargs) of a layer to build
Layer = tuple[str, tuple[Any, ...], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    """One bad input.

    layer: (class name, args, kwargs) of the layer to build, or None for masked_softmax.
    args, kwargs: the call's; numpy arrays among them become the backend's tensors (one tensor
        per array, so that an array passed three times is self-attention's one tensor). args
        None: building the layer must raise.
    first: arguments of a call made first, which must succeed (a lazy layer infers its sizes).
    weights: canonical weights given to mha.set_weights instead of a call.
    without_gradients: the call runs in the backend's `without_gradients()`, where it has one,
        as inference runs it.
    """

    layer: Layer | None
    args: tuple[Any, ...] | None = None
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    first: tuple[Any, ...] | None = None
    weights: Mapping[str, Any] | None = None
    without_gradients: bool = False


def raised(backend: str, case: ErrorCase) -> tuple[type[BaseException], str] | None:
    """The type and message of the exception `case` raises on `backend`; None if none."""
    module = load_backend(backend)
    tensors: dict[int, Any] = {}

    def tensor(value: Any) -> Any:
        if not isinstance(value, np.ndarray):
            return value
        if id(value) not in tensors:
            tensors[id(value)] = module.from_numpy(value)
        return tensors[id(value)]

    inference = contextlib.nullcontext()
    if case.without_gradients:
        inference = module.ADAPTER.without_gradients()
    try:
        args = None if case.args is None else [tensor(value) for value in case.args]
        kwargs = {key: tensor(value) for key, value in case.kwargs.items()}
        if case.layer is None:
            module.masked_softmax(*args, **kwargs)
            return None
        class_name, layer_args, layer_kwargs = case.layer
        layer = getattr(module, class_name)(*layer_args, **layer_kwargs)
        if case.first is not None:
            layer(*[tensor(value) for value in case.first])
        if case.weights is not None:
            set_weights(layer, dict(case.weights))
        if args is not None:
            with inference:
                layer(*args, **kwargs)
    except Exception as error:  # the type is compared too: any exception is an answer
        return type(error), str(error)
    return None


# The builders of the tables' entries


def build(class_name: str, *args: Any, **kwargs: Any) -> ErrorCase:
    """Building the layer must raise."""
    return ErrorCase((class_name, args, kwargs))


def call(layer: Layer | None, *args: Any, **kwargs: Any) -> ErrorCase:
    """Calling `layer` (masked_softmax when None) with args and kwargs must raise."""
    return ErrorCase(layer, args, kwargs)


def inference(*args: Any, **kwargs: Any) -> ErrorCase:
    """Self-attention without weights or gradients, inference's commonest call, must raise."""
    return ErrorCase(OWN, args, {"need_weights": False, **kwargs}, without_gradients=True)


def zeros(*shape: int, dtype: str = "float32") -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


f = zeros  # short, so that a table's entry reads on one line

# The inputs and layers the calls share: batch, queries, keys; queries, keys, values
B, Q, K = 2, 3, 5
QKV = (f(B, Q, 4), f(B, K, 4), f(B, K, 6))
MHA = ("MultiHeadAttention", (8, 2), {"query_size": 4, "key_size": 4, "value_size": 6})
DOT = ("DotProductAttention", (), {})
ADD = ("AdditiveAttention", (8,), {"query_size": 4, "key_size": 4})
# Self-attention: one array as queries, keys and values, in a sized layer
OWN = ("MultiHeadAttention", (4, 2), {"query_size": 4, "key_size": 4, "value_size": 4})
X = f(B, Q, 4)

# For each kind of value an option takes (mha.options.Option.check): values it refuses
BAD_VALUES = {
    "positive integer": (0, 2.5, np.int64(2), 2**50 + 1),
    "optional positive integer": (-1, True, np.int32(2), 2**63),
    "dropout": (1.0, -0.1),
    "boolean": (1, "yes"),
    "optional boolean": ("no",),
    "positive number": (0.0, "1e4"),
    "optional positive number": (-1.0, float("inf")),
    "scale": (float("inf"), "0.5", 0.0, -0.5),
    "empty_rows": ("nan", 0),
    "dtype": ("int32",),
    "qk_norm": ("rms", True),
    "query scaling": (
        0.1,
        {"beta": 0.1},
        {"beta": -0.1, "original_max_position_embeddings": 16},
        {"beta": 0.1, "original_max_position_embeddings": 16.5},
        {"beta": 0.1, "original_max_position_embeddings": 16, "factor": 2.0},
        {"beta": 0.1, "original_max_position_embeddings": 16, "position_offset": -1},
    ),
    "rope scaling": (
        "linear",
        {"rope_type": "ntk", "factor": 2.0},
        {"rope_type": "yarn", "factor": 2.0},
        {"rope_type": "linear", "factor": -2.0},
        {"rope_type": "proportional", "partial_rotary_factor": 1.5},
        {"rope_type": "linear", "factor": 0.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 16,
        },
    ),
}

# Arguments that build each layer, to which one bad option is added
GOOD_ARGUMENTS = {
    "DotProductAttention": {},
    "AdditiveAttention": {"num_hiddens": 8},
    "MultiHeadAttention": {"num_hiddens": 8, "num_heads": 2},
    "PositionalEncoding": {"num_hiddens": 4},
    "LearnedPositionalEncoding": {"num_hiddens": 4},
    "RotaryEmbedding": {"num_hiddens": 4},
    "AddNorm": {"num_hiddens": 4},
    "MultiHeadLatentAttention": {
        "num_hiddens": 8,
        "num_heads": 2,
        "kv_lora_rank": 4,
        "qk_nope_head_dim": 2,
        "qk_rope_head_dim": 2,
        "v_head_dim": 2,
    },
}


def option_rows() -> dict[str, ErrorCase]:
    """One row per option of mha.options, layer that takes it and value its kind refuses: an
    option added to the table is refused by every backend's constructor with no row written."""
    return {
        f"{option.name}={bad!r} ({layer})": build(
            layer, **{**GOOD_ARGUMENTS[layer], option.name: bad}
        )
        for option in OPTIONS
        for layer in option.layers
        for bad in BAD_VALUES[option.check]
    }


# Each option's refusals, and the rules between options (mha.layer_args)
CONSTRUCTORS = {
    **option_rows(),
    "not divisible": build("MultiHeadAttention", 100, 3),
    "num_kv_heads not a divisor": build("MultiHeadAttention", 12, 4, num_kv_heads=3),
    "rope odd head size": build("MultiHeadAttention", 6, 2, rope_theta=10000.0),
    "rotary odd size": build("RotaryEmbedding", 5),
    "rope_dim odd": build("MultiHeadAttention", 16, 2, rope_theta=1e4, rope_dim=3),
    "rope_dim over the head": build("MultiHeadAttention", 16, 2, rope_theta=1e4, rope_dim=10),
    "sinks and uniform empty rows": build(
        "MultiHeadAttention", 8, 2, sinks=True, empty_rows="uniform"
    ),
    "rope_scaling without rope_theta": build(
        "MultiHeadAttention", 8, 2, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "rope_interleaved without rope_theta": build("MultiHeadAttention", 8, 2, rope_interleaved=True),
    # A proportional scaling turns a fraction of the whole head: a part of its own as well
    # would turn a fraction of that part
    "rope_dim with a proportional scaling": build(
        "MultiHeadAttention",
        16,
        2,
        rope_theta=10.0,
        rope_dim=4,
        rope_scaling={"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5},
    ),
    "rotary_dim with a proportional scaling": build(
        "RotaryEmbedding", 8, rotary_dim=4, scaling={"rope_type": "proportional"}
    ),
    "rotary_dim over num_hiddens": build("RotaryEmbedding", 4, rotary_dim=6),
    "longrope factors per pair": build(
        "RotaryEmbedding",
        8,
        scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 3,
            "original_max_position_embeddings": 4,
        },
    ),
    "dynamic on one pair": build(
        "RotaryEmbedding",
        8,
        rotary_dim=2,
        scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4},
    ),
    "num_heads negative": build("MultiHeadAttention", 8, -2),
    # Windows and chunks count positions: whole numbers, whatever kind the table declares
    "sliding_window fractional": build("DotProductAttention", sliding_window=2.5),
    "attention_chunk_size fractional": build("MultiHeadAttention", 8, 2, attention_chunk_size=4.0),
    "latent rope odd": build(
        "MultiHeadLatentAttention",
        **{**GOOD_ARGUMENTS["MultiHeadLatentAttention"], "qk_rope_head_dim": 3},
    ),
    "latent without rope_theta": build(
        "MultiHeadLatentAttention", **GOOD_ARGUMENTS["MultiHeadLatentAttention"], rope_theta=None
    ),
    "latent longrope factors per pair": build(
        "MultiHeadLatentAttention",
        **GOOD_ARGUMENTS["MultiHeadLatentAttention"],
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 2,
            "long_factor": [2.0] * 2,
            "original_max_position_embeddings": 4,
        },
    ),
    "dropout positional": build("PositionalEncoding", 4, -0.1),
}

INPUTS = {
    "queries rank 2": call(MHA, f(Q, 4), *QKV[1:]),
    "keys rank 4": call(MHA, QKV[0], f(B, K, 4, 1), QKV[2]),
    "queries wrong dtype": call(MHA, f(B, Q, 4, dtype="float64"), *QKV[1:]),
    "values integer": call(DOT, *QKV[:2], f(B, K, 6, dtype="int64")),
    "batch sizes differ": call(MHA, QKV[0], f(3, K, 4), QKV[2]),
    "keys and values lengths differ": call(MHA, *QKV[:2], f(B, 4, 6)),
    "no keys": call(DOT, QKV[0], f(B, 0, 4), f(B, 0, 6)),
    "no queries": call(MHA, f(B, 0, 4), *QKV[1:]),
    "query_size mismatch": call(MHA, f(B, Q, 5), *QKV[1:]),
    "value_size mismatch": call(MHA, *QKV[:2], f(B, K, 7)),
    "key_size mismatch (additive)": call(ADD, QKV[0], f(B, K, 3), QKV[2]),
    "dot product sizes differ": call(DOT, QKV[0], f(B, K, 3), QKV[2]),
    "queries not a tensor": call(DOT, [[1.0]], *QKV[1:]),
    "size inferred at the first call": ErrorCase(
        ("MultiHeadAttention", (8, 2), {}), (f(B, Q, 5), *QKV[1:]), first=QKV
    ),
}

VALID_LENS = {
    "valid_lens wrong batch": call(MHA, *QKV, valid_lens=np.array([1, 2, 3])),
    "valid_lens rank 3": call(MHA, *QKV, valid_lens=np.ones((B, Q, 1), "int64")),
    "valid_lens bool": call(DOT, *QKV, valid_lens=np.array([True, False])),
    "valid_lens negative": call(MHA, *QKV, valid_lens=np.array([2, -1])),
    "valid_lens negative int32": call(DOT, *QKV, valid_lens=np.array([-3, 2], "int32")),
    "valid_lens negative float": call(ADD, *QKV, valid_lens=np.array([2.0, -3.0], "float32")),
    "valid_lens fractional": call(MHA, *QKV, valid_lens=np.array([2.0, 1.5])),
    "valid_lens 2-D wrong queries": call(DOT, *QKV, valid_lens=np.ones((B, Q + 1), "int32")),
}

MASKS = {
    "mask not bool": call(MHA, *QKV, mask=f(Q, K)),
    "mask integer": call(DOT, *QKV, mask=np.ones((Q, K), "int64")),
    "mask uint8": call(MHA, *QKV, mask=np.ones((B, Q, K), "uint8")),
    "mask wrong keys": call(MHA, *QKV, mask=np.ones((Q, K - 1), bool)),
    "mask wrong queries": call(DOT, *QKV, mask=np.ones((B, Q + 1, K), bool)),
    "mask 4-D wrong heads": call(MHA, *QKV, mask=np.ones((B, 3, Q, K), bool)),
    "mask 4-D wrong batch": call(MHA, *QKV, mask=np.ones((3, 2, Q, K), bool)),
    "mask 4-D on single head": call(DOT, *QKV, mask=np.ones((B, 1, Q, K), bool)),
    "mask 5-D": call(MHA, *QKV, mask=np.ones((1, B, 2, Q, K), bool)),
    "attn_bias bool": call(DOT, *QKV, attn_bias=np.ones((B, Q, K), bool)),
    "attn_bias wrong dtype": call(MHA, *QKV, attn_bias=f(B, Q, K, dtype="float64")),
    "attn_bias wrong keys": call(ADD, *QKV, attn_bias=f(B, Q, K + 1)),
    "attn_bias 4-D wrong heads": call(MHA, *QKV, attn_bias=f(1, 3, Q, K)),
    "attn_bias 4-D on single head": call(DOT, *QKV, attn_bias=f(1, 1, Q, K)),
    "causal not bool": call(DOT, *QKV, causal="yes"),
    "causal int": call(MHA, *QKV, causal=1),
    "alignment unknown": call(ADD, *QKV, causal=True, alignment="bottom"),
    "alignment a float": call(MHA, *QKV, causal=True, alignment=1.0),
    "alignment a bool": call(DOT, *QKV, causal=True, alignment=True),
    "alignment past 2**50": call(DOT, *QKV, causal=True, alignment=-(2**63)),
    "need_weights not bool": call(MHA, *QKV, need_weights=None),
    "window_mask rank 2": call(MHA, *QKV, window_mask=np.ones((Q, K), bool)),
    "window_mask not a batch divisor": call(MHA, *QKV, window_mask=np.ones((3, Q, K), bool)),
    "window_mask wrong keys": call(ADD, *QKV, window_mask=np.ones((1, Q, K + 1), bool)),
    "window_mask integer": call(MHA, *QKV, window_mask=np.ones((1, Q, K), "int32")),
    "window_mask float64": call(DOT, *QKV, window_mask=f(1, Q, K, dtype="float64")),
    "head_mask wrong size": call(MHA, *QKV, head_mask=f(3)),
    "head_mask wrong dtype": call(MHA, *QKV, head_mask=f(2, dtype="float64")),
    "head_mask integer": call(MHA, *QKV, head_mask=np.ones(2, "int64")),
    "head_mask 2-D wrong batch": call(MHA, *QKV, head_mask=f(3, 2)),
}

ENCODING = ("PositionalEncoding", (4,), {"max_len": 2})
LEARNED = ("LearnedPositionalEncoding", (4,), {"max_len": 2})
ADD_NORM = ("AddNorm", (4,), {})
ROTARY = ("RotaryEmbedding", (4,), {})
GQA = ("MultiHeadAttention", (8, 4), {"num_kv_heads": 2, "value_size": 6})

# masked_softmax, the positional encodings, AddNorm, rotary embeddings, grouped-query attention
OTHER_LAYERS = {
    "masked_softmax integer scores": call(None, np.ones((B, Q), "int64")),
    "masked_softmax rank 1": call(None, np.ones(3, "float32")),
    "masked_softmax not a tensor": call(None, "scores"),
    "masked_softmax no keys": call(None, f(B, Q, 0)),
    "masked_softmax wrong lengths": call(None, f(B, Q, K), np.array([1, 2, 3])),
    "masked_softmax 2-D lengths of rank 2": call(None, f(B, K), np.ones((B, Q), "int64")),
    # Its lengths' shape (B, B) would pass for (batch_size, no. of queries) of X read as 3-D
    "masked_softmax 2-D lengths of rank 2, square": call(None, f(B, K), np.ones((B, B), "int64")),
    "masked_softmax negative": call(None, f(B, Q, K), np.array([1, -1])),
    "masked_softmax fractional": call(None, f(B, Q, K), np.array([0.5, 1.0])),
    "sequence longer than max_len": call(ENCODING, f(B, Q, 4)),
    "encoding size mismatch": call(("PositionalEncoding", (5,), {}), f(B, Q, 4)),
    "learned encoding longer than max_len": call(LEARNED, f(B, Q, 4)),
    "add_norm shapes differ": call(ADD_NORM, f(B, Q, 4), f(B, 2, 4)),
    # Y of a lower rank, its axes the first of X's: X + Y would broadcast
    "add_norm ranks differ": call(ADD_NORM, f(4, 4, 4), f(4, 4)),
    "add_norm wrong dtype": call(ADD_NORM, f(B, Q, 4), f(B, Q, 4, dtype="float64")),
    "add_norm rank 1": call(ADD_NORM, f(4), f(4)),
    "rotary rank 1": call(ROTARY, f(4)),
    "rotary size mismatch": call(ROTARY, f(B, Q, 6)),
    "rotary wrong dtype": call(ROTARY, f(B, Q, 4, dtype="float64")),
    "rotary offset negative": call(ROTARY, f(B, Q, 4), offset=-1),
    "rotary offset float": call(ROTARY, f(B, Q, 4), offset=1.0),
    "rotary offset bool": call(ROTARY, f(B, Q, 4), offset=True),
    "gqa value_size mismatch": call(GQA, *QKV[:2], f(B, K, 5)),
}

# Multi-head latent attention: its input X, its latent cache
LATENT = ("MultiHeadLatentAttention", (), GOOD_ARGUMENTS["MultiHeadLatentAttention"])
XL = f(B, Q, 8)

LATENT_ATTENTION = {
    "latent X rank 2": call(LATENT, f(B, 8)),
    "latent X wrong size": call(LATENT, f(B, Q, 4)),
    "latent X wrong dtype": call(LATENT, f(B, Q, 8, dtype="float64")),
    "latent X not a tensor": call(LATENT, [[[1.0] * 8]]),
    "latent no positions": call(LATENT, f(B, 0, 8)),
    "latent valid_lens wrong batch": call(LATENT, XL, np.array([1, 2, 3])),
    "latent valid_lens negative": call(LATENT, XL, np.array([1, -1])),
    "latent valid_lens fractional": call(LATENT, XL, np.array([1.5, 2.0])),
    "latent mask wrong keys": call(LATENT, XL, mask=np.ones((Q, Q + 1), bool)),
    "latent mask 4-D wrong heads": call(LATENT, XL, mask=np.ones((B, 3, Q, Q), bool)),
    "latent attn_bias wrong dtype": call(LATENT, XL, attn_bias=f(B, Q, Q, dtype="float64")),
    "latent window_mask rank 2": call(LATENT, XL, window_mask=np.ones((Q, Q), bool)),
    "latent causal int": call(LATENT, XL, causal=1),
    "latent need_weights not bool": call(LATENT, XL, need_weights=None),
    "latent absorbed not bool": call(LATENT, XL, absorbed="yes"),
    "latent a KVCache": call(LATENT, XL, cache=KVCache()),
}

WEIGHTS = random_weights(
    "MultiHeadAttention", num_hiddens=8, num_heads=2, query_size=4, key_size=4, value_size=6
)
# Four problems: one missing, one unexpected, one transposed, one of the wrong shape
BAD_WEIGHTS = {**WEIGHTS, "W_q": WEIGHTS["W_q"].T, "W_o": WEIGHTS["W_o"][:, :3]}
BAD_WEIGHTS["W_x"] = BAD_WEIGHTS.pop("W_v")

LATENT_WEIGHTS = random_weights(LATENT[0], **LATENT[2])
# Three problems: one missing, one unexpected (W_qa without q_lora_rank), one transposed
BAD_LATENT_WEIGHTS = {**LATENT_WEIGHTS, "W_kvb": LATENT_WEIGHTS["W_kvb"].T}
BAD_LATENT_WEIGHTS["W_qa"] = BAD_LATENT_WEIGHTS.pop("kv_norm")

# mha.set_weights: every problem listed, with the layer's config (sizes inferred so far, None
# while lazy)
SET_WEIGHTS = {
    "set_weights problems": ErrorCase(MHA, weights=BAD_WEIGHTS),
    "set_weights problems (lazy)": ErrorCase(
        ("MultiHeadAttention", (8, 2), {"query_size": 4}), weights=BAD_WEIGHTS
    ),
    "set_weights problems (latent)": ErrorCase(LATENT, weights=BAD_LATENT_WEIGHTS),
}

# Self-attention without weights or gradients, inference's commonest call
INFERENCE = {
    "self wrong dtype (inference)": inference(*(f(B, Q, 4, dtype="float64"),) * 3),
    "self rank 2 (inference)": inference(*(f(B, 4),) * 3),
    "self no positions (inference)": inference(*(f(B, 0, 4),) * 3),
    "self query_size mismatch (inference)": inference(*(f(B, Q, 5),) * 3),
    "self valid_lens wrong batch (inference)": inference(X, X, X, np.array([1, 2, 3])),
    "self valid_lens 2-D wrong queries (inference)": inference(
        X, X, X, np.ones((B, Q + 1), "int64")
    ),
    "self valid_lens bool (inference)": inference(X, X, X, np.array([True, False])),
    "self valid_lens negative (inference)": inference(X, X, X, np.array([1, -2])),
    "self valid_lens negative int32 (inference)": inference(X, X, X, np.array([-3, 2], "int32")),
    "self valid_lens fractional (inference)": inference(X, X, X, np.array([1.5, 2.0], "float32")),
}

TABLES = (
    CONSTRUCTORS,
    INPUTS,
    VALID_LENS,
    MASKS,
    OTHER_LAYERS,
    LATENT_ATTENTION,
    SET_WEIGHTS,
    INFERENCE,
)

# id -> the bad input; tests/test_errors.py runs every one on every backend
ERRORS: dict[str, ErrorCase] = {name: case for table in TABLES for name, case in table.items()}
