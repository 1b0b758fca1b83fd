"""Backend selection: MHA_BACKEND, set_backend, use_backend, class forwarding, lazy imports."""

import importlib.util
import json
import os
import subprocess
import sys
import threading

import pytest

import mha
from conftest import backend_module
from mha import registry

FRAMEWORKS = ("torch", "tensorflow", "keras", "mxnet", "jax")


def run_python(code, **env):
    """Run `code` in a fresh interpreter and return its stdout (raises on failure)."""
    environment = {k: v for k, v in os.environ.items() if k != "MHA_BACKEND"}
    environment.update(env)
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=False
    )
    return completed


def test_import_mha_imports_no_framework():
    code = (
        "import sys, json, mha; mha.get_backend(); mha.MultiHeadAttention; "
        "mha.random_weights('AddNorm', num_hiddens=2); "
        f"print(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))"
    )
    completed = run_python(code)
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == []


# What `import mha` leaves for the first use of a name: the modules beside backend selection,
# numpy with them, and the test suite's tables (tests/agreement_cases.py, tests/error_cases.py)
LAZY = ("mha.golden", "mha.interop", "mha.porting", "mha.harness", "mha.weights", "numpy")
TEST_MODULES = ("agreement_cases", "error_cases", "export_cases", "conftest")
TEST_TABLES = ("all_cases", "ERRORS", "ErrorCase", "raised")


def test_import_mha_imports_its_modules_at_first_use_and_builds_no_test_data():
    # Expected: after `import mha`, none of LAZY nor of the tests' modules is imported, and
    # dir(mha) still lists every name; each name then resolves to what it was when mha
    # imported everything at once; the harness that `mha compare` imports holds no test table
    code = f"""if True:
        import json, sys
        import mha
        after_import = [name for name in {LAZY + TEST_MODULES!r} if name in sys.modules]
        listed = set(dir(mha)) >= {{*mha.__all__, "golden", "interop", "porting", "harness"}}
        same = [
            mha.golden is sys.modules["mha.golden"],
            mha.interop is sys.modules["mha.interop"],
            mha.porting is sys.modules["mha.porting"],
            mha.get_weights is mha.weights.get_weights,
            mha.set_weights is sys.modules["mha.weights"].set_weights,
            all(getattr(mha, name) is not None for name in mha.__all__),
        ]
        from mha import harness, load, porting
        tables = [name for name in {TEST_TABLES!r} if hasattr(harness, name)]
        tests = [name for name in {TEST_MODULES!r} if name in sys.modules]
        print(json.dumps([after_import, listed, same, tables, tests]))
    """
    completed = run_python(code)
    assert completed.returncode == 0, completed.stderr
    after_import, listed, same, tables, tests = json.loads(completed.stdout)
    assert after_import == []
    assert listed
    assert all(same), same
    assert tables == [] and tests == []


def test_default_backend_is_numpy():
    completed = run_python("import mha; print(mha.get_backend())")
    assert completed.stdout.strip() == "numpy"


@pytest.mark.parametrize("value", ["numpy", "NumPy", " NUMPY "])
def test_environment_variable_is_case_insensitive(value):
    completed = run_python("import mha; print(mha.get_backend())", MHA_BACKEND=value)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "numpy"


def test_environment_variable_with_unknown_name_lists_valid_names():
    completed = run_python("import mha; mha.get_backend()", MHA_BACKEND="theano")
    assert completed.returncode != 0
    assert "ValueError: MHA_BACKEND is not valid" in completed.stderr
    for name in ("numpy", "torch", "tensorflow", "mxnet", "jax", "pytorch", "tf"):
        assert name in completed.stderr
    assert "'theano'" in completed.stderr


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("pytorch", "torch"),
        ("PyTorch", "torch"),
        ("tf", "tensorflow"),
        ("TF", "tensorflow"),
        ("MXNet", "mxnet"),
        ("numpy", "numpy"),
    ],
)
def test_aliases_and_case(alias, name):
    assert registry.normalize_backend_name(alias) == name


def test_unknown_and_non_string_names():
    with pytest.raises(ValueError, match=r"Valid names: numpy, torch, tensorflow, mxnet"):
        mha.set_backend("caffe")
    with pytest.raises(TypeError, match=r"backend must be a string. Received: backend=3"):
        mha.use_backend(3).__enter__()


def test_missing_framework_raises_backend_unavailable_error():
    # Block torch's import, as if it were not installed.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import mha\n"
        "try:\n"
        "    mha.set_backend('pytorch')\n"
        "except mha.BackendUnavailableError as e:\n"
        "    print(isinstance(e, ImportError), mha.get_backend()); print(e)\n"
        "print('torch' in mha.available_backends())\n"
    )
    completed = run_python(code)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0] == "True numpy"  # an ImportError, and nothing changed
    assert "'torch'" in lines[1]
    assert "ModuleNotFoundError" in lines[1]
    assert 'pip install "torch>=2.7"' in lines[1]
    assert lines[-1] == "False"


