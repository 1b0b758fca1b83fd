"""Inputs at the edges every backend must take as the reference does: an empty batch, scores
near the largest float32, and tensors of another framework (mha's TypeError, never an
internal error)."""

import numpy as np
import pytest

import mha
from conftest import (
    assert_agrees,
    backend_module,
    backend_params,
    framework_import,
)
from mha.backends import numpy as N
from mha.cases import LATENT, LATENT_SIZES
from mha.layer_args import BACKEND_DTYPES
from mha.weights import numpy_dtype

Q, K, D, H = 3, 4, 8, 2
RANK = LATENT_SIZES["kv_lora_rank"]


def build(module, name, **extra):
    sizes = {"query_size": D, "key_size": D, "value_size": D}
    makers = {
        "MultiHeadAttention": lambda m: m.MultiHeadAttention(D, H, bias=True, **sizes, **extra),
        "DotProductAttention": lambda m: m.DotProductAttention(**extra),
        "AdditiveAttention": lambda m: m.AdditiveAttention(5, query_size=D, key_size=D, **extra),
        "AddNorm": lambda m: m.AddNorm(D, **extra),
        "PositionalEncoding": lambda m: m.PositionalEncoding(D, **extra),
        LATENT: lambda m: m.MultiHeadLatentAttention(D, H, **LATENT_SIZES, q_lora_rank=4, **extra),
    }
    reference, layer = makers[name](N), makers[name](module)
    weights = mha.get_weights(reference)
    if weights:
        mha.set_weights(layer, weights)
    return reference, layer


CALLS = {
    "MultiHeadAttention": [{}, {"valid_lens": np.zeros(0, "int64")}, {"causal": True}],
    "DotProductAttention": [{}, {"valid_lens": np.zeros((0, Q), "int64")}],
    "AdditiveAttention": [{"valid_lens": np.zeros(0, "int32")}],
    "AddNorm": [{}],
    "PositionalEncoding": [{}],
    # A cache, empty or holding K positions (of an empty batch too): the output and the cache
    LATENT: [
        {"valid_lens": np.zeros(0, "int64")},
        {"causal": True, "absorbed": True},
        {"cache": "empty"},
        {"cache": "held", "absorbed": True, "need_weights": False},
    ],
}


def latent_cache(module, kind):
    """A LatentCache of an empty batch, holding no position or K."""
    if kind == "empty":
        return mha.LatentCache()
    held = np.zeros((0, K, RANK), "float32")
    rotary = np.zeros((0, 1, K, LATENT_SIZES["qk_rope_head_dim"]), "float32")
    return mha.LatentCache(module.from_numpy(held), module.from_numpy(rotary))


def arguments_in(module, kwargs) -> dict:
    """kwargs with its arrays, and a cache named by its kind, in the module's tensors."""
    arguments = {
        k: module.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()
    }
    if "cache" in kwargs:
        arguments["cache"] = latent_cache(module, kwargs["cache"])
    return arguments


@pytest.mark.parametrize("layer_name", CALLS)
@pytest.mark.parametrize("name", backend_params())
def test_an_empty_batch_gives_an_empty_result(name, layer_name):
    module = backend_module(name)
    reference, layer = build(module, layer_name)
    X, Y = np.zeros((0, Q, D), "float32"), np.zeros((0, K, D), "float32")
    inputs = {
        "AddNorm": (X, X),
        "PositionalEncoding": (X,),
        LATENT: (X,),
    }.get(layer_name, (X, Y, Y))
    for kwargs in CALLS[layer_name]:
        expected = reference(*inputs, **arguments_in(N, kwargs))
        output = layer(*map(module.from_numpy, inputs), **arguments_in(module, kwargs))
        if "cache" in kwargs:
            (expected, held), (output, cache) = expected, output
            positions = K * (kwargs["cache"] == "held") + Q
            assert module.to_numpy(cache.latent).shape == held.latent.shape == (0, positions, RANK)
        assert module.to_numpy(output).shape == expected.shape == (0, Q, D)
    # The framework is still usable after it (MXNet once failed on its next operation)
    ones = np.ones((1, Q, D), "float32")
    assert module.to_numpy(module.from_numpy(ones) + module.from_numpy(ones)).sum() == 2 * Q * D


@pytest.mark.parametrize("name", backend_params())
def test_masked_softmax_of_an_empty_batch(name):
    module = backend_module(name)
    X = np.zeros((0, Q, K), "float32")
    for lens in (np.zeros(0, "int64"), np.zeros((0, Q), "int64")):
        output = module.masked_softmax(module.from_numpy(X), module.from_numpy(lens))
        assert module.to_numpy(output).shape == N.masked_softmax(X, lens).shape == (0, Q, K)


# Frameworks whose own operations take numpy arrays, and whose layers do too
TAKE_NUMPY = ("tensorflow", "jax")


def foreign_tensors(name):
    """A tensor of every other installed framework, the numpy array included where the
    layer's framework does not take numpy arrays itself."""
    x = np.ones((2, Q, D), "float32")
    tensors = {} if name in TAKE_NUMPY else {"numpy": x}
    for other in ("torch", "tensorflow", "mxnet", "jax"):
        if other == name:
            continue
        try:
            tensors[other] = mha.registry.load_backend(other).from_numpy(x)
        except mha.BackendUnavailableError:
            continue
    tensors.pop(name, None)
    return tensors


