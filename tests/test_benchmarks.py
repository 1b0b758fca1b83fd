"""The benchmark runner: `mha bench --quick` runs every code path, and its outputs parse.

No timing is asserted: the numbers depend on the machine and its load.
"""

import collections
import io
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha
from conftest import backend_module
from mha import bench, cli, harness
from mha.registry import FRAMEWORKS, select_backends

pytestmark = pytest.mark.numpy


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["bench", *argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_quick_run_prints_a_markdown_table_and_progress():
    code, out, err = run("--quick", "--backends", "numpy")
    assert code == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("| backend |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert columns[:6] == ["backend", "mode", "(B, L, d, h)", "valid_lens", "need_weights", "pass"]
    assert "ratio" in columns
    rows = [line for line in lines if line.startswith("| numpy |")]
    assert len(rows) == 4  # valid_lens x need_weights on one shape, forward only
    assert all(len(row.strip("|").split("|")) == len(columns) for row in rows)
    assert "matmul roofline" in rows[0]
    assert "[0/4]" in err and "done" in err


def test_quick_json_report(tmp_path):
    path = tmp_path / "bench.json"
    code, out, _ = run("--quick", "--backends", "numpy", "--json", "--output", str(path))
    assert code == 0
    document = json.loads(out)
    assert json.loads(path.read_text()) == document
    assert document["machine"]["cpu_count"] >= 1
    assert document["machine"]["matmul_roofline_gflops"] > 0
    results = document["results"]
    assert {(r["config"]["valid_lens"], r["config"]["need_weights"]) for r in results} == {
        (False, True),
        (False, False),
        (True, True),
        (True, False),
    }
    for row in results:
        assert row["backend"] == "numpy" and row["pass"] == "forward"
        assert row["mha_ms"] > 0 and row["ratio"] > 0 and row["repeats"] >= 2
        # The roofline product is no layer: no fault count of its own
        assert row["builtin_faults"] is None
        assert bench.resource is None or row["mha_faults"] >= 0


@pytest.mark.torch
def test_quick_torch_rows_compare_with_both_builtins():
    backend_module("torch")
    results, _ = bench.run(["torch"], bench.QUICK_SHAPES, bench.QUICK_BUDGET, memory=False)
    builtins = {(r.config.need_weights, r.pass_, r.builtin) for r in results}
    for pass_ in bench.PASSES:
        assert (True, pass_, "nn.MultiheadAttention") in builtins
        assert (False, pass_, "SDPA layer") in builtins
        assert (True, pass_, "SDPA layer") not in builtins  # SDPA cannot return weights
    assert all(r.ratio > 0 for r in results)
    if bench.resource is not None:
        assert all(r.mha_faults >= 0 and r.builtin_faults >= 0 for r in results)
    rows = bench.run_memory_scaling((32, 64), num_hiddens=16, num_heads=2)
    assert [row["length"] for row in rows] == [32, 64]
    assert bench.memory_table(rows).splitlines()[0].startswith("| length |")


@pytest.mark.torch
@pytest.mark.tensorflow
def test_a_bfloat16_run_times_torch_and_tensorflow_and_skips_the_others():
    backend_module("torch")
    backend_module("tensorflow")
    code, out, err = run("--quick", "--dtype", "bfloat16", "--json", "--no-memory")
    assert code == 0, err
    document = json.loads(out)
    rows = document["results"]
    assert {row["backend"] for row in rows} == {"torch", "tensorflow"}
    assert {(row["config"]["dtype"], row["config"]["device"]) for row in rows} == {
        ("bfloat16", "cpu")
    }
    assert document["machine"]["device"] == "cpu"
    skipped = document["skipped"]
    assert skipped["numpy"] == "benchmarked in float32 on the CPU only"
    if _installed("mxnet"):
        assert skipped["mxnet"] == "benchmarked in float32 on the CPU only"
    else:
        assert "not available" in skipped["mxnet"]


def test_a_backend_that_cannot_run_as_asked_is_a_usage_error(monkeypatch):
    code, _, err = run("--quick", "--backends", "numpy", "--dtype", "bfloat16")
    assert code == 2 and "--backends numpy: benchmarked in float32 on the CPU only" in err
    # Where no framework sees a GPU (made so here, whatever the machine), --device gpu has
    # nothing to run, and says why for each backend
    if _installed("torch"):
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if _installed("tensorflow"):
        tf = backend_module("tensorflow").tf
        monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    code, _, err = run("--quick", "--device", "gpu")
    assert code == 2 and "no backend can run in float32 on the gpu here" in err
    if _installed("torch"):
        assert "torch: torch sees no GPU" in err


def _rows_of(options):
    """(backend, mode, valid_lens, need_weights, pass, built-in) of each row of a quick run."""
    code, out, err = run("--quick", "--json", "--no-memory", *options.split())
    assert code == 0, err
    document = json.loads(out)
    keys = ("valid_lens", "need_weights")
    rows = [
        (r["backend"], r["mode"], *(r["config"][key] for key in keys), r["pass"], r["builtin"])
        for r in document["results"]
    ]
    return rows, document, err


_ROOFLINE, _SDPA, _TORCH_MHA = "matmul roofline", "SDPA layer", "nn.MultiheadAttention"


@pytest.mark.parametrize(
    "options, expected",
    [
        (
            "--backends numpy --valid-lens yes --need-weights false",
            [("numpy", "reference", True, False, "forward", _ROOFLINE)],
        ),
        (
            "--backends numpy --valid-lens no --pass forward",
            [
                ("numpy", "reference", False, False, "forward", _ROOFLINE),
                ("numpy", "reference", False, True, "forward", _ROOFLINE),
            ],
        ),
        pytest.param(
            "--backends torch --valid-lens no --need-weights false --pass forward+backward",
            [
                ("torch", "eager", False, False, "forward+backward", _SDPA),
                ("torch", "eager", False, False, "forward+backward", _TORCH_MHA),
            ],
            marks=pytest.mark.torch,
        ),
    ],
)
def test_the_row_options_time_only_the_rows_asked_for(options, expected):
    backend_module(options.split()[1])
    rows, _, err = _rows_of(options)
    assert sorted(rows) == expected
    # The progress counts the configurations that run
    assert f"[0/{len({row[2:4] for row in expected})}]" in err


@pytest.mark.mxnet
def test_a_mode_runs_only_the_backends_that_have_it():
    backend_module("mxnet")
    options = "--mode hybridized --valid-lens yes --need-weights true --pass forward"
    rows, document, _ = _rows_of(options)
    assert rows == [("mxnet", "hybridized", True, True, "forward", "d2l Gluon MultiHeadAttention")]
    # Backends without that mode are not run, and the report says why
    assert document["skipped"]["numpy"] == "has no hybridized mode (its modes: reference)"


def test_a_row_option_that_a_named_backend_lacks_is_a_usage_error():
    code, _, err = run("--quick", "--backends", "numpy", "--pass", "forward+backward")
    assert code == 2
    assert "--backends numpy: has no forward+backward pass (its passes: forward)" in err
    code, _, err = run("--quick", "--backends", "numpy", "--mode", "hybridized")
    assert code == 2 and "--backends numpy: has no hybridized mode (its modes: reference)" in err
    code, _, err = run("--quick", "--backends", "numpy", "--valid-lens", "maybe")
    assert code == 2 and "--valid-lens" in err


def test_each_backend_times_the_passes_it_is_said_to():
    # BACKEND_PASSES decides which backends a --pass runs: it must say what the calls time
    config = bench.Config(*bench.QUICK_SHAPES[0], valid_lens=False, need_weights=False)
    for name in select_backends(None)[0]:
        backend_module(name)
        for mode in bench.MODES[name]:
            assert tuple(bench._CALLS[name](config, mode)) == bench.BACKEND_PASSES[name]


def _installed(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_a_bad_backend_or_shape_is_a_usage_error():
    code, _, err = run("--quick", "--backends", "nope")
    assert code == 2 and "nope" in err
    code, _, err = run("--quick", "--backends", "numpy", "--shapes", "2,16,30,4")
    assert code == 2 and "B,L,d,h" in err


def test_markdown_table_format():
    config = bench.Config(2, 16, 32, 4, valid_lens=True, need_weights=False)
    result = bench.Result(
        "torch",
        "eager",
        config,
        "forward",
        "SDPA layer",
        1.5,
        3.0,
        0.5,
        1.0,
        2.0,
        6,
        ratio_interval=(0.45, 0.55),
    )
    table = bench.markdown_table([result]).splitlines()
    assert table[1] == "|" + "---|" * 14
    assert table[2] == (
        "| torch | eager | (2, 16, 32, 4) | yes | False | forward | SDPA layer | 1.50 | 3.00 "
        "| 0.500 | 0.450 to 0.550 | faster | 1.0 | 2.0 |"
    )


def _row(backend, builtin, interval, valid_lens=False, repeats=100):
    config = bench.Config(2, 16, 32, 4, valid_lens=valid_lens, need_weights=False)
    ratio = None if interval is None else sum(interval) / 2
    return bench.Result(
        backend,
        "eager",
        config,
        "forward",
        builtin,
        1.0,
        1.0,
        ratio,
        repeats=repeats,
        ratio_interval=interval,
    )


def test_the_verdict_is_where_the_interval_lies_against_the_target():
    # Against a built-in the target is 1.0 (equal times); an interval that holds it, ends
    # included, is a tie
    verdicts = {
        (0.90, 0.99): "faster",
        (0.99, 1.01): "tie",
        (1.00, 1.02): "tie",
        (0.97, 1.00): "tie",
        (1.01, 1.10): "slower",
    }
    for interval, expected in verdicts.items():
        assert _row("torch", "SDPA layer", interval).verdict == expected, interval
    # NumPy's ratio is the fraction of the roofline, and its target half of it: higher is better
    verdicts = {
        (0.55, 0.60): "above half",
        (0.45, 0.55): "tie with half",
        (0.30, 0.40): "below half",
    }
    for interval, expected in verdicts.items():
        assert _row("numpy", bench.ROOFLINE, interval).verdict == expected, interval
    assert _row("torch", "SDPA layer", None).verdict == "-"


def test_no_verdict_is_read_from_fewer_rounds_than_a_95_percent_interval_needs():
    # The whole range of n rounds misses their median when all n lie on one side of it:
    # probability 2 / 2**n, worked by hand: 2/32 = 6.25% for 5 rounds, 2/64 = 3.1% for 6
    assert bench.CONFIDENT_ROUNDS == 6
    for repeats in range(1, 6):
        for interval in ((0.90, 0.95), (0.99, 1.01), (1.05, 1.10)):
            row = _row("torch", "SDPA layer", interval, repeats=repeats)
            assert row.verdict == "too few rounds", (repeats, interval)
        assert _row("numpy", bench.ROOFLINE, (0.55, 0.6), repeats=repeats).verdict == (
            "too few rounds"
        )
    assert _row("torch", "SDPA layer", (0.90, 0.95), repeats=6).verdict == "faster"
    assert _row("torch", "SDPA layer", (1.05, 1.10), repeats=6).verdict == "slower"
    # The full run times every row in at least that many rounds, however short its budget
    assert bench.Budget().min_repeats == 6
    calls = {"mha": lambda: None, "built-in": lambda: None}
    times = bench._interleaved_times(calls, bench.Budget(warmup=0, seconds=0.0))
    assert {name: len(seconds) for name, seconds in times.items()} == dict.fromkeys(calls, 6)


def test_the_summary_counts_each_backends_verdicts():
    rows = [
        _row("numpy", bench.ROOFLINE, (0.55, 0.60)),
        _row("numpy", bench.ROOFLINE, (0.30, 0.40)),
        _row("torch", "SDPA layer", (0.90, 0.95)),
        _row("torch", "nn.MultiheadAttention", (0.90, 0.95)),
        _row("torch", "SDPA layer", (0.99, 1.01)),
        _row("torch", "nn.MultiheadAttention", (1.01, 1.02)),
        _row("tensorflow", "keras MultiHeadAttention", None),
        _row("mxnet", "d2l Gluon MultiHeadAttention", (0.90, 0.95), repeats=3),
        _row("mxnet", "d2l Gluon MultiHeadAttention", (0.90, 0.95)),
    ]
    assert bench.summary(rows) == [
        "numpy, 2 rows against half the roofline: above half 1, tie with half 0, below half 1",
        "torch, 4 rows against the built-ins: faster 2, tie 1, slower 1",
        "tensorflow, 1 row against the built-ins: faster 0, tie 0, slower 0, - 1",
        "mxnet, 2 rows against the built-ins: faster 1, tie 0, slower 0, too few rounds 1",
    ]


def test_a_report_written_before_dtype_and_device_reads_as_float32_on_the_cpu():
    row = _row("torch", "SDPA layer", (0.9, 0.95)).as_dict()
    for key in ("dtype", "device"):
        del row["config"][key]
    result = bench.Result.from_dict(row)
    assert (result.config.dtype, result.config.device) == ("float32", "cpu")


def test_a_saved_report_is_shown_again_without_running(tmp_path):
    path, again = tmp_path / "bench.json", tmp_path / "again.json"
    code, out, _ = run("--quick", "--backends", "numpy", "--output", str(path))
    assert code == 0
    document = json.loads(path.read_text())
    # Each row carries its verdict, and reads back as the same Result
    for row in document["results"]:
        result = bench.Result.from_dict(row)
        assert row["verdict"] == result.verdict
        assert json.loads(json.dumps(result.as_dict())) == row
    code, shown, err = run("--report", str(path), "--output", str(again))
    assert code == 0, err
    assert err == ""  # nothing ran: no progress
    assert shown == out
    assert json.loads(again.read_text()) == document
    assert "numpy, 4 rows against half the roofline:" in shown
    # A 95% interval misses a true tie on the slow side in (1 - 0.95) / 2 = 1/40 of runs:
    # the tables say so, so that one row marked slower among many is timed again first
    assert "slower in 1 run of 40" in shown


# Excerpts of /proc/cpuinfo: an x86 processor with AVX2 but no AVX-512, one with AVX-512
# and its bfloat16 instructions, and an Arm one
_CPUINFO = {
    "avx2": "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx f16c fma avx2 bmi2\n",
    "avx512": "model name\t: Intel Xeon\nflags\t: avx2 avx512f fma avx512_bf16 amx_bf16\n",
    "arm": "processor\t: 0\nFeatures\t: fp asimd sve sve2\nCPU implementer\t: 0x41\n",
}


@pytest.mark.parametrize(
    ("cpuinfo", "name", "extensions"),
    [
        ("avx2", "AMD EPYC", ["avx2", "fma"]),
        ("avx512", "Intel Xeon", ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]),
        ("arm", None, ["sve"]),
        ("", None, []),
    ],
)
def test_the_machine_facts_name_the_processors_vector_extensions(cpuinfo, name, extensions):
    # Two processors of one name can differ in AVX-512, and TensorFlow's bfloat16 kernels
    # round differently on the two: the report says which the figures come from
    text = _CPUINFO.get(cpuinfo, "")
    assert bench._vector_extensions(text) == extensions
    if name is not None:
        assert bench._cpu_name(text) == name


def test_the_printed_tables_name_the_vector_extensions(tmp_path):
    path = tmp_path / "bench.json"
    code, out, _ = run("--quick", "--backends", "numpy", "--output", str(path))
    assert code == 0
    document = json.loads(path.read_text())
    extensions = document["machine"]["vector_extensions"]
    assert extensions == bench._vector_extensions(bench._read_cpuinfo())
    machine_line = next(line for line in out.splitlines() if line.startswith("Machine: "))
    assert all(name in machine_line for name in extensions)
    # A report saved before they were recorded still shows
    del document["machine"]["vector_extensions"]
    path.write_text(json.dumps(document))
    code, shown, err = run("--report", str(path))
    assert code == 0, err
    assert "(vector extensions not recorded)" in shown


def test_a_bad_report_or_a_run_option_with_it_is_a_usage_error(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    code, _, err = run("--report", str(path))
    assert code == 2 and "not a report written by `mha bench --output`" in err
    code, _, err = run("--report", str(tmp_path / "missing.json"))
    assert code == 2 and "missing.json" in err
    code, _, err = run("--report", str(path), "--quick", "--backends", "numpy")
    assert code == 2 and "runs nothing: drop --backends, --quick" in err
    code, _, err = run("--report", str(path), "--seconds", "0")
    assert code == 2 and "drop --seconds" in err
    code, _, err = run("--report", str(path), "--valid-lens", "no", "--pass", "forward")
    assert code == 2 and "drop --valid-lens, --pass" in err


def test_the_ratio_interval_is_the_median_confidence_interval_by_ranks():
    # The textbook distribution-free 95% interval of a median of 100 values is from the 40th
    # to the 61st smallest (binomial tables); of 10 values from the 2nd to the 9th (it holds
    # the median with probability 1 - 2 x 11/1024); of 5 values the whole range
    ours = [float(rank) for rank in (17, 3, 88, 100, 40, 61, 1, 59)] + [
        float(rank) for rank in range(1, 101) if rank not in (17, 3, 88, 100, 40, 61, 1, 59)
    ]
    assert bench.paired_ratio_interval(ours, [1.0] * 100) == (40.0, 61.0)
    assert bench.paired_ratio_interval([float(r) for r in range(10, 0, -1)], [1.0] * 10) == (
        2.0,
        9.0,
    )
    assert bench.paired_ratio_interval([3.0, 1.0, 5.0, 2.0, 4.0], [1.0] * 5) == (1.0, 5.0)
    # 8 values: the 2nd to the 7th would hold it with probability 1 - 2 x 9/256 < 95%; 9 values:
    # the 2nd to the 8th, 1 - 2 x 10/512
    assert bench.paired_ratio_interval([float(r) for r in range(1, 9)], [1.0] * 8) == (1.0, 8.0)
    assert bench.paired_ratio_interval([float(r) for r in range(1, 10)], [1.0] * 9) == (2.0, 8.0)
    # Pairs are divided round by round: a slow round on both sides is no outlier
    assert bench.paired_ratio_interval([2.0, 20.0, 4.0], [1.0, 10.0, 2.0]) == (2.0, 2.0)


@pytest.mark.parametrize("count", [3, 4])
def test_each_call_comes_after_each_other_equally_often(count):
    # A call's time depends on the call before it: across the whole sequence, the last call of
    # a round before the first of the next included, every ordered pair of two different calls
    # is adjacent equally often and no call follows itself; every call runs once per round and
    # in each place of a round equally often. Two cycles of every order.
    names = "abcd"[:count]
    cycle = math.factorial(count)
    sequence = []
    calls = {name: (lambda name=name: sequence.append(name)) for name in names}
    budget = bench.Budget(warmup=0, min_repeats=2 * cycle, max_repeats=2 * cycle, seconds=0.0)
    times = bench._interleaved_times(calls, budget)
    assert {name: len(seconds) for name, seconds in times.items()} == dict.fromkeys(
        names, 2 * cycle
    )
    rounds = [sequence[start : start + count] for start in range(0, len(sequence), count)]
    assert all(sorted(order) == list(names) for order in rounds)
    places = collections.Counter(
        (place, name) for order in rounds for place, name in enumerate(order)
    )
    assert len(places) == count * count and set(places.values()) == {2 * cycle // count}
    # The sequence repeats: its last call comes before its first
    pairs = collections.Counter(itertools.pairwise([*sequence, sequence[0]]))
    assert all(before != after for before, after in pairs)
    assert len(pairs) == count * (count - 1) and len(set(pairs.values())) == 1


def test_two_calls_each_follow_themselves_as_often_as_each_other():
    # Two calls cannot avoid a call right after itself (or one call always opening the
    # round): each follows itself once in two rounds, and the other once
    sequence = []
    calls = {name: (lambda name=name: sequence.append(name)) for name in "ab"}
    budget = bench.Budget(warmup=0, min_repeats=8, max_repeats=8, seconds=0.0)
    bench._interleaved_times(calls, budget)
    pairs = collections.Counter(itertools.pairwise([*sequence, sequence[0]]))
    assert pairs == {("a", "b"): 4, ("b", "a"): 4, ("a", "a"): 4, ("b", "b"): 4}


@pytest.mark.mxnet
@pytest.mark.parametrize("hybridize", [False, True])
def test_the_books_gluon_block_computes_what_mha_computes(hybridize):
    # The MXNet baseline is only fair if it does the same work: same outputs, and hybridized
    # with need_weights=True the same weights, handed out as a second output.
    import numpy as np

    import mha

    MX = backend_module("mxnet")
    mx = MX.mx
    config = bench.Config(2, 6, 8, 2, valid_lens=True, need_weights=True)
    X_np, lens_np = bench._inputs(config)
    weights = bench._weights(config)
    theirs = bench._d2l_gluon_attention(mx, 8, 2, return_weights=True)
    for name in "qkvo":
        getattr(theirs, f"W_{name}").weight.set_data(mx.np.array(weights[f"W_{name}"].T))
    ours = MX.MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8)
    mha.set_weights(ours, weights)
    if hybridize:
        ours.hybridize()
        theirs.hybridize()
    X = mx.np.array(X_np)
    lengths = mx.np.array(np.repeat(lens_np[:, None], 6, axis=1).astype("int32"))
    output, their_weights = theirs(X, X, X, lengths)
    expected = ours(X, X, X, mx.np.array(lens_np))
    np.testing.assert_allclose(output.asnumpy(), expected.asnumpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        their_weights.asnumpy().reshape(2, 2, 6, 6),
        ours.attention_weights.asnumpy(),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("torch", marks=pytest.mark.torch),
        pytest.param("tensorflow", marks=pytest.mark.tensorflow),
    ],
)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_timed_layer_computes_what_mha_computes(backend, need_weights, dtype):
    # A ratio is only fair between layers that do the same work: the built-ins hold mha's
    # weights and make their masks from the same valid_lens inside the timed call, so every
    # timed forward call returns mha's output, up to rounding
    module = backend_module(backend)
    config = bench.Config(3, 10, 8, 2, True, need_weights, dtype)
    calls = bench._CALLS[backend](config, bench.MODES[backend][0])["forward"]
    assert len(calls) == (2 if need_weights or backend == "tensorflow" else 3)
    outputs = {name: module.to_numpy(call()) for name, call in calls.items()}
    assert {output.dtype.name for output in outputs.values()} == {dtype}
    X, lens = bench._inputs(config)
    assert lens.min() < 10  # some keys are masked
    # Each against the float64 NumPy layer on the same inputs and weights, rounded to the
    # dtype as the timed layers hold them, relative to the output's scale: the harness's
    # tolerances, and for bfloat16, which the harness does not compare, two of its epsilons
    # (2**-7), as the harness's float16 one is about two of float16's. Two layers that round
    # their intermediates apart may differ by about an epsilon: without AVX-512, TensorFlow's
    # bfloat16 kernels put mha and Keras one epsilon apart, each within 1.3 epsilons of the
    # exact output.
    from mha.backends import numpy as reference
    from mha.weights import numpy_dtype

    exact_layer = reference.MultiHeadAttention(8, 2, dtype="float64")
    weights = bench._weights(config)
    mha.set_weights(exact_layer, {name: w.astype(np.float64) for name, w in weights.items()})
    X = X.astype(numpy_dtype(dtype)).astype(np.float64)
    expected = exact_layer(X, X, X, lens)
    tolerance = harness.TOLERANCES.get(dtype, 2 * 2**-7)
    for name, output in outputs.items():
        assert harness.difference(output, expected, relative=True) <= tolerance, name


def test_page_faults_are_counted_per_call():
    # A call that writes 256 MiB of fresh memory faults in at least 128 pages (65536 of 4 KiB,
    # or 128 huge pages of 2 MiB); a call that allocates nothing faults in (almost) none.
    if bench.resource is None:
        pytest.skip("this platform does not count page faults")
    calls = {"fresh": lambda: np.ones(2**26, dtype=np.float32), "nothing": lambda: None}
    faults = {}
    budget = bench.Budget(warmup=1, min_repeats=3, max_repeats=3, seconds=0.0)
    times = bench._interleaved_times(calls, budget, faults)
    assert {name: len(counts) for name, counts in faults.items()} == {"fresh": 3, "nothing": 3}
    assert len(times["fresh"]) == 3
    assert min(faults["fresh"]) >= 128
    assert statistics.median(faults["nothing"]) < 128


# Allocates and frees a 24 MiB buffer four times, in a fresh process, and prints the page
# faults of each: below glibc's largest mmap threshold (32 MiB), above its starting one
_REUSE = """
import resource, sys
import numpy as np
from mha import bench
print(bench.steady_allocator(fix=sys.argv[1] == "fix"))
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = np.ones(6 * 2**20, dtype=np.float32)
    del buffer
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def _allocator_and_faults(script: str, environment: dict, *arguments: str):
    """Run one of the scripts above in a fresh process: what steady_allocator said, and the
    page faults of each allocation."""
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *arguments],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
    )
    said, counts = completed.stdout.splitlines()
    return said, [int(count) for count in counts.split()]


def test_the_bench_fixes_mallocs_thresholds_so_a_freed_buffer_is_reused():
    # With glibc's dynamic thresholds, the first 24 MiB buffer is mmap-ed and unmapped, the
    # threshold rises past it, and the second faults in fresh heap pages; with the thresholds
    # fixed, the first comes from the heap and stays there for every later one.
    if platform.libc_ver()[0] != "glibc" or bench.resource is None:
        pytest.skip("glibc's malloc thresholds only: this platform's allocator is left alone")
    environment = {k: v for k, v in os.environ.items() if k not in bench.STEADY_MALLOC}
    said, faults = {}, {}
    for how in ("fix", "leave"):
        said[how], faults[how] = _allocator_and_faults(_REUSE, environment, how)
    assert said["fix"].startswith("fixed by mha bench: MALLOC_MMAP_THRESHOLD_=33554432")
    assert said["leave"] == bench.MALLOC_DEFAULTS
    # 24 MiB is 6144 pages of 4 KiB, or 12 huge pages of 2 MiB
    assert min(faults["fix"][0], faults["leave"][0], faults["leave"][1]) >= 12
    assert max(faults["fix"][1:]) < 12


# In a thread of its own, holds two 24 MiB buffers, then allocates and frees a third four
# times, in a fresh process, and prints the page faults of each: a thread's arena grows in heaps
# of 64 MiB, so the third lies in a second heap
_THREAD_REUSE = """
import resource, threading
import numpy as np
from mha import bench
print(bench.steady_allocator())
faults = []
def work():
    kept = [np.ones(6 * 2**20, dtype=np.float32) for _ in range(2)]
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = np.ones(6 * 2**20, dtype=np.float32)
        del buffer
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(*faults)
"""


def test_the_bench_keeps_one_arena_so_a_buffer_freed_in_a_thread_is_reused():
    # glibc unmaps a thread arena's extra heap as soon as it is free, whatever the thresholds:
    # with the thresholds alone fixed (set from the environment, which steady_allocator leaves
    # as it is), the third buffer is fresh pages every time; with one arena it is reused.
    if platform.libc_ver()[0] != "glibc" or bench.resource is None:
        pytest.skip("glibc's malloc arenas only: this platform's allocator is left alone")
    environment = {k: v for k, v in os.environ.items() if k not in bench.STEADY_MALLOC}
    thresholds_only = {
        **environment,
        "MALLOC_MMAP_THRESHOLD_": str(bench.STEADY_MALLOC["MALLOC_MMAP_THRESHOLD_"]),
        "MALLOC_TRIM_THRESHOLD_": str(bench.STEADY_MALLOC["MALLOC_TRIM_THRESHOLD_"]),
    }
    said, faults = {}, {}
    for how, env in (("fixed", environment), ("thresholds only", thresholds_only)):
        said[how], faults[how] = _allocator_and_faults(_THREAD_REUSE, env)
    assert said["fixed"].endswith("MALLOC_ARENA_MAX=1")
    assert said["thresholds only"].startswith("set from the environment")
    # 24 MiB is 6144 pages of 4 KiB, or 12 huge pages of 2 MiB
    assert min(faults["thresholds only"]) >= 12
    assert max(faults["fixed"][1:]) < 12


# Runs `mha bench --quick` in a fresh process up to the timing, and prints which of the
# frameworks named in its arguments were imported when the allocator was fixed and when the
# timing began
_ORDER = """
import json, sys
from mha import bench, cli
def imported():
    return [name for name in sys.argv[1:] if name in sys.modules]
seen, steady_allocator = {}, bench.steady_allocator
def fix_allocator(**options):
    seen["allocator fixed"] = imported()
    return steady_allocator(**options)
class Stop(Exception):
    pass
def time_layers(*arguments, **options):
    seen["timing began"] = imported()
    raise Stop
bench.steady_allocator, bench.run = fix_allocator, time_layers
try:
    cli.main(["bench", "--quick"])
except Stop:
    pass
print(json.dumps(seen))
"""


def test_the_bench_fixes_the_allocator_before_any_framework_is_imported():
    # A thread keeps the arena it first allocated in, and frameworks start threads when they
    # are imported: fixed any later, the arenas of those threads would stay as they were
    # (numpy is imported by mha itself, and starts no thread that allocates)
    frameworks = [FRAMEWORKS[name] for name in mha.available_backends() if name != "numpy"]
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_ORDER), *frameworks],
        capture_output=True,
        text=True,
        check=True,
    )
    seen = json.loads(completed.stdout.splitlines()[-1])
    assert seen["allocator fixed"] == []
    # and every framework installed here was imported by the time the timing began
    assert seen["timing began"] == frameworks


def test_the_report_says_what_malloc_did(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    code, out, err = run("--quick", "--backends", "numpy")
    assert code == 0, err
    assert "malloc: set from the environment: MALLOC_TRIM_THRESHOLD_=1000" in out.splitlines()
    if platform.libc_ver()[0] != "glibc":
        return  # the rest is about glibc's thresholds
    # Fixed unless --malloc-defaults, each in a fresh process (once fixed, they stay fixed)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    command = [sys.executable, "-m", "mha", "bench", "--quick", "--backends", "numpy", "--json"]
    said = {}
    for option in ("--malloc-defaults", None):
        completed = subprocess.run(
            [*command, option] if option else command, capture_output=True, text=True, check=True
        )
        said[option] = json.loads(completed.stdout)["machine"]["malloc"]
    assert said["--malloc-defaults"] == bench.MALLOC_DEFAULTS
    assert said[None].startswith("fixed by mha bench: MALLOC_MMAP_THRESHOLD_=33554432")
