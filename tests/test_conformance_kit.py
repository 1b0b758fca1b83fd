"""mha.conformance and `mha conform`: the kit that holds someone's attention function to the
reference. mha's own function agrees in every backend, and so does torch's FlexAttention;
torch's SDPA (math kernel) and jax.nn.dot_product_attention are reported as they behave (what
they cannot express as not taken, what they compute otherwise as differing); a deliberately
broken function is flagged.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys

import numpy as np
import pytest

from conftest import backend_module, backend_params, framework_import
from mha import cli, conformance, conformance_adapters

DTYPES = ("float32", "float64")
PACKED = "packed segments (3 + 4, 5 + 2)"  # none of the frameworks' functions takes segments
PAIR = "packed segments, a pair (queries, keys)"
# The pair beside causal and a window (each position's index among its segment's)
PAIRED = {PAIR, "packed segments, a pair, causal", "packed segments, a pair, window (1, 0)"}
CACHED = "causal, alignment 1 (a cached key)"
INT_WINDOW = "window 3 (an int), alignment 1"
SOFTCAPS = {"softcap 5", "softcap 5, causal", "softcap 5, additive bias"}
# A row whose bias is -inf at every key, and NaN at keys a -inf bias leaves out: the functions
# that add the bias to the scores give NaN in both
MINUS_INFINITY = {"additive bias with -inf, a row all -inf", "NaN at keys a -inf bias leaves out"}
# A window beside causal, and where Q < K at each alignment
WINDOWS_MORE = {
    "window (2, 1) and causal",
    "window (2, 1), Q < K (top_left)",
    "window (2, 1) bottom_right, Q < K",
}
MASKS_TOGETHER = {"boolean mask and causal", "valid_lens and causal", "boolean mask and valid_lens"}
ZERO_LENGTH = "valid_lens with a 0 (an example of padding alone)"
QUERIES_BEFORE_KEYS = "causal bottom_right, Q > K (the first queries keep no key)"
LONG_ROWS = "long rows (K = 4133)"
OPEN_WINDOW = "window (None, 1), open on the left"


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
        CACHED,
        "window (2, 1)",
        INT_WINDOW,
        *SOFTCAPS,
        PACKED,
        *PAIRED,
        *WINDOWS_MORE,
        OPEN_WINDOW,
        "boolean mask and additive bias",  # one attn_mask
        QUERIES_BEFORE_KEYS,
    }
    # It adds its mask to the scores: a NaN at a masked key stays NaN
    assert found["differs"] == {"NaN at masked keys", "NaN at keys a -inf bias leaves out"}
    # What it expresses agrees: lengths as a boolean mask of keys among them
    for case in (
        "plain",
        "scale",
        "grouped heads (6 query, 3 key-value)",
        "value head size 12",
        "causal, Q = K",
        "causal, Q < K (top_left)",
        "boolean mask (batch, 1, 1, K)",
        "boolean mask (batch, heads, Q, K)",
        "additive bias (batch, heads, Q, K)",
        "valid_lens (batch,)",
        "valid_lens (batch, Q)",
        "additive bias with -inf, a row all -inf",  # its softmax gives such a row zeros
        "boolean mask (heads, Q, K)",
        LONG_ROWS,
        # Lengths join a mask, causal joins either (is_causal takes no attn_mask)
        *MASKS_TOGETHER,
        "grouped heads, causal",
        "grouped heads, boolean mask (batch, heads, Q, K)",
        ZERO_LENGTH,
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
        CACHED,
        INT_WINDOW,
        "valid_lens (batch, Q)",
        *SOFTCAPS,
        PACKED,
        *PAIRED,
        "window (2, 1) bottom_right, Q < K",
        OPEN_WINDOW,
        QUERIES_BEFORE_KEYS,
    }
    # A row with no key (a mask's, a length of 0's): the mean of the values, not zeros
    no_key = {"a row with no key", ZERO_LENGTH}
    assert no_key <= (found["agrees"] if empty_rows == "uniform" else found["differs"])
    assert "NaN at masked keys" in found["agrees"]  # it replaces masked scores
    assert MINUS_INFINITY <= found["differs"]  # but adds the bias
    assert {*MASKS_TOGETHER, "boolean mask and additive bias", "grouped heads, causal"} <= found[
        "agrees"
    ]
    # Some releases (0.7.1) apply local_window_size only with is_causal: the kit says so
    ignored = {"window (2, 1)", "window (2, 1), Q < K (top_left)"}
    if _ignores_windows_alone(jax):
        assert ignored <= found["differs"]
    else:
        assert not ignored & found.get("differs", set())
    assert "window (2, 1) and causal" in found["agrees"]
    expected = {*MINUS_INFINITY, *(no_key if empty_rows == "zeros" else ())}
    assert found["differs"] - ignored == expected


@pytest.mark.jax
def test_jax_dot_product_attention_float16_backward_on_the_cpu_is_reported_as_it_runs():
    # As the table of docs/attention-function.md says: its float16 output agrees; its backward
    # under jax.jit fails inside XLA on the CPU before jax 0.12 (with JAX_ENABLE_X64, as here),
    # an error in the kit's table, and the kit compares the gradients where JAX computes them
    framework_import("jax")
    adapter = conformance_adapters.jax_dot_product_attention()
    plain = conformance.CASES[:1]
    (row,) = conformance.run(adapter, "jax", ("float16",), plain, device="cpu")
    failure = _jax_float16_backward_failure()
    if failure:
        assert row.status == "error" and "F16_F16_F32" in row.note and "F16_F16_F32" in failure
    else:
        assert row.status == "agrees" and row.gradient_difference is not None, row
    (row,) = conformance.run(adapter, "jax", ("float16",), plain, gradients=False, device="cpu")
    assert row.status == "agrees", row


def _jax_float16_backward_failure() -> str:
    """What JAX itself raises for the gradients of its attention in float16 under jax.jit on
    the CPU ("" when it computes them)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x, cotangent = (jnp.asarray(rng.standard_normal((2, 5, 3, 8)), "float16") for _ in "xc")

    def loss(query, key, value):
        return jnp.sum(jax.nn.dot_product_attention(query, key, value) * cotangent)

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x)
    except Exception as error:  # XLA's own error, whatever its type
        return str(error)
    return ""


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