@pytest.mark.parametrize("name", backend_params())
def test_another_frameworks_tensor_is_a_type_error(name):
    module = backend_module(name)
    _, layer = build(module, "MultiHeadAttention")
    own = module.from_numpy(np.ones((2, Q, D), "float32"))
    for other, tensor in foreign_tensors(name).items():
        with pytest.raises(TypeError, match="must be an array or tensor of the layer's framework"):
            layer(tensor, own, own)
        with pytest.raises(TypeError, match="valid_lens must be an array or tensor of the layer"):
            layer(own, own, own, valid_lens=foreign_lengths(other))


def foreign_lengths(other):
    lengths = np.array([1, 2])
    if other == "numpy":
        return lengths
    return mha.registry.load_backend(other).from_numpy(lengths)


def _softmax64(scores, keep):
    scores = np.where(keep, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("name", backend_params())
def test_scores_near_the_largest_float32_stay_finite(name, need_weights):
    # Q K^T of these float32 inputs overflows, Q K^T / sqrt(d) does not: the scaled scores are
    # what the layers promise, so no weight and no output is NaN
    module = backend_module(name)
    rng = np.random.default_rng(0)
    queries, keys = (rng.standard_normal((2, n, D)) * 1e19 for n in (Q, K))
    values = rng.standard_normal((2, K, D))
    lengths = np.array([K, 2])
    scores = queries @ np.swapaxes(keys, 1, 2) / np.sqrt(D)
    largest = np.finfo("float32").max
    assert np.abs(scores).max() < largest < np.abs(scores).max() * np.sqrt(D)
    keep = np.arange(K)[None, None, :] < lengths[:, None, None]
    weights = _softmax64(scores, keep)
    # One head whose projections are the identity: the scores above, and weights @ values
    layer = module.MultiHeadAttention(D, 1, query_size=D, key_size=D, value_size=D)
    eye = np.eye(D, dtype="float32")
    mha.set_weights(layer, {"W_q": eye, "W_k": eye, "W_v": eye, "W_o": eye})
    inputs = [module.from_numpy(x.astype("float32")) for x in (queries, keys, values)]
    output = layer(*inputs, valid_lens=module.from_numpy(lengths), need_weights=need_weights)
    assert_agrees(module.to_numpy(output), weights @ values, "float32")
    if need_weights:
        assert_agrees(module.to_numpy(layer.attention_weights)[:, 0], weights, "float32")


@pytest.mark.parametrize("name", backend_params())
def test_add_norm_in_float16_far_from_zero(name):
    # Sums near 100, where float16's step is 1/16: a mean rounded to float16 would move every
    # centred entry by up to 1/32 of a spread near 1. Every backend, the reference among
    # them, stays within float16's agreement of the float64 formula on the float16 sum
    module = backend_module(name)
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((2, 2, 3, D)).astype("float16")
    Y += np.float16(100)
    gamma, beta = rng.standard_normal((2, D)).astype("float16")
    Z = (X + Y).astype("float64")  # the residual sum, in the layer's dtype
    normalized = (Z - Z.mean(-1, keepdims=True)) / np.sqrt(Z.var(-1, keepdims=True) + 1e-5)
    expected = normalized * gamma + beta
    layer = module.AddNorm(D, dtype="float16")
    mha.set_weights(layer, {"gamma": gamma, "beta": beta})
    output = layer(module.from_numpy(X), module.from_numpy(Y))
    assert_agrees(module.to_numpy(output).astype("float64"), expected, "float16")


@pytest.mark.parametrize("name", backend_params(("numpy", "torch", "tensorflow", "jax")))
def test_a_float16_soft_cap_divides_the_scores_rounding_once(name):
    # Scores near 30 capped at 50: XLA made JAX's float16 division a product by the rounded
    # reciprocal, a third of the quotients a step off (4.7e-3 off the formula, 2.3x float16's
    # agreement); the others divide as the formula rounds it
    module = backend_module(name)
    rng = np.random.default_rng(21)
    query, key = (rng.standard_normal((1, 1, n, 64)) * 3 for n in (4, 6))
    value = rng.standard_normal((1, 1, 6, 8))
    query, key, value = (x.astype("float16").astype("float64") for x in (query, key, value))
    scores = 50.0 * np.tanh(query @ np.swapaxes(key, -1, -2) / 8.0 / 50.0)
    expected = _softmax64(scores, np.ones(scores.shape, bool)) @ value
    output = module.dot_product_attention(
        *(module.from_numpy(x.astype("float16")) for x in (query, key, value)), softcap=50.0
    )
    assert_agrees(module.to_numpy(output).astype("float64"), expected, "float16")


@pytest.mark.parametrize("name", backend_params(("numpy", "torch", "tensorflow", "jax")))
def test_a_float16_alibi_bias_70000_positions_back_is_finite(name):
    # A query at position 70,000 over keys 0 and 1: their distances were cast to float16
    # before the slopes multiplied them, -inf past 65,504, and every output NaN. The products
    # in float32, rounded once to float16
    module = backend_module(name)
    rng = np.random.default_rng(8)
    X, KV = rng.standard_normal((1, 1, 8)), rng.standard_normal((1, 2, 8))
    layer = module.MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8,
                                      alibi=True, dtype="float16")  # fmt: skip
    weights = mha.random_weights(layer, seed=4, dtype="float16")
    mha.set_weights(layer, weights)
    W = {k: v.astype("float64") for k, v in weights.items()}
    X, KV = (x.astype("float16").astype("float64") for x in (X, KV))
    slopes = np.array([2.0**-4, 2.0**-8])  # 2 ** (-8k / 2), k = 1, 2
    queries, keys, values = ((x @ W[w]).reshape(1, -1, 2, 4).transpose(0, 2, 1, 3)
                             for x, w in ((X, "W_q"), (KV, "W_k"), (KV, "W_v")))  # fmt: skip
    # The bias in the layer's dtype, rounded once (-4375 and -4374.94 are both -4376), and
    # the scores plus the bias rounded to float16 too, in steps of 4 and 1/4 there
    alibi = (slopes[:, None, None] * (np.arange(2) - 70_000.0)).astype("float16")
    scores = (queries @ np.swapaxes(keys, -1, -2) / 2.0).astype("float16") + alibi
    heads = _softmax64(scores.astype("float64"), np.ones(scores.shape, bool)) @ values
    expected = heads.transpose(0, 2, 1, 3).reshape(1, 1, 8) @ W["W_o"]
    X, KV = (module.from_numpy(x.astype("float16")) for x in (X, KV))
    output = layer(X, KV, KV, alignment=70_000)
    assert_agrees(module.to_numpy(output).astype("float64"), expected, "float16")


