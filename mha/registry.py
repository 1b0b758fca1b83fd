"""Backend names, their modules, and lazy loading.

Nothing here imports a framework until a backend is asked for by name.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = [
    "ALIASES",
    "BACKENDS",
    "PUBLIC_NAMES",
    "BackendUnavailableError",
    "available_backends",
    "backend_of",
    "framework_version",
    "load_backend",
    "load_triton_before_tensorflow",
    "normalize_backend_name",
    "select_backends",
]

# Backend name -> module that implements it.
BACKENDS: dict[str, str] = {
    "numpy": "mha.backends.numpy",
    "torch": "mha.backends.torch",
    "tensorflow": "mha.backends.tensorflow",
    "mxnet": "mha.backends.mxnet",
    "jax": "mha.backends.jax",
}

ALIASES: dict[str, str] = {"pytorch": "torch", "tf": "tensorflow"}

# Backend name -> the pip command that installs its framework (numpy needs none) as mha's
# extra of that name requires it (pyproject.toml): the framework itself, since mha comes from
# its folder or wheel, which no package index holds
INSTALL: dict[str, str | None] = {
    "numpy": None,
    "torch": 'pip install "torch>=2.7"',
    "tensorflow": 'pip install "tensorflow>=2.16" "keras>=3.15" (or "tensorflow-cpu>=2.16", the '
    "CPU-only build)",
    "mxnet": 'pip install "mxnet==1.9.1" "numpy<2", in an environment of its own: numpy < 2 '
    "breaks the packages that need numpy 2 (JAX among them)",
    "jax": 'pip install "jax>=0.7.1" "flax>=0.12"',
}

# Backend name -> the framework's import name, for versions and messages.
FRAMEWORKS: dict[str, str] = {
    "numpy": "numpy",
    "torch": "torch",
    "tensorflow": "tensorflow",
    "mxnet": "mxnet",
    "jax": "jax",
}

# The names every backend module exports, with the same signatures.
PUBLIC_NAMES: tuple[str, ...] = (
    "masked_softmax",
    "dot_product_attention",
    "DotProductAttention",
    "AdditiveAttention",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "PositionalEncoding",
    "LearnedPositionalEncoding",
    "RotaryEmbedding",
    "AddNorm",
    "to_numpy",
    "from_numpy",
)


class BackendUnavailableError(ImportError):
    """A backend was selected whose framework is missing or fails to import.

    The message names the backend, the cause, and the pip command that installs it.
    """

    def __init__(self, backend: str, cause: BaseException | str):
        self.backend = backend
        self.cause = cause
        command = INSTALL.get(backend)
        hint = f" Install it with: {command}" if command else ""
        reason = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause
        super().__init__(f"The mha backend '{backend}' is not available ({reason}).{hint}")


def normalize_backend_name(name: str) -> str:
    """Return the canonical backend name for `name` (aliases, any case).

    Raises:
        TypeError: `name` is not a string.
        ValueError: `name` is not a known backend; the message lists the valid names.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string. Received: backend={name!r}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in BACKENDS:
        valid = ", ".join([*BACKENDS, *ALIASES])
        raise ValueError(f"Unknown mha backend. Valid names: {valid}. Received: backend={name!r}")
    return key


def load_triton_before_tensorflow() -> None:
    """Load triton's compiler library (torch's compiler on Linux), where it is installed,
    while TensorFlow is not imported yet. Each carries its own LLVM, and triton loaded after
    TensorFlow ends the process the first time torch compiles or makes an optimizer: a
    segmentation fault, or LLVM's "registered more than once" (TensorFlow 2.21 with triton
    3.7.1 and 3.9.0). Once TensorFlow is imported nothing is done: loading triton then is the
    crash itself."""
    if "tensorflow" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    try:
        importlib.import_module("triton._C.libtriton")
    except Exception:  # a broken triton is torch's to report when it compiles
        pass


_loaded: dict[str, types.ModuleType] = {}
_failures: dict[str, BackendUnavailableError] = {}


def load_backend(name: str) -> types.ModuleType:
    """Import and return the module of backend `name`.

    Raises:
        BackendUnavailableError: its framework is missing or broken.
    """
    key = normalize_backend_name(name)
    if key in _loaded:
        return _loaded[key]
    if key in _failures:
        raise _failures[key]
    try:
        module = importlib.import_module(BACKENDS[key])
    except ImportError as error:
        failure = BackendUnavailableError(key, error)
        failure.__cause__ = error
    except Exception as error:  # a broken installation can fail in any way at import
        failure = BackendUnavailableError(key, error)
        failure.__cause__ = error
    else:
        _loaded[key] = module
        return module
    _failures[key] = failure
    raise failure


def available_backends() -> list[str]:
    """Names of the backends whose framework imports on this machine.

    This imports each framework that is installed, so it is slow the first time.
    """
    names = []
    for name in BACKENDS:
        try:
            load_backend(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names


def select_backends(text: str | None) -> tuple[list[str], dict[str, str]]:
    """The backends a command runs on, and {backend: reason} for those skipped.

    Args:
        text: a comma list of names; each must import, and a name given twice (or by an
            alias) runs once. None: every backend that imports, the others listed as
            skipped with the reason.

    Raises:
        ValueError: an unknown name, or a list that names none.
        BackendUnavailableError: a named backend does not import.
    """
    if text is not None:
        names = [normalize_backend_name(name) for name in text.split(",") if name.strip()]
        names = list(dict.fromkeys(names))
        if not names:
            raise ValueError("--backends names no backend")
        for name in names:
            load_backend(name)
        return names, {}
    names, skipped = [], {}
    for name in BACKENDS:
        try:
            load_backend(name)
        except BackendUnavailableError as error:
            skipped[name] = str(error)
        else:
            names.append(name)
    return names, skipped


def framework_version(name: str) -> str | None:
    """The installed version of backend `name`'s framework, or None if it is not installed.

    Reads package metadata only; imports nothing.
    """
    from importlib import metadata

    key = normalize_backend_name(name)
    distributions = {"tensorflow": ("tensorflow", "tensorflow-cpu")}.get(key, (FRAMEWORKS[key],))
    for distribution in distributions:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def backend_of(layer: object) -> str:
    """The name of the backend that defines `layer`'s class (or one of its bases).

    Raises:
        TypeError: `layer` is not an mha layer.
    """
    modules = {module: name for name, module in BACKENDS.items()}
    for cls in type(layer).__mro__:
        if cls.__module__ in modules:
            return modules[cls.__module__]
    raise TypeError(
        f"Expected a layer from one of the mha backends. Received: an object of type "
        f"{type(layer).__module__}.{type(layer).__qualname__}"
    )
