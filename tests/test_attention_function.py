"""dot_product_attention, the attention function, in the NumPy reference and in torch: held
to ONNX's own `Attention` cases (read from the installed onnx package, with the outputs its
reference computed), to torch's F.scaled_dot_product_attention and jax.nn.dot_product_attention,
to hand-worked masks (alignment, windows, lengths, soft cap, the log-sum-exp), and torch to the
reference, gradients included.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import backend_module, backend_params, framework_import, required_import

# The backends that have the function
BACKENDS = backend_params()


def attention(name: str, *tensors, **options):
    """dot_product_attention of backend `name` on numpy arrays (tensors and masks), its
    results as numpy arrays."""
    module = backend_module(name)

    def convert_one(v):
        if isinstance(v, tuple):
            return tuple(convert_one(x) for x in v)
        return module.from_numpy(v) if isinstance(v, np.ndarray) else v

    convert = {k: convert_one(v) for k, v in options.items()}
    results = module.dot_product_attention(*map(module.from_numpy, tensors), **convert)
    if isinstance(results, tuple):
        return tuple(module.to_numpy(x) for x in results)
    return module.to_numpy(results)


# ---------------------------------------------------------------------------------------------
# ONNX's Attention cases

# Cases whose numbers mha's function does not give, and why (the conformance table of
# docs/attention-function.md)
ONNX_LEFT_OUT = {
    "nonpad_kv_seqlen with a window": "ONNX centres each batch row's window on its own "
    "positions (nonpad_kv_seqlen - Q + i); the function's windows share one alignment",
}
# Tolerance of each dtype, against ONNX's outputs computed in that dtype
ONNX_TOLERANCE = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def onnx_cases() -> list[tuple]:
    """(name, attributes, inputs by name, outputs by name) of every Attention case the
    installed onnx package ships, each computed by its reference as its test data is."""
    import onnx
    from onnx.backend.test.case.node import attention

    captured = []

    def expect(node, inputs, outputs, name, **_):
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        # An input or output left out has the name "" and no array
        named_inputs = dict(zip([n for n in node.input if n], inputs, strict=True))
        named_outputs = dict(zip([n for n in node.output if n], outputs, strict=True))
        captured.append((name, attributes, named_inputs, named_outputs))

    original, attention.expect = attention.expect, expect
    try:
        np.random.seed(0)
        for export in sorted(n for n in dir(attention.Attention) if n.startswith("export")):
            getattr(attention.Attention, export)()
    finally:
        attention.expect = original
    return captured


def onnx_call(attributes: dict, inputs: dict) -> tuple[dict, dict] | str:
    """dot_product_attention's arguments for an ONNX case, its tensors on (batch, heads,
    positions, head size); or the reason (a key of ONNX_LEFT_OUT) it has none."""
    q = _heads_first(inputs["Q"], attributes.get("q_num_heads"))
    k, v = (_heads_first(inputs[n], attributes.get("kv_num_heads")) for n in "KV")
    if "past_key" in inputs:
        k = np.concatenate([inputs["past_key"], k], axis=2)
        v = np.concatenate([inputs["past_value"], v], axis=2)
    left, right = attributes.get("left_window_size", -1), attributes.get("right_window_size", -1)
    window = (
        None
        if left < 0 and right < 0
        else (None if left < 0 else left, None if right < 0 else right)
    )
    causal = bool(attributes.get("is_causal", 0))
    lengths = inputs.get("nonpad_kv_seqlen")
    if lengths is not None and window is not None:
        return "nonpad_kv_seqlen with a window"
    if lengths is not None and causal:
        # Each row's query i sits at nonpad - Q + i: it keeps the keys before nonpad - Q + i + 1
        frontier = lengths[:, None] - q.shape[2] + 1 + np.arange(q.shape[2])[None, :]
        lengths, causal = np.maximum(frontier, 0), False
    options = {"causal": causal, "window": window, "valid_lens": lengths}
    # ONNX's query i sits at position i after the cached keys (past_key's, or none)
    options["alignment"] = inputs["past_key"].shape[2] if "past_key" in inputs else 0
    if attributes.get("scale") is not None:
        options["scale"] = attributes["scale"]
    if attributes.get("softcap", 0.0) > 0:
        options["softcap"] = attributes["softcap"]
    mask = inputs.get("attn_mask")
    if mask is not None:
        # A mask shorter than the keys leaves the others out
        missing = k.shape[2] - mask.shape[-1]
        pad = [(0, 0)] * (mask.ndim - 1) + [(0, missing)]
        fill = False if mask.dtype == np.bool_ else -np.inf
        mask = np.pad(mask, pad, constant_values=fill)
        options["mask" if mask.dtype == np.bool_ else "bias"] = mask
    return {"query": q, "key": k, "value": v}, options


def _heads_first(x: np.ndarray, heads: int | None) -> np.ndarray:
    """(batch, positions, heads * size) -> (batch, heads, positions, size); 4-D as it is."""
    if x.ndim == 4:
        return x
    return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(0, 2, 1, 3)


try:
    CASES = onnx_cases()
except ImportError:  # test_every_onnx_case_runs_or_is_listed says so in a lane run
    CASES = []


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
@pytest.mark.parametrize("name", BACKENDS)
def test_onnx_attention_case(name, case):
    case_name, attributes, inputs, outputs = case
    call = onnx_call(attributes, inputs)
    if isinstance(call, str):
        assert call in ONNX_LEFT_OUT
        return
    tensors, options = call
    dtype = tensors["query"].dtype
    mode = attributes.get("qk_matmul_output_mode", 0)
    q, k, v = tensors["query"], tensors["key"], tensors["value"]
    if name == "mxnet" and q.dtype.name == "bfloat16":
        pytest.skip("MXNet has no bfloat16")
    if name == "mxnet" and q.dtype.name == "float16":  # MXNet's float16 product: GPU only
        with pytest.raises(ValueError, match="run on a GPU context only"):
            attention(name, q, k, v, **options)
        return
    output, weights = attention(name, q, k, v, **options, return_weights=True)
    expected = outputs["Y"]
    if expected.ndim == 3:
        output = output.transpose(0, 2, 1, 3).reshape(expected.shape)
    tolerance = ONNX_TOLERANCE[str(dtype)]
    scale = max(1.0, float(np.max(np.abs(expected.astype("float64")))))
    np.testing.assert_allclose(
        output.astype("float64"),
        expected.astype("float64"),
        rtol=0,
        atol=tolerance * scale,
        err_msg=case_name,
    )
    if "present_key" in outputs:
        np.testing.assert_array_equal(tensors["key"], outputs["present_key"])
        np.testing.assert_array_equal(tensors["value"], outputs["present_value"])
    if mode == 3 and "qk_matmul_output" in outputs:  # the weights
        np.testing.assert_allclose(
            weights.astype("float64"),
            outputs["qk_matmul_output"].astype("float64"),
            rtol=0,
            atol=tolerance,
            err_msg=case_name,
        )


def test_every_onnx_case_runs_or_is_listed():
    onnx = required_import("onnx")
    assert len(CASES) >= 90, onnx.__version__
    left_out = [case[0] for case in CASES if isinstance(onnx_call(case[1], case[2]), str)]
    assert len(left_out) <= 4, left_out


# ---------------------------------------------------------------------------------------------
# Against the frameworks' own attention functions


def random_call(rng, batch=2, heads=4, kv_heads=2, queries=5, keys=7, d=8, dv=6):
    query = rng.standard_normal((batch, heads, queries, d))
    key = rng.standard_normal((batch, kv_heads, keys, d))
    value = rng.standard_normal((batch, kv_heads, keys, dv))
    return query, key, value


TORCH_CALLS = {
    "plain": {},
    "grouped, scale": {"scale": 0.3},
    "causal (top-left)": {"causal": True},
    "boolean mask (batch, 1, 1, K)": {"mask": "keys"},
    "boolean mask (Q, K)": {"mask": "queries"},
    "bias (heads, Q, K)": {"bias": "heads"},
}


@pytest.mark.torch
@pytest.mark.parametrize("call", TORCH_CALLS)
@pytest.mark.parametrize("name", BACKENDS)
def test_torch_scaled_dot_product_attention_gives_the_same(name, call, rng):
    torch = framework_import("torch")
    query, key, value = random_call(rng)
    options = dict(TORCH_CALLS[call])
    theirs = {"scale": options.get("scale"), "is_causal": options.get("causal", False)}
    if options.get("mask") == "keys":
        options["mask"] = rng.random((2, 1, 1, 7)) < 0.7
        options["mask"][:, :, :, 0] = True  # a kept key in every row: no empty row
    elif options.get("mask") == "queries":
        options["mask"] = np.tri(5, 7, k=1, dtype=bool)
    if options.get("bias") == "heads":
        options["bias"] = rng.standard_normal((4, 5, 7))
    for ours, torch_name in (("mask", "attn_mask"), ("bias", "attn_mask")):
        if ours in options:
            theirs[torch_name] = torch.from_numpy(options[ours])
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (query, key, value)), enable_gqa=True, **theirs
    )
    output = attention(name, query, key, value, **options)
    np.testing.assert_allclose(output, expected.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.jax
@pytest.mark.parametrize(
    "options",
    [
        {"causal": True},
        {"window": (2, 1)},
        {"window": (1, 0), "causal": True},
        {"valid_lens": "lengths"},
        {"bias": "bias", "scale": 0.5},
    ],
    ids=["causal", "window (2, 1)", "window (1, 0), causal", "valid_lens", "bias, scale"],
)
@pytest.mark.parametrize("name", BACKENDS)
def test_jax_dot_product_attention_gives_the_same(name, options, rng):
    # JAX's takes (batch, positions, heads, head size), its windows as (left, right) about
    # query i at position i, and the keys' lengths per batch row
    jax = framework_import("jax")
    query, key, value = random_call(rng, queries=6, keys=6, dv=8)
    options = dict(options)
    theirs = {"is_causal": options.get("causal", False), "scale": options.get("scale")}
    if "window" in options:
        theirs["local_window_size"] = options["window"]
    if options.get("valid_lens") == "lengths":
        options["valid_lens"] = np.array([3, 6])
        theirs["key_value_seq_lengths"] = jax.numpy.asarray(options["valid_lens"], "int32")
    if options.get("bias") == "bias":
        options["bias"] = rng.standard_normal((2, 4, 6, 6)).astype("float32")
        theirs["bias"] = options["bias"]
    query, key, value = (x.astype("float32") for x in (query, key, value))
    inputs = [x.transpose(0, 2, 1, 3) for x in (query, key, value)]
    expected = jax.nn.dot_product_attention(*inputs, **theirs)
    if "window" in options and not theirs["is_causal"]:
        unwindowed = jax.nn.dot_product_attention(*inputs, is_causal=False, scale=None)
        if np.array_equal(expected, unwindowed):
            pytest.skip(f"jax {jax.__version__} ignores local_window_size without is_causal")
    output = attention(name, query, key, value, **options)
    np.testing.assert_allclose(output, np.asarray(expected).transpose(0, 2, 1, 3), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# By hand


@pytest.mark.parametrize("name", BACKENDS)
def test_alignment_window_and_lengths_keep_the_keys_worked_out_by_hand(name):
    # 2 queries, 4 keys; the weights of equal scores are 1 / (kept keys) on the kept keys
    query, key = np.zeros((1, 1, 2, 1)), np.zeros((1, 1, 4, 1))
    value = np.eye(4).reshape(1, 1, 4, 4)

    def kept(**options):
        return attention(name, query, key, value, **options)[0, 0] > 0

    yes, no = True, False
    # Top-left: query i at position i; bottom-right: at i + 2
    assert (kept(causal=True) == [[yes, no, no, no], [yes, yes, no, no]]).all()
    # None as the layers' default is (without a cache): top-left, the function's default
    assert (kept(causal=True, alignment=None) == kept(causal=True)).all()
    assert (kept(causal=True, alignment="bottom_right") == [[yes] * 3 + [no], [yes] * 4]).all()
    assert (kept(causal=True, alignment=1) == [[yes, yes, no, no], [yes] * 3 + [no]]).all()
    # window=2: within one position; (0, 2): the query's and the next two
    assert (kept(window=2) == [[yes, yes, no, no], [yes, yes, yes, no]]).all()
    # ... its left side too, at positions 2 and 3
    assert (kept(window=2, alignment=2) == [[no, yes, yes, yes], [no, no, yes, yes]]).all()
    assert (kept(window=(0, 2)) == [[yes, yes, yes, no], [no, yes, yes, yes]]).all()
    assert (kept(window=(None, 0), alignment=2) == [[yes] * 3 + [no], [yes] * 4]).all()
    assert (kept(valid_lens=np.array([[1, 3]])) == [[yes] + [no] * 3, [yes] * 3 + [no]]).all()
    # A mask broadcast along the queries meets each query's own causal row (ONNX's reference
    # gives every row the first query's there)
    for shape in ((4,), (1, 4), (1, 1, 1, 4)):
        mask = np.array([yes, no, yes, yes]).reshape(shape)
        both = kept(causal=True, alignment="bottom_right", mask=mask)
        assert (both == [[yes, no, yes, no], [yes, no, yes, yes]]).all()
    # numpy's integers count as Python's: 126 + 3 past int8's range does not wrap
    wide = (None, np.int8(3))
    assert (kept(window=wide, alignment=np.int8(126)) == [[yes] * 4, [yes] * 4]).all()
    within_two = [[yes, no, no, no], [yes, yes, no, no]]
    assert (kept(window=(np.uint8(2), np.uint8(0)), alignment=np.uint8(0)) == within_two).all()


@pytest.mark.parametrize("name", BACKENDS)
def test_a_head_size_of_0_scores_0_and_a_value_size_of_0_is_empty(name, rng):
    # 4 query heads over 2 key-value heads: with no features every score is 0, so each kept
    # row is the mean of its key-value head's kept values (MXNet's repeat of an empty array
    # failed in its engine, at a later call)
    for heads, kv_heads in ((2, 2), (4, 2)):
        value = rng.standard_normal((2, kv_heads, 5, 3)).astype("float32")
        lengths = np.array([5, 2])
        output = attention(
            name,
            np.zeros((2, heads, 3, 0), "float32"),
            np.zeros((2, kv_heads, 5, 0), "float32"),
            value,
            valid_lens=lengths,
        )
        means = np.stack([value[b, :, :n].mean(axis=1) for b, n in enumerate(lengths)])
        expected = np.repeat(means, heads // kv_heads, axis=1)[:, :, None].repeat(3, axis=2)
        np.testing.assert_allclose(output, expected, rtol=1e-6, atol=1e-6)
        keys = rng.standard_normal((2, kv_heads, 5, 4)).astype("float32")
        queries = rng.standard_normal((2, heads, 3, 4)).astype("float32")
        empty = attention(name, queries, keys, np.zeros((2, kv_heads, 5, 0), "float32"))
        assert empty.shape == (2, heads, 3, 0)
    # the next call runs (an engine error would surface here)
    ones = np.ones((1, 1, 2, 2), "float32")
    np.testing.assert_array_equal(attention(name, ones, ones, ones), ones)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_float_window_and_a_bias_both_add_to_the_scores(name, rng):
    # DotProductAttention: batch b takes window b % 2; the window's -inf entries leave their
    # keys out, its finite ones add to the scores, and so does attn_bias
    module = backend_module(name)
    query, key, value = (rng.standard_normal((4, n, 3)) for n in (2, 5, 5))
    window = rng.standard_normal((2, 2, 5))
    window[0, 0, 1] = window[1, 1, 4] = -np.inf
    attn_bias = rng.standard_normal((4, 2, 5))
    output = module.DotProductAttention(dtype="float64")(
        *map(module.from_numpy, (query, key, value)),
        window_mask=module.from_numpy(window),
        attn_bias=module.from_numpy(attn_bias),
    )
    scores = query @ key.swapaxes(-1, -2) / math.sqrt(3) + window[[0, 1, 0, 1]] + attn_bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    assert weights[0, 0, 1] == weights[3, 1, 4] == 0
    np.testing.assert_allclose(module.to_numpy(output), weights @ value, atol=1e-12)


@pytest.mark.parametrize("name", BACKENDS)
def test_multihead_attention_without_weights_keeps_no_old_weights(name, rng):
    # need_weights=False leaves attention_weights None, not the last call's weights
    module = backend_module(name)
    layer = module.MultiHeadAttention(8, 2, dtype="float64")
    X = module.from_numpy(rng.standard_normal((2, 3, 8)))
    layer(X, X, X, need_weights=True)
    assert layer.attention_weights is not None
    layer(X, X, X, need_weights=False)
    assert layer.attention_weights is None


@pytest.mark.parametrize("name", BACKENDS)
def test_weights_log_sum_exp_soft_cap_and_empty_rows_by_the_formula(name, rng):
    query, key, value = random_call(rng, heads=2, kv_heads=2)
    mask = rng.random((2, 1, 5, 7)) < 0.6
    mask[0, 0, 1] = False  # an empty row
    key[:, :, 3] = np.nan  # kept out wherever the mask leaves key 3 out
    mask[..., 3] = False
    output, weights, lse = attention(
        name, query, key, value, mask=mask, softcap=2.0, return_weights=True, return_lse=True
    )
    scores = np.einsum("bhqd,bhkd->bhqk", query / math.sqrt(8), np.nan_to_num(key))
    scores = 2.0 * np.tanh(scores / 2.0)
    exp = np.where(mask, np.exp(scores), 0.0)
    total = exp.sum(-1, keepdims=True)
    expected = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
    np.testing.assert_allclose(weights, expected, atol=1e-14)
    np.testing.assert_allclose(output, expected @ value, atol=1e-14)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(lse, np.log(total[..., 0]), atol=1e-14)
    assert (output[0, :, 1] == 0).all() and np.isneginf(lse[0, :, 1]).all()
    uniform = attention(
        name, query, key, value, mask=mask, empty_rows="uniform", return_weights=True
    )[1]
    assert np.allclose(uniform[0, :, 1], 1 / 7)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"alignment": "centre"}, ValueError, "alignment must be 'top_left', 'bottom_right'"),
        ({"window": 0}, ValueError, "window must be a positive int"),
        ({"window": (1, -1)}, ValueError, r"window=\(1, -1\)"),
        ({"softcap": 0.0}, ValueError, "softcap must be a positive number"),
        ({"mask": np.ones((3, 7), bool)}, ValueError, r"mask must broadcast to the scores"),
        ({"mask": np.array(True)}, ValueError, r"mask must broadcast to the scores .* its last"),
        ({"mask": np.ones((5, 7))}, TypeError, "mask must be a boolean keep-mask"),
        ({"bias": np.ones((5, 7), "float32")}, TypeError, "bias must be added to the scores"),
        ({"valid_lens": np.array([1.5, 2.0])}, ValueError, "valid_lens must hold whole numbers"),
        ({"causal": 1}, TypeError, "causal must be True or False"),
    ],
)
@pytest.mark.parametrize("name", BACKENDS)
def test_bad_calls_are_refused_with_the_argument_named(name, options, error, message, rng):
    with pytest.raises(error, match=message):
        attention(name, *random_call(rng), **options)


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_tensors_are_refused(name, rng):
    query, key, value = random_call(rng)
    with pytest.raises(ValueError, match="query must have rank 4"):
        attention(name, query[0], key, value)
    with pytest.raises(ValueError, match="one number of heads that divides query's"):
        attention(name, query, key[:, :1], value)
    empty = "must each have at least one head and one position"
    with pytest.raises(ValueError, match=empty):
        attention(name, query, key[:, :0], value[:, :0])  # no key-value head
    with pytest.raises(ValueError, match=empty):
        attention(name, query[:, :, :0], key, value)  # no query
    with pytest.raises(TypeError, match="share one floating dtype"):
        attention(name, query, key.astype("float32"), value)
    # Integer tensors: the query named once
    with pytest.raises(
        TypeError, match=r"Received: query with shape \S+ \S+ \S+ \S+ and dtype int64$"
    ):
        attention(name, query.astype("int64"), key.astype("int64"), value.astype("int64"))
    with pytest.raises(TypeError, match="must be an array or tensor of the layer's framework"):
        backend_module(name).dot_product_attention(query.tolist(), key, value)


@pytest.mark.torch
def test_torch_gradients_are_the_references_finite_differences(rng):
    # Grouped heads, a value head size of its own, every mask kind and the soft cap; the loss
    # weighs the output and the log-sum-exp by fixed random numbers
    torch = framework_import("torch")
    from mha.backends import numpy as N
    from mha.backends import torch as T

    query, key, value = random_call(rng, batch=1, heads=2, kv_heads=1, queries=3, keys=4, d=2, dv=3)
    bias = rng.standard_normal((2, 3, 4))
    options = {
        "causal": True,
        "alignment": "bottom_right",
        "window": (2, None),
        "softcap": 1.5,
        "mask": np.array([True, True, False, True]),
        "valid_lens": np.array([4]),
    }
    weigh_output, weigh_lse = rng.standard_normal((1, 2, 3, 3)), rng.standard_normal((1, 2, 3))

    def loss(q, k, v, b):
        output, lse = N.dot_product_attention(q, k, v, bias=b, return_lse=True, **options)
        return np.sum(output * weigh_output) + np.sum(lse * weigh_lse)

    tensors = [torch.from_numpy(x).requires_grad_() for x in (query, key, value, bias)]
    torch_options = {
        k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in options.items()
    }
    output, lse = T.dot_product_attention(
        *tensors[:3], bias=tensors[3], return_lse=True, **torch_options
    )
    total = (output * torch.from_numpy(weigh_output)).sum() + (
        lse * torch.from_numpy(weigh_lse)
    ).sum()
    gradients = torch.autograd.grad(total, tensors)
    arrays = [query, key, value, bias]
    for i, (array, gradient) in enumerate(zip(arrays, gradients, strict=True)):
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            step = np.zeros_like(array)
            step[index] = 1e-6
            plus = [a + step if j == i else a for j, a in enumerate(arrays)]
            minus = [a - step if j == i else a for j, a in enumerate(arrays)]
            numeric[index] = (loss(*plus) - loss(*minus)) / 2e-6
        np.testing.assert_allclose(gradient.numpy(), numeric, atol=1e-7, err_msg=str(i))


@pytest.mark.parametrize("name", backend_params(["torch", "tensorflow", "mxnet", "jax"]))
def test_gradients_are_the_references_finite_differences(name, rng):
    # Each framework's autograd (as the harness runs it), every mask kind, the soft cap
    from mha.backends import numpy as N

    module = backend_module(name)
    query, key, value = random_call(rng, batch=1, heads=2, kv_heads=1, queries=3, keys=4, d=2, dv=3)
    arrays = {"query": query, "key": key, "value": value, "bias": rng.standard_normal((2, 3, 4))}
    options = {"causal": True, "alignment": 1, "window": (1, None), "softcap": 1.5}
    masks = {"mask": np.array([True, True, False, True]), "valid_lens": np.array([4])}
    cotangent = rng.standard_normal((1, 2, 3, 3))

    def loss(**given):
        return np.sum(N.dot_product_attention(**given, **masks, **options) * cotangent)

    def function(tensors):
        return module.dot_product_attention(**tensors, **options)

    tensors = {k: module.from_numpy(v) for k, v in {**arrays, **masks}.items()}
    _, gradients, _ = module.value_and_gradients(
        function, tensors, list(arrays), None, module.from_numpy(cotangent)
    )
    for argument, array in arrays.items():
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            step = np.zeros_like(array)
            step[index] = 1e-6
            plus, minus = dict(arrays), dict(arrays)
            plus[argument], minus[argument] = array + step, array - step
            numeric[index] = (loss(**plus) - loss(**minus)) / 2e-6
        np.testing.assert_allclose(gradients[argument], numeric, atol=1e-7, err_msg=argument)


COMPILERS = {
    "torch": lambda module, f: module.torch.compile(f, dynamic=False),
    "tensorflow": lambda module, f: module.tf.function(f),
    "jax": lambda module, f: module.jax.jit(f),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", backend_params(list(COMPILERS)))
def test_a_compiled_call_gives_the_references_numbers(name, rng):
    # torch.compile, tf.function, jax.jit: the lengths and masks are the compiled function's
    # inputs, a masked key holds NaN, and a row keeps no key
    from mha.backends import numpy as N

    module = backend_module(name)
    query, key, value = random_call(rng)
    key[:, :, 6] = np.nan
    masks = {"valid_lens": np.array([6, 0]), "bias": rng.standard_normal((5, 7))}
    options = {"causal": True, "alignment": "bottom_right", "window": (3, 1), "softcap": 5.0}

    def call(query, key, value, valid_lens, bias):
        return module.dot_product_attention(
            query, key, value, valid_lens=valid_lens, bias=bias, return_lse=True, **options
        )

    compiled = COMPILERS[name](module, call)
    tensors = [module.from_numpy(x) for x in (query, key, value, *masks.values())]
    output, lse = (module.to_numpy(x) for x in compiled(*tensors))
    expected, expected_lse = N.dot_product_attention(
        query, key, value, **masks, **options, return_lse=True
    )
    np.testing.assert_allclose(output, expected, atol=1e-12)
    np.testing.assert_allclose(lse, expected_lse, atol=1e-12)
    assert (output[1] == 0).all() and np.isneginf(lse[1]).all()


# Masks that leave key 6 (a NaN) out of every row, as each fast path takes them: lengths,
# a boolean mask of keys, a bias's -inf, and causal alone (top-left: the 5 queries see keys 0
# to 4)
NAN_KEY_MASKS = {
    "valid_lens": {"valid_lens": np.array([6, 6])},
    "mask of keys": {"mask": np.arange(7) < 6},
    "bias -inf": {"bias": np.where(np.arange(7) < 6, 0.0, -np.inf)},
    "causal alone": {"causal": True},
}


@pytest.mark.parametrize("masks", NAN_KEY_MASKS)
@pytest.mark.parametrize("name", BACKENDS)
def test_a_nan_at_a_masked_key_reaches_no_output_without_weights(name, masks, rng):
    # Without weights or log-sum-exp the function takes the frameworks' fast paths (torch's
    # fused kernels among them), eager and, for torch, compiled: the NaN stays out
    from mha.backends import numpy as N

    module = backend_module(name)
    query, key, value = random_call(rng, queries=5, keys=7)
    key[:, :, 6] = np.nan
    options = NAN_KEY_MASKS[masks]
    expected = N.dot_product_attention(query, key, value, **options)
    assert np.isfinite(expected).all()
    calls = [lambda *t, **o: module.dot_product_attention(*t, **o)]
    if name == "torch" and masks in ("valid_lens", "causal alone"):  # the fused kernels' paths
        calls.append(module.torch.compile(module.dot_product_attention, dynamic=False))
    for call in calls:
        output = attention_with(module, call, query, key, value, **options)
        np.testing.assert_allclose(output, expected, rtol=1e-12, atol=1e-12)


def attention_with(module, call, *tensors, **options):
    """`call` on the backend's tensors of numpy arrays, its output as numpy."""
    convert = {
        k: module.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in options.items()
    }
    return module.to_numpy(call(*map(module.from_numpy, tensors), **convert))


