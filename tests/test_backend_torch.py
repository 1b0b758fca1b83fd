"""What only the PyTorch backend promises; the agreement with the NumPy reference (every layer,
mask combination and dtype, gradients and the forward without gradients) is
tests/test_agreement.py's, through mha.harness, and the error table tests/test_errors.py's.

Here: the fused kernel's path surviving kernels that give NaN, torch.autograd.gradcheck,
half precision and bfloat16, train() / eval(), inputs left untouched (version counters), the
meta device, torch.compile (cached decoding included), lazy modules, state_dict and torch.save,
.to() / .double(), LearnedPositionalEncoding's trainable table, and every way of changing a
parameter reaching the next call.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import mha
from agreement_cases import all_cases
from conftest import assert_agrees, backend_module
from mha import harness
from mha.backends import numpy as N
from mha.encoding import sinusoid_table

pytestmark = pytest.mark.torch

B, H = 4, 2  # batch size and number of heads


@pytest.fixture(scope="module")
def T():
    """The torch backend module; a missing torch fails here when torch is required."""
    return backend_module("torch")


@pytest.fixture(scope="module")
def torch(T):
    return T.torch


# Layers built on both backends with the same weights


def build(M, kind, dtype="float32", dropout=0.0):
    """A layer of backend module M; sizes: queries 5, keys 6, values 7 features."""
    if kind == "dot":
        return M.DotProductAttention(dropout, dtype=dtype)
    if kind == "additive":
        return M.AdditiveAttention(8, dropout, query_size=5, key_size=6, dtype=dtype)
    if kind == "multihead":
        return M.MultiHeadAttention(
            8, H, dropout, True, query_size=5, key_size=6, value_size=7, dtype=dtype
        )
    if kind == "encoding":
        return M.PositionalEncoding(7, dropout, max_len=20, dtype=dtype)
    if kind == "addnorm":
        return M.AddNorm(7, dropout, dtype=dtype)
    raise AssertionError(kind)


def pair(T, kind, dtype, seed=0):
    """(numpy layer, torch layer) holding the same random canonical weights."""
    reference, layer = build(N, kind, dtype), build(T, kind, dtype)
    weights = mha.random_weights(reference, seed=seed)
    mha.set_weights(reference, weights)
    mha.set_weights(layer, weights)
    return reference, layer


def inputs(num_queries, num_keys, dtype, kind="multihead", seed=1):
    rng = np.random.default_rng(seed)
    query_size = 6 if kind == "dot" else 5
    queries = rng.standard_normal((B, num_queries, query_size))
    keys = rng.standard_normal((B, num_keys, 6))
    values = rng.standard_normal((B, num_keys, 7))
    return [x.astype(dtype) for x in (queries, keys, values)]


def to_torch(T, arguments: dict) -> dict:
    return {k: T.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arguments.items()}


# Masks for the tests of inputs left untouched
def _bools(rng, shape, p=0.7):
    return rng.random(shape) < p


def _window_additive(rng, Q, K, dtype):
    window = rng.standard_normal((2, Q, K))
    window[rng.random((2, Q, K)) < 0.3] = -np.inf
    window[1, 0, :] = -np.inf  # a fully masked row
    return window.astype(dtype)


# ---------------------------------------------------------------------------------------------
# The fused kernel's path


@pytest.mark.parametrize(
    "case",
    [
        harness.Case("MultiHeadAttention", ("mask_3d", "no_weights")),
        harness.Case("MultiHeadAttention", ("mask_4d", "window_mask", "no_weights")),
        # A window alone, with lengths above 0, can still empty a row
        harness.Case("MultiHeadAttention", ("valid_lens_2d", "window_bool", "no_weights")),
        # Fewer key-value heads than query heads, which the kernel pairs itself (enable_gqa)
        harness.Case(
            "MultiHeadAttention",
            ("valid_lens_1d", "no_weights"),
            {"num_heads": 4, "num_kv_heads": 2, "sliding_window": 2},
        ),
    ],
    ids=lambda case: case.id,
)
def test_fused_path_survives_kernels_that_give_nan(T, torch, monkeypatch, case):
    """Some SDPA kernels give NaN for a row with no kept key (torch 2.13's CPU kernels give 0):
    under such a kernel the fused path still computes the reference's numbers, zero rows
    included, with finite gradients that match the reference's finite differences."""

    def naive_attention(
        queries,
        keys,
        values,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if is_causal:  # top-left aligned: query i attends to keys j <= i
            assert attn_mask is None
            attn_mask = torch.ones(queries.shape[-2], keys.shape[-2], dtype=torch.bool).tril()
        if enable_gqa:  # query head h attends with key-value head h // group
            group = queries.shape[-3] // keys.shape[-3]
            keys, values = (x.repeat_interleave(group, dim=-3) for x in (keys, values))
        scale = queries.shape[-1] ** -0.5 if scale is None else scale
        scores = queries @ keys.transpose(-1, -2) * scale
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        elif attn_mask is not None:
            scores = scores + attn_mask
        return torch.softmax(scores, dim=-1) @ values  # NaN where a row is all -inf

    prepared = harness.prepare(case, dtype="float64")
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return naive_attention(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    row, _ = harness.check("torch", prepared)
    assert calls, "the fused path was not taken"
    assert row.passed, row


def _grouped_call_reaching_sdpa(T, torch, monkeypatch, device, choice):
    """What F.scaled_dot_product_attention receives from a bfloat16 grouped call (4 query
    heads, 2 key-value heads) with lengths and without weights on `device`, SDPA's own choice
    of kernel for grouped heads being `choice` (a torch.nn.attention.SDPBackend)."""
    import torch.nn.functional as F

    seen, real = [], F.scaled_dot_product_attention

    def spy(queries, keys, values, **options):
        mask = options.get("attn_mask")
        seen.append(
            (
                tuple(queries.shape),
                tuple(keys.shape),
                options.get("enable_gqa"),
                None if mask is None else tuple(mask.shape),
            )
        )
        return real(queries, keys, values, **options)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args, **kwargs: int(choice))
    sizes = dict(query_size=32, key_size=32, value_size=32, num_kv_heads=2)
    layer = T.MultiHeadAttention(32, 4, dtype="bfloat16", **sizes).to(device)
    X = torch.ones(2, 6, 32, dtype=torch.bfloat16, device=device)
    layer(X, X, X, torch.tensor([3, 6], device=device), need_weights=False)
    return seen


def test_grouped_heads_reach_a_kernel_that_pairs_them_as_they_are(T, torch, monkeypatch):
    # Off the CPU (here the meta device, which has shapes and no values), where SDPA's own
    # choice for grouped heads with the mask is one of its kernels (cuDNN's on CUDA), the
    # heads reach it unfolded and unrepeated, enable_gqa pairing them
    from torch.nn.attention import SDPBackend

    seen = _grouped_call_reaching_sdpa(T, torch, monkeypatch, "meta", SDPBackend.CUDNN_ATTENTION)
    assert seen == [((2, 4, 6, 8), (2, 2, 6, 8), True, (2, 1, 1, 6))]


def test_grouped_heads_are_folded_where_sdpa_would_fall_back_to_its_math(T, torch, monkeypatch):
    # SDPA's math fallback would repeat the keys for each query head: each group of query
    # heads becomes one head's rows first; on the CPU too, where folding is the faster
    from torch.nn.attention import SDPBackend

    for device in ("meta", "cpu"):
        seen = _grouped_call_reaching_sdpa(T, torch, monkeypatch, device, SDPBackend.MATH)
        assert seen == [((2, 2, 12, 8), (2, 2, 6, 8), False, (2, 1, 1, 6))], device


def test_a_torch_that_cannot_say_pairs_heads_only_without_a_mask(T, torch, monkeypatch):
    from mha.backends import torch_fused as fused

    def unknown(*args, enable_gqa=False, **kwargs):  # an older torch: no enable_gqa
        raise TypeError("_fused_sdp_choice() got an unexpected keyword argument 'enable_gqa'")

    monkeypatch.setattr(torch, "_fused_sdp_choice", unknown)
    q = torch.empty(2, 4, 6, 8, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 2, 6, 8, dtype=torch.bfloat16, device="meta")
    keep = torch.empty(2, 1, 1, 6, dtype=torch.bool, device="meta")
    assert fused._kernel_pairs_heads(q, kv, kv, None, 0.0, True)  # flash's, half precision
    assert not fused._kernel_pairs_heads(q, kv, kv, keep, 0.0, False)
    assert not fused._kernel_pairs_heads(q.float(), kv.float(), kv.float(), None, 0.0, True)
    on_cpu = (torch.empty(x.shape, dtype=x.dtype) for x in (q, kv, kv, keep))
    assert fused._kernel_pairs_heads(*on_cpu, 0.0, False)  # every kernel of the CPU's


# The masked product, taken where the scores are not few


@pytest.mark.slow
def test_masked_product_path_agrees_on_every_case_it_takes(T, torch, monkeypatch):
    """The case matrix's scores are few, which the scores path computes: with no call's scores
    counted few, the masked product computes every call it can, and agrees with the reference
    (outputs, weights, gradients)."""
    from mha.backends import torch_fused as fused

    monkeypatch.setattr(fused, "SMALL_SCORES", 0)
    product, taken = fused.masked_product, []
    monkeypatch.setattr(fused, "masked_product", lambda *a: taken.append(1) or product(*a))
    failed = []
    for case in all_cases():
        if case.layer not in ("DotProductAttention", "MultiHeadAttention"):
            continue
        before = len(taken)
        row, _ = harness.check("torch", harness.prepare(case, dtype="float64", seed=7))
        if len(taken) > before and not row.passed:
            failed.append(row)
    assert len(taken) > 50, "the masked product was hardly taken"
    assert not failed, failed


# ---------------------------------------------------------------------------------------------
# PositionalEncoding


def test_positional_table_is_a_buffer_outside_the_state_dict(T):
    layer = build(T, "encoding", "float64")
    assert "P" in dict(layer.named_buffers()) and "P" not in layer.state_dict()
    np.testing.assert_array_equal(T.to_numpy(layer.P), sinusoid_table(20, 7))


def test_learned_table_is_a_trained_parameter_in_the_state_dict(T, torch):
    # P is nn.Embedding's weight: a trainable parameter saved as embedding.weight and cast by
    # .double(); the rows of the positions seen get the gradient, the others none
    layer = T.LearnedPositionalEncoding(7, max_len=9)
    assert isinstance(layer.embedding, torch.nn.Embedding)
    assert [name for name, _ in layer.named_parameters()] == ["embedding.weight"]
    assert isinstance(layer.embedding.weight, torch.nn.Parameter)
    assert layer.embedding.weight.requires_grad
    assert list(layer.state_dict()) == ["embedding.weight"]
    np.testing.assert_array_equal(
        mha.get_weights(layer)["P"], T.to_numpy(layer.state_dict()["embedding.weight"])
    )
    config = {"num_hiddens": 7, "dropout": 0.0, "max_len": 9, "dtype": "float32"}
    assert T.layer_config(layer) == config
    layer = layer.double()
    assert layer.dtype == "float64" and layer.embedding.weight.dtype == torch.float64
    layer(torch.ones(3, 5, 7, dtype=torch.float64)).sum().backward()
    gradient = T.to_numpy(layer.embedding.weight.grad)
    np.testing.assert_array_equal(gradient[:5], np.full((5, 7), 3.0))
    np.testing.assert_array_equal(gradient[5:], 0.0)
    fresh = T.LearnedPositionalEncoding(7, max_len=9, dtype="float64")
    fresh.load_state_dict(layer.state_dict())
    np.testing.assert_array_equal(mha.get_weights(fresh)["P"], mha.get_weights(layer)["P"])


# ALiBi slopes of 12 heads (2 ** -(k / 2): not exact in half precision) and rotary frequencies
CONSTANTS = {"alibi": True, "rope_theta": 100.0, "query_size": 5, "key_size": 6}


def _layer_with_constants(T, seed, **call):
    """A float64 reference layer's weights, its output on inputs(3, 6) called with `call`,
    and a float32 torch layer holding the weights, each with buffers outside the state_dict."""
    reference = N.MultiHeadAttention(24, 12, value_size=7, dtype="float64", **CONSTANTS)
    weights = mha.random_weights(reference, seed=seed)
    mha.set_weights(reference, weights)
    queries, keys, values = inputs(3, 6, "float64")
    expected = reference(queries, keys, values, causal=True, **call)
    single = T.MultiHeadAttention(24, 12, value_size=7, **CONSTANTS)
    mha.set_weights(single, {name: w.astype(np.float32) for name, w in weights.items()})
    return weights, (queries, keys, values), expected, single


def test_constant_buffers_are_computed_again_by_to_empty_and_a_dtype_change(T, torch):
    # The constants and the sinusoid table are buffers outside the state_dict, so each is
    # computed again where .to_empty leaves it unset and where a cast would round it twice
    options = CONSTANTS
    weights, (queries, keys, values), expected, single = _layer_with_constants(
        T, 2, alignment="bottom_right"
    )
    with torch.device("meta"):
        on_meta = T.MultiHeadAttention(24, 12, value_size=7, **options)
    on_meta.to_empty(device="cpu").load_state_dict(single.state_dict())
    from_half = T.MultiHeadAttention(24, 12, value_size=7, dtype="float16", **options).double()
    mha.set_weights(from_half, weights)
    for layer, dtype in ((on_meta, "float32"), (from_half, "float64")):
        output = layer(
            *(T.from_numpy(x.astype(dtype)) for x in (queries, keys, values)),
            causal=True,
            alignment="bottom_right",
        )
        assert_agrees(T.to_numpy(output), expected, dtype)
    encoding = T.PositionalEncoding(7, max_len=20).to("meta").to_empty(device="cpu")
    table = sinusoid_table(20, 7).astype(np.float32)
    np.testing.assert_array_equal(T.to_numpy(encoding.P), table)


def test_a_layer_made_on_the_meta_device_keeps_its_constants_there_and_no_cpu_call(T, torch):
    # Made under torch.device("meta"): its constants follow the default device as its
    # parameters do (a CPU table beside meta weights failed its meta calls), and a call on CPU
    # inputs before its weights are loaded is refused (torch computed one with no numbers)
    with torch.device("meta"):
        layer = T.MultiHeadAttention(24, 12, value_size=7, **CONSTANTS)
        encoding = T.PositionalEncoding(8, max_len=20)
    assert {buffer.device.type for buffer in layer.buffers()} == {"meta"}
    assert encoding.P.device.type == "meta"
    sizes = (5, 6, 7)  # of queries, keys and values
    on_meta = [torch.empty(2, 3, size, device="meta") for size in sizes]
    assert layer(*on_meta, causal=True).device.type == "meta"
    cpu = [torch.zeros(2, 3, size) for size in sizes]
    with pytest.raises(ValueError, match=r"weights are on the meta device.*load them first"):
        layer(*cpu, causal=True)
    # A layer without weights has nothing to load: its constants are made where it is called
    X = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    table = sinusoid_table(20, 8).astype(np.float32)
    output = encoding(torch.from_numpy(X))
    np.testing.assert_allclose(T.to_numpy(output), X + table[:, :3], rtol=0, atol=1e-6)
    assert encoding.P.device.type == "cpu" and encoding.dtype == "float32"


def test_a_mask_on_another_device_than_the_inputs_is_named(T, torch):
    # Lengths left on the CPU for a call on a GPU (the meta device stands for it here) failed
    # inside torch's operations with its own message
    layer = T.MultiHeadAttention(8, 2, dtype="float32")
    on_meta = torch.empty(2, 3, 8, device="meta")
    lens, mask = torch.tensor([1, 3]), torch.ones(2, 3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"valid_lens must be on the device of queries, meta"):
        layer(on_meta, on_meta, on_meta, valid_lens=lens)
    with pytest.raises(ValueError, match=r"mask must be on the device of queries, meta.*on cpu"):
        layer(on_meta, on_meta, on_meta, mask=mask)
    heads = torch.zeros(2, 2, 3, 4)
    with pytest.raises(ValueError, match=r"valid_lens must be on the device of query, cpu"):
        T.dot_product_attention(heads, heads, heads, valid_lens=lens.to("meta"))


def test_load_state_dict_with_assign_gives_the_layer_its_tensors_dtype_and_device(T, torch):
    # torch's fast start (build on the meta device, then load with assign=True) left the
    # dtype markers and constants, which no state_dict holds, on meta: .to() failed and
    # autocast inputs were refused; a float64 layer given float32 tensors took neither dtype
    options = CONSTANTS
    _, (queries, keys, values), expected, single = _layer_with_constants(T, 3)
    with torch.device("meta"):
        on_meta = T.MultiHeadAttention(24, 12, value_size=7, **options)
    on_meta.load_state_dict(single.state_dict(), assign=True)
    was_double = T.MultiHeadAttention(24, 12, value_size=7, dtype="float64", **options)
    was_double.load_state_dict(single.state_dict(), assign=True)
    tensors = [T.from_numpy(x.astype(np.float32)) for x in (queries, keys, values)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = single(*(x.bfloat16() for x in tensors), causal=True)
    for layer in (on_meta.to("cpu"), was_double):
        assert layer.dtype == "float32"
        assert {b.device.type for b in layer.buffers()} == {"cpu"}
        assert_agrees(T.to_numpy(layer(*tensors, causal=True)), expected, "float32")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            again = layer(*(x.bfloat16() for x in tensors), causal=True)
        torch.testing.assert_close(again, half, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Half precision


def test_half_precision_runs_close_to_reference(T, torch):
    """float16 via mha weights, bfloat16 via .to(): finite, near the float64 reference."""
    reference, layer = pair(T, "multihead", "float64")
    queries, keys, values = inputs(3, 6, "float64")
    arguments = {"valid_lens": np.array([0, 2, 6, 1]), "causal": True}
    expected = reference(queries, keys, values, **arguments)
    for dtype in (torch.float16, torch.bfloat16):
        low = layer.to(dtype)
        assert low.dtype == str(dtype).split(".")[-1]
        for need_weights in (True, False):
            output = low(
                *(T.from_numpy(x).to(dtype) for x in (queries, keys, values)),
                **to_torch(T, arguments),
                need_weights=need_weights,
            )
            assert output.dtype == dtype
            np.testing.assert_allclose(T.to_numpy(output), expected, atol=0.05)
        layer = layer.to(torch.float64)


def test_half_precision_self_attention_of_one_example_runs_close_to_reference(T, torch):
    """One example, one tensor as queries, keys and values: the values reach the product with
    the weights as strided views of the projection (copied into contiguous heads there), with
    and without gradients."""
    reference, layer = (
        M.MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8, dtype="float64")
        for M in (N, T)
    )
    weights = mha.random_weights(reference, seed=3)
    mha.set_weights(reference, weights)
    mha.set_weights(layer, weights)
    X = np.random.default_rng(5).standard_normal((1, 6, 8))
    for valid_lens in (None, np.array([4])):
        expected = reference(X, X, X, valid_lens)
        for dtype in (torch.float16, torch.bfloat16):
            low = layer.to(dtype)
            inputs_low = T.from_numpy(X).to(dtype)
            lens = None if valid_lens is None else T.from_numpy(valid_lens)
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    output = low(inputs_low, inputs_low, inputs_low, lens)
                assert output.dtype == dtype
                np.testing.assert_allclose(T.to_numpy(output.detach()), expected, atol=0.05)
            layer = layer.to(torch.float64)


def test_bfloat16_weights_arrive_bit_for_bit(T, torch):
    """A bfloat16 layer takes and hands out ml_dtypes' bfloat16 weights exactly (numpy has no
    bfloat16 of its own), and computes near the float64 reference with them."""
    layer = build(T, "multihead", "bfloat16")
    weights = mha.random_weights(layer, seed=4)
    assert {w.dtype.name for w in weights.values()} == {"bfloat16"}
    mha.set_weights(layer, weights)
    for name in ("W_q", "W_k", "W_v", "W_o"):
        # torch keeps (out, in): the parameter's bits are those of the transposed array
        held = getattr(layer, name).weight.detach().T.contiguous()
        np.testing.assert_array_equal(
            held.view(torch.int16).numpy().view(np.uint16), weights[name].view(np.uint16)
        )
    again = mha.get_weights(layer)
    for name, value in weights.items():
        assert again[name].dtype == value.dtype
        np.testing.assert_array_equal(again[name].view(np.uint16), value.view(np.uint16))
    # The same numbers in float64, for the reference
    reference = build(N, "multihead", "float64")
    mha.set_weights(reference, {k: v.astype(np.float64) for k, v in weights.items()})
    queries, keys, values = inputs(3, 6, "float64")
    expected = reference(queries, keys, values, np.array([0, 2, 6, 1]))
    output = layer(
        *(T.from_numpy(x).bfloat16() for x in (queries, keys, values)),
        T.from_numpy(np.array([0, 2, 6, 1])),
    )
    assert output.dtype == torch.bfloat16
    np.testing.assert_allclose(T.to_numpy(output).astype(np.float64), expected, atol=0.05)


# ---------------------------------------------------------------------------------------------
# Gradients


def _gradcheck(torch, function, *tensors):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    assert torch.autograd.gradcheck(function, tensors, atol=1e-7)
    # The gradients themselves are finite
    output = function(*tensors)
    (output * torch.randn_like(output)).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in tensors)
    return tensors


@pytest.mark.parametrize(
    "kind, need_weights",
    [("dot", True), ("additive", True), ("multihead", True), ("multihead", False)],
    ids=["dot", "additive", "multihead", "multihead-fused"],
)
def test_gradcheck_attention(T, torch, kind, need_weights):
    _, layer = pair(T, kind, "float64")
    rng = np.random.default_rng(7)
    queries, keys, values = (T.from_numpy(x[:2]) for x in inputs(3, 4, "float64", kind))
    mask = np.ones((2, 3, 4), bool)
    mask[1, 2, :] = False  # a fully masked row
    mask[1, 0, 3] = False
    window = rng.standard_normal((2, 3, 4))
    window[1, 1, 0] = -np.inf
    arguments = {
        "valid_lens": T.from_numpy(np.array([0, 4])),  # a fully masked example
        "mask": T.from_numpy(mask),
        "window_mask": T.from_numpy(window),
    }
    if kind == "multihead":
        arguments["need_weights"] = need_weights
    names = [name for name, _ in layer.named_parameters()]

    def function(queries, keys, values, *parameters):
        weights = dict(zip(names, parameters, strict=True))
        return torch.func.functional_call(layer, weights, (queries, keys, values), arguments)

    tensors = _gradcheck(torch, function, queries, keys, values, *layer.parameters())
    # Example 0 attends to nothing: zero gradients for its queries, keys and values
    for tensor in tensors[:3]:
        assert (tensor.grad[0] == 0).all()
        assert (tensor.grad[1] != 0).any()


def test_gradcheck_masked_softmax(T, torch):
    X = torch.randn(2, 3, 4, dtype=torch.float64) * 3
    (X,) = _gradcheck(torch, lambda X: T.masked_softmax(X, torch.tensor([0, 2])) ** 2, X)
    assert (X.grad[0] == 0).all()


def test_gradcheck_encoding_and_add_norm(T, torch):
    encoding = build(T, "encoding", "float64")
    _gradcheck(torch, encoding, torch.randn(2, 5, 7, dtype=torch.float64))
    _, add_norm = pair(T, "addnorm", "float64")

    def function(X, Y, gamma, beta):
        return torch.func.functional_call(add_norm, {"ln.weight": gamma, "ln.bias": beta}, (X, Y))

    X, Y = torch.randn(2, 3, 7, dtype=torch.float64), torch.randn(2, 3, 7, dtype=torch.float64)
    _gradcheck(torch, function, X, Y, add_norm.ln.weight, add_norm.ln.bias)


@pytest.mark.parametrize("sinks", [False, True])
def test_vmap_maps_the_inputs_and_the_lengths(T, torch, sinks):
    # torch.func.vmap's batched tensors have no values to read (the lengths' check, the
    # search for empty rows) and no storage for the softmax's out=
    reference = N.MultiHeadAttention(8, H, query_size=5, key_size=6, value_size=7, sinks=sinks)
    layer = T.MultiHeadAttention(8, H, query_size=5, key_size=6, value_size=7, sinks=sinks)
    weights = mha.random_weights(reference, seed=7)
    mha.set_weights(reference, weights)
    mha.set_weights(layer, weights)
    rng = np.random.default_rng(7)
    queries = rng.standard_normal((3, B, 2, 5)).astype(np.float32)
    keys = rng.standard_normal((3, B, 6, 6)).astype(np.float32)
    values = rng.standard_normal((3, B, 6, 7)).astype(np.float32)
    lengths = rng.integers(0, 7, (3, B))
    lengths[0] = 0  # every row of one call empty
    for need_weights in (True, False):
        mapped = torch.func.vmap(
            lambda q, k, v, n, need_weights=need_weights: layer(
                q, k, v, n, causal=True, need_weights=need_weights
            )
        )
        output = T.to_numpy(mapped(*(T.from_numpy(x) for x in (queries, keys, values, lengths))))
        for i in range(3):
            expected = reference(queries[i], keys[i], values[i], lengths[i], causal=True)
            assert_agrees(output[i], expected, "float32")


def test_a_compiled_vmap_maps_the_lengths_and_dynamo_warns_of_nothing(T, torch):
    # Dynamo traces torch.func's test of a batched tensor, not its test of every wrapper,
    # which warned ("please file an issue") at each compile of a call with lengths
    reference = N.MultiHeadAttention(8, H, query_size=5, key_size=5, value_size=5)
    layer = T.MultiHeadAttention(8, H, query_size=5, key_size=5, value_size=5)
    mha.set_weights(layer, mha.get_weights(reference))
    rng = np.random.default_rng(8)
    X = rng.standard_normal((3, B, 4, 5)).astype(np.float32)
    lengths = rng.integers(0, 5, (3, B))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mapped = torch.compile(torch.func.vmap(lambda x, n: layer(x, x, x, n)), backend="eager")
        output = T.to_numpy(mapped(T.from_numpy(X), T.from_numpy(lengths)))
        single = torch.compile(layer, backend="eager")
        single(*(T.from_numpy(X[0]),) * 3, T.from_numpy(lengths[0]))
    assert not [w.message for w in caught if "functorch" in str(w.message)]
    for i in range(3):
        assert_agrees(output[i], reference(X[i], X[i], X[i], lengths[i]), "float32")


# ---------------------------------------------------------------------------------------------
# Training flag, in-place safety, devices, torch.compile


def test_dropout_follows_train_and_eval(T, torch):
    torch.manual_seed(0)
    reference, layer = pair(T, "multihead", "float32")
    layer.attention.dropout.p = 0.5
    queries, keys, values = (T.from_numpy(x) for x in inputs(3, 6, "float32"))
    expected = reference(*(T.to_numpy(x) for x in (queries, keys, values)))
    layer.eval()
    assert_agrees(T.to_numpy(layer(queries, keys, values)), expected, "float32")
    eval_weights = layer.attention_weights
    layer.train()
    assert layer.attention.training
    for need_weights in (True, False):
        output = layer(queries, keys, values, need_weights=need_weights)
        assert not np.allclose(T.to_numpy(output), expected, atol=1e-3)
    layer(queries, keys, values)
    # attention_weights are taken before dropout
    assert_agrees(T.to_numpy(layer.attention_weights), T.to_numpy(eval_weights), "float32")

    encoding = T.PositionalEncoding(7, 0.5, max_len=20).train()
    X = torch.randn(2, 5, 7)
    output, full = encoding(X), X + encoding.P[:, :5]
    assert ((output == 0) | torch.isclose(output, 2 * full)).all() and (output == 0).any()
    assert torch.equal(encoding.eval()(X), full)

    add_norm = T.AddNorm(7, 0.5).train()
    Y = torch.randn(2, 5, 7)
    assert not torch.allclose(add_norm(X, Y), add_norm.ln(X + Y))
    assert torch.equal(add_norm.eval()(X, Y), add_norm.ln(X + Y))


def test_eval_drops_nothing_on_the_fused_path_and_add_norm_drops_only_y(T, torch):
    # need_weights=False takes the fused kernel, whose dropout_p must be 0 in eval()
    torch.manual_seed(0)
    config = {"dropout": 0.5, "query_size": 8, "key_size": 8, "value_size": 8, "dtype": "float64"}
    reference, layer = N.MultiHeadAttention(8, 2, **config), T.MultiHeadAttention(8, 2, **config)
    weights = mha.random_weights(reference, seed=3)
    mha.set_weights(reference, weights)
    mha.set_weights(layer, weights)
    X = np.random.default_rng(2).standard_normal((B, 5, 8))
    output = layer.eval()(*(T.from_numpy(X),) * 3, need_weights=False)
    assert_agrees(T.to_numpy(output), reference(X, X, X), "float64")

    # In train(), AddNorm's dropout falls on Y only: with Y = 0 it is LayerNorm(X) exactly
    reference, add_norm = pair(T, "addnorm", "float64", seed=5)
    add_norm.dropout.p = 0.5
    X, Y = np.random.default_rng(4).standard_normal((2, 5, 7)), np.zeros((2, 5, 7))
    output = add_norm.train()(T.from_numpy(X), T.from_numpy(Y))
    assert_agrees(T.to_numpy(output), reference(X, Y), "float64")


def test_inputs_are_not_modified(T, torch):
    _, layer = pair(T, "multihead", "float32")
    queries, keys, values = (T.from_numpy(x) for x in inputs(3, 6, "float32"))
    rng = np.random.default_rng(8)
    arguments = {
        "valid_lens": T.from_numpy(np.array([0.0, 2.0, 9.0, 6.0], np.float32)),
        "mask": T.from_numpy(_bools(rng, (B, 1, 3, 6))),
        "window_mask": T.from_numpy(_window_additive(rng, 3, 6, "float32")),
        "head_mask": T.from_numpy(np.array([True, False])),
    }
    X = torch.randn(4, 3, 6)
    tensors = [queries, keys, values, *arguments.values(), X]
    copies = [t.clone() for t in tensors]
    versions = [t._version for t in tensors]
    for need_weights in (True, False):
        layer(queries, keys, values, causal=True, need_weights=need_weights, **arguments)
        layer(queries, keys, values, need_weights=need_weights)
    T.masked_softmax(X, arguments["valid_lens"])
    T.masked_softmax(X)
    _, additive = pair(T, "additive", "float32")
    additive(queries, keys, values, arguments["valid_lens"], window_mask=arguments["window_mask"])
    for tensor, copy, version in zip(tensors, copies, versions, strict=True):
        assert torch.equal(tensor, copy) and tensor._version == version


def test_no_tensor_is_created_on_the_cpu(T, torch):
    """On the meta device every op runs without data; a CPU tensor would be a device error."""
    layer = T.MultiHeadAttention(8, H, bias=True, query_size=5, key_size=6, value_size=7)
    layer = layer.to("meta")
    queries, keys, values = (T.from_numpy(x).to("meta") for x in inputs(3, 6, "float32"))
    mask = torch.ones(B, 3, 6, dtype=torch.bool, device="meta")
    window = torch.zeros(2, 3, 6, device="meta")
    for need_weights in (True, False):
        output = layer(
            queries,
            keys,
            values,
            mask=mask,
            causal=True,
            window_mask=window,
            head_mask=torch.ones(H, device="meta"),
            need_weights=need_weights,
        )
        assert output.device.type == "meta" and output.shape == (B, 3, 8)
    # Self-attention without gradients
    layer = T.MultiHeadAttention(8, H, bias=True, query_size=8, key_size=8, value_size=8)
    layer = layer.to("meta")
    X = torch.zeros(B, 3, 8, device="meta")
    with torch.no_grad():
        for need_weights in (True, False, True):
            assert layer(X, X, X, need_weights=need_weights).device.type == "meta"
    encoding = T.PositionalEncoding(8, max_len=10).to("meta")
    assert encoding(torch.zeros(2, 3, 8, device="meta")).device.type == "meta"
    # valid_lens on the meta device have no values to check: the call runs
    lengths = torch.zeros(B, dtype=torch.int64, device="meta")
    assert layer(X, X, X, valid_lens=lengths).shape == (B, 3, 8)
    assert T.masked_softmax(torch.zeros(B, 3, 6, device="meta"), lengths).device.type == "meta"


def test_no_case_of_the_matrix_reads_values_or_makes_a_cpu_tensor_off_the_cpu(T, torch):
    """Every case of the agreement matrix (every layer, mask, option and the function) on the
    meta device, forward and backward: a read of a value, or a tensor made on the CPU, raises
    there, as either would wait for a GPU or fail on it."""
    failed = []
    for case in all_cases():
        prepared = harness.prepare(case, dtype="float32", gradients=False)
        layer = harness.build_layer("torch", prepared.case, prepared.config, prepared.weights)
        layer = None if layer is None else layer.to("meta")
        tensors = {
            key: T.from_numpy(value).to("meta") if isinstance(value, np.ndarray) else value
            for key, value in prepared.inputs.items()
        }
        for name in harness.differentiable(prepared.case):
            tensors[name].requires_grad_(True)
        try:
            output = harness.call_layer(T, prepared.case, layer, tensors)
            output.sum().backward()
            assert output.device.type == "meta"
        except Exception as error:  # each case's failure named, not the first alone
            failed.append(f"{case}: {type(error).__name__}: {error}")
    assert not failed, "\n".join(failed)


def test_every_case_of_the_matrix_runs_under_fake_tensor_mode(T, torch):
    """Every case of the agreement matrix under FakeTensorMode, which memory and FLOP
    estimators and sharding planners trace with: its tensors say "cpu" and have no values,
    so no call may read one (torch raises DataDependentOutputException); each output has the
    shape and dtype of the eager call's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    failed = []
    for case in all_cases():
        prepared = harness.prepare(case, dtype="float32", gradients=False)
        layer = harness.build_layer("torch", prepared.case, prepared.config, prepared.weights)
        inputs = {
            key: T.from_numpy(value) if isinstance(value, np.ndarray) else value
            for key, value in prepared.inputs.items()
        }
        expected = harness.call_layer(T, prepared.case, layer, inputs)
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake = {
                    key: mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
                    for key, value in inputs.items()
                }
                output = harness.call_layer(T, prepared.case, layer, fake)
            assert (output.shape, output.dtype) == (expected.shape, expected.dtype)
        except Exception as error:  # each case's failure named, not the first alone
            failed.append(f"{case}: {type(error).__name__}: {error}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("absorbed", [None, False, True], ids=["kv_cache", "latent", "absorbed"])
def test_cached_decoding_reads_nothing_off_the_cpu(T, torch, absorbed):
    """Decoding steps with a cache on the meta device, a prompt then one position with
    lengths: the cache's positions are counted from shapes, never read."""
    latent = absorbed is not None
    if latent:
        layer = T.MultiHeadLatentAttention(
            16, 4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8
        )
        call = lambda X, **k: layer(X, causal=True, absorbed=absorbed, **k)  # noqa: E731
        cache = T.LatentCache()
    else:
        layer = T.MultiHeadAttention(
            16, 4, num_kv_heads=2, rope_theta=1e4, query_size=16, key_size=16, value_size=16
        )
        call = lambda X, **k: layer(X, X, X, causal=True, **k)  # noqa: E731
        cache = T.KVCache()
    layer.to("meta")
    _, cache = call(torch.zeros(B, 3, 16, device="meta"), cache=cache)
    lengths = torch.tensor([4, 2, 3, 1], device="meta")
    for need_weights in (True, False):
        output, cache = call(
            torch.zeros(B, 1, 16, device="meta"),
            cache=cache,
            valid_lens=lengths,
            need_weights=need_weights,
        )
        assert output.device.type == "meta" and output.shape == (B, 1, 16)
    stored = cache.latent if latent else cache.keys
    assert stored.shape[-2 if not latent else 1] == 5


@pytest.mark.parametrize("kind", ["dot", "multihead"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_lengths_of_at_least_one_leave_no_row_to_look_for(
    T, torch, monkeypatch, kind, causal, need_weights
):
    """Lengths of at least 1, alone or with the causal mask, keep key 0 in every row: the
    call reads the mask for empty rows no more (the reads are counted here) and gives the
    reference's numbers; a length of 0 is looked for and gives a row of zeros."""
    reads = []

    def read(attended):
        reads.append(attended.shape)
        return not bool(attended.all())

    monkeypatch.setattr(T.fused, "may_have_empty_rows", read)
    reference, layer = pair(T, kind, "float64")
    arguments = {"causal": causal} | ({"need_weights": need_weights} if kind != "dot" else {})
    for lengths, looked_for in (([1, 6, 3, 2], False), ([1, 0, 3, 2], True)):
        call = {"valid_lens": np.array(lengths), **arguments}
        reads.clear()
        got = layer(*(T.from_numpy(x) for x in inputs(3, 6, "float64", kind)), **to_torch(T, call))
        expected = reference(*inputs(3, 6, "float64", kind), **call)
        np.testing.assert_allclose(T.to_numpy(got), expected, rtol=1e-12, atol=1e-12)
        assert bool(reads) == looked_for, (lengths, reads)


def test_a_call_with_weights_over_few_scores_reads_no_key(T, torch, monkeypatch):
    """With weights over few scores the masked scores are replaced whatever the keys hold:
    no pass reads whether the keys are finite (it raises here), and a NaN at a masked key
    stays out, under a mask that varies along the queries."""

    def read(queries, keys):
        raise AssertionError("the keys were read")

    monkeypatch.setattr(T.fused, "_scores_known_finite", read)
    reference, layer = pair(T, "multihead", "float64")
    queries, keys, values = inputs(3, 6, "float64")
    call = {"valid_lens": np.array([[1, 2, 3]] * B), "causal": True}
    expected = reference(queries, keys, values, **call)
    keys[:, 5] = np.nan  # masked for every query: lengths of at most 3, causal from key 0
    got = layer(*(T.from_numpy(x) for x in (queries, keys, values)), **to_torch(T, call))
    np.testing.assert_allclose(T.to_numpy(got), expected, rtol=1e-12, atol=1e-12)


def test_no_call_reads_values_off_the_cpu(T, torch):
    """No call of any layer, with any mask, forward or backward, reads a tensor's values when
    the tensors are not on the CPU (where a read would wait for the device): a meta tensor
    has no values, so any read of one raises. Bad lengths go unchecked there, as documented."""
    lengths = {
        "1d": torch.tensor([2, -1, 3, 0], device="meta"),
        "2d_float": torch.zeros(B, 3, device="meta", dtype=torch.float32),
    }
    masks = [
        {"valid_lens": lengths["1d"]},
        {"valid_lens": lengths["2d_float"]},
        {"mask": torch.ones(B, 3, 6, dtype=torch.bool, device="meta")},
        {"causal": True},
        {"window_mask": torch.zeros(2, 3, 6, device="meta")},
        {"attn_bias": torch.zeros(B, H, 3, 6, device="meta"), "causal": True},
    ]
    layers = {
        "multihead": T.MultiHeadAttention(8, 4, query_size=8, key_size=8, value_size=8),
        "grouped_rotary_window": T.MultiHeadAttention(
            8,
            4,
            num_kv_heads=2,
            rope_theta=1e4,
            sliding_window=2,
            query_size=8,
            key_size=8,
            value_size=8,
        ),
    }
    X, Y = (torch.zeros(B, n, 8, device="meta", requires_grad=True) for n in (3, 6))
    for layer in layers.values():
        layer.to("meta")
        for each in masks:
            each = {k: v for k, v in each.items() if k != "attn_bias"} | (
                {"attn_bias": torch.zeros(B, 4, 3, 6, device="meta")} if "attn_bias" in each else {}
            )
            for need_weights in (True, False):
                output = layer(X, Y, Y, need_weights=need_weights, **each)
                output.sum().backward()  # autograd on the meta device reads nothing either
                assert output.device.type == "meta" and output.shape == (B, 3, 8)
    dot = T.DotProductAttention().to("meta")
    additive = T.AdditiveAttention(5, query_size=4, key_size=8).to("meta")
    additive(torch.zeros(B, 3, 4, device="meta"), Y, Y, lengths["1d"])
    dot(torch.zeros(B, 3, 8, device="meta"), Y, Y, lengths["2d_float"], causal=True)
    T.masked_softmax(torch.zeros(B, 3, 6, device="meta"), lengths["1d"])
    # On the CPU the same lengths are read and refused
    with pytest.raises(ValueError, match="non-negative"):
        T.masked_softmax(torch.zeros(B, 3, 6), torch.tensor([2, -1, 3, 0]))


@pytest.mark.parametrize(
    "call, is_causal",
    [
        ({"causal": True}, True),
        ({"causal": True, "num_kv_heads": 2}, True),
        ({"causal": True, "need_weights": True}, None),  # weights: no fused kernel
        ({"causal": True, "valid_lens": True}, False),  # another mask: the mask is passed
        ({"causal": True, "cached": True}, False),  # positions after a cache: bottom-right
        ({"causal": True, "dropout": True}, False),  # dropout changes the kernel's choice
    ],
    ids=["alone", "grouped", "with_weights", "with_lengths", "after_a_cache", "dropout"],
)
def test_causal_alone_is_the_kernels_is_causal(T, torch, monkeypatch, call, is_causal):
    """mha's causal mask alone, nothing cached, without weights, reaches
    F.scaled_dot_product_attention as is_causal (top-left aligned, as mha's is with nothing
    cached), which the flash kernels take; the output is the reference's either way."""
    call = dict(call)
    kv = call.pop("num_kv_heads", None)
    sizes = dict(query_size=16, key_size=16, value_size=16, num_kv_heads=kv)
    reference = N.MultiHeadAttention(16, 4, **sizes, dtype="float64")
    training = call.pop("dropout", False)
    layer = T.MultiHeadAttention(16, 4, dropout=0.5 if training else 0.0, **sizes, dtype="float64")
    mha.set_weights(layer, mha.get_weights(reference))
    X = np.random.default_rng(0).standard_normal((2, 5, 16))
    arguments = {"need_weights": call.pop("need_weights", False), **call}
    lengths = np.array([3, 5]) if arguments.pop("valid_lens", False) else None
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: seen.append(k["is_causal"]) or sdpa(*a, **k),
    )
    layer.train(training)
    if arguments.pop("cached", False):
        _, cache = layer(*(T.from_numpy(X[:, :2]),) * 3, **arguments, cache=T.KVCache())
        seen.clear()
        output, _ = layer(*(T.from_numpy(X[:, 2:]),) * 3, **arguments, cache=cache)
        expected = reference(X, X, X, causal=True)[:, 2:]
    else:
        valid_lens = None if lengths is None else T.from_numpy(lengths)
        output = layer(*(T.from_numpy(X),) * 3, valid_lens, **arguments)
        expected = reference(X, X, X, lengths, causal=True)
    assert seen == ([] if is_causal is None else [is_causal])
    if not training:  # dropout's output is random
        np.testing.assert_allclose(T.to_numpy(output), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("value_size", [8, 4], ids=["same_sizes", "value_size_of_its_own"])
def test_causal_alone_keeps_out_a_nan_key_that_no_query_reaches(T, torch, value_size):
    # Top-left causal, 5 queries and 7 keys: keys 5 and 6 are masked for every query. With a
    # value head size of its own SDPA's is_causal falls back to its math kernel, which adds
    # -inf to a NaN score: such a call must take another path and keep the NaN out
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 2, 5, 8)), rng.standard_normal((2, 2, 7, 8))
    v = rng.standard_normal((2, 2, 7, value_size))
    expected = N.dot_product_attention(q, k, v, causal=True)
    k[:, :, 5:] = np.nan
    output = T.dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Converting a tensor to a Python")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["heads", "grouped"])
def test_causal_alone_keeps_out_a_nan_key_where_sdpa_may_run_only_its_math(T, torch, kv_heads):
    # sdpa_kernel(MATH) (or torch.backends' switches) leaves SDPA its math kernel alone, whose
    # is_causal adds -inf to a NaN score: SDPA's own choice sends the call another path, and
    # where it cannot be asked (torch.func.vmap, torch.jit.trace) the switches do
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rng = np.random.default_rng(5)
    sizes = dict(query_size=16, key_size=16, value_size=16, num_kv_heads=kv_heads)
    reference = N.MultiHeadAttention(16, 4, **sizes, dtype="float64")
    mha.set_weights(reference, mha.random_weights(reference, seed=4))
    layer = T.MultiHeadAttention(16, 4, **sizes, dtype="float64")
    mha.set_weights(layer, mha.get_weights(reference))
    X, V = rng.standard_normal((2, 2, 5, 16))
    q, k, v = rng.standard_normal((3, 2, 4, 5, 8))
    expected = reference(X, X, V, causal=True), N.dot_product_attention(q, k, v, causal=True)
    X[:, 3], k[:, :, 3] = np.nan, np.nan  # key 3: a future key for queries 0 to 2
    tensors = [T.from_numpy(x) for x in (q, k, v)]

    def causal(*tensors):
        return T.dot_product_attention(*tensors, causal=True)

    with sdpa_kernel(SDPBackend.MATH):
        output = layer(*map(T.from_numpy, (X, X, V)), causal=True, need_weights=False)
        alones = [
            causal(*tensors),
            torch.func.vmap(causal)(*(x[:, None] for x in tensors))[:, 0],
            torch.jit.trace(causal, tuple(tensors), check_trace=False)(*tensors),
        ]
    np.testing.assert_allclose(T.to_numpy(output)[:, :3], expected[0][:, :3], rtol=0, atol=1e-12)
    for alone in alones:
        np.testing.assert_allclose(
            T.to_numpy(alone)[..., :3, :], expected[1][..., :3, :], rtol=0, atol=1e-12
        )


@pytest.mark.parametrize("option", [{"sinks": True}, {"softcap": 0.5}], ids=["sinks", "softcap"])
def test_grouped_causal_attention_with_sinks_or_a_soft_cap_without_weights(T, torch, option):
    # The causal mask alone, without weights, on 4 query heads sharing 2 key-value heads: the
    # kernel's is_causal takes neither sinks nor a soft cap, so the query heads are folded
    # onto their key-value heads for the path that replaces the scores
    sizes = dict(query_size=16, key_size=16, value_size=16, num_kv_heads=2, **option)
    reference = N.MultiHeadAttention(16, 4, **sizes, dtype="float64")
    weights = mha.random_weights(reference, seed=2)
    if "sinks" in option:
        weights["sinks"] = np.array([1.0, -2.0, 0.5, 3.0])
    mha.set_weights(reference, weights)
    layer = T.MultiHeadAttention(16, 4, **sizes, dtype="float64")
    mha.set_weights(layer, weights)
    X = np.random.default_rng(0).standard_normal((2, 5, 16))
    expected = reference(X, X, X, causal=True)
    output = layer(*(T.from_numpy(X),) * 3, causal=True, need_weights=False)
    np.testing.assert_allclose(T.to_numpy(output), expected, rtol=0, atol=1e-12)


def test_key_padding_takes_the_fused_kernel_whatever_a_padded_key_holds(T, torch, monkeypatch):
    # Lengths mask whole keys (for every query and head), which are zeroed before the kernel
    # adds the mask: a NaN at a padded key neither reaches an output nor keeps the call from
    # F.scaled_dot_product_attention (the keys need no read for whether they are finite)
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 2, n, 8)) for n in (5, 7, 7))
    lengths = np.array([4, 6])
    expected = N.dot_product_attention(q, k, v, valid_lens=lengths)
    k[0, :, 4:], k[1, :, 6] = np.nan, np.nan
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **kw: seen.append(1) or sdpa(*a, **kw),
    )
    arrays = [torch.from_numpy(x) for x in (q, k, v, lengths)]
    output = T.dot_product_attention(*arrays[:3], valid_lens=arrays[3])
    assert seen == [1]
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=1e-12)


