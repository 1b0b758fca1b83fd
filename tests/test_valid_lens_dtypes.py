"""valid_lens of every integer dtype, unsigned ones included, at their extremes, mean in every
backend what they mean in the reference: a length past the last key keeps every key."""

import numpy as np
import pytest

from conftest import backend_module, backend_params
from mha.backends import numpy as N
from mha.weights import numpy_dtype

B, Q, K, D = 2, 3, 4, 8


@pytest.mark.parametrize(
    "dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
)
@pytest.mark.parametrize("name", backend_params())
def test_every_integer_dtype_at_its_largest(name, dtype):
    module = backend_module(name)
    if name == "mxnet" and dtype in ("int16", "uint16", "uint32", "uint64"):
        # MXNet 1.9 has no arrays of these dtypes: a clear error, not a KeyError
        with pytest.raises(TypeError, match=f"MXNet has no {dtype} arrays"):
            module.from_numpy(np.zeros(2, dtype))
        return
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, n, D)) for n in (Q, K, K))
    largest = np.iinfo(dtype).max
    for lengths in (np.array([0, 2], dtype), np.array([largest, 3], dtype)):
        expected = N.DotProductAttention(dtype="float64")(q, k, v, valid_lens=lengths)
        layer = module.DotProductAttention(dtype="float64")
        output = layer(*map(module.from_numpy, (q, k, v)), valid_lens=module.from_numpy(lengths))
        np.testing.assert_allclose(module.to_numpy(output), expected, atol=1e-12)
        softmax = module.masked_softmax(module.from_numpy(q), module.from_numpy(lengths))
        np.testing.assert_allclose(
            module.to_numpy(softmax), N.masked_softmax(q, lengths), atol=1e-12
        )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("name", backend_params())
def test_every_float_dtype_of_whole_numbers(name, dtype):
    module = backend_module(name)
    if name == "mxnet" and dtype == "bfloat16":
        with pytest.raises(TypeError, match="MXNet has no bfloat16 arrays"):
            module.from_numpy(np.zeros(2, numpy_dtype(dtype)))
        return
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, n, D)) for n in (Q, K, K))
    # bfloat16 lengths are numpy's only through ml_dtypes, whose kind is not "f"
    lengths = np.array([0, 3], dtype=numpy_dtype(dtype))
    expected = N.DotProductAttention(dtype="float64")(q, k, v, valid_lens=lengths)
    layer = module.DotProductAttention(dtype="float64")
    output = layer(*map(module.from_numpy, (q, k, v)), valid_lens=module.from_numpy(lengths))
    np.testing.assert_allclose(module.to_numpy(output), expected, atol=1e-12)
    softmax = module.masked_softmax(module.from_numpy(q), module.from_numpy(lengths))
    np.testing.assert_allclose(module.to_numpy(softmax), N.masked_softmax(q, lengths), atol=1e-12)


# Per float dtype: keys past the dtype's exact integers, and lengths there. float16 counts by
# 2 above 2048 and bfloat16 above 256, so in the lengths' dtype the key before a length of
# 2052 (260) rounds up to it, and the number of keys, 2053 (261), down to a key
LONG_ROWS = {"float16": (2053, [2052, 4096]), "bfloat16": (261, [260, 512])}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", backend_params())
def test_float_lengths_past_the_dtypes_exact_integers_keep_their_keys(name, dtype):
    module = backend_module(name)
    if name == "mxnet" and dtype == "bfloat16":
        pytest.skip("MXNet has no bfloat16 arrays: the test above holds its error")
    num_keys, lengths = LONG_ROWS.get(dtype, LONG_ROWS["float16"])
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, n, 4)) for n in (1, num_keys, num_keys))
    # The lengths as integers: the reference compares no float
    expected = N.DotProductAttention(dtype="float64")(q, k, v, valid_lens=np.array(lengths))
    held = module.from_numpy(np.array(lengths, dtype=numpy_dtype(dtype)))
    layer = module.DotProductAttention(dtype="float64")
    output = layer(*map(module.from_numpy, (q, k, v)), valid_lens=held)
    np.testing.assert_allclose(module.to_numpy(output), expected, atol=1e-12)
    weights = module.to_numpy(layer.attention_weights)
    assert [int((row > 0).sum()) for row in weights[:, 0]] == [min(n, num_keys) for n in lengths]
