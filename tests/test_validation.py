"""Every user mistake raises ValueError or TypeError from mha.validation, naming the argument
and echoing what was received. Each row is one error path, with its full message."""

import re

import numpy as np
import pytest

import mha
from mha import validation

pytestmark = pytest.mark.numpy

f32 = np.zeros((2, 3, 4), "float32")
keys32 = np.zeros((2, 5, 4), "float32")
values32 = np.zeros((2, 5, 6), "float32")


def mha_layer(**kwargs):
    return mha.MultiHeadAttention(8, 2, query_size=4, key_size=4, value_size=6, **kwargs)


def call_mha(*args, **kwargs):
    mha_layer()(*args, **kwargs)


def attend(**kwargs):
    arguments = {"queries": f32, "keys": keys32, "values": values32}
    arguments.update(kwargs)
    mha_layer()(
        arguments.pop("queries"), arguments.pop("keys"), arguments.pop("values"), **arguments
    )


ERRORS = {
    # Constructors
    "num_hiddens zero": (
        lambda: mha.MultiHeadAttention(0, 1),
        ValueError,
        "num_hiddens must be a positive integer. Received: num_hiddens=0",
    ),
    "num_hiddens float": (
        lambda: mha.AdditiveAttention(2.5),
        ValueError,
        "num_hiddens must be a positive integer. Received: num_hiddens=2.5",
    ),
    "num_hiddens bool": (
        lambda: mha.AddNorm(True),
        ValueError,
        "num_hiddens must be a positive integer. Received: num_hiddens=True",
    ),
    "num_heads negative": (
        lambda: mha.MultiHeadAttention(8, -2),
        ValueError,
        "num_heads must be a positive integer. Received: num_heads=-2",
    ),
    "not divisible": (
        lambda: mha.MultiHeadAttention(100, 3),
        ValueError,
        "num_hiddens must be divisible by num_heads. Received: num_hiddens=100, num_heads=3",
    ),
    "rope odd head size": (
        # 6 features in 2 heads: heads of 3, which the rotary embedding cannot pair
        lambda: mha.MultiHeadAttention(6, 2, rope_theta=10000.0),
        ValueError,
        "rotary embeddings rotate pairs of features: the head size num_hiddens / num_heads "
        "must be even. Received: num_hiddens=6, num_heads=2",
    ),
    "sliding_window fractional": (
        # A window of 2.5 positions: windows count whole positions
        lambda: mha.DotProductAttention(sliding_window=2.5),
        ValueError,
        "sliding_window must be a positive integer. Received: sliding_window=2.5",
    ),
    "softcap a string": (
        lambda: mha.DotProductAttention(softcap="30"),
        ValueError,
        "softcap must be a positive number. Received: softcap='30'",
    ),
    "rope_theta a string": (
        lambda: mha.MultiHeadAttention(8, 2, rope_theta="1e4"),
        ValueError,
        "rope_theta must be a positive number. Received: rope_theta='1e4'",
    ),
    "dropout one": (
        lambda: mha.DotProductAttention(1.0),
        ValueError,
        "dropout must be a number in [0, 1). Received: dropout=1.0",
    ),
    "dropout negative": (
        lambda: mha.PositionalEncoding(4, -0.1),
        ValueError,
        "dropout must be a number in [0, 1). Received: dropout=-0.1",
    ),
    "dropout string": (
        lambda: mha.DotProductAttention("0.1"),
        ValueError,
        "dropout must be a number in [0, 1). Received: dropout='0.1'",
    ),
    "bias not bool": (
        lambda: mha.MultiHeadAttention(8, 2, bias=1),
        TypeError,
        "bias must be True or False. Received: bias=1",
    ),
    "query_size zero": (
        lambda: mha.MultiHeadAttention(8, 2, query_size=0),
        ValueError,
        "query_size must be a positive integer. Received: query_size=0",
    ),
    "key_size string": (
        lambda: mha.AdditiveAttention(8, key_size="4"),
        ValueError,
        "key_size must be a positive integer. Received: key_size='4'",
    ),
    "max_len zero": (
        lambda: mha.PositionalEncoding(4, max_len=0),
        ValueError,
        "max_len must be a positive integer. Received: max_len=0",
    ),
    "eps zero": (
        lambda: mha.AddNorm(4, eps=0.0),
        ValueError,
        "eps must be a positive number. Received: eps=0.0",
    ),
    "dtype unknown": (
        lambda: mha.DotProductAttention(dtype="int32"),
        ValueError,
        "dtype must be one of float16, bfloat16, float32, float64. Received: dtype='int32'",
    ),
    # Inputs
    "queries not a tensor": (
        lambda: attend(queries=[[1.0]]),
        TypeError,
        "queries must be an array or tensor of the layer's framework. "
        "Received: queries of type list",
    ),
    "queries rank 2": (
        lambda: attend(queries=np.zeros((3, 4), "float32")),
        ValueError,
        "queries must have rank 3: (batch_size, sequence length, features). "
        "Received: queries with shape (3, 4) and dtype float32",
    ),
    "keys rank 4": (
        lambda: attend(keys=np.zeros((2, 5, 4, 1), "float32")),
        ValueError,
        "keys must have rank 3: (batch_size, sequence length, features). "
        "Received: keys with shape (2, 5, 4, 1) and dtype float32",
    ),
    "queries float64 in float32 layer": (
        lambda: attend(queries=np.zeros((2, 3, 4))),
        TypeError,
        "queries must have the layer's dtype float32. "
        "Received: queries with shape (2, 3, 4) and dtype float64",
    ),
    "values int": (
        lambda: attend(values=np.zeros((2, 5, 6), "int64")),
        TypeError,
        "values must have the layer's dtype float32. "
        "Received: values with shape (2, 5, 6) and dtype int64",
    ),
    "batch sizes differ": (
        lambda: attend(keys=np.zeros((3, 5, 4), "float32")),
        ValueError,
        "queries, keys and values must have the same batch size. Received: "
        "queries with shape (2, 3, 4), keys with shape (3, 5, 4), "
        "values with shape (2, 5, 6)",
    ),
    "keys and values lengths differ": (
        lambda: attend(values=np.zeros((2, 4, 6), "float32")),
        ValueError,
        "keys and values must have the same number of key-value pairs (axis 1). Received: "
        "keys with shape (2, 5, 4), values with shape (2, 4, 6)",
    ),
    "no keys": (
        lambda: attend(keys=np.zeros((2, 0, 4), "float32"), values=np.zeros((2, 0, 6), "float32")),
        ValueError,
        "queries and keys must each hold at least one position (axis 1). Received: "
        "queries with shape (2, 3, 4), keys with shape (2, 0, 4)",
    ),
    "no queries": (
        lambda: attend(queries=np.zeros((2, 0, 4), "float32")),
        ValueError,
        "queries and keys must each hold at least one position (axis 1). Received: "
        "queries with shape (2, 0, 4), keys with shape (2, 5, 4)",
    ),
    "query_size mismatch": (
        lambda: attend(queries=np.zeros((2, 3, 5), "float32")),
        ValueError,
        "The last axis of queries must have size query_size=4. "
        "Received: queries with shape (2, 3, 5) and dtype float32",
    ),
    "value_size mismatch": (
        lambda: attend(values=np.zeros((2, 5, 7), "float32")),
        ValueError,
        "The last axis of values must have size value_size=6. "
        "Received: values with shape (2, 5, 7) and dtype float32",
    ),
    "dot product sizes differ": (
        lambda: mha.DotProductAttention()(f32, np.zeros((2, 5, 3), "float32"), values32),
        ValueError,
        "queries and keys must have the same feature size (last axis) for dot-product scores. "
        "Received: queries with shape (2, 3, 4), keys with shape (2, 5, 3)",
    ),
    # valid_lens
    "valid_lens wrong batch": (
        lambda: attend(valid_lens=np.array([1, 2, 3])),
        ValueError,
        "valid_lens must have shape (batch_size,) = (2,) or "
        "(batch_size, no. of queries) = (2, 3). "
        "Received: valid_lens with shape (3,) and dtype int64",
    ),
    "valid_lens rank 3": (
        lambda: attend(valid_lens=np.ones((2, 3, 1), "int64")),
        ValueError,
        "valid_lens must have shape (batch_size,) = (2,) or "
        "(batch_size, no. of queries) = (2, 3). "
        "Received: valid_lens with shape (2, 3, 1) and dtype int64",
    ),
    "valid_lens bool": (
        lambda: attend(valid_lens=np.array([True, False])),
        TypeError,
        "valid_lens must hold integers (an integer or float dtype). "
        "Received: valid_lens with shape (2,) and dtype bool",
    ),
    "valid_lens negative": (
        lambda: attend(valid_lens=np.array([2, -1])),
        ValueError,
        "valid_lens must be non-negative. Received: valid_lens containing -1",
    ),
    "valid_lens fractional": (
        lambda: attend(valid_lens=np.array([2.0, 1.5])),
        ValueError,
        "valid_lens must hold whole numbers. Received: valid_lens containing 1.5",
    ),
    "valid_lens list": (
        lambda: attend(valid_lens=[1, 2]),
        TypeError,
        "valid_lens must be an array or tensor of the layer's framework. "
        "Received: valid_lens of type list",
    ),
    # mask, causal, window_mask, head_mask, need_weights
    "mask not bool": (
        lambda: attend(mask=np.ones((3, 5), "float32")),
        TypeError,
        "mask must be a boolean keep-mask (True = attend). "
        "Received: mask with shape (3, 5) and dtype float32",
    ),
    "mask integer": (
        # A 0/1 integer mask is not read as a keep-mask: only booleans are
        lambda: attend(mask=np.ones((3, 5), "int64")),
        TypeError,
        "mask must be a boolean keep-mask (True = attend). "
        "Received: mask with shape (3, 5) and dtype int64",
    ),
    "mask wrong keys": (
        lambda: attend(mask=np.ones((3, 4), bool)),
        ValueError,
        "mask must broadcast to (batch_size, no. of queries, no. of keys) = "
        "(2, 3, 5), or 4-D to (batch_size, num_heads, no. of queries, no. of "
        "keys) = (2, 2, 3, 5). Received: mask with shape (3, 4) and dtype bool",
    ),
    "mask 4-D wrong heads": (
        lambda: attend(mask=np.ones((2, 3, 3, 5), bool)),
        ValueError,
        "mask must broadcast to (batch_size, no. of queries, no. of keys) "
        "= (2, 3, 5), or 4-D to (batch_size, num_heads, no. of queries, "
        "no. of keys) = (2, 2, 3, 5). "
        "Received: mask with shape (2, 3, 3, 5) and dtype bool",
    ),
    "mask 4-D on single head": (
        lambda: mha.DotProductAttention()(f32, keys32, values32, mask=np.ones((2, 1, 3, 5), bool)),
        ValueError,
        "mask must broadcast to (batch_size, no. of queries, no. of keys) = (2, 3, 5). "
        "Received: mask with shape (2, 1, 3, 5) and dtype bool",
    ),
    "causal not bool": (
        lambda: attend(causal="yes"),
        TypeError,
        "causal must be True or False. Received: causal='yes'",
    ),
    "alignment unknown": (
        lambda: attend(causal=True, alignment="bottom"),
        ValueError,
        "alignment must be 'top_left', 'bottom_right' or the position of the first query "
        "(an int). Received: alignment='bottom'",
    ),
    "alignment a bool": (
        # True is an int to Python, but not the position of the first query
        lambda: attend(causal=True, alignment=True),
        ValueError,
        "alignment must be 'top_left', 'bottom_right' or the position of the first query "
        "(an int). Received: alignment=True",
    ),
    "need_weights not bool": (
        lambda: attend(need_weights=None),
        TypeError,
        "need_weights must be True or False. Received: need_weights=None",
    ),
    "causal a numpy bool": (
        # numpy 1 prints its bool as Python's; the message says which it is
        lambda: attend(causal=np.array(True)[()]),
        TypeError,
        "causal must be True or False. Received: causal="
        + (
            "np.True_"
            if np.lib.NumpyVersion(np.__version__) >= "2.0.0"
            else "True of type numpy.bool_"
        ),
    ),
    "window_mask rank 2": (
        lambda: attend(window_mask=np.ones((3, 5), bool)),
        ValueError,
        "window_mask must have shape (num_windows, no. of queries, no. of keys)"
        " = (num_windows, 3, 5). "
        "Received: window_mask with shape (3, 5) and dtype bool",
    ),
    "window_mask not a batch divisor": (
        lambda: attend(window_mask=np.ones((3, 3, 5), bool)),
        ValueError,
        "batch_size must be a multiple of num_windows (the first axis of window_mask). "
        "Received: batch_size=2, window_mask with shape (3, 3, 5) and dtype bool",
    ),
    "window_mask int": (
        lambda: attend(window_mask=np.ones((1, 3, 5), "int32")),
        TypeError,
        "window_mask must be boolean (True = attend) or have the layer's dtype "
        "float32 (added to the scores). "
        "Received: window_mask with shape (1, 3, 5) and dtype int32",
    ),
    "head_mask wrong size": (
        lambda: attend(head_mask=np.ones(3, "float32")),
        ValueError,
        "head_mask must have shape (num_heads,) = (2,) or "
        "(batch_size, num_heads) = (2, 2). "
        "Received: head_mask with shape (3,) and dtype float32",
    ),
    "head_mask float64": (
        lambda: attend(head_mask=np.ones(2)),
        TypeError,
        "head_mask must be boolean or have the layer's dtype float32. "
        "Received: head_mask with shape (2,) and dtype float64",
    ),
    # masked_softmax, PositionalEncoding, AddNorm
    "masked_softmax int scores": (
        lambda: mha.masked_softmax(np.ones((2, 3), "int64")),
        TypeError,
        "X must have a floating dtype. Received: X with shape (2, 3) and dtype int64",
    ),
    "masked_softmax no keys": (
        lambda: mha.masked_softmax(np.ones((2, 0), "float32")),
        ValueError,
        "X must hold at least one key (last axis): a softmax over no keys is undefined. "
        "Received: X with shape (2, 0) and dtype float32",
    ),
    "masked_softmax rank 1": (
        lambda: mha.masked_softmax(np.ones(3)),
        ValueError,
        "X must have rank 2 or more: (batch_size, ..., no. of keys). "
        "Received: X with shape (3,) and dtype float64",
    ),
    "masked_softmax 2-D lengths of rank 2": (
        # X (2, 5) has no queries' axis: lengths (2, 2) are not per query, whatever their shape
        lambda: mha.masked_softmax(np.ones((2, 5), "float32"), np.ones((2, 2), "int64")),
        ValueError,
        "2-D valid_lens needs X of rank 3 or more: (batch_size, no. of queries, no. of keys). "
        "Received: X with shape (2, 5) and dtype float32, valid_lens with shape (2, 2) and "
        "dtype int64",
    ),
    "rotary offset bool": (
        # True is an int to Python, but not a position
        lambda: mha.RotaryEmbedding(4)(f32, offset=True),
        ValueError,
        "offset must be a non-negative integer. Received: offset=True",
    ),
    "add_norm ranks differ": (
        # Y (4, 4) would broadcast against X (4, 4, 4): the shapes must be the same
        lambda: mha.AddNorm(4)(np.ones((4, 4, 4), "float32"), np.ones((4, 4), "float32")),
        ValueError,
        "X and Y must have the same shape. Received: X with shape (4, 4, 4), Y with shape (4, 4)",
    ),
    "sequence longer than max_len": (
        lambda: mha.PositionalEncoding(4, max_len=2)(f32),
        ValueError,
        "X is longer than max_len=2: build the layer with a larger max_len. "
        "Received: X with shape (2, 3, 4) and dtype float32",
    ),
    "encoding size mismatch": (
        lambda: mha.PositionalEncoding(5)(f32),
        ValueError,
        "The last axis of X must have size num_hiddens=5. "
        "Received: X with shape (2, 3, 4) and dtype float32",
    ),
    "add_norm shapes differ": (
        lambda: mha.AddNorm(4)(f32, np.zeros((2, 2, 4), "float32")),
        ValueError,
        "X and Y must have the same shape. "
        "Received: X with shape (2, 3, 4), Y with shape (2, 2, 4)",
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_error_message(case):
    action, error_type, message = ERRORS[case]
    with pytest.raises(error_type) as caught:
        action()
    assert str(caught.value) == message
    # Raised by the shared checks, before any framework call: mha.validation's own, or those it
    # names from mha.layer_args (constructors' arguments), mha.cache and mha.tensors
    frame = caught.tb
    while frame.tb_next is not None:
        frame = frame.tb_next
    assert frame.tb_frame.f_code.co_filename.endswith(
        ("validation.py", "layer_args.py", "registry.py", "cache.py", "tensors.py")
    )


def test_messages_name_the_argument():
    for _, (_, _, message) in ERRORS.items():
        assert re.search(r"Received: ", message), message


def test_shape_and_dtype_readers():
    assert validation.shape_of(np.zeros((2, 3))) == (2, 3)
    assert validation.dtype_name(np.zeros(2, bool)) == "bool"
    assert validation.check_dtype(np.float64) == "float64"
    assert validation.check_dtype(np.dtype("float16")) == "float16"


@pytest.mark.parametrize(
    "lengths, message",
    [
        ([2, 0, 3], None),
        ([2, -1, -3], "must be non-negative. Received: valid_lens containing -3"),
        ([2.0, 1.5, 0.25], "must hold whole numbers. Received: valid_lens containing 1.5"),
        ([2.0, np.nan], "must hold whole numbers. Received: valid_lens containing nan"),
        ([2.0, np.inf], None),  # every key, as numpy's x == floor(x) says of infinity
        ([2.0, -np.inf], "must be non-negative. Received: valid_lens containing -inf"),
        ([np.float32(0.1)], "containing 0.10000000149011612"),  # float32's value, in full
        ([True, False], None),
    ],
)
def test_valid_lens_values_few_or_many_give_the_same_verdict(lengths, message):
    # A few lengths are read as Python numbers (by the backend, or from numpy), many by
    # numpy's reductions: the same rule, and the same smallest length
    dtype = np.asarray(lengths).dtype if not isinstance(lengths[0], np.float32) else "float32"
    few = np.array(lengths, dtype)
    many = np.concatenate([few, np.ones(validation.FEW_LENGTHS, dtype)]).reshape(-1, 1)
    assert many.size > validation.FEW_LENGTHS >= few.size
    for values in (few, many, few.tolist()):
        if message is None:
            assert validation.check_valid_lens_values(values) == np.min(values)
        else:
            with pytest.raises(ValueError, match="valid_lens " + re.escape(message) + "$"):
                validation.check_valid_lens_values(values)


def test_valid_lens_larger_than_keys_is_accepted():
    output = mha_layer()(f32, keys32, values32, np.array([7, 100]))
    assert output.shape == (2, 3, 8)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "bool"])
