"""`lightning-zero convert`: a sharded checkpoint directory to one plain Lightning checkpoint file
(`lightning_zero.checkpoint.convert_checkpoint`), or with `--format safetensors` to a Hugging Face
model folder (`lightning_zero.checkpoint.export_safetensors`), in one CPU process. The source is
checked against its checksums first; a missing, damaged or unwritable checkpoint exits with status 2
and one line naming the file and the cause, no traceback; so does one whose pickles name a global
that a weights-only load refuses, unless `--no-weights-only` says it is trusted. A checkpoint saved
without its frozen weights (`save_frozen=False`) needs `--base` (or `--trainable-only`): `frozen_base.py`."""

from __future__ import annotations

import argparse
import os

from lightning_zero.cli.arguments import Subcommand, add_weights_only_argument, parse_memory
from lightning_zero.cli.frozen_base import add_base_arguments, base_options, export_base
from lightning_zero.sizing import format_bytes

LIGHTNING, SAFETENSORS = "lightning", "safetensors"
SAFETENSORS_OPTIONS = {"strip_prefix": "--strip-prefix", "max_shard_size": "--max-shard-size", "dtype": "--dtype", "config": "--config"}
"""The options only `--format safetensors` takes, by their `args` name."""
LIGHTNING_OPTIONS = {"with_optimizer": "--with-optimizer", "weights_only": "--no-weights-only", "trainable_only": "--trainable-only"}
"""The options only `--format lightning` takes (an export reads no optimizer state and no meta.pt)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a sharded checkpoint written by lightning-zero: a directory, or a URL (s3://, gs://, az://, ...)")
    parser.add_argument(
        "dst",
        help="the file to write (a plain Lightning checkpoint), a path or a URL; with --format safetensors the folder"
        " to write (a local path: missing, empty, or an earlier export, which is replaced)",
    )
    parser.add_argument(
        "--format",
        choices=(LIGHTNING, SAFETENSORS),
        default=LIGHTNING,
        help="lightning (default): one checkpoint file for torch.load / load_from_checkpoint; safetensors: the weights"
        " as Hugging Face's save_pretrained writes them, for from_pretrained",
    )
    parser.add_argument(
        "--with-optimizer",
        action="store_true",
        help="also write the full optimizer state (in DDP's format), so training can resume from the file",
    )
    add_weights_only_argument(parser, "unpickle meta.pt as torch.load(weights_only=False) does, which can run code")
    add_base_arguments(parser)
    export = parser.add_argument_group("--format safetensors")
    export.add_argument(
        "--strip-prefix",
        default=None,
        metavar="PREFIX",
        help="removed from the start of every name; names without it are left out (e.g. 'model.' for a LightningModule"
        " holding the Hugging Face model as self.model). Default: names as saved",
    )
    export.add_argument(
        "--max-shard-size", type=parse_memory, default=None, metavar="SIZE", help="bytes per file, e.g. 5GB (the default) or 500MB"
    )
    export.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="cast floating-point weights; default: the checkpoint's")
    export.add_argument("--config", default=None, metavar="CONFIG_JSON", help="a config.json to copy into the folder, for from_pretrained")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _refuse_options_of_the_other_format(args, parser)
    if args.format == SAFETENSORS:
        return _export(args, parser)
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


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lightning_zero.checkpoint import export_safetensors
    from lightning_zero.checkpoint.safetensors_export import DEFAULT_MAX_SHARD_SIZE

    try:
        exported = export_safetensors(
            args.src,
            args.dst,
            strip_prefix=args.strip_prefix or "",
            max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
            dtype=args.dtype,
            config=args.config,
            base=export_base(args),
        )
    except (OSError, ValueError, ImportError) as err:  # no safetensors, a damaged checkpoint, a prefix that maps nothing
        parser.exit(2, f"lightning-zero convert: error: {err}\n")
    weight_files = [name for name in exported.files if name.endswith(".safetensors")]
    index = " and an index" if len(weight_files) < len(exported.files) else ""
    print(f"wrote {exported.out_dir} ({len(weight_files)} safetensors files{index}, {format_bytes(exported.total_size)} of weights)")
    if exported.tied:
        print("tied, written once: " + ", ".join(f"{alias} (as {name})" for alias, name in exported.tied.items()))
    if exported.outside_prefix:
        left_out = exported.outside_prefix
        print(f"left out, outside --strip-prefix: {', '.join(left_out[:5])}" + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""))
    return 0


def _refuse_options_of_the_other_format(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """An option of one format given with the other is a usage error, not silently ignored."""
    others = LIGHTNING_OPTIONS if args.format == SAFETENSORS else SAFETENSORS_OPTIONS
    given = [flag for name, flag in others.items() if getattr(args, name) not in (None, False)]
    if given:
        owner = LIGHTNING if args.format == SAFETENSORS else SAFETENSORS
        parser.error(f"{', '.join(given)} only applies with --format {owner} (this is --format {args.format})")


CONVERT = Subcommand(
    name="convert",
    help="Turn a sharded checkpoint directory into one plain Lightning checkpoint file, or a Hugging Face safetensors folder (no GPUs needed).",
    add_arguments=add_arguments,
    run=run,
)