def _dropping(option: str, beside: str):
    """mha's function that drops `option` where `beside` is given too: a kernel that takes one
    mask at a time."""

    def attention(query, key, value, **options):
        if beside in options:
            options.pop(option, None)
        return backend_module("numpy").dot_product_attention(query, key, value, **options)

    return attention


@pytest.mark.parametrize(
    "option, beside, case",
    [
        ("causal", "mask", "boolean mask and causal"),
        ("causal", "valid_lens", "valid_lens and causal"),
        ("mask", "bias", "boolean mask and additive bias"),
        ("mask", "valid_lens", "boolean mask and valid_lens"),
        ("window", "causal", "window (2, 1) and causal"),
    ],
)
def test_a_kernel_taking_one_mask_at_a_time_is_flagged(option, beside, case):
    rows = conformance.run(_dropping(option, beside), "numpy", ("float64",))
    assert statuses(rows)["differs"] == {case}


def folded_grouped_attention(query, key, value, *, causal=False):
    """Grouped heads folded into the query axis, (B, kv heads, group x Q, d), with causal read
    on the folded index: the queries of every group but the first see too many keys."""
    batch, heads, queries, _ = query.shape
    folded = query.reshape(batch, key.shape[1], -1, query.shape[-1])
    output = backend_module("numpy").dot_product_attention(folded, key, value, causal=causal)
    return output.reshape(batch, heads, queries, -1)


def lengths_minus_infinity_attention(query, key, value, *, valid_lens=None):
    """Lengths as -inf scores before a plain softmax: a length of 0 makes a row of NaN."""
    scores = query @ np.swapaxes(key, -1, -2) / np.sqrt(query.shape[-1])
    if valid_lens is not None:
        lengths = valid_lens.reshape(valid_lens.shape[0], 1, -1, 1)
        scores = np.where(np.arange(key.shape[-2]) < lengths, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True) @ value


