"""Each option is declared once, in mha.options: the constructors of every backend, the checks,
the configs of mha.weights and the argument docs all follow that table."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from conftest import backend_module, backend_params
from error_cases import BAD_VALUES, GOOD_ARGUMENTS
from mha import options, validation, weights

# Keywords a framework adds to its layers beside the options: Flax's random streams, and
# Keras's and Gluon's own constructor arguments
FRAMEWORK_KEYWORDS = {"rngs", "kwargs", "prefix", "params"}


@pytest.mark.parametrize("layer", options.LAYERS)
@pytest.mark.parametrize("name", backend_params())
def test_every_constructor_takes_its_options_with_their_defaults(name, layer):
    signature = inspect.signature(getattr(backend_module(name), layer).__init__)
    taken = {
        key: parameter.default
        for key, parameter in signature.parameters.items()
        if key != "self" and key not in FRAMEWORK_KEYWORDS
    }
    declared = options.layer_options(layer)
    assert set(taken) == {option.name for option in declared}
    for option in declared:
        default = option.default_for(layer)
        expected = inspect.Parameter.empty if default is options.REQUIRED else default
        assert taken[option.name] == expected, option.name


def _valid_config(layer):
    return {**GOOD_ARGUMENTS[layer], **options.layer_defaults(layer)}


@pytest.mark.parametrize(
    "layer, option",
    [(layer, option) for layer in options.LAYERS for option in options.layer_options(layer)],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_every_option_is_checked_by_the_kind_it_declares(layer, option):
    config = {o.name: _valid_config(layer)[o.name] for o in options.layer_options(layer)}
    assert validation.check_layer_args(layer, config) == "float32"
    for bad in BAD_VALUES[option.check]:
        with pytest.raises(_expected_error(option.check, bad), match=rf"^{option.name} must "):
            validation.check_layer_args(layer, {**config, option.name: bad})


def _expected_error(kind, bad):
    """TypeError for a value of the wrong type where the kind says so, else ValueError."""
    if kind in ("boolean", "optional boolean") or (kind == "scale" and isinstance(bad, str)):
        return TypeError
    if isinstance(bad, np.integer):  # a size is a Python int
        return TypeError
    if kind in ("rope scaling", "query scaling") and not isinstance(bad, dict):
        return TypeError
    return ValueError


def test_the_kinds_of_value_are_those_validation_checks():
    assert {option.check for option in options.OPTIONS} == set(BAD_VALUES)


def test_configs_defaults_and_untold_options_derive_from_the_table():
    for layer in options.LAYERS:
        assert weights.LAYER_CLASSES[layer] == tuple(o.name for o in options.layer_options(layer))
    added = [option for option in options.OPTIONS if option.added]
    assert weights.OPTION_DEFAULTS == {option.name: option.default for option in added}
    assert set(weights.UNTOLD_OPTIONS) == {
        "rope_theta",
        "rope_interleaved",
        "rope_dim",
        "rope_scaling",
        "query_scaling",
        "softcap",
        "qk_norm",
        "qk_norm_eps",
        "sliding_window",
        "attention_chunk_size",
        "alibi",
        "value_norm",
        "empty_rows",
    }


@pytest.mark.parametrize("layer", options.LAYERS)
def test_the_docs_list_every_option_once(layer):
    section = getattr(backend_module("numpy"), layer).__doc__
    args = section.split("Args:\n", 1)[1].split("\n\n", 1)[0]
    named = [line.split(":", 1)[0].strip() for line in args.splitlines() if line[4] != " "]
    assert named == [option.name for option in options.layer_options(layer)]
