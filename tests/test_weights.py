"""Canonical weights: get/set, random_weights, and safetensors files (good, bad and hostile)."""

import json
import os
import pickle
import struct

import numpy as np
import pytest
import safetensors.numpy

import mha
from mha import weights as W

pytestmark = pytest.mark.numpy

CONFIG = {"num_hiddens": 8, "num_heads": 2, "query_size": 3, "key_size": 4, "value_size": 5}


def make_mha(**overrides):
    return mha.MultiHeadAttention(**{**CONFIG, **overrides})


def inputs(dtype="float32"):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((2, 3, 3)).astype(dtype),
        rng.standard_normal((2, 4, 4)).astype(dtype),
        rng.standard_normal((2, 4, 5)).astype(dtype),
    )


def test_canonical_names_and_shapes():
    assert W.weight_shapes("MultiHeadAttention", {**CONFIG, "bias": True}) == {
        "W_q": (3, 8),
        "W_k": (4, 8),
        "W_v": (5, 8),
        "W_o": (8, 8),
        "b_q": (8,),
        "b_k": (8,),
        "b_v": (8,),
        "b_o": (8,),
    }
    assert W.weight_shapes(
        "AdditiveAttention", {"num_hiddens": 6, "query_size": 2, "key_size": 3}
    ) == {"W_q": (2, 6), "W_k": (3, 6), "w_v": (6, 1)}
    assert W.weight_shapes("AddNorm", {"num_hiddens": 4}) == {"gamma": (4,), "beta": (4,)}
    assert W.weight_shapes("DotProductAttention", {}) == {}
    assert W.weight_shapes("PositionalEncoding", {"num_hiddens": 4}) == {}


def test_every_canonical_weight_has_a_place():
    # The names weight_shapes gives are the names weight_places says where to find, in order
    for class_name in W.LAYER_CLASSES:
        for bias in (False, True):
            config = {**CONFIG, "bias": bias}
            assert list(W.weight_places(class_name, bias)) == list(
                W.weight_shapes(class_name, {**config, **LATENT})
            ), (class_name, bias)
    # Multi-head latent attention: with low-rank queries, or one W_q
    for bias in (False, True):
        for q_lora_rank in (None, 3):
            config = {**CONFIG, **LATENT, "bias": bias, "q_lora_rank": q_lora_rank}
            places = W.weight_places("MultiHeadLatentAttention", bias, q_lora_rank=q_lora_rank)
            assert list(places) == list(W.weight_shapes("MultiHeadLatentAttention", config))


# The sizes of multi-head latent attention beside CONFIG's
LATENT = {"kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3}


def test_weights_compute_x_at_W_plus_b():
    layer = make_mha(bias=True, dtype="float64")
    w = mha.random_weights(layer, seed=5)
    mha.set_weights(layer, w)
    q, k, v = (x.astype("float64") for x in inputs())
    layer(q, k, v)
    # The projections are plain x @ W + b in the canonical layout.
    np.testing.assert_allclose(layer.W_q(q), q @ w["W_q"] + w["b_q"], atol=1e-14)
    np.testing.assert_allclose(layer.W_o(np.eye(8)), w["W_o"] + w["b_o"], atol=1e-14)


def test_add_norm_weights_are_the_scale_and_the_shift(backend):
    # A hand-worked case in every backend: gamma scales and beta shifts the normalized sum
    layer = backend.AddNorm(4, dtype="float64")
    gamma, beta = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.0, 10.0, 20.0, 30.0])
    mha.set_weights(layer, {"gamma": gamma, "beta": beta})
    X, Y = np.array([[[1.0, 2.0, 3.0, 4.0]]]), np.zeros((1, 1, 4))
    # mean 2.5, variance 1.25
    expected = (X - 2.5) / np.sqrt(1.25 + 1e-5) * gamma + beta
    output = backend.to_numpy(layer(backend.from_numpy(X), backend.from_numpy(Y)))
    np.testing.assert_allclose(output, expected, atol=1e-12)
    np.testing.assert_array_equal(mha.get_weights(layer)["gamma"], gamma)


