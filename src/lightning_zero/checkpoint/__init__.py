"""Checkpoints: sharded directories (torch.distributed.checkpoint), atomic saves, conversion.

Like ``engine/collectives.py`` for communication, this package is the one place that talks to
``torch.distributed.checkpoint`` and DTensor.
"""

from lightning_zero.checkpoint.convert import convert_checkpoint
from lightning_zero.checkpoint.manifest import Manifest, is_sharded_checkpoint

__all__ = ["Manifest", "convert_checkpoint", "is_sharded_checkpoint"]
