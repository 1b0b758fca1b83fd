"""Packed sequences in the layers: segment_ids keep each query to its own sequence, and rotary
positions restart at each one, so that a packed row gives the numbers of its sequences run one
by one, in every backend."""

from __future__ import annotations

import numpy as np
import pytest

import mha
from conftest import backend_module, backend_params

BACKENDS = backend_params()

# Each row of the batch: the lengths of the sequences packed into it, seven positions each
ROWS = ((3, 4), (5, 2))
CONFIGS = {
    "rotary, grouped heads, causal": (
        "MultiHeadAttention",
        {"num_hiddens": 8, "num_heads": 4, "num_kv_heads": 2, "rope_theta": 10000.0},
        {"causal": True},
    ),
    "ALiBi and a sliding window, causal": (
        "MultiHeadAttention",
        {"num_hiddens": 8, "num_heads": 2, "alibi": True, "sliding_window": 2},
        {"causal": True},
    ),
    # Each segment's queries scaled by their own positions, which L = 2 tells apart
    "query scaling by position, causal": (
        "MultiHeadAttention",
        {
            "num_hiddens": 8,
            "num_heads": 2,
            "rope_theta": 100.0,
            "query_scaling": {"beta": 0.5, "original_max_position_embeddings": 2},
        },
        {"causal": True},
    ),
    "rotary, no weights": (
        "MultiHeadAttention",
        {"num_hiddens": 8, "num_heads": 2, "rope_theta": 500.0, "rope_interleaved": True},
        {"need_weights": False},
    ),
    # Causal alone takes the frameworks' own causal kernels: the segments must not be lost
    "causal, no weights": (
        "MultiHeadAttention",
        {"num_hiddens": 8, "num_heads": 2},
        {"causal": True, "need_weights": False},
    ),
    # alignment places each sequence's queries as it places a sequence's alone
    "chunks, a window and ALiBi, aligned at 3": (
        "MultiHeadAttention",
        {"num_hiddens": 8, "num_heads": 2, "attention_chunk_size": 2, "sliding_window": 3}
        | {"alibi": True},
        {"causal": True, "alignment": 3},
    ),
    # Not causal: the window's future side reads the packed distances too
    "a sliding window, not causal": (
        "MultiHeadAttention",
        {"num_hiddens": 8, "num_heads": 2, "sliding_window": 2},
        {},
    ),
    "dot product": ("DotProductAttention", {}, {}),
    "additive, causal": ("AdditiveAttention", {"num_hiddens": 8}, {"causal": True}),
}


def _segment_ids(rows) -> np.ndarray:
    """(batch, positions): each sequence of a row numbered 0, 1, ..."""
    return np.stack([np.repeat(np.arange(len(row)), row) for row in rows]).astype(np.int64)


# Segments need not be contiguous: each position's sequence, in any order
INTERLEAVED = np.array([[0, 1, 0, 0, 1, 2, 1], [1, 0, 1, 0, 1, 0, 1]], np.int64)
LAYOUTS = {"one after another": _segment_ids(ROWS), "interleaved": INTERLEAVED}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", BACKENDS)
def test_a_packed_row_gives_the_numbers_of_its_sequences_alone(name, config, layout, rng):
    # Causal, the window, chunks and ALiBi read each position's place within its own
    # sequence, as rotary embeddings do: the row's positions would put other keys in the window
    module = backend_module(name)
    layer_name, arguments, call = CONFIGS[config]
    layer = getattr(module, layer_name)(**arguments)
    X = rng.standard_normal((2, 7, 8)).astype(np.float32)
    ids = module.from_numpy(LAYOUTS[layout])
    packed = module.to_numpy(layer(*[module.from_numpy(X)] * 3, segment_ids=ids, **call))
    for b, row in enumerate(LAYOUTS[layout]):
        for segment in np.unique(row):
            where = np.flatnonzero(row == segment)
            alone = module.from_numpy(X[b : b + 1, where])
            expected = module.to_numpy(layer(alone, alone, alone, **call))[0]
            np.testing.assert_allclose(packed[b, where], expected, rtol=1e-5, atol=1e-5)


CROSS = {
    "rotary": ({"rope_theta": 10000.0}, {}),
    # Each sequence's queries from its own first position: the row's would misplace them
    "rotary, causal": ({"rope_theta": 10000.0}, {"causal": True}),
    "ALiBi and a window, causal": ({"alibi": True, "sliding_window": 2}, {"causal": True}),
}


