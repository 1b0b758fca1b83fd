"""The harness itself: its inputs, its finite differences and its verdicts."""

import dataclasses

import numpy as np
import pytest

from agreement_cases import all_cases
from conftest import assert_agrees, backend_module
from mha import harness
from mha.cases import MASKS

pytestmark = pytest.mark.numpy


def test_inputs_hold_a_zero_length_and_a_length_beyond_the_keys():
    shapes = harness.Shapes()
    inputs = harness.make_inputs(
        harness.Case("MultiHeadAttention", ("valid_lens_2d",)), shapes, "float32", 0
    )
    assert inputs["valid_lens"].min() == 0
    assert inputs["valid_lens"].max() > shapes.num_keys
    assert inputs["queries"].dtype == np.float32


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numpy_agrees_with_its_float64_self(dtype):
    rows = harness.compare(["numpy"], dtype=dtype, seed=5)
    assert len(rows) == len(harness.default_cases())
    assert all(row.passed for row in rows), [row for row in rows if not row.passed]
    if dtype == "float64":
        assert all(row.output_difference == 0.0 for row in rows)


def test_finite_differences_match_analytic_gradients():
    rng = np.random.default_rng(0)
    # PositionalEncoding adds a constant: d sum((X + P) * C) / dX = C
    case = harness.Case("PositionalEncoding")
    X = rng.standard_normal((2, 3, 4))
    C = rng.standard_normal((2, 3, 4))
    grads = harness.finite_difference_gradients(
        case, {"X": X}, {}, {"num_hiddens": 4, "dtype": "float64"}, C
    )
    np.testing.assert_allclose(grads["X"], C, atol=1e-8)
    # Attention is linear in the values: d sum((A V) * C) / dV = A^T C
    case = harness.Case("DotProductAttention", ("valid_lens_1d",))
    inputs = {
        "queries": rng.standard_normal((2, 3, 4)),
        "keys": rng.standard_normal((2, 5, 4)),
        "values": rng.standard_normal((2, 5, 2)),
        "valid_lens": np.array([0, 3]),
    }
    C = rng.standard_normal((2, 3, 2))
    result = harness.run_case("numpy", case, inputs, {}, {"dtype": "float64"})
    grads = harness.finite_difference_gradients(case, inputs, {}, {"dtype": "float64"}, C)
    A = result.attention_weights
    np.testing.assert_allclose(grads["values"], np.swapaxes(A, 1, 2) @ C, atol=1e-8)
    # The example with valid length 0 attends nothing: every gradient there is zero
    assert np.all(grads["queries"][0] == 0) and np.all(grads["keys"][0] == 0)


def test_difference_is_absolute_or_relative_to_scale():
    reference = np.array([10.0, -20.0])
    assert harness.difference(reference + np.array([0.5, 0.0]), reference, relative=False) == 0.5
    assert (
        harness.difference(reference + np.array([0.5, 0.0]), reference, relative=True) == 0.5 / 20
    )
    assert harness.difference(np.zeros(3), reference, relative=True) == float("inf")


def test_a_backend_that_crashes_is_a_failed_row(monkeypatch):
    original = harness.run_case

    def crashing(backend, case, inputs, weights, config, cotangent=None):
        if config["dtype"] == "float32" and case.layer == "AddNorm":
            raise RuntimeError("kaboom")
        return original(backend, case, inputs, weights, config, cotangent)

    monkeypatch.setattr(harness, "run_case", crashing)
    rows = harness.compare(["numpy"], cases=[harness.Case("AddNorm")])
    assert [row.passed for row in rows] == [False]
    assert rows[0].error == "RuntimeError: kaboom"


def test_nan_never_agrees():
    reference = np.array([1.0, 2.0])
    assert harness.difference(np.array([1.0, np.nan]), reference, relative=False) == float("inf")
    assert harness.difference(np.array([np.nan, 2.0]), reference, relative=True) == float("inf")


