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
from export_cases import (
    ATTENTION_MASKS,
    HEADS,
    LAYERS,
    MULTIHEAD_CASES,
    OTHER_CASES,
    SOFTMAX_CASES,
    attention_shapes,
    draws,
)
from mha.backends import numpy as N

pytestmark = [
    pytest.mark.torch,
    # The layers keep their last attention weights in an attribute, which export warns about
    pytest.mark.filterwarnings("ignore:The tensor attribute:UserWarning"),
]

# (batch size, no. of queries, no. of keys, cached positions) of the two draws of inputs. A
# program exported with static shapes runs on the first sizes twice; one exported with dynamic
# shapes, on the second sizes too.
SIZES = [(2, 3, 4, 2), (3, 5, 6, 3)]

# The ways a layer leaves Python: torch.export with the example's shapes, torch.export with
# every size free to change (Dim.AUTO), and the ONNX exporter (which uses torch.export), run by
# ONNX Runtime, with every size free
WAYS = ["export", "export-dynamic", "onnx"]


@pytest.fixture(scope="module")
def T():
    """The torch backend module; a missing torch fails here when torch is required."""
    return backend_module("torch")


# Inputs


def _draws(shapes, kinds, way):
    """Two draws of export_cases.draws: of other sizes in the second draw if `way` exports
    dynamic shapes."""
    return draws(shapes, kinds, SIZES if way != "export" else [SIZES[0]] * 2)


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
    if way in ("export-dynamic", "export-strict"):
        strict = way == "export-strict"  # traced by Dynamo, whose sizes pass for ints
        return T.torch.export.export(
            layer, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict
        ).module()
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


def _check_attention(T, name, config, kinds, way):
    layer, reference = _pair(T, name, {**LAYERS[name], **config})
    _check_exported(T, layer, reference, _draws(attention_shapes, kinds, way), way)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kinds", ATTENTION_MASKS, ids="+".join)
@pytest.mark.parametrize("name", LAYERS)
def test_exported_attention_gives_the_reference(T, name, kinds, way):
    _check_attention(T, name, {}, kinds, way)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("config", "kinds"), MULTIHEAD_CASES.values(), ids=MULTIHEAD_CASES)
def test_exported_multihead_attention_gives_the_reference(T, config, kinds, way):
    _check_attention(T, "MultiHeadAttention", config, kinds, way)


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


# A draw longer than SIZES': its scores are more than torch_fused.SMALL_SCORES, past the sizes
# at which a call's path changes
LONG = (3, 100, 120, 40)


@pytest.mark.parametrize("way", ["export-dynamic", "onnx"])
@pytest.mark.parametrize(
    "case", ["grouped_rotary", "grouped_rotary+no_weights", "cache", "no_weights+mask_3d"]
)
def test_a_program_with_free_sizes_runs_at_sizes_that_take_another_path(T, case, way):
    config, kinds = MULTIHEAD_CASES[case]
    layer, reference = _pair(T, "MultiHeadAttention", {**LAYERS["MultiHeadAttention"], **config})
    from mha.backends import torch_fused

    assert LONG[0] * HEADS * LONG[1] * LONG[2] > torch_fused.SMALL_SCORES
    _check_exported(T, layer, reference, draws(attention_shapes, kinds, [SIZES[0], LONG]), way)


# Rotary scalings whose frequencies follow the sequence's length, past 6 positions (two pairs
# of features turn: the heads' size is 4)
LENGTH_SCALINGS = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 6},
    "longrope": {
        "rope_type": "longrope",
        "factor": 4.0,
        "original_max_position_embeddings": 6,
        "short_factor": [1.0, 1.5],
        "long_factor": [2.0, 5.0],
    },
}


