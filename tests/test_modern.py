"""Grouped-query attention, rotary embeddings and sliding windows, against their definitions.

mha.harness holds every backend to the NumPy reference; these tests hold the reference (and,
through the backend fixture, every backend) to independent computations: rotary embeddings
as complex rotations, grouped-query attention as multi-head attention whose key and value
heads are copies, a sliding window as the keep-mask it stands for.
"""

from __future__ import annotations

import numpy as np
import pytest

import mha
from conftest import assert_agrees, backend_module, backend_params
from mha.backends import numpy as reference


def _complex_rotation(X, positions, theta, interleaved):
    """RoPE as the paper writes it: pair (a, b) is the complex number a + ib, multiplied by
    exp(i * position * theta^(-2k / d)) for pair k."""
    d = X.shape[-1]
    if interleaved:
        z = X[..., 0::2] + 1j * X[..., 1::2]
    else:
        z = X[..., : d // 2] + 1j * X[..., d // 2 :]
    frequencies = theta ** (-np.arange(d // 2) * 2.0 / d)
    z = z * np.exp(1j * positions[:, None] * frequencies[None, :])
    out = np.empty_like(X)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : d // 2], out[..., d // 2 :] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_is_a_complex_rotation(backend, rng, interleaved):
    X = rng.standard_normal((2, 3, 5, 8))
    rotary = backend.RotaryEmbedding(8, 500.0, interleaved=interleaved, dtype="float64")
    out = backend.to_numpy(rotary(backend.from_numpy(X), offset=4))
    expected = _complex_rotation(X, np.arange(4, 9, dtype=float), 500.0, interleaved)
    assert_agrees(out, expected, "float64")


def test_proportional_rotary_turns_its_first_pairs_at_the_whole_heads_frequencies(backend, rng):
    # Gemma 4's full layers, by hand: of a head of 16, pair i < 4 (half the head, 8 features)
    # turns at 100^(-2i / 16) / 2, as in the whole head's table; pairs 4 to 7 do not turn
    X = rng.standard_normal((2, 3, 5, 16))
    scaling = {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0}
    rotary = backend.RotaryEmbedding(16, 100.0, scaling=scaling, dtype="float64")
    out = backend.to_numpy(rotary(backend.from_numpy(X), offset=3))
    pairs = np.arange(8)
    frequencies = np.where(pairs < 4, 100.0 ** (-2 * pairs / 16) / 2, 0.0)
    z = (X[..., :8] + 1j * X[..., 8:]) * np.exp(1j * np.arange(3, 8)[:, None] * frequencies)
    assert_agrees(out, np.concatenate([z.real, z.imag], axis=-1), "float64")
    np.testing.assert_array_equal(out[..., 4:8], X[..., 4:8])  # frequency 0: unturned


def test_rotary_scores_depend_on_relative_positions_only(backend, rng):
    # <R(p) q, R(s) k> = <R(p + t) q, R(s + t) k>: RoPE's reason for being
    q, k = rng.standard_normal((1, 1, 8)), rng.standard_normal((1, 1, 8))
    rotary = backend.RotaryEmbedding(8, dtype="float64")

    def score(p, s):
        rq = backend.to_numpy(rotary(backend.from_numpy(q), offset=p))
        rk = backend.to_numpy(rotary(backend.from_numpy(k), offset=s))
        return float((rq * rk).sum())

    assert abs(score(3, 1) - score(10, 8)) < 1e-12
    assert abs(score(0, 5) - score(7, 12)) < 1e-12
    assert abs(score(3, 1) - score(3, 2)) > 1e-3  # and it does depend on the distance


def test_rotary_embedding_leaves_position_zero_unchanged(backend, rng):
    X = rng.standard_normal((2, 1, 6))
    out = backend.to_numpy(backend.RotaryEmbedding(6, dtype="float64")(backend.from_numpy(X)))
    np.testing.assert_array_equal(out, X)


def _expanded(weights, num_heads, num_kv_heads, num_hiddens):
    """The multi-head weights equal to grouped-query ones: each key-value head's columns
    copied to the query heads of its group."""
    head = num_hiddens // num_heads
    group = num_heads // num_kv_heads
    expanded = dict(weights)
    for name in ("W_k", "W_v", "b_k", "b_v"):
        if name in weights:
            blocks = np.split(weights[name], num_kv_heads, axis=-1)
            expanded[name] = np.concatenate([b for b in blocks for _ in range(group)], axis=-1)
            assert expanded[name].shape[-1] == head * num_heads
    return expanded


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_grouped_query_attention_is_multihead_attention_with_shared_heads(
    backend, rng, num_kv_heads
):
    config = dict(
        num_hiddens=8,
        num_heads=4,
        bias=True,
        query_size=6,
        key_size=5,
        value_size=3,
        dtype="float64",
    )
    gqa = mha.random_weights("MultiHeadAttention", num_kv_heads=num_kv_heads, seed=3, **config)
    assert gqa["W_k"].shape == (5, 2 * num_kv_heads)
    layer = backend.MultiHeadAttention(num_kv_heads=num_kv_heads, **config)
    mha.set_weights(layer, gqa)
    full = reference.MultiHeadAttention(**config)
    mha.set_weights(full, _expanded(gqa, 4, num_kv_heads, 8))
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 6), (2, 7, 5), (2, 7, 3)))
    valid_lens = np.array([3, 7])
    out = layer(*map(backend.from_numpy, (q, k, v)), backend.from_numpy(valid_lens))
    expected = full(q, k, v, valid_lens)
    assert_agrees(backend.to_numpy(out), expected, "float64")
    assert_agrees(backend.to_numpy(layer.attention_weights), full.attention_weights, "float64")