@pytest.mark.parametrize("bias", [False, True])
def test_get_set_round_trip(bias):
    source = make_mha(bias=bias)
    w = mha.random_weights(source, seed=1)
    mha.set_weights(source, w)
    got = mha.get_weights(source)
    assert set(got) == set(w)
    for key in w:
        np.testing.assert_array_equal(got[key], w[key])
    got["W_q"][:] = 0  # a fresh copy: changing it leaves the layer alone
    assert np.any(mha.get_weights(source)["W_q"] != 0)


def _aligned_copy(array):
    # In memory aligned as frameworks want it to wrap an array without copying (JAX's CPU
    # client does for 64-byte alignment), so that a layer that shares it is caught
    buffer = np.empty(array.nbytes + 64, np.uint8)
    start = -buffer.ctypes.data % 64
    aligned = buffer[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    aligned[...] = array
    return aligned


@pytest.mark.parametrize("lazy", [False, True], ids=["sized", "lazy"])
def test_weights_are_copied_in_and_out(backend, lazy):
    # Changing the arrays given to set_weights, or those get_weights returned, changes
    # neither the layer's weights nor its outputs
    sizes = {} if lazy else {k: CONFIG[k] for k in ("query_size", "key_size", "value_size")}
    layer = backend.MultiHeadAttention(8, 2, bias=True, **sizes)
    given = {k: _aligned_copy(w) for k, w in mha.random_weights(make_mha(bias=True)).items()}
    kept = {k: w.copy() for k, w in given.items()}
    mha.set_weights(layer, given)
    q, k, v = map(backend.from_numpy, inputs())
    before = backend.to_numpy(layer(q, k, v)).copy()
    for array in given.values():
        array += 7
    taken = mha.get_weights(layer)
    for array in taken.values():
        array -= 3
    for name, array in mha.get_weights(layer).items():
        np.testing.assert_array_equal(array, kept[name], err_msg=name)
    np.testing.assert_array_equal(backend.to_numpy(layer(q, k, v)), before)


def test_set_weights_before_first_call_infers_sizes():
    lazy = mha.MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="not created yet: query_size, key_size, value_size"):
        mha.get_weights(lazy)
    w = mha.random_weights("MultiHeadAttention", seed=2, **CONFIG)
    mha.set_weights(lazy, w)
    eager = make_mha()
    mha.set_weights(eager, w)
    np.testing.assert_array_equal(lazy(*inputs()), eager(*inputs()))
    assert mha.backends.numpy.layer_config(lazy)["value_size"] == 5


def test_set_weights_lists_every_problem_and_changes_nothing():
    layer = make_mha()
    before = mha.get_weights(layer)
    bad = mha.random_weights(layer)
    bad["W_q"] = bad["W_q"].astype("float64")
    bad["W_k"] = bad["W_k"][:, :7]
    del bad["W_v"]
    bad["W_x"] = np.zeros(3, "float32")
    bad["W_o"] = [[0.0]]
    with pytest.raises(ValueError) as caught:
        mha.set_weights(layer, bad)
    message = str(caught.value)
    assert message.startswith("set_weights found 5 problems for MultiHeadAttention(num_hiddens=8")
    assert "missing W_v: expected shape (5, 8)" in message
    assert "unexpected 'W_x': MultiHeadAttention has W_q, W_k, W_v, W_o" in message
    assert "W_q has shape (3, 8) and dtype float64; expected dtype float32" in message
    assert "W_k has shape (4, 7) and dtype float32; expected shape (4, 8)" in message
    assert "W_o must be a numpy.ndarray (see mha.to_numpy). Received: list" in message
    after = mha.get_weights(layer)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])


def test_set_weights_rejects_non_dicts_and_non_layers():
    with pytest.raises(TypeError, match="weights must be a dict"):
        mha.set_weights(make_mha(), [1, 2])
    with pytest.raises(TypeError, match=r"Expected an mha layer \(DotProductAttention"):
        mha.set_weights(object(), {})


