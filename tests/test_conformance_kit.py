"""mha.conformance and `mha conform`: the kit that holds someone's attention function to the
reference. mha's own function agrees in every backend, and so does torch's FlexAttention;
torch's SDPA (math kernel) and jax.nn.dot_product_attention are reported as they behave (what
they cannot express as not taken, what they compute otherwise as differing); a deliberately
broken function is flagged.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from conftest import backend_module, backend_params, framework_import
from mha import cli, conformance, conformance_adapters

DTYPES = ("float32", "float64")
PACKED = "packed segments (3 + 4, 5 + 2)"  # none of the frameworks' functions takes segments


def statuses(rows) -> dict[str, set[str]]:
    """Status -> the cases with it (in any dtype)."""
    found: dict[str, set[str]] = {}
    for row in rows:
        found.setdefault(row.status, set()).add(row.case)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", backend_params())
def test_mhas_own_function_agrees_on_every_case(name):
    module = backend_module(name)
    dtypes = ("float32", "float64", "float16", "bfloat16")
    if name == "mxnet":  # no bfloat16; float16 products on a GPU only
        dtypes = ("float32", "float64")
    # Its gradients against its own in float64 would tell nothing: test_attention_function.py
    # holds them to the reference's finite differences
    rows = conformance.run(module.dot_product_attention, name, dtypes, gradients=False)
    assert len(rows) == len(conformance.CASES) * len(dtypes)
    assert statuses(rows) == {"agrees": {case.name for case in conformance.CASES}}


@pytest.mark.torch
def test_torch_sdpa_math_is_reported_as_it_behaves():
    framework_import("torch")
    rows = conformance.run(conformance_adapters.torch_sdpa("math"), "torch", DTYPES)
    found = statuses(rows)
    assert "error" not in found
    # What SDPA cannot express: bottom-right causal, windows, a soft cap
    assert found["not taken"] == {
        "causal bottom_right, Q < K",
        "window (2, 1)",
        "softcap 5",
        PACKED,
    }
    # It adds its mask to the scores: a NaN at a masked key stays NaN
    assert "NaN at masked keys" in found["differs"]
    for case in (
        "plain",
        "grouped heads (4 query, 2 key-value)",
        "causal, Q < K (top_left)",
        "boolean mask (batch, heads, Q, K)",
        "additive bias (batch, heads, Q, K)",
    ):
        assert case in found["agrees"], case


@pytest.mark.torch
def test_torch_flex_attention_takes_every_case_and_agrees():
    # FlexAttention expresses every mask as a mask_mod and the bias and soft cap as a
    # score_mod: every case agrees (its CPU backward does not exist: outputs alone are
    # compared, and the row says so)
    torch = framework_import("torch")
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        pytest.skip(f"torch {torch.__version__} has no FlexAttention")
    # float32 alone: its eager path builds a block mask per call, the slowest of the adapters
    rows = conformance.run(conformance_adapters.torch_flex_attention(), "torch", ("float32",))
    assert statuses(rows) == {"agrees": {case.name for case in conformance.CASES}}
    plain = {case.name for case in conformance.CASES if case.inputs == "plain"}
    assert all("gradients not taken" in row.note for row in rows if row.case in plain)


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.parametrize("empty_rows", ["zeros", "uniform"])
def test_jax_dot_product_attention_is_reported_as_it_behaves(empty_rows):
    jax = framework_import("jax")
    adapter = conformance_adapters.jax_dot_product_attention()
    rows = conformance.run(adapter, "jax", ("float32",), empty_rows=empty_rows)
    found = statuses(rows)
    assert found["not taken"] == {
        "value head size 12",
        "causal bottom_right, Q < K",
        "softcap 5",
        PACKED,
    }
    # A row with no key: the mean of the values (equal scores), not zeros
    no_key = "a row with no key"
    assert no_key in (found["agrees"] if empty_rows == "uniform" else found["differs"])
    assert "NaN at masked keys" in found["agrees"]  # it replaces masked scores
    # Some releases (0.7.1) apply local_window_size only with is_causal: the kit says so
    ignored = _ignores_windows_alone(jax)
    assert ("window (2, 1)" in found.get("differs", ())) is ignored
    assert len(found.get("differs", ())) == (empty_rows == "zeros") + ignored


def _ignores_windows_alone(jax) -> bool:
    x = np.eye(4, dtype="float32").reshape(1, 4, 1, 4)
    windowed = jax.nn.dot_product_attention(x, x, x, local_window_size=(0, 0))
    return bool(np.allclose(windowed, jax.nn.dot_product_attention(x, x, x)))


def broken_attention(query, key, value, *, mask=None, causal=False, scale=None):
    """A kernel that forgets the scale and drops every causal mask."""
    scores = query @ np.swapaxes(key, -1, -2)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True) @ value


def test_a_broken_function_is_flagged_on_the_cases_it_breaks(capsys):
    rows = conformance.run(broken_attention, "numpy", ("float64",))
    found = statuses(rows)
    assert {"plain", "causal, Q = K", "boolean mask (batch, 1, 1, K)"} <= found["differs"]
    assert "scale" not in found.get("agrees", ())
    module = sys.modules[__name__]
    code = cli.main(
        [
            "conform",
            f"{module.__name__}:broken_attention",
            "--framework",
            "numpy",
            "--dtypes",
            "float64",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    plain = next(line for line in out.splitlines() if line.startswith("plain "))
    assert "DIFFERS" in plain and "plain, float64: differs: at (0, 0, 0, 0)" in out


def test_the_command_runs_a_framework_function_and_writes_json(capsys):
    code = cli.main(
        [
            "conform",
            "mha.backends.numpy:dot_product_attention",
            "--framework",
            "numpy",
            "--dtypes",
            "float32",
            "--json",
        ]
    )
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and len(rows) == len(conformance.CASES)
    assert {row["status"] for row in rows} == {"agrees"}


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["nothing"], "the target is MODULE:FUNCTION with --framework"),
        (["math:cos"], "the target is MODULE:FUNCTION with --framework"),
        (["no_such_module:f", "--framework", "numpy"], "cannot load no_such_module:f"),
        (["jax", "--framework", "torch"], "jax takes jax tensors, not torch's"),
        (
            [
                "mha.backends.numpy:dot_product_attention",
                "--framework",
                "numpy",
                "--dtypes",
                "float8",
            ],
            "--dtypes takes",
        ),
        (
            ["mha.backends.numpy:dot_product_attention", "--framework", "numpy", "--device", "cpu"],
            "mha does not place numpy's tensors",
        ),
    ],
)
def test_usage_errors_exit_2(arguments, message, capsys):
    assert cli.main(["conform", *arguments]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.jax
def test_device_places_the_functions_tensors():
    # JAX commits an array to a device only when it is placed there: the function sees every
    # tensor placed with device="cpu" and none without (a GPU's run places them on the GPU)
    module = backend_module("jax")
    seen = []

    def spy(query, key, value, **options):
        seen.append(all(x.committed for x in (query, key, value)))
        return module.dot_product_attention(query, key, value, **options)

    cases = conformance.CASES[:2]
    rows = conformance.run(spy, "jax", ("float32",), cases=cases, gradients=False, device="cpu")
    assert {row.status for row in rows} == {"agrees"} and seen and all(seen)
    seen.clear()
    conformance.run(spy, "jax", ("float32",), cases=cases, gradients=False)
    assert seen and not any(seen)


@pytest.mark.tensorflow
def test_keras_dot_product_attention_is_reported_as_it_behaves():
    backend_module("tensorflow")
    adapter = conformance_adapters.keras_dot_product_attention()
    rows = conformance.run(adapter, "tensorflow", ("float32",), empty_rows="uniform")
    found = statuses(rows)
    assert found["not taken"] == {
        "causal bottom_right, Q < K",
        "valid_lens (batch,)",
        "window (2, 1)",
        "softcap 5",
        PACKED,
    }
    assert set(found) == {"agrees", "not taken"}  # a row with no key: uniform, as held to


@pytest.mark.torch
def test_a_wrong_gradient_is_flagged(capsys):
    # Right outputs, and no gradient for the values: only the gradients can tell
    backend_module("torch")
    from mha.backends import torch as T

    def detached_values(query, key, value, **options):
        return T.dot_product_attention(query, key, value.detach(), **options)

    rows = conformance.run(detached_values, "torch", ("float32",))
    found = statuses(rows)
    assert "plain" in found["differs"] and "NaN at masked keys" in found["agrees"]
    plain = next(row for row in rows if row.case == "plain")
    assert plain.note.startswith("the gradient of value differs") and plain.difference < 1e-6
    without = conformance.run(detached_values, "torch", ("float32",), gradients=False)
    assert statuses(without) == {"agrees": {case.name for case in conformance.CASES}}
