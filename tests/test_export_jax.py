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
from export_cases import (
    ATTENTION_MASKS,
    LAYERS,
    MULTIHEAD_CASES,
    OTHER_CASES,
    SOFTMAX_CASES,
    attention_shapes,
    draws,
)
from mha.backends import numpy as N

pytestmark = pytest.mark.jax

# (batch size, no. of queries, no. of keys, cached positions) of both draws; a program exported
# with symbolic sizes runs on a second draw of SIZES_2. The batch size and the numbers of
# queries and keys differ from every other size, so that an axis is known by its size.
SIZES = (2, 3, 5, 2)
SIZES_2 = (5, 4, 7, 2)
# The ways the attention layers are exported: with the example's shapes, and with a symbolic
# batch size and numbers of queries and keys (jax.export.symbolic_shape)
WAYS = ["static", "symbolic"]


@pytest.fixture(scope="module")
def J():
    """The JAX backend module; a missing JAX fails here when JAX is required."""
    return backend_module("jax")


# Inputs


def _draws(shapes, kinds, sizes=(SIZES, SIZES)):
    return draws(shapes, kinds, sizes)


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


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kinds", ATTENTION_MASKS, ids="+".join)
@pytest.mark.parametrize("name", LAYERS)
def test_exported_attention_gives_the_reference(J, name, kinds, way):
    _check_layer(J, name, LAYERS[name], _draws(attention_shapes, kinds, _sizes(way)), way)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("config", "kinds"), MULTIHEAD_CASES.values(), ids=MULTIHEAD_CASES)
def test_exported_multihead_attention_gives_the_reference(J, config, kinds, way):
    config = {**LAYERS["MultiHeadAttention"], **config}
    draws = _draws(attention_shapes, kinds, _sizes(way))
    _check_layer(J, "MultiHeadAttention", config, draws, way)


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


@pytest.mark.parametrize(
    ("name", "config", "num_inputs", "kwargs"), OTHER_CASES.values(), ids=OTHER_CASES
)
def test_exported_encodings_and_add_norm_give_the_reference(J, name, config, num_inputs, kwargs):
    # Sequences of 5 positions (max_len 10); RotaryEmbedding's offset is a Python int, part of
    # the program as under jit
    draws = _draws(lambda B, Q, K: [(B, Q + 2, 8)] * num_inputs, [])
    _check_layer(J, name, config, [(args, kwargs) for args, _ in draws])


def test_longrope_past_its_original_length_follows_a_symbolic_length(J):
    # Exported on 5 keys, within the original 6, run on 7: the program picks the long factors
    # (as the eager layer does); dynamic, whose frequencies follow every length, is refused.
    # Heads of 4 features: two pairs turn
    longrope = {"rope_type": "longrope", "original_max_position_embeddings": 6}
    longrope.update(factor=4.0, short_factor=[1.0, 1.5], long_factor=[2.0, 5.0])
    config = {**LAYERS["MultiHeadAttention"], "num_hiddens": 16, "rope_theta": 1e4}
    draws = _draws(attention_shapes, ["causal", "valid_lens_1d"], (SIZES, SIZES_2))
    assert SIZES[2] <= 6 < SIZES_2[2]
    _check_layer(J, "MultiHeadAttention", {**config, "rope_scaling": longrope}, draws, "symbolic")
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 6}
    with pytest.raises(ValueError, match="dynamic rotary scaling"):
        _check_layer(
            J, "MultiHeadAttention", {**config, "rope_scaling": dynamic}, draws, "symbolic"
        )
