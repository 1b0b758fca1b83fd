"""The `mha` command: `mha info`, `mha compare`, `mha verify`, `mha convert`, `mha inspect` and
`mha bench`.

Exit codes: 0 when everything agrees, 1 on any disagreement, 2 on a usage error (including a
backend named with --backends that does not import). `mha convert` and `mha inspect` exit 1
when a file cannot be read or written or the destination cannot express the layer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Sequence

from mha import __version__, bench, conversion, golden, harness, model_config, porting
from mha.checkpoints import read_checkpoint
from mha.registry import (
    BACKENDS,
    INSTALL,
    BackendUnavailableError,
    framework_version,
    load_backend,
    select_backends,
)

__all__ = ["main"]


class _UsageError(Exception):
    pass


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**32 - 1. Received: {value}")
    return value


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
    _add_file_commands(commands)
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
        "--seed", type=_seed, default=0, help="seed of weights and inputs (0 to 2**32 - 1)"
    )
    defaults = harness.Shapes()
    for field in ("batch_size", "num_queries", "num_keys", "num_hiddens", "num_heads"):
        compare.add_argument(
            "--" + field.replace("_", "-"),
            type=_positive_int,
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


def _progress(err):
    interactive = err.isatty()

    def report(done: int, total: int, description: str) -> None:
        if interactive:
            end = "\n" if done == total else ""
            print(f"\r\x1b[K[{done}/{total}] {description}", end=end, file=err, flush=True)
        elif done == total or done % max(1, total // 10) == 0:
            print(f"[{done}/{total}] {description}", file=err, flush=True)

    return report


def _format(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _compare(arguments, out, err) -> int:
    shapes = _compare_shapes(arguments)
    try:
        names, skipped = select_backends(arguments.backends)
    except (ValueError, BackendUnavailableError) as error:
        raise _UsageError(str(error)) from None
    if "jax" in names and arguments.dtype == "float64":
        # JAX computes in float64 only in its 64-bit mode; this process is the command's own
        import jax

        jax.config.update("jax_enable_x64", True)
    rows = harness.compare(
        backends=names,
        dtype=arguments.dtype,
        seed=arguments.seed,
        shapes=shapes,
        progress=_progress(err),
    )
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


def _record(arguments, backend: str, shapes: harness.Shapes, err) -> bool:
    """Write --record's golden cases as `backend` computes them; False (reported) on failure."""
    try:
        golden.record_run(
            arguments.record,
            backend,
            dtype=arguments.dtype,
            seed=arguments.seed,
            shapes=shapes,
            progress=_progress(err),
        )
    except (ValueError, OSError) as error:
        print(f"mha compare: error: {error}", file=err)
        return False
    return True


