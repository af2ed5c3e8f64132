"""What every subcommand shares: the `Subcommand` record and argument types whose errors say what is
accepted (argparse turns their `ArgumentTypeError` into a usage error, status 2)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Callable


@dataclass(frozen=True)
class Subcommand:
    """One `lightning-zero NAME ...` command."""

    name: str
    help: str
    """One line, shown by `lightning-zero --help`."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]
    """Runs the parsed command and returns the exit status. It gets its parser so that checks argparse
    cannot express (e.g. one option needing another) fail the same way, via `parser.error` (status 2)."""


def add_weights_only_argument(parser: argparse.ArgumentParser, effect: str) -> None:
    """`--no-weights-only` (`args.weights_only`: False, else None): the checkpoint is trusted, its
    meta.pt may hold any Python object; ``effect``: what the subcommand then does, for the help."""
    parser.add_argument(
        "--no-weights-only",
        dest="weights_only",
        action="store_false",
        default=None,
        help=f"only for a checkpoint you trust: {effect}. Default: meta.pt is read by torch's weights-only"
        " unpickler, and a checkpoint naming anything else is refused",
    )


_COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_MEMORY_UNITS = {
    "": 10**9,  # a bare number is decimal GB, the unit of GPU spec sheets ("80 GB")
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_count(text: str) -> int:
    """A parameter count: `7500000000`, `7_500_000_000`, `7.5e9`, `7.5B`, `125M`, `350k`."""
    accepted = "a positive whole number such as 7500000000, 7.5e9, 7.5B or 125M"
    body = text.strip().replace("_", "")
    factor = _COUNT_SUFFIXES.get(body[-1:].lower(), 1)
    if factor != 1:
        body = body[:-1]
    try:
        # Decimal, not float: 7.24e9 must become exactly 7240000000.
        value = Decimal(body) * factor
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected {accepted}") from None
    if not value.is_finite() or value < 1 or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of parameters; expected {accepted}")
    return int(value)


def parse_memory(text: str) -> int:
    """A memory size in bytes: `80` or `80GB` (decimal GB), `80000MB`, `79.6GiB`, `1.5TB`."""
    accepted = "a positive size such as 80 (GB), 80GB, 80000MB or 79.6GiB; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
    body = text.strip().replace(" ", "")
    digits = len(body.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    number, unit = body[:digits], body[digits:].lower()
    if unit not in _MEMORY_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} has an unknown unit {unit!r}; expected {accepted}")
    try:
        value = Decimal(number) * _MEMORY_UNITS[unit]
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size; expected {accepted}") from None
    if not value.is_finite() or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive memory size; expected {accepted}")
    return int(value)


def positive_int(text: str) -> int:
    """A count of devices or nodes: a whole number, at least 1."""
    return _checked(text, int, lambda value: value >= 1, "is not a positive whole number")


def non_negative_int(text: str) -> int:
    """A count that may be 0, such as untimed warm-up steps."""
    return _checked(text, int, lambda value: value >= 0, "is not a whole number (0 or more)")


def positive_float(text: str) -> float:
    """A size or a duration: a number above 0."""
    return _checked(text, float, lambda value: value > 0, "is not a positive number")


def non_negative_float(text: str) -> float:
    """A duration that may be 0, such as a sleep: a finite number, 0 or more."""
    return _checked(text, float, lambda value: 0 <= value < float("inf"), "is not a finite number (0 or more)")


def _checked(text: str, convert: Callable[[str], Any], accept: Callable[[Any], bool], complaint: str) -> Any:
    """``convert(text)`` if it succeeds and ``accept`` takes the value, else the usage error
    "'<text>' <complaint>"."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not accept(value):
        raise argparse.ArgumentTypeError(f"{text!r} {complaint}")
    return value