@pytest.mark.parametrize("name", backend_params())
def test_add_norm_keeps_beta_in_a_row_far_from_zero_with_little_spread(name):
    # Rows of 1e5 and of 1000 (a mean any sum gives exactly) normalise to beta. Keras's
    # LayerNormalization adds beta - mean * gamma / std, in which a float32 row of 1e5 keeps
    # no bit of beta (every output 0), and a row of 1000 is 0.0125 off
    module = backend_module(name)
    gamma = np.array([1.0, 2.0, 3.0, 4.0], "float32")
    beta = np.array([0.1, 0.2, 0.3, 0.4], "float32")
    X = np.stack([np.full(4, 1e5), np.full(4, 1000.0)])[None].astype("float32")
    Z = X.astype("float64")  # the formula on the float32 sum X + 0
    normalized = (Z - Z.mean(-1, keepdims=True)) / np.sqrt(Z.var(-1, keepdims=True) + 1e-5)
    layer = module.AddNorm(4)
    mha.set_weights(layer, {"gamma": gamma, "beta": beta})
    output = layer(module.from_numpy(X), module.from_numpy(np.zeros_like(X)))
    assert_agrees(module.to_numpy(output), normalized * gamma + beta, "float32")


@pytest.mark.parametrize("name", backend_params(("numpy", "torch", "tensorflow", "jax")))
def test_a_float16_row_of_70000_keys(name):
    # The sum of a near-uniform row's exponentials passes float16's largest, 65504: summed in
    # float16 it is inf, and every weight 0. Each backend matches the float64 formula: the
    # output the values' mean, each row's log-sum-exp log(70000)
    module = backend_module(name)
    rng = np.random.default_rng(0)
    n = 70_000
    query = np.zeros((1, 1, 1, 8), "float16")
    key = (rng.standard_normal((1, 1, n, 8)) * 0.01).astype("float16")
    value = (rng.standard_normal((1, 1, n, 8)) + 0.5).astype("float16")
    output, lse = module.dot_product_attention(
        *(module.from_numpy(x) for x in (query, key, value)), return_lse=True
    )
    expected = value.astype("float64").mean(axis=2, keepdims=True)
    assert_agrees(module.to_numpy(output).astype("float64"), expected, "float16")
    assert_agrees(module.to_numpy(lse).astype("float64"), np.full((1, 1, 1), np.log(n)), "float16")


@pytest.mark.parametrize("name", backend_params(("numpy", "torch", "tensorflow", "jax")))
def test_bfloat16_weights_are_the_exact_softmax_rounded_once(name):
    # bfloat16 keeps 8 significant bits: a softmax computed in its steps (the exponentials, a
    # sum of 4,096 of them) puts weights several steps off; in float32, rounded once, each is
    # within half a step (2**-8 of it) of the float64 softmax of the same bfloat16 scores
    _assert_softmax_rounded_once(backend_module(name), "bfloat16", 2**-8, 0.0)


@pytest.mark.parametrize("name", backend_params())
def test_float16_weights_are_the_exact_softmax_rounded_once(name):
    # float16's 11 significant bits: summed in float16, a row of 4,096 exponentials puts
    # weights far off (every weight of a uniform row 1/2048); in float32, rounded once, each
    # is within half a step of the float64 softmax, or of float16's smallest step, 2**-24
    _assert_softmax_rounded_once(backend_module(name), "float16", 2**-11, 2**-25)