def test_a_masked_key_with_a_tiny_weight_fails(monkeypatch):
    # docs/design.md promises masked keys exactly 0: 1e-30 there is within every tolerance,
    # and still fails the row, as zero_difference
    original = harness.run_case

    def leaking(backend, case, inputs, weights, config, cotangent=None):
        result = original(backend, case, inputs, weights, config, cotangent)
        if config["dtype"] == "float32":
            result.attention_weights = np.where(
                result.attention_weights == 0, 1e-30, result.attention_weights
            )
        return result

    case = harness.Case("DotProductAttention", ("valid_lens_1d",))
    assert harness.compare(["numpy"], cases=[case])[0].zero_difference == 0.0
    monkeypatch.setattr(harness, "run_case", leaking)
    (row,) = harness.compare(["numpy"], cases=[case])
    assert row.weights_difference <= harness.TOLERANCES["float32"]
    assert 0 < row.zero_difference < 1e-29 and not row.passed


def test_an_output_in_another_dtype_than_the_runs_fails(monkeypatch):
    # A float32 layer giving float64 numbers holds the reference's numbers, and is wrong
    original = harness.run_case

    def widening(backend, case, inputs, weights, config, cotangent=None):
        result = original(backend, case, inputs, weights, config, cotangent)
        result.output = result.output.astype(np.float64)
        return result

    monkeypatch.setattr(harness, "run_case", widening)
    case = harness.Case("DotProductAttention", ("valid_lens_1d",))
    (row,) = harness.compare(["numpy"], cases=[case])
    assert not row.passed and row.error == "TypeError: the output is float64, not float32"
    (row,) = harness.compare(["numpy"], cases=[case], dtype="float64")
    assert row.passed


def test_gradients_that_disagree_between_backends_fail_the_row(monkeypatch):
    # JAX's gradients moved by 1e-8 of their scale: within the gradient tolerance of the
    # reference's finite differences (1e-7), far outside float64's agreement with the first
    # autograd backend's (torch's, the anchor: 1e-10)
    backend_module("torch"), backend_module("jax")
    original = harness.run_case

    def moved(backend, case, inputs, weights, config, cotangent=None):
        result = original(backend, case, inputs, weights, config, cotangent)
        if backend == "jax":
            result.gradients = {
                name: value + 1e-8 * np.abs(value).max() for name, value in result.gradients.items()
            }
        return result

    case = harness.Case("DotProductAttention", ("valid_lens_1d",))
    monkeypatch.setattr(harness, "run_case", moved)
    torch_row, jax_row = harness.compare(["torch", "jax"], dtype="float64", cases=[case])
    assert torch_row.passed and torch_row.gradient_agreement is None
    assert jax_row.gradient_difference <= harness.GRADIENT_TOLERANCES["float64"]
    assert jax_row.gradient_agreement > harness.TOLERANCES["float64"]
    assert not jax_row.passed


def test_weights_missing_from_a_backend_fail_the_row(monkeypatch):
    original = harness.run_case

    def without_weights(backend, case, inputs, weights, config, cotangent=None):
        result = original(backend, case, inputs, weights, config, cotangent)
        if config["dtype"] == "float32":
            result.attention_weights = None
        return result

    case = harness.Case("MultiHeadAttention", ("valid_lens_1d",))
    monkeypatch.setattr(harness, "run_case", without_weights)
    (row,) = harness.compare(["numpy"], cases=[case])
    assert row.weights_difference == float("inf") and not row.passed


def test_the_tests_agreement_is_absolute_in_float64_and_relative_otherwise():
    # conftest.assert_agrees, which the backends' own tests use, measures as the harness does
    expected = np.array([1000.0, 1.0])

    def off(by):
        return expected + np.array([0.0, by])

    with pytest.raises(AssertionError):
        assert_agrees(off(5e-9), expected, "float64")
    assert_agrees(off(5e-11), expected, "float64")
    assert_agrees(off(5e-3), expected, "float32")  # 5e-6 of the scale
    with pytest.raises(AssertionError):
        assert_agrees(off(5e-2), expected, "float32")
    with pytest.raises(AssertionError):
        assert_agrees(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]), "float64")


