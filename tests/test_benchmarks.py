"""The benchmark runner: quick runs give rows with ratios and intervals, the options select
rows, reports round-trip, and the built-ins timed against mha compute what mha computes.

No timing is asserted: the numbers depend on the machine and its load.
"""

import dataclasses
import importlib.util
import io
import json
import os

import numpy as np
import pytest

import mha
from conftest import backend_module
from mha import bench, bench_config, bench_frameworks, cli, harness
from mha.registry import select_backends

pytestmark = pytest.mark.numpy


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["bench", *argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _installed(name):
    return importlib.util.find_spec(name) is not None


def _quick_rows(*options):
    """The JSON report of a quick run, and its progress."""
    code, out, err = run("--quick", "--json", *options)
    assert code == 0, err
    return json.loads(out), err


def _key(row):
    config = row["config"]
    return (row["backend"], row["mode"], config["valid_lens"], config["need_weights"])


def test_a_quick_run_prints_a_markdown_table_a_summary_and_progress():
    code, out, err = run("--quick", "--backends", "numpy")
    assert code == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("| backend |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert columns == [
        "backend", "mode", "(B, L, d, h[, kv])", "valid_lens", "need_weights", "pass", "built-in",
        "mha ms", "built-in ms", "ratio", "95% interval", "rounds", "mha TFLOP/s",
    ]  # fmt: skip
    rows = [line for line in lines if line.startswith("| numpy |")]
    assert len(rows) == 4  # valid_lens x need_weights on one shape, forward only
    assert all(len(row.strip("|").split("|")) == len(columns) for row in rows)
    assert all("| matmul roofline |" in row for row in rows)
    assert any(line.startswith("Machine: ") and "load average" in line for line in lines)
    assert "numpy: 4 rows, ratio to the roofline" in out
    # 3 rounds give no verdict: no row is called slower
    assert "A smoke run: rows of 3 rounds show that every layer runs and give no verdict" in out
    assert "rows above" not in out
    assert "[0/4]" in err and "[4/4] done" in err  # progress goes to stderr only
    assert "[0/4]" not in out
    # Each row is printed to stderr as soon as it is measured, before the table
    measured = [line for line in err.splitlines() if "against matmul roofline: " in line]
    assert len(measured) == 4 and all("TFLOP/s" in line for line in measured)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_each_row_replaces_the_progress_line():
    # The progress line is rewritten in place without a newline: a row printed after it
    # erases it first, so that no row is glued onto "[k/n] ..."
    out, err = io.StringIO(), _Terminal()
    assert cli.main(["bench", "--quick", "--backends", "numpy"], out=out, err=err) == 0
    lines = err.getvalue().split("\n")
    rows = [line for line in lines if "against matmul roofline: " in line]
    assert len(rows) == 4
    for line in rows:
        # What the terminal shows is the text after the last erase: the row alone
        shown = line.split("\r\x1b[K")[-1]
        assert shown.startswith("  numpy reference ")


@pytest.mark.slow
def test_every_installed_backend_gives_rows_with_ratios_and_intervals(tmp_path):
    path = tmp_path / "bench.json"
    document, _ = _quick_rows("--output", str(path))
    assert json.loads(path.read_text()) == document
    names, skipped = select_backends(None)
    for name, reason in skipped.items():
        assert "not available" in reason, name
    # A backend not installed, or without a BENCHES entry, is skipped with the reason
    for name in [name for name in names if name not in bench.BENCHES]:
        names.remove(name)
        skipped[name] = "has no entry in mha.bench.BENCHES"
    assert document["skipped"] == skipped
    rows = document["results"]
    assert {row["backend"] for row in rows} == set(names)
    for name in names:
        entry = bench.BENCHES[name]
        # Every mode, valid_lens x need_weights, and each of the backend's passes
        assert {_key(row) for row in rows if row["backend"] == name} == {
            (name, mode, lens, weights)
            for mode in entry.modes
            for lens in (False, True)
            for weights in (False, True)
        }
        assert {row["pass"] for row in rows if row["backend"] == name} == set(entry.passes)
    for row in rows:
        low, high = row["interval"]
        assert row["rounds"] == bench.QUICK_BUDGET.min_rounds
        assert row["mha_ms"] > 0 and row["builtin_ms"] > 0
        assert 0 < low <= row["ratio"] <= high
        assert row["config"]["dtype"] == "float32" and row["config"]["device"] == "cpu"
    machine = document["machine"]
    assert machine["cpu_count"] >= 1 and machine["matmul_roofline_gflops"] > 0
    assert len(machine["load_average_start"]) == len(machine["load_average_end"]) == 3
    assert machine["budget"] == {"warmup": 1, "min_rounds": 3, "max_rounds": 3, "seconds": 0.0}


@pytest.mark.torch
def test_torch_rows_compare_with_both_builtins():
    backend_module("torch")
    results, _ = bench.run(["torch"], bench.QUICK_SHAPES, bench.QUICK_BUDGET)
    builtins = {(r.config.need_weights, r.pass_, r.builtin) for r in results}
    assert builtins == {
        (weights, pass_, builtin)
        for pass_ in bench.PASSES
        for weights, builtin in (
            (True, "nn.MultiheadAttention"),
            (False, "nn.MultiheadAttention"),
            (False, "SDPA layer"),  # SDPA cannot return weights
        )
    }
    assert len(results) == 12


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
        pytest.param(
            "--backends numpy,torch --need-weights true --valid-lens yes --pass forward",
            [
                ("numpy", "reference", True, True, "forward", _ROOFLINE),
                ("torch", "eager", True, True, "forward", _TORCH_MHA),
            ],
            marks=pytest.mark.torch,
        ),
    ],
)
def test_the_row_options_time_only_the_rows_asked_for(options, expected):
    for name in options.split()[1].split(","):
        backend_module(name)
    document, err = _quick_rows(*options.split())
    rows = [(*_key(row), row["pass"], row["builtin"]) for row in document["results"]]
    assert sorted(rows) == expected
    # The progress counts the configurations that run
    assert f"[0/{len({row[:4] for row in expected})}]" in err


