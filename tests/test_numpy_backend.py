"""The NumPy reference against hand-worked cases, the book's demos and loop implementations.

Every expected value here is computed independently of mha/backends/numpy.py: by hand, by
the formula with Python's math module, or by explicit loops over examples, heads and keys.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mha
from mha.backends import numpy as N

pytestmark = pytest.mark.numpy


def softmax_loop(row, kept):
    """Softmax of one row over the kept positions, by the formula; zeros elsewhere."""
    out = [0.0] * len(row)
    indices = [j for j in range(len(row)) if kept[j]]
    if not indices:
        return out
    top = max(row[j] for j in indices)
    total = sum(math.exp(row[j] - top) for j in indices)
    for j in indices:
        out[j] = math.exp(row[j] - top) / total
    return out


def loop_attention(q, k, v, keep, scores_fn, bias=None):
    """Attention by loops: q (Q, dq), k (K, dk), v (K, dv), keep (Q, K) -> (output, weights)."""
    num_queries, num_keys = q.shape[0], k.shape[0]
    weights = np.zeros((num_queries, num_keys))
    for i in range(num_queries):
        row = [
            scores_fn(q[i], k[j]) + (0.0 if bias is None else bias[i, j]) for j in range(num_keys)
        ]
        weights[i] = softmax_loop(row, keep[i])
    output = np.array(
        [
            [sum(weights[i, j] * v[j, c] for j in range(num_keys)) for c in range(v.shape[1])]
            for i in range(num_queries)
        ]
    )
    return output, weights


def keep_of(
    batch, num_queries, num_keys, valid_lens=None, mask=None, causal=False, window_mask=None
):
    """The combined keep-mask (B, Q, K) by explicit rules, one entry at a time."""
    keep = np.ones((batch, num_queries, num_keys), dtype=bool)
    for b in range(batch):
        for i in range(num_queries):
            for j in range(num_keys):
                if valid_lens is not None:
                    length = valid_lens[b] if np.ndim(valid_lens) == 1 else valid_lens[b][i]
                    keep[b, i, j] &= j < length
                if mask is not None:
                    m = np.broadcast_to(mask, (batch, num_queries, num_keys))
                    keep[b, i, j] &= bool(m[b, i, j])
                if causal:
                    keep[b, i, j] &= j <= i
                if window_mask is not None:
                    w = window_mask[b % window_mask.shape[0], i, j]
                    keep[b, i, j] &= bool(w) if window_mask.dtype == bool else w != -np.inf
    return keep


# ---------------------------------------------------------------------------------------------
# masked_softmax


def test_masked_softmax_book_demo_1d():
    X = np.random.default_rng(1).random((2, 2, 4)).astype("float32")
    P = mha.masked_softmax(X, np.array([2, 3]))
    assert np.all(P[0, :, 2:] == 0) and np.all(P[1, :, 3:] == 0)
    np.testing.assert_allclose(P.sum(-1), 1, rtol=1e-6)
    for b, length in enumerate([2, 3]):
        for i in range(2):
            expected = softmax_loop(X[b, i].tolist(), [j < length for j in range(4)])
            np.testing.assert_allclose(P[b, i], expected, rtol=1e-6)


def test_masked_softmax_book_demo_2d():
    X = np.random.default_rng(2).random((2, 2, 4)).astype("float32")
    lengths = [[1, 3], [2, 4]]
    P = mha.masked_softmax(X, np.array(lengths))
    for b in range(2):
        for i in range(2):
            assert np.all(P[b, i, lengths[b][i] :] == 0)
            expected = softmax_loop(X[b, i].tolist(), [j < lengths[b][i] for j in range(4)])
            np.testing.assert_allclose(P[b, i], expected, rtol=1e-6)
    np.testing.assert_allclose(P.sum(-1), 1, rtol=1e-6)


def test_masked_softmax_hand_worked():
    # Row [0, ln 3] keeps both keys: weights 1/4 and 3/4.
    X = np.array([[[0.0, math.log(3.0), 5.0]]])
    P = mha.masked_softmax(X, np.array([2]))
    np.testing.assert_allclose(P, [[[0.25, 0.75, 0.0]]], atol=1e-15)


def test_masked_softmax_zero_length_gives_zero_row_and_length_beyond_keys_keeps_all():
    X = np.random.default_rng(3).standard_normal((2, 3, 4))
    P = mha.masked_softmax(X, np.array([0, 9]))
    assert np.all(P[0] == 0)
    expected = np.exp(X[1]) / np.exp(X[1]).sum(-1, keepdims=True)
    np.testing.assert_allclose(P[1], expected, rtol=1e-12)


def test_masked_softmax_is_stable_for_large_logits():
    X = np.array([[[1e4, 1e4 - 1.0, -1e4]]], dtype="float32")
    P = mha.masked_softmax(X)
    assert np.all(np.isfinite(P))
    e = math.exp(-1.0)
    np.testing.assert_allclose(P[0, 0], [1 / (1 + e), e / (1 + e), 0.0], rtol=1e-6)
    # A weight that underflows to 0, or to a subnormal number, is no error, even where numpy
    # raises on underflow (its exp, its division by the row's sum, float16's cast back)
    with np.errstate(all="raise"):
        P = mha.masked_softmax(X, np.array([3]))
        spans = {"float32": 95.0, "float64": 740.0, "float16": 20.0}
        tiny = {t: mha.masked_softmax(np.array([[[0, 0, 0, -s]]], t)) for t, s in spans.items()}
    np.testing.assert_allclose(P[0, 0], [1 / (1 + e), e / (1 + e), 0.0], rtol=1e-6)
    for dtype, weights in tiny.items():
        assert weights.dtype == dtype
        np.testing.assert_allclose(weights[0, 0, :3].astype(float), 1 / 3, rtol=1e-3)


def test_masked_softmax_float_lengths_and_four_d_scores():
    X = np.random.default_rng(4).standard_normal((2, 3, 2, 5))  # (B, heads, Q, K)
    P = mha.masked_softmax(X, np.array([[1.0, 4.0], [5.0, 0.0]]))
    lengths = [[1, 4], [5, 0]]
    for b in range(2):
        for h in range(3):
            for i in range(2):
                expected = softmax_loop(X[b, h, i].tolist(), [j < lengths[b][i] for j in range(5)])
                np.testing.assert_allclose(P[b, h, i], expected, rtol=1e-12)


def test_masked_softmax_does_not_modify_inputs():
    X = np.random.default_rng(5).standard_normal((2, 2, 3))
    lengths = np.array([1, 2])
    X_before, lengths_before = X.copy(), lengths.copy()
    mha.masked_softmax(X, lengths)
    np.testing.assert_array_equal(X, X_before)
    np.testing.assert_array_equal(lengths, lengths_before)


# ---------------------------------------------------------------------------------------------
# DotProductAttention and AdditiveAttention


def test_dot_product_hand_worked():
    # scores: q.k / sqrt(2) = [1/sqrt2, 0]; weights [a, 1-a] with a = e^{1/sqrt2}/(e^{1/sqrt2}+1)
    queries = np.array([[[1.0, 0.0]]])
    keys = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    values = np.array([[[1.0], [3.0]]])
    layer = mha.DotProductAttention(dtype="float64")
    output = layer(queries, keys, values)
    a = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1)
    np.testing.assert_allclose(layer.attention_weights, [[[a, 1 - a]]], rtol=1e-14)
    np.testing.assert_allclose(output, [[[a * 1 + (1 - a) * 3]]], rtol=1e-14)


MASK_CASES = {
    "none": {},
    "valid_lens_1d": {"valid_lens": np.array([0, 2, 9])},
    "valid_lens_2d": {"valid_lens": np.array([[1, 0, 2, 4], [3, 3, 3, 3], [4, 1, 0, 2]])},
    "float_valid_lens": {"valid_lens": np.array([1.0, 3.0, 5.0])},
    "mask_2d": {"mask": np.random.default_rng(7).random((4, 5)) < 0.6},
    "mask_3d": {"mask": np.random.default_rng(8).random((3, 4, 5)) < 0.6},
    "mask_1d": {"mask": np.array([True, False, True, True, False])},
    "causal": {"causal": True},
    "window_bool": {"window_mask": np.random.default_rng(9).random((3, 4, 5)) < 0.7},
    "window_additive": {
        "window_mask": np.where(
            np.random.default_rng(10).random((1, 4, 5)) < 0.3,
            -np.inf,
            np.random.default_rng(11).standard_normal((1, 4, 5)),
        )
    },
    "combined": {
        "valid_lens": np.array([[1, 0, 2, 4], [3, 3, 3, 3], [4, 1, 0, 2]]),
        "mask": np.random.default_rng(12).random((4, 5)) < 0.7,
        "causal": True,
        "window_mask": np.random.default_rng(13).random((3, 4, 5)) < 0.8,
    },
}


def _bias_of(window_mask, batch):
    if window_mask is None or window_mask.dtype == bool:
        return [None] * batch
    return [
        np.where(
            np.isneginf(window_mask[b % len(window_mask)]), 0.0, window_mask[b % len(window_mask)]
        )
        for b in range(batch)
    ]


@pytest.mark.parametrize("case", MASK_CASES)
def test_dot_product_against_loops(case):
    rng = np.random.default_rng(20)
    queries, keys, values = (
        rng.standard_normal((3, 4, 6)),
        rng.standard_normal((3, 5, 6)),
        rng.standard_normal((3, 5, 2)),
    )
    masks = MASK_CASES[case]
    layer = mha.DotProductAttention(dtype="float64")
    output = layer(
        queries,
        keys,
        values,
        masks.get("valid_lens"),
        mask=masks.get("mask"),
        causal=masks.get("causal", False),
        window_mask=masks.get("window_mask"),
    )
    keep = keep_of(
        3,
        4,
        5,
        masks.get("valid_lens"),
        masks.get("mask"),
        masks.get("causal", False),
        masks.get("window_mask"),
    )
    biases = _bias_of(masks.get("window_mask"), 3)
    for b in range(3):
        expected, weights = loop_attention(
            queries[b],
            keys[b],
            values[b],
            keep[b],
            lambda q, k: float(q @ k) / math.sqrt(6),
            biases[b],
        )
        np.testing.assert_allclose(output[b], expected, atol=1e-12)
        np.testing.assert_allclose(layer.attention_weights[b], weights, atol=1e-12)
    assert np.all(layer.attention_weights[~keep] == 0)  # masked keys get exactly zero


@pytest.mark.parametrize("case", ["none", "valid_lens_2d", "mask_3d", "causal", "combined"])
def test_additive_against_loops(case):
    rng = np.random.default_rng(21)
    queries, keys, values = (
        rng.standard_normal((3, 4, 3)),
        rng.standard_normal((3, 5, 2)),
        rng.standard_normal((3, 5, 4)),
    )
    masks = MASK_CASES[case]
    layer = mha.AdditiveAttention(6, query_size=3, key_size=2, dtype="float64")
    w = mha.random_weights(layer, seed=3)
    mha.set_weights(layer, w)
    output = layer(
        queries,
        keys,
        values,
        masks.get("valid_lens"),
        mask=masks.get("mask"),
        causal=masks.get("causal", False),
        window_mask=masks.get("window_mask"),
    )
    keep = keep_of(
        3,
        4,
        5,
        masks.get("valid_lens"),
        masks.get("mask"),
        masks.get("causal", False),
        masks.get("window_mask"),
    )

    def score(q, k):
        hidden = [
            math.tanh(
                sum(q[a] * w["W_q"][a, c] for a in range(3))
                + sum(k[a] * w["W_k"][a, c] for a in range(2))
            )
            for c in range(6)
        ]
        return sum(hidden[c] * w["w_v"][c, 0] for c in range(6))

    for b in range(3):
        expected, weights = loop_attention(queries[b], keys[b], values[b], keep[b], score)
        np.testing.assert_allclose(output[b], expected, atol=1e-12)
        np.testing.assert_allclose(layer.attention_weights[b], weights, atol=1e-12)


def test_fully_masked_rows_are_zero_without_nan_in_every_dtype():
    for dtype in ("float16", "float32", "float64"):
        rng = np.random.default_rng(22)
        q = rng.standard_normal((2, 3, 4)).astype(dtype)
        layer = mha.MultiHeadAttention(
            4, 2, dtype=dtype, query_size=4, key_size=4, value_size=4, bias=True
        )
        mask = np.ones((2, 3, 3), dtype=bool)
        mask[1, 2, :] = False
        output = layer(q, q, q, np.array([0, 3]), mask=mask)
        assert not np.any(np.isnan(output))
        assert np.all(layer.attention_weights[0] == 0)
        assert np.all(layer.attention_weights[1, :, 2] == 0)
        # A row that attends nothing gives zero per head, so the output is b_o exactly.
        b_o = mha.get_weights(layer)["b_o"]
        np.testing.assert_array_equal(output[0], np.broadcast_to(b_o, (3, 4)))
        np.testing.assert_array_equal(output[1, 2], b_o)


def test_causal_is_top_left_aligned_when_queries_and_keys_differ():
    rng = np.random.default_rng(23)
    layer = mha.DotProductAttention(dtype="float64")
    layer(
        rng.standard_normal((1, 3, 2)),
        rng.standard_normal((1, 5, 2)),
        rng.standard_normal((1, 5, 2)),
        causal=True,
    )
    nonzero = layer.attention_weights[0] != 0
    np.testing.assert_array_equal(nonzero, [[j <= i for j in range(5)] for i in range(3)])


def test_window_mask_uses_window_b_mod_num_windows():
    rng = np.random.default_rng(24)
    windows = np.zeros((2, 2, 3), dtype=bool)
    windows[0, :, 0] = True  # window 0 sees key 0 only
    windows[1, :, 2] = True  # window 1 sees key 2 only
    layer = mha.DotProductAttention(dtype="float64")
    layer(
        rng.standard_normal((4, 2, 2)),
        rng.standard_normal((4, 3, 2)),
        rng.standard_normal((4, 3, 2)),
        window_mask=windows,
    )
    for b in range(4):
        expected = [1.0, 0.0, 0.0] if b % 2 == 0 else [0.0, 0.0, 1.0]
        np.testing.assert_array_equal(layer.attention_weights[b], [expected, expected])


# ---------------------------------------------------------------------------------------------
# MultiHeadAttention


def loop_multihead(
    w, queries, keys, values, keep4, num_heads, head_mask=None, bias=False, additive=None
):
    """Multi-head attention by loops over examples and heads, from the canonical weights."""
    batch = queries.shape[0]
    num_hiddens = w["W_o"].shape[0]
    p = num_hiddens // num_heads
    b = {k: (w[f"b_{k}"] if bias else 0.0) for k in "qkvo"}
    q, k, v = queries @ w["W_q"] + b["q"], keys @ w["W_k"] + b["k"], values @ w["W_v"] + b["v"]
    concat = np.zeros((batch, queries.shape[1], num_hiddens))
    weights = np.zeros((batch, num_heads, queries.shape[1], keys.shape[1]))
    for e in range(batch):
        for h in range(num_heads):
            block = slice(h * p, (h + 1) * p)  # head h owns columns h*p .. (h+1)*p - 1
            out, weights[e, h] = loop_attention(
                q[e, :, block],
                k[e, :, block],
                v[e, :, block],
                keep4[e, h],
                lambda x, y: float(x @ y) / math.sqrt(p),
                None if additive is None else additive[e],
            )
            factor = (
                1.0
                if head_mask is None
                else (head_mask[h] if head_mask.ndim == 1 else head_mask[e, h])
            )
            concat[e, :, block] = out * factor
    return concat @ w["W_o"] + b["o"], weights


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        "none",
        "valid_lens_1d",
        "valid_lens_2d",
        "mask_4d",
        "mask_3d",
        "causal",
        "window_additive",
        "head_mask_1d",
        "head_mask_2d",
        "combined",
    ],
)
def test_multihead_against_loops(case, bias):
    rng = np.random.default_rng(30)
    batch, num_queries, num_keys, num_heads = 3, 4, 5, 3
    queries, keys, values = (
        rng.standard_normal((batch, num_queries, 5)),
        rng.standard_normal((batch, num_keys, 4)),
        rng.standard_normal((batch, num_keys, 2)),
    )
    layer = mha.MultiHeadAttention(6, num_heads, bias=bias, dtype="float64")
    w = mha.random_weights(
        "MultiHeadAttention",
        num_hiddens=6,
        num_heads=num_heads,
        bias=bias,
        query_size=5,
        key_size=4,
        value_size=2,
        dtype="float64",
        seed=4,
    )
    mha.set_weights(layer, w)
    masks = dict(MASK_CASES.get(case, {}))
    head_mask = None
    mask4 = None
    if case == "mask_4d":
        mask4 = rng.random((batch, num_heads, 1, num_keys)) < 0.6
        masks["mask"] = mask4
    if case == "head_mask_1d":
        head_mask = np.array([1.0, 0.0, 0.5])
    if case == "head_mask_2d":
        head_mask = rng.random((batch, num_heads))
    if case == "combined":
        head_mask = np.array([0.0, 2.0, 1.0])
    arguments = dict(
        mask=masks.get("mask"),
        causal=masks.get("causal", False),
        window_mask=masks.get("window_mask"),
        head_mask=head_mask,
    )
    output = layer(queries, keys, values, masks.get("valid_lens"), **arguments)
    keep = keep_of(
        batch,
        num_queries,
        num_keys,
        masks.get("valid_lens"),
        None if mask4 is not None else masks.get("mask"),
        masks.get("causal", False),
        masks.get("window_mask"),
    )
    keep4 = np.repeat(keep[:, None], num_heads, axis=1)
    if mask4 is not None:
        keep4 &= np.broadcast_to(mask4, keep4.shape)
    additive = _bias_of(masks.get("window_mask"), batch)
    expected, weights = loop_multihead(
        w,
        queries,
        keys,
        values,
        keep4,
        num_heads,
        head_mask,
        bias,
        None if additive[0] is None else additive,
    )
    np.testing.assert_allclose(output, expected, atol=1e-12)
    np.testing.assert_allclose(layer.attention_weights, weights, atol=1e-12)
    assert layer.attention_weights.shape == (batch, num_heads, num_queries, num_keys)
    # Without the weights: the same computation, so the same output exactly
    without = layer(queries, keys, values, masks.get("valid_lens"), **arguments, need_weights=False)
    np.testing.assert_array_equal(without, output)
    assert layer.attention_weights is None


def test_multihead_three_d_attn_bias_adds_to_every_head_of_its_example():
    # attn_bias (batch, Q, K): example e's bias on each of its heads. batch == heads, so a
    # bias laid along the head axis instead would broadcast without an error
    rng = np.random.default_rng(31)
    batch = num_heads = 3
    num_queries, num_keys = 4, 5
    queries, keys, values = (
        rng.standard_normal((batch, n, 4)) for n in (num_queries, num_keys, num_keys)
    )
    w = mha.random_weights(
        "MultiHeadAttention",
        num_hiddens=6,
        num_heads=num_heads,
        bias=False,
        query_size=4,
        key_size=4,
        value_size=4,
        dtype="float64",
        seed=5,
    )
    layer = mha.MultiHeadAttention(6, num_heads, bias=False, dtype="float64")
    mha.set_weights(layer, w)
    attn_bias = rng.standard_normal((batch, num_queries, num_keys))
    attn_bias[1, 2, 0] = -np.inf  # leaves that key out of that row exactly
    output = layer(queries, keys, values, attn_bias=attn_bias)
    kept = np.isfinite(attn_bias)
    keep4 = np.broadcast_to(kept[:, None], (batch, num_heads, num_queries, num_keys))
    additive = np.where(kept, attn_bias, 0.0)
    expected, weights = loop_multihead(
        w, queries, keys, values, keep4, num_heads, additive=additive
    )
    np.testing.assert_allclose(output, expected, atol=1e-12)
    np.testing.assert_allclose(layer.attention_weights, weights, atol=1e-12)


def test_multihead_book_example_shapes_and_need_weights():
    layer = mha.MultiHeadAttention(100, 5, 0.5)
    X, Y = np.ones((2, 4, 100), "float32"), np.ones((2, 6, 100), "float32")
    valid_lens = np.array([3, 2])
    output = layer(X, Y, Y, valid_lens)
    assert output.shape == (2, 4, 100)
    assert layer.attention_weights.shape == (2, 5, 4, 6)
    assert mha.get_weights(layer)["W_q"].shape == (100, 100)  # sizes inferred at the call
    again = layer(X, Y, Y, valid_lens, need_weights=False)
    assert layer.attention_weights is None
    np.testing.assert_array_equal(again, output)


def test_dropout_acts_only_when_training_and_is_seedable():
    rng = np.random.default_rng(31)
    q = rng.standard_normal((2, 3, 8)).astype("float32")
    layer = mha.MultiHeadAttention(8, 2, dropout=0.5, query_size=8, key_size=8, value_size=8)
    evaluation = layer(q, q, q)
    np.testing.assert_array_equal(layer(q, q, q), evaluation)
    layer.train()
    assert layer.attention.training and layer.attention.dropout.training  # propagates
    np.random.seed(0)
    first = layer(q, q, q)
    np.random.seed(0)
    second = layer(q, q, q)
    np.testing.assert_array_equal(first, second)
    assert not np.allclose(first, evaluation)
    # attention_weights are recorded before dropout
    np.testing.assert_allclose(layer.attention_weights.sum(-1), 1, rtol=1e-6)
    layer.eval()
    np.testing.assert_array_equal(layer(q, q, q), evaluation)


def test_dropout_zeroes_and_rescales():
    dropout = N.Dropout(0.25).train()
    np.random.seed(1)
    X = np.ones((1000, 10), dtype="float32")
    Y = dropout(X)
    assert set(np.unique(Y).tolist()) == {0.0, np.float32(1 / 0.75)}
    assert abs((Y == 0).mean() - 0.25) < 0.02
    # A rate raised to 1 after construction (which refuses it) drops every entry: zeros, not
    # the NaN of 0 / 0
    dropout.p = 1.0
    assert np.array_equal(dropout(X), np.zeros_like(X))


# ---------------------------------------------------------------------------------------------
# PositionalEncoding and AddNorm


@pytest.mark.parametrize("num_hiddens", [6, 7, 1])
def test_positional_encoding_matches_the_formula(num_hiddens):
    layer = mha.PositionalEncoding(num_hiddens, max_len=50, dtype="float64")
    X = np.random.default_rng(32).standard_normal((2, 30, num_hiddens))
    Y = layer(X)
    for i in range(30):
        for c in range(num_hiddens):
            angle = i / 10000 ** ((c - c % 2) / num_hiddens)
            expected = math.sin(angle) if c % 2 == 0 else math.cos(angle)
            assert layer.P[0, i, c] == pytest.approx(expected, abs=1e-15)
            np.testing.assert_allclose(Y[:, i, c], X[:, i, c] + expected, atol=1e-14)
    assert mha.get_weights(layer) == {}  # P is a constant, not a weight


def test_positional_encoding_is_cast_once_from_float64():
    layer = mha.PositionalEncoding(16, max_len=100)
    assert layer.P.dtype == np.float32
    np.testing.assert_array_equal(
        layer.P, mha.PositionalEncoding(16, max_len=100, dtype="float64").P.astype("float32")
    )


def test_add_norm_matches_the_formula():
    rng = np.random.default_rng(33)
    X, Y = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    layer = mha.AddNorm(4, eps=1e-3, dtype="float64")
    w = mha.random_weights(layer, seed=2)
    mha.set_weights(layer, w)
    out = layer(X, Y)
    for b in range(2):
        for i in range(3):
            s = X[b, i] + Y[b, i]
            mean = sum(s) / 4
            var = sum((x - mean) ** 2 for x in s) / 4
            expected = [
                (x - mean) / math.sqrt(var + 1e-3) * g + be
                for x, g, be in zip(s, w["gamma"], w["beta"], strict=True)
            ]
            np.testing.assert_allclose(out[b, i], expected, atol=1e-12)


def test_float32_layers_compute_in_float32():
    rng = np.random.default_rng(34)
    q = rng.standard_normal((2, 3, 4)).astype("float32")
    for layer, args in [
        (mha.DotProductAttention(), (q, q, q)),
        (mha.AdditiveAttention(5), (q, q, q)),
        (mha.MultiHeadAttention(4, 2), (q, q, q, np.array([1, 2]))),
        (mha.PositionalEncoding(4), (q,)),
        (mha.AddNorm(4), (q, q)),
    ]:
        assert layer(*args).dtype == np.float32, type(layer).__name__


# ---------------------------------------------------------------------------------------------
# Properties over random configurations


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    num_queries=st.integers(1, 4),
    num_keys=st.integers(1, 5),
    two_d=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_masked_softmax_properties(batch, num_queries, num_keys, two_d, seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((batch, num_queries, num_keys)) * 30
    shape = (batch, num_queries) if two_d else (batch,)
    lengths = rng.integers(0, num_keys + 2, size=shape)
    P = mha.masked_softmax(X, lengths)
    per_row = lengths if two_d else np.repeat(lengths[:, None], num_queries, axis=1)
    for b in range(batch):
        for i in range(num_queries):
            length = min(per_row[b, i], num_keys)
            assert np.all(P[b, i, length:] == 0)
            assert P[b, i].sum() == pytest.approx(1.0 if length > 0 else 0.0, abs=1e-12)
            expected = softmax_loop(X[b, i].tolist(), [j < length for j in range(num_keys)])
            np.testing.assert_allclose(P[b, i], expected, atol=1e-12)


@pytest.mark.parametrize(
    "keep_shape",
    [None, (4, 1, 1, 64), (4, 1, 48, 64), (1, 3, 1, 64), (4, 3, 48, 1), (48, 64), (64,)],
)
def test_softmax_with_every_broadcast_of_keep_matches_the_formula(keep_shape):
    # Scores of 4 x 3 x 48 x 64 float64 against keep-masks that broadcast along different
    # axes: every row by the formula, and the scores and keep never written.
    rng = np.random.default_rng(40)
    scores = rng.standard_normal((4, 3, 48, 64)) * 5
    keep = None if keep_shape is None else rng.random(keep_shape) < 0.7
    if keep is not None and keep.ndim > 1:
        keep[..., 0, :] = False  # some rows (or all, for a 1-row keep) have no kept key
    scores_before = scores.copy()
    keep_before = None if keep is None else keep.copy()
    weights = N._softmax(scores, keep)
    np.testing.assert_array_equal(scores, scores_before)
    if keep is not None:
        np.testing.assert_array_equal(keep, keep_before)
    assert weights.shape == scores.shape and not np.any(np.isnan(weights))
    kept = np.broadcast_to(True if keep is None else keep, scores.shape)
    assert np.all(weights[~kept] == 0)
    for index in [(0, 0, 0), (1, 2, 5), (3, 1, 47), (2, 0, 30)]:
        expected = softmax_loop(scores[index].tolist(), kept[index].tolist())
        np.testing.assert_allclose(weights[index], expected, rtol=1e-12, atol=1e-300)


def test_float16_layers_take_underflow_as_rounding_whatever_numpy_raises_on():
    # np.seterr(all="raise") made float16 layers raise FloatingPointError at ordinary inputs:
    # a drawn weight near 0, the positional table's small entries, the rotary products. Every
    # framework rounds such a result to a subnormal or 0; the reference does too, and gives
    # the numbers it gives without the setting (the same draws, seeded)
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype("float16")
    sizes = {"query_size": 16, "key_size": 16, "value_size": 16, "dtype": "float16"}

    def outputs(seed):
        np.random.seed(seed)
        layers = [
            N.MultiHeadAttention(16, 2, rope_theta=10000.0, alibi=True, sinks=True, **sizes),
            N.MultiHeadAttention(16, 2, sliding_window=2, qk_norm="head", **sizes),
        ]
        results = [layer(x, x, x, causal=True) for layer in layers]
        results.append(N.PositionalEncoding(16, max_len=1000, dtype="float16")(x))
        results.append(N.dot_product_attention(*(x[:, None],) * 3, causal=True))
        return results

    for seed in range(8):
        expected = outputs(seed)
        with np.errstate(all="raise"):
            got = outputs(seed)
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)