def test_weights_over_many_scores_take_the_masked_product_and_over_few_do_not(
    T, torch, monkeypatch
):
    # With weights, adding the mask inside one batched product pays over many scores (2**16
    # here, all the heads' and examples'), not over few (2**10), which the scores path takes:
    # both give the reference's outputs and weights
    product, taken = T.fused.masked_product, []
    monkeypatch.setattr(T.fused, "masked_product", lambda *a: taken.append(1) or product(*a))
    rng = np.random.default_rng(6)
    for Q, K, many in ((64, 128, True), (8, 16, False)):
        q, k, v = (rng.standard_normal((2, 4, n, 8)) for n in (Q, K, K))
        lengths = np.array([K // 2, K])
        expected = N.dot_product_attention(q, k, v, valid_lens=lengths, return_weights=True)
        taken.clear()
        arrays = [torch.from_numpy(x) for x in (q, k, v, lengths)]
        got = T.dot_product_attention(*arrays[:3], valid_lens=arrays[3], return_weights=True)
        assert bool(taken) == many, (Q, K)
        for x, y in zip(got, expected, strict=True):
            np.testing.assert_allclose(x.numpy(), y, rtol=0, atol=1e-12)


def test_is_causal_is_taken_on_the_cpu_not_where_sdpa_has_no_causal_kernel(T, torch):
    # SDPA's is_causal on a device without a causal kernel of its own (here meta) is its math
    # fallback, which adds -inf to a NaN score: such calls pass the mask instead
    stay = torch.nn.Dropout(0.0)
    for device in ("cpu", "meta"):
        q = torch.zeros(2, 4, 5, 8, dtype=torch.float64, device=device)
        path = T.fused.choose_path(q, q, q, None, None, False, "zeros", stay, causal=True)
        assert (path == "is_causal") == (device == "cpu"), device


@pytest.mark.parametrize("masks", ["valid_lens", "mask"])
def test_a_row_with_no_key_takes_uniform_weights_without_weights_too(T, torch, masks):
    # empty_rows="uniform": a row with no kept key averages the values, which neither fused
    # kernel gives (they zero the row): without weights too, the call must not take them
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 2, 5, 8)) for _ in range(3))
    keep = np.ones((5, 5), bool)
    keep[1] = False
    call = {"valid_lens": np.array([0, 3])} if masks == "valid_lens" else {"mask": keep}
    expected = N.dot_product_attention(q, k, v, empty_rows="uniform", **call)
    arrays = [torch.from_numpy(x) for x in (q, k, v)]
    output = T.dot_product_attention(*arrays, empty_rows="uniform", **to_torch(T, call))
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=1e-12)