def test_shapes_choose_the_configurations():
    document, _ = _quick_rows("--backends", "numpy", "--shapes", "1,8,16,2;2,4,8,4")
    shapes = [row["config"] for row in document["results"]]
    assert {(c["batch_size"], c["length"], c["num_hiddens"], c["num_heads"]) for c in shapes} == {
        (1, 8, 16, 2),
        (2, 4, 8, 4),
    }
    assert len(shapes) == 8


def test_a_mode_runs_only_its_rows_and_seconds_set_the_budget(monkeypatch):
    # Without MXNet no backend has two modes: numpy is given a second here, its calls the same
    two = dataclasses.replace(bench.BENCHES["numpy"], modes=("reference", "other"))
    monkeypatch.setitem(bench.BENCHES, "numpy", two)
    budgets = []
    original = bench.interleaved_times

    def spy(calls, budget):
        budgets.append(budget)
        return original(calls, budget)

    monkeypatch.setattr(bench, "interleaved_times", spy)
    options = ("--backends", "numpy", "--mode", "other", "--seconds", "0.25")
    document, _ = _quick_rows(*options, "--valid-lens", "no", "--need-weights", "true")
    rows = [(*_key(row), row["pass"]) for row in document["results"]]
    assert rows == [("numpy", "other", False, True, "forward")]
    # The rounds ran with the budget asked for, past --quick's 3, and the report says so
    assert budgets and {b.seconds for b in budgets if b.min_rounds == 3} == {0.25}
    assert document["machine"]["budget"]["seconds"] == 0.25
    assert document["results"][0]["rounds"] > 3


def test_shapes_of_decoding_steps_and_of_whole_sequences_mix():
    # numpy has no decoding rows: of the two shapes it times the one without a cache
    document, _ = _quick_rows("--backends", "numpy", "--shapes", "1,8,16,2;1,1,8,2+4")
    configs = {(c["batch_size"], c["length"], c["num_hiddens"], c["num_heads"], c["cached"])
               for c in (row["config"] for row in document["results"])}  # fmt: skip
    assert configs == {(1, 8, 16, 2, 0)}
    assert len(document["results"]) == 4


@pytest.mark.mxnet
def test_a_mode_runs_only_the_backends_that_have_it():
    backend_module("mxnet")
    options = "--mode hybridized --valid-lens yes --need-weights true --pass forward"
    document, _ = _quick_rows(*options.split())
    rows = [(*_key(row), row["pass"], row["builtin"]) for row in document["results"]]
    assert rows == [("mxnet", "hybridized", True, True, "forward", "d2l Gluon MultiHeadAttention")]
    # Backends without that mode are not run, and the report says why
    assert document["skipped"]["numpy"] == "has no hybridized mode (its modes: reference)"


@pytest.mark.torch
@pytest.mark.tensorflow
def test_a_bfloat16_run_times_torch_tensorflow_and_jax_and_skips_the_others():
    backend_module("torch")
    backend_module("tensorflow")
    backend_module("jax")
    document, _ = _quick_rows("--dtype", "bfloat16", "--pass", "forward", "--valid-lens", "yes")
    rows = document["results"]
    assert {row["backend"] for row in rows} == {"torch", "tensorflow", "jax"}
    assert {(row["config"]["dtype"], row["config"]["device"]) for row in rows} == {
        ("bfloat16", "cpu")
    }
    skipped = document["skipped"]
    assert skipped["numpy"] == "benchmarked in float32 on the CPU only"
    if _installed("mxnet"):
        assert skipped["mxnet"] == "benchmarked in float32 on the CPU only"
    else:
        assert "not available" in skipped["mxnet"]


