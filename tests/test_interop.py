"""mha.interop: mha's MultiHeadAttention against torch's and Keras's own, in both directions.

The built-in layers are the independent side: the same weights and inputs, with the masks
translated, must give the same outputs and per-head attention weights in every mha backend.
Rows with no allowed key are compared separately (torch gives NaN there, mha zeros).
"""

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
from packaging.version import Version

import mha
from conftest import backend_module, backend_params
from mha import harness, interop

BATCH, QUERIES, KEYS = 3, 4, 6

# (num_hiddens, num_heads, bias, query_size, key_size, value_size). Every head size is 4:
# Keras rounds its score scale 1/sqrt(key_dim) to float32 even in float64 (see
# test_keras_float64_scale_is_rounded_to_float32), and 1/sqrt(4) is exact.
TORCH_CONFIGS = {
    "packed-bias": (8, 2, True, 8, 8, 8),
    "packed-nobias": (16, 4, False, 16, 16, 16),
    "kdim-vdim-bias": (8, 2, True, 8, 5, 3),
    "kdim-vdim-nobias": (12, 3, False, 12, 5, 7),
}
KERAS_CONFIGS = {
    **TORCH_CONFIGS,
    "query-size-bias": (8, 2, True, 6, 5, 3),
}


@pytest.fixture(scope="module")
def torch():
    backend_module("torch")  # a required framework that is missing fails, else skips
    import torch

    return torch


@pytest.fixture(scope="module")
def keras():
    backend_module("tensorflow")
    import tensorflow as tf

    return tf.keras


def mha_mask_cases(num_heads, rng, *, per_head=True):
    """(name, valid_lens, mask, causal) in mha's terms; lengths of 0 leave rows with no key."""
    lengths_1d = np.array([2, KEYS + 3, 0])
    lengths_2d = rng.integers(0, KEYS + 1, size=(BATCH, QUERIES))
    mask_3d = rng.random((BATCH, QUERIES, KEYS)) < 0.7
    mask_3d[0, 1] = False  # a row with no key
    cases = [
        ("none", None, None, False),
        ("valid_lens_1d", lengths_1d, None, False),
        ("valid_lens_2d", lengths_2d, None, False),
        ("mask_2d", None, rng.random((QUERIES, KEYS)) < 0.7, False),
        ("mask_3d", None, mask_3d, False),
        ("causal", None, None, True),
        ("causal+valid_lens_1d+mask_3d", lengths_1d, mask_3d, True),
    ]
    if per_head:
        cases.append(("mask_4d", None, rng.random((BATCH, num_heads, QUERIES, KEYS)) < 0.7, False))
    return cases


def inputs(config, dtype, rng):
    _, _, _, query_size, key_size, value_size = config
    return (
        rng.standard_normal((BATCH, QUERIES, query_size)).astype(dtype),
        rng.standard_normal((BATCH, KEYS, key_size)).astype(dtype),
        rng.standard_normal((BATCH, KEYS, value_size)).astype(dtype),
    )


def mha_layer(module, config, dtype, seed=0):
    num_hiddens, num_heads, bias, query_size, key_size, value_size = config
    layer = module.MultiHeadAttention(
        num_hiddens,
        num_heads,
        bias=bias,
        query_size=query_size,
        key_size=key_size,
        value_size=value_size,
        dtype=dtype,
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=seed))
    return layer


def call_mha(module, layer, queries, keys, values, valid_lens=None, **masks):
    tensors = [module.from_numpy(x) for x in (queries, keys, values)]
    if valid_lens is not None:
        valid_lens = module.from_numpy(valid_lens)
    masks = {
        key: module.from_numpy(value) if isinstance(value, np.ndarray) else value
        for key, value in masks.items()
        if value is not None
    }
    output = layer(*tensors, valid_lens, **masks)
    return module.to_numpy(output), module.to_numpy(layer.attention_weights)


def call_torch(torch, module, queries, keys, values, **masks):
    with torch.no_grad():
        output, weights = module(
            *(torch.from_numpy(x) for x in (queries, keys, values)),
            need_weights=True,
            average_attn_weights=False,
            **masks,
        )
    return output.numpy(), weights.numpy()


def call_keras(layer, queries, keys, values, **masks):
    output, weights = layer(queries, values, keys, return_attention_scores=True, **masks)
    return np.asarray(output), np.asarray(weights)


def assert_agree(ours, theirs, dtype):
    """Outputs and per-head weights agree on every row with at least one allowed key."""
    (output, weights), (other_output, other_weights) = ours, theirs
    assert output.shape == other_output.shape and weights.shape == other_weights.shape
    # mha's weights of a row sum to 1 when it has a key and are all zero when it has none
    sums = weights.astype(np.float64).sum(-1)
    has_key = sums > 0.5
    assert np.allclose(sums[~has_key], 0.0)
    tolerance = harness.TOLERANCES[dtype]
    relative = dtype != "float64"
    assert harness.difference(other_weights[has_key], weights[has_key], relative) <= tolerance
    rows = has_key.all(axis=1)  # an output row mixes every head
    assert rows.any()
    assert harness.difference(other_output[rows], output[rows], relative) <= tolerance


def randomize_torch(torch, module, seed):
    """Random values in every parameter (torch starts biases at zero, which would hide them)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            values = torch.rand(parameter.shape, generator=generator, dtype=torch.float64)
            parameter.copy_(values - 0.5)


def randomize_keras(layer, seed):
    rng = np.random.default_rng(seed)
    for variable in layer.weights:
        variable.assign(rng.uniform(-0.5, 0.5, tuple(variable.shape)).astype(variable.dtype))


# ---------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("config", TORCH_CONFIGS.values(), ids=TORCH_CONFIGS.keys())
@pytest.mark.parametrize("name", backend_params())
def test_mha_to_torch(torch, name, config, dtype):
    module = backend_module(name)
    layer = mha_layer(module, config, dtype)
    builtin = interop.to_torch(layer).eval()
    assert builtin.batch_first and builtin.num_heads == config[1]
    assert builtin._qkv_same_embed_dim == (config[4] == config[5] == config[0])
    rng = np.random.default_rng(1)
    tensors = inputs(config, dtype, rng)
    for case, valid_lens, mask, causal in mha_mask_cases(config[1], rng):
        ours = call_mha(module, layer, *tensors, valid_lens, mask=mask, causal=causal)
        masks = interop.to_torch_masks(
            valid_lens, mask, causal, num_heads=config[1], num_queries=QUERIES, num_keys=KEYS
        )
        theirs = call_torch(torch, builtin, *tensors, **masks)
        try:
            assert_agree(ours, theirs, dtype)
        except AssertionError as error:
            raise AssertionError(f"mask case {case}: {error}") from None


def torch_mask_cases(torch, num_heads, rng):
    """(name, key_padding_mask, attn_mask) in torch's terms: True = NOT allowed."""
    padding = torch.from_numpy(np.arange(KEYS)[None, :] >= np.array([[3], [KEYS], [1]]))
    future = torch.triu(torch.ones(QUERIES, KEYS, dtype=torch.bool), diagonal=1)
    float_future = torch.zeros(QUERIES, KEYS).masked_fill(future, float("-inf"))
    per_head = torch.from_numpy(rng.random((BATCH * num_heads, QUERIES, KEYS)) < 0.3)
    return [
        ("key_padding_mask", padding, None),
        ("attn_mask_2d", None, future),
        ("attn_mask_float", None, float_future),
        ("attn_mask_3d+key_padding_mask", padding, per_head),
    ]


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("config", TORCH_CONFIGS.values(), ids=TORCH_CONFIGS.keys())
@pytest.mark.parametrize("name", backend_params())
def test_torch_to_mha(torch, name, config, dtype):
    module = backend_module(name)
    num_hiddens, num_heads, bias, _, key_size, value_size = config
    builtin = torch.nn.MultiheadAttention(
        num_hiddens,
        num_heads,
        bias=bias,
        kdim=key_size,
        vdim=value_size,
        batch_first=True,
        dtype=getattr(torch, dtype),
    ).eval()
    randomize_torch(torch, builtin, seed=2)
    layer = interop.from_torch(builtin, backend=name)
    assert mha.registry.backend_of(layer) == name
    assert module.layer_config(layer) == {
        "num_hiddens": num_hiddens,
        "num_heads": num_heads,
        "dropout": 0.0,
        "bias": bias,
        "query_size": num_hiddens,
        "key_size": key_size,
        "value_size": value_size,
        "dtype": dtype,
        "out_bias": None,
        "out_features": None,
        "scale": None,
        "empty_rows": "zeros",
        "sliding_window": None,
        "attention_chunk_size": None,
        "num_kv_heads": None,
        "rope_theta": None,
        "rope_interleaved": False,
        "rope_dim": None,
        "rope_scaling": None,
        "query_scaling": None,
        "softcap": None,
        "sinks": False,
        "qk_norm": None,
        "qk_norm_eps": 1e-06,
        "output_gate": False,
        "alibi": False,
        "value_norm": False,
    }
    rng = np.random.default_rng(3)
    tensors = inputs(config, dtype, rng)
    for case, padding, attn_mask in torch_mask_cases(torch, num_heads, rng):
        if attn_mask is not None and attn_mask.dtype.is_floating_point:
            attn_mask = attn_mask.to(getattr(torch, dtype))
        theirs = call_torch(torch, builtin, *tensors, key_padding_mask=padding, attn_mask=attn_mask)
        masks = interop.from_torch_masks(padding, attn_mask, num_heads=num_heads, backend=name)
        ours = call_mha(module, layer, *tensors, **masks)
        try:
            assert_agree(ours, theirs, dtype)
        except AssertionError as error:
            raise AssertionError(f"mask case {case}: {error}") from None