def test_grouped_heads_and_lengths_of_0_are_held_beside_the_masks():
    found = statuses(conformance.run(folded_grouped_attention, "numpy", ("float64",)))
    assert {"grouped heads (6 query, 3 key-value)", "causal, Q < K (top_left)"} <= found["agrees"]
    assert "grouped heads, causal" in found["differs"]
    found = statuses(conformance.run(lengths_minus_infinity_attention, "numpy", ("float64",)))
    assert {"valid_lens (batch,)", "valid_lens (batch, Q)"} <= found["agrees"]
    assert found["differs"] == {ZERO_LENGTH}


def _tiled(query, key, value, rescale: bool, whole_tiles: bool, tile: int = 128):
    """An online softmax over tiles of keys, in float32, as flash kernels compute: with
    whole_tiles, the keys past the last whole tile are lost; without rescale, the sums of
    earlier tiles keep an earlier maximum."""
    q, k, v = (np.asarray(x, dtype="float32") for x in (query, key, value))
    scores = q @ np.swapaxes(k, -1, -2) / np.float32(np.sqrt(q.shape[-1]))
    end = scores.shape[-1] // tile * tile if whole_tiles else scores.shape[-1]
    peak = np.full((*scores.shape[:-1], 1), -np.inf, dtype="float32")
    total, accumulated = 0.0, 0.0
    for start in range(0, end, tile):
        part = scores[..., start : min(start + tile, end)]
        new_peak = np.maximum(peak, part.max(-1, keepdims=True))
        shrink = np.exp(peak - new_peak) if rescale else 1.0
        p = np.exp(part - new_peak)
        total = total * shrink + p.sum(-1, keepdims=True)
        accumulated = accumulated * shrink + p @ v[..., start : start + p.shape[-1], :]
        peak = new_peak
    return (accumulated / total).astype(query.dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_tiled_kernel_losing_a_tile_or_its_rescaling_is_flagged(dtype):
    # Rows of more keys than any tile size divides, each row's weight on a few keys
    (case,) = (case for case in conformance.CASES if case.name == LONG_ROWS)
    right = functools.partial(_tiled, rescale=True, whole_tiles=False)
    assert statuses(conformance.run(right, "numpy", (dtype,), [case])) == {"agrees": {LONG_ROWS}}
    for wrong in ({"rescale": False, "whole_tiles": False}, {"rescale": True, "whole_tiles": True}):
        rows = conformance.run(functools.partial(_tiled, **wrong), "numpy", (dtype,), [case])
        assert statuses(rows) == {"differs": {LONG_ROWS}}, wrong


def unpacking_window(query, key, value, *, window=None, alignment="top_left"):
    """A kernel that takes a window but fails inside on an int one."""
    left, right = (None, None) if window is None else window
    return backend_module("numpy").dot_product_attention(
        query, key, value, window=(left, right), alignment=alignment
    )


def forwarding_attention(query, key, value, **options):
    """A wrapper handing its options to a function that takes a mask alone."""
    return mask_only_attention(query, key, value, **options)


def mask_only_attention(query, key, value, *, mask=None):
    return backend_module("numpy").dot_product_attention(query, key, value, mask=mask)


def test_a_typeerror_inside_the_function_is_an_error_not_an_option_it_lacks():
    rows = conformance.run(unpacking_window, "numpy", ("float64",))
    found = statuses(rows)
    assert found["error"] == {INT_WINDOW} and "window (2, 1)" in found["agrees"]
    assert "softcap 5" in found["not taken"]  # no argument for it
    # An unexpected keyword from a function the options are handed on to: not taken
    found = statuses(conformance.run(forwarding_attention, "numpy", ("float64",)))
    assert "error" not in found and "softcap 5" in found["not taken"]
    assert "boolean mask (batch, heads, Q, K)" in found["agrees"]


def attention_of_other_names(q, k, v, *, temperature):
    """A function that needs an argument the kit never gives: every call is a TypeError."""
    return q


def attention_by_position(q, k, v, /, **options):
    """mha's function under names of its own, the three tensors positional only."""
    return backend_module("numpy").dot_product_attention(q, k, v, **options)


def zeros_attention(q, k, v, **options):
    """A function that takes every case and gets each one wrong."""
    return np.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)


