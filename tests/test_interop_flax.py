"""Flax's own multi-head attention (NNX's MultiHeadAttention, Linen's
MultiHeadDotProductAttention) into every mha backend and back, judged by Flax's own outputs;
and Flax's msgpack parameter files through `mha convert`."""

import numpy as np
import pytest

import mha
from conftest import backend_module, backend_params
from mha import interop
from mha.backends import numpy as N

pytestmark = pytest.mark.jax

B, Q, K, D, H = 2, 3, 5, 8, 2


@pytest.fixture(scope="module")
def flax():
    backend_module("jax")
    import flax

    return flax


def inputs(seed=0, key_size=D):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, Q, D)).astype("float32"),
        rng.standard_normal((B, K, key_size)).astype("float32"),
        rng.standard_normal((B, K, key_size)).astype("float32"),
    )


# Masks under which every query keeps a key: Flax gives a query with none the mean of the
# values, mha gives zeros
MASKS = {
    "none": {},
    "valid_lens": {"valid_lens": np.array([2, 5])},
    "causal": {"causal": True},
    "mask": {"mask": np.arange(Q * K).reshape(1, Q, K) % 4 != 1},
}


def flax_call(module, q, k, v, masks):
    import jax.numpy as jnp

    flax_masks = interop.to_flax_masks(**masks, num_queries=Q, num_keys=K)
    mask = {name: jnp.asarray(value) for name, value in flax_masks.items()}
    return np.asarray(module(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), **mask))


def mha_call(layer, q, k, v, masks):
    module = backend_module(mha.registry.backend_of(layer))
    arguments = {
        name: module.from_numpy(value) if isinstance(value, np.ndarray) else value
        for name, value in masks.items()
    }
    output = layer(*map(module.from_numpy, (q, k, v)), **arguments)
    return module.to_numpy(output)


@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name", backend_params())
def test_nnx_multihead_attention_into_every_backend(flax, name, bias, masks):
    from flax import nnx

    backend_module(name)

    module = nnx.MultiHeadAttention(
        H,
        D,
        qkv_features=D,
        out_features=D,
        in_kv_features=6,
        use_bias=bias,
        decode=False,
        deterministic=True,
        rngs=nnx.Rngs(3),
    )
    if bias:  # Flax starts biases at zero: make them count
        for projection in (module.query, module.key, module.value, module.out):
            shape = projection.bias[...].shape
            values = 0.1 * (1 + np.arange(np.prod(shape))).reshape(shape)
            projection.bias[...] = projection.bias[...] + values.astype("float32")
    layer = interop.from_flax(module, backend=name)
    assert mha.get_weights(layer)["W_k"].shape == (6, D)
    q, k, v = inputs(key_size=6)
    expected = flax_call(module, q, k, v, MASKS[masks])
    np.testing.assert_allclose(mha_call(layer, q, k, v, MASKS[masks]), expected, atol=2e-5)


@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("name", backend_params())
def test_every_backend_to_nnx(flax, name, masks):
    # Keys and values of a size other than the queries' (nnx's in_kv_features)
    module = backend_module(name)
    sizes = {"query_size": D, "key_size": 6, "value_size": 6}
    reference = N.MultiHeadAttention(D, H, bias=True, **sizes)
    layer = module.MultiHeadAttention(D, H, bias=True, **sizes)
    mha.set_weights(layer, mha.get_weights(reference))
    builtin = interop.to_flax(layer)
    builtin.eval()
    assert builtin.in_kv_features == 6
    q, k, v = inputs(1, key_size=6)
    np.testing.assert_allclose(
        flax_call(builtin, q, k, v, MASKS[masks]), reference(q, k, v, **MASKS[masks]), atol=2e-5
    )


@pytest.mark.parametrize("name", backend_params())
def test_flax_masks_of_each_rank_into_every_backend(flax, name):
    # Flax reads a mask of 3 axes as (heads, Q, K), which mha's layers would read as (batch,
    # Q, K): with as many examples as heads nothing else would tell them apart. A float 0/1
    # mask (make_attention_mask's) attends where nonzero
    import jax.numpy as jnp
    from flax import nnx

    backend_module(name)
    module = nnx.MultiHeadAttention(H, D, decode=False, deterministic=True, rngs=nnx.Rngs(5))
    layer = interop.from_flax(module, backend=name)
    q, k, v = inputs(2)
    rng = np.random.default_rng(6)
    per_head = rng.random((H, Q, K)) < 0.6
    per_head[..., 0] = True  # a key in every row: Flax gives a row with none the values' mean
    keys = (np.arange(K) < np.array([[3], [5]]))[:, None, :]  # (B, 1, K)
    for mask in (per_head, per_head[0], per_head[None] & keys[:, None], keys[:, None] * 1.0):
        expected = np.asarray(module(*map(jnp.asarray, (q, k, v)), mask=jnp.asarray(mask)))
        output = mha_call(layer, q, k, v, interop.from_flax_masks(mask, backend="numpy"))
        np.testing.assert_allclose(output, expected, atol=2e-5)
    with pytest.raises(ValueError, match=r"\(batch, heads, Q, K\)"):
        interop.from_flax_masks(np.ones((1, 1, H, Q, K), bool))


