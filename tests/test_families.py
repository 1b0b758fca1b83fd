"""Every rotary model type mha knows ports in one line: for each, a tiny random transformers
model, each of its attention layers ported with `options_from_config(config, layer)`, against
the output of the model's own attention module in a run of the whole model.

This holds the rotary convention of each model type (half or pairs), the defaults its config
leaves to transformers, and its QK-norms, scales, windows and soft caps, together; the
per-feature tests in test_porting.py and test_rope_scaling.py show each in every backend.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import mha
from conftest import framework_import, required_import, scores_of_order_one
from mha import porting
from mha.layouts import LAYOUTS
from mha.rotary_types import ROTARY
from mha.shared_layers import KEYS_VALUES_ELSEWHERE

torch = framework_import("torch", module_level=True)  # transformers' models are torch modules
pytestmark = pytest.mark.torch

SIZES = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=32,
    num_hidden_layers=4,
    vocab_size=64,
    pad_token_id=0,
)
# Model types whose config names a size otherwise, or needs one the others do not give
OWN_SIZES = {
    "falcon": {"head_dim": None, "new_decoder_architecture": True, "num_kv_heads": 2},
    "gptj": {"rotary_dim": 4},  # its default, 64, is beyond the head size
    "roformer": {"head_dim": None, "num_key_value_heads": None},  # no grouped heads
    "esmc": {"num_key_value_heads": None},  # its k_norm is over the whole hidden size
    "ultrabert": {"sliding_window": 2},  # a window within the sequence, each side
    # Multi-head latent attention, and few small experts
    "deepseek_v3": {
        "head_dim": None,  # its rotary part's, qk_rope_head_dim
        "num_key_value_heads": 4,  # every head's keys and values from the latent
        "q_lora_rank": 16,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
    },
}
# DeepSeek-V2's attention without low-rank queries (V2-Lite's), its experts as V3's; Kimi K2's
# config is DeepSeek-V3's (see tiny_model); the other latent types' modules are V2's or V3's
OWN_SIZES["deepseek_v2"] = {**OWN_SIZES["deepseek_v3"], "q_lora_rank": None}
OWN_SIZES["kimi_k2"] = OWN_SIZES["deepseek_v3"]
for model_type in ("axk1", "glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu"):
    OWN_SIZES[model_type] = OWN_SIZES["deepseek_v3"]
# MiniCPM3's configs scale its rotary by LongRoPE, Youtu-LLM's here by YaRN: the sequence of
# attention_io is longer than the original length, so the long factors apply
OWN_SIZES["minicpm3"] = {
    **OWN_SIZES["minicpm3"],
    "max_position_embeddings": 16,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "long_factor": [1.0, 2.0],
        "short_factor": [1.5, 1.2],
        "original_max_position_embeddings": 4,
    },
}
OWN_SIZES["youtu"] = {
    **OWN_SIZES["youtu"],
    "max_position_embeddings": 16,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
# Ministral 3's and Mistral 4's queries scaled by their positions past every 2 (their configs:
# 16384 and 8192), so within the sequence, and YaRN over the same length
SCALED_QUERIES = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 2,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.5,
}
OWN_SIZES["ministral3"] = {"max_position_embeddings": 8, "rope_parameters": SCALED_QUERIES}
# Mistral 4's config makes the part rotated a fraction of the whole head (nope + rope)
OWN_SIZES["mistral4"] = {**OWN_SIZES["deepseek_v3"], **OWN_SIZES["ministral3"]}
# Gemma 4: sliding and full layers, the full ones with heads twice as large, one key-value
# head, their values from the key projection and a quarter of each head turned
# proportionally; its per-layer inputs small
OWN_SIZES["gemma4_text"] = {
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 4,
    "global_head_dim": 16,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 64,
}
# EmbeddingGemma 2: Gemma 4's attention both ways, its sliding layers within a radius of 2
OWN_SIZES["embedding_gemma2_text"] = {
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 2,
    "global_head_dim": 16,
    "num_global_key_value_heads": 1,
    "hidden_size_per_layer_input": 8,
}
# Gemma 3n: sliding and full layers, none sharing another's keys and values (its default: the
# last 15); its per-layer inputs, AltUp and LAuReL small
OWN_SIZES["gemma3n_text"] = {
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 4,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 64,
    "laurel_rank": 4,
}
# LFM3: sliding and full attention beside a convolution, its window within the sequence
OWN_SIZES["lfm3"] = {
    "layer_types": ["sliding_attention", "conv", "full_attention", "full_attention"],
    "sliding_window": 4,
    "norm_eps": 1e-3,
}
# Llama 4: chunks of 3 positions on its rotary layers, the queries of its others (every
# second layer here) scaled past every 2 positions; few small experts
OWN_SIZES["llama4_text"] = {
    "attention_chunk_size": 3,
    "no_rope_layer_interval": 2,
    "floor_scale": 2,
    "attn_scale": 0.5,
    "num_local_experts": 4,
    "intermediate_size_mlp": 32,
}
# Hunyuan: its base stretched by a fixed NTK alpha (its checkpoints' "dynamic" with alpha);
# the MoE's few small experts
OWN_SIZES["hunyuan_v1_dense"] = {
    "rope_parameters": {
        "rope_type": "dynamic",
        "rope_theta": 10000.0,
        "alpha": 1000.0,
        "factor": 1.0,
    },
}
OWN_SIZES["hunyuan_v1_moe"] = {**OWN_SIZES["hunyuan_v1_dense"], "num_experts": 4, "moe_topk": 2}
# Kolibri 1: its full layers have no rotary embedding where it has a sliding window; Mellum's
# windows; Falcon-H1's keys scaled; Molmo 2's norms of the whole projection (OLMo's)
OWN_SIZES["kolibri1"] = {
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 4,
}
OWN_SIZES["mellum"] = {
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 4,
}
OWN_SIZES["falcon_h1"] = {"key_multiplier": 0.5}
OWN_SIZES["molmo2_text"] = {"qk_norm_type": "olmo"}
# LFM2's MoE: its attention and convolution layers, few small experts past a dense one
OWN_SIZES["lfm2_moe"] = {
    "layer_types": ["full_attention", "conv"] * 2,
    "num_dense_layers": 1,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "norm_eps": 1e-3,
}
OWN_SIZES["lfm2"] = {"norm_eps": 1e-3}
# Few small experts; LaraMini's linear-attention layers small, its window within the sequence
FEW_EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
OWN_SIZES["sarvam_moe"] = {**FEW_EXPERTS, "n_routed_experts": 4, "n_group": 1, "topk_group": 1}
OWN_SIZES["param2moe"] = OWN_SIZES["sarvam_moe"]
OWN_SIZES["minicpm5_moe"] = {**FEW_EXPERTS, "n_routed_experts": 4}
OWN_SIZES["lara_mini"] = {
    **FEW_EXPERTS,
    "num_experts": 4,
    "shared_expert_intermediate_size": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "sliding_window": 4,
}
# Qwen3.5's text models: a quarter of each head rotated is 4 features, which tells halves from
# pairs; few small experts and linear-attention layers
OWN_SIZES["qwen3_5_moe_text"] = {**OWN_SIZES["lara_mini"], "head_dim": 16, "hidden_size": 64}
# Qwen3.5's configs split the frequencies among the axes of images' positions (multimodal
# rotary); the tokens of a text take one position on every axis
OWN_SIZES["qwen3_5_text"] = {
    **OWN_SIZES["qwen3_5_moe_text"],
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
}
# Qwen2-VL's and Qwen2.5-VL's text models: the multimodal rotary's split of the frequencies
# (a text's positions alike on every axis), named "mrope" as their older configs name it
for model_type in ("qwen2_vl_text", "qwen2_5_vl_text"):
    OWN_SIZES[model_type] = {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}
# GLM-4.1V's, GLM-OCR's and GLM-Image's text models (and GLM-4.5V's, half of each head turned
# by default, few small experts): the split of the frequencies among the axes of images'
# positions to fit the part turned, a text's positions alike on every axis
GLM_V = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]}
for model_type in ("glm4v_text", "glm_ocr_text", "glm_image_text"):
    OWN_SIZES[model_type] = {"rope_parameters": {**GLM_V, "partial_rotary_factor": 0.5}}
OWN_SIZES["glm4v_moe_text"] = {
    "rope_parameters": GLM_V,
    **FEW_EXPERTS,
    "n_routed_experts": 4,
    "first_k_dense_replace": 1,
}
# dots.llm1: its layers from max_window_layers on sliding, within the sequence; few small
# experts
OWN_SIZES["dots1"] = {
    **FEW_EXPERTS,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "max_window_layers": 2,
    "sliding_window": 4,
}
# Flint: its sinks, its windows within the sequence (rotary on its sliding layers alone), its
# eight layers' kinds (the first two, the sixth and the last full); few small experts
OWN_SIZES["flint"] = {
    **FEW_EXPERTS,
    "num_experts": 4,
    "num_hidden_layers": 8,
    "sliding_window": 4,
}
# MiniMax-M3's text model: half of each head turned (its rotary_dim unread); few small experts
OWN_SIZES["minimax_m3_vl_text"] = {
    **FEW_EXPERTS,
    "num_local_experts": 4,
    "rotary_dim": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
}
# AFMoE (Arcee's Trinity): its gate_proj, a full layer every 2 (the others sliding, rotated,
# their window within the sequence); few small experts past a dense layer
OWN_SIZES["afmoe"] = {
    **FEW_EXPERTS,
    "num_experts": 4,
    "num_dense_layers": 1,
    "global_attn_every_n_layers": 2,
    "sliding_window": 4,
}
# Cohere's North (Compass) text model: a rotary embedding per layer type, none on its full
# layers; its sliding layers' window within the sequence
OWN_SIZES["cohere_compass_text"] = {
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 4,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": None,
    },
}
# RecurrentGemma: its window within the sequence (attention_window_size, its own name of it);
# its default blocks, two recurrent ones for each of attention
OWN_SIZES["recurrent_gemma"] = {"attention_window_size": 3}
# Muse Glimmer's text model: its weightless QK-norms and scaled queries, its gate_proj, every
# fourth layer from the last full and without a rotary embedding, the others' window within
# the sequence
OWN_SIZES["muse_glimmer_text"] = {"sliding_window": 4}
# Windows within the sequence
OWN_SIZES["cwm"] = {"sliding_window": 4}
# Granite SWA's bases per layer, 0 for none; its sinks (set away from 0 in tiny_model)
OWN_SIZES["granite_swa"] = {"sliding_window": 4, "layer_rope_theta": [1e4, 0, 5e5, 0]}
OWN_SIZES["granite_swa"]["attention_multiplier"] = 0.3
OWN_SIZES["granitemoe_swa"] = {**OWN_SIZES["granite_swa"], **FEW_EXPERTS, "num_local_experts": 4}
# Cohere 2's and EXAONE 4's MoE variants rotate their sliding layers only: windows within the
# sequence
OWN_SIZES["cohere2_moe"] = {"sliding_window": 4, **FEW_EXPERTS, "num_local_experts": 4}
OWN_SIZES["exaone_moe"] = {"sliding_window": 4, **FEW_EXPERTS, "num_experts": 4}
# Granite's scale; MiniMax-M2's configs name the part rotated rotary_dim
OWN_SIZES["granitemoeshared"] = {"attention_multiplier": 0.3, **FEW_EXPERTS, "num_local_experts": 4}
OWN_SIZES["minimax_m2"] = {"rotary_dim": 4, **FEW_EXPERTS, "num_local_experts": 4}
# A base their code ignores, 10000 being in it
for model_type in ("gptj", "roformer"):
    OWN_SIZES[model_type]["rope_theta"] = 20000.0
# Granite 4.0: attention beside Mamba layers (their older names), turned where
# position_embedding_type says "rope"; few small experts
OWN_SIZES["granitemoehybrid"] = {
    **FEW_EXPERTS,
    "layer_types": ["mamba", "attention"] * 2,
    "position_embedding_type": "rope",
    "attention_multiplier": 0.3,
    "num_local_experts": 4,
    "shared_intermediate_size": 16,
    "mamba_n_heads": 8,
    "mamba_n_groups": 1,
    "mamba_d_state": 8,
    "mamba_chunk_size": 4,
}
# ESM-2: BERT's names, a layer norm of the attention's input inside its module
OWN_SIZES["esm"] = {
    "head_dim": None,
    "num_key_value_heads": None,
    "position_embedding_type": "rotary",
    "emb_layer_norm_before": True,
}
# ModernBERT and its decoder: a full layer every 2, the others' window half local_attention
# (either side in the encoder, within the sequence), no grouped heads
OWN_SIZES["modernbert"] = {
    "head_dim": None,
    "num_key_value_heads": None,
    "local_attention": 4,
    "global_attn_every_n_layers": 2,
}
OWN_SIZES["modernbert-decoder"] = OWN_SIZES["modernbert"]
# OpenAI's privacy filter: its window within the sequence, either side; few small experts
OWN_SIZES["openai_privacy_filter"] = {"sliding_window": 2, **FEW_EXPERTS, "num_local_experts": 4}
# Model types whose attention looks both ways (encoders)
ENCODERS = frozenset(
    (
        "embedding_gemma2_text esm esmc eurobert gte jina_embeddings_v3 modernbert nomic_bert "
        "openai_privacy_filter roformer ultrabert"
    ).split()
)
BY_NAME = {layout.name: layout for layout in LAYOUTS}


def tiny_model(model_type: str, attn_implementation: str | None = None, **changes):
    """A tiny random model of the type in float32, its norms' weights away from 1 and its
    matrices' scores of order 1; changes:
    config fields beside its sizes."""
    T = required_import("transformers")
    # A copy: transformers' configs fill in the nested dicts they are given
    sizes = copy.deepcopy({**SIZES, **OWN_SIZES.get(model_type, {}), **changes})
    sizes = {k: v for k, v in sizes.items() if v is not None or k == "q_lora_rank"}
    if model_type == "kimi_k2":
        # Kimi K2's own config.json (model_type kimi_k2), as transformers reads it: Kimi
        # K2.5's text_config, a DeepSeek-V3 config
        from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

        config = Kimi_K25Config(text_config={"model_type": model_type, **sizes}).text_config
    else:
        config = T.AutoConfig.for_model(model_type, **sizes)
    torch.manual_seed(3)
    model = T.AutoModel.from_config(config, attn_implementation=attn_implementation)
    model = model.float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and parameter.dim() == 1:
                parameter.uniform_(0.5, 1.5)
            if name.endswith("sinks"):  # gpt-oss's and Granite SWA's start at 0
                parameter.uniform_(-1.0, 1.0)
    scores_of_order_one(model)
    return config, model


def attention_io(model, found: list[tuple[str, str]], attention_mask=None):
    """Each attention module's input hidden states (its query projection's, where the module
    norms them first: ESM) and its output projection's output in one run of the whole model:
    {prefix: (x, y)}. found: (prefix, layout name) pairs; attention_mask: the model's, its
    positions counted from each row's first token."""
    seen: dict[str, list] = {prefix: [] for prefix, _ in found}
    handles = []
    for prefix, layout in found:
        paths = BY_NAME[layout].paths if layout in BY_NAME else {"o": "o_proj"}  # latent's
        module = model.get_submodule(prefix)
        if "LayerNorm" in dict(module.named_children()):  # ESM's norm of the input
            module = model.get_submodule(f"{prefix}.{paths['q']}")
        output = model.get_submodule(f"{prefix}.{paths['o']}")

        def take_input(module, args, kwargs, prefix=prefix):
            seen[prefix].append((args[0] if args else kwargs["hidden_states"]).numpy())

        def take_output(module, args, output, prefix=prefix):
            seen[prefix].append((output[0] if isinstance(output, tuple) else output).numpy())

        handles.append(module.register_forward_pre_hook(take_input, with_kwargs=True))
        handles.append(output.register_forward_hook(take_output))
    ids = torch.tensor([[5, 17, 3, 42, 8, 29, 11], [33, 4, 19, 7, 48, 26, 12]])
    # An encoder-decoder's decoder reads the same ids (BART's would shift them; Pegasus's,
    # Marian's, ... need them given)
    decoder = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
    padding = {}
    if attention_mask is not None:
        # positions from each row's first token, as transformers' generate gives them
        positions = np.maximum(np.cumsum(attention_mask, axis=-1) - 1, 0)
        padding = {"attention_mask": torch.tensor(attention_mask)}
        padding["position_ids"] = torch.tensor(positions)
    with torch.no_grad():
        model(input_ids=ids, **decoder, **padding)
    for handle in handles:
        handle.remove()
    return seen