def _refuse_repeats(name: str, monkeypatch) -> None:
    """Make the function that would repeat keys and values per query head raise in `name`."""

    def refuse(*args, **kwargs):
        raise AssertionError("keys or values repeated for each query head")

    if name == "torch":
        import torch

        monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    elif name == "tensorflow":
        import tensorflow as tf

        monkeypatch.setattr(tf, "repeat", refuse)
    else:
        import jax.numpy as jnp

        monkeypatch.setattr(jnp, "repeat", refuse)


LATENT_SIZES = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("name", ["torch", "tensorflow", "jax"])
def test_grouped_heads_and_the_absorbed_latent_read_the_keys_without_copies(
    name, rng, monkeypatch, need_weights
):
    """torch, TensorFlow and JAX attend with fewer key-value heads than query heads (grouped
    queries under every mask kind, a decoding step after a cache, the latent layer's absorbed
    form) without repeating keys or values per query head: the repeat raises, and the numbers
    are the reference's, which repeats them."""
    backend = backend_module(name)
    _refuse_repeats(name, monkeypatch)
    B, Q, K = 2, 3, 5
    config = dict(num_hiddens=8, num_heads=4, num_kv_heads=2, dtype="float64", rope_theta=1e4)
    sizes = dict(query_size=8, key_size=8, value_size=8)
    weights = mha.random_weights("MultiHeadAttention", seed=1, **config, **sizes)
    q, kv = rng.standard_normal((B, Q, 8)), rng.standard_normal((B, K, 8))
    calls = [
        {"valid_lens": np.array([2, 5])},
        {"valid_lens": rng.integers(0, 6, (B, Q)).astype(np.float64)},
        {"mask": rng.random((B, 4, Q, K)) > 0.3},
        {"causal": True, "alignment": "bottom_right"},
        {"attn_bias": rng.standard_normal((B, 4, Q, K)), "causal": True},
    ]
    for arguments in calls:
        layer = backend.MultiHeadAttention(**config, **sizes)
        expected = reference.MultiHeadAttention(**config, **sizes)
        for each in (layer, expected):
            mha.set_weights(each, weights)
        wanted = expected(q, kv, kv, **arguments)
        given = {
            k: backend.from_numpy(v) if isinstance(v, np.ndarray) else v
            for k, v in arguments.items()
        }
        output = layer(*map(backend.from_numpy, (q, kv, kv)), need_weights=need_weights, **given)
        assert_agrees(backend.to_numpy(output), wanted, "float64")
    # The latent layer's absorbed form, and a decoding step after a cache of it
    latent = mha.random_weights(
        "MultiHeadLatentAttention",
        seed=2,
        num_hiddens=8,
        num_heads=4,
        **LATENT_SIZES,
        dtype="float64",
    )
    layer = backend.MultiHeadLatentAttention(8, 4, **LATENT_SIZES, dtype="float64")
    expected = reference.MultiHeadLatentAttention(8, 4, **LATENT_SIZES, dtype="float64")
    for each in (layer, expected):
        mha.set_weights(each, latent)
    X = rng.standard_normal((B, 4, 8))
    wanted = expected(X, np.array([3, 4]), causal=True)
    _, cache = layer(
        backend.from_numpy(X[:, :3]), causal=True, absorbed=True, cache=backend.LatentCache()
    )
    output, _ = layer(
        backend.from_numpy(X[:, 3:]),
        backend.from_numpy(np.array([3, 4])),
        causal=True,
        absorbed=True,
        need_weights=need_weights,
        cache=cache,
    )
    assert_agrees(backend.to_numpy(output), wanted[:, 3:], "float64")