def test_linen_parameters_both_ways(flax):
    import jax
    import jax.numpy as jnp
    from flax import linen

    module = linen.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, out_features=D)
    q, k, v = inputs(2)
    params = module.init(jax.random.PRNGKey(0), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    params = jax.tree_util.tree_map(lambda x: x + 0.01, params)  # non-zero biases
    expected = np.asarray(module.apply(params, *map(jnp.asarray, (q, k, v))))
    # The whole variables dict ({"params": ...}) or the params alone
    for source in (params, params["params"]):
        layer = interop.from_flax(source, backend="numpy")
        np.testing.assert_allclose(layer(q, k, v), expected, atol=2e-5)
    # And back: mha's weights as Linen parameters give mha's output
    weights = mha.get_weights(layer)
    again = interop.flax_params(weights, H)
    output = module.apply({"params": again}, *map(jnp.asarray, (q, k, v)))
    np.testing.assert_allclose(np.asarray(output), layer(q, k, v), atol=2e-5)


def test_what_flax_layers_mha_cannot_hold_is_an_error(flax):
    from flax import nnx

    normalized = nnx.MultiHeadAttention(H, D, normalize_qk=True, decode=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="normalize_qk"):
        interop.from_flax(normalized)
    wide = nnx.MultiHeadAttention(
        H, D, qkv_features=D, out_features=12, decode=False, rngs=nnx.Rngs(0)
    )
    # Another output size converts, with out_features
    x = np.random.default_rng(0).standard_normal((2, 3, D)).astype("float32")
    layer = interop.from_flax(wide, backend="numpy")
    assert layer.out_features == 12
    np.testing.assert_allclose(layer(x, x, x), np.asarray(wide(x, x, x)), atol=2e-5)
    np.testing.assert_allclose(
        np.asarray(interop.to_flax(layer)(x, x, x)), layer(x, x, x), atol=2e-5
    )
    with pytest.raises(ValueError, match=r"Found: \['query', 'value'\]"):
        interop.from_flax(
            {"query": {"kernel": np.zeros((D, H, 4))}, "value": {"kernel": np.zeros((D, H, 4))}}
        )
    with pytest.raises(ValueError, match=r"Found: \[1, 'query'\]"):
        interop.from_flax({"query": {"kernel": np.zeros((D, H, 4))}, 1: 2})
    with pytest.raises(TypeError, match=r"flax\.nnx\.MultiHeadAttention"):
        interop.from_flax(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"Flax's multi-head attention holds.*AddNorm"):
        interop.to_flax(N.AddNorm(4))
    layer = N.MultiHeadAttention(D, H, query_size=D, key_size=4, value_size=6)
    with pytest.raises(ValueError, match="in_kv_features"):
        interop.to_flax(layer)
    gated = N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D, output_gate=True)
    with pytest.raises(ValueError, match="an output gate"):  # Flax's layer has none
        interop.flax_params(mha.get_weights(gated), H)


def test_linen_parameters_of_a_qk_norm_are_refused(flax):
    # Linen's normalize_qk adds query_ln and key_ln beside the four projections: read as
    # if they were not there, the queries and keys would go unnormalized (other numbers)
    import jax
    import jax.numpy as jnp
    from flax import linen

    module = linen.MultiHeadDotProductAttention(
        num_heads=H, qkv_features=D, out_features=D, normalize_qk=True
    )
    q, k, v = map(jnp.asarray, inputs(3))
    params = module.init(jax.random.PRNGKey(0), q, k, v)
    assert {"query_ln", "key_ln"} <= set(params["params"])
    for source in (params, params["params"]):
        with pytest.raises(ValueError, match=r"Found: \['key', 'key_ln', .*normalize_qk=True"):
            interop.from_flax(source, backend="numpy")


