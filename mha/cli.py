"""The `mha` command: `mha info`, `mha compare`, `mha verify`, `mha conform`, `mha convert`,
`mha inspect` and `mha bench`.

Exit codes: 0 when everything agrees (for `mha conform`, every case the function takes), 1 on
any disagreement, 2 on a usage error (including a backend named with --backends that does not
import); `mha compare` exits 3 when everything agrees but only numpy ran, so that nothing was
compared across frameworks. `mha convert` and
`mha inspect` exit 1 when a file cannot be read or written or the destination cannot express
the layer.

`mha convert` and `mha inspect` are `mha.cli_files`'s; what the commands share (the usage
error, the types of arguments, the progress line) is `mha.cli_common`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Sequence

from mha import __version__, bench, conformance, conformance_adapters, golden, harness
from mha.cli_common import (
    OneLineParser,
    UsageError,
    format_difference,
    framework_logs_aside,
    placeable,
    positive_int,
    print_table,
    progress,
    reference_precision,
    seed,
)
from mha.cli_files import add_file_commands, file_command
from mha.files import check_destination
from mha.registry import (
    BACKENDS,
    BackendUnavailableError,
    framework_version,
    load_backend,
    select_backends,
)

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="mha",
        description="Attention layers of Dive into Deep Learning in NumPy, PyTorch, TensorFlow, "
        "MXNet and JAX, with proof that they compute the same numbers.",
    )
    parser.add_argument("--version", action="version", version=f"mha {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    commands.add_parser(
        "info", help="list the backends, whether each imports, and its framework version"
    )

    _add_compare_command(commands)
    _add_verify_command(commands)
    _add_conform_command(commands)
    bench.add_arguments(
        commands.add_parser(
            "bench",
            help="time MultiHeadAttention against each framework's own attention layer",
            description="Time the forward and forward+backward passes of mha's "
            "MultiHeadAttention side by side with each framework's own layer, one call of each "
            "per round; print a markdown table of medians and ratios (mha / built-in), each "
            "ratio with a 95% interval.",
        )
    )
    add_file_commands(commands)
    return parser


_TABLE_HELP = (
    "print every row (default: each backend's largest differences and the rows that disagree)"
)


def _add_compare_command(commands) -> None:
    compare = commands.add_parser(
        "compare",
        help="run every layer on every backend with one weight set and compare the outputs",
        description="Run every layer, the main mask combinations and every mask kind at least "
        "once on each backend, with one canonical weight set and the same inputs, and compare "
        "each result with the NumPy reference in float64. A case whose options cannot take the "
        "sizes given (4 query heads, rotary embeddings' even head size) takes sizes of its own, "
        "named in its label. Exit 0 when all agree within tolerance, 1 otherwise, 2 on a usage "
        "error, 3 when all agree but only numpy ran (nothing compared across frameworks).",
    )
    compare.add_argument(
        "--backends",
        help="comma-separated backends (default: every installed one; a named backend that "
        "does not import is an error)",
    )
    compare.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    compare.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        help="run torch and jax there (a GPU: CUDA's current device, JAX's first GPU); the "
        "NumPy reference stays on the CPU; other backends are a usage error. Default: where "
        "each framework puts its arrays",
    )
    compare.add_argument(
        "--seed", type=seed, default=0, help="seed of weights and inputs (0 to 2**32 - 1)"
    )
    defaults = harness.Shapes()
    for field in ("batch_size", "num_queries", "num_keys", "num_hiddens", "num_heads"):
        compare.add_argument(
            "--" + field.replace("_", "-"),
            type=positive_int,
            default=getattr(defaults, field),
            help=f"default {getattr(defaults, field)}",
        )
    compare.add_argument("--json", action="store_true", help="print the rows as JSON")
    compare.add_argument("--table", "--verbose", action="store_true", help=_TABLE_HELP)
    compare.add_argument(
        "--record",
        metavar="CASES.safetensors",
        help="also write the run's cases, as the first backend computes them (its gradients "
        "too where it has autograd), for `mha verify` on any machine",
    )


def _add_verify_command(commands) -> None:
    verify = commands.add_parser(
        "verify",
        help="run recorded cases on every backend and compare with the recorded numbers",
        description="Run the cases of a golden-case file (written by `mha compare --record` "
        "or mha.golden.record) on each backend and compare outputs, attention weights and "
        "gradients with the recorded ones. Exit 0 when all agree within tolerance, 1 "
        "otherwise, 2 on a usage error.",
    )
    verify.add_argument("path", metavar="CASES.safetensors")
    verify.add_argument(
        "--backends",
        help="comma-separated backends (default: every installed one; a named backend that "
        "does not import is an error)",
    )
    verify.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        help="the dtype to run in (default: each case's own)",
    )
    verify.add_argument("--table", "--verbose", action="store_true", help=_TABLE_HELP)


def _info(out, err) -> int:
    """The backends: each one's status and version; what to install only where it is missing
    or does not import. Progress on `err` while the frameworks import (seconds each)."""
    print(f"mha {__version__}", file=out)
    lines, report = [], progress(err)
    for done, name in enumerate(BACKENDS):
        report(done, len(BACKENDS), f"importing {name}")
        try:
            load_backend(name)
        except BackendUnavailableError as error:
            status, detail = "unavailable", str(error)
        else:
            status, detail = "ok", ""
        version = framework_version(name) or "-"
        lines.append(f"{name:<12} {status:<11} {version:<10} {detail}".rstrip())
    report(len(BACKENDS), len(BACKENDS), "done")
    print(f"{'backend':<12} {'status':<11} {'version':<10} detail", file=out)
    print("\n".join(lines), file=out)
    return 0


def _own_sizes(shapes: harness.Shapes) -> list[str]:
    """The cases that take sizes of their own rather than those given."""
    fitted = [(case, harness.fit(case, shapes)) for case in harness.default_cases()]
    return [fit.id for case, fit in fitted if fit != case]


def _compare(arguments, out, err) -> int:
    shapes = _compare_shapes(arguments)
    try:
        if arguments.record:  # before the run, which a wrong path would waste
            check_destination(arguments.record)
        names, skipped = select_backends(arguments.backends)
        if arguments.device and not arguments.backends:
            names = placeable(names, skipped, arguments.device)
        elif arguments.device not in (None, "cpu") and not _across_frameworks(names):
            raise ValueError(
                f"--device {arguments.device}: the NumPy reference computes on the CPU; name a "
                f"framework to run there (--backends numpy,torch)"
            )
    except (ValueError, BackendUnavailableError) as error:
        raise UsageError(str(error)) from None
    rows = _run_compare(arguments, names, shapes, err)
    passed = all(row.passed for row in rows)
    if arguments.json:
        print(json.dumps(_json_report(arguments, rows, skipped, names, shapes), indent=2), file=out)
    else:
        title = (
            f"Largest differences from the NumPy reference in float64 ({arguments.dtype} "
            f"runs, seed {arguments.seed})."
        )
        own_sizes = _own_sizes(shapes)
        if own_sizes:
            cases = "1 case needs" if len(own_sizes) == 1 else f"{len(own_sizes)} cases need"
            title += (
                f"\n  {cases} other sizes than those given: each takes sizes of its own, named "
                "in its label"
            )
        _print_report(rows, names, skipped, arguments.dtype, out, title, table=arguments.table)
    # After the report, which a destination that fails to take the record loses nothing of
    if arguments.record and not _record(arguments, names[0], shapes, err):
        return 1
    if not arguments.json:
        _closing_lines(arguments, names, passed, out)
    return _exit_code(passed, names)


def _json_report(arguments, rows, skipped, names, shapes) -> dict:
    return {
        "passed": all(row.passed for row in rows),
        "dtype": arguments.dtype,
        "seed": arguments.seed,
        "tolerance": harness.TOLERANCES[arguments.dtype],
        "gradient_tolerance": harness.GRADIENT_TOLERANCES[arguments.dtype],
        "skipped": skipped,
        "own_sizes": _own_sizes(shapes),
        "across_frameworks": _across_frameworks(names),
        "rows": [row.as_dict() for row in rows],
    }


def _closing_lines(arguments, names, passed, out) -> None:
    if arguments.record:
        print(
            f"Recorded {len(harness.default_cases())} cases as {names[0]} computes them: "
            f"{arguments.record}",
            file=out,
        )
    if passed and not _across_frameworks(names):
        against = (
            "the float64 reference is numpy's own run"
            if arguments.dtype == "float64"
            else f"each layer's {arguments.dtype} run agrees with its own float64 reference"
        )
        print(
            f"Only numpy ran: {against}, and nothing was compared across frameworks (exit 3). "
            'Install a framework (pip install "torch>=2.7") or name one with --backends.',
            file=out,
        )
    _hint_table(arguments, out)


def _hint_table(arguments, out) -> None:
    if not arguments.table:  # mha verify has no --json
        also = " (or --json)" if hasattr(arguments, "json") else ""
        print(f"Every row: --table{also}.", file=out)


# The exit code of a run that agrees where only numpy ran: nothing across frameworks
NOTHING_ACROSS = 3


def _across_frameworks(names) -> bool:
    return any(name != "numpy" for name in names)


def _exit_code(passed: bool, names) -> int:
    """0 when every row agrees and a framework beside numpy ran; 1 on a disagreement."""
    if not passed:
        return 1
    return 0 if _across_frameworks(names) else NOTHING_ACROSS


def _run_compare(arguments, names, shapes, err) -> list:
    """harness.compare's rows for the command's arguments (UsageError for a bad --device)."""
    reference_precision(names, arguments.dtype)
    try:
        return harness.compare(
            backends=names,
            dtype=arguments.dtype,
            seed=arguments.seed,
            shapes=shapes,
            progress=progress(err),
            device=arguments.device,
        )
    except ValueError as error:  # a backend that cannot be put on the device
        raise UsageError(str(error)) from None


def _record(arguments, backend: str, shapes: harness.Shapes, err) -> bool:
    """Write --record's golden cases as `backend` computes them; False (reported) on failure."""
    try:
        golden.record_run(
            arguments.record,
            backend,
            dtype=arguments.dtype,
            seed=arguments.seed,
            shapes=shapes,
            progress=progress(err),
        )
    except (ValueError, OSError) as error:
        print(f"mha compare: error: {error}", file=err)
        return False
    return True


