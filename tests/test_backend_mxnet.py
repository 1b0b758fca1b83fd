"""What only the MXNet Gluon backend promises; the agreement with the NumPy reference (every
layer, mask combination and dtype, gradients from autograd.record against the reference's
finite differences) is tests/test_agreement.py's, through mha.harness, and the error table
tests/test_errors.py's.

Here: hybridized blocks (the harness's cases run through a hybridized block, gradients
included; a repeated structure of call traced once; lazy sizes; no tracing inside a parent
graph; cached decoding through one graph, with a KVCache and with a LatentCache; the learned
positional encoding's embedding), float16, train_mode, inputs left untouched, numpy semantics
kept inside the blocks, contexts, weights and parameter files.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import mha
from conftest import assert_agrees, backend_module
from mha import cases, harness
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


# valid_lens, a mask, causal and an additive window: every mask kind at once
rng = np.random.default_rng(42)
COMBINED = {
    "valid_lens": np.array([3, 0, 5, 2]),
    "mask": rng.random((B, Q, K)) > 0.2,
    "causal": True,
    "window_mask": np.where(rng.random((4, Q, K)) > 0.2, 0.3, -np.inf),
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
# PositionalEncoding and float16


def test_positional_encoding_table_is_a_cast_constant(MX, mx):
    encoding = MX.PositionalEncoding(5, max_len=12, dtype="float64")
    angle = 3 / 10000 ** (2 / 5)
    P = MX.to_numpy(encoding.P)
    assert P.shape == (1, 12, 5)
    np.testing.assert_allclose(P[0, 3, 2], np.sin(angle), atol=1e-15)
    np.testing.assert_allclose(P[0, 3, 3], np.cos(angle), atol=1e-15)
    assert not isinstance(encoding.P, mx.gluon.Parameter)
    assert len(encoding.collect_params().keys()) == 0


def test_float16_runs_and_stays_close(MX):
    # AddNorm, PositionalEncoding and RotaryEmbedding only: MXNet 1.9.1 has float16 matmul and
    # FullyConnected on GPU only, so the attention layers in float16 need a GPU context
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
    rotary = MX.RotaryEmbedding(D, dtype="float16")
    output = rotary(MX.from_numpy(X.astype("float16")), offset=1000)
    assert output.dtype == np.float16
    expected = NP.RotaryEmbedding(D, dtype="float64")(X, 1000)
    np.testing.assert_allclose(MX.to_numpy(output), expected, atol=1e-2)


@pytest.mark.parametrize("hybridize", [False, True])
def test_float16_attention_on_the_cpu_is_a_clear_error(MX, mx, hybridize):
    # MXNet's own failure comes from its engine, and again in the caller's next operation
    X = MX.from_numpy(np.ones((B, Q, D), "float16"))
    layers = (MX.DotProductAttention(dtype="float16"),
              MX.AdditiveAttention(4, dtype="float16"),
              MX.MultiHeadAttention(D, 2, dtype="float16"))  # fmt: skip
    message = r"attention layers of the mxnet backend run on a GPU context only.*: {} on cpu"
    for layer in layers:
        if hybridize:
            layer.hybridize()
        with pytest.raises(ValueError, match=message.format("queries")):
            layer(X, X, X)
    # Latent attention names its X, the function its query
    sizes = {"kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2}
    latent = MX.MultiHeadLatentAttention(D, 2, **sizes, dtype="float16")
    with pytest.raises(ValueError, match=message.format("X")):
        latent(X)
    # The function refuses an empty batch as it refuses any other
    heads = MX.from_numpy(np.ones((0, 2, Q, D), "float16"))
    with pytest.raises(ValueError, match=message.format("query")):
        MX.dot_product_attention(heads, heads, heads, causal=True)
    # Nothing failed inside MXNet: the next operation runs
    assert MX.to_numpy(X + X).sum() == 2 * B * Q * D


# ---------------------------------------------------------------------------------------------
# Hybridization


# Every structure of call a hybridized block traces: each mask kind, lengths, a window of each
# kind, head masks, need_weights, self-attention, sliding windows, grouped-query attention with
# rotary embeddings; and PositionalEncoding, RotaryEmbedding and AddNorm
HYBRID_CASES = [
    harness.Case("DotProductAttention", ("valid_lens_2d", "mask_3d", "window_mask")),
    harness.Case(
        "DotProductAttention", ("square", "valid_lens_2d", "mask_2d", "causal", "window_mask")
    ),
    harness.Case("DotProductAttention", ("valid_lens_1d", "lens_float")),
    harness.Case("AdditiveAttention", ("window_mask",)),
    harness.Case("AdditiveAttention", ("valid_lens_2d", "lens_int32", "window_bool")),
    harness.Case(
        "AdditiveAttention", ("tall", "valid_lens_1d", "mask_keys", "causal", "window_mask")
    ),
    harness.Case("MultiHeadAttention", (), {"bias": True}),
    harness.Case("MultiHeadAttention", ("mask_1d",), {"bias": True}),
    harness.Case("MultiHeadAttention", ("valid_lens_1d", "no_weights"), {"bias": True}),
    harness.Case("MultiHeadAttention", ("valid_lens_1d", "mask_4d", "head_mask")),
    harness.Case(
        "MultiHeadAttention",
        ("valid_lens_2d", "mask_4d_batch", "causal", "window_bool", "head_mask_2d"),
        {"bias": True},
    ),
    harness.Case("MultiHeadAttention", ("mask_4d_heads", "head_mask_bool"), {"bias": True}),
    harness.Case(
        "MultiHeadAttention",
        ("self", "valid_lens_2d", "causal", "window_mask", "head_mask", "no_weights"),
    ),
    harness.Case("DotProductAttention", ("valid_lens_1d",), {"sliding_window": 2}),
    harness.Case(
        "MultiHeadAttention",
        ("self", "valid_lens_1d", "causal"),
        {"num_heads": 4, "num_kv_heads": 2, "rope_theta": 10000.0, "sliding_window": 2},
    ),
    harness.Case("PositionalEncoding"),
    harness.Case("RotaryEmbedding", ("offset",), {"interleaved": True}),
    harness.Case("AddNorm", ("rank_4",), {"eps": 1e-3}),
    # Multi-head latent attention: every case of the defaults (absorbed among them)
    *(harness.Case(layer, masks, config) for layer, masks, config in cases.LATENT_CASES),
]


@pytest.mark.parametrize("case", HYBRID_CASES, ids=lambda case: case.id)
def test_hybridized_block_agrees_with_the_reference(MX, case):
    # The harness's check, gradients included, on a hybridized block whose graph was first
    # traced on other sizes (a graph does not depend on batch size or sequence lengths).
    # Expected: the float64 reference and its finite differences, as for the imperative block.
    prepared = harness.prepare(case, dtype="float64", seed=3)
    other_sizes = harness.Shapes(batch_size=2, num_queries=4, num_keys=6)
    other = harness.make_inputs(case, other_sizes, "float64", seed=4)
    other = {k: MX.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in other.items()}
    blocks = []

    def hybridize(layer):
        layer.hybridize()
        harness.call_layer(MX, case, layer, other)
        blocks.append(layer)
        return layer

    row, _ = harness.check("mxnet", prepared, transform=hybridize)
    assert row.passed, row
    assert row.gradient_difference is not None
    assert blocks[0]._cached_op is not None  # the graph really ran


def test_hybridized_layer_traces_a_repeated_structure_of_call_once(MX, mx):
    # Calls of one structure (with or without valid_lens, evaluation or training) reuse the
    # graph traced for it, whatever came before; hybridize() again traces anew. (Whether calls
    # that alternate keep a graph per structure is the backend's choice: mxnet.py now retraces
    # when the structure changes.) Expected: the imperative layer and the reference each call.
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

    for kwargs in cases:
        for recording in (False, True):
            before = len(traces)
            for _ in range(3):
                actual = call(hybrid, kwargs, recording)
                np.testing.assert_allclose(
                    actual, call(imperative, kwargs, recording), rtol=0, atol=1e-12
                )
                assert_agrees(actual, reference(*args, **kwargs), "float64")
            assert len(traces) <= before + 1  # the repeats reuse the graph
    assert len(traces) == len(cases) * 2
    hybrid.hybridize()
    call(hybrid, cases[-1], True)  # the last structure again: traced anew after hybridize()
    assert len(traces) == len(cases) * 2 + 1


def test_hybridized_modern_attention_and_rotary_embedding(MX, mx):
    # Grouped-query attention (4 query heads, 2 key-value heads) with rotary embeddings and a
    # sliding window: the graph gives the imperative layer's numbers, and under
    # autograd.record its gradients (valid_lens with a sliding window is not the fused
    # length-masked path). The rotary frequencies are no Parameter, and a hybridized
    # RotaryEmbedding takes its offset as an input: two offsets, one graph, numpy's numbers.
    options = {"num_heads": 4, "num_kv_heads": 2, "rope_theta": 10000.0, "sliding_window": 2}
    imperative, reference = pair(MX, "MultiHeadAttention", "float64", **options)
    hybrid, _ = pair(MX, "MultiHeadAttention", "float64", **options)
    hybrid.hybridize()
    assert isinstance(hybrid.rotary, MX.RotaryEmbedding) and "rotary" in hybrid._children
    assert {p.split("_")[-1] for p in hybrid.collect_params()} == {"weight", "bias"}
    args = inputs("float64")
    kwargs = {"valid_lens": np.array([0, 1, 4, 5])}
    expected = reference(*args, **kwargs)
    results = []
    for layer in (imperative, hybrid):
        tensors = [MX.from_numpy(a) for a in args]
        for tensor in tensors:
            tensor.attach_grad()
        with mx.autograd.record():
            output = layer(*tensors, **to_mx(MX, kwargs))
            (output * output).sum().backward()
        grads = [MX.to_numpy(t.grad) for t in tensors]
        grads += [MX.to_numpy(getattr(layer, k).weight.grad()) for k in ("W_q", "W_k", "W_v")]
        assert_agrees(MX.to_numpy(output), expected, "float64")
        results.append((MX.to_numpy(output), grads))
    assert hybrid._cached_op is not None  # the graph really ran
    (output, grads), (hybrid_output, hybrid_grads) = results
    np.testing.assert_allclose(hybrid_output, output, rtol=0, atol=1e-12)
    for actual, wanted in zip(hybrid_grads, grads, strict=True):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=1e-12)
    assert np.abs(grads[2]).max() > 0  # the values' gradient is not trivially zero
    # RotaryEmbedding: a (batch, heads, n, num_hiddens) input at two offsets
    X = np.random.default_rng(5).standard_normal((2, 3, 4, D))

    def traced(block):
        traces = []
        trace = block.hybrid_forward
        block.hybrid_forward = lambda F, *args: traces.append(F) or trace(F, *args)
        return traces

    for interleaved in (False, True):
        rotary = MX.RotaryEmbedding(D, 100.0, interleaved=interleaved, dtype="float64")
        rotary.hybridize()
        assert len(rotary.collect_params().keys()) == 0
        traces = traced(rotary)
        numpy_rotary = NP.RotaryEmbedding(D, 100.0, interleaved=interleaved, dtype="float64")
        for offset in (0, 7):
            actual = MX.to_numpy(rotary(MX.from_numpy(X), offset=offset))
            assert_agrees(actual, numpy_rotary(X, offset), "float64")
        assert traces == [mx.sym]  # one graph, traced once, serves both offsets


def test_hybridized_cached_decoding_equals_full_causal_attention(MX, mx):
    # Grouped-query attention with rotary embeddings and a sliding window decodes a prompt of 3
    # positions, then one position per call, through the hybridized graph: the cached keys and
    # values are its inputs and the offset is counted in it, so every step after the first
    # reuses one graph. Expected: the reference's full causal attention, and the imperative
    # layer's numbers and cache at each step.
    options = {"num_heads": 4, "num_kv_heads": 2, "rope_theta": 100.0, "sliding_window": 3}
    config = {**options, "num_hiddens": 8, "bias": True, "dtype": "float64"}
    config.update(query_size=D, key_size=D, value_size=D)
    weights = mha.random_weights("MultiHeadAttention", seed=2, **config)
    hybrid, imperative, full = (
        MX.MultiHeadAttention(**config),
        MX.MultiHeadAttention(**config),
        NP.MultiHeadAttention(**config),
    )
    for layer in (hybrid, imperative, full):
        mha.set_weights(layer, weights)
    hybrid.hybridize()
    traces = []
    trace = hybrid.hybrid_forward
    hybrid.hybrid_forward = lambda F, *args: traces.append(F) or trace(F, *args)
    X = np.random.default_rng(7).standard_normal((2, 7, D))
    valid_lens = np.array([7, 5])  # the second example's last two keys are padding
    expected = full(X, X, X, valid_lens, causal=True)
    caches, outputs = [mha.KVCache(), mha.KVCache()], []
    for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):
        x = MX.from_numpy(X[:, start:stop])
        lengths = MX.from_numpy(np.minimum(valid_lens, stop))
        step = []
        for i, layer in enumerate((hybrid, imperative)):
            output, caches[i] = layer(x, x, x, lengths, causal=True, cache=caches[i])
            step.append(MX.to_numpy(output))
        np.testing.assert_allclose(step[0], step[1], rtol=0, atol=1e-12)
        for hybrid_held, held in zip(*caches, strict=True):
            assert isinstance(hybrid_held, mx.np.ndarray) and hybrid_held.shape == (2, 2, stop, 2)
            np.testing.assert_allclose(MX.to_numpy(hybrid_held), MX.to_numpy(held), atol=1e-12)
        outputs.append(step[0])
    assert_agrees(np.concatenate(outputs, axis=1), expected, "float64")
    assert hybrid.attention_weights.shape == (2, 4, 1, 7)
    assert traces == [mx.sym, mx.sym]  # the empty cache's graph, then one for every step


def _traces(layer) -> list:
    """The F of each of layer's hybrid_forward calls from now on: mx.sym where it traces."""
    traces, trace = [], layer.hybrid_forward
    layer.hybrid_forward = lambda F, *args: traces.append(F) or trace(F, *args)
    return traces


