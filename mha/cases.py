"""The cases the harness compares, and their inputs: what is run, on which sizes and masks.

A `Case` names a layer (or masked_softmax), the masks and input variants of its call and the
options of its config; `Shapes` gives the sizes of a run. `default_cases()` is what `mha
compare` runs, and its tables (mha.case_tables) are the test suite's too
(tests/agreement_cases.py). `make_inputs` draws a case's seeded inputs, and `fit` gives a
case sizes of its own where those of the run cannot build it. `mha.harness` names all of
them as well, and runs them.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha.case_tables import (
    CACHED_CASES,
    EMPTY_ROWS_AND_BIAS_CASES,
    GQA,
    LATENT,
    LATENT_CASES,
    LATENT_SIZES,
    LATENT_YARN,
    MODERN_CASES,
    MQA,
    OPTION_CASES,
    ROPE,
    ROPE_SCALING_CASES,
    SHAPE_CASES,
    UNIFORM,
)
from mha.registry import load_backend

__all__ = [
    "CACHED_CASES",
    "DIFFERENTIABLE",
    "EMPTY_ROWS_AND_BIAS_CASES",
    "GQA",
    "LATENT",
    "LATENT_CASES",
    "LATENT_SIZES",
    "LATENT_YARN",
    "MASKS",
    "MODERN_CASES",
    "MQA",
    "OPTION_CASES",
    "ROPE",
    "ROPE_SCALING_CASES",
    "SHAPE_CASES",
    "UNIFORM",
    "Case",
    "Shapes",
    "default_cases",
    "differentiable",
    "fit",
    "make_inputs",
]


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
    keys), "mask_4d_batch" (batch x 1 x queries x keys), "causal" (with "bottom_right" or
    "aligned_2", the masks' alignment: the last query beside the last key, or the first query
    at position 2), "segments" (segment_ids: each row two packed sequences; with "square" or
    "self"), "window_mask" (additive: finite biases and -inf), "window_bool", "head_mask"
    (heads,), "head_mask_2d" (batch x heads), "head_mask_bool" (batch x heads, boolean),
    "attn_bias" (batch x queries x keys, finite and -inf, a row all -inf), "attn_bias_4d" (1 x
    heads x queries x keys, finite, as T5's), "no_weights" (need_weights=False), "absorbed"
    (MultiHeadLatentAttention's absorbed form; its X is self-attention's, as many keys as
    queries, and its sizes beside num_hiddens and num_heads LATENT_SIZES'), "cached" (the
    attention layers called as decoding calls them, with a cache: mha.case_calls). The layer
    "dot_product_attention" is the attention function: its config holds its options (scale,
    softcap, window, empty_rows) and the heads of its inputs (num_heads, num_kv_heads), and
    attn_bias_4d is its bias.
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
        config = sorted(self.config.items())
        options = ",".join(f"{key}={_id_value(value)}" for key, value in config)
        layer = f"{self.layer}({options})" if options else self.layer
        return f"{layer}[{'+'.join(self.masks) or 'no_mask'}]"


def _id_value(value: Any) -> str:
    # A rope scaling by its type, so that a row's label stays short; another mapping as
    # compact JSON, so that an id holds no spaces
    if isinstance(value, Mapping) and "rope_type" in value:
        return str(value["rope_type"])
    return json.dumps(value, separators=(",", ":")) if isinstance(value, Mapping) else str(value)


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
    "bottom_right",
    "aligned_2",
    "segments",
    "window_mask",
    "window_bool",
    "head_mask",
    "head_mask_2d",
    "head_mask_bool",
    "attn_bias",
    "attn_bias_4d",
    "no_weights",
    "absorbed",
    "cached",
    "rank_2",
    "rank_4",
    "offset",
)


def default_cases() -> list[Case]:
    """Every layer, the main mask combinations on the attention layers, every mask kind at
    least once, and the options' tables (mha.case_tables)."""
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
    cases += [Case(layer, masks, config) for layer, masks, config in SHAPE_CASES]
    cases += [Case(layer, masks, config) for layer, masks, config in EMPTY_ROWS_AND_BIAS_CASES]
    cases += [Case(layer, masks, config) for layer, masks, config in MODERN_CASES]
    cases += [Case(layer, masks, config) for layer, masks, config in LATENT_CASES]
    cases += [Case(layer, masks, config) for layer, masks, config in CACHED_CASES]
    cases += [Case("PositionalEncoding"), Case("AddNorm")]
    return cases