def test_a_function_that_gets_every_case_wrong_says_so(capsys):
    # Exit 1, and the message counts the rows that do not agree: they were compared
    target = f"{sys.modules[__name__].__name__}:zeros_attention"
    code = cli.main(["conform", target, "--framework", "numpy", "--dtypes", "float64"])
    captured = capsys.readouterr()
    taken = len(conformance.CASES)
    assert code == 1
    assert f"{taken} of the {taken} rows taken (a case in a dtype) do not agree" in captured.err
    assert "no case was compared" not in captured.err


def scribbling_attention(q, k, v, **options):
    """mha's function, writing into its mask once it has computed with it."""
    output = backend_module("numpy").dot_product_attention(q, k, v, **options)
    if "mask" in options:
        options["mask"][...] = True
    return output


def test_a_function_that_writes_into_its_inputs_changes_no_other_call():
    # Each dtype's call gets inputs of its own: the next dtype's reference, and the next
    # call, see the case's mask as it was made
    rows = conformance.run(scribbling_attention, "numpy", ("float32", "float64"))
    assert statuses(rows) == {"agrees": {case.name for case in conformance.CASES}}


def test_the_query_key_and_value_are_given_by_position():
    # The contract calls function(query, key, value, **options): any names take them
    rows = conformance.run(attention_by_position, "numpy", ("float64",))
    assert set(statuses(rows)) == {"agrees"}


def test_a_function_that_takes_no_case_fails(capsys):
    # A TypeError for the query, key and value alone is no refused option but an error, and
    # a run that compared nothing does not pass
    rows = conformance.run(attention_of_other_names, "numpy", ("float64",))
    found = statuses(rows)
    unmasked = {c.name for c in conformance.CASES if not (c.options or c.masks)}
    assert {"plain", "grouped heads (6 query, 3 key-value)"} <= unmasked
    assert found["error"] == unmasked and "agrees" not in found
    assert found["not taken"] == {c.name for c in conformance.CASES} - unmasked
    target = f"{sys.modules[__name__].__name__}:attention_of_other_names"
    code = cli.main(["conform", target, "--framework", "numpy", "--dtypes", "float64"])
    captured = capsys.readouterr()
    assert code == 1 and "no case was compared" in captured.err
    assert "plain, float64: error: TypeError:" in captured.out


def test_the_table_says_where_gradients_were_not_compared():
    # An agreeing cell without "+grad" would read as a framework without autograd: the note
    # under the table says why its gradients were not compared
    row = conformance.Row("plain", "float32", "agrees", 1e-7, 1e-5, "gradients not taken: no")
    table = conformance.format_table([row])
    assert "plain, float32: agrees: gradients not taken: no" in table


def test_the_command_runs_a_framework_function_and_writes_json(capsys):
    code = cli.main(
        [
            "conform",
            "mha.backends.numpy:dot_product_attention",
            "--framework",
            "numpy",
            "--dtypes",
            "float32, float32",  # a dtype given twice runs once
            "--json",
        ]
    )
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and len(rows) == len(conformance.CASES)
    assert {row["status"] for row in rows} == {"agrees"}


def uniform_attention(query, key, value, **options):
    """mha's NumPy function, giving a row with no key the mean of the values."""
    from mha.backends import numpy as reference

    return reference.dot_product_attention(query, key, value, **options, empty_rows="uniform")