def _compare_shapes(arguments) -> harness.Shapes:
    """The sizes of compare's arguments; a usage error where no multi-head case can use them
    (a case whose options need other sizes takes its own: harness.fit)."""
    if arguments.num_hiddens % arguments.num_heads != 0:
        raise UsageError(
            f"argument --num-heads: must divide --num-hiddens {arguments.num_hiddens}. "
            f"Received: {arguments.num_heads}"
        )
    return harness.Shapes(
        batch_size=arguments.batch_size,
        num_queries=arguments.num_queries,
        num_keys=arguments.num_keys,
        num_hiddens=arguments.num_hiddens,
        num_heads=arguments.num_heads,
    )


def _verify(arguments, out, err) -> int:
    if not os.path.isfile(arguments.path):
        raise UsageError(f"{arguments.path} does not exist or is not a file")
    try:
        names, skipped = select_backends(arguments.backends)
    except (ValueError, BackendUnavailableError) as error:
        raise UsageError(str(error)) from None
    try:
        cases = golden.read(arguments.path)
    except ValueError as error:
        print(f"mha verify: error: {error}", file=err)
        return 1
    reference_precision(names, None)
    rows = golden.verify(cases, names, arguments.dtype, progress=progress(err))
    # The legend's tolerance is the one each row was held to: the less precise dtype's
    dtypes = {golden.tolerance_dtype(arguments.dtype or case.dtype, case.dtype) for case in cases}
    _print_report(
        rows,
        names,
        skipped,
        "float64" if dtypes == {"float64"} else "float32",
        out,
        golden.report_title(arguments.path, cases, rows),
        gradients="grad~rec",
        table=arguments.table,
    )
    _hint_table(arguments, out)
    return 0 if all(row.passed for row in rows) else 1


