"""Whatever a masked key holds stays out: NaN or inf in a key that a mask excludes changes no
output of a query that does not attend to it, in every backend, under every kind of mask,
called eagerly and under the backend's compiler (torch.compile, tf.function, hybridize, nnx.jit).

Padding positions of real batches hold anything; masked keys get exactly zero weight.
"""

import numpy as np
import pytest
from masked_key_cases import LAST, MASKS, K, Q

import mha
from conftest import backend_module, backend_params, framework_import
from mha.backends import numpy as N

B, D, H = 2, 8, 2


def layers(module, multihead):
    if not multihead:
        return N.DotProductAttention(dtype="float64"), module.DotProductAttention(dtype="float64")
    reference = N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D, dtype="float64")
    layer = module.MultiHeadAttention(D, H, dtype="float64")
    mha.set_weights(layer, mha.get_weights(reference))
    return reference, layer


def eager(module, layer, inputs, arguments):
    return layer(*inputs, **arguments), layer.attention_weights


def assert_masked_key_changes_nothing(name, kind, masks, poison, call=eager):
    """Key LAST holds `poison`; the rows that do not attend to it must equal the reference's
    on clean keys, and its weights be 0. `call(module, layer, inputs, arguments)` returns the
    output and the weights (the layer's own call, eager, by default)."""
    module = backend_module(name)
    reference, layer = layers(module, kind != "dot")
    rng = np.random.default_rng(0)
    queries, keys, values = (rng.standard_normal((B, n, D)) for n in (Q, K, K))
    kwargs = MASKS[masks]
    expected = reference(queries, keys, values, **kwargs)
    weights = reference.attention_weights
    # Rows that give key LAST no weight (in every head)
    masked = weights[..., LAST] == 0
    rows = masked.all(axis=1) if weights.ndim == 4 else masked
    assert rows.any()
    poisoned = keys.copy()
    poisoned[:, LAST] = poison
    arguments = {
        k: module.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()
    }
    if kind == "multihead_no_weights":
        arguments["need_weights"] = False
    inputs = [module.from_numpy(x) for x in (queries, poisoned, values)]
    output, got = call(module, layer, inputs, arguments)
    output = module.to_numpy(output)
    np.testing.assert_allclose(output[rows], expected[rows], rtol=0, atol=1e-12)
    if kind != "multihead_no_weights":
        got = module.to_numpy(got)
        np.testing.assert_allclose(got[..., LAST][masked], 0, atol=0)


KINDS = ["dot", "multihead", "multihead_no_weights"]


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", backend_params())
def test_a_masked_key_holding_anything_changes_nothing(name, kind, masks, poison):
    assert_masked_key_changes_nothing(name, kind, masks, poison)


# Compiled, a call cannot read the keys' values to choose its path (a graph has none, and on an
# accelerator a read waits for the device): each compiler's call keeps the masked keys out too.
# Each call checks that it was traced, so that an eager fallback passes nothing by accident.


def torch_compiled(module, layer, inputs, arguments):
    import torch

    traced = []
    attend = module.DotProductAttention.attend

    def spy(self, *args, **kwargs):  # the attention's paths are chosen while compiling
        traced.append(torch.compiler.is_compiling())
        return attend(self, *args, **kwargs)

    # A fresh cache: each test's layer is a new graph, and dynamo stops compiling a function
    # after a few graphs (its recompile limit), then runs it eagerly
    torch.compiler.reset()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module.DotProductAttention, "attend", spy)
        # backend="eager" runs dynamo's graph as captured: the paths of compiled calls, quickly
        output = torch.compile(layer, backend="eager")(*inputs, **arguments)
    assert traced == [True]
    return output, layer.attention_weights


def tensorflow_function(module, layer, inputs, arguments):
    import tensorflow as tf

    traced = []

    @tf.function
    def call(queries, keys, values):
        traced.append(not tf.executing_eagerly())
        return layer(queries, keys, values, **arguments), layer.attention_weights

    output = call(*inputs)
    assert traced == [True]
    return output


