"""The README's Python examples run as written."""

import pathlib
import re

import pytest

from conftest import backend_module

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.torch
@pytest.mark.tensorflow
@pytest.mark.parametrize("number", range(len(BLOCKS)))
def test_readme_example_runs(number, tmp_path, monkeypatch):
    for name in ("torch", "tensorflow"):
        backend_module(name)  # the examples move weights between torch, Keras and mha
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[number], f"README.md example {number + 1}", "exec"), {})


def test_readme_has_examples():
    assert len(BLOCKS) >= 2