@pytest.mark.torch
def test_masks_that_broadcast_become_attn_masks_torch_takes(torch):
    # Masks of any shape mha's layer takes, broadcasting over examples, heads or queries:
    # torch's layer with the translated masks computes what the NumPy reference does
    num_heads = 2
    builtin = torch.nn.MultiheadAttention(8, num_heads, batch_first=True).eval()
    randomize_torch(torch, builtin, seed=4)
    layer = interop.from_torch(builtin, backend="numpy")
    rng = np.random.default_rng(5)
    queries, keys, values = inputs((8, num_heads, True, 8, 8, 8), "float32", rng)
    shapes = [(KEYS,), (1, 1, KEYS), (QUERIES, KEYS), (1, QUERIES, KEYS), (BATCH, 1, 1, KEYS)]
    shapes += [(1, num_heads, QUERIES, KEYS), (BATCH, num_heads, 1, KEYS)]
    for shape in shapes:
        mask = rng.random(shape) < 0.7
        mask[..., 0] = True  # every row keeps a key: torch's rows without one are NaN
        sizes = dict(num_heads=num_heads, num_queries=QUERIES, num_keys=KEYS, batch_size=BATCH)
        masks = interop.to_torch_masks(None, mask, **sizes)
        theirs = call_torch(torch, builtin, queries, keys, values, **masks)
        ours = call_mha(backend_module("numpy"), layer, queries, keys, values, mask=mask)
        assert_agree(ours, theirs, "float32")
    with pytest.raises(ValueError, match="give batch_size"):  # torch's mask has a batch axis
        interop.to_torch_masks(
            None,
            np.ones((1, num_heads, QUERIES, KEYS), bool),
            num_heads=num_heads,
            num_queries=QUERIES,
            num_keys=KEYS,
        )


@pytest.mark.torch
def test_rows_without_keys_torch_gives_nan_mha_gives_b_o(torch):
    config = TORCH_CONFIGS["packed-bias"]
    layer = mha_layer(backend_module("numpy"), config, "float32")
    builtin = interop.to_torch(layer).eval()
    tensors = inputs(config, "float32", np.random.default_rng(0))
    valid_lens = np.array([2, 0, KEYS])
    masks = interop.to_torch_masks(
        valid_lens, num_heads=config[1], num_queries=QUERIES, num_keys=KEYS
    )
    output, weights = call_torch(torch, builtin, *tensors, **masks)
    assert np.isnan(output[1]).all() and np.isnan(weights[1]).all()
    assert np.isfinite(output[[0, 2]]).all()
    ours, our_weights = call_mha(backend_module("numpy"), layer, *tensors, valid_lens)
    assert np.array_equal(our_weights[1], np.zeros_like(our_weights[1]))
    assert np.allclose(ours[1], mha.get_weights(layer)["b_o"])


@pytest.mark.torch
def test_torch_state_dict_layouts(torch):
    weights = mha.random_weights(
        "MultiHeadAttention",
        num_hiddens=4,
        num_heads=2,
        bias=True,
        query_size=4,
        key_size=4,
        value_size=4,
        seed=5,
    )
    state = interop.torch_state_dict(weights)
    assert {k: v.shape for k, v in state.items()} == {
        "in_proj_weight": (12, 4),
        "in_proj_bias": (12,),
        "out_proj.weight": (4, 4),
        "out_proj.bias": (4,),
    }
    # torch computes x @ in_proj_weight.T: rows 0..3 are the query projection
    assert np.array_equal(state["in_proj_weight"][:4], weights["W_q"].T)
    assert np.array_equal(state["in_proj_bias"][4:8], weights["b_k"])
    back, config = interop.canonical_from_torch(state)
    assert all(np.array_equal(back[k], weights[k]) for k in weights)
    assert config["key_size"] == 4 and config["bias"] is True
    torch.nn.MultiheadAttention(4, 2).load_state_dict(
        {k: torch.from_numpy(v) for k, v in state.items()}
    )


@pytest.mark.torch
@pytest.mark.parametrize("sizes", [(8, 3), (5, 8)], ids=["key-size-only", "value-size-only"])
def test_one_input_size_of_embed_dim_gives_separate_torch_projections(torch, sizes):
    # torch packs in_proj_weight only when kdim and vdim both equal embed_dim: one of them
    # alone is three separate projections, and torch's layer computes what mha's does
    config = (8, 2, True, 8, *sizes)
    module = backend_module("numpy")
    layer = mha_layer(module, config, "float32", seed=6)
    builtin = interop.to_torch(layer).eval()
    assert not builtin._qkv_same_embed_dim and "in_proj_weight" not in builtin.state_dict()
    tensors = inputs(config, "float32", np.random.default_rng(6))
    assert_agree(call_mha(module, layer, *tensors), call_torch(torch, builtin, *tensors), "float32")
    back = interop.from_torch(builtin, backend="numpy")
    for name, value in mha.get_weights(layer).items():
        np.testing.assert_array_equal(mha.get_weights(back)[name], value)


@pytest.mark.torch
def test_the_config_read_from_a_torch_state_has_each_input_size(torch):
    # kdim 5 and vdim 3 beside embed_dim 8: separate projections, each its own input size
    module = torch.nn.MultiheadAttention(8, 2, kdim=5, vdim=3)
    weights, config = interop.canonical_from_torch(module.state_dict())
    sizes = {"num_hiddens": 8, "query_size": 8, "key_size": 5, "value_size": 3}
    assert {name: config[name] for name in sizes} == sizes
    assert weights["W_k"].shape == (5, 8) and weights["W_v"].shape == (3, 8)


