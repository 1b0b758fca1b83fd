"""Files of an attention layer in every framework's kind, and conversion between them.

The kinds (FILE_KINDS, told by the file name's ending): an mha checkpoint (.safetensors), a
torch nn.MultiheadAttention state_dict (.pt, .pth), Keras MultiHeadAttention weights
(.weights.h5) and Flax multi-head attention parameters (.msgpack). `read_file` gives the
canonical weights and config of any of them, `write_file` writes any of them, `convert` goes
from one to another (with `prefix`, out of a whole model's weights, through `mha.porting`),
and `read_state` reads every array of a whole model's file.

This module sits above `mha.interop` (the layouts) and `mha.porting` (the models' layouts),
which both stand without it. `mha.interop.convert` and the other names of this module that
`mha.interop` held before are still looked up there.

Only data is read, never code. Frameworks are imported inside the functions that need them:
importing this module imports none.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha import layer_args, layouts, porting, stored, validation
from mha.checkpoints import checkpoint_bytes, read_checkpoint, read_safetensors, same_setting
from mha.files import check_source, check_zip_archive, write_atomically
from mha.interop.common import check_expressible, layer_from_weights, options_of
from mha.interop.flax import canonical_from_flax, flax_params
from mha.interop.keras import canonical_from_keras, to_keras
from mha.interop.torch import canonical_from_torch, torch_state_dict
from mha.keras_files import keras_weights_bytes, load_keras_file
from mha.model_shapes import check_heads, shapes_given
from mha.options import layer_defaults
from mha.port_adjustments import LOCAL_CHUNKS, local_chunks_untold
from mha.registry import BackendUnavailableError, load_backend
from mha.weights import (
    LAYER_CLASSES,
    OPTION_DEFAULTS,
    build_layer,
    check_untold_options,
    set_weights,
)

__all__ = ["FILE_KINDS", "convert", "file_kind", "read_file", "read_state", "write_file"]

FILE_KINDS = {
    "mha": "mha checkpoint (.safetensors)",
    "torch": "torch.nn.MultiheadAttention state_dict (.pt, .pth)",
    "keras": "Keras MultiHeadAttention weights (.weights.h5)",
    "flax": "Flax multi-head attention parameters (.msgpack, flax.serialization)",
}
_SUFFIXES = {"mha": ".safetensors", "torch": ".pt", "keras": ".weights.h5", "flax": ".msgpack"}


def file_kind(path: str | os.PathLike) -> str:
    """ "mha", "torch", "keras" or "flax", from the file name's ending (see FILE_KINDS).

    Raises:
        ValueError: any other ending (a Keras file must end in .weights.h5, as Keras asks).
    """
    name = os.fspath(path).lower()
    if name.endswith(".safetensors"):
        return "mha"
    if name.endswith((".pt", ".pth")):
        return "torch"
    if name.endswith(".weights.h5"):
        return "keras"
    if name.endswith(".msgpack"):
        return "flax"
    hint = ""
    if name.endswith(".bin"):  # transformers' older pytorch_model.bin
        hint = "; a .bin of transformers' holds a torch state_dict: give it a .pt name (a link)"
    raise ValueError(
        f"cannot tell the kind of {os.fspath(path)!r} from its name. Use "
        + ", ".join(FILE_KINDS.values())
        + hint
    )


# ---------------------------------------------------------------------------------------------
# Reading


def read_file(
    path: str | os.PathLike, *, num_heads: int | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Canonical MultiHeadAttention weights and config from any file kind (see `file_kind`).

    Only data is read, never code: safetensors with numpy, the torch file with
    `torch.load(weights_only=True)` (which refuses anything but tensors and plain
    containers), the Keras file with h5py (to learn the sizes) and `keras.saving.load_weights`.

    Args:
        path: the file.
        num_heads: the number of heads; needed for a torch file, whose weights do not tell it;
            checked against the file for the other kinds.

    Returns:
        (weights, config) with config holding num_hiddens, num_heads (None when unknown),
        dropout, bias, query_size, key_size, value_size and dtype.

    Raises:
        ValueError: the file cannot be read, holds no MultiHeadAttention, or its number of
            heads differs from `num_heads`.
    """
    weights, config = _read_any(path)
    config = {**OPTION_DEFAULTS, **config}
    if num_heads is not None:
        if config["num_heads"] is not None and config["num_heads"] != num_heads:
            raise ValueError(
                f"{os.fspath(path)} holds a layer with num_heads={config['num_heads']}. "
                f"Received: num_heads={num_heads}"
            )
        given = {
            "num_hiddens": config["num_hiddens"],
            "num_heads": num_heads,
            "bias": config["bias"],
        }
        validation.check_layer_args(
            "MultiHeadAttention", {**layer_defaults("MultiHeadAttention"), **given}
        )
        config["num_heads"] = num_heads
    return weights, {key: config[key] for key in LAYER_CLASSES["MultiHeadAttention"]}