@pytest.mark.parametrize("causal", [False, True])
def test_a_sliding_window_is_its_band_mask(backend, rng, causal):
    q, k, v = (rng.standard_normal(s) for s in ((2, 6, 4), (2, 6, 4), (2, 6, 3)))
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    band = np.abs(i - j) < 3
    if causal:  # Mistral's window: the query and the two keys before it
        band &= j <= i
    expected = reference.DotProductAttention(dtype="float64")(q, k, v, mask=band)
    layer = backend.DotProductAttention(sliding_window=3, dtype="float64")
    out = layer(*map(backend.from_numpy, (q, k, v)), causal=causal)
    assert_agrees(backend.to_numpy(out), expected, "float64")
    kept = backend.to_numpy(layer.attention_weights) > 0
    np.testing.assert_array_equal(kept, np.broadcast_to(band, kept.shape))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_chunks_are_their_block_mask(backend, rng, causal):
    # Chunks of 3 positions: queries and keys 0-2, 3-5, 6 attend among themselves; packed
    # rows restart them at each segment (segments of 4 and 3: chunks 0-2, 3 and 4-6)
    i, j = np.arange(7)[:, None], np.arange(7)[None, :]
    blocks = i // 3 == j // 3
    within = np.array([0, 1, 2, 3, 0, 1, 2])
    segments = np.array([0, 0, 0, 0, 1, 1, 1])
    packed = (segments[:, None] == segments[None, :]) & (within[:, None] // 3 == within // 3)
    if causal:  # Llama 4's chunked attention: the keys up to the query, in its chunk
        blocks, packed = blocks & (j <= i), packed & (j <= i)
    config = dict(num_hiddens=8, num_heads=4, num_kv_heads=2, dtype="float64")
    weights = mha.random_weights(
        "MultiHeadAttention", seed=5, **config, query_size=8, key_size=8, value_size=8
    )
    plain = reference.MultiHeadAttention(**config)
    mha.set_weights(plain, weights)
    x, lengths = rng.standard_normal((2, 7, 8)), np.array([7, 5])
    layer = backend.MultiHeadAttention(attention_chunk_size=3, **config)
    mha.set_weights(layer, weights)
    arrays = [backend.from_numpy(a) for a in (x, x, x, lengths)]
    for keep, given in ((blocks, {}), (packed, {"segment_ids": np.stack([segments] * 2)})):
        expected = plain(x, x, x, lengths, mask=np.broadcast_to(keep, (2, 7, 7)))
        extra = {key: backend.from_numpy(value) for key, value in given.items()}
        out = layer(*arrays, causal=causal, **extra)
        assert_agrees(backend.to_numpy(out), expected, "float64")
        kept = backend.to_numpy(layer.attention_weights) > 0
        np.testing.assert_array_equal(kept, plain.attention_weights > 0)


def test_alibi_adds_each_heads_slope_times_the_distance(backend, rng):
    # 6 heads, by hand from BLOOM's rule: the powers of 2 ** -2 for the 4 heads of the power
    # of 2 below 6, then the odd powers of 2 ** -1 for the other 2
    slopes = 2.0 ** -np.array([2, 4, 6, 8, 1, 3])
    i, j = np.arange(5)[:, None], np.arange(5)[None, :]
    bias = (slopes[:, None, None] * (j - i))[None]  # (1, heads, queries, keys)
    x, lengths = rng.standard_normal((2, 5, 12)), np.array([5, 3])
    config = dict(num_hiddens=12, num_heads=6, bias=True, dtype="float64")
    sizes = dict(query_size=12, key_size=12, value_size=12)
    weights = mha.random_weights("MultiHeadAttention", seed=3, **sizes, **config)
    plain = reference.MultiHeadAttention(**config)
    mha.set_weights(plain, weights)
    expected = plain(x, x, x, lengths, causal=True, attn_bias=bias)
    layer = backend.MultiHeadAttention(alibi=True, **config)
    mha.set_weights(layer, weights)
    if hasattr(layer, "hybridize"):  # MXNet: the slopes are an input of the traced graph
        layer.hybridize()
    for _ in range(2):
        out = layer(*[backend.from_numpy(x)] * 3, backend.from_numpy(lengths), causal=True)
        assert_agrees(backend.to_numpy(out), expected, "float64")
    assert_agrees(backend.to_numpy(layer.attention_weights), plain.attention_weights, "float64")


def test_alibi_and_a_given_attn_bias_both_add_to_the_scores(backend, rng):
    # 2 heads, by hand: slopes 2 ** (-8k / 2) for k = 1, 2. A call's own attn_bias (with a
    # -inf entry) and a float window mask add beside ALiBi's: the plain layer gets their sum
    slopes = 2.0 ** -np.array([4.0, 8.0])
    i, j = np.arange(5)[:, None], np.arange(5)[None, :]
    alibi = (slopes[:, None, None] * (j - i))[None]  # (1, heads, queries, keys)
    given = rng.standard_normal((2, 2, 5, 5))
    given[0, 1, 3, 1] = -np.inf
    window = rng.standard_normal((1, 5, 5))
    x, lengths = rng.standard_normal((2, 5, 8)), np.array([5, 4])
    config = dict(num_hiddens=8, num_heads=2, dtype="float64")
    weights = mha.random_weights(
        "MultiHeadAttention", seed=6, query_size=8, key_size=8, value_size=8, **config
    )
    plain = reference.MultiHeadAttention(**config)
    mha.set_weights(plain, weights)
    layer = backend.MultiHeadAttention(alibi=True, **config)
    mha.set_weights(layer, weights)
    tensors = [backend.from_numpy(a) for a in (x, x, x, lengths)]
    for extra, call in (
        (given, {"attn_bias": given}),
        (window[:, None], {"window_mask": window}),
    ):
        expected = plain(x, x, x, lengths, causal=True, attn_bias=alibi + extra)
        given_call = {key: backend.from_numpy(value) for key, value in call.items()}
        out = layer(*tensors, causal=True, **given_call)
        assert_agrees(backend.to_numpy(out), expected, "float64")


@pytest.mark.parametrize(
    "offset, spans", [(None, [0, 0, 1, 1, 2, 2, 3]), (1, [0, 1, 1, 2, 2, 3, 3])]
)
def test_query_scaling_multiplies_each_query_by_its_positions_factor(backend, rng, offset, spans):
    # By hand: positions 0 to 6 over L = 2 are 0, 0, 1, 1, 2, 2, 3 whole spans past the first
    # (1 to 7, Llama 4's position_offset=1: 0, 1, 1, 2, 2, 3, 3), so the factors are
    # 1 + beta * log(1 + that). Without a bias (and before any norm) a scaled query is the
    # projection of a scaled input, which the plain layer is given
    scaling = {"beta": 0.3, "original_max_position_embeddings": 2}
    if offset is not None:
        scaling["position_offset"] = offset
    factors = 1 + 0.3 * np.log(1 + np.array(spans))
    config = dict(num_hiddens=8, num_heads=4, num_kv_heads=2, rope_theta=100.0, dtype="float64")
    weights = mha.random_weights(
        "MultiHeadAttention", seed=4, query_size=8, key_size=8, value_size=8, **config
    )
    plain = reference.MultiHeadAttention(**config)
    mha.set_weights(plain, weights)
    x, lengths = rng.standard_normal((2, 7, 8)), np.array([7, 5])
    expected = plain(x * factors[:, None], x, x, lengths, causal=True)
    layer = backend.MultiHeadAttention(query_scaling=scaling, **config)
    mha.set_weights(layer, weights)
    out = layer(*[backend.from_numpy(x)] * 3, backend.from_numpy(lengths), causal=True)
    assert_agrees(backend.to_numpy(out), expected, "float64")
    # Decoding: the queries of a later call take the positions after the cached ones
    cache, outputs = mha.KVCache(), []
    for start, stop in ((0, 3), (3, 4), (4, 7)):
        part, upto = backend.from_numpy(x[:, start:stop]), np.minimum(lengths, stop)
        output, cache = layer(part, part, part, backend.from_numpy(upto), causal=True, cache=cache)
        outputs.append(backend.to_numpy(output))
    assert_agrees(np.concatenate(outputs, axis=1), expected, "float64")


def test_value_norm_scales_each_heads_values_to_a_mean_square_of_1(backend, rng):
    # Written out: the plain layer's weights (value_norm leaves them), over each key-value
    # head's values divided by their root mean square, each serving two query heads
    config = dict(num_hiddens=8, num_heads=4, num_kv_heads=2, qk_norm_eps=1e-3, dtype="float64")
    sizes = dict(query_size=6, key_size=6, value_size=6)
    weights = mha.random_weights("MultiHeadAttention", seed=8, **sizes, **config)
    plain = reference.MultiHeadAttention(**config)
    mha.set_weights(plain, weights)
    q, kv, lengths = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 5, 6)), [5, 2]
    plain(q, kv, kv, np.array(lengths))
    v = (kv @ weights["W_v"]).reshape(2, 5, 2, 2).transpose(0, 2, 1, 3)
    v = np.repeat(v / np.sqrt(np.mean(v**2, axis=-1, keepdims=True) + 1e-3), 2, axis=1)
    merged = (plain.attention_weights @ v).transpose(0, 2, 1, 3).reshape(2, 3, 8)
    layer = backend.MultiHeadAttention(value_norm=True, **config)
    mha.set_weights(layer, weights)
    arrays = [backend.from_numpy(x) for x in (q, kv, kv, np.array(lengths))]
    assert_agrees(backend.to_numpy(layer(*arrays)), merged @ weights["W_o"], "float64")