@pytest.mark.parametrize(
    "mask, key, shape",
    [
        ("mask_1d", "mask", (7,)),
        ("mask_2d", "mask", (5, 7)),
        ("mask_keys", "mask", (4, 1, 7)),
        ("mask_3d", "mask", (4, 5, 7)),
        ("mask_4d", "mask", (4, 2, 5, 7)),
        ("mask_4d_heads", "mask", (1, 2, 1, 7)),
        ("mask_4d_batch", "mask", (4, 1, 5, 7)),
        ("window_mask", "window_mask", (2, 5, 7)),
        ("window_bool", "window_mask", (2, 5, 7)),
        ("head_mask", "head_mask", (2,)),
        ("head_mask_2d", "head_mask", (4, 2)),
        ("head_mask_bool", "head_mask", (4, 2)),
    ],
)
def test_every_mask_kind_has_its_shape_and_an_empty_row(mask, key, shape):
    # Expected: the shapes of Case's docstring (Shapes(): batch 4, 5 queries, 7 keys, 2
    # heads); every mask of queries x keys but mask_1d and mask_4d_heads has a row with no key
    # kept, and every mask keeps some key
    value = harness.make_inputs(
        harness.Case("MultiHeadAttention", (mask,)), harness.Shapes(), "float32", 0
    )[key]
    assert value.shape == shape
    if key == "head_mask":
        return
    kept = value if value.dtype == bool else value != -np.inf
    assert kept.any()
    if mask not in ("mask_1d", "mask_4d_heads"):
        assert not kept.any(axis=-1).all()
    if mask == "window_mask":  # a bias besides -inf: finite values other than 0
        assert np.any(np.isfinite(value) & (value != 0))


def test_shape_and_dtype_variants():
    shapes = harness.Shapes()

    def inputs(*masks, layer="DotProductAttention"):
        return harness.make_inputs(harness.Case(layer, masks), shapes, "float32", 0)

    assert inputs("tall")["keys"].shape[1] < inputs("tall")["queries"].shape[1]
    assert inputs("square")["keys"].shape[1] == inputs("square")["queries"].shape[1]
    assert "keys" not in inputs("self")
    assert inputs("valid_lens_1d", "lens_float")["valid_lens"].dtype == np.float32
    assert inputs("valid_lens_2d", "lens_int32")["valid_lens"].dtype == np.int32
    assert inputs("rank_2", layer="masked_softmax")["X"].shape == (4, 7)
    assert inputs("rank_4", layer="masked_softmax")["X"].shape == (4, 2, 5, 7)
    assert inputs("rank_4", layer="AddNorm")["Y"].shape == (4, 2, 5, 8)


def test_all_cases_use_only_known_masks_and_are_distinct():
    cases = all_cases()
    assert len({case.id for case in cases}) == len(cases)
    assert {mask for case in cases for mask in case.masks} == set(MASKS)


def test_valid_lens_hold_every_extreme_and_attend_in_a_small_batch():
    # Expected: at the default batch of 4 the 1-D lengths are 0, 1, exactly K and more; a
    # batch too small for all four keeps their first ones and one example that attends to
    # some of its K = 7 keys, so that no batch's lengths prove zeros alone
    case = harness.Case("MultiHeadAttention", ("valid_lens_1d",))
    lengths = harness.make_inputs(case, harness.Shapes(), "float32", 0)["valid_lens"]
    assert lengths.tolist() == [0, 1, 7, 10]
    for batch_size in (1, 2, 3):
        shapes = harness.Shapes(batch_size=batch_size)
        lengths = harness.make_inputs(case, shapes, "float32", 0)["valid_lens"]
        assert lengths[:-1].tolist() == [0, 1, 7][: batch_size - 1]
        assert 1 <= lengths[-1] <= 7