def test_the_docs_example_runs_and_gives_the_shapes_it_says():
    page = (Path(__file__).resolve().parents[1] / "docs" / "attention-function.md").read_text()
    example = re.findall(r"```python\n(.*?)```", page, re.S)[0]
    names: dict = {}
    exec(compile(example, "docs/attention-function.md", "exec"), names)
    said = re.search(r"# output (\(.*?\)), weights (\(.*?\)), lse (\(.*?\))", example).groups()
    shapes = [names[n].shape for n in ("output", "weights", "lse")]
    assert [str(shape) for shape in shapes] == list(said)
    assert np.isfinite(names["output"]).all()


@pytest.mark.parametrize("name", BACKENDS)
def test_packed_sequences_give_the_numbers_of_each_sequence_alone(name, rng):
    # Row 0 packs sequences of 3, 4 and 2 positions; row 1 one of 5 and 4 of padding (id -1,
    # whose outputs are not compared); causal with a window, as a decoder runs packed batches
    query, key, value = random_call(rng, batch=2, heads=4, kv_heads=2, queries=9, keys=9)
    ids = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [7, 7, 7, 7, 7, -1, -1, -1, -1]])
    options = {"causal": True, "window": (2, 0)}
    packed = attention(name, query, key, value, segment_ids=ids, **options)
    for row, starts in ((0, (0, 3, 7, 9)), (1, (0, 5))):
        for start, end in itertools.pairwise(starts):
            part = (slice(row, row + 1), slice(None), slice(start, end))
            alone = attention(name, query[part], key[part], value[part], **options)
            np.testing.assert_allclose(packed[part], alone, atol=1e-12, err_msg=f"{row}")
    # A pair: queries of one segment against keys of several
    pair = (ids[:, 5:], ids)
    cross = attention(name, query[:, :, 5:], key, value, segment_ids=pair, return_weights=True)
    kept = cross[1] > 0
    assert (kept == (pair[0][:, None, :, None] == pair[1][:, None, None, :])).all()


