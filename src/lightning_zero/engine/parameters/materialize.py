"""Building the stage-3 units: every parameter leaves setup as a chunk on its device, and no rank
ever holds more than one unit's full parameters on the device.

[Note: meta-device models]
Under stage 3, ``configure_model`` (and ``trainer.init_module()``) run on the meta device, so
layers cost nothing when created. Here each module is materialized in turn, in module order, by
allocating its meta tensors and calling its ``reset_parameters()`` — the convention of torch's
layers and of Lightning's FSDP strategies — and each unit is sharded as soon as its last parameter
is real. With a seeded RNG this draws the same random numbers in the same order as building the
model eagerly, as long as modules are registered in the order they are created and initialise
themselves in ``reset_parameters()``. A parameter shared with a module materialized earlier (a
tied weight) keeps its value: the later module's ``reset_parameters()`` still runs, to draw the
same random numbers as an eager build would, and the shared tensor is restored afterwards.

Each module is initialised on the host, whatever the compute device, and its tensors are then moved
there: the eager build this matches is the usual one, on the CPU, whose layers draw from the CPU
generator (a CUDA tensor would draw from the CUDA generator, another sequence altogether). So a
meta-built model materialized on a GPU holds the bits of ``torch.manual_seed(s); Model().to(device)``.
The host holds one module's own tensors at a time; the cost is the CPU's initialisation speed, as
for an eager build.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.parameters.unit import Unit, UnitCommunication
from lightning_zero.engine.parameters.unit_plan import plan_units
from lightning_zero.engine.shards.sharded_param import ShardedParam


def build_units(
    module: nn.Module,
    device: torch.device,
    comm: UnitCommunication,
    unit_classes: Sequence[str] = (),
    min_unit_params: int = 0,
    host: Optional[torch.device] = None,
    keep_device_chunks: bool = False,
) -> list[Unit]:
    """Materialize (if on meta), move, broadcast from rank 0 and shard ``module``'s parameters,
    unit by unit; buffers are moved and broadcast too. Returns the units, root first.

    ``host``: where the chunks the optimizer steps live (None: on ``device``);
    ``keep_device_chunks``: also keep a device copy of each chunk to gather from (see ShardedParam).
    """
    group = comm.gather_group
    rank, world_size = collectives.rank(group), collectives.world_size(group)
    plans = plan_units(module, unit_classes, min_unit_params)
    by_name = {plan.name: i for i, plan in enumerate(plans)}
    sharded: dict[int, list[ShardedParam]] = {}
    was_meta = {id(m) for m in module.modules() if _has_meta_tensors(m)}
    done: set[int] = set()
    open_units: list[int] = []  # units whose module subtree the pre-order walk is inside

    def close_units_not_containing(module_name: Optional[str]) -> None:
        # a unit is complete once the walk leaves its subtree: every owner of its parameters
        # (tied ones included) lies inside it. None: the walk is over.
        while open_units and (module_name is None or not _is_within(module_name, plans[open_units[-1]].name)):
            unit = open_units.pop()
            names = plans[unit].param_names
            sharded[unit] = _shard_unit(module, names, rank, world_size, comm, host, keep_device_chunks)

    for module_name, m in module.named_modules():
        close_units_not_containing(module_name)
        if module_name in by_name:
            open_units.append(by_name[module_name])
        if id(m) in was_meta:
            _materialize(module_name, m, done)
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
            if id(t) not in done and t.device != device:
                t.data = t.data.to(device)
            done.add(id(t))
    close_units_not_containing(None)  # the root closes last
    _broadcast_from_first_rank(list(module.buffers()), comm)
    return [Unit(i, plan.name, plan.module, sharded[i], comm) for i, plan in enumerate(plans)]


def _broadcast_from_first_rank(tensors: list[Tensor], comm: UnitCommunication) -> None:
    """Every rank gets the first rank's values: with hybrid sharding, first across the shard groups
    (the first group's member at each position sends), then within each group from its first."""
    if comm.replicate_group is not None:
        collectives.broadcast_tensors_(tensors, src=0, group=comm.replicate_group)
    collectives.broadcast_tensors_(tensors, src=0, group=comm.gather_group)


def _is_within(module_name: str, unit_name: str) -> bool:
    return unit_name == "" or module_name == unit_name or module_name.startswith(unit_name + ".")


def _shard_unit(
    root: nn.Module,
    names: Sequence[str],
    rank: int,
    world_size: int,
    comm: UnitCommunication,
    host: Optional[torch.device],
    keep_device_chunks: bool,
) -> list[ShardedParam]:
    params = [root.get_parameter(name) for name in names]
    _broadcast_from_first_rank([p.data for p in params], comm)  # as DDP does
    shards = [
        ShardedParam(name, p, rank, world_size, keep_full=False, **_chunk_place(p, host, keep_device_chunks))
        for name, p in zip(names, params)
    ]
    for shard in shards:
        shard.rest_until_attached()
    return shards


def _chunk_place(p: nn.Parameter, host: Optional[torch.device], keep_device_chunks: bool) -> dict[str, Any]:
    """Where ``p``'s chunk lives: with only the optimizer offloaded (``keep_device_chunks``) a frozen
    parameter's chunk stays on the device, its one copy, since no host step reads it; otherwise as
    ``host`` and ``keep_device_chunks`` say (see [Note: frozen chunks] in ``sharded_param.py``)."""
    if keep_device_chunks and not p.requires_grad:
        return dict(host=None, keep_device_chunk=False)
    return dict(host=host, keep_device_chunk=keep_device_chunks)


def _has_meta_tensors(m: nn.Module) -> bool:
    return any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))