@pytest.mark.torch
def test_what_torch_cannot_express(torch):
    numpy_backend = backend_module("numpy")
    layer = mha_layer(numpy_backend, KERAS_CONFIGS["query-size-bias"], "float32")
    with pytest.raises(ValueError, match=r"query size to equal embed_dim.*query_size=6"):
        interop.to_torch(layer)
    with pytest.raises(ValueError, match="add_bias_kv"):
        interop.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        interop.from_torch(torch.nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(ValueError, match="meta device holds no values"):
        interop.from_torch(torch.nn.MultiheadAttention(8, 2, device="meta"))
    with pytest.raises(TypeError, match=r"torch\.nn\.MultiheadAttention holds.*AddNorm"):
        interop.to_torch(numpy_backend.AddNorm(4))
    with pytest.raises(ValueError, match=r"missing out_proj\.weight"):
        interop.canonical_from_torch({"in_proj_weight": np.zeros((6, 2), "f")})
    with pytest.raises(ValueError, match="in_proj_weight has shape"):
        interop.canonical_from_torch(
            {"in_proj_weight": np.zeros((6, 3), "f"), "out_proj.weight": np.zeros((2, 2), "f")}
        )
    # bfloat16 is a float too, which numpy does not class as one
    bfloat16 = torch.tensor([[0.0, -1.0], [2.0, 0.0]], dtype=torch.bfloat16)
    for masks in ({"attn_mask": bfloat16}, {"key_padding_mask": bfloat16}):
        bias = interop.from_torch_masks(**masks, num_heads=2, backend="torch")["attn_bias"]
        assert bias.dtype == torch.bfloat16 and bias.flatten().tolist() == [0, -1, 2, 0]
    # torch takes boolean and float masks only, and (B * num_heads, Q, K) of the batch's B
    for masks in ({"attn_mask": np.eye(2, dtype=int)}, {"key_padding_mask": np.eye(2, dtype="u1")}):
        with pytest.raises(ValueError, match=r"must be boolean .* or float .* Received dtype"):
            interop.from_torch_masks(**masks, num_heads=2)
    padding = np.zeros((3, 2), bool)
    with pytest.raises(ValueError, match=r"\(B \* num_heads = 6, Q, K\).*shape \(2, 2, 2\)"):
        interop.from_torch_masks(padding, np.zeros((2, 2, 2), bool), num_heads=2)
    causal = torch.tensor([[0.0, -np.inf], [0.0, 0.0]], dtype=torch.bfloat16)
    allowed = interop.from_torch_masks(attn_mask=causal, num_heads=2)
    assert np.asarray(allowed["mask"]).tolist() == [[[[True, False], [True, True]]]]
    # A file's keys may be anything: one that is not a name is named, not a TypeError
    state = {**torch.nn.MultiheadAttention(4, 2).state_dict(), 0: torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected 0"):
        interop.canonical_from_torch(state)
    # A state_dict holds the packed projection or the three separate ones
    state = torch.nn.MultiheadAttention(4, 2).state_dict()
    state["q_proj_weight"] = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="both in_proj_weight and q_proj_weight"):
        interop.canonical_from_torch(state)


@pytest.mark.torch
def test_a_torch_state_dict_of_mixed_dtypes_or_half_its_biases_is_refused(torch):
    # torch's load_state_dict would cast the odd tensor silently; mha reads one dtype, and
    # biases on the input projections and on the output one, or on neither
    state = torch.nn.MultiheadAttention(4, 2).state_dict()
    mixed = {**state, "out_proj.weight": state["out_proj.weight"].double()}
    with pytest.raises(ValueError, match="different dtypes: float32, float64"):
        interop.canonical_from_torch(mixed)
    halves = [
        {k: v for k, v in state.items() if k != "out_proj.bias"},
        {k: v for k, v in state.items() if k != "in_proj_bias"},
    ]
    for half in halves:
        with pytest.raises(ValueError, match="must be both present or both absent"):
            interop.canonical_from_torch(half)


@pytest.mark.torch
@pytest.mark.parametrize("name", backend_params())
def test_torch_float_masks_of_any_numbers_become_attn_bias(torch, name):
    # torch adds a float mask to the scores, as mha adds attn_bias; -inf leaves a key out
    config = TORCH_CONFIGS["packed-bias"]
    num_heads, module = config[1], backend_module(name)
    builtin = torch.nn.MultiheadAttention(8, num_heads, batch_first=True, dtype=torch.float64)
    randomize_torch(torch, builtin.eval(), seed=4)
    layer = interop.from_torch(builtin, backend=name)
    rng = np.random.default_rng(4)
    tensors = inputs(config, "float64", rng)
    per_head = rng.standard_normal((BATCH * num_heads, QUERIES, KEYS))
    per_head[rng.random(per_head.shape) < 0.2] = -np.inf
    padding = np.where(np.arange(KEYS) < np.array([[KEYS], [3], [5]]), 0.0, -np.inf)
    cases = {
        "attn_mask (Q, K)": {"attn_mask": rng.standard_normal((QUERIES, KEYS))},
        "attn_mask (B * heads, Q, K)": {"attn_mask": per_head},
        "key_padding_mask": {"key_padding_mask": padding + rng.standard_normal((BATCH, KEYS))},
        "both": {"key_padding_mask": padding, "attn_mask": per_head},
        "boolean padding, float bias": {"key_padding_mask": padding < 0, "attn_mask": per_head},
    }
    for case, masks in cases.items():
        theirs = call_torch(
            torch, builtin, *tensors, **{k: torch.from_numpy(v) for k, v in masks.items()}
        )
        converted = interop.from_torch_masks(**masks, num_heads=num_heads, backend=name)
        assert "attn_bias" in converted, case
        try:
            assert_agree(call_mha(module, layer, *tensors, **converted), theirs, "float64")
        except AssertionError as error:
            raise AssertionError(f"mask case {case}: {error}") from None


@pytest.mark.torch
def test_two_float_torch_masks_of_any_numbers_add_up(torch):
    # A float key_padding_mask and a float attn_mask, neither only 0 and -inf: torch adds
    # both to the scores, so mha's attn_bias is their sum
    num_heads, module = 2, backend_module("numpy")
    builtin = torch.nn.MultiheadAttention(8, num_heads, batch_first=True, dtype=torch.float64)
    randomize_torch(torch, builtin.eval(), seed=7)
    layer = interop.from_torch(builtin, backend="numpy")
    rng = np.random.default_rng(7)
    tensors = inputs(TORCH_CONFIGS["packed-bias"], "float64", rng)
    masks = {
        "key_padding_mask": 2.0 * rng.standard_normal((BATCH, KEYS)),
        "attn_mask": 2.0 * rng.standard_normal((BATCH * num_heads, QUERIES, KEYS)),
    }
    theirs = call_torch(
        torch, builtin, *tensors, **{k: torch.from_numpy(v) for k, v in masks.items()}
    )
    converted = interop.from_torch_masks(**masks, num_heads=num_heads, backend="numpy")
    assert set(converted) == {"causal", "attn_bias"}
    assert_agree(call_mha(module, layer, *tensors, **converted), theirs, "float64")


@pytest.mark.torch
def test_mha_attn_bias_becomes_a_float_attn_mask(torch):
    config = TORCH_CONFIGS["packed-bias"]
    num_heads, module = config[1], backend_module("numpy")
    layer = mha_layer(module, config, "float64")
    builtin = interop.to_torch(layer).eval()
    rng = np.random.default_rng(6)
    tensors = inputs(config, "float64", rng)
    per_head = rng.standard_normal((BATCH, num_heads, QUERIES, KEYS))
    per_head[rng.random(per_head.shape) < 0.2] = -np.inf
    lengths = np.array([2, KEYS + 3, 0])
    cases = {
        "(Q, K)": (rng.standard_normal((QUERIES, KEYS)), {}),
        "(B, Q, K), causal": (per_head[:, 0], {"causal": True}),
        "(1, heads, Q, K)": (per_head[:1], {}),
        "(B, heads, Q, K), valid_lens": (per_head, {"valid_lens": lengths}),
        "(B, 1, 1, K), mask": (
            rng.standard_normal((BATCH, 1, 1, KEYS)),
            {"mask": rng.random((QUERIES, KEYS)) < 0.7},
        ),
    }
    for case, (bias, masks) in cases.items():
        ours = call_mha(module, layer, *tensors, attn_bias=bias, **masks)
        converted = interop.to_torch_masks(
            **masks,
            attn_bias=bias,
            num_heads=num_heads,
            num_queries=QUERIES,
            num_keys=KEYS,
            batch_size=BATCH,
        )
        assert converted["attn_mask"].dtype == torch.float64 and len(converted) == 1, case
        try:
            assert_agree(ours, call_torch(torch, builtin, *tensors, **converted), "float64")
        except AssertionError as error:
            raise AssertionError(f"mask case {case}: {error}") from None
    with pytest.raises(ValueError, match=r"attn_bias must be a float array .* dtype bool"):
        interop.to_torch_masks(
            attn_bias=np.ones((QUERIES, KEYS), bool),
            num_heads=2,
            num_queries=QUERIES,
            num_keys=KEYS,
        )


@pytest.mark.torch
@pytest.mark.parametrize("need_weights", [True, False])
def test_is_causal_is_torchs_hint_that_attn_mask_is_the_causal_mask(torch, need_weights):
    config = TORCH_CONFIGS["packed-bias"]
    builtin = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64).eval()
    randomize_torch(torch, builtin, seed=5)
    layer = interop.from_torch(builtin, backend="numpy")
    x = inputs(config, "float64", np.random.default_rng(5))[0]  # self-attention, Q = K
    future = np.triu(np.ones((QUERIES, QUERIES), bool), 1)
    padding = np.arange(QUERIES) >= np.array([[QUERIES], [2], [3]])
    for attn_mask in (future, np.where(future, -np.inf, 0.0)):
        for key_padding_mask in (None, padding):
            masks = {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask}
            with torch.no_grad():
                theirs = builtin(
                    *[torch.from_numpy(x)] * 3,
                    **{k: None if v is None else torch.from_numpy(v) for k, v in masks.items()},
                    is_causal=True,
                    need_weights=need_weights,
                )[0].numpy()
            converted = interop.from_torch_masks(**masks, num_heads=2, is_causal=True)
            assert converted["causal"] and ("mask" in converted) == (key_padding_mask is not None)
            np.testing.assert_allclose(layer(x, x, x, **converted), theirs, rtol=1e-12, atol=1e-12)
    # Without attn_mask torch refuses the hint, or on its fast path attends to every key; with
    # another mask it computes with the mask or with causal, depending on its path
    with pytest.raises(ValueError, match="needs the attn_mask too"):
        interop.from_torch_masks(num_heads=2, is_causal=True)
    for attn_mask in (~future, np.where(future, -1e9, 0.0)):
        with pytest.raises(ValueError, match="and this attn_mask is not"):
            interop.from_torch_masks(attn_mask=attn_mask, num_heads=2, is_causal=True)


