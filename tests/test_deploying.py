"""docs/deploying.md's examples run as written and hold their own checks.

Each example asserts that what it exported or trained gives the NumPy reference's numbers (or
one process's gradients); this test runs each one in a fresh directory, after asking conftest
for the backends it imports, so that a required backend that is missing fails here.
"""

import pathlib
import re

import pytest

from conftest import backend_module

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "deploying.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def _backends(block):
    return [
        name for name in re.findall(r"from mha\.backends import (\w+)", block) if name != "numpy"
    ]


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(
            block,
            id=f"example-{number + 1}",
            marks=[getattr(pytest.mark, name) for name in _backends(block)],
        )
        for number, block in enumerate(BLOCKS)
    ],
)
def test_example_runs(block, tmp_path, monkeypatch):
    for name in _backends(block):
        backend_module(name)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, f"docs/deploying.md, {block.splitlines()[0]}", "exec"), {})


def test_page_has_an_example_per_framework():
    imported = {name for block in BLOCKS for name in _backends(block)}
    assert imported >= {"torch", "tensorflow", "jax"}, imported
