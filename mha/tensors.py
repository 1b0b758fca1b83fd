"""Reading any framework's tensor: its shape and the plain name of its dtype.

The checks of `mha.validation` read `.shape` and `.dtype` of a numpy array or of any
framework's tensor with these, without converting it to numpy, and describe it in their
messages the same way in every backend. `mha.validation.shape_of` and `dtype_name` are these.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "LayerDtype",
    "broadcastable",
    "describe",
    "dtype_name",
    "format_shape",
    "is_tensor",
    "layout_refused",
    "plain_dtype_name",
    "require_dtype",
    "require_tensor",
    "same",
    "shape_of",
]

Shape = tuple[int | None, ...]
# A layer's dtype, or the dtypes a call of it takes: the layer's first (see require_dtype)
LayerDtype = str | tuple[str, ...]


def shape_of(x: Any) -> Shape:
    """The shape of a numpy array or framework tensor as a tuple; unknown sizes are None, and
    symbolic sizes (torch.export's dynamic shapes, jax.export's symbolic shapes) stay symbolic."""
    shape = x.shape
    if isinstance(shape, tuple) and all(type(d) is int for d in shape):
        # numpy, torch.Size, MXNet: plain ints already (checks run on every call)
        return tuple(shape)
    if hasattr(shape, "as_list"):  # tf.TensorShape, possibly with unknown dimensions
        return tuple(shape.as_list()) if shape.rank is not None else ()
    return tuple(_size(d) for d in shape)


def _size(d: Any) -> Any:
    if d is None or type(d).__name__ in _SYMBOLIC_SIZES:
        # Symbolic sizes stay symbolic: int() would pin torch's program to the example, and
        # JAX's refuses to become a constant
        return d
    return int(d)


# torch.export's size with dynamic shapes, and jax.export's with a symbolic shape
_SYMBOLIC_SIZES = ("SymInt", "_DimExpr")


def dtype_name(x: Any) -> str:
    """The dtype of a numpy array or framework tensor as a plain name, e.g. "float32"."""
    return plain_dtype_name(x.dtype)


def require_dtype(
    name: str, x: Any, dtype: LayerDtype, boolean: str | None = None, why: str = ""
) -> None:
    """x must have `dtype`, a layer's, or one of a tuple of them (the layer's first, then one
    its framework computes the layer in for now: torch's autocast), or be boolean where
    `boolean` (how one reads) is given; `why` says what x is for."""
    names = (dtype,) if isinstance(dtype, str) else dtype
    if dtype_name(x) in names or (boolean is not None and dtype_name(x) == "bool"):
        return
    allowed = names[0] + (f" (or {' or '.join(names[1:])} inside autocast)" if names[1:] else "")
    either = "" if boolean is None else f"be boolean{boolean} or "
    raise TypeError(
        f"{name} must {either}have the layer's dtype {allowed}{why}. Received: {describe(name, x)}"
    )


def plain_dtype_name(dtype: Any) -> str:
    """The plain name of a dtype object of numpy or any framework, e.g. "float32"."""
    names = _DTYPE_NAMES.setdefault(type(dtype), {})
    try:
        return names[dtype]
    except (KeyError, TypeError):  # TypeError: not hashable
        name = _read_dtype_name(dtype)
    try:
        names[dtype] = name
    except TypeError:
        pass
    return name


# Names already read, by type of dtype object, then by dtype object: reading one parses its
# text, on every call. One table per type: torch.compile traces a lookup in a table of torch
# dtypes, but not in one that also holds another framework's (TensorFlow's DType has a hash
# that it cannot trace), and the checks run inside compiled torch code
_DTYPE_NAMES: dict[type, dict[Any, str]] = {}


def _read_dtype_name(dtype: Any) -> str:
    name = getattr(dtype, "name", None)  # numpy dtype, tf.DType
    if isinstance(name, str):
        return name
    text = str(dtype)  # torch.float32, <class 'numpy.float32'> (mxnet)
    if text.startswith("<class '"):
        text = text[len("<class '") : -2]
    return text.rsplit(".", 1)[-1]


def is_tensor(x: Any) -> bool:
    """Whether `x` has a shape and a dtype, as arrays and tensors of every framework have."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def layout_refused(x: Any) -> str | None:
    """What keeps the array or tensor `x` from being read as a plain one (a numpy masked
    array, a torch tensor that is sparse or nested, a TensorFlow sparse or ragged one), or
    None."""
    masked = sys.modules.get("numpy.ma")  # `import mha` imports no numpy: none before it
    if masked is not None and isinstance(x, masked.MaskedArray):
        return "a numpy masked array, whose mask the layers would not read"
    if any(c.__name__ == "matrix" and c.__module__.startswith("numpy") for c in type(x).__mro__):
        return "a numpy matrix, which keeps two axes where the layers reshape; np.asarray gives one"
    layout = getattr(x, "layout", None)
    if type(layout).__module__ == "torch" and str(layout) != "torch.strided":
        return f"a tensor of layout {layout}"
    if getattr(x, "is_nested", False) is True:
        return "a nested tensor"
    kind = type(x).__name__
    if kind in ("SparseTensor", "RaggedTensor") and type(x).__module__.startswith("tensorflow"):
        dense = "tf.sparse.to_dense(x)" if kind == "SparseTensor" else "x.to_tensor()"
        return f"a TensorFlow {kind}; {dense} gives a dense one"
    if getattr(getattr(x, "dtype", None), "byteorder", "=") in ("<", ">"):  # "=": this machine's
        # JAX reads such an array's bytes in this machine's order: refused alike everywhere
        return (
            "a numpy array whose bytes are not in this machine's order (dtype "
            f"{x.dtype.str}); x.astype(x.dtype.newbyteorder('=')) or mha's from_numpy gives one"
        )
    return None


