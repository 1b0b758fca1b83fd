"""The backend adapter: what mha's glue (weights and files, the harness, golden files, the
converters) needs from a backend beside its layers, declared once.

Each module of mha/backends ends with `ADAPTER = Adapter(...)` naming its own functions; the
glue reaches them only through it (`load_backend(name).ADAPTER`), so what a backend offers is
read from one declaration, not probed for. The layer classes stay in the module a learner
reads, above it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A backend's conversion and gradient hooks.

    to_numpy(x), from_numpy(array): tensors to and from numpy arrays (bfloat16 as ml_dtypes').
    layer_config(layer): the constructor arguments of a built layer, sizes and dtype included.
    parameters: {kind: (attribute, transposed)}, how a sub-layer holds each kind of canonical
        weight ("kernel", "bias", "scale", "shift", "table"); see mha.weights.
    read_parameter(parameter, transposed), write_parameter(sublayer, kind, value): one weight
        as a canonical numpy array, out of and into a layer.
    without_gradients(): a context in which calls record no gradients.
    value_and_gradients(function, tensors, wrt, layer, cotangent): the output and the
        gradients of sum(output * cotangent), for mha.harness; None without autograd.
    to_device(x, device): a tensor or layer on "cpu" or "gpu"; None where mha does not place
        the framework's arrays (they stay where the framework puts them).
    """

    to_numpy: Callable[[Any], np.ndarray]
    from_numpy: Callable[[Any], Any]
    layer_config: Callable[[Any], dict[str, Any]]
    parameters: Mapping[str, tuple[str, bool]]
    read_parameter: Callable[[Any, bool], np.ndarray]
    write_parameter: Callable[[Any, str, np.ndarray], None]
    without_gradients: Callable[[], AbstractContextManager]
    value_and_gradients: Callable[..., Any] | None = None
    to_device: Callable[[Any, str], Any] | None = None

    @property
    def autograd(self) -> bool:
        return self.value_and_gradients is not None
