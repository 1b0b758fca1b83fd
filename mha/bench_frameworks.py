"""Each framework's calls that `mha bench` times: mha's MultiHeadAttention and the
framework's own attention layer, holding the same weights (see mha/bench.py for what is timed
and how). A backend is benchmarked through its entry in BENCHES.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mha.registry import load_backend

__all__ = ["BENCHES", "DTYPES", "PASSES", "ROOFLINE", "ROOFLINE_SIZE", "Bench", "Calls", "Config"]

PASSES = ("forward", "forward+backward")
DTYPES = ("float32", "bfloat16", "float16")
ROOFLINE, ROOFLINE_SIZE = "matmul roofline", 1024

Calls = dict[str, dict[str, Callable[[], Any]]]  # {pass: {"mha": call, built-in: call, ...}}


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmarked call: self-attention on X (batch_size, length, num_hiddens)."""

    batch_size: int
    length: int
    num_hiddens: int
    num_heads: int
    valid_lens: bool
    need_weights: bool
    dtype: str = "float32"
    device: str = "cpu"  # or "gpu": torch's "cuda", TensorFlow's "/GPU:0"
    num_kv_heads: int | None = None  # grouped-query attention
    # Decoding: positions in a KV cache before the call, whose `length` queries attend to them
    # and to themselves
    cached: int = 0

    @property
    def shape(self) -> str:
        kv = "" if self.num_kv_heads is None else f", kv {self.num_kv_heads}"
        kv += f", cache {self.cached}" if self.cached else ""
        return f"({self.batch_size}, {self.length}, {self.num_hiddens}, {self.num_heads}{kv})"

    def forward_flops(self) -> float:
        """2 x the multiply-adds of the four projections of the call's positions and the two
        attention products over every key (the cached ones too)."""
        b, n, d = self.batch_size, self.length, self.num_hiddens
        kv = d // self.num_heads * (self.num_kv_heads or self.num_heads)
        keys = n + self.cached
        return 2.0 * (2 * b * n * d * d + 2 * b * n * d * kv + 2 * b * n * keys * d)


# ---------------------------------------------------------------------------------------------
# The layers and calls of each backend