@pytest.mark.parametrize(
    ("masks", "given"),
    [
        (("mask_2d", "mask_3d"), "mask"),
        (("attn_bias", "attn_bias_4d"), "attn_bias"),
        (("valid_lens_1d", "valid_lens_2d"), "valid_lens"),
        (("bottom_right", "aligned_2"), "alignment"),
    ],
)
def test_two_masks_that_give_one_input_are_an_error(masks, given):
    # Expected: one would replace the other, and the row would name a mask it never ran
    case = harness.Case("MultiHeadAttention", masks)
    with pytest.raises(ValueError, match=f"give its {given}: one would be lost"):
        harness.make_inputs(case, harness.Shapes(), "float32", 0)


@pytest.mark.parametrize(
    ("case", "left_out"),
    [
        (harness.Case("masked_softmax", ("mask_2d",)), "mask"),
        (harness.Case("masked_softmax", ("valid_lens_1d",), {"softcap": 5.0}), "softcap"),
        (harness.Case("dot_product_attention", ("window_mask",)), "window_mask"),
        (harness.Case("dot_product_attention", ("no_weights",)), "need_weights"),
        (harness.Case("MultiHeadLatentAttention", ("head_mask",)), "head_mask"),
        (harness.Case("AddNorm", ("causal",)), "causal"),
    ],
)
def test_an_input_the_call_does_not_take_is_an_error(case, left_out):
    # Expected: a row whose mask or option never reached the call would agree with the row
    # without it, and name what it did not run: the harness refuses it
    with pytest.raises(ValueError, match=f"call takes no {left_out}"):
        harness.prepare(case, harness.Shapes(), "float32", 0, gradients=False)


# Every size `mha compare` accepts up to 12 features: num_hiddens with each of its divisors as
# num_heads (10/5, 12/3, 6/2, 4/2 and 1/1 among them), beside the default lengths, one example
# of one query and one key, and more queries than a case's max_len of 9
SMALL_SIZES = [(h, n) for h in range(1, 13) for n in range(1, h + 1) if h % n == 0]
LENGTHS = [(4, 5, 7), (1, 1, 1), (2, 12, 3)]


def test_compare_runs_at_every_small_size():
    # Expected: every case of mha compare agrees at every size; a case whose options cannot
    # take the sizes given runs with sizes of its own, which its row's label names, and every
    # other case runs with the sizes given
    for num_hiddens, num_heads in SMALL_SIZES:
        for batch_size, num_queries, num_keys in LENGTHS:
            shapes = harness.Shapes(
                batch_size=batch_size,
                num_queries=num_queries,
                num_keys=num_keys,
                num_hiddens=num_hiddens,
                num_heads=num_heads,
            )
            rows = harness.compare(["numpy"], shapes=shapes)
            assert [row for row in rows if not row.passed] == [], shapes
            for case, row in zip(harness.default_cases(), rows, strict=True):
                fitted = harness.fit(case, shapes)
                assert row.case == fitted.id
                assert row.output_shape[0] == batch_size
                if case.layer == "MultiHeadAttention" and "out_features" not in case.config:
                    assert row.output_shape[-1] == fitted.config.get("num_hiddens", num_hiddens)


@pytest.mark.torch
def test_cases_with_sizes_of_their_own_agree_on_an_autograd_backend():
    # Expected: the cases that take sizes of their own agree with the reference on torch,
    # gradients included (central differences of the reference and torch's autograd)
    backend_module("torch")
    for shapes in (
        harness.Shapes(num_hiddens=6, num_heads=2),
        harness.Shapes(batch_size=1, num_queries=1, num_keys=1, num_hiddens=10, num_heads=5),
        harness.Shapes(batch_size=2, num_queries=12, num_keys=3, num_hiddens=12, num_heads=3),
    ):
        cases = [case for case in harness.default_cases() if harness.fit(case, shapes) != case]
        assert cases, shapes
        rows = harness.compare(["numpy", "torch"], shapes=shapes, cases=cases)
        assert all(row.passed for row in rows), [row for row in rows if not row.passed]
        assert all(row.gradient_difference is not None for row in rows if row.backend == "torch")