@pytest.mark.torch
def test_dropout_and_batch_first_carry_over_to_and_from_torch(torch):
    # The dropout rate is config, not weights: it must reach the new layer both ways. With
    # batch_first=False torch takes (Q, B, d): the same numbers, the batch on axis 1
    config = TORCH_CONFIGS["packed-bias"]
    module = backend_module("numpy")
    layer = module.MultiHeadAttention(8, 2, 0.25, True, query_size=8, key_size=8, value_size=8)
    mha.set_weights(layer, mha.random_weights(layer, seed=3))
    builtin = interop.to_torch(layer, batch_first=False)
    assert builtin.dropout == 0.25 and not builtin.batch_first
    back = interop.from_torch(builtin, backend="numpy")
    assert module.layer_config(back)["dropout"] == 0.25
    tensors = inputs(config, "float32", np.random.default_rng(7))
    builtin.eval()
    with torch.no_grad():
        output, _ = builtin(*(torch.from_numpy(x.swapaxes(0, 1).copy()) for x in tensors))
    layer_eval = mha_layer(module, config, "float32", seed=3)
    ours, _ = call_mha(module, layer_eval, *tensors)
    np.testing.assert_allclose(output.numpy().swapaxes(0, 1), ours, rtol=1e-5, atol=1e-6)


# The backends whose layers keep a mode of their own; Keras and Gluon take it at each call,
# and compute without dropout when a call gives none
KEEP_A_MODE = {"numpy", "torch", "jax"}


@pytest.mark.torch
@pytest.mark.parametrize("name", backend_params())
def test_a_torch_modules_mode_carries_over_both_ways(torch, name):
    # A module in eval mode with dropout computes without it: so must the layer made from it,
    # called as the module is, without a mode; one in training mode makes a layer that drops
    module = backend_module(name)
    builtin = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    randomize_torch(torch, builtin, seed=5)
    x = np.random.default_rng(5).standard_normal((2, 4, 8)).astype("float32")
    expected, _ = call_torch(torch, builtin.eval(), x, x, x)
    layer = interop.from_torch(builtin, backend=name)
    ours, _ = call_mha(module, layer, x, x, x)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
    back = interop.to_torch(layer)
    assert back.training is (False if name in KEEP_A_MODE else True)  # else torch's default
    dropping = call_mha(module, interop.from_torch(builtin.train(), backend=name), x, x, x)[0]
    assert np.allclose(dropping, expected, atol=1e-3) is (name not in KEEP_A_MODE)


@pytest.mark.torch
def test_is_causal_refuses_a_mask_that_differs_from_causal_in_one_key(torch):
    # One forbidden key more than the causal mask (query 2 may not see key 0): not the mask
    # that is_causal promises, so torch's paths would disagree and mha refuses the hint
    future = np.triu(np.ones((QUERIES, QUERIES), bool), 1)
    almost = future.copy()
    almost[2, 0] = True
    for attn_mask in (almost, np.where(almost, -np.inf, 0.0)):
        with pytest.raises(ValueError, match="and this attn_mask is not"):
            interop.from_torch_masks(attn_mask=attn_mask, num_heads=2, is_causal=True)
    allowed = interop.from_torch_masks(attn_mask=almost, num_heads=2)["mask"]
    assert np.array_equal(np.asarray(allowed)[0, 0], ~almost)


@pytest.mark.torch
def test_attn_bias_becomes_minus_infinity_exactly_where_masks_drop_a_key(torch):
    # torch's float attn_mask: the bias where mha keeps a key, -inf (not a large negative
    # number, which would still give a row without keys weights) where it does not
    rng = np.random.default_rng(8)
    bias = rng.standard_normal((BATCH, 2, QUERIES, KEYS))
    lengths = np.array([2, KEYS, 0])
    mask = rng.random((QUERIES, KEYS)) < 0.7
    converted = interop.to_torch_masks(
        lengths, mask, True, attn_bias=bias, num_heads=2, num_queries=QUERIES, num_keys=KEYS
    )
    added = converted["attn_mask"].numpy().reshape(BATCH, 2, QUERIES, KEYS)
    keep = spelled_out_keep(lengths, mask, True, 2)
    assert np.array_equal(np.isneginf(added), ~keep)
    assert np.array_equal(added[keep], bias[keep])


@pytest.mark.torch
def test_a_qk_norm_eps_without_a_qk_norm_converts_to_torch(torch):
    # The eps of a QK-norm the layer does not have changes no number: not an option torch
    # lacks, so the layer converts, and torch's layer computes what it does
    config = TORCH_CONFIGS["packed-bias"]
    module = backend_module("numpy")
    layer = module.MultiHeadAttention(
        8, 2, bias=True, query_size=8, key_size=8, value_size=8, qk_norm_eps=1e-3
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=4))
    builtin = interop.to_torch(layer).eval()
    tensors = inputs(config, "float32", np.random.default_rng(4))
    ours = call_mha(module, layer, *tensors)
    assert_agree(ours, call_torch(torch, builtin, *tensors), "float32")


@pytest.mark.torch
def test_a_torch_subclass_computing_its_own_way_is_refused(torch):
    # A forward of its own may compute other numbers from the same weights
    class Scaled(torch.nn.MultiheadAttention):
        def forward(self, query, key, value, **kwargs):
            return super().forward(2.0 * query, key, value, **kwargs)

    class Named(torch.nn.MultiheadAttention):
        def describe(self):
            return "attention"

    with pytest.raises(ValueError, match=r"Scaled overrides forward of torch's Multihead"):
        interop.from_torch(Scaled(8, 2, batch_first=True))
    # A subclass that adds methods computes torch's numbers, and converts
    named = Named(8, 2, batch_first=True).double()
    x = np.random.default_rng(3).standard_normal((2, 3, 8))
    layer = interop.from_torch(named, backend="numpy")
    expected = named(*[torch.from_numpy(x)] * 3, need_weights=False)[0].detach().numpy()
    np.testing.assert_allclose(layer(x, x, x), expected, rtol=0, atol=1e-12)


@pytest.mark.torch
def test_a_torch_module_with_forward_hooks_is_refused(torch):
    # A hook changes what the module computes as an override does (pruning computes its
    # weights from in_proj_weight_orig and a mask in one): converted, it gave other numbers
    from torch.nn.utils import prune

    scaled, pruned = (torch.nn.MultiheadAttention(8, 2, batch_first=True) for _ in "ab")
    scaled.register_forward_hook(lambda module, inputs, output: (0.5 * output[0], output[1]))
    prune.l1_unstructured(pruned, "in_proj_weight", amount=0.5)
    for module, name in ((scaled, "<lambda>"), (pruned, "L1Unstructured")):
        with pytest.raises(ValueError, match=rf"has forward hooks \({name}\).*prune.remove"):
            interop.from_torch(module)
    prune.remove(pruned, "in_proj_weight")  # its weights, zeros and all
    x = np.random.default_rng(5).standard_normal((2, 3, 8)).astype("float32")
    expected = pruned(*[torch.from_numpy(x)] * 3, need_weights=False)[0].detach().numpy()
    converted = interop.from_torch(pruned, backend="numpy")
    np.testing.assert_allclose(converted(x, x, x), expected, rtol=0, atol=1e-5)


