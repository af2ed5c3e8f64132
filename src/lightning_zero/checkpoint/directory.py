"""A whole Lightning checkpoint to and from a sharded directory (see ``sharded.py`` for the format).

Lightning builds a checkpoint as one dict; under ZeRO its ``state_dict`` and ``optimizer_states``
entries are this rank's chunks (``model_tensors`` / ``optimizer_shards``). Here they go to DCP,
written by every rank, and the rest — loops, callbacks, LR schedulers, precision state,
hyperparameters — to ``meta.pt``, written by rank 0.

A weight-averaging callback (Lightning's ``WeightAveraging``: ``EMAWeightAveraging``) replaces
``state_dict`` with its average and moves the chunks to ``current_model_state`` in its
``on_save_checkpoint``; under ZeRO its average is this rank's chunks too
(``lightning/sharded_averaging.py``). Both are kept, as in DDP's file: the average as the weights,
the training weights under ``current/``. A load puts the average into the module, as DDP's does;
resuming a fit with the callback also hands it both, as this rank's chunks.

Lightning's ``StochasticWeightAveraging`` keeps its average in its own state (``callbacks`` in the
checkpoint); under ZeRO that entry holds shards, which go to DCP under ``callbacks/<i>/<field>/``
with a stub left in meta.pt, and come back as this rank's chunks (whole, in ``convert.py``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.frozen import FrozenRecord, check_model_frozen
from lightning_zero.checkpoint.manifest import Manifest, PathLike
from lightning_zero.checkpoint.sharded import (
    CURRENT_PREFIX,
    SHARD_KEY_PREFIXES,
    build_manifest,
    host_entries,
    load_model,
    load_optimizer,
    mesh_of,
    read_chunks,
)
from lightning_zero.checkpoint.storage import CheckpointGroup, read_dcp_metadata, read_meta, verify_on_ranks, write_directory
from lightning_zero.engine import ZeroEngine

OPTIMIZERS_KEY = "lightning_zero_optimizers"
"""Where meta.pt keeps what of each optimizer's state is not a tensor: its param groups (with
parameter names) and non-tensor values."""
AVERAGED_KEY = "lightning_zero_averaged"
"""True in meta.pt when the weights are a weight-averaging callback's average (see above)."""
CURRENT_MODEL_STATE = "current_model_state"
"""Where Lightning's ``WeightAveraging`` moves the weights it replaces with the average."""
SHARDED_ENTRY = "lightning_zero_sharded_entry"
"""In meta.pt, the stub left for a callback's state entry that holds shards: the prefix of its DCP keys."""


class DirectoryContents(NamedTuple):
    """What a sharded directory holds, before it is written: the DCP entries (this rank's chunks,
    DTensors, and plain tensors, where training keeps them: the save copies them to the host),
    meta.pt's dict and the manifest."""

    tensors: dict[str, Any]
    meta: dict[str, Any]
    manifest: Manifest


def save_directory(
    directory: PathLike,
    checkpoint: dict[str, Any],
    module: nn.Module,
    engine: ZeroEngine,
    stage: int,
    world_size: int,
    group: CheckpointGroup,
    frozen: Optional[FrozenRecord] = None,
) -> None:
    """Write ``checkpoint`` into ``directory`` (a collective: every rank calls it), its device
    tensors copied to the host first (see [Note: host copies of a save] in ``sharded.py``)."""
    contents = directory_contents(checkpoint, module, engine, stage, world_size, frozen)
    write_directory(directory, host_entries(contents.tensors, group), contents.meta, contents.manifest, group)


def directory_contents(
    checkpoint: dict[str, Any], module: nn.Module, engine: ZeroEngine, stage: int, world_size: int, frozen: Optional[FrozenRecord] = None
) -> DirectoryContents:
    """``checkpoint`` split into what each file of the directory holds (no communication).
    ``frozen``: the fingerprint of the frozen parameters its weights leave out, if they do."""
    tensors, averaged = weight_entries(checkpoint)
    optimizers = checkpoint.get("optimizer_states", [])  # absent for weights-only checkpoints
    for shards in optimizers:
        tensors.update(shards.tensors)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", CURRENT_MODEL_STATE)}
    if "callbacks" in meta:
        meta["callbacks"] = _move_callback_shards(meta["callbacks"], tensors)
    meta[OPTIMIZERS_KEY] = [{"param_groups": o.param_groups, "values": o.values} for o in optimizers]
    meta[AVERAGED_KEY] = averaged
    return DirectoryContents(tensors, meta, build_manifest(module, engine, stage, world_size, optimizers, frozen))


def _holds_shards(state: dict[str, Any]) -> bool:
    return all(key.startswith(SHARD_KEY_PREFIXES) for key in state)