def test_fit_takes_the_nearest_sizes_that_fit_and_only_where_needed():
    # Expected: at the default sizes every case runs as written; elsewhere a case whose own
    # options need it takes the nearest larger sizes that fit, and a case with no such option
    # keeps the sizes given (a num_heads that does not divide num_hiddens stays the caller's
    # error)
    assert all(harness.fit(case, harness.Shapes()) == case for case in all_cases())
    gqa = harness.Case("MultiHeadAttention", (), {"num_heads": 4, "num_kv_heads": 2})
    rope = harness.Case("MultiHeadAttention", (), {"rope_theta": 10000.0})
    pinned = harness.Case("MultiHeadAttention", (), {"rope_theta": 1.0, "num_hiddens": 16})
    plain = harness.Case("MultiHeadAttention", (), {"bias": True})
    six = harness.Shapes(num_hiddens=6, num_heads=2)
    assert harness.fit(gqa, six).config == {"num_heads": 4, "num_kv_heads": 2, "num_hiddens": 8}
    assert harness.fit(rope, six).config["num_hiddens"] == 8
    assert harness.fit(rope, harness.Shapes(num_hiddens=12, num_heads=3)) == rope
    assert harness.fit(pinned, harness.Shapes(num_heads=3)).config["num_hiddens"] == 18
    assert harness.fit(plain, harness.Shapes(num_hiddens=10, num_heads=3)) == plain
    odd = harness.Shapes(num_hiddens=7, num_heads=7)
    assert harness.fit(harness.Case("RotaryEmbedding"), odd).config == {"num_hiddens": 8}
    learned = harness.Case("LearnedPositionalEncoding", (), {"max_len": 9})
    assert harness.fit(learned, harness.Shapes(num_queries=12)).config == {"max_len": 12}
    long = harness.Shapes(num_queries=1001)  # beyond the layer's default max_len of 1000
    assert harness.fit(harness.Case("PositionalEncoding"), long).config == {"max_len": 1001}
    assert (
        harness.fit(harness.Case("PositionalEncoding"), harness.Shapes(num_queries=1000)).config
        == {}
    )


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_compare_places_the_backend_where_asked(name, monkeypatch):
    # Expected: with device="cpu" every layer and tensor goes through the backend's to_device
    # (counted), and the rows agree with the reference as they do unplaced
    module = backend_module(name)
    placed = []
    to_device = module.ADAPTER.to_device
    counted = dataclasses.replace(
        module.ADAPTER, to_device=lambda x, d: placed.append(d) or to_device(x, d)
    )
    monkeypatch.setattr(module, "ADAPTER", counted)
    cases = [harness.Case("MultiHeadAttention", ("valid_lens_1d", "causal"))]
    rows = harness.compare(["numpy", name], "float32", cases=cases, device="cpu")
    assert all(row.passed for row in rows), rows
    # The probe, then the layer, queries, keys, values, valid_lens and the cotangent
    assert placed and set(placed) == {"cpu"} and len(placed) >= 6


def test_compare_refuses_a_device_it_cannot_reach():
    # Expected: a backend without to_device, and a device the framework does not see, are
    # ValueErrors naming them, before anything runs
    backend_module("tensorflow")
    with pytest.raises(ValueError, match="cannot put the tensorflow backend on a device"):
        harness.compare(["numpy", "tensorflow"], device="cpu")
    torch = backend_module("torch").torch
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch cannot reach a gpu"):
            harness.compare(["torch"], device="gpu")
    # torch's meta device takes the tensors and gives no numbers back
    with pytest.raises(ValueError, match="torch cannot reach a meta: Cannot copy out of meta"):
        harness.compare(["numpy", "torch"], device="meta")


