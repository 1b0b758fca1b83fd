"""The layers' `alignment`, the attention function's: where the causal mask, the sliding window
and ALiBi put the first query when queries and keys differ in number. Each call is held to the
same layer given the keep-mask worked out by hand, in every backend, and to the reference."""

from __future__ import annotations

import numpy as np
import pytest

import mha
from conftest import backend_module, backend_params, required_import

BACKENDS = backend_params()
Q, K = 3, 5


def _hand_mask(first: int, band: int | None = None) -> np.ndarray:
    """(Q, K): query i, at position first + i, keeps keys j <= first + i, and with a band only
    those with first + i - j < band."""
    position = first + np.arange(Q)[:, None]
    keep = np.arange(K)[None, :] <= position
    if band is not None:
        keep &= position - np.arange(K)[None, :] < band
    return keep


def _numbers(name, layer_name, config, rng, **call):
    """(the layer's output with call, the output of the same weights with `hand`, mha's mask
    worked by hand, instead and no sliding window, the NumPy reference's output with call) on
    one draw."""
    module = backend_module(name)
    hand = call.pop("hand")
    layer = getattr(module, layer_name)(**config)
    queries = rng.standard_normal((2, Q, 4)).astype(np.float32)
    keys = rng.standard_normal((2, K, 4)).astype(np.float32)
    tensors = [module.from_numpy(x) for x in (queries, keys, keys)]
    output = module.to_numpy(layer(*tensors, **call))
    weights = mha.get_weights(layer)
    reference = getattr(backend_module("numpy"), layer_name)(**config)
    mha.set_weights(reference, weights)
    expected = reference(queries, keys, keys, **call)
    plain = {k: v for k, v in config.items() if k not in ("sliding_window", "attention_chunk_size")}
    by_hand = getattr(module, layer_name)(**plain)
    mha.set_weights(by_hand, weights)
    by_hand = module.to_numpy(by_hand(*tensors, mask=module.from_numpy(hand)))
    return output, by_hand, expected


