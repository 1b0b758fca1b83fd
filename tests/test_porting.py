"""Porting: one attention layer out of a whole model's weights, checked against the model.

The real layers of transformers (BERT, GPT-2, ViT, BART, T5) run in float64 with hooks that
capture the attention's input and its output projection's output; mha's import of the same
weights must give that output in every backend. Layouts whose libraries do not install here
(timm) are checked against their forward written out in torch, and the Keras and Flax
layouts against Keras's and Flax's own layers.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import mha
from conftest import (
    backend_module,
    backend_params,
    framework_import,
    required_import,
    scores_of_order_one,
)
from mha import cli, interop, layouts, model_rope, porting, rotary_types

torch = framework_import("torch", module_level=True)  # the sources are torch modules

TOLERANCE = 1e-10  # float64, as mha.harness holds the backends to the reference


def transformers():
    """transformers is in the test extra: a lane run requires it, elsewhere it may be absent."""
    return required_import("transformers")


def capture(model, inputs_of, output_of, **call):
    """Run `model(**call)` and return (the input hidden states of module `inputs_of`, the
    output of module `output_of`), as float64 numpy arrays."""
    seen = {}

    def take_input(module, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]

    def take_output(module, args, output):
        seen["y"] = output[0] if isinstance(output, tuple) else output

    handles = [
        inputs_of.register_forward_pre_hook(take_input, with_kwargs=True),
        output_of.register_forward_hook(take_output),
    ]
    with torch.no_grad():
        model(**call)
    for handle in handles:
        handle.remove()
    return seen["x"].numpy(), seen["y"].numpy()


def check_port(name, state, prefix, x, expected, num_heads=None, atol=TOLERANCE, **call):
    """mha's import of `state` under `prefix`, in backend `name`, gives `expected` on x."""
    module = backend_module(name)
    layer = porting.from_state_dict(state, prefix, num_heads=num_heads, backend=name)
    arguments = {
        key: module.from_numpy(value) if isinstance(value, np.ndarray) else value
        for key, value in call.items()
    }
    output = module.to_numpy(layer(*[module.from_numpy(x)] * 3, **arguments))
    np.testing.assert_allclose(output, expected, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def bert():
    T = transformers()
    torch.manual_seed(0)
    config = T.BertConfig(
        hidden_size=16,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=32,
    )
    model = T.BertModel(config).double().eval()
    ids = torch.randint(0, 50, (2, 7))
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 4:] = 0
    attention = model.encoder.layer[1].attention
    x, y = capture(
        model, attention.self, attention.output.dense, input_ids=ids, attention_mask=padding
    )
    return model.state_dict(), x, y


@pytest.mark.parametrize("name", backend_params())
def test_bert_attention_ports_to_every_backend(name, bert):
    state, x, y = bert
    check_port(
        name, state, "encoder.layer.1.attention", x, y, num_heads=4, valid_lens=np.array([7, 4])
    )


def test_bert_as_a_decoder_ports_and_is_called_causal():
    # is_decoder=True masks each query's later keys; the config gives no option for it:
    # the call's causal=True does (porting.md)
    T = transformers()
    torch.manual_seed(3)
    sizes = dict(hidden_size=16, num_attention_heads=4, num_hidden_layers=1, vocab_size=50)
    config = T.BertConfig(**sizes, intermediate_size=32, is_decoder=True)
    model = T.BertModel(config).double().eval()
    attention = model.encoder.layer[0].attention
    with torch.no_grad():  # scores of a spread the mask shows in
        for parameter in attention.self.parameters():
            parameter.normal_(0.0, 0.5)
    ids = torch.randint(0, 50, (2, 7))
    x, y = capture(model, attention.self, attention.output.dense, input_ids=ids)
    # heads of 16 / 4 features, each with its own keys and values
    heads = {"num_heads": 4, "head_size": 4, "num_kv_heads": 4, "query_size": 16}
    assert porting.options_from_config(config.to_dict()) == heads
    layer = porting.from_state_dict(model.state_dict(), "encoder.layer.0.attention", num_heads=4)
    np.testing.assert_allclose(layer(x, x, x, causal=True), y, rtol=0, atol=TOLERANCE)
    assert not np.allclose(layer(x, x, x), y, rtol=0, atol=TOLERANCE)


def test_two_names_that_flatten_to_one_are_refused():
    # "a/b" and "a.b", or a nested "a" holding "b" beside "a.b": either could be the weight
    eye = np.eye(4)
    state = {f"attn.{k}_proj.weight": eye for k in "qkvo"}
    with pytest.raises(ValueError, match=r"both named 'attn.q_proj.weight' .*\['attn/q_pr"):
        porting.canonical_from_state_dict({**state, "attn/q_proj.weight": eye}, "attn", num_heads=2)
    nested = {"attn": {"query": {"kernel": np.ones((4, 2, 2))}}, "attn.query": {"kernel": eye}}
    with pytest.raises(ValueError, match=r"\['attn'\]\['query'\]\['kernel'\] and \['attn.q"):
        porting.find_attention(nested)


@pytest.mark.parametrize("name", backend_params())
def test_gpt2_attention_ports_to_every_backend(name):
    T = transformers()
    torch.manual_seed(1)
    config = T.GPT2Config(n_embd=16, n_head=4, n_layer=2, vocab_size=50, n_positions=32)
    model = T.GPT2Model(config).double().eval()
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[0, 5:] = 0
    attention = model.h[1].attn
    x, y = capture(
        model,
        attention,
        attention.c_proj,
        input_ids=torch.randint(0, 50, (2, 6)),
        attention_mask=padding,
    )
    # Causal, and the padded key out of every row (a padded query still sees the rest)
    check_port(
        name,
        model.state_dict(),
        "h.1.attn",
        x,
        y,
        num_heads=4,
        causal=True,
        valid_lens=np.array([5, 6]),
    )


@pytest.mark.parametrize("name", backend_params())
def test_gpt2_cross_attention_ports_to_every_backend(name):
    # An encoder-decoder's GPT-2 (add_cross_attention): queries from q_attn, keys and values
    # from c_attn's halves applied to the encoder's states; the encoder's padding masked
    T = transformers()
    torch.manual_seed(5)
    config = T.GPT2Config(
        n_embd=16, n_head=4, n_layer=1, vocab_size=50, n_positions=32, add_cross_attention=True
    )
    model = T.GPT2Model(config).double().eval()
    attention = model.h[0].crossattention
    with torch.no_grad():  # biases of zeros would hide a lost one
        for parameter in attention.parameters():
            parameter.normal_(0.0, 0.5)
    encoder = torch.randn(2, 5, 16, dtype=torch.float64)
    seen = {}
    hook = attention.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(x=args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True,
    )
    _, y = capture(
        model,
        attention,
        attention.c_proj,
        input_ids=torch.randint(0, 50, (2, 6)),
        encoder_hidden_states=encoder,
        encoder_attention_mask=torch.tensor([[1] * 5, [1] * 3 + [0] * 2]),
    )
    hook.remove()
    found = dict(porting.find_attention(model.state_dict()))
    assert found["h.0.crossattention"].startswith("GPT-2 Conv1D cross-attention")
    assert found["h.0.attn"].startswith("GPT-2 Conv1D (")
    module = backend_module(name)
    layer = porting.from_state_dict(
        model.state_dict(), "h.0.crossattention", num_heads=4, backend=name
    )
    x, memory = (module.from_numpy(a.numpy()) for a in (seen["x"], encoder))
    output = layer(x, memory, memory, module.from_numpy(np.array([5, 3])))
    np.testing.assert_allclose(module.to_numpy(output), y, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", backend_params())
def test_vit_attention_ports_to_every_backend(name):
    T = transformers()
    torch.manual_seed(2)
    config = T.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
    )
    model = T.ViTModel(config).double().eval()
    attention = model.layers[0].attention if hasattr(model, "layers") else None
    if attention is None:  # transformers 4 names ViT's projections query ... output.dense
        attention = model.encoder.layer[0].attention
        inputs_of, output_of = attention.attention, attention.output.dense
    else:
        inputs_of, output_of = attention, attention.o_proj
    x, y = capture(
        model, inputs_of, output_of, pixel_values=torch.randn(2, 3, 8, 8, dtype=torch.float64)
    )
    state = model.state_dict()
    # The names of ViT checkpoints (transformers 4 and the files it wrote)
    prefix = "encoder.layer.0.attention"
    names = {
        "q": "attention.query",
        "k": "attention.key",
        "v": "attention.value",
        "o": "output.dense",
    }
    checkpoint = dict(state)
    for key, value in state.items():
        for k, path in names.items():
            for current in (f"layers.0.attention.{k}_proj.", f"{prefix}.{path}."):
                if key.startswith(current):
                    checkpoint[f"{prefix}.{path}.{key[len(current) :]}"] = value
    assert porting.canonical_from_state_dict(checkpoint, prefix, num_heads=2).layout == "HF ViT"
    check_port(name, checkpoint, prefix, x, y, num_heads=2)


@pytest.mark.parametrize("name", backend_params())
def test_modernbert_attention_ports_to_every_backend(name):
    # ModernBERT's fused Wqkv and Wo, its sliding layer's base and window either side, and
    # padding, from its config alone
    T = transformers()
    torch.manual_seed(5)
    config = T.ModernBertConfig(
        hidden_size=16,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=32,
        vocab_size=50,
        local_attention=4,
        global_attn_every_n_layers=2,
        attention_bias=True,
        pad_token_id=0,
    )
    model = T.ModernBertModel(config).double().eval()
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 5:] = 0
    attention = model.layers[1].attn
    ids = torch.randint(1, 50, (2, 7))
    x, y = capture(model, attention, attention.Wo, input_ids=ids, attention_mask=padding)
    options = porting.options_from_config(config.to_dict(), 1)
    assert options["sliding_window"] == 3  # two positions either side, inclusive
    module = backend_module(name)
    layer = porting.from_state_dict(model.state_dict(), "layers.1.attn", backend=name, **options)
    X, lengths = module.from_numpy(x), module.from_numpy(np.array([7, 5]))
    output = module.to_numpy(layer(X, X, X, lengths))
    # transformers turns in float32 whatever the model's dtype
    np.testing.assert_allclose(output, y, rtol=0, atol=1e-6 * np.max(np.abs(y)))


@pytest.mark.parametrize("name", backend_params())
def test_bart_attention_ports_to_every_backend(name):
    T = transformers()
    torch.manual_seed(3)
    config = T.BartConfig(
        d_model=16,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        vocab_size=50,
        max_position_embeddings=32,
    )
    model = T.BartModel(config).double().eval()
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[1, 3:] = 0
    attention = model.encoder.layers[0].self_attn
    x, y = capture(
        model.encoder,
        attention,
        attention.out_proj,
        input_ids=torch.randint(3, 50, (2, 6)),
        attention_mask=padding,
    )
    check_port(
        name,
        model.state_dict(),
        "encoder.layers.0.self_attn",
        x,
        y,
        num_heads=4,
        valid_lens=np.array([6, 3]),
    )


@pytest.mark.parametrize("name", backend_params())
def test_t5_self_attention_is_one_layer(name):
    # T5 does not scale its scores (the layout imports with scale=1) and adds a relative
    # position bias per head, which its layer computes from positions: mha takes it as attn_bias
    T = transformers()
    from transformers.models.t5.modeling_t5 import T5Attention

    torch.manual_seed(4)
    config = T.T5Config(d_model=16, d_kv=4, num_heads=4, num_layers=1, vocab_size=50)
    attention = T5Attention(config, has_relative_attention_bias=True).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        y, position_bias = attention(x)[:2]
    port = porting.canonical_from_state_dict(attention.state_dict(), num_heads=4)
    assert port.layout == "T5" and port.config["scale"] == 1.0 and not port.config["bias"]
    assert port.left_out == ["relative_attention_bias.weight"]
    # The bias from the left-out table, as T5 computes it: no T5 code needed to run the port
    bias = porting.t5_position_bias(attention.state_dict()["relative_attention_bias.weight"], 5, 5)
    np.testing.assert_array_equal(bias, position_bias.numpy())
    check_port(name, attention.state_dict(), "", x.numpy(), y.numpy(), num_heads=4, attn_bias=bias)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_t5_position_bias_buckets_distances_as_t5_does(bidirectional):
    # Long enough for the logarithmic buckets and past max_distance
    T = transformers()
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T.T5Config(
        d_model=16,
        d_kv=4,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        is_decoder=not bidirectional,
    )
    attention = T5Attention(config, has_relative_attention_bias=True).double()
    table = attention.relative_attention_bias.weight
    buckets = {"bidirectional": bidirectional, "num_buckets": 8, "max_distance": 20}
    written = config.to_dict()
    for alignment, cached in [("top_left", 0), (3, 3), ("bottom_right", 7)]:
        with torch.no_grad():
            expected = attention.compute_bias(30, 37, past_seen_tokens=cached).numpy()
        bias = porting.t5_position_bias(table, 30, 37, **buckets, alignment=alignment)
        np.testing.assert_array_equal(bias, expected)
        # The same two fields read from the config itself, as options_from_config reads it
        bias = porting.t5_position_bias(
            table, 30, 37, bidirectional=bidirectional, alignment=alignment, config=written
        )
        np.testing.assert_array_equal(bias, expected)
    with pytest.raises(ValueError, match=r"max_distance=128 differs from the config's rel"):
        porting.t5_position_bias(table, 3, 3, max_distance=128, config=written)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_t5_position_bias_places_the_queries_last_as_t5_does_under_a_cache(bidirectional):
    # T5 puts a call's queries after the cached positions (past_seen_tokens): a decoding
    # step's one query is the last key's position, not the first
    T = transformers()
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T.T5Config(d_model=16, d_kv=4, num_heads=4, is_decoder=not bidirectional)
    attention = T5Attention(config, has_relative_attention_bias=True).double()
    table = attention.relative_attention_bias.weight
    for num_queries, num_keys in [(1, 1), (1, 40), (4, 300), (6, 6)]:
        with torch.no_grad():
            cached = num_keys - num_queries
            expected = attention.compute_bias(num_queries, num_keys, past_seen_tokens=cached)
        bias = porting.t5_position_bias(table, num_queries, num_keys, bidirectional=bidirectional)
        np.testing.assert_array_equal(bias, expected.numpy())