def test_usage_errors_exit_2_with_the_reason(monkeypatch):
    cases = {
        ("--backends", "nope"): "Unknown mha backend",
        ("--backends", "numpy", "--pass", "forward+backward"): (
            "--backends numpy: has no forward+backward pass (its passes: forward)"
        ),
        ("--backends", "numpy", "--mode", "hybridized"): (
            "--backends numpy: has no hybridized mode (its modes: reference)"
        ),
        ("--backends", "numpy", "--dtype", "bfloat16"): (
            "--backends numpy: benchmarked in float32 on the CPU only"
        ),
        ("--backends", "numpy", "--shapes", "2,16,30,4"): "B,L,d,h",
        ("--backends", "numpy", "--shapes", "2,16,x,4"): "B,L,d,h",
        ("--backends", "numpy", "--shapes", "2,16,32,4,3"): "B,L,d,h",  # 3 kv heads of 4
        ("--backends", "numpy", "--shapes", "2,0,32,4"): "B,L,d,h",
        ("--backends", "numpy", "--shapes", "2,16,32,\u00b2"): "B,L,d,h",  # '²'.isdigit()
        ("--backends", "numpy", "--shapes", ""): "B,L,d,h",
        ("--backends", ""): "--backends names no backend",
        ("--backends", "numpy", "--valid-lens", "maybe"): "--valid-lens",
        ("--backends", "numpy", "--memory-scaling"): "unrecognized arguments",
        ("--backends", "numpy", "--seconds", "0"): "expected a number above 0",
        ("--backends", "numpy", "--seconds", "nan"): "expected a finite number",
    }
    if _installed("jax"):
        cases["--backends", "jax", "--dtype", "float16"] = (
            "--backends jax: benchmarked in float16 on a GPU only: Flax's attention"
        )
    for argv, message in cases.items():
        code, out, err = run("--quick", *argv)
        assert code == 2 and message in err, (argv, err)
        assert out == ""
    # Where no framework sees a GPU (made so here, whatever the machine), --device gpu has
    # nothing to run, and says why for each backend
    for name in ("torch", "tensorflow"):
        blind = dataclasses.replace(bench.BENCHES[name], gpu=lambda: False)
        monkeypatch.setitem(bench.BENCHES, name, blind)
    code, _, err = run("--quick", "--device", "gpu")
    assert code == 2 and "no backend has the rows asked for" in err
    assert "numpy: benchmarked in float32 on the CPU only" in err
    if _installed("torch"):
        assert "torch: torch sees no GPU" in err
    if _installed("tensorflow"):
        assert "tensorflow: TensorFlow sees no GPU" in err


@pytest.mark.torch
def test_options_that_leave_no_row_to_measure_are_a_usage_error():
    # A decoding step is timed forward only: nothing of forward+backward to time
    argv = ("--backends", "torch", "--shapes", "2,1,32,4+8", "--pass", "forward+backward")
    code, out, err = run(*argv, "--seconds", "0.1")
    assert code == 2 and out == "" and "no row was measured" in err


def test_a_named_backend_that_is_not_installed_is_a_usage_error(monkeypatch):
    from mha import registry

    failure = registry.BackendUnavailableError("mxnet", "not here")
    monkeypatch.setitem(registry._failures, "mxnet", failure)
    monkeypatch.delitem(registry._loaded, "mxnet", raising=False)
    code, _, err = run("--quick", "--backends", "mxnet")
    assert code == 2 and "The mha backend 'mxnet' is not available (not here)" in err


def test_each_backend_times_the_passes_and_modes_it_is_said_to():
    # BENCHES decides which backends a --pass or --mode runs: it must say what the calls time
    config = bench.Config(*bench.QUICK_SHAPES[0], valid_lens=False, need_weights=False)
    for name in [name for name in select_backends(None)[0] if name in bench.BENCHES]:
        for mode in bench.BENCHES[name].modes:
            calls = bench.BENCHES[name].calls(config, mode)
            assert tuple(calls) == bench.BENCHES[name].passes
            assert all(next(iter(by_name)) == "mha" for by_name in calls.values())


def test_a_saved_report_is_shown_again_without_running(tmp_path):
    path, again = tmp_path / "bench.json", tmp_path / "again.json"
    code, out, _ = run("--quick", "--backends", "numpy", "--output", str(path))
    assert code == 0
    document = json.loads(path.read_text())
    for row in document["results"]:
        assert json.loads(json.dumps(bench.Result.from_dict(row).as_dict())) == row
    code, shown, err = run("--report", str(path), "--output", str(again))
    assert code == 0, err
    assert err == ""  # nothing ran: no progress
    assert shown == out
    assert json.loads(again.read_text()) == document
    code, shown, _ = run("--report", str(path), "--json")
    assert code == 0 and json.loads(shown) == document


def test_a_report_that_cannot_be_written_exits_1(tmp_path, monkeypatch):
    from mha import files

    def full_disk(path, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(files, "write_atomically", full_disk)
    path = tmp_path / "bench.json"
    code, out, err = run("--quick", "--backends", "numpy", "--output", str(path))
    assert code == 1
    assert "mha bench: error:" in err and "No space left on device" in err
    assert not path.exists()
    # The run is printed before the file is written: a failed write loses none of it
    assert "| backend | mode |" in out and "rows, ratio to the roofline" in out


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="a folder no file can be made in")
def test_an_output_in_a_folder_that_takes_no_file_is_refused_before_the_run():
    # /proc refuses new files even to root, whom a folder's permissions do not stop
    code, out, err = run("--quick", "--backends", "numpy", "--output", "/proc/bench.json")
    assert code == 2 and "cannot write /proc/bench.json" in err
    assert out == "" and "[0/" not in err  # nothing ran