def make_inputs(case: Case, shapes: Shapes, dtype: str, seed: int) -> dict[str, Any]:
    """Seeded numpy inputs for `case`: tensors in `dtype`, masks and lengths as they are.

    valid_lens hold lengths of 0 (a fully masked row), 1, exactly the number of keys and more;
    every boolean mask but mask_1d and mask_4d_heads, and every window, has a row with no key.
    """
    draw, masks = _Draws(np.random.default_rng(seed), dtype), set(case.masks)
    sizes = _call_sizes(case, shapes, masks)
    inputs = _Inputs(_layer_inputs(case, shapes, masks, sizes, draw))
    inputs.update(_length_inputs(shapes, masks, sizes, draw))
    inputs.update(_keep_masks(shapes, masks, sizes, draw))
    inputs.update(_other_masks(shapes, masks, sizes, draw))
    return dict(inputs)


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
    if {"square", "self"} & masks or case.layer == LATENT:  # causal masks differ when the
        num_keys = num_queries  # counts differ; latent attention attends over its X
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
    if case.layer in ("PositionalEncoding", "LearnedPositionalEncoding", LATENT):
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
    if case.layer == "dot_product_attention":
        return _function_inputs(case, s, sizes, draw)
    query_size = s.key_size if case.layer == "DotProductAttention" else s.query_size
    inputs = {"queries": draw.normal(B, Q, query_size)}
    if "self" not in masks:  # self-attention: queries serve as keys and values
        inputs["keys"] = draw.normal(B, K, s.key_size)
        inputs["values"] = draw.normal(B, K, s.value_size)
    return inputs


# The inputs each layer is differentiated with respect to.
def differentiable(case: Case) -> tuple[str, ...]:
    """The inputs `case` is differentiated with respect to (self-attention has one), and its
    masks given as floats: a bias or a soft head mask may be trained, as T5's relative
    position bias and Swin's window bias are."""
    inputs = ("queries",) if "self" in case.masks else DIFFERENTIABLE[case.layer]
    floats = (FLOAT_MASKS[mask] for mask in case.masks if mask in FLOAT_MASKS)
    return inputs + tuple(dict.fromkeys(floats))


# The masks drawn as floats, by the input each gives
FLOAT_MASKS = {
    "window_mask": "window_mask",
    "head_mask": "head_mask",
    "head_mask_2d": "head_mask",
    "attn_bias": "attn_bias",
    "attn_bias_4d": "attn_bias",
}

DIFFERENTIABLE: dict[str, tuple[str, ...]] = {
    "masked_softmax": ("X",),
    "PositionalEncoding": ("X",),
    "RotaryEmbedding": ("X",),
    "LearnedPositionalEncoding": ("X",),
    "AddNorm": ("X", "Y"),
    "DotProductAttention": ("queries", "keys", "values"),
    "AdditiveAttention": ("queries", "keys", "values"),
    "MultiHeadAttention": ("queries", "keys", "values"),
    "MultiHeadLatentAttention": ("X",),
    "dot_product_attention": ("query", "key", "value"),
}

# The attention function's config: what sizes its inputs (the others are its options)
FUNCTION_SIZES = ("num_heads", "num_kv_heads")


def _function_inputs(case: Case, s: Shapes, sizes: _Sizes, draw: _Draws) -> dict[str, Any]:
    """query (B, heads, Q, query_size), key (B, kv heads, K, query_size) and value (B, kv
    heads, K, value_size) of the attention function: a value head size of its own."""
    B, Q, K = s.batch_size, sizes.num_queries, sizes.num_keys
    heads = case.config.get("num_heads", s.num_heads)
    kv_heads = case.config.get("num_kv_heads", heads)
    return {
        "query": draw.normal(B, heads, Q, s.query_size),
        "key": draw.normal(B, kv_heads, K, s.query_size),
        "value": draw.normal(B, kv_heads, K, s.value_size),
    }