def _print_report(rows, names, skipped, dtype, out, title, gradients=None, table=False) -> None:
    """The agreement of `mha compare` and `mha verify`: the legend; every row (`table`), or
    each backend's largest differences and the rows that disagree; the verdict."""
    columns = _legend(rows, dtype, out, title, gradients)
    if table:
        print_table(rows, columns, out)
    else:
        _print_backends(rows, names, columns, out)
        failing = [row for row in rows if not row.passed]
        if failing:
            print("\nThe rows that disagree:", file=out)
            print_table(failing, columns, out)
    _print_summary(rows, names, skipped, out)


def _legend(rows, dtype, out, title, gradients) -> list[tuple[str, str]]:
    """Print the title and what each difference is; return the columns of differences
    (heading, Row field)."""
    tolerance = harness.TOLERANCES[dtype]
    scale = "absolute" if dtype == "float64" else "relative to the output's scale"
    print(
        f"{title}\n  output, weights: the layer's output and attention_weights, tolerance "
        f"{tolerance:.0e} {scale}",
        file=out,
    )
    columns = [("output", "output_difference"), ("weights", "weights_difference")]
    autograd = [
        row.backend
        for row in rows
        if row.gradient_difference is not None or row.gradient_agreement is not None
    ]
    if autograd and gradients is None:
        anchor = autograd[0]
        print(
            f"  grad~fd: gradients of the inputs, float masks and weights against float64 central "
            f"differences, tolerance {harness.GRADIENT_TOLERANCES[dtype]:.0e} relative\n"
            f"  grad~{anchor}: gradients against {anchor}'s, tolerance {tolerance:.0e}",
            file=out,
        )
        columns += [("grad~fd", "gradient_difference"), (f"grad~{anchor}", "gradient_agreement")]
    elif gradients is not None and autograd:
        print(
            f"  {gradients}: gradients against the recorded ones, tolerance {tolerance:.0e} "
            "relative",
            file=out,
        )
        columns.append((gradients, "gradient_agreement"))
    return columns


