"""torch's automatic mixed precision (torch.autocast), the usual way to train on a GPU: inside
it the layers before an mha layer give their outputs in autocast's dtype, and a float32 mha
layer takes them, as torch's own layers do; outside it an input of another dtype is still a
TypeError. Run here on the CPU, whose autocast computes the products in its dtype as CUDA's
does (bfloat16 or float16); CUDA's also lifts the softmax and the layer norms to float32, which
the GPU lane's autocast steps run (tests/gpu_lane.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from masked_key_cases import LAST, MASKS, K, Q

import mha
from conftest import backend_module
from mha.backends import numpy as N

pytestmark = pytest.mark.torch

B, L, D, H = 2, 6, 16, 4


@pytest.fixture(scope="module")
def torch():
    """torch itself, through mha's torch backend (a missing torch fails here)."""
    return backend_module("torch").torch


@pytest.fixture(scope="module")
def T(torch):
    return backend_module("torch")


def _autocast(torch, dtype):
    return torch.autocast("cpu", dtype=getattr(torch, dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_transformer_block_under_autocast_computes_as_torchs_own_layers(T, torch, dtype):
    """Self-attention with lengths, add & norm, then cross-attention to the first attention's
    output (autocast's dtype): mha's layers against nn.MultiheadAttention and nn.LayerNorm
    holding the same weights, in the same autocast; the outputs and the inputs' gradients."""
    torch.manual_seed(0)
    ours = [T.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D) for _ in "ab"]
    theirs = [mha.interop.to_torch(layer, batch_first=True) for layer in ours]
    norm, their_norm = T.AddNorm(D), torch.nn.LayerNorm(D)
    lengths = torch.tensor([3, L])
    padding = torch.arange(L) >= lengths[:, None]
    outputs, gradients = [], []
    for block in ("ours", "theirs"):
        X = torch.randn(B, L, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with _autocast(torch, dtype):
            if block == "ours":
                Y = ours[0](X, X, X, lengths)
                output = ours[1](norm(X, Y), Y, Y)
            else:
                Y = theirs[0](X, X, X, key_padding_mask=padding)[0]
                output = theirs[1](their_norm(X + Y), Y, Y)[0]
        assert Y.dtype == output.dtype == getattr(torch, dtype)
        output.float().square().sum().backward()
        outputs.append(output)
        gradients.append(X.grad)
    torch.testing.assert_close(*outputs)
    torch.testing.assert_close(*gradients, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("qk_norm", [None, "head"])
def test_decoding_under_autocast_caches_what_the_call_computed(T, torch, qk_norm):
    """A prompt, then one position at a time with a KVCache, rotary embeddings and grouped
    heads, all inside autocast: each step as the NumPy reference's whole causal call, to
    bfloat16's precision. The cache holds autocast's dtype, but the keys a float32 QK-norm's
    weights gave (torch's promotion, as transformers' RMSNorm gives them)."""
    options = dict(num_kv_heads=2, rope_theta=1e4, qk_norm=qk_norm, query_size=D, key_size=D,
                   value_size=D)  # fmt: skip
    layer, reference = (M.MultiHeadAttention(D, H, **options) for M in (T, N))
    mha.set_weights(reference, mha.get_weights(layer))
    X = np.random.default_rng(0).standard_normal((B, L, D)).astype("float32")
    expected = reference(X, X, X, causal=True)
    steps, cache = [], mha.KVCache()
    with torch.no_grad(), _autocast(torch, "bfloat16"):
        for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6)):
            part = torch.from_numpy(X[:, start:stop])
            output, cache = layer(part, part, part, causal=True, cache=cache)
            steps.append(output.float().numpy())
    assert cache.values.dtype == torch.bfloat16
    assert cache.keys.dtype == (torch.bfloat16 if qk_norm is None else torch.float32)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), expected, atol=3e-2, rtol=0)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("masks", MASKS)
def test_a_nan_at_a_masked_key_stays_out_under_autocast(T, torch, masks, need_weights):
    """NaN at key LAST, which each mask leaves out of some rows: those rows as with the key
    clean, in the same autocast (the calls without weights reach the fused kernel), to
    bfloat16's precision: a mask other than key padding takes another path when a key is
    not finite, which rounds otherwise."""
    layer = T.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D).eval()
    rng = np.random.default_rng(0)
    queries, keys, values = (torch.from_numpy(rng.standard_normal((B, n, D), "float32"))
                             for n in (Q, K, K))  # fmt: skip
    poisoned = keys.clone()
    poisoned[:, LAST] = float("nan")
    arguments = {k: torch.from_numpy(v.astype("float32") if v.dtype == "float64" else v)
                 if isinstance(v, np.ndarray) else v for k, v in MASKS[masks].items()}  # fmt: skip
    with torch.no_grad(), _autocast(torch, "bfloat16"):
        layer(queries, keys, values, **arguments)
        # Rows that give key LAST no weight in any head
        rows = (layer.attention_weights[..., LAST] == 0).all(dim=1)
        clean, output = (layer(queries, x, values, need_weights=need_weights, **arguments)
                         for x in (keys, poisoned))  # fmt: skip
    assert rows.any()
    torch.testing.assert_close(output[rows], clean[rows], atol=1e-2, rtol=2e-2)