def test_hybridized_latent_decoding_equals_full_causal_attention(MX, mx):
    # Multi-head latent attention with low-rank queries, yarn and a sliding window decodes a
    # prompt of 3 positions, then one position per call, through the hybridized graph, in its
    # expanded and absorbed forms: the cached latents and rotary keys are the graph's inputs
    # and outputs and the offset is counted in it, so every step after the first reuses one
    # graph. Expected: the reference's full causal attention and the imperative layer's cache.
    config = {
        "num_hiddens": 8,
        "num_heads": 2,
        **cases.LATENT_SIZES,
        "q_lora_rank": 5,
        "bias": True,
        "rope_scaling": cases.LATENT_YARN,
        "sliding_window": 3,
        "dtype": "float64",
    }
    weights = mha.random_weights(cases.LATENT, seed=2, **config)
    full = NP.MultiHeadLatentAttention(**config)
    mha.set_weights(full, weights)
    X = np.random.default_rng(7).standard_normal((2, 7, 8))
    valid_lens = np.array([7, 5])  # the second example's last two keys are padding
    expected = full(X, valid_lens, causal=True)
    for absorbed in (False, True):
        hybrid, imperative = (MX.MultiHeadLatentAttention(**config) for _ in range(2))
        for layer in (hybrid, imperative):
            mha.set_weights(layer, weights)
        hybrid.hybridize()
        traces = _traces(hybrid)
        caches, outputs = [mha.LatentCache(), mha.LatentCache()], []
        for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):
            x = MX.from_numpy(X[:, start:stop])
            lengths = MX.from_numpy(np.minimum(valid_lens, stop))
            for i, layer in enumerate((hybrid, imperative)):
                output, caches[i] = layer(
                    x, lengths, causal=True, cache=caches[i], absorbed=absorbed
                )
                if i == 0:
                    outputs.append(MX.to_numpy(output))
            assert caches[0].latent.shape == (2, stop, 6)
            for hybrid_held, held in zip(*caches, strict=True):
                np.testing.assert_allclose(MX.to_numpy(hybrid_held), MX.to_numpy(held), atol=1e-12)
        assert_agrees(np.concatenate(outputs, axis=1), expected, "float64")
        assert hybrid.attention_weights.shape == (2, 2, 1, 7)
        assert traces == [mx.sym, mx.sym]  # the empty cache's graph, then one for every step