def _print_backends(rows, names, columns, out) -> None:
    """One line per backend: its rows, how many disagree, and its largest differences."""
    headings = "  ".join(f"{heading:>{max(8, len(heading))}}" for heading, _ in columns)
    header = f"{'backend':<10}  {'rows':>5}  {'disagree':>8}  {headings}"
    print(f"{header}\n{'-' * len(header)}", file=out)
    for name in names:
        mine = [row for row in rows if row.backend == name]
        values = []
        for heading, field in columns:
            found = [getattr(row, field) for row in mine if getattr(row, field) is not None]
            largest = format_difference(max(found) if found else None)
            values.append(f"{largest:>{max(8, len(heading))}}")
        disagree = sum(not row.passed for row in mine)
        print(f"{name:<10}  {len(mine):>5}  {disagree:>8}  {'  '.join(values)}", file=out)


def _print_summary(rows, names, skipped, out) -> None:
    """The lines below the agreement table: the backends skipped, and the verdict."""
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}", file=out)
    failures = sum(not row.passed for row in rows)
    if not failures:
        print(f"All {len(rows)} comparisons agree on {', '.join(names)}.", file=out)
    else:
        failing = sorted({row.backend for row in rows if not row.passed})
        print(
            f"{failures} of {len(rows)} comparisons disagree, on: {', '.join(failing)}.", file=out
        )


def _bench(arguments, out, err) -> int:
    try:
        return bench.execute(arguments, out, err, progress(err))
    except (ValueError, BackendUnavailableError) as error:
        raise UsageError(str(error)) from None
    except OSError as error:  # --output could not be written; the path is left as it was
        print(f"mha bench: error: {error}", file=err)
        return 1


def _add_conform_command(commands) -> None:
    conform = commands.add_parser(
        "conform",
        help="hold an attention function (yours, or a framework's) to mha's reference",
        description="Call an attention function on every case of mha.conformance (each mask "
        "kind, both causal alignments, grouped heads, windows, soft cap, lengths, a row with "
        "no key, NaN at masked keys) in each dtype, and compare it with the float64 "
        "reference. The function takes (query, key, value, **options) on (batch, heads, "
        "positions, head size) tensors, options named as mha.dot_product_attention's; one "
        "that raises TypeError or NotImplementedError for an option has not taken that case. "
        "Exit 0 when every case it takes agrees, 1 otherwise.",
    )
    adapters = ", ".join(conformance_adapters.ADAPTERS)
    conform.add_argument("target", help=f"MODULE:FUNCTION (with --framework), or {adapters}")
    conform.add_argument(
        "--framework", choices=list(BACKENDS), help="whose tensors MODULE:FUNCTION takes"
    )
    conform.add_argument(
        "--dtypes",
        default=",".join(conformance.DTYPES),
        help="comma-separated (default: %(default)s; float64 too)",
    )
    conform.add_argument(
        "--empty-rows",
        choices=("zeros", "uniform"),
        default="zeros",
        help="what a row with no key must give (default: zeros)",
    )
    conform.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        help="give the function torch or jax tensors there (a GPU: CUDA's current device, "
        "JAX's first GPU); the references run where the framework puts its arrays. Default: "
        "where the framework puts them",
    )
    conform.add_argument(
        "--outputs-only",
        action="store_true",
        help="compare the outputs alone, not the gradients (a kernel with no backward)",
    )
    conform.add_argument("--json", action="store_true", help="print the rows as JSON")