def in_machine_order(array: Any) -> Any:
    """A numpy array with its bytes in this machine's order: `array` itself where they are."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def require_tensor(name: str, x: Any) -> None:
    if not is_tensor(x):
        raise TypeError(
            f"{name} must be an array or tensor of the layer's framework. "
            f"Received: {name} of type {type(x).__name__}"
        )


def describe(name: str, x: Any) -> str:
    """`x` as the checks' messages name it: "<name> with shape (2, 3) and dtype float32"."""
    if getattr(x.shape, "rank", 0) is None:  # a tf.TensorSpec(None): no axis is known
        return f"{name} of unknown rank and dtype {dtype_name(x)}"
    return f"{name} with shape {format_shape(shape_of(x))} and dtype {dtype_name(x)}"


def format_shape(shape: Shape) -> str:
    """A shape as a message writes it: (3,), (2, 3), None for a size not known."""
    if len(shape) == 1:
        return f"({shape[0]},)"
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


def same(a: int | None, b: int | None) -> bool:
    """Sizes agree, or one of them is not known yet (symbolic shapes)."""
    return a is None or b is None or a == b


def broadcastable(shape: Shape, target: Shape) -> bool:
    """`shape` broadcasts to `target` (right-aligned, each size equal or 1)."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or same(s, t) for s, t in zip(shape[::-1], target[::-1], strict=False))


def require_framework(tensor_type: Any, **tensors: Any) -> None:
    """Each given tensor is one of the layer's framework (`tensor_type`): another framework's
    tensor is a TypeError here rather than an internal error in the first operation."""
    for name, x in tensors.items():
        refused = None if x is None else layout_refused(x)
        if refused:
            raise TypeError(f"{name} must be a plain dense array or tensor. Received: {refused}")
        # The layer's own tensors, the common case, answer at the isinstance
        if x is not None and not isinstance(x, tensor_type) and is_tensor(x):
            raise TypeError(
                f"{name} must be an array or tensor of the layer's framework. "
                f"Received: {name} of type {type(x).__module__}.{type(x).__qualname__}"
            )
    _require_one_torch_device(tensors)


def _require_one_torch_device(tensors: dict[str, Any]) -> None:
    # torch's operations take tensors of one device only (and 0-d ones on the CPU): lengths
    # left on the CPU for a call on a GPU failed deep inside with torch's own message
    first = None
    for name, x in tensors.items():
        device = getattr(x, "device", None)
        if type(device).__module__ != "torch" or not getattr(x, "ndim", 0):
            continue
        if first is None:
            first = name, device
        elif device != first[1]:
            raise ValueError(
                f"{name} must be on the device of {first[0]}, {first[1]}. Received: {name} "
                f"on {device}; move it with .to({first[0]}.device)"
            )
