"""`lightning-zero convert`'s options for a checkpoint saved without its frozen weights
(``save_frozen=False``): the base to merge back, or the trainable weights alone. Kept apart from
``convert.py`` so that its other options grow there undisturbed."""

from __future__ import annotations

import argparse
from typing import Any, Optional


def add_base_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base",
        metavar="PATH",
        help="for a checkpoint saved with save_frozen=False: the frozen weights it was fine-tuned on, merged into"
        " the output once they match its fingerprint (a torch.save state dict, a .safetensors file, or a directory of them)",
    )
    parser.add_argument(
        "--base-prefix", default=None, metavar="PREFIX", help="put before every name of --base to get the checkpoint's names"
    )
    parser.add_argument(
        "--trainable-only",
        action="store_true",
        help="for a checkpoint saved with save_frozen=False and no --base: write the trainable weights alone",
    )


def base_options(args: argparse.Namespace) -> dict[str, Any]:
    """``convert_checkpoint``'s keyword arguments for the options above."""
    return {"base": args.base, "base_prefix": args.base_prefix or "", "trainable_only": args.trainable_only}


def export_base(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """``export_safetensors``'s ``base``: the tensors of ``--base`` by exported name (the checkpoint's,
    ``--strip-prefix`` removed), or None."""
    if args.base is None:
        return None
    from lightning_zero.checkpoint.frozen_merge import read_base

    strip = args.strip_prefix or ""
    named = read_base(args.base, args.base_prefix or "")
    return {name[len(strip) :]: t for name, t in named.items() if name.startswith(strip)}
