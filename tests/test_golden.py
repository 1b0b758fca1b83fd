"""Golden cases: numbers recorded once, verified on every backend, machine and lane.

tests/golden/mxnet-legacy.safetensors was recorded with MXNet in the legacy lane
(`mha compare --backends mxnet --record ...`); each lane verifies it on numpy and torch, so
CI shows a case crossing lanes (the current lane has no MXNet).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import mha
from conftest import backend_module, required_backends
from mha import cli, golden, harness

GOLDEN = pathlib.Path(__file__).parent / "golden" / "mxnet-legacy.safetensors"
CASES = [
    harness.Case("MultiHeadAttention", ("valid_lens_1d",), {"bias": True}),
    harness.Case("MultiHeadAttention", ("self", "causal", "no_weights")),
    harness.Case("DotProductAttention", ("valid_lens_2d", "window_mask")),
    harness.Case("masked_softmax", ("valid_lens_2d",)),
    harness.Case("AddNorm"),
    # An alignment by name, a float bias (differentiated), and the attention function with a
    # window pair (a list in the file's JSON)
    harness.Case("MultiHeadAttention", ("tall", "causal", "bottom_right", "attn_bias")),
    harness.Case("dot_product_attention", ("mask_2d", "causal", "aligned_2"), {"window": (2, 1)}),
]


def recorder() -> str:
    """An autograd backend this run has, so that gradients are recorded too."""
    for name in ("torch", "jax", "tensorflow", "mxnet"):
        if name in required_backends():
            backend_module(name)
            return name
    return "numpy"


def test_a_recorded_run_verifies_on_every_backend(tmp_path):
    path = tmp_path / "cases.safetensors"
    recorded = golden.record_run(path, recorder(), CASES)
    again = golden.read(path)
    assert [case.name for case in again] == [case.id for case in CASES]
    for a, b in zip(recorded, again, strict=True):
        np.testing.assert_array_equal(a.output, b.output)
        assert a.inputs.keys() == b.inputs.keys() and a.config == b.config
    assert any(case.gradients for case in again) == (recorder() != "numpy")
    rows = golden.verify(path, required_backends())
    assert len(rows) == len(CASES) * len(required_backends())
    assert all(row.passed for row in rows), [row for row in rows if not row.passed]


def test_an_altered_number_is_refused(tmp_path, capsys):
    path = tmp_path / "cases.safetensors"
    cases = golden.record_run(path, "numpy", CASES[:2])
    cases[1].output = cases[1].output.copy()
    cases[1].output[0, 0, 0] += 1e-3  # one number, well above float32's tolerance
    golden.record(path, cases)
    rows = golden.verify(path, ["numpy"])
    assert [row.passed for row in rows] == [True, False]
    assert cli.main(["verify", str(path), "--backends", "numpy"]) == 1
    assert "1 of 2 comparisons disagree, on: numpy." in capsys.readouterr().out


def test_a_leak_at_a_masked_key_is_refused_and_unchecked_gradients_are_said(
    tmp_path, capsys, monkeypatch
):
    # The recorded weights are exactly 0 at the masked keys: a backend giving 1e-9 there
    # (well within the tolerance of 1e-5) leaks, as compare holds it; an underflow of the
    # less precise dtype (a subnormal number) does not
    path = tmp_path / "cases.safetensors"
    (case,) = golden.record_run(path, recorder(), CASES[:1])
    assert (case.attention_weights == 0).any()
    run_case = harness.run_case
    for leak, passes in ((1e-9, False), (1e-40, True)):

        def leaking(*arguments, leak=leak):
            result = run_case(*arguments)
            weights = result.attention_weights
            result.attention_weights = np.where(weights == 0, weights.dtype.type(leak), weights)
            return result

        monkeypatch.setattr(harness, "run_case", leaking)
        (row,) = golden.verify(path, ["numpy"])
        assert row.passed == passes and row.zero_difference == np.float32(leak), row
    monkeypatch.setattr(harness, "run_case", run_case)
    if case.gradients is not None:
        case.gradients = {name: 3 * value for name, value in case.gradients.items()}
        golden.record(path, [case])
        assert cli.main(["verify", str(path), "--backends", "numpy"]) == 0
        assert "their gradients unchecked: no backend here has autograd" in capsys.readouterr().out


@pytest.mark.slow
def test_the_case_recorded_in_the_legacy_lane_verifies_here(capsys):
    cases = golden.read(GOLDEN)
    assert {case.recorded_with.split()[0] for case in cases} == {"mxnet"}
    assert len(cases) == len(harness.default_cases())
    # On the reference, and on torch for the recorded gradients: the agreement matrix holds
    # the lane's other backends to the reference
    backends = [name for name in ("numpy", "torch") if name in required_backends()]
    assert cli.main(["verify", str(GOLDEN), "--backends", ",".join(backends)]) == 0
    out = capsys.readouterr().out
    assert f"All {len(cases) * len(backends)} comparisons agree" in out


def test_one_call_proves_a_ported_layer_against_its_source():
    # torch's own layer gives the expected numbers; mha's import of it must give them in
    # every backend, and a changed number must fail
    torch = backend_module("torch").torch
    torch.manual_seed(0)
    source = torch.nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        expected, weights = source(x, x, x, key_padding_mask=padding, average_attn_weights=False)
    layer = mha.interop.from_torch(source, backend="numpy")
    inputs = {"queries": x, "valid_lens": np.array([5, 3])}
    rows = golden.verify_layer(layer, inputs, expected, weights, backends=required_backends())
    assert rows and all(row.passed for row in rows), [row for row in rows if not row.passed]
    assert all(row.output_difference <= 1e-10 for row in rows)
    changed = expected.clone()
    changed[1, 2, 3] += 1e-6
    rows = golden.verify_layer(layer, inputs, changed, backends=["numpy"])
    assert not rows[0].passed


def test_files_that_are_not_cases_are_refused(tmp_path, capsys):
    layer = backend_module("numpy").MultiHeadAttention(4, 2, query_size=4, key_size=4, value_size=4)
    mha.set_weights(layer, mha.random_weights(layer))
    mha.save(layer, tmp_path / "layer.safetensors")
    with pytest.raises(ValueError, match="not an mha golden-case file"):
        golden.read(tmp_path / "layer.safetensors")
    assert cli.main(["verify", str(tmp_path / "layer.safetensors")]) == 1
    assert "not an mha golden-case file" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "missing.safetensors")]) == 2


def test_a_golden_file_of_no_case_or_of_options_not_an_object_is_refused(tmp_path, capsys):
    import json

    from mha.checkpoints import read_safetensors, write_safetensors

    recorded = tmp_path / "recorded.safetensors"
    golden.record_run(recorded, backend="numpy")
    tensors, metadata = read_safetensors(recorded)
    cases = json.loads(metadata["cases"])
    function = {"layer": "dot_product_attention", "config": {"window": 2, "dropout": 0.1}}
    for name, described, message in [
        ("empty", [], "its case list is empty: there is nothing to verify"),
        ("alignment", [{**cases[0], "options": {"alignment": [2]}}], "options of the wrong types"),
        ("function", [{**cases[0], **function}], "attention function takes no dropout"),
        ("options", [{**cases[0], "options": "causal"}], "case 0's config and options are not"),
    ]:
        path = tmp_path / f"{name}.safetensors"
        write_safetensors(path, tensors, {**metadata, "cases": json.dumps(described)})
        with pytest.raises(ValueError, match=message):
            golden.read(path)
        assert cli.main(["verify", str(path), "--backends", "numpy"]) == 1
        assert message in capsys.readouterr().err


def test_a_case_may_not_ask_for_sizes_its_file_does_not_hold(tmp_path):
    # verify builds each case's layer: its sizes are held to the file's weights first, and a
    # table made from the config alone to the bound a checkpoint has
    import json

    from mha.checkpoints import read_safetensors, write_safetensors

    layer = backend_module("numpy").MultiHeadAttention(4, 2, query_size=4, key_size=4, value_size=4)
    mha.set_weights(layer, mha.random_weights(layer))
    x = np.zeros((1, 3, 4), "float32")
    encoding = backend_module("numpy").PositionalEncoding(4, max_len=8)
    path = tmp_path / "cases.safetensors"
    golden.record(
        path,
        [
            golden.case_of(layer, {"queries": x, "keys": x, "values": x}, layer(x, x, x)),
            golden.case_of(encoding, {"X": x}, encoding(x)),
        ],
    )
    assert len(golden.read(path)) == 2
    tensors, metadata = read_safetensors(path)
    for index, change, message in (
        (0, {"num_hiddens": 2**15}, r"case 0's weights do not fit its MultiHeadAttention: W_q"),
        (1, {"max_len": 2**26}, r"case 1 asks for a positional table .* = 268435456 numbers"),
    ):
        cases = json.loads(metadata["cases"])
        cases[index]["config"].update(change)
        hostile = tmp_path / f"hostile{index}.safetensors"
        write_safetensors(hostile, tensors, {**metadata, "cases": json.dumps(cases)})
        with pytest.raises(ValueError, match=message):
            golden.read(hostile)


def test_a_float64_case_is_held_to_an_absolute_tolerance_whatever_its_scale():
    # float64: 1e-10 absolute, so outputs in the thousands are refused for a change of 1e-8
    torch = backend_module("torch").torch
    torch.manual_seed(0)
    source = torch.nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    with torch.no_grad():
        source.out_proj.weight.mul_(1000.0)
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        expected, _ = source(x, x, x)
    assert float(expected.abs().max()) > 100.0
    layer = mha.interop.from_torch(source, backend="numpy")
    rows = golden.verify_layer(layer, {"queries": x}, expected, backends=["numpy"])
    assert rows[0].passed and rows[0].output_difference <= 1e-10
    changed = expected.clone()
    changed[1, 2, 3] += 1e-8
    rows = golden.verify_layer(layer, {"queries": x}, changed, backends=["numpy"])
    assert not rows[0].passed
    np.testing.assert_allclose(rows[0].output_difference, 1e-8, rtol=1e-3)


@pytest.mark.parametrize("masks, name", [(("valid_lens_1d",), None), (("attn_bias",), "attn_bias")])
def test_an_altered_gradient_is_refused(tmp_path, masks, name):
    # A case's gradients are part of what it proves, as its output is: a float mask's too
    backend_module("torch")  # an autograd backend, so that gradients are recorded
    path = tmp_path / "cases.safetensors"
    case = harness.Case("MultiHeadAttention", masks, {"bias": True})
    cases = golden.record_run(path, "torch", [case])
    assert cases[0].gradients
    assert all(row.passed for row in golden.verify(path, ["torch"]))
    name = name or sorted(cases[0].gradients)[0]
    changed = cases[0].gradients[name].copy()
    changed.flat[0] += 1e-3 * max(1.0, float(abs(changed).max()))
    cases[0].gradients[name] = changed
    golden.record(path, cases)
    assert not golden.verify(path, ["torch"])[0].passed


def test_an_expected_output_of_another_shape_is_refused():
    # torch's nn.MultiheadAttention gives (length, batch, features) unless batch_first
    torch = backend_module("torch").torch
    torch.manual_seed(0)
    source = torch.nn.MultiheadAttention(8, 2).double().eval()
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    with torch.no_grad():
        expected, weights = source(x, x, x, average_attn_weights=False)
    layer = mha.interop.from_torch(source, backend="numpy")
    inputs = {"queries": x.transpose(0, 1)}  # mha's (batch, length, features)
    rows = golden.verify_layer(layer, inputs, expected.transpose(0, 1), weights, ["numpy"])
    assert rows[0].passed
    rows = golden.verify_layer(layer, inputs, expected, weights, ["numpy"])
    assert not rows[0].passed and rows[0].output_difference == float("inf")
    rows = golden.verify_layer(layer, inputs, expected.transpose(0, 1), weights[0], ["numpy"])
    assert not rows[0].passed and rows[0].weights_difference == float("inf")


@pytest.mark.jax
def test_a_float64_verify_on_jax_leaves_its_64_bit_mode_as_it_was():
    # verify turned JAX's 64-bit mode on for the whole process: the caller's own JAX code
    # then made float64 and int64 arrays where it had float32 and int32
    from conftest import framework_import

    jax = framework_import("jax")
    reference = backend_module("numpy").MultiHeadAttention(8, 2, dtype="float64")
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    expected = reference(x, x, x)
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        rows = golden.verify_layer(reference, {"queries": x}, expected, backends=["jax"])
        assert not jax.config.jax_enable_x64
        assert jax.numpy.ones(1).dtype == "float32"
        # Inside a scoped 64-bit switch of the caller's: the switch, not the process, after
        if hasattr(jax, "enable_x64"):  # jax 0.8 on
            scoped = jax.enable_x64(True)
        else:
            from jax.experimental import enable_x64 as scoped_x64

            scoped = scoped_x64()
        with scoped:
            golden.verify_layer(reference, {"queries": x}, expected, backends=["jax"])
        assert not jax.config.jax_enable_x64
    finally:
        jax.config.update("jax_enable_x64", before)
    assert rows[0].passed and rows[0].output_difference <= 1e-10, rows
