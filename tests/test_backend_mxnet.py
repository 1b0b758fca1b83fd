"""The MXNet Gluon backend against the NumPy reference.

Every layer and mask kind under shared weights (float32 and float64), hybridized against
imperative, gradients against finite differences of the reference, weights and parameter
files, Gluon habits (train_mode, contexts, numpy semantics kept inside), and the error table.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import mha
from conftest import backend_module
from mha.backends import numpy as NP

pytestmark = pytest.mark.mxnet

B, Q, K, D, V = 4, 3, 5, 6, 7
NUM_HIDDENS, NUM_HEADS = 8, 2


@pytest.fixture(scope="module")
def MX():
    return backend_module("mxnet")


@pytest.fixture(scope="module")
def mx(MX):
    import mxnet

    return mxnet


# ---------------------------------------------------------------------------------------------
# Helpers


def inputs(dtype, num_queries=Q, num_keys=K, query_size=D, key_size=D, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, num_queries, query_size)).astype(dtype),
        rng.standard_normal((B, num_keys, key_size)).astype(dtype),
        rng.standard_normal((B, num_keys, V)).astype(dtype),
    )


def config(name, dtype, **overrides):
    sizes = {
        "DotProductAttention": {},
        "AdditiveAttention": {"num_hiddens": NUM_HIDDENS, "query_size": D, "key_size": D},
        "MultiHeadAttention": {
            "num_hiddens": NUM_HIDDENS,
            "num_heads": NUM_HEADS,
            "bias": True,
            "query_size": D,
            "key_size": D,
            "value_size": V,
        },
        "PositionalEncoding": {"num_hiddens": D, "max_len": 10},
        "AddNorm": {"num_hiddens": D},
    }[name]
    return {**sizes, "dtype": dtype, **overrides}


def pair(MX, name, dtype, lazy=False, **overrides):
    """An MXNet layer and a NumPy reference layer with the same random weights."""
    arguments = config(name, dtype, **overrides)
    reference = getattr(NP, name)(**arguments)
    built = dict(arguments)
    if lazy:
        for size in ("query_size", "key_size", "value_size"):
            built.pop(size, None)
    layer = getattr(MX, name)(**built)
    weights = mha.random_weights(name, seed=1, **arguments)
    mha.set_weights(layer, weights)
    mha.set_weights(reference, weights)
    return layer, reference


def to_mx(MX, kwargs):
    return {k: MX.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


def assert_close(actual, expected, dtype):
    assert actual.shape == expected.shape
    if dtype == "float64":
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-10)
    else:
        scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * scale)


def run_attention(MX, layer, reference, args, kwargs, dtype):
    output = layer(*[MX.from_numpy(a) for a in args], **to_mx(MX, kwargs))
    expected = reference(*args, **kwargs)
    assert_close(MX.to_numpy(output), expected, dtype)
    if reference.attention_weights is None:
        assert layer.attention_weights is None
    else:
        assert_close(MX.to_numpy(layer.attention_weights), reference.attention_weights, dtype)
    return MX.to_numpy(output)


rng = np.random.default_rng(42)
MASK_CASES = {
    "none": {},
    "valid_lens_1d_zero_and_long": {"valid_lens": np.array([0, 2, 9, 5])},
    "valid_lens_1d_float": {"valid_lens": np.array([1.0, 3.0, 0.0, 7.0], dtype="float32")},
    "valid_lens_2d": {"valid_lens": rng.integers(0, K + 2, size=(B, Q)).astype("int32")},
    "mask_2d": {"mask": rng.random((Q, K)) > 0.4},
    "mask_3d": {"mask": rng.random((B, Q, K)) > 0.4},
    "mask_3d_broadcast": {"mask": rng.random((B, 1, K)) > 0.3},
    "mask_1d": {"mask": np.array([True, False, True, True, False])},
    "causal": {"causal": True},
    "window_bool": {"window_mask": rng.random((2, Q, K)) > 0.3},
    "window_additive": {
        "window_mask": np.where(
            rng.random((2, Q, K)) > 0.3, rng.standard_normal((2, Q, K)), -np.inf
        )
    },
    "window_one": {"window_mask": np.zeros((1, Q, K))},
    "combined": {
        "valid_lens": np.array([3, 0, 5, 2]),
        "mask": rng.random((B, Q, K)) > 0.2,
        "causal": True,
        "window_mask": np.where(rng.random((4, Q, K)) > 0.2, 0.3, -np.inf),
    },
    "fully_masked_rows": {"mask": np.array([[True] * K, [False] * K, [True] * K])},
}
MULTIHEAD_CASES = {
    "mask_4d": {"mask": rng.random((B, NUM_HEADS, Q, K)) > 0.4},
    "mask_4d_heads_only": {"mask": rng.random((1, NUM_HEADS, 1, K)) > 0.3},
    "head_mask_1d": {"head_mask": np.array([1.0, 0.0])},
    "head_mask_2d_bool": {"head_mask": rng.random((B, NUM_HEADS)) > 0.5},
    "need_weights_false": {"valid_lens": np.array([0, 2, 9, 5]), "need_weights": False},
    "all_with_4d_mask": {
        "valid_lens": rng.integers(0, K, size=(B, Q)),
        "mask": rng.random((B, 1, Q, K)) > 0.2,
        "causal": True,
        "window_mask": rng.random((2, Q, K)) > 0.2,
        "head_mask": rng.random((B, NUM_HEADS)),
    },
}


def cast_case(kwargs, dtype):
    """Float masks of a case in the layer's dtype (valid_lens keeps its own)."""
    out = {}
    for key, value in kwargs.items():
        if key in ("window_mask", "head_mask") and value.dtype.kind == "f":
            value = value.astype(dtype)
        out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(MASK_CASES))
