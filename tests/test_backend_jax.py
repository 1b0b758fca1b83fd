"""What only the JAX backend promises: Flax NNX modules that run under nnx.jit and jax.jit with
the eager numbers, Flax's training flag and rngs, and float64 only in JAX's 64-bit mode.

Agreement with the reference (every layer, mask and dtype, gradients included) is
tests/test_agreement.py's, through mha.harness.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import mha
from agreement_cases import all_cases
from conftest import backend_module
from mha import harness
from mha.backends import numpy as N

pytestmark = pytest.mark.jax

B, Q, K, D, H = 2, 4, 6, 8, 2


@pytest.fixture(scope="module")
def J():
    return backend_module("jax")


@pytest.fixture(scope="module")
def jax():
    import jax

    return jax


@pytest.fixture(scope="module")
def nnx():
    from flax import nnx

    return nnx


def inputs(dtype="float64", seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, Q, D)).astype(dtype),
        rng.standard_normal((B, K, D)).astype(dtype),
        rng.standard_normal((B, K, D)).astype(dtype),
    )


def pair(J, dtype="float64"):
    """A JAX MultiHeadAttention and the reference with the same weights."""
    reference = N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D, dtype=dtype)
    layer = J.MultiHeadAttention(D, H, dtype=dtype)
    mha.set_weights(layer, mha.get_weights(reference))
    return layer, reference


CALLS = {
    "none": {},
    "valid_lens": {"valid_lens": np.array([0, 4])},
    "valid_lens_2d": {"valid_lens": np.array([[1, 2, 0, 6], [6, 5, 4, 3]])},
    "causal": {"causal": True},
    "mask_4d": {"mask": np.arange(H * K).reshape(1, H, 1, K) % 3 != 0},
    "window_additive": {
        "window_mask": np.where(np.eye(Q, K, dtype=bool), -np.inf, 0.5).reshape(1, Q, K)
    },
    "head_mask": {"head_mask": np.array([1.0, 0.0])},
    "no_weights": {"valid_lens": np.array([2, 0]), "need_weights": False},
}


def as_jax(J, kwargs):
    return {k: J.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("call", CALLS)
def test_nnx_jit_gives_the_eager_numbers_and_the_weights(J, nnx, call):
    layer, reference = pair(J)
    q, k, v = inputs()
    kwargs = CALLS[call]
    static = {key: value for key, value in kwargs.items() if not isinstance(value, np.ndarray)}
    arrays = {key: value for key, value in kwargs.items() if isinstance(value, np.ndarray)}

    @nnx.jit
    def run(layer, q, k, v, arrays):
        return layer(q, k, v, **arrays, **static)

    output = run(layer, J.from_numpy(q), J.from_numpy(k), J.from_numpy(v), as_jax(J, arrays))
    expected = reference(q, k, v, **kwargs)
    np.testing.assert_allclose(J.to_numpy(output), expected, rtol=0, atol=1e-12)
    if kwargs.get("need_weights", True):
        # nnx.jit carries the layer's new state, attention_weights included, out of the call
        np.testing.assert_allclose(
            J.to_numpy(layer.attention_weights), reference.attention_weights, atol=1e-12
        )
    else:
        assert layer.attention_weights is None


@pytest.mark.parametrize("need_weights", [True, False])
def test_nnx_jit_compiles_a_call_that_keeps_weights_twice_and_one_without_once(
    J, nnx, need_weights
):
    # docs/backends.md: the weights going from None to an array change the graph once
    layer, reference = pair(J)
    q, k, v = map(J.from_numpy, inputs())
    traced = []

    @nnx.jit
    def run(layer, q, k, v):
        traced.append(1)  # runs only while tracing
        return layer(q, k, v, need_weights=need_weights)

    for _ in range(4):
        output = run(layer, q, k, v)
    assert len(traced) == (2 if need_weights else 1)
    np.testing.assert_allclose(J.to_numpy(output), reference(*inputs()), atol=1e-12)


def test_jax_jit_over_split_and_merge(J, jax, nnx):
    # The functional style: the layer as (graphdef, state), the weights read from the state
    layer, reference = pair(J)
    q, k, v = inputs()
    graphdef, state = nnx.split(layer)

    @jax.jit
    def run(state, q, k, v, valid_lens):
        layer = nnx.merge(graphdef, state)
        output = layer(q, k, v, valid_lens=valid_lens)
        # attention_weights, None before the first call, changes the graph: return both
        return output, nnx.split(layer)

    lens = np.array([3, 1])
    output, split = run(state, *map(J.from_numpy, (q, k, v)), J.from_numpy(lens))
    np.testing.assert_allclose(J.to_numpy(output), reference(q, k, v, valid_lens=lens), atol=1e-12)
    layer = nnx.merge(*split)
    np.testing.assert_allclose(
        J.to_numpy(layer.attention_weights), reference.attention_weights, atol=1e-12
    )


def test_grouped_rotary_sliding_attention_under_nnx_jit(J, jax, nnx):
    # Llama-like: 4 query heads sharing 2 key-value heads, rotary embeddings, and a window
    config = {"num_kv_heads": 2, "rope_theta": 10000.0, "sliding_window": 3, "bias": True}
    reference = N.MultiHeadAttention(
        D, 4, query_size=D, key_size=D, value_size=D, dtype="float64", **config
    )
    layer = J.MultiHeadAttention(D, 4, dtype="float64", **config)
    mha.set_weights(layer, mha.get_weights(reference))
    assert mha.get_weights(layer)["W_k"].shape == (D, D // 2)
    q, k, v = inputs()
    lens = np.array([5, 2])
    x = tuple(map(J.from_numpy, (q, k, v)))

    def loss(layer, q, lens):
        return (layer(q, *x[1:], valid_lens=lens, causal=True) ** 2).sum()

    eager = J.to_numpy(layer(*x, valid_lens=J.from_numpy(lens), causal=True))
    expected = reference(q, k, v, valid_lens=lens, causal=True)
    np.testing.assert_allclose(eager, expected, rtol=0, atol=1e-12)
    eager_grads = nnx.grad(loss, argnums=(0, 1))(layer, x[0], J.from_numpy(lens))

    @nnx.jit
    def run(layer, q, k, v, lens):
        return layer(q, k, v, valid_lens=lens, causal=True)

    output = run(layer, *x, J.from_numpy(lens))
    np.testing.assert_allclose(J.to_numpy(output), eager, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        J.to_numpy(layer.attention_weights), reference.attention_weights, atol=1e-12
    )
    jit_grads = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(layer, x[0], J.from_numpy(lens))
    for got, want in zip(
        jax.tree_util.tree_leaves(jit_grads), jax.tree_util.tree_leaves(eager_grads), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)


def test_rotary_embedding_under_jit_at_two_offsets(J, jax, nnx):
    X = np.random.default_rng(2).standard_normal((B, H, Q, D))
    for interleaved in (False, True):
        reference = N.RotaryEmbedding(D, 100.0, interleaved=interleaved, dtype="float64")
        layer = J.RotaryEmbedding(D, 100.0, interleaved=interleaved, dtype="float64")
        # offset is a Python int: static under jit, one compilation per offset
        rotate = nnx.jit(lambda layer, X, offset: layer(X, offset), static_argnums=2)
        for offset in (0, 5):
            np.testing.assert_allclose(
                J.to_numpy(rotate(layer, J.from_numpy(X), offset)),
                reference(X, offset),
                rtol=0,
                atol=1e-12,
            )
        # The frequencies are a constant, not state
        assert jax.tree_util.tree_leaves(nnx.state(layer)) == []


def test_constant_tables_first_made_under_jit_stay_concrete(J, nnx):
    # A size met first inside jit: the cached table and frequencies are arrays, not tracers
    X = J.from_numpy(np.ones((1, 3, 6)))
    for layer in (
        J.PositionalEncoding(6, max_len=37, dtype="float64"),
        J.RotaryEmbedding(6, 37.0, dtype="float64"),
    ):
        jitted = nnx.jit(lambda layer, X: layer(X))(layer, X)
        np.testing.assert_allclose(J.to_numpy(layer(X)), J.to_numpy(jitted), rtol=0, atol=1e-12)


def test_every_layer_runs_under_nnx_jit(J, nnx):
    rng = np.random.default_rng(1)
    X = rng.standard_normal((B, Q, D))
    for name, args in (
        ("DotProductAttention", ()),
        ("AdditiveAttention", (5,)),
        ("PositionalEncoding", (D,)),
        ("AddNorm", (D,)),
    ):
        reference = getattr(N, name)(*args, dtype="float64")
        layer = getattr(J, name)(*args, dtype="float64")
        call = (X, X) if name == "AddNorm" else (X,) if name == "PositionalEncoding" else (X, X, X)
        expected = reference(*call)  # makes the reference's lazy weights
        weights = mha.get_weights(reference)
        if weights:
            mha.set_weights(layer, weights)
        output = nnx.jit(lambda layer, *xs: layer(*xs))(layer, *map(J.from_numpy, call))
        np.testing.assert_allclose(J.to_numpy(output), expected, atol=1e-12, err_msg=name)


def test_sizes_are_inferred_at_the_first_call_under_nnx_jit(J, nnx):
    layer = J.MultiHeadAttention(D, H, dtype="float64")
    q, k, v = inputs()
    nnx.jit(lambda layer, q, k, v: layer(q, k, v))(layer, *map(J.from_numpy, (q, k, v)))
    weights = mha.get_weights(layer)
    assert {name: w.shape for name, w in weights.items()} == {
        name: (D, D) for name in ("W_q", "W_k", "W_v", "W_o")
    }
    reference = N.MultiHeadAttention(D, H, dtype="float64")
    mha.set_weights(reference, weights)
    np.testing.assert_allclose(
        J.to_numpy(layer(*map(J.from_numpy, (q, k, v)))), reference(q, k, v), atol=1e-12
    )


def test_value_checks_run_eagerly_and_shape_checks_always(J, nnx):
    layer, _ = pair(J)
    q, k, v = map(J.from_numpy, inputs())
    with pytest.raises(ValueError, match="valid_lens must be non-negative"):
        layer(q, k, v, valid_lens=J.from_numpy(np.array([2, -1])))
    jitted = nnx.jit(lambda layer, q, k, v, lens: layer(q, k, v, valid_lens=lens))
    # Under jit the values are not known: a negative length keeps no key, as length 0 does
    output = jitted(layer, q, k, v, J.from_numpy(np.array([2, -1])))
    zero = jitted(layer, q, k, v, J.from_numpy(np.array([2, 0])))
    np.testing.assert_array_equal(J.to_numpy(output), J.to_numpy(zero))
    with pytest.raises(ValueError, match="valid_lens"):
        jitted(layer, q, k, v, J.from_numpy(np.array([1, 2, 3])))


def test_training_flag_and_rngs(J, nnx):
    q, k, v = map(J.from_numpy, inputs("float32"))

    def layer(seed):
        return J.MultiHeadAttention(D, H, dropout=0.5, rngs=nnx.Rngs(seed))

    a, b = layer(0), layer(0)
    # A new layer trains, as in Flax: dropout draws from its rngs, the same for the same seed
    out_a, out_b = a(q, k, v), b(q, k, v)
    np.testing.assert_array_equal(J.to_numpy(out_a), J.to_numpy(out_b))
    assert not np.allclose(J.to_numpy(a(q, k, v)), J.to_numpy(out_a))  # a new draw per call
    a.eval()
    first, second = J.to_numpy(a(q, k, v)), J.to_numpy(a(q, k, v))
    np.testing.assert_array_equal(first, second)
    reference = N.MultiHeadAttention(D, H, dtype="float32")
    mha.set_weights(reference, mha.get_weights(a))
    np.testing.assert_allclose(first, reference(*map(np.asarray, (q, k, v))), atol=2e-6)
    # attention_weights are taken before dropout: training, they are eval's (the reference's)
    a.train()
    a(q, k, v)
    np.testing.assert_allclose(
        J.to_numpy(a.attention_weights), reference.attention_weights, atol=2e-6
    )
    # Without rngs a layer draws from nnx.Rngs(0): the same weights every time
    sizes = {"query_size": D, "key_size": D, "value_size": D}
    weights = [mha.get_weights(J.MultiHeadAttention(D, H, **sizes)) for _ in range(2)]
    np.testing.assert_array_equal(weights[0]["W_q"], weights[1]["W_q"])
    other = mha.get_weights(J.MultiHeadAttention(D, H, **sizes, rngs=nnx.Rngs(1)))
    assert not np.array_equal(weights[0]["W_q"], other["W_q"])


def test_a_layer_without_dropout_keeps_no_random_stream(J, jax, nnx):
    q, k, v = map(J.from_numpy, inputs("float32"))
    sizes = {"query_size": D, "key_size": D, "value_size": D}
    latent = {"kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4}
    kinds = {
        "MultiHeadAttention": lambda rate, rngs: J.MultiHeadAttention(
            D, H, dropout=rate, **sizes, rngs=rngs
        ),
        "AdditiveAttention": lambda rate, rngs: J.AdditiveAttention(
            D, rate, query_size=D, key_size=D, rngs=rngs
        ),
        "MultiHeadLatentAttention": lambda rate, rngs: J.MultiHeadLatentAttention(
            D, H, **latent, dropout=rate, rngs=rngs
        ),
    }
    for name, make in kinds.items():
        quiet, dropping = make(0.0, nnx.Rngs(3)), make(0.5, nnx.Rngs(3))
        # nnx's transforms carry a layer's random streams through every call: none to carry
        assert not jax.tree.leaves(nnx.state(quiet, nnx.RngState)), name
        assert jax.tree.leaves(nnx.state(dropping, nnx.RngState)), name
        # The same seed gives the same weights whatever the rate
        quiet_weights, dropping_weights = mha.get_weights(quiet), mha.get_weights(dropping)
        assert quiet_weights.keys() == dropping_weights.keys()
        for key in quiet_weights:
            np.testing.assert_array_equal(quiet_weights[key], dropping_weights[key])
    # Training at rate 0 draws nothing: the output is eval's, under nnx.jit too
    layer = kinds["MultiHeadAttention"](0.0, nnx.Rngs(3))
    jitted = nnx.jit(lambda layer, q, k, v: layer(q, k, v))
    trained = J.to_numpy(jitted(layer, q, k, v))
    layer.eval()
    np.testing.assert_allclose(trained, J.to_numpy(jitted(layer, q, k, v)), rtol=1e-6, atol=1e-7)
    for make in (lambda: J.PositionalEncoding(D, 0.0), lambda: J.AddNorm(D, 0.0)):
        assert not jax.tree.leaves(nnx.state(make(), nnx.RngState))
    # A rate raised later has no stream: Flax asks for one, and one given to it draws
    layer.train()
    layer.attention.dropout.rate = 0.5
    with pytest.raises(ValueError, match="rngs"):
        layer(q, k, v)
    layer.attention.dropout.rngs = nnx.Rngs(dropout=1).dropout.fork()
    first, second = (J.to_numpy(layer(q, k, v)) for _ in range(2))
    assert not np.allclose(first, trained) and not np.allclose(first, second)


def test_gradients_through_every_mask_are_finite_under_jit(J, jax, nnx):
    layer, _ = pair(J)
    q, k, v = map(J.from_numpy, inputs())
    for call in CALLS.values():
        arrays = as_jax(J, call)

        @nnx.jit
        def grads(layer, q, arrays=arrays):
            def loss(layer, q):
                return layer(q, k, v, **arrays).sum()

            return nnx.grad(loss, argnums=(0, 1))(layer, q)

        layer_grads, q_grad = grads(layer, q)
        assert np.isfinite(J.to_numpy(q_grad)).all()
        for leaf in jax.tree_util.tree_leaves(nnx.state(layer_grads, nnx.Param)):
            assert np.isfinite(np.asarray(leaf)).all()


def test_a_nan_at_a_masked_key_stays_out(J):
    layer, reference = pair(J)
    q, k, v = inputs()
    poisoned = k.copy()
    poisoned[0, 5] = np.nan
    for kwargs in ({"valid_lens": np.array([5, 6])}, {"mask": np.arange(K) < 5}):
        output = J.to_numpy(layer(*map(J.from_numpy, (q, poisoned, v)), **as_jax(J, kwargs)))
        np.testing.assert_allclose(output, reference(q, k, v, **kwargs), atol=1e-12)


@pytest.mark.parametrize("kind", ["multihead", "dot", "function"])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_of_at_least_one_leave_no_row_to_look_for(J, monkeypatch, kind, causal):
    """Lengths of at least 1, alone or with the causal mask, keep key 0 in every row: an
    eager call looks for no empty row (what the softmax is told is recorded here) and gives
    the reference's numbers; a length of 0 is looked for and gives a row of zeros."""
    told, softmax = [], J._softmax

    def recorded(scores, keep, empty_rows="zeros", rows_kept=False):
        told.append(rows_kept)
        return softmax(scores, keep, empty_rows, rows_kept)

    monkeypatch.setattr(J, "_softmax", recorded)
    if kind == "multihead":
        layer, reference = pair(J)
        arrays = inputs()
    elif kind == "dot":
        layer, reference = (
            J.DotProductAttention(dtype="float64"),
            N.DotProductAttention(dtype="float64"),
        )
        arrays = inputs()
    else:
        layer, reference = J.dot_product_attention, N.dot_product_attention
        arrays = tuple(x.reshape(B, -1, H, D // H).swapaxes(1, 2) for x in inputs())
    for lengths, kept in (([1, 6], True), ([0, 6], False)):
        call = {"valid_lens": np.array(lengths), "causal": causal}
        told.clear()
        got = layer(*map(J.from_numpy, arrays), **as_jax(J, call))
        np.testing.assert_allclose(J.to_numpy(got), reference(*arrays, **call), atol=1e-12)
        assert told == [kept], (lengths, told)


def test_state_holds_the_weights_and_not_the_table(J, nnx):
    layer, _ = pair(J)
    params = nnx.state(layer, nnx.Param)
    assert len(jax_leaves(params)) == 4
    encoding = J.PositionalEncoding(D, max_len=50, dtype="float64")
    assert jax_leaves(nnx.state(encoding, nnx.Param)) == []
    assert encoding.P.shape == (1, 50, D)


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_bfloat16_runs_close_to_the_reference(J):
    layer, reference = pair(J, "float32")
    bf16 = J.MultiHeadAttention(D, H, dtype="bfloat16")
    weights = mha.get_weights(layer)
    mha.set_weights(
        bf16,
        {
            name: w.astype(J.to_numpy(J.from_numpy(w).astype("bfloat16")).dtype)
            for name, w in weights.items()
        },
    )
    q, k, v = inputs("float32")
    output = bf16(*(J.from_numpy(x).astype("bfloat16") for x in (q, k, v)))
    assert str(output.dtype) == "bfloat16"
    np.testing.assert_allclose(
        np.asarray(output, dtype=np.float32), reference(q, k, v), atol=0.1, rtol=0.05
    )


def test_a_float64_layer_called_after_64_bit_mode_is_turned_off_is_an_error():
    """Made in 64-bit mode, then called without it: every layer refuses, where JAX would
    compute the call in float32 and the layer would still say float64."""
    code = """
import jax
import numpy as np
from mha.backends import jax as J
x = np.ones((1, 3, 8))
layers = {
    "MultiHeadAttention": (J.MultiHeadAttention(8, 2, query_size=8, dtype="float64"), (x, x, x)),
    "DotProductAttention": (J.DotProductAttention(dtype="float64"), (x, x, x)),
    "AdditiveAttention": (J.AdditiveAttention(4, query_size=8, key_size=8, dtype="float64"),
                          (x, x, x)),
    "PositionalEncoding": (J.PositionalEncoding(8, dtype="float64"), (x,)),
    "AddNorm": (J.AddNorm(8, dtype="float64"), (x, x)),
}
jax.config.update("jax_enable_x64", False)
for name, (layer, arguments) in layers.items():
    try:
        layer(*arguments)
    except ValueError as error:
        assert "jax_enable_x64" in str(error), (name, error)
    else:
        raise AssertionError(f"{name}: float64 without 64-bit mode was accepted")
print("ok")
"""
    environment = {**os.environ, "JAX_ENABLE_X64": "1"}
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=False
    )
    assert completed.stdout.strip() == "ok", completed.stderr[-2000:]


def test_float64_without_64_bit_mode_is_an_error():
    """A float64 layer, array, or numpy float64 input of the functions (which JAX's own
    functions take and compute in float32) is refused."""
    # A fresh process: JAX reads its mode when it is first imported
    code = """
import numpy as np
from mha.backends import jax as J
layer = J.MultiHeadAttention(8, 2, query_size=8, dtype="float32")
x = J.from_numpy(np.ones((1, 3, 8), "float32"))
assert layer(x, x, x).dtype == np.float32
q = np.ones((1, 2, 3, 4))
for make in (lambda: J.MultiHeadAttention(8, 2, dtype="float64"),
             lambda: J.from_numpy(np.ones(3)),
             lambda: J.dot_product_attention(q, q, q),
             lambda: J.masked_softmax(np.ones((2, 3, 4)), np.array([1, 2]))):
    try:
        make()
    except ValueError as error:
        assert "jax_enable_x64" in str(error), error
    else:
        raise AssertionError("float64 without 64-bit mode was accepted")
print("ok")
"""
    environment = {**os.environ, "JAX_ENABLE_X64": "0"}
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
    )
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stderr[-3000:]


