"""Multi-head latent attention: the NumPy reference's
MultiHeadLatentAttention against transformers' own DeepseekV3Attention (tiny and random, with
and without the low-rank queries, causal, with yarn's scaled rotary, with a sliding window and
an additive bias); its absorbed form against its expanded one; decoding with the latent cache
against full causal attention; and each other backend's class, given the reference's
canonical weights (mha.set_weights), against the reference, expanded, absorbed and cached,
eager and under its compiler (torch.compile, tf.function, nnx.jit, MXNet's hybridize)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from conftest import backend_module, backend_params, framework_import, required_import
from mha.backends import numpy as N

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


# The sizes of the layers of these tests beside num_hiddens and num_heads (transformers'
# config below has the same)
SIZES = dict(kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)


def _their_layer(
    torch, q_lora_rank, rope_parameters, interleave=True, rms_norm_eps=1e-6, model="deepseek_v3"
):
    """transformers' DeepseekV3Attention (or V2's: model="deepseek_v2", whose rotary always
    turns pairs), its weights random, and its rotary embedding."""
    transformers = required_import("transformers")
    deepseek = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    version = "V2" if model == "deepseek_v2" else "V3"
    their = {"rope_interleave": interleave} if version == "V3" else {}
    config = getattr(transformers, f"Deepseek{version}Config")(
        **their,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=6,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rope_parameters=rope_parameters,
        attention_bias=False,
        max_position_embeddings=64,
        rms_norm_eps=rms_norm_eps,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = getattr(deepseek, f"Deepseek{version}Attention")(config, layer_idx=0).double().eval()
    for name, parameter in layer.named_parameters():  # norms away from 1
        with torch.no_grad():
            parameter.copy_(torch.randn_like(parameter) * (0.3 if "norm" not in name else 1.0))
    rotary = getattr(deepseek, f"Deepseek{version}RotaryEmbedding")(config).double()
    return config, layer, rotary


def _our_layer(config, theirs, q_lora_rank, scaling, sliding_window=None):
    ours = N.MultiHeadLatentAttention(
        16,
        2,
        **SIZES,
        q_lora_rank=q_lora_rank,
        rope_theta=config.rope_parameters["rope_theta"],
        rope_scaling=scaling,
        norm_eps=1e-6,  # the eps of transformers' latent norms, whatever rms_norm_eps
        sliding_window=sliding_window,
        dtype="float64",
    )
    weights = {name: p.detach().numpy() for name, p in theirs.named_parameters()}
    linear = {
        "q_proj": "W_q",
        "q_a_proj": "W_qa",
        "q_b_proj": "W_qb",
        "kv_a_proj_with_mqa": "W_kva",
        "kv_b_proj": "W_kvb",
        "o_proj": "W_o",
    }
    for their_name, our_name in linear.items():
        if f"{their_name}.weight" in weights:
            getattr(ours, our_name).weight = weights[f"{their_name}.weight"].T.copy()
            getattr(ours, our_name).in_features = weights[f"{their_name}.weight"].shape[1]
    for their_name, our_name in (("q_a_layernorm", "q_norm"), ("kv_a_layernorm", "kv_norm")):
        if f"{their_name}.weight" in weights:
            getattr(ours, our_name).gamma = weights[f"{their_name}.weight"].copy()
    return ours


@pytest.mark.torch
@pytest.mark.parametrize("q_lora_rank", [None, 8], ids=["plain queries", "low-rank queries"])
@pytest.mark.parametrize("scaling", [None, YARN], ids=["default rotary", "yarn"])
def test_the_reference_is_transformers_own(q_lora_rank, scaling):
    torch = framework_import("torch")
    rope = (
        {"rope_type": "default", "rope_theta": 10000.0}
        if scaling is None
        else {**scaling, "rope_theta": 10000.0}
    )
    config, theirs, rotary = _their_layer(torch, q_lora_rank, rope)
    ours = _our_layer(config, theirs, q_lora_rank, scaling)
    X = np.random.default_rng(1).standard_normal((2, 5, 16))
    hidden = torch.from_numpy(X)
    positions = torch.arange(5)[None].expand(2, -1)
    causal = torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = theirs(hidden, rotary(hidden, positions), causal.expand(2, 1, 5, 5))
    output = ours(X, causal=True)
    # transformers turns the rotary by float32 angles whatever the dtype: 1e-6 of it
    np.testing.assert_allclose(output, expected.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.torch
def test_a_sliding_window_and_an_additive_bias_are_transformers_own():
    # transformers takes one additive mask: causal, the band of the 2 latest keys and a bias,
    # each written here by hand; mha takes causal, sliding_window=2 and attn_bias
    torch = framework_import("torch")
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    config, theirs, rotary = _their_layer(torch, 8, rope)
    ours = _our_layer(config, theirs, 8, None, sliding_window=2)
    rng = np.random.default_rng(2)
    X, bias = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 2, 5, 5))
    i, j = np.arange(5)[:, None], np.arange(5)[None, :]
    kept = (j <= i) & (j > i - 2)
    additive = np.where(kept, 0.0, -np.inf) + bias
    hidden = torch.from_numpy(X)
    positions = torch.arange(5)[None].expand(2, -1)
    with torch.no_grad():
        expected, _ = theirs(hidden, rotary(hidden, positions), torch.from_numpy(additive))
    for absorbed in (False, True):
        output = ours(X, causal=True, attn_bias=bias, absorbed=absorbed)
        np.testing.assert_allclose(output, expected.numpy(), rtol=1e-6, atol=1e-6)


def _layer(q_lora_rank=8, sliding_window=None):
    np.random.seed(0)
    layer = N.MultiHeadLatentAttention(
        16,
        4,
        **SIZES,
        q_lora_rank=q_lora_rank,
        sliding_window=sliding_window,
        dtype="float64",
    )
    rng = np.random.default_rng(3)
    if q_lora_rank is not None:  # norms away from 1
        layer.q_norm.gamma = rng.uniform(0.5, 1.5, q_lora_rank)
    layer.kv_norm.gamma = rng.uniform(0.5, 1.5, 6)
    return layer


def test_the_absorbed_form_gives_the_expanded_numbers():
    # W_kvb folded into the queries and the output: one shared key per position (the latent
    # and its rotary key), the numbers of the heads expanded from it
    layer = _layer()
    X = np.random.default_rng(4).standard_normal((2, 6, 16))
    lengths = np.array([4, 6])
    expanded = layer(X, lengths, causal=True)
    weights = layer.attention_weights
    absorbed = layer(X, lengths, causal=True, absorbed=True)
    np.testing.assert_allclose(absorbed, expanded, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer.attention_weights, weights, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_decoding_with_the_latent_cache_is_full_causal_attention(absorbed):
    # A prompt of 3, then one position at a time: each step's output is that position's row
    # of full causal attention over the whole sequence; the cache holds latents and rotary
    # keys (kv_lora_rank + rope numbers per position), not expanded keys and values
    import mha

    layer = _layer(q_lora_rank=None)
    X = np.random.default_rng(5).standard_normal((2, 6, 16))
    full = layer(X, causal=True)
    output, cache = layer(X[:, :3], causal=True, cache=mha.LatentCache(), absorbed=absorbed)
    steps = [output]
    for t in range(3, 6):
        output, cache = layer(X[:, t : t + 1], causal=True, cache=cache, absorbed=absorbed)
        steps.append(output)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-12, atol=1e-12)
    assert cache.latent.shape == (2, 6, 6) and cache.rotary_keys.shape == (2, 1, 6, 4)


def _load(layer, reference, dtype):
    """The reference's weights, canonical, in a layer of another backend."""
    import mha

    weights = {name: w.astype(dtype) for name, w in mha.get_weights(reference).items()}
    mha.set_weights(layer, weights)
    # and back: the canonical weights the layer was given
    for name, value in mha.get_weights(layer).items():
        np.testing.assert_array_equal(value, weights[name], err_msg=name)