def _compare_shapes(arguments) -> harness.Shapes:
    """The sizes of compare's arguments; a usage error where no multi-head case can use them
    (a case whose options need other sizes takes its own: harness.fit)."""
    if arguments.num_hiddens % arguments.num_heads != 0:
        raise _UsageError(
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
        raise _UsageError(f"{arguments.path} does not exist or is not a file")
    try:
        names, skipped = select_backends(arguments.backends)
    except (ValueError, BackendUnavailableError) as error:
        raise _UsageError(str(error)) from None
    try:
        cases = golden.read(arguments.path)
    except ValueError as error:
        print(f"mha verify: error: {error}", file=err)
        return 1
    rows = golden.verify(cases, names, arguments.dtype, progress=_progress(err))
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
        return bench.execute(arguments, out, err, _progress(err))
    except (ValueError, BackendUnavailableError) as error:
        raise _UsageError(str(error)) from None
    except OSError as error:  # --output could not be written; the path is left as it was
        print(f"mha bench: error: {error}", file=err)
        return 1


def _add_file_commands(commands) -> None:
    kinds = "; ".join(conversion.FILE_KINDS.values())
    convert = commands.add_parser(
        "convert",
        help="convert MultiHeadAttention weights between mha, torch, Keras and Flax files",
        description="Convert MultiHeadAttention weights from SRC to DST, the kinds told by the "
        f"file names: {kinds}. The configuration is read off the weights; a torch state_dict "
        "does not tell the number of heads, so give --num-heads with one. DST is read back and "
        "must give the same weights before it replaces a file already there (a failure leaves DST "
        "as it was). Exit 0 on success, 1 when a file cannot be read or written or the "
        "destination cannot express the layer, 2 on a usage error.",
    )
    convert.add_argument("source", metavar="SRC")
    convert.add_argument("destination", metavar="DST")
    convert.add_argument(
        "--num-heads",
        type=_positive_int,
        help="number of heads (needed for a torch state_dict source)",
    )
    _add_port_arguments(convert)
    inspect = commands.add_parser(
        "inspect",
        help="print the class, config and weight shapes of a checkpoint",
        description=f"Print the layer class, config and weight shapes of PATH ({kinds}).",
    )
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument(
        "--num-heads", type=_positive_int, help="number of heads, for a torch state_dict"
    )
    _add_port_arguments(inspect)


def _add_port_arguments(parser) -> None:
    parser.add_argument(
        "--prefix",
        metavar="MODULE.PATH",
        help="read SRC as a whole model's weights (.pt, .pth, .safetensors, .msgpack) and take "
        "the attention layer under this path, e.g. bert.encoder.layer.0.attention; the "
        "layout (BERT, ViT, Llama, BART, T5, timm, GPT-2, Keras, Flax, torch) is recognized "
        "from the names there ('' for a file holding one layer)",
    )
    parser.add_argument(
        "--scale",
        type=_finite_float,
        help="the score scale, when the model's differs from its layout's default",
    )
    parser.add_argument(
        "--config",
        metavar="CONFIG.JSON",
        help="a Hugging Face config.json: num_attention_heads, rope_theta, sliding_window and "
        "the score scale are read from it (the options below override it)",
    )
    parser.add_argument(
        "--rope-theta",
        type=_finite_float,
        help="rotary position embeddings of this base (Llama 2: 10000, Llama 3: 500000)",
    )
    parser.add_argument(
        "--rope-interleaved",
        action="store_true",
        help="rotate feature pairs (2i, 2i + 1), as GPT-J and Meta's original Llama weights",
    )
    parser.add_argument(
        "--sliding-window",
        type=_positive_int,
        help="attend only to keys within this many positions (Mistral's window, with causal)",
    )
    parser.add_argument(
        "--layer",
        type=int,
        help="the layer's index in the model, for a --config whose layers differ (Gemma 2 and "
        "3, gpt-oss: sliding and full attention)",
    )


def _file_command(arguments, out, err) -> int:
    paths = [arguments.path] if arguments.command == "inspect" else [arguments.source]
    if arguments.command == "convert":
        paths.append(arguments.destination)
    try:
        kinds = [conversion.file_kind(path) for path in paths]
    except ValueError as error:
        raise _UsageError(str(error)) from None
    if not os.path.isfile(paths[0]):
        raise _UsageError(f"{paths[0]} does not exist or is not a file")
    from_model = arguments.prefix is not None
    options = _check_file_arguments(arguments, paths, kinds)
    try:
        if arguments.command == "inspect":
            if from_model:
                return _inspect_port(paths[0], arguments, options, out)
            return _inspect(paths[0], kinds[0], arguments.num_heads, out)
        config = conversion.convert(
            *paths,
            num_heads=arguments.num_heads,
            prefix=arguments.prefix,
            scale=arguments.scale,
            **options,
        )
    except (ValueError, OSError) as error:
        print(f"mha {arguments.command}: error: {error}", file=err)
        return 1
    layout, left_out = config.pop("layout", None), config.pop("left_out", None)
    described = ", ".join(f"{key}={value!r}" for key, value in config.items())
    source = (
        f"{arguments.prefix!r} of {paths[0]} ({layout})"
        if from_model
        else f"{paths[0]} ({conversion.FILE_KINDS[kinds[0]]})"
    )
    print(
        f"{source} -> {paths[1]} ({conversion.FILE_KINDS[kinds[1]]})\n"
        f"MultiHeadAttention({described}); read back: the same weights",
        file=out,
    )
    if left_out:
        print(f"left out (not attention weights): {', '.join(left_out)}", file=out)
    return 0


def _check_file_arguments(arguments, paths, kinds) -> dict:
    """A usage error for arguments of `mha convert` and `mha inspect` that do not go together,
    or a file kind whose framework does not import; else the layer options given."""
    from_model = arguments.prefix is not None
    if from_model and kinds[0] == "keras":
        raise _UsageError("--prefix reads .pt, .pth, .safetensors or .msgpack files")
    options = _layer_options(arguments)
    if options and arguments.command == "inspect" and not from_model:
        raise _UsageError("--rope-theta, --rope-interleaved and --sliding-window go with --prefix")
    if not from_model and arguments.scale is not None and kinds[0] != "mha":
        raise _UsageError("--scale goes with --prefix, or with an mha checkpoint")
    torch_source = arguments.command == "convert" and kinds[0] == "torch" != kinds[1]
    if torch_source and not from_model and arguments.num_heads is None:
        raise _UsageError(
            f"{paths[0]} is a torch state_dict, which does not tell the number of heads: "
            "give --num-heads"
        )
    needed = {"mha": None, "torch": "torch", "keras": "tensorflow", "flax": "jax"}
    for kind in kinds:
        if needed[kind] is not None:
            try:
                load_backend(needed[kind])
            except BackendUnavailableError as error:
                raise _UsageError(f"{conversion.FILE_KINDS[kind]} files need {error}") from None
    return options


def _layer_options(arguments) -> dict:
    """The layer options of --config, --rope-theta, --rope-interleaved and --sliding-window;
    num_heads from --config too, unless --num-heads gives it."""
    options = {}
    if arguments.config is not None:
        try:
            options = model_config.options_from_config(arguments.config, arguments.layer)
        except ValueError as error:
            raise _UsageError(str(error)) from None
        if arguments.num_heads is None:
            arguments.num_heads = options.get("num_heads")
        if arguments.scale is None:
            arguments.scale = options.get("scale")
        options.pop("num_heads", None)
        options.pop("scale", None)
    elif arguments.layer is not None:
        raise _UsageError("--layer goes with --config")
    given = {
        "rope_theta": arguments.rope_theta,
        "rope_interleaved": arguments.rope_interleaved or None,
        "sliding_window": arguments.sliding_window,
    }
    options.update({key: value for key, value in given.items() if value is not None})
    if options.get("rope_interleaved") and "rope_theta" not in options:
        raise _UsageError("--rope-interleaved goes with --rope-theta (or a --config giving it)")
    return options


def _inspect_port(path: str, arguments, options, out) -> int:
    port = porting.canonical_from_state_dict(
        conversion.read_state(path),
        arguments.prefix,
        num_heads=arguments.num_heads,
        scale=arguments.scale,
        **options,
    )
    print(f"{path}, under {arguments.prefix!r}: {port.layout}", file=out)
    print("class: MultiHeadAttention (config inferred from the weights)", file=out)
    print(f"config: {json.dumps(port.config, sort_keys=True)}", file=out)
    print("weights:", file=out)
    for name, value in port.weights.items():
        print(f"  {name:<4} {tuple(value.shape)!s:<12} {value.dtype}", file=out)
    print(f"read: {', '.join(port.used)}", file=out)
    if port.left_out:
        print(f"left out (not attention weights): {', '.join(port.left_out)}", file=out)
    return 0


def _inspect(path: str, kind: str, num_heads: int | None, out) -> int:
    print(f"{path}: {conversion.FILE_KINDS[kind]}", file=out)
    if kind == "mha":
        checkpoint = read_checkpoint(path)
        class_name, config, weights = (
            checkpoint.class_name,
            checkpoint.config,
            checkpoint.weights,
        )
        saved_from = checkpoint.metadata.get("backend", "-")
        print(f"class: {class_name} (saved from the {saved_from} backend)", file=out)
    else:
        weights, config = conversion.read_file(path, num_heads=num_heads)
        print("class: MultiHeadAttention (config inferred from the weights)", file=out)
    print(f"config: {json.dumps(config, sort_keys=True)}", file=out)
    print("weights:", file=out)
    for name, value in weights.items():
        print(f"  {name:<4} {tuple(value.shape)!s:<12} {value.dtype}", file=out)
    return 0


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
            return _file_command(arguments, out, err)
        if arguments.command == "bench":
            return _bench(arguments, out, err)
        if arguments.command == "verify":
            return _verify(arguments, out, err)
        return _compare(arguments, out, err)
    except _UsageError as error:
        print(f"mha {arguments.command}: error: {error}", file=err)
        return 2
