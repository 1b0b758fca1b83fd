"""docs/deploying.md's examples run as written and hold their own checks.

Each example fenced as python asserts that what it exported gives the NumPy reference's
numbers; this test runs each one in a fresh directory, after asking conftest for the backends
it imports, so that a required backend that is missing fails here. The page's excerpts of the
scripts in tests/distributed are fenced as py: tests/test_distributed.py runs those scripts.
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
    exec(compile(block, "docs/deploying.md", "exec"), {})


def test_page_has_an_example_per_framework():
    imported = {name for block in BLOCKS for name in _backends(block)}
    assert imported >= {"torch", "tensorflow", "jax"}, imported


def test_excerpts_are_of_the_scripts_that_run():
    # Every script the page names is one that tests/test_distributed.py runs
    named = set(re.findall(r"tests/distributed/(\w+\.py)", PAGE.read_text()))
    scripts = {path.name for path in (PAGE.parents[1] / "tests" / "distributed").glob("*.py")}
    assert named == scripts, (named, scripts)