def test_a_bad_report_or_a_run_option_with_it_is_a_usage_error(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    code, _, err = run("--report", str(path))
    assert code == 2 and "not a report written by `mha bench --output`" in err
    code, _, err = run("--report", str(tmp_path / "missing.json"))
    assert code == 2 and "missing.json" in err
    path.write_text('{"results": [], "results": []}')  # the last would silently win
    code, _, err = run("--report", str(path))
    assert code == 2 and "'results' more than once" in err
    # A binary file: one short line (the decoder's error held every byte of it)
    path.write_bytes(bytes(range(128, 256)) * 512)
    code, _, err = run("--report", str(path))
    assert code == 2 and "is not UTF-8 text" in err and len(err) < 400, len(err)
    code, _, err = run("--report", str(tmp_path))
    assert code == 2 and "is not a regular file" in err
    code, _, err = run("--report", str(path), "--quick", "--backends", "numpy")
    assert code == 2 and "runs nothing: drop --backends, --quick" in err
    code, _, err = run("--report", str(path), "--valid-lens", "no", "--pass", "forward")
    assert code == 2 and "drop --valid-lens, --pass" in err
    # A budget is a run's option too (0 is none: --seconds takes a number above 0)
    code, _, err = run("--report", str(path), "--seconds", "0.5")
    assert code == 2 and "drop --seconds" in err
    code, _, err = run("--report", str(path), "--seconds", "0")
    assert code == 2 and "expected a number above 0" in err
    # Valid JSON with the rows' fields but not the machine's or an empty interval: refused
    # before anything is printed
    code, _, _ = run("--quick", "--backends", "numpy", "--output", str(path))
    document = json.loads(path.read_text())
    broken = [
        {**document, "machine": {}},
        {**document, "results": [{**document["results"][0], "interval": [1.0]}]},
        {**document, "results": [{**document["results"][0], "mha_ms": "fast"}]},
    ]
    for report in broken:
        path.write_text(json.dumps(report))
        code, out, err = run("--report", str(path))
        assert (code, out) == (2, "") and "not a report written by" in err, err


def test_markdown_table_and_summary():
    config = bench.Config(2, 16, 32, 4, valid_lens=True, need_weights=False)
    rows = [
        bench.Result("torch", "eager", config, "forward", "SDPA layer", 1.5, 3.0, 0.5,
                     (0.45, 0.55), 6),
        bench.Result("torch", "eager", config, "forward+backward", "SDPA layer", 3.3, 3.0, 1.1234,
                     (1.05, 1.2), 6),
    ]  # fmt: skip
    table = bench.markdown_table(rows).splitlines()
    assert table[1] == "|" + "---|" * 13
    # 2 x (4 projections of 2 x 16 x 32 x 32 and 2 products of 2 x 16 x 16 x 32) multiply-adds
    # = 327680 FLOPs in 1.5 ms, and three times that forward and backward in 3.3 ms
    assert table[2] == (
        "| torch | eager | (2, 16, 32, 4) | yes | False | forward | SDPA layer | 1.50 | 3.00 "
        "| 0.500 | 0.450 to 0.550 | 6 | 0.000218 |"
    )
    assert table[3].endswith("| 6 | 0.000298 |")
    assert bench.summary(rows) == [
        "torch: 2 rows, ratio to the built-ins 0.500 to 1.123",
        "rows above 1.10 against a built-in: 1",
        "  torch eager (2, 16, 32, 4) valid_lens=True need_weights=False forward+backward "
        "against SDPA layer: 1.123",
    ]
    # Fewer rounds than a full run's least: a smoke run, no row listed as slower
    smoke = [dataclasses.replace(row, rounds=3) for row in rows]
    assert bench.summary(smoke)[1].startswith("A smoke run: rows of 3 rounds")
    assert len(bench.summary(smoke)) == 2
    assert bench.summary(smoke, min_rounds=3)[1].startswith("A smoke run")  # --quick's budget
    # A saved run judged by its own budget: rows of 5 rounds where its least was 5
    saved = [dataclasses.replace(row, rounds=5) for row in rows]
    assert bench.summary(saved, min_rounds=5)[1] == "rows above 1.10 against a built-in: 1"
    assert bench.summary(saved)[1].startswith("A smoke run")


def test_a_rows_ratio_is_the_median_of_mhas_time_over_the_builtins_round_by_round():
    # Three rounds, in seconds: mha 2, 4, 30 and the built-in 1, 1, 3, so the rounds' ratios
    # are 2, 4 and 10, their median 4 (their mean would be 5.33, the inverse ratios' median
    # 0.25); the medians of the times are 4 s and 1 s; 3 rounds' interval is the whole range
    config = bench.Config(2, 16, 32, 4, valid_lens=False, need_weights=True)
    times = {"mha": [2.0, 4.0, 30.0], "SDPA layer": [1.0, 1.0, 3.0]}
    (row,) = bench._rows("torch", "eager", config, "forward", times)
    assert (row.backend, row.mode, row.pass_, row.builtin) == (
        "torch", "eager", "forward", "SDPA layer",
    )  # fmt: skip
    assert row.ratio == pytest.approx(4.0)
    assert (row.mha_ms, row.builtin_ms) == (pytest.approx(4000.0), pytest.approx(1000.0))
    assert row.interval == (pytest.approx(2.0), pytest.approx(10.0))
    assert row.rounds == 3
    # numpy's rows: against the time its FLOPs take at the rate of the 1024 x 1024 x 1024
    # product timed in the same round (2 * 1024**3 FLOPs); this config's forward is 327680
    # FLOPs (test_markdown_table_and_summary), so at 2 * 1024**3 FLOP/s it takes 327680 / (2 *
    # 1024**3) s, and mha taking 4 times that has the ratio 4
    product = 1.0  # seconds of the product: 2 * 1024**3 FLOP/s
    forward = 327680 / (2 * 1024**3)
    times = {"mha": [4 * forward] * 3, bench.ROOFLINE: [product] * 3}
    (row,) = bench._rows("numpy", "reference", config, "forward", times)
    assert row.builtin == "matmul roofline"
    assert row.ratio == pytest.approx(4.0)
    assert row.builtin_ms == pytest.approx(forward * 1e3)


def test_the_summary_gives_each_backend_its_own_range_and_lists_no_roofline_row():
    # Full runs (6 rounds): numpy's only row is 2.5 times the roofline's time, which is no
    # built-in, so not a row above the bar; torch's rows are 0.9 and 1.2, JAX's 1.05
    config = bench.Config(2, 16, 32, 4, valid_lens=False, need_weights=True)

    def row(backend, builtin, ratio):
        return bench.Result(backend, "eager", config, "forward", builtin, 1.0, 1.0, ratio,
                            (ratio - 0.01, ratio + 0.01), 6)  # fmt: skip

    rows = [
        row("numpy", bench.ROOFLINE, 2.5),
        row("torch", "SDPA layer", 0.9),
        row("torch", "torch.nn.MultiheadAttention", 1.2),
        row("jax", "flax.nnx.MultiHeadAttention", 1.05),
    ]
    lines = bench.summary(rows)
    assert lines[:3] == [
        "numpy: 1 rows, ratio to the roofline 2.500 to 2.500",
        "torch: 2 rows, ratio to the built-ins 0.900 to 1.200",
        "jax: 1 rows, ratio to the built-ins 1.050 to 1.050",
    ]
    assert lines[3] == "rows above 1.10 against a built-in: 1"
    assert len(lines) == 5 and "against torch.nn.MultiheadAttention: 1.200" in lines[4]


def test_the_summary_range_leaves_out_the_layer_without_a_cache():
    # A decoding row against nn.MultiheadAttention, which projects every cached position in
    # each call, is more work than mha's step: its 0.3 is no measure of mha's speed
    config = bench.Config(1, 1, 512, 8, valid_lens=False, need_weights=True, cached=512)

    def row(builtin, ratio):
        return bench.Result("torch", "eager", config, "forward", builtin, 1.0, 1.0, ratio,
                            (ratio - 0.01, ratio + 0.01), 6)  # fmt: skip

    rows = [row(bench_frameworks.NO_CACHE, 0.3), row("SDPA layer with the cache", 1.04)]
    assert bench.summary(rows)[0] == (
        "torch: 2 rows, ratio to the built-ins 1.040 to 1.040 "
        "(1 against nn.MultiheadAttention (no cache) aside)"
    )


def test_the_interval_is_the_median_confidence_interval_by_ranks():
    # The textbook distribution-free 95% interval of a median of 100 values is from the 40th
    # to the 61st smallest (binomial tables); of 10 values from the 2nd to the 9th; of 8 or
    # fewer values the whole range
    shuffled = np.random.default_rng(0).permutation(np.arange(1.0, 101.0))
    assert bench.ratio_interval(list(shuffled)) == (40.0, 61.0)
    assert bench.ratio_interval([float(r) for r in range(10, 0, -1)]) == (2.0, 9.0)
    assert bench.ratio_interval([float(r) for r in range(1, 9)]) == (1.0, 8.0)
    assert bench.ratio_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)


