"""One layer shared between threads: every call gets its own masks and its own kind of result.

Each thread calls the same layer with another combination of `causal`, valid_lens and
`need_weights`, many times; every output must be the NumPy reference's for that call.
"""

import sys
import threading

import numpy as np
import pytest

import mha
from conftest import backend_module, backend_params
from mha.backends import numpy as N

B, L, D, H = 2, 5, 8, 2
CALLS = [
    {"causal": causal, "valid_lens": valid_lens, "need_weights": need_weights}
    for causal in (False, True)
    for valid_lens in (None, np.array([2, 5]))
    for need_weights in (True, False)
]


@pytest.mark.parametrize("name", backend_params())
@pytest.mark.parametrize("hybridize", [False, True], ids=["eager", "hybridized"])
def test_a_layer_shared_between_threads_computes_each_call(name, hybridize):
    module = backend_module(name)
    if hybridize and name != "mxnet":
        pytest.skip("hybridize is MXNet's")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((B, L, D))
    reference = N.MultiHeadAttention(D, H, query_size=D, key_size=D, value_size=D, dtype="float64")
    layer = module.MultiHeadAttention(D, H, dtype="float64")
    weights = mha.get_weights(reference)
    mha.set_weights(layer, weights)
    if hybridize:
        layer.hybridize()
    expected = [reference(X, X, X, **call) for call in CALLS]
    inputs = module.from_numpy(X)
    lengths = {i: call["valid_lens"] for i, call in enumerate(CALLS)}
    arguments = [
        {**call, "valid_lens": None if lengths[i] is None else module.from_numpy(lengths[i])}
        for i, call in enumerate(CALLS)
    ]
    failures = []
    start = threading.Barrier(len(CALLS))

    def work(i):
        start.wait()
        for _ in range(20):
            output = layer(inputs, inputs, inputs, **arguments[i])
            if isinstance(output, tuple):
                failures.append((i, "a tuple"))
                return
            difference = np.abs(module.to_numpy(output) - expected[i]).max()
            if not difference < 1e-10:
                failures.append((i, difference))
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(CALLS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.parametrize("name", backend_params())
def test_a_lazy_layers_first_calls_from_several_threads_draw_its_weights_once(name):
    # Its input sizes unknown until called: threads that call it first at once must all
    # compute with the one set of weights it keeps (each drew its own, or read them half made)
    module = backend_module(name)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((B, L, D)) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often, inside the first call too
    try:
        for _ in range(10):
            layer = module.MultiHeadAttention(D, H, bias=True, dtype="float64")
            outputs, start = {}, threading.Barrier(len(inputs))

            def work(i, layer=layer, outputs=outputs, start=start):
                start.wait()
                X = module.from_numpy(inputs[i])
                try:
                    outputs[i] = module.to_numpy(layer(X, X, X))
                except Exception as error:  # a framework's error for a layer built twice
                    outputs[i] = error

            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            reference = N.MultiHeadAttention(D, H, bias=True, dtype="float64")
            reference(inputs[0], inputs[0], inputs[0])  # sized, then given the layer's weights
            mha.set_weights(reference, mha.get_weights(layer))
            for i, X in enumerate(inputs):
                assert not isinstance(outputs[i], Exception), outputs[i]
                np.testing.assert_allclose(outputs[i], reference(X, X, X), rtol=0, atol=1e-12)
    finally:
        sys.setswitchinterval(interval)