def _assert_softmax_rounded_once(module, dtype: str, half_step: float, smallest: float) -> None:
    rng = np.random.default_rng(0)
    scores = (rng.standard_normal((2, 3, 4096)) * 2).astype(numpy_dtype(dtype))
    scores[1, 2] = 0  # a uniform row
    exact = scores.astype("float64")
    for valid_lens in (None, np.array([4096, 3000])):
        # Shape of kept: (2, 1, 4096), one row of kept keys per sequence
        kept = np.arange(4096) < (4096 if valid_lens is None else valid_lens[:, None, None])
        expected = np.exp(np.where(kept, exact - exact.max(-1, keepdims=True), -np.inf))
        expected /= expected.sum(-1, keepdims=True)
        lengths = None if valid_lens is None else module.from_numpy(valid_lens)
        actual = module.to_numpy(module.masked_softmax(module.from_numpy(scores), lengths))
        assert actual.dtype.name == dtype, actual.dtype
        error = np.abs(actual.astype("float64") - expected)
        bound = np.maximum(half_step * expected, smallest) * 1.001
        assert np.all(error <= bound), (module.__name__, error.max())


@pytest.mark.parametrize("name", backend_params(("numpy", "torch", "tensorflow", "jax")))
def test_the_absorbed_latent_form_in_float16_over_512_latent_features(name):
    # DeepSeek's kv_lora_rank: the absorbed form sums 512 products per output feature, which
    # a float16 sum (np.einsum's, tf.einsum's) rounds past float16's agreement
    module = backend_module(name)
    sizes = {"kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32}
    reference = N.MultiHeadLatentAttention(128, 4, **sizes, v_head_dim=64, dtype="float64")
    layer = module.MultiHeadLatentAttention(128, 4, **sizes, v_head_dim=64, dtype="float16")
    weights = mha.get_weights(reference)
    mha.set_weights(layer, {key: w.astype("float16") for key, w in weights.items()})
    X = np.random.default_rng(0).standard_normal((1, 64, 128)).astype("float16")
    expected = reference(X.astype("float64"), causal=True)
    output = layer(module.from_numpy(X), causal=True, absorbed=True)
    assert_agrees(module.to_numpy(output).astype("float64"), expected, "float16")


@pytest.mark.parametrize("name", backend_params(("torch", "tensorflow", "mxnet", "jax")))
def test_a_rotary_embedding_past_2_24_turns_as_the_reference(name):
    # Each position rounded once to float32, as the reference counts them: positions counted
    # in float32 steps, or the offset rounded before them, turn the rows by other angles
    module = backend_module(name)
    offset, n = 2**24 + 1, 300
    X = np.random.default_rng(0).standard_normal((1, 1, n, 8)).astype("float32")
    expected = backend_module("numpy").RotaryEmbedding(8, dtype="float32")(X, offset)
    output = module.to_numpy(module.RotaryEmbedding(8)(module.from_numpy(X), offset))
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", backend_params(("numpy", "torch", "tensorflow", "jax")))
def test_rotary_positions_past_2_24_are_whole_positions_rounded_once(name):
    # float32 holds every second whole number past 2**24: each position is rounded once, as
    # transformers rounds its int64 positions, not counted in float32 steps (which drift by
    # a step per position). Expected: the same rows at the same positions given one by one
    module = backend_module(name)
    offset, n = 2**24 + 1, 300
    X = np.random.default_rng(0).standard_normal((1, 1, n, 8)).astype("float32")
    rotary = module.RotaryEmbedding(8)
    at_offset = module.to_numpy(rotary.rotate(module.from_numpy(X), offset))
    given = module.from_numpy(np.arange(offset, offset + n)[None])
    one_by_one = module.to_numpy(rotary.rotate(module.from_numpy(X), offset, positions=given))
    np.testing.assert_array_equal(at_offset, one_by_one)


@pytest.mark.parametrize("name", backend_params())
def test_the_function_of_an_empty_batch_with_weights_and_lse(name):
    # MXNet's sum of an empty batch returned, then failed the next call (its error is late)
    module = backend_module(name)
    q, k, v = (module.from_numpy(np.zeros((0, H, n, D), "float32")) for n in (Q, K, K))
    output, weights, lse = module.dot_product_attention(
        q, k, v, return_weights=True, return_lse=True
    )
    shapes = [module.to_numpy(x).shape for x in (output, weights, lse)]
    assert shapes == [(0, H, Q, D), (0, H, Q, K), (0, H, Q)]
    x = np.random.default_rng(0).standard_normal((1, H, Q, D)).astype("float32")
    again = module.dot_product_attention(*(module.from_numpy(x) for _ in "qkv"))
    assert_agrees(module.to_numpy(again), N.dot_product_attention(x, x, x), "float32")


@pytest.mark.parametrize("name", backend_params())
@pytest.mark.parametrize(
    "given",
    [
        {"mask": (Q, K)},
        {"mask": (K,)},
        {"bias": (Q, K)},
        {"bias": (1, 1, Q, K)},
        {"window": 2},
        {"causal": True},
    ],
    ids=["mask QK", "mask K", "bias QK", "bias 11QK", "window", "causal"],
)
def test_the_function_of_an_empty_batch_with_masks_that_broadcast_over_it(name, given):
    # MXNet's kernels met a mask of batch 1 with scores of batch 0: a segfault or batch_dot's error
    module = backend_module(name)
    q, k, v = (module.from_numpy(np.zeros((0, H, n, D), "float32")) for n in (Q, K, K))
    made = {
        key: module.from_numpy(np.ones(shape, "bool" if key == "mask" else "float32"))
        if isinstance(shape, tuple)
        else shape
        for key, shape in given.items()
    }
    results = module.dot_product_attention(q, k, v, **made, return_weights=True, return_lse=True)
    shapes = [module.to_numpy(x).shape for x in results]
    assert shapes == [(0, H, Q, D), (0, H, Q, K), (0, H, Q)]
    # Without weights torch reads whether the scores are finite: of none at all here
    assert module.to_numpy(module.dot_product_attention(q, k, v, **made)).shape == (0, H, Q, D)


@pytest.mark.parametrize("name", backend_params())
def test_the_lse_of_a_row_with_a_kept_infinite_or_nan_score(name):
    # log(sum(exp)) of a row holding a kept +inf is +inf (torch's, TensorFlow's and JAX's
    # logsumexp); of a NaN, NaN; of a row with no kept score, -inf. numpy and MXNet shifted by
    # the +inf maximum and gave inf - inf = NaN
    module = backend_module(name)
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((1, 1, n, 4)).astype("float32") for n in (3, 4))
    bias = np.zeros((1, 1, 3, 4), "float32")
    bias[..., 0, 1], bias[..., 1, 2] = np.inf, np.nan
    bias[..., 2, :] = -np.inf
    q, k, bias = (module.from_numpy(t) for t in (q, k, bias))
    _, lse = module.dot_product_attention(q, k, k, bias=bias, return_lse=True)
    lse = module.to_numpy(lse)[0, 0]
    assert lse[0] == np.inf and np.isnan(lse[1]) and lse[2] == -np.inf