@pytest.mark.torch
def test_a_parametrized_torch_module_is_refused_by_name(torch):
    # Its state_dict holds parametrizations.in_proj_weight.original, not the weight it uses
    from torch.nn.utils import parametrize

    class Halved(torch.nn.Module):
        def forward(self, weight):
            return 0.5 * weight

    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    parametrize.register_parametrization(module, "in_proj_weight", Halved())
    with pytest.raises(ValueError, match=r"computes in_proj_weight by parametrizations"):
        interop.from_torch(module)
    # out_proj's, a module inside it; and pruning there, a hook of out_proj's
    inside = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    parametrize.register_parametrization(inside.out_proj, "weight", Halved())
    with pytest.raises(ValueError, match=r"computes out_proj.weight by parametrizations"):
        interop.from_torch(inside)
    pruned = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    torch.nn.utils.prune.l1_unstructured(pruned.out_proj, "weight", amount=0.5)
    with pytest.raises(ValueError, match=r"has forward hooks \(L1Unstructured\)"):
        interop.from_torch(pruned)
    parametrize.remove_parametrizations(module, "in_proj_weight")  # the halved weight stays
    x = np.random.default_rng(6).standard_normal((2, 3, 8)).astype("float32")
    expected = module(*[torch.from_numpy(x)] * 3, need_weights=False)[0].detach().numpy()
    converted = interop.from_torch(module, backend="numpy")
    np.testing.assert_allclose(converted(x, x, x), expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# keras.layers.MultiHeadAttention


@pytest.mark.tensorflow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("config", KERAS_CONFIGS.values(), ids=KERAS_CONFIGS.keys())
@pytest.mark.parametrize("name", backend_params())
def test_mha_to_keras(keras, name, config, dtype):
    module = backend_module(name)
    layer = mha_layer(module, config, dtype)
    builtin = interop.to_keras(layer)
    assert isinstance(builtin, keras.layers.MultiHeadAttention)
    assert builtin.key_dim == builtin.value_dim == config[0] // config[1]
    rng = np.random.default_rng(4)
    tensors = inputs(config, dtype, rng)
    # A per-head mask among them: Keras's layers apply a 4-D attention_mask to each head
    for case, valid_lens, mask, causal in mha_mask_cases(config[1], rng):
        ours = call_mha(module, layer, *tensors, valid_lens, mask=mask, causal=causal)
        masks = interop.to_keras_masks(valid_lens, mask, causal, num_queries=QUERIES, num_keys=KEYS)
        theirs = call_keras(builtin, *tensors, **masks)
        try:
            assert_agree(ours, theirs, dtype)
        except AssertionError as error:
            raise AssertionError(f"mask case {case}: {error}") from None


@pytest.mark.tensorflow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("config", KERAS_CONFIGS.values(), ids=KERAS_CONFIGS.keys())
@pytest.mark.parametrize("name", backend_params())
def test_keras_to_mha(keras, name, config, dtype):
    module = backend_module(name)
    num_hiddens, num_heads, bias, query_size, _, _ = config
    builtin = keras.layers.MultiHeadAttention(
        num_heads, num_hiddens // num_heads, use_bias=bias, output_shape=num_hiddens, dtype=dtype
    )
    rng = np.random.default_rng(5)
    tensors = inputs(config, dtype, rng)
    builtin(tensors[0], tensors[2], tensors[1])  # builds it
    randomize_keras(builtin, seed=6)
    layer = interop.from_keras(builtin, backend=name)
    assert module.layer_config(layer)["query_size"] == query_size
    attention_mask = rng.random((BATCH, QUERIES, KEYS)) < 0.6
    attention_mask[1, 2] = False  # a row with no key
    cases = [
        ("none", None, False),
        ("attention_mask", attention_mask, False),
        ("use_causal_mask", None, True),
        ("both", attention_mask, True),
    ]
    for case, attention, causal in cases:
        theirs = call_keras(builtin, *tensors, attention_mask=attention, use_causal_mask=causal)
        masks = interop.from_keras_masks(attention, causal, backend=name)
        ours = call_mha(module, layer, *tensors, **masks)
        try:
            assert_agree(ours, theirs, dtype)
        except AssertionError as error:
            raise AssertionError(f"mask case {case}: {error}") from None


@pytest.mark.tensorflow
def test_a_keras_layer_of_head_size_one_converts_to_its_formula(keras):
    # Keras on TensorFlow adds the (heads, 1) biases along the positions where a sequence is
    # as long as the heads (docs/weights-and-files.md): the converted layer keeps the formula
    builtin = keras.layers.MultiHeadAttention(4, 1, dtype="float64")
    rng = np.random.default_rng(11)
    X = rng.standard_normal((2, 4, 6))
    builtin(X, X)
    randomize_keras(builtin, seed=12)
    weights = {w.path.split("/")[-2] + "/" + w.name: np.asarray(w) for w in builtin.weights}

    def heads(name):  # (batch, heads, positions, 1)
        kernel, bias = weights[f"{name}/kernel"], weights[f"{name}/bias"]
        return np.einsum("bpf,fhd->bhpd", X, kernel) + bias[:, None, :]

    scores = heads("query") @ heads("key").swapaxes(-1, -2)
    attention = np.exp(scores - scores.max(-1, keepdims=True))
    attention /= attention.sum(-1, keepdims=True)
    kernel, bias = weights["attention_output/kernel"], weights["attention_output/bias"]
    expected = np.einsum("bhpd,hdo->bpo", attention @ heads("value"), kernel) + bias
    ours = interop.from_keras(builtin, backend="numpy")(X, X, X)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-12)


@pytest.mark.tensorflow
def test_a_float_keras_mask_attends_where_it_is_nonzero(keras):
    # Keras casts attention_mask to bool: 0.3, -1.0 and 2.0 attend, as 1.0 does
    builtin = keras.layers.MultiHeadAttention(2, 4, dtype="float64")
    rng = np.random.default_rng(8)
    queries, values = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 8))
    builtin(queries, values)
    randomize_keras(builtin, seed=9)
    layer = interop.from_keras(builtin, backend="numpy")
    attention_mask = np.array([[0.3, 1.0, 0.0, -1.0], [1.0, 0.7, 0.2, 0.0], [0.0, 0.0, 1.0, 2.0]])
    attention_mask = np.broadcast_to(attention_mask, (2, 3, 4))
    for causal in (False, True):
        theirs = builtin(queries, values, attention_mask=attention_mask, use_causal_mask=causal)
        masks = interop.from_keras_masks(attention_mask, causal, backend="numpy")
        ours = layer(queries, values, values, **masks)
        np.testing.assert_allclose(ours, np.asarray(theirs), rtol=0, atol=1e-12)


@pytest.mark.tensorflow
def test_the_masks_keras_inputs_carry_are_given_to_from_keras_masks(keras):
    # Embedding(mask_zero=True) marks padding on its output, which Keras's layer joins with
    # attention_mask by itself: given as query_mask and value_mask, mha's layer agrees on
    # every query that attends; left out, it attends to the padding
    ids = np.array([[3, 1, 4, 0], [5, 9, 0, 0]])
    embedding = keras.layers.Embedding(10, 8, mask_zero=True, dtype="float64")
    builtin = keras.layers.MultiHeadAttention(2, 4, dtype="float64")
    builtin(embedding(ids), embedding(ids))
    randomize_keras(builtin, seed=3)
    layer = interop.from_keras(builtin, backend="numpy")
    attention_mask = np.random.default_rng(4).random((2, 4, 4)) < 0.8
    attention_mask[..., 0] = True
    # Keras clears the masks of the tensors a call takes: each call gets fresh ones
    embedded = embedding(ids)
    x = np.asarray(embedded)
    theirs = np.asarray(builtin(embedded, embedded, attention_mask=attention_mask))
    real = ids != 0
    masks = interop.from_keras_masks(
        attention_mask, query_mask=real, value_mask=real, backend="numpy"
    )
    ours = layer(x, x, x, **masks)
    np.testing.assert_allclose(ours[real], theirs[real], rtol=0, atol=1e-12)
    unmasked = layer(x, x, x, **interop.from_keras_masks(attention_mask, backend="numpy"))
    assert not np.allclose(unmasked[real], theirs[real], atol=1e-3)


@pytest.mark.tensorflow
def test_a_per_head_keras_mask_beside_the_inputs_masks_is_refused(keras):
    # Keras joins a (B, Q, K) mask of its inputs to a (B, heads, Q, K) attention_mask by
    # broadcasting, the batch axis against the heads': no join gives its numbers, so the
    # pair is refused; joined by hand into the attention_mask, both layers agree
    builtin = keras.layers.MultiHeadAttention(2, 4, dtype="float64")
    x = np.random.default_rng(5).standard_normal((2, 4, 8))
    builtin(x, x)
    randomize_keras(builtin, seed=6)
    layer = interop.from_keras(builtin, backend="numpy")
    attention_mask = np.random.default_rng(7).random((2, 2, 4, 4)) < 0.8
    attention_mask[..., 0] = True
    real = np.array([[True, True, True, False], [True, True, False, False]])
    with pytest.raises(ValueError, match=r"batch axis against the heads'.*\(2, 2, 4, 4\)"):
        interop.from_keras_masks(attention_mask, value_mask=real, backend="numpy")
    joined = attention_mask & real[:, None, None, :]
    theirs = np.asarray(builtin(x, x, attention_mask=joined))
    ours = layer(x, x, x, **interop.from_keras_masks(joined, backend="numpy"))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
    # Of one example, Keras's broadcast is the example's join: taken
    one = interop.from_keras_masks(attention_mask[:1], value_mask=real[:1], backend="numpy")
    theirs = builtin(x[:1], x[:1], value_mask=real[:1], attention_mask=attention_mask[:1])
    theirs = np.asarray(theirs)
    np.testing.assert_allclose(layer(x[:1], x[:1], x[:1], **one), theirs, rtol=0, atol=1e-12)


@pytest.mark.tensorflow
def test_rows_without_keys_keras_gives_zero_weights_like_mha(keras):
    config = TORCH_CONFIGS["packed-bias"]
    layer = mha_layer(backend_module("numpy"), config, "float64")
    builtin = interop.to_keras(layer)
    tensors = inputs(config, "float64", np.random.default_rng(0))
    valid_lens = np.array([2, 0, KEYS])
    masks = interop.to_keras_masks(valid_lens, num_queries=QUERIES, num_keys=KEYS)
    output, weights = call_keras(builtin, *tensors, **masks)
    ours, _ = call_mha(backend_module("numpy"), layer, *tensors, valid_lens)
    if Version(keras.__version__) < Version("3.10"):
        # Earlier Keras softmaxes such a row over every key, as if it had no mask
        _, unmasked = call_keras(builtin, *tensors)
        np.testing.assert_allclose(weights[1], unmasked[1], atol=1e-12)
        return
    assert np.array_equal(weights[1], np.zeros_like(weights[1]))
    assert np.allclose(output, ours, atol=1e-10)