def _length_inputs(s: Shapes, masks, sizes: _Sizes, draw: _Draws) -> dict[str, Any]:
    """valid_lens: lengths of 0 (nothing attended), 1, exactly K, and more than K among them,
    as many as the batch holds beside one drawn length (1 to K) where it holds fewer than four,
    so that a small batch's 1-D lengths still attend."""
    K = sizes.num_keys
    extremes = np.array([0, 1, K, K + 3])
    lengths = draw.rng.integers(1, K + 1, size=(s.batch_size, sizes.num_queries))
    first = lengths[-1, 0]  # drawn
    lengths[:, 0] = np.resize(extremes, s.batch_size)
    if s.batch_size < extremes.size:
        lengths[-1, 0] = first
    lengths[0, -1] = K + 3
    inputs = _Inputs()
    if "valid_lens_1d" in masks:
        inputs["valid_lens"] = lengths[:, 0].copy()
    if "valid_lens_2d" in masks:
        inputs["valid_lens"] = lengths
    casts = {"lens_float": np.float32, "lens_int32": np.int32}
    for name in sorted(masks & casts.keys()):
        if "valid_lens" in inputs:
            inputs.replace("valid_lens", inputs["valid_lens"].astype(casts[name]))
    return inputs


class _Inputs(dict):
    """A case's inputs, each given by one of its masks: a second mask giving the same input
    would replace the first, and the row would name a mask it never ran, so it is an error."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self:
            raise ValueError(f"two of the case's masks give its {key}: one would be lost")
        super().__setitem__(key, value)

    def update(self, other: dict[str, Any]) -> None:
        for key, value in other.items():
            self[key] = value

    def replace(self, key: str, value: Any) -> None:
        """The same input, changed (its dtype)."""
        super().__setitem__(key, value)


def _keep_masks(s: Shapes, masks, sizes: _Sizes, draw: _Draws) -> dict[str, Any]:
    """The boolean keep-masks of the case, each with a row that keeps no key where it can."""
    B, H, Q, K, empty = (
        s.batch_size,
        s.num_heads,
        sizes.num_queries,
        sizes.num_keys,
        sizes.empty_query,
    )
    inputs = _Inputs()
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
    if "bottom_right" in masks:  # the masks' last query beside the last key
        inputs["alignment"] = "bottom_right"
    if "aligned_2" in masks:  # the masks' first query at position 2
        inputs["alignment"] = 2
    if "cached" in masks:
        _check_cached(masks)
        inputs["cached"] = True
    return inputs


# The masks a cached case may have: those of every key alone, which a call of some of the
# positions takes as they are (valid_lens count the cached keys too)
_CACHED_MASKS = {"cached", "square", "self", "valid_lens_1d", "lens_float", "lens_int32"}
_CACHED_MASKS |= {"causal", "head_mask", "no_weights", "absorbed"}


def _check_cached(masks: set[str]) -> None:
    if masks - _CACHED_MASKS:
        raise ValueError(
            "a cached case takes masks of every key alone: "
            f"{', '.join(sorted(_CACHED_MASKS - {'cached'}))}. Received: {sorted(masks)}"
        )


def _other_masks(s: Shapes, masks, sizes: _Sizes, draw: _Draws) -> dict[str, Any]:
    """Windows, head masks, additive biases and need_weights of the case."""
    B, H, Q, K = s.batch_size, s.num_heads, sizes.num_queries, sizes.num_keys
    # Swin style: one window per example b mod num_windows, two windows when the batch allows
    num_windows = 2 if B % 2 == 0 else 1
    rows = None if sizes.empty_query is None else (-1, sizes.empty_query)
    inputs = _Inputs()
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
    if "absorbed" in masks:
        inputs["absorbed"] = True
    if "segments" in masks:  # packed sequences: each row split in two at its own place
        cuts = draw.rng.integers(1, max(2, K), size=(B, 1))
        inputs["segment_ids"] = (np.arange(K)[None, :] >= cuts).astype(np.int64)
    return inputs


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
