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
