"""The `lightning-zero` console script.

Each subcommand is a `Subcommand`: a name, a line of help, a function that adds its arguments and a
function that runs it. `main` only dispatches, so `convert` and `bench` can live in their own modules
and join by adding their `Subcommand` to `_subcommands()`. `estimate`'s command-line layer is here
because it is small; the arithmetic it presents is `lightning_zero.estimate`, and `--model` is
counted by `lightning_zero.model_count`.

Bad input exits with status 2 and an argparse-style message, as argparse itself does.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable, Optional, Sequence

from lightning_zero import estimate as est
from lightning_zero.checkpoint import convert
from lightning_zero import model_count


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`), run the subcommand and return its exit status."""
    parser = argparse.ArgumentParser(
        prog="lightning-zero", description="Tools for lightning-zero, ZeRO stages 1-3 for PyTorch Lightning."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _subcommands():
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_run=command.run, _parser=sub)
    args = parser.parse_args(argv)
    return args._run(args, args._parser)


def _subcommands() -> tuple[Subcommand, ...]:
    """Every subcommand, in `--help` order; a function so that entries defined further down (or imported
    from their own modules) are looked up when `main` runs, not when this module is imported."""
    from lightning_zero.bench.command import BENCH  # imported here: it imports this module

    return (ESTIMATE, CONVERT, BENCH)


# --- argument types: each raises ArgumentTypeError saying what is accepted --------------------------

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
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


# --- estimate --------------------------------------------------------------------------------------


def _add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=parse_count, metavar="N", help="number of parameters, e.g. 7.5e9 or 7.5B")
    model.add_argument(
        "--model",
        metavar="SPEC",
        help="count the parameters of package.module:Class or path/to/file.py:Class, built on the meta device",
    )
    parser.add_argument(
        "--init-args",
        metavar="JSON",
        help="keyword arguments for --model's constructor as a JSON object, e.g. '{\"n_layer\": 12}'",
    )
    parser.add_argument("--devices", type=positive_int, required=True, metavar="N", help="devices (ranks) per node")
    parser.add_argument("--nodes", type=positive_int, default=1, metavar="N", help="number of nodes (default: 1)")
    parser.add_argument(
        "--precision",
        choices=list(est.SCHEMES),
        default="mixed",
        help="bytes per parameter: "
        + "; ".join(f"{s.name} = {s.weight_bytes}+{s.gradient_bytes}+{s.optimizer_bytes}" for s in est.SCHEMES.values())
        + " (weights+gradients+optimizer; default: mixed)",
    )
    parser.add_argument(
        "--gpu-memory",
        type=parse_memory,
        metavar="SIZE",
        help="memory per device, e.g. 80GB or 80 (GB); recommends the cheapest layout that fits",
    )
    parser.add_argument(
        "--host-memory",
        type=parse_memory,
        metavar="SIZE",
        help="memory per node for offloaded states, e.g. 1TB; only used with --gpu-memory",
    )


def _run_estimate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.init_args is not None and args.model is None:
        parser.error("--init-args needs --model")
    if args.host_memory is not None and args.gpu_memory is None:
        parser.error("--host-memory needs --gpu-memory")
    num_params = args.params if args.model is None else _count_model(args.model, args.init_args, parser)
    scheme = est.precision_scheme(args.precision)
    topology = est.Topology(devices=args.devices, nodes=args.nodes)
    estimates = est.estimate_all(num_params, scheme, topology)
    recommendation = None
    if args.gpu_memory is not None:
        recommendation = est.recommend(estimates, args.gpu_memory, args.host_memory)
    report = _EstimateReport(num_params, scheme, topology, estimates, recommendation)
    if sys.stdout.isatty():
        _print_rich(report)
    else:
        _print_plain(report)
    return 0


def _count_model(spec: str, init_args: Optional[str], parser: argparse.ArgumentParser) -> int:
    # A console script runs with its own directory on sys.path, not the working directory as
    # `python -m` does; add it so `--model mypackage.model:Net` finds a package next to the user.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return model_count.count_parameters(spec, init_args)
    except model_count.ModelSpecError as error:
        parser.error(f"--model: {error}")
        raise  # parser.error exits; this line only tells type checkers so


@dataclass(frozen=True)
class _EstimateReport:
    num_params: int
    scheme: est.PrecisionScheme
    topology: est.Topology
    estimates: tuple[est.MemoryEstimate, ...]
    recommendation: Optional[est.Recommendation]

    @property
    def title(self) -> str:
        s, t = self.scheme, self.topology
        return (
            f"Model states of {self.num_params:,} parameters, precision {s.name} "
            f"({s.weight_bytes} B weights + {s.gradient_bytes} B gradients + {s.optimizer_bytes} B optimizer "
            f"per parameter), {t.devices} device(s) x {t.nodes} node(s) = {t.world_size} data-parallel ranks"
        )

    @property
    def unit(self) -> tuple[str, int]:
        """One unit for the whole table, so its columns compare at a glance."""
        return est.decimal_unit(max(e.device.total for e in self.estimates))

    @property
    def headers(self) -> list[str]:
        unit = self.unit[0]
        headers = [
            "layout",
            f"per device ({unit})",
            "weights",
            "gradients",
            "optimizer",
            f"host per node ({unit})",
        ]
        return headers + (["fits"] if self.recommendation else [])

    @property
    def rows(self) -> list[list[str]]:
        size = self.unit[1]

        def number(nbytes: int) -> str:
            return f"{nbytes / size:,.3f}"

        rows = []
        for e in self.estimates:
            row = [
                e.layout.label,
                number(e.device.total),
                number(e.device.weights),
                number(e.device.gradients),
                number(e.device.optimizer),
                number(e.host.total),
            ]
            if self.recommendation:
                r = self.recommendation
                row.append("yes" if est.fits(e, r.gpu_memory, r.host_memory) else "no")
            rows.append(row)
        return rows

    @property
    def footer(self) -> str:
        return self.recommendation.message if self.recommendation else est.LEFT_OUT


def _print_plain(report: _EstimateReport) -> None:
    """Aligned text for pipes and files: the layout column left-aligned, numbers right-aligned."""
    table = [report.headers, *report.rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(report.headers))]
    print(report.title)
    for row in table:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        print("  ".join(cells).rstrip())
    print(report.footer)


def _print_rich(report: _EstimateReport) -> None:
    # Imported here: only a terminal needs rich.
    from rich.console import Console
    from rich.table import Table

    table = Table(title=report.title, caption=report.footer, caption_justify="left")
    for i, header in enumerate(report.headers):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in report.rows:
        table.add_row(*row, style=None if row[-1] != "no" else "dim")
    Console().print(table)


ESTIMATE = Subcommand(
    name="estimate",
    help="Model-state memory per device and per node for DDP and ZeRO stages 1-3, with and without offload.",
    add_arguments=_add_estimate_arguments,
    run=_run_estimate,
)

CONVERT = Subcommand(
    name="convert",
    help="Turn a sharded checkpoint directory into one plain Lightning checkpoint file (no GPUs needed).",
    add_arguments=convert.add_arguments,
    run=convert.run,
)


if __name__ == "__main__":
    sys.exit(main())