BACKENDS = ("torch", "jax", "tensorflow", "mxnet")
# Each backend's compiler, where the call also runs compiled (JAX without its 64-bit mode
# computes in float32)
COMPILERS = {
    "jax": lambda module, call: module.nnx.jit(call),
    "mxnet": lambda module, call: _hybridized(call),
    "tensorflow": lambda module, call: module.tf.function(call),
    "torch": lambda module, call: module.torch.compile(call, dynamic=False),
}


def _hybridized(call):
    """call(layer, ...) with the MXNet layer hybridized: Gluon compiles the block, not a call."""

    def hybridized(layer, *args):
        layer.hybridize()
        try:
            output = call(layer, *args)
            assert layer._cached_op is not None  # the graph really ran
            return output
        finally:
            layer.hybridize(False)

    return hybridized


@pytest.mark.parametrize("name", backend_params(list(BACKENDS)))
def test_each_backend_gives_the_references_numbers(name):
    # The same weights in each backend, expanded and absorbed (and compiled where the
    # framework compiles), with lengths, causal and a latent cache: the reference's numbers
    import mha

    module = backend_module(name)
    dtype, tolerance = ("float32", 1e-5) if name == "jax" else ("float64", 1e-12)
    reference = _layer()
    layer = module.MultiHeadLatentAttention(
        16,
        4,
        **SIZES,
        q_lora_rank=8,
        dtype=dtype,
    )
    _load(layer, reference, dtype)
    X = np.random.default_rng(6).standard_normal((2, 5, 16))
    lengths = np.array([3, 5])
    expected = reference(X, lengths, causal=True)

    def call(layer, X, lengths, absorbed):
        return layer(X, lengths, causal=True, absorbed=absorbed)

    calls = [call]
    if name in COMPILERS:
        compiled = COMPILERS[name](module, lambda layer, X, lengths: call(layer, X, lengths, True))
        calls.append(lambda layer, X, lengths, absorbed: compiled(layer, X, lengths))
    tensors = (module.from_numpy(X.astype(dtype)), module.from_numpy(lengths))
    for each in calls:
        for absorbed in (False, True):
            output = module.to_numpy(each(layer, *tensors, absorbed))
            np.testing.assert_allclose(output, expected, rtol=tolerance, atol=tolerance)
    # Decoding after a prompt of 2 with the latent cache, eager and compiled
    queries, full = tensors[0], reference(X, causal=True)
    _, cache = layer(queries[:, :2], causal=True, cache=mha.LatentCache())

    def decode(layer, X, cache):
        return layer(X, causal=True, cache=cache, absorbed=True)[0]

    for each in [decode] + ([COMPILERS[name](module, decode)] if name in COMPILERS else []):
        step = module.to_numpy(each(layer, queries[:, 2:], cache))
        np.testing.assert_allclose(step, full[:, 2:], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", backend_params(list(BACKENDS)))
def test_each_backend_takes_windows_and_a_bias_as_the_reference(name):
    # A sliding window, a window mask per example and an additive bias, expanded and absorbed
    module = backend_module(name)
    dtype, tolerance = ("float32", 1e-5) if name == "jax" else ("float64", 1e-12)
    reference = _layer(sliding_window=3)
    layer = module.MultiHeadLatentAttention(
        16, 4, **SIZES, q_lora_rank=8, sliding_window=3, dtype=dtype
    )
    _load(layer, reference, dtype)
    rng = np.random.default_rng(7)
    X, bias = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 4, 5, 5))
    windows = rng.random((2, 5, 5)) < 0.7
    windows[:, :, 0] = True  # a key for every query
    expected = reference(X, window_mask=windows, attn_bias=bias)
    given = [module.from_numpy(x.astype(dtype)) for x in (X, bias)]
    for absorbed in (False, True):
        output = layer(
            given[0], window_mask=module.from_numpy(windows), attn_bias=given[1], absorbed=absorbed
        )
        np.testing.assert_allclose(
            module.to_numpy(output), expected, rtol=tolerance, atol=tolerance
        )