def test_each_round_calls_each_layer_once_alternating_the_order():
    sequence = []
    calls = {name: (lambda name=name: sequence.append(name)) for name in "abc"}
    budget = bench.Budget(warmup=1, min_rounds=4, max_rounds=4, seconds=0.0)
    times = bench.interleaved_times(calls, budget)
    assert {name: len(seconds) for name, seconds in times.items()} == dict.fromkeys("abc", 4)
    assert "".join(sequence) == "abc" + "abc" + "cba" + "abc" + "cba"  # warm-up, then rounds
    # The budget's seconds decide between min_rounds and max_rounds
    budget = bench.Budget(warmup=0, min_rounds=2, max_rounds=50, seconds=0.0)
    assert len(bench.interleaved_times(calls, budget)["a"]) == 2
    # Every warm-up call is made, a slow call's too (seconds of 0: every call is slow): a JAX
    # layer keeping its weights compiles in its first two calls
    sequence.clear()
    bench.interleaved_times(calls, bench.Budget(warmup=2, min_rounds=1, max_rounds=1, seconds=0))
    assert "".join(sequence) == "aabbcc" + "abc"


def test_the_fewest_rounds_give_an_interval_holding_the_median_with_95_percent():
    # With n rounds the whole range misses the median when every ratio falls on one side of it:
    # 2 / 2**n; 5 rounds give 93.75%
    n = bench.Budget().min_rounds
    assert 1 - 2 / 2**n >= 0.95
    assert bench.ratio_interval([float(r) for r in range(n)]) == (0.0, float(n - 1))