def test_64_bit_integers_without_64_bit_mode_keep_their_meaning():
    """Without 64-bit mode JAX holds numpy's int64 as int32, wrapping 2**40 to 0: numpy's
    lengths past int32 still keep every key (as the NumPy reference's), and an id or an array
    that JAX would wrap into another number is an error."""
    code = """
import numpy as np
from mha.backends import jax as J, numpy as N
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 3, 8)).astype("float32")
for lengths in (np.array([2**40, 1]), np.array([2**32 + 1, 2]), np.array([2**63, 1], "uint64")):
    expected = N.DotProductAttention()(x, x, x, lengths)
    output = J.DotProductAttention()(*map(J.from_numpy, (x, x, x)), lengths)
    assert np.abs(np.asarray(output) - expected).max() < 1e-6, (lengths, output, expected)
    softmax = J.masked_softmax(J.from_numpy(x), lengths)
    assert np.abs(np.asarray(softmax) - N.masked_softmax(x, lengths)).max() < 1e-6
layer = J.MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8)
X = J.from_numpy(x)
for call in (lambda: J.from_numpy(np.array([2**31, 1])),
             lambda: layer(X, X, X, segment_ids=np.array([[2**32 + 1, 1, 1]] * 2))):
    try:
        call()
    except ValueError as error:
        assert "jax_enable_x64" in str(error) and "past the range of int32" in str(error), error
    else:
        raise AssertionError("a value JAX wraps was accepted")
assert J.from_numpy(np.array([2**31 - 1])).item() == 2**31 - 1
print("ok")
"""
    environment = {**os.environ, "JAX_ENABLE_X64": "0"}
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=False
    )
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stderr[-3000:]