def test_random_weights_are_seeded_and_shaped():
    a = mha.random_weights("MultiHeadAttention", seed=3, bias=True, **CONFIG)
    b = mha.random_weights(mha.backends.numpy.MultiHeadAttention, seed=3, bias=True, **CONFIG)
    c = mha.random_weights("MultiHeadAttention", seed=4, bias=True, **CONFIG)
    assert set(a) == {"W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o"}
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
        assert not np.array_equal(a[key], c[key])
        assert a[key].dtype == np.float32
    bound = 1 / np.sqrt(3)
    assert np.all(np.abs(a["W_q"]) <= bound)
    assert (
        mha.random_weights("AddNorm", num_hiddens=3, dtype="float64")["gamma"].dtype == np.float64
    )


def test_random_weights_needs_every_size():
    with pytest.raises(
        ValueError, match="the shapes of W_k, W_q, W_v depend on sizes that are None"
    ):
        mha.random_weights("MultiHeadAttention", num_hiddens=8, num_heads=2)
    with pytest.raises(TypeError, match="has no argument heads"):
        mha.random_weights("MultiHeadAttention", num_hiddens=8, heads=2)
    with pytest.raises(ValueError, match="Unknown layer class"):
        mha.random_weights("Transformer", num_hiddens=8)


# ---------------------------------------------------------------------------------------------
# Files


LAYERS = {
    "MultiHeadAttention": lambda: make_mha(bias=True),
    "AdditiveAttention": lambda: mha.AdditiveAttention(6, query_size=3, key_size=4),
    "AddNorm": lambda: mha.AddNorm(5, dtype="float64"),
    "DotProductAttention": lambda: mha.DotProductAttention(),
    "PositionalEncoding": lambda: mha.PositionalEncoding(4),
}


@pytest.mark.parametrize("name", LAYERS)
def test_save_load_round_trip(tmp_path, name):
    source, target = LAYERS[name](), LAYERS[name]()
    if mha.get_weights(source):
        mha.set_weights(source, mha.random_weights(source, seed=9))
    path = tmp_path / "layer.safetensors"
    mha.save_weights(source, path)
    mha.load_weights(target, path)
    saved, loaded = mha.get_weights(source), mha.get_weights(target)
    assert set(saved) == set(loaded)
    for key in saved:
        np.testing.assert_array_equal(saved[key], loaded[key])


@pytest.mark.torch
def test_bfloat16_files_are_standard_safetensors(tmp_path):
    # BF16 tensors are the upper 16 bits of float32 numbers; the reference implementation
    # (safetensors.torch) reads what mha writes and writes what mha reads, bit for bit
    from conftest import backend_module

    backend_module("torch")
    import ml_dtypes
    import safetensors.torch
    import torch

    values = np.array([[1.5, -0.25, 3.0], [0.0, -2.0, 96.0]], "float32")
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # by hand: float32 -> bfloat16
    path = tmp_path / "bf16.safetensors"
    W.write_safetensors(path, {"W": values.astype(ml_dtypes.bfloat16)}, {"k": "v"})
    read = safetensors.torch.load_file(str(path))["W"]
    assert read.dtype == torch.bfloat16
    np.testing.assert_array_equal(read.view(torch.int16).numpy().view(np.uint16), bits)
    np.testing.assert_array_equal(read.float().numpy(), values)

    other = tmp_path / "other.safetensors"
    safetensors.torch.save_file({"W": torch.from_numpy(values).bfloat16()}, str(other))
    tensors, _ = W.read_safetensors(other)
    assert tensors["W"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(tensors["W"].view(np.uint16), bits)


@pytest.mark.torch
def test_a_bfloat16_checkpoint_loads_only_where_bfloat16_computes(tmp_path):
    from conftest import backend_module

    T = backend_module("torch")
    layer = T.MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8, dtype="bfloat16")
    mha.set_weights(layer, mha.random_weights(layer, seed=2))
    path = tmp_path / "bf16.safetensors"
    mha.save(layer, path)
    again = mha.load(path, backend="torch")
    for name, value in mha.get_weights(layer).items():
        np.testing.assert_array_equal(
            mha.get_weights(again)[name].view(np.uint16), value.view(np.uint16)
        )
    with pytest.raises(ValueError, match="in the numpy backend"):
        mha.load(path, backend="numpy")


