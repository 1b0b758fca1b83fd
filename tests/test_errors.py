"""The error table: every bad input raises the same exception, with the same message, in
every backend (the NumPy backend's is the expected one, and is itself pinned down, message by
message, in test_validation.py)."""

import numpy as np
import pytest

from conftest import backend_module, backend_params

B, Q, K = 2, 3, 5


def f(*shape, dtype="float32"):
    return np.zeros(shape, dtype=dtype)


QKV = (f(B, Q, 4), f(B, K, 4), f(B, K, 6))
MHA = ("MultiHeadAttention", (8, 2), {"query_size": 4, "key_size": 4, "value_size": 6})
DOT = ("DotProductAttention", (), {})
ADD = ("AdditiveAttention", (8,), {"query_size": 4, "key_size": 4})

# id: (layer to build: (class, args, kwargs), or None for masked_softmax; call args; call kwargs)
ERRORS = {
    # constructors
    "num_hiddens zero": (("MultiHeadAttention", (0, 1), {}), None, None),
    "num_hiddens float": (("AdditiveAttention", (2.5,), {}), None, None),
    "num_heads negative": (("MultiHeadAttention", (8, -2), {}), None, None),
    "not divisible": (("MultiHeadAttention", (100, 3), {}), None, None),
    "dropout one": (("DotProductAttention", (1.0,), {}), None, None),
    "dropout negative": (("PositionalEncoding", (4, -0.1), {}), None, None),
    "bias not bool": (("MultiHeadAttention", (8, 2), {"bias": 1}), None, None),
    "query_size zero": (("MultiHeadAttention", (8, 2), {"query_size": 0}), None, None),
    "max_len zero": (("PositionalEncoding", (4,), {"max_len": 0}), None, None),
    "eps negative": (("AddNorm", (4,), {"eps": -1e-5}), None, None),
    "dtype unknown": (("DotProductAttention", (), {"dtype": "int32"}), None, None),
    # inputs
    "queries rank 2": (MHA, (f(Q, 4), *QKV[1:]), {}),
    "keys rank 4": (MHA, (QKV[0], f(B, K, 4, 1), QKV[2]), {}),
    "queries wrong dtype": (MHA, (f(B, Q, 4, dtype="float64"), *QKV[1:]), {}),
    "values integer": (DOT, (*QKV[:2], f(B, K, 6, dtype="int64")), {}),
    "batch sizes differ": (MHA, (QKV[0], f(3, K, 4), QKV[2]), {}),
    "keys and values lengths differ": (MHA, (*QKV[:2], f(B, 4, 6)), {}),
    "no keys": (DOT, (QKV[0], f(B, 0, 4), f(B, 0, 6)), {}),
    "no queries": (MHA, (f(B, 0, 4), *QKV[1:]), {}),
    "query_size mismatch": (MHA, (f(B, Q, 5), *QKV[1:]), {}),
    "value_size mismatch": (MHA, (*QKV[:2], f(B, K, 7)), {}),
    "key_size mismatch (additive)": (ADD, (QKV[0], f(B, K, 3), QKV[2]), {}),
    "dot product sizes differ": (DOT, (QKV[0], f(B, K, 3), QKV[2]), {}),
    "queries not a tensor": (DOT, ([[1.0]], *QKV[1:]), {}),
    # valid_lens
    "valid_lens wrong batch": (MHA, QKV, {"valid_lens": np.array([1, 2, 3])}),
    "valid_lens rank 3": (MHA, QKV, {"valid_lens": np.ones((B, Q, 1), "int64")}),
    "valid_lens bool": (DOT, QKV, {"valid_lens": np.array([True, False])}),
    "valid_lens negative": (MHA, QKV, {"valid_lens": np.array([2, -1])}),
    "valid_lens negative float": (ADD, QKV, {"valid_lens": np.array([2.0, -3.0], "float32")}),
    "valid_lens fractional": (MHA, QKV, {"valid_lens": np.array([2.0, 1.5])}),
    "valid_lens 2-D wrong queries": (DOT, QKV, {"valid_lens": np.ones((B, Q + 1), "int32")}),
    # masks
    "mask not bool": (MHA, QKV, {"mask": f(Q, K)}),
    "mask wrong keys": (MHA, QKV, {"mask": np.ones((Q, K - 1), bool)}),
    "mask 4-D wrong heads": (MHA, QKV, {"mask": np.ones((B, 3, Q, K), bool)}),
    "mask 4-D on single head": (DOT, QKV, {"mask": np.ones((B, 1, Q, K), bool)}),
    "mask 5-D": (MHA, QKV, {"mask": np.ones((1, B, 2, Q, K), bool)}),
    "causal not bool": (DOT, QKV, {"causal": "yes"}),
    "need_weights not bool": (MHA, QKV, {"need_weights": None}),
    "window_mask rank 2": (MHA, QKV, {"window_mask": np.ones((Q, K), bool)}),
    "window_mask not a batch divisor": (MHA, QKV, {"window_mask": np.ones((3, Q, K), bool)}),
    "window_mask wrong keys": (ADD, QKV, {"window_mask": np.ones((1, Q, K + 1), bool)}),
    "window_mask integer": (MHA, QKV, {"window_mask": np.ones((1, Q, K), "int32")}),
    "head_mask wrong size": (MHA, QKV, {"head_mask": f(3)}),
    "head_mask wrong dtype": (MHA, QKV, {"head_mask": f(2, dtype="float64")}),
    # masked_softmax, PositionalEncoding, AddNorm
    "masked_softmax integer scores": (None, (np.ones((B, Q), "int64"),), {}),
    "masked_softmax rank 1": (None, (np.ones(3, "float32"),), {}),
    "masked_softmax no keys": (None, (f(B, Q, 0),), {}),
    "masked_softmax wrong lengths": (None, (f(B, Q, K), np.array([1, 2, 3])), {}),
    "sequence longer than max_len": (
        ("PositionalEncoding", (4,), {"max_len": 2}),
        (f(B, Q, 4),),
        {},
    ),
    "encoding size mismatch": (("PositionalEncoding", (5,), {}), (f(B, Q, 4),), {}),
    "add_norm shapes differ": (("AddNorm", (4,), {}), (f(B, Q, 4), f(B, 2, 4)), {}),
    "add_norm wrong dtype": (("AddNorm", (4,), {}), (f(B, Q, 4), f(B, Q, 4, dtype="float64")), {}),
}


def raised(module, entry):
    """The exception `entry` raises on backend `module` (fails if none)."""
    build, args, kwargs = entry

    def tensor(value):
        return module.from_numpy(value) if isinstance(value, np.ndarray) else value

    try:
        if build is None:
            module.masked_softmax(*map(tensor, args))
        else:
            class_name, build_args, build_kwargs = build
            layer = getattr(module, class_name)(*build_args, **build_kwargs)
            if args is not None:
                layer(*map(tensor, args), **{k: tensor(v) for k, v in kwargs.items()})
    except (ValueError, TypeError) as error:
        return error
    pytest.fail(f"no error raised by {module.__name__}")


def test_the_table_is_large_enough():
    assert len(ERRORS) >= 30


@pytest.mark.parametrize("case", ERRORS)
@pytest.mark.parametrize("name", backend_params())
def test_same_error_in_every_backend(name, case):
    module = backend_module(name)
    expected = raised(backend_module("numpy"), ERRORS[case])
    actual = raised(module, ERRORS[case])
    assert type(actual) is type(expected)
    assert str(actual) == str(expected)
    assert "Received" in str(expected)