@pytest.mark.tensorflow
def test_keras_float64_scale_is_rounded_to_float32(keras):
    """Keras casts the Python float 1/sqrt(key_dim) through float32, even in float64: with a
    head size whose inverse root is not a float32 number, Keras's float64 results agree with
    mha's to about 1e-8 (float32's rounding of the scale), not 1e-10."""
    config = (8, 4, True, 8, 8, 8)  # head size 2
    layer = mha_layer(backend_module("numpy"), config, "float64")
    tensors = inputs(config, "float64", np.random.default_rng(0))
    output, weights = call_keras(interop.to_keras(layer), *tensors)
    ours, our_weights = call_mha(backend_module("numpy"), layer, *tensors)
    assert harness.difference(weights, our_weights, relative=True) <= 1e-7
    assert harness.difference(output, ours, relative=True) <= 1e-7


@pytest.mark.tensorflow
def test_keras_weights_layout(keras):
    weights = mha.random_weights(
        "MultiHeadAttention",
        num_hiddens=6,
        num_heads=3,
        bias=True,
        query_size=4,
        key_size=5,
        value_size=2,
        seed=7,
    )
    layout = interop.keras_weights(weights, num_heads=3)
    assert layout["query/kernel"].shape == (4, 3, 2)
    assert layout["attention_output/kernel"].shape == (3, 2, 6)
    # head 1 of the query projection is columns 2..3 of W_q
    assert np.array_equal(layout["query/kernel"][:, 1, :], weights["W_q"][:, 2:4])
    assert np.array_equal(layout["value/bias"][2], weights["b_v"][4:6])
    layer = backend_module("numpy").MultiHeadAttention(6, 3, bias=True)
    mha.set_weights(layer, weights)
    builtin = interop.to_keras(layer)
    paths = {v.path.split("/", 1)[1]: np.asarray(v) for v in builtin.weights}
    assert set(paths) == set(layout)
    assert all(np.array_equal(paths[k], layout[k]) for k in layout)


@pytest.mark.tensorflow
def test_a_keras_layer_with_another_output_size_converts_with_out_features(keras):
    # Keras's output_shape defaults to the query's size, here 4, while its heads give 2 * 3
    source = keras.layers.MultiHeadAttention(2, 3, dtype="float64")
    x = np.random.default_rng(0).standard_normal((2, 5, 4))
    expected = np.asarray(source(x, x))
    layer = interop.from_keras(source, backend="numpy")
    assert (layer.num_hiddens, layer.out_features) == (6, 4)
    np.testing.assert_allclose(layer(x, x, x), expected, rtol=0, atol=1e-7)
    again = interop.to_keras(layer)
    np.testing.assert_allclose(np.asarray(again(x, x)), expected, rtol=0, atol=1e-12)


@pytest.mark.tensorflow
def test_what_mha_cannot_take_from_keras(keras):
    def built(**arguments):
        layer = keras.layers.MultiHeadAttention(**arguments)
        layer.build((None, 3, 4), (None, 5, 4))
        return layer

    with pytest.raises(ValueError, match="value_dim=3 differs from key_dim=2"):
        interop.from_keras(built(num_heads=2, key_dim=2, value_dim=3))
    with pytest.raises(ValueError, match="has the shape"):
        interop.from_keras(built(num_heads=2, key_dim=3, output_shape=(2, 2)))
    # Attending over axis 1 of (B, n, m, d): the kernels of (B, n, d), another layer's call
    image = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2, attention_axes=(1,))
    image.build((None, 3, 5, 4), (None, 3, 5, 4))
    with pytest.raises(ValueError, match=r"built for inputs of rank 4; mha takes \(B, n, d\)"):
        interop.from_keras(image)
    with pytest.raises(ValueError, match="not built"):
        interop.from_keras(keras.layers.MultiHeadAttention(2, 2))
    with pytest.raises(TypeError, match=r"keras\.layers\.MultiHeadAttention"):
        interop.from_keras(object())


@pytest.mark.tensorflow
def test_keras_attention_axes_of_rank_3_inputs_convert_only_over_the_sequence(keras):
    # Built for (B, n, d), a Keras layer may still attend over the batch axis or the heads'
    # axis: the kernels are those of any other layer, the numbers are not mha's
    x = np.random.default_rng(2).standard_normal((2, 3, 8))
    for axes in ((0,), (2,)):
        other = keras.layers.MultiHeadAttention(2, 4, attention_axes=axes, dtype="float64")
        other(x, x)
        with pytest.raises(ValueError, match=r"attention_axes=\(\d,\); mha attends over axis 1"):
            interop.from_keras(other)
    # Axis -2 of (B, n, d) is the sequence: it converts, and computes Keras's numbers
    same = keras.layers.MultiHeadAttention(2, 4, attention_axes=(-2,), dtype="float64")
    expected = np.asarray(same(x, x))
    layer = interop.from_keras(same, backend="numpy")
    np.testing.assert_allclose(layer(x, x, x), expected, rtol=0, atol=1e-7)


@pytest.mark.tensorflow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sliding_window", [None, 2])
@pytest.mark.parametrize("name", backend_params())
def test_keras_group_query_attention_into_every_backend_and_back(
    keras, name, sliding_window, dtype
):
    # Keras's own GroupQueryAttention (4 query heads on 2 key-value heads) is the judge
    module = backend_module(name)
    builtin = keras.layers.GroupQueryAttention(
        4, 4, 2, use_bias=True, sliding_window=sliding_window, dtype=dtype
    )
    rng = np.random.default_rng(7)
    query = rng.standard_normal((BATCH, QUERIES, 6)).astype(dtype)
    key = rng.standard_normal((BATCH, KEYS, 5)).astype(dtype)
    value = rng.standard_normal((BATCH, KEYS, 4)).astype(dtype)
    builtin(query, value, key)  # builds it
    randomize_keras(builtin, seed=8)
    layer = interop.from_keras(builtin, backend=name)
    config = module.layer_config(layer)
    assert (config["num_heads"], config["num_kv_heads"]) == (4, 2)
    assert config["sliding_window"] == sliding_window and config["out_features"] == 6
    for causal in (False, True):
        theirs = call_keras(builtin, query, key, value, use_causal_mask=causal)
        ours = call_mha(module, layer, query, key, value, causal=causal)
        assert_agree(ours, theirs, dtype)
    again = interop.to_keras(layer)
    assert isinstance(again, keras.layers.GroupQueryAttention)
    assert again.sliding_window == sliding_window
    np.testing.assert_array_equal(
        np.asarray(again(query, value, key, use_causal_mask=True)),
        np.asarray(builtin(query, value, key, use_causal_mask=True)),
    )


@pytest.mark.tensorflow
def test_a_keras_sliding_window_converts_both_ways(keras):
    source = keras.layers.MultiHeadAttention(2, 3, sliding_window=2, dtype="float64")
    x = np.random.default_rng(1).standard_normal((2, 6, 6))
    expected = np.asarray(source(x, x, use_causal_mask=True))
    layer = interop.from_keras(source, backend="numpy")
    assert layer.sliding_window == 2
    np.testing.assert_allclose(layer(x, x, x, causal=True), expected, rtol=0, atol=1e-7)
    again = interop.to_keras(layer)
    np.testing.assert_array_equal(np.asarray(again(x, x, use_causal_mask=True)), expected)


@pytest.mark.tensorflow
def test_what_keras_cannot_hold_of_modern_attention(keras, tmp_path):
    N = backend_module("numpy")
    rope = N.MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8, rope_theta=1e4)
    with pytest.raises(ValueError, match=r"rope_theta=10000\.0"):
        interop.to_keras(rope)
    gqa = N.MultiHeadAttention(8, 4, query_size=6, key_size=6, value_size=6, num_kv_heads=2)
    with pytest.raises(ValueError, match="GroupQueryAttention's output has the query's size"):
        interop.to_keras(gqa)
    # A sliding window is config, which a weights file does not hold: only mha's keeps it
    windowed = N.MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8, sliding_window=3)
    mha.save(windowed, tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match="sliding_window=3"):
        interop.convert(tmp_path / "w.safetensors", tmp_path / "w.weights.h5", num_heads=2)
    assert not (tmp_path / "w.weights.h5").exists()


def _gated_keras_layers(keras, dtype):
    """Keras's layers with use_gate=True: MultiHeadAttention (its flag is `_use_gate`) with
    and without biases and with another output size, and GroupQueryAttention."""
    return {
        "multihead": keras.layers.MultiHeadAttention(2, 4, use_gate=True, dtype=dtype),
        "multihead_no_bias": keras.layers.MultiHeadAttention(
            2, 4, use_gate=True, use_bias=False, output_shape=5, dtype=dtype
        ),
        "grouped": keras.layers.GroupQueryAttention(4, 4, 2, use_gate=True, dtype=dtype),
    }


