"""jax.export of every layer and mask: the deserialized program gives the NumPy reference's
numbers.

Each float32 layer is split into its graph and its weights (nnx.split), and a pure function of
(weights, inputs) that merges the layer and calls it is jitted and exported with jax.export on
one draw of inputs, with its shapes or with a symbolic batch size and lengths. The export is
serialized to bytes and deserialized, as a deployed program is. The deserialized program then
runs on that draw and on a second one whose inputs and weights differ, whose row with no key to
attend is elsewhere, and whose sizes differ where they are symbolic, so that nothing of the
first draw can stay in the program. Both are held to the float64 NumPy reference holding the
same weights, within float32's agreement: the output, the attention weights and the KV cache.
"""

from __future__ import annotations

import numpy as np
import pytest

import mha
from conftest import assert_agrees, backend_module
from mha.backends import numpy as N

pytestmark = pytest.mark.jax

HEADS, HEAD_SIZE = 4, 2
# (batch size, no. of queries, no. of keys, cached positions) of both draws; a program exported
# with symbolic sizes runs on a second draw of SIZES_2. The batch size and the numbers of
# queries and keys differ from every other size, so that an axis is known by its size.
SIZES = (2, 3, 5, 2)
SIZES_2 = (5, 4, 7, 2)
# The ways the attention layers are exported: with the example's shapes, and with a symbolic
# batch size and numbers of queries and keys (jax.export.symbolic_shape)
WAYS = ["static", "symbolic"]

LAYERS = {
    "DotProductAttention": {},
    "AdditiveAttention": {"num_hiddens": 8, "query_size": 6, "key_size": 6},
    "MultiHeadAttention": {
        "num_hiddens": HEADS * HEAD_SIZE,
        "num_heads": HEADS,
        "bias": True,
        "query_size": 6,
        "key_size": 6,
        "value_size": 7,
    },
}
# Llama's attention: 4 query heads sharing 2 key-value heads, rotary embeddings
GROUPED = {"num_kv_heads": 2, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def J():
    """The JAX backend module; a missing JAX fails here when JAX is required."""
    return backend_module("jax")


# Inputs


def _masks(kinds, rng, empty, sizes):
    """The mask arguments of one draw of these sizes, as numpy arrays: in example `empty`,
    query 1 attends to no key (every query, for 1-D valid_lens; every example, for the shared
    boolean window)."""
    B, Q, K, cached = sizes
    kwargs = {}
    for kind in kinds:
        if kind == "valid_lens_1d":
            kwargs["valid_lens"] = rng.integers(1, K + 1, B)
            kwargs["valid_lens"][empty] = 0
        elif kind == "valid_lens_2d":
            kwargs["valid_lens"] = rng.integers(1, K + 1, (B, Q))
            kwargs["valid_lens"][empty, 1] = 0
        elif kind in ("mask_3d", "mask_4d"):
            shape = (B, Q, K) if kind == "mask_3d" else (B, HEADS, Q, K)
            kwargs["mask"] = rng.random(shape) < 0.7
            kwargs["mask"][empty, ..., 1, :] = False
        elif kind == "causal":
            kwargs["causal"] = True
        elif kind == "window_float":
            window = rng.standard_normal((B, Q, K)).astype(np.float32)
            window[rng.random(window.shape) < 0.2] = -np.inf
            window[empty, 1] = -np.inf
            kwargs["window_mask"] = window
        elif kind == "window_bool":
            # One window shared by the batch
            kwargs["window_mask"] = rng.random((1, Q, K)) < 0.7
            kwargs["window_mask"][0, 1 + empty] = False
        elif kind in ("attn_bias", "attn_bias_4d"):
            shape = (B, Q, K) if kind == "attn_bias" else (B, HEADS, Q, K)
            bias = rng.standard_normal(shape).astype(np.float32)
            bias[empty, ..., 1, :] = -np.inf
            kwargs["attn_bias"] = bias
        elif kind in ("head_mask_1d", "head_mask_2d"):
            shape = (HEADS,) if kind == "head_mask_1d" else (B, HEADS)
            kwargs["head_mask"] = rng.random(shape).astype(np.float32)
        elif kind == "no_weights":
            kwargs["need_weights"] = False
        elif kind == "empty_cache":
            kwargs["cache"] = mha.KVCache()
        elif kind == "cache":
            # Keys and values of the cached positions, with GROUPED's 2 key-value heads
            shape = (B, GROUPED["num_kv_heads"], cached, HEAD_SIZE)
            kwargs["cache"] = mha.KVCache(
                *(rng.standard_normal(shape).astype(np.float32) for _ in range(2))
            )
        else:
            raise AssertionError(kind)
    return kwargs


def _draws(shapes, kinds, sizes=(SIZES, SIZES)):
    """Two draws of (args, kwargs), one of each of `sizes`: numpy float32 inputs of the shapes
    that `shapes` gives for (batch, queries, keys) and the masks of `kinds`, the first with
    its row of no key in example 0, the second in example 1."""
    draws = []
    for seed, each in enumerate(sizes):
        rng = np.random.default_rng(seed)
        args = tuple(rng.standard_normal(shape).astype(np.float32) for shape in shapes(*each[:3]))
        draws.append((args, _masks(kinds, rng, seed, each)))
    return draws


def _float64(value):
    """Float arrays, alone or in a tuple, KVCache or dict, as float64 for the reference."""
    if isinstance(value, np.ndarray):
        return value.astype(np.float64) if value.dtype.kind == "f" else value
    if isinstance(value, mha.KVCache):
        return mha.KVCache(*(None if x is None else _float64(x) for x in value))
    if isinstance(value, tuple):
        return tuple(_float64(x) for x in value)
    if isinstance(value, dict):
        return {name: _float64(x) for name, x in value.items()}
    return value


# Export and compare


def _split_arguments(kwargs):
    """(arrays, static): the keyword arguments that are inputs of the program, with a KVCache
    as a plain (keys, values) tuple, and those that are part of it (causal, need_weights).
    jax.export serializes trees of tuples, lists and dicts; a NamedTuple such as KVCache
    would need export.register_namedtuple_serialization, once per process."""
    arrays, static = {}, {}
    for name, value in kwargs.items():
        if isinstance(value, mha.KVCache):
            arrays[name] = tuple(value)
        elif isinstance(value, np.ndarray):
            arrays[name] = value
        else:
            static[name] = value
    return arrays, static


def _weights(layer):
    """The layer's weights as the exported program takes them: nested dicts of arrays."""
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(layer, nnx.Param))