@pytest.mark.parametrize("name", backend_params(["numpy", *BACKENDS]))
def test_a_file_rebuilds_the_layer_in_each_backend(name, tmp_path):
    # Saved from the reference with every option its weights do not tell (yarn, a window,
    # eps, interleaving), loaded by mha.load: the same class, config and numbers
    import mha

    reference = N.MultiHeadLatentAttention(
        16,
        4,
        **SIZES,
        q_lora_rank=8,
        bias=True,
        rope_theta=500.0,
        rope_interleaved=False,
        rope_scaling=YARN,
        norm_eps=1e-5,
        sliding_window=3,
        dtype="float64",
    )
    mha.set_weights(reference, mha.random_weights(reference, seed=8))
    mha.save(reference, tmp_path / "latent.safetensors")
    module = backend_module(name)
    layer = mha.load(tmp_path / "latent.safetensors", backend=name)
    assert isinstance(layer, module.MultiHeadLatentAttention)
    assert mha.weights.layer_info(layer)[2] == mha.weights.layer_info(reference)[2]
    X = np.random.default_rng(9).standard_normal((2, 5, 16))
    output = module.to_numpy(layer(module.from_numpy(X), causal=True))
    tolerance = 1e-5 if name == "jax" else 1e-12  # JAX without x64 computes in float32
    np.testing.assert_allclose(output, reference(X, causal=True), rtol=tolerance, atol=tolerance)


