"""mha: the attention building blocks of Dive into Deep Learning, in every framework.

`import mha` imports no framework. The layer classes resolve on the current backend when
they are looked up, so `mha.MultiHeadAttention` is a `torch.nn.Module` under the torch
backend, a Keras layer under tensorflow, a Gluon block under mxnet, and a plain Python
class under numpy (the default):

    >>> import mha
    >>> with mha.use_backend("numpy"):
    ...     attention = mha.MultiHeadAttention(num_hiddens=8, num_heads=2)

`from mha import MultiHeadAttention` binds the class of the backend current at that moment.
"""

from __future__ import annotations

from typing import Any

# Imports no framework: mha.interop, conversion, porting and golden import frameworks inside
# their functions.
from mha import conversion, golden, interop, porting
from mha.cache import KVCache
from mha.config import get_backend, set_backend, use_backend
from mha.registry import (
    PUBLIC_NAMES,
    BackendUnavailableError,
    available_backends,
    load_backend,
)
from mha.weights import (
    get_weights,
    load,
    load_weights,
    random_weights,
    save,
    save_weights,
    set_weights,
)

__version__ = "0.1.0"

__all__ = [
    "AddNorm",
    "AdditiveAttention",
    "BackendUnavailableError",
    "DotProductAttention",
    "KVCache",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "PositionalEncoding",
    "RotaryEmbedding",
    "available_backends",
    "conversion",
    "from_numpy",
    "get_backend",
    "get_weights",
    "golden",
    "interop",
    "load",
    "load_weights",
    "masked_softmax",
    "porting",
    "random_weights",
    "save",
    "save_weights",
    "set_backend",
    "set_weights",
    "to_numpy",
    "use_backend",
]


def __getattr__(name: str) -> Any:
    # Layer classes and functions resolve on the backend current at access time.
    if name in PUBLIC_NAMES:
        return getattr(load_backend(get_backend()), name)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