def test_learned_positional_encoding_hybridized_and_its_gradient(MX, mx):
    # P is the weight of Gluon's own Embedding: a Parameter, so the hybridized graph reads it
    # and autograd.record gives it a gradient. Expected: the imperative layer's numbers, and
    # for sum(output) the batch size in each entry of the first n rows of P, zeros after.
    layers = [MX.LearnedPositionalEncoding(D, max_len=10, dtype="float64") for _ in range(2)]
    assert isinstance(layers[0].embedding, mx.gluon.nn.Embedding)
    P = np.random.default_rng(8).standard_normal((10, D))
    for layer in layers:
        mha.set_weights(layer, {"P": P})
    layers[1].hybridize()
    X = np.random.default_rng(9).standard_normal((B, Q, D))
    results = []
    for layer in layers:
        with mx.autograd.record():
            output = layer(MX.from_numpy(X))
            total = output.sum()
        total.backward()
        results.append((MX.to_numpy(output), MX.to_numpy(layer.embedding.weight.grad())))
    assert layers[1]._cached_op is not None  # the graph really ran
    (output, grad), (hybrid_output, hybrid_grad) = results
    np.testing.assert_allclose(hybrid_output, output, rtol=0, atol=1e-12)
    assert_agrees(output, X + P[None, :Q], "float64")
    expected = np.zeros((10, D))
    expected[:Q] = B
    for gradient in (grad, hybrid_grad):
        np.testing.assert_array_equal(gradient, expected)