def test_bfloat16_without_ml_dtypes_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "ml_dtypes", None)  # import fails
    with pytest.raises(ModuleNotFoundError, match="pip install ml_dtypes"):
        W.numpy_dtype("bfloat16")
    with pytest.raises(ModuleNotFoundError, match="ml_dtypes"):
        mha.random_weights(
            "MultiHeadAttention",
            num_hiddens=4,
            num_heads=2,
            query_size=4,
            key_size=4,
            value_size=4,
            dtype="bfloat16",
        )
    assert W.numpy_dtype("float16") == np.float16


def test_file_is_standard_safetensors_with_class_and_config(tmp_path):
    layer = make_mha(bias=True)
    path = tmp_path / "mha.safetensors"
    mha.save_weights(layer, path)
    # Read by the reference safetensors implementation, independently of mha's reader
    tensors = safetensors.numpy.load_file(str(path))
    for key, value in mha.get_weights(layer).items():
        np.testing.assert_array_equal(tensors[key], value)
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    metadata = json.loads(path.read_bytes()[8 : 8 + size])["__metadata__"]
    assert metadata["class"] == "MultiHeadAttention"
    assert json.loads(metadata["config"])["num_heads"] == 2


def test_reads_files_written_by_the_safetensors_package(tmp_path):
    path = tmp_path / "other.safetensors"
    arrays = {
        "a": np.arange(6, dtype="float64").reshape(2, 3),
        "b": np.array([1, 2], "int32"),
        "c": np.ones((0, 2), "float16"),
    }
    safetensors.numpy.save_file(arrays, str(path), metadata={"k": "v"})
    tensors, metadata = W.read_safetensors(path)
    assert metadata == {"k": "v"}
    for key in arrays:
        np.testing.assert_array_equal(tensors[key], arrays[key])
        assert tensors[key].dtype == arrays[key].dtype


def test_load_into_lazy_layer_infers_sizes(tmp_path):
    source = make_mha()
    path = tmp_path / "w.safetensors"
    mha.save_weights(source, path)
    lazy = mha.MultiHeadAttention(8, 2)
    mha.load_weights(lazy, path)
    np.testing.assert_array_equal(lazy(*inputs()), source(*inputs()))


def test_load_rejects_other_class_and_other_config(tmp_path):
    path = tmp_path / "w.safetensors"
    mha.save_weights(make_mha(), path)
    with pytest.raises(
        ValueError,
        match="holds weights of MultiHeadAttention; cannot load them into AdditiveAttention",
    ):
        mha.load_weights(mha.AdditiveAttention(8), path)
    # Same shapes, different heads: the shapes alone would not tell.
    with pytest.raises(ValueError, match="saved with num_heads=2; this layer has num_heads=4"):
        mha.load_weights(make_mha(num_heads=4), path)
    with pytest.raises(ValueError) as caught:
        mha.load_weights(make_mha(query_size=7, bias=True), path)
    message = str(caught.value)
    assert "saved with query_size=3; this layer has query_size=7" in message
    assert "saved with bias=False; this layer has bias=True" in message
    assert "missing b_q" in message


@pytest.mark.parametrize(
    "option", [{"scale": 0.5}, {"rope_theta": 10000.0}, {"softcap": 30.0}, {"sliding_window": 2}]
)
def test_load_rejects_a_setting_of_the_file_the_layer_lacks(tmp_path, option):
    # The weights fit either layer; the numbers they give do not
    path = tmp_path / "w.safetensors"
    source = make_mha(**option)
    mha.save_weights(source, path)
    [(key, value)] = option.items()
    with pytest.raises(ValueError, match=f"saved with {key}={value!r}; this layer has {key}=None"):
        mha.load_weights(make_mha(), path)
    again = make_mha(**option)
    mha.load_weights(again, path)
    np.testing.assert_array_equal(again(*inputs()), source(*inputs()))