@pytest.mark.parametrize("name", ["DotProductAttention", "AdditiveAttention", "MultiHeadAttention"])
def test_attention_matches_numpy(MX, name, case, dtype):
    layer, reference = pair(MX, name, dtype)
    kwargs = cast_case(MASK_CASES[case], dtype)
    output = run_attention(MX, layer, reference, inputs(dtype), kwargs, dtype)
    if case == "fully_masked_rows":
        weights = MX.to_numpy(layer.attention_weights)
        assert np.all(weights[..., 1, :] == 0)
        if name == "MultiHeadAttention":
            b_o = mha.get_weights(layer)["b_o"]
            np.testing.assert_allclose(output[:, 1, :], np.broadcast_to(b_o, (B, NUM_HIDDENS)))
        else:
            assert np.all(output[:, 1, :] == 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(MULTIHEAD_CASES))
def test_multihead_options_match_numpy(MX, case, dtype):
    layer, reference = pair(MX, "MultiHeadAttention", dtype)
    kwargs = cast_case(MULTIHEAD_CASES[case], dtype)
    run_attention(MX, layer, reference, inputs(dtype), kwargs, dtype)


@pytest.mark.parametrize("name", ["DotProductAttention", "AdditiveAttention", "MultiHeadAttention"])
def test_causal_with_more_queries_than_keys_is_top_left_aligned(MX, name):
    layer, reference = pair(MX, name, "float64")
    args = inputs("float64", num_queries=7, num_keys=4)
    run_attention(
        MX, layer, reference, args, {"causal": True, "valid_lens": np.arange(4)}, "float64"
    )
    weights = MX.to_numpy(layer.attention_weights)
    # Query i sees keys 0..i: the upper triangle is exactly zero
    assert np.all(weights[..., np.triu_indices(7, 1, 4)[0], np.triu_indices(7, 1, 4)[1]] == 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_additive_attention_with_different_query_and_key_sizes(MX, dtype):
    layer, reference = pair(MX, "AdditiveAttention", dtype, query_size=3, key_size=4)
    args = inputs(dtype, query_size=3, key_size=4)
    run_attention(MX, layer, reference, args, {"valid_lens": np.array([1, 2, 3, 4])}, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_positional_encoding_and_add_norm_match_numpy(MX, dtype):
    X = np.random.default_rng(3).standard_normal((B, 6, D)).astype(dtype)
    Y = np.random.default_rng(4).standard_normal((B, 6, D)).astype(dtype)
    encoding, reference = pair(MX, "PositionalEncoding", dtype)
    assert_close(MX.to_numpy(encoding(MX.from_numpy(X))), reference(X), dtype)
    add_norm, reference = pair(MX, "AddNorm", dtype, eps=1e-3)
    output = add_norm(MX.from_numpy(X), MX.from_numpy(Y))
    assert_close(MX.to_numpy(output), reference(X, Y), dtype)


def test_positional_encoding_table_is_a_cast_constant(MX, mx):
    encoding = MX.PositionalEncoding(5, max_len=12, dtype="float64")
    angle = 3 / 10000 ** (2 / 5)
    P = MX.to_numpy(encoding.P)
    assert P.shape == (1, 12, 5)
    np.testing.assert_allclose(P[0, 3, 2], np.sin(angle), atol=1e-15)
    np.testing.assert_allclose(P[0, 3, 3], np.cos(angle), atol=1e-15)
    assert not isinstance(encoding.P, mx.gluon.Parameter)
    assert len(encoding.collect_params().keys()) == 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_masked_softmax_matches_numpy(MX, dtype):
    rng = np.random.default_rng(5)
    cases = [
        (rng.standard_normal((3, 4)), None),
        (rng.standard_normal((3, 4)), np.array([0, 2, 6])),
        (rng.standard_normal((2, 3, 4)), np.array([1.0, 3.0])),
        (rng.standard_normal((2, 3, 4)), np.array([[0, 1, 4], [2, 9, 3]])),
        (rng.standard_normal((2, 2, 3, 4)), np.array([[0, 1, 4], [2, 9, 3]])),
        (1e4 * rng.standard_normal((2, 3, 4)), np.array([2, 3])),
    ]
    for X, valid_lens in cases:
        X = X.astype(dtype)
        expected = NP.masked_softmax(X, valid_lens)
        actual = MX.to_numpy(
            MX.masked_softmax(
                MX.from_numpy(X), None if valid_lens is None else MX.from_numpy(valid_lens)
            )
        )
        assert np.all(np.isfinite(actual))
        assert_close(actual, expected, dtype)
        assert np.all(actual[expected == 0] == 0)


def test_float16_runs_and_stays_close(MX):
    # AddNorm and PositionalEncoding only: MXNet 1.9.1 has float16 matmul and FullyConnected
    # on GPU only, so the attention layers in float16 need a GPU context
    X = np.random.default_rng(6).standard_normal((B, Q, D))
    add_norm = MX.AddNorm(D, dtype="float16")
    output = add_norm(MX.from_numpy(X.astype("float16")), MX.from_numpy(X.astype("float16")))
    assert output.dtype == np.float16
    expected = NP.AddNorm(D, dtype="float64")(X, X)
    np.testing.assert_allclose(MX.to_numpy(output), expected, atol=2e-2)
    encoding = MX.PositionalEncoding(D, dtype="float16")
    output = encoding(MX.from_numpy(X.astype("float16")))
    expected = NP.PositionalEncoding(D, dtype="float64")(X)
    np.testing.assert_allclose(MX.to_numpy(output), expected, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# Hybridization


HYBRID_CALLS = {
    "DotProductAttention": [{}, MASK_CASES["combined"], {"valid_lens": np.array([1, 2, 3, 4])}],
    "AdditiveAttention": [MASK_CASES["window_additive"], {}, MASK_CASES["valid_lens_2d"]],
    "MultiHeadAttention": [
        MULTIHEAD_CASES["all_with_4d_mask"],
        {},
        MULTIHEAD_CASES["need_weights_false"],
        MASK_CASES["mask_2d"],
        {"causal": True},
    ],
}


@pytest.mark.parametrize("name", list(HYBRID_CALLS))
def test_hybridized_attention_matches_imperative_and_numpy(MX, name):
    imperative, reference = pair(MX, name, "float64")
    hybrid, _ = pair(MX, name, "float64")
    hybrid.hybridize()
    for shapes in ({}, {"num_queries": 4, "num_keys": 6}):
        for kwargs in HYBRID_CALLS[name]:
            if shapes:  # other sizes: masks without fixed sizes only
                kwargs = {"valid_lens": np.array([0, 1, 6, 3]), "causal": True}
            args = inputs("float64", **shapes)
            kwargs = cast_case(kwargs, "float64")
            mx_args = [MX.from_numpy(a) for a in args]
            expected = MX.to_numpy(imperative(*mx_args, **to_mx(MX, kwargs)))
            actual = MX.to_numpy(hybrid(*mx_args, **to_mx(MX, kwargs)))
            np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-12)
            assert_close(actual, reference(*args, **kwargs), "float64")
            if imperative.attention_weights is None:
                assert hybrid.attention_weights is None
            else:
                np.testing.assert_allclose(
                    MX.to_numpy(hybrid.attention_weights),
                    MX.to_numpy(imperative.attention_weights),
                    atol=1e-12,
                )
    assert hybrid._cached_op is not None  # the graph really ran


def test_hybridized_layer_traces_each_structure_of_call_once(MX, mx):
    # Calls that alternate (with and without valid_lens, evaluation and training) reuse the
    # graph traced for their structure; hybridize() again traces anew
    imperative, reference = pair(MX, "MultiHeadAttention", "float64")
    hybrid, _ = pair(MX, "MultiHeadAttention", "float64")
    hybrid.hybridize()
    traces = []
    trace = hybrid.hybrid_forward
    hybrid.hybrid_forward = lambda F, *args: traces.append(F) or trace(F, *args)
    args = inputs("float64")
    mx_args = [MX.from_numpy(a) for a in args]
    cases = [{}, {"valid_lens": np.array([0, 1, 6, 3])}]

    def call(layer, kwargs, recording):
        with mx.autograd.record() if recording else contextlib.nullcontext():
            output = layer(*mx_args, **to_mx(MX, kwargs))
        return MX.to_numpy(output)

    for _ in range(3):
        for kwargs in cases:
            for recording in (False, True):
                actual = call(hybrid, kwargs, recording)
                np.testing.assert_allclose(
                    actual, call(imperative, kwargs, recording), rtol=0, atol=1e-12
                )
                assert_close(actual, reference(*args, **kwargs), "float64")
    assert len(traces) == len(cases) * 2
    hybrid.hybridize()
    call(hybrid, cases[0], False)
    assert len(traces) == len(cases) * 2 + 1


def test_hybridized_encoding_and_add_norm_match_imperative(MX):
    for name in ("PositionalEncoding", "AddNorm"):
        imperative, reference = pair(MX, name, "float32")
        hybrid, _ = pair(MX, name, "float32")
        hybrid.hybridize()
        for steps in (3, 7):
            X = np.random.default_rng(steps).standard_normal((2, steps, D)).astype("float32")
            args = (X,) if name == "PositionalEncoding" else (X, X[::-1].copy())
            mx_args = [MX.from_numpy(a) for a in args]
            actual = MX.to_numpy(hybrid(*mx_args))
            np.testing.assert_allclose(actual, MX.to_numpy(imperative(*mx_args)), atol=1e-6)
            assert_close(actual, reference(*args), "float32")
        assert hybrid._cached_op is not None


def test_hybridized_lazy_layer_infers_sizes(MX):
    layer, reference = pair(MX, "MultiHeadAttention", "float64")
    lazy = MX.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, bias=True, dtype="float64")
    lazy.hybridize()
    args = inputs("float64")
    lazy(*[MX.from_numpy(a) for a in args])
    assert mha.get_weights(lazy)["W_v"].shape == (V, NUM_HIDDENS)
    mha.set_weights(lazy, mha.get_weights(layer))
    output = lazy(*[MX.from_numpy(a) for a in args], valid_lens=MX.from_numpy(np.array([1] * B)))
    assert_close(MX.to_numpy(output), reference(*args, valid_lens=np.array([1] * B)), "float64")


def test_traced_inside_a_parent_graph_is_a_clear_error(MX, mx):
    @mx.util.use_np
    class Parent(mx.gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            self.attention = MX.DotProductAttention()

        def hybrid_forward(self, F, x):
            return self.attention(x, x, x)

    parent = Parent()
    parent.hybridize()
    with pytest.raises(TypeError, match="cannot be traced inside another block"):
        parent(MX.from_numpy(np.ones((1, 2, 3), "float32")))


# ---------------------------------------------------------------------------------------------
# Gradients


def finite_differences(f, array, eps=1e-6):
    grad = np.zeros_like(array)
    for index in np.ndindex(array.shape):
        saved = array[index]
        array[index] = saved + eps
        plus = f()
        array[index] = saved - eps
        minus = f()
        array[index] = saved
        grad[index] = (plus - minus) / (2 * eps)
    return grad


GRADIENT_CASES = {
    "DotProductAttention": {"valid_lens": np.array([0, 2, 9]), "causal": True},
    "AdditiveAttention": {
        "mask": np.array([[True] * 4, [False] * 4, [True, False] * 2]),
        "window_mask": np.where(np.eye(3, 4) > 0, -np.inf, 0.5)[None],
    },
    "MultiHeadAttention": {
        "valid_lens": np.array([[0, 1, 3], [4, 0, 2], [1, 1, 1]]),
        "head_mask": np.array([0.5, 2.0]),
    },
}


@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_gradients_match_finite_differences(MX, mx, name):
    layer, reference = pair(MX, name, "float64")
    rng = np.random.default_rng(7)
    args = [
        rng.standard_normal((3, 3, D)),
        rng.standard_normal((3, 4, D)),
        rng.standard_normal((3, 4, V)),
    ]
    kwargs = GRADIENT_CASES[name]
    R = rng.standard_normal(reference(*args, **kwargs).shape)
    mx_args = [MX.from_numpy(a) for a in args]
    for a in mx_args:
        a.attach_grad()
    layer.hybridize()
    with mx.autograd.record():
        loss = (layer(*mx_args, **to_mx(MX, kwargs)) * MX.from_numpy(R)).sum()
    loss.backward()

    def objective():
        return float((reference(*args, **kwargs) * R).sum())

    for array, mx_array in zip(args, mx_args, strict=True):
        grad = MX.to_numpy(mx_array.grad)
        assert np.all(np.isfinite(grad))
        np.testing.assert_allclose(grad, finite_differences(objective, array), atol=1e-7)
    if name != "DotProductAttention":  # a weight's gradient too
        expected = finite_differences(objective, reference.W_q.weight)
        np.testing.assert_allclose(MX.to_numpy(layer.W_q.weight.grad()).T, expected, atol=1e-7)


def test_fully_masked_rows_have_zero_finite_gradients(MX, mx):
    layer = MX.MultiHeadAttention(8, 2, dtype="float64")
    queries, keys, values = [MX.from_numpy(a) for a in inputs("float64")]
    for a in (queries, keys, values):
        a.attach_grad()
    mask = MX.from_numpy(np.zeros((B, Q, K), bool))
    with mx.autograd.record():
        output = layer(queries, keys, values, mask=mask)
    output.backward()
    for a in (queries, keys, values):
        grad = MX.to_numpy(a.grad)
        assert np.all(grad == 0)
    assert np.all(MX.to_numpy(layer.attention_weights) == 0)
    for parameter in layer.collect_params().values():
        assert np.all(np.isfinite(MX.to_numpy(parameter.grad())))


def test_masked_softmax_gradient_matches_finite_differences(MX, mx):
    rng = np.random.default_rng(8)
    X = 50 * rng.standard_normal((2, 3, 4))
    valid_lens = np.array([[0, 2, 4], [1, 3, 9]])
    R = rng.standard_normal(X.shape)
    x = MX.from_numpy(X)
    x.attach_grad()
    with mx.autograd.record():
        loss = (MX.masked_softmax(x, MX.from_numpy(valid_lens)) * MX.from_numpy(R)).sum()
    loss.backward()
    expected = finite_differences(lambda: float((NP.masked_softmax(X, valid_lens) * R).sum()), X)
    np.testing.assert_allclose(MX.to_numpy(x.grad), expected, atol=1e-6)
    assert np.all(MX.to_numpy(x.grad)[0, 0] == 0)


def test_add_norm_gradient_matches_finite_differences(MX, mx):
    layer, reference = pair(MX, "AddNorm", "float64")
    rng = np.random.default_rng(9)
    X, Y = rng.standard_normal((2, 3, D)), rng.standard_normal((2, 3, D))
    R = rng.standard_normal(X.shape)
    x, y = MX.from_numpy(X), MX.from_numpy(Y)
    x.attach_grad()
    with mx.autograd.record():
        loss = (layer(x, y) * MX.from_numpy(R)).sum()
    loss.backward()
    expected = finite_differences(lambda: float((reference(X, Y) * R).sum()), X)
    np.testing.assert_allclose(MX.to_numpy(x.grad), expected, atol=1e-7)
    expected = finite_differences(lambda: float((reference(X, Y) * R).sum()), reference.ln.gamma)
    np.testing.assert_allclose(MX.to_numpy(layer.ln.gamma.grad()), expected, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Gluon habits


def test_train_mode_decides_dropout(MX, mx):
    layer = MX.MultiHeadAttention(8, 2, dropout=0.5, dtype="float64")
    args = [MX.from_numpy(a) for a in inputs("float64")]
    evaluated = MX.to_numpy(layer(*args))
    with mx.autograd.record(train_mode=False):
        np.testing.assert_array_equal(MX.to_numpy(layer(*args)), evaluated)
    with mx.autograd.predict_mode():
        np.testing.assert_array_equal(MX.to_numpy(layer(*args)), evaluated)
    with mx.autograd.record():
        trained = MX.to_numpy(layer(*args))
    assert not np.allclose(trained, evaluated)
    # attention_weights are taken before dropout
    weights = MX.to_numpy(layer.attention_weights)
    np.testing.assert_allclose(weights.sum(-1), 1.0)
    encoding = MX.PositionalEncoding(D, dropout=0.5)
    X = MX.from_numpy(np.ones((2, 3, D), "float32"))
    with mx.autograd.record():
        dropped = MX.to_numpy(encoding(X))
    assert np.any(dropped == 0)
    assert not np.any(MX.to_numpy(encoding(X)) == 0)


def test_inputs_are_not_modified(MX):
    # Run imperatively, masks are added into the layer's own scores in place: never into an
    # argument
    layer, _ = pair(MX, "MultiHeadAttention", "float32")
    args = [MX.from_numpy(a) for a in inputs("float32")]
    arguments = to_mx(MX, cast_case(MASK_CASES["combined"], "float32"))
    tensors = [*args, *(v for v in arguments.values() if not isinstance(v, bool))]
    copies = [MX.to_numpy(t).copy() for t in tensors]
    for need_weights in (True, False):
        layer(*args, need_weights=need_weights, **arguments)
    X = MX.from_numpy(np.random.default_rng(3).standard_normal((B, Q, K)).astype("float32"))
    tensors.append(X)
    copies.append(MX.to_numpy(X).copy())
    MX.masked_softmax(X, arguments["valid_lens"])
    additive, _ = pair(MX, "AdditiveAttention", "float32")
    additive(*args, arguments["valid_lens"], window_mask=arguments["window_mask"])
    for tensor, copy in zip(tensors, copies, strict=True):
        np.testing.assert_array_equal(MX.to_numpy(tensor), copy)


def test_numpy_semantics_stay_inside_the_blocks(MX, mx):
    before = mx.util.is_np_array(), mx.util.is_np_shape()
    layer = MX.MultiHeadAttention(8, 2)
    layer.hybridize()
    layer(*[MX.from_numpy(a) for a in inputs("float32")])
    MX.masked_softmax(MX.from_numpy(np.ones((2, 3), "float32")))
    mha.get_weights(layer)
    assert (mx.util.is_np_array(), mx.util.is_np_shape()) == before == (False, False)
    # The caller's own legacy NDArray code still works
    assert isinstance(mx.nd.ones((2,)) + 1, mx.nd.NDArray)


def test_runs_on_the_inputs_context(MX, mx):
    context = mx.cpu(1)
    layer, reference = pair(MX, "MultiHeadAttention", "float64")
    layer.collect_params().reset_ctx(context)
    args = inputs("float64")
    kwargs = {
        "valid_lens": np.array([0, 1, 2, 9]),
        "causal": True,
        "window_mask": np.where(np.eye(Q, K) > 0, -np.inf, 0.0)[None],
    }
    for hybridize in (False, True):
        layer.hybridize(hybridize)
        mx_kwargs = {
            k: v.as_in_context(context) if hasattr(v, "as_in_context") else v
            for k, v in to_mx(MX, kwargs).items()
        }
        output = layer(*[MX.from_numpy(a).as_in_context(context) for a in args], **mx_kwargs)
        assert output.ctx == context and layer.attention_weights.ctx == context
        assert_close(MX.to_numpy(output), reference(*args, **kwargs), "float64")
    encoding = MX.PositionalEncoding(D)
    assert (
        encoding(MX.from_numpy(np.ones((1, 2, D), "float32")).as_in_context(context)).ctx == context
    )


# ---------------------------------------------------------------------------------------------
# Weights and parameter files


@pytest.mark.parametrize("name", ["AdditiveAttention", "MultiHeadAttention", "AddNorm"])
def test_weights_round_trip_before_the_first_call(MX, name):
    arguments = config(name, "float64")
    weights = mha.random_weights(name, seed=3, **arguments)
    lazy = {k: v for k, v in arguments.items() if k not in ("query_size", "key_size", "value_size")}
    layer = getattr(MX, name)(**lazy)
    if name != "AddNorm":
        with pytest.raises(ValueError, match="not created yet"):
            mha.get_weights(layer)
        assert MX.layer_config(layer)["query_size"] is None
    mha.set_weights(layer, weights)
    assert {k: v for k, v in MX.layer_config(layer).items() if k in arguments} == arguments
    exported = mha.get_weights(layer)
    assert exported.keys() == weights.keys()
    for key in weights:
        np.testing.assert_array_equal(exported[key], weights[key])
        assert exported[key].dtype == np.float64
    if name == "MultiHeadAttention":
        # Gluon keeps (out, in): the canonical W is its transpose
        np.testing.assert_array_equal(MX.to_numpy(layer.W_q.weight.data()), weights["W_q"].T)


def test_layer_config_of_every_layer(MX):
    assert MX.layer_config(MX.DotProductAttention(0.25, dtype="float64")) == {
        "dropout": 0.25,
        "dtype": "float64",
    }
    assert MX.layer_config(MX.PositionalEncoding(6, 0.1, 20)) == {
        "num_hiddens": 6,
        "dropout": 0.1,
        "max_len": 20,
        "dtype": "float32",
    }
    assert MX.layer_config(MX.AddNorm(6, eps=1e-3)) == {
        "num_hiddens": 6,
        "dropout": 0.0,
        "eps": 1e-3,
        "dtype": "float32",
    }
    assert mha.get_weights(MX.DotProductAttention()) == {}
    with pytest.raises(TypeError):
        MX.layer_config(object())


def test_save_and_load_parameters_round_trip(MX, tmp_path):
    layer, reference = pair(MX, "MultiHeadAttention", "float32")
    args = inputs("float32")
    layer(*[MX.from_numpy(a) for a in args])
    path = str(tmp_path / "mha.params")
    layer.save_parameters(path)
    restored = MX.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, bias=True)
    restored.load_parameters(path)
    for key, value in mha.get_weights(layer).items():
        np.testing.assert_array_equal(mha.get_weights(restored)[key], value)
    output = restored(*[MX.from_numpy(a) for a in args])
    assert_close(MX.to_numpy(output), reference(*args), "float32")


def test_mha_selects_gluon_blocks(MX, mx):
    with mha.use_backend("mxnet"):
        layer = mha.MultiHeadAttention(8, 2)
    assert isinstance(layer, mx.gluon.HybridBlock)
    assert {"W_q", "W_k", "W_v", "W_o", "attention"} <= set(layer._children)
    assert "w_v" in MX.AdditiveAttention(4)._children


# ---------------------------------------------------------------------------------------------
# Errors: the same type and message as the NumPy backend


def _f(*shape, dtype="float32"):
    return np.zeros(shape, dtype)


ERROR_CASES = {
    "heads_do_not_divide": ("MultiHeadAttention", {"num_hiddens": 100, "num_heads": 3}, None),
    "bad_dropout": ("DotProductAttention", {"dropout": 1.0}, None),
    "bad_dtype": ("AdditiveAttention", {"num_hiddens": 4, "dtype": "int32"}, None),
    "bias_not_bool": ("MultiHeadAttention", {"num_hiddens": 4, "num_heads": 2, "bias": 1}, None),
    "bad_eps": ("AddNorm", {"num_hiddens": 4, "eps": 0.0}, None),
    "rank_2_queries": ("DotProductAttention", {}, ((_f(2, 3), _f(2, 4, 3), _f(2, 4, 3)), {})),
    "wrong_dtype": (
        "DotProductAttention",
        {},
        ((_f(2, 3, 3, dtype="float64"), _f(2, 4, 3), _f(2, 4, 3)), {}),
    ),
    "batch_mismatch": ("DotProductAttention", {}, ((_f(2, 3, 3), _f(1, 4, 3), _f(2, 4, 3)), {})),
    "query_key_size": ("DotProductAttention", {}, ((_f(2, 3, 3), _f(2, 4, 2), _f(2, 4, 3)), {})),
    "query_size": (
        "MultiHeadAttention",
        {"num_hiddens": 4, "num_heads": 2, "query_size": 5},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {}),
    ),
    "negative_valid_lens": (
        "DotProductAttention",
        {},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"valid_lens": np.array([1, -2])}),
    ),
    "fractional_valid_lens": (
        "MultiHeadAttention",
        {"num_hiddens": 4, "num_heads": 2},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"valid_lens": np.array([1.0, 2.5], "float32")}),
    ),
    "valid_lens_shape": (
        "AdditiveAttention",
        {"num_hiddens": 4},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"valid_lens": np.array([1, 2, 3])}),
    ),
    "mask_not_bool": (
        "DotProductAttention",
        {},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"mask": _f(3, 4)}),
    ),
    "mask_shape": (
        "DotProductAttention",
        {},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"mask": np.ones((2, 3), bool)}),
    ),
    "mask_4d_single_head": (
        "DotProductAttention",
        {},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"mask": np.ones((2, 1, 3, 4), bool)}),
    ),
    "causal_not_bool": (
        "DotProductAttention",
        {},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"causal": 1}),
    ),
    "window_batch": (
        "MultiHeadAttention",
        {"num_hiddens": 4, "num_heads": 2},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"window_mask": _f(3, 3, 4)}),
    ),
    "window_dtype": (
        "DotProductAttention",
        {},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"window_mask": _f(1, 3, 4, dtype="float64")}),
    ),
    "head_mask_shape": (
        "MultiHeadAttention",
        {"num_hiddens": 4, "num_heads": 2},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"head_mask": _f(3)}),
    ),
    "need_weights_not_bool": (
        "MultiHeadAttention",
        {"num_hiddens": 4, "num_heads": 2},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"need_weights": None}),
    ),
    "head_mask_single_head": (
        "DotProductAttention",
        {},
        ((_f(2, 3, 3), _f(2, 4, 3), _f(2, 4, 3)), {"head_mask": _f(2)}),
    ),
    "not_an_array": ("DotProductAttention", {}, (([[1.0]], _f(2, 4, 3), _f(2, 4, 3)), {})),
    "sequence_too_long": (
        "PositionalEncoding",
        {"num_hiddens": 3, "max_len": 2},
        ((_f(1, 3, 3),), {}),
    ),
    "add_norm_shapes": ("AddNorm", {"num_hiddens": 3}, ((_f(1, 2, 3), _f(2, 2, 3)), {})),
}


