"""to_numpy and from_numpy: every backend converts both ways without changing values or dtype."""

import numpy as np
import pytest

from conftest import backend_module, backend_params

DTYPES = ("float32", "float64", "int32", "int64", "bool")


def sample(dtype):
    values = np.arange(-3, 9).reshape(3, 4) * 0.5
    return (values > 0) if dtype == "bool" else values.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", backend_params())
def test_from_numpy_then_to_numpy_is_a_round_trip(name, dtype):
    module = backend_module(name)
    array = sample(dtype)
    back = module.to_numpy(module.from_numpy(array))
    assert isinstance(back, np.ndarray)
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("name", backend_params())
def test_to_numpy_accepts_a_numpy_array(name):
    module = backend_module(name)
    array = sample("float32")
    back = module.to_numpy(array)
    assert isinstance(back, np.ndarray) and back.dtype == array.dtype
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("name", backend_params())
def test_a_scalar_array_round_trips(name):
    module = backend_module(name)
    back = module.to_numpy(module.from_numpy(np.float64(2.5)))
    assert back.shape == () and back.dtype == np.float64 and back == 2.5


@pytest.mark.parametrize("name", backend_params(["torch", "tensorflow"]))
def test_bfloat16_round_trips_bit_for_bit(name):
    # numpy has no bfloat16: both backends hand it out as ml_dtypes' bfloat16, the same 16 bits
    module = backend_module(name)
    import ml_dtypes

    array = sample("float32").astype(ml_dtypes.bfloat16)  # halves: exact in bfloat16
    tensor = module.from_numpy(array)
    assert "bfloat16" in str(tensor.dtype)
    back = module.to_numpy(tensor)
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back.view(np.uint16), array.view(np.uint16))
    np.testing.assert_array_equal(back.astype("float32"), sample("float32"))


@pytest.mark.tensorflow
def test_a_keras_file_with_key_and_value_inputs_of_different_sizes_converts(tmp_path):
    # Keras's layer takes (query, value, key): inputs of sizes 6, 5 and 7; its file converts
    # to mha, which computes what Keras does, and back to the same arrays
    import mha
    from mha import conversion

    keras = backend_module("tensorflow").keras
    from keras import saving

    rng = np.random.default_rng(21)
    q, v, k = (rng.standard_normal(shape) for shape in [(2, 4, 6), (2, 5, 5), (2, 5, 7)])
    source = keras.layers.MultiHeadAttention(2, 3, dtype="float64")
    source(q, v, key=k)  # builds it
    for variable in source.weights:
        variable.assign(rng.uniform(-0.5, 0.5, tuple(variable.shape)))
    expected = np.asarray(source(q, v, key=k))
    path = tmp_path / "kv.weights.h5"
    saving.save_weights(source, path)
    weights, config = conversion.read_file(path)
    assert (config["query_size"], config["key_size"], config["value_size"]) == (6, 7, 5)
    conversion.convert(path, tmp_path / "kv.safetensors")
    layer = mha.load(tmp_path / "kv.safetensors", backend="numpy")
    np.testing.assert_allclose(layer(q, k, v), expected, rtol=0, atol=1e-6)
    conversion.convert(tmp_path / "kv.safetensors", tmp_path / "kv.again.weights.h5")
    again, _ = conversion.read_file(tmp_path / "kv.again.weights.h5")
    for name, array in weights.items():
        np.testing.assert_array_equal(again[name], array)