@pytest.mark.mxnet
@pytest.mark.parametrize("hybridize", [False, True])
def test_the_books_gluon_block_computes_what_mha_computes(hybridize):
    # The MXNet baseline is only fair if it does the same work: same outputs, and with
    # need_weights=True the same weights, handed out as a second output when hybridized
    MX = backend_module("mxnet")
    mx = MX.mx
    config = bench.Config(2, 6, 8, 2, valid_lens=True, need_weights=True)
    mode = "hybridized" if hybridize else "imperative"
    calls = bench.BENCHES["mxnet"].calls(config, mode)["forward"]
    outputs = {name: call().asnumpy() for name, call in calls.items()}
    np.testing.assert_allclose(*outputs.values(), rtol=1e-5, atol=1e-6)
    X_np, lens_np = bench_config.inputs(config)
    theirs = bench_frameworks._d2l_gluon_attention(mx, 8, 2, return_weights=True)
    weights = bench_config.weights(config)
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


# The (backend, dtype) pairs the CPU times: JAX's float16 attention is timed on a GPU only
_CPU_TIMED = [
    pytest.param(backend, dtype, marks=getattr(pytest.mark, backend))
    for backend in ("torch", "tensorflow", "jax")
    for dtype in ("float32", "bfloat16", "float16")
    if (backend, dtype) != ("jax", "float16")
]


@pytest.mark.parametrize(("backend", "dtype"), _CPU_TIMED)
@pytest.mark.parametrize("need_weights", [True, False])
def test_every_timed_layer_computes_what_mha_computes(backend, need_weights, dtype):
    # A ratio is only fair between layers that do the same work: the built-ins hold mha's
    # weights and make their masks from the same valid_lens inside the timed call, so every
    # timed forward call returns mha's output, up to rounding
    module = backend_module(backend)
    config = bench.Config(3, 10, 8, 2, True, need_weights, dtype)
    mode = bench.BENCHES[backend].modes[0]
    calls = bench.BENCHES[backend].calls(config, mode)["forward"]
    assert len(calls) == (2 if need_weights or backend == "tensorflow" else 3)
    outputs = {name: module.to_numpy(call()) for name, call in calls.items()}
    assert {output.dtype.name for output in outputs.values()} == {dtype}
    assert bench_config.inputs(config)[1].min() < 10  # some keys are masked
    expected, tolerance = _exact_output(config)
    for name, output in outputs.items():
        assert harness.difference(output, expected, relative=True) <= tolerance, name


def _exact_output(config):
    """The float64 NumPy layer's output on the bench's inputs and weights, rounded to the dtype
    as the timed layers hold them, and the tolerance relative to the output's scale: the
    harness's, and for bfloat16, which the harness does not compare, two of its epsilons."""
    from mha.backends import numpy as reference
    from mha.weights import numpy_dtype

    X, lens = bench_config.inputs(config)
    exact_layer = reference.MultiHeadAttention(
        config.num_hiddens, config.num_heads, num_kv_heads=config.num_kv_heads, dtype="float64"
    )
    weights = bench_config.weights(config)
    mha.set_weights(exact_layer, {name: w.astype(np.float64) for name, w in weights.items()})
    X = X.astype(numpy_dtype(config.dtype)).astype(np.float64)
    return exact_layer(X, X, X, lens), harness.TOLERANCES.get(config.dtype, 2 * 2**-7)


@pytest.mark.torch
@pytest.mark.jax
def test_a_backend_with_no_row_for_the_options_given_is_named_as_skipped():
    # JAX times a decoding step with weights for one position only: its steps of three
    # positions with weights have no layer to time against, and the report says so
    backend_module("torch"), backend_module("jax")
    code, out, err = run(
        "--quick", "--backends", "torch,jax", "--shapes", "1,3,8,2+4", "--need-weights", "true"
    )
    assert code == 0, err
    assert "skipped jax: has no layer to time against that takes the options given" in out
    assert "| torch | eager | (1, 3, 8, 2, cache 4) |" in out


@pytest.mark.jax
def test_the_cudnn_layer_computes_every_query_as_mha_does():
    # The GPU's cuDNN row takes the lengths as cuDNN does; through XLA's implementation of
    # the same call, on the CPU, it gives mha's output, the queries past a length included
    # (the keys' lengths alone: query lengths would leave those rows zero, less work)
    from mha import bench_jax

    backend_module("jax")
    config = bench.Config(3, 10, 8, 2, True, False, "float32")
    _, theirs, X, lens = bench_jax._jax_layers_and_inputs(config)
    output, _ = bench_jax._call_cudnn(theirs, X, lens, implementation="xla")
    expected, tolerance = _exact_output(config)
    assert harness.difference(np.asarray(output), expected, relative=True) <= tolerance


