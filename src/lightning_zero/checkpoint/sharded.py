"""Sharded checkpoint directories, written and read with ``torch.distributed.checkpoint`` (DCP).

Layout of ``<path>/``::

    .metadata, __<rank>_0.distcp   DCP: every rank writes its own chunks, in parallel
    meta.pt                        rank 0: the rest of the Lightning checkpoint
    lightning_zero.json            the manifest, written last (see manifest.py), with the size and
                                   CRC-32 of every other file (see integrity.py)

DCP keys (flat, "/"-separated so that parameter names keep their dots)::

    model/<param>                  1-D DTensor sharded like torch.chunk over the ranks: the flat
                                   parameter, each rank holding its chunk (our exact layout)
    model/<param>                  or a plain tensor, for a parameter no rank shards (stages 1-2:
                                   one in no optimizer); identical on every rank, stored once.
                                   With ``save_frozen=False`` no entry for a frozen parameter: the
                                   manifest's ``frozen`` holds its fingerprint instead (``frozen.py``)
    buffer/<state_dict key>        plain tensor: rank 0's, as DDP's checkpoint holds (the ranks'
                                   BatchNorm statistics differ; see [Note: which rank writes a
                                   whole entry] in save_plan.py)
    optim/<i>/<param>/<state key>  1-D DTensor for per-element state (Adam's moments), plain
                                   tensor for the rest (a step count)
    current/model/<param>,         only when a weight-averaging callback saved (Lightning's
    current/buffer/<key>           ``WeightAveraging``, e.g. EMA): the training weights, which the
                                   callback moves to ``current_model_state``; ``model/`` and
                                   ``buffer/`` then hold the average, as DDP's ``state_dict`` does
    callbacks/<i>/<field>/model/…, a callback's state entry that holds shards (Lightning's SWA
    callbacks/<i>/<field>/buffer/… average, ``lightning/sharded_averaging.py``), laid out as the
                                   weights; meta.pt keeps a stub in its place (``directory.py``)

Why DTensor: plain tensors saved under one key by every rank are deduplicated by DCP as if
replicated, silently keeping rank 0's chunk only. A DTensor tells DCP which slice each rank
holds, so a checkpoint loads at any world size and any stage: loading asks for the slices the
new layout needs.

[Note: host copies of a save]
The entries ``model_tensors`` and ``optimizer_shards`` return are the tensors training keeps, where
it keeps them, never copied: on the device (DTensors on a mesh of the device's type, see
``CheckpointGroup.mesh_for``) or on the host (offloaded chunks and optimizer state, everything on a
CPU run). The save copies each to the host once, right before DCP writes it:

- synchronous (``host_entries``): a blocking copy of each device tensor into new memory; host
  tensors are written as they are, training waiting for the write;
- asynchronous (``StagingBuffers.stage`` in ``async_save.py``): every tensor straight into the
  staging arena, device tensors with one non-blocking copy each into pinned memory and one stream
  synchronization for the whole save, host tensors with one host copy.

Either way DCP sees host tensors only (DTensors on the CPU's mesh): its planner and files are the
same as ever, and its writer threads never touch CUDA (see ``_writer`` in ``storage.py``).

Reading and writing the files (with checksums and errors that name the file) is ``storage.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from lightning_zero.checkpoint.errors import CorruptCheckpointError
from lightning_zero.checkpoint.frozen import FrozenRecord
from lightning_zero.checkpoint.manifest import Manifest, PathLike
from lightning_zero.checkpoint.storage import CheckpointGroup, read_dcp_metadata, read_tensors, tensor_metadata
from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.optimizer.averaged_shards import AveragedShards
from lightning_zero.engine.shards.partition import ChunkLayout
from lightning_zero.engine.shards.sharded_param import ShardedParam

SHARDED, TENSOR, VALUE = "sharded", "tensor", "value"
SHARD_KEY_PREFIXES = ("model/", "buffer/")
"""Every key of the weights' part of a sharded checkpoint starts with one of these (see above)."""
CURRENT_PREFIX = "current/"
"""Before ``SHARD_KEY_PREFIXES``: the training weights when the saved ``state_dict`` is an average."""


def _flat_dtensor(local: Tensor, numel: int, mesh: DeviceMesh) -> DTensor:
    """This rank's chunk as a slice of the flat parameter (``torch.chunk`` layout, as ours); on a
    hybrid mesh the same slice is held by each shard group (``Replicate`` across them). ``local``
    must be on ``mesh``'s device type (``DTensor.from_local`` would copy it there)."""
    local = local.detach().reshape(-1)
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))


