"""Canonical weights: one format for every backend.

The canonical weights of a layer are a plain `dict[str, numpy.ndarray]` computing
`y = x @ W + b`, with W of shape (in, out), whatever layout the framework keeps internally:

    MultiHeadAttention   W_q (query_size, num_hiddens), W_k (key_size, num_hiddens),
                         W_v (value_size, num_hiddens), W_o (num_hiddens, out_features);
                         with bias=True also b_q, b_k, b_v (num_hiddens,), and with
                         out_bias (None: bias) b_o (out_features,)
    MultiHeadLatentAttention  W_q (num_hiddens, num_heads (nope + rope)), or W_qa
                         (num_hiddens, q_lora_rank), W_qb (q_lora_rank, num_heads (nope
                         + rope)), q_norm (q_lora_rank,); W_kva (num_hiddens, kv_lora_rank
                         + rope), W_kvb (kv_lora_rank, num_heads (nope + v)), kv_norm
                         (kv_lora_rank,), W_o (num_heads v, num_hiddens); with bias=True
                         also b_qa, b_kva, b_o (nope, rope, v: the head dims)
    AdditiveAttention    W_q (query_size, num_hiddens), W_k (key_size, num_hiddens),
                         w_v (num_hiddens, 1)
    AddNorm              gamma (num_hiddens,), beta (num_hiddens,)
    LearnedPositionalEncoding  P (max_len, num_hiddens), row i added at position i
    DotProductAttention, PositionalEncoding, RotaryEmbedding: {}

With num_kv_heads (grouped-query attention), W_k and W_v are (size, num_kv_heads * head size)
and b_k, b_v (num_kv_heads * head size,), the head size being num_hiddens / num_heads.

`get_weights`, `set_weights` and `random_weights` read, write and make them on a layer of any
backend. Their files, safetensors checkpoints that record the layer's class and config, are
`mha.checkpoints`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mha import options, validation
from mha.registry import backend_of, load_backend
from mha.tensors import format_shape

__all__ = [
    "LAYER_CLASSES",
    "build_layer",
    "get_weights",
    "random_weights",
    "set_weights",
    "weight_shapes",
]

# Layer class -> its options (its constructor's arguments), in the order of mha.options'
# table, which configs follow (not the signatures' order)
LAYER_CLASSES: dict[str, tuple[str, ...]] = {
    layer: tuple(option.name for option in options.layer_options(layer)) for layer in options.LAYERS
}


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
        if config.get("sinks", False):  # one logit per head
            shapes["sinks"] = (config["num_heads"],)
        if config.get("output_gate", False):  # the gate's projection, from the queries
            shapes["W_g"] = (config.get("query_size"), n)
            if config.get("bias", False):
                shapes["b_g"] = (n,)
        if config.get("qk_norm") in ("head", "head_after_rotary"):  # one scale of the head size
            shapes.update(
                {"q_norm": (n // config["num_heads"],), "k_norm": (n // config["num_heads"],)}
            )
        elif config.get("qk_norm") == "projection":
            shapes.update({"q_norm": (n,), "k_norm": (kv,)})
        elif config.get("qk_norm") == "layer_norm_per_head":  # a scale for each head
            head = n // config["num_heads"]
            shapes.update({"q_norm": (config["num_heads"], head), "k_norm": (kv // head, head)})
        return shapes
    if class_name == "MultiHeadLatentAttention":
        return _latent_shapes(config)
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
    raise _unknown_class(class_name)


def _unknown_class(class_name: Any) -> ValueError:
    return ValueError(
        f"Unknown layer class. Valid names: {', '.join(LAYER_CLASSES)}. Received: {class_name!r}"
    )


def _latent_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """MultiHeadLatentAttention's weights, in the order of its places: queries through W_q,
    or W_qa, q_norm and W_qb; the latent and the rotary key through W_kva and kv_norm; each
    head's key part and value through W_kvb."""
    n, heads, rank = config["num_hiddens"], config["num_heads"], config["kv_lora_rank"]
    nope, rope, v = (config[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_rank = config.get("q_lora_rank")
    shapes = {
        "W_q": (n, heads * (nope + rope)),
        "W_qa": (n, q_rank),
        "W_qb": (q_rank, heads * (nope + rope)),
        "W_kva": (n, rank + rope),
        "W_kvb": (rank, heads * (nope + v)),
        "W_o": (heads * v, n),
        "b_qa": (q_rank,),
        "b_kva": (rank + rope,),
        "b_o": (n,),
        "q_norm": (q_rank,),
        "kv_norm": (rank,),
    }
    return {name: shapes[name] for name in _latent_places(q_rank, config.get("bias", False))}


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
    class_name: str,
    bias: bool = False,
    out_bias: bool | None = None,
    qk_norm: str | None = None,
    sinks: bool = False,
    output_gate: bool = False,
    q_lora_rank: int | None = None,
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
        if sinks:  # each head's sink logit, held as the bias of the sub-layer sink_logits
            places["sinks"] = ("sink_logits", "bias")
        if output_gate:  # the gate's projection of the queries, biased as they are
            places["W_g"] = ("W_g", "kernel")
            if bias:
                places["b_g"] = ("W_g", "bias")
        if qk_norm is not None:  # the scales of the RMSNorms of queries and keys
            places.update({"q_norm": ("q_norm", "scale"), "k_norm": ("k_norm", "scale")})
        return places
    if class_name == "MultiHeadLatentAttention":
        return _latent_places(q_lora_rank, bias)
    if class_name == "AdditiveAttention":
        return {name: (name, "kernel") for name in ("W_q", "W_k", "w_v")}
    if class_name == "AddNorm":
        return {"gamma": ("ln", "scale"), "beta": ("ln", "shift")}
    if class_name == "LearnedPositionalEncoding":
        return {"P": ("embedding", "table")}
    return {}


def _latent_places(q_lora_rank: int | None, bias: bool) -> dict[str, tuple[str, str]]:
    """weight_places of MultiHeadLatentAttention."""
    kernels = ("W_q",) if q_lora_rank is None else ("W_qa", "W_qb")
    places = {name: (name, "kernel") for name in (*kernels, "W_kva", "W_kvb", "W_o")}
    if bias:  # as DeepSeek's: the first projections and the output's
        biased = ("W_kva", "W_o") if q_lora_rank is None else ("W_qa", "W_kva", "W_o")
        places.update({f"b_{name[2:]}": (name, "bias") for name in biased})
    norms = ("kv_norm",) if q_lora_rank is None else ("q_norm", "kv_norm")
    places.update({name: (name, "scale") for name in norms})
    return places


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
    if class_name == "MultiHeadLatentAttention":
        return weight_places(class_name, layer.bias, q_lora_rank=layer.q_lora_rank)
    if class_name != "MultiHeadAttention":
        return weight_places(class_name)
    return weight_places(
        class_name, layer.bias, layer.out_bias, layer.qk_norm, layer.sinks, layer.output_gate
    )


def _export_weights(backend: Any, layer: Any) -> dict[str, np.ndarray]:
    adapter = backend.ADAPTER
    parameters = canonical_parameters(layer, adapter.parameters)
    return {name: adapter.read_parameter(*held) for name, held in parameters.items()}


def import_weights(backend: Any, layer: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """Write checked canonical arrays into the layer's parameters, through its backend."""
    for name, (sublayer, kind) in _weight_places_of(layer).items():
        backend.ADAPTER.write_parameter(getattr(layer, sublayer), kind, arrays[name])


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
    return f"shape {format_shape(value.shape)} and dtype {value.dtype}"


def find_problems(
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
            problems.append(f"missing {name}: expected shape {format_shape(shapes[name])}")
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
                f"{name} has {_describe_array(value)}; expected shape {format_shape(expected)}"
            )
        elif value.dtype.name != dtype:
            problems.append(
                f"{name} has {_describe_array(value)}; expected dtype {dtype} (the layer's dtype)"
            )
        else:
            arrays[name] = value
    return problems, arrays


def raise_problems(what: str, class_name: str, config: Mapping[str, Any], problems: list[str]):
    """One ValueError listing every problem `find_problems` found for the layer."""
    count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
    lines = "\n".join(f"  - {problem}" for problem in problems)
    raise ValueError(f"{what} found {count} for {_describe_layer(class_name, config)}:\n{lines}")


def layer_info(layer: Any) -> tuple[Any, str, dict[str, Any]]:
    class_name = _layer_class_name(layer)
    backend = load_backend(backend_of(layer))
    return backend, class_name, backend.ADAPTER.layer_config(layer)


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
    problems, arrays = find_problems(class_name, config, weights)
    if problems:
        raise_problems("set_weights", class_name, config, problems)
    import_weights(backend, layer, arrays)


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
        if class_name not in LAYER_CLASSES:
            raise _unknown_class(class_name)
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
        if key in ("gamma", "q_norm", "k_norm", "kv_norm"):  # scales of norms: near 1
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


def in_dtype(name: str, array: np.ndarray, dtype: str) -> np.ndarray:
    """A weight cast to the dtype named, or a ValueError where a finite number would be inf
    there (a bfloat16 checkpoint's weight past 65504 held in float16)."""
    with np.errstate(over="ignore"):
        cast = array.astype(numpy_dtype(dtype))
    if not np.isfinite(cast).all():  # each a float dtype (ml_dtypes' bfloat16 of kind "V")
        overflowed = np.isfinite(array) & ~np.isfinite(cast)
        if overflowed.any():
            largest = float(np.abs(array[overflowed].astype(np.float64)).max())
            raise ValueError(
                f"{name} holds {largest:g}, past {dtype}'s largest number: it would be inf "
                f"there. Hold the weights in a wider dtype"
            )
    return cast


def _layer_class_name_of_type(cls: type) -> str:
    for base in cls.__mro__:
        if base.__name__ in LAYER_CLASSES and base.__module__.startswith("mha.backends."):
            return base.__name__
    raise TypeError(f"Expected an mha layer class. Received: {cls.__qualname__}")


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


def build_layer(module: Any, class_name: str, config: Mapping[str, Any]) -> Any:
    """A new `class_name` layer of backend `module` from its constructor arguments."""
    positional = [key for key in LAYER_CLASSES[class_name] if key in ("num_hiddens", "num_heads")]
    return getattr(module, class_name)(
        *(config[key] for key in positional),
        **{key: value for key, value in config.items() if key not in positional},
    )


# The files' names, which moved to mha.checkpoints (which imports this module): looked up there
# on first use, so that mha.weights.read_checkpoint and the rest still work
MOVED_TO_CHECKPOINTS = (
    "Checkpoint",
    "FORMAT",
    "FORMAT_VERSION",
    "checkpoint_bytes",
    "load",
    "load_weights",
    "read_checkpoint",
    "read_safetensors",
    "safetensors_bytes",
    "save",
    "save_weights",
    "write_safetensors",
)


def __getattr__(name: str) -> Any:
    if name in MOVED_TO_CHECKPOINTS:
        from mha import checkpoints

        return getattr(checkpoints, name)
    raise AttributeError(f"module 'mha.weights' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(MOVED_TO_CHECKPOINTS))
