"""torch.export and ONNX of every layer and mask: the exported program gives the NumPy
reference's numbers.

Each layer is exported on one draw of inputs, by torch.export.export with static shapes, by
torch.export.export with every size dynamic, and by torch.onnx.export(dynamo=True) with every
size dynamic, whose model ONNX Runtime runs. The program then runs on that draw and on a second
one whose values differ, whose row with no key to attend is elsewhere, and whose sizes differ
where they are dynamic, so that nothing read from the first draw can stay in the program. Both
are held to the reference layer holding the same weights, and to the eager call.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import mha
from conftest import assert_agrees, backend_module
from mha.backends import numpy as N

pytestmark = [
    pytest.mark.torch,
    # The layers keep their last attention weights in an attribute, which export warns about
    pytest.mark.filterwarnings("ignore:The tensor attribute:UserWarning"),
]

HEADS, HEAD_SIZE = 4, 2
# (batch size, no. of queries, no. of keys, cached positions) of the two draws of inputs. A
# program exported with static shapes runs on the first sizes twice; one exported with dynamic
# shapes, on the second sizes too.
SIZES = [(2, 3, 4, 2), (3, 5, 6, 3)]

LAYERS = {
    "DotProductAttention": {},
    "AdditiveAttention": {"num_hiddens": 8, "query_size": 6, "key_size": 6},
    "MultiHeadAttention": {
        "num_hiddens": HEADS * HEAD_SIZE,
        "num_heads": HEADS,
        "bias": True,
        "query_size": 6,
        "key_size": 6,
        "value_size": 7,
    },
}
# Llama's attention: 4 query heads sharing 2 key-value heads, rotary embeddings
GROUPED = {"num_kv_heads": 2, "rope_theta": 10000.0}
# The ways a layer leaves Python: torch.export with the example's shapes, torch.export with
# every size free to change (Dim.AUTO), and the ONNX exporter (which uses torch.export), run by
# ONNX Runtime, with every size free
WAYS = ["export", "export-dynamic", "onnx"]


@pytest.fixture(scope="module")
def T():
    """The torch backend module; a missing torch fails here when torch is required."""
    return backend_module("torch")


# Inputs


def _masks(kinds, rng, empty, sizes):
    """The mask arguments of one draw of these sizes, as numpy arrays: in example `empty`,
    query 1 attends to no key (every query, for 1-D valid_lens; every example, for the shared
    boolean window)."""
    B, Q, K, cached = sizes
    kwargs = {}
    for kind in kinds:
        if kind == "valid_lens_1d":
            kwargs["valid_lens"] = rng.integers(1, K + 1, B)
            kwargs["valid_lens"][empty] = 0
        elif kind == "valid_lens_2d":
            kwargs["valid_lens"] = rng.integers(1, K + 1, (B, Q))
            kwargs["valid_lens"][empty, 1] = 0
        elif kind in ("mask_3d", "mask_4d"):
            shape = (B, Q, K) if kind == "mask_3d" else (B, HEADS, Q, K)
            kwargs["mask"] = rng.random(shape) < 0.7
            kwargs["mask"][empty, ..., 1, :] = False
        elif kind == "causal":
            kwargs["causal"] = True
        elif kind == "window_float":
            window = rng.standard_normal((B, Q, K)).astype(np.float32)
            window[rng.random(window.shape) < 0.2] = -np.inf
            window[empty, 1] = -np.inf
            kwargs["window_mask"] = window
        elif kind == "window_bool":
            # One window shared by the batch
            kwargs["window_mask"] = rng.random((1, Q, K)) < 0.7
            kwargs["window_mask"][0, 1 + empty] = False
        elif kind in ("attn_bias", "attn_bias_4d"):
            shape = (B, Q, K) if kind == "attn_bias" else (B, HEADS, Q, K)
            bias = rng.standard_normal(shape).astype(np.float32)
            bias[empty, ..., 1, :] = -np.inf
            kwargs["attn_bias"] = bias
        elif kind in ("head_mask_1d", "head_mask_2d"):
            shape = (HEADS,) if kind == "head_mask_1d" else (B, HEADS)
            kwargs["head_mask"] = rng.random(shape).astype(np.float32)
        elif kind == "no_weights":
            kwargs["need_weights"] = False
        elif kind == "empty_cache":
            kwargs["cache"] = mha.KVCache()
        elif kind == "cache":
            # Keys and values of the cached positions, with GROUPED's 2 key-value heads
            shape = (B, GROUPED["num_kv_heads"], cached, HEAD_SIZE)
            kwargs["cache"] = mha.KVCache(
                *(rng.standard_normal(shape).astype(np.float32) for _ in range(2))
            )
        else:
            raise AssertionError(kind)
    return kwargs


def _draws(shapes, kinds, way):
    """Two draws of (args, kwargs): numpy float32 inputs of the shapes that `shapes` gives for
    (batch, queries, keys) and the masks of `kinds`, the first with its row of no key in
    example 0, the second in example 1; of other sizes in the second draw if `way` exports
    dynamic shapes."""
    draws = []
    for seed in (0, 1):
        sizes = SIZES[seed if way != "export" else 0]
        rng = np.random.default_rng(seed)
        args = tuple(rng.standard_normal(shape).astype(np.float32) for shape in shapes(*sizes[:3]))
        draws.append((args, _masks(kinds, rng, seed, sizes)))
    return draws


def _to_torch(T, value):
    """numpy arrays, alone or in a tuple, KVCache or dict, as torch tensors; the rest as it is."""
    if isinstance(value, np.ndarray):
        return T.from_numpy(value)
    if isinstance(value, mha.KVCache):
        return mha.KVCache(*(None if x is None else T.from_numpy(x) for x in value))
    if isinstance(value, tuple):
        return tuple(_to_torch(T, x) for x in value)
    if isinstance(value, dict):
        return {name: _to_torch(T, x) for name, x in value.items()}
    return value


def _free_sizes(T, value):
    """torch.export's dynamic_shapes for these inputs: every size of every tensor may change."""
    Dim = T.torch.export.Dim
    if isinstance(value, T.torch.Tensor):
        return dict.fromkeys(range(value.dim()), Dim.AUTO)
    if isinstance(value, mha.KVCache):
        # The batch and the cached length; the number of key-value heads and the head size are
        # the layer's (ONNX's grouped-query attention needs them static)
        return mha.KVCache(*(None if x is None else {0: Dim.AUTO, 2: Dim.AUTO} for x in value))
    if isinstance(value, tuple):
        return tuple(_free_sizes(T, x) for x in value)
    if isinstance(value, dict):
        return {name: _free_sizes(T, x) for name, x in value.items()}
    return None


