"""The notebooks run from top to bottom, and the committed files hold their outputs.

Each notebook is executed in a fresh kernel (notebooks/run.py's `execute`, the one way the
project runs them) on a copy in a temporary directory, so the committed files are never
written here. The notebooks that show one backend at a time read MHA_BACKEND and run under
every backend; the others compare every framework installed, and must see every one the
run requires. A cell that raises fails the test with the cell's traceback. compare_frameworks
runs every 8th case of its agreement matrix here (PARAMETERS), the whole of which
tests/test_agreement.py holds every backend to.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat
import pytest

from conftest import backend_module, backend_params, required_backends

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"


def _load_runner():
    spec = importlib.util.spec_from_file_location("notebooks_run", NOTEBOOKS / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _load_runner()

SINGLE_BACKEND = ("attention_scoring", "self_attention_positional_encoding")
EVERY_BACKEND = ("multihead_attention", "compare_frameworks")

# The plots each notebook must show, by the tag of the cell that draws them.
FIGURES = {
    "attention_scoring": (
        "figure-dot-product-heatmap",
        "figure-additive-heatmap",
        "figure-fully-masked-heatmap",
    ),
    "multihead_attention": (
        "figure-head-heatmaps",
        "figure-head-importance",
        "figure-trained-head-heatmaps",
    ),
    "self_attention_positional_encoding": (
        "figure-encoding-columns",
        "figure-binary-analogy",
        "figure-encoding-heatmap",
        "figure-rotary-scores",
        "figure-scaling",
    ),
    "compare_frameworks": ("figure-agreement", "figure-speed"),
}

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_every_notebook_is_listed():
    on_disk = sorted(path.stem for path in NOTEBOOKS.glob("*.ipynb"))
    assert on_disk == sorted(runner.NOTEBOOKS) == sorted(FIGURES)
    assert sorted(SINGLE_BACKEND + EVERY_BACKEND) == sorted(FIGURES)


def _code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _check_outputs(name, notebook):
    """Every code cell ran, in order, without error; every named plot is an embedded PNG."""
    cells = _code_cells(notebook)
    counts = [cell.execution_count for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{name}: not run top to bottom: {counts}"
    for cell in cells:
        errors = [output for output in cell.outputs if output.output_type == "error"]
        assert not errors, f"{name}: a cell failed: {errors[0].ename}: {errors[0].evalue}"
    for tag in FIGURES[name]:
        tagged = [cell for cell in cells if tag in cell.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name}: {len(tagged)} cells tagged {tag}"
        images = [
            base64.b64decode(output.data["image/png"])
            for output in tagged[0].outputs
            if output.output_type == "display_data" and "image/png" in output.data
        ]
        assert len(images) == 1, f"{name}: the {tag} cell shows {len(images)} PNG images"
        assert images[0].startswith(PNG_SIGNATURE) and len(images[0]) > 2000, (
            f"{name}: the {tag} image is not a real plot"
        )


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_committed_notebook_holds_its_outputs(name):
    path = NOTEBOOKS / f"{name}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    _check_outputs(name, notebook)
    # Small enough to open quickly on a code host
    assert path.stat().st_size < 400_000, f"{name}: {path.stat().st_size} bytes"


def test_the_committed_agreement_table_holds_every_case():
    # The committed table is the code's: a case added to mha's harness asks for the notebook
    # to run again (notebooks/run.py), or the file shows a matrix the code no longer runs
    from mha import harness

    notebook = nbformat.read(NOTEBOOKS / "compare_frameworks.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for c in _code_cells(notebook) for o in c.outputs)
    counts = {int(n) for n in re.findall(r"(\d+) cases, all passed", printed)}
    assert counts == {len(harness.default_cases())}


# What the runs here change, by notebook: compare_frameworks runs every 8th case of the matrix
# that tests/test_agreement.py holds whole
PARAMETERS = {"compare_frameworks": {"CASE_STEP": 8}}


def _execute(name, tmp_path, backend=None):
    copy = tmp_path / f"{name}.ipynb"
    shutil.copyfile(NOTEBOOKS / copy.name, copy)
    notebook = nbformat.read(copy, as_version=4)
    for cell in _code_cells(notebook):
        cell.outputs, cell.execution_count = [], None
    runner.execute(notebook, cwd=tmp_path, backend=backend, parameters=PARAMETERS.get(name))
    nbformat.write(notebook, copy)  # kept in tmp_path, for a look after a failure
    _check_outputs(name, notebook)
    return notebook


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", SINGLE_BACKEND)
def test_single_backend_notebook_runs(name, backend, tmp_path):
    backend_module(backend)
    _execute(name, tmp_path, backend)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.every_lane  # every backend of the lane, MXNet in the legacy one
@pytest.mark.parametrize("name", EVERY_BACKEND)
def test_every_backend_notebook_runs(name, tmp_path):
    backend_module("torch")  # the notebooks train or save something in torch
    for backend in required_backends():
        backend_module(backend)
    notebook = _execute(name, tmp_path)
    # They compare every framework installed: every one this run requires, at least
    printed = "".join(output.get("text", "") for output in _code_cells(notebook)[0].outputs)
    (line,) = [line for line in printed.splitlines() if line.startswith("backends:")]
    assert set(required_backends()) <= set(ast.literal_eval(line.removeprefix("backends:").strip()))


# A run ends with its kernel shut down, whether its cells pass, raise, pass the time limit or
# kill the kernel, and the last two fail at once rather than wait on a kernel that cannot answer
ENDINGS = {
    "passes": ("x = 1", ""),
    "raises": ("raise ValueError('no')", "CellExecutionError"),
    "hangs": ("import time\ntime.sleep(600)", "CellTimeoutError"),
    "dies": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "DeadKernelError"),
}
ENDING = """
import importlib.util, os, nbformat
spec = importlib.util.spec_from_file_location("run", {runner!r})
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)
run.CELL_TIMEOUT = 5
notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell({code!r})])
try:
    run.execute(notebook, cwd={cwd!r})
except Exception as error:
    print(type(error).__name__)
try:
    print("kernel-left-running" if os.waitpid(-1, os.WNOHANG) == (0, 0) else "")
except ChildProcessError:
    pass  # no child at all: the kernel was shut down and reaped
"""


@pytest.mark.skipif(os.name == "nt", reason="counts the kernel among the run's POSIX children")
@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_run_ends_at_once_with_its_kernel_shut_down(ending, tmp_path):
    code, error = ENDINGS[ending]
    script = ENDING.format(runner=str(NOTEBOOKS / "run.py"), code=code, cwd=str(tmp_path))
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ([error] if error else []), done.stdout + done.stderr[-2000:]
