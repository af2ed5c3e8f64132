"""A whole Lightning checkpoint to and from a sharded directory (see ``sharded.py`` for the format).

Lightning builds a checkpoint as one dict; under ZeRO its ``state_dict`` and ``optimizer_states``
entries are this rank's chunks (``model_tensors`` / ``optimizer_shards``). Here they go to DCP,
written by every rank, and the rest — loops, callbacks, LR schedulers, precision state,
hyperparameters — to ``meta.pt``, written by rank 0.

A weight-averaging callback (Lightning's ``WeightAveraging``: ``EMAWeightAveraging``) replaces
``state_dict`` with its averaged copy's full weights and moves the chunks to ``current_model_state``
in its ``on_save_checkpoint``. Both are kept, as in DDP's file: the average as the weights (each rank
writing its chunk of it), the chunks under ``current/``. A load puts the average into the module, as
DDP's does; resuming a fit with the callback also hands it both in full, which it needs.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.manifest import PathLike
from lightning_zero.checkpoint.sharded import (
    CURRENT_PREFIX,
    SHARD_KEY_PREFIXES,
    build_manifest,
    load_model,
    load_optimizer,
    mesh_of,
    model_tensors,
    read_full_state,
)
from lightning_zero.checkpoint.storage import CheckpointGroup, read_meta, verify_on_ranks, write_directory
from lightning_zero.engine import ZeroEngine

OPTIMIZERS_KEY = "lightning_zero_optimizers"
"""Where meta.pt keeps what of each optimizer's state is not a tensor: its param groups (with
parameter names) and non-tensor values."""
AVERAGED_KEY = "lightning_zero_averaged"
"""True in meta.pt when the weights are a weight-averaging callback's average (see above)."""
CURRENT_MODEL_STATE = "current_model_state"
"""Where Lightning's ``WeightAveraging`` moves the weights it replaces with the average."""


def save_directory(
    directory: PathLike, checkpoint: dict[str, Any], module: nn.Module, engine: ZeroEngine, stage: int, world_size: int, group: CheckpointGroup
) -> None:
    """Write ``checkpoint`` into ``directory`` (a collective: every rank calls it)."""
    tensors, averaged = weight_entries(checkpoint, module, engine, group)
    optimizers = checkpoint.get("optimizer_states", [])  # absent for weights-only checkpoints
    for shards in optimizers:
        tensors.update(shards.tensors)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", CURRENT_MODEL_STATE)}
    meta[OPTIMIZERS_KEY] = [{"param_groups": o.param_groups, "values": o.values} for o in optimizers]
    meta[AVERAGED_KEY] = averaged
    manifest = build_manifest(module, engine, stage, world_size, optimizers)
    write_directory(directory, tensors, meta, manifest, group)


def _holds_shards(state: dict[str, Any]) -> bool:
    return all(key.startswith(SHARD_KEY_PREFIXES) for key in state)


def weight_entries(
    checkpoint: dict[str, Any], module: nn.Module, engine: ZeroEngine, group: CheckpointGroup
) -> tuple[dict[str, Any], bool]:
    """The DCP entries of the checkpoint's weights, and whether they are a weight-averaging
    callback's average (the training weights then beside them, under ``current/``). Refuses a
    ``state_dict`` that a callback replaced with plain weights otherwise: writing it would lose the
    weights silently."""
    state = checkpoint.get("state_dict", {})
    if _holds_shards(state):
        return dict(state), False
    current = checkpoint.get(CURRENT_MODEL_STATE)
    if current is not None and _holds_shards(current):
        missing = [name for name, _ in module.named_parameters() if name not in state]
        if missing:
            raise ValueError(
                f"A weight-averaging callback put weights into the checkpoint's `state_dict` that lack {missing[:5]}"
                " of the module's parameters. HINT: save one file instead: `ZeroStrategy(..., state_dict_type=\"full\")`."
            )
        entries = model_tensors(module, engine, mesh_of(group, engine), weights=state)
        entries.update({CURRENT_PREFIX + key: value for key, value in current.items()})
        return entries, True
    foreign = next(key for key in state if not key.startswith(SHARD_KEY_PREFIXES))
    raise ValueError(
        f"A callback replaced the checkpoint's `state_dict` with plain weights (e.g. {foreign!r}),"
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
    averaging_states: bool = False,
) -> dict[str, Any]:
    """Load the weights (and the ``optimizers``' state, when given) straight into this rank's
    chunks, at any world size and stage; returns the rest of the checkpoint for Lightning, with
    empty ``state_dict`` / ``optimizer_states`` entries (already restored). Every file is checked
    against its checksum first, each rank checking a share.

    ``averaging_states``: for a fit resumed with a weight-averaging callback, the checkpoint's
    weights (its average, if saved with one) are also returned in full under ``state_dict``, and
    its training weights under ``current_model_state``, as in DDP's file, for the callback to
    restore (each rank reads them all: up to two full copies of the weights in host memory while
    the callback loads them)."""
    manifest = verify_on_ranks(directory, group)
    meta = read_meta(directory)
    averaged = meta.pop(AVERAGED_KEY, False)
    load_model(directory, manifest, module, engine, group, strict=strict)
    if engine is not None:
        for index, optimizer in enumerate(optimizers):
            load_optimizer(directory, manifest, meta[OPTIMIZERS_KEY], engine, optimizer, index, group)
    checkpoint = {**meta, "state_dict": {}, "optimizer_states": [{} for _ in manifest.optimizers]}
    if averaging_states:  # the callback starts its average from `state_dict`, saved with one or not
        checkpoint["state_dict"] = read_full_state(directory, manifest)
        if averaged:
            checkpoint[CURRENT_MODEL_STATE] = read_full_state(directory, manifest, CURRENT_PREFIX)
    return checkpoint