def test_the_command_holds_rows_with_no_key_to_empty_rows(capsys):
    # A function that gives an empty row the mean of the values agrees on every case with
    # --empty-rows uniform, and differs on the row with no key by default (zeros)
    target = [f"{__name__}:uniform_attention", "--framework", "numpy", "--dtypes", "float64"]
    assert cli.main(["conform", *target, "--empty-rows", "uniform", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["status"] for row in rows} == {"agrees"}
    assert cli.main(["conform", *target, "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    differs = {row["case"] for row in rows if row["status"] != "agrees"}
    no_key = {"a row with no key", "additive bias with -inf, a row all -inf"}
    assert differs == {*no_key, ZERO_LENGTH, QUERIES_BEFORE_KEYS}, differs


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


@pytest.mark.torch
def test_a_device_the_framework_cannot_reach_is_a_usage_error(monkeypatch, capsys):
    # As `mha compare --device`: exit 2 before any case, not one error row per case
    import dataclasses

    module = backend_module("torch")

    def unreachable(x, device):
        raise RuntimeError("Found no NVIDIA driver on your system")

    adapter = dataclasses.replace(module.ADAPTER, to_device=unreachable)
    monkeypatch.setattr(module, "ADAPTER", adapter)
    code = cli.main(["conform", "torch-sdpa-math", "--dtypes", "float32", "--device", "gpu"])
    captured = capsys.readouterr()
    assert code == 2 and "torch cannot reach a gpu: Found no NVIDIA driver" in captured.err
    assert "plain" not in captured.out


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
        CACHED,
        "valid_lens (batch,)",
        "valid_lens (batch, Q)",
        "window (2, 1)",
        INT_WINDOW,
        *SOFTCAPS,
        PACKED,
        *PAIRED,
        *WINDOWS_MORE,
        OPEN_WINDOW,
        "valid_lens and causal",
        "boolean mask and valid_lens",
        ZERO_LENGTH,
        QUERIES_BEFORE_KEYS,
    }
    # A row with no key: uniform, as held to; it adds the bias to the scores
    assert found["differs"] == MINUS_INFINITY and set(found) == {"agrees", "not taken", "differs"}


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


def test_an_output_off_by_5e_5_in_either_direction_differs_in_float32():
    # float32's tolerance is 1e-5 of the reference's scale (its largest output, at least 1;
    # the kit's outputs are means of standard normal values, within a few units): mha's own
    # function with 5e-5 taken off or added to every output differs on every case, by 5e-5
    from mha.backends import numpy as N

    for shift in (-5e-5, 5e-5):

        def shifted(query, key, value, shift=shift, **options):
            output = N.dot_product_attention(query, key, value, **options)
            return output + np.float32(shift)

        rows = conformance.run(shifted, "numpy", ("float32",))
        assert statuses(rows) == {"differs": {case.name for case in conformance.CASES}}
        for row in rows:
            assert row.difference == pytest.approx(5e-5, rel=0.02), row
            assert row.difference > row.tolerance


def test_an_output_of_another_shape_differs_even_with_the_same_numbers():
    # The right numbers under an extra axis broadcast against the reference without a
    # difference; the kit still says the shape differs, naming both
    from mha.backends import numpy as N

    def unsqueezed(query, key, value, **options):
        return N.dot_product_attention(query, key, value, **options)[None]

    rows = conformance.run(unsqueezed, "numpy", ("float64",), cases=conformance.CASES[:1])
    (row,) = rows
    assert row.status == "differs" and row.difference is None
    assert row.note == (
        "output shape (1, 2, 4, 5, 8) and dtype float64, expected (2, 4, 5, 8) and float64"
    )


def _reference(query, key, value, **options):
    return backend_module("numpy").dot_product_attention(query, key, value, **options)


def _cutting_queries(query, key, value, *, valid_lens=None, **options):
    # A varlen kernel's reading: lengths cut the queries too (zeros past each length)
    output = _reference(query, key, value, valid_lens=valid_lens, **options)
    if valid_lens is not None and valid_lens.ndim == 1:
        output = np.where(np.arange(query.shape[2])[:, None] < valid_lens[:, None, None, None],
                          output, 0.0)  # fmt: skip
    return output


def _groups_by_kv_heads(query, key, value, **options):
    # Query head h on key-value head h // kv_heads, where h // (heads // kv_heads) is right
    group = np.arange(query.shape[1]) // key.shape[1]
    return _reference(query, key[:, group], value[:, group], **options)


def _mask_2d_as_key_padding(query, key, value, *, mask=None, **options):
    # torch's key_padding_mask reading of a 2-D mask, (batch, K): its first rows, one each
    if mask is not None and mask.ndim == 2:
        mask = mask[: query.shape[0], None, None, :]
    return _reference(query, key, value, mask=mask, **options)


def _pads_a_key_axis_of_1(query, key, value, *, bias=None, **options):
    # ONNX's padding of a shorter key axis: the bias at key 0 alone, 0 at the others
    if bias is not None and bias.shape[-1] == 1:
        bias = np.concatenate([bias, np.zeros((*bias.shape[:-1], key.shape[2] - 1))], -1)
    return _reference(query, key, value, bias=bias, **options)


def _open_side_as_0(query, key, value, *, window=None, **options):
    if isinstance(window, tuple):
        window = tuple(0 if side is None else side for side in window)
    return _reference(query, key, value, window=window, **options)


@pytest.mark.parametrize(
    "function, cases",
    [
        (_cutting_queries, {"valid_lens (batch,)", "boolean mask and valid_lens"}),
        (_groups_by_kv_heads, {"grouped heads (6 query, 3 key-value)"}),
        (_mask_2d_as_key_padding, {"boolean mask (Q, K)"}),
        (_pads_a_key_axis_of_1, {"additive bias (heads, Q, 1), every key's"}),
        (_open_side_as_0, {"window (None, 1), open on the left"}),
    ],
)
def test_a_function_misreading_an_input_form_is_flagged(function, cases):
    # Each misreads a form the contract defines: lengths shorter than the queries, six heads
    # over three, a 2-D mask, a key axis of 1, an open window side
    found = statuses(conformance.run(function, "numpy", ("float64",)))
    assert cases <= found["differs"], found.get("differs")


def _with_key_gradient(torch, backward):
    """mha's torch function, its key passed through an identity whose backward is `backward`."""
    from mha.backends import torch as T

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad)

    def attention(query, key, value, **options):
        return T.dot_product_attention(query, Identity.apply(key), value, **options)

    return attention


@pytest.mark.torch
def test_a_nan_gradient_differs_and_a_failing_backward_is_an_error():
    # Right outputs both: a key gradient of NaN is no agreement, and a backward that raises
    # (other than NotImplementedError, which says there is none) is an error, not "not taken"
    torch = framework_import("torch")
    plain = conformance.CASES[:1]
    nan = _with_key_gradient(torch, lambda grad: grad * float("nan"))
    (row,) = conformance.run(nan, "torch", ("float32",), cases=plain)
    assert row.status == "differs" and row.note.startswith("the gradient of key differs by nan")

    def boom(grad):
        raise RuntimeError("boom")

    (row,) = conformance.run(_with_key_gradient(torch, boom), "torch", ("float32",), cases=plain)
    assert row.status == "error" and "boom" in row.note
    fine = _with_key_gradient(torch, lambda grad: grad)
    (row,) = conformance.run(fine, "torch", ("float32",), cases=plain)
    assert row.status == "agrees" and row.gradient_difference < 1e-5


def forward_only_attention(query, key, value, **options):
    """mha's torch function run without autograd, as an inference kernel runs."""
    from mha.backends import torch as T

    with framework_import("torch").no_grad():
        return T.dot_product_attention(query, key, value, **options)


@pytest.mark.torch
def test_outputs_only_holds_a_kernel_with_no_backward_to_its_outputs(capsys):
    # Its gradients cannot be taken: every case whose gradients are compared an error (those
    # with NaN at masked keys compare outputs alone), unless the outputs alone are asked
    target = f"{sys.modules[__name__].__name__}:forward_only_attention"
    command = ["conform", target, "--framework", "torch", "--dtypes", "float32"]
    assert cli.main(command) == 1
    failed = sum(case.inputs != "nan at masked keys" for case in conformance.CASES)
    counts = f"{failed} of the {len(conformance.CASES)} rows taken (a case in a dtype)"
    assert f"{counts} do not agree" in capsys.readouterr().err
    assert cli.main([*command, "--outputs-only", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["status"] for row in rows} == {"agrees"} and len(rows) == len(conformance.CASES)
    assert all(row["gradient_difference"] is None for row in rows)


@pytest.mark.jax
def test_without_jaxs_64_bit_mode_the_outputs_alone_are_compared():
    # No float64 reference gradients there: the function's backward is not run, so one that
    # cannot run (jax.nn's in float16 on the CPU) leaves its agreeing outputs agreeing
    jax = framework_import("jax")
    module = backend_module("jax")
    ran = []

    @jax.custom_vjp
    def attention(query, key, value):
        return module.dot_product_attention(query, key, value)

    def forward(query, key, value):
        return attention(query, key, value), None

    def backward(_, cotangent):
        ran.append(True)
        raise RuntimeError("no backward here")

    attention.defvjp(forward, backward)
    plain = conformance.CASES[:1]
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        (row,) = conformance.run(lambda q, k, v: attention(q, k, v), "jax", ("float32",), plain)
    finally:
        jax.config.update("jax_enable_x64", previous)
    assert row.status == "agrees" and row.difference < 1e-5, row
    assert not ran and row.gradient_difference is None
    # With it, the backward runs, and one that fails is an error
    (row,) = conformance.run(lambda q, k, v: attention(q, k, v), "jax", ("float32",), plain)
    assert ran and row.status == "error" and "no backward here" in row.note


@pytest.mark.jax
def test_the_jax_adapter_gives_a_whole_window_as_its_sides():
    # mha's window=3 keeps the keys within 2 positions either side of the query; the adapter
    # gives jax.nn.dot_product_attention local_window_size=(2, 2), and agrees with the
    # reference, as the pair (2, 2) does; a window aligned bottom-right it does not take
    jax = framework_import("jax")
    if _ignores_windows_alone(jax):
        pytest.skip(f"jax {jax.__version__} applies local_window_size only with is_causal")
    adapter = conformance_adapters.jax_dot_product_attention()
    sizes = (2, 4, 4, 7, 7, 8, 8)
    cases = [
        conformance.Case("window 3", sizes=sizes, options=(("window", 3),)),
        conformance.Case("window (2, 2)", sizes=sizes, options=(("window", (2, 2)),)),
        # Its windows are about the top-left alignment alone: another is not taken
        conformance.Case(
            "window bottom_right, Q < K",
            options=(("window", (2, 1)), ("alignment", "bottom_right")),
        ),
    ]
    rows = conformance.run(adapter, "jax", ("float32",), cases=cases, gradients=False)
    assert [row.status for row in rows] == ["agrees", "agrees", "not taken"], rows


@pytest.mark.torch
def test_flex_adapter_takes_lengths_per_query_and_segments_of_its_own_keys():
    # Lengths of shape (batch, queries) and segment ids given as (of the queries, of the
    # keys), which the kit's cases do not reach: the adapter gives the same numbers as torch's
    # math SDPA with the boolean mask they mean, built here from their definitions
    torch = framework_import("torch")
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        pytest.skip(f"torch {torch.__version__} has no FlexAttention")
    F = torch.nn.functional
    rng = np.random.default_rng(3)
    q, k, v = (torch.tensor(rng.standard_normal((2, 2, n, 8))) for n in (4, 6, 6))
    flex = conformance_adapters.torch_flex_attention()
    lengths = torch.tensor([[1, 2, 3, 6], [6, 5, 4, 2]])
    kept = torch.arange(6) < lengths[:, None, :, None]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=kept)
    torch.testing.assert_close(flex(q, k, v, valid_lens=lengths), expected, rtol=0, atol=1e-12)
    query_ids = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 2]])
    key_ids = torch.tensor([[0, 1, 1, 1, 0, 0], [2, 2, 1, 1, 0, 0]])
    kept = query_ids[:, None, :, None] == key_ids[:, None, None, :]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=kept)
    found = flex(q, k, v, segment_ids=(query_ids, key_ids))
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-12)