def mxnet_hybridized(module, layer, inputs, arguments):
    layer.hybridize()
    output = layer(*inputs, **arguments)
    assert layer._cached_op is not None  # the hybridized graph ran
    return output, layer.attention_weights


def jax_nnx_jit(module, layer, inputs, arguments):
    import jax
    from flax import nnx

    traced = []
    arrays = {k: v for k, v in arguments.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in arguments.items() if k not in arrays}

    @nnx.jit
    def call(layer, queries, keys, values, arrays):
        traced.append(isinstance(keys, jax.core.Tracer))
        return layer(queries, keys, values, **arrays, **static), layer.attention_weights

    output = call(layer, *inputs, arrays)
    assert traced == [True]
    return output


def torch_traced(module, layer, inputs, arguments):
    """torch.jit.trace of the call on clean inputs (zeros, lengths keeping every key), run on
    the real ones: its graph keeps every branch its example took, so none may hang on values."""
    import torch

    tensors = {k: v for k, v in arguments.items() if isinstance(v, torch.Tensor)}
    static = {k: v for k, v in arguments.items() if k not in tensors}
    weights = static.get("need_weights", True)

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, queries, keys, values, *masks):
            output = self.layer(
                queries, keys, values, **dict(zip(tensors, masks, strict=True)), **static
            )
            return (output, self.layer.attention_weights) if weights else output

    example = [torch.full_like(v, K) if k == "valid_lens" else v for k, v in tensors.items()]
    traced = torch.jit.trace(Call(), (*map(torch.zeros_like, inputs), *example), check_trace=False)
    result = traced(*inputs, *tensors.values())
    return result if weights else (result, None)


COMPILED = {
    "torch": torch_compiled,
    "tensorflow": tensorflow_function,
    "mxnet": mxnet_hybridized,
    "jax": jax_nnx_jit,
}


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", backend_params(list(COMPILED)))
def test_a_masked_key_changes_nothing_in_a_compiled_call(name, kind, masks, poison):
    assert_masked_key_changes_nothing(name, kind, masks, poison, COMPILED[name])


# torch warns where a size becomes the trace's constant: the sizes are the example's
@pytest.mark.filterwarnings("ignore:Converting a tensor to a Python")
@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_masked_key_changes_nothing_in_a_torch_jit_trace(kind, masks, poison):
    # Traced on finite keys whose lengths keep every key: rows with no key and masked keys
    # holding NaN must still be what the reference gives
    assert_masked_key_changes_nothing("torch", kind, masks, poison, torch_traced)


@pytest.mark.torch
@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("kind", ["dot", "multihead"])
def test_a_masked_key_changes_nothing_in_torchs_masked_product(kind, masks, poison, monkeypatch):
    # These scores are few, which the scores path computes: counted as many, a call with
    # weights takes the masked product where it may (a mask of whole keys, whose masked keys
    # are zeroed first), and the poison must stay out there too
    backend_module("torch")
    from mha.backends import torch_fused

    monkeypatch.setattr(torch_fused, "SMALL_SCORES", 0)
    product, taken = torch_fused.masked_product, []
    monkeypatch.setattr(torch_fused, "masked_product", lambda *a: taken.append(1) or product(*a))
    assert_masked_key_changes_nothing("torch", kind, masks, poison)
    assert bool(taken) == (masks in ("valid_lens", "mask")), taken


def float32_layers(module, kind):
    """A float64 reference and a float32 layer; multi-head ones with identity projections."""
    if kind == "dot":
        return N.DotProductAttention(dtype="float64"), module.DotProductAttention()
    reference = N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D, dtype="float64")
    layer = module.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D)
    identity = {n: np.eye(D) for n in ("W_q", "W_k", "W_v", "W_o")}
    mha.set_weights(reference, identity)
    mha.set_weights(layer, {n: w.astype("float32") for n, w in identity.items()})
    return reference, layer