def _every_layer(T, name):
    """A layer of that kind, and its call on an input x: (layer, call(layer, x))."""
    lengths = T.torch.tensor([3, L])
    if name == "DotProductAttention":
        return T.DotProductAttention(), lambda f, x: f(x, x, x, lengths)
    if name == "AdditiveAttention":
        layer = T.AdditiveAttention(8, query_size=D, key_size=D)
        return layer, lambda f, x: f(x, x, x, lengths)
    if name == "MultiHeadAttention":
        layer = T.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D)
        return layer, lambda f, x: f(x, x, x, lengths, causal=True)
    if name == "MultiHeadLatentAttention":
        layer = T.MultiHeadLatentAttention(
            D, H, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4
        )
        return layer, lambda f, x: f(x, lengths, causal=True)
    if name == "RotaryEmbedding":
        return T.RotaryEmbedding(D), lambda f, x: f(x, 2)
    if name == "AddNorm":
        return T.AddNorm(D), lambda f, x: f(x, x)
    return getattr(T, name)(D), lambda f, x: f(x)  # the positional encodings


LAYERS = ["DotProductAttention", "AdditiveAttention", "MultiHeadAttention",
          "MultiHeadLatentAttention", "PositionalEncoding", "LearnedPositionalEncoding",
          "RotaryEmbedding", "AddNorm"]  # fmt: skip


@pytest.mark.parametrize("name", LAYERS)
def test_every_layer_takes_autocasts_dtype_inside_autocast_only(T, torch, name):
    """A bfloat16 input to a float32 layer: a TypeError naming the layer's dtype outside
    autocast; inside it, the float32 call's numbers to bfloat16's precision."""
    torch.manual_seed(0)
    layer, call = _every_layer(T, name)
    layer.eval()
    X = torch.randn(B, L, D)
    expected = call(layer, X)
    low = X.to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"layer's dtype float32\. Received"):
        call(layer, low)
    with _autocast(torch, "bfloat16"):
        output = call(layer, low)
    torch.testing.assert_close(output.float(), expected, atol=5e-2, rtol=2e-2)


def test_autocast_takes_its_own_dtype_alone_and_leaves_float64_layers_as_they_are(T, torch):
    """Inside a bfloat16 autocast a float32 layer refuses float16, naming both dtypes it
    takes; a float64 layer, which autocast does not cast, refuses bfloat16."""
    layer = T.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D)
    wide = T.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D, dtype="float64")
    X = torch.randn(B, L, D)
    with _autocast(torch, "bfloat16"):
        half = X.half()
        with pytest.raises(TypeError, match=r"float32 \(or bfloat16 inside autocast\)"):
            layer(half, half, half)
        low = X.to(torch.bfloat16)
        with pytest.raises(TypeError, match=r"layer's dtype float64\. Received"):
            wide(low, low, low)
        cache = mha.KVCache(torch.zeros(B, H, 2, D // H, dtype=torch.float16), None)
        with pytest.raises(TypeError, match=r"cache\.keys must have the layer's dtype float32"):
            layer(X, X, X, cache=cache)


def test_a_half_precision_layer_inside_its_own_autocast_names_its_dtype_once(T, torch):
    layer = T.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D, dtype="bfloat16")
    X = torch.randn(B, L, D)
    with _autocast(torch, "bfloat16"), pytest.raises(TypeError) as error:
        layer(X, X, X)
    assert "must have the layer's dtype bfloat16. Received" in str(error.value)


@pytest.mark.parametrize("dtype, other", [("float16", "bfloat16"), ("bfloat16", "float16")])
def test_a_half_precision_add_norm_takes_its_own_dtype_alone_inside_autocast(
    T, torch, dtype, other
):
    """torch's layer norm takes a half-precision input with weights of its dtype or of float32
    alone (nn.LayerNorm of one half dtype fails inside the other's autocast): mha's AddNorm of
    one half dtype refuses the other's inputs by name, where a float32 one takes them, as
    nn.LayerNorm in float32 does."""
    torch.manual_seed(0)
    X, Y = (torch.randn(B, L, D).to(getattr(torch, other)) for _ in "XY")
    with _autocast(torch, other):
        with pytest.raises(RuntimeError):
            torch.nn.LayerNorm(D, dtype=getattr(torch, dtype))(X + Y)
        with pytest.raises(TypeError, match=rf"X must have the layer's dtype {dtype}\. Received"):
            T.AddNorm(D, dtype=dtype)(X, Y)
        torch.testing.assert_close(T.AddNorm(D)(X, Y), torch.nn.LayerNorm(D)(X + Y))


@pytest.mark.parametrize("dtype, other", [("float16", "bfloat16"), ("bfloat16", "float16")])
def test_one_half_dtype_inside_the_others_autocast_is_named_not_torchs_failure(
    T, torch, dtype, other
):
    """torch's cat and stack fail on one half dtype inside the other's autocast ("Unexpected
    floating ScalarType"): a RotaryEmbedding of one half dtype, and a cache of one continued
    in the other's autocast, are TypeErrors naming both; a float32 RotaryEmbedding takes
    autocast's dtype there."""
    X = torch.randn(B, L, D).to(getattr(torch, dtype))
    with _autocast(torch, other):
        with pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
            torch.cat([X, X], dim=-1)
        with pytest.raises(TypeError, match=rf"a {dtype} RotaryEmbedding cannot run inside"):
            T.RotaryEmbedding(D, dtype=dtype)(X)
        low = X.to(getattr(torch, other))
        assert T.RotaryEmbedding(D)(low).dtype == low.dtype
    layer = T.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D, dtype=dtype)
    _, cache = layer(X[:, :2], X[:, :2], X[:, :2], causal=True, cache=mha.KVCache())
    with _autocast(torch, other), pytest.raises(TypeError, match=f"the cache holds {dtype}"):
        layer(X[:, 2:], X[:, 2:], X[:, 2:], causal=True, cache=cache)


