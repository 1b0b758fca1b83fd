"""The code base keeps its own rules: ruff clean, and backend modules that mirror each other."""

import ast
import dataclasses
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


# What ruff holds: the package, the tests, the lanes, the notebooks' runner and the site
CHECKED = ("mha", "tests", "lanes.py", "notebooks/run.py", "website")


def test_ruff_check():
    completed = subprocess.run(
        [_ruff(), "check", *CHECKED], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_ruff_format():
    completed = subprocess.run(
        [_ruff(), "format", "--check", *CHECKED],
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


# ---------------------------------------------------------------------------------------------
# The import graph of mha/ (docs/design.md, "Layout")

PACKAGE = ROOT / "mha"


def _module_names():
    """Dotted name -> path of every module of mha/ outside mha/backends, whose modules import
    only their framework and mha's shared modules."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[:2] == ("mha", "backends"):
            continue
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(tree, name, is_package):
    """(line, module, imported name) for every import of `tree`, at module level or inside a
    function, relative ones resolved. An import inside a module's `__getattr__` is left out:
    it runs when a name that moved elsewhere is looked up, after both modules are loaded, and
    no code of the module itself depends on it."""
    lazy = {
        id(inner)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
        for inner in ast.walk(node)
    }
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, base, alias.name


def _import_graph():
    """(edges, private) of mha/: edges maps a module to the modules of mha/ it imports, each
    with the packages above it that the importer is not inside (Python runs a package's
    __init__ before any module in it); private lists imports of names with a leading
    underscore from another module."""
    modules = _module_names()
    edges, private = {name: set() for name in modules}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for line, module, imported in _imports(tree, name, path.name == "__init__.py"):
            if module != "mha" and not module.startswith("mha."):
                continue
            full = f"{module}.{imported}" if imported else module
            target = full if full in modules else module
            if imported and full not in modules and imported.startswith("_"):
                if not (imported.startswith("__") and imported.endswith("__")):
                    private.append(f"{path.relative_to(ROOT)}:{line} imports {full}")
            parts = target.split(".")
            for depth in range(1, len(parts) + 1):
                above = ".".join(parts[:depth])
                inside = name == above or name.startswith(above + ".")
                if above in modules and not inside:
                    edges[name].add(above)
    return edges, private


def _cycles(edges):
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def test_the_package_has_no_import_cycle():
    edges, _ = _import_graph()
    cycles = _cycles(edges)
    assert not cycles, f"modules that import each other, directly or not: {cycles}"


def test_no_module_imports_a_private_name_of_another():
    # A name two modules use is public in the lower one
    _, private = _import_graph()
    assert not private, private


@pytest.mark.parametrize(
    "path",
    [path for path in sorted(PACKAGE.rglob("*.py")) if path.parent.name != "backends"],
    ids=lambda path: str(path.relative_to(PACKAGE)),
)
def test_every_function_of_the_package_fits_on_a_screen(path):
    tree = ast.parse(path.read_text())
    longer = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > SCREEN
    ]
    assert not longer, longer


# A module of the package outside the backends reads whole: split it along its seams before it
# grows past this (the backend modules mirror each other instead, and grow with the options)
MODULE_LINES = 600


@pytest.mark.parametrize(
    "path",
    [path for path in sorted(PACKAGE.rglob("*.py")) if path.parent.name != "backends"],
    ids=lambda path: str(path.relative_to(PACKAGE)),
)
def test_every_module_of_the_package_outside_the_backends_is_short(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


ADAPTER_HOOKS = {
    "to_numpy": "to_numpy",
    "from_numpy": "from_numpy",
    "layer_config": "layer_config",
    "parameters": "PARAMETERS",
    "read_parameter": "read_parameter",
    "write_parameter": "write_parameter",
    "without_gradients": "without_gradients",
    "value_and_gradients": "value_and_gradients",
    "to_device": "to_device",
}


@pytest.mark.parametrize(
    "path",
    [BACKENDS / f"{name}.py" for name in ("numpy", "torch", "tensorflow", "mxnet", "jax")],
    ids=lambda path: path.stem,
)
def test_each_backend_declares_its_adapter_with_its_own_hooks(path):
    # Expected: the module ends with `ADAPTER = Adapter(...)`, which names the module's own
    # hooks, every one it defines (none left out, none of another module's), so the glue
    # reads what a backend offers from the declaration; and the glue never probes a backend
    # module with hasattr
    from mha.adapter import Adapter

    tree = ast.parse(path.read_text())
    assignments = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["ADAPTER"]
    ]
    assert len(assignments) == 1 and tree.body[-1] is assignments[0], path.name
    call = assignments[0].value
    assert isinstance(call, ast.Call) and call.func.id == "Adapter"
    fields = [field.name for field in dataclasses.fields(Adapter)]
    given = dict(zip(fields, call.args, strict=False))
    given.update({keyword.arg: keyword.value for keyword in call.keywords})
    defined = {
        node.name if isinstance(node, ast.FunctionDef) else node.targets[0].id
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        or (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name))
    }
    for field, hook in ADAPTER_HOOKS.items():
        if hook in defined:
            assert isinstance(given.get(field), ast.Name) and given[field].id == hook, field
        else:
            assert (
                field not in given
                or not isinstance(given[field], ast.Name)
                or (given[field].id not in defined)
            ), field


def test_the_glue_never_probes_a_backend_module():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "backends":
            continue
        source = path.read_text()
        for probe in ("hasattr(module", "hasattr(backend", "hasattr(load_backend"):
            assert probe not in source, (path.name, probe)