def test_kernels_of_another_head_layout_are_refused(flax):
    # (head size, heads, out) holds as many numbers as (heads, head size, out): read as if it
    # were Flax's layout, the heads' outputs would meet the wrong rows of W_o
    layer = N.MultiHeadAttention(D, H, bias=False, query_size=D, key_size=D, value_size=D)
    params = interop.flax_params(mha.get_weights(layer), H)
    out = params["out"]["kernel"]
    params["out"]["kernel"] = out.reshape(D // H, H, D)
    with pytest.raises(ValueError, match=r"out kernel \(4, 2, 8\): expected \(num_heads"):
        interop.from_flax(params)
    params["out"]["kernel"] = out
    # Keys or values in 4 heads of 2 beside queries in 2 heads of 4: as many columns, but
    # heads that Flax's attention could not pair
    for name in ("key", "value"):
        changed = {**params, name: {"kernel": params[name]["kernel"].reshape(D, 2 * H, 2)}}
        with pytest.raises(ValueError, match="heads or head sizes that do not fit together"):
            interop.from_flax(changed)
    # Three key-value heads do not divide four query heads (grouped-query attention)
    rng = np.random.default_rng(1)
    kernels = {"query": (D, 4, 2), "key": (D, 3, 2), "value": (D, 3, 2), "out": (4, 2, D)}
    grouped = {name: {"kernel": rng.standard_normal(shape)} for name, shape in kernels.items()}
    with pytest.raises(ValueError, match="heads or head sizes that do not fit together"):
        interop.canonical_from_flax(grouped)


def test_flax_parameters_with_biases_on_some_projections_only_are_refused(flax):
    # Flax's use_bias gives the four projections a bias each, or none: a dict with some of
    # them is not the parameters of its multi-head attention
    layer = N.MultiHeadAttention(D, H, bias=True, query_size=D, key_size=D, value_size=D)
    params = interop.flax_params(mha.get_weights(layer), H)
    for name in ("key", "out"):
        partial = {**params, name: {"kernel": params[name]["kernel"]}}
        with pytest.raises(ValueError, match=r"biases on \[.*\] only"):
            interop.canonical_from_flax(partial)


def test_a_flax_layer_computing_with_functions_of_its_own_is_an_error(flax):
    # Its attention_fn (or products) computes other numbers than mha's layer would
    import jax
    from flax import nnx

    def doubled(query, key, value, *args, **kwargs):
        return nnx.dot_product_attention(2.0 * query, key, value, *args, **kwargs)

    own = {"attention_fn": doubled, "qkv_dot_general": jax.lax.dot_general}
    for name, function in own.items():
        source = nnx.MultiHeadAttention(H, D, decode=False, rngs=nnx.Rngs(0), **{name: function})
        with pytest.raises(ValueError, match=name):
            interop.from_flax(source)
    # Flax's own default, given by name, ports
    same = nnx.MultiHeadAttention(
        H, D, attention_fn=nnx.dot_product_attention, decode=False, rngs=nnx.Rngs(0)
    )
    x = np.random.default_rng(1).standard_normal((2, 3, D)).astype("float32")
    layer = interop.from_flax(same, backend="numpy")
    np.testing.assert_allclose(layer(x, x, x), np.asarray(same(x, x, x)), atol=2e-5)


def test_a_flax_subclass_computing_its_own_way_is_refused(flax):
    from flax import nnx

    class Scaled(nnx.MultiHeadAttention):
        def __call__(self, inputs_q, *args, **kwargs):
            return super().__call__(2.0 * inputs_q, *args, **kwargs)

    source = Scaled(H, D, decode=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"Scaled overrides __call__ of flax's MultiHeadAttention"):
        interop.from_flax(source)


@pytest.mark.parametrize("name", backend_params())
def test_flax_num_kv_heads_into_every_backend_and_back(flax, name):
    import inspect

    backend_module(name)  # a required backend that is missing fails, else skips
    from flax import nnx

    if "num_kv_heads" not in inspect.signature(nnx.MultiHeadAttention.__init__).parameters:
        # Flax 0.12.0 (beside MXNet) has no grouped heads: mha says so instead of guessing
        layer = N.MultiHeadAttention(D, 4, query_size=D, key_size=D, value_size=D, num_kv_heads=2)
        with pytest.raises(ValueError, match="fewer key-value heads"):
            interop.to_flax(layer)
        return
    source = nnx.MultiHeadAttention(4, D, num_kv_heads=2, decode=False, rngs=nnx.Rngs(3))
    q, k, v = inputs(4)
    layer = interop.from_flax(source, backend=name)
    assert (layer.num_heads, layer.num_kv_heads) == (4, 2)
    _, config = interop.canonical_from_flax(source)
    assert (config["num_heads"], config["num_kv_heads"]) == (4, 2)
    for masks in MASKS.values():
        expected = flax_call(source, q, k, v, masks)
        np.testing.assert_allclose(mha_call(layer, q, k, v, masks), expected, atol=2e-5)
    again = interop.to_flax(layer)
    np.testing.assert_allclose(np.asarray(again(q, k, v)), np.asarray(source(q, k, v)), atol=1e-6)


@pytest.mark.parametrize("name", backend_params())
def test_a_flax_layer_in_decode_mode_ports_and_decodes_as_mha_does(flax, name):
    # decode=True is how a Flax layer is called, not what it holds: its weights port, and mha's
    # KVCache, one position a call, gives each of Flax's cached decoding steps
    import jax.numpy as jnp
    from flax import nnx

    module = backend_module(name)
    source = nnx.MultiHeadAttention(H, D, decode=True, rngs=nnx.Rngs(5))
    steps = np.random.default_rng(6).standard_normal((B, 4, D)).astype("float32")
    source.init_cache(steps.shape)
    layer, cache = interop.from_flax(source, backend=name), mha.KVCache()
    for t in range(steps.shape[1]):
        expected = np.asarray(source(jnp.asarray(steps[:, t : t + 1])))
        x = module.from_numpy(steps[:, t : t + 1])
        output, cache = layer(x, x, x, cache=cache)
        np.testing.assert_allclose(module.to_numpy(output), expected, atol=2e-5)
    assert module.to_numpy(cache.keys).shape == (B, H, 4, D // H)


def test_convert_through_a_flax_msgpack_file(flax, tmp_path):
    from flax import serialization

    reference = N.MultiHeadAttention(D, H, bias=True, query_size=D, key_size=D, value_size=D)
    mha.save(reference, tmp_path / "a.safetensors")
    interop.convert(tmp_path / "a.safetensors", tmp_path / "a.msgpack")
    # What Flax itself reads from the file: the parameters of its layer
    params = serialization.msgpack_restore((tmp_path / "a.msgpack").read_bytes())
    assert params["query"]["kernel"].shape == (D, H, D // H)
    assert params["out"]["kernel"].shape == (H, D // H, D)
    interop.convert(tmp_path / "a.msgpack", tmp_path / "b.safetensors")
    back = mha.load(tmp_path / "b.safetensors")
    for name, value in mha.get_weights(reference).items():
        np.testing.assert_array_equal(mha.get_weights(back)[name], value)


def test_a_foreign_msgpack_file_is_one_error(flax, tmp_path):
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\xc1not msgpack at all")
    with pytest.raises(ValueError, match=r"not a flax\.serialization msgpack file"):
        interop.read_file(bad)


def test_a_msgpack_file_not_holding_a_map_is_refused_before_it_is_read(flax, tmp_path):
    # 1 GiB of zeros (sparse: no disk): a msgpack integer 0, then bytes; refused by its first
    zeros = tmp_path / "zeros.msgpack"
    with open(zeros, "wb") as file:
        file.truncate(1 << 30)
    for path, content in ((zeros, None), (tmp_path / "empty.msgpack", b"")):
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(ValueError, match="does not begin with a map"):
            interop.read_file(path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p["key"].update(kernel=p["key"]["kernel"].astype(np.int64)), "int64"),
        (lambda p: p["key"].update(kernel=p["key"]["kernel"].astype(bool)), "bool"),
        (lambda p: p["out"].update(bias=p["out"]["bias"].astype(np.float64)), "float32, float64"),
        (lambda p: p["query"].update(bias=np.float32(1.0)), r"query bias \(\): expected \(2, 4\)"),
        (lambda p: p["out"].update(bias=np.zeros((1, D), "f4")), r"out bias \(1, 8\)"),
    ],
    ids=["int64", "bool", "mixed", "scalar-bias", "out-bias-2d"],
)
def test_a_msgpack_file_of_other_dtypes_or_bias_shapes_is_refused_as_read(
    flax, tmp_path, change, message
):
    # Flax files carry any dtype and shape: refused where read, not after a conversion began
    from flax import serialization

    layer = N.MultiHeadAttention(D, H, bias=True, query_size=D, key_size=D, value_size=D)
    params = interop.flax_params(mha.get_weights(layer), H)
    change(params)
    path = tmp_path / "other.msgpack"
    path.write_bytes(serialization.msgpack_serialize(params))
    with pytest.raises(ValueError, match=rf"^{path}: This Flax .*\n  - .*{message}"):
        interop.read_file(path)
    with pytest.raises(ValueError, match=message):
        interop.convert(path, tmp_path / "other.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.msgpack"]


def test_dropout_draws_a_mask_for_each_weight_both_ways(flax):
    from flax import nnx

    # Four identical examples in training: one mask shared by the batch (Flax's default,
    # broadcast_dropout=True) gives them one output, a mask for each weight (mha's) four
    x = np.repeat(np.random.default_rng(0).standard_normal((1, Q, D)), 4, 0).astype("float32")
    layer = N.MultiHeadAttention(D, H, 0.5, query_size=D, key_size=D, value_size=D)
    builtin = interop.to_flax(layer)
    builtin.train()
    output = np.asarray(builtin(x, x, x))
    assert not np.allclose(output[0], output[1:])
    shared = nnx.MultiHeadAttention(H, D, dropout_rate=0.5, decode=False, rngs=nnx.Rngs(0))
    shared.train()
    output = np.asarray(shared(x, x, x))
    assert np.allclose(output[0], output[1:])
    with pytest.raises(ValueError, match=r"broadcast_dropout=True with dropout_rate=0\.5"):
        interop.from_flax(shared)
    # Either setting changed on the layer converts it
    for changed in ({"broadcast_dropout": False}, {"dropout_rate": 0.0}):
        source = nnx.MultiHeadAttention(
            H, D, **{"dropout_rate": 0.5, **changed}, decode=False, rngs=nnx.Rngs(0)
        )
        converted = interop.from_flax(source, backend="numpy")
        assert N.layer_config(converted)["dropout"] == source.dropout_rate


@pytest.mark.parametrize("name", backend_params())
def test_an_nnx_modules_mode_carries_over_both_ways(flax, name):
    # A deterministic module computes without dropout, so must the layer made from it; an mha
    # layer's mode (NumPy's layers start in evaluation) makes a module callable without one
    from flax import nnx

    backend_module(name)
    source = nnx.MultiHeadAttention(
        H, D, dropout_rate=0.5, broadcast_dropout=False, decode=False, rngs=nnx.Rngs(1)
    )
    source.eval()
    q, k, v = inputs(seed=4)
    expected = flax_call(source, q, k, v, {})
    layer = interop.from_flax(source, backend=name)
    np.testing.assert_allclose(mha_call(layer, q, k, v, {}), expected, rtol=1e-5, atol=1e-6)
    evaluating = N.MultiHeadAttention(D, H, 0.5, True, query_size=D, key_size=D, value_size=D)
    mha.set_weights(evaluating, mha.get_weights(layer))
    builtin = interop.to_flax(evaluating)
    np.testing.assert_allclose(flax_call(builtin, q, k, v, {}), expected, rtol=1e-5, atol=1e-6)
    assert builtin.deterministic is True


def test_big_endian_parameters_convert_as_the_same_numbers(flax, tmp_path):
    # numpy keeps a file's byte order; torch takes only this machine's
    backend_module("torch")
    rng = np.random.default_rng(7)
    params = {
        "query": {"kernel": rng.standard_normal((D, H, D // H))},
        "key": {"kernel": rng.standard_normal((D, H, D // H))},
        "value": {"kernel": rng.standard_normal((D, H, D // H))},
        "out": {"kernel": rng.standard_normal((H, D // H, D))},
    }
    swapped = {k: {"kernel": v["kernel"].astype(">f4")} for k, v in params.items()}
    weights, _ = interop.canonical_from_flax(swapped)
    expected, _ = interop.canonical_from_flax(
        {k: {"kernel": v["kernel"].astype("<f4")} for k, v in params.items()}
    )
    for name, value in weights.items():
        assert value.dtype == np.dtype("float32") and value.dtype.isnative
        np.testing.assert_array_equal(value, expected[name])
    interop.write_file(tmp_path / "w.pt", weights)  # torch refuses a foreign byte order
    read, _ = interop.read_file(tmp_path / "w.pt", num_heads=H)
    np.testing.assert_array_equal(read["W_q"], expected["W_q"])


def test_to_flax_multiplies_at_the_mha_layers_precision(flax):
    # Flax's default precision is TF32 on a GPU: to_flax's layer ran its float32 products
    # there where mha's run at full precision. A CPU computes float32 exactly anyway: the
    # lowered program shows the policy, and a precision the user sets when it is made wins
    import jax

    layer = N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D)
    x = jax.numpy.ones((B, Q, D), "float32")

    def products(module):
        text = jax.jit(lambda q: module(q, q, q)).lower(x).as_text()
        return [line for line in text.splitlines() if "dot_general" in line]

    full = products(interop.to_flax(layer))
    assert full and all("precision = [HIGHEST, HIGHEST]" in line for line in full)
    with jax.default_matmul_precision("tensorfloat32"):
        chosen = products(interop.to_flax(layer))
    assert len(chosen) == len(full) and not any("HIGHEST" in line for line in chosen)