@pytest.mark.tensorflow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", backend_params())
def test_a_keras_gate_is_the_output_gate_both_ways(keras, name, dtype):
    # Keras's gate, sigmoid(query @ W_g + b_g) times each head's output, is mha's output_gate:
    # Keras's own layer is the judge, and the layer converted back computes what it did
    module = backend_module(name)
    rng = np.random.default_rng(11)
    query = rng.standard_normal((BATCH, QUERIES, 8)).astype(dtype)
    key, value = (rng.standard_normal((BATCH, KEYS, 8)).astype(dtype) for _ in range(2))
    for builtin in _gated_keras_layers(keras, dtype).values():
        builtin(query, value, key)  # builds it
        randomize_keras(builtin, seed=12)
        layer = interop.from_keras(builtin, backend=name)
        assert module.layer_config(layer)["output_gate"] and "W_g" in mha.get_weights(layer)
        for causal in (False, True):
            theirs = call_keras(builtin, query, key, value, use_causal_mask=causal)
            assert_agree(call_mha(module, layer, query, key, value, causal=causal), theirs, dtype)
        again = interop.to_keras(layer)
        np.testing.assert_array_equal(
            np.asarray(again(query, value, key)), np.asarray(builtin(query, value, key))
        )


@pytest.mark.tensorflow
def test_dropout_carries_over_to_and_from_keras(keras):
    # The dropout rate is config, not weights: both Keras layers keep it through mha
    module = backend_module("numpy")
    layer = module.MultiHeadAttention(8, 2, 0.25, True, query_size=8, key_size=8, value_size=8)
    mha.set_weights(layer, mha.random_weights(layer, seed=0))
    builtin = interop.to_keras(layer)
    assert builtin.dropout == 0.25
    assert interop.canonical_from_keras(builtin)[1]["dropout"] == 0.25
    assert module.layer_config(interop.from_keras(builtin, backend="numpy"))["dropout"] == 0.25
    grouped = keras.layers.GroupQueryAttention(4, 4, 2, dropout=0.125)
    grouped.build((None, 3, 8), (None, 3, 8))
    _, config = interop.canonical_from_keras(grouped)
    assert (config["dropout"], config["num_kv_heads"]) == (0.125, 2)
    assert interop.to_keras(interop.from_keras(grouped, backend="numpy")).dropout == 0.125


@pytest.mark.tensorflow
def test_a_keras_subclass_computing_its_own_way_is_refused(keras):
    # keras_hub's rotary and relative-position layers subclass MultiHeadAttention and
    # override how it computes: the same weights would convert to other numbers
    class Rotated(keras.layers.MultiHeadAttention):
        def _compute_attention(self, query, key, value, *args, **kwargs):
            return super()._compute_attention(2.0 * query, key, value, *args, **kwargs)

    class Grouped(keras.layers.GroupQueryAttention):
        def call(self, query, value, key=None, **kwargs):
            return super().call(query, value, key, **kwargs)

    class Configured(keras.layers.MultiHeadAttention):
        def get_config(self):
            return {**super().get_config(), "note": "mine"}

    x = np.random.default_rng(4).standard_normal((2, 3, 8))
    for layer, method in ((Rotated(2, 4), "_compute_attention"), (Grouped(4, 4, 2), "call")):
        layer(x, x)
        with pytest.raises(ValueError, match=rf"overrides {method} of keras's"):
            interop.from_keras(layer)

    # keras_hub's cached layer (known by its name) computes MultiHeadAttention's numbers
    # without a cache, but applies no gate
    class Cached(keras.layers.MultiHeadAttention):
        def call(self, query, value, key=None, **kwargs):
            return super().call(query, value, key, **kwargs)

    Cached.__module__ = "keras_hub.src.layers.modeling.cached_multi_head_attention"
    Cached.__qualname__ = "CachedMultiHeadAttention"
    for layer in (Configured(2, 4, dtype="float64"), Cached(2, 4, dtype="float64")):
        layer(x, x)
        converted = interop.from_keras(layer, backend="numpy")
        np.testing.assert_allclose(converted(x, x, x), layer(x, x).numpy(), rtol=0, atol=1e-12)
    gated = Cached(2, 4, use_gate=True)
    gated(x, x)
    with pytest.raises(ValueError, match="CachedMultiHeadAttention overrides call"):
        interop.from_keras(gated)


@pytest.mark.tensorflow
@pytest.mark.parametrize("mode", ["float8", "int8"])
def test_a_keras_layer_quantized_by_keras_is_refused(keras, mode):
    # Model.quantize makes the projections multiply by float8 or int8 weights: their float
    # kernels converted gave other numbers (float8: 0.67 off outputs of 4)
    inputs = keras.Input((None, 8))
    layer = keras.layers.MultiHeadAttention(2, 4)
    model = keras.Model(inputs, layer(inputs, inputs))
    with warnings.catch_warnings():  # Keras names the layers it leaves (Softmax, Dropout)
        warnings.simplefilter("ignore")
        model.quantize(mode)
    with pytest.raises(ValueError, match=f"quantized \\(quantization_mode='{mode}'\\)"):
        interop.from_keras(layer)


@pytest.mark.tensorflow
def test_a_gated_keras_file_converts_with_its_gate(keras, tmp_path):
    from keras import saving  # Keras 3's, which tf.keras does not name

    x = np.random.default_rng(13).standard_normal((BATCH, QUERIES, 8)).astype("float32")
    for kind, builtin in _gated_keras_layers(keras, "float32").items():
        builtin(x, x)
        randomize_keras(builtin, seed=14)
        path = tmp_path / f"{kind}.weights.h5"
        saving.save_weights(builtin, path)
        interop.convert(path, tmp_path / f"{kind}.safetensors")
        layer = mha.load(tmp_path / f"{kind}.safetensors", backend="numpy")
        np.testing.assert_allclose(layer(x, x, x), np.asarray(builtin(x, x)), atol=1e-6)
        interop.convert(tmp_path / f"{kind}.safetensors", tmp_path / f"{kind}.again.weights.h5")
        again, _ = interop.read_file(tmp_path / f"{kind}.again.weights.h5")
        for name, array in mha.get_weights(layer).items():
            np.testing.assert_array_equal(again[name], array)


@pytest.mark.tensorflow
def test_a_keras_file_with_arrays_mha_does_not_read_is_refused(keras, tmp_path):
    import h5py
    from keras import saving

    builtin = keras.layers.MultiHeadAttention(2, 4)
    builtin.build((None, 3, 8), (None, 3, 8))
    path = tmp_path / "extra.weights.h5"
    saving.save_weights(builtin, path)
    with h5py.File(path, "a") as file:  # a sub-layer with weights mha's layer has no place for
        file.create_dataset("_extra_dense/vars/0", data=np.ones((8, 2)))
    with pytest.raises(ValueError, match="_extra_dense/vars/0"):
        interop.read_file(path)


@pytest.mark.tensorflow
@pytest.mark.torch
def test_grouped_query_weights_go_through_keras_files_not_torch_ones(keras, tmp_path):
    N = backend_module("numpy")
    layer = N.MultiHeadAttention(
        8, 4, bias=True, query_size=8, key_size=5, value_size=5, num_kv_heads=1
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=2))
    mha.save(layer, tmp_path / "g.safetensors")
    interop.convert(tmp_path / "g.safetensors", tmp_path / "g.weights.h5")
    weights, config = interop.read_file(tmp_path / "g.weights.h5")
    assert config["num_kv_heads"] == 1 and weights["W_k"].shape == (5, 2)
    interop.convert(tmp_path / "g.weights.h5", tmp_path / "back.safetensors")
    back = mha.load(tmp_path / "back.safetensors", backend="numpy")
    for key, value in mha.get_weights(layer).items():
        np.testing.assert_array_equal(mha.get_weights(back)[key], value)
    with pytest.raises(ValueError, match="fewer key-value heads"):
        interop.convert(tmp_path / "g.safetensors", tmp_path / "g.pt")


# ---------------------------------------------------------------------------------------------
# The whole trip, and import hygiene


@pytest.mark.torch
@pytest.mark.tensorflow
@pytest.mark.parametrize("backend", backend_params())
def test_torch_to_keras_through_mha_and_back(torch, keras, backend):
    backend_module(backend)
    builtin = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    randomize_torch(torch, builtin, seed=8)
    keras_layer = interop.to_keras(interop.from_torch(builtin, backend="numpy"))
    again = interop.to_torch(interop.from_keras(keras_layer, backend=backend)).eval()
    rng = np.random.default_rng(9)
    queries, keys, values = inputs((8, 2, True, 8, 8, 8), "float32", rng)
    reference = call_torch(torch, builtin, queries, keys, values)
    for other in (
        call_keras(keras_layer, queries, keys, values),
        call_torch(torch, again, queries, keys, values),
    ):
        assert_agree(reference, other, "float32")
    for name, value in builtin.state_dict().items():
        assert torch.equal(value, again.state_dict()[name])