@pytest.mark.filterwarnings("ignore:overflow encountered")  # NumPy's, at the masked scores
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", backend_params())
def test_a_finite_masked_key_whose_score_overflows_changes_nothing(name, kind, masks):
    assert_overflowing_masked_key_changes_nothing(name, kind, masks)


@pytest.mark.torch
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_finite_masked_key_whose_score_overflows_in_torchs_masked_product(
    kind, masks, monkeypatch
):
    # These scores are few: counted as many, a call with weights takes the masked product
    backend_module("torch")
    from mha.backends import torch_fused

    monkeypatch.setattr(torch_fused, "SMALL_SCORES", 0)
    assert_overflowing_masked_key_changes_nothing("torch", kind, masks)


def assert_overflowing_masked_key_changes_nothing(name, kind, masks):
    # Key LAST holds 3e38 and -3e38, finite in float32, summing to 0, and every query scores
    # it +inf: torch added the mask's -inf to that +inf (NaN in every row), which its check of
    # the keys' sum let through. Identity projections keep the key as it is
    module = backend_module(name)
    reference, layer = float32_layers(module, kind)
    sign = np.where(np.arange(D) % 2 == 0, 1, -1).astype("float32")
    rng = np.random.default_rng(0)
    queries = 2 * sign * (1 + rng.random((B, Q, D), "float32"))  # each query's signs: the key's
    keys, values = (rng.standard_normal((B, K, D), "float32") for _ in "kv")
    kwargs = MASKS[masks]
    expected = reference(*(x.astype("float64") for x in (queries, keys, values)), **kwargs)
    masked = reference.attention_weights[..., LAST] == 0
    rows = masked.all(axis=1) if masked.ndim == 3 else masked
    # One of each sign, in one example: no partial sum over the keys overflows
    keys[0, LAST] = 0
    keys[0, LAST, :2] = 3e38, -3e38
    arguments = {
        k: module.from_numpy(v.astype("float32") if v.dtype == "float64" else v)
        if isinstance(v, np.ndarray)
        else v
        for k, v in kwargs.items()
    }
    if kind == "multihead_no_weights":
        arguments["need_weights"] = False
    output = layer(*(module.from_numpy(x) for x in (queries, keys, values)), **arguments)
    np.testing.assert_allclose(module.to_numpy(output)[rows], expected[rows], rtol=0, atol=1e-5)


# What an attended score holds decides its row: softmax of a row with a NaN, a +inf, or only
# -inf among its kept entries is undefined, and in float64 every backend gives NaN in the
# whole row, as the frameworks' softmax does; a -inf beside finite kept entries just gets
# weight 0.
NAN_ROW = [np.nan] * 4
ATTENDED = {
    "nan": ([np.nan, 1.0, 2.0, 3.0], 3, NAN_ROW),
    "+inf": ([np.inf, 1.0, 2.0, 3.0], 3, NAN_ROW),
    "two +inf": ([np.inf, np.inf, 2.0, 3.0], None, NAN_ROW),
    "only -inf kept": ([-np.inf, -np.inf, 1.0, 2.0], 2, NAN_ROW),
    "only -inf, no mask": ([-np.inf] * 4, None, NAN_ROW),
    "-inf beside a finite": ([-np.inf, 0.0, 1.0, 2.0], 2, [0.0, 1.0, 0.0, 0.0]),
    "no kept key": ([np.inf, np.nan, -np.inf, 1.0], 0, [0.0] * 4),
}


@pytest.mark.parametrize("case", ATTENDED)
@pytest.mark.parametrize("name", backend_params())
def test_a_row_with_nan_or_inf_at_attended_scores(name, case):
    module = backend_module(name)
    row, length, expected = ATTENDED[case]
    X = module.from_numpy(np.array([[row]]))
    valid_lens = None if length is None else module.from_numpy(np.array([length]))
    got = module.to_numpy(module.masked_softmax(X, valid_lens))
    np.testing.assert_array_equal(got[0, 0], expected)