def test_a_shared_bias_over_many_scores_is_added_with_weights(T, torch):
    # One bias for every example and head, with weights, over many scores (2**16, where the
    # mask may be added inside one batched product): the bias is added too, with the
    # causal mask or alone
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 4, n, 8)) for n in (64, 128, 128))
    bias = rng.standard_normal((64, 128))
    for causal in (False, True):
        expected = N.dot_product_attention(q, k, v, bias=bias, causal=causal, return_weights=True)
        arrays = [torch.from_numpy(x) for x in (q, k, v, bias)]
        got = T.dot_product_attention(
            *arrays[:3], bias=arrays[3], causal=causal, return_weights=True
        )
        for x, y in zip(got, expected, strict=True):
            np.testing.assert_allclose(x.numpy(), y, rtol=0, atol=1e-12)


def test_an_inf_at_a_key_no_query_reaches_stays_out_under_a_mask_along_the_queries(T, torch):
    # Causal with lengths varies along the queries: a kernel would add the mask to the scores,
    # where +inf + -inf is NaN, so a key holding +inf (not only NaN) keeps the call off it
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((2, 2, n, 8)) for n in (5, 7, 7))
    q[..., 0] = np.abs(q[..., 0]) + 0.1  # each query's score with key 6 is +inf
    lengths = np.array([7, 6])
    expected = N.dot_product_attention(q, k, v, causal=True, valid_lens=lengths)
    k[:, :, 6, 0] = np.inf  # masked for every query: top-left causal, 5 queries
    arrays = [torch.from_numpy(x) for x in (q, k, v, lengths)]
    output = T.dot_product_attention(*arrays[:3], causal=True, valid_lens=arrays[3])
    np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=1e-12)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.*")
