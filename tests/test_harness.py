"""The harness itself: its inputs, its finite differences and its verdicts."""

import numpy as np
import pytest

from mha import harness

pytestmark = pytest.mark.numpy


def test_inputs_hold_a_zero_length_and_a_length_beyond_the_keys():
    shapes = harness.Shapes()
    inputs = harness.make_inputs(
        harness.Case("MultiHeadAttention", ("valid_lens_2d",)), shapes, "float32", 0
    )
    assert inputs["valid_lens"].min() == 0
    assert inputs["valid_lens"].max() > shapes.num_keys
    assert inputs["queries"].dtype == np.float32


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_agrees_with_its_float64_self(dtype):
    rows = harness.compare(["numpy"], dtype=dtype, seed=5)
    assert len(rows) == len(harness.default_cases())
    assert all(row.passed for row in rows), [row for row in rows if not row.passed]
    if dtype == "float64":
        assert all(row.output_difference == 0.0 for row in rows)


def test_finite_differences_match_analytic_gradients():
    rng = np.random.default_rng(0)
    # PositionalEncoding adds a constant: d sum((X + P) * C) / dX = C
    case = harness.Case("PositionalEncoding")
    X = rng.standard_normal((2, 3, 4))
    C = rng.standard_normal((2, 3, 4))
    grads = harness.finite_difference_gradients(
        case, {"X": X}, {}, {"num_hiddens": 4, "dtype": "float64"}, C
    )
    np.testing.assert_allclose(grads["X"], C, atol=1e-8)
    # Attention is linear in the values: d sum((A V) * C) / dV = A^T C
    case = harness.Case("DotProductAttention", ("valid_lens_1d",))
    inputs = {
        "queries": rng.standard_normal((2, 3, 4)),
        "keys": rng.standard_normal((2, 5, 4)),
        "values": rng.standard_normal((2, 5, 2)),
        "valid_lens": np.array([0, 3]),
    }
    C = rng.standard_normal((2, 3, 2))
    result = harness.run_case("numpy", case, inputs, {}, {"dtype": "float64"})
    grads = harness.finite_difference_gradients(case, inputs, {}, {"dtype": "float64"}, C)
    A = result.attention_weights
    np.testing.assert_allclose(grads["values"], np.swapaxes(A, 1, 2) @ C, atol=1e-8)
    # The example with valid length 0 attends nothing: every gradient there is zero
    assert np.all(grads["queries"][0] == 0) and np.all(grads["keys"][0] == 0)


def test_difference_is_absolute_or_relative_to_scale():
    reference = np.array([10.0, -20.0])
    assert harness.difference(reference + np.array([0.5, 0.0]), reference, relative=False) == 0.5
    assert (
        harness.difference(reference + np.array([0.5, 0.0]), reference, relative=True) == 0.5 / 20
    )
    assert harness.difference(np.zeros(3), reference, relative=True) == float("inf")


def test_a_backend_that_crashes_is_a_failed_row(monkeypatch):
    original = harness.run_case

    def crashing(backend, case, inputs, weights, config, cotangent=None):
        if config["dtype"] == "float32" and case.layer == "AddNorm":
            raise RuntimeError("kaboom")
        return original(backend, case, inputs, weights, config, cotangent)

    monkeypatch.setattr(harness, "run_case", crashing)
    rows = harness.compare(["numpy"], cases=[harness.Case("AddNorm")])
    assert [row.passed for row in rows] == [False]
    assert rows[0].error == "RuntimeError: kaboom"