def test_query_scaling_past_int32_without_64_bit_mode_is_computed():
    """query_scaling's offset and original length were Python ints JAX parsed as int32
    without 64-bit mode: an OverflowError at 2**40. Up to 2**50 they give the reference's
    numbers (positions are counted in float32 there, as in every backend)."""
    code = """
import mha
import numpy as np
from mha.backends import jax as J, numpy as N
scaling = {"beta": 0.5, "original_max_position_embeddings": 2**40, "position_offset": 2**50}
X = np.random.default_rng(9).standard_normal((1, 3, 8)).astype("float32")
reference, layer = (m.MultiHeadAttention(8, 2, query_scaling=scaling) for m in (N, J))
reference(X, X, X)
layer(X, X, X)
mha.set_weights(layer, mha.get_weights(reference))
difference = np.abs(np.asarray(layer(X, X, X, causal=True)) - reference(X, X, X, causal=True))
assert difference.max() < 1e-6, difference.max()
print("ok")
"""
    environment = {**os.environ, "JAX_ENABLE_X64": "0"}
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=False
    )
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stderr[-3000:]


def test_packed_positions_past_int32_without_64_bit_mode_are_refused():
    """A packed row's positions (segment_ids) with an alignment or window past int32 wrapped
    in JAX's int32 without 64-bit mode: keys kept where every query comes before every key,
    and an OverflowError inside. They are refused by name, as unpacked ones are; a window
    side that int32 holds is taken, against the NumPy reference."""
    code = """
import numpy as np
from mha.backends import jax as J
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, 4, 8)).astype("float32") for _ in range(3))
packed = {"segment_ids": np.array([[0, 0, 1, 1]])}
for options in ({"causal": True, "alignment": -(2**31) + 1}, {"causal": True, "alignment": 2**40},
                {"window": 2**40}):
    try:
        J.dot_product_attention(q, k, v, **packed, **options)
    except ValueError as error:
        assert "int32's range" in str(error) and "jax_enable_x64" in str(error), error
    else:
        raise AssertionError(f"{options} was accepted")
# A packed window's side is compared with positions within segments: int32's largest fits
from mha.backends import numpy as N
for window in ((2**31 - 1, 0), 2**31):
    output = J.dot_product_attention(q, k, v, **packed, window=window)
    expected = N.dot_product_attention(q, k, v, **packed, window=window)
    assert np.abs(np.asarray(output) - expected).max() < 1e-6, window
print("ok")
"""
    environment = {**os.environ, "JAX_ENABLE_X64": "0"}
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=False
    )
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stderr[-3000:]