# Dynamo's tracing (strict) holds a call with a cache to the example's batch size (a guard)
@pytest.mark.parametrize(
    "way, cached",
    [("export-dynamic", 0), ("export-dynamic", 3), ("onnx", 0), ("onnx", 3), ("export-strict", 0)],
)
@pytest.mark.parametrize("scaling", LENGTH_SCALINGS.values(), ids=LENGTH_SCALINGS)
def test_a_rotary_scaling_of_the_length_holds_past_the_traced_length(T, scaling, cached, way):
    # Traced on a sequence within the original positions, run on one past them: the program
    # keeps no frequencies of the traced length (the ONNX exporter keeps no guard on it)
    config = {**LAYERS["MultiHeadAttention"], "num_hiddens": 16, "num_kv_heads": 2}
    config.update(rope_theta=1e4, rope_scaling=scaling)
    layer, reference = _pair(T, "MultiHeadAttention", config)
    calls = []
    for seed, (B, Q, K) in enumerate([(2, 3, 3), (3, 5, 9)]):
        rng = np.random.default_rng(seed)
        shapes = attention_shapes(B, Q, K)
        args = tuple(rng.standard_normal(shape).astype(np.float32) for shape in shapes)
        kwargs = {"causal": True, "valid_lens": rng.integers(1, K + 1, B)}
        if cached:  # 3 + 3 positions, then 3 + 9: past the original 6
            shape = (B, 2, cached, 4)
            arrays = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
            kwargs["cache"] = mha.KVCache(*arrays)
        calls.append((args, kwargs))
    _check_exported(T, layer, reference, calls, way)


@pytest.mark.parametrize("way", ["export-dynamic", "export-strict", "onnx"])
@pytest.mark.parametrize("scaling", ["dynamic", "longrope"])
def test_packed_rows_of_a_scaling_of_the_length_are_refused_when_their_length_is_free(
    T, scaling, way
):
    # Each packed sequence's frequencies would follow the row's length past the original
    # positions: a program whose rows' length is free cannot hold them, and is refused, also
    # by Dynamo's tracing (strict, the ONNX exporter's retry), which passes a size for an int
    config = {**LAYERS["MultiHeadAttention"], "num_hiddens": 16}
    config.update(rope_theta=1e4, rope_scaling=LENGTH_SCALINGS[scaling])
    layer, _ = _pair(T, "MultiHeadAttention", config)
    rng = np.random.default_rng(0)
    args = tuple(
        T.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in attention_shapes(2, 3, 3)
    )
    kwargs = {"causal": True, "segment_ids": T.from_numpy(np.array([[0, 0, 1], [0, 1, 1]]))}
    with pytest.raises(Exception, match="rows of a length a traced program leaves free"):
        _export(T, layer, args, kwargs, way)


@pytest.mark.parametrize("way", ["export-dynamic", "onnx"])
@pytest.mark.parametrize(
    "sizes", [[(2, 3, 5), (3, 4, 4)], [(2, 4, 4), (3, 3, 5)]], ids=["keys_first", "as_many_first"]
)
def test_a_bottom_right_causal_program_runs_at_every_offset(T, sizes, way):
    # The causal mask's offset K - Q of free sizes: the program is bound to no choice made on
    # the example's offset (0, or not), and runs at the other
    layer, reference = _pair(T, "MultiHeadAttention", LAYERS["MultiHeadAttention"])
    calls = []
    for seed, (B, Q, K) in enumerate(sizes):
        rng = np.random.default_rng(seed)
        shapes = attention_shapes(B, Q, K)
        args = tuple(rng.standard_normal(shape).astype(np.float32) for shape in shapes)
        calls.append((args, {"causal": True, "alignment": "bottom_right"}))
    _check_exported(T, layer, reference, calls, way)


@pytest.mark.parametrize("strict", [False, True])
def test_the_function_exports_with_free_sizes(T, strict):
    # The function's own checks compare torch.export's symbolic sizes (never hash them) and
    # bind the program to no example's size: it runs at another batch, heads' group and length
    torch = T.torch

    class Function(torch.nn.Module):
        def forward(self, queries, keys, values, valid_lens):
            return T.dot_product_attention(queries, keys, values, valid_lens=valid_lens)

    def draw(seed, B, K):
        rng = np.random.default_rng(seed)
        shapes = ((B, 4, 3, 8), (B, 2, K, 8), (B, 2, K, 6))
        arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
        return (*arrays, rng.integers(0, K + 1, B))

    first, second = draw(0, 2, 5), draw(1, 3, 7)
    batch, batch_and_keys = (
        {0: torch.export.Dim.AUTO},
        {0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO},
    )
    free = {"queries": batch, "keys": batch_and_keys, "values": batch_and_keys, "valid_lens": batch}
    inputs = tuple(T.from_numpy(x) for x in first)
    program = torch.export.export(Function(), inputs, dynamic_shapes=free, strict=strict)
    for arrays in (first, second):
        output = program.module()(*(T.from_numpy(x) for x in arrays))
        expected = N.dot_product_attention(*arrays[:3], valid_lens=arrays[3])
        assert_agrees(T.to_numpy(output), expected, "float32")