def weight_entries(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The DCP entries of the checkpoint's weights, and whether they are a weight-averaging
    callback's average (the training weights then beside them, under ``current/``). Refuses a
    ``state_dict`` that a callback replaced with plain weights: writing it would lose the weights
    silently."""
    state = checkpoint.get("state_dict", {})
    current = checkpoint.get(CURRENT_MODEL_STATE)
    if _holds_shards(state) and current is None:
        return dict(state), False
    if _holds_shards(state) and _holds_shards(current):
        return {**state, **{CURRENT_PREFIX + key: value for key, value in current.items()}}, True
    foreign = next((key for key in state if not key.startswith(SHARD_KEY_PREFIXES)), None)
    raise ValueError(
        f"A callback replaced the checkpoint's `state_dict` with plain weights (e.g. {foreign!r}),"
        " which a sharded checkpoint directory cannot hold. HINT: save one file instead:"
        " `ZeroStrategy(..., state_dict_type=\"full\")`."
    )


def _move_callback_shards(callbacks: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The callbacks' states for meta.pt: each entry that holds shards (a dict of ``model/`` and
    ``buffer/`` keys) moves into ``tensors`` under its own prefix, a stub naming it left behind."""
    kept: dict[str, Any] = {}
    for index, (key, state) in enumerate(callbacks.items()):
        if isinstance(state, dict):
            state = dict(state)
            for field, value in state.items():
                if isinstance(value, dict) and value and _holds_shards(value):
                    prefix = f"callbacks/{index}/{field}/"
                    tensors.update({prefix + name: t for name, t in value.items()})
                    state[field] = {SHARDED_ENTRY: prefix}
        kept[key] = state
    return kept


def read_callback_shards(callbacks: dict[str, Any], read: Callable[[str], dict[str, Tensor]]) -> None:
    """Put back, in place, each callback state entry that ``_move_callback_shards`` stubbed, as
    ``read(prefix)`` gives it (this rank's chunks, or whole tensors)."""
    for state in callbacks.values():
        if isinstance(state, dict):
            for field, value in state.items():
                if isinstance(value, dict) and SHARDED_ENTRY in value:
                    state[field] = read(value[SHARDED_ENTRY])


def load_directory(
    directory: PathLike,
    module: nn.Module,
    engine: Optional[ZeroEngine],
    optimizers: Sequence[Optimizer],
    strict: bool,
    group: CheckpointGroup,
    weights_only: Optional[bool] = None,
    averaging_states: bool = False,
) -> dict[str, Any]:
    """Load the weights (and the ``optimizers``' state, when given) straight into this rank's
    chunks, at any world size and stage; returns the rest of the checkpoint for Lightning, with
    empty ``state_dict`` / ``optimizer_states`` entries (already restored). Every file is checked
    against its checksum first, each rank checking a share; where the frozen weights were left out
    (``save_frozen=False``), the module's own are kept, once they match the checkpoint's fingerprint
    of them (``frozen.py``; refused on every rank before anything is loaded otherwise).
    ``weights_only``: how meta.pt is unpickled,
    as for a checkpoint file (see [Note: untrusted checkpoints] in ``pickles.py``).

    ``averaging_states``: for a fit resumed with a weight-averaging callback, the checkpoint's
    weights (its average, if saved with one) are also returned under ``state_dict``, and its
    training weights under ``current_model_state``, as in DDP's file, for the callback to restore:
    as shard entries (``read_chunks``), each rank reading its chunks only. A callback state entry
    saved as shards comes back the same way."""
    manifest = verify_on_ranks(directory, group)
    meta = read_meta(directory, weights_only)
    averaged = meta.pop(AVERAGED_KEY, False)
    dcp_metadata = read_dcp_metadata(directory)  # once for every read below
    if manifest.frozen:  # before anything changes: the model's frozen weights are the ones trained on
        check_model_frozen(manifest.frozen, module, engine, group, str(directory), strict)
    load_model(directory, manifest, module, engine, group, strict=strict, dcp_metadata=dcp_metadata)
    if engine is not None:
        for index, optimizer in enumerate(optimizers):
            load_optimizer(directory, manifest, meta[OPTIMIZERS_KEY], engine, optimizer, index, group, dcp_metadata)
    checkpoint = {**meta, "state_dict": {}, "optimizer_states": [{} for _ in manifest.optimizers]}

    def chunks(prefix: str = "") -> dict[str, Tensor]:  # a mesh only when asked: a process with no process group loads too
        return read_chunks(directory, manifest, group, mesh_of(group, engine), prefix, dcp_metadata)

    read_callback_shards(checkpoint.get("callbacks", {}), chunks)
    if averaging_states:  # the callback starts its average from `state_dict`, saved with one or not
        checkpoint["state_dict"] = chunks()
        if averaged:
            checkpoint[CURRENT_MODEL_STATE] = chunks(CURRENT_PREFIX)
    return checkpoint