def test_latent_query_scaling_decodes_as_one_call(backend, rng):
    # Mistral 4: the queries of a later call take the positions after the cached latents, in
    # the expanded and the absorbed forms
    sizes = dict(num_hiddens=8, num_heads=4, **LATENT_SIZES, dtype="float64")
    scaling = {"beta": 0.5, "original_max_position_embeddings": 2}
    weights = mha.random_weights("MultiHeadLatentAttention", seed=6, **sizes)
    expected = reference.MultiHeadLatentAttention(query_scaling=scaling, **sizes)
    layer = backend.MultiHeadLatentAttention(query_scaling=scaling, **sizes)
    for each in (layer, expected):
        mha.set_weights(each, weights)
    X = rng.standard_normal((2, 6, 8))
    wanted = expected(X, causal=True)
    for absorbed in (False, True):
        cache, outputs = backend.LatentCache(), []
        for start, stop in ((0, 3), (3, 4), (4, 6)):
            part = backend.from_numpy(X[:, start:stop])
            output, cache = layer(part, causal=True, absorbed=absorbed, cache=cache)
            outputs.append(backend.to_numpy(output))
        assert_agrees(np.concatenate(outputs, axis=1), wanted, "float64")


@pytest.mark.parametrize("name", backend_params())
def test_query_scaling_is_kept_by_a_file(name, tmp_path, rng):
    # Written by the reference, read by each backend: the same option, the same numbers;
    # numpy's numbers in it are kept as Python's, which files write
    module = backend_module(name)  # a backend not required and not installed: a skip
    scaling = {"beta": np.float64(0.3), "original_max_position_embeddings": np.int64(2)}
    layer = reference.MultiHeadAttention(
        8, 2, query_size=8, key_size=8, value_size=8, query_scaling=scaling, dtype="float64"
    )
    x = rng.standard_normal((2, 5, 8))
    mha.set_weights(layer, mha.random_weights(layer, seed=1))
    mha.save(layer, tmp_path / "layer.safetensors")
    loaded = mha.load(tmp_path / "layer.safetensors", backend=name)
    assert loaded.query_scaling == scaling
    out = loaded(*[module.from_numpy(x)] * 3, causal=True)
    assert_agrees(module.to_numpy(out), layer(x, x, x, causal=True), "float64")