def test_float16_products_are_summed_in_float32_with_xlas_own_flags(J):
    """jax 0.7.1's CPU sums float16 products in float16 at XLA's default optimization, which
    the lanes turn off (lanes.QUICK_XLA): a fresh process with XLA's flags as users have them,
    the function over 4,096 keys and a layer's projections, against the float64 formula."""
    code = """
import numpy as np
from mha.backends import jax as J
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, n, 64)) for n in (1, 4096, 4096))
q, k, v = (x.astype("float16") for x in (q, k, v + 3))
exact = [x.astype("float64") for x in (q, k, v)]
scores = exact[0] @ exact[1].swapaxes(-1, -2) / 8.0
weights = np.exp(scores - scores.max(-1, keepdims=True))
expected = weights / weights.sum(-1, keepdims=True) @ exact[2]
output = np.asarray(J.dot_product_attention(*map(J.from_numpy, (q, k, v))), "float64")
error = np.abs(output - expected).max() / np.abs(expected).max()
assert error <= 2e-3, ("function", error)
X = (rng.standard_normal((4, 64, 1024)) + 3).astype("float16")
W = (rng.standard_normal((1024, 1024)) / 32).astype("float16")
expected = X.astype("float64") @ W.astype("float64")
output = np.asarray(J._matmul(J.from_numpy(X), J.from_numpy(W)), "float64")
error = np.abs(output - expected).max() / np.abs(expected).max()
assert error <= 2e-3, ("projection", error)
print("ok")
"""
    environment = {**os.environ}
    environment.pop("XLA_FLAGS", None)
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=False
    )
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stderr[-3000:]


