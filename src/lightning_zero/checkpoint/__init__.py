"""Checkpoints: sharded directories (torch.distributed.checkpoint), checksums, atomic saves,
conversion (to one Lightning file, or to a Hugging Face safetensors folder) and verification.

Like ``engine/comm/collectives.py`` for communication, this package is the one place that talks to
``torch.distributed.checkpoint`` and DTensor.
"""

from lightning_zero.checkpoint.convert import checkpoint_file, convert_checkpoint, full_checkpoint
from lightning_zero.checkpoint.errors import CheckpointReadError, CheckpointWriteError, CorruptCheckpointError, UntrustedCheckpointError
from lightning_zero.checkpoint.frozen import FrozenWeightsMismatchError
from lightning_zero.checkpoint.manifest import Manifest, is_sharded_checkpoint
from lightning_zero.checkpoint.safetensors_export import ExportedModel, export_safetensors
from lightning_zero.checkpoint.verify import verify_checkpoint

__all__ = [
    "CheckpointReadError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "ExportedModel",
    "FrozenWeightsMismatchError",
    "Manifest",
    "UntrustedCheckpointError",
    "checkpoint_file",
    "convert_checkpoint",
    "export_safetensors",
    "full_checkpoint",
    "is_sharded_checkpoint",
    "verify_checkpoint",
]