def test_torch_compile_matches_eager(T, torch):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = T.MultiHeadAttention(8, H, bias=True)
            self.add_norm = T.AddNorm(8)

        def forward(self, X, mask):
            Y = self.attention(X, X, X, mask=mask, causal=True)
            Z = self.attention(X, X, X, mask=mask, need_weights=False)
            return self.add_norm(X, Y + Z)

    torch.manual_seed(0)
    block = Block().eval()
    X = torch.randn(2, 5, 8)
    mask = torch.rand(2, 5, 5) < 0.7
    mask[0, 1] = False
    expected = block(X, mask)
    compiled = torch.compile(block)
    with torch.no_grad():
        output = compiled(X, mask)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.*")
@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_compiled_scaling_of_a_free_length_keeps_float64(T, torch, kind):
    # A length torch.compile leaves free passes for an int: numpy traced with it kept
    # float32's precision (1e-9 off in float64). Expected: the NumPy reference
    scaling = {"rope_type": kind, "factor": 2.0, "original_max_position_embeddings": 4}
    if kind == "longrope":
        scaling.update(short_factor=[1.0, 1.5], long_factor=[2.0, 3.0])
    options = dict(query_size=8, key_size=8, value_size=8, dtype="float64", rope_theta=100.0)
    reference = N.MultiHeadAttention(8, H, rope_scaling=scaling, **options)
    layer = T.MultiHeadAttention(8, H, rope_scaling=scaling, **options).eval()
    mha.set_weights(layer, mha.get_weights(reference))
    compiled = torch.compile(layer, backend="aot_eager", dynamic=True)
    for n in (3, 6, 8):
        x = np.random.default_rng(n).standard_normal((2, n, 8))
        expected = reference(x, x, x, causal=True)[0]
        with torch.no_grad():
            output = compiled(*(torch.from_numpy(x),) * 3, causal=True)[0]
        np.testing.assert_allclose(output.numpy(), expected, rtol=0, atol=1e-13)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.*")
