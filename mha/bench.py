"""Benchmarks: mha's MultiHeadAttention against each framework's own attention layer.

Run by `mha bench` (and `python benchmarks/run.py`). Self-attention on X (batch_size, length,
num_hiddens), no bias, dropout 0, with and without valid_lens, need_weights True and False;
"forward" runs as inference, "forward+backward" differentiates sum(output) with respect to X
and every weight. mha's layer and the built-ins hold the same weights and run in one process,
one call of each per round, so that both see the same machine load:

- torch: `nn.MultiheadAttention` (from `mha.interop.to_torch`), and with need_weights=False
  `F.scaled_dot_product_attention` on its weights (the SDPA layer, which returns no weights);
- tensorflow: `keras.layers.MultiHeadAttention` (from `mha.interop.to_keras`);
- mxnet: the book's Gluon multi-head attention (d2l's code, below), imperative and hybridized;
- numpy: no layer of its own, so its forward pass is timed against the time its FLOPs take at
  the rate of a float32 matrix product timed in the same rounds (the roofline).

A shape with a fifth number, num_kv_heads, times grouped-query attention: against the SDPA
layer with `enable_gqa` in torch (torch has no such layer), `keras.layers.GroupQueryAttention`
and `nnx.MultiHeadAttention(num_kv_heads=...)` where Flax has it; MXNet has none. A shape
ending in +C times one decoding step after C cached positions, mha's KVCache against the
SDPA layer with the same cache in torch and Flax's layer with its own cache in JAX. torch's
grouped and decoding calls with weights, which no torch layer makes, are timed against
transformers' eager attention (Llama's, repeat_kv) where transformers is installed.

A row's ratio is the median over rounds of mha's time over the built-in's in the same round
(below 1.0: mha is faster), with a 95% interval of that median: one that holds 1.0 is a tie.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mha.bench_frameworks import (
    BENCHES,
    DTYPES,
    NO_CACHE,
    PASSES,
    ROOFLINE,
    ROOFLINE_SIZE,
    Bench,
    Config,
)
from mha.cli_common import positive_float
from mha.registry import BACKENDS, BackendUnavailableError, select_backends

__all__ = ["BENCHES", "SHAPES", "Bench", "Config", "Result", "markdown_table", "run"]

# (batch_size, length, num_hiddens, num_heads), then num_kv_heads for grouped-query attention
# (None: as many as num_heads), then the positions cached before a decoding step
SHAPES = (
    (32, 64, 256, 8),
    (8, 512, 512, 8),
    (1, 4096, 512, 8),
    (8, 512, 512, 8, 2),
    (1, 1, 512, 8),  # one position: the per-call cost
    (1, 1, 512, 8, None, 512),  # one decoding step after 512 cached positions
    (1, 1, 512, 8, None, 4096),
)
QUICK_SHAPES = ((2, 16, 32, 4),)
BAR = 1.10  # the project's bar: no row slower than this against the framework's own layer


@dataclasses.dataclass
class Result:
    """One row: mha against one built-in (or the roofline) for one config and pass."""

    backend: str
    mode: str
    config: Config
    pass_: str
    builtin: str
    mha_ms: float
    builtin_ms: float
    ratio: float
    interval: tuple[float, float]  # 95% interval of the ratio (ratio_interval)
    rounds: int

    @property
    def mha_tflops(self) -> float:
        """mha's rate in TFLOP/s: the forward's FLOPs (three times them forward and backward)
        over mha's median time."""
        flops = self.config.forward_flops() * (3 if self.pass_ == "forward+backward" else 1)
        return flops / (self.mha_ms * 1e-3) / 1e12

    def as_dict(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["pass"] = row.pop("pass_")
        return row

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Result:
        values = {field.name: row.get(field.name) for field in dataclasses.fields(cls)}
        values.update(config=Config(**row["config"]), pass_=row["pass"])
        return cls(**{**values, "interval": tuple(row["interval"])})


@dataclasses.dataclass
class Budget:
    """Warm-up calls, then rounds until `seconds` have passed, within [min_rounds, max_rounds]."""

    warmup: int = 2
    min_rounds: int = 6  # the fewest whose whole range holds the median with 95%
    max_rounds: int = 500
    seconds: float = 3.0


QUICK_BUDGET = Budget(warmup=1, min_rounds=3, max_rounds=3, seconds=0.0)


# Plain perf_counter for every framework, torch included: torch.utils.benchmark.Timer times one
# statement per measurement (on one thread by default), so it cannot interleave two layers.
def interleaved_times(calls: dict[str, Callable[[], Any]], budget: Budget) -> dict[str, list]:
    """Seconds of each call in each round: one call of each per round, in the given order in
    even rounds and reversed in odd ones, so that no call always runs after the same one."""
    # Every warm-up, slow calls' too: a JAX layer keeping its weights compiles in each of its
    # first two jitted calls (the weights join its state in the first)
    for call in calls.values():
        for _ in range(budget.warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    order, start = list(calls), time.perf_counter()
    while len(times[order[0]]) < budget.max_rounds:
        for name in order:
            begin = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - begin)
        order.reverse()
        enough = len(times[order[0]]) >= budget.min_rounds
        if enough and time.perf_counter() - start >= budget.seconds:
            break
    return times


def ratio_interval(ratios: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval of the median of `ratios`: from the j-th smallest to the
    j-th largest, for the largest j for which it holds the median with probability at least
    `confidence` (1 - 2 P(Binomial(n, 1/2) < j)); with 8 values or fewer, the whole range."""
    ratios, n = sorted(ratios), len(ratios)
    j, below = 1, 1 / 2**n  # below = P(Binomial(n, 1/2) < j)
    while j < n // 2 and 2 * (below + math.comb(n, j) / 2**n) <= 1 - confidence:
        below += math.comb(n, j) / 2**n
        j += 1
    return ratios[j - 1], ratios[n - j]


# ---------------------------------------------------------------------------------------------
# Running


def why_not(
    backend: str,
    dtype="float32",
    device="cpu",
    mode=None,
    pass_=None,
    grouped=False,
    decoding=False,
) -> str | None:
    """Why `backend` has no rows in `dtype` on `device`, `mode` and `pass_` (None: any), and
    with `grouped` or `decoding`, for grouped-query attention or decoding steps alone."""
    entry = BENCHES.get(backend)
    if entry is None:
        return "has no entry in mha.bench.BENCHES"
    if grouped and not entry.grouped():
        return "has no grouped-query attention layer to time against"
    if decoding and not entry.decoding:
        return "has no layer with a KV cache to time decoding against"
    if dtype not in entry.dtypes or (device == "gpu" and entry.gpu is None):
        return f"benchmarked in {', '.join(entry.dtypes)} on the CPU only"
    if device == "cpu" and dtype in entry.gpu_only[0]:
        return f"benchmarked in {dtype} on a GPU only: {entry.gpu_only[1]}"
    if device == "gpu" and not entry.gpu():
        return f"{'TensorFlow' if backend == 'tensorflow' else backend} sees no GPU"
    if mode is not None and mode not in entry.modes:
        return f"has no {mode} mode (its modes: {', '.join(entry.modes)})"
    if pass_ is not None and pass_ not in entry.passes:
        return f"has no {pass_} pass (its passes: {', '.join(entry.passes)})"
    return None


def run(
    backends: Sequence[str],
    shapes: Sequence[tuple] = SHAPES,
    budget: Budget | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    valid_lens: Sequence[bool] = (False, True),
    need_weights: Sequence[bool] = (True, False),
    passes: Sequence[str] = PASSES,
    modes: Sequence[str] | None = None,
    on_row: Callable[[Result], None] | None = None,
) -> tuple[list[Result], dict[str, Any]]:
    """Time the rows selected; returns them and facts about the machine. `on_row` is given
    each row as soon as it is measured."""
    budget, facts, results = budget or Budget(), machine(device, backends), []
    cases = [
        (backend, mode, Config(*shape[:4], lens, weights, dtype, device, *shape[4:]))
        for backend in backends
        for mode in BENCHES[backend].modes
        if modes is None or mode in modes
        for shape in shapes
        if _has_rows(backend, shape)
        for lens in valid_lens
        for weights in need_weights
    ]
    for index, (backend, mode, config) in enumerate(cases):
        if progress:
            described = f"valid_lens={config.valid_lens} need_weights={config.need_weights}"
            progress(index, len(cases), f"{backend} {mode} {config.shape} {described}")
        calls = {p: c for p, c in BENCHES[backend].calls(config, mode).items() if p in passes}
        for pass_ in list(calls):  # popped: one config's layers and weights go before the next
            timed = calls.pop(pass_)
            if len(timed) < 2:  # mha's layer alone: nothing to time it against
                continue
            rows = _rows(backend, mode, config, pass_, interleaved_times(timed, budget))
            results += rows
            for row in rows if on_row else ():
                on_row(row)
    if progress:
        progress(len(cases), len(cases), "done")
    facts["load_average_end"] = _load()
    return results, facts


def _has_rows(backend: str, shape: tuple) -> bool:
    """Whether `backend` has rows at `shape` (see SHAPES): grouped-query and decoding shapes
    only where its framework has a layer to time against."""
    grouped = len(shape) > 4 and shape[4] is not None
    decoding = len(shape) > 5 and shape[5]
    return (not grouped or BENCHES[backend].grouped()) and (
        not decoding or BENCHES[backend].decoding
    )


def _rows(backend, mode, config, pass_, times) -> list[Result]:
    ours, rows = times.pop("mha"), []
    for name, theirs in times.items():
        if name == ROOFLINE:  # the time the forward's FLOPs take at the product's rate
            theirs = [t * config.forward_flops() / (2.0 * ROOFLINE_SIZE**3) for t in theirs]
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        ms = [statistics.median(times) * 1e3 for times in (ours, theirs)]
        median, interval = statistics.median(ratios), ratio_interval(ratios)
        rows.append(Result(backend, mode, config, pass_, name, *ms, median, interval, len(ours)))
    return rows


def _row_line(r: Result) -> str:
    """One measured row on a line, as `mha bench` prints it while it runs."""
    lens, weights = r.config.valid_lens, r.config.need_weights
    return (
        f"{r.backend} {r.mode} {r.config.shape} valid_lens={lens} need_weights={weights} "
        f"{r.pass_} against {r.builtin}: {r.ratio:.3f} ({r.mha_ms:.3g} ms, "
        f"{r.mha_tflops:.3g} TFLOP/s)"
    )


def _load() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(load, 2) for load in os.getloadavg()]
    return None


# Two processors of one name can differ in these, and so can the kernels the frameworks run
VECTOR_EXTENSIONS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "sve")


def machine(device: str = "cpu", backends: Sequence[str] = ()) -> dict[str, Any]:
    """What the numbers are measured on, with the load average (1, 5, 15 min) at the start."""
    from mha.registry import framework_version

    cpuinfo = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as file:
        cpuinfo = file.read()
    name = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flags = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.MULTILINE)
    flags = set(flags.group(1).split()) if flags else set()
    if device == "gpu" and "torch" in backends:
        import torch

        device = torch.cuda.get_device_name(0)
    elif device == "gpu" and "jax" in backends:
        import jax

        device = jax.devices("gpu")[0].device_kind
    a, b = np.random.default_rng(0).standard_normal((2, ROOFLINE_SIZE, ROOFLINE_SIZE), "float32")
    seconds = min(interleaved_times({"product": lambda: a @ b}, Budget(1, 5, 5, 0))["product"])
    return {
        "processor": name.group(1).strip() if name else platform.processor() or "unknown",
        "vector_extensions": [ext for ext in VECTOR_EXTENSIONS if ext in flags],
        "cpu_count": os.cpu_count(),
        "device": device,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        **{name: framework_version(name) for name in BACKENDS if name != "numpy"},
        "matmul_roofline_gflops": round(2.0 * ROOFLINE_SIZE**3 / seconds / 1e9, 1),
        "load_average_start": _load(),
    }


# ---------------------------------------------------------------------------------------------
# Output


def markdown_table(results: Sequence[Result]) -> str:
    """The rows as a markdown table: ratio = mha / built-in, with its 95% interval."""
    lines = [
        "| backend | mode | (B, L, d, h[, kv]) | valid_lens | need_weights | pass | built-in "
        "| mha ms | built-in ms | ratio | 95% interval | rounds | mha TFLOP/s |",
        "|" + "---|" * 13,
    ]
    for r in results:
        row = (r.backend, r.mode, r.config.shape, "yes" if r.config.valid_lens else "no")
        row += (r.config.need_weights, r.pass_, r.builtin, f"{r.mha_ms:.2f}", f"{r.builtin_ms:.2f}")
        row += (f"{r.ratio:.3f}", f"{r.interval[0]:.3f} to {r.interval[1]:.3f}", r.rounds)
        row += (f"{r.mha_tflops:.3g}",)
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return "\n".join(lines)


def summary(results: Sequence[Result], min_rounds: int = Budget.min_rounds) -> list[str]:
    """Per backend, its range of ratios against layers doing mha's work (a layer without a
    cache aside); then every row above BAR (numpy's aside), where the rows ran enough rounds
    for a verdict: the run's own min_rounds (a saved report's budget), or --quick's fewer."""
    lines = []
    for backend in dict.fromkeys(r.backend for r in results):
        rows = [r for r in results if r.backend == backend]
        ratios = [r.ratio for r in rows if r.builtin != NO_CACHE] or [r.ratio for r in rows]
        against = "the roofline" if backend == "numpy" else "the built-ins"
        aside = len(rows) - len(ratios)
        lines.append(
            f"{backend}: {len(rows)} rows, ratio to {against} {min(ratios):.3f} to "
            f"{max(ratios):.3f}" + (f" ({aside} against {NO_CACHE} aside)" if aside else "")
        )
    fewest = min((r.rounds for r in results), default=0)
    # --quick: 3 rounds time one call each, noise included
    if fewest < min(min_rounds, Budget.min_rounds) or min_rounds <= QUICK_BUDGET.min_rounds:
        lines.append(
            f"A smoke run: rows of {fewest} rounds show that every layer runs and give no "
            f"verdict on speed; without --quick each row runs {Budget.min_rounds} to "
            f"{Budget.max_rounds} rounds, with its interval."
        )
        return lines
    above = [r for r in results if r.ratio > BAR and r.builtin != ROOFLINE]
    lines.append(f"rows above {BAR:.2f} against a built-in: {len(above) or 'none'}")
    for r in above:
        lens, weights = r.config.valid_lens, r.config.need_weights
        described = f"valid_lens={lens} need_weights={weights} {r.pass_} against {r.builtin}"
        lines.append(f"  {r.backend} {r.mode} {r.config.shape} {described}: {r.ratio:.3f}")
    return lines


def _write_or_print(document: dict[str, Any], arguments, out) -> None:
    """Print the report, as JSON (--json) or as a table, then write it to --output if given:
    a file that cannot be written loses nothing printed."""
    print(_report_text(document, arguments.json), file=out)
    if arguments.output:
        from mha.files import write_atomically

        write_atomically(arguments.output, (json.dumps(document, indent=2) + "\n").encode())


def _report_text(document: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(document, indent=2)
    facts, results = document["machine"], [Result.from_dict(r) for r in document["results"]]
    min_rounds = facts.get("budget", {}).get("min_rounds", Budget.min_rounds)
    settings = sorted({(r.config.dtype, r.config.device) for r in results})
    lines = [
        f"Machine: {facts['processor']} ({', '.join(facts['vector_extensions']) or '-'}), "
        f"{facts['cpu_count']} CPU cores, device {facts['device']}; matmul roofline "
        f"{facts['matmul_roofline_gflops']} GFLOP/s; load average {facts['load_average_start']} "
        f"at the start, {facts['load_average_end']} at the end\n"
        f"Layers, inputs and weights in {', '.join(f'{t} on the {d}' for t, d in settings)}\n"
        "ratio: median over rounds of mha's time / the built-in's in the same round (below 1.0: "
        "mha is faster);\nnumpy: / the time of its FLOPs at the roofline. 95% interval: of that "
        "median; one that holds 1.0 is a tie.",
        markdown_table(results) + "\n\n" + "\n".join(summary(results, min_rounds)),
    ]
    lines += [f"skipped {name}: {reason}" for name, reason in document["skipped"].items()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line (`mha bench`, `python benchmarks/run.py`)


def add_arguments(parser) -> None:
    """The options of `mha bench`."""
    add = parser.add_argument
    add("--backends", help="comma-separated backends (default: every installed one)")
    add(
        "--quick",
        action="store_true",
        help="one tiny shape, 3 rounds (or more, within --seconds): a smoke run that every "
        "layer runs, no verdict on speed (about 20 s with every framework)",
    )
    add("--json", action="store_true", help="print the report as JSON")
    add("--output", help="also write the JSON report to this file")
    default = ";".join(_shape_text(shape) for shape in SHAPES)
    add(
        "--shapes",
        help="semicolon-separated B,L,d,h[,kv][+C], C positions cached before a decoding step "
        f"(default: {default})",
    )
    add(
        "--seconds",
        type=positive_float,
        help="time budget of each row's measurement (default: 3)",
    )
    add("--valid-lens", choices=("yes", "no"), help="only the rows with or without valid_lens")
    add("--need-weights", choices=("true", "false"), help="only the rows with need_weights so")
    add("--pass", dest="pass_", choices=PASSES, help="only the rows of this pass")
    modes = sorted({mode for entry in BENCHES.values() for mode in entry.modes})
    add(
        "--mode",
        choices=modes,
        help="only the rows of this mode (MXNet: imperative or hybridized; one mode elsewhere)",
    )
    add("--dtype", choices=DTYPES, help="of layers, inputs and weights (default: float32)")
    add("--device", choices=("cpu", "gpu"), help="cpu (default) or gpu: torch, TensorFlow and JAX")
    add("--report", metavar="FILE", help="print a saved JSON report (--output) without running")


def _shape_text(shape: tuple) -> str:
    """A shape as --shapes takes it: B,L,d,h[,kv][+C]."""
    text = ",".join(str(v) for v in shape[:5] if v is not None)
    return text + (f"+{shape[5]}" if len(shape) > 5 and shape[5] else "")


def _parse_shapes(text: str) -> list[tuple]:
    shapes = []
    for part in text.split(";"):
        sizes, plus, cached = part.partition("+")
        shape = tuple(int(v) if v.strip().isdecimal() else 0 for v in sizes.split(","))
        if (
            len(shape) not in (4, 5)
            or min(shape) <= 0
            or shape[2] % shape[3]
            or shape[3] % shape[-1]
            or (len(shape) == 5 and shape[4] == shape[3])  # as many key-value heads: not grouped
            or (plus and not (cached.strip().isdecimal() and int(cached) > 0))
        ):
            raise ValueError(
                "a shape is four positive integers B,L,d,h, h dividing d, and a fifth for "
                "grouped-query attention, the key-value heads, dividing h and fewer than h "
                "(leave it out for as many); +C after them "
                f"times a decoding step after C > 0 cached positions: {part!r}"
            )
        if plus:
            shape = (*shape[:4], shape[4] if len(shape) == 5 else None, int(cached))
        shapes.append(shape)
    return list(dict.fromkeys(shapes))  # a shape given twice is timed once


# Options that choose what to run: they mean nothing with --report
_MAX_REPORT_BYTES = 1 << 26  # a report holds a few hundred rows of a few hundred bytes
_RUN_OPTIONS = "backends quick shapes seconds valid_lens need_weights pass_ mode dtype device"


def execute(arguments, out, err, progress=None) -> int:
    """Run `mha bench` with parsed arguments; raises ValueError or BackendUnavailableError on a
    usage error."""
    if arguments.report:
        return _show_saved_report(arguments, out)
    if arguments.output:
        from mha.files import check_destination

        check_destination(arguments.output)  # before the run, which a wrong path would waste
    names, skipped = select_backends(arguments.backends)
    dtype, device = arguments.dtype or "float32", arguments.device or "cpu"
    shapes = QUICK_SHAPES if arguments.quick else SHAPES
    shapes = _parse_shapes(arguments.shapes) if arguments.shapes is not None else shapes
    grouped = all(len(shape) > 4 and shape[4] is not None for shape in shapes)
    decoding = all(len(shape) > 5 and shape[5] for shape in shapes)
    for name in list(names):
        reason = why_not(name, dtype, device, arguments.mode, arguments.pass_, grouped, decoding)
        if reason and arguments.backends:
            raise ValueError(f"--backends {name}: {reason}")
        if reason:
            names.remove(name)
            skipped[name] = reason
    if not names:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
        raise ValueError(f"no backend has the rows asked for here ({reasons})")
    budget = dataclasses.replace(QUICK_BUDGET if arguments.quick else Budget())
    if arguments.seconds is not None:  # with --quick: 3 rounds or more, until the seconds pass
        budget.seconds, budget.max_rounds = arguments.seconds, Budget.max_rounds
    chosen = {"yes": (True,), "no": (False,), "true": (True,), "false": (False,)}
    lead = "\r\x1b[K" if err.isatty() else ""
    results, facts = run(
        names,
        shapes,
        budget,
        progress,
        dtype=dtype,
        device=device,
        valid_lens=chosen.get(arguments.valid_lens, (False, True)),
        need_weights=chosen.get(arguments.need_weights, (True, False)),
        passes=PASSES if arguments.pass_ is None else (arguments.pass_,),
        modes=None if arguments.mode is None else (arguments.mode,),
        # On a terminal the row replaces the progress line, which the next step writes again
        on_row=lambda row: print(f"{lead}  {_row_line(row)}", file=err, flush=True),
    )
    if not results:
        raise ValueError(
            "no row was measured: no layer to time against takes the options given (a decoding "
            "step is timed forward only, and in JAX with weights only for one position)"
        )
    for name in [name for name in names if name not in {r.backend for r in results}]:
        skipped[name] = "has no layer to time against that takes the options given"
    facts["budget"] = dataclasses.asdict(budget)
    document = {"machine": facts, "results": [r.as_dict() for r in results], "skipped": skipped}
    _write_or_print(document, arguments, out)
    return 0


def _show_saved_report(arguments, out) -> int:
    """`mha bench --report FILE`: a saved report's table again, without running."""
    values = {name: getattr(arguments, name) for name in _RUN_OPTIONS.split()}
    # `is`, not `in`: a --seconds of 0 is given, though 0 == False
    given = [name for name, value in values.items() if value is not None and value is not False]
    if given:
        options = ", ".join("--" + name.strip("_").replace("_", "-") for name in given)
        raise ValueError(f"--report shows a saved report and runs nothing: drop {options}")
    try:
        from mha.files import parse_json, read_bytes

        document = parse_json(read_bytes(arguments.report, _MAX_REPORT_BYTES))
        results = [Result.from_dict(row).as_dict() for row in document["results"]]
        document = {**document, "results": results, "skipped": dict(document["skipped"])}
        _report_text(document, as_json=False)  # every field the table reads, read before printing
    except (OSError, ValueError, KeyError, TypeError, IndexError, ArithmeticError) as error:
        raise ValueError(
            f"{arguments.report} is not a report written by `mha bench --output`: "
            f"{type(error).__name__}: {error}"
        ) from None
    _write_or_print(document, arguments, out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n")[0])
    add_arguments(parser)
    arguments = parser.parse_args(argv)

    def progress(done: int, total: int, description: str) -> None:
        print(f"[{done}/{total}] {description}", file=sys.stderr, flush=True)

    try:
        return execute(arguments, sys.stdout, sys.stderr, progress)
    except (ValueError, BackendUnavailableError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