@pytest.mark.tensorflow
def test_a_keras_file_keeps_the_layer(tmp_path):
    # A functional model with the layer, saved as .keras and loaded: its config (yarn
    # included) and weights, so the same numbers
    TF = backend_module("tensorflow")
    keras = TF.keras
    layer = TF.MultiHeadLatentAttention(
        16,
        2,
        **SIZES,
        q_lora_rank=8,
        rope_scaling=YARN,
        sliding_window=3,
    )
    X = keras.Input((5, 16))
    model = keras.Model(X, layer(X, causal=True))
    model.save(tmp_path / "latent.keras")
    loaded = keras.models.load_model(tmp_path / "latent.keras")
    inputs = np.random.default_rng(10).standard_normal((2, 5, 16)).astype("float32")
    np.testing.assert_allclose(loaded(inputs), model(inputs), rtol=1e-6, atol=1e-6)
    again = loaded.layers[-1]
    assert isinstance(again, TF.MultiHeadLatentAttention)
    assert TF.layer_config(again) == TF.layer_config(layer)


# DeepSeek-V3's module, its rotary as rope_interleave says; DeepSeek-V2's (pairs)
MODELS = {
    "v3-interleaved": ("deepseek_v3", True),
    "v3-halves": ("deepseek_v3", False),
    "v2": ("deepseek_v2", None),
}


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", backend_params(["numpy", *BACKENDS]))
def test_deepseek_ports_in_one_line(name, model, dtype):
    # A model's state_dict and config (yarn, low-rank queries, V3's rope_interleave as given):
    # the port's numbers are transformers' own module's, causal with padding, in every backend
    import mha

    torch = framework_import("torch")
    module = backend_module(name)  # a backend neither required nor installed skips
    model_type, interleave = MODELS[model]
    # rms_norm_eps far from 1e-6: the latent norms of transformers' module take 1e-6 all the
    # same (the model's other norms take it)
    config, theirs, rotary = _their_layer(
        torch, 8, {**YARN, "rope_theta": 10000.0}, interleave, 0.5, model_type
    )
    if dtype == "float32":
        theirs, rotary = theirs.float(), rotary.float()
    prefix = "model.layers.0.self_attn"
    state = {f"{prefix}.{key}": value for key, value in theirs.state_dict().items()}
    options = mha.porting.options_from_config(config.to_dict())
    layer = mha.porting.from_state_dict(state, prefix, backend=name, **options)
    X = np.random.default_rng(11).standard_normal((2, 5, 16)).astype(dtype)
    lengths = np.array([3, 5])
    keep = np.tril(np.ones((5, 5), bool)) & (np.arange(5) < lengths[:, None, None])
    hidden = torch.from_numpy(X)
    additive = torch.from_numpy(np.where(keep, 0.0, -np.inf).astype(dtype))[:, None]
    positions = torch.arange(5)[None].expand(2, -1)
    with torch.no_grad():
        # keywords: V2's module takes the mask before the rotary's angles, V3's after
        embeddings = rotary(hidden, positions)
        expected, _ = theirs(hidden, position_embeddings=embeddings, attention_mask=additive)
    output = layer(module.from_numpy(X), module.from_numpy(lengths), causal=True)
    # transformers turns the rotary by float32 angles whatever the dtype; JAX without its
    # 64-bit mode computes in float32
    tolerance = 1e-5 if dtype == "float32" or name == "jax" else 1e-6
    np.testing.assert_allclose(
        module.to_numpy(output), expected.numpy(), rtol=tolerance, atol=tolerance
    )