def _error(backend, name, arguments, call):
    convert = backend.from_numpy
    with pytest.raises((ValueError, TypeError)) as info:
        layer = getattr(backend, name)(**arguments)
        if call is not None:
            args, kwargs = call
            args = [convert(a) if isinstance(a, np.ndarray) else a for a in args]
            kwargs = {k: convert(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
            layer(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_match_numpy(MX, case):
    name, arguments, call = ERROR_CASES[case]
    expected = _error(NP, name, arguments, call)
    actual = _error(MX, name, arguments, call)
    assert type(actual) is type(expected)
    assert str(actual) == str(expected)


def test_masked_softmax_errors_match_numpy(MX):
    for X, valid_lens in [
        (np.zeros((3,), "float32"), None),
        (np.zeros((2, 3), "int32"), None),
        (np.zeros((2, 3), "float32"), np.array([[1, 2, 3], [1, 1, 1]])),
        (np.zeros((2, 3, 4), "float32"), np.array([1, -1])),
        (np.zeros((2, 3, 4), "float32"), np.array([0.5, 1.0])),
    ]:
        with pytest.raises((ValueError, TypeError)) as expected:
            NP.masked_softmax(X, valid_lens)
        with pytest.raises(type(expected.value)) as actual:
            MX.masked_softmax(
                MX.from_numpy(X), None if valid_lens is None else MX.from_numpy(valid_lens)
            )
        assert str(actual.value) == str(expected.value)


def test_set_weights_problems_are_reported(MX):
    layer = MX.MultiHeadAttention(4, 2, query_size=3, key_size=3, value_size=3)
    with pytest.raises(ValueError, match=r"4 problems"):
        mha.set_weights(layer, {"W_q": np.zeros((3, 4), "float64")})
