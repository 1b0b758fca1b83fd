"""What each framework's own attention gives a query that has no key to attend.

Each framework's layer runs here with identity projections on one batch in which query 1 has
every key masked, and the test reads what that row holds: zeros, the mean of the values (the
softmax of a row of equal large negative numbers: uniform weights), or NaN. docs/porting.md
tabulates the results; mha's `empty_rows` reproduces each one ("zeros" or "uniform"). float32,
every framework's default: in float64, jax.nn.dot_product_attention (jax 0.7.1) gives NaN there.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import mha
from conftest import backend_module, backend_params, required_import

X = np.random.default_rng(0).standard_normal((1, 3, 4)).astype("float32")
# Query 0 attends to keys 0 and 1, query 1 to none, query 2 to key 0
KEEP = np.array([[True, True, False], [False, False, False], [True, False, False]])
MEAN_OF_VALUES = X[0].mean(axis=0)


def empty_row(output) -> str:
    """What the row of the query with no key holds."""
    row = np.asarray(output, dtype="float64").reshape(3, 4)[1]
    if np.isnan(row).any():
        return "NaN"
    if np.array_equal(row, np.zeros(4)):
        return "zeros"
    if np.allclose(row, MEAN_OF_VALUES, rtol=0, atol=1e-6):
        return "uniform"
    return f"other: {row}"


def torch_layer(bias=False, num_heads=1):
    torch = backend_module("torch").torch
    layer = torch.nn.MultiheadAttention(4, num_heads, bias=bias, batch_first=True).eval()
    with torch.no_grad():
        layer.in_proj_weight.copy_(torch.cat([torch.eye(4)] * 3))
        layer.out_proj.weight.copy_(torch.eye(4))
        if bias:  # zero: the projections stay the identity
            layer.in_proj_bias.zero_()
            layer.out_proj.bias.zero_()
    return torch, layer


def keras_layer():
    keras = backend_module("tensorflow").keras
    layer = keras.layers.MultiHeadAttention(1, 4, use_bias=False)
    layer(X, X)
    for variable in layer.weights:
        variable.assign(np.eye(4, dtype="float32").reshape(variable.shape))
    return layer


def torch_multihead(need_weights, fast=False):
    """fast: biases and an even number of heads, which with evaluation, no gradient,
    self-attention and need_weights=False take torch's fast path
    (torch._native_multi_head_attention)."""
    torch, layer = torch_layer(bias=fast, num_heads=2 if fast else 1)
    x = torch.tensor(X)
    with torch.no_grad():
        return layer(x, x, x, attn_mask=torch.tensor(~KEEP), need_weights=need_weights)[0]


def torch_sdpa():
    torch = backend_module("torch").torch
    x = torch.tensor(X)
    return torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=torch.tensor(KEEP))


def keras_multihead(return_attention_scores):
    layer = keras_layer()
    output = layer(X, X, attention_mask=KEEP[None], return_attention_scores=return_attention_scores)
    return output[0] if return_attention_scores else output


def jax_dot_product_attention():
    jax = backend_module("jax").jax
    x = X[:, :, None, :]  # (batch, length, heads, head size)
    return jax.nn.dot_product_attention(x, x, x, mask=KEEP[None, None])


def flax_multihead():
    backend_module("jax")
    import jax.numpy as jnp
    from flax import nnx

    layer = nnx.MultiHeadAttention(
        1, 4, qkv_features=4, use_bias=False, decode=False, rngs=nnx.Rngs(0)
    )
    eye = jnp.eye(4, dtype="float32")
    for name in ("query", "key", "value"):
        getattr(layer, name).kernel[...] = eye.reshape(4, 1, 4)
    layer.out.kernel[...] = eye.reshape(1, 4, 4)
    return layer(X, X, X, mask=KEEP[None, None])


def transformers_attention(kind):
    """transformers' attention functions of its models (Llama's and the others'), given the
    mask as its models hand it to each: eager an additive one, the dtype's lowest number where
    masked; SDPA a boolean one, True = attend."""
    torch = backend_module("torch").torch
    required_import("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    x = torch.tensor(X)[:, None]  # (batch, heads, length, head size)
    module = types.SimpleNamespace(num_key_value_groups=1, is_causal=False, training=False)
    keep = torch.tensor(KEEP)[None, None]
    if kind == "sdpa":
        return sdpa_attention_forward(module, x, x, x, keep, scaling=0.5)[0]
    lowest = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    return eager_attention_forward(module, x, x, x, lowest, scaling=0.5)[0]


def d2l_masked_softmax():
    """d2l's masked_softmax (the book's code, in numpy): masked scores become -1e6."""
    scores = X @ X.transpose(0, 2, 1) / np.sqrt(4)
    scores = np.where(KEEP[None], scores, -1e6)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True) @ X


FRAMEWORKS = {
    "torch nn.MultiheadAttention, need_weights=True": (lambda: torch_multihead(True), "NaN"),
    "torch nn.MultiheadAttention, need_weights=False": (lambda: torch_multihead(False), "zeros"),
    "torch nn.MultiheadAttention, need_weights=False, its fast path": (
        lambda: torch_multihead(False, fast=True),
        "NaN",
    ),
    "torch F.scaled_dot_product_attention": (torch_sdpa, "zeros"),
    "keras MultiHeadAttention": (lambda: keras_multihead(False), "uniform"),
    "keras MultiHeadAttention, return_attention_scores=True": (
        lambda: keras_multihead(True),
        "zeros",
    ),
    "jax.nn.dot_product_attention": (jax_dot_product_attention, "uniform"),
    "flax nnx.MultiHeadAttention": (flax_multihead, "uniform"),
    "transformers eager attention (eager_attention_forward)": (
        lambda: transformers_attention("eager"),
        "uniform",
    ),
    "transformers SDPA attention (sdpa_attention_forward)": (
        lambda: transformers_attention("sdpa"),
        "zeros",
    ),
    "d2l masked_softmax (-1e6 fill)": (d2l_masked_softmax, "uniform"),
}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_what_each_framework_gives_a_query_with_no_key(framework):
    run, expected = FRAMEWORKS[framework]
    assert empty_row(run()) == expected


@pytest.mark.parametrize("empty_rows", ["zeros", "uniform"])
@pytest.mark.parametrize("name", backend_params())
def test_empty_rows_reproduces_each_framework(name, empty_rows):
    # mha's layer with the same identity projections, mask and empty_rows gives the numbers of
    # every framework above that gives zeros or uniform weights, every row of them
    module = backend_module(name)
    layer = module.MultiHeadAttention(
        4, 1, query_size=4, key_size=4, value_size=4, empty_rows=empty_rows
    )
    mha.set_weights(layer, {f"W_{k}": np.eye(4, dtype="float32") for k in "qkvo"})
    x = module.from_numpy(X)
    output = module.to_numpy(layer(x, x, x, mask=module.from_numpy(KEEP)))
    assert empty_row(output) == empty_rows
    for framework, (run, gives) in FRAMEWORKS.items():
        if gives == empty_rows and "d2l" not in framework:
            np.testing.assert_allclose(
                output,
                np.asarray(run()).reshape(output.shape),
                rtol=0,
                atol=1e-6,
                err_msg=framework,
            )