@pytest.mark.torch
def test_the_flex_adapter_counts_places_in_segments_on_the_ids_device():
    # Each position's place among the earlier ones of its segment, counted by hand; on the
    # meta device (a GPU's stand-in) the count stays there, where a CPU tensor made beside
    # it failed every segment case on a GPU
    torch = framework_import("torch")
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [5, 5, 2, 2, 2, 5, 5]])
    places = conformance_adapters._places_in_segments(torch, ids)
    assert places.tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 2, 3]]
    assert conformance_adapters._places_in_segments(torch, ids.to("meta")).device.type == "meta"


@pytest.mark.torch
def test_an_option_the_adapters_do_not_know_is_a_type_error():
    # The kit reads a TypeError as "not taken": an option an adapter does not know (a
    # misspelled one, or one of a later kit) is refused, never silently dropped
    torch = framework_import("torch")
    x = torch.zeros((1, 1, 2, 4))
    for adapter in (conformance_adapters.torch_sdpa("math"), conformance_adapters.torch_sdpa()):
        with pytest.raises(TypeError, match="unknown options: scal, sinks"):
            adapter(x, x, x, sinks=x, scal=0.3)
        assert adapter(x, x, x, scale=0.3).shape == (1, 1, 2, 4)


DOMINANT = "a dominant key (its score 106, the others near 0)"
LARGE_PRODUCTS = "products past float16's range (q.k near 80,000), scale 3e-5"
WIDE_SCORES = [c for c in conformance.CASES if c.name in (DOMINANT, LARGE_PRODUCTS)]