@pytest.mark.parametrize("name", backend_params())
def test_a_numpy_float64_scale_and_softcap_keep_the_inputs_dtype(name):
    # numpy 2 widens a float32 array times numpy's float64 (not a weak scalar) to float64
    module = backend_module(name)
    x = module.from_numpy(np.random.default_rng(2).standard_normal((1, 2, 3, 4)).astype("float32"))
    output, weights = module.dot_product_attention(
        x, x, x, scale=np.float64(0.3), softcap=np.float64(5.0), return_weights=True
    )
    assert {module.to_numpy(t).dtype for t in (output, weights)} == {np.dtype("float32")}
    layer = module.DotProductAttention(scale=np.float64(0.3), softcap=np.float64(5.0))
    assert module.to_numpy(layer(x[0], x[0], x[0])).dtype == np.float32


@pytest.mark.torch
def test_torchs_path_without_weights_gives_a_nan_query_zeros_as_its_kernel_does():
    # As docs/design.md says: F.scaled_dot_product_attention's CPU kernel gives the row of a
    # query holding NaN zeros, and mha's path without weights passes it through (reading the
    # queries for it would cost a pass over them on every call); with weights it is NaN
    T = backend_module("torch")
    import torch

    x = torch.from_numpy(np.random.default_rng(3).standard_normal((1, 1, 3, 4)).astype("float32"))
    q = x.clone()
    q[0, 0, 1, 2] = float("nan")
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, x, x)
    without = T.dot_product_attention(q, x, x)
    with_weights, _ = T.dot_product_attention(q, x, x, return_weights=True)
    assert torch.equal(without, sdpa) and not without[0, 0, 1].isnan().any()
    assert with_weights[0, 0, 1].isnan().all() and not with_weights[0, 0, 0].isnan().any()


@pytest.mark.parametrize("name", backend_params())
def test_a_scale_or_soft_cap_past_the_dtypes_largest_number_is_refused(name):
    """Past the dtype's largest number a scale or soft cap is infinity in that dtype, and the
    scores NaN where it is rounded to the inputs' dtype (numpy, TensorFlow, JAX) where torch
    multiplied in float32: refused in every backend; float32's largest itself gives the
    float64 formula's numbers."""
    module = backend_module(name)
    pasts = [("float32", 1e39)] + ([] if name == "mxnet" else [("float16", 7e4)])
    for dtype, past in pasts:
        q = module.from_numpy(np.full((1, 1, 2, 4), 0.1, dtype))
        for option in ("scale", "softcap"):
            with pytest.raises(ValueError, match=f"{option} must be at most"):
                module.dot_product_attention(q, q, q, **{option: past})
            with pytest.raises(ValueError, match=f"{option} must be at most"):
                module.DotProductAttention(dtype=dtype, **{option: past})
    largest = 3.4028234663852886e38
    rng = np.random.default_rng(0)
    query = np.full((1, 2, 3, 4), 2e-38, "float32")  # normal: XLA flushes subnormals to 0
    key, value = rng.standard_normal((2, 1, 2, 5, 4)).astype("float32")
    key *= np.float32(0.1)
    scores = (query.astype("float64") * largest) @ key.astype("float64").swapaxes(-1, -2)
    expected = _softmax64(scores, np.ones(scores.shape, bool)) @ value
    output = module.dot_product_attention(
        *map(module.from_numpy, (query, key, value)), scale=largest
    )
    assert_agrees(module.to_numpy(output), expected, "float32")


