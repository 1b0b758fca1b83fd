"""Canonical weights: one format for every backend, and safetensors files.

The canonical weights of a layer are a plain `dict[str, numpy.ndarray]` computing
`y = x @ W + b`, with W of shape (in, out), whatever layout the framework keeps internally:

    MultiHeadAttention   W_q (query_size, num_hiddens), W_k (key_size, num_hiddens),
                         W_v (value_size, num_hiddens), W_o (num_hiddens, out_features);
                         with bias=True also b_q, b_k, b_v (num_hiddens,), and with
                         out_bias (None: bias) b_o (out_features,)
    AdditiveAttention    W_q (query_size, num_hiddens), W_k (key_size, num_hiddens),
                         w_v (num_hiddens, 1)
    AddNorm              gamma (num_hiddens,), beta (num_hiddens,)
    LearnedPositionalEncoding  P (max_len, num_hiddens), row i added at position i
    DotProductAttention, PositionalEncoding, RotaryEmbedding: {}

With num_kv_heads (grouped-query attention), W_k and W_v are (size, num_kv_heads * head size)
and b_k, b_v (num_kv_heads * head size,), the head size being num_hiddens / num_heads.

Files are safetensors (a JSON header and raw little-endian bytes), read and written here with
numpy alone (bfloat16 through ml_dtypes, numpy's bfloat16), never with pickle. The header's
metadata records the layer's class and constructor config, so a file cannot be loaded into a
layer it does not fit.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from mha import options, validation
from mha.config import get_backend
from mha.files import write_atomically
from mha.registry import backend_of, load_backend

__all__ = [
    "LAYER_CLASSES",
    "Checkpoint",
    "build_layer",
    "get_weights",
    "load",
    "load_weights",
    "random_weights",
    "read_checkpoint",
    "read_safetensors",
    "save",
    "save_weights",
    "set_weights",
    "weight_shapes",
    "write_safetensors",
]

# Layer class -> the names of its constructor arguments, in signature order.
# Each layer's options (its constructor's arguments), in the order configs list them
LAYER_CLASSES: dict[str, tuple[str, ...]] = {
    layer: tuple(option.name for option in options.layer_options(layer)) for layer in options.LAYERS
}

FORMAT = "mha"
FORMAT_VERSION = "1"


def weight_shapes(class_name: str, config: Mapping[str, Any]) -> dict[str, tuple[int | None, ...]]:
    """The canonical weight names and shapes of a layer; None marks a size not known yet.

    Args:
        class_name: one of LAYER_CLASSES, e.g. "MultiHeadAttention".
        config: its constructor arguments (sizes may be None).
    """
    if class_name == "MultiHeadAttention":
        n = config["num_hiddens"]
        out = config.get("out_features") or n
        # Keys and values have num_kv_heads heads of the query heads' size
        num_kv_heads = config.get("num_kv_heads")
        kv = n if num_kv_heads is None else n // config["num_heads"] * num_kv_heads
        shapes = {
            "W_q": (config.get("query_size"), n),
            "W_k": (config.get("key_size"), kv),
            "W_v": (config.get("value_size"), kv),
            "W_o": (n, out),
        }
        if config.get("bias", False):
            shapes.update({"b_q": (n,), "b_k": (kv,), "b_v": (kv,)})
        if _out_bias(config.get("bias", False), config.get("out_bias")):
            shapes["b_o"] = (out,)
        return shapes
    if class_name == "AdditiveAttention":
        n = config["num_hiddens"]
        return {
            "W_q": (config.get("query_size"), n),
            "W_k": (config.get("key_size"), n),
            "w_v": (n, 1),
        }
    if class_name == "AddNorm":
        n = config["num_hiddens"]
        return {"gamma": (n,), "beta": (n,)}
    if class_name == "LearnedPositionalEncoding":
        return {"P": (config.get("max_len", 1000), config["num_hiddens"])}
    if class_name in ("DotProductAttention", "PositionalEncoding", "RotaryEmbedding"):
        return {}
    raise ValueError(
        f"Unknown layer class. Valid names: {', '.join(LAYER_CLASSES)}. Received: {class_name!r}"
    )


# The sub-layer whose input size each size argument is
_SIZE_OF = {"query_size": "W_q", "key_size": "W_k", "value_size": "W_v"}


def read_config(layer: Any, input_size: Any, dropout_rate: Any) -> dict[str, Any]:
    """The constructor arguments of `layer`, with sizes inferred so far (None while unknown).

    The layers of every backend keep their other arguments as attributes of the same names;
    the backend says how to read a sub-layer's input size and a dropout layer's rate.
    """
    class_name = _layer_class_name(layer)
    config = {}
    for key in LAYER_CLASSES[class_name]:
        if key == "dropout":
            owner = layer.attention if class_name == "MultiHeadAttention" else layer
            config[key] = dropout_rate(owner.dropout)
        elif key in _SIZE_OF:
            config[key] = input_size(getattr(layer, _SIZE_OF[key]))
        else:
            config[key] = getattr(layer, key)
    return config


def _out_bias(bias: bool, out_bias: bool | None) -> bool:
    # Whether W_o has a bias: out_bias, or bias when out_bias is None
    return bias if out_bias is None else out_bias


def weight_places(
    class_name: str, bias: bool = False, out_bias: bool | None = None
) -> dict[str, tuple[str, str]]:
    """Where each canonical weight lives in a layer, the same in every backend.

    Canonical name -> (the attribute of the sub-layer that holds it, the kind of parameter):
    a dense layer's "kernel" (canonically (in, out)) and "bias", a layer norm's "scale" and
    "shift", an embedding's "table" (one row per index). Each backend's PARAMETERS says how
    its framework keeps each kind. Kernels come first: written in this order, a lazy sub-layer
    makes its parameters before its bias is set.
    """
    if class_name == "MultiHeadAttention":
        places = {f"W_{k}": (f"W_{k}", "kernel") for k in "qkvo"}
        if bias:
            places.update({f"b_{k}": (f"W_{k}", "bias") for k in "qkv"})
        if _out_bias(bias, out_bias):
            places["b_o"] = ("W_o", "bias")
        return places
    if class_name == "AdditiveAttention":
        return {name: (name, "kernel") for name in ("W_q", "W_k", "w_v")}
    if class_name == "AddNorm":
        return {"gamma": ("ln", "scale"), "beta": ("ln", "shift")}
    if class_name == "LearnedPositionalEncoding":
        return {"P": ("embedding", "table")}
    return {}


def canonical_parameters(
    layer: Any, parameters: Mapping[str, tuple[str, bool]]
) -> dict[str, tuple[Any, bool]]:
    """Canonical name -> (the framework's parameter that holds it, whether it holds it
    transposed), for a layer of the backend whose PARAMETERS table is `parameters`."""
    places = _weight_places_of(layer)
    return {
        name: (getattr(getattr(layer, sublayer), parameters[kind][0]), parameters[kind][1])
        for name, (sublayer, kind) in places.items()
    }


def _weight_places_of(layer: Any) -> dict[str, tuple[str, str]]:
    class_name = _layer_class_name(layer)
    if class_name != "MultiHeadAttention":
        return weight_places(class_name)
    return weight_places(class_name, layer.bias, layer.out_bias)


def _export_weights(backend: Any, layer: Any) -> dict[str, np.ndarray]:
    parameters = canonical_parameters(layer, backend.PARAMETERS)
    return {name: backend.read_parameter(*held) for name, held in parameters.items()}


def _import_weights(backend: Any, layer: Any, arrays: Mapping[str, np.ndarray]) -> None:
    for name, (sublayer, kind) in _weight_places_of(layer).items():
        backend.write_parameter(getattr(layer, sublayer), kind, arrays[name])


def _describe_layer(class_name: str, config: Mapping[str, Any]) -> str:
    arguments = ", ".join(
        f"{key}={config[key]!r}" for key in LAYER_CLASSES[class_name] if key in config
    )
    return f"{class_name}({arguments})"


def _layer_class_name(layer: Any) -> str:
    """The mha class a layer is an instance of (also for user subclasses)."""
    for cls in type(layer).__mro__:
        if cls.__name__ in LAYER_CLASSES and cls.__module__.startswith("mha.backends."):
            return cls.__name__
    raise TypeError(
        f"Expected an mha layer ({', '.join(LAYER_CLASSES)}). "
        f"Received: an object of type {type(layer).__qualname__}"
    )


def _describe_array(value: Any) -> str:
    return f"shape {validation._format_shape(value.shape)} and dtype {value.dtype}"


def _find_problems(
    class_name: str, config: Mapping[str, Any], weights: Any
) -> tuple[list[str], dict[str, np.ndarray]]:
    """Every problem of `weights` for the layer, and the weights as numpy arrays."""
    if not isinstance(weights, Mapping):
        raise TypeError(
            "weights must be a dict of numpy arrays keyed by the canonical names. "
            f"Received: weights of type {type(weights).__name__}"
        )
    shapes = weight_shapes(class_name, config)
    dtype = config["dtype"]
    problems = []
    arrays = {}
    for name in shapes:
        if name not in weights:
            problems.append(
                f"missing {name}: expected shape {validation._format_shape(shapes[name])}"
            )
    for name in weights:
        if name not in shapes:
            expected = ", ".join(shapes) or "no weights"
            problems.append(f"unexpected {name!r}: {class_name} has {expected}")
    for name, expected in shapes.items():
        if name not in weights:
            continue
        value = weights[name]
        if not isinstance(value, np.ndarray):
            problems.append(
                f"{name} must be a numpy.ndarray (see mha.to_numpy). "
                f"Received: {type(value).__name__}"
            )
            continue
        shape_ok = len(value.shape) == len(expected) and all(
            e is None or e == s for s, e in zip(value.shape, expected, strict=False)
        )
        if not shape_ok:
            problems.append(
                f"{name} has {_describe_array(value)}; "
                f"expected shape {validation._format_shape(expected)}"
            )
        elif value.dtype.name != dtype:
            problems.append(
                f"{name} has {_describe_array(value)}; expected dtype {dtype} (the layer's dtype)"
            )
        else:
            arrays[name] = value
    return problems, arrays


def _raise_problems(what: str, class_name: str, config: Mapping[str, Any], problems: list[str]):
    count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
    lines = "\n".join(f"  - {problem}" for problem in problems)
    raise ValueError(f"{what} found {count} for {_describe_layer(class_name, config)}:\n{lines}")


def layer_info(layer: Any) -> tuple[Any, str, dict[str, Any]]:
    class_name = _layer_class_name(layer)
    backend = load_backend(backend_of(layer))
    return backend, class_name, backend.layer_config(layer)


def get_weights(layer: Any) -> dict[str, np.ndarray]:
    """The layer's weights in the canonical format, as fresh numpy arrays.

    Works on a layer of any backend. A layer whose input sizes are not known yet (lazy, never
    called, no weights loaded) has no weights to return and raises ValueError.
    """
    backend, class_name, config = layer_info(layer)
    shapes = weight_shapes(class_name, config)
    unknown = [
        key
        for key in ("query_size", "key_size", "value_size")
        if key in config and config[key] is None
    ]
    if shapes and unknown:
        raise ValueError(
            f"The weights of {_describe_layer(class_name, config)} are not created yet: "
            f"{', '.join(unknown)} unknown. Call the layer once, pass the sizes to its "
            "constructor, or load weights with mha.set_weights."
        )
    return _export_weights(backend, layer)


def set_weights(layer: Any, weights: Mapping[str, np.ndarray]) -> None:
    """Load canonical weights into a layer of any backend.

    Sizes the layer does not know yet (lazy query_size, key_size, value_size) are taken from
    the weights. Nothing is changed unless every weight fits.

    Raises:
        TypeError: `weights` is not a dict.
        ValueError: one error listing every missing, unexpected, misshapen or mistyped weight.
    """
    backend, class_name, config = layer_info(layer)
    problems, arrays = _find_problems(class_name, config, weights)
    if problems:
        _raise_problems("set_weights", class_name, config, problems)
    _import_weights(backend, layer, arrays)


def random_weights(
    layer: Any, *, seed: int = 0, dtype: str | None = None, **config: Any
) -> dict[str, np.ndarray]:
    """A seeded set of canonical weights.

    Args:
        layer: an mha layer (its class and config are used), or a class name or class such
            as "MultiHeadAttention", with the constructor arguments given as keywords.
        seed: the seed; the same seed gives the same weights on every machine.
        dtype: float dtype name; defaults to the layer's dtype, else "float32".
        **config: constructor arguments when `layer` is a name or class. Every size the
            weights need must be known (query_size etc.).

    Matrices are uniform in [-1/sqrt(in), 1/sqrt(in)] (torch.nn.Linear's default), biases
    likewise, AddNorm's gamma near 1 and beta near 0.

    Example:
        >>> w = mha.random_weights("MultiHeadAttention", num_hiddens=8, num_heads=2,
        ...                        query_size=4, key_size=4, value_size=4, seed=1)
    """
    if isinstance(layer, str) or isinstance(layer, type):
        class_name = layer if isinstance(layer, str) else _layer_class_name_of_type(layer)
        weight_shapes(class_name, {"num_hiddens": 1})  # rejects an unknown name
        unknown = sorted(set(config) - set(LAYER_CLASSES[class_name]))
        if unknown:
            raise TypeError(
                f"{class_name} has no argument {', '.join(unknown)}. "
                f"Valid: {', '.join(LAYER_CLASSES[class_name])}"
            )
        if "num_hiddens" in LAYER_CLASSES[class_name] and "num_hiddens" not in config:
            raise TypeError(f"random_weights for {class_name} needs num_hiddens")
        layer_config = dict(config)
        layer_config.setdefault("dtype", "float32")
    else:
        if config:
            raise TypeError("random_weights takes no constructor arguments when given a layer")
        _, class_name, layer_config = layer_info(layer)
    name = validation.check_dtype(dtype if dtype is not None else layer_config["dtype"])
    shapes = weight_shapes(class_name, layer_config)
    unknown = sorted(n for n, shape in shapes.items() if None in shape)
    if unknown:
        raise ValueError(
            f"random_weights needs every size of {_describe_layer(class_name, layer_config)}: "
            f"the shapes of {', '.join(unknown)} depend on sizes that are None"
        )
    rng = np.random.default_rng(seed)
    weights = {}
    for key in sorted(shapes):
        shape = shapes[key]
        if key == "gamma":
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif key == "beta":
            value = 0.1 * rng.standard_normal(shape)
        else:
            fan_in = shape[0] if len(shape) == 2 else shapes["W_o"][0]
            bound = 1.0 / math.sqrt(fan_in)
            value = rng.uniform(-bound, bound, shape)
        weights[key] = value.astype(numpy_dtype(name))
    return weights


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name such as "float32".

    numpy has no bfloat16 of its own: bfloat16 weights are arrays of ml_dtypes' bfloat16,
    the type TensorFlow and JAX hand out, imported here when first needed.
    """
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise ModuleNotFoundError(
            "bfloat16 weights are numpy arrays of ml_dtypes.bfloat16, and the ml_dtypes "
            "package is not installed: pip install ml_dtypes"
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def _layer_class_name_of_type(cls: type) -> str:
    for base in cls.__mro__:
        if base.__name__ in LAYER_CLASSES and base.__module__.startswith("mha.backends."):
            return base.__name__
    raise TypeError(f"Expected an mha layer class. Received: {cls.__qualname__}")


# ---------------------------------------------------------------------------------------------
# Files


def save_weights(layer: Any, path: str | os.PathLike) -> None:
    """Write the layer's canonical weights, class and config to a safetensors file.

    The file is written to a temporary name and renamed (`mha.files.write_atomically`), so a
    failed or interrupted save never leaves a truncated file under `path`.

    Raises:
        OSError: the file could not be written; `path` is left as it was.
    """
    write_atomically(path, checkpoint_bytes(layer))


def checkpoint_bytes(layer: Any) -> bytes:
    """The content of the checkpoint `save_weights` writes: weights, class and config."""
    _, class_name, config = layer_info(layer)
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "class": class_name,
        "config": json.dumps(config, sort_keys=True),
        "backend": backend_of(layer),
    }
    return safetensors_bytes(get_weights(layer), metadata)


def load_weights(layer: Any, path: str | os.PathLike) -> None:
    """Load a file written by `save_weights` (from any backend) into `layer`.

    Raises:
        ValueError: the file is not an mha safetensors file, is truncated or corrupted, was
            saved from another class, or its config or weights do not fit the layer; every
            problem is listed.
    """
    _, class_name, config = layer_info(layer)
    saved_class, saved, tensors, _ = _read_mha_file(path)
    if saved_class != class_name:
        raise ValueError(
            f"{os.fspath(path)} holds weights of {saved_class}; cannot load them into {class_name}"
        )
    problems = []
    for key in LAYER_CLASSES[class_name]:
        if key in ("dropout", "dtype", "eps", "max_len"):
            continue  # not part of the weights; dtype is checked per tensor below
        mine, theirs = config.get(key), saved.get(key)
        if mine is not None and mine != theirs:
            problems.append(
                f"the file was saved with {key}={theirs!r}; this layer has {key}={mine!r}"
            )
    more, arrays = _find_problems(class_name, config, tensors)
    problems.extend(more)
    if problems:
        _raise_problems(f"load_weights({os.fspath(path)!r})", class_name, config, problems)
    _import_weights(load_backend(backend_of(layer)), layer, arrays)


class Checkpoint(NamedTuple):
    """The contents of an mha checkpoint file, checked: see `read_checkpoint`."""

    class_name: str
    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    metadata: dict[str, str]


def _read_mha_file(
    path: str | os.PathLike,
) -> tuple[str, dict[str, Any], dict[str, np.ndarray], dict[str, str]]:
    """Class, config, tensors and metadata of a file written by `save_weights` / `save`."""
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT or "class" not in metadata or "config" not in metadata:
        raise ValueError(
            f"{os.fspath(path)} is a safetensors file but not one written by "
            "mha.save_weights (its metadata has no mha class and config)"
        )
    if metadata.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise ValueError(
            f"{os.fspath(path)} is an mha file of format version "
            f"{metadata['format_version']!r}; this mha reads version {FORMAT_VERSION!r} "
            "(a newer mha wrote it?)"
        )
    class_name = metadata["class"]
    if class_name not in LAYER_CLASSES:
        raise ValueError(
            f"{os.fspath(path)} holds an unknown layer class. Valid names: "
            f"{', '.join(LAYER_CLASSES)}. Received: {class_name!r}"
        )
    try:
        saved = json.loads(metadata["config"])
        if not isinstance(saved, dict):
            raise TypeError("config is not a JSON object")
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{os.fspath(path)} has a corrupted config in its metadata: {error}"
        ) from None
    return class_name, saved, tensors, metadata


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and check an mha checkpoint (written by `save` or `save_weights`) without a layer.

    Only data is read (safetensors: a JSON header and raw numbers); nothing is executed.

    Returns:
        Checkpoint(class_name, config, weights, metadata).

    Raises:
        ValueError: the file is truncated, not safetensors, not written by mha, names an
            unknown class, has a config with missing, unknown or wrongly typed arguments, or
            weights whose names, shapes or dtypes do not fit that config. Every weight problem
            is listed.
    """
    name = os.fspath(path)
    class_name, config, tensors, metadata = _read_mha_file(path)
    expected = LAYER_CLASSES[class_name]
    # A file written before an argument existed has that argument's default
    config = {**{k: v for k, v in OPTION_DEFAULTS.items() if k in expected}, **config}
    unknown = sorted(set(config) - set(expected))
    missing = [key for key in expected if key not in config]
    if unknown or missing:
        details = []
        if unknown:
            details.append(f"unknown {', '.join(unknown)}")
        if missing:
            details.append(f"missing {', '.join(missing)}")
        raise ValueError(
            f"{name} has an invalid config for {class_name} ({'; '.join(details)}). "
            f"{class_name} takes {', '.join(expected)}"
        )
    try:
        validation.check_layer_args(class_name, config)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} has an invalid config for {class_name}: {error}") from None
    if class_name == "PositionalEncoding":
        # Its table is made from the config alone: a few bytes of file must not ask for TiBs
        size = config["max_len"] * config["num_hiddens"]
        if size > _MAX_TABLE_SIZE:
            raise ValueError(
                f"{name} asks for a positional table of max_len * num_hiddens = {size} numbers, "
                f"more than a file may ask for ({_MAX_TABLE_SIZE}); build the layer with "
                "these arguments yourself if you mean it"
            )
    problems, arrays = _find_problems(class_name, config, tensors)
    if problems:
        _raise_problems(f"read_checkpoint({name!r})", class_name, config, problems)
    return Checkpoint(class_name, config, arrays, metadata)


# The options beside the book's arguments, with their defaults: a file written before they
# existed, and a framework's layer, which has none of them, take these
OPTION_DEFAULTS = {option.name: option.default for option in options.OPTIONS if option.added}

# The options of MultiHeadAttention that its weights do not tell (num_kv_heads they do tell):
# a port or a conversion is given them
UNTOLD_OPTIONS = options.untold("MultiHeadAttention")


def check_untold_options(options: Mapping[str, Any]) -> None:
    """Raise TypeError for an option that is not one of UNTOLD_OPTIONS."""
    unknown = sorted(set(options) - set(UNTOLD_OPTIONS))
    if unknown:
        raise TypeError(
            f"unknown option {', '.join(unknown)}; the options: {', '.join(UNTOLD_OPTIONS)}"
        )


# The largest positional table a checkpoint may ask for: 2**27 numbers, 1 GiB in float64
_MAX_TABLE_SIZE = 2**27


def build_layer(module: Any, class_name: str, config: Mapping[str, Any]) -> Any:
    """A new `class_name` layer of backend `module` from its constructor arguments."""
    positional = [key for key in LAYER_CLASSES[class_name] if key in ("num_hiddens", "num_heads")]
    return getattr(module, class_name)(
        *(config[key] for key in positional),
        **{key: value for key, value in config.items() if key not in positional},
    )


def save(layer: Any, path: str | os.PathLike) -> None:
    """Save a layer as a checkpoint: its canonical weights, class and config (safetensors).

    The same file format as `save_weights`; `load` rebuilds the layer from it in any backend.

    Example:
        >>> mha.save(attention, "attention.safetensors")
        >>> again = mha.load("attention.safetensors", backend="torch")
    """
    save_weights(layer, path)


def load(path: str | os.PathLike, backend: str | None = None) -> Any:
    """Rebuild the layer saved in a checkpoint, in `backend` (default: the current backend).

    The layer gets the saved class, config (dropout and dtype included) and weights, whatever
    backend saved it. Nothing in the file is executed.

    Raises:
        ValueError: the file cannot be read, or its class, config or weights are invalid
            (see `read_checkpoint`).
        BackendUnavailableError: `backend` does not import.
    """
    checkpoint = read_checkpoint(path)
    module = load_backend(backend if backend is not None else get_backend())
    class_name, config = checkpoint.class_name, checkpoint.config
    layer = build_layer(module, class_name, config)
    if checkpoint.weights:
        _import_weights(module, layer, checkpoint.weights)
    return layer


# The safetensors dtypes mha reads and writes, and their little-endian numpy types; BF16 is
# stored as the 16-bit patterns of ml_dtypes' bfloat16 (the upper half of a float32)
_SAFETENSORS_DTYPES = {
    "F16": "<f2",
    "F32": "<f4",
    "F64": "<f8",
    "I8": "i1",
    "I16": "<i2",
    "I32": "<i4",
    "I64": "<i8",
    "U8": "u1",
    "BOOL": "?",
    "BF16": "<u2",
}
_NUMPY_TO_SAFETENSORS = {np.dtype(v).name: k for k, v in _SAFETENSORS_DTYPES.items()}
_NUMPY_TO_SAFETENSORS["bfloat16"] = _NUMPY_TO_SAFETENSORS.pop("uint16")
_MAX_HEADER_BYTES = 100_000_000


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]
) -> None:
    """Write numpy arrays and string metadata as a safetensors file (atomically).

    Raises:
        OSError: the file could not be written; `path` is left as it was.
    """
    write_atomically(path, safetensors_bytes(tensors, metadata))


def safetensors_bytes(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """The content of a safetensors file of numpy arrays and string metadata."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        if array.dtype.name not in _NUMPY_TO_SAFETENSORS:
            raise TypeError(f"cannot write {name} with dtype {array.dtype} to safetensors")
        dtype = _NUMPY_TO_SAFETENSORS[array.dtype.name]
        if dtype == "BF16":
            array = np.ascontiguousarray(array).view(np.uint16)  # the bit patterns
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the format asks
    return b"".join([struct.pack("<Q", len(encoded)), encoded, *blobs])


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A key given twice would leave the last one silently winning: the file is refused
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"it names {', '.join(map(repr, twice))} more than once")
    return dict(pairs)


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file into numpy arrays and its string metadata.

    Every size and offset is checked before any data is read, so a truncated, foreign or
    hostile file raises ValueError instead of crashing or allocating without bound.
    """
    name = os.fspath(path)

    def corrupt(reason: str) -> ValueError:
        return ValueError(f"{name} is not a valid safetensors file: {reason}")

    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < 8:
            raise corrupt(f"it has {size} bytes, fewer than the 8-byte header size")
        (header_size,) = struct.unpack("<Q", file.read(8))
        # The header's size is checked against the file's before anything more is read
        if header_size > _MAX_HEADER_BYTES:
            raise corrupt(f"its header claims {header_size} bytes (limit {_MAX_HEADER_BYTES})")
        if 8 + header_size > size:
            raise corrupt(
                f"it is truncated: the header needs {header_size} bytes, {size - 8} remain"
            )
        file.seek(0)
        content = file.read()
    try:
        header = json.loads(
            content[8 : 8 + header_size].decode("utf-8"), object_pairs_hook=_unique_keys
        )
    except (UnicodeDecodeError, ValueError) as error:
        raise corrupt(f"its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise corrupt("its __metadata__ is not a map of strings")
    data = memoryview(content)[8 + header_size :]
    entries = _safetensors_entries(header, len(data), corrupt)
    tensors = {}
    for begin, end, key, dtype, shape in entries:
        array = np.frombuffer(data[begin:end], dtype=_SAFETENSORS_DTYPES[dtype])
        array = array.reshape(shape).astype(array.dtype.newbyteorder("="))
        tensors[key] = array.view(numpy_dtype("bfloat16")) if dtype == "BF16" else array
    return tensors, metadata


def _safetensors_entries(
    header: Mapping[str, Any], data_size: int, corrupt: Any
) -> list[tuple[int, int, str, str, list[int]]]:
    """(begin, end, name, dtype, shape) of each tensor of a safetensors header, in the order of
    their data, after checking that they fill the data_size bytes after the header exactly;
    `corrupt(reason)` makes the error to raise."""
    entries = []
    for key, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise corrupt(f"the entry of {key!r} is not dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _SAFETENSORS_DTYPES:
            raise corrupt(f"{key!r} has dtype {dtype!r}, which mha does not read")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise corrupt(f"{key!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise corrupt(f"{key!r} has invalid data_offsets {offsets!r}")
        itemsize = np.dtype(_SAFETENSORS_DTYPES[dtype]).itemsize
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
            raise corrupt(f"{key!r} has {offsets[1] - offsets[0]} bytes for shape {shape}")
        entries.append((offsets[0], offsets[1], key, dtype, shape))
    entries.sort()
    position = 0
    for begin, end, key, _, _ in entries:
        if begin != position:
            raise corrupt(f"the data of {key!r} does not follow the previous tensor's")
        position = end
    if position != data_size:
        if position > data_size:
            raise corrupt(f"it is truncated: the tensors need {position} bytes, {data_size} remain")
        raise corrupt(f"it has {data_size - position} bytes after the last tensor")
    return entries
