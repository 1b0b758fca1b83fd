"""A whole model's safetensors weights, read as they are used: one file, the shards that a
Hugging Face index (model.safetensors.index.json) names, or a folder holding either.

Only the headers are read at first, each checked as `mha.checkpoints` checks a whole file; a
tensor's bytes are read when numpy takes it (`np.asarray`), so that porting one layer of a
model of many gigabytes reads that layer's tensors alone, from whichever shards hold them.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import numpy as np

from mha.checkpoints import (
    Entry,
    corrupt_error,
    safetensors_array,
    safetensors_dtype,
    safetensors_layout,
)
from mha.files import check_source, parse_json, read_bytes

__all__ = [
    "INDEX_SUFFIX",
    "StoredTensor",
    "is_whole_model",
    "read_lazily",
    "refuse_overwriting",
    "shard_hint",
]

INDEX_SUFFIX = ".safetensors.index.json"
# The files a folder of a model holds, one of them
_MODEL_FILES = ("model" + INDEX_SUFFIX, "model.safetensors")
_MAX_INDEX_BYTES = 100_000_000
_SHARD = re.compile(r"-\d+-of-\d+\.safetensors$", re.IGNORECASE)


class StoredTensor:
    """One tensor of a safetensors file: its name, shape and dtype from the file's checked
    header, its numbers read from the file when numpy asks for them (`np.asarray`)."""

    def __init__(self, path: str, entry: Entry, start: int, stamp: tuple):
        self.path, self.entry = path, entry
        # Where the data starts in the file, and the file as it was when its header was read
        self._start, self._stamp = start, stamp

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry.shape)

    @property
    def dtype(self) -> np.dtype:
        return safetensors_dtype(self.entry.dtype)

    @property
    def ndim(self) -> int:
        return len(self.entry.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False:  # numpy 2's protocol: the numbers are read from the file, a copy
            raise ValueError(f"{self!r} is read from its file: np.asarray makes a new array")
        begin, end = self._start + self.entry.begin, self._start + self.entry.end
        with open(check_source(self.path), "rb") as file:
            # The header's checks hold for the file as it was then: a file since rewritten
            # could give other bytes, or fewer, under the same entry
            if _stamp(file) != self._stamp:
                raise ValueError(f"{self.path} changed after its header was read")
            file.seek(begin)
            data = file.read(end - begin)
        if len(data) != end - begin:
            raise ValueError(f"{self.path} changed after its header was read")
        array = safetensors_array(data, self.entry, corrupt_error(self.path))
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        return f"StoredTensor({self.entry.key!r}, shape={self.shape}, dtype={self.dtype.name})"


def is_whole_model(path: str | os.PathLike) -> bool:
    """Whether `path` names a model's weights that only `read_lazily` reads: a folder, or an
    index of shards."""
    return os.path.isdir(path) or os.fsdecode(path).lower().endswith(INDEX_SUFFIX)


def shard_hint(path: str | os.PathLike) -> str:
    """What to add to an error about `path` where it is one shard of a model (named as
    transformers names them, model-00001-of-00004.safetensors): a layer may go on in another."""
    name = os.fsdecode(path)
    if not _SHARD.search(os.path.basename(name)):
        return ""
    return f" ({name} is one shard of a model: give its model{INDEX_SUFFIX} or its folder)"


def refuse_overwriting(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Raise ValueError where `destination` is a file that `source` reads: the file itself,
    or of a whole model its index and the shards the index names (a write there would replace
    the model being read with one layer)."""
    name, target = os.fsdecode(source), os.fsdecode(destination)
    if not os.path.isfile(target):
        return
    files = [name]
    if os.path.isdir(name):
        files = [os.path.join(name, file) for file in _MODEL_FILES]
    for index in [file for file in files if file.lower().endswith(INDEX_SUFFIX)]:
        with contextlib.suppress(OSError, ValueError):  # a bad index is read's to refuse
            shards = set(_weight_map(index).values())
            files += [os.path.join(os.path.dirname(index), shard) for shard in shards]
    for file in files:
        if os.path.isfile(file) and os.path.samefile(file, target):
            raise ValueError(
                f"{target} is {'' if file == name else 'a file of '}the source being read "
                f"({name}); write the layer to another file: nothing was written"
            )