@pytest.mark.slow
def test_the_case_matrix_agrees_in_jax_default_mode(J):
    """The suite turns JAX's 64-bit mode on; its users mostly have it off (JAX's default),
    where JAX holds numpy's int64 as int32 and refuses float64: `mha compare` there, float32,
    every case of the matrix against the reference. XLA's flags are its defaults too (the
    lanes compile without LLVM's optimizations, lanes.QUICK_XLA)."""
    environment = {**os.environ, "JAX_ENABLE_X64": "0"}
    environment.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "mha", "compare", "--backends", "numpy,jax"]
    completed = subprocess.run(
        command, capture_output=True, text=True, env=environment, check=False
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "comparisons agree on numpy, jax." in completed.stdout, completed.stdout[-3000:]


def test_cached_decoding_under_nnx_jit_gives_full_causal_attention(J, nnx):
    # Llama- and Mistral-like: a prompt of 3 positions, then one position per jitted call
    config = dict(
        num_hiddens=D,
        num_heads=4,
        bias=True,
        query_size=D,
        key_size=D,
        value_size=D,
        num_kv_heads=2,
        rope_theta=100.0,
        sliding_window=3,
        dtype="float64",
    )
    reference = N.MultiHeadAttention(**config)
    layer = J.MultiHeadAttention(**config)
    mha.set_weights(layer, mha.get_weights(reference))
    X = np.random.default_rng(3).standard_normal((B, 7, D))
    expected = reference(X, X, X, causal=True)

    # KVCache is a pytree: it goes in and comes out of nnx.jit, one trace per cached length
    @nnx.jit
    def step(layer, x, cache):
        return layer(x, x, x, causal=True, cache=cache)

    cache, outputs = mha.KVCache(), []
    for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):
        output, cache = step(layer, J.from_numpy(X[:, start:stop]), cache)
        outputs.append(J.to_numpy(output))
        # The cache holds the 2 key-value heads, not the 4 query heads they are repeated to
        assert cache.keys.shape == cache.values.shape == (B, 2, stop, D // 4)
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, rtol=0, atol=1e-10)
    # The last call's weights are the last query's row of the full attention
    np.testing.assert_allclose(
        J.to_numpy(layer.attention_weights),
        reference.attention_weights[:, :, -1:],
        rtol=0,
        atol=1e-10,
    )


