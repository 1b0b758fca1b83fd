"""What the commands of `mha` share: the usage error, the types of their arguments, the
progress line they write while they run, and the frameworks' log lines set aside meanwhile.

A `UsageError` raised by a command exits 2 with its message (`mha.cli.main`); the types turn
an argument's text into its value or tell argparse why they cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys
import tempfile

__all__ = [
    "OneLineParser",
    "UsageError",
    "finite_float",
    "format_difference",
    "framework_logs_aside",
    "placeable",
    "positive_int",
    "print_table",
    "progress",
    "reference_precision",
    "seed",
]


class UsageError(Exception):
    """A command's arguments that do not go together: `mha` exits 2 with the message."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line, as a UsageError's are (its
    commands' parsers are of the same class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} -h for usage)\n")


def positive_int(text: str) -> int:
    """The argument type of a size: a whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """The argument type of a finite number."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """The argument type of a finite number above 0 (a time budget)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def seed(text: str) -> int:
    """The argument type of a seed: a whole number from 0 to 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**32 - 1. Received: {value}")
    return value


def progress(err):
    """A reporter `progress(done, total, description)` writing to `err`: one line rewritten
    in place on a terminal, about ten lines otherwise."""
    interactive = err.isatty()

    def report(done: int, total: int, description: str) -> None:
        if interactive:
            end = "\n" if done == total else ""
            print(f"\r\x1b[K[{done}/{total}] {description}", end=end, file=err, flush=True)
        elif done == total or done % max(1, total // 10) == 0:
            print(f"[{done}/{total}] {description}", file=err, flush=True)

    return report


_LOG_TAIL = 64 * 1024


@contextlib.contextmanager
def framework_logs_aside(err, kept: list[str]):
    """While the body runs, what the frameworks' native code writes to the process's standard
    error (TensorFlow's and XLA's C++ log lines, oneDNN's notes) goes to a temporary file, and
    its text is appended to `kept` on leaving; the descriptor is restored then. Yields the
    stream for mha's own messages: `err`, or where `err` is that standard error, a copy of it
    that still reaches the terminal. Where the descriptor cannot be copied, nothing changes."""
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield err
        return
    own = None
    try:
        with tempfile.TemporaryFile() as aside:
            os.dup2(aside.fileno(), 2)
            if _descriptor(err) == 2:
                copy = io.FileIO(os.dup(saved), "w")
                # As Python's own standard error: a name no encoding holds is escaped
                encoding = getattr(err, "encoding", None) or "utf-8"
                own = err = io.TextIOWrapper(
                    copy, encoding=encoding, errors="backslashreplace", line_buffering=True
                )
            try:
                yield err
            finally:
                if sys.stderr is not None:
                    sys.stderr.flush()
                os.dup2(saved, 2)
                # The last lines, at most _LOG_TAIL bytes: a framework may write without end
                aside.seek(max(0, aside.seek(0, os.SEEK_END) - _LOG_TAIL))
                kept.append(aside.read(_LOG_TAIL).decode("utf-8", "replace"))
    finally:
        if own is not None:
            own.close()
        os.close(saved)


def _descriptor(stream) -> int | None:
    """The file descriptor `stream` writes to, or None (a StringIO, a captured stream)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def placeable(names: list[str], skipped: dict[str, str], device: str) -> list[str]:
    """The backends of a default selection that reach `device`, the others added to skipped
    with the reason (named in --backends, such a backend is a usage error)."""
    from mha.harness import device_of

    placed = []
    for name in names:
        try:
            device_of(name, device)
            placed.append(name)
        except ValueError as error:
            skipped[name] = str(error)
    if all(name == "numpy" for name in placed):
        reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
        raise ValueError(f"no framework here runs on the {device} ({reasons})")
    return placed


def reference_precision(names, dtype: str | None) -> None:
    """Set this process, the command's own, to compute as the reference does: JAX's 64-bit
    mode for a float64 run (JAX computes in float64 only there), and TensorFlow's TF32 off
    (on by default on NVIDIA GPUs since Ampere; its only switch is process-wide, which mha's
    layers leave to their user: docs/backends.md)."""
    if "jax" in names and dtype == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)
    if "tensorflow" in names:
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)


def format_difference(value: float | None) -> str:
    """A difference as the reports print it: 1.2e-07, or - where there is none."""
    return "-" if value is None else f"{value:.1e}"


def print_table(rows, columns, out) -> None:
    """One line per row: its case, backend, output shape, differences and result."""
    width = max([len(row.case) for row in rows] + [13])
    headings = "  ".join(f"{heading:>{max(8, len(heading))}}" for heading, _ in columns)
    header = (
        f"{'layer [masks]':<{width}}  {'backend':<10}  {'output shape':<14}  {headings}  result"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for row in rows:
        shape = "-" if row.output_shape is None else str(row.output_shape)
        values = "  ".join(
            f"{format_difference(getattr(row, field)):>{max(8, len(heading))}}"
            for heading, field in columns
        )
        line = f"{row.case:<{width}}  {row.backend:<10}  {shape:<14}  {values}  "
        line += "ok" if row.passed else "FAIL"
        if row.error:
            line += f"  ({row.error})"
        print(line, file=out)
