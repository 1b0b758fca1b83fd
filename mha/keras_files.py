"""Keras MultiHeadAttention weights files (.weights.h5): read through h5py, every array
checked before Keras loads it (its dtype, its place in the file, the kernels of one layer),
and written by Keras's own store in memory. `mha.conversion` reads and writes them so.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

from mha import validation
from mha.interop.keras import KERAS_DENSE, KERAS_GATE
from mha.registry import load_triton_before_tensorflow

__all__ = ["keras_weights_bytes", "load_keras_file"]


def load_keras_file(name: str) -> Any:
    load_triton_before_tensorflow()
    import keras  # Keras 3, the tf.keras of TensorFlow 2.16 and later
    import tensorflow as tf

    grouped, shapes, dtype, bias = _keras_file_layout(name)
    gated = {"use_gate": True} if "g" in shapes else {}
    if len(shapes["q"]) != 3 or len(shapes["v"]) != 3 or len(shapes["o"]) < 3:
        raise ValueError(
            f"{name} holds Keras MultiHeadAttention weights of a shape mha does not convert: "
            f"query kernel {shapes['q']}, value kernel {shapes['v']}, output kernel "
            f"{shapes['o']}"
        )
    num_heads, key_dim = shapes["q"][1:]
    q, k, v, o = (shapes[role] for role in "qkvo")
    if (
        len(k) != 3
        or (k[2], v[1], o[:2]) != (key_dim, k[1], (num_heads, v[2]))
        or (not grouped and k[1] != num_heads)
    ):
        raise ValueError(
            f"{name} holds kernels that are not one layer's: query {q}, key {k}, value {v}, "
            f"output {o} ((input size, heads, head size); the output's (heads, head size, ...))"
        )
    if grouped:
        # GroupQueryAttention's output has the query's size
        layer = tf.keras.layers.GroupQueryAttention(
            key_dim,
            num_heads,
            shapes["k"][1],
            use_bias=bias,
            dtype=validation.check_dtype(dtype),
            **gated,
        )
    else:
        layer = tf.keras.layers.MultiHeadAttention(
            num_heads,
            key_dim,
            value_dim=shapes["v"][2],
            use_bias=bias,
            output_shape=shapes["o"][2:],
            dtype=validation.check_dtype(dtype),
            **gated,
        )
    layer.build(
        (None, None, shapes["q"][0]), (None, None, shapes["v"][0]), (None, None, shapes["k"][0])
    )
    try:
        keras.saving.load_weights(layer, name)
    except (ValueError, OSError, KeyError, RuntimeError) as error:
        raise ValueError(f"{name} does not load into a Keras MultiHeadAttention: {error}") from None
    return layer


def _keras_file_layout(name: str) -> tuple[bool, dict[str, tuple[int, ...]], str, bool]:
    """(grouped, kernel shapes by projection, dtype, bias) of a Keras weights file, read with
    h5py before Keras reads its numbers; the projections include "g" where the layer has a
    gate (use_gate=True)."""
    import h5py

    try:
        with h5py.File(name, "r") as file:
            # GroupQueryAttention's sub-layers are saved under their attribute names
            grouped = "_query_dense" in file
            paths = {k: f"_{dense}" if grouped else dense for k, dense in KERAS_DENSE.items()}
            if f"_{KERAS_GATE}_dense" in file:  # both layers' gate: its attribute name
                paths["g"] = f"_{KERAS_GATE}_dense"
            _refuse_unknown_keras_entries(file, paths.values())
            missing = [f"{path}/vars/0" for path in paths.values() if f"{path}/vars/0" not in file]
            if missing:
                raise ValueError(f"it has no {', '.join(missing)} (the kernels)")
            names = [f"{path}/vars/{i}" for path in paths.values() for i in (0, 1)]
            dtype = _keras_entries_dtype(file, [n for n in names if n in file])
            # Every array is read whole: together they must fit in the file that holds them
            declared = sum(file[n].size * file[n].dtype.itemsize for n in names if n in file)
            if declared > os.path.getsize(name):
                raise ValueError(f"its arrays declare {declared} bytes, more than the file has")
            shapes = {k: tuple(file[f"{path}/vars/0"].shape) for k, path in paths.items()}
            biased = [path for path in paths.values() if f"{path}/vars/1" in file]
            if biased and len(biased) != len(paths):
                raise ValueError(f"only some projections have biases: {', '.join(biased)}")
            bias = bool(biased)
    # h5py raises RuntimeError for damaged metadata
    except (OSError, KeyError, RuntimeError, TypeError, ValueError) as error:
        raise ValueError(
            f"{name} is not a Keras MultiHeadAttention or GroupQueryAttention weights file (as "
            f"written by keras.saving.save_weights): {error}"
        ) from None
    return grouped, shapes, dtype, bias


def _keras_entries_dtype(file: Any, names: list[str]) -> str:
    """The one dtype of a Keras file's weight arrays `names`, each checked to be an array of
    this file's own (no link to another file, no storage outside it) whose data has the
    dtype Keras names: Keras would cast any other silently as it loads."""
    import h5py

    found = {}
    for name in names:
        parts = name.split("/")
        for end in range(1, len(parts) + 1):
            link = file.get("/".join(parts[:end]), getlink=True)
            if not isinstance(link, h5py.HardLink):
                raise ValueError(f"{name} is a {type(link).__name__}; mha reads arrays in place")
        entry = file[name]
        if not isinstance(entry, h5py.Dataset) or entry.external or entry.is_virtual:
            raise ValueError(f"{name} is not an array held in the file")
        # Keras stores bfloat16 as 2 raw bytes per number and names it in an attribute
        named = entry.attrs.get("dtype", entry.dtype.name)
        named = named.decode() if isinstance(named, bytes) else str(named)
        if entry.dtype.kind != "V" and named != entry.dtype.name:
            raise ValueError(f"{name} holds {entry.dtype.name} numbers named {named}")
        if entry.dtype.kind == "V" and (named, entry.dtype.itemsize) != ("bfloat16", 2):
            raise ValueError(
                f"{name} holds raw {entry.dtype.itemsize}-byte items named {named}; Keras "
                "writes raw bytes for bfloat16 alone, 2 each"
            )
        found[name] = named
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in found.items())
        raise ValueError(f"its arrays have different dtypes, which Keras would cast: {listed}")
    return next(iter(found.values()))


def _refuse_unknown_keras_entries(file: Any, projections: Any) -> None:
    """Raise ValueError for an array of a Keras file that mha would not read (anything but a
    projection's kernel and bias: a sub-layer of a newer or custom layer, LoRA's kernels, a
    quantized kernel's scales), rather than convert the layer without it."""
    import h5py

    read = {f"{path}/vars/{i}" for path in projections for i in (0, 1)}
    unknown = []
    file.visititems(
        lambda path, entry: (
            unknown.append(path) if isinstance(entry, h5py.Dataset) and path not in read else None
        )
    )
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(
            "it holds arrays mha does not read, which the layer would be converted without: "
            + ", ".join(unknown[:5])
            + more
        )


def keras_weights_bytes(layer: Any) -> bytes:
    """The .weights.h5 file `keras.saving.save_weights(layer, path)` writes, built in memory.

    h5py crashes the process when the disk refuses a write while it closes a file, so the
    HDF5 file is made in a BytesIO with the store and walk `save_weights` itself uses (Keras 3
    has no public call that writes to memory); write_file reads the file back to check it.
    """
    try:
        from keras.src.saving import saving_lib

        buffer = io.BytesIO()
        store = saving_lib.H5IOStore(buffer, mode="w")
        try:
            # Positional: the names of a private function's parameters are no promise
            saving_lib._save_state(layer, store, None, "", set())
        finally:
            store.close()
        return buffer.getvalue()
    except (ImportError, AttributeError, TypeError):
        return _keras_weights_bytes_by_file(layer)


def _keras_weights_bytes_by_file(layer: Any) -> bytes:
    """The same bytes by Keras's public save_weights, for a Keras whose private store differs:
    written in a scratch folder of the system's, never beside the destination."""
    import keras

    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "layer.weights.h5")
        keras.saving.save_weights(layer, path)
        with open(path, "rb") as file:
            return file.read()