@pytest.mark.parametrize("name", BACKENDS)
def test_interleaved_and_paired_segments_count_positions_within_each(name, rng):
    # Segments in any order, and queries and keys packed each their own way: causal and the
    # window read each position's place in its own sequence, which alone gives the numbers
    query, key, value = random_call(rng, batch=1, heads=2, queries=7, keys=7)
    ids = np.array([[0, 1, 0, 0, 1, 2, 1]])
    options = {"causal": True, "window": (1, 0)}
    packed = attention(name, query, key, value, segment_ids=ids, **options)
    for segment in (0, 1, 2):
        where = np.flatnonzero(ids[0] == segment)
        alone = attention(name, *(x[:, :, where] for x in (query, key, value)), **options)
        np.testing.assert_allclose(packed[:, :, where], alone, atol=1e-12)
    # Queries 2 + 3 against keys 4 + 3: each sequence's queries from its own first position
    pair = (np.array([[0, 0, 1, 1, 1]]), np.array([[0, 0, 0, 0, 1, 1, 1]]))
    for alignment in ("top_left", 1):
        options = {"causal": True, "window": (2, None), "alignment": alignment}
        packed = attention(name, query[:, :, :5], key, value, segment_ids=pair, **options)
        for rows, keys in ((slice(0, 2), slice(0, 4)), (slice(2, 5), slice(4, 7))):
            alone = attention(
                name, query[:, :, rows], key[:, :, keys], value[:, :, keys], **options
            )
            np.testing.assert_allclose(packed[:, :, rows], alone, atol=1e-12)