_AUTOGRAD = [
    pytest.param(backend, marks=getattr(pytest.mark, backend))
    for backend in ("torch", "tensorflow", "mxnet", "jax")
]


def _exact_gradients(config):
    """The float64 NumPy layer's gradients of sum(output) on the bench's inputs and weights,
    by central differences: X's, and the squared sum of every weight's, which holds whatever
    layout a framework gives its weights (torch's built-ins pack three in one)."""
    from mha.backends import numpy as reference

    X, lens = bench_config.inputs(config)
    X = X.astype(np.float64)
    weights = {k: w.astype(np.float64) for k, w in bench_config.weights(config).items()}
    layer = reference.MultiHeadAttention(
        config.num_hiddens, config.num_heads, num_kv_heads=config.num_kv_heads, dtype="float64"
    )

    def loss():
        mha.set_weights(layer, weights)
        return layer(X, X, X, lens).sum()

    gradients = {}
    for name, array in (("X", X), *weights.items()):
        gradient = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            original = array[index]
            array[index] = original + 1e-6
            above = loss()
            array[index] = original - 1e-6
            gradient[index] = (above - loss()) / 2e-6
            array[index] = original
        gradients[name] = gradient
    return gradients.pop("X"), sum(float(np.sum(g**2)) for g in gradients.values())


def _gradient_arrays(backend, result):
    """X's gradient and the weights' from a timed backward call, as NumPy arrays."""
    if backend == "jax":  # ((the layer's gradients, X's), what else left the call)
        import jax

        (layer, X), _ = result
        return np.asarray(X), [np.asarray(g) for g in jax.tree_util.tree_leaves(layer)]
    arrays = [g.asnumpy() if backend == "mxnet" else np.asarray(g) for g in result]
    return arrays[0], arrays[1:]


@pytest.mark.parametrize("backend", _AUTOGRAD)
@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_every_timed_backward_pass_gives_the_reference_gradients(backend, num_kv_heads):
    # forward+backward differentiates sum(output) with respect to X and every weight of the
    # layer, on every side: the same work, X's gradient and the weights' the reference's
    backend_module(backend)
    if num_kv_heads and not bench.BENCHES[backend].grouped():  # MXNet, Flax before 0.12.1
        assert "no grouped-query" in bench.why_not(backend, grouped=True)
        return
    config = bench.Config(2, 6, 8, 4, True, need_weights=False, num_kv_heads=num_kv_heads)
    expected_X, expected_squares = _exact_gradients(config)
    for mode in bench.BENCHES[backend].modes:
        calls = bench.BENCHES[backend].calls(config, mode)["forward+backward"]
        assert len(calls) >= 2 and "mha" in calls
        for name, call in calls.items():
            X, weights = _gradient_arrays(backend, call())
            assert harness.difference(X, expected_X, relative=True) <= 1e-5, (mode, name)
            squares = sum(float(np.sum(g.astype(np.float64) ** 2)) for g in weights)
            assert squares == pytest.approx(expected_squares, rel=1e-5), (mode, name)


def test_grouped_query_rows_time_the_frameworks_grouped_layers():
    # A fifth number in a shape: num_kv_heads. torch has no such layer: its SDPA with
    # enable_gqa, which returns no weights, is the built-in, so need_weights=False rows only
    backends = [name for name in ("torch", "tensorflow") if _installed(name)]
    if not backends:
        pytest.skip("neither torch nor tensorflow is installed")
    document, _ = _quick_rows("--backends", ",".join(backends), "--shapes", "2,8,16,4,2")
    builtins = {(row["backend"], row["builtin"]) for row in document["results"]}
    expected = {
        "torch": {("torch", "SDPA layer (enable_gqa)")},
        "tensorflow": {("tensorflow", "keras GroupedQueryAttention")},
    }
    if _installed("transformers"):  # torch's rows with weights
        expected["torch"].add(("torch", bench_frameworks.EAGER))
    assert builtins == set().union(*(expected[name] for name in backends))
    for row in document["results"]:
        assert row["config"]["num_kv_heads"] == 2
        eager = row["builtin"] == bench_frameworks.EAGER
        assert row["backend"] != "torch" or row["config"]["need_weights"] == eager
    if _installed("mxnet"):
        code, _, err = run("--quick", "--backends", "mxnet", "--shapes", "2,8,16,4,2")
        assert code == 2 and "no grouped-query attention layer" in err


