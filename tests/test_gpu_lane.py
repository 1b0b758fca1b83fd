"""The GPU lane (tests/gpu_lane.py, run by `python3 lanes.py gpu`) on the CPU, so that it keeps
working where CI has no GPU: its masked-key and synchronization steps pass, and a step that
finds a poisoned row says FAILED."""

import pathlib
import subprocess
import sys

import gpu_lane
import numpy as np
import pytest

from conftest import backend_module

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def both_frameworks():
    for name in gpu_lane.BACKENDS:
        backend_module(name)


@pytest.mark.parametrize("step", ["masked_keys", "sync"])
def test_a_step_passes_on_the_cpu(step, capsys):
    assert gpu_lane.main([step, "--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith(f"{step} on cpu: ok")
    for name in gpu_lane.BACKENDS:
        assert f" {name} on cpu: " in out


class Leaky:
    """A layer that lets a NaN key through to every output."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, queries, keys, values, **arguments):
        output = self.layer(queries, keys, values, **arguments)
        return output * (keys.sum() * 0 + 1)  # NaN everywhere when a key is NaN

    @property
    def attention_weights(self):
        return self.layer.attention_weights


@pytest.mark.parametrize("name", gpu_lane.BACKENDS)
def test_a_poisoned_row_fails_the_step(name, monkeypatch):
    real = gpu_lane._layers

    def leaky(*arguments):
        reference, layer = real(*arguments)
        return reference, Leaky(layer)

    assert gpu_lane.one_masked_key(name, "multihead", "causal", np.nan, "float32", "cpu") is None
    monkeypatch.setattr(gpu_lane, "_layers", leaky)
    problem = gpu_lane.one_masked_key(name, "multihead", "causal", np.nan, "float32", "cpu")
    assert problem and "the poison reached a row" in problem


def test_the_lane_without_a_gpu_says_so():
    lane = subprocess.run(
        [sys.executable, "lanes.py", "gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    backend = backend_module("torch")
    if backend.torch.cuda.is_available():
        pytest.skip("a GPU is here: the lane runs rather than saying there is none")
    assert lane.returncode == 0 and "nothing to run" in lane.stdout