def _chunk_entry(local: Tensor, numel: int, group: CheckpointGroup, engine: Optional[ZeroEngine]) -> DTensor:
    """A save's entry for this rank's chunk, where training keeps it (see [Note: host copies of a save])."""
    return _flat_dtensor(local, numel, mesh_of(group, engine, local.device.type))


def mesh_of(group: CheckpointGroup, engine: Optional[ZeroEngine], device_type: str = "cpu") -> DeviceMesh:
    """The mesh ``engine``'s chunks are DTensors on, for chunks on ``device_type`` (see
    ``CheckpointGroup.mesh_for``)."""
    return group.mesh_for(engine.shard_group_size if engine is not None else None, device_type)


# ---- what is saved ------------------------------------------------------------------------------
def _param_names(module: nn.Module) -> tuple[dict[int, str], dict[str, str], list[str]]:
    """(first name of each parameter by id, aliases: other state_dict key -> first name, buffer keys)."""
    first = {id(p): name for name, p in module.named_parameters()}
    aliases, buffers = {}, []
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) in first:
            if first[id(t)] != key:
                aliases[key] = first[id(t)]
        else:
            buffers.append(key)
    return first, aliases, buffers


def model_tensors(
    module: nn.Module,
    engine: Optional[ZeroEngine],
    group: CheckpointGroup,
    average: Optional[AveragedShards] = None,
    leave_out: Collection[str] = (),
) -> dict[str, Tensor]:
    """The module's weights as DCP entries: this rank's chunks (no gathering) and the buffers, where
    training keeps them (see [Note: host copies of a save]); DTensors on ``group``'s meshes.
    ``average``: a weight-averaging callback's average instead (its chunks, laid out as the
    engine's; its buffers where it keeps them, else the module's). ``leave_out``: parameter names
    not to save (the frozen ones, with ``save_frozen=False``)."""
    sharded = {id(sp.param): sp for sp in engine.params} if engine is not None else {}
    chunks = engine.weight_chunks() if engine is not None and average is None else {}
    _, _, buffers = _param_names(module)
    state = module.state_dict(keep_vars=True)
    tensors: dict[str, Tensor] = {}
    for name, p in module.named_parameters():
        if name in leave_out:
            continue
        sp = sharded.get(id(p))
        if average is not None:
            tensors[f"model/{name}"] = _chunk_entry(average.chunk(name), average.chunks[name].layout.numel, group, engine)
        elif sp is None:
            tensors[f"model/{name}"] = p.detach().reshape(-1)
        else:  # at stage 3 the parameter itself is an empty placeholder at rest
            # the optimizer's chunk is the most precise copy of the weight (fp32 master where the
            # parameter is half precision), so converted checkpoints get full-precision weights
            tensors[f"model/{name}"] = _chunk_entry(chunks[id(sp)], sp.layout.numel, group, engine)
    for key in buffers:
        kept = average.buffer(key) if average is not None else None
        tensors[f"buffer/{key}"] = (kept if kept is not None else state[key]).detach()
    return tensors


@dataclass
class OptimizerShards:
    """One optimizer's state as DCP entries, plus what is not a tensor (kept in meta.pt)."""

    tensors: dict[str, Tensor]
    layout: dict[str, dict[str, str]]
    values: dict[str, dict[str, Any]]
    param_groups: list[dict[str, Any]]
    """Hyperparameters of each group, with the names of its parameters under "params"."""


def optimizer_shards(engine: ZeroEngine, optimizer: Optimizer, index: int, group: CheckpointGroup) -> OptimizerShards:
    """``optimizer``'s state in this rank's chunks, its tensors where training keeps them (see
    [Note: host copies of a save]); DTensors on ``group``'s meshes."""
    params = engine.params_of(optimizer)
    state_dict, chunked = engine.optimizer_chunked_state(optimizer)  # whole-tensor optimizers' state too
    tensors: dict[str, Tensor] = {}
    layout: dict[str, dict[str, str]] = {}
    values: dict[str, dict[str, Any]] = {}
    for position, sp in enumerate(params):
        for key, value in state_dict["state"].get(position, {}).items():
            entry = f"optim/{index}/{sp.name}/{key}"
            if (position, key) in chunked:
                tensors[entry] = _chunk_entry(value, sp.layout.numel, group, engine)
                layout.setdefault(sp.name, {})[key] = SHARDED
            elif isinstance(value, Tensor):
                tensors[entry] = value.detach()
                layout.setdefault(sp.name, {})[key] = TENSOR
            else:
                values.setdefault(sp.name, {})[key] = value
                layout.setdefault(sp.name, {})[key] = VALUE
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [params[i].name for i in group["params"]]}
        for group in state_dict["param_groups"]
    ]
    return OptimizerShards(tensors, layout, values, groups)