@pytest.mark.parametrize(
    "segment_ids, message",
    [
        (
            np.zeros((2, 4), "int64"),
            r"of the queries must be integers .* = \(2, 5\)",
        ),
        (np.zeros((2, 5)), "must be integers"),
        ((np.zeros((2, 5), "int64"),), "a tuple of 1"),
    ],
)
def test_bad_segment_ids_are_refused(segment_ids, message, rng):
    with pytest.raises(ValueError, match=message):
        attention("numpy", *random_call(rng), segment_ids=segment_ids)


def test_a_pair_of_segment_ids_takes_no_bottom_right_alignment(rng):
    # Only each sequence's own lengths could put its last query beside its last key
    pair = (np.zeros((2, 5), "int64"), np.zeros((2, 5), "int64"))
    with pytest.raises(ValueError, match="alignment='bottom_right' cannot be given with a pair"):
        attention("numpy", *random_call(rng), segment_ids=pair, alignment="bottom_right")
    with pytest.raises(ValueError, match="alignment='bottom_right' cannot be given with a pair"):
        backend_module("numpy").MultiHeadAttention(8, 2)(
            *[np.zeros((2, 5, 8), "float32")] * 3, segment_ids=pair, alignment="bottom_right"
        )


@pytest.mark.parametrize("packed", [False, True], ids=["", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options",
    [
        {"causal": True, "alignment": 2**31 - 1},
        {"causal": True, "alignment": 2**40},
        {"window": 2**31},
        {"window": (2**40, 2**40)},
        {"causal": True, "alignment": 2**50},
        {"window": (2**50, None)},
        {"causal": True, "alignment": -(2**31) + 1},
        {"causal": True, "alignment": -(2**40)},
    ],
    ids=[
        "alignment-int32-max",
        "alignment-2**40",
        "window-2**31",
        "window-left-2**40",
        "alignment-2**50",
        "window-left-2**50",
        "alignment-int32-min",
        "alignment--2**40",
    ],
)
def test_positions_past_int32_keep_every_key_or_none_or_are_refused(backend, options, packed, rng):
    """An offset or window past int32's range keeps every key here (each query after every
    key, or within its window; or before every key, then none), by the plain formula, in a
    packed row each segment's: no backend wraps it into another mask. JAX without its 64-bit
    mode counts positions in int32 and refuses it by name."""
    B = backend_module(backend)
    query, key, value = (
        rng.standard_normal(shape).astype(np.float32)
        for shape in ((1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 3))
    )
    segment_ids = np.array([[0, 0, 1, 1, 1]])
    keep = segment_ids[0][:, None] == segment_ids[0] if packed else np.ones((5, 5), bool)
    keep &= options.get("alignment", 0) >= 0  # every query before every key: no key at all
    scores = np.where(keep, query @ key.swapaxes(-1, -2) / 2.0, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True, initial=-1e30))
    expected = np.nan_to_num(weights / weights.sum(-1, keepdims=True)) @ value
    arrays = [B.from_numpy(x) for x in (query, key, value)]
    if packed:
        options = {**options, "segment_ids": B.from_numpy(segment_ids)}
    if backend == "jax" and not required_import("jax").config.jax_enable_x64:
        with pytest.raises(ValueError, match="int32's range"):
            B.dot_product_attention(*arrays, **options)
        return
    output = B.to_numpy(B.dot_product_attention(*arrays, **options))
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options, name",
    [
        ({"window": 2**63}, "window"),
        ({"window": (None, 2**50 + 1)}, "a side of window"),
        ({"causal": True, "alignment": 2**63 - 1}, "alignment"),
        ({"causal": True, "alignment": -(2**51)}, "alignment"),
    ],
)
def test_positions_past_2_to_the_50_are_refused_by_name(backend, options, name, rng):
    """Past 2**50 a sum of positions, windows and chunks could wrap in int64 (2**63 became
    another window) or round in float64: every backend refuses it before computing."""
    B = backend_module(backend)
    arrays = [B.from_numpy(x.astype(np.float32)) for x in random_call(rng)]
    with pytest.raises(ValueError, match=rf"^{name} must be at most 2\*\*50"):
        B.dot_product_attention(*arrays, **options)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2, 0, 5), (2, 0, 3, 5), (2, 2, 0, 5)])
def test_masked_softmax_of_no_rows_is_empty(backend, shape):
    B = backend_module(backend)
    output = B.masked_softmax(
        B.from_numpy(np.zeros(shape, np.float32)), B.from_numpy(np.array([1, 2]))
    )
    assert B.to_numpy(output).shape == shape


@pytest.mark.parametrize("name", BACKENDS)
def test_the_log_sum_exp_of_scores_past_exps_range_is_finite(name):
    # Every score 20 * 20 * 4 / sqrt(4) = 800, past float64's exp: 800 + log 3 by the formula,
    # the row's maximum taken out first; the third key masked leaves 800 + log 2
    query, key = np.full((1, 1, 2, 4), 20.0), np.full((1, 1, 3, 4), 20.0)
    value = np.eye(3, 4).reshape(1, 1, 3, 4)
    _, lse = attention(name, query, key, value, return_lse=True)
    np.testing.assert_allclose(lse, np.full((1, 1, 2), 800 + np.log(3)), rtol=1e-15)
    _, lse = attention(name, query, key, value, valid_lens=np.array([2]), return_lse=True)
    np.testing.assert_allclose(lse, np.full((1, 1, 2), 800 + np.log(2)), rtol=1e-15)
