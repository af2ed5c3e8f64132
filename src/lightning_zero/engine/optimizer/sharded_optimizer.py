"""The user's optimizer, stepping this rank's shards instead of the full parameters.

We keep the optimizer object that ``configure_optimizers`` returned — its class, param groups and
hyperparameters, and the LR schedulers that hold it — and rebind each param group's ``params`` to
the matching :attr:`ShardedParam.shard`, one for one and in order. The optimizer then allocates
state only for this rank's chunks. Its ``state_dict`` indices keep meaning "the i-th parameter",
which is how a full (unsharded) optimizer state maps onto shards and back.

Only element-wise optimizers give the same update on a flat chunk as on the whole tensor. Ones that
look across a tensor (per-tensor norms, factored second moments, orthogonalization) step each
parameter whole on an owner rank instead (see [Note: step granularity] in ``optimizer_kinds.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.optimizer.optimizer_kinds import check_steppable
from lightning_zero.engine.optimizer.whole_tensor_step import STEP_KEY, ChunkedState
from lightning_zero.engine.shards.partition import copy_rows_into_flat
from lightning_zero.engine.shards.sharded_param import ShardedParam


def check_optimizer_type(optimizer: object) -> None:
    """Raise a ``TypeError`` unless ``optimizer`` is a torch optimizer, the only kind we can rebind."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            "lightning-zero shards torch optimizers: `configure_optimizers` must return"
            f" `torch.optim.Optimizer` instances (optionally with LR schedulers), got {type(optimizer).__name__}."
        )


SHARDING_OPTIMIZER_MODULES = ("torch.distributed.optim", "fairscale.optim", "deepspeed")
"""Where optimizers that shard or synchronize their own state live (``ZeroRedundancyOptimizer``,
FairScale's ``OSS``, DeepSpeed's): wrapping one in ZeRO would shard twice, and its state would
need a consolidation step our checkpoints never make."""


def check_optimizer(optimizer: object) -> None:
    """Raise for an optimizer no path can step (see ``optimizer_kinds.py``)."""
    check_optimizer_type(optimizer)
    assert isinstance(optimizer, Optimizer)  # for type checkers
    cls = type(optimizer)
    if cls.__module__.startswith(SHARDING_OPTIMIZER_MODULES):
        raise ValueError(
            f"{cls.__name__} ({cls.__module__}) is a distributed optimizer: it shards or synchronizes"
            " its state itself, and lightning-zero already shards the optimizer state. HINT: return the"
            " plain optimizer it wraps from `configure_optimizers` (e.g. `torch.optim.AdamW(self.parameters())`)."
        )
    check_steppable(optimizer)
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameters"
            " before training started; lightning-zero must shard it before its first step."
            " Create optimizers in `configure_optimizers` and do not step them there."
        )


def rebind_param_groups(optimizer: Optimizer, sharded: dict[int, ShardedParam]) -> list[ShardedParam]:
    """Point every param group at the shards of its parameters; returns them in ``state_dict`` order."""
    ordered: list[ShardedParam] = []
    for group in optimizer.param_groups:
        members = [sharded[id(p)] for p in group["params"]]
        group["params"] = [p.shard for p in members]
        ordered.extend(members)
    return ordered


def chunked_entries(state_dict: dict[str, Any], params: Sequence[ShardedParam]) -> frozenset[tuple[int, str]]:
    """The chunk path's per-element state entries, ``(position, key)``: those with the shard's shape
    (a rank-local test that every rank answers the same way, since all ranks hold the same keys).
    torch's optimizers keep their step count under ``STEP_KEY``: a scalar, never sharded, even for
    a 0-dimensional parameter whose other state is 0-dimensional too."""
    return frozenset(
        (index, key)
        for index, state in state_dict["state"].items()
        for key, value in state.items()
        if key != STEP_KEY and isinstance(value, Tensor) and value.shape == params[index].shard.shape
    )