def test_self_attention_compiles_into_one_graph(T, torch):
    # Without gradients, self-attention traces whole (fullgraph=True: a graph break is an
    # error). (valid_lens would break it: their value check reads them.) Expected: the eager
    # call.
    layer = T.MultiHeadAttention(8, H, bias=True, query_size=8, key_size=8, value_size=8)
    layer.eval()
    X = torch.randn(2, 5, 8)
    for causal in (True, False):
        torch._dynamo.reset()
        with torch.no_grad():
            expected = layer(X, X, X, causal=causal, need_weights=False)
            compiled = torch.compile(layer, fullgraph=True)
            output = compiled(X, X, X, causal=causal, need_weights=False)
        torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.*")
@pytest.mark.filterwarnings("ignore::UserWarning:torch.*")
@pytest.mark.parametrize(
    "lengths, message",
    [([-1, 2], "must be non-negative"), ([1.5, 2.0], "must hold whole numbers")],
)
def test_a_compiled_call_refuses_the_lengths_an_eager_one_refuses(T, torch, lengths, message):
    # Expected: the eager call's ValueError, from the same value check (docs/backends.md)
    layer = T.MultiHeadAttention(8, H)
    X = torch.randn(2, 3, 8)
    valid_lens = torch.tensor(lengths)
    with pytest.raises(ValueError, match=message):
        layer(X, X, X, valid_lens)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=message):
        torch.compile(layer, backend="eager")(X, X, X, valid_lens)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.*")