def entry_tensors(entries: dict[str, Any]) -> dict[str, Tensor]:
    """The tensor holding each entry's values, where training keeps it (a DTensor's chunk), by key."""
    return {key: (v.to_local() if isinstance(v, DTensor) else v) for key, v in entries.items() if isinstance(v, Tensor)}


def entries_over(entries: dict[str, Any], copies: dict[str, Tensor], group: CheckpointGroup) -> dict[str, Any]:
    """``entries`` with each tensor replaced by its host copy in ``copies`` (a DTensor rebuilt over
    its copy, with the same placements and global shape, on the CPU's mesh); other values as they are."""
    rebuilt: dict[str, Any] = {}
    for key, value in entries.items():
        if isinstance(value, DTensor):
            mesh = group.host_mesh(value.device_mesh)
            rebuilt[key] = DTensor.from_local(copies[key], mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
        else:
            rebuilt[key] = copies[key] if isinstance(value, Tensor) else value
    return rebuilt


def host_entries(entries: dict[str, Any], group: CheckpointGroup) -> dict[str, Any]:
    """A synchronous save's entries on the host: a blocking copy of each device tensor, host
    tensors as they are (see [Note: host copies of a save])."""
    return entries_over(entries, {key: t.to("cpu") for key, t in entry_tensors(entries).items()}, group)


def build_manifest(
    module: nn.Module,
    engine: Optional[ZeroEngine],
    stage: int,
    world_size: int,
    optimizers: Sequence[OptimizerShards],
    frozen: Optional[FrozenRecord] = None,
) -> Manifest:
    """``frozen``: the fingerprint of the parameters left out (``save_frozen=False``), else None."""
    _, aliases, buffers = _param_names(module)
    frozen = frozen or {}
    return Manifest(
        stage=stage,
        world_size=world_size,
        params={name: shape for name, shape in true_shapes(module, engine).items() if name not in frozen},
        frozen=frozen,
        aliases=aliases,
        buffers=buffers,
        optimizers=[o.layout for o in optimizers],
        optimizer_params=[[g["params"] for g in o.param_groups] for o in optimizers],
    )


def true_shapes(module: nn.Module, engine: Optional[ZeroEngine]) -> dict[str, list[int]]:
    """Every parameter's full shape (at stage 3 a parameter at rest is an empty placeholder)."""
    sharded = {id(sp.param): sp.shape for sp in engine.params} if engine is not None else {}
    return {name: list(sharded.get(id(p), p.shape)) for name, p in module.named_parameters()}


# ---- what is loaded -----------------------------------------------------------------------------
def read_chunks(
    directory: PathLike, manifest: Manifest, group: CheckpointGroup, mesh: DeviceMesh, prefix: str = "", dcp_metadata: Any = None
) -> dict[str, Tensor]:
    """The weights under ``prefix`` as shard entries: ``model/<param>`` this rank's chunk of it on
    ``mesh`` (the layout of the engine's chunks and of ``AveragedShards``), ``buffer/<key>`` whole.
    A collective over ``group``; no rank reads more than its chunks and the buffers. ``dcp_metadata``
    (here and below): DCP's metadata when the caller read it already (``read_dcp_metadata``)."""
    dcp_metadata = read_dcp_metadata(directory) if dcp_metadata is None else dcp_metadata
    metadata = tensor_metadata(directory, dcp_metadata)
    shard_dim = mesh.ndim - 1
    size, rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    targets: dict[str, Tensor] = {}
    for name, shape in manifest.params.items():
        numel, key = math.prod(shape), f"{prefix}model/{name}"
        local = torch.empty(ChunkLayout(numel, size).owned_numel(rank), dtype=metadata[key].properties.dtype)
        targets[key] = _flat_dtensor(local, numel, mesh)
    for buffer in manifest.buffers:
        key = f"{prefix}buffer/{buffer}"
        targets[key] = torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)
    read_tensors(targets, directory, group, dcp_metadata)
    return {key[len(prefix) :]: t.to_local() if isinstance(t, DTensor) else t for key, t in targets.items()}


