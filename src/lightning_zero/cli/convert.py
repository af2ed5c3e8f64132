"""`lightning-zero convert`: a sharded checkpoint directory to one plain Lightning checkpoint file
(`lightning_zero.checkpoint.convert_checkpoint`), in one CPU process. The source is checked against
its checksums first; a missing, damaged or unwritable checkpoint exits with status 2 and one line
naming the file and the cause, no traceback; so does one whose pickles name a global that a
weights-only load refuses, unless `--no-weights-only` says it is trusted."""

from __future__ import annotations

import argparse
import os

from lightning_zero.cli.arguments import Subcommand, add_weights_only_argument
from lightning_zero.cli.frozen_base import add_base_arguments, base_options
from lightning_zero.sizing import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a sharded checkpoint written by lightning-zero: a directory, or a URL (s3://, gs://, az://, ...)")
    parser.add_argument("dst", help="the file to write (a plain Lightning checkpoint), a path or a URL")
    parser.add_argument(
        "--with-optimizer",
        action="store_true",
        help="also write the full optimizer state (in DDP's format), so training can resume from the file",
    )
    add_weights_only_argument(parser, "unpickle meta.pt as torch.load(weights_only=False) does, which can run code")
    add_base_arguments(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # torch.distributed.checkpoint and DTensor (~0.9 s): imported by this subcommand alone
    from lightning_zero.checkpoint import UntrustedCheckpointError, convert_checkpoint
    try:
        out = convert_checkpoint(
            args.src, args.dst, include_optimizer=args.with_optimizer, weights_only=args.weights_only, **base_options(args)
        )
    except (OSError, ValueError, UntrustedCheckpointError) as err:  # missing, damaged (CorruptCheckpointError), a full disk
        parser.exit(2, f"lightning-zero convert: error: {err}\n")
    size = out.fs.size(out.path) if hasattr(out, "fs") else os.path.getsize(out)  # a URL's object, or a local file
    print(f"wrote {out} ({format_bytes(size)})")
    return 0


CONVERT = Subcommand(
    name="convert",
    help="Turn a sharded checkpoint directory into one plain Lightning checkpoint file (no GPUs needed).",
    add_arguments=add_arguments,
    run=run,
)