def config_as(written: str, config, model_type: str) -> dict:
    """The config as its config.json writes it, or the fields tiny_model gave alone."""
    if written == "config.json":
        return {**config.to_dict(), "model_type": model_type}
    sizes = {**SIZES, **OWN_SIZES.get(model_type, {})}
    return {**{k: v for k, v in sizes.items() if v is not None}, "model_type": model_type}


# The layer types mha's layer is (Falcon-H1's "hybrid" layers: attention beside a Mamba mixer)
ATTENTION = ("full_attention", "sliding_attention", "chunked_attention", "hybrid")


@pytest.mark.parametrize("written", ["config.json", "sizes alone"])
@pytest.mark.parametrize("model_type", sorted(ROTARY))
def test_each_rotary_model_type_ports_in_one_line(model_type, written):
    # Every attention layer of the model: sliding and full ones differ in some families
    # (windows, rotary bases, rotary on one kind alone); Qwen3-Next's linear ones are not.
    # The config as transformers writes it, and as one that writes the sizes alone, whose
    # other fields take transformers' defaults (mha.config_defaults, mha.layer_kinds)
    config, model = tiny_model(model_type)
    assert_each_layer_ports(model_type, model, config, config_as(written, config, model_type))


def attention_layers(model, config) -> dict[int, tuple[str, str]]:
    """{index: (prefix, layout name)} of the config's attention layers in the model (the first
    of each index: an encoder's, a backbone's)."""
    kinds = list(getattr(config, "layer_types", None) or [])
    layers = [i for i in range(config.num_hidden_layers) if not kinds or kinds[i] in ATTENTION]
    assert layers, f"no attention layer among {kinds}"
    found = porting.find_attention(model.state_dict())
    return {
        layer: next((prefix, name) for prefix, name in found if f".{layer}." in f"{prefix}.")
        for layer in layers
    }