def softmax_without_its_maximum(query, key, value, scale=None):
    """exp of the scores as they are: exp(106) is past float32's largest number."""
    scores = (query @ np.swapaxes(key, -1, -2)).astype("float32")
    weights = np.exp(scores * np.float32(scale or query.shape[-1] ** -0.5))
    # ml_dtypes' bfloat16 product is float32: the output in the inputs' dtype, as the kit asks
    return ((weights / weights.sum(-1, keepdims=True)).astype(query.dtype) @ value).astype(
        query.dtype
    )


def products_rounded_before_scaling(query, key, value, scale=None):
    """The products in the inputs' dtype (float16: past 65,504 is inf), scaled after."""
    scores = (query @ np.swapaxes(key, -1, -2)).astype("float32")
    scores = scores * np.float32(scale or query.shape[-1] ** -0.5)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return ((weights / weights.sum(-1, keepdims=True)).astype(query.dtype) @ value).astype(
        query.dtype
    )


def test_scores_a_softmax_must_take_apart_catch_the_kernels_that_do_not():
    # Without its maximum subtracted, a softmax gives NaN in every dtype at the dominant key;
    # products rounded to float16 before scaling give NaN in float16 alone (bfloat16 and
    # float32 hold 80,000): each case flags the kernel that breaks it, and no other
    dtypes = ("float32", "float16", "bfloat16")
    with np.errstate(over="ignore", invalid="ignore"):
        unsubtracted = conformance.run(
            softmax_without_its_maximum, "numpy", dtypes, cases=WIDE_SCORES
        )
        rounded = conformance.run(
            products_rounded_before_scaling, "numpy", dtypes, cases=WIDE_SCORES
        )
    differs = {(row.case, row.dtype) for row in unsubtracted if row.status == "differs"}
    assert {(DOMINANT, dtype) for dtype in dtypes} <= differs
    assert all(row.note.startswith("NaN in") for row in unsubtracted if row.case == DOMINANT)
    assert {(row.case, row.dtype) for row in rounded if row.status != "agrees"} == {
        (LARGE_PRODUCTS, "float16")
    }