@pytest.mark.parametrize("qk_norm", [None, "head_after_rotary"])
def test_rope_in_multihead_attention_rotates_each_heads_queries_and_keys(backend, rng, qk_norm):
    # Written out: project, split heads, rotate by the complex formula (then, Hunyuan's
    # "head_after_rotary", normalize the turned features and scale them), attend, merge
    config = dict(
        num_hiddens=8, num_heads=2, query_size=4, key_size=4, value_size=4, dtype="float64"
    )
    config.update(qk_norm=qk_norm, qk_norm_eps=1e-3)
    weights = mha.random_weights("MultiHeadAttention", seed=5, **config)
    layer = backend.MultiHeadAttention(rope_theta=100.0, **config)
    mha.set_weights(layer, weights)
    X = rng.standard_normal((1, 5, 4))
    out = backend.to_numpy(layer(*[backend.from_numpy(X)] * 3, causal=True))

    def heads(Y):
        return Y.reshape(1, 5, 2, 4).transpose(0, 2, 1, 3)

    def normed(Y, scale):
        if qk_norm is None:
            return Y
        return Y / np.sqrt(np.mean(Y**2, axis=-1, keepdims=True) + 1e-3) * scale

    positions = np.arange(5, dtype=float)
    q = _complex_rotation(heads(X @ weights["W_q"]), positions, 100.0, False)
    k = _complex_rotation(heads(X @ weights["W_k"]), positions, 100.0, False)
    if qk_norm is not None:
        q, k = normed(q, weights["q_norm"]), normed(k, weights["k_norm"])
    scores = q @ k.swapaxes(-1, -2) / 2.0
    scores = np.where(np.tri(5, dtype=bool), scores, -np.inf)
    attention = np.exp(scores - scores.max(-1, keepdims=True))
    attention /= attention.sum(-1, keepdims=True)
    merged = (attention @ heads(X @ weights["W_v"])).transpose(0, 2, 1, 3).reshape(1, 5, 8)
    assert_agrees(out, merged @ weights["W_o"], "float64")


