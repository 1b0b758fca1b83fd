"""The error table: every bad input raises the same exception, with the same message, in every
backend. The table is mha.harness.ERRORS (so that `mha compare` can ask it too); the NumPy
backend's exception is the expected one, and is itself pinned down, message by message, in
test_validation.py."""

import pytest

from conftest import backend_module, backend_params
from mha import harness


def test_the_table_is_large_enough():
    assert len(harness.ERRORS) >= 80


@pytest.mark.parametrize("case", harness.ERRORS)
@pytest.mark.parametrize("name", backend_params())
def test_same_error_in_every_backend(name, case):
    backend_module(name)
    expected = harness.raised("numpy", harness.ERRORS[case])
    assert expected is not None, f"the NumPy backend raises nothing for {case!r}"
    assert expected[0] in (ValueError, TypeError)
    assert "Received" in expected[1] or expected[1].startswith("set_weights found")
    actual = harness.raised(name, harness.ERRORS[case])
    assert actual is not None, f"{name} raises nothing for {case!r}"
    assert actual[0] is expected[0], actual
    assert actual[1] == expected[1]
