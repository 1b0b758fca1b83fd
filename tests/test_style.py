"""The code base keeps its own rules: ruff clean, and backend modules that mirror each other."""

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import backend_module
from mha.docstrings import SECTIONS

ROOT = pathlib.Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "mha" / "backends"

# Defined by every backend, in this order, so that two modules read side by side.
MIRRORED = (
    "to_numpy",
    "from_numpy",
    "_check_valid_lens_values",
    "_length_mask",
    "_Masks",
    "_softmax",
    "masked_softmax",
    "_attention_pool",
    "DotProductAttention",
    "AdditiveAttention",
    "MultiHeadAttention",
    "PositionalEncoding",
    "LearnedPositionalEncoding",
    "RotaryEmbedding",
    "AddNorm",
    "layer_config",
    "read_parameter",
    "write_parameter",
)


def top_level_names(path):
    tree = ast.parse(path.read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)]


@pytest.mark.parametrize("name", ["numpy", "torch", "tensorflow", "mxnet", "jax"])
def test_backend_modules_define_the_shared_names_in_the_same_order(name):
    names = top_level_names(BACKENDS / f"{name}.py")
    present = [n for n in names if n in MIRRORED]
    assert present == list(MIRRORED)


def _ruff():
    ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which(
        "ruff"
    )
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return ruff


def test_ruff_check():
    completed = subprocess.run(
        [_ruff(), "check", "mha", "tests"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_ruff_format():
    completed = subprocess.run(
        [_ruff(), "format", "--check", "mha", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


@pytest.mark.parametrize("name", ["numpy", "torch", "tensorflow", "mxnet", "jax"])
def test_every_public_object_documents_the_shared_contract(name):
    # Written once in mha.docstrings, appended to each backend's own line by @documented
    source = (BACKENDS / f"{name}.py").read_text()
    tree = ast.parse(source)
    documented = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
        and any(ast.unparse(d) == "documented" for d in node.decorator_list)
    }
    assert documented == set(SECTIONS)
    module = backend_module(name)
    for public in SECTIONS:
        doc = getattr(module, public).__doc__
        assert SECTIONS[public].strip() in doc
        assert (
            doc.splitlines()[0]
            == ast.get_docstring(
                next(n for n in tree.body if getattr(n, "name", None) == public)
            ).splitlines()[0]
        )


# The call of each backend's layers: torch's and MXNet's forward, Keras's and Flax's __call__
CALLS = {"numpy": "forward", "torch": "forward", "tensorflow": "__call__", "mxnet": "forward",
         "jax": "__call__"}  # fmt: skip
# What a framework adds to every layer: Keras's training and **kwargs, Flax's rngs
FRAMEWORK_ARGUMENTS = {"self", "kwargs", "training", "rngs"}


def _parameters(function):
    import inspect

    return [
        name for name in inspect.signature(function).parameters if name not in FRAMEWORK_ARGUMENTS
    ]


@pytest.mark.parametrize("name", ["torch", "tensorflow", "mxnet", "jax"])
def test_every_backend_takes_the_references_arguments_in_its_order(name):
    reference, module = backend_module("numpy"), backend_module(name)
    for public in SECTIONS:
        ours, theirs = getattr(reference, public), getattr(module, public)
        if not isinstance(ours, type):  # masked_softmax
            assert _parameters(theirs) == _parameters(ours), public
            continue
        assert _parameters(theirs.__init__) == _parameters(ours.__init__), public
        call = getattr(theirs, CALLS[name])
        assert _parameters(call) == _parameters(ours.forward), public


# A function or method of a backend module fits on a screen (docs/design.md)
SCREEN = 60


@pytest.mark.parametrize("name", ["numpy", "torch", "tensorflow", "mxnet", "jax"])
def test_every_function_of_a_backend_module_fits_on_a_screen(name):
    tree = ast.parse((BACKENDS / f"{name}.py").read_text())
    longer = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > SCREEN
    ]
    assert not longer, longer