def test_difference_counts_either_sign_scales_by_the_reference_and_refuses_other_shapes():
    # Worked by hand: an entry 0.5 below the reference is 0.5 off, as one above it is; the
    # relative difference divides by the reference's largest entry (2), not the actual's
    # (100); the same numbers in another shape are no agreement (docs/design.md, "Agreement")
    reference = np.array([10.0, -20.0])
    assert harness.difference(np.array([9.5, -20.0]), reference, relative=False) == 0.5
    assert harness.difference(np.array([10.0, -20.5]), reference, relative=True) == 0.5 / 20
    assert harness.difference(np.array([100.0, 0.0]), np.array([0.0, 2.0]), relative=True) == 50
    flat = np.arange(6.0)
    assert harness.difference(flat.reshape(1, 6), flat, relative=False) == float("inf")
    assert harness.difference(flat.reshape(3, 2), flat.reshape(2, 3), relative=True) == float("inf")


def _shifted_run_case(monkeypatch, change):
    """harness.run_case with `change(backend, result)` applied to what it returns."""
    original = harness.run_case

    def changed(backend, case, inputs, weights, config, cotangent=None):
        result = original(backend, case, inputs, weights, config, cotangent)
        change(backend, result)
        return result

    monkeypatch.setattr(harness, "run_case", changed)


def test_float64_agreement_is_absolute_whatever_the_scale(monkeypatch):
    # docs/design.md: float64 within 1e-10 absolute. An output whose largest entry s is well
    # above 1, moved by d between 1e-10 and 1e-10 * s, is within 1e-10 of its scale and still
    # fails; NumPy's float64 row is otherwise exact
    case = harness.Case("PositionalEncoding")
    prepared = harness.prepare(case, dtype="float64", gradients=False)
    scale = float(np.max(np.abs(prepared.reference.output)))
    assert scale > 1.5
    moved = 1e-10 * (1 + scale) / 2

    def move(backend, result):
        result.output = result.output + moved

    _shifted_run_case(monkeypatch, move)
    row, _ = harness.check("numpy", prepared)
    assert row.output_difference == pytest.approx(moved, rel=1e-3)
    assert not row.passed


@pytest.mark.torch
def test_float64_gradients_off_by_5e_7_of_their_scale_fail(monkeypatch):
    # docs/design.md: float64 gradients within 1e-7 of their scale of the reference's central
    # differences, which are accurate to about 1e-9. torch's gradients moved by 5e-7 of each
    # one's scale are found that far off, and fail the row
    backend_module("torch")
    case = harness.Case("DotProductAttention", ("valid_lens_1d",))
    prepared = harness.prepare(case, dtype="float64", seed=3)
    row, _ = harness.check("torch", prepared)
    assert row.passed and row.gradient_difference < 1e-8

    def move(backend, result):
        result.gradients = {k: v + 5e-7 * np.abs(v).max() for k, v in result.gradients.items()}

    _shifted_run_case(monkeypatch, move)
    row, _ = harness.check("torch", prepared)
    assert row.gradient_difference == pytest.approx(5e-7, rel=0.05)
    assert not row.passed


@pytest.mark.torch
def test_a_gradient_a_backend_does_not_give_fails_the_row(monkeypatch):
    # Every input and weight has a gradient (central differences of the reference give each
    # one): a backend that returns no gradient for W_o has not shown it agrees, and fails
    backend_module("torch")
    case = harness.Case("MultiHeadAttention", ("valid_lens_1d",))
    prepared = harness.prepare(case, dtype="float64", seed=3)
    assert "W_o" in prepared.numeric_gradients

    def drop(backend, result):
        del result.gradients["W_o"]

    _shifted_run_case(monkeypatch, drop)
    row, _ = harness.check("torch", prepared)
    assert row.output_difference < 1e-10 and not row.passed
    assert row.gradient_difference == float("inf")


