"""JAX's cuDNN path (mha/backends/jax_fused.py) on the CPU: which calls may take it, and that
its steps around the kernel keep a masked key's NaN out and zero a row with no key even when
the mask is added to the scores as a large negative number, as cuDNN adds it (here XLA's
function stands in for the kernel, which needs a GPU; the GPU lane runs the kernel itself),
and that a prefix of the keys reaches it as sequence lengths, any other key padding as a
mask."""

from __future__ import annotations

import numpy as np
import pytest

import mha
from conftest import backend_module

pytestmark = pytest.mark.jax


@pytest.fixture
def modules():
    backend_module("jax")
    import jax.numpy as jnp

    from mha.backends import jax_fused

    return jnp, jax_fused


def test_which_calls_may_take_cudnn(modules):
    jnp, fused = modules
    q = jnp.zeros((2, 4, 8, 16), jnp.bfloat16)
    padding = jnp.ones((2, 1, 1, 8), bool)
    per_query = jnp.ones((1, 1, 8, 8), bool)
    plain = dict(causal_alone=False, others=False, dropping=False, empty_rows="zeros")

    def may(queries=q, values=q, keep=None, **changes):
        return fused.may_fuse(queries, values, keep, **{**plain, **changes})

    assert may() and may(keep=padding) and may(q.astype(jnp.float16))
    assert may(keep=per_query, causal_alone=True)  # the causal mask, as cuDNN's own
    # A mask that varies by query or head would be added to a NaN key's score
    assert not may(keep=per_query) and not may(keep=jnp.ones((2, 4, 1, 8), bool))
    assert not may(q.astype(jnp.float32))  # cuDNN's kernels: float16 and bfloat16 only
    assert not may(others=True) and not may(dropping=True)  # weights, lse, bias, dropout ...
    assert not may(empty_rows="uniform")
    assert not may(values=jnp.zeros((2, 4, 8, 12), jnp.bfloat16))  # a value size of its own
    assert not may(q[0])  # four axes, as cuDNN takes them
    assert not may(jnp.zeros((2, 4, 8, 12), jnp.bfloat16), jnp.zeros((2, 4, 8, 12), jnp.bfloat16))
    assert not may(jnp.zeros((2, 4, 8, 256), jnp.bfloat16), jnp.zeros((2, 4, 8, 256), jnp.bfloat16))
    # Head sizes up to 128 inclusive, the largest cuDNN takes on every GPU
    sized = {n: jnp.zeros((2, 4, 8, n), jnp.bfloat16) for n in (0, 8, 128, 136)}
    assert may(sized[8], sized[8]) and may(sized[128], sized[128])
    assert not may(sized[136], sized[136])
    assert not may(sized[0], sized[0])  # 0 is a multiple of 8, and a size no kernel takes


def _added_mask(real, routes=None):
    """jax.nn.dot_product_attention as cuDNN computes it: XLA's, with a boolean mask, or the
    one its sequence lengths make, added to the scores as a large negative number (JAX's
    combine_bias_and_mask), whatever the masked keys hold. `routes`, a list, gets "lengths"
    or "mask" for each call as it runs (not as it is traced: of a jax.lax.cond's two branches,
    only the one taken)."""
    import jax
    import jax.numpy as jnp

    def kernel(
        query,
        key,
        value,
        *,
        mask=None,
        implementation=None,
        query_seq_lengths=None,
        key_value_seq_lengths=None,
        **options,
    ):
        assert implementation == "cudnn"
        if key_value_seq_lengths is not None:
            # Shape of mask: (batch, 1, Q, K), True where both positions are within the lengths
            queries = jnp.arange(query.shape[1]) < query_seq_lengths[:, None]
            keys = jnp.arange(key.shape[1]) < key_value_seq_lengths[:, None]
            mask = (queries[:, :, None] & keys[:, None, :])[:, None]
        if routes is not None:
            route = "mask" if key_value_seq_lengths is None else "lengths"
            jax.debug.callback(lambda: routes.append(route))
        bias = None if mask is None else jnp.where(mask, 0.0, -0.7 * jnp.finfo(query.dtype).max)
        return real(
            query,
            key,
            value,
            bias=None if bias is None else bias.astype(query.dtype),
            implementation="xla",
            **options,
        )

    return kernel


