"""The GPU lane (tests/gpu_lane.py, run by `python3 lanes.py gpu`) on the CPU, so that it keeps
working where CI has no GPU: its masked-key and synchronization steps pass, and a step that
finds a poisoned row says FAILED."""

import os
import pathlib
import subprocess
import sys
import time

import gpu_lane
import numpy as np
import pytest

from conftest import backend_module

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def both_frameworks():
    for name in gpu_lane.BACKENDS:
        backend_module(name)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["masked_keys", "sync", "conform"])
def test_a_step_passes_on_the_cpu(step, capsys):
    assert gpu_lane.main([step, "--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith(f"{step} on cpu: ok")
    for name in gpu_lane.BACKENDS:
        assert f" {name} on cpu: " in out or f" {gpu_lane.CONFORM[name][0]} on cpu:" in out


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


def test_the_lane_without_a_gpu_says_so(tmp_path):
    # It passes, unless MHA_GPU_LANE_OUT asks for the reports of a run on a GPU
    backend = backend_module("torch")
    if backend.torch.cuda.is_available():
        pytest.skip("a GPU is here: the lane runs rather than saying there is none")
    environment = {k: v for k, v in os.environ.items() if k != "MHA_GPU_LANE_OUT"}
    for out, code in ((None, 0), (tmp_path, 3)):
        if out is not None:
            environment["MHA_GPU_LANE_OUT"] = str(out)
        lane = subprocess.run(
            [sys.executable, "lanes.py", "gpu"],
            cwd=ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert lane.returncode == code and "nothing to run" in lane.stdout


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.skipif(not pathlib.Path("/proc").is_dir(), reason="reads /proc")
def test_a_step_past_its_limit_is_killed_with_the_processes_it_started(tmp_path):
    # The bench step runs `mha bench` in a process of its own: a step killed at its limit
    # must not leave it running on the GPU beside the next step
    sys.path.insert(0, str(ROOT))
    import lanes

    marker = tmp_path / "child"
    step = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", step], start_new_session=True)
    for _ in range(200):
        if marker.exists() and marker.read_text():
            break
        time.sleep(0.05)
    child = int(marker.read_text())
    assert lanes._wait(process, time.monotonic() + 0.5) == 124
    for _ in range(100):  # SIGKILL is delivered asynchronously
        if not _alive(child):
            break
        time.sleep(0.05)
    assert not _alive(process.pid) and not _alive(child)