@pytest.mark.parametrize("strict", [False, True])
def test_a_decomposed_causal_program_leaves_a_nan_future_key_out(T, strict):
    # Decomposing an exported program (run_decompositions, as ExecuTorch's lowering does)
    # makes SDPA's is_causal a mask added to the scores, NaN + -inf being NaN: the export
    # zeroes the keys after the last query first, so they may hold NaN
    torch = T.torch

    class Causal(torch.nn.Module):
        def forward(self, queries, keys, values):
            return T.dot_product_attention(queries, keys, values, causal=True)

    rng = np.random.default_rng(0)
    queries, keys, values = (
        rng.standard_normal((1, 2, n, 8)).astype(np.float32) for n in (3, 5, 5)
    )
    keys[:, :, 3:] = np.nan  # keys 3 and 4: after the last query's position, top-left
    expected = N.dot_product_attention(queries, keys, values, causal=True)
    assert np.isfinite(expected).all()
    inputs = tuple(T.from_numpy(x) for x in (queries, keys, values))
    program = torch.export.export(Causal(), inputs, strict=strict).run_decompositions()
    assert_agrees(T.to_numpy(program.module()(*inputs)), expected, "float32")


def test_value_checks_of_valid_lens_still_raise_eagerly(T):
    layer, _ = _pair(T, "MultiHeadAttention", LAYERS["MultiHeadAttention"])
    args, kwargs = _draws(attention_shapes, ["valid_lens_1d"], "export")[0]
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


def test_a_program_called_with_a_cache_saves_and_loads(T, tmp_path):
    # torch.export.save writes the input tree by its classes' names and torch.export.load reads
    # them back with its weights_only unpickler: a KVCache (its sizes free, as deploying.md
    # gives them) and a LatentCache save, load and give the reference's numbers again
    torch = T.torch
    Dim = torch.export.Dim
    config = dict(num_hiddens=16, num_heads=4, num_kv_heads=2, rope_theta=1e4, query_size=8,
                  key_size=8, value_size=8)  # fmt: skip
    layer, reference = _pair(T, "MultiHeadAttention", config)
    latent, latent_reference = _pair(T, "MultiHeadLatentAttention", dict(
        num_hiddens=8, num_heads=2, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2,
        v_head_dim=2))  # fmt: skip
    rng = np.random.default_rng(0)

    def draw(B, Q, shape):
        queries = rng.standard_normal((B, Q, shape[0])).astype(np.float32)
        return queries, tuple(rng.standard_normal((B, *s)).astype(np.float32) for s in shape[1:])

    batch, steps, cached = Dim("batch"), Dim("steps"), Dim("cached")
    free = {0: batch, 2: cached}
    for model, numpy_model, shape, make in (
        (layer, reference, [8, (2, 3, 4), (2, 3, 4)], mha.KVCache),
        (latent, latent_reference, [8, (3, 4), (1, 3, 2)], mha.LatentCache),
    ):
        queries, arrays = draw(2, 4, shape)
        if make is mha.KVCache:
            args, kwargs = [_to_torch(T, queries)] * 3, {"causal": True}
            dynamic = {key: {0: batch, 1: steps} for key in ("queries", "keys", "values")}
            dynamic.update(causal=None, cache=mha.KVCache(free, free))
        else:
            args, kwargs, dynamic = [_to_torch(T, queries)], {"causal": True}, None
        kwargs["cache"] = make(*_to_torch(T, arrays))
        program = torch.export.export(model, tuple(args), kwargs, dynamic_shapes=dynamic)
        torch.export.save(program, tmp_path / "program.pt2")
        loaded = torch.export.load(tmp_path / "program.pt2").module()
        output, cache = loaded(*args, **kwargs)
        assert isinstance(cache, make)
        numpy_args = [queries] * len(args)
        expected, expected_cache = numpy_model(*numpy_args, causal=True, cache=make(*arrays))
        assert_agrees(T.to_numpy(output), expected, "float32")
        for each, want in zip(cache, expected_cache, strict=True):
            assert_agrees(T.to_numpy(each), want, "float32")
