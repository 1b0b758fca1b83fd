"""Which backend is current: MHA_BACKEND, set_backend, use_backend.

Precedence, highest first: the innermost `use_backend` block of the current context (thread
or task), then `set_backend`, then the MHA_BACKEND environment variable (read at the first
use), then "numpy".
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator

from mha.registry import load_backend, normalize_backend_name

__all__ = ["DEFAULT_BACKEND", "ENV_VARIABLE", "get_backend", "set_backend", "use_backend"]

DEFAULT_BACKEND = "numpy"
ENV_VARIABLE = "MHA_BACKEND"

# Set by use_backend; contextvars keep it per thread and per asyncio task.
_context_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mha_backend", default=None
)
# Set by set_backend, or from MHA_BACKEND at the first use; shared by all threads.
_process_backend: str | None = None
_lock = threading.Lock()


def get_backend() -> str:
    """Return the name of the current backend ("numpy", "torch", "tensorflow", "mxnet" or "jax").

    Raises:
        ValueError: MHA_BACKEND names no known backend.
    """
    global _process_backend
    name = _context_backend.get()
    if name is not None:
        return name
    if _process_backend is None:
        with _lock:
            if _process_backend is None:
                value = os.environ.get(ENV_VARIABLE, "").strip()
                if value:
                    try:
                        _process_backend = normalize_backend_name(value)
                    except ValueError as error:
                        raise ValueError(f"{ENV_VARIABLE} is not valid: {error}") from None
                else:
                    _process_backend = DEFAULT_BACKEND
    return _process_backend


def set_backend(name: str) -> None:
    """Make `name` the current backend for the whole process.

    The backend is imported first, so a missing framework raises here and changes nothing.

    Raises:
        ValueError: unknown name.
        BackendUnavailableError: the framework is missing or broken.
    """
    global _process_backend
    key = normalize_backend_name(name)
    load_backend(key)
    with _lock:
        _process_backend = key


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Use backend `name` inside a `with` block, in the current thread or task only.

    The previous backend is restored on exit, also when the block raises.

    Example:
        >>> with mha.use_backend("torch"):
        ...     layer = mha.MultiHeadAttention(8, 2)   # a torch.nn.Module
    """
    key = normalize_backend_name(name)
    load_backend(key)
    token = _context_backend.set(key)
    try:
        yield key
    finally:
        _context_backend.reset(token)
