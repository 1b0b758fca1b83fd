"""mha: the attention building blocks of Dive into Deep Learning, in every framework.

`import mha` imports no framework. The layer classes resolve on the current backend when
they are looked up, so `mha.MultiHeadAttention` is a `torch.nn.Module` under the torch
backend, a Keras layer under tensorflow, a Gluon block under mxnet, and a plain Python
class under numpy (the default):

    >>> import mha
    >>> with mha.use_backend("numpy"):
    ...     attention = mha.MultiHeadAttention(num_hiddens=8, num_heads=2)

`from mha import MultiHeadAttention` binds the class of the backend current at that moment.

`import mha` imports only what backend selection needs. The weight functions (`mha.save`,
`mha.set_weights`, ...) and the modules `mha.conversion`, `mha.golden`, `mha.interop` and
`mha.porting` are imported when first looked up, and are then the same objects as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mha.cache import KVCache, LatentCache
from mha.config import get_backend, set_backend, use_backend
from mha.registry import (
    PUBLIC_NAMES,
    BackendUnavailableError,
    available_backends,
    load_backend,
)

if TYPE_CHECKING:  # the names __getattr__ imports at their first use
    from mha import conversion, golden, interop, porting
    from mha.checkpoints import load, load_weights, save, save_weights
    from mha.weights import get_weights, random_weights, set_weights

__version__ = "0.1.0"

__all__ = [
    "AddNorm",
    "AdditiveAttention",
    "BackendUnavailableError",
    "DotProductAttention",
    "KVCache",
    "LatentCache",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PositionalEncoding",
    "RotaryEmbedding",
    "available_backends",
    "conversion",
    "dot_product_attention",
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


# Imported at their first use (PEP 562): the functions of mha.weights and mha.checkpoints
# (which import numpy), each once, and any module of the package, `mha.golden` or
# `mha.harness`, say, which `import mha` used to import at once; dir() lists those as it did
# then. Function -> the module that defines it.
_WEIGHT_FUNCTIONS = {
    "get_weights": "weights",
    "load": "checkpoints",
    "load_weights": "checkpoints",
    "random_weights": "weights",
    "save": "checkpoints",
    "save_weights": "checkpoints",
    "set_weights": "weights",
}
_MODULES = (
    "conversion",
    "files",
    "golden",
    "harness",
    "interop",
    "masks",
    "options",
    "porting",
    "validation",
    "weights",
)


def __getattr__(name: str) -> Any:
    # Layer classes and functions resolve on the backend current at access time.
    if name in PUBLIC_NAMES:
        return getattr(load_backend(get_backend()), name)
    if name in _WEIGHT_FUNCTIONS:
        import importlib

        module = importlib.import_module(f"mha.{_WEIGHT_FUNCTIONS[name]}")
        globals()[name] = getattr(module, name)  # found without __getattr__ from now on
        return globals()[name]
    if name.isidentifier() and not name.startswith("_"):
        import importlib.util

        if importlib.util.find_spec(f"mha.{name}") is not None:
            return importlib.import_module(f"mha.{name}")  # which binds it here as mha.<name>
    raise AttributeError(f"module 'mha' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The names `import mha` showed when it imported these modules at once: every lazy name,
    # imported yet or not, and no private helper
    shown = {name for name in globals() if name.startswith("__") or not name.startswith("_")}
    return sorted((shown - {"TYPE_CHECKING"}) | set(__all__) | set(_MODULES))