def read_lazily(path: str | os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file, of the shards that an index names, or of the model
    in a folder (its model.safetensors.index.json or its model.safetensors), by name.

    Raises:
        ValueError: a file that is not safetensors (by name or content), an index that is not
            one, a shard that is not beside its index or lacks a tensor the index places
            there, a name in two shards, a folder holding neither file or both.
        OSError: a file cannot be read, or `path` does not exist.
    """
    name = os.fsdecode(path)
    if not os.path.exists(name):
        raise FileNotFoundError(f"{name} does not exist")
    if not is_whole_model(name) and not name.lower().endswith(".safetensors"):
        raise ValueError(
            f"{name}: a path of a model's weights is read as safetensors (.safetensors, "
            f"model{INDEX_SUFFIX}, or a folder); read other files with "
            "mha.conversion.read_state and give their state"
        )
    if os.path.isdir(name):
        found = [os.path.join(name, file) for file in _MODEL_FILES]
        found = [file for file in found if os.path.isfile(file)]
        if not found:
            raise ValueError(f"{name} holds neither {' nor '.join(_MODEL_FILES)}")
        if len(found) > 1:  # two sets of weights: either could be the model's
            raise ValueError(f"{name} holds both {' and '.join(_MODEL_FILES)}: give the one")
        name = found[0]
    if name.lower().endswith(INDEX_SUFFIX):
        return _read_index(name)
    return _read_file(name)


def _read_file(path: str) -> dict[str, StoredTensor]:
    name = check_source(path)
    with open(name, "rb") as file:
        entries, _, start = safetensors_layout(file, name)
        stamp = _stamp(file)
    return {entry.key: StoredTensor(name, entry, start, stamp) for entry in entries}


def _stamp(file: Any) -> tuple:
    """What tells an open file from another or from itself rewritten: its inode, size and the
    time it last changed (to the nanosecond)."""
    status = os.fstat(file.fileno())
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _read_index(path: str) -> dict[str, StoredTensor]:
    """The tensors of every shard an index names: all of each (a tensor the index left out is
    still the model's), each name in one shard alone, the one the index places it in."""
    weight_map = _weight_map(path)
    folder = os.path.dirname(path)
    state: dict[str, StoredTensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not os.path.exists(os.path.join(folder, shard)):
            raise FileNotFoundError(
                f"{path} names the shard {shard}, which is not beside it: every shard the "
                "index names is read (their headers), so give them all"
            )
        for key, tensor in _read_file(os.path.join(folder, shard)).items():
            if key in state:
                raise ValueError(
                    f"{path}: {key!r} is in two shards, {os.path.basename(state[key].path)} "
                    f"and {shard}; either could be the weight"
                )
            state[key] = tensor
    for key, shard in weight_map.items():
        held = state.get(key)
        if held is None or os.path.basename(held.path) != shard:
            raise ValueError(f"{path} places {key!r} in {shard}, which does not hold it")
    return state


def _weight_map(path: str) -> dict[str, str]:
    """An index's weight_map, tensor name -> shard file, each shard a file name beside it."""
    try:
        index = parse_json(read_bytes(path, _MAX_INDEX_BYTES))
    except ValueError as error:
        raise ValueError(f"{path} is not a safetensors index: {error}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{path} is not a safetensors index: no weight_map of names to files")
    if not weight_map:
        raise ValueError(f"{path} is a safetensors index of no tensor: its weight_map is empty")
    for key, shard in weight_map.items():
        # A shard is named by its file alone: the index reads nothing outside its folder
        if shard in ("", ".", "..") or os.path.basename(shard) != shard or "\\" in shard:
            raise ValueError(f"{path} places {key!r} in {shard!r}, not a file beside it")
    return weight_map