def _conform(arguments, out, err) -> int:
    try:
        function, framework = _conform_target(arguments.target, arguments.framework)
    except BackendUnavailableError as error:
        raise UsageError(str(error)) from None
    dtypes = list(dict.fromkeys(d.strip() for d in arguments.dtypes.split(",") if d.strip()))
    unknown = [d for d in dtypes if d not in conformance.TOLERANCES]
    if unknown or not dtypes:
        raise UsageError(f"--dtypes takes {', '.join(conformance.TOLERANCES)}: {unknown}")
    if arguments.device is not None:
        if load_backend(framework).ADAPTER.to_device is None:
            raise UsageError(f"mha does not place {framework}'s tensors (--device: torch, jax)")
        try:  # a device the framework cannot reach, as `mha compare --device` says
            harness.device_of(framework, arguments.device)
        except ValueError as error:
            raise UsageError(str(error)) from None
    rows = conformance.run(
        function,
        framework,
        dtypes,
        empty_rows=arguments.empty_rows,
        gradients=not arguments.outputs_only,
        device=arguments.device,
    )
    if arguments.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows], indent=1), file=out)
    else:
        print(f"{arguments.target} on {framework} tensors", file=out)
        print(conformance.format_table(rows), file=out)
    taken = [row for row in rows if row.status != "not taken"]
    failed = [row for row in taken if row.status != "agrees"]
    if not any(row.status in ("agrees", "differs") for row in rows):
        counts = f"{len(rows) - len(taken)} not taken, {len(taken)} failed"
        print(f"mha conform: no case was compared: {counts}", file=err)
    elif failed:
        counts = f"{len(failed)} of the {len(taken)} rows taken (a case in a dtype)"
        print(f"mha conform: {counts} do not agree", file=err)
    return 0 if taken and not failed else 1


def _conform_target(target: str, framework: str | None):
    """The function `mha conform` runs, and the framework whose tensors it takes."""
    if target in conformance_adapters.ADAPTERS:
        named, make = conformance_adapters.ADAPTERS[target]
        if framework not in (None, named):
            raise UsageError(f"{target} takes {named} tensors, not {framework}'s")
        load_backend(named)  # a missing framework is a usage error, as --backends's
        return make(), named
    module_name, _, name = target.partition(":")
    if not name or framework is None:
        raise UsageError(
            "the target is MODULE:FUNCTION with --framework, or one of "
            + ", ".join(conformance_adapters.ADAPTERS)
        )
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"cannot load {target}: {error}") from None
    load_backend(framework)
    return function, framework


def main(argv: Sequence[str] | None = None, out=None, err=None) -> int:
    """Run the command line; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    parser = _parser()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            arguments = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on usage errors and 0 for --help
        return int(exit_.code or 0)
    hidden: list[str] = []
    code = 1
    try:
        with framework_logs_aside(err, hidden) as messages:
            code = _run(arguments, out, messages)
    except BrokenPipeError:  # the reader of the output stopped (`| head`): nothing to tell it
        if out is sys.__stdout__:  # Python's flush at exit would raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    finally:
        # The frameworks' log lines may explain a failure: shown then, not otherwise
        if code == 1 and "".join(hidden).strip():
            print("The frameworks' log lines, set aside while mha ran:", file=err)
            print("".join(hidden).rstrip(), file=err)
    return code


def _run(arguments, out, err) -> int:
    """The command's exit code (2 for a UsageError, with its message)."""
    try:
        if arguments.command == "info":
            return _info(out, err)
        if arguments.command in ("convert", "inspect"):
            return file_command(arguments, out, err)
        if arguments.command == "bench":
            return _bench(arguments, out, err)
        if arguments.command == "verify":
            return _verify(arguments, out, err)
        if arguments.command == "conform":
            return _conform(arguments, out, err)
        return _compare(arguments, out, err)
    except UsageError as error:
        print(f"mha {arguments.command}: error: {error}", file=err)
        return 2
    except MemoryError as error:  # sizes past this machine's memory, as numpy says it
        print(f"mha {arguments.command}: error: not enough memory: {error}", file=err)
        return 1