def test_t5_decoding_with_a_cache_gives_the_full_calls_numbers():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((32, 4))
    x = rng.standard_normal((2, 9, 16))
    layer = backend_module("numpy").MultiHeadAttention(
        16, 4, scale=1.0, query_size=16, key_size=16, value_size=16, dtype="float64"
    )
    decoder = {"bidirectional": False}
    full = layer(x, x, x, causal=True, attn_bias=porting.t5_position_bias(table, 9, 9, **decoder))
    cache, steps = mha.KVCache(), []
    for n in range(9):
        step = x[:, n : n + 1]
        bias = porting.t5_position_bias(table, 1, n + 1, **decoder)
        output, cache = layer(step, step, step, causal=True, cache=cache, attn_bias=bias)
        steps.append(output)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # A table of 64 buckets read as 32 would put distances in the wrong buckets
        (lambda table: porting.t5_position_bias(np.zeros((64, 4)), 3, 3), "num_buckets"),
        (lambda table: porting.t5_position_bias(table, 3, 3, alignment=True), "alignment"),
        (lambda table: porting.t5_position_bias(table, 3, 3, alignment="last"), "alignment"),
        (lambda table: porting.t5_position_bias(table, 0, 3), "num_queries"),
        (lambda table: porting.t5_position_bias(table, 3, 2.0), "num_keys"),
    ],
)
def test_t5_position_bias_refuses_what_would_misplace_a_bucket(call, message):
    with pytest.raises(ValueError, match=message):
        call(np.zeros((32, 4)))