def assert_each_layer_ports(
    model_type: str, model, config, written: dict, causal: bool | None = None
) -> None:
    """Each attention layer of the model, ported with options_from_config(written, layer),
    gives the output of the model's own attention module in a run of the whole model.
    causal: whether its attention is (None: the model type's, ENCODERS' attend both ways)."""
    chosen = attention_layers(model, config)
    seen = attention_io(model, list(chosen.values()))
    for layer, (prefix, _) in chosen.items():
        (x, expected) = seen[prefix]
        options = porting.options_from_config(written, layer)
        ported = porting.from_state_dict(model.state_dict(), prefix, backend="numpy", **options)
        if causal is None:
            causal = model_type not in ENCODERS
        latent = type(ported).__name__ == "MultiHeadLatentAttention"  # DeepSeek's, Kimi K2's
        output = ported(x, causal=causal) if latent else ported(x, x, x, causal=causal)
        # float32's precision: transformers computes in float32, the reference in float64
        atol = 1e-5 * np.max(np.abs(expected))
        np.testing.assert_allclose(output, expected, rtol=0, atol=atol, err_msg=prefix)


@pytest.mark.parametrize("model_type", ["llama4_text", "ministral3", "hunyuan_v1_dense"])
def test_left_padding_ports_with_the_text_as_its_own_segment(model_type):
    # transformers counts positions from each row's first token: Llama 4's chunks,
    # Ministral 3's query scales and Hunyuan's scores (its QK-norms' weights scale the turned
    # features) follow them where the padding is a segment (porting.md); Llama 4's layers
    # without rotary scale by the column, padding included: the mask alone
    config, model = tiny_model(model_type)
    padded = np.array([[0, 0, 0, 0, 1, 1, 1], [1] * 7])
    found = porting.find_attention(model.state_dict())
    seen = attention_io(model, found, padded)
    for index, (prefix, _) in enumerate(found):
        (x, expected) = seen[prefix]
        options = porting.options_from_config(config.to_dict(), index)
        ported = porting.from_state_dict(model.state_dict(), prefix, backend="numpy", **options)
        unturned = options.get("rope_theta") is None
        call = {"mask": padded[:, None].astype(bool)} if unturned else {"segment_ids": padded}
        output = ported(x, x, x, causal=True, **call)
        kept = padded.astype(bool)  # the padded rows' outputs are not read
        atol = 1e-5 * np.max(np.abs(expected))
        np.testing.assert_allclose(output[kept], expected[kept], rtol=0, atol=atol, err_msg=prefix)