def _layer_program(layer, static):
    """The pure function of (weights, args, arrays) that calls `layer`, merged from its graph
    and those weights, with the `static` keyword arguments. It returns (output, cache as a
    tuple or None, attention weights or None)."""
    from flax import nnx

    graphdef, _, rest = nnx.split(layer, nnx.Param, ...)

    def run(weights, args, arrays):
        layer = nnx.merge(graphdef, weights, rest)
        if "cache" in arrays:
            arrays = {**arrays, "cache": mha.KVCache(*arrays["cache"])}
        output = layer(*args, **arrays, **static)
        cache = None
        if isinstance(output, tuple):
            output, cache = output[0], tuple(output[1])
        return output, cache, getattr(layer, "attention_weights", None)

    return run


def _deserialized(run, *example):
    """`run` jitted and exported on the example inputs (arrays or jax.ShapeDtypeStructs),
    serialized to bytes, and read back."""
    import jax
    from jax import export

    return export.deserialize(export.export(jax.jit(run))(*example).serialize())


def _results(output, cache, weights):
    """(output, cached keys, cached values, attention weights), None where a call has none."""
    return (output, *(cache or (None, None)), weights)


def _assert_results_agree(actual, expected):
    for got, want in zip(actual, expected, strict=True):
        if want is None:
            assert got is None
        else:
            assert_agrees(np.asarray(got), want, "float32")


def _sizes(way):
    """The sizes of the two draws for the `way` of exporting."""
    return (SIZES, SIZES) if way == "static" else (SIZES, SIZES_2)


def _with_symbolic_sizes(example):
    """The example's inputs as jax.ShapeDtypeStructs whose sizes are symbolic where they are
    the batch's (a first axis), the queries' or the keys' (other axes); the rest keep theirs:
    a window shared by the batch, heads, features, the cached positions."""
    import jax
    from jax import export

    B, Q, K, _ = SIZES
    batch, queries, keys = export.symbolic_shape("b, q, k")

    def struct(x):
        shape = [batch if x.shape[:1] == (B,) else size for size in x.shape[:1]]
        shape += [{Q: queries, K: keys}.get(size, size) for size in x.shape[1:]]
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    return jax.tree.map(struct, example)


def _check_layer(J, name, config, draws, way="static"):
    """Export the float32 layer of this class and config on the first draw (on its shapes, or
    with symbolic sizes for the way "symbolic"); the deserialized program on each draw, with
    new weights for each, gives the numbers of the float64 reference holding those weights."""
    layer = getattr(J, name)(**config)
    layer.eval()
    reference = getattr(N, name)(**config, dtype="float64")
    program = None
    for seed, (args, kwargs) in enumerate(draws):
        weights = mha.random_weights(layer, seed=seed)
        mha.set_weights(layer, weights)
        mha.set_weights(reference, _float64(weights))
        arrays, static = _split_arguments(kwargs)
        if program is None:
            example = (args, arrays)
            if way == "symbolic":
                example = _with_symbolic_sizes(example)
            program = _deserialized(_layer_program(layer, static), _weights(layer), *example)
        expected = reference(*_float64(args), **_float64(kwargs))
        cache = None
        if isinstance(expected, tuple):
            expected, cache = expected
        _assert_results_agree(
            # The weights are an input of the program: the second draw's are new
            _results(*program.call(_weights(layer), args, arrays)),
            _results(expected, cache, getattr(reference, "attention_weights", None)),
        )


