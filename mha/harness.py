"""Cross-backend comparison: one weight set, the same inputs, every backend.

This module owns the question "do the backends compute the same numbers?", so that the tests,
`mha compare` and the notebooks all ask it the same way. The reference is always the NumPy
backend run in float64; every backend (NumPy itself included) runs in the dtype asked for and
is compared with it. The cases `mha compare` runs are data here (default_cases); the test
suite's own tables, its fuller agreement matrix and its table of bad inputs, live with the
tests (tests/agreement_cases.py, tests/error_cases.py), so that importing the harness builds
no test data.

    >>> from mha import harness
    >>> rows = harness.compare(backends=["numpy"], dtype="float32")
    >>> all(row.passed for row in rows)
    True
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mha import weights as weights_module
from mha.registry import load_backend, normalize_backend_name
from mha.weights import random_weights, set_weights

__all__ = [
    "GRADIENT_TOLERANCES",
    "TOLERANCES",
    "Case",
    "Prepared",
    "Result",
    "Row",
    "Shapes",
    "check",
    "compare",
    "default_cases",
    "difference",
    "fit",
    "make_inputs",
    "prepare",
    "run_case",
]

# The agreement every backend must reach against the float64 reference (docs/design.md,
# "Agreement"): float64 in absolute terms, float32 and float16 relative to the scale of the
# reference (its largest absolute entry, at least 1).
TOLERANCES: dict[str, float] = {"float64": 1e-10, "float32": 1e-5, "float16": 2e-3}

# Gradients against float64 central differences on the reference, relative to the scale of
# the gradient: the differences themselves are accurate to about 1e-9 with a step of 1e-6.
GRADIENT_TOLERANCES: dict[str, float] = {"float64": 1e-7, "float32": 1e-5, "float16": 1e-2}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Input sizes for a comparison run (keys smaller than queries, so that additive attention
    and the projections see three different input sizes)."""

    batch_size: int = 4
    num_queries: int = 5
    num_keys: int = 7
    query_size: int = 6
    key_size: int = 5
    value_size: int = 3
    num_hiddens: int = 8
    num_heads: int = 2


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer (or masked_softmax) with one combination of masks and input variants.

    masks: names from MASKS. The masks: "valid_lens_1d", "valid_lens_2d" (lengths of 0, 1,
    the number of keys and more), "mask_1d" (keys), "mask_2d" (queries x keys), "mask_keys"
    (batch x 1 x keys, key padding), "mask_3d", "mask_4d", "mask_4d_heads" (1 x heads x 1 x
    keys), "mask_4d_batch" (batch x 1 x queries x keys), "causal", "window_mask" (additive:
    finite biases and -inf), "window_bool", "head_mask" (heads,), "head_mask_2d" (batch x
    heads), "head_mask_bool" (batch x heads, boolean), "attn_bias" (batch x queries x keys,
    finite and -inf, a row all -inf), "attn_bias_4d" (1 x heads x queries x keys, finite, as
    T5's), "no_weights" (need_weights=False).
    Every boolean mask but mask_1d and mask_4d_heads, and every window, leaves one row with no
    key. The variants: "square" for as many keys as queries, "tall" for fewer keys than
    queries, "self" for self-attention (one tensor passed as queries, keys and values, the
    same object, so that fast paths for self-attention are exercised), "lens_float" and
    "lens_int32" for valid_lens of those dtypes (int64 otherwise), "rank_2" and "rank_4" for
    the scores of masked_softmax and the inputs of AddNorm (rank 3 otherwise), and "offset"
    for RotaryEmbedding's positions starting at 3 (its X is (batch, heads, Q, num_hiddens)).
    config: constructor arguments that override the ones made from the Shapes.
    """

    layer: str
    masks: tuple[str, ...] = ()
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def id(self) -> str:
        options = ",".join(f"{key}={value}" for key, value in sorted(self.config.items()))
        layer = f"{self.layer}({options})" if options else self.layer
        return f"{layer}[{'+'.join(self.masks) or 'no_mask'}]"


MASKS = (
    "square",
    "tall",
    "self",
    "valid_lens_1d",
    "valid_lens_2d",
    "lens_float",
    "lens_int32",
    "mask_1d",
    "mask_2d",
    "mask_keys",
    "mask_3d",
    "mask_4d",
    "mask_4d_heads",
    "mask_4d_batch",
    "causal",
    "window_mask",
    "window_bool",
    "head_mask",
    "head_mask_2d",
    "head_mask_bool",
    "attn_bias",
    "attn_bias_4d",
    "no_weights",
    "rank_2",
    "rank_4",
    "offset",
)


@dataclasses.dataclass
class Result:
    """What one backend computed for one case, as numpy arrays.

    gradients: d sum(output * cotangent) / d input and / d weight, keyed by input names and
    canonical weight names; None when not asked for or when the backend has no autograd.
    inference: with gradients, the same call made again without recording them (the
    backend's `without_gradients`), whose output and weights are checked too: some paths
    run only there; None otherwise, when the one call already ran without gradients.
    """

    output: np.ndarray
    attention_weights: np.ndarray | None
    gradients: dict[str, np.ndarray] | None = None
    inference: Result | None = None


@dataclasses.dataclass
class Row:
    """One line of the agreement table.

    output_difference, weights_difference: from the float64 NumPy reference (absolute for
    float64, relative to the reference's scale otherwise), the larger of the calls with and
    without gradients (Result.inference); within TOLERANCES to pass.
    gradient_difference: from float64 central differences, relative to the gradients' scale;
    within GRADIENT_TOLERANCES. gradient_agreement: from the first autograd backend of the run;
    within TOLERANCES. None where it does not apply.
    zero_difference: the largest absolute value of the output and attention weights where the
    reference's are exactly 0 (masked keys, rows with no key to attend); must be 0, since
    docs/design.md promises exact zeros there. A NaN anywhere counts as an infinite difference.
    """

    case: str
    backend: str
    dtype: str
    output_shape: tuple[int, ...] | None
    output_difference: float | None
    weights_difference: float | None
    gradient_difference: float | None
    gradient_agreement: float | None
    passed: bool
    error: str | None = None
    zero_difference: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_cases() -> list[Case]:
    """Every layer, and the main mask combinations on the attention layers."""
    cases = [
        Case("masked_softmax"),
        Case("masked_softmax", ("valid_lens_1d",)),
        Case("masked_softmax", ("valid_lens_2d",)),
    ]
    for layer in ("DotProductAttention", "AdditiveAttention"):
        cases += [
            Case(layer),
            Case(layer, ("valid_lens_1d",)),
            Case(layer, ("valid_lens_2d",)),
            Case(layer, ("mask_3d",)),
            Case(layer, ("causal",)),
            Case(layer, ("window_mask",)),
            Case(layer, ("valid_lens_2d", "mask_2d", "causal", "window_mask")),
        ]
    for bias in (False, True):
        config = {"bias": bias}
        cases += [
            Case("MultiHeadAttention", (), config),
            Case("MultiHeadAttention", ("valid_lens_1d",), config),
            Case("MultiHeadAttention", ("valid_lens_2d",), config),
            Case("MultiHeadAttention", ("mask_4d",), config),
            Case("MultiHeadAttention", ("causal",), config),
            Case("MultiHeadAttention", ("window_mask",), config),
            Case("MultiHeadAttention", ("head_mask",), config),
            Case("MultiHeadAttention", ("valid_lens_1d", "no_weights"), config),
            Case("MultiHeadAttention", ("self", "valid_lens_1d", "causal"), config),
            Case("MultiHeadAttention", ("self", "valid_lens_1d", "no_weights"), config),
            Case(
                "MultiHeadAttention",
                ("valid_lens_2d", "mask_3d", "causal", "window_mask", "head_mask"),
                config,
            ),
        ]
    cases += [Case("MultiHeadAttention", masks, config) for masks, config in OPTION_CASES]
    cases += [Case("DotProductAttention", ("valid_lens_2d",), {"scale": 0.25})]
    cases += [Case(layer, masks, config) for layer, masks, config in EMPTY_ROWS_AND_BIAS_CASES]
    cases += [Case(layer, masks, config) for layer, masks, config in MODERN_CASES]
    cases += [Case("PositionalEncoding"), Case("AddNorm")]
    return cases


# The tables of default_cases below; the test suite's matrix runs them too
# (tests/agreement_cases.py).

# A row with no key taking uniform weights, and biases added to the scores, on each layer
UNIFORM = {"empty_rows": "uniform"}
EMPTY_ROWS_AND_BIAS_CASES = (
    ("masked_softmax", ("valid_lens_2d",), UNIFORM),
    ("DotProductAttention", ("valid_lens_1d",), UNIFORM),
    ("AdditiveAttention", ("mask_3d",), UNIFORM),
    ("MultiHeadAttention", ("valid_lens_1d",), UNIFORM),
    ("MultiHeadAttention", ("mask_4d", "no_weights"), UNIFORM),
    ("DotProductAttention", ("attn_bias",), {}),
    ("AdditiveAttention", ("valid_lens_1d", "attn_bias"), {}),
    ("MultiHeadAttention", ("valid_lens_1d", "attn_bias_4d"), {"scale": 1.0}),
    ("MultiHeadAttention", ("attn_bias", "no_weights"), {}),
)


# The layer options beside bias, each on a path that reads it (the fused path without weights)
OPTION_CASES = (
    (("valid_lens_1d",), {"out_bias": True}),
    (("causal",), {"bias": True, "out_bias": False, "out_features": 5}),
    (("valid_lens_1d",), {"scale": 1.0}),
    (("valid_lens_1d", "no_weights"), {"scale": 1.0, "out_features": 3}),
)


# Grouped-query attention, rotary embeddings and sliding windows, each on the paths with and
# without weights; 4 query heads share 2 or 1 key-value heads
GQA = {"num_heads": 4, "num_kv_heads": 2}
MQA = {"num_heads": 4, "num_kv_heads": 1}
ROPE = {"rope_theta": 10000.0}
MODERN_CASES = (
    ("MultiHeadAttention", ("valid_lens_1d",), GQA),
    ("MultiHeadAttention", ("causal", "no_weights"), {**MQA, "bias": True}),
    ("MultiHeadAttention", ("valid_lens_2d",), ROPE),
    ("MultiHeadAttention", ("self", "causal", "no_weights"), {**ROPE, "rope_interleaved": True}),
    # Llama: grouped-query attention with rotary embeddings, causal, with padding
    ("MultiHeadAttention", ("self", "valid_lens_1d", "causal"), {**GQA, **ROPE}),
    ("MultiHeadAttention", ("square", "causal"), {"sliding_window": 2}),
    ("MultiHeadAttention", ("mask_3d", "no_weights"), {**GQA, "sliding_window": 3}),
    ("DotProductAttention", ("valid_lens_1d",), {"sliding_window": 2}),
    ("AdditiveAttention", ("causal",), {"sliding_window": 3}),
    ("RotaryEmbedding", (), {}),
    ("RotaryEmbedding", ("offset",), {"interleaved": True, "theta": 100.0}),
    ("LearnedPositionalEncoding", (), {"max_len": 9}),
)


def make_inputs(case: Case, shapes: Shapes, dtype: str, seed: int) -> dict[str, Any]:
    """Seeded numpy inputs for `case`: tensors in `dtype`, masks and lengths as they are.

    valid_lens hold lengths of 0 (a fully masked row), 1, exactly the number of keys and more;
    every boolean mask but mask_1d and mask_4d_heads, and every window, has a row with no key.
    """
    draw, masks = _Draws(np.random.default_rng(seed), dtype), set(case.masks)
    sizes = _call_sizes(case, shapes, masks)
    inputs = _layer_inputs(case, shapes, masks, sizes, draw)
    inputs.update(_length_inputs(shapes, masks, sizes, draw))
    inputs.update(_keep_masks(shapes, masks, sizes, draw))
    inputs.update(_other_masks(shapes, masks, sizes, draw))
    return inputs


@dataclasses.dataclass
class _Draws:
    """The random arrays of one case's inputs, drawn in turn from one seeded generator."""

    rng: np.random.Generator
    dtype: str

    def normal(self, *shape) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(self.dtype)

    def keep(self, *shape, p=0.8, empty=None) -> np.ndarray:
        # Kept with probability p; `empty` indexes a row that then keeps no key
        kept = self.rng.random(shape) < p
        if empty is not None:
            kept[empty] = False
        return kept


@dataclasses.dataclass(frozen=True)
class _Sizes:
    num_queries: int
    num_keys: int
    num_hiddens: int
    # A row with no key among the queries of one example when it has more than one query (one
    # example among several for key padding), so that the other rows still attend
    empty_query: int | None
    empty_example: int | None


def _call_sizes(case: Case, s: Shapes, masks: set[str]) -> _Sizes:
    num_queries, num_keys = s.num_queries, s.num_keys
    if {"square", "self"} & masks:  # causal masks differ when the counts differ
        num_keys = num_queries
    elif "tall" in masks:  # queries past the last key attend to every key under causal
        num_keys = max(1, num_queries - 2)
    num_hiddens = case.config.get("num_hiddens", s.num_hiddens)
    empty_query = 1 if num_queries > 1 else None
    empty_example = min(2, s.batch_size - 1) if s.batch_size > 1 else None
    return _Sizes(num_queries, num_keys, num_hiddens, empty_query, empty_example)


def _layer_inputs(case: Case, s: Shapes, masks, sizes: _Sizes, draw: _Draws) -> dict[str, Any]:
    """The tensors the layer of `case` is called on."""
    B, Q, K, n = s.batch_size, sizes.num_queries, sizes.num_keys, sizes.num_hiddens
    if case.layer == "masked_softmax":
        shape = {"rank_2": (B, K), "rank_4": (B, s.num_heads, Q, K)}
        rank = next((key for key in shape if key in masks), None)
        return {"X": draw.normal(*shape.get(rank, (B, Q, K)))}
    if case.layer in ("PositionalEncoding", "LearnedPositionalEncoding"):
        return {"X": draw.normal(B, Q, n)}
    if case.layer == "RotaryEmbedding":
        return {
            "X": draw.normal(B, s.num_heads, Q, n),
            **({"offset": 3} if "offset" in masks else {}),
        }
    if case.layer == "AddNorm":
        shape = {"rank_2": (B, n), "rank_4": (B, 2, Q, n)}
        shape = shape.get(next((key for key in shape if key in masks), None), (B, Q, n))
        return {"X": draw.normal(*shape), "Y": draw.normal(*shape)}
    query_size = s.key_size if case.layer == "DotProductAttention" else s.query_size
    inputs = {"queries": draw.normal(B, Q, query_size)}
    if "self" not in masks:  # self-attention: queries serve as keys and values
        inputs["keys"] = draw.normal(B, K, s.key_size)
        inputs["values"] = draw.normal(B, K, s.value_size)
    return inputs


def _length_inputs(s: Shapes, masks, sizes: _Sizes, draw: _Draws) -> dict[str, Any]:
    """valid_lens: lengths of 0 (nothing attended), 1, exactly K, and more than K among them."""
    K = sizes.num_keys
    extremes = np.array([0, 1, K, K + 3])
    lengths = draw.rng.integers(1, K + 1, size=(s.batch_size, sizes.num_queries))
    lengths[:, 0] = np.resize(extremes, s.batch_size)
    lengths[0, -1] = K + 3
    inputs: dict[str, Any] = {}
    if "valid_lens_1d" in masks:
        inputs["valid_lens"] = lengths[:, 0].copy()
    if "valid_lens_2d" in masks:
        inputs["valid_lens"] = lengths
    if "valid_lens" in inputs and "lens_float" in masks:
        inputs["valid_lens"] = inputs["valid_lens"].astype(np.float32)
    if "valid_lens" in inputs and "lens_int32" in masks:
        inputs["valid_lens"] = inputs["valid_lens"].astype(np.int32)
    return inputs


def _keep_masks(s: Shapes, masks, sizes: _Sizes, draw: _Draws) -> dict[str, Any]:
    """The boolean keep-masks of the case, each with a row that keeps no key where it can."""
    B, H, Q, K, empty = (
        s.batch_size,
        s.num_heads,
        sizes.num_queries,
        sizes.num_keys,
        sizes.empty_query,
    )
    inputs: dict[str, Any] = {}
    if "mask_1d" in masks:
        inputs["mask"] = draw.keep(K, p=0.6)
        inputs["mask"][0] = True  # never empty: a 1-D mask applies to every row
    if "mask_2d" in masks:
        inputs["mask"] = draw.keep(Q, K, empty=empty)
    if "mask_keys" in masks:  # key padding: every query of an example keeps the same keys
        inputs["mask"] = draw.keep(B, 1, K, empty=sizes.empty_example)
    if "mask_3d" in masks:
        inputs["mask"] = draw.keep(B, Q, K, empty=None if empty is None else (-1, empty))
    if "mask_4d" in masks:
        inputs["mask"] = draw.keep(B, H, Q, K, empty=None if empty is None else (0, -1, empty))
    if "mask_4d_heads" in masks:
        inputs["mask"] = draw.keep(1, H, 1, K, p=0.7)
    if "mask_4d_batch" in masks:
        inputs["mask"] = draw.keep(B, 1, Q, K, empty=None if empty is None else (0, 0, empty))
    if "causal" in masks:
        inputs["causal"] = True
    return inputs


def _other_masks(s: Shapes, masks, sizes: _Sizes, draw: _Draws) -> dict[str, Any]:
    """Windows, head masks, additive biases and need_weights of the case."""
    B, H, Q, K = s.batch_size, s.num_heads, sizes.num_queries, sizes.num_keys
    # Swin style: one window per example b mod num_windows, two windows when the batch allows
    num_windows = 2 if B % 2 == 0 else 1
    rows = None if sizes.empty_query is None else (-1, sizes.empty_query)
    inputs: dict[str, Any] = {}
    if "window_mask" in masks:
        # Additive: a bias where attended (a relative position bias), -inf where not
        blocked = ~draw.keep(num_windows, Q, K, p=0.7)
        if rows is not None:
            blocked[rows] = True
        bias = 0.5 * draw.rng.standard_normal(blocked.shape)
        inputs["window_mask"] = np.where(blocked, -np.inf, bias).astype(draw.dtype)
    if "window_bool" in masks:
        inputs["window_mask"] = draw.keep(num_windows, Q, K, p=0.7, empty=rows)
    if "head_mask" in masks:
        inputs["head_mask"] = draw.rng.random(H).astype(draw.dtype)
    if "head_mask_2d" in masks:
        inputs["head_mask"] = draw.normal(B, H)
    if "head_mask_bool" in masks:
        inputs["head_mask"] = draw.keep(B, H, p=0.5)
    if "attn_bias" in masks:
        # Added to the scores (ALiBi, a relative bias), its -inf entries excluding keys, and
        # every key of one row
        bias = 0.5 * draw.rng.standard_normal((B, Q, K))
        bias[~draw.keep(B, Q, K, p=0.8, empty=rows)] = -np.inf
        inputs["attn_bias"] = bias.astype(draw.dtype)
    if "attn_bias_4d" in masks:  # one bias per head, as T5's relative position bias
        inputs["attn_bias"] = draw.normal(1, H, Q, K)
    if "no_weights" in masks:
        inputs["need_weights"] = False
    return inputs


def _config(case: Case, shapes: Shapes, dtype: str) -> dict[str, Any]:
    s = shapes
    config: dict[str, Any] = {"dtype": dtype}
    if case.layer == "AdditiveAttention":
        config.update(num_hiddens=s.num_hiddens, query_size=s.query_size, key_size=s.key_size)
    elif case.layer == "MultiHeadAttention":
        config.update(
            num_hiddens=s.num_hiddens,
            num_heads=s.num_heads,
            query_size=s.query_size,
            key_size=s.key_size,
            value_size=s.value_size,
        )
    elif case.layer in (
        "PositionalEncoding",
        "LearnedPositionalEncoding",
        "AddNorm",
        "RotaryEmbedding",
    ):
        config.update(num_hiddens=s.num_hiddens)
    if "self" in case.masks and "query_size" in config:
        config["key_size"] = config["query_size"]
        if "value_size" in config:
            config["value_size"] = config["query_size"]
    config.update(case.config)
    return config


def fit(case: Case, shapes: Shapes) -> Case:
    """`case` with sizes of its own where its options cannot take those of `shapes`: the query
    heads a case names (4 for grouped-query attention) must divide num_hiddens, rotary
    embeddings need an even head size, and a positional encoding a max_len of at least the
    number of queries. It takes the nearest larger sizes that fit, written into its config so
    that its id names them; `case` itself where the sizes of `shapes` fit."""
    config = dict(case.config)
    options = {"num_heads", "num_hiddens", "rope_theta"}
    if case.layer == "MultiHeadAttention" and options & set(config):
        num_heads = config.get("num_heads", shapes.num_heads)
        num_hiddens = config.get("num_hiddens", shapes.num_hiddens)
        head_size = -(-num_hiddens // num_heads)  # rounded up: num_heads divides num_hiddens
        if config.get("rope_theta") is not None:  # rotary embeddings turn pairs of features
            head_size += head_size % 2
        if num_heads * head_size != num_hiddens:
            config["num_hiddens"] = num_heads * head_size
    elif case.layer == "RotaryEmbedding":
        num_hiddens = config.get("num_hiddens", shapes.num_hiddens)
        if num_hiddens % 2:
            config["num_hiddens"] = num_hiddens + 1
    elif case.layer in ("PositionalEncoding", "LearnedPositionalEncoding"):
        # The layer's own default where the case gives none
        layer = getattr(load_backend("numpy"), case.layer)
        max_len = config.get("max_len", inspect.signature(layer).parameters["max_len"].default)
        if shapes.num_queries > max_len:
            config["max_len"] = shapes.num_queries
    return case if config == dict(case.config) else dataclasses.replace(case, config=config)


# The inputs each layer is differentiated with respect to.
def differentiable(case: Case) -> tuple[str, ...]:
    """The inputs `case` is differentiated with respect to (self-attention has one)."""
    if "self" in case.masks:
        return ("queries",)
    return DIFFERENTIABLE[case.layer]


DIFFERENTIABLE: dict[str, tuple[str, ...]] = {
    "masked_softmax": ("X",),
    "PositionalEncoding": ("X",),
    "RotaryEmbedding": ("X",),
    "LearnedPositionalEncoding": ("X",),
    "AddNorm": ("X", "Y"),
    "DotProductAttention": ("queries", "keys", "values"),
    "AdditiveAttention": ("queries", "keys", "values"),
    "MultiHeadAttention": ("queries", "keys", "values"),
}


def build_layer(backend: str, case: Case, config: Mapping[str, Any], weights=None) -> Any:
    """The layer of `case` in `backend` with `config`, holding `weights` when given."""
    if case.layer == "masked_softmax":
        return None
    layer = weights_module.build_layer(load_backend(backend), case.layer, config)
    if weights:
        set_weights(layer, dict(weights))
    return layer


def call_layer(module: Any, case: Case, layer: Any, tensors: Mapping[str, Any]) -> Any:
    """Call `layer` (or the backend's masked_softmax) on the case's tensors."""
    if case.layer == "masked_softmax":
        options = {key: case.config[key] for key in ("empty_rows",) if key in case.config}
        return module.masked_softmax(tensors["X"], tensors.get("valid_lens"), **options)
    if case.layer in ("PositionalEncoding", "LearnedPositionalEncoding"):
        return layer(tensors["X"])
    if case.layer == "RotaryEmbedding":
        return layer(tensors["X"], **({"offset": tensors["offset"]} if "offset" in tensors else {}))
    if case.layer == "AddNorm":
        return layer(tensors["X"], tensors["Y"])
    arguments = {
        key: tensors[key]
        for key in ("mask", "causal", "window_mask", "head_mask", "need_weights", "attn_bias")
        if key in tensors
    }
    queries = tensors["queries"]
    keys, values = tensors.get("keys", queries), tensors.get("values", queries)
    return layer(queries, keys, values, tensors.get("valid_lens"), **arguments)


def run_case(
    backend: str,
    case: Case,
    inputs: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    cotangent: np.ndarray | None = None,
    transform: Callable[[Any], Any] | None = None,
) -> Result:
    """Build `case.layer` in `backend` with `weights`, call it on `inputs`, return numpy.

    With a `cotangent` (an array of the output's shape) and a backend with autograd, also
    returns the gradients of sum(output * cotangent) with respect to the inputs and to every
    weight, the latter in canonical names and layout.

    transform: called with the built layer, returns what is called instead (a compiled or
    hybridized layer: the framework's own ways of running it); the layer itself still holds
    the weights and attention_weights. Not for masked_softmax.
    """
    module = load_backend(backend)
    tensors = {
        key: module.from_numpy(value) if isinstance(value, np.ndarray) else value
        for key, value in inputs.items()
    }
    layer = build_layer(backend, case, config, weights)
    called = layer if transform is None else transform(layer)

    def forward() -> Result:
        output = module.to_numpy(call_layer(module, case, called, tensors))
        return Result(output, _attention_weights(module, layer))

    if cotangent is None or not hasattr(module, "value_and_gradients"):
        return forward()
    with module.without_gradients():
        inference = forward()
    output, input_gradients, weight_gradients = module.value_and_gradients(
        # A backend may call another layer holding the same weights (JAX: a copy made inside
        # its trace, since Flax modules are not mutated across traces)
        lambda arguments, other=None: call_layer(
            module, case, called if other is None else other, arguments
        ),
        tensors,
        differentiable(case),
        layer,
        module.from_numpy(cotangent),
    )
    return Result(
        output,
        _attention_weights(module, layer),
        {**input_gradients, **weight_gradients},
        inference,
    )


def _attention_weights(module: Any, layer: Any) -> np.ndarray | None:
    """The layer's attention_weights of its last call as numpy, None when it has none."""
    attention_weights = getattr(layer, "attention_weights", None)
    return None if attention_weights is None else module.to_numpy(attention_weights)


def finite_difference_gradients(
    case: Case,
    inputs: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    cotangent: np.ndarray,
    step: float = 1e-6,
) -> dict[str, np.ndarray]:
    """Central differences of sum(output * cotangent) on the float64 NumPy reference, with
    respect to the differentiable inputs and every weight."""
    inputs = _upcast(inputs)
    weights = _upcast(weights)
    config = {**config, "dtype": "float64"}
    layer = build_layer("numpy", case, config, weights)
    module = load_backend("numpy")

    def loss() -> float:
        if weights:
            set_weights(layer, weights)
        return float(np.sum(call_layer(module, case, layer, inputs) * cotangent))

    gradients = {}
    for source, names in ((inputs, differentiable(case)), (weights, sorted(weights))):
        for name in names:
            array = source[name]
            gradient = np.zeros_like(array)
            for index in np.ndindex(array.shape):
                original = array[index]
                array[index] = original + step
                above = loss()
                array[index] = original - step
                below = loss()
                array[index] = original
                gradient[index] = (above - below) / (2 * step)
            gradients[name] = gradient
    return gradients


def difference(actual: np.ndarray, reference: np.ndarray, relative: bool) -> float:
    """The largest absolute difference, divided when `relative` by the reference's scale (its
    largest absolute entry, at least 1). Different shapes and NaN give infinity."""
    actual = np.asarray(actual, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if actual.shape != reference.shape:
        return float("inf")
    if actual.size == 0:
        return 0.0
    error = float(np.max(np.abs(actual - reference)))
    if np.isnan(error):  # a NaN is no number: never within a tolerance
        return float("inf")
    if not relative:
        return error
    return error / max(1.0, float(np.max(np.abs(reference))))


def _gradient_difference(
    actual: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], relative: bool
) -> float:
    if set(actual) != set(reference):
        return float("inf")
    return max((difference(actual[k], reference[k], relative) for k in reference), default=0.0)


def _upcast(arrays: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: value.astype(np.float64)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f"
        else value
        for key, value in arrays.items()
    }


@dataclasses.dataclass
class Prepared:
    """One case made ready for any number of backends: the case as run (with the sizes of its
    own that fit gave it), its config, weights and inputs in the run's dtype, the float64
    reference, and (for gradients) the cotangent and the central differences of the reference."""

    case: Case
    dtype: str
    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    inputs: dict[str, Any]
    reference: Result
    cotangent: np.ndarray | None = None
    numeric_gradients: dict[str, np.ndarray] | None = None


def prepare(
    case: Case,
    shapes: Shapes = Shapes(),
    dtype: str = "float32",
    seed: int = 0,
    gradients: bool = True,
) -> Prepared:
    """Make the weights, inputs and float64 reference of `case` (see Prepared), with sizes of
    its own where those of `shapes` cannot build it (see fit; Prepared.case is the case run)."""
    case = fit(case, shapes)
    config = _config(case, shapes, dtype)
    reference_config = {**config, "dtype": "float64"}
    weights = (
        random_weights(case.layer, seed=seed, **config) if case.layer != "masked_softmax" else {}
    )
    inputs = make_inputs(case, shapes, dtype, seed)
    # The reference sees exactly the numbers the backends see, upcast to float64, so that the
    # difference measures the computation alone.
    reference = run_case("numpy", case, _upcast(inputs), _upcast(weights), reference_config)
    prepared = Prepared(case, dtype, config, weights, inputs, reference)
    if gradients:
        cotangent = np.random.default_rng(seed + 1).standard_normal(reference.output.shape)
        prepared.numeric_gradients = finite_difference_gradients(
            case, inputs, weights, config, cotangent
        )
        prepared.cotangent = cotangent.astype(dtype)
    return prepared


def check(
    backend: str,
    prepared: Prepared,
    anchor: Result | None = None,
    transform: Callable[[Any], Any] | None = None,
) -> tuple[Row, Result | None]:
    """Run a prepared case on `backend` and compare it with the reference.

    Args:
        anchor: another autograd backend's result for the same case; this backend's gradients
            must agree with its gradients.
        transform: as run_case's (the layer compiled or hybridized by the framework).

    Returns:
        The Row, and the Result (None when the backend raised).
    """
    case, dtype = prepared.case, prepared.dtype
    relative = dtype != "float64"
    try:
        # transform only when given: run_case's six-argument form stays the common one
        extra = {} if transform is None else {"transform": transform}
        result = run_case(
            backend,
            case,
            prepared.inputs,
            prepared.weights,
            prepared.config,
            prepared.cotangent,
            **extra,
        )
    except Exception as error:  # a crash is a disagreement, reported with its cause
        failure = f"{type(error).__name__}: {error}"
        return Row(case.id, backend, dtype, None, None, None, None, None, False, failure), None
    reference = prepared.reference
    # With gradients, the call without them too: the larger of the two differences
    calls = [result] if result.inference is None else [result, result.inference]
    output_difference = max(difference(call.output, reference.output, relative) for call in calls)
    weights_difference = _weights_difference(calls, reference, relative)
    zero_difference = _zero_difference(calls, reference)
    gradient_difference, gradient_agreement = _gradient_differences(result, prepared, anchor)
    passed = (
        max(output_difference, weights_difference or 0.0, gradient_agreement or 0.0)
        <= TOLERANCES[dtype]
        and (gradient_difference or 0.0) <= GRADIENT_TOLERANCES[dtype]
        and zero_difference == 0.0
    )
    row = Row(
        case.id,
        backend,
        dtype,
        tuple(result.output.shape),
        output_difference,
        weights_difference,
        gradient_difference,
        gradient_agreement,
        passed,
        zero_difference=zero_difference,
    )
    return row, result


def _gradient_differences(
    result: Result, prepared: Prepared, anchor: Result | None
) -> tuple[float | None, float | None]:
    """The gradients' difference from the reference's central differences (relative), and
    from another autograd backend's (the anchor); None where there is nothing to compare."""
    if result.gradients is None or prepared.numeric_gradients is None:
        return None, None
    numeric = _gradient_difference(result.gradients, prepared.numeric_gradients, True)
    if anchor is None or anchor.gradients is None:
        return numeric, None
    relative = prepared.dtype != "float64"
    return numeric, _gradient_difference(result.gradients, anchor.gradients, relative)


def _zero_difference(calls: Sequence[Result], reference: Result) -> float:
    """The largest absolute value the calls give where the reference's output or attention
    weights are exactly 0 (inf for a NaN there); 0.0 when they keep every zero."""
    largest = 0.0
    pairs = [(reference.output, call.output) for call in calls]
    if reference.attention_weights is not None:
        pairs += [(reference.attention_weights, call.attention_weights) for call in calls]
    for expected, actual in pairs:
        if actual is None or np.shape(actual) != np.shape(expected):
            continue  # counted as a difference of the output or weights already
        zeros = np.asarray(actual, dtype=np.float64)[np.asarray(expected) == 0]
        if zeros.size:
            largest = max(largest, float(np.max(np.nan_to_num(np.abs(zeros), nan=np.inf))))
    return largest


def _weights_difference(calls: Sequence[Result], reference: Result, relative: bool) -> float | None:
    """The largest difference of the calls' attention weights from the reference's; None
    when neither has any, inf when only one side has them."""
    differences = []
    for call in calls:
        if reference.attention_weights is None and call.attention_weights is None:
            continue
        if call.attention_weights is None or reference.attention_weights is None:
            differences.append(float("inf"))
        else:
            differences.append(
                difference(call.attention_weights, reference.attention_weights, relative)
            )
    return max(differences, default=None)


def compare(
    backends: Sequence[str] = ("numpy",),
    dtype: str = "float32",
    seed: int = 0,
    shapes: Shapes = Shapes(),
    cases: Iterable[Case] | None = None,
    gradients: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Row]:
    """Run every case on every backend and compare with the float64 NumPy reference.

    Args:
        backends: backend names; each must import.
        dtype: the dtype the backends run in ("float32" or "float64").
        seed: seeds the weights, the inputs and the gradients' cotangent.
        shapes: input sizes.
        cases: what to run; default_cases() when None.
        gradients: also compare the gradients of the autograd backends, with float64 central
            differences on the NumPy reference and with each other (the first autograd
            backend named is the one the others must agree with).
        progress: called as progress(done, total, description) before each run.

    Returns:
        One Row per case and backend. A backend that raises gives a failed row with the error.
    """
    names = [normalize_backend_name(name) for name in backends]
    autograd = any(hasattr(load_backend(name), "value_and_gradients") for name in names)
    cases = list(default_cases() if cases is None else cases)
    rows = []
    total, done = len(cases) * len(names), 0
    for case in cases:
        prepared = prepare(case, shapes, dtype, seed, gradients and autograd)
        anchor = None
        for name in names:
            if progress is not None:
                progress(done, total, f"{prepared.case.id} on {name}")
            done += 1
            row, result = check(name, prepared, anchor)
            if anchor is None and result is not None and result.gradients is not None:
                anchor = result
            rows.append(row)
    if progress is not None:
        progress(total, total, "done")
    return rows