def gather_full_state_dict(
    chunked: ChunkedState, params: Sequence[ShardedParam], group: collectives.ProcessGroup, device: torch.device, keep: bool = True
) -> dict[str, Any]:
    """An optimizer's ``state_dict`` as an unsharded optimizer would have it (same format as under
    DDP), on the CPU, from its state in chunks. A collective: every rank must call it; ranks with
    ``keep=False`` take part but drop each gathered tensor at once and return an empty dict. Each
    state tensor is gathered on ``device``, the compute device (an offloaded optimizer's state is
    on the host, and NCCL gathers device tensors only), one at a time."""
    state_dict = chunked.state_dict
    n = collectives.world_size(group)
    full_state: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(params):
        if index not in state_dict["state"]:
            continue
        state = dict(state_dict["state"][index])
        c = param.padded_chunk_numel
        for key in sorted(key for key in state if (index, key) in chunked.chunked):
            local = state[key]
            padded = torch.zeros(c, dtype=local.dtype, device=device)
            padded[: local.numel()].copy_(local.reshape(-1))
            gathered = torch.empty(n * c, dtype=local.dtype, device=device)
            collectives.start_all_gather(gathered, padded, group).wait()
            if keep:
                full = torch.empty(param.layout.numel, dtype=local.dtype, device="cpu")
                copy_rows_into_flat(gathered.view(n, c), full)
                state[key] = full.view(param.shape)
        full_state[index] = state
    return {"state": full_state, "param_groups": state_dict["param_groups"]} if keep else {}


def check_full_state_dict(full_state_dict: dict[str, Any], params: Sequence[ShardedParam]) -> dict[int, dict[str, Any]]:
    """An unsharded optimizer ``state_dict``'s state by position, checked against ``params``."""
    states: dict[int, dict[str, Any]] = {}
    for index, saved in full_state_dict["state"].items():
        index = int(index)
        if index >= len(params):
            raise ValueError(
                f"The optimizer state has an entry for parameter #{index}, but the optimizer holds only"
                f" {len(params)} parameters: the checkpoint was saved for a different model or optimizer."
            )
        param = params[index]
        for key, value in saved.items():
            if key != STEP_KEY and isinstance(value, Tensor) and value.shape != param.shape and value.numel() == param.layout.numel > 1:
                raise ValueError(
                    f"Optimizer state {key!r} of parameter {param.name!r} has shape {tuple(value.shape)},"
                    f" the parameter has shape {tuple(param.shape)}."
                )
        states[index] = saved
    return states


def load_full_state_dict(optimizer: Optimizer, full_state_dict: dict[str, Any], params: Sequence[ShardedParam]) -> None:
    """Load an unsharded optimizer ``state_dict`` (ours, or one saved by DDP) keeping this rank's chunks."""
    state: dict[int, dict[str, Any]] = {}
    for index, saved in check_full_state_dict(full_state_dict, params).items():
        param = params[index]
        start, end = param.layout.owned_range(param.rank)
        state[index] = {}
        for key, value in saved.items():
            if key != STEP_KEY and isinstance(value, Tensor) and value.shape == param.shape:
                value = value.reshape(-1)[start:end].clone()
            state[index][key] = value
    optimizer.load_state_dict({"state": state, "param_groups": full_state_dict["param_groups"]})


def optimizer_index_of_params(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[int, int]:
    """Map ``id(param)`` to the index of the first optimizer that holds it (its buckets go with
    that optimizer's), checking that optimizers hold only the module's parameters, each at most once
    per optimizer, and that something is trainable. A parameter several optimizers step (a shared
    layer in a GAN) has one shard that each of them steps, as under DDP."""
    optimizers = [opt for opt in optimizers if opt.param_groups]  # Lightning's stand-in when there is none
    if optimizers and not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameter with `requires_grad=True`: there is nothing to"
            " train or shard. Unfreeze at least one parameter, or run `trainer.validate/test/predict`."
        )
    names = {id(p): name for name, p in module.named_parameters()}
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        check_optimizer(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        f"{type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} that is"
                        " not a parameter of the module; lightning-zero can only shard the module's"
                        " own parameters. Build the optimizer from `self.parameters()` (or a subset)."
                    )
                if owner.get(id(p)) == index:
                    raise ValueError(
                        f"Parameter {names[id(p)]!r} appears twice in {type(optimizer).__name__} (#{index});"
                        " list each parameter in one param group of an optimizer."
                    )
                owner.setdefault(id(p), index)
    return owner