def test_a_float32_bias_meets_the_scores_in_float32_inside_autocast(T, torch):
    """torch's type promotion: scores in autocast's dtype plus a float32 attn_bias are float32,
    so a row biased by -1e4 (transformers' padded query) keeps its scores' softmax, the float64
    reference's weights to bfloat16's precision; rounded to bfloat16 first, as
    nn.MultiheadAttention's baddbmm rounds its mask, -1e4 + a score keeps none of the score."""
    layer, reference = (M.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D)
                        for M in (T, N))  # fmt: skip
    mha.set_weights(reference, mha.get_weights(layer))
    X = np.random.default_rng(0).standard_normal((B, L, D)).astype("float32")
    bias = np.zeros((B, 1, L, L), "float32")
    bias[0, :, L - 1] = -1e4
    expected = reference(X, X, X, attn_bias=bias)
    inputs = torch.from_numpy(X)
    with torch.no_grad(), _autocast(torch, "bfloat16"):
        output = layer(inputs, inputs, inputs, attn_bias=torch.from_numpy(bias))
    weights = layer.attention_weights
    assert weights.dtype == torch.float32
    np.testing.assert_allclose(weights.numpy(), reference.attention_weights, atol=2e-2)
    np.testing.assert_allclose(output.float().numpy(), expected, atol=3e-2)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("name", ["MultiHeadAttention", "MultiHeadLatentAttention"])
def test_a_float32_bias_of_small_steps_is_added_in_float32_on_every_path(
    T, torch, name, need_weights
):
    """-1000 + 0.75 k at key k: in bfloat16 (steps of 4 there) every key's bias is one number.
    Without weights the call took SDPA's kernel, whose mask autocast rounds with its inputs:
    0.59 off the reference (0.97 for latent attention), where the other path is 5e-3 off."""
    sizes = {"query_size": D, "key_size": D, "value_size": D}
    if name == "MultiHeadLatentAttention":
        sizes = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4}
    layer, reference = (getattr(M, name)(D, H, **sizes) for M in (T, N))
    mha.set_weights(reference, mha.get_weights(layer))
    X = np.random.default_rng(0).standard_normal((B, L, D)).astype("float32")
    bias = np.broadcast_to(-1000 + 0.75 * np.arange(L, dtype="float32"), (B, 1, L, L))
    inputs = [torch.from_numpy(X)] * (1 if name == "MultiHeadLatentAttention" else 3)
    expected = reference(*[X] * len(inputs), attn_bias=bias)
    with torch.no_grad(), _autocast(torch, "bfloat16"):
        output = layer(*inputs, attn_bias=torch.from_numpy(bias.copy()), need_weights=need_weights)
    np.testing.assert_allclose(output.float().numpy(), expected, atol=3e-2)


def test_autocast_keeps_a_call_off_the_kernel_only_where_it_would_round_the_bias(T, torch):
    # Inside autocast a float32 bias would be cast with SDPA's inputs: the scores path. A
    # float64 call, which autocast leaves alone, keeps the kernel, as without a bias
    from mha.backends import torch_fused

    for dtype, path in ((torch.float32, "scores"), (torch.float64, "fused")):
        q = torch.zeros(B, H, L, D // H, dtype=dtype)
        bias = torch.zeros(B, 1, L, L, dtype=dtype)
        with _autocast(torch, "bfloat16"):
            chosen = torch_fused.choose_path(q, q, q, None, bias, False, "zeros", 0.0)
            unbiased = torch_fused.choose_path(q, q, q, None, None, False, "zeros", 0.0)
        assert (chosen, unbiased) == (path, "fused")
        assert torch_fused.choose_path(q, q, q, None, bias, False, "zeros", 0.0) == "fused"


def test_a_layer_on_the_meta_device_runs_inside_autocast(T, torch):
    """The meta device has no autocast state to read: the layer's own dtype applies."""
    layer = T.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D).to("meta")
    X = torch.zeros(B, L, D, device="meta")
    with _autocast(torch, "bfloat16"):
        output = layer(X, X, X, causal=True)
    assert output.device.type == "meta" and output.shape == (B, L, D)