@pytest.mark.parametrize("name", backend_params())
def test_a_scale_below_float16s_normal_numbers_multiplies_in_float32(name):
    """float16 holds 1e-7 as 1.19e-7 and 2e-8 as 0 (uniform weights): a half dtype's scale
    multiplies in float32, rounded once, as torch's and the kernels'. Below float32's
    smallest normal number (float64's in float64) XLA and TensorFlow flush it: refused."""
    module = backend_module(name)
    query = np.ones((1, 1, 2, 4))
    query[0, 0, 1] = 2.0
    key = np.zeros((1, 1, 3, 4))
    key[0, 0, :, 0] = [1.0, 2.0, 3.0]
    value = np.eye(3, 4).reshape(1, 1, 3, 4).astype(np.float16)
    for scale in () if name == "mxnet" else (1e-7, 2e-8):  # MXNet: float16 on a GPU only
        size = np.sqrt(1 / (scale * 4))  # scores of a few units once scaled
        q, k = (np.float16(x * size) for x in (query, key))
        scores = (q.astype(np.float64) * scale) @ k.astype(np.float64).swapaxes(-1, -2)
        expected = _softmax64(scores, np.ones(scores.shape, bool)) @ value
        output = module.dot_product_attention(*map(module.from_numpy, (q, k, value)), scale=scale)
        assert_agrees(module.to_numpy(output), expected, "float16")
    # The soft cap divides the scores in their dtype: in float16 below 6.1e-5 (where XLA
    # flushes 1e-6 to 0, and a score of 0 over it is NaN)
    belows = {"float32": (1e-38,) * 2, "float16": (1e-39, 1e-6), "float64": (1e-308,) * 2}
    for dtype, (below, cap_below) in belows.items():
        if dtype in BACKEND_DTYPES[name]:
            q = module.from_numpy(np.full((1, 1, 2, 4), 0.1, dtype))
            for option, value in (("scale", below), ("softcap", cap_below)):
                with pytest.raises(ValueError, match=f"{option} must be at least"):
                    module.dot_product_attention(q, q, q, **{option: value})
                with pytest.raises(ValueError, match=f"{option} must be at least"):
                    module.DotProductAttention(dtype=dtype, **{option: value})


@pytest.mark.parametrize("name", backend_params())
def test_a_soft_cap_is_at_most_what_keeps_the_scores_quotients_normal(name):
    """XLA and TensorFlow flush to 0 a quotient below the smallest normal number: with a
    cap of 1e38 in float32 every score of a few units was 0 there, the weights uniform. Up to
    epsilon over the smallest normal number (float32's for bfloat16) only scores below the
    dtype's rounding of 1 flush, which the formula's numbers hold; past it, refused."""
    module = backend_module(name)
    rng = np.random.default_rng(4)
    epsilons = {"float32": 2.0**-23, "float64": 2.0**-52, "bfloat16": 2.0**-7}
    for dtype, epsilon in epsilons.items():
        if dtype not in BACKEND_DTYPES[name]:
            continue
        wide = "float64" if dtype == "float64" else "float32"
        ceiling = epsilon / float(np.finfo(wide).tiny)
        query, key, value = rng.standard_normal((3, 1, 2, 5, 4)).astype(numpy_dtype(dtype))
        q, k, v = map(module.from_numpy, (query, key, value))
        exact = [x.astype("float64") for x in (query, key, value)]
        scores = exact[0] @ exact[1].swapaxes(-1, -2) / 2
        scores = ceiling * np.tanh(scores / ceiling)
        expected = _softmax64(scores, np.ones(scores.shape, bool)) @ exact[2]
        output = module.to_numpy(module.dot_product_attention(q, k, v, softcap=ceiling))
        if dtype == "bfloat16":  # each product in float32, rounded once (as above)
            assert np.abs(output.astype("float64") - expected).max() <= 2e-2
        else:
            assert_agrees(output, expected, dtype)
        with pytest.raises(ValueError, match="softcap must be at most"):
            module.dot_product_attention(q, k, v, softcap=ceiling * 2)
        with pytest.raises(ValueError, match="softcap must be at most"):
            module.MultiHeadAttention(8, 2, softcap=ceiling * 2, dtype=dtype)