@pytest.mark.parametrize("cross", CROSS)
@pytest.mark.parametrize("name", BACKENDS)
def test_packed_queries_and_keys_of_their_own(name, cross, rng):
    # Cross-attention over packed rows: query ids (batch, Q) and key ids (batch, K)
    module = backend_module(name)
    options, call = CROSS[cross]
    config = {"num_hiddens": 8, "num_heads": 2, **options}
    layer = module.MultiHeadAttention(**config)
    queries_rows, keys_rows = ((2, 3),), ((4, 3),)
    queries = rng.standard_normal((1, 5, 8)).astype(np.float32)
    keys = rng.standard_normal((1, 7, 8)).astype(np.float32)
    # The query ids in int32, the key ids in int64: ids of two dtypes compare as numbers
    ids = (_segment_ids(queries_rows).astype(np.int32), _segment_ids(keys_rows))
    pair = tuple(module.from_numpy(x) for x in ids)
    packed = module.to_numpy(
        layer(module.from_numpy(queries), *[module.from_numpy(keys)] * 2, segment_ids=pair, **call)
    )
    reference = backend_module("numpy").MultiHeadAttention(**config)
    mha.set_weights(reference, mha.get_weights(layer))
    q0 = k0 = 0
    for q_len, k_len in zip(queries_rows[0], keys_rows[0], strict=True):
        k = keys[:, k0 : k0 + k_len]
        expected = reference(queries[:, q0 : q0 + q_len], k, k, **call)
        np.testing.assert_allclose(packed[:, q0 : q0 + q_len], expected, rtol=1e-4, atol=1e-5)
        q0, k0 = q0 + q_len, k0 + k_len


@pytest.mark.parametrize(
    "arguments, call, message",
    [
        ({}, {"cache": "empty"}, "segment_ids cannot be given with a cache"),
        ({}, {"segment_ids": np.zeros((2, 6), np.int64)}, "segment_ids of the queries must be"),
        ({}, {"segment_ids": np.zeros((2, 7), np.float32)}, "must be integers"),
        (
            {
                "rope_theta": 10000.0,
                "rope_scaling": {
                    "rope_type": "dynamic",
                    "factor": 2.0,
                    "original_max_position_embeddings": 4,
                },
            },
            {},
            "need rows of at most its original_max_position_embeddings (4)",
        ),
        (
            {
                "rope_theta": 10000.0,
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0, 1.0],
                    "long_factor": [2.0, 2.0],
                    "original_max_position_embeddings": 6,
                },
            },
            {},
            # Rows of 7 positions, one past the 6: their frequencies would be the long ones
            "need rows of at most its original_max_position_embeddings (6)",
        ),
    ],
    ids=[
        "with a cache",
        "wrong length",
        "floats",
        "dynamic scaling, longer rows",
        "longrope scaling, one position longer",
    ],
)
@pytest.mark.parametrize("name", BACKENDS)
def test_bad_packing_is_refused(name, arguments, call, message, rng):
    module = backend_module(name)
    layer = module.MultiHeadAttention(num_hiddens=8, num_heads=2, **arguments)
    X = module.from_numpy(rng.standard_normal((2, 7, 8)).astype(np.float32))
    call = dict(call)
    segment_ids = call.pop("segment_ids", _segment_ids(ROWS))
    if call.get("cache") == "empty":
        call["cache"] = mha.KVCache()
    with pytest.raises(ValueError, match=None) as error:
        layer(X, X, X, segment_ids=module.from_numpy(segment_ids), **call)
    assert message in str(error.value)


def _compiled(name, module, layer):
    """A call of `layer` (X, segment_ids, alignment fixed) under the framework's compiler."""

    def call(X, keys, segment_ids):
        return layer(X, keys, keys, segment_ids=segment_ids, causal=True, alignment=1)

    if name == "torch":
        return module.torch.compile(call, dynamic=False)
    if name == "tensorflow":
        return module.tf.function(call)
    if name == "jax":
        jitted = module.nnx.jit(
            lambda layer, X, keys, ids: layer(
                X, keys, keys, segment_ids=ids, causal=True, alignment=1
            )
        )
        return lambda *tensors: jitted(layer, *tensors)
    layer.hybridize()  # mxnet: the graph takes the segment ids as inputs
    return call


@pytest.mark.parametrize("name", backend_params(["torch", "tensorflow", "jax", "mxnet"]))
def test_a_compiled_layer_packs_and_aligns_as_the_reference(name, rng):
    # Packed rows and an alignment, through torch.compile, tf.function, nnx.jit and a
    # hybridized graph: the reference's numbers
    module = backend_module(name)
    config = {"num_hiddens": 8, "num_heads": 4, "num_kv_heads": 2, "rope_theta": 10000.0}
    # Each position's place in its interleaved sequence, for the window, chunks and ALiBi
    config |= {"sliding_window": 3, "attention_chunk_size": 2, "alibi": True}
    sizes = {"query_size": 8, "key_size": 8, "value_size": 8}
    layer = module.MultiHeadAttention(**config, **sizes)
    reference = backend_module("numpy").MultiHeadAttention(**config, **sizes)
    mha.set_weights(reference, mha.get_weights(layer))
    X = rng.standard_normal((2, 7, 8)).astype(np.float32)
    segment_ids = INTERLEAVED
    expected = reference(X, X, X, segment_ids=segment_ids, causal=True, alignment=1)
    compiled = _compiled(name, module, layer)
    tensors = [module.from_numpy(x) for x in (X, X, segment_ids)]
    output = module.to_numpy(compiled(*tensors))
    np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)