def _inputs(config: Config, seed: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((config.batch_size, config.length, config.num_hiddens), "float32")
    if not config.valid_lens:
        return X, None
    # Between half the keys and all of them (the cached ones too): every row keeps some
    keys = config.length + config.cached
    return X, rng.integers(max(1, keys // 2), keys + 1, config.batch_size).astype("int64")


def _weights(config: Config, seed: int = 0) -> dict[str, np.ndarray]:
    from mha import random_weights

    d, h = config.num_hiddens, config.num_heads
    sizes = dict(num_hiddens=d, num_heads=h, query_size=d, key_size=d, value_size=d)
    sizes["num_kv_heads"] = config.num_kv_heads
    return random_weights("MultiHeadAttention", **sizes, seed=seed, dtype=config.dtype)


def _mha_layer(backend: str, config: Config):
    import mha

    d, module = config.num_hiddens, load_backend(backend)
    sizes = dict(query_size=d, key_size=d, value_size=d, dtype=config.dtype)
    layer = module.MultiHeadAttention(
        d, config.num_heads, num_kv_heads=config.num_kv_heads, **sizes
    )
    mha.set_weights(layer, _weights(config))
    return layer


def _passes(layers: dict, forward: Callable, backward: Callable) -> Calls:
    """{pass: {name: call}} from {name: (run, layer)} and each pass's `how(run, layer)`."""
    return {
        name: {key: functools.partial(how, *run_layer) for key, run_layer in layers.items()}
        for name, how in (("forward", forward), ("forward+backward", backward))
    }


def _numpy_calls(config: Config, mode: str) -> Calls:
    ours = _mha_layer("numpy", config)
    X, valid_lens = _inputs(config)
    a, b = np.random.default_rng(0).standard_normal((2, ROOFLINE_SIZE, ROOFLINE_SIZE), "float32")
    run_ours = functools.partial(ours, X, X, X, valid_lens, need_weights=config.need_weights)
    return {"forward": {"mha": run_ours, ROOFLINE: functools.partial(np.matmul, a, b)}}


def _torch_calls(config: Config, mode: str) -> Calls:
    import torch

    device = "cuda" if config.device == "gpu" else "cpu"
    X_np, lens_np = _inputs(config)
    X = torch.from_numpy(X_np).to(device, getattr(torch, config.dtype))
    valid_lens = None if lens_np is None else torch.from_numpy(lens_np).to(device)
    ours = _mha_layer("torch", config).to(device).eval()
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

    calls = _passes(layers, forward, backward) if layers else {}
    return {"forward": calls["forward"]} if config.cached else calls  # decoding: inference


def _torch_decoding_layers(config: Config, ours, X, valid_lens) -> dict:
    """One decoding step: the call's positions after `config.cached` cached ones. mha's layer
    with its KVCache; the SDPA layer on the same weights with the same cache (its projections,
    the new keys and values appended, F.scaled_dot_product_attention); nn.MultiheadAttention,
    which has no cache, on every position's keys and values, as its users call it."""
    import torch
    import torch.nn.functional as F

    import mha

    b, n, d, h = config.batch_size, config.length, config.num_hiddens, config.num_heads
    kv, keys = config.num_kv_heads or h, n + config.cached
    rng = np.random.default_rng(1)
    before = rng.standard_normal((b, config.cached, d), "float32")
    before = torch.from_numpy(before).to(X.device, X.dtype)
    with torch.no_grad():
        _, cache = ours(before, before, before, cache=mha.KVCache())
    everything = torch.cat([before, X], dim=1)
    keep = (
        None if valid_lens is None else (torch.arange(keys, device=X.device) < valid_lens[:, None])
    )

    def run_ours():
        return ours(X, X, X, valid_lens, need_weights=config.need_weights, cache=cache)[0]

    def run_sdpa():
        q = ours.W_q(X).view(b, n, h, d // h).transpose(1, 2)
        k, v = (w(X).view(b, n, kv, d // h).transpose(1, 2) for w in (ours.W_k, ours.W_v))
        k, v = torch.cat([cache.keys, k], dim=2), torch.cat([cache.values, v], dim=2)
        mask = None if keep is None else keep[:, None, None, :]
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv != h)
        return ours.W_o(output.transpose(1, 2).reshape(b, n, d))

    layers = {"mha": (run_ours, ours)}
    if not config.need_weights:  # SDPA cannot return the weights
        layers["SDPA layer with the cache"] = (run_sdpa, ours)
    if kv == h:
        theirs = mha.interop.to_torch(ours, batch_first=True).to(X.device).eval()
        options = {"need_weights": config.need_weights, "average_attn_weights": False}
        padding = None if keep is None else ~keep
        layers["nn.MultiheadAttention (no cache)"] = (
            lambda: theirs(X, everything, everything, key_padding_mask=padding, **options)[0],
            theirs,
        )
    return layers


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
    """Grouped-query attention: torch has no such layer, so the built-in is the SDPA layer
    with enable_gqa on mha's weights (nn.Linear layers holding them); it returns no weights,
    so there are rows without need_weights only (none: an empty dict)."""
    import torch
    import torch.nn.functional as F

    if config.need_weights:
        return {}
    b, n, d, h = config.batch_size, config.length, config.num_hiddens, config.num_heads
    kv = config.num_kv_heads
    theirs = torch.nn.ModuleDict({name: getattr(ours, name) for name in ("W_q", "W_k", "W_v")})
    theirs["W_o"] = ours.W_o

    def run_sdpa():
        keep = None
        if valid_lens is not None:
            keep = (torch.arange(n, device=X.device) < valid_lens[:, None])[:, None, None, :]
        q = theirs["W_q"](X).view(b, n, h, d // h).transpose(1, 2)
        k, v = (theirs[w](X).view(b, n, kv, d // h).transpose(1, 2) for w in ("W_k", "W_v"))
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        return theirs["W_o"](output.transpose(1, 2).reshape(b, n, d))

    return {"mha": (run_ours, ours), "SDPA layer (enable_gqa)": (run_sdpa, theirs)}


def _tensorflow_calls(config: Config, mode: str) -> Calls:
    import mha

    tf = load_backend("tensorflow").tf
    # Every variable, constant and op on one device: TensorFlow would pick a GPU by itself
    device, n = "/GPU:0" if config.device == "gpu" else "/CPU:0", config.length
    X_np, lens_np = _inputs(config)
    with tf.device(device):
        X = tf.constant(X_np, dtype=config.dtype)
        valid_lens = None if lens_np is None else tf.constant(lens_np)
        ours = _mha_layer("tensorflow", config)
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
    return _passes(layers, forward, backward)


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

    X_np, lens_np = _inputs(config)
    X = mx.np.array(X_np, dtype="float32")
    valid_lens = None if lens_np is None else mx.np.array(lens_np, dtype="int64")
    ours = _mha_layer("mxnet", config)
    # Hybridized, the book's block hands out weights only as a second output
    returns_weights = config.need_weights and mode == "hybridized"
    theirs = _d2l_gluon_attention(mx, config.num_hiddens, config.num_heads, returns_weights)
    weights = _weights(config)
    for name in "qkvo":
        getattr(theirs, f"W_{name}").weight.set_data(mx.np.array(weights[f"W_{name}"].T))
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
    return _passes(layers, forward, backward)


def _jax_calls(config: Config, mode: str) -> Calls:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    ours, theirs, X, valid_lens = _jax_layers_and_inputs(config)
    n = config.length

    def keep(lens):  # Flax's mask (True = attend), made inside the call as mha makes its own
        return None if lens is None else (jnp.arange(n) < lens[:, None])[:, None, None, :]

    # Each call returns (output, what else leaves it): the weights leave both layers' calls,
    # mha's as the layer's state, Flax's sown ones popped and returned
    def call_ours(layer, X, lens):
        return layer(X, X, X, lens, need_weights=config.need_weights), None

    def call_theirs(layer, X, lens):
        output = layer(X, X, X, mask=keep(lens), sow_weights=config.need_weights)
        return output, nnx.pop(layer, nnx.Intermediate)

    def call_dpa(layer, X, lens):  # Flax's weights on jax.nn.dot_product_attention
        q, k, v = (getattr(layer, p)(X) for p in ("query", "key", "value"))
        output = jax.nn.dot_product_attention(q, k, v, mask=keep(lens))
        return layer.out(output), None

    def summed(result):
        output, taken = result
        return output.sum(), taken

    layers = {"mha": (call_ours, ours), "nnx.MultiHeadAttention": (call_theirs, theirs)}
    if not config.need_weights:  # dot_product_attention cannot return the weights
        layers["dot_product_attention layer"] = (call_dpa, theirs)
    if not config.need_weights and _cudnn_runs(_call_cudnn, theirs, X, valid_lens):
        layers["cuDNN dot_product_attention layer"] = (_call_cudnn, theirs)
    # Jitted on both sides; a timed call ends when its results are ready
    forwards = {name: nnx.jit(call) for name, (call, _) in layers.items()}
    backwards = {
        name: nnx.jit(
            nnx.grad(
                lambda layer, X, lens, call=call: summed(call(layer, X, lens)),
                argnums=(0, 1),
                has_aux=True,
            )
        )
        for name, (call, _) in layers.items()
    }
    names = {id(call): name for name, (call, _) in layers.items()}

    def forward(call, layer):
        return jax.block_until_ready(forwards[names[id(call)]](layer, X, valid_lens))[0]

    def backward(call, layer):
        return jax.block_until_ready(backwards[names[id(call)]](layer, X, valid_lens))

    return _passes(layers, forward, backward)


def _call_cudnn(layer, X, lens):
    """Flax's weights on cuDNN's fused kernel, lengths as it takes them."""
    import jax

    q, k, v = (getattr(layer, p)(X) for p in ("query", "key", "value"))
    output = jax.nn.dot_product_attention(
        q, k, v, query_seq_lengths=lens, key_value_seq_lengths=lens, implementation="cudnn"
    )
    return layer.out(output), None


def _cudnn_runs(call, layer, X, valid_lens) -> bool:
    """Whether JAX's cuDNN attention takes the call here (a GPU, float16 or bfloat16, a head
    size and sequence it supports); JAX raises when it does not."""
    import jax
    from flax import nnx

    if X.dtype not in ("float16", "bfloat16") or all(d.platform != "gpu" for d in X.devices()):
        return False
    try:
        jax.block_until_ready(nnx.jit(call)(layer, X, valid_lens))
    except Exception:  # not taken: no row
        return False
    return True


def _jax_layers_and_inputs(config: Config):
    """mha's layer, Flax's with the same weights, X and valid_lens, all committed to the device
    asked for: the jitted calls run where their arguments are, whatever JAX's default device."""
    import jax.numpy as jnp

    import mha

    to_device = load_backend("jax").ADAPTER.to_device
    X_np, lens_np = _inputs(config)
    X = to_device(jnp.asarray(X_np, config.dtype), config.device)
    valid_lens = None if lens_np is None else to_device(lens_np.astype("int32"), config.device)
    ours = _mha_layer("jax", config)
    theirs = mha.interop.to_flax(ours)
    for layer in (ours, theirs):
        layer.eval()
        to_device(layer, config.device)
    return ours, theirs, X, valid_lens


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


BENCHES = {
    "numpy": Bench(_numpy_calls, ("reference",), ("forward",)),
    "torch": Bench(_torch_calls, dtypes=DTYPES, gpu=_torch_sees_gpu, decoding=True),
    "tensorflow": Bench(_tensorflow_calls, dtypes=DTYPES, gpu=_tensorflow_sees_gpu),
    # MXNet 1.9: float16 on GPU only; neither the book nor Gluon has grouped-query attention
    "mxnet": Bench(_mxnet_calls, ("imperative", "hybridized"), grouped=lambda: False),
    "jax": Bench(
        _jax_calls, ("jit",), dtypes=DTYPES, gpu=_jax_sees_gpu, grouped=_flax_has_num_kv_heads
    ),
}
