"""Execute the notebooks in place, so that the files hold fresh outputs and plots.

    python notebooks/run.py                       # every notebook
    python notebooks/run.py attention_scoring     # some of them, by name

The notebooks that show one backend at a time run under MHA_BACKEND=numpy here (the test
suite runs them under every backend). The kernel is the Python that runs this script, with
the repository on its path, so no kernel needs to be registered and mha need not be
installed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import time

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

# In the order a reader meets them.
NOTEBOOKS = (
    "attention_scoring",
    "multihead_attention",
    "self_attention_positional_encoding",
    "compare_frameworks",
)

# Longest time one cell may take before the run fails.
CELL_TIMEOUT = 300


def kernel_environment(backend: str | None = None) -> dict[str, str]:
    """This process's environment, with the repository on PYTHONPATH and MHA_BACKEND set."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    if backend is not None:
        env["MHA_BACKEND"] = backend
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's start-up log is noise here
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return env


def execute(
    notebook: nbformat.NotebookNode,
    *,
    cwd: str | os.PathLike,
    backend: str | None = None,
    progress=None,
    parameters: dict | None = None,
) -> nbformat.NotebookNode:
    """Run every cell of `notebook` (in place) in a fresh kernel working in `cwd`.

    Args:
        backend: MHA_BACKEND for the kernel; None keeps this process's setting.
        progress: called as progress(index, total, cell) before each code cell.
        parameters: names and values (Python literals) that a cell added after the one
            tagged "parameters" assigns, as papermill does (the tests' smaller runs).

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised; the notebook holds the
            outputs up to that cell.
    """
    # The kernel runs on this very interpreter (ipykernel's built-in spec), whatever
    # kernels are registered on the machine. An asynchronous manager, as nbclient expects:
    # with a blocking one, waiting for a cell's output blocks the loop that checks the cell's
    # time limit and the kernel's life, and a kernel that dies leaves the run waiting forever.
    manager = AsyncKernelManager(
        kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[])
    )
    if parameters:
        _inject(notebook, parameters)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]

    def on_cell_start(cell, cell_index):
        if progress is not None and cell.cell_type == "code":
            progress(code_cells.index(cell) + 1, len(code_cells), cell)

    client = NotebookClient(
        notebook,
        km=manager,
        timeout=CELL_TIMEOUT,
        record_timing=False,
        resources={"metadata": {"path": str(cwd)}},
        on_cell_start=on_cell_start,
    )
    try:  # the kernel is shut down after the run, as it ends or fails, not left running
        client.execute(env=kernel_environment(backend), cleanup_kc=True)
    finally:
        _drop_framework_start_up_logs(notebook)
    return notebook


def _inject(notebook: nbformat.NotebookNode, parameters: dict) -> None:
    """A code cell assigning `parameters`, after the cell tagged "parameters"."""
    tagged = [i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"{len(tagged)} cells are tagged parameters; parameters need one")
    source = "\n".join(f"{name} = {value!r}" for name, value in parameters.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    notebook.cells.insert(tagged[0] + 1, cell)


# TensorFlow's C++ runtime logs these lines at import, to the process's stderr, whatever
# TF_CPP_MIN_LOG_LEVEL says; the kernel forwards them into the notebook. They say nothing
# about the notebook, so they are removed from its outputs (any other stderr stays).
START_UP_LOG = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:. ]+\d+ port\.cc:\d+\] oneDNN custom operations are on\..*"
    r"|I\d{4} [\d:. ]+\d+ cpu_feature_guard\.cc:\d+\] .*"
    r"|To enable the following instructions: .*"
    r"|)$"
)


def _drop_framework_start_up_logs(notebook: nbformat.NotebookNode) -> None:
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = [
            output
            for output in cell.outputs
            if not (
                output.output_type == "stream"
                and output.name == "stderr"
                and all(START_UP_LOG.match(line) for line in output.text.splitlines())
            )
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"notebooks to run (default: all of {NOTEBOOKS})")
    names = [name.removesuffix(".ipynb") for name in parser.parse_args(argv).names] or NOTEBOOKS
    unknown = sorted(set(names) - set(NOTEBOOKS))
    if unknown:
        parser.error(f"unknown notebook {', '.join(unknown)}; valid: {', '.join(NOTEBOOKS)}")
    tty = sys.stdout.isatty()
    for number, name in enumerate(names, 1):
        path = HERE / f"{name}.ipynb"
        notebook = nbformat.read(path, as_version=4)
        start = time.perf_counter()

        def progress(index, total, cell, name=name, number=number):
            # One line, rewritten in place, on a terminal; a line per cell in a log
            line = cell.source.splitlines()[0] if cell.source else ""
            text = f"[{number}/{len(names)}] {name}: cell {index}/{total}  {line[:50]:<50}"
            print(f"\r{text}" if tty else text, end="" if tty else "\n", flush=True)

        # The single-backend notebooks show NumPy in the committed outputs.
        execute(notebook, cwd=HERE, backend="numpy", progress=progress)
        nbformat.write(notebook, path)
        seconds = time.perf_counter() - start
        print(f"\r[{number}/{len(names)}] {name}: done in {seconds:.0f} s".ljust(90))
    return 0


if __name__ == "__main__":
    sys.exit(main())