def test_new_options_round_trip_through_checkpoints(backend, tmp_path):
    layer = backend.MultiHeadAttention(
        8,
        4,
        query_size=4,
        key_size=4,
        value_size=4,
        num_kv_heads=2,
        rope_theta=1e4,
        rope_interleaved=True,
        sliding_window=3,
        dtype="float64",
    )
    path = tmp_path / "layer.safetensors"
    mha.save(layer, path)
    checkpoint = mha.weights.read_checkpoint(path)
    assert checkpoint.config["num_kv_heads"] == 2
    assert checkpoint.config["rope_theta"] == 1e4
    assert checkpoint.config["rope_interleaved"] is True
    assert checkpoint.config["sliding_window"] == 3
    assert checkpoint.weights["W_k"].shape == (4, 4)
    with mha.use_backend("numpy"):
        again = mha.load(path)
    np.testing.assert_array_equal(mha.get_weights(again)["W_v"], checkpoint.weights["W_v"])


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_kv_heads": 2, "rope_theta": 100.0},
        {"num_kv_heads": 1, "rope_theta": 1e4, "rope_interleaved": True, "sliding_window": 3},
        {"num_kv_heads": 2, "rope_theta": 100.0, "qk_norm": "head"},
        {"num_kv_heads": 2, "qk_norm": "projection", "qk_norm_eps": 1e-5},
        {"softcap": 0.5, "sliding_window": 3},
        {
            "rope_theta": 100.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 4,
            },
        },
        {"num_kv_heads": 2, "sinks": True, "sliding_window": 3, "rope_theta": 100.0},
        {"num_kv_heads": 2, "output_gate": True, "qk_norm": "head", "rope_theta": 100.0},
        {"num_kv_heads": 2, "qk_norm": "layer_norm_per_head", "rope_theta": 100.0},
        {"num_kv_heads": 2, "alibi": True},
        {
            "num_kv_heads": 2,
            "attention_chunk_size": 3,
            "qk_norm": "head",
            "rope_theta": 100.0,
            "rope_interleaved": True,
        },
        {"num_kv_heads": 2, "qk_norm": "head_after_rotary", "rope_theta": 100.0},
        {
            "num_kv_heads": 2,
            "query_scaling": {
                "beta": 0.5,
                "original_max_position_embeddings": 2,
                "position_offset": 1,
            },
        },
    ],
    ids=[
        "plain",
        "llama",
        "mistral",
        "qwen3",
        "olmo2",
        "gemma2",
        "llama3.1",
        "gpt-oss",
        "qwen3-next",
        "stablelm",
        "bloom",
        "llama4-chunked",
        "hunyuan",
        "llama4-nope",
    ],
)
def test_cached_decoding_equals_full_causal_attention(backend, rng, options):
    # A prompt of 3 positions, then one position per call, then two at once
    config = dict(
        num_hiddens=8,
        num_heads=4,
        bias=True,
        query_size=6,
        key_size=6,
        value_size=6,
        dtype="float64",
        **options,
    )
    weights = mha.random_weights("MultiHeadAttention", seed=9, **config)
    layer = backend.MultiHeadAttention(**config)
    mha.set_weights(layer, weights)
    X = rng.standard_normal((2, 7, 6))
    valid_lens = np.array([7, 5])  # the second example's last two keys are padding
    full = reference.MultiHeadAttention(**config)
    mha.set_weights(full, weights)
    expected = full(X, X, X, valid_lens, causal=True)
    cache, outputs = mha.KVCache(), []
    for start, stop in ((0, 3), (3, 4), (4, 5), (5, 7)):
        x = backend.from_numpy(X[:, start:stop])
        lengths = backend.from_numpy(np.minimum(valid_lens, stop))
        output, cache = layer(x, x, x, lengths, causal=True, cache=cache)
        outputs.append(backend.to_numpy(output))
        assert backend.to_numpy(cache.keys).shape == (2, options.get("num_kv_heads", 4), stop, 2)
    assert_agrees(np.concatenate(outputs, axis=1), expected, "float64")
    # The last call's weights cover every key so far
    assert backend.to_numpy(layer.attention_weights).shape == (2, 4, 2, 7)


