"""A whole Lightning checkpoint to and from a sharded directory (see ``sharded.py`` for the format).

Lightning builds a checkpoint as one dict; under ZeRO its ``state_dict`` and ``optimizer_states``
entries are this rank's chunks (``model_tensors`` / ``optimizer_shards``). Here they go to DCP,
written by every rank, and the rest — loops, callbacks, LR schedulers, precision state,
hyperparameters — to ``meta.pt``, written by rank 0.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.manifest import PathLike
from lightning_zero.checkpoint.sharded import SHARD_KEY_PREFIXES, build_manifest, load_model, load_optimizer
from lightning_zero.checkpoint.storage import CheckpointGroup, read_meta, verify_on_ranks, write_directory
from lightning_zero.engine import ZeroEngine

OPTIMIZERS_KEY = "lightning_zero_optimizers"
"""Where meta.pt keeps what of each optimizer's state is not a tensor: its param groups (with
parameter names) and non-tensor values."""


def save_directory(
    directory: PathLike, checkpoint: dict[str, Any], module: nn.Module, engine: ZeroEngine, stage: int, world_size: int, group: CheckpointGroup
) -> None:
    """Write ``checkpoint`` into ``directory`` (a collective: every rank calls it)."""
    check_holds_shards(checkpoint)
    optimizers = checkpoint.get("optimizer_states", [])  # absent for weights-only checkpoints
    tensors = dict(checkpoint["state_dict"])
    for shards in optimizers:
        tensors.update(shards.tensors)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta[OPTIMIZERS_KEY] = [{"param_groups": o.param_groups, "values": o.values} for o in optimizers]
    manifest = build_manifest(module, engine, stage, world_size, optimizers)
    write_directory(directory, tensors, meta, manifest, group)


def check_holds_shards(checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint whose ``state_dict`` is no longer the shards the strategy put there: a
    callback's ``on_save_checkpoint`` replaced it (Lightning's ``WeightAveraging``/EMA callbacks put
    the averaged model's full weights there), and writing it would lose the weights silently."""
    foreign = [key for key in checkpoint.get("state_dict", {}) if not key.startswith(SHARD_KEY_PREFIXES)]
    if foreign:
        replaced_by = " (moved to 'current_model_state' by a WeightAveraging callback)" if "current_model_state" in checkpoint else ""
        raise ValueError(
            "A callback replaced the checkpoint's `state_dict`" + replaced_by + f" with plain weights (e.g. {foreign[0]!r}),"
            " which a sharded checkpoint directory cannot hold. HINT: save one file instead:"
            " `ZeroStrategy(..., state_dict_type=\"full\")`."
        )


def load_directory(
    directory: PathLike,
    module: nn.Module,
    engine: Optional[ZeroEngine],
    optimizers: Sequence[Optimizer],
    strict: bool,
    group: CheckpointGroup,
) -> dict[str, Any]:
    """Load the weights (and the ``optimizers``' state, when given) straight into this rank's
    chunks, at any world size and stage; returns the rest of the checkpoint for Lightning, with
    empty ``state_dict`` / ``optimizer_states`` entries (already restored). Every file is checked
    against its checksum first, each rank checking a share."""
    manifest = verify_on_ranks(directory, group)
    meta = read_meta(directory)
    load_model(directory, manifest, module, engine, group, strict=strict)
    if engine is not None:
        for index, optimizer in enumerate(optimizers):
            load_optimizer(directory, manifest, meta[OPTIMIZERS_KEY], engine, optimizer, index, group)
    return {**meta, "state_dict": {}, "optimizer_states": [{} for _ in manifest.optimizers]}