@pytest.mark.parametrize("backend", [p for p in _AUTOGRAD if p.values[0] != "mxnet"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_grouped_rows_compute_what_mha_computes(backend, need_weights):
    # The grouped built-ins (torch's SDPA layer with enable_gqa, with weights transformers'
    # eager attention; Keras's GroupedQueryAttention; Flax's layer with num_kv_heads and the
    # dot_product_attention layer) give the float64 reference's output
    module = backend_module(backend)
    if not bench.BENCHES[backend].grouped():  # Flax before 0.12.1
        return
    config = bench.Config(2, 6, 8, 4, True, need_weights, num_kv_heads=2)
    calls = bench.BENCHES[backend].calls(config, bench.BENCHES[backend].modes[0])
    if backend == "torch" and need_weights and not _installed("transformers"):
        assert calls == {}
        return
    expected, _ = _exact_output(config)
    assert len(calls["forward"]) >= 2
    for name, call in calls["forward"].items():
        output = module.to_numpy(call())
        assert harness.difference(output, expected, relative=True) <= 1e-5, name


# transformers' eager attention (Llama's) times the calls with weights that torch's layers
# cannot make, where transformers is installed (the test extra installs it)
EAGER_WITH_THE_CACHE = (
    {"transformers eager attention with the cache"} if _installed("transformers") else set()
)
DECODING_BUILTINS = {  # (backend, need_weights, grouped): the built-ins of a decoding row
    ("torch", True, False): {"nn.MultiheadAttention (no cache)", *EAGER_WITH_THE_CACHE},
    ("torch", True, True): EAGER_WITH_THE_CACHE,
    ("torch", False, False): {"nn.MultiheadAttention (no cache)", "SDPA layer with the cache"},
    ("torch", False, True): {"SDPA layer with the cache"},
    ("jax", True, False): {"nnx.MultiHeadAttention with its cache"},
    ("jax", True, True): {"nnx.MultiHeadAttention with its cache"},
    ("jax", False, False): {
        "nnx.MultiHeadAttention with its cache",
        "dot_product_attention layer with the cache",
    },
    ("jax", False, True): {
        "nnx.MultiHeadAttention with its cache",
        "dot_product_attention layer with the cache",
    },
}


@pytest.mark.parametrize(
    "backend",
    [pytest.param("torch", marks=pytest.mark.torch), pytest.param("jax", marks=pytest.mark.jax)],
)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("valid_lens", [True, False])
def test_decoding_rows_time_one_step_after_the_cache(
    backend, need_weights, num_kv_heads, length, valid_lens
):
    # A +C shape: one decoding step of L positions after C cached positions. Every timed
    # layer returns the float64 reference's output of the step's queries attending causally
    # to every position (the cached ones are the bench's own, made from a second draw),
    # forward only; called twice, so that a layer whose cache moves on with each call would
    # be caught
    module = backend_module(backend)
    if num_kv_heads and not bench.BENCHES[backend].grouped():  # Flax before 0.12.1: no rows
        assert "no grouped-query" in bench.why_not(backend, grouped=True, decoding=True)
        return
    config = bench.Config(
        2, length, 8, 4, valid_lens, need_weights, num_kv_heads=num_kv_heads, cached=6
    )
    calls = bench.BENCHES[backend].calls(config, bench.BENCHES[backend].modes[0])
    assert list(calls) == ["forward"]
    expected_names = {"mha"} | DECODING_BUILTINS[backend, need_weights, bool(num_kv_heads)]
    if length > 1:  # Flax's cache takes one position a call
        expected_names.discard("nnx.MultiHeadAttention with its cache")
    assert set(calls["forward"]) == expected_names
    from mha.backends import numpy as reference

    X, lens = bench_config.inputs(config)
    assert lens is None or (lens.max() <= 6 + length and lens.min() >= 3)  # over every key
    before = np.random.default_rng(1).standard_normal((2, 6, 8), "float32")
    everything = np.concatenate([before, X], axis=1).astype(np.float64)
    exact = reference.MultiHeadAttention(8, 4, num_kv_heads=num_kv_heads, dtype="float64")
    weights = bench_config.weights(config)
    mha.set_weights(exact, {name: w.astype(np.float64) for name, w in weights.items()})
    expected = exact(everything, everything, everything, lens, causal=True)[:, 6:]
    for name, call in calls["forward"].items():
        for _ in range(2):
            output = module.to_numpy(call())
            assert harness.difference(output, expected, relative=True) <= 1e-5, name


def test_decoding_shapes_parse_and_name_the_cache(monkeypatch):
    assert bench._parse_shapes("1,1,512,8+4096;2,1,16,4,2+8;1,1,512,8+4096") == [
        (1, 1, 512, 8, None, 4096),
        (2, 1, 16, 4, 2, 8),
    ]
    assert bench.Config(1, 1, 512, 8, False, False, cached=4096).shape == (
        "(1, 1, 512, 8, cache 4096)"
    )
    for shape in bench.SHAPES:
        assert bench._parse_shapes(bench._shape_text(shape)) == [shape]
    # torch and JAX have decoding rows; a backend without them says so
    code, _, err = run("--quick", "--backends", "numpy", "--shapes", "1,1,8,2+4")
    assert code == 2 and "no layer with a KV cache" in err
    # As many key-value heads as heads is the layer without grouped heads: leave kv out
    code, _, err = run("--quick", "--backends", "numpy", "--shapes", "2,8,16,4,4")
    assert code == 2 and "fewer than h" in err
    for cached in ("x", "0", ""):  # +0 would be a call without a cache, not a decoding step
        code, _, err = run("--quick", "--backends", "numpy", "--shapes", f"1,1,8,2+{cached}")
        assert code == 2 and "+C" in err, cached