@pytest.mark.tensorflow
def test_keras_float16_rounds_its_products_before_scaling_them():
    # As docs/attention-function.md's table says (Keras 3.15 on TensorFlow: an einsum in
    # float16, then the scale in float32): NaN where the products pass 65,504
    backend_module("tensorflow")
    adapter = conformance_adapters.keras_dot_product_attention()
    dtypes = ("float32", "float16", "bfloat16")
    rows = conformance.run(adapter, "tensorflow", dtypes, cases=WIDE_SCORES, gradients=False)
    wrong = {(row.case, row.dtype): row.note for row in rows if row.status != "agrees"}
    assert list(wrong) == [(LARGE_PRODUCTS, "float16")]
    assert wrong[LARGE_PRODUCTS, "float16"].startswith("NaN in")


def test_an_output_of_another_dtype_or_not_numbers_differs_or_is_an_error():
    # A float16 call answered in float64 is no float16 kernel; a string, which crashed the
    # run, is an output of no numbers
    from mha.backends import numpy as N

    def upcast(query, key, value, **options):
        return N.dot_product_attention(*(x.astype("float64") for x in (query, key, value)))

    (row,) = conformance.run(upcast, "numpy", ("float16",), cases=conformance.CASES[:1])
    assert row.status == "differs"
    assert "dtype float64, expected (2, 4, 5, 8) and float16" in row.note
    (row,) = conformance.run(lambda *args: "output", "numpy", ("float32",), conformance.CASES[:1])
    assert row.status == "differs" and "shape () and dtype <U6" in row.note, row
