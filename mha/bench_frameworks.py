"""Each framework's calls that `mha bench` times: mha's MultiHeadAttention and the
framework's own attention layer, holding the same weights (see mha/bench.py for what is timed
and how; mha/bench_config.py for what the frameworks share, mha/bench_jax.py for JAX's
calls). A backend is benchmarked through its entry in BENCHES.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np

from mha.bench_config import DTYPES, PASSES, Calls, Config, inputs, mha_layer, passes, weights
from mha.bench_jax import jax_calls
from mha.registry import load_backend

__all__ = ["BENCHES", "DTYPES", "PASSES", "ROOFLINE", "ROOFLINE_SIZE", "Bench", "Calls", "Config"]

ROOFLINE, ROOFLINE_SIZE = "matmul roofline", 1024
# A decoding row's layer without a cache: it projects every position in each call, more work
# than mha's step, so its rows stay out of the summary's ranges
NO_CACHE = "nn.MultiheadAttention (no cache)"
EAGER = "transformers eager attention (repeat_kv)"  # torch's grouped built-in with weights


# ---------------------------------------------------------------------------------------------
# The layers and calls of each backend


def _numpy_calls(config: Config, mode: str) -> Calls:
    ours = mha_layer("numpy", config)
    X, valid_lens = inputs(config)
    a, b = np.random.default_rng(0).standard_normal((2, ROOFLINE_SIZE, ROOFLINE_SIZE), "float32")
    run_ours = functools.partial(ours, X, X, X, valid_lens, need_weights=config.need_weights)
    return {"forward": {"mha": run_ours, ROOFLINE: functools.partial(np.matmul, a, b)}}


def _torch_calls(config: Config, mode: str) -> Calls:
    import torch

    device = "cuda" if config.device == "gpu" else "cpu"
    X_np, lens_np = inputs(config)
    X = torch.from_numpy(X_np).to(device, getattr(torch, config.dtype))
    valid_lens = None if lens_np is None else torch.from_numpy(lens_np).to(device)
    ours = mha_layer("torch", config).to(device).eval()
    run_ours = functools.partial(ours, X, X, X, valid_lens, need_weights=config.need_weights)
    if config.cached:
        layers = _torch_decoding_layers(config, ours, X, valid_lens)
        run_ours = layers["mha"][0]
    elif config.num_kv_heads is not None:
        layers = _torch_grouped_layers(config, ours, run_ours, X, valid_lens)
    else:
        layers = _torch_layers(config, ours, run_ours, X, valid_lens)
    # A GPU runs asynchronously: a timed call ends when the device has finished its work
    synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None

    def forward(run, layer):
        with torch.no_grad():
            output = run()
        synchronize()
        return output

    def backward(run, layer):
        X.requires_grad_(True)
        gradients = torch.autograd.grad(run().sum(), [X, *layer.parameters()])
        X.requires_grad_(False)
        synchronize()
        return gradients

    calls = passes(layers, forward, backward) if layers else {}
    return {"forward": calls["forward"]} if config.cached else calls  # decoding: inference


def _torch_decoding_layers(config: Config, ours, X, valid_lens) -> dict:
    """One decoding step: the call's positions after `config.cached` cached ones, causal (each
    attends to the cached ones, itself and the new ones before it). mha's layer with its
    KVCache; the SDPA layer on the same weights with the same cache (its projections, the new
    keys and values appended, F.scaled_dot_product_attention), or with weights transformers'
    eager attention with the cache; nn.MultiheadAttention, which has no cache, on every
    position's keys and values, as its users call it."""
    import torch
    import torch.nn.functional as F

    import mha

    b, n, d, h = config.batch_size, config.length, config.num_hiddens, config.num_heads
    kv = config.num_kv_heads or h
    rng = np.random.default_rng(1)
    before = rng.standard_normal((b, config.cached, d), "float32")
    before = torch.from_numpy(before).to(X.device, X.dtype)
    with torch.no_grad():
        _, cache = ours(before, before, before, cache=mha.KVCache())
    everything = torch.cat([before, X], dim=1)

    keep, later = _decoding_masks(config, X, valid_lens)

    def heads_keep():  # (batch_size or 1, 1, n or 1, keys): the lengths and the causal mask
        allowed = None if valid_lens is None else keep()[:, None, None, :]
        if n > 1:
            allowed = ~later() if allowed is None else allowed & ~later()
        return allowed

    def run_ours():
        options = {"need_weights": config.need_weights, "causal": True, "cache": cache}
        return ours(X, X, X, valid_lens, **options)[0]

    def run_sdpa():
        q, k, v = _heads(ours, X, cache)
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=heads_keep(), enable_gqa=kv != h)
        return ours.W_o(output.transpose(1, 2).reshape(b, n, d))

    layers = {"mha": (run_ours, ours)}
    if not config.need_weights:  # SDPA cannot return the weights
        layers["SDPA layer with the cache"] = (run_sdpa, ours)
    elif (eager := _transformers_eager(ours, X, heads_keep, cache)) is not None:
        layers["transformers eager attention with the cache"] = (eager, ours)
    if kv == h:
        theirs = mha.interop.to_torch(ours, batch_first=True).to(X.device).eval()
        options = {"need_weights": config.need_weights, "average_attn_weights": False}
        held = {}  # weights the built-in returns are kept until its next call, as mha keeps its own

        def run_theirs():
            padding = None if valid_lens is None else ~keep()
            output, held["weights"] = theirs(
                X, everything, everything, key_padding_mask=padding, attn_mask=later(), **options
            )
            return output

        layers[NO_CACHE] = (run_theirs, theirs)
    return layers


