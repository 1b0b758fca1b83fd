"""mha's table of transformers' config defaults (mha.config_defaults) is transformers' own:
for every model type mha ports from a config, the default of each field a port reads, as
the installed transformers' config class gives it; so is its table of the other names a
config class takes a field under (its attribute_map)."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from conftest import required_import
from mha import porting, refused_models
from mha.config_defaults import ALIASES, DEFAULTS, FIELDS, READ_NAMES
from mha.config_fields import PLAIN
from mha.rotary_types import ROTARY, UNCHECKED_ROTARY

pytestmark = pytest.mark.torch  # transformers' configs

# Model types mha reads beside the rotary ones; Kimi K2's config is DeepSeek-V3's
READ = sorted((set(ROTARY) | {"bloom", "gpt2", "gpt_neo", "mpt"}) - {"kimi_k2"})


def class_defaults(model_type: str) -> dict:
    """The defaults of FIELDS in transformers' config class of the model type (its dataclass
    fields, or its class attributes), where one is given (not None)."""
    T = required_import("transformers")
    cls = type(T.AutoConfig.for_model(model_type))
    fields = {field.name: field for field in dataclasses.fields(cls)}
    found = {}
    for name in FIELDS:
        if name in fields and fields[name].default is not dataclasses.MISSING:
            value = fields[name].default
        elif name not in fields and not isinstance(getattr(cls, name, None), property):
            value = getattr(cls, name, None)
        else:
            value = None
        if value is not None and not isinstance(value, (list, dict)):
            found[name] = value
    return found


@pytest.mark.parametrize("model_type", READ)
def test_the_table_holds_transformers_defaults(model_type):
    assert DEFAULTS.get(model_type, {}) == class_defaults(model_type)


def test_a_field_left_out_takes_transformers_default_and_null_stays_null():
    # Gemma 2's config.json without its scale or soft cap: transformers' 256 and 50
    gemma2 = {"model_type": "gemma2", "num_attention_heads": 4, "head_dim": 8, "layer_types": []}
    options = porting.options_from_config({**gemma2, "layer_types": ["full_attention"]}, 0)
    assert options["scale"] == 256**-0.5 and options["softcap"] == 50.0
    # Mistral's window of 4096 where the config does not write one; none where it writes null
    mistral = {"model_type": "mistral", "num_attention_heads": 4, "rope_theta": 1e4}
    assert porting.options_from_config(mistral)["sliding_window"] == 4096
    assert "sliding_window" not in porting.options_from_config({**mistral, "sliding_window": None})
    # OLMo 2's norms' eps, 1e-5; Granite's attention_multiplier, 1.0
    olmo2 = {"model_type": "olmo2", "num_attention_heads": 4}
    assert porting.options_from_config(olmo2)["qk_norm_eps"] == 1e-5
    assert porting.options_from_config({"model_type": "granite", "num_attention_heads": 4})[
        "scale"
    ] == pytest.approx(1.0)


@pytest.mark.parametrize("model_type", sorted(UNCHECKED_ROTARY))
def test_a_model_type_that_rotates_by_a_rule_mha_has_not_checked_is_refused(model_type):
    # Their code rotates whatever the config writes: a config without a rotary field (which
    # takes transformers' default) is refused too, not ported without the rotation; those
    # whose attention is another (DiffLlama's, ...) with what it does
    T = required_import("transformers")
    assert model_type not in ROTARY
    T.AutoConfig.for_model(model_type)  # a model type of transformers
    config = {"model_type": model_type, "num_attention_heads": 4, "num_hidden_layers": 1}
    reason = refused_models.MISREAD_MODEL_TYPES.get(model_type, "has a rotary embedding")
    with pytest.raises(ValueError, match=re.escape(f"model_type={model_type!r} {reason}")):
        porting.options_from_config({**config, "layer_types": ["full_attention"]}, 0)


def test_a_head_size_left_out_is_transformers_default_not_the_hidden_size_over_the_heads():
    # GLM's config class gives head_dim 128 whatever the hidden size; half of it turns
    glm = {"model_type": "glm", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 1e4}
    assert porting.options_from_config(glm)["rope_dim"] == 64
    assert porting.options_from_config({**glm, "head_dim": 16})["rope_dim"] == 8


@pytest.mark.parametrize("model_type", sorted((set(ROTARY) | PLAIN) - {"kimi_k2"}))
def test_the_other_names_are_transformers_attribute_map(model_type):
    # Of the names a port reads: Molmo 2's layer_norm_eps is its rms_norm_eps, GPT-2's
    # num_attention_heads its n_head, ...
    T = required_import("transformers")
    attribute_map = type(T.AutoConfig.for_model(model_type)).attribute_map
    read = {
        other: own
        for other, own in attribute_map.items()
        if other in READ_NAMES or own in READ_NAMES
    }
    assert ALIASES.get(model_type, {}) == read


def test_a_field_under_its_other_name_is_read_as_transformers_reads_it():
    T = required_import("transformers")
    for model_type, other, own in (
        ("molmo2_text", "layer_norm_eps", "rms_norm_eps"),
        ("lfm3", "rms_norm_eps", "norm_eps"),
    ):
        sizes = {"model_type": model_type, "num_attention_heads": 4, "hidden_size": 32}
        # Alone, and beside the class's own name, which it overrides in transformers
        for written in ({other: 0.25}, {own: 1e-3, other: 0.25}):
            config = T.AutoConfig.for_model(model_type).from_dict(written)
            assert getattr(config, own) == 0.25
            kinds = {"layer_types": ["full_attention"]}  # LFM3's rotary embedding is per kind
            options = porting.options_from_config({**sizes, **kinds, **written}, 0)
            assert options["qk_norm_eps"] == 0.25, (model_type, written)


# A call of a rotary embedding in a modeling module (not its definition)
_TURNS = r"^(?!\s*def ).*\b_?(apply_rotary_pos_emb\w*|apply_rotary_emb\w*|rotary_emb)\("


def test_every_model_type_whose_code_turns_queries_and_keys_is_known():
    # A model type outside ROTARY whose code rotates would port unrotated from a config
    # without rotary fields; configs that nest their models' (sub_configs) are refused as such
    T = required_import("transformers")
    turning = set()
    for model_type, config_class in T.CONFIG_MAPPING.items():
        if getattr(config_class, "sub_configs", None):
            continue
        text = "".join(_read(path) for path in _modeling_files(T, model_type, config_class))
        if re.search(_TURNS, text, re.MULTILINE):
            turning.add(model_type)
    assert turning - set(ROTARY) - UNCHECKED_ROTARY == set()
    assert not turning & PLAIN


def test_a_config_whose_model_is_another_types_is_read_in_that_models_code():
    # EXAONE 3's config has no modeling module: transformers builds Llama's model from it
    T = required_import("transformers")
    config_class = T.CONFIG_MAPPING["exaone"]
    files = [os.path.basename(path) for path in _modeling_files(T, "exaone", config_class)]
    assert files == ["modeling_llama.py"]


def _modeling_files(T, model_type: str, config_class) -> list[str]:
    """The modeling modules of the config class's folder, and of the folder of the model
    class transformers builds from the model type where it is another's (Llama's for
    EXAONE 3, GLM-4.5's for Param2)."""
    folder = os.path.join(os.path.dirname(T.__file__), "models")
    folders = {config_class.__module__.split(".")[2]}
    model_names = T.models.auto.modeling_auto.MODEL_MAPPING_NAMES.get(model_type, ())
    for model_name in (model_names,) if isinstance(model_names, str) else model_names:
        if hasattr(T, model_name):
            folders.add(getattr(T, model_name).__module__.split(".")[2])
    return [
        os.path.join(folder, name, file)
        for name in sorted(folders)
        for file in sorted(os.listdir(os.path.join(folder, name)))
        if file.startswith("modeling_")
    ]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        return file.read()
