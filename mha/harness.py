"""Cross-backend comparison: one weight set, the same inputs, every backend.

This module owns the question "do the backends compute the same numbers?", so that the tests,
`mha compare` and the notebooks all ask it the same way. The reference is always the NumPy
backend run in float64; every backend (NumPy itself included) runs in the dtype asked for and
is compared with it. The cases `mha compare` runs are data in `mha.cases` (default_cases),
and this module names them, their sizes and inputs too (Case, Shapes, make_inputs, fit); the
test suite's own tables, its fuller agreement matrix and its table of bad inputs, live with the
tests (tests/agreement_cases.py, tests/error_cases.py), so that importing the harness builds
no test data.

    >>> from mha import harness
    >>> rows = harness.compare(backends=["numpy"], dtype="float32")
    >>> all(row.passed for row in rows)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mha import weights as weights_module
from mha.case_calls import call_layer
from mha.cases import (
    LATENT_SIZES,
    Case,
    Shapes,
    default_cases,
    differentiable,
    fit,
    make_inputs,
)
from mha.registry import load_backend, normalize_backend_name
from mha.tensors import dtype_name
from mha.weights import random_weights, set_weights

__all__ = [
    "GRADIENT_TOLERANCES",
    "TOLERANCES",
    "Case",
    "Prepared",
    "Result",
    "Row",
    "Shapes",
    "check",
    "compare",
    "default_cases",
    "device_of",
    "difference",
    "fit",
    "make_inputs",
    "prepare",
    "run_case",
]

# The agreement every backend must reach against the float64 reference (docs/design.md,
# "Agreement"): float64 in absolute terms, float32 and float16 relative to the scale of the
# reference (its largest absolute entry, at least 1).
TOLERANCES: dict[str, float] = {"float64": 1e-10, "float32": 1e-5, "float16": 2e-3}

# Gradients against float64 central differences on the reference, relative to the scale of
# the gradient: the differences themselves are accurate to about 1e-9 with a step of 1e-6.
GRADIENT_TOLERANCES: dict[str, float] = {"float64": 1e-7, "float32": 1e-5, "float16": 1e-2}


@dataclasses.dataclass
class Result:
    """What one backend computed for one case, as numpy arrays.

    gradients: d sum(output * cotangent) / d input and / d weight, keyed by input names and
    canonical weight names; None when not asked for or when the backend has no autograd.
    inference: with gradients, the same call made again without recording them (the
    backend's `without_gradients`), whose output and weights are checked too: some paths
    run only there; None otherwise, when the one call already ran without gradients.
    """

    output: np.ndarray
    attention_weights: np.ndarray | None
    gradients: dict[str, np.ndarray] | None = None
    inference: Result | None = None


@dataclasses.dataclass
class Row:
    """One line of the agreement table.

    output_difference, weights_difference: from the float64 NumPy reference (absolute for
    float64, relative to the reference's scale otherwise), the larger of the calls with and
    without gradients (Result.inference); within TOLERANCES to pass.
    gradient_difference: from float64 central differences, relative to the gradients' scale;
    within GRADIENT_TOLERANCES. gradient_agreement: from the first autograd backend of the run;
    within TOLERANCES. None where it does not apply.
    zero_difference: the largest absolute value of the output and attention weights where the
    reference's are exactly 0 (masked keys, rows with no key to attend); must be 0, since
    docs/design.md promises exact zeros there. A NaN anywhere counts as an infinite difference.
    """

    case: str
    backend: str
    dtype: str
    output_shape: tuple[int, ...] | None
    output_difference: float | None
    weights_difference: float | None
    gradient_difference: float | None
    gradient_agreement: float | None
    passed: bool
    error: str | None = None
    zero_difference: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _config(case: Case, shapes: Shapes, dtype: str) -> dict[str, Any]:
    s = shapes
    config: dict[str, Any] = {"dtype": dtype}
    if case.layer == "AdditiveAttention":
        config.update(num_hiddens=s.num_hiddens, query_size=s.query_size, key_size=s.key_size)
    elif case.layer == "MultiHeadAttention":
        config.update(
            num_hiddens=s.num_hiddens,
            num_heads=s.num_heads,
            query_size=s.query_size,
            key_size=s.key_size,
            value_size=s.value_size,
        )
    elif case.layer == "MultiHeadLatentAttention":
        config.update(num_hiddens=s.num_hiddens, num_heads=s.num_heads, **LATENT_SIZES)
    elif case.layer in (
        "PositionalEncoding",
        "LearnedPositionalEncoding",
        "AddNorm",
        "RotaryEmbedding",
    ):
        config.update(num_hiddens=s.num_hiddens)
    if "self" in case.masks and "query_size" in config:
        config["key_size"] = config["query_size"]
        if "value_size" in config:
            config["value_size"] = config["query_size"]
    config.update(case.config)
    return config


# The cases that call a function: no layer, no weights
FUNCTIONS = ("masked_softmax", "dot_product_attention")


def build_layer(backend: str, case: Case, config: Mapping[str, Any], weights=None) -> Any:
    """The layer of `case` in `backend` with `config`, holding `weights` when given."""
    if case.layer in FUNCTIONS:
        return None
    layer = weights_module.build_layer(load_backend(backend), case.layer, config)
    if weights:
        set_weights(layer, dict(weights))
    return layer


def run_case(
    backend: str,
    case: Case,
    inputs: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    cotangent: np.ndarray | None = None,
    transform: Callable[[Any], Any] | None = None,
    device: str | None = None,
) -> Result:
    """Build `case.layer` in `backend` with `weights`, call it on `inputs`, return numpy.

    With a `cotangent` (an array of the output's shape) and a backend with autograd, also
    returns the gradients of sum(output * cotangent) with respect to the differentiable inputs
    (`differentiable`: float masks among them) and to every weight, the latter in canonical
    names and layout.

    transform: called with the built layer, returns what is called instead (a compiled or
    hybridized layer: the framework's own ways of running it); the layer itself still holds
    the weights and attention_weights. Not for masked_softmax.
    device: where the layer and tensors are put ("cpu" or "gpu", for a backend whose adapter
    has to_device: torch, jax); None leaves them where the framework makes them.
    """
    module = load_backend(backend)
    adapter = module.ADAPTER
    place = (lambda x: x) if device is None else (lambda x: adapter.to_device(x, device))
    tensors = {
        key: place(adapter.from_numpy(value)) if isinstance(value, np.ndarray) else value
        for key, value in inputs.items()
    }
    layer = build_layer(backend, case, config, weights)
    layer = layer if layer is None else place(layer)
    called = layer if transform is None else transform(layer)

    def forward() -> Result:
        output = adapter.to_numpy(call_layer(module, case, called, tensors))
        return Result(output, _attention_weights(adapter, layer))

    if cotangent is None or not adapter.autograd:
        return forward()
    with adapter.without_gradients():
        inference = forward()
    output, input_gradients, weight_gradients = adapter.value_and_gradients(
        # A backend may call another layer holding the same weights (JAX: a copy made inside
        # its trace, since Flax modules are not mutated across traces)
        lambda arguments, other=None: call_layer(
            module, case, called if other is None else other, arguments
        ),
        tensors,
        differentiable(case),
        layer,
        place(adapter.from_numpy(cotangent)),
    )
    return Result(
        output,
        _attention_weights(adapter, layer),
        {**input_gradients, **weight_gradients},
        inference,
    )


def _attention_weights(adapter: Any, layer: Any) -> np.ndarray | None:
    """The layer's attention_weights of its last call as numpy, None when it has none."""
    attention_weights = getattr(layer, "attention_weights", None)
    return None if attention_weights is None else adapter.to_numpy(attention_weights)


def finite_difference_gradients(
    case: Case,
    inputs: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    cotangent: np.ndarray,
    step: float = 1e-6,
) -> dict[str, np.ndarray]:
    """Central differences of sum(output * cotangent) on the float64 NumPy reference, with
    respect to the differentiable inputs and every weight."""
    inputs = _upcast(inputs)
    weights = _upcast(weights)
    config = {**config, "dtype": "float64"}
    layer = build_layer("numpy", case, config, weights)
    module = load_backend("numpy")

    def loss() -> float:
        if weights:
            set_weights(layer, weights)
        return float(np.sum(call_layer(module, case, layer, inputs) * cotangent))

    gradients = {}
    for source, names in ((inputs, differentiable(case)), (weights, sorted(weights))):
        for name in names:
            array = source[name]
            gradient = np.zeros_like(array)
            for index in np.ndindex(array.shape):
                original = array[index]
                array[index] = original + step
                above = loss()
                array[index] = original - step
                below = loss()
                array[index] = original
                gradient[index] = (above - below) / (2 * step)
            gradients[name] = gradient
    return gradients


def difference(actual: np.ndarray, reference: np.ndarray, relative: bool) -> float:
    """The largest absolute difference, divided when `relative` by the reference's scale (its
    largest absolute entry, at least 1). Different shapes and NaN give infinity."""
    actual = np.asarray(actual, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if actual.shape != reference.shape:
        return float("inf")
    if actual.size == 0:
        return 0.0
    error = float(np.max(np.abs(actual - reference)))
    if np.isnan(error):  # a NaN is no number: never within a tolerance
        return float("inf")
    if not relative:
        return error
    return error / max(1.0, float(np.max(np.abs(reference))))


def _gradient_difference(
    actual: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], relative: bool
) -> float:
    if set(actual) != set(reference):
        return float("inf")
    return max((difference(actual[k], reference[k], relative) for k in reference), default=0.0)


def _upcast(arrays: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: value.astype(np.float64)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f"
        else value
        for key, value in arrays.items()
    }


@dataclasses.dataclass
class Prepared:
    """One case made ready for any number of backends: the case as run (with the sizes of its
    own that fit gave it), its config, weights and inputs in the run's dtype, the float64
    reference, and (for gradients) the cotangent and the central differences of the reference."""

    case: Case
    dtype: str
    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    inputs: dict[str, Any]
    reference: Result
    cotangent: np.ndarray | None = None
    numeric_gradients: dict[str, np.ndarray] | None = None


def prepare(
    case: Case,
    shapes: Shapes = Shapes(),
    dtype: str = "float32",
    seed: int = 0,
    gradients: bool = True,
) -> Prepared:
    """Make the weights, inputs and float64 reference of `case` (see Prepared), with sizes of
    its own where those of `shapes` cannot build it (see fit; Prepared.case is the case run)."""
    case = fit(case, shapes)
    config = _config(case, shapes, dtype)
    reference_config = {**config, "dtype": "float64"}
    weights = random_weights(case.layer, seed=seed, **config) if case.layer not in FUNCTIONS else {}
    inputs = make_inputs(case, shapes, dtype, seed)
    # The reference sees exactly the numbers the backends see, upcast to float64, so that the
    # difference measures the computation alone.
    reference = run_case("numpy", case, _upcast(inputs), _upcast(weights), reference_config)
    prepared = Prepared(case, dtype, config, weights, inputs, reference)
    if gradients:
        cotangent = np.random.default_rng(seed + 1).standard_normal(reference.output.shape)
        prepared.numeric_gradients = finite_difference_gradients(
            case, inputs, weights, config, cotangent
        )
        prepared.cotangent = cotangent.astype(dtype)
    return prepared


def check(
    backend: str,
    prepared: Prepared,
    anchor: Result | None = None,
    transform: Callable[[Any], Any] | None = None,
    device: str | None = None,
) -> tuple[Row, Result | None]:
    """Run a prepared case on `backend` and compare it with the reference.

    Args:
        anchor: another autograd backend's result for the same case; this backend's gradients
            must agree with its gradients.
        transform, device: as run_case's (transform: the layer compiled or hybridized).

    Returns:
        The Row, and the Result (None when the backend raised).
    """
    case, dtype = prepared.case, prepared.dtype
    relative = dtype != "float64"
    try:
        # Only those given: run_case's six-argument form stays the common one
        extra = {k: v for k, v in (("transform", transform), ("device", device)) if v is not None}
        given = (prepared.inputs, prepared.weights, prepared.config, prepared.cotangent)
        result = run_case(backend, case, *given, **extra)
        _check_result_dtypes(result, dtype)
    except Exception as error:  # a crash is a disagreement, reported with its cause
        failure = f"{type(error).__name__}: {error}"
        return Row(case.id, backend, dtype, None, None, None, None, None, False, failure), None
    reference = prepared.reference
    # With gradients, the call without them too: the larger of the two differences
    calls = [result] if result.inference is None else [result, result.inference]
    output_difference = max(difference(call.output, reference.output, relative) for call in calls)
    weights_difference = _weights_difference(calls, reference, relative)
    zero_difference = zero_differences(calls, reference)
    gradient_difference, gradient_agreement = _gradient_differences(result, prepared, anchor)
    passed = (
        max(output_difference, weights_difference or 0.0, gradient_agreement or 0.0)
        <= TOLERANCES[dtype]
        and (gradient_difference or 0.0) <= GRADIENT_TOLERANCES[dtype]
        and zero_difference == 0.0
    )
    row = Row(
        case.id,
        backend,
        dtype,
        tuple(result.output.shape),
        output_difference,
        weights_difference,
        gradient_difference,
        gradient_agreement,
        passed,
        zero_difference=zero_difference,
    )
    return row, result


def _check_result_dtypes(result: Result, dtype: str) -> None:
    """A layer of `dtype` gives its output and weights in it (a float64 output of a float32
    layer would hold the reference's numbers and double the memory)."""
    for name, array in (("output", result.output), ("weights", result.attention_weights)):
        if array is not None and dtype_name(array) != dtype:
            raise TypeError(f"the {name} is {dtype_name(array)}, not {dtype}")


def _gradient_differences(
    result: Result, prepared: Prepared, anchor: Result | None
) -> tuple[float | None, float | None]:
    """The gradients' difference from the reference's central differences (relative), and
    from another autograd backend's (the anchor); None where there is nothing to compare."""
    if result.gradients is None or prepared.numeric_gradients is None:
        return None, None
    numeric = _gradient_difference(result.gradients, prepared.numeric_gradients, True)
    if anchor is None or anchor.gradients is None:
        return numeric, None
    relative = prepared.dtype != "float64"
    return numeric, _gradient_difference(result.gradients, anchor.gradients, relative)


def device_of(name: str, device: str | None) -> str | None:
    """Where compare runs backend `name` when asked for `device`: NumPy stays on the CPU."""
    if device is None or name == "numpy":
        return None
    adapter = load_backend(name).ADAPTER
    if adapter.to_device is None:
        raise ValueError(f"mha cannot put the {name} backend on a device (only torch and jax)")
    try:  # there and back: a device whose numbers cannot be read (torch's meta) is none
        adapter.to_numpy(adapter.to_device(adapter.from_numpy(np.zeros(1, "float32")), device))
    except Exception as error:  # each framework says it its own way: no such device here
        raise ValueError(f"{name} cannot reach a {device}: {error}") from None
    return device


def zero_differences(calls: Sequence[Result], reference: Result) -> float:
    """The largest absolute value the calls give where the reference's output or attention
    weights are exactly 0 (inf for a NaN there); 0.0 when they keep every zero."""
    largest = 0.0
    pairs = [(reference.output, call.output) for call in calls]
    if reference.attention_weights is not None:
        pairs += [(reference.attention_weights, call.attention_weights) for call in calls]
    for expected, actual in pairs:
        if actual is None or np.shape(actual) != np.shape(expected):
            continue  # counted as a difference of the output or weights already
        zeros = np.asarray(actual, dtype=np.float64)[np.asarray(expected) == 0]
        if zeros.size:
            largest = max(largest, float(np.max(np.nan_to_num(np.abs(zeros), nan=np.inf))))
    return largest


def _weights_difference(calls: Sequence[Result], reference: Result, relative: bool) -> float | None:
    """The largest difference of the calls' attention weights from the reference's; None
    when neither has any, inf when only one side has them."""
    differences = []
    for call in calls:
        if reference.attention_weights is None and call.attention_weights is None:
            continue
        if call.attention_weights is None or reference.attention_weights is None:
            differences.append(float("inf"))
        else:
            differences.append(
                difference(call.attention_weights, reference.attention_weights, relative)
            )
    return max(differences, default=None)


def compare(
    backends: Sequence[str] = ("numpy",),
    dtype: str = "float32",
    seed: int = 0,
    shapes: Shapes = Shapes(),
    cases: Iterable[Case] | None = None,
    gradients: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
    device: str | None = None,
) -> list[Row]:
    """Run every case on every backend and compare with the float64 NumPy reference.

    Args:
        backends: backend names; each must import.
        dtype: the dtype the backends run in ("float32" or "float64").
        seed: seeds the weights, the inputs and the gradients' cotangent.
        shapes: input sizes.
        cases: what to run; default_cases() when None.
        gradients: also compare the gradients of the autograd backends, with float64 central
            differences on the NumPy reference and with each other (the first autograd
            backend named is the one the others must agree with).
        progress: called as progress(done, total, description) before each run.
        device: where every backend but NumPy runs ("cpu" or "gpu"); None: where each
            framework puts its arrays. A backend without to_device is a ValueError.

    Returns:
        One Row per case and backend. A backend that raises gives a failed row with the error.
    """
    names = [normalize_backend_name(name) for name in backends]
    placed = {name: device_of(name, device) for name in names}
    autograd = any(load_backend(name).ADAPTER.autograd for name in names)
    cases = list(default_cases() if cases is None else cases)
    rows = []
    total, done = len(cases) * len(names), 0
    for case in cases:
        prepared = prepare(case, shapes, dtype, seed, gradients and autograd)
        anchor = None
        for name in names:
            if progress is not None:
                progress(done, total, f"{prepared.case.id} on {name}")
            done += 1
            row, result = check(name, prepared, anchor, device=placed[name])
            if anchor is None and result is not None and result.gradients is not None:
                anchor = result
            rows.append(row)
    if progress is not None:
        progress(total, total, "done")
    return rows
