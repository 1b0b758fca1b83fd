"""Every backend computes the NumPy reference's numbers, from one weight set and the same inputs.

Parametrized over backend x layer and masks x dtype: the cases of agreement_cases.py, the one
agreement matrix, whose inputs, references and tolerances are mha.harness's; the backend files
hold no other. Gradients are compared with float64 central differences of the reference and,
for every autograd backend but the run's first, with that one's (the anchor's, as
`mha compare` does); the forward pass runs with and without gradients; masked keys and rows
with no key must give exactly 0. Beside it, one hand-worked case no random input reaches:
logits of 1e4.
"""

import contextlib
import functools

import numpy as np
import pytest

import mha
from agreement_cases import all_cases
from conftest import backend_module, backend_params, required_backends
from mha import harness
from mha.backends import numpy as N
from mha.registry import BACKENDS

# The rows of numpy, MXNet and JAX run in both lanes, those of torch and TensorFlow (the same
# releases in both) in the current lane only (lanes.py)

CASES = all_cases()
DTYPES = ("float32", "float64")
AUTOGRAD = [name for name in BACKENDS if name != "numpy"]


BY_ID = {case.id: case for case in CASES}


def anchor_backend() -> str | None:
    """The autograd backend whose gradients every other one's must match: the run's first."""
    return next((name for name in AUTOGRAD if name in required_backends()), None)


@functools.cache
def _prepared(case_id: str, dtype: str) -> harness.Prepared:
    return harness.prepare(BY_ID[case_id], dtype=dtype, seed=7)


@functools.cache
def _checked(name: str, case_id: str, dtype: str):
    anchor, first = None, anchor_backend()
    if name not in ("numpy", first) and first is not None:
        anchor = _checked(first, case_id, dtype)[1]  # None where the anchor's own row failed
    return harness.check(name, _prepared(case_id, dtype), anchor)


def checked(name: str, case: harness.Case, dtype: str):
    """The Row and Result of `case` on backend `name`, computed once per run; an autograd
    backend's gradients compared with the anchor backend's too."""
    return _checked(name, case.id, dtype)


def describe(row: harness.Row) -> str:
    return (
        f"{row.backend} disagrees on {row.case} in {row.dtype}: output {row.output_difference}, "
        f"weights {row.weights_difference}, gradients vs finite differences "
        f"{row.gradient_difference}, vs {anchor_backend()}'s {row.gradient_agreement} "
        f"(tolerances {harness.TOLERANCES[row.dtype]}, "
        f"{harness.GRADIENT_TOLERANCES[row.dtype]}); error: {row.error}"
    )


# Each case's rows in one pytest-xdist worker (lanes.py runs --dist loadgroup): the reference's
# central differences and the anchor's row, computed once per worker, are then computed once
GROUPED_CASES = [
    pytest.param(case, id=case.id, marks=pytest.mark.xdist_group(case.id)) for case in CASES
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GROUPED_CASES)
@pytest.mark.parametrize("name", backend_params())
def test_backend_agrees_with_the_reference(name, case, dtype):
    module = backend_module(name)
    row, result = checked(name, case, dtype)
    assert row.passed, describe(row)
    if module.ADAPTER.autograd:
        assert result.gradients is not None and row.gradient_difference is not None
        first = anchor_backend()
        if name != first and checked(first, case, dtype)[1] is not None:
            assert row.gradient_agreement is not None


@pytest.mark.parametrize("name", backend_params())
def test_masked_softmax_of_large_logits_by_hand(name):
    # Logits of 1e4 overflow exp() unless the row maximum is subtracted, and a masked logit of
    # 1e4 must not count. Worked by hand: lengths 2 keep [1e4, -1e4] -> [1, 0] and [0, 0] ->
    # [1/2, 1/2]; length 0 gives zeros. Gradient of sum(P * C) per row: P * (C - sum(P * C)),
    # with C = [1, 2, 3, 4]: [0, 0, 0, 0] and [-1/4, 1/4, 0, 0]; zero for the row of length 0.
    module = backend_module(name)
    X = np.array([[[1e4, -1e4, 0.0, 5e3], [0.0, 0.0, 5.0, 1e4]]] * 2, "float32")
    valid_lens = np.array([2, 0])
    expected = np.zeros((2, 2, 4), "float32")
    expected[0, 0, 0] = 1.0
    expected[0, 1, :2] = 0.5
    tensors = {"X": module.from_numpy(X), "valid_lens": module.from_numpy(valid_lens)}
    output = module.masked_softmax(tensors["X"], tensors["valid_lens"])
    np.testing.assert_allclose(module.to_numpy(output), expected, rtol=0, atol=1e-7)
    if module.ADAPTER.autograd:
        cotangent = np.broadcast_to(np.arange(1.0, 5.0, dtype="float32"), X.shape).copy()
        _, gradients, _ = module.value_and_gradients(
            lambda t: module.masked_softmax(t["X"], t["valid_lens"]),
            tensors,
            ("X",),
            None,
            module.from_numpy(cotangent),
        )
        gradient = np.zeros((2, 2, 4), "float32")
        gradient[0, 1, :2] = [-0.25, 0.25]
        np.testing.assert_allclose(gradients["X"], gradient, rtol=0, atol=1e-7)


