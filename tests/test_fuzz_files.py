"""The file readers take any bytes: each file is read, or refused with one ValueError, never
another exception, a crash or an unbounded allocation (hypothesis draws the bytes)."""

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mha
from conftest import framework_import
from mha import interop
from mha.backends import numpy as N
from mha.weights import LAYER_CLASSES, read_safetensors

FUZZ = settings(
    max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def a_checkpoint(tmp_path):
    layer = N.MultiHeadAttention(4, 2, bias=True, query_size=4, key_size=4, value_size=4)
    path = tmp_path / "good.safetensors"
    mha.save(layer, path)
    return path.read_bytes()


def read_or_refuse(read, path):
    try:
        read(path)
    except ValueError:
        pass


@FUZZ
@given(data=st.binary(max_size=512))
def test_any_bytes_as_safetensors(tmp_path, data):
    path = tmp_path / "any.safetensors"
    path.write_bytes(data)
    read_or_refuse(read_safetensors, path)
    read_or_refuse(mha.load, path)


@FUZZ
@given(
    cut=st.integers(0, 10_000),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 7)), max_size=4),
)
def test_a_checkpoint_cut_or_bit_flipped(tmp_path, cut, flips):
    content = bytearray(a_checkpoint(tmp_path))
    for position, bit in flips:
        content[position % len(content)] ^= 1 << bit
    path = tmp_path / "changed.safetensors"
    path.write_bytes(bytes(content[: cut % (len(content) + 1)]))
    read_or_refuse(mha.load, path)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(header=st.dictionaries(st.text(max_size=12), JSON, max_size=5), tail=st.binary(max_size=64))
def test_any_json_header(tmp_path, header, tail):
    encoded = json.dumps(header).encode()
    path = tmp_path / "header.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + tail)
    read_or_refuse(mha.load, path)


@FUZZ
@given(
    config=st.dictionaries(
        # Every constructor argument of every layer, and one that none takes
        st.sampled_from(
            [*sorted({key for keys in LAYER_CLASSES.values() for key in keys}), "extra"]
        ),
        JSON,
        max_size=9,
    ),
    name=st.sampled_from([*LAYER_CLASSES, "Nope"]),
)
def test_any_config_in_an_mha_file(tmp_path, config, name):
    from mha.checkpoints import FORMAT, write_safetensors

    path = tmp_path / "config.safetensors"
    metadata = {"format": FORMAT, "class": name, "config": json.dumps(config)}
    write_safetensors(path, {"W_q": np.zeros((4, 4), "float32")}, metadata)
    read_or_refuse(mha.load, path)


@pytest.mark.jax
@FUZZ
@given(data=st.binary(max_size=256))
def test_any_bytes_as_a_flax_msgpack_file(tmp_path, data):
    framework_import("flax")
    path = tmp_path / "any.msgpack"
    path.write_bytes(data)
    read_or_refuse(interop.read_file, path)


@pytest.mark.torch
@FUZZ
@given(data=st.binary(max_size=256))
def test_any_bytes_as_a_torch_file(tmp_path, data):
    framework_import("torch")
    path = tmp_path / "any.pt"
    path.write_bytes(data)
    read_or_refuse(lambda p: interop.read_file(p, num_heads=2), path)