def test_layer_from_weights_keeps_what_the_weights_cannot_tell():
    # num_heads, dropout, scale and the untold options are not in the weights: the layer
    # built from them computes what a layer constructed with them does
    module = backend_module("numpy")
    options = dict(dropout=0.25, scale=0.3, sliding_window=2)
    sizes = dict(query_size=6, key_size=5, value_size=3, dtype="float64")
    expected = module.MultiHeadAttention(8, 4, bias=True, **sizes, **options)
    weights = mha.random_weights(expected, seed=9)
    mha.set_weights(expected, weights)
    layer = interop.layer_from_weights(weights, 4, backend="numpy", **options)
    assert module.layer_config(layer) == module.layer_config(expected)
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 5, n)) for n in (6, 5, 3))
    np.testing.assert_allclose(
        layer(q, k, v, causal=True), expected(q, k, v, causal=True), rtol=0, atol=1e-12
    )


def test_import_mha_and_interop_imports_no_framework():
    code = (
        "import sys, json, mha, mha.interop; mha.interop.to_torch; "
        "print(json.dumps([m for m in ('torch', 'tensorflow', 'keras', 'mxnet', 'h5py') "
        "if m in sys.modules]))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == []


def test_file_functions_live_in_conversion_and_keep_their_interop_names():
    from mha import conversion

    for name in interop.MOVED_TO_CONVERSION:
        assert getattr(interop, name) is getattr(conversion, name), name
        assert name in dir(interop)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        interop.no_such_name  # noqa: B018


# ---------------------------------------------------------------------------------------------
# The mask helpers follow the layers' rules


def layer_message(valid_lens):
    """The message of the numpy reference's MultiHeadAttention for these valid_lens."""
    module = backend_module("numpy")
    layer = mha_layer(module, (8, 2, False, 8, 8, 8), "float64")
    batch_size = len(valid_lens)
    queries = np.zeros((batch_size, QUERIES, 8))
    keys = np.zeros((batch_size, KEYS, 8))
    with pytest.raises(ValueError) as raised:
        layer(queries, keys, keys, valid_lens)
    return str(raised.value)


def call_mask_helper(framework, valid_lens):
    """The mask helper of `framework` on valid_lens, for a call with QUERIES and KEYS."""
    if framework == "torch":
        backend_module("torch")  # to_torch_masks makes torch tensors
        return interop.to_torch_masks(valid_lens, num_heads=2, num_queries=QUERIES, num_keys=KEYS)
    helper = interop.to_keras_masks if framework == "keras" else interop.to_flax_masks
    return helper(valid_lens, num_queries=QUERIES, num_keys=KEYS)


BAD_LENGTHS = {
    "fractional": np.array([1.5, 2.0]),
    "fractional-2d": np.array([[1.0, 2.0, 2.5, 3.0], [0.0, 1.0, 1.0, 1.0]]),
    "negative": np.array([2, -1]),
    "negative-float": np.array([-1.0, 2.0]),
    "negative-2d": np.array([[1, 2, 3, 4], [0, -2, 1, 1]]),
}


@pytest.mark.parametrize("valid_lens", BAD_LENGTHS.values(), ids=BAD_LENGTHS.keys())
@pytest.mark.parametrize(
    "framework", ["keras", "flax", pytest.param("torch", marks=pytest.mark.torch)]
)
def test_mask_helpers_refuse_bad_lengths_with_the_layers_message(framework, valid_lens):
    expected = layer_message(valid_lens)
    with pytest.raises(ValueError) as raised:
        call_mask_helper(framework, valid_lens)
    assert str(raised.value) == expected


@pytest.mark.parametrize(
    "framework", ["keras", "flax", pytest.param("torch", marks=pytest.mark.torch)]
)
def test_mask_helpers_refuse_lengths_and_masks_of_too_many_axes(framework):
    # valid_lens of 3 axes and masks of 5 have no meaning for the layers, which refuse them;
    # a helper that took them would hand the framework a mask of another shape
    lengths = np.full((BATCH, QUERIES, 1), 2)
    assert "valid_lens must have shape" in layer_message(lengths)  # the layer refuses them
    with pytest.raises(ValueError, match=r"valid_lens must have shape .* Received: valid_lens of"):
        call_mask_helper(framework, lengths)
    helper = getattr(interop, f"to_{framework}_masks")
    sizes = {"num_queries": QUERIES, "num_keys": KEYS}
    sizes.update({"num_heads": 2} if framework == "torch" else {})
    with pytest.raises(ValueError, match=r"mask must have at most 4 axes"):
        helper(mask=np.ones((1, 1, 1, QUERIES, KEYS), bool), **sizes)


def spelled_out_keep(valid_lens, mask, causal, num_heads):
    """The keep-mask (B, num_heads, Q, K) one key at a time: key j of query i is kept when
    j < its length, the mask allows it (a 4-D mask per head, any other for every head) and,
    under causal, j <= i."""
    shape = (BATCH, num_heads, QUERIES, KEYS)
    if mask is not None:
        per_head = mask if mask.ndim == 4 else np.broadcast_to(mask, shape[:1] + shape[2:])[:, None]
        mask = np.broadcast_to(per_head, shape)
    keep = np.ones(shape, bool)
    for b, h, i, j in np.ndindex(shape):
        if valid_lens is not None:
            length = valid_lens[b] if valid_lens.ndim == 1 else valid_lens[b, i]
            keep[b, h, i, j] &= j < length
        if mask is not None:
            keep[b, h, i, j] &= mask[b, h, i, j]
        if causal:
            keep[b, h, i, j] &= j <= i
    return keep


@pytest.mark.parametrize("helper", ["to_torch_masks", "to_keras_masks", "to_flax_masks"])
def test_mask_helpers_refuse_a_mask_that_is_not_boolean(helper):
    # As the layers do: an additive mask (0 and -inf) read as nonzero = keep would invert
    additive = np.where(np.tril(np.ones((3, 3), bool)), 0.0, -np.inf)
    if helper == "to_torch_masks":  # its masks are torch tensors
        backend_module("torch")
    sizes = {"num_queries": 3, "num_keys": 3, **({"num_heads": 2} if "torch" in helper else {})}
    for mask in (additive, np.tril(np.ones((3, 3), int))):
        with pytest.raises(TypeError, match=r"mask must be a boolean keep-mask \(True = attend"):
            getattr(interop, helper)(mask=mask, **sizes)


def test_mask_helpers_give_the_masks_of_the_layers_rules():
    num_heads = 2
    for case, valid_lens, mask, causal in mha_mask_cases(num_heads, np.random.default_rng(5)):
        expected = spelled_out_keep(valid_lens, mask, causal, num_heads)
        flax = interop.to_flax_masks(valid_lens, mask, causal, num_queries=QUERIES, num_keys=KEYS)
        if case == "none":
            assert flax == {}
            continue
        keep = flax["mask"]
        assert keep.dtype == bool and keep.ndim == 4, case
        assert keep.shape[0] in (1, BATCH) and keep.shape[1] in (1, num_heads), case
        assert np.array_equal(np.broadcast_to(keep, expected.shape), expected), case
        if case == "mask_4d":
            continue
        keras = interop.to_keras_masks(valid_lens, mask, causal, num_queries=QUERIES, num_keys=KEYS)
        assert keras["use_causal_mask"] == causal, case
        if valid_lens is None and mask is None:
            assert "attention_mask" not in keras, case
            continue
        attention_mask = keras["attention_mask"]
        assert attention_mask.shape[1:] == (QUERIES, KEYS), case
        # Keras applies use_causal_mask itself; the helper's mask leaves it out
        uncausal = spelled_out_keep(valid_lens, mask, False, 1)[:, 0]
        assert np.array_equal(np.broadcast_to(attention_mask, uncausal.shape), uncausal), case


@pytest.mark.torch
def test_torch_mask_helper_gives_the_masks_of_the_layers_rules(torch):
    num_heads = 2
    for case, valid_lens, mask, causal in mha_mask_cases(num_heads, np.random.default_rng(6)):
        expected = spelled_out_keep(valid_lens, mask, causal, num_heads)
        masks = interop.to_torch_masks(
            valid_lens, mask, causal, num_heads=num_heads, num_queries=QUERIES, num_keys=KEYS
        )
        allowed = np.ones_like(expected)
        if "key_padding_mask" in masks:  # (B, K), True = ignore
            allowed &= ~masks["key_padding_mask"].numpy()[:, None, None, :]
        if "attn_mask" in masks:  # (Q, K) or (B * num_heads, Q, K), True = not allowed
            forbidden = masks["attn_mask"].numpy()
            allowed &= (
                ~forbidden.reshape(-1, num_heads, QUERIES, KEYS)
                if forbidden.ndim == 3
                else ~forbidden
            )
        assert np.array_equal(allowed, expected), case
