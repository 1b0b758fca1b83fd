"""Attention whose position biases the model computes outside the attention module: LayoutLMv3
adds biases of the tokens' order and of their boxes (LayoutLMv2 too, and UDOP's encoder), BEiT
and data2vec's vision model a table of relative positions kept in the layer or the encoder. A
port of the module cannot hold them, so a config that turns them on is refused, naming its
field; with them off the port gives the model's numbers, and the way the refusal names (a port
without the config, the biases given to each call as attn_bias) gives them with the biases on.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from conftest import framework_import, required_import, scores_of_order_one
from mha import model_config, porting, refused_models

torch = framework_import("torch", module_level=True)  # transformers' models are torch modules
pytestmark = pytest.mark.torch

SIZES = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=32)
# LayoutLMv3's box embeddings fill the hidden size: 4 coordinates and 2 sizes
LAYOUT = dict(vocab_size=64, coordinate_size=6, shape_size=4, input_size=32, patch_size=16)
IMAGE = dict(image_size=32, patch_size=8)
# model type -> (the sizes of a tiny model, the fields that turn the biases on)
MODELS = {
    "layoutlmv3": (LAYOUT, ("has_relative_attention_bias", "has_spatial_attention_bias")),
    "beit": (IMAGE, ("use_relative_position_bias", "use_shared_relative_position_bias")),
    "data2vec-vision": (
        IMAGE,
        ("use_relative_position_bias", "use_shared_relative_position_bias"),
    ),
}


def tiny_model(model_type: str, **fields):
    """A tiny random model of the type, its scores of order 1 and its position-bias tables
    drawn away from zero."""
    T = required_import("transformers")
    config = T.AutoConfig.for_model(model_type, **SIZES, **MODELS[model_type][0], **fields)
    torch.manual_seed(5)
    model = T.AutoModel.from_config(config, attn_implementation="eager").float().eval()
    scores_of_order_one(model)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "rel" in name:
                parameter.normal_(0.0, 1.0)
    return config, model


def first_attention(model, config):
    """(x, the biases the model hands the module, the output projection's output) of its
    first attention module in a run of the whole model, and its prefix."""
    prefix = porting.find_attention(model.state_dict())[0][0]
    module = model.get_submodule(prefix)
    seen = {}

    def take_input(module, args, kwargs):
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).numpy()
        # LayoutLMv3's biases come as position_bias; BEiT's with the mask, which has none
        # here; data2vec's shared table's as relative_position_bias or third
        keys = ("position_bias", "attention_mask", "relative_position_bias")
        given = [kwargs.get(key) for key in keys] + list(args[2:3])
        bias = next((each for each in given if isinstance(each, torch.Tensor)), None)
        seen["bias"] = None if bias is None else bias.numpy()

    def take_output(module, args, output):
        seen["y"] = output.numpy()

    output = next(m for name, m in module.named_modules() if name in ("output.dense", "o_proj"))
    handles = [
        module.register_forward_pre_hook(take_input, with_kwargs=True),
        output.register_forward_hook(take_output),
    ]
    generator = torch.Generator().manual_seed(0)
    if config.model_type == "layoutlmv3":
        boxes = torch.randint(0, 1000, (2, 7, 4), generator=generator).sort(-1).values
        ids = torch.randint(1, 64, (2, 7), generator=generator)
        inputs = {"input_ids": ids, "bbox": boxes[..., [0, 1, 2, 3]]}
    else:
        inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=generator)}
    with torch.no_grad():
        model(**inputs)
    for handle in handles:
        handle.remove()
    return prefix, seen


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_a_config_with_biases_from_outside_is_refused_naming_them(model_type):
    fields = MODELS[model_type][1]
    for field in fields:
        config, _ = tiny_model(model_type, **{other: other == field for other in fields})
        with pytest.raises(ValueError, match=f"{field}=True adds position biases"):
            porting.options_from_config(config.to_dict())


def test_biases_are_on_where_a_config_writes_none_as_in_transformers():
    # transformers' LayoutLMv2Config turns both on (its model needs detectron2 to be built);
    # UdopConfig gives its encoder three kinds of biases
    with pytest.raises(ValueError, match=r"has_relative_attention_bias=True.*spatial"):
        porting.options_from_config({"model_type": "layoutlmv2", "num_attention_heads": 4})
    T = required_import("transformers")
    written = T.UdopConfig(num_heads=4).to_dict()
    for config in (written, {"model_type": "udop", "num_heads": 4}):
        with pytest.raises(ValueError, match=r"relative_bias_args=\[\{'type': '1d'\}"):
            porting.options_from_config(config)
    # ... and none where it writes none
    assert porting.options_from_config({**written, "relative_bias_args": []})["num_heads"] == 4


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_without_the_biases_the_port_gives_the_model_s_numbers(model_type):
    config, model = tiny_model(model_type, **dict.fromkeys(MODELS[model_type][1], False))
    prefix, seen = first_attention(model, config)
    options = porting.options_from_config(config.to_dict(), 0)
    ported = porting.from_state_dict(model.state_dict(), prefix, backend="numpy", **options)
    x = seen["x"]
    atol = 1e-5 * np.max(np.abs(seen["y"]))
    np.testing.assert_allclose(ported(x, x, x), seen["y"], rtol=0, atol=atol)


# The biases handed to the module: LayoutLMv3's by default, BEiT's table of each layer (kept
# in the layer) or of the encoder, data2vec's of the encoder (its layers' are the module's own,
# which a port refuses as a tensor beside the projections)
HANDED = [
    ("layoutlmv3", {}),
    ("beit", {"use_relative_position_bias": True}),
    ("beit", {"use_shared_relative_position_bias": True}),
    ("data2vec-vision", {"use_shared_relative_position_bias": True}),
]


@pytest.mark.parametrize(("model_type", "fields"), HANDED, ids=lambda case: str(case))
def test_with_the_biases_given_to_each_call_the_port_gives_the_model_s_numbers(model_type, fields):
    config, model = tiny_model(model_type, **fields)
    prefix, seen = first_attention(model, config)
    assert seen["bias"] is not None and np.ptp(seen["bias"]) > 0.1
    ported = porting.from_state_dict(
        model.state_dict(), prefix, backend="numpy", num_heads=config.num_attention_heads
    )
    x = seen["x"]
    output = ported(x, x, x, attn_bias=seen["bias"])
    atol = 1e-5 * np.max(np.abs(seen["y"]))
    np.testing.assert_allclose(output, seen["y"], rtol=0, atol=atol)
    # ... and without them other numbers: the refusal is not of a bias that changes nothing
    assert np.max(np.abs(ported(x, x, x) - seen["y"])) > 100 * atol


# A forward in a modeling module that takes a position bias, relative positions or an
# embedding of boxes from its caller
_TAKES_A_BIAS = re.compile(
    r"def forward\(\s*self,[^)]*?\b(position_bias|relative_position_bias|rel_pos|rel_2d_pos"
    r"|bbox_pos_emb)\b",
    re.DOTALL,
)
# transformers' model folders whose attention takes one, and where each stands: T5's relative
# position bias (the caller's attn_bias, porting.md), MPT's ALiBi (the layer's alibi), a table
# in the attention module (a port refuses the tensor), no layout a port reads, layers of a
# kind mha's is not, or refused by config or model type (the others)
TAKEN = {
    **dict.fromkeys(("t5", "mt5", "switch_transformers", "pop2piano"), "T5's"),
    "mpt": "ALiBi",
    "wavlm": "its own table",
    **dict.fromkeys(("cpmant", "pix2struct"), "no layout"),
    "pp_doclayout_v2": "its layers' kind",
    **dict.fromkeys(
        ("bros", "data2vec", "layoutlmv2", "layoutlmv3", "longt5", "mpnet", "speecht5", "udop"),
        "refused",
    ),
}


def test_every_attention_that_takes_a_bias_from_its_caller_is_known():
    # A model transformers adds whose attention adds what its caller computes is looked at
    # before its configs port as written
    T = required_import("transformers")
    models = os.path.join(os.path.dirname(T.__file__), "models")
    taking = set()
    for folder in os.listdir(models):
        path = os.path.join(models, folder)
        files = os.listdir(path) if os.path.isdir(path) else []
        modeling = [name for name in files if name.startswith("modeling_")]
        if any(_TAKES_A_BIAS.search(_read(path, name)) for name in modeling):
            taking.add(folder)
    assert taking - TAKEN.keys() == set()
    refused = (
        refused_models.MISREAD_MODEL_TYPES.keys()
        | model_config._BIASES_FROM_OUTSIDE.keys()
        | refused_models.SPARSE_ATTENTION_TYPES.keys()
    )
    for folder in (folder for folder, where in TAKEN.items() if where == "refused"):
        types = {t for t, c in T.CONFIG_MAPPING.items() if c.__module__.split(".")[2] == folder}
        assert types & refused, folder


def _read(folder: str, name: str) -> str:
    with open(os.path.join(folder, name), encoding="utf-8") as file:
        return file.read()