@pytest.mark.parametrize("name", backend_params())
def test_an_epsilon_below_the_smallest_normal_number_is_refused(name):
    """XLA and TensorFlow flush an epsilon of 1e-40 to 0 where it is added (float32): a row
    of no spread was 0 / 0, NaN there and 0 elsewhere. At float32's smallest normal number
    such rows give the formula's numbers: AddNorm's its beta, a query of zeros under qk_norm
    the values' mean."""
    module = backend_module(name)
    tiny = float(np.finfo("float32").tiny)
    with pytest.raises(ValueError, match="eps must be at least"):
        module.AddNorm(4, eps=1e-40)
    with pytest.raises(ValueError, match="qk_norm_eps must be at least"):
        module.MultiHeadAttention(4, 2, qk_norm="head", qk_norm_eps=1e-40)
    with pytest.raises(ValueError, match="norm_eps must be at least"):
        module.MultiHeadLatentAttention(8, 2, **LATENT_SIZES, norm_eps=1e-40)
    X = np.ones((1, 3, 4), "float32")
    beta = np.arange(4, dtype="float32")
    layer = module.AddNorm(4, eps=tiny)
    mha.set_weights(layer, {"gamma": np.ones(4, "float32"), "beta": beta})
    output = module.to_numpy(layer(module.from_numpy(X), module.from_numpy(X)))
    np.testing.assert_array_equal(output, np.broadcast_to(beta, (1, 3, 4)))
    layer = module.MultiHeadAttention(4, 2, qk_norm="head", qk_norm_eps=tiny, query_size=4,
                                      key_size=4, value_size=4)  # fmt: skip
    eye = np.eye(4, dtype="float32")
    ones = np.ones(2, "float32")  # each head's norm weight
    mha.set_weights(layer, {"W_q": eye, "W_k": eye, "W_v": eye, "W_o": eye, "q_norm": ones,
                            "k_norm": ones})  # fmt: skip
    queries = np.zeros((1, 1, 4), "float32")
    keys = np.random.default_rng(5).standard_normal((1, 3, 4)).astype("float32")
    output = module.to_numpy(layer(*map(module.from_numpy, (queries, keys, keys))))
    np.testing.assert_allclose(output, keys.mean(1, keepdims=True), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", backend_params())
def test_query_scaling_takes_positions_up_to_the_limit_and_refuses_past_it(name):
    """An offset or original length past int32 was JAX's OverflowError without its 64-bit
    mode (torch's past int64): up to 2**50, as every position, the reference's numbers;
    past it refused, rope_scaling's original length too."""
    module = backend_module(name)
    scaling = {"beta": 0.5, "original_max_position_embeddings": 2**40, "position_offset": 2**50}
    X = np.random.default_rng(9).standard_normal((1, 3, 8)).astype("float32")
    reference = N.MultiHeadAttention(8, 2, query_scaling=scaling)
    layer = module.MultiHeadAttention(8, 2, query_scaling=scaling)
    reference(X, X, X)
    layer(*map(module.from_numpy, (X, X, X)))
    mha.set_weights(layer, mha.get_weights(reference))
    output = layer(*map(module.from_numpy, (X, X, X)), causal=True)
    assert_agrees(module.to_numpy(output), reference(X, X, X, causal=True), "float32")
    for key in ("original_max_position_embeddings", "position_offset"):
        with pytest.raises(ValueError, match=f"query_scaling's {key} must be at most 2"):
            module.MultiHeadAttention(8, 2, query_scaling={**scaling, key: 2**51})
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2**64}
    with pytest.raises(ValueError, match="original_max_position_embeddings must be at most"):
        module.MultiHeadAttention(8, 2, rope_theta=1e4, rope_scaling=yarn)


@pytest.mark.parametrize("name", backend_params())
def test_rotary_frequencies_past_the_angles_dtype_are_refused(name):
    """A linear factor of 1e-39 (or a base of 1e-60) made float32 frequencies inf: NaN in
    every output of every backend. Refused; a float64 layer, whose angles hold them, takes
    the same scaling."""
    module = backend_module(name)
    linear = {"rope_type": "linear", "factor": 1e-39}
    with np.errstate(over="ignore"):  # the first pair's frequency, in float32
        assert np.float64(1.0 / 1e-39).astype("float32") == np.inf
    with pytest.raises(ValueError, match="pass the largest float32 number"):
        module.MultiHeadAttention(8, 2, rope_theta=1e4, rope_scaling=linear)
    with pytest.raises(ValueError, match="pass the largest float32 number"):
        module.RotaryEmbedding(8, 1e-60)
    if "float64" in BACKEND_DTYPES[name]:
        module.MultiHeadAttention(8, 2, rope_theta=1e4, rope_scaling=linear, dtype="float64")


@pytest.mark.parametrize("name", backend_params())
def test_a_lazy_layer_refuses_inputs_without_features(name):
    # The constructor refuses query_size=0; a lazy layer taking it from its first call
    # refuses it there, rather than dividing by it or keeping a (0, h) projection
    module = backend_module(name)
    none = module.from_numpy(np.zeros((2, 3, 0), "float32"))
    some = module.from_numpy(np.ones((2, 3, 4), "float32"))
    for size, inputs in [
        ("query_size", (none, some, some)),
        ("key_size", (some, none, some)),
        ("value_size", (some, some, none)),
    ]:
        with pytest.raises(ValueError, match=f"{size} must be a positive integer: the last"):
            module.MultiHeadAttention(4, 2)(*inputs)
    with pytest.raises(ValueError, match="query_size must be a positive integer: the last"):
        module.AdditiveAttention(6)(none, some, some)