def read_full_state(directory: PathLike, manifest: Manifest, prefix: str = "", dcp_metadata: Any = None) -> dict[str, Tensor]:
    """The module's full ``state_dict`` (tied weights under each of their keys), read from the
    entries under ``prefix`` in this process alone: every rank that calls it reads all of it."""
    dcp_metadata = read_dcp_metadata(directory) if dcp_metadata is None else dcp_metadata
    metadata = tensor_metadata(directory, dcp_metadata)
    flat: dict[str, Tensor] = {}
    for name, shape in manifest.params.items():
        key = f"{prefix}model/{name}"
        flat[key] = torch.empty(shape, dtype=metadata[key].properties.dtype).reshape(-1)
    for buffer in manifest.buffers:
        key = f"{prefix}buffer/{buffer}"
        flat[key] = torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)
    read_tensors(flat, directory, None, dcp_metadata)
    state = {name: flat[f"{prefix}model/{name}"].view(shape) for name, shape in manifest.params.items()}
    for alias, name in manifest.aliases.items():
        if name in state:  # else a frozen parameter left out (``tie_aliases`` once its base is merged)
            state[alias] = state[name]
    for buffer in manifest.buffers:
        state[buffer] = flat[f"{prefix}buffer/{buffer}"]
    return state


def check_model_matches(manifest: Manifest, expected: dict[str, list[int]], directory: PathLike, strict: bool) -> None:
    """Names and shapes of the checkpoint against the model's, with every difference named."""
    missing = sorted(set(expected) - set(manifest.params))
    unexpected = sorted(set(manifest.params) - set(expected))
    wrong = sorted(n for n in set(expected) & set(manifest.params) if expected[n] != manifest.params[n])
    problems = []
    if wrong:
        problems.append("shapes differ for " + ", ".join(f"{n} (checkpoint {manifest.params[n]}, model {expected[n]})" for n in wrong[:5]))
    if strict and missing:
        problems.append(f"missing from the checkpoint: {missing[:10]}")
    if strict and unexpected:
        problems.append(f"not in the model: {unexpected[:10]}")
    if problems:
        raise ValueError(f"Checkpoint {str(directory)!r} does not match the model: " + "; ".join(problems) + ".")


def load_model(
    directory: PathLike,
    manifest: Manifest,
    module: nn.Module,
    engine: Optional[ZeroEngine],
    group: CheckpointGroup,
    strict: bool,
    dcp_metadata: Any = None,
) -> None:
    """Read each parameter as this rank needs it — its chunk where the engine shards it, else the
    whole tensor — and the buffers."""
    expected = {name: shape for name, shape in true_shapes(module, engine).items() if name not in manifest.frozen}
    check_model_matches(manifest, expected, directory, strict)
    sharded = {id(sp.param): sp for sp in engine.params} if engine is not None else {}
    dcp_metadata = read_dcp_metadata(directory) if dcp_metadata is None else dcp_metadata
    metadata = tensor_metadata(directory, dcp_metadata)
    targets: dict[str, Tensor] = {}
    for name, p in module.named_parameters():
        key = f"model/{name}"
        if key not in metadata:
            if name in manifest.params:  # listed, yet no rank wrote it: never skip weights silently
                raise CorruptCheckpointError(
                    f"Checkpoint {str(directory)!r} lists parameter {name!r} in its manifest but holds no"
                    " tensor for it; it was not written by lightning-zero's save (or was altered since)."
                )
            continue
        dtype = metadata[key].properties.dtype
        sp = sharded.get(id(p))
        if sp is not None and not sp.keeps_full:
            targets[key] = _flat_dtensor(torch.empty(sp.owned_numel, dtype=dtype), sp.layout.numel, mesh_of(group, engine))
        else:
            targets[key] = torch.empty(manifest.params[name], dtype=dtype).reshape(-1)
    state = module.state_dict(keep_vars=True)
    for key in manifest.buffers:
        if key in state and f"buffer/{key}" in metadata:
            targets[f"buffer/{key}"] = torch.empty(state[key].shape, dtype=metadata[f"buffer/{key}"].properties.dtype)
    read_tensors(targets, directory, group, dcp_metadata)
    names = {id(p): name for name, p in module.named_parameters() if f"model/{name}" in targets}
    with torch.no_grad():
        # chunks kept on disk between uses (offload_params="nvme") are read in a bucket at a time,
        # and written back before the next is read
        for bucket in engine.buckets_in_memory(writing=True) if engine is not None else ():
            for sp in bucket:
                name = names.get(id(sp.param))
                if name is not None:
                    _load_parameter(sp.param, sp, targets[f"model/{name}"], manifest.params[name])
        for name, p in module.named_parameters():
            if id(p) not in sharded and id(p) in names:
                _load_parameter(p, None, targets[f"model/{name}"], manifest.params[name])
        for key in manifest.buffers:
            if f"buffer/{key}" in targets:
                state[key].copy_(targets[f"buffer/{key}"])