def _attention_shapes(B, Q, K):
    return [(B, Q, 6), (B, K, 6), (B, K, 7)]


ATTENTION_MASKS = [
    ["valid_lens_1d"],
    ["valid_lens_2d"],
    ["mask_3d"],
    ["causal", "valid_lens_1d"],
    ["window_float"],
    ["window_bool"],
    ["attn_bias"],
]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kinds", ATTENTION_MASKS, ids="+".join)
@pytest.mark.parametrize("name", LAYERS)
def test_exported_attention_gives_the_reference(J, name, kinds, way):
    _check_layer(J, name, LAYERS[name], _draws(_attention_shapes, kinds, _sizes(way)), way)


MULTIHEAD_CASES = {
    "mask_4d": ({}, ["mask_4d"]),
    "attn_bias_4d": ({}, ["attn_bias_4d"]),
    "head_mask_1d": ({}, ["valid_lens_1d", "head_mask_1d"]),
    "head_mask_2d": ({}, ["mask_3d", "head_mask_2d"]),
    "no_weights+valid_lens_1d": ({}, ["valid_lens_1d", "no_weights"]),
    "no_weights+mask_3d": ({}, ["mask_3d", "no_weights"]),
    "no_weights+window_float": ({}, ["window_float", "no_weights"]),
    "sliding_window": ({"sliding_window": 2}, ["valid_lens_2d"]),
    "grouped_rotary": (GROUPED, ["causal", "valid_lens_1d"]),
    "grouped_rotary+no_weights": (GROUPED, ["causal", "valid_lens_1d", "no_weights"]),
    "empty_cache": ({}, ["causal", "valid_lens_1d", "empty_cache"]),
    "cache": (GROUPED, ["causal", "valid_lens_1d", "cache"]),
    "cache+no_weights": (GROUPED, ["causal", "valid_lens_1d", "cache", "no_weights"]),
    "uniform_empty_rows": ({"empty_rows": "uniform"}, ["valid_lens_2d"]),
}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("config", "kinds"), MULTIHEAD_CASES.values(), ids=MULTIHEAD_CASES)
def test_exported_multihead_attention_gives_the_reference(J, config, kinds, way):
    config = {**LAYERS["MultiHeadAttention"], **config}
    draws = _draws(_attention_shapes, kinds, _sizes(way))
    _check_layer(J, "MultiHeadAttention", config, draws, way)


SOFTMAX_CASES = {
    "no_lens": (lambda B, Q, K: [(B, Q, K)], [], "zeros"),
    "valid_lens_1d": (lambda B, Q, K: [(B, Q, K)], ["valid_lens_1d"], "zeros"),
    "valid_lens_2d": (lambda B, Q, K: [(B, Q, K)], ["valid_lens_2d"], "zeros"),
    "heads+valid_lens_2d": (lambda B, Q, K: [(B, HEADS, Q, K)], ["valid_lens_2d"], "zeros"),
    "uniform_empty_rows": (lambda B, Q, K: [(B, Q, K)], ["valid_lens_1d"], "uniform"),
}


@pytest.mark.parametrize(
    ("shapes", "kinds", "empty_rows"), SOFTMAX_CASES.values(), ids=SOFTMAX_CASES
)
def test_exported_masked_softmax_gives_the_reference(J, shapes, kinds, empty_rows):
    def run(args, arrays):
        return J.masked_softmax(*args, **arrays, empty_rows=empty_rows)

    draws = _draws(shapes, kinds)
    program = _deserialized(run, *draws[0])
    for args, kwargs in draws:
        expected = N.masked_softmax(*_float64(args), **kwargs, empty_rows=empty_rows)
        assert_agrees(np.asarray(program.call(args, kwargs)), expected, "float32")


OTHER_CASES = {
    "PositionalEncoding": ("PositionalEncoding", {"num_hiddens": 8, "max_len": 10}, 1, {}),
    "LearnedPositionalEncoding": (
        "LearnedPositionalEncoding",
        {"num_hiddens": 8, "max_len": 10},
        1,
        {},
    ),
    "RotaryEmbedding": ("RotaryEmbedding", {"num_hiddens": 8, "theta": 500.0}, 1, {"offset": 3}),
    "RotaryEmbedding-interleaved": (
        "RotaryEmbedding",
        {"num_hiddens": 8, "interleaved": True},
        1,
        {"offset": 3},
    ),
    "AddNorm": ("AddNorm", {"num_hiddens": 8}, 2, {}),
}


@pytest.mark.parametrize(
    ("name", "config", "num_inputs", "kwargs"), OTHER_CASES.values(), ids=OTHER_CASES
)
def test_exported_encodings_and_add_norm_give_the_reference(J, name, config, num_inputs, kwargs):
    # Sequences of 5 positions (max_len 10); RotaryEmbedding's offset is a Python int, part of
    # the program as under jit
    draws = _draws(lambda B, Q, K: [(B, Q + 2, 8)] * num_inputs, [])
    _check_layer(J, name, config, [(args, kwargs) for args, _ in draws])