def test_learned_positional_encoding_trains_its_rows_under_nnx_jit(J, jax, nnx):
    layer = J.LearnedPositionalEncoding(D, max_len=10, dtype="float64")
    # P is the one parameter, held by flax's Embed, and the canonical weight "P"
    (table,) = jax.tree_util.tree_leaves(nnx.state(layer, nnx.Param))
    assert table.shape == (10, D)
    np.testing.assert_array_equal(mha.get_weights(layer)["P"], J.to_numpy(table))
    X = J.from_numpy(np.random.default_rng(4).standard_normal((3, Q, D)))

    @nnx.jit
    def grads(layer, X):
        return nnx.grad(lambda layer: layer(X).sum())(layer)

    # Row i is added to each example's position i: its gradient is the batch size for the
    # first Q rows, and the rows of positions not seen get none
    (gradient,) = jax.tree_util.tree_leaves(nnx.state(grads(layer, X), nnx.Param))
    expected = np.zeros((10, D))
    expected[:Q] = 3.0
    np.testing.assert_array_equal(np.asarray(gradient), expected)


# JAX's own transforms of a closure over a layer, as with Flax's nnx.MultiHeadAttention: the
# layer cannot change under them, and gives the eager numbers
TRANSFORMS = ["jit", "grad", "value_and_grad", "vmap", "export"]