INIT_DEVICE = torch.device("cpu")
"""Where meta modules are initialised before they move to the compute device (see [Note:
meta-device models]): the host, so that they draw from the CPU generator as an eager build does."""


def _materialize(name: str, m: nn.Module, done: set[int]) -> None:
    """Allocate ``m``'s own meta tensors on the host and initialise them there (see [Note:
    meta-device models]); ``build_units`` moves them to the compute device right after."""
    reset = getattr(m, "reset_parameters", None)
    if not callable(reset):
        raise TypeError(
            f"Module {name or '<root>'!r} ({type(m).__name__}) was created on the meta device (ZeRO-3 builds"
            " `configure_model` there) but has no `reset_parameters()` to initialise its tensors"
            f" {[n for n, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)) if t.is_meta]}."
            " Define `reset_parameters()` on it, or create the model in `LightningModule.__init__`."
        )
    kept: dict[int, Tensor] = {}
    lent: dict[int, Tensor] = {}  # shared tensors on the compute device: their data, while `reset()` draws into host copies
    # a tensor already sharded (shared with a module materialized before) is at rest: `reset()` may
    # touch its placeholder, and it gets its kept value back (see [Note: parameters at rest])
    with torch._C.DisableTorchFunctionSubclass():
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
            if t.is_meta:
                # meta and real tensors cannot share `.data`; swapping keeps the Python object, so
                # optimizers built from the meta model (with the true shapes) keep pointing at it
                torch.utils.swap_tensors(t, _same_kind(t, torch.empty_like(t, device=INIT_DEVICE)))
            elif id(t) in done and t.device != INIT_DEVICE and t.numel():
                lent[id(t)] = t.data  # its values stay there, untouched
                t.data = t.data.to(INIT_DEVICE, copy=True)  # what `reset()` reads and draws into
            elif id(t) in done:
                kept[id(t)] = t.detach().clone()
        with torch.no_grad():
            try:
                reset()
            finally:
                for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                    if id(t) in lent:
                        t.data = lent[id(t)]
                    elif id(t) in kept:
                        t.copy_(kept[id(t)])


def _same_kind(like: Tensor, data: Tensor) -> Tensor:
    return nn.Parameter(data, requires_grad=like.requires_grad) if isinstance(like, nn.Parameter) else data
