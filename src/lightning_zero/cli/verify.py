"""`lightning-zero verify PATH`: check a checkpoint on disk without loading a model
(`lightning_zero.checkpoint.verify_checkpoint`) — for a sharded directory the manifest, every file's
size and checksum, DCP's metadata and meta.pt; for a single file its zip records' checksums. At a
URL the files are read in place, and version folders that interrupted saves left there are named.

Prints one `OK` line and exits 0, or names the damaged file and the cause and exits 1 — also for a
pickle naming a global that a weights-only load refuses (unless `--no-weights-only`: then meta.pt is
not unpickled, and those globals are listed); a path that does not exist or is not a checkpoint
exits 2, as bad input does in every subcommand.
"""

from __future__ import annotations

import argparse

from lightning_zero.cli.arguments import Subcommand, add_weights_only_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a sharded checkpoint directory or a checkpoint file, local or at a URL (s3://, gs://, az://, ...)")
    add_weights_only_argument(parser, "do not unpickle meta.pt; list what it names beyond the weights-only allow list")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # torch.distributed.checkpoint and DTensor (~0.9 s): imported by this subcommand alone
    from lightning_zero.checkpoint import CorruptCheckpointError, UntrustedCheckpointError, verify_checkpoint
    try:
        summary = verify_checkpoint(args.path, weights_only=args.weights_only is not False)
    except (CorruptCheckpointError, UntrustedCheckpointError) as err:
        parser.exit(1, f"lightning-zero verify: error: {err}\n")
    except (OSError, ValueError) as err:  # missing, or not a checkpoint
        parser.exit(2, f"lightning-zero verify: error: {err}\n")
    print(summary)
    return 0


VERIFY = Subcommand(
    name="verify",
    help="Check a checkpoint's files (sizes, checksums, metadata) without loading a model.",
    add_arguments=add_arguments,
    run=run,
)
