"""Inputs at the edges every backend must take as the reference does: an empty batch, and
tensors of another framework (mha's TypeError, never an internal error)."""

import numpy as np
import pytest

import mha
from conftest import backend_module, backend_params
from mha.backends import numpy as N

Q, K, D, H = 3, 4, 8, 2


def build(module, name, **extra):
    sizes = {"query_size": D, "key_size": D, "value_size": D}
    makers = {
        "MultiHeadAttention": lambda m: m.MultiHeadAttention(D, H, bias=True, **sizes, **extra),
        "DotProductAttention": lambda m: m.DotProductAttention(**extra),
        "AdditiveAttention": lambda m: m.AdditiveAttention(5, query_size=D, key_size=D, **extra),
        "AddNorm": lambda m: m.AddNorm(D, **extra),
        "PositionalEncoding": lambda m: m.PositionalEncoding(D, **extra),
    }
    reference, layer = makers[name](N), makers[name](module)
    weights = mha.get_weights(reference)
    if weights:
        mha.set_weights(layer, weights)
    return reference, layer


CALLS = {
    "MultiHeadAttention": [{}, {"valid_lens": np.zeros(0, "int64")}, {"causal": True}],
    "DotProductAttention": [{}, {"valid_lens": np.zeros((0, Q), "int64")}],
    "AdditiveAttention": [{"valid_lens": np.zeros(0, "int32")}],
    "AddNorm": [{}],
    "PositionalEncoding": [{}],
}


@pytest.mark.parametrize("layer_name", CALLS)
@pytest.mark.parametrize("name", backend_params())
def test_an_empty_batch_gives_an_empty_result(name, layer_name):
    module = backend_module(name)
    reference, layer = build(module, layer_name)
    X, Y = np.zeros((0, Q, D), "float32"), np.zeros((0, K, D), "float32")
    inputs = {
        "AddNorm": (X, X),
        "PositionalEncoding": (X,),
    }.get(layer_name, (X, Y, Y))
    for kwargs in CALLS[layer_name]:
        expected = reference(*inputs, **kwargs)
        arguments = {
            k: module.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()
        }
        output = module.to_numpy(layer(*map(module.from_numpy, inputs), **arguments))
        assert output.shape == expected.shape == (0, Q, D)
    # The framework is still usable after it (MXNet once failed on its next operation)
    ones = np.ones((1, Q, D), "float32")
    assert module.to_numpy(module.from_numpy(ones) + module.from_numpy(ones)).sum() == 2 * Q * D


@pytest.mark.parametrize("name", backend_params())
def test_masked_softmax_of_an_empty_batch(name):
    module = backend_module(name)
    X = np.zeros((0, Q, K), "float32")
    for lens in (np.zeros(0, "int64"), np.zeros((0, Q), "int64")):
        output = module.masked_softmax(module.from_numpy(X), module.from_numpy(lens))
        assert module.to_numpy(output).shape == N.masked_softmax(X, lens).shape == (0, Q, K)


# Frameworks whose own operations take numpy arrays, and whose layers do too
TAKE_NUMPY = ("tensorflow", "jax")


def foreign_tensors(name):
    """A tensor of every other installed framework, the numpy array included where the
    layer's framework does not take numpy arrays itself."""
    x = np.ones((2, Q, D), "float32")
    tensors = {} if name in TAKE_NUMPY else {"numpy": x}
    for other in ("torch", "tensorflow", "mxnet", "jax"):
        if other == name:
            continue
        try:
            tensors[other] = mha.registry.load_backend(other).from_numpy(x)
        except mha.BackendUnavailableError:
            continue
    tensors.pop(name, None)
    return tensors


@pytest.mark.parametrize("name", backend_params())
def test_another_frameworks_tensor_is_a_type_error(name):
    module = backend_module(name)
    _, layer = build(module, "MultiHeadAttention")
    own = module.from_numpy(np.ones((2, Q, D), "float32"))
    for other, tensor in foreign_tensors(name).items():
        with pytest.raises(TypeError, match="must be an array or tensor of the layer's framework"):
            layer(tensor, own, own)
        with pytest.raises(TypeError, match="valid_lens must be an array or tensor of the layer"):
            layer(own, own, own, valid_lens=foreign_lengths(other))


def foreign_lengths(other):
    lengths = np.array([1, 2])
    if other == "numpy":
        return lengths
    return mha.registry.load_backend(other).from_numpy(lengths)
