"""Shared fixtures: backends as parameters, and the rule for backends that fail to import.

MHA_TEST_BACKENDS (comma list) names the backends this run requires; by default, every
backend mha has. A required backend that does not import fails its tests; a backend that is
not required and not installed is skipped with the reason.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
from hypothesis import settings

from mha import harness
from mha.registry import (
    BACKENDS,
    BackendUnavailableError,
    load_backend,
    load_triton_before_tensorflow,
    normalize_backend_name,
)

# The tests compare float64 layers in every backend: JAX computes in float64 only in its 64-bit
# mode, read when JAX is first imported (tests of the mode being off run in a subprocess)
os.environ.setdefault("JAX_ENABLE_X64", "1")
# A test may import Keras before mha's backend: torch's triton goes first (see the function)
load_triton_before_tensorflow()


def required_backends() -> list[str]:
    value = os.environ.get("MHA_TEST_BACKENDS", "").strip()
    if not value:
        return list(BACKENDS)
    return [normalize_backend_name(name) for name in value.split(",") if name.strip()]


def required_import(module: str):
    """A module of a test extra (transformers, the docs extra's): a lane run, which names its
    backends in MHA_TEST_BACKENDS, requires it; elsewhere the test skips without it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if os.environ.get("MHA_TEST_BACKENDS"):
            pytest.fail(f"{module} does not import: {error}", pytrace=False)
        pytest.skip(str(error))


# The mha backend whose framework each module is
_BACKEND_OF_FRAMEWORK = {
    "torch": "torch",
    "tensorflow": "tensorflow",
    "keras": "tensorflow",
    "mxnet": "mxnet",
    "jax": "jax",
    "flax": "jax",
}


def framework_import(module: str, *, module_level: bool = False):
    """A framework's own module (torch, keras, jax...), for a test of mha's backend beside it:
    as backend_module, it fails where that backend is required and missing, and skips
    otherwise (the whole test file where module_level)."""
    try:
        backend_module(_BACKEND_OF_FRAMEWORK[module.partition(".")[0]])
    except pytest.skip.Exception as skipped:
        if not module_level:
            raise
        pytest.skip(skipped.msg, allow_module_level=True)
    return importlib.import_module(module)


def backend_params(names=None):
    """pytest params over backends, each marked with its name (`pytest -m torch`)."""
    return [
        pytest.param(name, marks=getattr(pytest.mark, name), id=name)
        for name in (names or BACKENDS)
    ]


def backend_module(name: str):
    """The backend's module; fails if it is required and missing, skips otherwise."""
    try:
        return load_backend(name)
    except BackendUnavailableError as error:
        if name in required_backends():
            pytest.fail(f"required backend {name!r} does not import: {error}", pytrace=False)
        pytest.skip(str(error))


def scores_of_order_one(model) -> None:
    """Redraws a torch model's matrices (its embeddings' aside) at 2 / sqrt(fan in): scores of
    order 1. At transformers' initial std of 0.02 attention is near uniform, and a wrong
    rotary base, scaling or bias hides under a port's tolerance."""
    torch = framework_import("torch")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed" not in name:
                parameter.normal_(0.0, 2.0 / parameter.shape[1] ** 0.5)


def assert_agrees(actual, expected, dtype: str) -> None:
    """`actual` (numpy) within docs/design.md's agreement of `expected`, as mha.harness
    measures it: float64 within 1e-10 absolute, float32 within 1e-5 and float16 within 2e-3
    of the expected scale; NaN never agrees. For the framework-only tests of the backend files
    (compiled, hybridized, cast, reloaded layers); the agreement matrix is mha.harness's."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    error = harness.difference(actual, expected, relative=dtype != "float64")
    assert error <= harness.TOLERANCES[dtype], (
        f"differs by {error} from the expected (tolerance {harness.TOLERANCES[dtype]}, {dtype})"
    )


@pytest.fixture(params=backend_params())
def backend(request):
    """Each backend's module in turn (numpy, torch, tensorflow, mxnet)."""
    return backend_module(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# Property-based tests: a few hundred examples per run by default; MHA_HYPOTHESIS_PROFILE=long
# for a long search (thousands of examples), e.g. before a release.
settings.register_profile("default", max_examples=150, deadline=None)
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("MHA_HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(items):
    """The tests marked slow first: pytest-xdist hands the tests out in this order, so that
    no worker is left running a long one after the others have finished."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
