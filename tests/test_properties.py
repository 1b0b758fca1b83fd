"""Random configurations (batch, lengths, feature sizes, heads, dtype, masks) drawn by
hypothesis: every backend agrees with the NumPy reference on outputs and attention weights.

A run draws the examples of the hypothesis profile (MHA_HYPOTHESIS_PROFILE, see conftest.py),
a third of them in JAX.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import backend_module, backend_params
from mha import harness
from mha.registry import BACKENDS

LAYERS = ("DotProductAttention", "AdditiveAttention", "MultiHeadAttention")


@st.composite
def configurations(draw):
    """(case, shapes, dtype, seed): one layer with a random combination of masks."""
    layer = draw(st.sampled_from(LAYERS))
    multihead = layer == "MultiHeadAttention"
    num_heads = draw(st.integers(1, 3))
    shapes = harness.Shapes(
        batch_size=draw(st.integers(1, 4)),
        num_queries=draw(st.integers(1, 6)),
        num_keys=draw(st.integers(1, 6)),
        query_size=draw(st.integers(1, 5)),
        key_size=draw(st.integers(1, 5)),
        value_size=draw(st.integers(1, 5)),
        num_hiddens=num_heads * draw(st.integers(1, 3)),
        num_heads=num_heads,
    )
    # At most one valid_lens and one boolean mask; any of the others
    masks = [
        draw(st.sampled_from([None, "valid_lens_1d", "valid_lens_2d"])),
        draw(st.sampled_from([None, "mask_2d", "mask_3d"] + (["mask_4d"] if multihead else []))),
    ]
    others = ["causal", "window_mask", "square"] + (
        ["head_mask", "no_weights"] if multihead else []
    )
    masks += draw(st.lists(st.sampled_from(others), unique=True))
    config = {"bias": draw(st.booleans())} if multihead else {}
    case = harness.Case(layer, tuple(mask for mask in masks if mask), config)
    return case, shapes, draw(st.sampled_from(["float32", "float64"])), draw(st.integers(0, 2**16))


@pytest.mark.slow
@pytest.mark.parametrize("name", backend_params([name for name in BACKENDS if name != "numpy"]))
def test_random_configurations_agree(name):
    backend_module(name)
    # JAX compiles each operation for each new shape, about ten times the others' cost per
    # example: a third of the profile's examples (test_agreement.py holds every case in JAX)
    examples = settings().max_examples // (3 if name == "jax" else 1)

    @settings(max_examples=examples)
    @given(configurations())
    def agree(configuration):
        case, shapes, dtype, seed = configuration
        prepared = harness.prepare(case, shapes, dtype, seed, gradients=False)
        row, _ = harness.check(name, prepared)
        assert row.passed, (row, shapes)

    agree()