def _load_parameter(p: nn.Parameter, sp: Optional[ShardedParam], value: Tensor, shape: Sequence[int]) -> None:
    """Give ``p`` (``sp``: the engine's record of it, where it shards it) what was read for it: this
    rank's chunk (a DTensor) or the whole tensor, flat."""
    if isinstance(value, DTensor):
        assert sp is not None
        sp.load_chunk(value.to_local())
    elif sp is not None:
        sp.load_full_value(value.view(shape))
    else:
        p.copy_(value.view(shape))


def load_optimizer(
    directory: PathLike,
    manifest: Manifest,
    saved: list[dict[str, Any]],
    engine: ZeroEngine,
    optimizer: Optimizer,
    index: int,
    group: CheckpointGroup,
    dcp_metadata: Any = None,
) -> None:
    """Rebuild ``optimizer``'s state for this rank's chunks, matching parameters by name."""
    if index >= len(manifest.optimizers):
        raise ValueError(
            f"Checkpoint {str(directory)!r} holds state for {len(manifest.optimizers)} optimizers, but"
            f" `configure_optimizers` returned more."
        )
    params = engine.params_of(optimizer)
    saved_groups = saved[index]["param_groups"]
    current_groups = [[params[i].name for i in g["params"]] for g in optimizer.state_dict()["param_groups"]]
    if [sorted(g["params"]) for g in saved_groups] != [sorted(g) for g in current_groups]:
        raise ValueError(
            f"Optimizer #{index} groups its parameters differently from the checkpoint's: checkpoint"
            f" {[len(g['params']) for g in saved_groups]} parameters per group, now"
            f" {[len(g) for g in current_groups]}."
        )
    dcp_metadata = read_dcp_metadata(directory) if dcp_metadata is None else dcp_metadata
    metadata = tensor_metadata(directory, dcp_metadata)
    layout, values = manifest.optimizers[index], saved[index]["values"]
    targets: dict[str, Tensor] = {}
    chunks: dict[str, Tensor] = {}  # what DCP fills of each DTensor target: the state's own tensor, no copy
    for sp in params:
        for key, kind in layout.get(sp.name, {}).items():
            entry = f"optim/{index}/{sp.name}/{key}"
            if kind == SHARDED:
                chunks[entry] = torch.empty(sp.owned_numel, dtype=metadata[entry].properties.dtype)
                targets[entry] = _flat_dtensor(chunks[entry], sp.layout.numel, mesh_of(group, engine))
            elif kind == TENSOR:
                targets[entry] = torch.empty(metadata[entry].size, dtype=metadata[entry].properties.dtype)
    read_tensors(targets, directory, group, dcp_metadata)
    state: dict[int, dict[str, Any]] = {}
    chunked: set[tuple[int, str]] = set()
    for position, sp in enumerate(params):
        entries = {}
        for key, kind in layout.get(sp.name, {}).items():
            entry = f"optim/{index}/{sp.name}/{key}"
            if kind == SHARDED:
                entries[key] = chunks[entry]
                chunked.add((position, key))
            elif kind == TENSOR:
                entries[key] = targets[entry]
            else:
                entries[key] = values[sp.name][key]
        if entries:
            state[position] = entries
    position_of = {sp.name: i for i, sp in enumerate(params)}
    groups = [
        {**{k: v for k, v in saved.items() if k != "params"}, "params": [position_of[name] for name in current]}
        for saved, current in zip(saved_groups, current_groups)
    ]
    engine.load_optimizer_chunked_state(optimizer, {"state": state, "param_groups": groups}, frozenset(chunked))


