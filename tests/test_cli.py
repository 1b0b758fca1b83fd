"""The command line: `mha info`, `mha compare`, `python -m mha`, exit codes."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mha import cli, cli_common, harness

pytestmark = pytest.mark.numpy


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_info_lists_every_backend_with_a_hint_only_where_it_is_missing():
    code, out, err = run("info")
    assert code == 0
    lines = out.splitlines()
    for name in ("numpy", "torch", "tensorflow", "mxnet", "jax"):
        line = next(line for line in lines if line.startswith(name + " "))
        assert (" ok " in line and "pip" not in line) or (
            "unavailable" in line and "pip install" in line
        ), line
        assert f"importing {name}" in err  # progress while the frameworks import
    numpy_line = next(line for line in lines if line.startswith("numpy "))
    assert np.__version__ in numpy_line


def test_compare_on_numpy_alone_says_it_compared_nothing_across_frameworks():
    # A summary by default: each backend's rows and largest differences, the verdict; exit 3
    code, out, err = run("compare", "--backends", "numpy", "--dtype", "float32", "--seed", "3")
    assert code == 3, out
    rows = len(harness.default_cases())
    numpy_line = next(line for line in out.splitlines() if line.startswith("numpy "))
    assert numpy_line.split()[1:3] == [str(rows), "0"], numpy_line
    assert f"All {rows} comparisons agree on numpy." in out
    assert "nothing was compared across frameworks" in out
    assert "MultiHeadAttention(bias=True)[valid_lens_1d]" not in out
    assert "[0/" in err and "done" in err  # progress
    # Every row with --table (or --verbose)
    for flag in ("--table", "--verbose"):
        code, out, _ = run("compare", "--backends", "numpy", "--seed", "3", flag)
        assert code == 3 and "layer [masks]" in out
        assert "MultiHeadAttention(bias=True)[valid_lens_1d]" in out
        assert len([line for line in out.splitlines() if line.endswith("  ok")]) == rows


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
    assert code == 3
    report = json.loads(out)
    assert report["passed"] is True and report["tolerance"] == 1e-10
    assert report["across_frameworks"] is False
    rows = report["rows"]
    assert len(rows) == len(harness.default_cases())
    multihead = next(r for r in rows if r["case"] == "MultiHeadAttention(bias=False)[no_mask]")
    assert multihead["output_shape"] == [2, 5, 8]


def test_compare_fails_and_names_the_backend_that_disagrees(monkeypatch):
    original = harness.run_case

    def broken(backend, case, inputs, weights, config, *args, **kwargs):
        result = original(backend, case, inputs, weights, config, *args, **kwargs)
        # Break the float32 run, not the float64 reference
        if case.layer == "MultiHeadAttention" and config["dtype"] == "float32":
            result.output = result.output * 1.001  # a small arithmetic error
            os.write(2, b"a framework's native log line\n")
        return result

    monkeypatch.setattr(harness, "run_case", broken)
    code, out, err = run("compare", "--backends", "numpy")
    assert code == 1
    # Only the broken layer fails, on its output, listed under the summary: the others agree
    failing = [line for line in out.splitlines() if "FAIL" in line]
    assert failing and all(line.startswith("MultiHeadAttention") for line in failing), out
    assert not any("error" in line.lower() for line in failing), out
    multihead = sum(case.layer == "MultiHeadAttention" for case in harness.default_cases())
    assert len(failing) == multihead
    assert f"{multihead} of {len(harness.default_cases())} comparisons disagree, on: numpy." in out
    # The native log lines set aside while it ran are shown after a failure
    assert "set aside while mha ran:\na framework's native log line" in err


def test_compare_json_of_a_disagreement_says_it_failed(monkeypatch):
    original = harness.run_case

    def broken(backend, case, inputs, weights, config, *args, **kwargs):
        result = original(backend, case, inputs, weights, config, *args, **kwargs)
        if case.layer == "AddNorm" and config["dtype"] == "float32":
            result.output = result.output + 0.01  # an arithmetic error in one layer
        return result

    monkeypatch.setattr(harness, "run_case", broken)
    code, out, _ = run("compare", "--backends", "numpy", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["passed"] is False
    failing = {
        row["case"].split("[")[0].split("(")[0] for row in report["rows"] if not row["passed"]
    }
    assert failing == {"AddNorm"}


def test_compare_runs_with_the_seed_sizes_and_dtype_given(monkeypatch):
    # What --seed and the sizes choose reaches the comparison; --dtype defaults to float32
    seen = []
    original = harness.compare

    def spy(**kwargs):
        seen.append(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(harness, "compare", spy)
    sizes = ["--batch-size", "3", "--num-queries", "2", "--num-keys", "6"]
    sizes += ["--num-hiddens", "12", "--num-heads", "3"]
    code, out, _ = run("compare", "--backends", "numpy", "--json", "--seed", "7", *sizes)
    assert code == 3
    (arguments,) = seen
    assert arguments["seed"] == 7 and arguments["dtype"] == "float32"
    assert arguments["shapes"] == harness.Shapes(
        batch_size=3, num_queries=2, num_keys=6, num_hiddens=12, num_heads=3
    )
    report = json.loads(out)
    assert (report["seed"], report["dtype"]) == (7, "float32")
    multihead = next(
        r for r in report["rows"] if r["case"] == "MultiHeadAttention(bias=False)[no_mask]"
    )
    assert multihead["output_shape"] == [3, 2, 12]  # (batch, queries, num_hiddens)


def test_compare_records_its_own_run_and_a_failed_record_exits_1(tmp_path, monkeypatch):
    from mha import golden

    path = tmp_path / "cases.safetensors"
    code, out, err = run("compare", "--backends", "numpy", "--seed", "4", "--record", str(path))
    assert code == 3, err
    assert f"Recorded {len(harness.default_cases())} cases as numpy computes them" in out
    # The recorded inputs are those of seed 4: as recording seed 4 directly, not seed 0
    recorded = golden.read(path)
    direct = {seed: golden.record_run(tmp_path / f"{seed}.safetensors", "numpy", seed=seed)
              for seed in (0, 4)}  # fmt: skip
    case = next(c for c in recorded if c.layer == "MultiHeadAttention")

    def inputs_of(cases):
        found = next(c for c in cases if c.name == case.name)
        return np.asarray(found.inputs["queries"])

    np.testing.assert_array_equal(inputs_of(recorded), inputs_of(direct[4]))
    assert not np.array_equal(inputs_of(recorded), inputs_of(direct[0]))
    assert cli.main(["verify", str(path), "--backends", "numpy"], out=io.StringIO()) == 0

    # A write that fails (the disk refuses it): the run is reported as failed
    def refused(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(golden, "write_safetensors", refused)
    code, out, err = run("compare", "--backends", "numpy", "--record", str(path))
    assert code == 1 and "mha compare: error: No space left on device" in err
    # The report came before the record: the run is not lost with it
    assert "Largest differences from the NumPy reference" in out and "Recorded" not in out


def test_a_reader_that_stops_or_sizes_past_memory_end_in_one_line(tmp_path):
    class Stopped(io.StringIO):  # `mha compare --table | head -1`: the pipe closes
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    err = io.StringIO()
    assert cli.main(["info"], out=Stopped(), err=err) == 1
    assert "Traceback" not in err.getvalue()
    # numpy refuses the first array of this size at once (petabytes)
    sizes = ("--batch-size", "100000", "--num-queries", "100000", "--num-keys", "100000")
    code, _, err = run("compare", "--backends", "numpy", *sizes)
    assert code == 1 and "mha compare: error: not enough memory: Unable to allocate" in err


@pytest.mark.torch
@pytest.mark.tensorflow
def test_compare_on_a_device_skips_the_backends_mha_cannot_place_unless_named():
    skipped = {}
    assert cli_common.placeable(["numpy", "tensorflow", "torch"], skipped, "cpu") == [
        "numpy",
        "torch",
    ]
    assert "only torch and jax" in skipped["tensorflow"]
    with pytest.raises(ValueError, match="no framework here runs on the cpu"):
        cli_common.placeable(["numpy", "tensorflow"], {}, "cpu")
    code, _, err = run("compare", "--backends", "numpy,tensorflow", "--device", "cpu")
    assert code == 2 and "only torch and jax" in err


def test_a_folder_given_without_prefix_is_named_a_folder(tmp_path):
    code, _, err = run("inspect", str(tmp_path))
    assert (
        code == 2
        and f"{tmp_path} is a folder, read as a whole model's weights: give --prefix" in err
    )


def test_verify_runs_in_the_dtype_given(tmp_path, monkeypatch):
    from mha import golden

    path = tmp_path / "cases.safetensors"
    golden.record_run(path, "numpy", harness.default_cases()[:2])  # float32 cases
    seen = []
    original = golden.verify

    def spy(cases, names, dtype=None, **kwargs):
        seen.append(dtype)
        return original(cases, names, dtype, **kwargs)

    monkeypatch.setattr(golden, "verify", spy)
    for argv, dtype in (([], None), (["--dtype", "float64"], "float64")):
        code, out, _ = run("verify", str(path), "--backends", "numpy", *argv)
        assert code == 0 and "All 2 comparisons agree on numpy." in out
        assert seen.pop() == dtype
        # float32 numbers hold a float64 run to float32's tolerance, and the legend says so
        assert "tolerance 1e-05 relative to the output's scale" in out, out
        # the options it names are its own (verify has no --json)
        assert out.rstrip().endswith("Every row: --table."), out


def test_compare_on_numpy_alone_in_float64_says_what_was_compared():
    # In float64 numpy's run is the reference itself: no "float32 run" was compared
    code, out, _ = run("compare", "--backends", "numpy", "--dtype", "float64")
    assert code == 3
    assert "the float64 reference is numpy's own run" in out and "float32" not in out


def test_native_log_lines_are_set_aside_and_standard_error_restored(capfd, monkeypatch):
    original = harness.run_case

    def noisy(*args, **kwargs):
        os.write(2, b"I0000 a native note\n")
        return original(*args, **kwargs)

    monkeypatch.setattr(harness, "run_case", noisy)
    assert cli.main(["compare", "--backends", "numpy"], out=io.StringIO()) == 3
    os.write(2, b"after mha\n")
    err = capfd.readouterr().err
    assert "I0000" not in err and "after mha" in err  # the descriptor is the same again
    assert "[0/" in err  # mha's own progress reached standard error while it ran


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--backends", "theano"], "Unknown mha backend"),
        (["compare", "--num-hiddens", "10", "--num-heads", "3"], "argument --num-heads: must"),
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
    assert len(err.strip().splitlines()) == 1, err  # one line, as docs/cli.md says


def test_compare_exit_codes_at_small_sizes():
    # Expected: 0 where the sizes given let every case agree, the grouped-query and rotary
    # cases taking sizes of their own (named in their label and in the JSON's own_sizes) where
    # 6 features in 2 heads cannot build them; 2, with one argparse-style line naming the
    # argument and the value, where num_heads does not divide num_hiddens
    small = ["--num-hiddens", "6", "--num-heads", "2", "--batch-size", "1"]
    small += ["--num-queries", "1", "--num-keys", "1"]
    code, out, err = run("compare", "--backends", "numpy", "--table", *small)
    assert code == 3, out + err
    assert "MultiHeadAttention(num_heads=4,num_hiddens=8,num_kv_heads=2)[valid_lens_1d]" in out
    assert "MultiHeadAttention(num_hiddens=8,rope_theta=10000.0)[valid_lens_2d]" in out
    assert "22 cases need other sizes than those given" in out
    assert "agree on numpy." in out
    code, out, _ = run("compare", "--backends", "numpy", "--json", *small)
    assert code == 3 and len(json.loads(out)["own_sizes"]) == 22
    code, out, err = run(
        "compare", "--backends", "numpy", "--num-hiddens", "10", "--num-heads", "4"
    )
    assert code == 2 and out == ""
    assert (
        err == "mha compare: error: argument --num-heads: must divide --num-hiddens 10. "
        "Received: 4\n"
    )


@pytest.mark.jax
def test_compare_in_float64_turns_on_jaxs_64_bit_mode(monkeypatch):
    # JAX computes in float64 only in its 64-bit mode, off unless turned on: the command turns
    # it on, and JAX's float64 rows agree with the reference (two cases, for time)
    from conftest import framework_import

    jax = framework_import("jax")
    cases = [case for case in harness.default_cases() if case.layer == "MultiHeadAttention"]
    monkeypatch.setattr(harness, "default_cases", lambda: cases[:2])
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        code, out, err = run("compare", "--backends", "jax", "--dtype", "float64", "--json")
        assert jax.config.jax_enable_x64
    finally:
        jax.config.update("jax_enable_x64", before)
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert len(rows) == 2 and all(row["passed"] for row in rows), rows


@pytest.mark.tensorflow
def test_compare_turns_off_tensorflows_tf32_in_its_process(monkeypatch):
    # TensorFlow multiplies float32 in TF32 on NVIDIA GPUs since Ampere unless told not to,
    # process-wide: its float32 rows there would be 1e-4 off the reference's. The command owns
    # its process and turns it off (a CPU computes float32 exactly: the switch is what shows)
    from conftest import framework_import

    tf = framework_import("tensorflow")
    cases = [case for case in harness.default_cases() if case.layer == "MultiHeadAttention"]
    monkeypatch.setattr(harness, "default_cases", lambda: cases[:1])
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(True)
    try:
        code, _, err = run("compare", "--backends", "numpy,tensorflow")
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)
    assert code == 0, err


def test_python_dash_m_mha():
    completed = subprocess.run(
        [sys.executable, "-m", "mha", "compare", "--backends", "numpy"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 3, completed.stderr
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
    from mha import registry

    load_backend = registry.load_backend

    def without_mxnet(name):
        if name == "mxnet":
            raise registry.BackendUnavailableError(
                "mxnet", ModuleNotFoundError("No module named 'mxnet'")
            )
        return load_backend(name)

    # Only numpy and a missing mxnet, whatever is installed here
    monkeypatch.setattr(registry, "load_backend", without_mxnet)
    monkeypatch.setattr(registry, "BACKENDS", {"numpy": "mha.backends.numpy", "mxnet": "x"})
    code, out, _ = run("compare")
    assert code == 3
    assert "skipped mxnet: The mha backend 'mxnet' is not available" in out
    assert 'pip install "mxnet==1.9.1" "numpy<2", in an environment of its own' in out
    code, _, err = run("compare", "--backends", "numpy,mxnet")
    assert code == 2
    assert "The mha backend 'mxnet' is not available" in err


# ---------------------------------------------------------------------------------------------
# mha convert and mha inspect


def torch_module(seed=0, **arguments):
    import torch

    module = torch.nn.MultiheadAttention(8, 2, batch_first=True, **arguments).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.rand(parameter.shape, generator=generator) - 0.5)
    return module


def convert_round_trip(tmp_path, module):
    """`mha convert` of a module's state_dict: torch -> Keras -> mha checkpoint -> torch.
    Returns the first conversion's report, the Keras file, the checkpoint and the state_dict
    read back at the end."""
    import torch

    source, keras_file = tmp_path / "attention.pt", tmp_path / "attention.weights.h5"
    checkpoint, back = tmp_path / "attention.safetensors", tmp_path / "back.pth"
    torch.save(module.state_dict(), source)
    code, out, err = run("convert", str(source), str(keras_file), "--num-heads", "2")
    assert code == 0, err
    assert run("convert", str(keras_file), str(checkpoint))[0] == 0
    assert run("convert", str(checkpoint), str(back))[0] == 0
    return out, keras_file, checkpoint, torch.load(back, weights_only=True)


@pytest.mark.torch
@pytest.mark.tensorflow
@pytest.mark.parametrize("kdim", [None, 5], ids=["packed", "kdim"])
def test_convert_torch_to_keras_to_mha_and_back(tmp_path, kdim):
    from conftest import backend_module, required_backends

    backend_module("torch")
    backend_module("tensorflow")
    import keras
    import torch

    import mha

    module = torch_module(kdim=kdim, vdim=kdim)
    out, keras_file, checkpoint, again = convert_round_trip(tmp_path, module)
    assert "read back: the same weights" in out
    assert again.keys() == module.state_dict().keys()
    assert all(torch.equal(again[k], v) for k, v in module.state_dict().items())
    # The Keras file loads into a Keras layer with Keras's own loader and computes the same
    rng = np.random.default_rng(0)
    queries = rng.standard_normal((2, 3, 8)).astype("float32")
    keys = rng.standard_normal((2, 4, kdim or 8)).astype("float32")
    values = rng.standard_normal((2, 4, kdim or 8)).astype("float32")
    layer = keras.layers.MultiHeadAttention(2, 4, output_shape=8)
    layer.build(queries.shape, values.shape, keys.shape)
    keras.saving.load_weights(layer, str(keras_file))
    expected, _ = module(*(torch.from_numpy(x) for x in (queries, keys, values)))
    assert (
        harness.difference(
            np.asarray(layer(queries, values, keys)), expected.detach().numpy(), relative=True
        )
        <= 1e-5
    )
    for backend in required_backends():
        loaded = mha.load(checkpoint, backend=backend)
        module_of = backend_module(backend)
        output = loaded(*(module_of.from_numpy(x) for x in (queries, keys, values)))
        assert (
            harness.difference(module_of.to_numpy(output), expected.detach().numpy(), relative=True)
            <= 1e-5
        )


@pytest.mark.torch
@pytest.mark.tensorflow
def test_convert_keeps_bfloat16_bit_for_bit(tmp_path):
    # bfloat16 weights, the usual dtype of large checkpoints, cross every file kind unchanged;
    # the Keras file also loads with Keras's own loader into a bfloat16 Keras layer
    from conftest import backend_module

    backend_module("torch")
    backend_module("tensorflow")
    import keras
    import torch

    module = torch_module(seed=3).to(torch.bfloat16)
    out, keras_file, _, again = convert_round_trip(tmp_path, module)
    assert "bfloat16" in out
    for name, value in module.state_dict().items():
        assert again[name].dtype == torch.bfloat16
        assert torch.equal(again[name].view(torch.int16), value.view(torch.int16)), name
    layer = keras.layers.MultiHeadAttention(2, 4, output_shape=8, dtype="bfloat16")
    layer.build((2, 3, 8), (2, 4, 8), (2, 4, 8))
    keras.saving.load_weights(layer, str(keras_file))
    # Keras's query kernel is (in, heads, head size): torch's first third of in_proj_weight
    kernel = np.asarray(layer.query_dense.kernel).reshape(8, 8).T
    expected = module.in_proj_weight[:8].view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(kernel.view(np.uint16), expected)


@pytest.mark.torch
def test_convert_usage_errors_exit_2(tmp_path):
    from conftest import backend_module

    torch = backend_module("torch").torch

    source = tmp_path / "attention.pt"
    torch.save(torch_module().state_dict(), source)
    code, _, err = run("convert", str(source), str(tmp_path / "a.safetensors"))
    assert code == 2 and "give --num-heads" in err
    code, _, err = run("convert", str(source), str(tmp_path / "a.txt"), "--num-heads", "2")
    assert code == 2 and "cannot tell the kind" in err
    # transformers' pytorch_model.bin: the error says what it is, and how to read it
    os.link(source, tmp_path / "pytorch_model.bin")
    code, _, err = run("inspect", str(tmp_path / "pytorch_model.bin"), "--num-heads", "2")
    assert code == 2 and "holds a torch state_dict: give it a .pt name" in err
    code, _, err = run("convert", str(tmp_path / "missing.pt"), str(tmp_path / "a.safetensors"))
    assert code == 2 and "does not exist" in err
    code, _, err = run("convert", str(source), str(tmp_path / "a.safetensors"), "--num-heads", "0")
    assert code == 2 and "expected a positive integer" in err
    code, _, err = run("convert", str(source), str(tmp_path / "a.safetensors"), "--num-heads", "3")
    assert code == 1 and "divisible" in err


@pytest.mark.torch
def test_convert_refuses_files_it_cannot_read_or_express(tmp_path):
    import pickle

    import mha
    import mha.backends.numpy
    from conftest import backend_module

    torch = backend_module("torch").torch

    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    hostile = tmp_path / "hostile.pt"
    hostile.write_bytes(pickle.dumps({"in_proj_weight": Payload()}, protocol=2))
    code, _, err = run("convert", str(hostile), str(tmp_path / "a.safetensors"), "--num-heads", "2")
    assert code == 1 and "weights_only=True" in err
    assert not marker.exists()
    bias_kv = tmp_path / "bias_kv.pt"
    torch.save(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True).state_dict(), bias_kv)
    code, _, err = run("convert", str(bias_kv), str(tmp_path / "a.safetensors"), "--num-heads", "2")
    assert code == 1 and "add_bias_kv" in err
    layer = mha.backends.numpy.MultiHeadAttention(8, 2, query_size=6, key_size=8, value_size=8)
    mha.set_weights(layer, mha.random_weights(layer))
    mha.save(layer, tmp_path / "query6.safetensors")
    code, _, err = run("convert", str(tmp_path / "query6.safetensors"), str(tmp_path / "a.pt"))
    assert code == 1 and "query size to equal embed_dim" in err
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    code, out, err = run("inspect", str(tmp_path / "junk.safetensors"))
    assert code == 1 and "not a valid safetensors file" in err
    assert out == ""  # nothing of the file is told before it is read


def test_inspect_prints_class_config_and_shapes(tmp_path):
    import mha
    import mha.backends.numpy

    layer = mha.backends.numpy.MultiHeadAttention(
        8, 2, bias=True, query_size=6, key_size=5, value_size=4
    )
    mha.set_weights(layer, mha.random_weights(layer, seed=3))
    mha.save(layer, tmp_path / "attention.safetensors")
    code, out, _ = run("inspect", str(tmp_path / "attention.safetensors"))
    assert code == 0
    assert "class: MultiHeadAttention (saved from the numpy backend)" in out
    config = json.loads(out.split("config: ", 1)[1].splitlines()[0])
    assert config == {
        "num_hiddens": 8,
        "num_heads": 2,
        "dropout": 0.0,
        "bias": True,
        "query_size": 6,
        "key_size": 5,
        "value_size": 4,
        "dtype": "float32",
        "out_bias": None,
        "out_features": None,
        "scale": None,
        "empty_rows": "zeros",
        "sliding_window": None,
        "attention_chunk_size": None,
        "num_kv_heads": None,
        "rope_theta": None,
        "rope_interleaved": False,
        "rope_dim": None,
        "rope_scaling": None,
        "query_scaling": None,
        "softcap": None,
        "sinks": False,
        "qk_norm": None,
        "qk_norm_eps": 1e-06,
        "output_gate": False,
        "alibi": False,
        "value_norm": False,
    }
    shapes = dict(line.split(maxsplit=1) for line in out.split("weights:\n", 1)[1].splitlines())
    assert shapes["W_q"].split()[:2] == ["(6,", "8)"] and shapes["b_o"].split() == [
        "(8,)",
        "float32",
    ]
    # A head count the file contradicts is refused, as in every other kind; the file's own
    # count is taken
    path = str(tmp_path / "attention.safetensors")
    code, _, err = run("inspect", path, "--num-heads", "4")
    assert code == 1 and "holds a layer with num_heads=2. Received: num_heads=4" in err
    assert run("inspect", path, "--num-heads", "2")[0] == 0
    # The file records its scale: --scale, which would not be shown, is a usage error
    code, _, err = run("inspect", path, "--scale", "0.5")
    assert code == 2 and "mha inspect takes --scale with --prefix" in err
    # Layer options without --prefix: the error names those given, --config's among them
    code, _, err = run("inspect", path, "--sliding-window", "4")
    assert code == 2 and "--sliding-window: layer options, which go with --prefix" in err
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_attention_heads": 2,
                                  "hidden_size": 8, "rope_theta": 500000.0}))  # fmt: skip
    code, _, err = run("inspect", path, "--config", str(config))
    assert code == 2 and "--config's rope_theta: layer options" in err, err
    assert "--rope-interleaved" not in err and "--sliding-window" not in err


def test_compare_record_into_a_missing_folder_is_refused_before_the_run(tmp_path):
    code, out, err = run("compare", "--record", str(tmp_path / "no" / "cases.safetensors"))
    assert code == 2 and "does not exist" in err and out == ""


def test_a_path_no_encoding_holds_is_named_escaped_in_the_error(tmp_path):
    # A file name of bytes that are not UTF-8 reaches the message, escaped, not a traceback
    name = os.path.join(os.fsencode(tmp_path), b"no\xfe.safetensors")
    completed = subprocess.run(
        [os.fsencode(sys.executable), b"-m", b"mha", b"inspect", name],
        capture_output=True,
        check=False,
    )
    err = completed.stderr.decode("utf-8", "replace")
    assert completed.returncode == 2 and "no\\udcfe.safetensors" in err, err
    assert "Traceback" not in err


def test_compare_device_that_cannot_be_reached_is_a_usage_error():
    code, _, err = run("compare", "--backends", "numpy", "--device", "tpu")
    assert code == 2 and "--device" in err
    # numpy alone on a GPU ran on the CPU (exit 3), where without --backends it is refused
    code, out, err = run("compare", "--backends", "numpy", "--device", "gpu")
    assert (code, out) == (2, "") and "the NumPy reference computes on the CPU" in err


@pytest.mark.tensorflow
def test_compare_device_of_a_backend_without_devices_is_a_usage_error():
    from conftest import backend_module

    backend_module("tensorflow")
    code, _, err = run("compare", "--backends", "numpy,tensorflow", "--device", "cpu")
    assert code == 2 and "cannot put the tensorflow backend on a device" in err


@pytest.mark.parametrize("command", ["convert", "inspect", "verify"])
def test_a_path_that_does_not_exist_is_a_usage_error(command, tmp_path):
    # docs/cli.md: 2, with one line naming the path; nothing is written
    missing = tmp_path / "missing.safetensors"
    extra = [str(tmp_path / "out.pt")] if command == "convert" else []
    code, out, err = run(command, str(missing), *extra)
    assert code == 2 and out == ""
    assert err.strip() == f"mha {command}: error: {missing} does not exist or is not a file"
    assert sorted(tmp_path.iterdir()) == []
