"""The command line: `mha info`, `mha compare`, `python -m mha`, exit codes."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from mha import cli, harness

pytestmark = pytest.mark.numpy


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_info_lists_every_backend():
    code, out, _ = run("info")
    assert code == 0
    lines = out.splitlines()
    for name in ("numpy", "torch", "tensorflow", "mxnet"):
        line = next(line for line in lines if line.startswith(name + " "))
        assert (" ok " in line) or ("unavailable" in line and "pip install" in line)
    numpy_line = next(line for line in lines if line.startswith("numpy "))
    assert np.__version__ in numpy_line


def test_compare_on_numpy_agrees_and_prints_a_table():
    code, out, err = run("compare", "--backends", "numpy", "--dtype", "float32", "--seed", "3")
    assert code == 0, out
    assert "layer [masks]" in out and "backend" in out
    assert "MultiHeadAttention(bias=True)[valid_lens_1d]" in out
    assert out.strip().endswith("agree on numpy.")
    assert "[0/" in err and "done" in err  # progress


def test_compare_json_is_machine_readable():
    code, out, _ = run(
        "compare",
        "--backends",
        "numpy",
        "--json",
        "--dtype",
        "float64",
        "--batch-size",
        "2",
        "--num-heads",
        "4",
    )
    assert code == 0
    report = json.loads(out)
    assert report["passed"] is True and report["tolerance"] == 1e-10
    rows = report["rows"]
    assert len(rows) == len(harness.default_cases())
    multihead = next(r for r in rows if r["case"] == "MultiHeadAttention(bias=False)[no_mask]")
    assert multihead["output_shape"] == [2, 5, 8]


def test_compare_fails_and_names_the_backend_that_disagrees(monkeypatch):
    original = harness.run_case

    def broken(backend, case, inputs, weights, config):
        result = original(backend, case, inputs, weights, config)
        # Break the float32 run, not the float64 reference
        if case.layer == "MultiHeadAttention" and config["dtype"] == "float32":
            result.output = result.output * 1.001  # a small arithmetic error
        return result

    monkeypatch.setattr(harness, "run_case", broken)
    code, out, _ = run("compare", "--backends", "numpy")
    assert code == 1
    assert "FAIL" in out
    assert out.strip().endswith("disagree, on: numpy.")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--backends", "theano"], "Unknown mha backend"),
        (["compare", "--num-hiddens", "10", "--num-heads", "3"], "divisible"),
        (["compare", "--num-heads", "0"], "expected a positive integer"),
        (["compare", "--dtype", "int8"], "invalid choice"),
        (["launch"], "invalid choice"),
        ([], "required"),
    ],
)
def test_usage_errors_exit_2(argv, message):
    code, _, err = run(*argv)
    assert code == 2
    assert message in err


def test_python_dash_m_mha():
    completed = subprocess.run(
        [sys.executable, "-m", "mha", "compare", "--backends", "numpy"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "agree on numpy" in completed.stdout
    completed = subprocess.run(
        [sys.executable, "-m", "mha", "compare", "--backends", "nope"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 2
    assert "Unknown mha backend" in completed.stderr


def test_a_missing_backend_is_skipped_unless_named(monkeypatch):
    from mha.registry import BackendUnavailableError, load_backend

    def without_mxnet(name):
        if name == "mxnet":
            raise BackendUnavailableError("mxnet", ModuleNotFoundError("No module named 'mxnet'"))
        return load_backend(name)

    monkeypatch.setattr(cli, "load_backend", without_mxnet)
    monkeypatch.setattr(cli, "BACKENDS", {"numpy": "mha.backends.numpy", "mxnet": "x"})
    code, out, _ = run("compare")
    assert code == 0
    assert "skipped mxnet: The mha backend 'mxnet' is not available" in out
    assert 'pip install "mha[mxnet]"' in out
    code, _, err = run("compare", "--backends", "numpy,mxnet")
    assert code == 2
    assert "The mha backend 'mxnet' is not available" in err