def test_shapes_and_dtypes_of_every_framework(backend, dtype):
    # Read from the framework's own tensor, without converting it to numpy
    tensor = backend.from_numpy(np.zeros((2, 3, 1), dtype=dtype))
    assert validation.shape_of(tensor) == (2, 3, 1)
    assert validation.dtype_name(tensor) == dtype


def test_unknown_sizes_of_symbolic_shapes_are_not_errors():
    class Symbolic:
        shape = (None, 3, 4)
        dtype = np.dtype("float32")

    queries = Symbolic()
    sizes = validation.check_attention_call(queries, queries, queries, dtype="float32")
    assert sizes == (None, 3, 3)


LAYERS = {
    "MultiHeadAttention": (8, 2),
    "DotProductAttention": (),
    "AdditiveAttention": (8,),
    "PositionalEncoding": (8,),
    "AddNorm": (8,),
}


@pytest.mark.parametrize("class_name", LAYERS)
def test_bfloat16_only_where_the_backend_computes_in_it(backend, class_name):
    # numpy and MXNet 1.9 have no bfloat16 arithmetic: a clear error at construction, not
    # numpy's or MXNet's own error, nor a silent float32 result; torch and TensorFlow build it
    name = backend.__name__.rsplit(".", 1)[-1]
    build = getattr(backend, class_name)
    if name in ("numpy", "mxnet"):
        message = (
            f"dtype must be one of float16, float32, float64 in the {name} backend "
            "(bfloat16 computes in torch, tensorflow and jax). Received: dtype='bfloat16'"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            build(*LAYERS[class_name], dtype="bfloat16")
    else:
        assert build(*LAYERS[class_name], dtype="bfloat16").dtype == "bfloat16"
    assert build(*LAYERS[class_name], dtype="float16").dtype == "float16"


def test_a_mask_for_more_queries_than_the_call_has_is_refused():
    # Broadcasting goes one way: a mask of 3 queries does not fit a call of 1 query (it
    # would make 3 rows of output from 1), though the call's 1 would fit the mask's 3
    one = np.zeros((2, 1, 4), "float32")
    mask = np.ones((2, 3, 5), bool)
    with pytest.raises(ValueError, match=r"mask must broadcast to .* = \(2, 1, 5\)"):
        attend(queries=one, mask=mask)
    attend(mask=mask)  # 3 queries: the same mask fits