@pytest.mark.parametrize(
    "alignment, first",
    [("top_left", 0), ("bottom_right", K - Q), (1, 1), (-1, -1), (np.int64(1), 1)],
    ids=["top_left", "bottom_right", "1", "-1", "numpy 1"],
)
@pytest.mark.parametrize("name", BACKENDS)
def test_causal_keeps_the_keys_of_the_alignments_first_position(name, alignment, first, rng):
    for layer_name, config in (
        ("DotProductAttention", {}),
        ("AdditiveAttention", {"num_hiddens": 4}),
        ("MultiHeadAttention", {"num_hiddens": 4, "num_heads": 2, "num_kv_heads": 1}),
    ):
        # alignment -1: the first query is before every key, a row with no key (zeros)
        output, by_hand, expected = _numbers(
            name,
            layer_name,
            config,
            rng,
            causal=True,
            alignment=alignment,
            hand=_hand_mask(first),
        )
        np.testing.assert_allclose(output, by_hand, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_sliding_window_follows_the_alignment(name, rng):
    config = {"num_hiddens": 4, "num_heads": 2, "sliding_window": 2}
    output, by_hand, expected = _numbers(
        name,
        "MultiHeadAttention",
        config,
        rng,
        causal=True,
        alignment="bottom_right",
        hand=_hand_mask(K - Q, band=2),
    )
    np.testing.assert_allclose(output, by_hand, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "size, first",
    [(2**31, 0), (2**32, 2**32 - 2), (2**25, 2**25 - 2), (2**40, 2**40 - 1)],
    ids=["chunk-2**31", "chunk-2**32", "chunk-2**25", "chunk-2**40"],
)
@pytest.mark.parametrize("name", BACKENDS)
def test_chunks_far_out_keep_the_keys_of_their_chunk(name, size, first, rng):
    """Chunks and positions past int32's range (and float32's whole numbers) split queries and
    keys where whole numbers do: query i, at position first + i, keeps the keys of its chunk,
    (first + i) // size, as the hand mask counts in Python; none is wrapped into another.
    JAX without its 64-bit mode counts positions in int32 and refuses them by name."""
    hand = (first + np.arange(Q)[:, None]) // size == np.arange(K)[None, :] // size
    config = {"num_hiddens": 4, "num_heads": 2, "attention_chunk_size": size}
    x64 = name != "jax" or required_import("jax").config.jax_enable_x64
    if not x64 and max(size, first + K) >= 2**31:
        with pytest.raises(ValueError, match="int32's range"):
            _numbers(name, "MultiHeadAttention", config, rng, alignment=first, hand=hand)
        return
    output, by_hand, expected = _numbers(
        name, "MultiHeadAttention", config, rng, alignment=first, hand=hand
    )
    np.testing.assert_allclose(output, by_hand, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)


# Queries at 2**24 - 1, 2**24 and 2**24 + 1: float32 has no 2**24 + 1, and a first query
# below 2**24 does not say that a later one passes it
STRADDLING = 2**24 - 1


@pytest.mark.parametrize("name", BACKENDS)
def test_queries_that_straddle_float32s_whole_numbers_keep_their_own_keys(name, rng):
    # Expected, by hand: the last query keeps keys 2 to 4 of a window of 2**24 (key 1 too if
    # its position rounded to 2**24) and none in a chunk of 2**24 + 1 (every key if it did)
    position, key = STRADDLING + np.arange(Q)[:, None], np.arange(K)[None, :]
    for option, hand in (
        ({"sliding_window": 2**24}, np.abs(position - key) < 2**24),
        ({"attention_chunk_size": 2**24 + 1}, position // (2**24 + 1) == key // (2**24 + 1)),
    ):
        assert hand[-1].sum() in (0, 3)  # the rounded position would keep 4 or 5
        config = {"num_hiddens": 4, "num_heads": 2, **option}
        output, by_hand, expected = _numbers(
            name, "MultiHeadAttention", config, rng, alignment=STRADDLING, hand=hand
        )
        np.testing.assert_allclose(output, by_hand, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_the_functions_window_keeps_its_keys_where_queries_straddle_2_to_the_24(name, rng):
    # Expected: query i, at STRADDLING + i, keeps keys p - (2**24 - 1) <= j <= p, by hand:
    # keys 2 to 4 for the last (1 to 4 had its position rounded to 2**24)
    module = backend_module(name)
    position, key = STRADDLING + np.arange(Q)[:, None], np.arange(K)[None, :]
    hand = (position - key <= 2**24 - 1) & (key <= position)
    assert hand[-1].tolist() == [False, False, True, True, True]
    query, key_, value = (rng.standard_normal((2, 2, n, 4)).astype(np.float32) for n in (Q, K, K))
    tensors = [module.from_numpy(x) for x in (query, key_, value)]
    window = (2**24 - 1, 0)
    output = module.to_numpy(
        module.dot_product_attention(*tensors, window=window, alignment=STRADDLING)
    )
    by_hand = module.to_numpy(module.dot_product_attention(*tensors, mask=module.from_numpy(hand)))
    np.testing.assert_allclose(output, by_hand, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
def test_a_window_over_a_cache_past_2_to_the_24_keeps_the_keys_at_its_own_positions(name, rng):
    # Queries at 2**24 and 2**24 + 1 after a cache of 2**24 positions, causal, a window of 2:
    # each keeps its own key and the one before, as queries at 2 and 3 after the cache's last
    # two positions alone do. Key 2**24 + 1 counted in float32 is 2**24: the first query
    # would keep it too (and so the numbers of the whole cache would differ from these)
    module = backend_module(name)
    config = {"num_hiddens": 2, "num_heads": 1, "sliding_window": 2, "query_size": 2}
    config.update(key_size=2, value_size=2)
    layer = module.MultiHeadAttention(**config)
    mha.set_weights(layer, mha.random_weights("MultiHeadAttention", seed=0, **config))
    keys, values = (rng.standard_normal((1, 1, 2**24, 2)).astype(np.float32) for _ in range(2))
    x = module.from_numpy(rng.standard_normal((1, 2, 2)).astype(np.float32))
    outputs = []
    for cached in (slice(None), slice(-2, None)):
        cache = mha.KVCache(
            module.from_numpy(keys[:, :, cached]), module.from_numpy(values[:, :, cached])
        )
        outputs.append(module.to_numpy(layer(x, x, x, causal=True, cache=cache)[0]))
        del cache
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", BACKENDS)
def test_the_default_is_top_left_and_after_the_cache(name, rng):
    module = backend_module(name)
    layer = module.MultiHeadAttention(num_hiddens=4, num_heads=2, rope_theta=10000.0)
    queries = rng.standard_normal((2, Q, 4)).astype(np.float32)
    keys = rng.standard_normal((2, K, 4)).astype(np.float32)
    X, Y = (module.from_numpy(x) for x in (queries, keys))
    default = module.to_numpy(layer(X, Y, Y, causal=True))
    top_left = module.to_numpy(layer(X, Y, Y, causal=True, alignment="top_left"))
    np.testing.assert_array_equal(default, top_left)
    # Decoding: after two cached positions, the third query is the last key's neighbour,
    # as bottom_right places it; rotary positions follow the cache either way
    _, cache = layer(Y[:, :2], Y[:, :2], Y[:, :2], causal=True, cache=mha.KVCache())
    after_cache, _ = layer(Y[:, 2:], Y[:, 2:], Y[:, 2:], causal=True, cache=cache)
    aligned, _ = layer(
        Y[:, 2:], Y[:, 2:], Y[:, 2:], causal=True, cache=cache, alignment="bottom_right"
    )
    np.testing.assert_array_equal(module.to_numpy(after_cache), module.to_numpy(aligned))
    whole = layer(Y, Y, Y, causal=True)
    np.testing.assert_allclose(
        module.to_numpy(after_cache), module.to_numpy(whole)[:, 2:], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("name", BACKENDS)
def test_an_alignment_of_0_is_top_left_after_a_cache_too(name, rng):
    # alignment=0, an int, places the first query at position 0 as "top_left" does, not
    # after the cached positions: the same layer given that mask by hand over every key
    module = backend_module(name)
    layer = module.MultiHeadAttention(num_hiddens=4, num_heads=2)
    Y = module.from_numpy(rng.standard_normal((2, K, 4)).astype(np.float32))
    _, cache = layer(Y[:, :2], Y[:, :2], Y[:, :2], causal=True, cache=mha.KVCache())
    new = Y[:, K - Q :]  # the Q positions after the 2 cached ones
    by_hand = module.to_numpy(layer(new, Y, Y, mask=module.from_numpy(_hand_mask(0))))
    for alignment in (0, "top_left"):
        aligned, _ = layer(new, new, new, causal=True, cache=cache, alignment=alignment)
        np.testing.assert_allclose(module.to_numpy(aligned), by_hand, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("num_kv_heads", [1, 2], ids=["grouped", "every head"])
def test_without_weights_causal_follows_the_alignment_and_the_cache(name, num_kv_heads, rng):
    # need_weights=False reaches the frameworks' fused kernels, whose own causal mask is
    # top-left: bottom_right, an int alignment and queries after a cache are not, and each
    # call is held to the same layer given that mask by hand over every key
    module = backend_module(name)
    layer = module.MultiHeadAttention(num_hiddens=4, num_heads=2, num_kv_heads=num_kv_heads)
    Y = module.from_numpy(rng.standard_normal((2, K, 4)).astype(np.float32))
    new = Y[:, K - Q :]
    for alignment, first in (("bottom_right", K - Q), (1, 1), ("top_left", 0)):
        found = layer(new, Y, Y, causal=True, alignment=alignment, need_weights=False)
        by_hand = layer(new, Y, Y, mask=module.from_numpy(_hand_mask(first)))
        np.testing.assert_allclose(
            module.to_numpy(found), module.to_numpy(by_hand), rtol=1e-5, atol=1e-6
        )
    # Decoding: the Q queries after K - Q cached positions, as bottom_right places them
    _, cache = layer(Y[:, : K - Q], Y[:, : K - Q], Y[:, : K - Q], cache=mha.KVCache())
    found, _ = layer(new, new, new, causal=True, cache=cache, need_weights=False)
    by_hand = layer(new, Y, Y, mask=module.from_numpy(_hand_mask(K - Q)))
    np.testing.assert_allclose(
        module.to_numpy(found), module.to_numpy(by_hand), rtol=1e-5, atol=1e-6
    )