def _closure(layer, k, v, kwargs):
    return lambda q: layer(q, k, v, **kwargs)


def _reference_gradient(reference, q, k, v, kwargs, step=1e-6):
    # Central differences of sum(output) over each query entry, in float64
    gradient = np.zeros_like(q)
    for index in np.ndindex(q.shape):
        up, down = q.copy(), q.copy()
        up[index] += step
        down[index] -= step
        gradient[index] = (
            reference(up, k, v, **kwargs).sum() - reference(down, k, v, **kwargs).sum()
        ) / (2 * step)
    return gradient


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_jax_transforms_of_a_closure_give_the_eager_numbers(J, jax, transform, call):
    layer, reference = pair(J)
    q, k, v = inputs()
    kwargs = CALLS[call]
    f = _closure(layer, J.from_numpy(k), J.from_numpy(v), as_jax(J, kwargs))
    expected = reference(q, k, v, **kwargs)
    if transform == "jit":
        got = jax.jit(f)(J.from_numpy(q))
    elif transform == "vmap":
        # Two batches stacked on a new leading axis, the second the first reversed
        stacked = np.stack([q, q[::-1]])
        got = jax.vmap(f)(J.from_numpy(stacked))
        np.testing.assert_allclose(
            J.to_numpy(got[1]), reference(q[::-1], k, v, **kwargs), rtol=0, atol=1e-12
        )
        got = got[0]
    elif transform == "export":
        from jax import export

        exported = export.export(jax.jit(f))(J.from_numpy(q))
        got = exported.call(J.from_numpy(q))
    else:
        total = lambda q: f(q).sum()  # noqa: E731
        if transform == "grad":
            got = jax.grad(total)(J.from_numpy(q))
        else:
            value, got = jax.value_and_grad(total)(J.from_numpy(q))
            np.testing.assert_allclose(float(value), expected.sum(), rtol=0, atol=1e-12)
        expected = _reference_gradient(reference, q, k, v, kwargs)
        np.testing.assert_allclose(J.to_numpy(got), expected, rtol=0, atol=1e-7)
        return
    np.testing.assert_allclose(J.to_numpy(got), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
def test_attention_weights_keep_the_last_eager_call_under_a_transform(J, jax, transform):
    # The layer cannot change under jax's transforms: it keeps the eager call's weights, a
    # concrete array (never a leaked tracer)
    layer, reference = pair(J)
    q, k, v = inputs()
    layer(*map(J.from_numpy, (q, k, v)))
    reference(q, k, v)
    f = _closure(layer, J.from_numpy(k), J.from_numpy(v), {"causal": True})
    other = J.from_numpy(q[::-1])
    if transform == "jit":
        jax.jit(f)(other)
    elif transform == "grad":
        jax.grad(lambda q: f(q).sum())(other)
    else:
        jax.vmap(f)(other[None])
    np.testing.assert_allclose(
        J.to_numpy(layer.attention_weights), reference.attention_weights, rtol=0, atol=1e-12
    )


ARITY = {
    "DotProductAttention": 3,
    "AdditiveAttention": 3,
    "PositionalEncoding": 1,
    "AddNorm": 2,
    "RotaryEmbedding": 1,
    "LearnedPositionalEncoding": 1,
}


@pytest.mark.parametrize("name", ARITY)
def test_every_layer_runs_under_jax_jit_and_grad(J, jax, nnx, name):
    # The closure's numbers are the eager call's, and its gradient nnx.grad's
    X = J.from_numpy(np.random.default_rng(2).standard_normal((B, Q, D)))
    args = (5,) if name == "AdditiveAttention" else () if name == "DotProductAttention" else (D,)
    layer = getattr(J, name)(*args, dtype="float64")
    eager = J.to_numpy(layer(*[X] * ARITY[name]))
    f = lambda x: layer(*[x] * ARITY[name])  # noqa: E731
    np.testing.assert_allclose(J.to_numpy(jax.jit(f)(X)), eager, rtol=0, atol=1e-12)
    gradient = jax.grad(lambda x: f(x).sum())(X)
    expected = nnx.grad(lambda layer, x: layer(*[x] * ARITY[name]).sum(), argnums=1)(layer, X)
    np.testing.assert_allclose(J.to_numpy(gradient), J.to_numpy(expected), rtol=0, atol=1e-12)


def test_no_case_of_the_matrix_reads_a_value_while_traced(J, jax, nnx):
    """Every case of the agreement matrix (every layer, mask, option and the function), its
    gradient traced by jax.make_jaxpr (no compile) with the weights and every tensor of the
    call as traced arguments: a read of a value raises while tracing, where an eager call on a
    GPU would wait for the device; and the program closes over no array on a device (the
    rotary frequencies, ALiBi's slopes, the sinusoid table), which building it would read
    back to the host."""
    failed = []
    for case in all_cases():
        prepared = harness.prepare(case, dtype="float32", gradients=False)
        run = prepared.case
        layer = harness.build_layer("jax", run, prepared.config, prepared.weights)
        graph, params, rest = nnx.split(layer, nnx.Param, ...) if layer else (None, {}, None)
        arrays = {k: v for k, v in prepared.inputs.items() if isinstance(v, np.ndarray)}
        wrt = {k: J.from_numpy(arrays[k]) for k in harness.differentiable(run)}
        others = {k: J.from_numpy(v) for k, v in arrays.items() if k not in wrt}
        static = {k: v for k, v in prepared.inputs.items() if k not in arrays}

        def loss(params, wrt, others, run=run, graph=graph, rest=rest, static=static):
            called = None if graph is None else nnx.merge(graph, params, rest)
            tensors = {**wrt, **others, **static}
            return harness.call_layer(J, run, called, tensors).sum()

        try:
            program = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, wrt, others)
        except Exception as error:  # each case's failure named, not the first alone
            failed.append(f"{case}: {type(error).__name__}: {error}")
            continue
        on_a_device = [c.shape for c in program.consts if isinstance(c, jax.Array)]
        if on_a_device:
            failed.append(f"{case}: closes over arrays on a device, shaped {on_a_device}")
    assert not failed, "\n".join(failed)


