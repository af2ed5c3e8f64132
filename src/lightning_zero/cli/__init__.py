"""The `lightning-zero` console script: one module per subcommand, this one only dispatches.

Each subcommand module (`estimate`, `convert`, `verify`, `bench`) defines a `Subcommand`: a name, a line of
help, a function that adds its arguments and one that runs it. Bad input exits with status 2 and an
argparse-style message, as argparse itself does. Nothing else in the package imports this one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from lightning_zero.cli.bench import BENCH
from lightning_zero.cli.convert import CONVERT
from lightning_zero.cli.estimate import ESTIMATE
from lightning_zero.cli.verify import VERIFY

SUBCOMMANDS = (ESTIMATE, CONVERT, VERIFY, BENCH)
"""Every subcommand, in `--help` order."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`), run the subcommand and return its exit status."""
    parser = argparse.ArgumentParser(
        prog="lightning-zero", description="Tools for lightning-zero, ZeRO stages 1-3 for PyTorch Lightning."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in SUBCOMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(_run=command.run, _parser=sub)
    args = parser.parse_args(argv)
    return args._run(args, args._parser)


if __name__ == "__main__":
    sys.exit(main())