def _read_any(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The weights and config a file of any kind holds, as its kind tells them."""
    kind, name = file_kind(path), check_source(path)
    if kind == "mha":
        checkpoint = read_checkpoint(path)
        if checkpoint.class_name != "MultiHeadAttention":
            raise ValueError(
                f"{name} holds a {checkpoint.class_name}; only a MultiHeadAttention has a "
                "built-in counterpart in torch and Keras"
            )
        return checkpoint.weights, dict(checkpoint.config)
    try:
        if kind == "torch":
            weights, config = canonical_from_torch(_load_torch_file(name))
            return weights, {**config, "num_heads": None, "dropout": 0.0}
        read = canonical_from_flax if kind == "flax" else canonical_from_keras
        return read(_load_flax_file(name) if kind == "flax" else load_keras_file(name))
    except ValueError as error:  # the layer's problems, named with the file they are in
        raise ValueError(str(error) if name in str(error) else f"{name}: {error}") from None


def _load_torch_file(name: str, only_weights: bool = True) -> dict[str, Any]:
    """The state_dict of a torch file; with only_weights, every tensor must be a dense float
    one (a whole model's file also holds integer buffers: mha.porting checks what it uses)."""
    import torch

    try:
        check_zip_archive(name)
        state = torch.load(name, map_location="cpu", weights_only=True)
    except Exception as error:  # torch's restricted unpickler raises many kinds on bad bytes
        message = _torch_load_message(error)
        raise ValueError(
            f"{name} is not a torch state_dict file that loads with weights_only=True "
            f"(nothing in it was executed): {message}"
        ) from None
    if not isinstance(state, Mapping) or not all(
        isinstance(value, torch.Tensor) for value in state.values()
    ):
        raise ValueError(
            f"{name} does not hold a state_dict (a dict of tensors). "
            f"Received: {type(state).__name__}"
        )
    _check_storages(name, state, torch)
    for key, value in state.items() if only_weights else ():
        # Only plain dense float tensors are weights mha reads
        kind = (
            "a sparse"
            if value.layout != torch.strided
            else "a quantized"
            if value.is_quantized
            else "a meta (data-less)"
            if value.device.type == "meta"
            else None
        )
        if kind is None and value.dtype not in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
        ):
            kind = f"a {str(value.dtype).removeprefix('torch.')}"
        if kind is not None:
            raise ValueError(
                f"{name} holds {kind} tensor at {key!r}; mha reads dense float16, bfloat16, "
                "float32 and float64 weights"
            )
    return dict(state)


def _check_storages(name: str, state: Mapping[str, Any], torch) -> None:
    """Each dense tensor's elements within the bytes its storage holds: a view that repeats
    them (stride 0) would grow a file of a few bytes into gigabytes when read."""
    for key, value in state.items():
        if value.layout != torch.strided or value.device.type == "meta":
            continue
        size, stored = value.numel() * value.element_size(), value.untyped_storage().nbytes()
        if size > stored:
            raise ValueError(
                f"{name} holds a tensor at {key!r} of {size} bytes that repeats a storage of "
                f"{stored} (a view with a stride of 0); mha reads tensors stored whole"
            )


def _torch_load_message(error: Exception) -> str:
    """The first line of torch's refusal, without its terminal's bold, and the class it would
    have had to import (a whole pickled module, not a state_dict) where it names one."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    if not text:
        return repr(error)
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    named = (
        f" It would import {found.group(1)}: a pickled object, not a state_dict." if found else ""
    )
    return text.splitlines()[0].strip() + named


def _load_flax_file(name: str) -> Any:
    from flax import serialization

    with open(name, "rb") as file:
        first = file.read(1)
        # Flax's parameters are a msgpack map (fixmap, map 16 or map 32): anything else is
        # refused before the whole file is read
        if not first or not (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF)):
            raise ValueError(
                f"{name} is not a flax.serialization msgpack file of parameters: it does not "
                "begin with a map"
            )
        content = first + file.read()
    try:
        params = serialization.msgpack_restore(content)
    except Exception as error:  # msgpack raises its own kinds for every way bytes can be wrong
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise ValueError(
            f"{name} is not a flax.serialization msgpack file: {type(error).__name__}: {message}"
        ) from None
    if not isinstance(params, Mapping):
        raise ValueError(
            f"{name} holds a {type(params).__name__}, not the parameters of a Flax layer (a map)"
        )
    return params


def read_state(path: str | os.PathLike, *, lazily: bool = False) -> dict[str, Any]:
    """Every array of a whole model's weights, by name: a torch state_dict (.pt, .pth,
    loaded with weights_only=True), a safetensors file, the shards of a Hugging Face index
    (model.safetensors.index.json), a folder holding either, or Flax parameters (.msgpack,
    flattened with "."). Only data is read, never code.

    lazily: safetensors tensors as `mha.stored.StoredTensor`, each read when numpy takes it
    (`np.asarray`), the headers alone read now: what a port of one layer of a big model
    reads (mha.porting takes a path so).
    """
    if stored.is_whole_model(path) or (lazily and file_kind(path) == "mha"):
        tensors = stored.read_lazily(path)
        return tensors if lazily else {key: np.asarray(x) for key, x in tensors.items()}
    kind, name = file_kind(path), check_source(path)
    if kind == "torch":
        return _load_torch_file(name, only_weights=False)
    if kind == "flax":
        return layouts.flatten(_load_flax_file(name))
    if kind == "mha":
        return read_safetensors(path)[0]
    raise ValueError(
        f"{name}: a whole model's weights are read from .pt, .pth, .safetensors or .msgpack files"
    )


# ---------------------------------------------------------------------------------------------
# Writing


def write_file(
    path: str | os.PathLike,
    weights: Mapping[str, np.ndarray],
    *,
    num_heads: int | None = None,
    dropout: float = 0.0,
    scale: float | None = None,
    **options: Any,
) -> None:
    """Write canonical MultiHeadAttention weights as the file kind of `path`, atomically.

    An mha checkpoint holds the weights, class and config; a torch file the module's
    state_dict, saved with `torch.save`; a Keras file the layer's weights, as
    `keras.saving.save_weights` writes them; a Flax file the parameters (`flax_params`) as
    `flax.serialization.msgpack_serialize` writes them. num_heads is needed for every kind
    but torch's. The file is built in memory (the frameworks' writers never touch the disk),
    written beside `path` and read back as the same weights, bit for bit, before it replaces
    `path`: on any failure `path` is left as it was and nothing else is left beside it.
    `options` (the layer's rope_theta, rope_interleaved, sliding_window) are kept by an mha
    checkpoint only; fewer key-value heads go into mha and Keras files (GroupQueryAttention's
    weights).

    Raises:
        ValueError, TypeError: the kind cannot hold these weights, or they would not read back.
        OSError: the file could not be written (a framework's writer failed, a full disk, a
            file-size limit); `path` is left as it was.
    """
    kind = file_kind(path)
    if kind != "torch" and num_heads is None:
        raise ValueError(f"writing {FILE_KINDS[kind]} needs num_heads")
    if kind != "mha":
        # A Keras file holds grouped heads and a gate (to_keras refuses the gate where this
        # Keras has none)
        has = ("num_kv_heads", "output_gate") if kind == "keras" else ()
        check_expressible(weights, scale, FILE_KINDS[kind], kind != "torch", options, has)
    try:
        content = _file_bytes(kind, weights, num_heads, dropout, scale, options)
    except (ValueError, TypeError):
        raise
    except Exception as error:  # the frameworks' writers raise their own kinds
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        name = os.fspath(path)
        raise OSError(f"writing {name} failed: {message}; {name} is left as it was") from error

    def check(temporary: str) -> None:
        again, _ = read_file(temporary, num_heads=num_heads)
        if not _same_weights(again, weights):
            raise ValueError(f"{os.fspath(path)} would not read back as the same weights")

    write_atomically(path, content, suffix=_SUFFIXES[kind], check=check)


def _file_bytes(
    kind: str,
    weights: Mapping[str, np.ndarray],
    num_heads: int | None,
    dropout: float,
    scale: float | None,
    options: Mapping[str, Any],
) -> bytes:
    """The content of a file of `kind` holding `weights`, built in memory."""
    if kind == "torch":
        import torch

        from_numpy = load_backend("torch").from_numpy
        state = torch_state_dict(weights)
        buffer = io.BytesIO()
        torch.save({key: from_numpy(value) for key, value in state.items()}, buffer)
        return buffer.getvalue()
    if kind == "flax":
        from flax import serialization

        return serialization.msgpack_serialize(flax_params(weights, num_heads))
    layer = layer_from_weights(
        weights,
        num_heads,
        backend=_carrier(weights),
        dropout=dropout,
        scale=scale,
        **{key: value for key, value in options.items() if value not in (None, False)},
    )
    if kind == "mha":
        return checkpoint_bytes(layer)
    return keras_weights_bytes(to_keras(layer))


def _same_weights(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    # Bit for bit: NaN equals the same NaN, and -0.0 differs from 0.0
    def bits(x):
        x = np.asarray(x)
        return x.shape, x.dtype, np.ascontiguousarray(x).tobytes()

    return set(a) == set(b) and all(bits(a[key]) == bits(b[key]) for key in a)


def _carrier(weights: Mapping[str, np.ndarray]) -> str:
    """The backend whose layer carries `weights` into a file: numpy, unless numpy does not
    compute in their dtype (bfloat16); then torch, or TensorFlow without torch."""
    dtype = np.asarray(next(iter(weights.values()), np.zeros(0, "float32"))).dtype.name
    if dtype in layer_args.BACKEND_DTYPES["numpy"]:
        return "numpy"
    for backend in ("torch", "tensorflow"):
        try:
            load_backend(backend)
        except BackendUnavailableError:
            continue
        return backend
    raise ValueError(f"writing {dtype} weights to a file needs torch or tensorflow installed")


# ---------------------------------------------------------------------------------------------
# Converting


def convert(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    num_heads: int | None = None,
    prefix: str | None = None,
    scale: float | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Convert a MultiHeadAttention file to another kind, and check it by reading it back.

    The kinds (see `file_kind`): an mha checkpoint (.safetensors), a torch
    nn.MultiheadAttention state_dict (.pt, .pth), Keras MultiHeadAttention weights
    (.weights.h5) and Flax multi-head attention parameters (.msgpack). The config is inferred
    from the weights; a torch file does not tell the number of heads, so `num_heads` is needed
    when converting one to another kind. The destination is replaced only once the new file
    reads back as the same weights, bit for bit; on any failure it is left as it was.

    With `prefix`, the source is a whole model's weights (a torch state_dict .pt/.pth, a
    safetensors file such as a Hugging Face model.safetensors, the shards of its
    model.safetensors.index.json or a folder holding either, or Flax .msgpack parameters)
    and the attention layer under `prefix` is taken (of safetensors, its tensors alone are
    read), in any layout `mha.porting` reads. `options` (rope_theta, rope_interleaved,
    sliding_window) set what weights do not tell; only an mha checkpoint keeps them.

    Example:
        >>> mha.conversion.convert("attention.pt", "attention.weights.h5", num_heads=4)
        >>> mha.conversion.convert("bert.pt", "layer0.safetensors", num_heads=12,
        ...                        prefix="bert.encoder.layer.0.attention")

    Returns:
        The config the destination holds, read back; with `prefix`, "layout" (the layout
        found) and "left_out" (the names under the prefix that are not attention weights);
        "notes": what a port added that the source does not hold (each exact), and what of
        the source's config the destination does not (a framework's file: dropout, empty_rows).

    Raises:
        ValueError: a file that cannot be read, a configuration the destination cannot express
            (e.g. a query size other than num_hiddens for torch), num_heads missing, or a
            destination that does not read back as the same weights.
    """
    stored.refuse_overwriting(source, destination)
    weights, config, extra = _source_layer(source, num_heads, prefix, scale, options)
    if extra.get("layer", "MultiHeadAttention") != "MultiHeadAttention":
        _write_latent(destination, weights, config)
        return {**config, **extra}
    if config["num_heads"] is None and file_kind(destination) != "torch":
        raise ValueError(
            f"{os.fspath(source)} is a torch state_dict, which does not tell the number of "
            "heads: give num_heads"
        )
    write_file(
        destination,
        weights,
        num_heads=config["num_heads"],
        dropout=config["dropout"],
        scale=config["scale"],
        **options_of(config),
    )
    return _held(destination, config, extra)


def _held(destination: str | os.PathLike, config: Mapping[str, Any], extra: dict) -> dict:
    """`extra` beside the config `destination` holds, read back, with a note naming what of
    `config` it does not hold (a framework's file holds weights and sizes alone)."""
    _, held = read_file(destination, num_heads=config["num_heads"])
    lost = [
        key for key, value in config.items() if key in held and not same_setting(held[key], value)
    ]
    if lost:
        given = ", ".join(f"{key}={config[key]!r}" for key in lost)
        found = ", ".join(f"{key}={held[key]!r}" for key in lost)
        note = f"{os.fspath(destination)} does not hold {given}: read back, {found}"
        extra = {**extra, "notes": [*extra.get("notes", ()), note]}
    return {**held, **extra}


def _write_latent(path, weights: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> None:
    """A ported MultiHeadLatentAttention as an mha checkpoint, the one kind of file that holds
    it, replacing `path` only once it reads back as the same weights."""
    if file_kind(path) != "mha":
        raise ValueError(
            f"{os.fspath(path)}: multi-head latent attention goes into an mha checkpoint "
            "(.safetensors) only; the frameworks' own layers do not hold it"
        )
    layer = build_layer(load_backend(_carrier(weights)), "MultiHeadLatentAttention", config)
    set_weights(layer, weights)

    def check(temporary: str) -> None:
        if not _same_weights(read_checkpoint(temporary).weights, weights):
            raise ValueError(f"{os.fspath(path)} would not read back as the same weights")

    write_atomically(path, checkpoint_bytes(layer), suffix=_SUFFIXES["mha"], check=check)


def _source_layer(
    source: str | os.PathLike,
    num_heads: int | None,
    prefix: str | None,
    scale: float | None,
    options: Mapping[str, Any],
) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """(weights, config, what a port adds to the result) of the layer `convert` reads."""
    if prefix is not None:
        port = porting.canonical_from_state_dict(
            read_state(source, lazily=True), prefix, num_heads=num_heads, scale=scale, **options
        )
        extra = {"layout": port.layout, "left_out": port.left_out, "notes": list(port.notes)}
        extra["layer"] = port.layer
        return port.weights, port.config, extra
    if stored.is_whole_model(source):
        raise ValueError(f"{os.fspath(source)} holds a whole model's weights: give prefix")
    options = dict(options)
    shapes = shapes_given(options)  # the config's heads, which the file's must be
    chunks = options.pop(LOCAL_CHUNKS, None)  # CANINE's initial character encoder's
    check_untold_options(options)
    weights, config = read_file(source, num_heads=num_heads)
    check_heads(config, shapes, f"in {os.fspath(source)}")
    if chunks is not None and config.get("attention_chunk_size") is None:
        raise local_chunks_untold(chunks, os.fspath(source))
    if scale is not None:
        config["scale"] = scale
    config.update(options)
    return weights, config, {}
