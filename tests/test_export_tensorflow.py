"""Keras models holding mha's TensorFlow layers, exported: a SavedModel (keras.Model.export),
a .keras file and a LiteRT flatbuffer give the float64 NumPy reference's numbers.

One functional model holds every case below (each layer with each of its masks, a KV cache,
the masked softmax, the positional encodings, the rotary embedding and AddNorm), its outputs
keyed by case, so that it is exported, saved and converted once. Every size of batch, queries,
keys and cached positions is left unknown to the model. The artifacts run on two draws of
inputs: the second's values differ, its row with no key to attend is in another example and
its sizes differ, so that nothing read from the first draw can stay in them. Each is held to
the reference layer built in float64 with the same weights, within float32's agreement
(tests/test_export_torch.py does the same for torch.export and ONNX).

LiteRT is converted with TensorFlow Lite's builtin ops alone (no Select TF ops): the
interpreter of ai-edge-litert, like tf.lite.Interpreter, runs no Flex op. A .keras file cannot
hold a call given a KV cache; a test states how loading it fails.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import mha
from conftest import assert_agrees, backend_module
from export_cases import (
    ATTENTION_MASKS,
    GROUPED,
    HEAD_SIZE,
    HEADS,
    LAYERS,
    MULTIHEAD_CASES,
    OTHER_CASES,
)
from mha.backends import numpy as N

pytestmark = pytest.mark.tensorflow

# (batch size, no. of queries, no. of keys, cached positions) of the two draws of inputs; no
# size of one equals the same size of the other, so an axis whose size the draws share is one
# the model fixes
SIZES = [(2, 3, 4, 2), (3, 5, 6, 3)]

# Attention cases: id -> (class name, config, mask kinds)
ATTENTION_CASES = {
    f"{name}-{'+'.join(kinds)}": (name, LAYERS[name], kinds)
    for name in LAYERS
    for kinds in ATTENTION_MASKS
} | {
    f"MultiHeadAttention-{case}": (
        "MultiHeadAttention",
        {**LAYERS["MultiHeadAttention"], **config},
        kinds,
    )
    for case, (config, kinds) in MULTIHEAD_CASES.items()
}
# masked_softmax cases: id -> (the input holding X, mask kinds, empty_rows)
SOFTMAX_CASES = {
    "masked_softmax-no_lens": ("scores", [], "zeros"),
    "masked_softmax-valid_lens_1d": ("scores", ["valid_lens_1d"], "zeros"),
    "masked_softmax-valid_lens_2d": ("scores", ["valid_lens_2d"], "zeros"),
    "masked_softmax-heads+valid_lens_2d": ("scores_4d", ["valid_lens_2d"], "zeros"),
    "masked_softmax-uniform_empty_rows": ("scores", ["valid_lens_1d"], "uniform"),
}
CASES = [*ATTENTION_CASES, *SOFTMAX_CASES, *OTHER_CASES]

# The call argument each kind of mask is given as; the flags are Python values, fixed in the
# model
ARGUMENTS = {
    "valid_lens_1d": "valid_lens",
    "valid_lens_2d": "valid_lens",
    "mask_3d": "mask",
    "mask_4d": "mask",
    "window_float": "window_mask",
    "window_bool": "window_mask",
    "attn_bias": "attn_bias",
    "attn_bias_4d": "attn_bias",
    "head_mask_1d": "head_mask",
    "head_mask_2d": "head_mask",
}
FLAGS = {"causal": {"causal": True}, "no_weights": {"need_weights": False}}

# How the model leaves Python and comes back: the model itself (eager), the SavedModel's
# `serve` endpoint and its serving_default signature (what TensorFlow Serving calls), a .keras
# file loaded again, and the LiteRT flatbuffer run by the LiteRT interpreter
WAYS = ["eager", "saved_model", "saved_model_signature", "keras_file", "litert"]


@pytest.fixture(scope="module")
def TF():
    """The tensorflow backend module; a missing TensorFlow fails here when it is required."""
    return backend_module("tensorflow")


# Inputs


def _draw(seed):
    """One draw of every input as numpy arrays: in example `seed` (0 or 1), query 1 attends to
    no key (every query, for 1-D valid_lens; the row 1 + seed of the shared boolean window)."""
    B, Q, K, cached = SIZES[seed]
    empty = seed
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    arrays = {
        "queries": normal(B, Q, 6),
        "keys": normal(B, K, 6),
        "values": normal(B, K, 7),
        "scores": normal(B, Q, K),
        "scores_4d": normal(B, HEADS, Q, K),
        # Sequences of 5 positions, and 7 in the second draw (max_len 10)
        "sequence": normal(B, Q + 2, 8),
        "residual": normal(B, Q + 2, 8),
    }
    arrays["valid_lens_1d"] = rng.integers(1, K + 1, B).astype(np.int32)
    arrays["valid_lens_1d"][empty] = 0
    arrays["valid_lens_2d"] = rng.integers(1, K + 1, (B, Q)).astype(np.int32)
    arrays["valid_lens_2d"][empty, 1] = 0
    for kind, shape in (("mask_3d", (B, Q, K)), ("mask_4d", (B, HEADS, Q, K))):
        arrays[kind] = rng.random(shape) < 0.7
        arrays[kind][empty, ..., 1, :] = False
    window = normal(B, Q, K)
    window[rng.random(window.shape) < 0.2] = -np.inf
    window[empty, 1] = -np.inf
    arrays["window_float"] = window
    # One window shared by the batch
    arrays["window_bool"] = rng.random((1, Q, K)) < 0.7
    arrays["window_bool"][0, 1 + empty] = False
    for kind, shape in (("attn_bias", (B, Q, K)), ("attn_bias_4d", (B, HEADS, Q, K))):
        arrays[kind] = normal(*shape)
        arrays[kind][empty, ..., 1, :] = -np.inf
    arrays["head_mask_1d"] = rng.random(HEADS).astype(np.float32)
    arrays["head_mask_2d"] = rng.random((B, HEADS)).astype(np.float32)
    # Keys and values of the cached positions, with GROUPED's 2 key-value heads
    arrays["cache_keys"] = normal(B, GROUPED["num_kv_heads"], cached, HEAD_SIZE)
    arrays["cache_values"] = normal(B, GROUPED["num_kv_heads"], cached, HEAD_SIZE)
    return arrays


DRAWS = [_draw(0), _draw(1)]


def _call_arguments(kinds, inputs):
    """The keyword arguments of a call with the masks of `kinds`, taken from `inputs`."""
    kwargs = {}
    for kind in kinds:
        if kind in FLAGS:
            kwargs.update(FLAGS[kind])
        elif kind == "empty_cache":
            kwargs["cache"] = mha.KVCache()
        elif kind == "cache":
            kwargs["cache"] = mha.KVCache(inputs["cache_keys"], inputs["cache_values"])
        else:
            kwargs[ARGUMENTS[kind]] = inputs[kind]
    return kwargs


def _leaves(output):
    """An output, or (output, KVCache), as a list of arrays."""
    if isinstance(output, tuple | list):
        return [leaf for each in output for leaf in _leaves(each)]
    return [output]


def _output_names(case, count):
    """The names of a case's `count` outputs in the model, the SavedModel's signature and
    LiteRT's."""
    name = re.sub(r"\W", "_", case)
    return [f"{name}_{i}" for i in range(count)]