@pytest.mark.parametrize("case", [case for case in ATTENDED if ATTENDED[case][2] is NAN_ROW])
@pytest.mark.parametrize("name", backend_params())
def test_an_undefined_row_in_float32_is_nan_where_it_is_undefined(name, case):
    # docs/design.md: in float32, TensorFlow's and MXNet's softmax kernels give 0 beside the
    # NaN and +inf scores of an undefined row, where the others give NaN
    module = backend_module(name)
    row, length, _ = ATTENDED[case]
    row = np.array(row)
    kept = np.arange(len(row)) < (len(row) if length is None else length)
    undefined = kept & (np.isnan(row) | (row == np.inf))
    if not undefined.any():  # only -inf kept: every kept entry
        undefined = kept
    X = module.from_numpy(row[None, None].astype("float32"))
    valid_lens = None if length is None else module.from_numpy(np.array([length]))
    got = module.to_numpy(module.masked_softmax(X, valid_lens))[0, 0]
    assert np.isnan(got[undefined]).all()
    assert (np.isnan(got) | (got == 0)).all()
    if name not in ("tensorflow", "mxnet"):
        assert np.isnan(got).all()


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("kind", ["dot", "multihead", "multihead_no_weights"])
@pytest.mark.parametrize("name", backend_params())
def test_an_attended_key_holding_nan_or_inf_makes_its_rows_nan(name, kind, poison):
    module = backend_module(name)
    _, layer = layers(module, kind != "dot")
    rng = np.random.default_rng(1)
    queries, keys, values = (rng.standard_normal((B, n, D)) for n in (Q, K, K))
    keys[:, LAST] = poison
    # Key LAST is attended by every query of example 0 and by none of example 1
    valid_lens = np.array([K, LAST])
    extra = {"need_weights": False} if kind == "multihead_no_weights" else {}
    output = module.to_numpy(
        layer(
            *map(module.from_numpy, (queries, keys, values)), module.from_numpy(valid_lens), **extra
        )
    )
    assert np.isnan(output[0]).all()
    assert np.isfinite(output[1]).all()
    if not extra:
        weights = module.to_numpy(layer.attention_weights)
        assert np.isnan(weights[0]).all()
        assert np.isfinite(weights[1]).all()


@pytest.mark.torch
@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
def test_a_bias_holding_anything_at_masked_keys_changes_no_gradient(need_weights, poison):
    # An example with no key (valid_lens 0) and a bias holding NaN or inf only at keys the
    # lengths leave out: the gradients of every input and weight are those of the same call
    # with a clean bias (torch's fused path once took them all NaN: an empty row keeps every
    # key in the kernel, its bias with them)
    T = backend_module("torch")
    torch = framework_import("torch")
    layer = T.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D, dtype="float64")
    rng = np.random.default_rng(0)
    queries, keys, values = (rng.standard_normal((B, n, D)) for n in (Q, K, K))
    lengths = np.array([0, K - 1])
    clean = rng.standard_normal((B, H, Q, K))
    poisoned = clean.copy()
    poisoned[0], poisoned[1, ..., K - 1] = poison, poison

    def gradients(bias):
        tensors = [torch.tensor(x, requires_grad=True) for x in (queries, keys, values, bias)]
        layer.zero_grad()
        output = layer(
            *tensors[:3], torch.tensor(lengths), attn_bias=tensors[3], need_weights=need_weights
        )
        output.sum().backward()
        grads = [t.grad for t in tensors[:3]] + [p.grad for p in layer.parameters()]
        bias_grad = tensors[3].grad.clone()
        bias_grad[0], bias_grad[1, ..., K - 1] = 0, 0  # the poisoned entries' own
        return [g.numpy() for g in (*grads, bias_grad)]

    for got, expected in zip(gradients(poisoned), gradients(clean), strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
