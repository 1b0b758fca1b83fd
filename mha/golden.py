"""Golden cases: recorded numbers that every backend must reproduce, on any machine or lane.

A case holds a layer (class, config, canonical weights), the arrays and options of one call,
and the numbers some computation gave for it: the output, the attention weights, and the
gradients of sum(output * cotangent) where they were recorded. It is a safetensors file, read
with numpy alone, so that a case recorded with MXNet in one environment verifies with JAX in
another.

    >>> mha.golden.record("bert.safetensors", [mha.golden.case_of(layer, inputs, output)])
    >>> rows = mha.golden.verify("bert.safetensors")      # every installed backend
    >>> mha.golden.verify_layer(layer, inputs, output)    # the same, in one call, no file

`mha compare --record CASES.safetensors` records the run's cases as the first backend named
computes them; `mha verify CASES.safetensors` runs them again (see docs/cli.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mha import harness, validation
from mha.cases import FLOAT_MASKS, FUNCTION_SIZES
from mha.checkpoints import check_sizes_asked, read_safetensors, write_safetensors
from mha.files import parse_json
from mha.interop.common import as_numpy
from mha.layer_args import SMALLEST_NORMAL
from mha.options import layer_defaults
from mha.registry import framework_version, load_backend, normalize_backend_name, select_backends
from mha.weights import LAYER_CLASSES, find_problems, get_weights, layer_info

__all__ = [
    "GoldenCase",
    "case_of",
    "read",
    "record",
    "record_run",
    "report_title",
    "tolerance_dtype",
    "verify",
    "verify_layer",
]

FORMAT = "mha-golden"
FORMAT_VERSION = "1"
# The call's options that are not arrays
_OPTIONS = ("causal", "need_weights", "absorbed", "offset", "alignment", "cached")
# What each layer's call takes as arrays, in harness.call_layer's names
_ARRAYS = {
    "masked_softmax": ("X", "valid_lens"),
    "PositionalEncoding": ("X",),
    "RotaryEmbedding": ("X",),
    "LearnedPositionalEncoding": ("X",),
    "AddNorm": ("X", "Y"),
    "MultiHeadLatentAttention": ("X", "valid_lens", "mask", "window_mask", "attn_bias"),
}
_ATTENTION_ARRAYS = (
    "queries",
    "keys",
    "values",
    "valid_lens",
    "mask",
    "window_mask",
    "head_mask",
    "attn_bias",
    "segment_ids",
)
# The attention function's options a case's config may hold, beside its inputs' heads
_FUNCTION_OPTIONS = ("scale", "softcap", "window", "empty_rows", *FUNCTION_SIZES, "dtype")


@dataclasses.dataclass
class GoldenCase:
    """One recorded call and its numbers.

    inputs: the call's arrays (queries, keys, values, valid_lens, masks; X and Y for the other
    layers; query, key and value for the attention function) and its options (causal,
    alignment, need_weights, absorbed), by harness.call_layer's names; self-attention passes
    queries alone. gradients: keyed by input names and canonical weight
    names, of sum(output * cotangent); None when not recorded.
    """

    name: str
    layer: str
    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    inputs: dict[str, Any]
    output: np.ndarray
    attention_weights: np.ndarray | None = None
    cotangent: np.ndarray | None = None
    gradients: dict[str, np.ndarray] | None = None
    recorded_with: str = ""

    @property
    def dtype(self) -> str:
        return np.asarray(self.output).dtype.name


def case_of(
    layer: Any,
    inputs: Mapping[str, Any],
    output: Any,
    attention_weights: Any = None,
    *,
    name: str = "case",
    recorded_with: str = "",
) -> GoldenCase:
    """A case from a user's own mha layer (any backend), the inputs of one call and the
    numbers expected of it, for example captured from the layer it was ported from.

    inputs: "queries", "keys", "values" (keys and values default to queries), "valid_lens",
    "mask", "causal", "alignment", "window_mask", "head_mask", "attn_bias", "segment_ids",
    "need_weights"
    (MultiHeadLatentAttention: "X", "valid_lens", "mask", "causal", "window_mask",
    "attn_bias", "need_weights", "absorbed"); arrays of any framework.
    """
    _, class_name, config = layer_info(layer)
    known = _ARRAYS.get(class_name, _ATTENTION_ARRAYS) + _OPTIONS
    unknown = sorted(set(inputs) - set(known))
    if unknown:
        raise ValueError(
            f"{class_name} takes no input {', '.join(unknown)}. Valid: {', '.join(known)}"
        )
    arrays = {
        key: value if key in _OPTIONS else as_numpy(value)
        for key, value in inputs.items()
        if value is not None
    }
    return GoldenCase(
        name,
        class_name,
        dict(config),
        get_weights(layer),
        arrays,
        as_numpy(output),
        None if attention_weights is None else as_numpy(attention_weights),
        recorded_with=recorded_with,
    )


# ---------------------------------------------------------------------------------------------
# Files


def record(path: str | os.PathLike, cases: Sequence[GoldenCase]) -> None:
    """Write cases to a safetensors file, atomically (see mha.checkpoints.write_safetensors)."""
    tensors, described = {}, []
    for index, case in enumerate(cases):
        arrays = {
            f"inputs/{key}": value for key, value in case.inputs.items() if key not in _OPTIONS
        }
        arrays.update({f"weights/{key}": value for key, value in case.weights.items()})
        arrays["output"] = case.output
        if case.attention_weights is not None:
            arrays["attention_weights"] = case.attention_weights
        if case.gradients is not None:
            arrays["cotangent"] = case.cotangent
            arrays.update({f"gradients/{key}": value for key, value in case.gradients.items()})
        tensors.update({f"{index}/{key}": np.asarray(value) for key, value in arrays.items()})
        described.append(
            {
                "name": case.name,
                "layer": case.layer,
                "config": case.config,
                "options": {key: case.inputs[key] for key in _OPTIONS if key in case.inputs},
                "recorded_with": case.recorded_with,
            }
        )
    write_safetensors(
        path,
        tensors,
        {"format": FORMAT, "format_version": FORMAT_VERSION, "cases": json.dumps(described)},
    )


def read(path: str | os.PathLike) -> list[GoldenCase]:
    """The cases of a file written by `record` (or `mha compare --record`).

    Raises:
        ValueError: not a golden-case file, or cases whose arrays are missing.
    """
    name = os.fspath(path)
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"{name} is not an mha golden-case file (its format is "
            f"{metadata.get('format')!r}; mha compare --record writes them)"
        )
    try:
        described = parse_json(metadata["cases"])
        if not isinstance(described, list) or not all(isinstance(d, dict) for d in described):
            raise ValueError("its case list is not a list of objects")
        if not described:
            raise ValueError("its case list is empty: there is nothing to verify")
        cases = [_case_of_entry(index, entry, tensors) for index, entry in enumerate(described)]
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"{name} is not a valid golden-case file: {error!r}") from None
    except ValueError as error:
        raise ValueError(f"{name} is not a valid golden-case file: {error}") from None
    return cases


def _case_of_entry(
    index: int, entry: Mapping[str, Any], tensors: Mapping[str, np.ndarray]
) -> GoldenCase:
    """Case `index` of a golden-case file: its entry in the file's case list, with its arrays
    (named "index/...") among the file's tensors."""
    layer = entry["layer"]
    if layer not in harness.FUNCTIONS and layer not in LAYER_CLASSES:
        raise ValueError(f"case {index} names an unknown layer {layer!r}")
    arrays = {
        key[len(f"{index}/") :]: value
        for key, value in tensors.items()
        if key.startswith(f"{index}/")
    }

    def group(prefix):
        return {
            key[len(prefix) :]: value for key, value in arrays.items() if key.startswith(prefix)
        }

    if not isinstance(entry["config"], dict) or not isinstance(entry.get("options", {}), dict):
        raise ValueError(f"case {index}'s config and options are not both objects")
    config, weights = dict(entry["config"]), group("weights/")
    unknown = sorted(set(config) - set(_FUNCTION_OPTIONS))
    if layer == "dot_product_attention" and unknown:
        raise ValueError(f"case {index}'s attention function takes no {', '.join(unknown)}")
    if layer == "dot_product_attention" and isinstance(config.get("window"), list):
        config["window"] = tuple(config["window"])  # a pair (left, right), a list in JSON
    if layer not in harness.FUNCTIONS:
        # The sizes the layer is built with, before it is: bounded by the file's weights
        check_sizes_asked(f"case {index}", layer, {**layer_defaults(layer), **config})
        problems, _ = find_problems(layer, config, weights)
        if problems:
            raise ValueError(f"case {index}'s weights do not fit its {layer}: {problems[0]}")
    options = entry.get("options", {})
    # causal, need_weights and absorbed are booleans, offset a non-negative integer, alignment
    # a name or an integer (its value checked by the call)
    offset, alignment = options.get("offset", 0), options.get("alignment", 0)
    if not (
        all(isinstance(options.get(key, True), bool) for key in _OPTIONS[:3])
        and type(offset) is int
        and offset >= 0
        and type(alignment) in (int, str)
    ):
        raise ValueError(f"case {index} has options of the wrong types: {options}")
    return GoldenCase(
        str(entry["name"]),
        layer,
        config,
        weights,
        {**group("inputs/"), **options},
        arrays["output"],
        arrays.get("attention_weights"),
        arrays.get("cotangent"),
        group("gradients/") or None,
        str(entry.get("recorded_with", "")),
    )


