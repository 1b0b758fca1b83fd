"""Every backend computes the NumPy reference's numbers, from one weight set and the same inputs.

Parametrized over backend x layer and masks x dtype through mha.harness, the one place that
asks the question (tolerances included). Gradients are compared with float64 central
differences of the reference and, between autograd backends, with each other.
"""

import functools

import pytest

from conftest import backend_module, backend_params
from mha import harness
from mha.registry import BACKENDS

CASES = harness.all_cases()
DTYPES = ("float32", "float64")
AUTOGRAD = [name for name in BACKENDS if name != "numpy"]


BY_ID = {case.id: case for case in CASES}


@functools.cache
def _prepared(case_id: str, dtype: str) -> harness.Prepared:
    return harness.prepare(BY_ID[case_id], dtype=dtype, seed=7)


@functools.cache
def _checked(name: str, case_id: str, dtype: str):
    return harness.check(name, _prepared(case_id, dtype))


def checked(name: str, case: harness.Case, dtype: str):
    """The Row and Result of `case` on backend `name`, computed once per run."""
    return _checked(name, case.id, dtype)


def describe(row: harness.Row) -> str:
    return (
        f"{row.backend} disagrees on {row.case} in {row.dtype}: output {row.output_difference}, "
        f"weights {row.weights_difference}, gradients vs finite differences "
        f"{row.gradient_difference} (tolerances {harness.TOLERANCES[row.dtype]}, "
        f"{harness.GRADIENT_TOLERANCES[row.dtype]}); error: {row.error}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
@pytest.mark.parametrize("name", backend_params())
def test_backend_agrees_with_the_reference(name, case, dtype):
    module = backend_module(name)
    row, result = checked(name, case, dtype)
    assert row.passed, describe(row)
    if hasattr(module, "value_and_gradients"):
        assert result.gradients is not None and row.gradient_difference is not None


@pytest.mark.torch
@pytest.mark.tensorflow
@pytest.mark.mxnet
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_autograd_backends_agree_with_each_other(case, dtype):
    results = {}
    for name in AUTOGRAD:
        backend_module(name)
        row, result = checked(name, case, dtype)
        assert result is not None, describe(row)
        results[name] = result.gradients
    first, *others = AUTOGRAD
    for name in others:
        assert set(results[name]) == set(results[first])
        for key in results[first]:
            error = harness.difference(results[name][key], results[first][key], dtype != "float64")
            assert error <= harness.TOLERANCES[dtype], (
                f"d/d{key} of {case.id}: {name} differs from {first} by {error}"
            )


def _perturbed(original):
    def softmax(*args, **kwargs):
        return original(*args, **kwargs) * 1.0001  # a small arithmetic mistake

    return softmax


@pytest.mark.parametrize("name", backend_params(AUTOGRAD))
def test_a_broken_backend_is_caught_and_named(name, monkeypatch):
    from mha import cli

    module = backend_module(name)
    monkeypatch.setattr(module, "_softmax", _perturbed(module._softmax))
    cases = [harness.Case("DotProductAttention"), harness.Case("MultiHeadAttention", ("causal",))]
    rows = harness.compare(["numpy", name], cases=cases, gradients=False)
    assert [row.passed for row in rows if row.backend == "numpy"] == [True, True]
    assert not any(row.passed for row in rows if row.backend == name)
    code = cli.main(
        ["compare", "--backends", f"numpy,{name}"], out=(out := _Buffer()), err=_Buffer()
    )
    assert code == 1
    assert out.text().strip().endswith(f"disagree, on: {name}.")


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