def test_a_deepseek_v3_config_gives_every_option_the_weights_do_not_tell():
    # Written by hand as a config.json has them: the rotary embedding (yarn, its convention
    # from rope_interleave), the latent norms' eps; a part of the rotary part turned is refused
    from mha.porting import options_from_config

    config = {
        "model_type": "deepseek_v3",
        "num_attention_heads": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_interleave": True,
        "max_position_embeddings": 163840,
        "rope_parameters": {
            "rope_theta": 10000.0,
            **YARN,
            "original_max_position_embeddings": 4096,
        },
    }
    assert options_from_config(config) == {
        "num_heads": 128,
        "rope_theta": 10000.0,
        "rope_interleaved": True,
        "rope_scaling": {**YARN, "original_max_position_embeddings": 4096},
        "norm_eps": 1e-6,
    }
    # The latent norms' eps is transformers' RMSNorm default, whatever rms_norm_eps says
    halves = options_from_config({**config, "rope_interleave": False, "rms_norm_eps": 1e-5})
    assert halves["rope_interleaved"] is False and halves["norm_eps"] == 1e-6
    # A fraction: DeepSeek's default rotary embedding turns the whole rotary part whatever it
    # says, as transformers' code; its scaled one (YaRN) turns part of it, which is refused
    plain = {**config, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    assert options_from_config(plain)["rope_theta"] == 1e4
    partial = {**config, "rope_parameters": {**config["rope_parameters"]}}
    partial["rope_parameters"]["partial_rotary_factor"] = 0.5
    with pytest.raises(
        ValueError, match="rotates 32 of the 64 features of the rotary part of each head"
    ):
        options_from_config(partial)


def test_deepseek_v2_and_kimi_k2_configs_give_their_options():
    # DeepSeek-V2's config.json (transformers 4's rope_scaling, yarn's "type"): its rotary
    # always turns pairs; Kimi K2's own config.json (model_type kimi_k2) is read as
    # DeepSeek-V3's, as transformers reads it (Kimi K2.5's text_config)
    from mha.porting import options_from_config

    transformers = required_import("transformers")
    v2 = {
        "model_type": "deepseek_v2",
        "num_attention_heads": 16,
        "qk_rope_head_dim": 64,
        "rope_theta": 10000,
        "rope_scaling": {**YARN, "type": "yarn", "mscale": 0.707, "mscale_all_dim": 0.707},
    }
    del v2["rope_scaling"]["rope_type"]
    options = options_from_config(v2)
    assert options["rope_interleaved"] is True and options["norm_eps"] == 1e-6
    assert options["rope_scaling"]["mscale_all_dim"] == 0.707
    # Where the config writes no rotary embedding: transformers' default base
    unwritten = {key: v2[key] for key in ("model_type", "num_attention_heads")}
    theirs = transformers.DeepseekV2Config(num_attention_heads=16).rope_parameters["rope_theta"]
    assert options_from_config(unwritten)["rope_theta"] == theirs
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    k2 = {**v2, "model_type": "kimi_k2", "rope_theta": 50000.0, "rope_interleave": False}
    assert Kimi_K25Config(text_config=dict(k2)).text_config.model_type == "deepseek_v3"
    v3 = options_from_config({**k2, "model_type": "deepseek_v3"})
    assert options_from_config(k2) == v3 and v3["rope_interleaved"] is False


def test_a_kimi_k2_config_without_rope_interleave_turns_pairs_as_transformers_reads_it():
    # transformers reads Kimi K2's text config as DeepSeek-V3's, whose rope_interleave
    # defaults to True: each head's rotary part turns by pairs
    required_import("transformers")
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    from mha.porting import options_from_config

    k2 = {"model_type": "kimi_k2", "num_attention_heads": 4, "qk_rope_head_dim": 64}
    assert Kimi_K25Config(text_config=dict(k2)).text_config.rope_interleave is True
    assert options_from_config(k2)["rope_interleaved"] is True


def test_a_mistral4_config_without_its_nope_size_or_rotary_parameters_takes_the_defaults():
    # transformers fills a Mistral 4 config's qk_nope_head_dim (64) and rope_parameters (YaRN
    # turning 0.5 of the whole head, nope + rope: its rotary part) from the class's defaults
    required_import("transformers")
    from transformers import Mistral4Config

    from mha.porting import options_from_config

    written = Mistral4Config().to_dict()
    expected = options_from_config(written)
    for left_out in (
        ("qk_nope_head_dim",),
        ("rope_parameters",),
        ("qk_nope_head_dim", "rope_parameters"),
    ):
        config = {key: value for key, value in written.items() if key not in left_out}
        filled = Mistral4Config(**config)
        assert filled.qk_nope_head_dim == 64
        assert filled.rope_parameters["partial_rotary_factor"] == 0.5
        assert options_from_config(config) == expected, left_out
    # A nope part of 128 under the default rotary parameters turns 0.5 x 192 = 96 features,
    # more than the rotary part holds: refused
    wider = {key: value for key, value in written.items() if key != "rope_parameters"}
    with pytest.raises(ValueError, match="rotates 96 of the 64 features"):
        options_from_config({**wider, "qk_nope_head_dim": 128})


def test_an_older_sarvam_config_gives_the_yarn_transformers_reads():
    # Sarvam's latent model's older config.json names its YaRN "deepseek_yarn" (rope_scaling's
    # type) and writes a head_dim: transformers reads it as DeepSeek-V3's YaRN, and so does mha
    from mha.porting import options_from_config

    transformers = required_import("transformers")
    older = {
        "model_type": "sarvam_mla",
        "num_attention_heads": 16,
        "head_dim": 192,
        "qk_rope_head_dim": 64,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "rope_scaling": {**YARN, "type": "deepseek_yarn"},
    }
    del older["rope_scaling"]["rope_type"]
    theirs = transformers.AutoConfig.for_model(**older).rope_parameters
    options = options_from_config(older)
    assert options["rope_scaling"] == {k: v for k, v in theirs.items() if k != "rope_theta"}
    assert options["rope_theta"] == theirs["rope_theta"] and options["rope_interleaved"] is True
    # The same name under rope_type, which transformers reads as YaRN too
    renamed = {**older, "rope_scaling": {**YARN, "rope_type": "deepseek_yarn"}}
    assert transformers.AutoConfig.for_model(**renamed).rope_parameters == theirs
    assert options_from_config(renamed) == options
    # DeepSeek's own configs have no such type: refused, as any rotary type mha does not take
    with pytest.raises(ValueError, match="'deepseek_yarn'"):
        options_from_config({**older, "model_type": "deepseek_v3"})


@pytest.mark.torch
def test_mha_convert_writes_a_deepseek_v3_layer_as_a_checkpoint(tmp_path, capsys):
    # A model's safetensors file and config.json: `mha convert --prefix --config` writes the
    # latent layer, which rebuilds in any backend with transformers' numbers; a framework's
    # file, which cannot hold it, is refused
    import json

    import safetensors.numpy

    import mha
    from mha import cli

    torch = framework_import("torch")
    config, theirs, rotary = _their_layer(torch, None, {**YARN, "rope_theta": 10000.0})
    prefix = "model.layers.3.self_attn"
    state = {f"{prefix}.{key}": value.numpy() for key, value in theirs.state_dict().items()}
    safetensors.numpy.save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    paths = [str(tmp_path / name) for name in ("model.safetensors", "layer.safetensors")]
    arguments = ["--prefix", prefix, "--config", str(tmp_path / "config.json")]
    assert cli.main(["convert", *paths, *arguments]) == 0
    assert "MultiHeadLatentAttention(" in capsys.readouterr().out
    assert cli.main(["inspect", paths[0], *arguments]) == 0
    assert "class: MultiHeadLatentAttention" in capsys.readouterr().out
    X = np.random.default_rng(12).standard_normal((2, 5, 16))
    hidden, positions = torch.from_numpy(X), torch.arange(5)[None].expand(2, -1)
    causal = torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = theirs(hidden, rotary(hidden, positions), causal.expand(2, 1, 5, 5))
    layer = mha.load(paths[1], backend="numpy")
    np.testing.assert_allclose(layer(X, causal=True), expected.numpy(), rtol=1e-6, atol=1e-6)
    torch_file = str(tmp_path / "layer.pt")
    assert cli.main(["convert", paths[0], torch_file, *arguments]) == 1
    assert "goes into an mha checkpoint (.safetensors) only" in capsys.readouterr().err
    assert not (tmp_path / "layer.pt").exists()
    # In bfloat16, as such models are released: written so (by a backend that holds it)
    import safetensors.torch

    half = {key: value.to(torch.bfloat16) for key, value in theirs.state_dict().items()}
    half = {f"{prefix}.{key}": value for key, value in half.items()}
    safetensors.torch.save_file(half, tmp_path / "model.safetensors")
    assert cli.main(["convert", *paths, *arguments]) == 0, capsys.readouterr().err
    written = mha.weights.read_checkpoint(paths[1])
    expected = mha.porting.canonical_from_state_dict(
        {key: value.float().numpy() for key, value in half.items()}, prefix,
        **mha.porting.options_from_config(config.to_dict(), 3),
    )  # fmt: skip
    assert written.weights.keys() == expected.weights.keys()
    for name, value in written.weights.items():
        assert value.dtype.name == "bfloat16"
        np.testing.assert_array_equal(value.astype(np.float32), expected.weights[name])


@pytest.mark.torch
def test_a_latent_port_refuses_weights_of_a_dtype_it_does_not_read_by_name():
    # FP8, as DeepSeek-V3 is released, was torch's bare TypeError and int8 was taken as
    # numbers; the other layouts name the tensor, and so does this one
    from mha import porting

    torch = framework_import("torch")
    prefix = "layers.0.self_attn"
    state = _tiny_deepseek_state("deepseek_v3")
    weight = state[f"{prefix}.kv_b_proj.weight"]
    dtypes = [torch.int8, *(d for d in [getattr(torch, "float8_e4m3fn", None)] if d)]
    for dtype in dtypes:
        given = {**state, f"{prefix}.kv_b_proj.weight": (weight * 100).to(dtype)}
        with pytest.raises(ValueError, match=r"kv_b_proj.weight under 'layers.0.self_attn' "):
            porting.from_state_dict(given, prefix, num_heads=4, rope_theta=10000.0)


@pytest.mark.torch
def test_a_port_to_a_narrower_dtype_refuses_a_weight_it_would_make_inf():
    # A bfloat16 checkpoint's weight of 1e5 held in float16 (largest 65504) was inf, with
    # only numpy's overflow warning, and every output NaN
    import mha
    from mha import porting

    torch = framework_import("torch")
    prefix = "layers.0.self_attn"
    state = {k: v.to(torch.bfloat16) for k, v in _tiny_deepseek_state("deepseek_v3").items()}
    state[f"{prefix}.o_proj.weight"][0, 0] = 1e5
    with pytest.raises(ValueError, match=r"W_o holds 99840, past float16's largest number"):
        porting.from_state_dict(state, prefix, num_heads=4, rope_theta=10000.0, dtype="float16")
    layer = porting.from_state_dict(state, prefix, num_heads=4, rope_theta=10000.0,
                                    dtype="float32", backend="numpy")  # fmt: skip
    assert mha.get_weights(layer)["W_o"][0, 0] == 99840.0  # bfloat16's 1e5, held exactly


@pytest.mark.torch
def test_deepseek_v3_2_sparse_attention_is_not_listed_as_v3_and_its_port_is_refused():
    # DeepSeek-V3.2's attention holds V3's latent modules and an indexer that picks the keys
    # of each query: find_attention does not list it as V3's, and its port says why
    from mha import porting

    state = _tiny_deepseek_state("deepseek_v32", index_head_dim=8, index_n_heads=2)
    prefix = "layers.0.self_attn"
    assert any(name.startswith(f"{prefix}.indexer.") for name in state)
    assert porting.find_attention(state) == []
    with pytest.raises(ValueError, match=r"DeepSeek-V3.2's sparse attention: its indexer \("):
        porting.from_state_dict(state, prefix, num_heads=4, rope_theta=10000.0)
    # Without the indexer the same modules are V3's, and port
    dense = {name: value for name, value in state.items() if ".indexer." not in name}
    assert (
        prefix,
        "DeepSeek-V3 latent attention (q_a_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj)",
    ) in porting.find_attention(dense)
    porting.from_state_dict(dense, prefix, num_heads=4, rope_theta=10000.0)


@pytest.mark.torch
@pytest.mark.parametrize(
    "option", [{"output_gate": True}, {"scale": 0.5}, {"without_positions": True}]
)
def test_multi_head_attentions_port_options_are_refused_for_latent_attention(option):
    # DeepSeek-V3's layer ports without them; an option that would change a
    # MultiHeadAttention's port is an error naming it here, never silently dropped
    from mha import porting

    torch = framework_import("torch")
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    _, theirs, _ = _their_layer(torch, None, rope)
    state = theirs.state_dict()
    port = porting.canonical_from_state_dict(state, num_heads=2, rope_theta=10000.0)
    assert port.layer == "MultiHeadLatentAttention"
    (name,) = option
    with pytest.raises(ValueError, match=f"{name} is MultiHeadAttention's; the attention"):
        porting.canonical_from_state_dict(state, num_heads=2, rope_theta=10000.0, **option)


@pytest.mark.torch
def test_a_module_beside_deepseeks_latent_modules_is_refused_naming_it():
    # A tensor mha's latent layer does not hold (gpt-oss's sinks, say) would change the
    # numbers: its port is refused, not ported without it
    from mha import porting

    state = _tiny_deepseek_state("deepseek_v3")
    prefix = "layers.0.self_attn"
    porting.from_state_dict(state, prefix, num_heads=4, rope_theta=10000.0)
    state[f"{prefix}.sinks"] = framework_import("torch").zeros(4)
    with pytest.raises(ValueError, match=rf"'{prefix}' holds sinks, which mha's"):
        porting.from_state_dict(state, prefix, num_heads=4, rope_theta=10000.0)


@pytest.mark.torch
def test_a_latent_config_at_a_wrong_prefix_or_beside_other_weights_is_named():
    # A DeepSeek config's options (norm_eps among them) at a prefix with no layer name the
    # prefix, and beside another layout's weights name the mismatch, never "unknown option"
    from mha import porting

    state = _tiny_deepseek_state("deepseek_v3")
    options = dict(num_heads=4, rope_theta=10000.0, norm_eps=1e-6)
    where = r"no known attention layout under 'model.layers.0.self_attn'.*found under 'layers"
    with pytest.raises(ValueError, match=where):
        porting.from_state_dict(state, "model.layers.0.self_attn", **options)
    llama = {f"p.{name}_proj.weight": np.eye(8, dtype="float32") for name in "qkvo"}
    with pytest.raises(ValueError, match=r"norm_eps is of multi-head latent attention.*q/k/v/o"):
        porting.from_state_dict(llama, "p", **options)


@pytest.mark.torch
def test_a_query_projection_beside_the_low_rank_ones_is_refused():
    # q_proj is DeepSeek's query without a low rank (q_lora_rank null); q_b_proj beside it
    # belongs to the low-rank queries, whose q_a_proj is missing: neither reading holds all
    from mha import porting

    prefix = "layers.0.self_attn"
    state = _tiny_deepseek_state("deepseek_v3")
    q_a = state.pop(f"{prefix}.q_a_proj.weight")
    del state[f"{prefix}.q_a_layernorm.weight"]
    q_b = state.pop(f"{prefix}.q_b_proj.weight")
    state[f"{prefix}.q_proj.weight"] = q_b @ q_a  # a query projection of full rank
    porting.from_state_dict(state, prefix, num_heads=4, rope_theta=10000.0)
    state[f"{prefix}.q_b_proj.weight"] = q_b
    with pytest.raises(ValueError, match="must have q_proj, or q_a_proj, q_a_layernorm and"):
        porting.from_state_dict(state, prefix, num_heads=4, rope_theta=10000.0)


@pytest.mark.torch
@pytest.mark.parametrize(
    "changed, message",
    [
        # DeepSeek's attention_bias gives q_a_proj, kv_a_proj_with_mqa and o_proj biases
        # together; o_proj's alone would shift every output: refused, naming what is missing
        ("o_proj.bias", "b_kva missing"),
        # One tensor in float64 beside float32 ones: a checkpoint mixed so is refused by name
        ("kv_b_proj.weight", "different dtypes: float32, float64"),
    ],
)
def test_a_latent_state_with_one_odd_tensor_is_refused_naming_it(changed, message):
    from mha import porting

    prefix = "layers.0.self_attn"
    state = _tiny_deepseek_state("deepseek_v3")
    name = f"{prefix}.{changed}"
    state[name] = state[name].double() if name in state else framework_import("torch").ones(32)
    with pytest.raises(ValueError, match=message):
        porting.from_state_dict(state, prefix, num_heads=4, rope_theta=10000.0)


def _tiny_deepseek_state(model_type, **extra):
    """The state_dict of a one-layer DeepSeek model of `model_type` from transformers, with
    4 heads and the latent sizes of SIZES."""
    transformers = required_import("transformers")
    torch = framework_import("torch")
    sizes = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, **SIZES)
    sizes |= dict(q_lora_rank=8, num_hidden_layers=1, vocab_size=16, n_routed_experts=2)
    sizes |= dict(num_experts_per_tok=1, n_group=1, topk_group=1, moe_intermediate_size=8)
    config = transformers.AutoConfig.for_model(model_type, intermediate_size=16, **sizes, **extra)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).state_dict()
