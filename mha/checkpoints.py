"""mha's files: checkpoints of a layer, and the safetensors format they are written in.

A checkpoint holds a layer's canonical weights (`mha.weights`), and in the header's metadata
its class and constructor config, so a file cannot be loaded into a layer it does not fit:
`save` and `save_weights` write one, `load` rebuilds the layer in any backend, `load_weights`
loads it into a layer, and `read_checkpoint` reads and checks it without a layer.

Files are safetensors (a JSON header and raw little-endian bytes), read and written here with
numpy alone (bfloat16 through ml_dtypes, numpy's bfloat16), never with pickle.

`mha.save`, `mha.load`, `mha.save_weights` and `mha.load_weights` are this module's; the
older names `mha.weights.read_checkpoint` and the rest still work, looked up here when first
asked for.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from mha import validation
from mha.config import get_backend
from mha.files import check_source, parse_json, write_atomically
from mha.layer_args import check_dtype
from mha.options import added_defaults
from mha.registry import backend_of, load_backend
from mha.weights import (
    LAYER_CLASSES,
    build_layer,
    find_problems,
    get_weights,
    import_weights,
    in_dtype,
    layer_info,
    numpy_dtype,
    raise_problems,
)

__all__ = [
    "Checkpoint",
    "load",
    "load_weights",
    "read_checkpoint",
    "read_safetensors",
    "save",
    "save_weights",
    "write_safetensors",
]

FORMAT = "mha"
FORMAT_VERSION = "1"


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
    # A file written before an argument existed has that argument's default
    saved = {**added_defaults(class_name), **saved}
    for key in LAYER_CLASSES[class_name]:
        if key in ("dropout", "dtype", "max_len"):
            continue  # not part of the weights; dtype is checked per tensor below
        mine, theirs = config.get(key), saved.get(key)
        # A lazy layer's input sizes are still None: the file's weights give them. Any other
        # setting of the file's (scale, rope_theta, a window) must be the layer's
        if not same_setting(mine, theirs) and not (mine is None and key in _LAZY_SIZES):
            problems.append(
                f"the file was saved with {key}={theirs!r}; this layer has {key}={mine!r}"
            )
    more, arrays = find_problems(class_name, config, tensors)
    problems.extend(more)
    if problems:
        raise_problems(f"load_weights({os.fspath(path)!r})", class_name, config, problems)
    import_weights(load_backend(backend_of(layer)), layer, arrays)


_LAZY_SIZES = ("query_size", "key_size", "value_size")


def same_setting(a: Any, b: Any) -> bool:
    """Equal options as files write them: a tuple as a list, a scaling as a plain mapping."""

    def written(x: Any) -> str:  # repr for a value JSON has no form of: compared, not failed
        return json.dumps(x, sort_keys=True, default=repr)

    return written(a) == written(b)


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
        saved = parse_json(metadata["config"])
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
    config = {**added_defaults(class_name), **config}
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
    check_sizes_asked(name, class_name, config)
    problems, arrays = find_problems(class_name, config, tensors)
    if problems:
        raise_problems(f"read_checkpoint({name!r})", class_name, config, problems)
    return Checkpoint(class_name, config, arrays, metadata)


# The largest positional table a checkpoint may ask for: 2**27 numbers, 1 GiB in float64
_MAX_TABLE_SIZE = 2**27


def check_sizes_asked(name: str, class_name: str, config: Mapping[str, Any]) -> None:
    """Raise ValueError where a file's `config` asks for a table made from the config alone
    (no weights of the file's bound it) larger than a file may ask for: a few bytes of file
    must not ask for TiBs."""
    tables = {
        "PositionalEncoding": ("a positional table of max_len * num_hiddens", "max_len"),
        "RotaryEmbedding": ("a rotary table of num_hiddens", None),
    }
    if class_name in tables:
        table, length = tables[class_name]
        size = config["num_hiddens"] * (config[length] if length else 1)
        if size > _MAX_TABLE_SIZE:
            raise ValueError(
                f"{name} asks for {table} = {size} numbers, more than a file may ask for "
                f"({_MAX_TABLE_SIZE}); build the layer with these arguments yourself if you "
                "mean it"
            )


def save(layer: Any, path: str | os.PathLike) -> None:
    """Save a layer as a checkpoint: its canonical weights, class and config (safetensors).

    The same file format as `save_weights`; `load` rebuilds the layer from it in any backend.

    Example:
        >>> mha.save(attention, "attention.safetensors")
        >>> again = mha.load("attention.safetensors", backend="torch")
    """
    save_weights(layer, path)


def load(path: str | os.PathLike, backend: str | None = None, *, dtype: str | None = None) -> Any:
    """Rebuild the layer saved in a checkpoint, in `backend` (default: the current backend).

    The layer gets the saved class, config (dropout and dtype included) and weights, whatever
    backend saved it; `dtype` builds it in another dtype, the weights cast to it (bfloat16
    widens to float32 exactly, for the backends that compute no bfloat16). Nothing in the
    file is executed.

    Raises:
        ValueError: the file cannot be read, or its class, config or weights are invalid
            (see `read_checkpoint`).
        BackendUnavailableError: `backend` does not import.
    """
    checkpoint = read_checkpoint(path)
    module = load_backend(backend if backend is not None else get_backend())
    class_name, config, weights = checkpoint.class_name, checkpoint.config, checkpoint.weights
    if dtype is not None:
        config = {**config, "dtype": check_dtype(dtype)}
        weights = {name: in_dtype(name, w, config["dtype"]) for name, w in weights.items()}
    layer = build_layer(module, class_name, config)
    if weights:
        import_weights(module, layer, weights)
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
    """The content of a safetensors file of numpy arrays and string metadata.

    Raises:
        TypeError: a tensor of a dtype safetensors has not, or metadata other than strings
            (the format holds strings only, and its readers refuse anything else).
        ValueError: a tensor's name that is not a string, or is "__metadata__", the
            format's own entry.
    """
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"safetensors metadata holds strings only. Received {key!r}: {value!r}")
    for name in tensors:
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"a tensor of a safetensors file may not be named {name!r}")
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


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file into numpy arrays and its string metadata.

    Every size and offset is checked before any data is read, so a truncated, foreign or
    hostile file raises ValueError instead of crashing or allocating without bound.
    """
    name = check_source(path)
    with open(path, "rb") as file:
        entries, metadata, _ = safetensors_layout(file, name)
        data = memoryview(file.read())
    corrupt = corrupt_error(name)
    # The entries fill the data exactly (safetensors_layout): other bytes, another file
    if len(data) != (entries[-1].end if entries else 0):
        raise corrupt("it changed while it was read")
    tensors = {entry.key: safetensors_array(data[entry.begin : entry.end], entry, corrupt)
               for entry in entries}  # fmt: skip
    return tensors, metadata


class Entry(NamedTuple):
    """One tensor of a safetensors file: its bytes from `begin` to `end` of the data (which
    starts after the header), its name, safetensors dtype and shape."""

    begin: int
    end: int
    key: str
    dtype: str
    shape: list[int]


def safetensors_layout(file: Any, name: str) -> tuple[list[Entry], dict[str, str], int]:
    """(entries, metadata, where the data starts) of the safetensors file open in `file` (at
    its start), from its header alone, every size and offset checked against the file's size;
    `name` is the file's, for the errors (ValueError)."""
    corrupt = corrupt_error(name)
    size = os.fstat(file.fileno()).st_size
    if size < 8:
        raise corrupt(f"it has {size} bytes, fewer than the 8-byte header size")
    (header_size,) = struct.unpack("<Q", file.read(8))
    # The header's size is checked against the file's before anything more is read
    if header_size > _MAX_HEADER_BYTES:
        raise corrupt(f"its header claims {header_size} bytes (limit {_MAX_HEADER_BYTES})")
    if 8 + header_size > size:
        raise corrupt(f"it is truncated: the header needs {header_size} bytes, {size - 8} remain")
    try:
        header = parse_json(file.read(header_size).decode("utf-8"))
    except ValueError as error:  # UnicodeDecodeError is one
        raise corrupt(f"its header is not JSON ({type(error).__name__}: {error})") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # null as absent, as safetensors reads it
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise corrupt("its __metadata__ is not a map of strings")
    entries = _safetensors_entries(header, size - 8 - header_size, corrupt)
    return entries, metadata, 8 + header_size


def safetensors_array(data: Any, entry: Entry, corrupt: Any) -> np.ndarray:
    """The array of a checked entry from its bytes, in native byte order (bfloat16 as
    ml_dtypes'); `corrupt(reason)` makes the error to raise."""
    array = np.frombuffer(data, dtype=_SAFETENSORS_DTYPES[entry.dtype])
    if entry.dtype == "BOOL" and array.view(np.uint8).max(initial=0) > 1:
        # numpy keeps such a byte: ~ of it stays True, so a mask and its negation would agree
        raise corrupt(f"{entry.key!r} is boolean and holds bytes other than 0 and 1")
    try:
        array = array.reshape(entry.shape)
    except ValueError as error:  # more axes than this numpy's arrays have (32 or 64)
        raise corrupt(f"{entry.key!r} has shape {entry.shape}: {error}") from None
    array = array.astype(array.dtype.newbyteorder("="))
    return array.view(numpy_dtype("bfloat16")) if entry.dtype == "BF16" else array


def safetensors_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype's arrays as mha reads them."""
    return numpy_dtype("bfloat16") if dtype == "BF16" else np.dtype(_SAFETENSORS_DTYPES[dtype])


def corrupt_error(name: str) -> Any:
    """The function that makes the ValueError of a reason the file `name` is not safetensors."""

    def corrupt(reason: str) -> ValueError:
        return ValueError(f"{name} is not a valid safetensors file: {reason}")

    return corrupt


def _safetensors_entries(header: Mapping[str, Any], data_size: int, corrupt: Any) -> list[Entry]:
    """The entry of each tensor of a safetensors header, in the order of their data, after
    checking that they fill the data_size bytes after the header exactly; `corrupt(reason)`
    makes the error to raise."""
    entries = []
    for key, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise corrupt(f"the entry of {key!r} is not dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPES:
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
        entries.append(Entry(offsets[0], offsets[1], key, dtype, shape))
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