def test_unmasked_weights_compile_without_an_out_argument(T, torch):
    # Without gradients the eager softmax writes over the scores (out=); a graph must not:
    # Inductor failed on it (KeyError) where the keys were a multiple of 8. Expected: the
    # reference's weights and output
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, n, 8)).astype("float32") for n in (5, 16, 16))
    reference = N.DotProductAttention()
    expected = reference(q, k, v)
    layer = T.DotProductAttention().eval()
    torch._dynamo.reset()
    with torch.no_grad():
        output = torch.compile(layer, fullgraph=True)(*map(torch.from_numpy, (q, k, v)))
    np.testing.assert_allclose(output.numpy(), expected, rtol=1e-5, atol=1e-6)
    weights = layer.attention_weights.numpy()
    np.testing.assert_allclose(weights, reference.attention_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.*")
@pytest.mark.parametrize(
    "masks", [("self", "valid_lens_1d", "causal"), ("mask_3d", "no_weights")], ids="+".join
)
def test_compiled_grouped_rotary_sliding_attention_matches_the_reference(T, torch, masks):
    # Llama's and Mistral's attention (4 query heads sharing 2 key-value heads, rotary
    # embeddings, a sliding window), compiled, with and without weights: the reference's
    # numbers and gradients, as eager gives (compiled, a mask that varies along the queries
    # replaces the masked scores even without weights: the keys' values are not read)
    config = {"num_heads": 4, "num_kv_heads": 2, "rope_theta": 10000.0, "sliding_window": 3}
    prepared = harness.prepare(harness.Case("MultiHeadAttention", masks, config))
    eager_row, eager = harness.check("torch", prepared)
    torch._dynamo.reset()
    row, compiled = harness.check("torch", prepared, transform=torch.compile)
    assert eager_row.passed and row.passed, (eager_row, row)
    torch.testing.assert_close(compiled.output, eager.output, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.*")
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
def test_compiled_cached_decoding_equals_full_causal_attention(T, torch, need_weights):
    # A prompt of 3 positions, then one position per call, through torch.compile (a graph per
    # cache length, or one with the length symbolic): the reference's full causal attention,
    # the causal mask shifted by the cached positions
    config = dict(
        num_hiddens=8,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        sliding_window=3,
        bias=True,
        query_size=6,
        key_size=6,
        value_size=6,
        dtype="float64",
    )
    weights = mha.random_weights("MultiHeadAttention", seed=5, **config)
    layer = T.MultiHeadAttention(**config)
    mha.set_weights(layer, weights)
    full = N.MultiHeadAttention(**config)
    mha.set_weights(full, weights)
    X = np.random.default_rng(4).standard_normal((2, 7, 6))
    valid_lens = np.array([7, 6])
    torch._dynamo.reset()
    decode = torch.compile(layer)
    for lengths in (valid_lens, None):
        expected = full(X, X, X, lengths, causal=True)
        cache, outputs = mha.KVCache(), []
        for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):
            x = T.from_numpy(X[:, start:stop])
            known = None if lengths is None else T.from_numpy(np.minimum(lengths, stop))
            output, cache = decode(
                x, x, x, known, causal=True, need_weights=need_weights, cache=cache
            )
            outputs.append(T.to_numpy(output))
            # The cache holds the 2 key-value heads, not the 4 repeated for the queries
            assert type(cache) is mha.KVCache
            assert tuple(cache.keys.shape) == tuple(cache.values.shape) == (2, 2, stop, 2)
        assert_agrees(np.concatenate(outputs, axis=1), expected, "float64")


# ---------------------------------------------------------------------------------------------
# Canonical weights, state_dict, dtype conversion


def test_weights_before_the_first_call(T, torch):
    sized = build(T, "multihead", "float32")
    weights = mha.get_weights(sized)
    assert weights["W_q"].shape == (5, 8) and weights["W_v"].shape == (7, 8)
    np.testing.assert_array_equal(weights["W_q"], T.to_numpy(sized.W_q.weight).T)

    lazy = T.MultiHeadAttention(8, H, bias=True)
    with pytest.raises(ValueError, match="not created yet"):
        mha.get_weights(lazy)
    assert T.layer_config(lazy)["query_size"] is None
    mha.set_weights(lazy, weights)
    assert T.layer_config(lazy)["query_size"] == 5
    assert all(np.array_equal(v, weights[k]) for k, v in mha.get_weights(lazy).items())
    queries, keys, values = inputs(3, 6, "float32")
    assert_agrees(
        T.to_numpy(lazy(*map(T.from_numpy, (queries, keys, values)))),
        T.to_numpy(sized(*map(T.from_numpy, (queries, keys, values)))),
        "float32",
    )

    additive = T.AdditiveAttention(8)
    reference, _ = pair(T, "additive", "float32")
    mha.set_weights(additive, mha.get_weights(reference))
    queries, keys, values = inputs(3, 6, "float32", "additive")
    assert_agrees(
        T.to_numpy(additive(*map(T.from_numpy, (queries, keys, values)))),
        reference(queries, keys, values),
        "float32",
    )


def test_save_in_torch_load_in_numpy(T, tmp_path):
    _, layer = pair(T, "multihead", "float64", seed=5)
    mha.save_weights(layer, tmp_path / "weights.safetensors")
    reference = build(N, "multihead", "float64")
    mha.load_weights(reference, tmp_path / "weights.safetensors")
    queries, keys, values = inputs(3, 6, "float64")
    output = layer(*map(T.from_numpy, (queries, keys, values)), causal=True)
    assert_agrees(T.to_numpy(output), reference(queries, keys, values, causal=True), "float64")


@pytest.mark.parametrize("kind", ["dot", "additive", "multihead"])
def test_a_layer_copies_after_a_call_that_records_gradients(T, torch, kind):
    # An EMA or best-model copy taken after a training step: the attention weights kept
    # from that call belong to its graph, which copy.deepcopy refuses for a tensor
    _, layer = pair(T, kind, "float32", seed=4)
    queries, keys, values = (T.from_numpy(x) for x in inputs(3, 6, "float32", kind))
    queries.requires_grad_(True)
    expected = T.to_numpy(layer(queries, keys, values, causal=True))
    assert layer.attention_weights.grad_fn is not None
    copy = __import__("copy").deepcopy(layer)
    np.testing.assert_array_equal(
        T.to_numpy(copy.attention_weights), T.to_numpy(layer.attention_weights)
    )
    np.testing.assert_array_equal(T.to_numpy(copy(queries, keys, values, causal=True)), expected)


def test_state_dict_round_trip(T):
    _, layer = pair(T, "multihead", "float32", seed=3)
    state = layer.state_dict()
    assert {"W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight", "W_o.bias"} <= set(state)
    queries, keys, values = (T.from_numpy(x) for x in inputs(3, 6, "float32"))
    expected = layer(queries, keys, values, causal=True)
    for fresh in (build(T, "multihead", "float32"), T.MultiHeadAttention(8, H, bias=True)):
        fresh.load_state_dict(state)
        actual = T.to_numpy(fresh(queries, keys, values, causal=True))
        assert_agrees(actual, T.to_numpy(expected), "float64")
    _, add_norm = pair(T, "addnorm", "float32", seed=3)
    fresh = T.AddNorm(7)
    fresh.load_state_dict(add_norm.state_dict())
    np.testing.assert_array_equal(
        mha.get_weights(fresh)["gamma"], mha.get_weights(add_norm)["gamma"]
    )


def test_to_float64(T, torch):
    _, layer = pair(T, "multihead", "float32")
    layer = layer.to(torch.float64)
    assert layer.dtype == "float64" and T.layer_config(layer)["dtype"] == "float64"
    weights = mha.get_weights(layer)
    assert weights["W_q"].dtype == np.float64
    wide = build(N, "multihead", "float64")
    mha.set_weights(wide, weights)
    queries, keys, values = inputs(3, 6, "float64")
    expected = wide(queries, keys, values, causal=True)
    output = layer(*map(T.from_numpy, (queries, keys, values)), causal=True)
    assert_agrees(T.to_numpy(output), expected, "float64")
    with pytest.raises(TypeError, match="must have the layer's dtype float64"):
        layer(*(T.from_numpy(x.astype("float32")) for x in (queries, keys, values)))
    lazy = T.AdditiveAttention(8).double()
    assert lazy.dtype == "float64"
    lazy(*map(T.from_numpy, inputs(3, 6, "float64", "additive")))
    assert lazy.W_q.weight.dtype == torch.float64
    encoding = T.PositionalEncoding(7, max_len=20).to(torch.float64)
    np.testing.assert_array_equal(T.to_numpy(encoding.P), sinusoid_table(20, 7))


def test_conversion(T, torch):
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    tensor = T.from_numpy(array)
    assert tensor.dtype == torch.int32 and np.array_equal(T.to_numpy(tensor), array)
    grad = torch.ones(2, requires_grad=True) * 2
    np.testing.assert_array_equal(T.to_numpy(grad), [2.0, 2.0])


def test_layers_are_modules(T, torch):
    layer = T.MultiHeadAttention(8, H)
    assert isinstance(layer, torch.nn.Module)
    assert isinstance(layer.attention, T.DotProductAttention)
    assert isinstance(layer.W_q, torch.nn.LazyLinear)
    assert isinstance(build(T, "multihead", "float32").W_q, torch.nn.Linear)
    assert mha.registry.backend_of(layer) == "torch"
    with mha.use_backend("torch"):
        assert mha.MultiHeadAttention is T.MultiHeadAttention


def test_self_attention_weights_follow_every_change(T, torch):
    # Each way of changing a weight must reach the next call without gradients: the layer
    # keeps nothing computed from its weights. Expected: the NumPy reference with the layer's
    # weights of the moment.
    layer = T.MultiHeadAttention(8, H, bias=True, query_size=8, key_size=8, value_size=8)
    reference = N.MultiHeadAttention(8, H, bias=True, dtype="float64")
    X = np.random.default_rng(7).standard_normal((3, 5, 8))

    def check(dtype="float32"):
        mha.set_weights(
            reference, {k: v.astype("float64") for k, v in mha.get_weights(layer).items()}
        )
        with torch.no_grad():
            actual = layer(*(T.from_numpy(X.astype(dtype)),) * 3)
        assert_agrees(T.to_numpy(actual), reference(X, X, X), dtype)

    check()
    mha.set_weights(layer, mha.random_weights(layer, seed=1))  # copy_ in place
    check()
    with torch.no_grad():
        layer.W_k.weight.mul_(-2.0)  # an in-place update, as an optimizer step
        layer.W_v.bias.add_(1.0)
    check()
    layer.load_state_dict(
        T.MultiHeadAttention(8, H, bias=True, query_size=8, key_size=8, value_size=8).state_dict()
    )
    check()
    # Through .data, and by an optimizer's step
    layer.W_k.weight.data.mul_(0.5)
    layer.W_q.bias.data.copy_(torch.arange(8.0))
    check()
    layer(*(T.from_numpy(X.astype("float32")),) * 3).square().sum().backward()
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    check()
    # Transposed through .data: the same storage, other strides
    layer.W_q.weight.data = layer.W_q.weight.data.t()
    check()
    # Tied through .data: W_k now shares W_q's storage, and follows it
    layer.W_k.weight.data = layer.W_q.weight.data
    check()
    layer.W_q.weight.data.add_(1.0)
    check()
    copy = __import__("copy").deepcopy(layer)
    copy.W_v.weight.data.mul_(3.0)
    layer = copy
    check()
    other = T.MultiHeadAttention(8, H, bias=True, query_size=8, key_size=8, value_size=8)
    layer.load_state_dict(other.state_dict(), assign=True)  # the other layer's tensors
    with torch.no_grad():
        other.W_k.weight.mul_(-1.0)  # shared with layer now
    check()
    layer.W_q.weight = torch.nn.Parameter(torch.ones(8, 8))  # a new tensor
    check()
    # In place through .data, as hand-written training loops and weight-porting code do: no
    # version counter records it
    layer.W_q.weight.data.mul_(0.5)
    layer.W_v.weight.data.copy_(torch.from_numpy(np.eye(8, dtype="float32")))
    check()
    layer.W_k.weight.data = torch.full((8, 8), 0.25)  # new storage through .data
    check()
    # A round trip through another dtype, changed on the way
    layer.double()
    with torch.no_grad():
        layer.W_q.weight.add_(1.0)
    layer.float()
    check()
    layer.double()  # new storage, new dtype
    check("float64")
    # With gradients W_q gets its gradient
    X64 = T.from_numpy(X)
    layer(X64, X64, X64).sum().backward()
    assert layer.W_q.weight.grad is not None and layer.W_q.weight.grad.abs().sum() > 0


def test_weights_save_and_load_as_state_dicts(T, torch, tmp_path):
    # torch.save and safetensors write and read each parameter. Expected: the same outputs
    # from a fresh layer that loaded them.
    import safetensors.torch as safetensors_torch  # a test requirement (pyproject.toml)

    layer = T.MultiHeadAttention(8, H, bias=True, query_size=8, key_size=8, value_size=8)
    X = T.from_numpy(np.random.default_rng(4).standard_normal((2, 5, 8)).astype("float32"))
    with torch.no_grad():
        expected = layer(X, X, X)
    torch.save(layer.state_dict(), tmp_path / "weights.pt")
    safetensors_torch.save_file(layer.state_dict(), tmp_path / "weights.safetensors")
    for state in (
        torch.load(tmp_path / "weights.pt"),
        safetensors_torch.load_file(tmp_path / "weights.safetensors"),
    ):
        fresh = T.MultiHeadAttention(8, H, bias=True, query_size=8, key_size=8, value_size=8)
        fresh.load_state_dict(state)
        with torch.no_grad():
            assert torch.equal(fresh(X, X, X), expected)


def test_a_masked_decoding_step_replaces_its_scores(T, torch, monkeypatch):
    """One query under a mask (a decoding step with lengths) takes the path that replaces its
    masked scores, which costs less than a pass over the cached keys (benchmarks/README.md),
    without weights too; its output is the reference's."""
    reference = N.MultiHeadAttention(
        16, 4, query_size=16, key_size=16, value_size=16, dtype="float64"
    )
    layer = T.MultiHeadAttention(16, 4, dtype="float64")
    mha.set_weights(layer, mha.get_weights(reference))
    X = np.random.default_rng(0).standard_normal((2, 7, 16))
    lengths = np.array([4, 7])
    fused = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: fused.append(1) or sdpa(*a, **k),
    )
    _, cache = layer(*(T.from_numpy(X[:, :6]),) * 3, cache=mha.KVCache())
    fused.clear()
    output, _ = layer(
        *(T.from_numpy(X[:, 6:]),) * 3, T.from_numpy(lengths), need_weights=False, cache=cache
    )
    assert fused == []
    expected = reference(X, X, X, lengths, causal=True)[:, 6:]
    np.testing.assert_allclose(T.to_numpy(output), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("fill", [-1e4, float(np.finfo(np.float16).min)])
def test_a_half_precision_bias_is_added_in_its_dtype_with_weights_or_without(T, torch, fill):
    # The fused kernel adds the bias in float32; the reference adds it in float16, where -1e4
    # rounds every score of the row to one number: a row masked by a large finite number
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 2, n, 8)).astype("float16") for n in (5, 7, 7))
    bias = np.zeros((2, 2, 5, 7), "float16")
    bias[:, :, 1] = fill
    expected = N.dot_product_attention(q, k, v, bias=bias)
    arrays = [torch.from_numpy(x) for x in (q, k, v)]
    for weights in (False, True):
        output = T.dot_product_attention(
            *arrays, bias=torch.from_numpy(bias), return_weights=weights
        )
        output = output[0] if weights else output
        np.testing.assert_allclose(output.numpy().astype("float32"), expected, atol=2e-3)