def test_load_rejects_an_add_norm_of_another_eps(tmp_path):
    # eps changes the normalized numbers as scale changes the scores
    path = tmp_path / "w.safetensors"
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype("float32") * 1e-3
    source = mha.AddNorm(4, eps=1e-6)
    mha.save_weights(source, path)
    with pytest.raises(ValueError, match="saved with eps=1e-06; this layer has eps=1e-05"):
        mha.load_weights(mha.AddNorm(4), path)
    again = mha.AddNorm(4, eps=1e-6)
    mha.load_weights(again, path)
    np.testing.assert_array_equal(again(x, x), source(x, x))


def test_load_rejects_dtype_mismatch(tmp_path):
    path = tmp_path / "w.safetensors"
    mha.save_weights(make_mha(dtype="float64"), path)
    with pytest.raises(ValueError, match="expected dtype float32"):
        mha.load_weights(make_mha(), path)


def test_load_rejects_plain_safetensors_without_mha_metadata(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file(mha.get_weights(make_mha()), str(path))
    with pytest.raises(ValueError, match=r"not one written by mha\.save_weights"):
        mha.load_weights(make_mha(), path)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "good.safetensors"
    mha.save_weights(make_mha(bias=True), path)
    return path


@pytest.mark.parametrize("cut", [0, 4, 8, 20, -1, -100])
def test_truncated_files_raise_clear_errors(tmp_path, saved, cut):
    content = saved.read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(content[:cut] if cut >= 0 else content[: len(content) + cut])
    with pytest.raises(
        ValueError, match=r"is not a valid safetensors file: .*(truncated|fewer|header)"
    ):
        mha.load_weights(make_mha(bias=True), path)


def write_raw(path, header, data=b""):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "reason"),
    [
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 12,
            "4 bytes after the last tensor",
        ),
        (
            {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            b"\0" * 8,
            "has 8 bytes for shape",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            b"\0" * 12,
            "does not follow",
        ),
        (
            {"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}},
            b"\0" * 8,
            "dtype 'C64', which mha does not read",
        ),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", "invalid shape"),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}},
            b"",
            "invalid data_offsets",
        ),
        ({"a": [1, 2]}, b"", "is not dtype, shape and data_offsets"),
        ([1, 2], b"", "header is not a JSON object"),
        ({"__metadata__": {"a": 1}}, b"", "__metadata__ is not a map of strings"),
    ],
)
def test_corrupted_headers(tmp_path, header, data, reason):
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ValueError, match=f"not a valid safetensors file: .*{reason}"):
        W.read_safetensors(path)


def test_huge_header_claim_is_refused_without_allocating(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(ValueError, match="header claims"):
        W.read_safetensors(path)


def test_foreign_files(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("just some text, long enough to have a header")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        mha.load_weights(make_mha(), text)
    not_json = tmp_path / "garbage.bin"
    not_json.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]")
    with pytest.raises(ValueError, match="header is not JSON"):
        mha.load_weights(make_mha(), not_json)


class Explode:
    """Unpickling this would create a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_files_are_never_executed(tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "model.pt"
    path.write_bytes(pickle.dumps(Explode(str(marker))))
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        mha.load_weights(make_mha(), path)
    assert not marker.exists()


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "w.safetensors"
    mha.save_weights(make_mha(), path)
    mha.save_weights(make_mha(), path)  # overwrite in place
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]


def test_write_safetensors_refuses_what_the_format_cannot_hold(tmp_path):
    # A file the readers refuse must not replace a good one
    path = tmp_path / "w.safetensors"
    W.write_safetensors(path, {"W": np.ones(2, "f4")}, {"k": "v"})
    before = path.read_bytes()
    for tensors, metadata, error in (
        ({"W": np.ones(2, "f4")}, {"k": 1}, TypeError),
        ({"__metadata__": np.ones(2, "f4")}, {}, ValueError),
        ({0: np.ones(2, "f4")}, {}, ValueError),
    ):
        with pytest.raises(error, match=r"strings only|may not be named"):
            W.write_safetensors(path, tensors, metadata)
        assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
    tensors, metadata = safetensors.numpy.load_file(str(path)), W.read_safetensors(path)[1]
    assert metadata == {"k": "v"} and tensors["W"].tolist() == [1, 1]
