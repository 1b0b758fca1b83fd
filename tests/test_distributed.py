"""The layers under the frameworks' own distributed engines, two CPU workers each: torch
DistributedDataParallel and FSDP2 (gloo over loopback), tf.distribute.MirroredStrategy over two
logical CPU devices, and JAX's sharding of the batch over two host devices.

Each engine's gradients (and weights after one SGD step) from two halves of a float64 batch
equal those of a single-process step on the full batch from the same weights, within the
float64 agreement of docs/design.md. Every engine runs in a fresh interpreter, tests/distributed/
*.py, whose setup must come before the framework starts (logical devices, XLA_FLAGS) and whose
process group must not outlive the run; each prints one JSON line that the tests here judge.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from conftest import backend_module
from mha import harness

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "distributed"
TOLERANCE = harness.TOLERANCES["float64"]
# Every script starts one framework (torch: three interpreters) on 2 cores shared with others
TIMEOUT = 240


def run_script(name: str, *args: str, environment: dict | None = None) -> dict | list:
    """The JSON line a script of tests/distributed prints; fails on its error or timeout."""
    env = {**os.environ, **(environment or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # A session of its own: on timeout the script and every rank it spawned are killed
    process = subprocess.Popen(
        [sys.executable, str(SCRIPTS / name), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{name} {args} ran past {TIMEOUT} s:\n{stderr[-4000:]}")
    assert process.returncode == 0, f"{name} {args} failed:\n{stderr[-4000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_torch_data_parallel_gives_the_single_process_step(engine):
    backend_module("torch")
    ranks = run_script("torch_data_parallel.py", engine)

    assert len(ranks) == 2
    for rank in ranks:
        expected_type = {"ddp": "DistributedDataParallel", "fsdp2": "FSDPModel"}[engine]
        assert rank["engine"] == expected_type
        assert rank["world_size"] == 2 and rank["local_batch"] == 4
        # DDP replicates every parameter; FSDP2 shards every one (DTensor) over the two ranks
        assert rank["sharded"] == [engine == "fsdp2"] * 10
        assert rank["local_rows"] == (8 if engine == "fsdp2" else 16)
        assert rank["gradients"] <= TOLERANCE, rank
        # A rank's half alone is far from the full batch: the engine's reduction did the rest
        assert rank["half_batch_alone"] > 1e-3, rank
        assert rank["weights"] <= TOLERANCE, rank
        assert rank["across_ranks"] == 0.0, rank


@pytest.mark.slow
@pytest.mark.tensorflow
def test_tensorflow_mirrored_strategy_gives_the_single_device_step():
    backend_module("tensorflow")
    result = run_script("tf_mirrored.py", environment={"TF_CPP_MIN_LOG_LEVEL": "2"})

    assert result["replicas"] == 2
    assert [device.rsplit("/", 1)[-1] for device in result["devices"]] == [
        "device:CPU:0",
        "device:CPU:1",
    ]
    assert result["local_batch"] == [4, 4]
    assert result["mirrored"] == ["MirroredVariable"] * 10
    assert max(result["gradients"]) <= TOLERANCE, result
    # Each replica's copy of the weights after model.fit's step, and the step moved them
    assert len(result["weights"]) == 2 and max(result["weights"]) <= TOLERANCE, result
    assert result["moved"] > 1e-3, result


@pytest.mark.jax
def test_jax_sharded_batch_gives_the_unsharded_gradient():
    backend_module("jax")
    result = run_script("jax_sharding.py", environment={"JAX_ENABLE_X64": "1"})

    assert result["devices"] == 2
    # X, valid_lens and target each split into two halves of the batch, one per device
    assert result["input_devices"] == [2, 2, 2]
    assert result["input_shards"] == [[[4, 5, 8]] * 2, [[4]] * 2, [[4, 5]] * 2]
    assert result["params_replicated"] and result["gradients_replicated"], result
    assert result["all_reduce"], result
    assert result["dtype"] == "float64"
    assert result["gradients"] <= TOLERANCE, result
    assert result["weights"] <= TOLERANCE, result