def test_set_backend_and_use_backend_restore():
    previous = mha.get_backend()
    try:
        mha.set_backend("numpy")
        with mha.use_backend("NUMPY") as name:
            assert name == "numpy"
            assert mha.get_backend() == "numpy"
        assert mha.get_backend() == "numpy"
    finally:
        mha.set_backend(previous)


def test_use_backend_restores_on_error(backend):
    name = backend.__name__.rsplit(".", 1)[-1]
    before = mha.get_backend()
    with pytest.raises(RuntimeError, match="boom"):
        with mha.use_backend(name):
            assert mha.get_backend() == name
            raise RuntimeError("boom")
    assert mha.get_backend() == before


def test_use_backend_is_per_thread(backend):
    name = backend.__name__.rsplit(".", 1)[-1]
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def inside():
        with mha.use_backend(name):
            seen["inside"] = mha.get_backend()
            entered.set()
            release.wait(10)

    def outside():
        entered.wait(10)
        seen["outside"] = mha.get_backend()
        release.set()

    threads = [threading.Thread(target=inside), threading.Thread(target=outside)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"inside": name, "outside": "numpy"}


def test_classes_resolve_on_the_current_backend(backend):
    name = backend.__name__.rsplit(".", 1)[-1]
    with mha.use_backend(name):
        for public in registry.PUBLIC_NAMES:
            assert getattr(mha, public) is getattr(backend, public)


def test_every_backend_exports_the_same_names(backend):
    hooks = ("layer_config", "PARAMETERS", "read_parameter", "write_parameter")  # mha.weights calls
    for public in (*registry.PUBLIC_NAMES, *hooks):
        assert hasattr(backend, public), public
    # `from mha.backends.torch import *` gives the public names, and only those
    assert sorted(backend.__all__) == sorted(registry.PUBLIC_NAMES)


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no attribute 'Transformer'"):
        mha.Transformer  # noqa: B018


def test_a_backend_named_twice_runs_once():
    # An alias or another case names the same backend: running it twice would count its rows
    # twice in `mha compare` and `mha bench`
    assert registry.select_backends("numpy, NumPy,numpy") == (["numpy"], {})


def test_available_backends_include_numpy():
    assert "numpy" in mha.available_backends()


def test_backend_of_rejects_foreign_objects():
    with pytest.raises(TypeError, match="Expected a layer from one of the mha backends"):
        registry.backend_of(object())


# A stand-in for torch's triton that says whether TensorFlow was imported before it
_TRITON = "import sys\nprint('triton', 'after' if 'tensorflow' in sys.modules else 'first')\n"


@pytest.mark.tensorflow
def test_triton_is_loaded_before_tensorflow_and_never_after_it(tmp_path):
    # TensorFlow's LLVM and triton's loaded after it end the process at torch's first compile
    # or optimizer: mha's ways into TensorFlow (the backend, Keras files, the converters to
    # Keras) load triton first, and never after TensorFlow
    backend_module("tensorflow")
    (tmp_path / "triton" / "_C").mkdir(parents=True)
    (tmp_path / "triton" / "__init__.py").write_text("")
    (tmp_path / "triton" / "_C" / "__init__.py").write_text("")
    (tmp_path / "triton" / "_C" / "libtriton.py").write_text(_TRITON)
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    calls = {
        "mha.load_backend('tensorflow')": ["triton first", "done"],
        "from mha.keras_files import load_keras_file\n"
        "try:\n    load_keras_file('missing.keras')\nexcept ValueError:\n    pass": [
            "triton first",
            "done",
        ],
        "import numpy\nlayer = mha.MultiHeadAttention(8, 2)\nx = numpy.ones((1, 2, 8), 'f')\n"
        "layer(x, x, x)\nmha.interop.to_keras(layer)": ["triton first", "done"],
        "import tensorflow\nmha.load_backend('tensorflow')": ["done"],
    }
    for call, expected in calls.items():
        completed = run_python(f"import mha\n{call}\nprint('done')", PYTHONPATH=path)
        assert completed.returncode == 0, completed.stderr
        assert completed.stdout.splitlines() == expected, call


@pytest.mark.torch
@pytest.mark.tensorflow
def test_torch_trains_after_mha_loads_tensorflow_where_triton_is_installed():
    # torch's CUDA build (what pip gives on Linux) installs triton; its CPU build has none
    backend_module("torch")
    backend_module("tensorflow")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (torch's CPU build has none)")
    code = (
        "import mha\nmha.load_backend('tensorflow')\nimport torch\n"
        "model = torch.nn.Linear(2, 2)\noptimizer = torch.optim.Adam(model.parameters())\n"
        "model(torch.ones(1, 2)).sum().backward()\noptimizer.step()\nprint('stepped')"
    )
    completed = run_python(code)
    assert completed.returncode == 0, (completed.returncode, completed.stderr[-2000:])
    assert completed.stdout.splitlines()[-1] == "stepped"