def _perturbed(original):
    def softmax(*args, **kwargs):
        return original(*args, **kwargs) * 1.0001  # a small arithmetic mistake

    return softmax


@pytest.mark.parametrize("name", backend_params(AUTOGRAD))
def test_a_broken_backend_is_caught(name, monkeypatch):
    module = backend_module(name)
    monkeypatch.setattr(module, "_softmax", _perturbed(module._softmax))
    cases = [harness.Case("DotProductAttention"), harness.Case("MultiHeadAttention", ("causal",))]
    rows = harness.compare(["numpy", name], cases=cases, gradients=False)
    assert [row.passed for row in rows if row.backend == "numpy"] == [True, True]
    assert not any(row.passed for row in rows if row.backend == name)


@pytest.mark.torch
def test_mha_compare_names_the_broken_backend(monkeypatch):
    # The verdict is the command's, the same for every backend and case: one backend shows it,
    # on every 16th case (the whole matrix is test_backend_agrees_with_the_reference's)
    from mha import cli

    every = harness.default_cases()
    monkeypatch.setattr(harness, "default_cases", lambda: every[::16])
    module = backend_module("torch")
    monkeypatch.setattr(module, "_softmax", _perturbed(module._softmax))
    code = cli.main(["compare", "--backends", "numpy,torch"], out=(out := _Buffer()), err=_Buffer())
    assert code == 1
    assert "comparisons disagree, on: torch." in out.text()


@pytest.mark.torch
def test_a_broken_inference_path_is_caught():
    # The harness checks each autograd backend's forward without gradients too: a mistake
    # only there (here a softmax that is wrong only when no gradient is recorded) fails the
    # row. Expected: the case passes, then fails once that path is broken.
    module = backend_module("torch")
    case = harness.Case("MultiHeadAttention", ("self", "valid_lens_1d"))
    prepared = harness.prepare(case, dtype="float32", seed=7)
    row, result = harness.check("torch", prepared)
    assert row.passed and result.inference is not None and result.gradients is not None
    softmax = module._softmax
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            module,
            "_softmax",
            lambda *args, **kwargs: (
                softmax(*args, **kwargs) * (1.0 if module.torch.is_grad_enabled() else 1.0001)
            ),
        )
        row, _ = harness.check("torch", prepared)
    assert not row.passed and row.output_difference > harness.TOLERANCES["float32"]


class _Buffer:
    def __init__(self):
        self.parts = []

    def write(self, text):
        self.parts.append(text)

    def flush(self):
        pass

    def isatty(self):
        return False

    def text(self):
        return "".join(self.parts)


@pytest.mark.parametrize("name", backend_params())
def test_new_weights_reach_the_next_call(name):
    # A layer keeps nothing computed from its weights between calls: after set_weights, the
    # next self-attention call (MXNet's cached graph when hybridized among them) computes with
    # the new weights. Expected: the NumPy reference holding the same weights.
    backend = backend_module(name)
    X = np.random.default_rng(8).standard_normal((2, 5, 8))
    x = backend.from_numpy(X.astype("float32"))
    layers = {
        "eager": backend.MultiHeadAttention(8, 2, bias=True, query_size=8, key_size=8, value_size=8)
    }
    if name == "mxnet":
        layers["hybridized"] = backend.MultiHeadAttention(
            8, 2, bias=True, query_size=8, key_size=8, value_size=8
        )
        layers["hybridized"].hybridize()
    inference = contextlib.nullcontext
    if name == "torch":
        import torch

        inference = torch.no_grad
    for mode, layer in layers.items():
        with inference():
            layer(x, x, x)
            layer(x, x, x)  # a second call: whatever a backend keeps, it keeps by now
            for seed in (1, 2):
                weights = mha.random_weights(layer, seed=seed)
                mha.set_weights(layer, weights)
                reference = N.MultiHeadAttention(8, 2, bias=True, dtype="float64")
                mha.set_weights(reference, {k: v.astype("float64") for k, v in weights.items()})
                np.testing.assert_allclose(
                    backend.to_numpy(layer(x, x, x)),
                    reference(X, X, X),
                    rtol=1e-5,
                    atol=1e-5,
                    err_msg=f"{name} {mode}, weights of seed {seed}",
                )