def _leaves(output):
    """An output, or (output, KVCache), as a list of arrays."""
    if isinstance(output, tuple | list):
        return [leaf for each in output for leaf in _leaves(each)]
    return [output]


# Export and compare


def _export(T, layer, args, kwargs, way):
    """`layer` exported the `way` named, as a callable of torch tensors."""
    if way == "export":
        return T.torch.export.export(layer, args, kwargs).module()
    signature = inspect.signature(layer.forward)
    arguments = signature.bind(*args, **kwargs).arguments
    dynamic_shapes = {name: _free_sizes(T, value) for name, value in arguments.items()}
    if way == "export-dynamic":
        return T.torch.export.export(layer, args, kwargs, dynamic_shapes=dynamic_shapes).module()
    program = T.torch.onnx.export(
        layer, args, kwargs=kwargs, dynamo=True, dynamic_shapes=dynamic_shapes, verbose=False
    )
    import onnxruntime  # in the test extra, beside onnx and onnxscript, which the exporter uses

    session = onnxruntime.InferenceSession(
        program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = [each.name for each in session.get_inputs()]

    def run(*args, **kwargs):
        # The model's inputs are the tensors among the arguments, in the signature's order
        arguments = signature.bind(*args, **kwargs).arguments
        tensors = [T.to_numpy(x) for x in _tensors(T, list(arguments.values()))]
        assert len(tensors) == len(names), names
        return session.run(None, dict(zip(names, tensors, strict=True)))

    return run


def _tensors(T, value):
    """The torch tensors in `value` (tensors, tuples, lists), in order."""
    if isinstance(value, T.torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [tensor for each in value for tensor in _tensors(T, each)]
    return []


def _check_exported(T, layer, reference, draws, way):
    """Export `layer` on the first draw; its program on each draw gives the numbers of
    `reference` (a numpy callable) and of the eager call."""
    args, kwargs = draws[0]
    program = _export(T, layer, _to_torch(T, args), _to_torch(T, kwargs), way)
    for args, kwargs in draws:
        torch_args = _to_torch(T, args)
        torch_kwargs = _to_torch(T, kwargs)
        actual = _leaves(program(*torch_args, **torch_kwargs))
        expected = _leaves(reference(*args, **kwargs))
        eager = _leaves(layer(*torch_args, **torch_kwargs))
        assert len(actual) == len(expected) == len(eager)
        for each, want, eager_each in zip(actual, expected, eager, strict=True):
            assert_agrees(_numpy(T, each), want, "float32")
            assert_agrees(_numpy(T, each), T.to_numpy(eager_each), "float32")


def _numpy(T, value):
    return value if isinstance(value, np.ndarray) else T.to_numpy(value)


def _pair(T, name, config):
    """(torch layer in eval mode, numpy layer) of this class and config, with the same weights."""
    layer = getattr(T, name)(**config).eval()
    reference = getattr(N, name)(**config)
    mha.set_weights(reference, mha.get_weights(layer))
    return layer, reference


def _attention_shapes(B, Q, K):
    return [(B, Q, 6), (B, K, 6), (B, K, 7)]


def _check_attention(T, name, config, kinds, way):
    layer, reference = _pair(T, name, {**LAYERS[name], **config})
    _check_exported(T, layer, reference, _draws(_attention_shapes, kinds, way), way)


ATTENTION_MASKS = [
    ["valid_lens_1d"],
    ["valid_lens_2d"],
    ["mask_3d"],
    ["causal", "valid_lens_1d"],
    ["window_float"],
    ["window_bool"],
    ["attn_bias"],
]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kinds", ATTENTION_MASKS, ids="+".join)
@pytest.mark.parametrize("name", LAYERS)
def test_exported_attention_gives_the_reference(T, name, kinds, way):
    _check_attention(T, name, {}, kinds, way)


MULTIHEAD_CASES = {
    "mask_4d": ({}, ["mask_4d"]),
    "attn_bias_4d": ({}, ["attn_bias_4d"]),
    "head_mask_1d": ({}, ["valid_lens_1d", "head_mask_1d"]),
    "head_mask_2d": ({}, ["mask_3d", "head_mask_2d"]),
    "no_weights+valid_lens_1d": ({}, ["valid_lens_1d", "no_weights"]),
    "no_weights+mask_3d": ({}, ["mask_3d", "no_weights"]),
    "no_weights+window_float": ({}, ["window_float", "no_weights"]),
    "sliding_window": ({"sliding_window": 2}, ["valid_lens_2d"]),
    "grouped_rotary": (GROUPED, ["causal", "valid_lens_1d"]),
    "grouped_rotary+no_weights": (GROUPED, ["causal", "valid_lens_1d", "no_weights"]),
    "empty_cache": ({}, ["causal", "valid_lens_1d", "empty_cache"]),
    "cache": (GROUPED, ["causal", "valid_lens_1d", "cache"]),
    "cache+no_weights": (GROUPED, ["causal", "valid_lens_1d", "cache", "no_weights"]),
    "uniform_empty_rows": ({"empty_rows": "uniform"}, ["valid_lens_2d"]),
}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("config", "kinds"), MULTIHEAD_CASES.values(), ids=MULTIHEAD_CASES)
def test_exported_multihead_attention_gives_the_reference(T, config, kinds, way):
    _check_attention(T, "MultiHeadAttention", config, kinds, way)


SOFTMAX_CASES = {
    "no_lens": (lambda B, Q, K: [(B, Q, K)], [], "zeros"),
    "valid_lens_1d": (lambda B, Q, K: [(B, Q, K)], ["valid_lens_1d"], "zeros"),
    "valid_lens_2d": (lambda B, Q, K: [(B, Q, K)], ["valid_lens_2d"], "zeros"),
    "heads+valid_lens_2d": (lambda B, Q, K: [(B, HEADS, Q, K)], ["valid_lens_2d"], "zeros"),
    "uniform_empty_rows": (lambda B, Q, K: [(B, Q, K)], ["valid_lens_1d"], "uniform"),
}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(
    ("shapes", "kinds", "empty_rows"), SOFTMAX_CASES.values(), ids=SOFTMAX_CASES
)
def test_exported_masked_softmax_gives_the_reference(T, shapes, kinds, empty_rows, way):
    class MaskedSoftmax(T.torch.nn.Module):
        def forward(self, X, valid_lens=None):
            return T.masked_softmax(X, valid_lens, empty_rows=empty_rows)

    def reference(X, valid_lens=None):
        return N.masked_softmax(X, valid_lens, empty_rows=empty_rows)

    _check_exported(T, MaskedSoftmax().eval(), reference, _draws(shapes, kinds, way), way)


OTHER_CASES = {
    "PositionalEncoding": ("PositionalEncoding", {"num_hiddens": 8, "max_len": 10}, 1, {}),
    "LearnedPositionalEncoding": (
        "LearnedPositionalEncoding",
        {"num_hiddens": 8, "max_len": 10},
        1,
        {},
    ),
    "RotaryEmbedding": ("RotaryEmbedding", {"num_hiddens": 8, "theta": 500.0}, 1, {"offset": 3}),
    "RotaryEmbedding-interleaved": (
        "RotaryEmbedding",
        {"num_hiddens": 8, "interleaved": True},
        1,
        {"offset": 3},
    ),
    "AddNorm": ("AddNorm", {"num_hiddens": 8}, 2, {}),
}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(
    ("name", "config", "num_inputs", "kwargs"), OTHER_CASES.values(), ids=OTHER_CASES
)
def test_exported_encodings_and_add_norm_give_the_reference(
    T, name, config, num_inputs, kwargs, way
):
    layer, reference = _pair(T, name, config)
    # Sequences of 5 positions, and 7 in the second draw when sizes are dynamic (max_len 10)
    draws = _draws(lambda B, Q, K: [(B, Q + 2, 8)] * num_inputs, [], way)
    _check_exported(T, layer, reference, [(args, kwargs) for args, _ in draws], way)


def test_value_checks_of_valid_lens_still_raise_eagerly(T):
    layer, _ = _pair(T, "MultiHeadAttention", LAYERS["MultiHeadAttention"])
    args, kwargs = _draws(_attention_shapes, ["valid_lens_1d"], "export")[0]
    args = _to_torch(T, args)
    program = T.torch.export.export(layer, args, _to_torch(T, kwargs)).module()
    negative = T.from_numpy(np.array([-1, 2]))
    # Eagerly, after the export too, the values are checked
    with pytest.raises(
        ValueError, match=r"valid_lens must be non-negative\. Received: valid_lens containing -1"
    ):
        layer(*args, valid_lens=negative)
    with pytest.raises(ValueError, match="valid_lens must be non-negative"):
        T.masked_softmax(T.from_numpy(np.zeros((2, 3, 4), np.float32)), negative)
    with pytest.raises(ValueError, match="valid_lens must hold whole numbers"):
        layer(*args, valid_lens=T.from_numpy(np.array([1.5, 2.0])))
    # The exported program does not read them (docs/backends.md): such a length keeps no key
    zero = T.from_numpy(np.array([0, 2]))
    T.torch.testing.assert_close(
        program(*args, valid_lens=negative), program(*args, valid_lens=zero)
    )