class TimmAttention(torch.nn.Module):
    """timm's vision transformer Attention, its forward as timm writes it (qkv_bias=False,
    its default: no input biases, a bias on proj)."""

    def __init__(self, dim, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = torch.nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        x = attn.softmax(dim=-1) @ v
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("name", backend_params())
def test_timm_fused_qkv_ports_with_its_biases(name, qkv_bias):
    torch.manual_seed(5)
    attention = TimmAttention(12, 3, qkv_bias).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    with torch.no_grad():
        y = attention(x).numpy()
    state = {f"blocks.0.attn.{key}": value for key, value in attention.state_dict().items()}
    port = porting.canonical_from_state_dict(state, "blocks.0.attn", num_heads=3)
    # The output bias alone when the inputs have none: no zero biases the source never had
    assert port.config["bias"] is qkv_bias
    assert sorted(name for name in port.weights if name.startswith("b_")) == (
        ["b_k", "b_o", "b_q", "b_v"] if qkv_bias else ["b_o"]
    )
    check_port(name, state, "blocks.0.attn", x.numpy(), y, num_heads=3)


def reference_attention(x, W, b, num_heads, scale=None):
    """Multi-head self-attention by the formula, in numpy, from canonical matrices."""
    q, k, v = (x @ W[i] + b.get(i, 0) for i in "qkv")
    B, N, n = q.shape
    heads = [a.reshape(B, N, num_heads, -1).transpose(0, 2, 1, 3) for a in (q, k, v)]
    scale = 1 / np.sqrt(n // num_heads) if scale is None else scale
    scores = heads[0] @ heads[1].transpose(0, 1, 3, 2) * scale
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = (weights @ heads[2]).transpose(0, 2, 1, 3).reshape(B, N, n)
    return out @ W["o"] + b.get("o", 0)


@pytest.mark.parametrize("name", backend_params())
def test_llama_names_without_biases_and_a_wider_output(name):
    # q_proj..o_proj as Llama keeps them (no biases); o_proj to another size, as T5's inner
    # dimension may differ from d_model
    rng = np.random.default_rng(6)
    W = {
        "q": rng.standard_normal((10, 8)),
        "k": rng.standard_normal((10, 8)),
        "v": rng.standard_normal((10, 8)),
        "o": rng.standard_normal((8, 6)),
    }
    state = {f"model.layers.3.self_attn.{k}_proj.weight": W[k].T for k in "qkvo"}
    state["model.layers.3.input_layernorm.weight"] = np.ones(10)
    x = rng.standard_normal((2, 4, 10))
    port = porting.canonical_from_state_dict(state, "model.layers.3.self_attn", num_heads=2)
    assert port.layout.startswith("q/k/v/o_proj") and port.config["out_features"] == 6
    check_port(
        name, state, "model.layers.3.self_attn", x, reference_attention(x, W, {}, 2), num_heads=2
    )


@pytest.mark.parametrize("name", backend_params())
def test_keras_kernels_port_with_their_heads(name):
    keras = backend_module("tensorflow").keras
    source = keras.layers.MultiHeadAttention(3, 4, dtype="float64")
    x = np.random.default_rng(7).standard_normal((2, 5, 10))
    y = np.asarray(source(x, x))
    # Keras's variable paths: query/kernel (in, heads, head size) ... attention_output/kernel
    state = {variable.path: variable.numpy() for variable in source.weights}
    port = porting.canonical_from_state_dict(state, source.name)
    assert port.layout == "Keras MultiHeadAttention" and port.config["num_heads"] == 3
    check_port(name, state, source.name, x, y)


@pytest.mark.parametrize("name", backend_params())
def test_flax_kernels_port_with_their_heads(name):
    backend_module("jax")
    from flax import nnx

    source = nnx.MultiHeadAttention(
        2, 8, qkv_features=8, decode=False, param_dtype="float64", dtype="float64", rngs=nnx.Rngs(0)
    )
    x = np.random.default_rng(8).standard_normal((2, 5, 8))
    y = np.asarray(source(x, x, x))
    state = {
        ".".join(map(str, path)): value[...]
        for path, value in nnx.to_flat_state(nnx.state(source, nnx.Param))
    }
    port = porting.canonical_from_state_dict(state)
    assert port.layout == "Flax multi-head attention" and port.config["num_heads"] == 2
    # Flax's float64 attention is not float64 throughout: it agrees with mha to about 3e-7
    check_port(name, state, "", x, y, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# What cannot be ported is an error that says what was found


def test_an_unknown_prefix_lists_what_is_there_and_where_attention_is():
    rng = np.random.default_rng(0)
    state = {
        f"encoder.{i}.attn.{k}_proj.weight": rng.standard_normal((4, 4))
        for i in range(2)
        for k in "qkvo"
    }
    with pytest.raises(ValueError) as error:
        porting.canonical_from_state_dict(state, "encoder", num_heads=2)
    message = str(error.value)
    assert "no known attention layout under 'encoder'" in message
    assert "0.attn.q_proj.weight" in message and "'encoder.1.attn'" in message
    assert porting.find_attention(state) == [
        ("encoder.0.attn", "q/k/v/o_proj (Llama, Mistral, Qwen)"),
        ("encoder.1.attn", "q/k/v/o_proj (Llama, Mistral, Qwen)"),
    ]


def test_two_layouts_under_one_prefix_are_ambiguous():
    state = {f"{k}_proj.weight": np.eye(4) for k in "qkvo"} | {"out_proj.weight": np.eye(4)}
    with pytest.raises(ValueError, match=r"more than one layout: q/k/v/o_proj.*out_proj"):
        porting.canonical_from_state_dict(state, num_heads=2)


@pytest.mark.parametrize(
    "change, message",
    [
        # Keys with fewer heads than values, or a head count that does not divide
        (lambda s: s.update({"k_proj.weight": np.zeros((4, 8))}), "the same number of heads"),
        (
            lambda s: s.update(
                {"k_proj.weight": np.zeros((2, 8)), "v_proj.weight": np.zeros((2, 8))}
            ),
            "not a number of key-value heads",
        ),
        (lambda s: s.update({"v_proj.weight": np.zeros((8, 8), "float32")}), "different dtypes"),
        (lambda s: s.update({"o_proj.weight": np.zeros((8, 6))}), "output projection takes 6"),
        (lambda s: s.update({"q_proj.weight": np.zeros((8, 8), "int64")}), "holds int64"),
    ],
    ids=["kv_heads_differ", "kv_size", "dtypes", "output_size", "integers"],
)
def test_weights_mha_cannot_hold_are_refused(change, message):
    state = {f"{k}_proj.weight": np.eye(8) for k in "qkvo"}
    change(state)
    with pytest.raises(ValueError, match=message):
        porting.canonical_from_state_dict(state, num_heads=2)


def test_num_heads_is_needed_unless_the_kernels_tell_it():
    state = {f"{k}_proj.weight": np.eye(8) for k in "qkvo"}
    with pytest.raises(ValueError, match="do not tell the number of heads"):
        porting.canonical_from_state_dict(state)
    with pytest.raises(ValueError, match="num_hiddens must be divisible by num_heads"):
        porting.canonical_from_state_dict(state, num_heads=3)


# ---------------------------------------------------------------------------------------------
# Llama and Mistral: grouped-query attention, rotary embeddings, sliding windows


def _hf_rotary(T, config, positions):
    """cos and sin of Hugging Face's rotate_half convention, written out in float64 from the
    formula (transformers computes its own in float32 whatever the model's dtype)."""
    head = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    frequencies = 1.0 / theta ** (torch.arange(0, head, 2, dtype=torch.float64) / head)
    angles = positions[..., None].double() * frequencies
    embedding = torch.cat([angles, angles], dim=-1)
    return embedding.cos(), embedding.sin()


def _decoder_attention(family, sliding_window=None, seed=6):
    T = transformers()
    torch.manual_seed(seed)
    Config, Model = {
        "llama": (T.LlamaConfig, T.LlamaModel),
        "mistral": (T.MistralConfig, T.MistralModel),
        "qwen2": (T.Qwen2Config, T.Qwen2Model),
    }[family]
    extra = {} if sliding_window is None else {"sliding_window": sliding_window}
    if family == "qwen2" and sliding_window is not None:
        extra["use_sliding_window"] = True
    config = Config(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        num_hidden_layers=1,
        vocab_size=50,
        rope_theta=500.0,
        **extra,
    )
    # SDPA computes in the model's dtype; the eager path takes its softmax in float32
    config._attn_implementation = "sdpa"
    model = Model(config).double().eval()
    scores_of_order_one(model)
    with torch.no_grad():  # a trained model's biases (Qwen2's), where transformers makes zeros
        for name, parameter in model.named_parameters():
            if name.endswith("proj.bias"):
                parameter.normal_()
    return T, config, model


@pytest.mark.parametrize("name", backend_params())
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_attention_is_one_layer_with_gqa_and_rope(name, family):
    # Grouped-query attention (4 query heads, 2 key-value heads), rotary embeddings, causal,
    # and right padding: HF's own attention module and HF's own mask
    from transformers.masking_utils import create_causal_mask

    T, config, model = _decoder_attention(family)
    attention = model.layers[0].self_attn
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    padding = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    positions = torch.arange(6)[None].expand(2, 6)
    mask = create_causal_mask(
        config=config,
        inputs_embeds=x,
        attention_mask=padding,
        past_key_values=None,
        position_ids=positions,
    )
    with torch.no_grad():
        expected, _ = attention(
            x, position_embeddings=_hf_rotary(T, config, positions), attention_mask=mask
        )
    options = porting.options_from_config(config.to_dict())
    heads = {"num_heads": 4, "head_size": 4, "num_kv_heads": 2, "query_size": 16}  # 16 / 4
    assert options == {**heads, "rope_theta": 500.0}
    module = backend_module(name)
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend=name, **options
    )
    assert layer.num_kv_heads == 2 and layer.bias == (family == "qwen2")
    X = module.from_numpy(x.numpy())
    output = layer(X, X, X, module.from_numpy(np.array([6, 4])), causal=True)
    np.testing.assert_allclose(module.to_numpy(output), expected.numpy(), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", backend_params())
def test_mistral_sliding_window_ports(name):
    from transformers.masking_utils import create_sliding_window_causal_mask

    T, config, model = _decoder_attention("mistral", sliding_window=3)
    attention = model.layers[0].self_attn
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    positions = torch.arange(7)[None].expand(2, 7)
    mask = create_sliding_window_causal_mask(
        config=config,
        inputs_embeds=x,
        attention_mask=torch.ones(2, 7, dtype=torch.long),
        past_key_values=None,
        position_ids=positions,
    )
    with torch.no_grad():
        expected, _ = attention(
            x, position_embeddings=_hf_rotary(T, config, positions), attention_mask=mask
        )
    options = porting.options_from_config(config.to_dict())
    assert options["sliding_window"] == 3
    module = backend_module(name)
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend=name, **options
    )
    X = module.from_numpy(x.numpy())
    output = layer(X, X, X, causal=True)
    np.testing.assert_allclose(module.to_numpy(output), expected.numpy(), rtol=0, atol=TOLERANCE)


def test_llama_in_float32_with_transformers_own_rotary_embedding():
    # Transformers' rotary embedding (its frequencies and angles in float32) against mha's
    T, config, model = _decoder_attention("llama")
    model = model.float()
    attention = model.layers[0].self_attn
    x = torch.randn(1, 9, 16)
    positions = torch.arange(9)[None]
    mask = T.masking_utils.create_causal_mask(
        config=config,
        inputs_embeds=x,
        attention_mask=None,
        past_key_values=None,
        position_ids=positions,
    )
    with torch.no_grad():
        expected, _ = attention(
            x, position_embeddings=model.rotary_emb(x, positions), attention_mask=mask
        )
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend="numpy", num_heads=4, rope_theta=500.0
    )
    output = layer(*[x.numpy()] * 3, causal=True)
    atol = 1e-6 * np.max(np.abs(expected.numpy()))  # float32's precision, of the outputs' scale
    np.testing.assert_allclose(output, expected.numpy(), rtol=0, atol=atol)


def test_convert_a_llama_layer_with_its_config(tmp_path, capsys):
    from safetensors.numpy import save_file

    _, config, model = _decoder_attention("llama")
    save_file(
        {key: value.numpy() for key, value in model.state_dict().items()},
        tmp_path / "model.safetensors",
    )
    config.to_json_file(tmp_path / "config.json")
    arguments = ["--prefix", "layers.0.self_attn", "--config", str(tmp_path / "config.json")]
    source, destination = tmp_path / "model.safetensors", tmp_path / "layer.safetensors"
    code = cli.main(["convert", str(source), str(destination), *arguments])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "q/k/v/o_proj" in out and "num_kv_heads=2" in out and "rope_theta=500.0" in out
    checkpoint = mha.weights.read_checkpoint(destination)
    assert checkpoint.config["num_heads"] == 4 and checkpoint.config["num_kv_heads"] == 2
    assert checkpoint.config["rope_theta"] == 500.0
    state = model.state_dict()
    np.testing.assert_array_equal(
        checkpoint.weights["W_k"], state["layers.0.self_attn.k_proj.weight"].numpy().T
    )
    # The command line overrides the config; a rotary embedding has no torch equivalent
    code = cli.main(["inspect", str(source), *arguments, "--rope-theta", "10000"])
    out = capsys.readouterr().out
    assert code == 0 and '"rope_theta": 10000.0' in out
    assert "(config inferred from the weights and --config)" in out
    code = cli.main(["convert", str(source), str(tmp_path / "layer.pt"), *arguments])
    assert code == 1 and "rope_theta=500.0" in capsys.readouterr().err
    assert not (tmp_path / "layer.pt").exists()


# What a config.json may write of its rotary embedding: nothing (transformers' defaults of
# the model type), the base only, Gemma 3's older base of its sliding layers, a fraction
ROPE_WRITTEN = {
    "nothing": {},
    "base": {"rope_theta": 20000.0},
    "local base": {"rope_theta": 20000.0, "rope_local_base_freq": 30000.0},
    "fraction": {"rope_theta": 20000.0, "partial_rotary_factor": 0.5},
    "older GPT-NeoX": {"rotary_emb_base": 20000.0, "rotary_pct": 0.5},
}


def transformers_rotary(config, kind, head_size):
    """The base, rotated features and rotary type of a layer of `kind` as transformers
    resolves the config (its rope_parameters, after its defaults). The code of the model
    types outside TURNS_PART turns whole heads whatever the fraction (tests/test_config_fields
    holds that to their models)."""
    rope = config.rope_parameters
    rope = rope[kind] if kind in rope else rope
    fraction = rope.get("partial_rotary_factor") or 1.0
    turns_part = (
        config.model_type in model_rope.TURNS_PART or rope.get("rope_type") == "proportional"
    )
    fraction = fraction if turns_part else 1.0
    return rope["rope_theta"], int(head_size * fraction), rope.get("rope_type", "default")


# GPT-J's and RoFormer's bases are in their code, ESM's is rope_theta alone (its family test
# writes the others); latent attention (DeepSeek-V2 and V3, and
# the types that take their modules) has tests of its own (test_latent_attention.py)
LATENT_TYPES = {"axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "kimi_k2", "minicpm3"}
LATENT_TYPES |= {"mistral4", "sarvam_mla", "youtu"}


# UltraBERT's rope_theta is a base per layer, refused (tests/test_config_fields.py); Cohere
# Compass's rotary embedding is its rope_parameters' per layer type alone (refused without)
@pytest.mark.parametrize(
    "model_type",
    sorted(
        set(rotary_types.ROTARY)
        - {"cohere_compass_text", "esm", "gptj", "roformer", "ultrabert"}
        - LATENT_TYPES
    ),
)
def test_a_config_that_does_not_write_its_rotary_embedding_gets_transformers_defaults(
    model_type,
):
    """Falcon-7B's config.json writes no rope_theta, Gemma 3's older configs give the sliding
    layers' base as rope_local_base_freq: options_from_config reads what transformers reads
    (GPT-J's base is in its code, not its config: its own test ports it)."""
    for name, written in ROPE_WRITTEN.items():
        small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
        small |= {"num_hidden_layers": 4, **written}
        if model_type != "falcon":  # Falcon's head size follows from the others
            small["head_dim"] = 16
        if model_type == "gemma3n_text":  # by default its last 15 layers share others' keys
            small["num_kv_shared_layers"] = 0
        config = transformers().AutoConfig.for_model(model_type, **small)
        raw = {"model_type": model_type, **small}
        if getattr(config, "layer_types", None):
            raw["layer_types"] = list(config.layer_types)
            raw["sliding_window"] = getattr(config, "sliding_window", None)
        for layer in range(4):
            kind = raw["layer_types"][layer] if "layer_types" in raw else None
            if kind not in (None, "full_attention", "sliding_attention", "chunked_attention"):
                continue  # Qwen3-Next's linear attention
            if not (getattr(config, "no_rope_layers", None) or [1] * 4)[layer]:
                continue  # SmolLM3's and Llama 4's layers without a rotary embedding
            rotates_sliding_only = ("afmoe", "cohere2", "cohere2_moe", "exaone4", "exaone_moe")
            rotates_sliding_only += ("flint", "lara_mini", "muse_glimmer_text")
            if model_type in rotates_sliding_only and kind == "full_attention":
                continue  # they rotate their sliding layers only (test_families.py ports both)
            try:
                options = porting.options_from_config(raw, layer)
            except ValueError as error:  # a fraction their code cannot run (Apertus's YaRN)
                assert name == "fraction" and "cannot run it" in str(error), (name, error)
                continue
            scaling = options.get("rope_scaling") or {"rope_type": "default"}
            turned = options.get("rope_dim", 16)
            if scaling["rope_type"] == "proportional":  # the whole head, part at frequency 0
                turned = 2 * int(scaling.get("partial_rotary_factor", 1.0) * turned // 2)
            got = (options["rope_theta"], turned, scaling["rope_type"])
            assert got == transformers_rotary(config, kind, 16), (name, layer)


@pytest.mark.parametrize("model_type", ["gptj", "roformer"])
def test_a_rotary_base_fixed_in_transformers_code_is_not_read_from_the_config(model_type):
    # Their modeling code turns by 10000 ** (-2i / d) whatever the config writes (the tiny
    # models of test_families.py write another base, which they ignore)
    written = {"rope_theta": 20000.0, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    options = porting.options_from_config({"model_type": model_type, **written, "num_heads": 4})
    heads = {"num_heads": 4, "num_kv_heads": 4}  # a key-value head each; no hidden size
    assert options == {**heads, "rope_theta": 10000.0, "rope_interleaved": True}


def test_options_from_config_reads_a_file_and_refuses_an_incomplete_scaling(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_attention_heads": 32, "rope_theta": 10000.0}))
    assert porting.options_from_config(path) == {"num_heads": 32, "rope_theta": 10000.0}
    llama3 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    with pytest.raises(ValueError, match="'llama3'"):
        porting.options_from_config(llama3)
    with pytest.raises(TypeError, match="unknown option rope_base"):
        porting.canonical_from_state_dict(
            {f"{k}_proj.weight": np.eye(8) for k in "qkvo"}, num_heads=2, rope_base=1.0
        )
    # JSON that is no model's config (a safetensors index given by mistake) read as one
    # ported a Llama layer without its rotary embedding, with no word
    index = {"metadata": {"total_size": 64}, "weight_map": {"q_proj.weight": "a.safetensors"}}
    for config in ({}, index):
        with pytest.raises(ValueError, match="it is not a model's config"):
            porting.options_from_config(config)
    # One whose other layer has a window is a model's, its first layer's options none
    windowed = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4}
    assert porting.options_from_config(windowed, 0) == {}
    assert porting.options_from_config(windowed, 1) == {"sliding_window": 4}


# ---------------------------------------------------------------------------------------------
# mha convert / inspect --prefix


@pytest.fixture
def whole_model(tmp_path, bert):
    from safetensors.numpy import save_file

    state, _, _ = bert
    torch.save(state, tmp_path / "bert.pt")  # holds an int64 buffer (position_ids) too
    save_file({key: value.numpy() for key, value in state.items()}, tmp_path / "model.safetensors")
    return tmp_path, state


@pytest.mark.parametrize("source", ["bert.pt", "model.safetensors"])
def test_convert_takes_one_attention_out_of_a_whole_model(whole_model, source, capsys):
    folder, state = whole_model
    destination = folder / "layer.safetensors"
    code = cli.main(
        [
            "convert",
            str(folder / source),
            str(destination),
            "--num-heads",
            "4",
            "--prefix",
            "encoder.layer.0.attention",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "HF BERT/RoBERTa" in out and "left out (not attention weights): output.LayerNorm" in out
    assert "output.LayerNorm.weight (the layer norm after the residual, outside" in out
    layer = mha.load(destination, backend="numpy")
    expected = porting.from_state_dict(
        state, "encoder.layer.0.attention", num_heads=4, backend="numpy"
    )
    for key, value in mha.get_weights(expected).items():
        np.testing.assert_array_equal(mha.get_weights(layer)[key], value)


def test_inspect_prefix_and_a_wrong_prefix(whole_model, capsys):
    folder, _ = whole_model
    code = cli.main(
        [
            "inspect",
            str(folder / "model.safetensors"),
            "--prefix",
            "encoder.layer.1.attention",
            "--num-heads",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "HF BERT/RoBERTa" in out
    config = json.loads(out.split("config: ")[1].splitlines()[0])
    assert config["num_hiddens"] == 16 and config["num_heads"] == 4 and config["bias"]
    code = cli.main(
        [
            "convert",
            str(folder / "bert.pt"),
            str(folder / "x.safetensors"),
            "--prefix",
            "encoder",
            "--num-heads",
            "4",
        ]
    )
    captured = capsys.readouterr()
    assert code == 1 and not (folder / "x.safetensors").exists()
    assert "'encoder.layer.0.attention' (HF BERT/RoBERTa)" in captured.err


def test_a_scale_the_destination_cannot_hold_is_refused(whole_model):
    folder, _ = whole_model
    with pytest.raises(ValueError, match="no equivalent of a score scale"):
        interop.convert(
            folder / "bert.pt",
            folder / "x.pt",
            num_heads=4,
            scale=0.5,
            prefix="encoder.layer.0.attention",
        )
    assert not (folder / "x.pt").exists()


# ---------------------------------------------------------------------------------------------
# Never silently wrong: what changes the numbers and mha cannot hold is refused by name


def _tiny_decoder(family, seed=9, **fields):
    """A tiny random transformers decoder of `family` in float64, and its config."""
    T = transformers()
    Config, Model = {
        "qwen3": (T.Qwen3Config, T.Qwen3Model),
        "gemma2": (T.Gemma2Config, T.Gemma2Model),
        "gemma3": (T.Gemma3TextConfig, T.Gemma3TextModel),
        "stablelm": (T.StableLmConfig, T.StableLmModel),
        "gpt_oss": (T.GptOssConfig, T.GptOssModel),
        "cohere": (T.CohereConfig, T.CohereModel),
        "cohere2": (T.Cohere2Config, T.Cohere2Model),
        "olmo2": (T.Olmo2Config, T.Olmo2Model),
        "phi3": (T.Phi3Config, T.Phi3Model),
        "qwen3_next": (T.Qwen3NextConfig, T.Qwen3NextModel),
        "minicpm5_moe": (T.MiniCPM5MoeConfig, T.MiniCPM5MoeModel),
    }[family]
    sizes = dict(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        num_hidden_layers=2,
        vocab_size=50,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    config = Config(**sizes, **fields)
    model = Model(config).double().eval()
    scores_of_order_one(model)
    # SDPA computes in the model's dtype (set once built: Gemma 2 refuses it at construction)
    model.config._attn_implementation = "sdpa"
    return config, model


IDS = torch.tensor([[5, 17, 3, 42, 8, 29, 11], [33, 4, 19, 7, 48, 26, 12]])


def _check_causal_port(name, state, prefix, options, x, expected, precision=1e-6):
    """The port in backend `name`, causal, matches the model's attention output within
    `precision` of its scale (float32's: transformers computes its rotary angles and norms in
    float32)."""
    module = backend_module(name)
    layer = porting.from_state_dict(state, prefix, backend=name, **options)
    output = module.to_numpy(layer(*[module.from_numpy(x)] * 3, causal=True))
    atol = precision * np.max(np.abs(expected))
    np.testing.assert_allclose(output, expected, rtol=0, atol=atol)


def _attention_io(model, ids):
    """{layer index: (input hidden states, attention output)} of a run of the whole model."""
    seen, handles = {}, []
    for i, block in enumerate(model.layers):

        def take_input(module, args, kwargs, i=i):
            seen[i] = [(args[0] if args else kwargs["hidden_states"]).numpy()]

        def take_output(module, args, output, i=i):
            seen[i].append(output[0].numpy())

        handles.append(block.self_attn.register_forward_pre_hook(take_input, with_kwargs=True))
        handles.append(block.self_attn.register_forward_hook(take_output))
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("name", backend_params())
@pytest.mark.parametrize("family, qk_norm", [("qwen3", "head"), ("olmo2", "projection")])
def test_qk_norm_ports_in_one_line(name, family, qk_norm):
    # Qwen3 normalizes each head's queries and keys, OLMo 2 the whole projections, before
    # the rotary embedding; transformers computes the norms in float32 in a float64 model
    config, model = _tiny_decoder(family, rms_norm_eps=1e-5)
    with torch.no_grad():  # scales away from 1, so that a port without them is off
        for block in model.layers:
            block.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            block.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    options = porting.options_from_config(config.to_dict(), 0)
    assert options["qk_norm"] == qk_norm and options["qk_norm_eps"] == 1e-5
    x, expected = _attention_io(model, torch.randint(3, 50, (2, 7)))[0]
    module = backend_module(name)
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend=name, **options
    )
    output = module.to_numpy(layer(*[module.from_numpy(x)] * 3, causal=True))
    atol = 1e-6 * np.max(np.abs(expected))
    np.testing.assert_allclose(output, expected, rtol=0, atol=atol)
    # Without the norms the port is refused by name, never silently wrong
    plain = {key: value for key, value in options.items() if not key.startswith("qk_norm")}
    with pytest.raises(ValueError, match=r"k_norm\.weight \(.*QK-norm.*q_norm\.weight"):
        porting.from_state_dict(model.state_dict(), "layers.0.self_attn", **plain)
    # ... and a norm of another tensor is not named a QK-norm: BitNet's of the heads' output
    state = {**model.state_dict(), "layers.0.self_attn.attn_sub_norm.weight": torch.ones(32)}
    with pytest.raises(ValueError, match=r"attn_sub_norm\.weight \(a norm .* not of its queries"):
        porting.from_state_dict(state, "layers.0.self_attn", **options)


@pytest.mark.parametrize("name", backend_params())
def test_gemma2_layers_get_their_own_window_scale_and_soft_cap(name):
    # Layer 0 slides and layer 1 attends to every key, with sliding_window set for both; the
    # scores are scaled by query_pre_attn_scalar ** -0.5, not by head_dim ** -0.5, and capped
    # by attn_logit_softcapping
    config, model = _tiny_decoder(
        "gemma2",
        head_dim=4,
        attn_logit_softcapping=0.5,
        query_pre_attn_scalar=8,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )
    with pytest.raises(ValueError, match=r"layers differ.*layer_types"):
        porting.options_from_config(config.to_dict())
    # transformers' SDPA path has no soft cap: its eager path takes the softmax in float32
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # scores of order 1, which the cap changes (initial weights are small)
        for block in model.layers:
            block.self_attn.q_proj.weight.mul_(100)
            block.self_attn.k_proj.weight.mul_(100)
    seen = _attention_io(model, torch.randint(3, 50, (2, 7)))
    module = backend_module(name)
    for layer, window in [(0, 3), (1, None)]:
        options = porting.options_from_config(config.to_dict(), layer)
        assert options.get("sliding_window") == window and options["scale"] == 8**-0.5
        assert options["softcap"] == 0.5
        ported = porting.from_state_dict(
            model.state_dict(), f"layers.{layer}.self_attn", backend=name, **options
        )
        x, expected = seen[layer]
        output = module.to_numpy(ported(*[module.from_numpy(x)] * 3, causal=True))
        atol = 1e-6 * np.max(np.abs(expected))
        np.testing.assert_allclose(output, expected, rtol=0, atol=atol)
        # The cap changes the numbers: without it the port is off
        plain = porting.from_state_dict(
            model.state_dict(),
            f"layers.{layer}.self_attn",
            backend=name,
            **{**options, "softcap": None},
        )
        off = module.to_numpy(plain(*[module.from_numpy(x)] * 3, causal=True)) - expected
        assert np.max(np.abs(off)) > 100 * atol


@pytest.mark.parametrize("name", backend_params())
def test_gemma3_ports_with_its_rope_per_layer_type_and_norms_of_one_plus_weight(name):
    # Layer 0 slides with the local rotary base, layer 1 attends to all with the global one,
    # scaled linearly; the QK-norms scale by 1 + weight (computed in float32 by transformers)
    config, model = _tiny_decoder(
        "gemma3",
        head_dim=4,
        query_pre_attn_scalar=8,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 8.0},
        },
    )
    with torch.no_grad():  # norm weights away from 0, scores of order 1
        for block in model.layers:
            block.self_attn.q_norm.weight.uniform_(-0.5, 0.5)
            block.self_attn.k_norm.weight.uniform_(-0.5, 0.5)
            block.self_attn.q_proj.weight.mul_(10)
    seen = _attention_io(model, torch.randint(3, 50, (2, 7)))
    module = backend_module(name)
    for layer, window, theta in [(0, 3, 10.0), (1, None, 1000.0)]:
        options = porting.options_from_config(config.to_dict(), layer)
        assert options.get("sliding_window") == window and options["rope_theta"] == theta
        assert options["qk_norm"] == "head" and options["qk_norm_offset"] == 1.0
        state, prefix = model.state_dict(), f"layers.{layer}.self_attn"
        ported = porting.from_state_dict(state, prefix, backend=name, **options)
        x, expected = seen[layer]
        output = module.to_numpy(ported(*[module.from_numpy(x)] * 3, causal=True))
        atol = 1e-6 * np.max(np.abs(expected))
        np.testing.assert_allclose(output, expected, rtol=0, atol=atol)
        # The weights alone, without the 1 Gemma adds, give other numbers
        options["qk_norm_offset"] = 0.0
        plain = porting.from_state_dict(state, prefix, backend=name, **options)
        off = module.to_numpy(plain(*[module.from_numpy(x)] * 3, causal=True)) - expected
        assert np.max(np.abs(off)) > 100 * atol
    port = porting.canonical_from_state_dict(state, prefix, **{**options, "qk_norm_offset": 1.0})
    assert any("1 + the source's norm weights" in note for note in port.notes)


def test_a_bfloat16_gemma3_widened_to_float32_sums_its_norms_in_float32():
    # 1 + a bfloat16 norm weight is exact in float32, as transformers sums it, and rounded in
    # bfloat16 (by up to 2**-8): widened, the port sums in float32 and gives the model's
    # numbers in float32, of the same bfloat16 weights
    config, model = _tiny_decoder(
        "gemma3", head_dim=4, layer_types=["full_attention"] * 2, sliding_window=3
    )
    with torch.no_grad():  # norm weights away from 0 (many bits below 1 + w's last), rounded
        for block in model.layers:
            block.self_attn.q_norm.weight.uniform_(-0.9, 0.9)
            block.self_attn.k_norm.weight.uniform_(-0.9, 0.9)
            block.self_attn.q_proj.weight.mul_(10)
        model.to(torch.bfloat16).to(torch.float32)
    x, expected = _attention_io(model, torch.randint(3, 50, (2, 7)))[1]
    state = {name: value.to(torch.bfloat16) for name, value in model.state_dict().items()}
    options = porting.options_from_config(config.to_dict(), 1)
    prefix = "layers.1.self_attn"
    port = porting.canonical_from_state_dict(state, prefix, dtype="float32", **options)
    norms = model.layers[1].self_attn.q_norm.weight.detach().numpy()
    np.testing.assert_array_equal(port.weights["q_norm"], 1 + norms)
    layer = porting.from_state_dict(state, prefix, backend="numpy", dtype="float32", **options)
    assert layer.dtype == "float32"
    output = layer(x, x, x, causal=True)
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6 * np.max(np.abs(expected)))


@pytest.mark.parametrize("name", backend_params())
def test_qwen3_next_ports_with_its_output_gate(name):
    # The query projection gives each head's queries, then its gate; the QK-norms scale by
    # 1 + weight; a quarter of each head (of 8) rotated. Its linear-attention layers are
    # refused by name (both layers of this model are full attention, with dense MLPs)
    config, model = _tiny_decoder(
        "qwen3_next",
        head_dim=8,
        layer_types=["full_attention", "full_attention"],
        mlp_only_layers=[0, 1],
    )
    with torch.no_grad():  # gates and norms away from their starting values
        for block in model.layers:
            block.self_attn.q_norm.weight.uniform_(-0.5, 0.5)
            block.self_attn.k_norm.weight.uniform_(-0.5, 0.5)
            block.self_attn.q_proj.weight.mul_(10)
    options = porting.options_from_config(config.to_dict(), 1)
    assert options["output_gate"] and options["qk_norm_offset"] == 1.0
    assert options["rope_dim"] == 2
    state, prefix = model.state_dict(), "layers.1.self_attn"
    port = porting.canonical_from_state_dict(state, prefix, **options)
    assert port.config["output_gate"] and port.weights["W_g"].shape == (16, 32)
    _check_causal_port(name, state, prefix, options, *_attention_io(model, IDS)[1])
    # Without the gate the query projection does not fit: refused, never silently wrong
    with pytest.raises(ValueError, match=r"the output projection takes 32 inputs"):
        porting.from_state_dict(state, prefix, **{**options, "output_gate": False})
    linear = {**config.to_dict(), "layer_types": ["linear_attention", "full_attention"]}
    with pytest.raises(ValueError, match=r"'linear_attention'"):
        porting.options_from_config(linear, 0)


@pytest.mark.parametrize("name", backend_params())
def test_minicpm5_ports_with_the_gate_in_its_query_projection(name):
    # q_gate_proj gives each head's queries, then its gate, with biases here; 4 query heads
    # of 8 over 2 key-value heads, the whole head turned by halves
    config, model = _tiny_decoder(
        "minicpm5_moe", head_dim=8, attention_bias=True, mlp_layer_types=["dense", "dense"]
    )
    with torch.no_grad():  # gates away from one half
        for block in model.layers:
            block.self_attn.q_gate_proj.weight.mul_(10)
            block.self_attn.q_gate_proj.bias.uniform_(-2, 2)
    options = porting.options_from_config(config.to_dict(), 1)
    assert options == {
        "num_heads": 4,
        "head_size": 8,  # its head_dim
        "num_kv_heads": 2,
        "query_size": 16,
        "rope_theta": config.rope_parameters["rope_theta"],
        "output_gate": True,
    }
    state, prefix = model.state_dict(), "layers.1.self_attn"
    port = porting.canonical_from_state_dict(state, prefix, **options)
    assert port.weights["W_g"].shape == (16, 32) and port.weights["b_g"].shape == (32,)
    _check_causal_port(name, state, prefix, options, *_attention_io(model, IDS)[1])
    # Without the gate the layout is refused by name, never ported as queries alone
    with pytest.raises(ValueError, match=r"in one projection: give output_gate=True"):
        porting.from_state_dict(state, prefix, **{**options, "output_gate": False})


@pytest.mark.parametrize("name", backend_params())
def test_stablelm_qk_layernorm_of_each_head_ports(name):
    # qk_layernorm: a layer norm of each head's queries and keys, a scale of each head's own
    # (4 query heads, 2 key-value heads), no shift; half of each head rotated
    config, model = _tiny_decoder(
        "stablelm",
        qk_layernorm=True,
        layer_norm_eps=1e-4,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
    )
    with torch.no_grad():  # scales that differ from head to head
        for block in model.layers:
            for norm in [*block.self_attn.q_layernorm.norms, *block.self_attn.k_layernorm.norms]:
                norm.weight.uniform_(0.5, 1.5)
    options = porting.options_from_config(config.to_dict(), 0)
    assert options["qk_norm"] == "layer_norm_per_head" and options["qk_norm_eps"] == 1e-4
    state, prefix = model.state_dict(), "layers.0.self_attn"
    port = porting.canonical_from_state_dict(state, prefix, **options)
    assert port.weights["q_norm"].shape == (4, 4) and port.weights["k_norm"].shape == (2, 4)
    _check_causal_port(name, state, prefix, options, *_attention_io(model, IDS)[0])
    # An RMSNorm shared by the heads is another norm: the per-head scales are refused by name
    with pytest.raises(ValueError, match=r"q_layernorm\.norms\.0\.weight \(.*QK-norm"):
        porting.from_state_dict(state, prefix, **{**options, "qk_norm": None})


@pytest.mark.parametrize("name", backend_params())
def test_cohere_qk_norm_of_each_head_ports(name):
    # Command R+'s use_qk_norm: StableLM's layer norm of each head, its scales one tensor of a
    # row per head (q_norm.weight (4, 4), k_norm.weight (2, 4)), before its pairs turn
    config, model = _tiny_decoder("cohere", use_qk_norm=True, layer_norm_eps=1e-3)
    with torch.no_grad():  # scales that differ from head to head
        for block in model.layers:
            for norm in (block.self_attn.q_norm, block.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    options = porting.options_from_config(config.to_dict(), 0)
    assert options["qk_norm"] == "layer_norm_per_head" and options["qk_norm_eps"] == 1e-3
    state, prefix = model.state_dict(), "layers.0.self_attn"
    port = porting.canonical_from_state_dict(state, prefix, **options)
    assert port.weights["q_norm"].shape == (4, 4) and port.weights["k_norm"].shape == (2, 4)
    _check_causal_port(name, state, prefix, options, *_attention_io(model, IDS)[0])
    # Without them the scales are refused by name
    with pytest.raises(ValueError, match=r"q_norm\.weight"):
        porting.from_state_dict(state, prefix, **{**options, "qk_norm": None})


def test_stablelm_partial_rotary_in_rope_parameters_is_read():
    # A quarter of heads of 4 features is 1 (transformers' rounding down): no pair to turn
    config, _ = _tiny_decoder("stablelm")
    assert "partial_rotary_factor" not in config.to_dict()  # transformers 5 keeps it inside
    options = porting.options_from_config(config.to_dict())
    assert options["rope_dim"] == 1
    heads = {"num_heads": 4, "head_size": 4, "num_kv_heads": 2, "query_size": 16}  # 16 / 4
    assert {key: options[key] for key in heads} == heads
    with pytest.raises(ValueError, match=r"rope_dim must be even"):
        mha.MultiHeadAttention(16, 4, rope_theta=options["rope_theta"], rope_dim=1)


def _gpt_oss():
    """A tiny gpt-oss in float32 whose sinks matter, its config, and its attention layers'
    inputs and outputs: layer 0 slides over 3 keys, layer 1 attends to all."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }
    config, model = _tiny_decoder(
        "gpt_oss",
        head_dim=4,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=3,
        rope_parameters=yarn,
    )
    # transformers' experts multiply in float32 only: the model and the port run in float32
    model = model.float()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # sinks that matter (transformers starts them near 0)
        for block in model.layers:
            block.self_attn.sinks.uniform_(-1.0, 1.0)
    return config, model, _attention_io(model, torch.randint(3, 50, (2, 7)))


@pytest.mark.parametrize("name", backend_params())
def test_gpt_oss_ports_with_its_sinks_yarn_and_windows(name):
    # Each head's sink joins the softmax; yarn scales the rotary frequencies (gpt-oss's own
    # parameters, its ramp not rounded). transformers' eager path (its SDPA path has no
    # sinks), compared at float32's 1e-5
    config, model, seen = _gpt_oss()
    with pytest.raises(ValueError, match="layer_types"):
        porting.options_from_config(config.to_dict())
    for layer, window in [(0, 3), (1, None)]:
        options = porting.options_from_config(config.to_dict(), layer)
        assert options.get("sliding_window") == window
        assert options["rope_scaling"]["rope_type"] == "yarn"
        prefix = f"layers.{layer}.self_attn"
        port = porting.canonical_from_state_dict(model.state_dict(), prefix, **options)
        assert port.config["sinks"] and "sinks" in port.used
        _check_causal_port(name, model.state_dict(), prefix, options, *seen[layer], 1e-5)


def test_mha_convert_writes_a_gpt_oss_layer_with_its_sinks(tmp_path, capsys):
    # The sinks are weights: the file's layer has them, and computes gpt-oss's attention
    from safetensors.numpy import save_file

    from mha import cli, load

    config, model, seen = _gpt_oss()
    save_file({k: v.numpy() for k, v in model.state_dict().items()}, tmp_path / "m.safetensors")
    config.to_json_file(tmp_path / "config.json")
    source, destination = str(tmp_path / "m.safetensors"), tmp_path / "layer.safetensors"
    prefix, config_file = "layers.0.self_attn", str(tmp_path / "config.json")
    arguments = ["convert", source, str(destination), "--prefix", prefix, "--config", config_file]
    assert cli.main([*arguments, "--layer", "0"]) == 0, capsys.readouterr()
    layer = load(destination, backend="numpy")
    assert layer.sinks and layer.sliding_window == 3
    x, expected = seen[0]
    output = layer(x, x, x, causal=True)
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-5 * np.max(np.abs(expected)))


@pytest.mark.parametrize("name", backend_params())
def test_cohere2_rotates_pairs_on_its_sliding_layers_only(name):
    # Cohere rotates feature pairs (2i, 2i + 1), which only its model type tells, and Cohere 2
    # rotates nothing on its full-attention layers
    config, model = _tiny_decoder(
        "cohere2", sliding_window=3, layer_types=["sliding_attention", "full_attention"]
    )
    seen = _attention_io(model, torch.randint(3, 50, (2, 7)))
    module = backend_module(name)
    for layer in (0, 1):
        options = porting.options_from_config(config.to_dict(), layer)
        assert options.get("rope_interleaved", False) is (layer == 0)
        ported = porting.from_state_dict(
            model.state_dict(), f"layers.{layer}.self_attn", backend=name, **options
        )
        x, expected = seen[layer]
        output = module.to_numpy(ported(*[module.from_numpy(x)] * 3, causal=True))
        # Cohere turns its queries and keys in float32, in a float64 model too
        atol = 1e-6 * np.max(np.abs(expected))
        np.testing.assert_allclose(output, expected, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"use_qk_norm": True}, "use_qk_norm=True"),
        ({"model_type": "persimmon", "qk_layernorm": True}, "qk_layernorm=True"),
        ({"clip_qkv": 8.0}, "clip_qkv=8.0"),
        (
            {"partial_rotary_factor": 0.5, "rope_theta": 1e4},
            r"partial_rotary_factor=0\.5.*head size",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling=.*no rope_theta"),
        # GPT-J's rotary_dim says the heads turn, in a config that tells no base to turn by
        ({"rotary_dim": 4, "num_attention_heads": 4}, "rope_parameters=.*no rope_theta"),
        # Two rotary embeddings: which one the model turns by is not told
        (
            {
                "rope_parameters": {"rope_theta": 1e4},
                "rope_scaling": {"type": "linear", "factor": 2},
            },
            "gives both rope_parameters",
        ),
        # Ministral 3's queries scaled over a pretrained length its rotary parameters do not
        # give: transformers' attention passes None (no max_position_embeddings in its stead)
        (
            {"model_type": "ministral3", "max_position_embeddings": 64}
            | {"rope_parameters": {"rope_theta": 1e4, "llama_4_scaling_beta": 0.1}},
            "llama_4_scaling_beta and original_max_position_embeddings of its rope_parameters",
        ),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "'su'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "'yarn'"),
        (
            {"rope_parameters": {"full_attention": {"rope_theta": 1e6}}},
            "per layer type .* no layer_types",
        ),
        ({"sliding_window": 4, "sliding_window_pattern": 6}, "sliding_window_pattern=6"),
        ({"layer_types": ["chunked_attention"]}, "'chunked_attention' \\(layer_types,"),
        (
            {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 2},
            "max_window_layers=2",
        ),
        ({"model_type": "persimmon", "rope_theta": 1e4}, "model_type='persimmon'"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"text_config": {"num_attention_heads": 4}}, r"config\['text_config'\]"),
        # Attention that BERT's or T5's names hold and mha does not compute
        ({"model_type": "yoso"}, "model_type='yoso' approximates softmax attention"),
        ({"model_type": "mra"}, "model_type='mra' approximates softmax attention"),
        ({"model_type": "longt5"}, "model_type='longt5' attends within blocks"),
        ({"model_type": "mpnet"}, "model_type='mpnet' adds a relative position bias"),
        ({"model_type": "big_bird"}, "attention_type='block_sparse' attends to blocks"),
        # ... and BART's: Informer's ProbSparse attention, Autoformer's auto-correlation,
        # PEGASUS-X's blocks with global tokens
        ({"model_type": "informer"}, "attention_type='prob' attends with a sample"),
        ({"model_type": "autoformer"}, "model_type='autoformer' replaces attention"),
        ({"model_type": "pegasus_x"}, "model_type='pegasus_x' attends within blocks"),
        # ... and terms of the queries their models compute outside the attention: BROS's of
        # the tokens' boxes, SpeechT5's encoder's relative positions (tests/
        # test_outside_biases.py: the biases others add)
        ({"model_type": "bros"}, "model_type='bros' adds to its scores the products"),
        ({"model_type": "speecht5"}, "model_type='speecht5' adds to its encoder's scores"),
        # Llama's names, whose attention is another than the rotary embedding's would suggest
        ({"model_type": "diffllama"}, "model_type='diffllama' subtracts a second softmax"),
        ({"model_type": "doge"}, "model_type='doge' adds to its scores a mask"),
        ({"model_type": "bitnet"}, "model_type='bitnet' norms the heads' output"),
        # ... whose rotary embeddings a port could take, beside what it cannot
        ({"model_type": "dory", "rope_theta": 1e4}, "model_type='dory' norms its queries"),
        ({"model_type": "laguna", "rope_theta": 1e4}, "model_type='laguna' gates its heads'"),
        ({"model_type": "zaya", "rope_theta": 1e4}, "model_type='zaya' mixes its queries"),
        ({"model_type": "beam", "rope_theta": 1e4}, "model_type='beam' scales its full"),
        ({"model_type": "ergo", "rope_theta": 1e4}, "model_type='ergo' computes its rotary"),
        # ... and others': LightGlue's keypoints turn its queries and keys, SAM 2's Hiera has
        # heads per stage, SAM 3's DETR decoder adds biases of its boxes
        ({"model_type": "lightglue"}, "model_type='lightglue' turns its self-attention's"),
        ({"model_type": "sam2_hiera_det_model"}, "own number of heads"),
        ({"model_type": "sam3_detr_decoder"}, "biases of the boxes' relative positions"),
        ({"model_type": "sam3_lite_text_detr_decoder"}, "biases of the boxes' relative"),
        # RoFormer turns the values too where rotary_value says, and not its cross-attention;
        # ESM turns its cross-attention's by the queries' positions; ESM's relative positions
        ({"model_type": "roformer", "rotary_value": True}, "rotary_value=True turns the values"),
        (
            {"model_type": "roformer", "add_cross_attention": True},
            "turns the cross-attention's queries and keys otherwise.*rope_interleaved",
        ),
        (
            {"model_type": "esm", "position_embedding_type": "rotary", "add_cross_attention": 1},
            "model_type='esm' turns the cross-attention's",
        ),
        (
            {"model_type": "esm", "position_embedding_type": "relative_key"},
            "position_embedding_type='relative_key' adds position biases",
        ),
        # Molmo 2's QK-norms of a kind it does not name
        ({"model_type": "molmo2_text", "qk_norm_type": "rms"}, "qk_norm_type='rms' is not a"),
        # Gemma 4's layers that attend over an earlier layer's keys and values, whose layers
        # differ; Gemma 3n's transformers' default, 15 of 4 layers; Gemma 4's text attending
        # both ways
        (
            {
                "model_type": "gemma4_text",
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "num_kv_shared_layers": 2,
            },
            "layers differ",
        ),
        (
            {"model_type": "gemma3n_text", "num_hidden_layers": 4},
            "num_kv_shared_layers=15 leaves none of its 4 layers",
        ),
        (
            {"model_type": "gemma4_text", "use_bidirectional_attention": "all"},
            "use_bidirectional_attention='all' attends both ways",
        ),
        # Llama 4's rule of Ministral 3, outside Ministral 3 and Mistral 4 (whose query_scaling
        # it gives), and a Ministral 3 config without its beta, which transformers needs
        (
            {"rope_parameters": {"rope_theta": 1e6, "llama_4_scaling_beta": 0.1}},
            "llama_4_scaling_beta, which mha's 'default' rotary",
        ),
        # PhiMoE's longrope multiplies its cosines and sines by its own mscales
        (
            {
                "model_type": "phimoe",
                "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}
                | {"short_factor": [1.0], "long_factor": [2.0]}
                | {"short_mscale": 1.1, "long_mscale": 1.2},
            },
            "long_mscale, short_mscale, which mha's 'longrope' rotary embedding has no",
        ),
        (
            {
                "model_type": "ministral3",
                "rope_parameters": {"rope_theta": 1e6, "original_max_position_embeddings": 64},
            },
            "ministral3's attention scales its queries by their positions",
        ),
        (
            {
                "model_type": "mistral4",
                "rope_parameters": {"rope_theta": 1e4, "llama_4_scaling_beta": -0.1},
            },
            "mistral4's attention scales its queries.*llama_4_scaling_beta': -0.1",
        ),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_config_fields_mha_cannot_represent_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        porting.options_from_config(config)


_GPT2 = {"model_type": "gpt2", "n_head": 4, "n_embd": 16}
_HEADS = {"num_attention_heads": 4, "hidden_size": 16}


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({**_GPT2, "scale_attn_weights": "false"}, "scale_attn_weights"),
        ({**_GPT2, "scale_attn_by_inverse_layer_idx": 0}, "scale_attn_by_inverse_layer_idx"),
        (
            {**_HEADS, "model_type": "qwen2", "sliding_window": 4, "use_sliding_window": "no"},
            "use_sliding_window",
        ),
        ({**_HEADS, "model_type": "glm4_moe", "use_qk_norm": "false"}, "use_qk_norm"),
        ({**_HEADS, "model_type": "stablelm", "qk_layernorm": 1}, "qk_layernorm"),
        (
            {**_HEADS, "model_type": "gemma3_text", "use_bidirectional_attention": "false"},
            "use_bidirectional_attention",
        ),
        (
            {**_HEADS, "model_type": "lfm3", "layer_types": ["full_attention"]}
            | {"use_attention_gate": "false"},
            "use_attention_gate",
        ),
    ],
)
def test_a_flag_that_is_not_true_or_false_is_refused(config, field):
    # "false" as a string is true to Python: read as a flag it would turn the option on
    with pytest.raises(ValueError, match=f"the config's {field}=.* is not true or false"):
        porting.options_from_config(config)


def test_a_null_flag_reads_as_false_as_transformers_reads_it():
    # GPT-2's attention scales its scores `if config.scale_attn_weights`: null leaves them
    # unscaled, as false does; absent, the default (true) scales them by 1 / sqrt(head size)
    assert porting.options_from_config({**_GPT2, "scale_attn_weights": None})["scale"] == 1.0
    assert porting.options_from_config({**_GPT2, "scale_attn_weights": False})["scale"] == 1.0
    assert "scale" not in porting.options_from_config(_GPT2)


def test_lfm3s_gate_of_each_head_ports_as_output_gate():
    # LFM3's g_proj gives each head one gate, sigmoid(x @ g_h), for all of the head's features:
    # output_gate's W_g with each head's row for every feature of the head
    rng = np.random.default_rng(1)
    state = {f"{k}_proj.weight": rng.standard_normal((8, 6)) for k in "qkv"}
    state["o_proj.weight"] = rng.standard_normal((6, 8))
    state["g_proj.weight"] = rng.standard_normal((2, 6))
    with pytest.raises(ValueError, match=r"g_proj.weight \(a gate of each head's output"):
        porting.canonical_from_state_dict(state, num_heads=2)
    port = porting.canonical_from_state_dict(state, num_heads=2, output_gate=True)
    gate = state["g_proj.weight"]
    np.testing.assert_array_equal(port.weights["W_g"][:, :4], np.stack([gate[0]] * 4, axis=1))
    np.testing.assert_array_equal(port.weights["W_g"][:, 4:], np.stack([gate[1]] * 4, axis=1))
    np.testing.assert_array_equal(port.weights["W_q"], state["q_proj.weight"].T)  # not split
    assert port.config["output_gate"] and "g_proj.weight" in port.used
    with pytest.raises(ValueError, match="not one gate row for each of 4 heads"):
        porting.canonical_from_state_dict(state, num_heads=4, output_gate=True)


def test_a_query_projection_with_its_gate_splits_by_hand():
    # Qwen3-Next's q_proj: each head's query rows, then as many gate rows. Two heads of two
    # features: rows 0-1 queries, 2-3 gate of head 0; rows 4-5 queries, 6-7 gate of head 1
    rng = np.random.default_rng(3)
    state = {"q_proj.weight": rng.standard_normal((8, 6))}
    state |= {f"{k}_proj.weight": rng.standard_normal((4, 6)) for k in "kv"}
    state["o_proj.weight"] = rng.standard_normal((6, 4))
    port = porting.canonical_from_state_dict(state, num_heads=2, output_gate=True)
    q = state["q_proj.weight"]
    np.testing.assert_array_equal(port.weights["W_q"], q[[0, 1, 4, 5]].T)
    np.testing.assert_array_equal(port.weights["W_g"], q[[2, 3, 6, 7]].T)
    # Three rows a head: no query and gate of equal size, refused by name
    state["q_proj.weight"] = rng.standard_normal((6, 6))
    with pytest.raises(ValueError, match="not a query and a gate of equal size"):
        porting.canonical_from_state_dict(state, num_heads=2, output_gate=True)


def test_afmoes_gate_of_each_feature_ports_as_output_gate():
    # AFMoE's gate_proj gives each output feature its gate, sigmoid(x @ g_j): output_gate's W_g,
    # the gate projection's rows as its columns
    rng = np.random.default_rng(2)
    state = {f"{k}_proj.weight": rng.standard_normal((8, 6)) for k in "qkv"}
    state["o_proj.weight"] = rng.standard_normal((6, 8))
    state["gate_proj.weight"] = rng.standard_normal((8, 6))
    with pytest.raises(ValueError, match=r"gate_proj.weight \(a gate of each output feature"):
        porting.canonical_from_state_dict(state, num_heads=2)
    port = porting.canonical_from_state_dict(state, num_heads=2, output_gate=True)
    np.testing.assert_array_equal(port.weights["W_g"], state["gate_proj.weight"].T)
    np.testing.assert_array_equal(port.weights["W_q"], state["q_proj.weight"].T)  # not split
    assert port.config["output_gate"] and "gate_proj.weight" in port.used
    # Biases on the projections, none on the gate (LFM3's and AFMoE's attention_bias): a zero
    # b_g, which the port says
    biased = {**state, **{f"{k}_proj.bias": rng.standard_normal(8) for k in "qkv"}}
    biased["o_proj.bias"] = rng.standard_normal(6)
    port = porting.canonical_from_state_dict(biased, num_heads=2, output_gate=True)
    np.testing.assert_array_equal(port.weights["b_g"], np.zeros(8))
    assert "gate_proj has no bias" in " ".join(port.notes)
    state["gate_proj.weight"] = rng.standard_normal((2, 6))
    with pytest.raises(ValueError, match="not one gate row for each of 8 features"):
        porting.canonical_from_state_dict(state, num_heads=2, output_gate=True)


def test_gemma4_layers_whose_values_are_their_keys_port_with_values_from_keys(tmp_path, capsys):
    # Gemma 4's full layers have no v_proj: their values are k_proj's output, before the keys'
    # norm. find_attention lists them; the port copies W_k into W_v where told, and says so
    rng = np.random.default_rng(0)
    state = {
        f"layers.0.attn.{k}_proj.weight": rng.standard_normal((8, 8)).astype("float32")
        for k in "qko"
    }
    assert porting.find_attention(state) == [("layers.0.attn", layouts.KEYS_AS_VALUES)]
    with pytest.raises(ValueError, match=r"without v_proj are .*values_from_keys=True"):
        porting.canonical_from_state_dict(state, "layers.0.attn", num_heads=2)
    port = porting.canonical_from_state_dict(
        state, "layers.0.attn", num_heads=2, values_from_keys=True
    )
    np.testing.assert_array_equal(port.weights["W_v"], state["layers.0.attn.k_proj.weight"].T)
    assert port.weights["W_v"] is not port.weights["W_k"]
    assert "layers.0.attn.v_proj.weight" not in port.used and "v_proj.weight" not in port.used
    assert any("v_proj is k_proj" in note for note in port.notes)
    # A layer with a v_proj of its own is not one
    state["layers.0.attn.v_proj.weight"] = rng.standard_normal((8, 8))
    with pytest.raises(ValueError, match="values_from_keys=True reads the values from k_proj"):
        porting.canonical_from_state_dict(
            state, "layers.0.attn", num_heads=2, values_from_keys=True
        )
    # From the command line: the flag, or the hint that names it
    from safetensors.numpy import save_file

    del state["layers.0.attn.v_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    arguments = ["inspect", str(tmp_path / "model.safetensors"), "--prefix", "layers.0.attn"]
    arguments += ["--num-heads", "2"]
    assert cli.main(arguments) == 1 and "--values-from-keys" in capsys.readouterr().err
    assert cli.main([*arguments, "--values-from-keys"]) == 0
    assert "note: v_proj is k_proj" in capsys.readouterr().out
    # Gemma 4's text attends one way where its images attend both ways
    vision = {"model_type": "gemma4_text", "use_bidirectional_attention": "vision"}
    options = porting.options_from_config({**vision, "layer_types": ["full_attention"]})
    assert options["value_norm"] and options["scale"] == 1.0


# Llama 4 Scout's text config.json as its repository writes it (no layer_types): three
# rotary layers, then one without (no_rope_layers), and Maverick's, without QK-norm
SCOUT = {
    "model_type": "llama4_text",
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "no_rope_layers": [1, 1, 1, 0],
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "use_qk_norm": True,
    "rms_norm_eps": 1e-05,
}


def test_llama4s_layers_read_their_chunks_norms_and_scaling_off_the_config():
    heads = {"num_heads": 40, "head_size": 128, "num_kv_heads": 8}
    rotary = {**heads, "rope_theta": 500000.0, "rope_interleaved": True}
    chunked = {**rotary, "attention_chunk_size": 8192}
    normed = {"qk_norm": "head_after_rotary", "weightless_qk_norm": True, "qk_norm_eps": 1e-05}
    scaled = {"beta": 0.1, "original_max_position_embeddings": 8192, "position_offset": 1}
    assert porting.options_from_config(SCOUT, 0) == {**chunked, **normed}
    assert porting.options_from_config(SCOUT, 3) == {**heads, "query_scaling": scaled}
    maverick = {**SCOUT, "use_qk_norm": False, "attn_temperature_tuning": False}
    assert porting.options_from_config(maverick, 1) == chunked
    assert porting.options_from_config(maverick, 3) == heads
    # layer_types, where written, say which layers are chunked
    written = {**SCOUT, "layer_types": ["full_attention"] * 3 + ["chunked_attention"]}
    assert "attention_chunk_size" not in porting.options_from_config(written, 0)
    assert porting.options_from_config(written, 3)["attention_chunk_size"] == 8192
    with pytest.raises(ValueError, match="layers differ"):
        porting.options_from_config(SCOUT)
    for bad in ({"attn_scale": -0.1}, {"floor_scale": 0}, {"attn_scale": None}):
        with pytest.raises(ValueError, match="by attn_scale and floor_scale: they must be"):
            porting.options_from_config({**SCOUT, **bad}, 3)
    with pytest.raises(ValueError, match="attention_chunk_size=0 is not a positive whole"):
        porting.options_from_config({**SCOUT, "attention_chunk_size": 0}, 0)
    # JSON's 8192.0 is the whole number
    as_float = porting.options_from_config({**SCOUT, "attention_chunk_size": 8192.0}, 0)
    assert as_float == porting.options_from_config(SCOUT, 0)
    with pytest.raises(ValueError, match="'chunked_attention' \\(layer_types,"):
        porting.options_from_config({"layer_types": ["chunked_attention"]}, 0)


def test_llama4s_temperature_tuning_is_a_flag():
    # "false" is true to Python: read so it would scale the queries of Llama 4's layers
    # without a rotary embedding
    with pytest.raises(ValueError, match="attn_temperature_tuning='false' is not true or false"):
        porting.options_from_config({**SCOUT, "attn_temperature_tuning": "false"}, 3)
    assert porting.options_from_config({**SCOUT, "attn_temperature_tuning": None}, 3) == {
        "num_heads": 40,
        "head_size": 128,
        "num_kv_heads": 8,
    }


def test_fields_transformers_does_not_read_leave_the_port_as_it_reads_them():
    # Hunyuan's released configs write use_qk_norm, which its code does not read (the norms
    # are always there); Falcon-H1's key_multiplier needs the head size to become a scale
    hunyuan = {"model_type": "hunyuan_v1_dense", "num_attention_heads": 4, "use_qk_norm": True}
    assert porting.options_from_config(hunyuan)["qk_norm"] == "head_after_rotary"
    falcon = {"model_type": "falcon_h1", "key_multiplier": 0.5}
    with pytest.raises(ValueError, match=r"key_multiplier=0\.5 scales the scores by the head size"):
        porting.options_from_config(falcon)
    sized = porting.options_from_config({**falcon, "num_attention_heads": 4, "head_dim": 16})
    assert sized["scale"] == 0.5 / 4


def test_weightless_qk_norms_port_as_scales_of_one():
    # Llama 4's norms have no weight: ones of the head size, noted; a norm weight beside the
    # projections is then refused by name, and only "head" norms are weightless
    rng = np.random.default_rng(2)
    state = {f"{k}_proj.weight": rng.standard_normal((8, 6)).astype("float32") for k in "qkv"}
    state["o_proj.weight"] = rng.standard_normal((6, 8)).astype("float32")
    given = dict(num_heads=2, qk_norm="head", weightless_qk_norm=True)
    port = porting.canonical_from_state_dict(state, **given)
    for name in ("q_norm", "k_norm"):
        np.testing.assert_array_equal(port.weights[name], np.ones(4, "float32"))
    assert any("have no weight" in note for note in port.notes)
    with pytest.raises(ValueError, match=r"q_norm\.weight"):
        porting.canonical_from_state_dict({**state, "q_norm.weight": np.ones(4)}, **given)
    with pytest.raises(ValueError, match='weightless_qk_norm=True is qk_norm="head"'):
        porting.canonical_from_state_dict(state, **{**given, "qk_norm": "projection"})


def _nanochat_attention(state, x, heads, theta, eps):
    """nanochat's attention written out: each head's (first half, second half) pairs turned
    by minus their angle (its rotate_half gives (x2, -x1)), then normed with no weight."""
    n, d = x.shape[1], state["q_proj.weight"].shape[0] // heads

    def turned_and_normed(name):
        a = x @ state[f"{name}.weight"].T + state[f"{name}.bias"]
        a = a.reshape(x.shape[0], n, heads, d).transpose(0, 2, 1, 3)
        angles = np.arange(n)[:, None] * theta ** (-np.arange(d // 2) * 2.0 / d)
        a1, a2 = a[..., : d // 2], a[..., d // 2 :]
        cos, sin = np.cos(angles), np.sin(angles)
        a = np.concatenate([a1 * cos + a2 * sin, a2 * cos - a1 * sin], axis=-1)
        return a / np.sqrt(np.mean(a**2, axis=-1, keepdims=True) + eps)

    q, k = turned_and_normed("q_proj"), turned_and_normed("k_proj")
    v = (x @ state["v_proj.weight"].T + state["v_proj.bias"]).reshape(x.shape[0], n, heads, d)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    scores = np.where(np.tri(n, dtype=bool), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    output = (weights @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3).reshape(x.shape[0], n, -1)
    return output @ state["o_proj.weight"].T + state["o_proj.bias"]


@pytest.mark.parametrize("name", backend_params())
def test_a_rotary_turned_the_other_way_ports_with_its_halves_swapped(name):
    # nanochat: with reversed_rotary each head's query and key halves are swapped (noted), and
    # mha's layer gives the attention written out
    rng = np.random.default_rng(4)
    state = {f"{k}_proj.weight": rng.standard_normal((8, 6)) for k in "qkv"}
    state["o_proj.weight"] = rng.standard_normal((6, 8))
    state.update(
        {
            f"{k}_proj.bias": rng.standard_normal(s)
            for k, s in zip("qkvo", (8, 8, 8, 6), strict=True)
        }
    )
    x = rng.standard_normal((2, 5, 6))
    options = dict(num_heads=2, rope_theta=100.0, qk_norm="head", qk_norm_eps=1e-3)
    options.update(weightless_qk_norm=True, reversed_rotary=True)
    port = porting.canonical_from_state_dict(state, **options)
    halves = port.weights["W_q"].reshape(6, 2, 2, 2)
    np.testing.assert_array_equal(halves[:, 0, 0], state["q_proj.weight"][2:4].T)
    assert any("halves of query and key features are swapped" in note for note in port.notes)
    module = backend_module(name)
    layer = porting.from_state_dict(state, backend=name, **options)  # float64, as the weights
    output = layer(*[module.from_numpy(x)] * 3, causal=True)
    expected = _nanochat_attention(state, x, 2, 100.0, 1e-3)
    np.testing.assert_allclose(module.to_numpy(output), expected, rtol=1e-10, atol=1e-12)
    # Halves of the whole head, turned as Llama turns them
    for wrong in ({"rope_interleaved": True}, {"rope_dim": 2}, {"rope_theta": None}):
        with pytest.raises(ValueError, match="reversed_rotary=True turns the halves"):
            porting.canonical_from_state_dict(state, **{**options, **wrong})


@pytest.mark.parametrize("name", backend_params())
def test_gpt_neo_ports_unscaled_with_its_local_windows(name):
    # GPT-Neo does not scale its scores, and its local layers attend to the last window_size
    # positions; its projections have BART's names, so only its config tells either
    T = transformers()
    config = T.GPTNeoConfig(
        hidden_size=16,
        num_heads=4,
        num_layers=2,
        attention_types=[[["global", "local"], 1]],
        window_size=3,
        vocab_size=50,
    )
    torch.manual_seed(4)
    model = T.GPTNeoModel(config).double().eval()
    seen = {}
    handles = []
    for i in range(2):
        attention = model.get_submodule(f"h.{i}.attn.attention")
        handles += [
            attention.register_forward_pre_hook(
                lambda m, args, kwargs, i=i: seen.__setitem__((i, "x"), args[0].numpy()),
                with_kwargs=True,
            ),
            attention.out_proj.register_forward_hook(
                lambda m, args, output, i=i: seen.__setitem__((i, "y"), output.numpy())
            ),
        ]
    with torch.no_grad():
        model(input_ids=IDS)
    for handle in handles:
        handle.remove()
    with pytest.raises(ValueError, match="attention_types"):
        porting.options_from_config(config.to_dict())  # which layer: they differ
    module = backend_module(name)
    for i, window in ((0, {}), (1, {"sliding_window": 3})):
        options = porting.options_from_config(config.to_dict(), i)
        # heads of 16 / 4 features (GPT-Neo's hidden_size), a key-value head each
        heads = {"num_heads": 4, "head_size": 4, "num_kv_heads": 4, "query_size": 16}
        assert options == {**heads, "scale": 1.0, **window}
        layer = porting.from_state_dict(
            model.state_dict(), f"h.{i}.attn.attention", backend=name, **options
        )
        x = module.from_numpy(seen[i, "x"])
        output = module.to_numpy(layer(x, x, x, causal=True))
        np.testing.assert_allclose(output, seen[i, "y"], rtol=0, atol=TOLERANCE)


def test_t5_names_with_biases_are_no_layout_mha_knows():
    # MPNet keeps q, k, v and o, with biases, and scales its scores: T5's have no biases
    state = {f"attn.{k}.{p}": np.ones((8, 8) if p == "weight" else 8) for k in "qkvo"
             for p in ("weight", "bias")}  # fmt: skip
    with pytest.raises(ValueError, match="no"):
        porting.canonical_from_state_dict(state, "attn", num_heads=2)
    t5 = {name: value for name, value in state.items() if name.endswith("weight")}
    assert porting.canonical_from_state_dict(t5, "attn", num_heads=2).config["scale"] == 1.0


def test_qwen2_max_window_layers_and_gpt2_scales_per_layer():
    qwen2 = {
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "rope_theta": 1e4,
        "sliding_window": 4,
        "use_sliding_window": True,
        "max_window_layers": 2,
    }
    assert [porting.options_from_config(qwen2, i).get("sliding_window") for i in range(3)] == [
        None,
        None,
        4,
    ]
    gpt2 = {"n_head": 4, "n_embd": 16, "n_layer": 2, "scale_attn_by_inverse_layer_idx": True}
    assert porting.options_from_config(gpt2, 1) == {"num_heads": 4, "scale": 0.5 / 2}


def test_unknown_tensors_under_the_attention_are_refused():
    rng = np.random.default_rng(10)
    state = {f"attn.{k}_proj.weight": rng.standard_normal((8, 8)) for k in "qkvo"}
    state["attn.gate.weight"] = np.ones((4, 8))
    with pytest.raises(ValueError, match=r"attn.*gate\.weight \(a tensor beside"):
        porting.canonical_from_state_dict(state, "attn", num_heads=2)
    # GPT-2's causal buffer `bias` is left out by its whole name: a tensor whose name merely
    # starts with it is no buffer of GPT-2's, and is refused
    gpt2 = {"c_attn.weight": np.ones((8, 24)), "c_proj.weight": np.ones((8, 8))}
    gpt2["bias"] = np.tril(np.ones((1, 1, 4, 4), bool))
    assert porting.canonical_from_state_dict(gpt2, num_heads=2).left_out == ["bias"]
    with pytest.raises(ValueError, match=r"bias_scale \(a tensor beside"):
        porting.canonical_from_state_dict(gpt2 | {"bias_scale": np.ones(8)}, num_heads=2)


def test_a_checkpoints_rotary_frequencies_are_checked():
    # Older Llama checkpoints keep rotary_emb.inv_freq under the attention
    state = {f"{k}_proj.weight": np.eye(8) for k in "qkvo"}
    state["rotary_emb.inv_freq"] = (1 / 500.0 ** (np.arange(0, 4, 2) / 4)).astype("float32")
    port = porting.canonical_from_state_dict(state, num_heads=2, rope_theta=500.0)
    assert "rotary_emb.inv_freq" in port.used and not port.left_out
    with pytest.raises(ValueError, match="give rope_theta"):
        porting.canonical_from_state_dict(state, num_heads=2)
    with pytest.raises(ValueError, match=r"other frequencies than those of rope_theta=10000\.0"):
        porting.canonical_from_state_dict(state, num_heads=2, rope_theta=10000.0)
    # fair-esm's ESM-2 keeps them as rot_emb.inv_freq beside BART's names
    state = {f"{k}_proj.weight": np.eye(8) for k in "qkv"} | {"out_proj.weight": np.eye(8)}
    state["rot_emb.inv_freq"] = (1 / 1e4 ** (np.arange(0, 4, 2) / 4)).astype("float32")
    port = porting.canonical_from_state_dict(state, num_heads=2, rope_theta=1e4)
    assert "rot_emb.inv_freq" in port.used and not port.left_out
    with pytest.raises(ValueError, match=r"rot_emb\.inv_freq.*other frequencies"):
        porting.canonical_from_state_dict(state, num_heads=2, rope_theta=500.0)


def test_convert_takes_the_layer_index_where_layers_differ(tmp_path, capsys):
    from safetensors.numpy import save_file

    # Gemma 3: its layers differ, and its QK-norms scale by 1 + weight
    config, model = _tiny_decoder(
        "gemma3", head_dim=4, sliding_window=3, layer_types=["sliding_attention", "full_attention"]
    )
    save_file(
        {key: value.numpy() for key, value in model.state_dict().items()},
        tmp_path / "model.safetensors",
    )
    config.to_json_file(tmp_path / "config.json")
    arguments = ["--prefix", "layers.1.self_attn", "--config", str(tmp_path / "config.json")]
    source, destination = tmp_path / "model.safetensors", tmp_path / "layer.safetensors"
    # --layer is the prefix's number (1: full attention); another is the other layer's options
    code = cli.main(["convert", str(source), str(destination), *arguments, "--layer", "0"])
    assert code == 2 and "is not the layer of --prefix" in capsys.readouterr().err
    assert not destination.exists()
    for given in ([], ["--layer", "1"]):
        code = cli.main(["convert", str(source), str(destination), *arguments, *given])
        assert code == 0, capsys.readouterr().err
        assert "1 + the source's norm weights" in capsys.readouterr().out
    checkpoint = mha.weights.read_checkpoint(destination)
    assert checkpoint.config["sliding_window"] is None and checkpoint.config["rope_theta"]
    assert checkpoint.config["qk_norm"] == "head"
    norm = model.state_dict()["layers.1.self_attn.q_norm.weight"].numpy()
    np.testing.assert_array_equal(checkpoint.weights["q_norm"], 1 + norm)


# ---------------------------------------------------------------------------------------------
# Layouts that need a few lines by hand elsewhere: Phi-3's fused qkv_proj, DistilBERT's names,
# Whisper's k_proj without a bias


@pytest.mark.parametrize("name", backend_params())
def test_phi3_fused_qkv_proj_with_grouped_heads_ports(name):
    # qkv_proj stacks q's rows, then k's and v's (2 key-value heads of 4); half of each
    # head rotated. transformers computes its rotary angles in float32
    config, model = _tiny_decoder(
        "phi3",
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
    )
    options = porting.options_from_config(config.to_dict(), 0)
    assert options["rope_dim"] == 2
    x, expected = _attention_io(model, torch.randint(3, 50, (2, 7)))[0]
    module = backend_module(name)
    port = porting.canonical_from_state_dict(model.state_dict(), "layers.0.self_attn", **options)
    assert port.layout.startswith("fused qkv_proj") and port.config["num_kv_heads"] == 2
    layer = porting.from_state_dict(
        model.state_dict(), "layers.0.self_attn", backend=name, **options
    )
    output = module.to_numpy(layer(*[module.from_numpy(x)] * 3, causal=True))
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6 * np.max(np.abs(expected)))


def test_a_fused_grouped_qkv_proj_bias_is_cut_as_its_weight():
    # Phi-3's layout (q's rows, then k's and v's: one key-value head of 4 here) with a bias,
    # which Phi-3 has not but such a state may: each projection takes its own rows of both
    rng = np.random.default_rng(0)
    state = {
        "qkv_proj.weight": rng.standard_normal((16, 8)),
        "qkv_proj.bias": rng.standard_normal(16),
        "o_proj.weight": rng.standard_normal((8, 8)),
    }
    port = porting.canonical_from_state_dict(state, num_heads=2, without_positions=True)
    assert port.config["bias"] is True and port.config["num_kv_heads"] == 1
    for name, rows in (("q", slice(0, 8)), ("k", slice(8, 12)), ("v", slice(12, 16))):
        np.testing.assert_array_equal(port.weights[f"W_{name}"], state["qkv_proj.weight"][rows].T)
        np.testing.assert_array_equal(port.weights[f"b_{name}"], state["qkv_proj.bias"][rows])


@pytest.mark.parametrize("name", backend_params())
def test_distilbert_attention_ports_to_every_backend(name):
    T = transformers()
    config = T.DistilBertConfig(vocab_size=50, dim=16, n_heads=4, n_layers=1, hidden_dim=32)
    config._attn_implementation = "sdpa"
    torch.manual_seed(7)
    model = T.DistilBertModel(config).double().eval()
    padding = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    attention = model.transformer.layer[0].attention
    x, y = capture(
        model, attention, attention, input_ids=torch.randint(3, 50, (2, 6)), attention_mask=padding
    )
    module = backend_module(name)
    prefix = "transformer.layer.0.attention"
    layer = porting.from_state_dict(model.state_dict(), prefix, backend=name, num_heads=4)
    X = module.from_numpy(x)
    output = layer(X, X, X, module.from_numpy(np.array([6, 4])))
    np.testing.assert_allclose(module.to_numpy(output), y, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", backend_params())
def test_whisper_k_proj_without_a_bias_takes_a_zero_one(name, capsys):
    T = transformers()
    from transformers.models.whisper.modeling_whisper import WhisperAttention

    config = T.WhisperConfig(d_model=16, encoder_attention_heads=4, decoder_attention_heads=4)
    torch.manual_seed(8)
    attention = WhisperAttention(16, 4, config=config).double().eval()
    state = attention.state_dict()
    assert "k_proj.bias" not in state and "q_proj.bias" in state
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        expected = attention(x)[0].numpy()
    port = porting.canonical_from_state_dict(state, num_heads=4)
    assert port.notes == ("k_proj has no bias: its bias is zero, which gives the same numbers",)
    assert not port.weights["b_k"].any()
    module = backend_module(name)
    layer = porting.from_state_dict(state, backend=name, num_heads=4)
    output = module.to_numpy(layer(*[module.from_numpy(x.numpy())] * 3))
    np.testing.assert_allclose(output, expected, rtol=0, atol=TOLERANCE)


def test_inspect_and_convert_say_which_bias_is_zero(tmp_path, capsys):
    from safetensors.numpy import save_file

    T = transformers()
    from transformers.models.whisper.modeling_whisper import WhisperAttention

    config = T.WhisperConfig(d_model=16, encoder_attention_heads=4, decoder_attention_heads=4)
    attention = WhisperAttention(16, 4, config=config)
    save_file({k: v.numpy() for k, v in attention.state_dict().items()}, tmp_path / "w.safetensors")
    note = "note: k_proj has no bias: its bias is zero, which gives the same numbers"
    source, arguments = str(tmp_path / "w.safetensors"), ["--prefix", "", "--num-heads", "4"]
    assert cli.main(["inspect", source, *arguments]) == 0
    assert note in capsys.readouterr().out
    assert cli.main(["convert", source, str(tmp_path / "l.safetensors"), *arguments]) == 0
    assert note in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# query_key_value and dense: GPT-NeoX's and BLOOM's q, k, v per head, Falcon's per group


def _fused_decoder(Config, Model, seed=11, **fields):
    """A tiny random transformers model with a query_key_value layout, in float64, causal
    with left padding in the second row, and (input, output) of layer 0's attention."""
    torch.manual_seed(seed)
    sizes = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=50)
    config = Config(**sizes, **fields)
    model = Model(config).double().eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # biases of zeros, as transformers starts them, would hide a lost one
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
    block = model.layers[0] if hasattr(model, "layers") else model.h[0]
    attention = getattr(block, "attention", None) or block.self_attention
    padding = torch.tensor([[1] * 7, [0] * 2 + [1] * 5])
    x, y = capture(
        model, attention, attention, input_ids=torch.randint(3, 50, (2, 7)), attention_mask=padding
    )
    return config, model, x, y


def _check_padded_causal(name, state, prefix, options, x, expected):
    """The port, causal with the second row's first 2 keys masked, matches on the rows
    transformers computes from keys (its padded rows' queries see no key)."""
    module = backend_module(name)
    layer = porting.from_state_dict(state, prefix, backend=name, **options)
    mask = np.ones((2, 7, 7), bool)
    mask[1, :, :2] = False
    arguments = [module.from_numpy(x)] * 3
    output = module.to_numpy(layer(*arguments, mask=module.from_numpy(mask), causal=True))
    rows = np.s_[:, 2:]  # rows of queries that see a key in both rows
    atol = 1e-6 * np.max(np.abs(expected[rows]))
    np.testing.assert_allclose(output[rows], expected[rows], rtol=0, atol=atol)


@pytest.mark.parametrize("name", backend_params())
def test_gpt_neox_per_head_query_key_value_and_a_quarter_rotated_ports(name):
    # Each head's q, k and v rows in turn; rotary on the first quarter of each head (of 16
    # features: 4), the half-split rotation; transformers' rotary angles are float32's
    T = transformers()
    config, model, x, y = _fused_decoder(T.GPTNeoXConfig, T.GPTNeoXModel, intermediate_size=64)
    options = porting.options_from_config(config.to_dict(), 0)
    heads = {"num_heads": 4, "head_size": 16, "num_kv_heads": 4, "query_size": 64}  # 64 / 4
    assert options == {**heads, "rope_theta": 10000.0, "rope_dim": 4}
    port = porting.canonical_from_state_dict(model.state_dict(), "layers.0.attention", **options)
    assert port.layout.startswith("fused query_key_value") and port.config["num_kv_heads"] is None
    _check_padded_causal(name, model.state_dict(), "layers.0.attention", options, x, y)


@pytest.mark.parametrize("name", backend_params())
def test_falcon_query_key_value_of_each_kind_ports(name):
    # Multi-query (one key-value head after all query heads), the new architecture's groups
    # (2 key-value heads, each after its 2 query heads), and per head (q, k, v of each head)
    T = transformers()
    kinds = [
        dict(multi_query=True),
        dict(new_decoder_architecture=True, num_kv_heads=2, bias=True),
        dict(multi_query=False),
    ]
    for fields, kv_heads in zip(kinds, [1, 2, 4], strict=True):
        config, model, x, y = _fused_decoder(T.FalconConfig, T.FalconModel, **fields)
        options = porting.options_from_config(config.to_dict(), 0)
        port = porting.canonical_from_state_dict(
            model.state_dict(), "h.0.self_attention", **options
        )
        assert (port.config["num_kv_heads"] or 4) == kv_heads, fields
        _check_padded_causal(name, model.state_dict(), "h.0.self_attention", options, x, y)


def test_falcon_alibi_and_mpt_options_are_refused_and_query_key_value_needs_the_heads():
    # Falcon scales ALiBi's biases with the scores
    T = transformers()
    with pytest.raises(ValueError, match=r"alibi=True adds ALiBi's position biases"):
        porting.options_from_config(T.FalconConfig(alibi=True, num_hidden_layers=1).to_dict())
    # What transformers' MPT does not do as its config says, or mha's layer cannot
    for field, value in [("alibi", False), ("alibi_bias_max", 4), ("clip_qkv", 6.0)]:
        config = T.MptConfig(n_layers=1, attn_config={field: value}).to_dict()
        with pytest.raises(ValueError, match=rf"attn_config\['{field}'\]={value!r}"):
            porting.options_from_config(config)
    # BLOOM's slices of the output projection, summed without its bias
    bloom = T.BloomConfig(n_layer=1, pretraining_tp=2, slow_but_exact=True).to_dict()
    with pytest.raises(ValueError, match=r"slow_but_exact=True with pretraining_tp=2 leaves"):
        porting.options_from_config(bloom)
    assert porting.options_from_config({**bloom, "slow_but_exact": False})["alibi"]
    # ChatGLM (remote code) names its block-ordered q, k and v query_key_value too
    chatglm = {"model_type": "chatglm", "num_attention_heads": 4, "rope_ratio": 1.0}
    with pytest.raises(ValueError, match=r"model_type='chatglm' keeps q, k and v in blocks"):
        porting.options_from_config(chatglm)
    # GPT-BigCode's Linear c_attn under GPT-2's Conv1D names: multi-query, or q, k, v per head
    for multi_query in (True, False):
        bigcode = T.GPTBigCodeConfig(n_layer=1, multi_query=multi_query).to_dict()
        with pytest.raises(ValueError, match=r"'gpt_bigcode' keeps q, k and v in a Linear"):
            porting.options_from_config(bigcode)
    torch.manual_seed(0)
    sizes = dict(hidden_size=16, num_attention_heads=4, intermediate_size=16, vocab_size=50)
    state = T.GPTNeoXModel(T.GPTNeoXConfig(num_hidden_layers=1, **sizes)).state_dict()
    with pytest.raises(ValueError, match=r"query_key_value's rows follows the heads: give num"):
        porting.canonical_from_state_dict(state, "layers.0.attention")
    with pytest.raises(ValueError, match=r"48 outputs: with 3 heads of the output projection's"):
        porting.canonical_from_state_dict(state, "layers.0.attention", num_heads=3)


def test_falcon_alibi_bias_is_transformers_own_bit_for_bit():
    # bfloat16 slopes times bfloat16 positions (from each row's first token), rounded again;
    # 12 heads, whose odd slopes are not powers of 2, and positions past 256 that bfloat16
    # cannot all hold
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    padding = np.ones((2, 300), np.int64)
    padding[1, :3] = 0
    for dtype in ("float32", "float64"):
        expected = build_alibi_tensor(torch.tensor(padding), 12, getattr(torch, dtype))
        expected = (expected.reshape(2, 12, 1, 300) / math.sqrt(4)).numpy()
        bias = porting.falcon_alibi_bias(12, 300, head_size=4, attention_mask=padding, dtype=dtype)
        assert bias.dtype == dtype
        np.testing.assert_array_equal(bias, expected)
    unpadded = porting.falcon_alibi_bias(12, 300, head_size=4)
    np.testing.assert_array_equal(
        unpadded[0], porting.falcon_alibi_bias(12, 300, head_size=4, attention_mask=padding)[0]
    )
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, num_keys=300\)"):
        porting.falcon_alibi_bias(12, 300, head_size=4, attention_mask=padding[:, 1:])


@pytest.mark.parametrize("name", backend_params())
def test_falcon_with_alibi_ports_with_its_bias_at_each_call(name):
    # Falcon-RW's attention: its config is refused (ALiBi scaled with the scores), and the
    # port without positions given falcon_alibi_bias at the call is transformers' module;
    # alibi_bias / sqrt(head size), unrounded, is not
    T = transformers()
    torch.manual_seed(2)
    config = T.FalconConfig(
        hidden_size=48, num_attention_heads=12, num_hidden_layers=1, vocab_size=50, alibi=True
    )
    config._attn_implementation = "eager"
    model = T.FalconModel(config).double().eval()
    attention = model.h[0].self_attention
    with torch.no_grad():  # scores of a spread the biases' roundings show beside
        for parameter in attention.parameters():
            parameter.normal_(0.0, 0.5)
    padding = np.ones((2, 300), np.int64)
    padding[1, :3] = 0
    ids = torch.randint(3, 50, (2, 300))
    x, y = capture(model, attention, attention, input_ids=ids, attention_mask=torch.tensor(padding))
    module = backend_module(name)
    layer = porting.from_state_dict(
        model.state_dict(), "h.0.self_attention", num_heads=12, without_positions=True, backend=name
    )
    mask = module.from_numpy(np.broadcast_to(padding[:, None].astype(bool), (2, 300, 300)).copy())
    rows = np.s_[:, 3:]  # the padded row's first queries see no key (NaN in transformers')
    atol = 1e-6 * np.max(np.abs(y[rows]))
    for bias, agrees in [
        (
            porting.falcon_alibi_bias(
                12, 300, head_size=4, attention_mask=padding, dtype="float64"
            ),
            True,
        ),
        (porting.alibi_bias(12, 300, 300, dtype="float64") / math.sqrt(4), False),
    ]:
        call = {"mask": mask, "causal": True, "attn_bias": module.from_numpy(bias)}
        output = module.to_numpy(layer(*[module.from_numpy(x)] * 3, **call))
        assert bool(np.max(np.abs(output - y)[rows]) <= atol) is agrees


def test_a_layout_whose_models_all_add_positions_needs_them_told(tmp_path, capsys):
    # GPT-NeoX, Falcon and BLOOM (query_key_value), MPT (Wqkv) and Phi-3 (qkv_proj) add
    # rotary embeddings or ALiBi that their weights do not hold: with num_heads alone the
    # port would compute other numbers than the model
    eye = np.eye(8)
    states = {
        "query_key_value": {"query_key_value.weight": np.eye(24, 8), "dense.weight": eye},
        "Wqkv": {"Wqkv.weight": np.eye(24, 8), "out_proj.weight": eye},
        "qkv_proj": {"qkv_proj.weight": np.eye(24, 8), "o_proj.weight": eye},
    }
    for name, state in states.items():
        with pytest.raises(ValueError, match=r"add .* inside the attention, which the weights"):
            porting.canonical_from_state_dict(state, num_heads=2)
        port = porting.canonical_from_state_dict(state, num_heads=2, without_positions=True)
        assert port.config["rope_theta"] is None and not port.config["alibi"], name
        told = porting.canonical_from_state_dict(state, num_heads=2, rope_theta=100.0)
        assert told.config["rope_theta"] == 100.0
        with pytest.raises(ValueError, match=r"without_positions=True and alibi=True contra"):
            porting.canonical_from_state_dict(state, num_heads=2, alibi=True, without_positions=1)
    # Llama's names are ViT's too in transformers 5: only the config tells
    llama = {f"{k}_proj.weight": eye for k in "qkvo"}
    assert porting.canonical_from_state_dict(llama, num_heads=2).config["rope_theta"] is None
    # From the command line: exit 1 naming the remedy, or the option
    from safetensors.numpy import save_file

    source = tmp_path / "model.safetensors"
    save_file({f"h.0.{k}": v for k, v in states["Wqkv"].items()}, source)
    arguments = ["convert", str(source), str(tmp_path / "layer.safetensors"), "--prefix", "h.0"]
    assert cli.main([*arguments, "--num-heads", "2"]) == 1
    assert "--without-positions" in capsys.readouterr().err
    assert not (tmp_path / "layer.safetensors").exists()
    assert cli.main([*arguments, "--num-heads", "2", "--without-positions"]) == 0
    assert cli.main(["inspect", str(source), "--without-positions"]) == 2
    assert "--without-positions goes with --prefix" in capsys.readouterr().err


@pytest.mark.parametrize("name", backend_params())
def test_bloom_and_mpt_port_in_one_line_and_with_alibi_bias(name):
    # BLOOM's query_key_value per head and MPT's Wqkv blocks, 6 heads (not a power of 2, where
    # the slopes' order matters); causal with left padding. Ported from the config (the alibi
    # option), and with num_heads alone and ALiBi's biases given at the call
    T = transformers()
    torch.manual_seed(12)
    sizes = dict(vocab_size=50, n_layer=1)
    models = [
        (T.BloomModel(T.BloomConfig(hidden_size=48, n_head=6, **sizes)), "h.0.self_attention"),
        (T.MptModel(T.MptConfig(d_model=48, n_heads=6, **sizes)), "blocks.0.attn"),
    ]
    module = backend_module(name)
    for model, prefix in models:
        model = model.double().eval()
        options = porting.options_from_config(model.config.to_dict())
        heads = {"num_heads": 6, "head_size": 8, "num_kv_heads": 6, "query_size": 48}  # 48 / 6
        assert options == {**heads, "alibi": True}
        x, expected = _alibi_layer_call(model, prefix)
        mask = np.ones((2, 7, 7), bool)
        mask[1, :, :2] = False
        bias = module.from_numpy(porting.alibi_bias(6, 7, 7, dtype="float64"))
        ports = {
            "config": ({**options}, {}),
            "attn_bias": ({"num_heads": 6, "without_positions": True}, {"attn_bias": bias}),
        }
        for way, (port_options, extra) in ports.items():
            state = model.state_dict()
            layer = porting.from_state_dict(state, prefix, backend=name, **port_options)
            arguments = [module.from_numpy(x)] * 3
            output = layer(*arguments, mask=module.from_numpy(mask), causal=True, **extra)
            rows = np.s_[:, 2:]
            atol = 1e-6 * np.max(np.abs(expected[rows]))
            np.testing.assert_allclose(
                module.to_numpy(output)[rows], expected[rows], atol=atol, err_msg=way
            )


def _alibi_layer_call(model, prefix):
    """The attention's input and output (less BLOOM's residual) in a padded call."""
    attention = model.get_submodule(prefix)
    seen = {}

    def take(module, args, kwargs):
        seen.update(x=args[0], residual=args[1:2])

    attention.register_forward_pre_hook(take, with_kwargs=True)
    padding = torch.tensor([[1] * 7, [0] * 2 + [1] * 5])
    ids = torch.randint(3, 50, (2, 7))
    _, y = capture(model, attention, attention, input_ids=ids, attention_mask=padding)
    residual = seen["residual"][0].numpy() if seen["residual"] else 0.0  # BLOOM adds it
    return seen["x"].numpy(), y - residual


def test_alibi_slopes_by_hand_and_bad_sizes():
    # 8 heads: slopes 1/2, 1/4, ..., 1/256; 2 queries, the last 2 of 3 positions
    assert porting.alibi_bias(8, 2, 3).dtype == np.float32  # the layers' default dtype
    bias = porting.alibi_bias(8, 2, 3, dtype="float64")
    assert bias.shape == (1, 8, 2, 3)
    np.testing.assert_array_equal(bias[0, 0], [[-0.5, 0.0, 0.5], [-1.0, -0.5, 0.0]])
    np.testing.assert_array_equal(bias[0, :, 0, 0], -(2.0 ** -np.arange(1, 9)))
    # 3 heads: of 4's slopes 1/4, 1/16, 1/64, 1/256 the even k first, then the odd ones
    expected = [-1 / 16, -1 / 256, -1 / 4]
    np.testing.assert_array_equal(
        porting.alibi_bias(3, 1, 2, dtype="float64")[0, :, 0, 0], expected
    )
    for sizes in [(0, 1, 1), (2, 3, 2), (2, 1.0, 1)]:
        with pytest.raises(ValueError, match=r"must be"):
            porting.alibi_bias(*sizes)


@pytest.mark.parametrize("name", backend_params())
def test_alibi_bias_under_a_kv_cache_gives_the_full_calls_numbers(name):
    # Each step's queries are the last positions of the keys so far: alibi_bias(H, q, keys)
    module, reference = backend_module(name), backend_module("numpy")
    config = dict(num_hiddens=8, num_heads=4, query_size=6, key_size=6, value_size=6)
    weights = mha.random_weights("MultiHeadAttention", seed=3, dtype="float64", **config)
    layer = module.MultiHeadAttention(**config, dtype="float64")
    full = reference.MultiHeadAttention(**config, dtype="float64")
    mha.set_weights(layer, weights)
    mha.set_weights(full, weights)
    X = np.random.default_rng(5).standard_normal((2, 7, 6))
    expected = full(X, X, X, causal=True, attn_bias=porting.alibi_bias(4, 7, 7, dtype="float64"))
    cache, outputs = mha.KVCache(), []
    for start, stop in ((0, 3), (3, 4), (4, 7)):
        x = module.from_numpy(X[:, start:stop])
        bias = module.from_numpy(porting.alibi_bias(4, stop - start, stop, dtype="float64"))
        output, cache = layer(x, x, x, causal=True, attn_bias=bias, cache=cache)
        outputs.append(module.to_numpy(output))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", backend_params())
def test_keras_kernels_with_key_and_value_inputs_of_different_sizes_port(name):
    # Keras's layer takes (query, value, key): inputs of sizes 6, 5 and 7 here, so that a
    # size read off the wrong kernel is seen
    keras = backend_module("tensorflow").keras
    source = keras.layers.MultiHeadAttention(2, 3, dtype="float64")
    rng = np.random.default_rng(11)
    q, v, k = (rng.standard_normal(shape) for shape in [(2, 4, 6), (2, 5, 5), (2, 5, 7)])
    expected = np.asarray(source(q, v, key=k))
    state = {variable.path: variable.numpy() for variable in source.weights}
    port = porting.canonical_from_state_dict(state, source.name)
    assert port.layout == "Keras MultiHeadAttention"
    sizes = (port.config["query_size"], port.config["key_size"], port.config["value_size"])
    assert sizes == (6, 7, 5)
    module = backend_module(name)
    layer = porting.from_state_dict(state, source.name, backend=name)
    output = module.to_numpy(layer(*(module.from_numpy(a) for a in (q, k, v))))
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6)


def test_convert_with_a_config_keeps_its_score_scale(tmp_path, capsys):
    # Gemma 2 scales by query_pre_attn_scalar ** -0.5 (1/8 here), not head_dim ** -0.5 (1/2):
    # `mha convert --config` keeps it, and the layer computes what transformers' layer does
    from safetensors.numpy import save_file

    config, model = _tiny_decoder(
        "gemma2",
        head_dim=4,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
    )
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # scores of order 1 or more, which the scale changes
        for block in model.layers:
            block.self_attn.q_proj.weight.mul_(10)
            block.self_attn.k_proj.weight.mul_(10)
    assert model.layers[1].self_attn.scaling == 64**-0.5
    x, expected = _attention_io(model, torch.randint(3, 50, (2, 7)))[1]
    state = {key: value.numpy() for key, value in model.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    config.to_json_file(tmp_path / "config.json")
    destination = tmp_path / "layer.safetensors"
    arguments = ["convert", str(tmp_path / "model.safetensors"), str(destination)]
    arguments += ["--prefix", "layers.1.self_attn", "--config", str(tmp_path / "config.json")]
    code = cli.main([*arguments, "--layer", "1"])
    assert code == 0, capsys.readouterr()
    layer = mha.load(destination, backend="numpy")
    assert layer.scale == 64**-0.5
    output = layer(x, x, x, causal=True)
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-6 * np.max(np.abs(expected)))


def test_float32_rotary_frequencies_of_a_nearby_theta_are_refused():
    # Worked from the formula 1 / theta ** (2i / d): with d = 8, theta 10100's frequencies
    # differ from 10000's by up to 1 - 1.01 ** -0.75 = 0.75%, far beyond float32's rounding
    # (6e-8). A float32 checkpoint's are held to that rounding, not to half precision's 1%
    state = {f"{k}_proj.weight": np.eye(16) for k in "qkvo"}
    frequencies = 1 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    state["rotary_emb.inv_freq"] = frequencies.astype("float32")
    port = porting.canonical_from_state_dict(state, num_heads=2, rope_theta=10000.0)
    assert "rotary_emb.inv_freq" in port.used
    nearby = 1 / 10100.0 ** (np.arange(0, 8, 2) / 8)
    assert 5e-3 < np.max(np.abs(nearby / frequencies - 1)) < 1e-2
    with pytest.raises(ValueError, match=r"other frequencies than those of rope_theta=10100\.0"):
        porting.canonical_from_state_dict(state, num_heads=2, rope_theta=10100.0)
    # Those of 4 of each head's 8 features (rope_dim=4) are other frequencies too
    state["rotary_emb.inv_freq"] = (1 / 10000.0 ** (np.arange(0, 4, 2) / 4)).astype("float32")
    with pytest.raises(ValueError, match=r"other frequencies than those of rope_theta=10000\.0"):
        porting.canonical_from_state_dict(state, num_heads=2, rope_theta=10000.0)


@pytest.mark.tensorflow
def test_a_head_count_other_than_the_kernels_is_refused():
    # Keras's kernels per head tell their heads (3 here): num_heads=3 agrees with them, and
    # num_heads=2 contradicts them, an error rather than one of the two silently winning
    keras = backend_module("tensorflow").keras
    source = keras.layers.MultiHeadAttention(3, 4, dtype="float64")
    x = np.random.default_rng(7).standard_normal((2, 5, 10))
    source(x, x)
    state = {variable.path: variable.numpy() for variable in source.weights}
    assert state[f"{source.name}/query/kernel"].shape == (10, 3, 4)
    port = porting.canonical_from_state_dict(state, source.name, num_heads=3)
    assert port.config["num_heads"] == 3
    with pytest.raises(ValueError, match=r"have 3 heads\. Received: num_heads=2"):
        porting.canonical_from_state_dict(state, source.name, num_heads=2)


def test_from_state_dict_takes_values_from_keys():
    # Gemma 4's full layers hold no v_proj: with values_from_keys the built layer computes as
    # the same layer ported from weights whose v_proj is a copy of k_proj
    rng = np.random.default_rng(5)
    state = {f"{k}_proj.weight": rng.standard_normal((8, 8)) for k in "qko"}
    with_values = {**state, "v_proj.weight": state["k_proj.weight"].copy()}
    layer = porting.from_state_dict(state, num_heads=2, values_from_keys=True, backend="numpy")
    same = porting.from_state_dict(with_values, num_heads=2, backend="numpy")
    x = rng.standard_normal((2, 5, 8))
    np.testing.assert_array_equal(layer(x, x, x, None), same(x, x, x, None))
    other = porting.from_state_dict(
        {**state, "v_proj.weight": state["q_proj.weight"]}, num_heads=2, backend="numpy"
    )
    assert not np.allclose(other(x, x, x, None), same(x, x, x, None))