def test_hybridized_lazy_layer_infers_sizes(MX):
    layer, reference = pair(MX, "MultiHeadAttention", "float64")
    lazy = MX.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, bias=True, dtype="float64")
    lazy.hybridize()
    args = inputs("float64")
    lazy(*[MX.from_numpy(a) for a in args])
    assert mha.get_weights(lazy)["W_v"].shape == (V, NUM_HIDDENS)
    mha.set_weights(lazy, mha.get_weights(layer))
    output = lazy(*[MX.from_numpy(a) for a in args], valid_lens=MX.from_numpy(np.array([1] * B)))
    assert_agrees(MX.to_numpy(output), reference(*args, valid_lens=np.array([1] * B)), "float64")


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


@pytest.mark.parametrize(
    "name, hybridize",
    [
        ("MultiHeadAttention", False),
        ("MultiHeadAttention", True),
        ("DotProductAttention", False),
        ("DotProductAttention", True),
        ("function", False),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_of_at_least_one_leave_no_row_to_look_for(MX, monkeypatch, name, hybridize, causal):
    """Lengths of at least 1, alone or with the causal mask, keep key 0 in every row: an
    imperative call reads the mask for empty rows no more (the reads are counted here) and
    gives the reference's numbers; a length of 0 is looked for and gives a row of zeros. A
    hybridized graph, whose structure follows no values, looks for them whatever the lengths."""
    looks, look = [], MX._may_have_empty_rows

    def counted(attended):
        looks.append(attended)
        return look(attended)

    monkeypatch.setattr(MX, "_may_have_empty_rows", counted)
    if name == "function":
        layer, reference = MX.dot_product_attention, NP.dot_product_attention
        rng = np.random.default_rng(0)
        arrays = [rng.standard_normal((B, 2, n, 3)) for n in (Q, K, K)]
    else:
        layer, reference = pair(MX, name, "float64")
        arrays = inputs("float64")
        if hybridize:
            layer.hybridize()
    looked = []
    for lengths in ([1, 5, 3, 2], [1, 0, 3, 2]):
        call = {"valid_lens": np.array(lengths), "causal": causal}
        looks.clear()
        got = layer(*(MX.from_numpy(x) for x in arrays), **to_mx(MX, call))
        assert_agrees(MX.to_numpy(got), reference(*arrays, **call), "float64")
        looked.append(bool(looks))
    # Hybridized: the first call traces the graph, which looks; the second runs it again
    assert looked == ([True, False] if hybridize else [False, True])


def test_inputs_are_not_modified(MX):
    # Run imperatively, masks are added into the layer's own scores in place: never into an
    # argument
    layer, _ = pair(MX, "MultiHeadAttention", "float32")
    args = [MX.from_numpy(a) for a in inputs("float32")]
    arguments = to_mx(MX, cast_case(COMBINED, "float32"))
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
        assert_agrees(MX.to_numpy(output), reference(*args, **kwargs), "float64")
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


@pytest.mark.parametrize("hybridize", [False, True])
def test_cast_carries_the_dtype_and_the_constants(MX, hybridize):
    # Block.cast changes the parameters; the layer's dtype, its norms' and its constant
    # arrays follow, computed again in float64 (ALiBi's 12 slopes are not exact in float32)
    options = {"alibi": True, "rope_theta": 100.0, "qk_norm": "head", "value_size": V}
    reference = NP.MultiHeadAttention(24, 12, query_size=D, key_size=D, dtype="float64", **options)
    weights = mha.random_weights(reference, seed=6)
    mha.set_weights(reference, weights)
    layer = MX.MultiHeadAttention(24, 12, query_size=D, key_size=D, **options)
    layer.hybridize(hybridize)
    queries, keys, values = inputs("float32")
    layer(*(MX.from_numpy(x) for x in (queries, keys, values)), causal=True)
    layer.cast("float64")
    assert layer.dtype == "float64"
    mha.set_weights(layer, weights)
    queries, keys, values = (x.astype(np.float64) for x in (queries, keys, values))
    output = layer(*(MX.from_numpy(x) for x in (queries, keys, values)), causal=True)
    expected = reference(queries, keys, values, causal=True)
    assert_agrees(MX.to_numpy(output), expected, "float64")
    encoding = MX.PositionalEncoding(7, max_len=20)
    encoding.cast(np.float64)
    np.testing.assert_array_equal(
        MX.to_numpy(encoding.P), NP.PositionalEncoding(7, max_len=20, dtype="float64").P
    )
    with pytest.raises(ValueError, match="dtype must be one of"):
        encoding.cast("bfloat16")


def test_layer_config_of_every_layer(MX):
    assert MX.layer_config(MX.DotProductAttention(0.25, dtype="float64")) == {
        "dropout": 0.25,
        "dtype": "float64",
        "scale": None,
        "empty_rows": "zeros",
        "sliding_window": None,
        "softcap": None,
    }
    assert MX.layer_config(MX.PositionalEncoding(6, 0.1, 20)) == {
        "num_hiddens": 6,
        "dropout": 0.1,
        "max_len": 20,
        "dtype": "float32",
    }
    assert MX.layer_config(MX.LearnedPositionalEncoding(6, 0.1, 20, dtype="float16")) == {
        "num_hiddens": 6,
        "dropout": 0.1,
        "max_len": 20,
        "dtype": "float16",
    }
    assert MX.layer_config(MX.RotaryEmbedding(6, 500000.0, interleaved=True)) == {
        "num_hiddens": 6,
        "theta": 500000.0,
        "interleaved": True,
        "dtype": "float32",
        "rotary_dim": None,
        "scaling": None,
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
    assert_agrees(MX.to_numpy(output), reference(*args), "float32")


def test_mha_selects_gluon_blocks(MX, mx):
    with mha.use_backend("mxnet"):
        layer = mha.MultiHeadAttention(8, 2)
    assert isinstance(layer, mx.gluon.HybridBlock)
    assert {"W_q", "W_k", "W_v", "W_o", "attention"} <= set(layer._children)
    assert "w_v" in MX.AdditiveAttention(4)._children


def exported_causal(MX, mx, tmp_path, num_inputs, **options):
    """A hybridized layer exported after a causal call, its numpy twin, and the graph read
    back as a SymbolBlock taking `num_inputs` arrays (data0, data1, ...)."""
    sizes = dict(query_size=D, key_size=D, value_size=V)
    layer = MX.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, **sizes, **options)
    reference = NP.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, **sizes, **options)
    mha.set_weights(reference, mha.get_weights(layer))
    layer.hybridize()
    layer(*map(MX.from_numpy, inputs("float32")), causal=True)
    layer.export(str(tmp_path / "layer"))
    with mx.util.np_shape(True), mx.util.np_array(True):
        imported = mx.gluon.SymbolBlock.imports(
            str(tmp_path / "layer-symbol.json"),
            [f"data{i}" for i in range(num_inputs)],
            str(tmp_path / "layer-0000.params"),
        )
    return layer, reference, imported


def test_an_exported_graph_holds_no_position_of_the_traced_sizes(MX, mx, tmp_path):
    # Exported after a causal call, the graph's masks follow every other number of queries
    # and keys; one traced with alignment="bottom_right" would hold the traced K - Q: refused
    layer, reference, imported = exported_causal(MX, mx, tmp_path, num_inputs=3)
    with mx.util.np_shape(True), mx.util.np_array(True):
        for num_queries, num_keys in ((3, 5), (4, 9), (6, 6)):
            arrays = inputs("float32", num_queries, num_keys, seed=num_keys)
            output = imported(*map(MX.from_numpy, arrays))
            output = output[0] if isinstance(output, list | tuple) else output
            expected = reference(*arrays, causal=True)
            np.testing.assert_allclose(MX.to_numpy(output), expected, atol=1e-5)
    layer(*map(MX.from_numpy, inputs("float32")), causal=True, alignment="bottom_right")
    with pytest.raises(ValueError, match="bottom_right"):
        layer.export(str(tmp_path / "bottom_right"))


@pytest.mark.parametrize(
    "options", [{"rope_theta": 100.0}, {"alibi": True}], ids=["rotary", "alibi"]
)
def test_an_exported_rotary_or_alibi_graph_takes_its_constants_as_an_input(
    MX, mx, tmp_path, options
):
    # The frequencies (or slopes) are the graph's fourth input, data3, not a parameter; each
    # call hands them over for its number of keys, as backends.md says
    layer, reference, imported = exported_causal(MX, mx, tmp_path, num_inputs=4, **options)
    with mx.util.np_shape(True), mx.util.np_array(True):
        for num_queries, num_keys in ((3, 5), (6, 6)):
            arrays = inputs("float32", num_queries, num_keys, seed=num_keys)
            if "alibi" in options:
                constant = layer.alibi_slopes
            else:
                constant = layer.rotary.frequencies_at(num_keys, mx.cpu())
            output = imported(*map(MX.from_numpy, arrays), constant)
            output = output[0] if isinstance(output, list | tuple) else output
            expected = reference(*arrays, causal=True)
            np.testing.assert_allclose(MX.to_numpy(output), expected, atol=1e-5)