# ---------------------------------------------------------------------------------------------
# Recording a run and verifying cases


def record_run(
    path: str | os.PathLike,
    backend: str,
    cases: Iterable[harness.Case] | None = None,
    dtype: str = "float32",
    seed: int = 0,
    shapes: harness.Shapes | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[GoldenCase]:
    """Record harness cases (default: mha compare's) as `backend` computes them, with its
    gradients where it has autograd, and write them to `path`."""
    backend = normalize_backend_name(backend)
    module = load_backend(backend)
    cases = list(harness.default_cases() if cases is None else cases)
    recorded = []
    for done, case in enumerate(cases):
        if progress is not None:
            progress(done, len(cases), f"{case.id} on {backend}")
        prepared = harness.prepare(case, shapes or harness.Shapes(), dtype, seed, gradients=False)
        case = prepared.case  # with the sizes of its own it takes where those given do not fit
        cotangent = None
        if module.ADAPTER.autograd:
            rng = np.random.default_rng(seed + 1)
            cotangent = rng.standard_normal(prepared.reference.output.shape).astype(dtype)
        result = harness.run_case(
            backend, case, prepared.inputs, prepared.weights, prepared.config, cotangent
        )
        inputs = dict(prepared.inputs)
        if "self" in case.masks:
            inputs = {key: value for key, value in inputs.items() if key not in ("keys", "values")}
        recorded.append(
            GoldenCase(
                case.id,
                case.layer,
                dict(prepared.config),
                dict(prepared.weights),
                inputs,
                result.output,
                result.attention_weights,
                cotangent,
                result.gradients,
                f"{backend} {_version(backend)}",
            )
        )
    record(path, recorded)
    return recorded


def _version(backend: str) -> str:
    return framework_version(backend) or ""


def verify(
    source: str | os.PathLike | Sequence[GoldenCase],
    backends: Sequence[str] | None = None,
    dtype: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[harness.Row]:
    """Run recorded cases on `backends` (default: every installed one) and compare each
    backend's numbers with the recorded ones.

    dtype: the dtype to run in (default: each case's own). The tolerance is that of the less
    precise of the two: float64 within 1e-10 absolute, float32 within 1e-5 of the scale.

    Returns:
        One harness.Row per case and backend: output_difference, weights_difference, and in
        gradient_agreement the gradients' difference where the case has gradients and the
        backend autograd. A backend that raises gives a failed row with the error.
    """
    cases = read(source) if isinstance(source, (str, os.PathLike)) else list(source)
    names, _ = select_backends(",".join(backends) if backends else None)
    wide = "jax" in names and "float64" in {dtype, *(case.dtype for case in cases)}
    rows, total = [], len(cases) * len(names)
    with _jax_64_bit_mode() if wide else contextlib.nullcontext():
        for index, case in enumerate(cases):
            for position, backend in enumerate(names):
                if progress is not None:
                    progress(index * len(names) + position, total, f"{case.name} on {backend}")
                rows.append(_verify_one(case, backend, dtype or case.dtype))
    return rows


def _jax_64_bit_mode() -> contextlib.AbstractContextManager:
    """JAX's 64-bit mode, in which alone it computes in float64, for this thread while the
    context lasts (JAX's own scoped switch): the caller's JAX code keeps its setting, a
    scoped one of its own included."""
    import jax

    if hasattr(jax, "enable_x64"):  # jax 0.8 on
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def verify_layer(
    layer: Any,
    inputs: Mapping[str, Any],
    output: Any,
    attention_weights: Any = None,
    backends: Sequence[str] | None = None,
    dtype: str | None = None,
) -> list[harness.Row]:
    """Prove in one call that `layer`, rebuilt in every backend, gives `output` (and
    `attention_weights`) on `inputs`: `verify([case_of(layer, inputs, output, ...)])`."""
    return verify([case_of(layer, inputs, output, attention_weights)], backends, dtype)


def report_title(path: str, cases: Sequence[GoldenCase], rows: Sequence[harness.Row]) -> str:
    """mha verify's title: the file, what recorded its cases, and whether their gradients
    went unchecked (no backend of the run has autograd)."""
    recorded = sorted({case.recorded_with for case in cases if case.recorded_with})
    unchecked = any(case.gradients is not None for case in cases) and all(
        row.gradient_agreement is None for row in rows
    )
    return (
        f"Largest differences from the numbers recorded in {path} "
        f"({', '.join(recorded) or 'recorded elsewhere'}; {len(cases)} cases"
        + ("; their gradients unchecked: no backend here has autograd" if unchecked else "")
        + ")."
    )


def tolerance_dtype(dtype: str, recorded: str) -> str:
    """The dtype whose tolerance holds a run in `dtype` of numbers recorded in `recorded`:
    the less precise of the two."""
    return "float64" if {dtype, recorded} == {"float64"} else "float32"


def _verify_one(case: GoldenCase, backend: str, dtype: str) -> harness.Row:
    precision = tolerance_dtype(dtype, case.dtype)
    relative = precision != "float64"
    try:
        result = _run_recorded(case, backend, dtype)
    except Exception as error:  # a crash is a disagreement, reported with its cause
        failure = f"{type(error).__name__}: {error}"
        return harness.Row(case.name, backend, dtype, None, None, None, None, None, False, failure)
    output_difference = _difference(result.output, case.output, relative)
    weights_difference = None
    if case.attention_weights is not None:
        weights_difference = _difference(result.attention_weights, case.attention_weights, relative)
    gradient_difference = None
    if case.gradients is not None and result.gradients is not None:
        gradient_difference = max(
            _difference(result.gradients.get(key), value, True)
            for key, value in case.gradients.items()
        )
    # Exact zeros where the recorded numbers are 0 (masked keys, empty rows), as compare
    # holds them, up to the subnormal numbers of the less precise dtype (an underflow)
    zero_difference = harness.zero_differences([result], case)
    subnormal = max(SMALLEST_NORMAL[dtype], SMALLEST_NORMAL[case.dtype])
    differences = (output_difference, weights_difference or 0.0, gradient_difference or 0.0)
    passed = max(differences) <= harness.TOLERANCES[precision] and zero_difference < subnormal
    return harness.Row(
        case.name,
        backend,
        dtype,
        tuple(result.output.shape),
        output_difference,
        weights_difference,
        None,
        gradient_difference,
        passed,
        zero_difference=zero_difference,
    )


def _run_recorded(case: GoldenCase, backend: str, dtype: str) -> harness.Result:
    """The recorded case run on `backend` in `dtype`, with its gradients where recorded."""
    validation.check_dtype(dtype)
    config = {**case.config, "dtype": dtype} if "dtype" in case.config else {}
    inputs = {key: _cast(value, dtype) for key, value in case.inputs.items()}
    weights = {key: np.asarray(value).astype(dtype) for key, value in case.weights.items()}
    masks = ("self",) if "keys" not in inputs and "queries" in inputs else ()
    # The masks given as floats are differentiated, as the harness does: by their inputs'
    # names, which are among the names of the masks giving them
    masks += tuple(
        mask for mask, name in FLOAT_MASKS.items() if mask == name and _is_float(inputs.get(name))
    )
    cotangent = None if case.gradients is None else case.cotangent.astype(dtype)
    # A function takes its options (empty_rows, scale, ...) in the call, from the case
    options = case.config if case.layer in harness.FUNCTIONS else {}
    layer = harness.Case(case.layer, masks, {k: v for k, v in options.items() if k != "dtype"})
    return harness.run_case(backend, layer, inputs, weights, config, cotangent)


def _is_float(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind == "f"


def _cast(value: Any, dtype: str) -> Any:
    # Floating arrays (inputs, additive masks) run in the dtype; lengths and masks keep theirs
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return value.astype(dtype)
    return value


def _difference(actual: Any, expected: np.ndarray, relative: bool) -> float:
    if actual is None or np.shape(actual) != np.shape(expected):
        return float("inf")
    return harness.difference(
        np.asarray(actual, "float64"), np.asarray(expected, "float64"), relative
    )
