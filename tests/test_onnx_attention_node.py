"""ONNX's own Attention operator (opset 23) from mha's torch code: exported at opset 23, a call
of the attention function or of a layer without weights becomes one `Attention` node, with no
softmax of mha's beside it, and ONNX Runtime running that node gives the NumPy reference's
numbers, on the draw it was exported with and on another."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from conftest import backend_module, framework_import, required_import
from mha.backends import numpy as N

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:The tensor attribute:UserWarning"),
]


def _exported(torch, module, args, kwargs):
    """(operator counts, ONNX Runtime session) of `module` exported at opset 23, its tensor
    sizes static."""
    onnxruntime = required_import("onnxruntime")
    program = torch.onnx.export(
        module, args, kwargs=kwargs, dynamo=True, opset_version=23, verbose=False
    )
    graph = program.model_proto.graph
    operators = collections.Counter(node.op_type for node in graph.node)
    session = onnxruntime.InferenceSession(
        program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return operators, session


def _run(session, *arrays):
    names = [each.name for each in session.get_inputs()]
    assert len(names) == len(arrays), names
    return session.run(None, dict(zip(names, arrays, strict=True)))[0]


@pytest.mark.parametrize(
    "options",
    [{"lengths": True}, {"scale": 0.3}],
    ids=["lengths", "scale"],
)
def test_the_function_becomes_one_attention_node(options, rng):
    torch = framework_import("torch")
    T = backend_module("torch")
    lengths = options.pop("lengths", False)

    class Call(torch.nn.Module):
        def forward(self, query, key, value, valid_lens=None):
            return T.dot_product_attention(query, key, value, valid_lens=valid_lens, **options)

    def draw(batch, positions):
        tensors = [
            rng.standard_normal((batch, heads, positions, 8)).astype(np.float32)
            for heads in (4, 2, 2)
        ]
        # Lengths of 1 and more: a row with no key is the kernels' NaN, not a test of export
        return tensors + ([rng.integers(1, positions + 1, batch)] if lengths else [])

    example = draw(2, 5)
    operators, session = _exported(torch, Call(), tuple(map(torch.from_numpy, example)), {})
    assert operators["Attention"] == 1 and "Softmax" not in operators, dict(operators)
    for arrays in (example, draw(2, 5)):
        expected = N.dot_product_attention(
            *arrays[:3], valid_lens=arrays[3] if lengths else None, **options
        )
        np.testing.assert_allclose(_run(session, *arrays), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{"lengths": True}], ids=["lengths"])
def test_a_layer_without_weights_becomes_one_attention_node(options, rng):
    torch = framework_import("torch")
    T = backend_module("torch")
    import mha

    config = dict(num_hiddens=16, num_heads=4, num_kv_heads=2, rope_theta=10000.0)
    layer = T.MultiHeadAttention(**config).eval()
    reference = N.MultiHeadAttention(**config)
    X = rng.standard_normal((2, 5, 16)).astype(np.float32)
    valid_lens = np.array([3, 5])
    kwargs = {"need_weights": False, "causal": options.get("causal", False)}
    if options.get("lengths"):
        kwargs["valid_lens"] = torch.from_numpy(valid_lens)
    operators, session = _exported(torch, layer, (torch.from_numpy(X),) * 3, kwargs)
    mha.set_weights(reference, mha.get_weights(layer))
    assert operators["Attention"] == 1 and "Softmax" not in operators, dict(operators)
    for draw in (X, rng.standard_normal((2, 5, 16)).astype(np.float32)):
        arrays = [draw] * 3 + ([valid_lens] if options.get("lengths") else [])
        expected = reference(
            draw,
            draw,
            draw,
            valid_lens if options.get("lengths") else None,
            causal=kwargs["causal"],
        )
        np.testing.assert_allclose(_run(session, *arrays), expected, rtol=1e-5, atol=1e-5)


def test_a_causal_call_keeps_a_nan_future_key_out_of_the_onnx_program(rng):
    """ONNX's causal mask (the exporter's of is_causal, the Attention node's) is added to the
    scores, and NaN + -inf is NaN: mha's causal calls export as products that replace the
    masked scores, and a NaN or inf after every query reaches no output."""
    torch = framework_import("torch")
    T = backend_module("torch")
    import mha

    config = dict(num_hiddens=16, num_heads=4, num_kv_heads=2, rope_theta=10000.0)
    config.update(query_size=16, key_size=16, value_size=16)
    layer = T.MultiHeadAttention(**config).eval()
    reference = N.MultiHeadAttention(**config)
    mha.set_weights(reference, mha.get_weights(layer))

    class Function(torch.nn.Module):
        def forward(self, query, key, value):
            return T.dot_product_attention(query, key, value, causal=True)

    X = rng.standard_normal((2, 5, 16)).astype(np.float32)
    heads = [rng.standard_normal((2, n, 5, 8)).astype(np.float32) for n in (4, 2, 2)]
    kwargs = {"need_weights": False, "causal": True}
    for module, arrays, call in (
        (layer, [X, X.copy(), X.copy()], lambda *a: reference(*a, causal=True)),
        (Function(), heads, lambda *a: N.dot_product_attention(*a, causal=True)),
    ):
        tensors = tuple(map(torch.from_numpy, arrays))
        _, session = _exported(torch, module, tensors, kwargs if module is layer else {})
        for poison in (np.nan, np.inf):
            keys = arrays[1].copy()
            keys[..., -1, :] = poison  # the last key, after every query but the last
            expected = call(arrays[0], keys, arrays[2])
            got = _run(session, arrays[0], keys, arrays[2])
            # The last query attends the poisoned key: only the rows before it are finite
            np.testing.assert_allclose(
                got[..., :-1, :], expected[..., :-1, :], rtol=1e-5, atol=1e-5
            )