def _layer_key(name, config, kinds=()):
    """The layer a case calls: one per class and config, and another for the calls that
    return a KV cache. In a functional model, a layer whose later call returns more tensors
    than its first call leaves those out of the graph (Keras 3.15: "Output ... is not
    connected to `inputs`")."""
    return name, json.dumps(config, sort_keys=True), any("cache" in kind for kind in kinds)


def _float64(arrays):
    return {
        name: x.astype(np.float64) if x.dtype == np.float32 else x for name, x in arrays.items()
    }


# The reference


def _reference_layers(layers):
    """The float64 NumPy layer of each TensorFlow layer, with the same weights."""
    references = {}
    for key, layer in layers.items():
        name, config = key[0], json.loads(key[1])
        reference = getattr(N, name)(**config, dtype="float64")
        weights = mha.get_weights(layer)
        if weights:
            mha.set_weights(reference, {n: w.astype(np.float64) for n, w in weights.items()})
        references[key] = reference
    return references


def _assert_has_empty_row(weights, empty_rows):
    """The draw holds a query attending to no key: a row of zeros, or of 1 / no. of keys."""
    if empty_rows == "zeros":
        assert (weights == 0).all(axis=-1).any()
    else:
        assert (weights == weights.dtype.type(1 / weights.shape[-1])).all(axis=-1).any()


