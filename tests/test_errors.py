"""The error table: every bad input raises the same exception, with the same message, in every
backend. The table is error_cases.ERRORS; the NumPy backend's exception is the expected one,
and is itself pinned down, message by message, in test_validation.py."""

import pytest

from conftest import backend_module, backend_params
from error_cases import ERRORS, TABLES, ErrorCase, raised


def test_the_table_is_large_enough_and_its_ids_distinct():
    assert len(ERRORS) >= 150
    assert len(ERRORS) == sum(len(table) for table in TABLES)


@pytest.mark.numpy
def test_raised_gives_the_type_and_message_or_none():
    # Expected: the NumPy backend's own error for a bad constructor; None for a good layer
    # (which test_same_error_in_every_backend then reports as a failure, not an agreement)
    error_type, message = raised("numpy", ERRORS["num_heads=0 (MultiHeadAttention)"])
    assert error_type is ValueError and "num_heads" in message and "Received" in message
    assert raised("numpy", ErrorCase(("DotProductAttention", (), {}))) is None


@pytest.mark.parametrize("case", ERRORS)
@pytest.mark.parametrize("name", backend_params())
def test_same_error_in_every_backend(name, case):
    backend_module(name)
    expected = raised("numpy", ERRORS[case])
    assert expected is not None, f"the NumPy backend raises nothing for {case!r}"
    assert expected[0] in (ValueError, TypeError)
    assert "Received" in expected[1] or expected[1].startswith("set_weights found")
    actual = raised(name, ERRORS[case])
    assert actual is not None, f"{name} raises nothing for {case!r}"
    assert actual[0] is expected[0], actual
    assert actual[1] == expected[1]


@pytest.mark.parametrize(
    "layer, options",
    [
        ("MultiHeadLatentAttention", {"softcap": 3.0}),  # an option of another class
        ("MultiHeadAttention", {"rope_thet": 1.0}),  # misspelt
        ("DotProductAttention", {"sinks": True}),
    ],
)
@pytest.mark.parametrize("name", backend_params())
def test_an_argument_the_class_does_not_take_is_pythons_type_error(name, layer, options):
    # Expected: the error Python's own signature gives; Keras's layers, whose keyword
    # arguments go on to keras.layers.Layer, give it too rather than Keras's ValueError
    module = backend_module(name)
    given = {
        "MultiHeadLatentAttention": dict(
            kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4
        ),
        "MultiHeadAttention": {},
        "DotProductAttention": {},
    }[layer]
    sizes = () if layer == "DotProductAttention" else (16, 2)
    unexpected = f"{layer}.__init__() got an unexpected keyword argument '{next(iter(options))}'"
    with pytest.raises(TypeError) as error:
        getattr(module, layer)(*sizes, **given, **options)
    assert str(error.value) == unexpected