def test_a_cache_that_does_not_fit_is_refused(backend):
    layer = backend.MultiHeadAttention(
        8, 4, query_size=8, key_size=8, value_size=8, num_kv_heads=2, dtype="float64"
    )
    x = backend.from_numpy(np.zeros((2, 1, 8)))
    wrong_heads = mha.KVCache(*[backend.from_numpy(np.zeros((2, 4, 3, 2)))] * 2)
    with pytest.raises(ValueError, match=r"cache\.keys must have shape \(batch_size, num_kv_heads"):
        layer(x, x, x, cache=wrong_heads)
    with pytest.raises(TypeError, match=r"cache must be an mha\.KVCache"):
        layer(x, x, x, cache=(None, None))
    uneven = mha.KVCache(
        backend.from_numpy(np.zeros((2, 2, 3, 2))), backend.from_numpy(np.zeros((2, 2, 4, 2)))
    )
    with pytest.raises(ValueError, match="the same positions"):
        layer(x, x, x, cache=uneven)


def test_a_cache_of_another_dtype_or_with_one_tensor_is_refused(backend):
    # A float32 cache would be promoted (numpy) or cast silently into a float64 layer's
    # numbers; a cache holding keys but no values is not the empty KVCache()
    layer = backend.MultiHeadAttention(
        8, 4, query_size=8, key_size=8, value_size=8, num_kv_heads=2, dtype="float64"
    )
    x = backend.from_numpy(np.zeros((2, 1, 8)))
    narrow = mha.KVCache(*[backend.from_numpy(np.zeros((2, 2, 3, 2), np.float32))] * 2)
    with pytest.raises(TypeError, match=r"cache\.keys must have the layer's dtype float64"):
        layer(x, x, x, cache=narrow)
    half = mha.KVCache(backend.from_numpy(np.zeros((2, 2, 3, 2))), None)
    with pytest.raises(TypeError, match=r"cache\.values must be an array or tensor"):
        layer(x, x, x, cache=half)


def test_learned_positional_encoding_adds_its_rows(backend, rng, tmp_path):
    # The book's exercise: P is a weight, row i added at position i
    layer = backend.LearnedPositionalEncoding(6, max_len=10, dtype="float64")
    P = rng.standard_normal((10, 6))
    mha.set_weights(layer, {"P": P})
    X = rng.standard_normal((3, 4, 6))
    out = backend.to_numpy(layer(backend.from_numpy(X)))
    assert_agrees(out, X + P[None, :4], "float64")
    mha.save(layer, tmp_path / "P.safetensors")
    with mha.use_backend("numpy"):
        again = mha.load(tmp_path / "P.safetensors")
    np.testing.assert_array_equal(mha.get_weights(again)["P"], P)
    with pytest.raises(ValueError, match="longer than max_len=10"):
        layer(backend.from_numpy(rng.standard_normal((1, 11, 6))))
