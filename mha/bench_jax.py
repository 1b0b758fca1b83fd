"""JAX's calls that `mha bench` times: mha's MultiHeadAttention and Flax's own attention
layers holding the same weights, every call under nnx.jit (see mha/bench.py for what is timed
and how, and mha/bench_frameworks.py for the other frameworks').
"""

from __future__ import annotations

import numpy as np

from mha.bench_config import Calls, Config, inputs, mha_layer, passes
from mha.registry import load_backend

__all__ = ["jax_calls"]


def jax_calls(config: Config, mode: str) -> Calls:
    """JAX's calls of `config` in `mode` (jit), for mha.bench_frameworks.BENCHES."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if config.cached:
        return _jax_decoding_calls(config)
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

    return passes(layers, forward, backward)


def _jax_decoding_calls(config: Config) -> Calls:
    """One decoding step after `config.cached` positions, causal, forward only: mha's layer
    with its KVCache; Flax's layer with its own cache (decode=True) holding the same positions;
    and without weights the dot_product_attention layer with the cache (Flax's projections of
    the new positions, their keys and values appended to the cached ones,
    jax.nn.dot_product_attention)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import mha

    ours, theirs, X, valid_lens = _jax_layers_and_inputs(config)
    to_device, cached = load_backend("jax").ADAPTER.to_device, config.cached
    before = np.random.default_rng(1).standard_normal(
        (config.batch_size, cached, config.num_hiddens), "float32"
    )
    before = to_device(jnp.asarray(before, config.dtype), config.device)
    cache = ours(before, before, before, cache=mha.KVCache())[1]
    keys, values = theirs.key(before), theirs.value(before)  # (b, cached, kv, head size)

    def keep(lens):  # Flax's mask over every key (True = attend), made inside the call
        positions = jnp.arange(cached + config.length)
        # causal: each query attends to the keys up to its own position
        if config.length > 1:  # (1, 1, n, keys)
            allowed = (positions <= positions[cached:, None])[None, None]
        else:
            allowed = None
        if lens is None:
            return allowed
        within = (positions < lens[:, None])[:, None, None, :]
        return within if allowed is None else within & allowed

    def call_ours(layer, X, lens, cache):
        options = {"need_weights": config.need_weights, "causal": True, "cache": cache}
        return layer(X, X, X, lens, **options)[0], None

    def call_theirs(layer, X, lens, cache):
        layer.cache_index[...] = jnp.asarray(cached, jnp.int32)  # the same step every call
        output = layer(X, mask=keep(lens), decode=True, sow_weights=config.need_weights)
        return output, nnx.pop(layer, nnx.Intermediate)

    def call_dpa(layer, X, lens, cache):
        q, k, v = (getattr(layer, p)(X) for p in ("query", "key", "value"))
        k, v = jnp.concatenate([cache[0], k], axis=1), jnp.concatenate([cache[1], v], axis=1)
        return layer.out(jax.nn.dot_product_attention(q, k, v, mask=keep(lens))), None

    layers = {"mha": (call_ours, ours, cache)}
    if config.length == 1:  # Flax's cache takes one position a call
        flax_layer = _flax_layer_with_cache(config, ours, keys, values)
        layers["nnx.MultiHeadAttention with its cache"] = (call_theirs, flax_layer, None)
    if not config.need_weights:  # dot_product_attention cannot return the weights
        layers["dot_product_attention layer with the cache"] = (call_dpa, theirs, (keys, values))

    def timed(call, layer, extra):  # jitted; a timed call ends when its results are ready
        call = nnx.jit(call)
        return lambda: jax.block_until_ready(call(layer, X, valid_lens, extra))[0]

    return {"forward": {name: timed(*layer) for name, layer in layers.items()}}


def _flax_layer_with_cache(config: Config, ours, keys, values):
    """Flax's layer holding mha's weights, its decoding cache holding `keys` and `values`
    (batch_size, cached, kv heads, head size) and room for one position more."""
    import mha

    layer = mha.interop.to_flax(ours)
    layer.eval()
    cached = keys.shape[1]
    layer.init_cache((config.batch_size, cached + 1, config.num_hiddens), keys.dtype)
    for name, projected in (("cached_key", keys), ("cached_value", values)):
        variable = getattr(layer, name)
        variable[...] = variable[...].at[:, :cached].set(projected)
    load_backend("jax").ADAPTER.to_device(layer, config.device)
    return layer


def _call_cudnn(layer, X, lens, implementation="cudnn"):
    """Flax's weights on cuDNN's fused kernel, lengths as it takes them: the keys' only, every
    query computed, as mha computes them (another `implementation` checks the numbers)."""
    import jax
    import jax.numpy as jnp

    q, k, v = (getattr(layer, p)(X) for p in ("query", "key", "value"))
    every_query = None if lens is None else jnp.full_like(lens, X.shape[1])
    output = jax.nn.dot_product_attention(
        q,
        k,
        v,
        query_seq_lengths=every_query,
        key_value_seq_lengths=lens,
        implementation=implementation,
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
    X_np, lens_np = inputs(config)
    X = to_device(jnp.asarray(X_np, config.dtype), config.device)
    valid_lens = None if lens_np is None else to_device(lens_np.astype("int32"), config.device)
    ours = mha_layer("jax", config)
    theirs = mha.interop.to_flax(ours)
    for layer in (ours, theirs):
        layer.eval()
        to_device(layer, config.device)
    return ours, theirs, X, valid_lens