def test_mistral4_left_padded_rows_port_without_their_padding():
    # Mistral 4's latent layer takes no segment_ids, and its queries scale by the positions
    # that generate counts from each row's first token: with the mask alone the padded row
    # differs; called without its padding columns it agrees (porting.md, "Left padding")
    config, model = tiny_model("mistral4")
    padded = np.array([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    found = porting.find_attention(model.state_dict())
    x, expected = attention_io(model, found, padded)[found[0][0]]
    options = porting.options_from_config(config.to_dict(), 0)
    ported = porting.from_state_dict(model.state_dict(), found[0][0], backend="numpy", **options)
    kept, atol = padded.astype(bool), 1e-5 * np.max(np.abs(expected))
    whole = ported(x, causal=True, mask=kept[:, None])
    assert np.max(np.abs(whole - expected)[kept]) > 100 * atol
    np.testing.assert_allclose(whole[1], expected[1], rtol=0, atol=atol)  # not padded
    alone = ported(x[:1, 3:], causal=True)
    np.testing.assert_allclose(alone[0], expected[0, 3:], rtol=0, atol=atol)


def test_exaone_ports_under_the_names_of_its_checkpoints():
    # EXAONE 3's checkpoints keep Llama's projections as transformer.h.N.attn.attention's
    # q/k/v_proj and out_proj, which transformers renames on loading: BART's names, rotary
    # from the config all the same
    config, model = tiny_model("exaone")
    seen = attention_io(model, [("layers.0.self_attn", "q/k/v/o_proj (Llama, Mistral, Qwen)")])
    (x, expected) = seen["layers.0.self_attn"]
    renamed = {}
    for name, value in model.state_dict().items():
        name = name.replace("self_attn.o_proj.", "self_attn.out_proj.")
        name = name.replace("layers.", "transformer.h.", 1).replace("self_attn.", "attn.attention.")
        renamed[name] = value
    prefix = "transformer.h.0.attn.attention"
    assert (prefix, "q/k/v_proj and out_proj (BART, OPT, Whisper)") in porting.find_attention(
        renamed
    )
    options = porting.options_from_config({**config.to_dict(), "model_type": "exaone"}, 0)
    ported = porting.from_state_dict(renamed, prefix, backend="numpy", **options)
    atol = 1e-5 * np.max(np.abs(expected))
    np.testing.assert_allclose(ported(x, x, x, causal=True), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("positions", ["rotary", "absolute"])
def test_esm_ports_as_its_checkpoints_keep_it(positions):
    # ESM-2 (rotary) and ESM-1b (absolute positions, added to the embeddings): their
    # checkpoints keep the layer norm of the attention's input under the attention, and
    # ESM-2's transformers 4 checkpoints the rotary frequencies, in configs without rope_theta;
    # its code reads no other rotary field
    config, model = tiny_model("esm", position_embedding_type=positions)
    written = {**config.to_dict(), "model_type": "esm", "partial_rotary_factor": 0.5}
    written["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    written.pop("rope_theta", None)
    state = dict(model.state_dict())
    inv_freq = "encoder.layer.1.attention.self.rotary_embeddings.inv_freq"
    if positions == "rotary":
        state[inv_freq] = 1 / 10000.0 ** (torch.arange(0, 8, 2) / 8)
    prefix = "encoder.layer.1.attention"
    (x, expected) = attention_io(model, [(prefix, "HF BERT/RoBERTa")])[prefix]
    options = porting.options_from_config(written, 1)
    assert ("rope_theta" in options) == (positions == "rotary")
    port = porting.canonical_from_state_dict(state, prefix, **options)
    assert {"LayerNorm.weight", "LayerNorm.bias"} <= set(port.left_out)
    assert ("self.rotary_embeddings.inv_freq" in port.used) == (positions == "rotary")
    ported = porting.from_state_dict(state, prefix, backend="numpy", **options)
    atol = 1e-5 * np.max(np.abs(expected))
    np.testing.assert_allclose(ported(x, x, x), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text"])
def test_kv_shared_layers_port_with_the_keys_and_values_of_an_earlier_layer(model_type):
    # Gemma 3n's and 4's last num_kv_shared_layers layers (here 2 and 3) attend over the keys
    # and values of the last earlier layer of their kind (0 and 1), computed from that
    # layer's input: ported with keys_values_of, called with that input as keys and values.
    # Gemma 4's full layers here have no v_proj (attention_k_eq_v): layer 3 takes layer 1's
    config, model = tiny_model(model_type, num_kv_shared_layers=2)
    prefixes = [f"layers.{i}.self_attn" for i in range(4)]
    found = dict(reversed(porting.find_attention(model.state_dict())))
    assert [found[prefix] == KEYS_VALUES_ELSEWHERE for prefix in prefixes] == [0, 0, 1, 1]
    seen = attention_io(model, [(prefix, found[prefix]) for prefix in prefixes])
    written = config_as("config.json", config, model_type)
    for layer, prefix in enumerate(prefixes):
        options = porting.options_from_config(written, layer)
        assert options.get("keys_values_of") == (layer - 2 if layer >= 2 else None)
        port = porting.canonical_from_state_dict(model.state_dict(), prefix, **options)
        ported = porting.from_state_dict(model.state_dict(), prefix, backend="numpy", **options)
        (x, expected) = seen[prefix]
        source = prefixes[options.get("keys_values_of", layer)]
        keys_values = seen[source][0]
        output = ported(x, keys_values, keys_values, causal=True)
        atol = 1e-5 * np.max(np.abs(expected))
        np.testing.assert_allclose(output, expected, rtol=0, atol=atol, err_msg=prefix)
        if layer >= 2:
            assert any(source in note and "as keys and values" in note for note in port.notes)
            assert not any(name.startswith(("k_proj", "v_proj")) for name in port.used)


def test_convert_ports_a_kv_shared_layer_from_the_command_line(tmp_path, capsys):
    # --config tells a KV-shared layer's source; --keys-values-of gives it by hand, as a
    # prefix or as that layer's index
    from safetensors.torch import save_file

    import mha
    from mha import cli

    config, model = tiny_model("gemma3n_text", num_kv_shared_layers=2)
    state = {name: value.contiguous().clone() for name, value in model.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    config.to_json_file(tmp_path / "config.json")
    prefixes = ["layers.0.self_attn", "layers.2.self_attn"]
    seen = attention_io(model, [(prefix, "") for prefix in prefixes])
    (x, expected), keys_values = seen[prefixes[1]], seen[prefixes[0]][0]
    by_hand = [["--keys-values-of", prefixes[0]], ["--keys-values-of", "0"]]
    for given in [["--layer", "2"]] + [["--layer", "2", *each] for each in by_hand]:
        destination = tmp_path / "layer.safetensors"
        arguments = ["convert", str(tmp_path / "model.safetensors"), str(destination)]
        arguments += ["--prefix", prefixes[1], "--config", str(tmp_path / "config.json")]
        assert cli.main(arguments + given) == 0
        assert f"those under '{prefixes[0]}': call the layer" in capsys.readouterr().out
        layer = mha.load(destination, backend="numpy")
        output = layer(x, keys_values, keys_values, causal=True)
        atol = 1e-5 * np.max(np.abs(expected))
        np.testing.assert_allclose(output, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("positions", ["nope", None])
@pytest.mark.parametrize("written", ["config.json", "sizes alone"])
def test_granite4_attention_without_positions_ports_unturned(positions, written):
    # Granite 4.0's released configs add no positions in attention ("nope"; transformers
    # turns only where position_embedding_type says "rope"), and write a rope_theta it ignores
    config, model = tiny_model("granitemoehybrid", position_embedding_type=positions)
    raw = {**config_as(written, config, "granitemoehybrid"), "rope_theta": 1e4}
    raw["position_embedding_type"] = positions
    seen = attention_io(model, [("layers.1.self_attn", "")])
    (x, expected) = seen["layers.1.self_attn"]
    options = porting.options_from_config(raw, 1)
    assert "rope_theta" not in options and options["scale"] == pytest.approx(0.3)
    ported = porting.from_state_dict(
        model.state_dict(), "layers.1.self_attn", backend="numpy", **options
    )
    atol = 1e-5 * np.max(np.abs(expected))
    np.testing.assert_allclose(ported(x, x, x, causal=True), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("written", ["config.json", "sizes alone"])
def test_olmo_hybrid_without_a_base_ports_unturned(written):
    # OLMo Hybrid's released configs write rope_parameters with a rope_theta of null, which
    # turns its rotary embedding off (transformers builds none); its linear-attention layers
    # are other modules, its full ones OLMo 3's attention with QK-norms of the projection
    rope = {"rope_type": "default", "rope_theta": None}
    config, model = tiny_model("olmo_hybrid", rope_parameters=rope)
    assert model.rotary_emb is None
    raw = {**config_as(written, config, "olmo_hybrid"), "rope_parameters": rope}
    options = porting.options_from_config(raw, 3)
    assert "rope_theta" not in options and options["qk_norm"] == "projection"
    assert_each_layer_ports("olmo_hybrid", model, config, raw)
    with pytest.raises(ValueError, match="layer 0 of the config is 'linear_attention'"):
        porting.options_from_config(raw, 0)


@pytest.mark.parametrize(
    "dense",
    [
        {"first_k_dense_replace": 2},
        {
            "mlp_layer_types": ["dense", "dense", "sparse", "sparse"],
            "layer_types": ["full_attention"] * 2 + ["sliding_attention", "full_attention"],
        },
        {"first_k_dense_replace": 2, "prefix_dense_sliding_window_pattern": 2},
    ],
    ids=["first_k_dense_replace", "mlp_layer_types", "dense layers' pattern 2"],
)
@pytest.mark.parametrize("written", ["config.json", "sizes alone"])
def test_cohere2_moe_dense_layers_turn_where_their_pattern_is_1(dense, written):
    # Cohere 2 MoE's code turns a dense layer that has no window where the dense layers'
    # pattern is 1 (its force_rope); with a pattern of 2, its dense full layers do not turn
    config, model = tiny_model("cohere2_moe", **dense)
    raw = {**config_as(written, config, "cohere2_moe"), **dense}
    turned = porting.options_from_config(raw, 1)
    assert ("rope_theta" in turned) == ("prefix_dense_sliding_window_pattern" not in dense)
    assert_each_layer_ports("cohere2_moe", model, config, raw)


def test_esmc_layer_norms_of_the_projections_need_qk_norm_projection():
    # Centering the projections turns their RMSNorm into the layer norm; another qk_norm is
    # not a layer norm of the projection, and is refused naming the option
    config, model = tiny_model("esmc")
    options = {**porting.options_from_config(config_as("sizes alone", config, "esmc"), 0)}
    assert options["centered_qk_norm"] and options["qk_norm"] == "projection"
    prefix = porting.find_attention(model.state_dict())[0][0]
    with pytest.raises(ValueError, match="centered_qk_norm=True is a layer norm"):
        porting.from_state_dict(model.state_dict(), prefix, **{**options, "qk_norm": "head"})


def test_roberta_prelayernorm_ports_with_its_input_norm_left_out():
    # RoBERTa-PreLayerNorm's attention norms its input inside the module, as ESM's does: the
    # port leaves the norm out, and the layer takes the normed input
    T = required_import("transformers")
    config = T.RobertaPreLayerNormConfig(
        hidden_size=32, num_attention_heads=4, intermediate_size=32, num_hidden_layers=2
    )
    torch.manual_seed(3)
    model = T.AutoModel.from_config(config).float().eval()
    scores_of_order_one(model)
    prefix = "encoder.layer.1.attention"
    (x, expected) = attention_io(model, [(prefix, "HF BERT/RoBERTa")])[prefix]
    port = porting.canonical_from_state_dict(model.state_dict(), prefix, num_heads=4)
    assert {"LayerNorm.weight", "LayerNorm.bias"} <= set(port.left_out)
    ported = porting.from_state_dict(model.state_dict(), prefix, backend="numpy", num_heads=4)
    atol = 1e-5 * np.max(np.abs(expected))
    np.testing.assert_allclose(ported(x, x, x), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("fraction", [0.35, 0.6])
def test_a_fraction_of_a_head_rounds_down_as_transformers(fraction):
    # StableLM with heads of 8: int(2.8) = 2 and int(4.8) = 4 features turned, where round()
    # would give 3 and 5 (transformers: rotary_ndims = int(head_dim * partial_rotary_factor))
    rope = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": fraction}
    config, model = tiny_model("stablelm", rope_parameters=rope)
    written = {**SIZES, "rope_parameters": rope, "model_type": "stablelm"}
    head = config.hidden_size // config.num_attention_heads
    turned = model.layers[0].self_attn.rotary_ndims
    assert porting.options_from_config(written, 0)["rope_dim"] == turned == int(head * fraction)
    assert_each_layer_ports("stablelm", model, config, written)


def test_canine_s_initial_character_encoder_attends_within_its_chunks():
    # CANINE's initial character encoder attends within chunks of local_transformer_stride
    # positions, its deep and final encoders to every key; each ports from the config alone,
    # the first through the port option its prefix takes (7 characters: chunks of 3)
    config, model = tiny_model("canine", local_transformer_stride=3)
    found = porting.find_attention(model.state_dict())
    assert [prefix.split(".")[0] for prefix, _ in found] == [
        "initial_char_encoder",
        *["encoder"] * config.num_hidden_layers,
        "final_char_encoder",
    ]
    seen = attention_io(model, found)
    options = porting.options_from_config(config.to_dict())
    assert options["local_chunk_size"] == 3
    for prefix, _ in found:
        (x, expected) = seen[prefix]
        ported = porting.from_state_dict(model.state_dict(), prefix, backend="numpy", **options)
        atol = 1e-5 * np.max(np.abs(expected))
        np.testing.assert_allclose(ported(x, x, x), expected, rtol=0, atol=atol, err_msg=prefix)
    # ... a state of the module alone, which does not tell its encoder, is refused
    alone = model.get_submodule(found[0][0]).state_dict()
    with pytest.raises(ValueError, match="the prefix '' does not tell which encoder"):
        porting.from_state_dict(alone, "", backend="numpy", **options)
    # ... where attending to every key would give other numbers
    everywhere = {key: value for key, value in options.items() if key != "local_chunk_size"}
    prefix = found[0][0]
    ported = porting.from_state_dict(model.state_dict(), prefix, backend="numpy", **everywhere)
    x, expected = seen[prefix]
    assert np.max(np.abs(ported(x, x, x) - expected)) > 1e-2 * np.max(np.abs(expected))


def test_canine_s_config_with_a_layer_s_file_needs_the_file_to_tell_its_encoder(tmp_path):
    # A layer's own file has no prefix: one with the initial encoder's chunks converts, one
    # without could be either encoder's and is refused, never given the wrong attention
    from mha import conversion

    config, model = tiny_model("canine", local_transformer_stride=3)
    options = porting.options_from_config(config.to_dict())
    state = model.state_dict()
    layers = {"initial_char_encoder.layer.0.attention": True, "encoder.layer.0.attention": False}
    for prefix, chunked in layers.items():
        source = tmp_path / f"{chunked}.safetensors"
        mha.save(porting.from_state_dict(state, prefix, backend="numpy", **options), source)
        target = tmp_path / f"{chunked}-again.safetensors"
        if chunked:
            conversion.convert(source, target, **options)
            assert mha.load(target, backend="numpy").attention_chunk_size == 3
        else:
            with pytest.raises(ValueError, match="does not tell which encoder the layer is"):
                conversion.convert(source, target, **options)
            assert not target.exists()