def _decoding_masks(config: Config, X, valid_lens) -> tuple[Callable, Callable]:
    """A decoding step's masks, made in each call as mha makes its own: keep(), (batch_size,
    keys), True = a key within the length (None without lengths), and later(), (n, keys),
    True = a key after its query (None for one query, which has none)."""
    import torch

    keys = config.cached + config.length

    def keep():
        if valid_lens is not None:
            return torch.arange(keys, device=X.device) < valid_lens[:, None]

    def later():
        if config.length > 1:
            positions = torch.arange(keys, device=X.device)
            return positions > positions[config.cached :, None]

    return keep, later


def _torch_layers(config: Config, ours, run_ours, X, valid_lens) -> dict:
    """mha's layer and torch's: nn.MultiheadAttention holding the same weights, and without
    need_weights the SDPA layer on its weights."""
    import torch
    import torch.nn.functional as F

    import mha

    b, n, d, h = config.batch_size, config.length, config.num_hiddens, config.num_heads
    theirs = mha.interop.to_torch(ours, batch_first=True).to(X.device).eval()

    def ignored():  # key_padding_mask, made inside the call as mha makes its own: True = ignore
        return (
            None if valid_lens is None else torch.arange(n, device=X.device) >= valid_lens[:, None]
        )

    held = {}  # weights a built-in returns are kept until its next call, as mha keeps its own
    options = {"need_weights": config.need_weights, "average_attn_weights": False}

    def run_theirs():
        output, held["weights"] = theirs(X, X, X, key_padding_mask=ignored(), **options)
        return output

    def run_sdpa():  # nn.MultiheadAttention's weights, packed, on F.scaled_dot_product_attention
        keep = None if valid_lens is None else ~ignored()[:, None, None, :]
        qkv = F.linear(X, theirs.in_proj_weight).view(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
        output = F.scaled_dot_product_attention(*qkv, attn_mask=keep)
        return F.linear(output.transpose(1, 2).reshape(b, n, d), theirs.out_proj.weight)

    layers = {"mha": (run_ours, ours), "nn.MultiheadAttention": (run_theirs, theirs)}
    if not config.need_weights:  # SDPA cannot return the weights
        layers["SDPA layer"] = (run_sdpa, theirs)
    return layers


def _torch_grouped_layers(config: Config, ours, run_ours, X, valid_lens) -> dict:
    """Grouped-query attention: torch has no such layer, so the built-ins are the SDPA layer
    with enable_gqa on mha's weights (nn.Linear layers holding them), which returns no weights,
    and with weights transformers' eager attention (Llama's, repeat_kv) where it is installed
    (neither: an empty dict)."""
    import torch
    import torch.nn.functional as F

    b, n, d = config.batch_size, config.length, config.num_hiddens
    # mha's own projections, whose gradients the built-ins' backward passes take
    theirs = torch.nn.ModuleDict({name: getattr(ours, name) for name in ("W_q", "W_k", "W_v")})
    theirs["W_o"] = ours.W_o

    def keep():  # made inside the call, as mha makes its own: True = attend
        if valid_lens is None:
            return None
        return (torch.arange(n, device=X.device) < valid_lens[:, None])[:, None, None, :]

    def run_sdpa():
        q, k, v = _heads(ours, X)
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=keep(), enable_gqa=True)
        return ours.W_o(output.transpose(1, 2).reshape(b, n, d))

    if not config.need_weights:
        return {"mha": (run_ours, ours), "SDPA layer (enable_gqa)": (run_sdpa, theirs)}
    eager = _transformers_eager(ours, X, keep)
    return {} if eager is None else {"mha": (run_ours, ours), EAGER: (eager, theirs)}