@pytest.mark.parametrize("name", backend_params(("numpy", "torch", "tensorflow", "jax")))
def test_the_function_in_bfloat16_gives_bfloat16_near_the_formula(name):
    # The NumPy reference's function takes ml_dtypes' bfloat16 as the frameworks' do: each
    # product and the softmax in float32, rounded once to bfloat16, which is what it returns
    module = backend_module(name)
    rng = np.random.default_rng(1)
    bfloat16 = numpy_dtype("bfloat16")
    q = rng.standard_normal((1, 2, 4, 8)).astype(bfloat16)
    k, v = (rng.standard_normal((2, 1, 2, 2048, 8)) * 2).astype(bfloat16)
    exact = [x.astype("float64") for x in (q, k, v)]
    scores = exact[0] @ exact[1].swapaxes(-1, -2) / np.sqrt(8)
    weights = _softmax64(scores, np.ones(scores.shape, bool))
    lse = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
    results = module.dot_product_attention(
        *map(module.from_numpy, (q, k, v)), return_weights=True, return_lse=True
    )
    results = [module.to_numpy(x) for x in results]
    assert [x.dtype.name for x in results] == ["bfloat16"] * 3
    for actual, expected in zip(results, (weights @ exact[2], weights, lse), strict=True):
        scale = max(1.0, np.abs(expected).max())
        assert np.abs(actual.astype("float64") - expected).max() <= 2e-2 * scale


def test_masked_arrays_and_sparse_tensors_are_refused_by_name():
    # Their checks pass (a shape, a dtype, the framework's class) and the computation would
    # ignore a numpy mask or fail inside on a sparse layout
    x = np.ones((2, 3, 4), "float32")
    masked = np.ma.masked_array(x, mask=x > 2)
    with pytest.raises(TypeError, match=r"queries must be a plain dense.*numpy masked array"):
        N.DotProductAttention()(masked, x, x)
    with pytest.raises(TypeError, match=r"valid_lens must be a plain dense.*masked array"):
        N.masked_softmax(x, np.ma.masked_array([1, 2]))
    T = backend_module("torch")
    torch = framework_import("torch")
    X = torch.ones(2, 3, 4)
    with pytest.raises(TypeError, match=r"keys must be a plain dense.*layout torch.sparse_coo"):
        T.DotProductAttention()(X, X.to_sparse(), X)
    lens = torch.tensor([1, 2]).to_sparse()
    with pytest.raises(TypeError, match="valid_lens must be a plain dense"):
        T.dot_product_attention(X[None], X[None], X[None], valid_lens=lens)


@pytest.mark.tensorflow
def test_tensorflow_sparse_and_ragged_tensors_are_refused_by_name():
    # TensorFlow's own classes, refused as another framework's were, by that name
    TF = backend_module("tensorflow")
    tf = framework_import("tensorflow")
    x = tf.ones((2, 3, 4))
    sparse = r"queries must be a plain dense.*SparseTensor; tf\.sparse\.to_dense\(x\)"
    with pytest.raises(TypeError, match=sparse):
        TF.DotProductAttention()(tf.sparse.from_dense(x), x, x)
    with pytest.raises(TypeError, match=r"X must be a plain dense.*RaggedTensor; x\.to_tensor"):
        TF.masked_softmax(tf.RaggedTensor.from_tensor(x), tf.constant([1, 2]))


@pytest.mark.parametrize("name", backend_params())
def test_arrays_in_the_other_byte_order(name):
    # JAX read a big-endian float32 array's bytes in this machine's order: NaN or 1e38 outputs
    # once its call was compiled for that shape. Layers refuse such arrays alike everywhere;
    # from_numpy gives them in this machine's order
    module = backend_module(name)
    rng = np.random.default_rng(3)
    native = [rng.standard_normal((1, H, n, D)).astype("float32") for n in (Q, K, K)]
    swapped = [x.astype(">f4" if np.little_endian else "<f4") for x in native]
    assert not swapped[0].dtype.isnative
    structured = np.zeros((1, H, Q, D), [("x", swapped[0].dtype)])  # refused for its dtype
    with pytest.raises(TypeError, match=r"dtype"):
        N.dot_product_attention(structured, *native[1:])
    expected = N.dot_product_attention(*native)
    got = module.dot_product_attention(*map(module.from_numpy, swapped))
    assert_agrees(module.to_numpy(got), expected, "float32")
    with pytest.raises(TypeError, match=r"machine's order|framework"):
        module.dot_product_attention(*swapped)
    layer = module.MultiHeadAttention(D, H, dtype="float32")
    with pytest.raises(TypeError, match=r"machine's order|framework"):
        layer(*(x.reshape(1, -1, D) for x in swapped))


def test_a_numpy_matrix_is_refused_by_name():
    # A (batch, queries) np.matrix of lengths failed inside the value check ('<' between a
    # list and an int): a matrix keeps two axes where the layers ravel and reshape
    x = np.random.default_rng(4).standard_normal((2, Q, K)).astype("float32")
    lens = np.matrix([[1, 2, 3], [2, 2, 1]])
    with pytest.raises(TypeError, match=r"valid_lens must be a plain.*numpy matrix"):
        N.masked_softmax(x, lens)

    class Matrix(np.matrix):
        pass

    with pytest.raises(TypeError, match=r"valid_lens must be a plain.*numpy matrix"):
        N.masked_softmax(x, Matrix(lens))
    weights = N.masked_softmax(x, np.asarray(lens))  # as the hint says: keys below each length
    kept = np.arange(K) < np.asarray(lens)[..., None]
    expected = np.where(kept, np.exp(x - x.max(-1, keepdims=True)), 0)
    assert_agrees(weights, expected / expected.sum(-1, keepdims=True), "float32")