def _run(fused, jnp, q, k, v, keep, causal_alone):
    scaled = jnp.asarray(q / np.sqrt(q.shape[-1]), jnp.float32)
    keys, values = (jnp.asarray(x, jnp.float32) for x in (k, v))
    return np.asarray(fused._cudnn(scaled, keys, values, keep, causal_alone))


@pytest.fixture
def routes(monkeypatch):
    """cuDNN's kernel replaced by _added_mask's stand-in: the list of the routes it ran."""
    import jax

    routes = []
    kernel = _added_mask(jax.nn.dot_product_attention, routes)
    monkeypatch.setattr(jax.nn, "dot_product_attention", kernel)
    return routes


def test_masked_keys_are_zeroed_and_empty_rows_zeros(modules, routes):
    from mha.backends import numpy as reference

    jnp, fused = modules
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 4, 6, 8)) for _ in range(3))
    lengths = np.array([4, 0, 6])  # example 1 keeps no key: its rows must be zeros
    expected = reference.dot_product_attention(q, k, v, valid_lens=lengths)
    k[0, :, 4:] = np.nan  # what a masked key holds is not read
    k[1] = np.inf
    keep = jnp.asarray((np.arange(6) < lengths[:, None])[:, None, None, :])
    got = _run(fused, jnp, q, k, v, keep, False)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert routes == ["lengths"]  # a prefix of the keys: the kernel's sequence lengths


def test_key_padding_that_is_no_prefix_is_a_mask(modules, routes):
    # Left padding, a hole, no key: the kernel's sequence lengths cannot say it, its mask does
    from mha.backends import numpy as reference

    jnp, fused = modules
    rng = np.random.default_rng(2)
    q = rng.standard_normal((3, 4, 5, 8))
    k, v = (rng.standard_normal((3, 2, 6, 8)) for _ in range(2))  # grouped: 2 key-value heads
    keep = np.array([[0, 0, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0]], bool)
    expected = reference.dot_product_attention(q, k, v, mask=keep[:, None, None, :])
    k[0, :, ~keep[0]] = np.nan
    k[1, :, ~keep[1]] = np.nan
    k[2] = np.inf
    got = _run(fused, jnp, q, k, v, jnp.asarray(keep[:, None, None, :]), False)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert routes == ["mask"]


def test_prefix_lengths(modules):
    jnp, fused = modules
    prefix = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    lengths, is_prefix = fused._prefix_lengths(jnp.asarray(prefix[:, None, None, :]))
    assert np.asarray(lengths).tolist() == [3, 0, 4] and bool(is_prefix)
    assert np.asarray(lengths).dtype == np.int32
    for other in ([[1, 0, 1, 0]], [[0, 1, 1, 1]], [[1, 1, 0, 0], [0, 1, 0, 0]]):
        keep = jnp.asarray(np.array(other, bool)[:, None, None, :])
        assert not bool(fused._prefix_lengths(keep)[1])


def test_grouped_heads_reach_the_kernel_unrepeated(modules, monkeypatch):
    # cuDNN pairs each key-value head with its query heads: the layer neither folds nor
    # repeats them for it
    jnp, fused = modules
    module = backend_module("jax")
    seen = []
    real = fused.attend

    def spy(queries, keys, values, keep, **options):
        seen.append((queries.shape, keys.shape))
        return real(queries, keys, values, keep, **options)

    monkeypatch.setattr(fused, "attend", spy)
    layer = module.MultiHeadAttention(32, 4, num_kv_heads=2, dtype="bfloat16")
    X = jnp.ones((2, 6, 32), jnp.bfloat16)
    layer(X, X, X, jnp.asarray([3, 6]), need_weights=False)
    assert seen == [((2, 4, 6, 8), (2, 2, 6, 8))]


