"""What every framework's benchmark shares: the configuration of a timed call (Config), its
inputs and weights, mha's layer holding them, and the passes a bench times
(mha/bench_frameworks.py and mha/bench_jax.py build each framework's calls from them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from mha.registry import load_backend

__all__ = ["DTYPES", "PASSES", "Calls", "Config", "inputs", "mha_layer", "passes", "weights"]

PASSES = ("forward", "forward+backward")
DTYPES = ("float32", "bfloat16", "float16")

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


def inputs(config: Config, seed: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """X and, if the config has them, valid_lens, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((config.batch_size, config.length, config.num_hiddens), "float32")
    if not config.valid_lens:
        return X, None
    # Between half the keys and all of them (the cached ones too): every row keeps some
    keys = config.length + config.cached
    return X, rng.integers(max(1, keys // 2), keys + 1, config.batch_size).astype("int64")


def weights(config: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """mha's canonical weights of the config's layer, drawn from `seed`."""
    from mha import random_weights

    d, h = config.num_hiddens, config.num_heads
    sizes = dict(num_hiddens=d, num_heads=h, query_size=d, key_size=d, value_size=d)
    sizes["num_kv_heads"] = config.num_kv_heads
    return random_weights("MultiHeadAttention", **sizes, seed=seed, dtype=config.dtype)


def mha_layer(backend: str, config: Config):
    """mha's MultiHeadAttention of `backend` holding `weights(config)`."""
    import mha

    d, module = config.num_hiddens, load_backend(backend)
    sizes = dict(query_size=d, key_size=d, value_size=d, dtype=config.dtype)
    layer = module.MultiHeadAttention(
        d, config.num_heads, num_kv_heads=config.num_kv_heads, **sizes
    )
    mha.set_weights(layer, weights(config))
    return layer


def passes(layers: dict, forward: Callable, backward: Callable) -> Calls:
    """{pass: {name: call}} from {name: (run, layer)} and each pass's `how(run, layer)`."""
    return {
        name: {key: functools.partial(how, *run_layer) for key, run_layer in layers.items()}
        for name, how in (("forward", forward), ("forward+backward", backward))
    }
