"""The `mha` command: `mha info`, `mha compare`, `mha verify`, `mha convert`, `mha inspect` and
`mha bench`.

Exit codes: 0 when everything agrees, 1 on any disagreement, 2 on a usage error (including a
backend named with --backends that does not import). `mha convert` and `mha inspect` exit 1
when a file cannot be read or written or the destination cannot express the layer.

`mha convert` and `mha inspect` are `mha.cli_files`'s; what the commands share (the usage
error, the types of arguments, the progress line) is `mha.cli_common`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence

from mha import __version__, bench, golden, harness
from mha.cli_common import UsageError, positive_int, progress, seed
from mha.cli_files import add_file_commands, file_command
from mha.registry import (
    BACKENDS,
    INSTALL,
    BackendUnavailableError,
    framework_version,
    load_backend,
    select_backends,
)

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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


def _add_compare_command(commands) -> None:
    compare = commands.add_parser(
        "compare",
        help="run every layer on every backend with one weight set and compare the outputs",
        description="Run every layer and the main mask combinations on each backend, with one "
        "canonical weight set and the same inputs, and compare each result with the NumPy "
        "reference computed in float64. A case whose options cannot take the sizes given "
        "(4 query heads, rotary embeddings' even head size) takes sizes of its own, named in "
        "its label. Exit 0 when all agree within tolerance, 1 otherwise, 2 on a usage error.",
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


def _info(out) -> int:
    print(f"mha {__version__}", file=out)
    print(f"{'backend':<12} {'status':<11} {'version':<10} detail", file=out)
    for name in BACKENDS:
        version = framework_version(name) or "-"
        try:
            load_backend(name)
        except BackendUnavailableError as error:
            status, detail = "unavailable", str(error)
        else:
            status = "ok"
            detail = INSTALL[name] or "always available"
        print(f"{name:<12} {status:<11} {version:<10} {detail}", file=out)
    return 0


def _format(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _compare(arguments, out, err) -> int:
    shapes = _compare_shapes(arguments)
    try:
        names, skipped = select_backends(arguments.backends)
    except (ValueError, BackendUnavailableError) as error:
        raise UsageError(str(error)) from None
    rows = _run_compare(arguments, names, shapes, err)
    passed = all(row.passed for row in rows)
    if arguments.record and not _record(arguments, names[0], shapes, err):
        return 1
    own_sizes = [
        harness.fit(case, shapes).id
        for case in harness.default_cases()
        if harness.fit(case, shapes) != case
    ]
    if arguments.json:
        report = {
            "passed": passed,
            "dtype": arguments.dtype,
            "seed": arguments.seed,
            "tolerance": harness.TOLERANCES[arguments.dtype],
            "gradient_tolerance": harness.GRADIENT_TOLERANCES[arguments.dtype],
            "skipped": skipped,
            "own_sizes": own_sizes,
            "rows": [row.as_dict() for row in rows],
        }
        print(json.dumps(report, indent=2), file=out)
        return 0 if passed else 1
    title = (
        f"Largest differences from the NumPy reference in float64 ({arguments.dtype} "
        f"runs, seed {arguments.seed})."
    )
    if own_sizes:
        cases = "1 case needs" if len(own_sizes) == 1 else f"{len(own_sizes)} cases need"
        title += (
            f"\n  {cases} other sizes than those given: each takes sizes of its own, named in "
            "its label"
        )
    _print_rows(rows, names, skipped, arguments.dtype, out, title)
    if arguments.record:
        print(
            f"Recorded {len(harness.default_cases())} cases as {names[0]} computes them: "
            f"{arguments.record}",
            file=out,
        )
    return 0 if passed else 1


def _run_compare(arguments, names, shapes, err) -> list:
    """harness.compare's rows for the command's arguments (UsageError for a bad --device)."""
    if "jax" in names and arguments.dtype == "float64":
        # JAX computes in float64 only in its 64-bit mode; this process is the command's own
        import jax

        jax.config.update("jax_enable_x64", True)
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
    rows = golden.verify(cases, names, arguments.dtype, progress=progress(err))
    recorded = sorted({case.recorded_with for case in cases if case.recorded_with})
    dtype = arguments.dtype or (cases[0].dtype if cases else "float32")
    _print_rows(
        rows,
        names,
        skipped,
        dtype,
        out,
        f"Largest differences from the numbers recorded in {arguments.path} "
        f"({', '.join(recorded) or 'recorded elsewhere'}; {len(cases)} cases).",
        gradients="grad~rec",
    )
    return 0 if all(row.passed for row in rows) else 1


def _print_rows(rows, names, skipped, dtype, out, title, gradients=None) -> None:
    """The agreement table of `mha compare` and `mha verify`."""
    tolerance = harness.TOLERANCES[dtype]
    gradient_tolerance = harness.GRADIENT_TOLERANCES[dtype]
    scale = "absolute" if dtype == "float64" else "relative to the output's scale"
    autograd = [
        row.backend
        for row in rows
        if row.gradient_difference is not None or row.gradient_agreement is not None
    ]
    anchor = autograd[0] if autograd and gradients is None else None
    print(
        f"{title}\n"
        f"  output, weights: the layer's output and attention_weights, tolerance "
        f"{tolerance:.0e} {scale}",
        file=out,
    )
    if anchor is not None:
        print(
            f"  grad~fd: gradients of the inputs and weights against float64 central "
            f"differences, tolerance {gradient_tolerance:.0e} relative\n"
            f"  grad~{anchor}: gradients against {anchor}'s, tolerance {tolerance:.0e}",
            file=out,
        )
    elif gradients is not None and autograd:
        print(
            f"  {gradients}: gradients against the recorded ones, tolerance {tolerance:.0e} "
            "relative",
            file=out,
        )
    width = max([len(row.case) for row in rows] + [13])
    columns = f"{'output':>8}  {'weights':>8}"
    if anchor is not None:
        columns += f"  {'grad~fd':>8}  {'grad~' + anchor:>10}"
    elif gradients is not None and autograd:
        columns += f"  {gradients:>10}"
    header = f"{'layer [masks]':<{width}}  {'backend':<10}  {'output shape':<14}  {columns}  result"
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in rows:
        shape = "-" if row.output_shape is None else str(row.output_shape)
        result = "ok" if row.passed else "FAIL"
        values = f"{_format(row.output_difference):>8}  {_format(row.weights_difference):>8}"
        if anchor is not None:
            values += (
                f"  {_format(row.gradient_difference):>8}  {_format(row.gradient_agreement):>10}"
            )
        elif gradients is not None and autograd:
            values += f"  {_format(row.gradient_agreement):>10}"
        line = f"{row.case:<{width}}  {row.backend:<10}  {shape:<14}  {values}  {result}"
        if row.error:
            line += f"  ({row.error})"
        print(line, file=out)
    _print_summary(rows, names, skipped, out)


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
    try:
        if arguments.command == "info":
            return _info(out)
        if arguments.command in ("convert", "inspect"):
            return file_command(arguments, out, err)
        if arguments.command == "bench":
            return _bench(arguments, out, err)
        if arguments.command == "verify":
            return _verify(arguments, out, err)
        return _compare(arguments, out, err)
    except UsageError as error:
        print(f"mha {arguments.command}: error: {error}", file=err)
        return 2