def test_a_lazy_layer_first_called_under_jax_jit_is_a_clear_error(J, jax):
    layer = J.MultiHeadAttention(D, H, dtype="float64")
    q, k, v = map(J.from_numpy, inputs())
    with pytest.raises(ValueError, match="lazy layer takes them at its first call"):
        jax.jit(lambda q: layer(q, k, v))(q)
    # Nothing changed: the first eager call still infers the sizes
    assert layer(q, k, v).shape == (B, Q, D)
    assert jax.jit(lambda q: layer(q, k, v))(q).shape == (B, Q, D)


def _products(jax, call, *arrays):
    """The lines of call's lowered program that multiply matrices."""
    text = jax.jit(call).lower(*arrays).as_text()
    return [line for line in text.splitlines() if "dot_general" in line]


# Every call that multiplies matrices
PRODUCT_CALLS = (
    "MultiHeadAttention",
    "DotProductAttention",
    "AdditiveAttention",
    "latent_expanded",
    "latent_absorbed",
    "dot_product_attention",
)


@pytest.mark.parametrize("kind", PRODUCT_CALLS)
def test_float32_products_run_at_full_precision_unless_jax_is_told_otherwise(J, jax, kind):
    # A CPU computes float32 exactly anyway: the lowered program shows the policy, which keeps
    # XLA's TF32 default on GPUs away, in every call that multiplies matrices
    latent = {"kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4}
    calls = {
        "MultiHeadAttention": lambda q: J.MultiHeadAttention(
            D, H, query_size=D, key_size=D, value_size=D
        )(q, q, q),
        "DotProductAttention": lambda q: J.DotProductAttention()(q, q, q),
        "AdditiveAttention": lambda q: J.AdditiveAttention(D, query_size=D, key_size=D)(q, q, q),
        "latent_expanded": lambda q: J.MultiHeadLatentAttention(D, H, **latent)(q),
        "latent_absorbed": lambda q: J.MultiHeadLatentAttention(D, H, **latent)(q, absorbed=True),
        "dot_product_attention": lambda q: J.dot_product_attention(q, q, q),
    }
    shape = (B, H, Q, D) if kind == "dot_product_attention" else (B, Q, D)
    q = J.from_numpy(np.ones(shape, "float32"))
    products = _products(jax, calls[kind], q)
    assert products, kind
    assert all("precision = [HIGHEST, HIGHEST]" in line for line in products), kind
    # The user's own precision is taken instead, in every product
    with jax.default_matmul_precision("tensorfloat32"):
        chosen = _products(jax, calls[kind], q)
    assert len(chosen) == len(products)
    assert not any("HIGHEST" in line for line in chosen), kind


def test_the_layer_makes_six_products(J, jax):
    # Four projections, the scores, and the weights times values: none escapes the rule above
    layer = J.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D)
    q = J.from_numpy(np.ones((B, Q, D), "float32"))
    assert len(_products(jax, lambda q: layer(q, q, q), q)) == 6


def test_a_traced_fractional_length_keeps_the_keys_below_it(J, jax):
    # Unchecked under jit, 0.5 keeps one key and 2.5 three, as TensorFlow's tf.function and
    # torch's traces keep them (backends.md); an int32 cast would have dropped one
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, n, 4)).astype("float32") for n in (3, 5, 5))
    lengths = np.array([0.5, 2.5], "float32")
    call = jax.jit(lambda *arrays: J.DotProductAttention()(*arrays[:3], valid_lens=arrays[3]))
    output = call(*map(J.from_numpy, (q, k, v, lengths)))
    expected = N.DotProductAttention()(q, k, v, valid_lens=np.ceil(lengths))
    np.testing.assert_allclose(J.to_numpy(output), expected, rtol=1e-5, atol=1e-6)