def _reference_outputs(references, arrays):
    """Every case's output by the float64 reference, on one draw."""
    arrays = _float64(arrays)
    outputs = {}
    for case, (name, config, kinds) in ATTENTION_CASES.items():
        reference = references[_layer_key(name, config, kinds)]
        outputs[case] = _leaves(
            reference(
                arrays["queries"],
                arrays["keys"],
                arrays["values"],
                **_call_arguments(kinds, arrays),
            )
        )
        if "no_weights" not in kinds:
            _assert_has_empty_row(reference.attention_weights, config.get("empty_rows", "zeros"))
    for case, (source, kinds, empty_rows) in SOFTMAX_CASES.items():
        valid_lens = _call_arguments(kinds, arrays).get("valid_lens")
        outputs[case] = [N.masked_softmax(arrays[source], valid_lens, empty_rows=empty_rows)]
        if valid_lens is not None:
            _assert_has_empty_row(outputs[case][0], empty_rows)
    for case, (name, config, num_inputs, kwargs) in OTHER_CASES.items():
        reference = references[_layer_key(name, config)]
        sequences = [arrays["sequence"], arrays["residual"]][:num_inputs]
        outputs[case] = [reference(*sequences, **kwargs)]
    return outputs


# The model


def _model(TF):
    """(functional Keras model of every case, the model of the cases a .keras file can hold,
    the mha layers keyed by _layer_key, the custom objects to load a .keras file with). Each
    layer is made once, with seeded random weights, and called once per case of its key."""
    import keras

    class MaskedSoftmax(keras.layers.Layer):
        """mha's masked_softmax as a layer: a function, it needs real tensors."""

        def __init__(self, empty_rows="zeros", **kwargs):
            super().__init__(**kwargs)
            self.empty_rows = empty_rows

        def call(self, X, valid_lens=None):
            return TF.masked_softmax(X, valid_lens, empty_rows=self.empty_rows)

        def get_config(self):
            return {**super().get_config(), "empty_rows": self.empty_rows}

    # Every size that differs between the two draws is unknown to the model
    inputs = {
        name: keras.Input(
            batch_shape=tuple(
                a if a == b else None for a, b in zip(first.shape, second.shape, strict=True)
            ),
            dtype=first.dtype.name,
            name=name,
        )
        for (name, first), second in zip(DRAWS[0].items(), DRAWS[1].values(), strict=True)
    }
    layers = {}

    def layer(name, config, kinds=()):
        key = _layer_key(name, config, kinds)
        if key not in layers:
            layers[key] = getattr(TF, name)(**config)
            weights = mha.random_weights(layers[key], seed=len(layers))
            if weights:
                mha.set_weights(layers[key], weights)
        return layers[key]

    outputs = {}
    for case, (name, config, kinds) in ATTENTION_CASES.items():
        outputs[case] = layer(name, config, kinds)(
            inputs["queries"], inputs["keys"], inputs["values"], **_call_arguments(kinds, inputs)
        )
    for case, (source, kinds, empty_rows) in SOFTMAX_CASES.items():
        softmax = MaskedSoftmax(empty_rows)
        outputs[case] = softmax(inputs[source], **_call_arguments(kinds, inputs))
    for case, (name, config, num_inputs, kwargs) in OTHER_CASES.items():
        sequences = [inputs["sequence"], inputs["residual"]][:num_inputs]
        outputs[case] = layer(name, config)(*sequences, **kwargs)
    outputs = {case: _leaves(output) for case, output in outputs.items()}

    def named(cases):
        return {
            name: leaf
            for case in cases
            for name, leaf in zip(
                _output_names(case, len(outputs[case])), outputs[case], strict=True
            )
        }

    return keras.Model(inputs, named(outputs)), layers, {"MaskedSoftmax": MaskedSoftmax}


