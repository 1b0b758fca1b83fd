"""What the commands of `mha` share: the usage error, the types of their arguments, and the
progress line they write while they run.

A `UsageError` raised by a command exits 2 with its message (`mha.cli.main`); the types turn
an argument's text into its value or tell argparse why they cannot.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["UsageError", "finite_float", "positive_int", "progress", "seed"]


class UsageError(Exception):
    """A command's arguments that do not go together: `mha` exits 2 with the message."""


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