@pytest.mark.parametrize("leak", [1e-30, np.nan])
def test_an_output_row_with_no_key_must_stay_exactly_zero(monkeypatch, leak):
    # docs/design.md: a row with no key gives an all-zero attention output. DotProductAttention
    # with a valid length of 0 gives such rows; 1e-30 there is within every tolerance and
    # still fails the row, and a NaN there is an infinite difference
    case = harness.Case("DotProductAttention", ("valid_lens_1d",))
    prepared = harness.prepare(case, dtype="float32", gradients=False)
    zero_rows = np.all(prepared.reference.output == 0, axis=-1)
    assert zero_rows.any()

    def leak_into_the_output(backend, result):
        result.output = np.where(zero_rows[..., None], np.float32(leak), result.output)

    _shifted_run_case(monkeypatch, leak_into_the_output)
    row, _ = harness.check("numpy", prepared)
    if leak == 1e-30:
        assert row.output_difference <= harness.TOLERANCES["float32"]
        assert row.weights_difference <= harness.TOLERANCES["float32"]
        assert 0 < row.zero_difference < 1e-29
    else:
        assert row.zero_difference == float("inf")
    assert not row.passed


@pytest.mark.torch
@pytest.mark.jax
def test_float64_gradient_agreement_between_backends_is_absolute(monkeypatch):
    # Between autograd backends, float64 gradients agree within 1e-10 absolute, as outputs do:
    # one entry of JAX's largest gradient (scale s above 1) moved by d between 1e-10 and
    # 1e-10 * s fails the row, though it is within 1e-10 of that gradient's scale
    backend_module("torch"), backend_module("jax")
    case = harness.Case("MultiHeadAttention", ("valid_lens_1d",))
    prepared = harness.prepare(case, dtype="float64", seed=3)
    name, scale = max(
        ((k, float(np.max(np.abs(v)))) for k, v in prepared.numeric_gradients.items()),
        key=lambda item: item[1],
    )
    assert scale > 1.5
    moved = 1e-10 * (1 + scale) / 2

    def move(backend, result):
        if backend == "jax":
            result.gradients[name] = result.gradients[name] + moved

    _shifted_run_case(monkeypatch, move)
    torch_row, jax_row = harness.compare(["torch", "jax"], dtype="float64", cases=[case], seed=3)
    assert torch_row.passed
    assert jax_row.gradient_agreement == pytest.approx(moved, rel=0.01)
    assert not jax_row.passed


@pytest.mark.torch
@pytest.mark.jax
@pytest.mark.tensorflow
def test_every_backend_agrees_with_the_first_autograd_backend(monkeypatch):
    # compare's docstring: the first autograd backend named is the one the others must agree
    # with. torch's gradients moved by 1e-8 of their scale (within the finite differences'
    # 1e-7): JAX and TensorFlow, which agree with each other, both disagree with torch
    for name in ("torch", "jax", "tensorflow"):
        backend_module(name)

    def move(backend, result):
        if backend == "torch":
            result.gradients = {k: v + 1e-8 * np.abs(v).max() for k, v in result.gradients.items()}

    _shifted_run_case(monkeypatch, move)
    case = harness.Case("DotProductAttention", ("valid_lens_1d",))
    rows = harness.compare(["torch", "jax", "tensorflow"], dtype="float64", cases=[case])
    torch_row, jax_row, tf_row = rows
    assert torch_row.passed and torch_row.gradient_agreement is None
    assert jax_row.gradient_agreement > harness.TOLERANCES["float64"] and not jax_row.passed
    assert tf_row.gradient_agreement == pytest.approx(jax_row.gradient_agreement, rel=1e-3)
    assert not tf_row.passed