class _Served:
    """The model, exported each way on first use, and its outputs on both draws."""

    def __init__(self, TF, directory):
        self.TF, self.directory = TF, directory
        self.model, layers, self.custom_objects = _model(TF)
        references = _reference_layers(layers)
        self.expected = [_reference_outputs(references, arrays) for arrays in DRAWS]
        self._outputs = {}

    def outputs(self, way):
        """[outputs on the first draw, on the second], each keyed by output name."""
        if way not in self._outputs:
            # A way that fails fails each of its tests, with its error, once
            try:
                run = getattr(self, f"_{way}")()
                self._outputs[way] = [
                    {name: self.TF.to_numpy(x) for name, x in run(arrays).items()}
                    for arrays in DRAWS
                ]
            except Exception as error:
                self._outputs[way] = error
        if isinstance(self._outputs[way], Exception):
            raise self._outputs[way]
        return self._outputs[way]

    def _eager(self):
        # As inference calls it: Keras passes `training` on to every layer of the model
        return lambda arrays: self.model(arrays, training=False)

    def _saved_model_path(self):
        path = self.directory / "saved_model"
        if not path.exists():
            self.model.export(path, verbose=False)
        return path

    def _loaded(self):
        import tensorflow as tf

        # Kept: the restored functions hold only weak references to its variables
        self.loaded = tf.saved_model.load(str(self._saved_model_path()))
        return self.loaded

    def _saved_model(self):
        return self._loaded().serve

    def _saved_model_signature(self):
        import tensorflow as tf

        signature = self._loaded().signatures["serving_default"]
        return lambda arrays: signature(**{name: tf.constant(x) for name, x in arrays.items()})

    def _keras_file(self):
        import keras

        path = self.directory / "model.keras"
        self.model.save(path)
        loaded = keras.models.load_model(path, custom_objects=self.custom_objects)
        return loaded

    def _litert(self):
        import tensorflow as tf

        try:
            from ai_edge_litert.interpreter import Interpreter
        except ImportError as error:
            pytest.fail(f"ai-edge-litert (the test extra) does not import: {error}", pytrace=False)
        # Keras converts its SavedModel with tf.lite.TFLiteConverter; builtin ops only, so that
        # the converter raises, naming the op, if the model needs another
        path = self.directory / "model.tflite"
        self.model.export(
            path,
            format="litert",
            verbose=False,
            target_spec={"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]},
        )
        runner = Interpreter(model_path=str(path)).get_signature_runner()
        return lambda arrays: runner(**arrays)


@pytest.fixture(scope="module")
def served(TF, tmp_path_factory):
    return _Served(TF, tmp_path_factory.mktemp("export_tensorflow"))


@pytest.mark.parametrize(
    ("way", "case"),
    [pytest.param(way, case, id=f"{way}-{case}") for way in WAYS for case in CASES],
)
def test_exported_model_gives_the_reference(served, way, case):
    for outputs, expected in zip(served.outputs(way), served.expected, strict=True):
        names = _output_names(case, len(expected[case]))
        for name, want in zip(names, expected[case], strict=True):
            assert_agrees(outputs[name], want, "float32")


def test_packed_sequences_convert_to_litert(TF, tmp_path):
    # segment_ids (batch, positions), both sizes unknown, with the rotary positions, chunks and
    # queries' scaling they restart: LiteRT's builtins alone, at two lengths
    import keras
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    X = keras.Input((None, 8), name="X")
    segments = keras.Input((None,), dtype="int32", name="segment_ids")
    scaling = {"beta": 0.5, "original_max_position_embeddings": 2}
    config = {"rope_theta": 100.0, "attention_chunk_size": 2, "query_scaling": scaling}
    layer = TF.MultiHeadAttention(8, HEADS, query_size=8, key_size=8, value_size=8, **config)
    model = keras.Model({"X": X, "segment_ids": segments}, layer(X, X, X, segment_ids=segments))
    builtins = {"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]}
    model.export(tmp_path / "packed.tflite", format="litert", verbose=False, target_spec=builtins)
    runner = Interpreter(model_path=str(tmp_path / "packed.tflite")).get_signature_runner()
    reference = backend_module("numpy").MultiHeadAttention(8, HEADS, **config)
    mha.set_weights(reference, mha.get_weights(layer))
    for n in (5, 9):
        x = np.random.default_rng(n).standard_normal((2, n, 8)).astype(np.float32)
        ids = np.array([[0] * 2 + [1] * (n - 2), [0] * (n - 1) + [2]], np.int32)
        (output,) = runner(X=x, segment_ids=ids).values()
        assert_agrees(output, reference(x, x, x, segment_ids=ids), "float32")


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_latent_attention_converts_to_litert(TF, tmp_path, absorbed):
    # DeepSeek's layer, low-rank queries, lengths and the causal mask, batch and length
    # unknown: LiteRT's builtins alone (its new axes from expand_dims), at two sizes
    import keras
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    sizes = dict(kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3)
    sizes.update(q_lora_rank=4, rope_theta=100.0)
    X = keras.Input((None, 8), name="X")
    lengths = keras.Input((), dtype="int32", name="valid_lens")
    layer = TF.MultiHeadLatentAttention(8, HEADS, **sizes)
    output = layer(X, lengths, causal=True, absorbed=absorbed)
    model = keras.Model({"X": X, "valid_lens": lengths}, output)
    builtins = {"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]}
    model.export(tmp_path / "latent.tflite", format="litert", verbose=False, target_spec=builtins)
    runner = Interpreter(model_path=str(tmp_path / "latent.tflite")).get_signature_runner()
    reference = N.MultiHeadLatentAttention(8, HEADS, **sizes, dtype="float64")
    weights = mha.get_weights(layer)
    mha.set_weights(reference, {name: w.astype(np.float64) for name, w in weights.items()})
    for batch, n in ((2, 5), (3, 9)):
        rng = np.random.default_rng(n)
        x = rng.standard_normal((batch, n, 8)).astype(np.float32)
        valid_lens = rng.integers(1, n + 1, batch).astype(np.int32)
        (got,) = runner(X=x, valid_lens=valid_lens).values()
        expected = reference(x.astype(np.float64), valid_lens, causal=True)
        assert_agrees(got, expected, "float32")


def _litert_runner_and_reference(model, layer, tmp_path):
    """The model exported to LiteRT with builtin operations alone, its signature runner, and
    the NumPy MultiHeadAttention holding `layer`'s weights."""
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    builtins = {"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]}
    model.export(tmp_path / "lengths.tflite", format="litert", verbose=False, target_spec=builtins)
    runner = Interpreter(model_path=str(tmp_path / "lengths.tflite")).get_signature_runner()
    reference = backend_module("numpy").MultiHeadAttention(8, HEADS)
    mha.set_weights(reference, mha.get_weights(layer))
    return runner, reference


def test_a_litert_model_refuses_lengths_and_head_masks_of_another_batch(TF, tmp_path):
    # LiteRT drops the graph's assertions; the sizes the tensors share are tied by reshaping
    # them too, so lengths or head weights of one example for three fail rather than broadcast
    # (deploying.md); the head weights' tie survives the converter's folding of reshapes
    import keras

    X = keras.Input((None, 8), name="X")
    lengths = keras.Input((), dtype="int32", name="valid_lens")
    heads = keras.Input((HEADS,), name="head_mask")
    layer = TF.MultiHeadAttention(8, HEADS, query_size=8, key_size=8, value_size=8)
    inputs = {"X": X, "valid_lens": lengths, "head_mask": heads}
    model = keras.Model(inputs, layer(X, X, X, lengths, head_mask=heads))
    runner, reference = _litert_runner_and_reference(model, layer, tmp_path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 8)).astype(np.float32)
    valid_lens = np.array([2, 5, 3], np.int32)
    head_mask = rng.random((3, HEADS)).astype(np.float32)
    (output,) = runner(X=x, valid_lens=valid_lens, head_mask=head_mask).values()
    assert_agrees(output, reference(x, x, x, valid_lens, head_mask=head_mask), "float32")
    with pytest.raises(RuntimeError, match="RESHAPE"):
        runner(X=x, valid_lens=valid_lens[:1], head_mask=head_mask)
    with pytest.raises(RuntimeError, match="RESHAPE"):
        runner(X=x, valid_lens=valid_lens, head_mask=head_mask[:1])


def test_a_litert_model_refuses_lengths_of_as_many_elements_in_another_shape(TF, tmp_path):
    # (5, 3) lengths of each query for 3 examples of 5 queries hold as many numbers as the
    # right (3, 5) ones: a reshape alone would read them in another order, so a size that
    # differs makes every size of the tie's target -2, which LiteRT's RESHAPE refuses
    import keras

    X = keras.Input((None, 8), name="X")
    lengths = keras.Input((None,), dtype="int32", name="valid_lens")
    layer = TF.MultiHeadAttention(8, HEADS, query_size=8, key_size=8, value_size=8)
    model = keras.Model({"X": X, "valid_lens": lengths}, layer(X, X, X, lengths))
    runner, reference = _litert_runner_and_reference(model, layer, tmp_path)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 8)).astype(np.float32)
    valid_lens = rng.integers(1, 6, (3, 5)).astype(np.int32)
    (output,) = runner(X=x, valid_lens=valid_lens).values()
    assert_agrees(output, reference(x, x, x, valid_lens), "float32")
    with pytest.raises(RuntimeError, match="RESHAPE"):
        runner(X=x, valid_lens=valid_lens.reshape(5, 3))


def test_only_a_keras_file_passes_a_kv_cache_as_a_list(TF):
    import keras

    # A .keras file keeps the KVCache (a namedtuple) as a list of its two symbolic tensors
    # (or Nones), and loading it calls the layer with that list and symbolic queries: the
    # keras_file rows above load it. Any other call given a list is refused, as in every
    # backend
    layer = TF.MultiHeadAttention(**LAYERS["MultiHeadAttention"], **GROUPED)
    cached = (None, GROUPED["num_kv_heads"], None, HEAD_SIZE)
    symbolic = [keras.Input(batch_shape=cached), keras.Input(batch_shape=cached)]
    queries = keras.Input(batch_shape=(None, None, 6))
    values = keras.Input(batch_shape=(None, None, 7))
    _, cache = layer(queries, queries, values, cache=symbolic)
    assert isinstance(cache, mha.KVCache)
    queries = TF.from_numpy(np.zeros((1, 3, 6), "float32"))
    values = TF.from_numpy(np.ones((1, 3, 7), "float32"))
    heads = TF.from_numpy(np.zeros((1, GROUPED["num_kv_heads"], 2, HEAD_SIZE), "float32"))
    others = ([heads, heads], (heads, heads), [None, None], [*symbolic, heads], symbolic[:1])
    for other in others:
        with pytest.raises(TypeError, match=r"cache must be an mha\.KVCache.*Received: cache"):
            layer(queries, queries, values, cache=other)