def test_the_causal_mask_is_the_kernels_own(modules, monkeypatch):
    jnp, fused = modules
    import jax

    from mha.backends import numpy as reference

    monkeypatch.setattr(jax.nn, "dot_product_attention", _added_mask(jax.nn.dot_product_attention))
    rng = np.random.default_rng(1)
    # Grouped heads (4 query heads, 2 key-value heads) and fewer queries than keys, top-left
    q, k, v = (rng.standard_normal(shape) for shape in [(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)])
    expected = reference.dot_product_attention(q, k, v, causal=True)
    causal = jnp.asarray(np.tril(np.ones((5, 7), bool)))[None, None]
    np.testing.assert_allclose(_run(fused, jnp, q, k, v, causal, True), expected, atol=1e-5)


@pytest.mark.parametrize(
    "call, alone",
    [
        ({"causal": True}, True),
        ({"causal": True, "segment_ids": np.array([[0, 0, 0, 1, 1, 1]] * 2)}, False),
        ({"causal": True, "valid_lens": np.array([3, 6])}, False),
        ({"causal": True, "alignment": 1}, False),
    ],
)
def test_only_the_causal_mask_alone_takes_the_kernels_own(modules, monkeypatch, call, alone):
    # The kernel's own causal mask knows nothing of segments, lengths or a moved diagonal
    jnp, fused = modules
    module = backend_module("jax")
    seen = []
    real = fused.attend

    def spy(*arguments, causal_alone, unfused):
        seen.append(causal_alone)
        return real(*arguments, causal_alone=causal_alone, unfused=unfused)

    monkeypatch.setattr(fused, "attend", spy)
    layer = module.MultiHeadAttention(
        16, 2, query_size=16, key_size=16, value_size=16, dtype="bfloat16"
    )
    X = jnp.ones((2, 6, 16), jnp.bfloat16)
    call = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in call.items()}
    layer(X, X, X, need_weights=False, **call)
    # Otherwise the mask varies by query: mha's own steps compute it, not the kernel
    assert seen == ([True] if alone else [])


@pytest.mark.parametrize("option", ["sinks", "softcap", "attn_bias"])
def test_sinks_a_soft_cap_and_a_bias_take_mhas_own_steps(modules, option):
    # A bfloat16 call without weights may take the kernel's path, whose steps have no sinks,
    # soft cap or bias: a call with one of them must not take it, on the CPU too
    jnp, _ = modules
    import ml_dtypes

    from mha.backends import jax as backend
    from mha.backends import numpy as reference

    options = {"sinks": {"sinks": True}, "softcap": {"softcap": 0.5}}.get(option, {})
    sizes = {"query_size": 32, "key_size": 32, "value_size": 32}
    numpy_layer = reference.MultiHeadAttention(32, 2, dtype="float64", **sizes, **options)
    weights = mha.random_weights(numpy_layer, seed=8)
    if option == "sinks":
        weights["sinks"] = np.array([3.0, -1.0])
    weights = {name: w.astype(ml_dtypes.bfloat16) for name, w in weights.items()}
    mha.set_weights(numpy_layer, {name: w.astype(np.float64) for name, w in weights.items()})
    layer = backend.MultiHeadAttention(32, 2, dtype="bfloat16", **sizes, **options)
    mha.set_weights(layer, weights)
    rng = np.random.default_rng(8)
    X = rng.standard_normal((2, 5, 32)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal((2, 1, 5, 5)).astype(ml_dtypes.bfloat16) * 3
    call = {"attn_bias": bias} if option == "attn_bias" else {}
    expected = numpy_layer(
        *(X.astype(np.float64),) * 3, **{k: v.astype(np.float64) for k, v in call.items()}
    )
    output = layer(
        *(jnp.asarray(X),) * 3, need_weights=False, **{k: jnp.asarray(v) for k, v in call.items()}
    )
    np.testing.assert_allclose(
        np.asarray(output, np.float64), expected, atol=0.05 * np.abs(expected).max()
    )