def _transformers_eager(ours, X, keep: Callable, cache=None) -> Callable | None:
    """A call of transformers' eager attention (Llama's eager_attention_forward: each
    key-value head repeated for its query heads, softmax in float32) on mha's projections of
    X, after the cached keys and values if given, its additive mask made from `keep()` inside
    the call; it keeps the weights it returns, as mha does. None without transformers."""
    try:
        from transformers.models.llama.modeling_llama import eager_attention_forward
    except ImportError:
        return None
    import types

    import torch

    (b, n, d), h, held = X.shape, ours.num_heads, {}
    module = types.SimpleNamespace(
        num_key_value_groups=h // (ours.num_kv_heads or h), training=False
    )

    def run():
        q, k, v = _heads(ours, X, cache)
        mask = keep()
        if mask is not None:  # transformers' additive mask: the dtype's least value at a masked key
            mask = torch.zeros(mask.shape, dtype=X.dtype, device=X.device).masked_fill(
                ~mask, torch.finfo(X.dtype).min
            )
        output, held["weights"] = eager_attention_forward(module, q, k, v, mask, (d // h) ** -0.5)
        return ours.W_o(output.reshape(b, n, d))

    return run


def _heads(ours, X, cache=None):
    """mha's projections of X split into heads, (batch_size, heads, n, head size), the keys
    and values after the cached ones if a cache is given."""
    import torch

    (b, n, d), h = X.shape, ours.num_heads
    kv = ours.num_kv_heads or h
    q = ours.W_q(X).view(b, n, h, d // h).transpose(1, 2)
    k, v = (w(X).view(b, n, kv, d // h).transpose(1, 2) for w in (ours.W_k, ours.W_v))
    if cache is not None:
        k, v = torch.cat([cache.keys, k], dim=2), torch.cat([cache.values, v], dim=2)
    return q, k, v


def _tensorflow_calls(config: Config, mode: str) -> Calls:
    import mha

    tf = load_backend("tensorflow").tf
    # Every variable, constant and op on one device: TensorFlow would pick a GPU by itself
    device, n = "/GPU:0" if config.device == "gpu" else "/CPU:0", config.length
    X_np, lens_np = inputs(config)
    with tf.device(device):
        X = tf.constant(X_np, dtype=config.dtype)
        valid_lens = None if lens_np is None else tf.constant(lens_np)
        ours = mha_layer("tensorflow", config)
        theirs = mha.interop.to_keras(ours)

    def attention_mask():  # (batch_size, queries, keys), made inside the call: True = attend
        if valid_lens is None:
            return None
        keep = tf.range(n)[None, :] < tf.cast(valid_lens, tf.int32)[:, None]
        return tf.tile(keep[:, None, :], [1, n, 1])

    held = {}  # weights the built-in returns are kept until its next call, as mha keeps its own

    def run_ours(training=False):
        return ours(X, X, X, valid_lens, need_weights=config.need_weights, training=training)

    def run_theirs(training=False):
        options = {"return_attention_scores": config.need_weights, "training": training}
        outputs = theirs(X, X, attention_mask=attention_mask(), **options)
        if not config.need_weights:
            return outputs
        output, held["weights"] = outputs
        return output

    # Reading the results to the host (.numpy()) also waits for a GPU to finish the call
    def forward(run, layer):
        with tf.device(device):
            return run().numpy()

    def backward(run, layer):
        with tf.device(device), tf.GradientTape() as tape:
            tape.watch(X)
            loss = tf.reduce_sum(run(training=True))
        return [g.numpy() for g in tape.gradient(loss, [X, *layer.trainable_variables])]

    layers = {"mha": (run_ours, ours), f"keras {type(theirs).__name__}": (run_theirs, theirs)}
    return passes(layers, forward, backward)


def _d2l_gluon_attention(mx, num_hiddens: int, num_heads: int, return_weights: bool = False):
    """The book's Gluon MultiHeadAttention and DotProductAttention (d2l, "Multi-Head
    Attention") in one HybridBlock. valid_lens is d2l's 2-D (batch_size, queries) int32, for
    MXNet's fused npx.softmax(..., use_length=True). `return_weights` also returns the weights,
    (batch_size * num_heads, queries, keys): the one way a hybridized block hands them out."""
    from mxnet.gluon import nn

    def dense():
        return nn.Dense(num_hiddens, use_bias=False, flatten=False, in_units=num_hiddens)

    def transpose_qkv(F, X):  # (b, n, num_hiddens) -> (b * num_heads, n, head size)
        X = F.np.transpose(F.npx.reshape(X, (-2, -2, num_heads, -1)), (0, 2, 1, 3))
        return F.npx.reshape(X, (-5, -2, -2))

    def transpose_output(F, X):  # the reverse of transpose_qkv
        X = F.np.transpose(F.npx.reshape(X, (-6, -1, num_heads, -2, -2)), (0, 2, 1, 3))
        return F.npx.reshape(X, (-2, -2, -1))

    @mx.util.use_np
    class MultiHeadAttention(nn.HybridBlock):
        def __init__(self):
            super().__init__()
            self.W_q, self.W_k, self.W_v, self.W_o = dense(), dense(), dense(), dense()

        def hybrid_forward(self, F, queries, keys, values, valid_lens=None):
            queries = transpose_qkv(F, self.W_q(queries))
            keys, values = transpose_qkv(F, self.W_k(keys)), transpose_qkv(F, self.W_v(values))
            scale = math.sqrt(num_hiddens // num_heads)
            scores = F.npx.batch_dot(queries, keys, transpose_b=True) / scale
            if valid_lens is None:
                weights = F.npx.softmax(scores)
            else:  # each example's lengths once per head
                lengths = F.np.repeat(valid_lens, num_heads, axis=0)
                weights = F.npx.softmax(scores, lengths, use_length=True)
            self.attention_weights = weights
            output = self.W_o(transpose_output(F, F.npx.batch_dot(weights, values)))
            return (output, weights) if return_weights else output

    block = MultiHeadAttention()
    block.initialize()
    return block


def _mxnet_calls(config: Config, mode: str) -> Calls:
    mx = load_backend("mxnet").mx
    from mxnet import autograd

    X_np, lens_np = inputs(config)
    X = mx.np.array(X_np, dtype="float32")
    valid_lens = None if lens_np is None else mx.np.array(lens_np, dtype="int64")
    ours = mha_layer("mxnet", config)
    # Hybridized, the book's block hands out weights only as a second output
    returns_weights = config.need_weights and mode == "hybridized"
    theirs = _d2l_gluon_attention(mx, config.num_hiddens, config.num_heads, returns_weights)
    canonical = weights(config)
    for name in "qkvo":
        getattr(theirs, f"W_{name}").weight.set_data(mx.np.array(canonical[f"W_{name}"].T))
    their_lens = None  # d2l's 2-D valid_lens: (batch_size, no. of queries)
    if lens_np is not None:
        their_lens = mx.np.array(np.repeat(lens_np[:, None], config.length, 1), dtype="int32")
    if mode == "hybridized":
        ours.hybridize()
        theirs.hybridize()
    held = {}  # weights the block returns are kept until its next call, as mha keeps its own

    def run_theirs():
        if not returns_weights:
            return theirs(X, X, X, their_lens)
        output, held["weights"] = theirs(X, X, X, their_lens)
        return output

    # MXNet's engine is asynchronous: each call waits for all it pushed, its frees included
    def forward(run, layer):
        output = run()
        mx.nd.waitall()
        return output

    def backward(run, layer):
        X.attach_grad()
        with autograd.record(train_mode=False):
            output = run()
        output.backward()
        mx.nd.waitall()
        return [X.grad, *(p.grad() for p in layer.collect_params().values())]

    run_ours = functools.partial(ours, X, X, X, valid_lens, need_weights=config.need_weights)
    layers = {"mha": (run_ours, ours), "d2l Gluon MultiHeadAttention": (run_theirs, theirs)}
    return passes(layers, forward, backward)


def _jax_sees_gpu() -> bool:
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend
        return False


def _flax_has_num_kv_heads() -> bool:
    import inspect

    from flax import nnx

    return "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters


def _torch_sees_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _tensorflow_sees_gpu() -> bool:
    return bool(load_backend("tensorflow").tf.config.list_physical_devices("GPU"))


@dataclasses.dataclass(frozen=True)
class Bench:
    """How `mha bench` times a backend: `calls(config, mode)` gives each pass's calls, mha's
    as "mha", for each mode; `gpu` tells whether a GPU is visible (None: the CPU only)."""

    calls: Callable[[Config, str], Calls]
    modes: tuple[str, ...] = ("eager",)
    passes: tuple[str, ...] = PASSES
    dtypes: tuple[str, ...] = ("float32",)
    gpu: Callable[[], bool] | None = None
    # Whether the framework has a grouped-query attention layer to time against
    grouped: Callable[[], bool] = lambda: True
    decoding: bool = False  # whether it has rows of one decoding step (Config.cached)
    # The dtypes timed on a GPU only, and why
    gpu_only: tuple[tuple[str, ...], str] = ((), "")


BENCHES = {
    "numpy": Bench(_numpy_calls, ("reference",), ("forward",)),
    "torch": Bench(_torch_calls, dtypes=DTYPES, gpu=_torch_sees_gpu, decoding=True),
    "tensorflow": Bench(_tensorflow_calls, dtypes=DTYPES, gpu=_tensorflow_sees_gpu),
    # MXNet 1.9: float16 on GPU only; neither the book nor Gluon has grouped-query attention
    "mxnet": Bench(_mxnet_calls, ("imperative", "hybridized"), grouped=lambda: False),
    "jax": Bench(
        jax_calls,
        ("jit",),
        dtypes=DTYPES,
        gpu=_jax_sees_gpu,
        grouped=_flax_has_num_kv_heads,
        decoding=True,
        gpu_only=(
            ("float16",),
            "Flax's attention asks for a float16 product accumulated in float32, which XLA's "
            "CPU does not compute",
        ),
    ),
}
