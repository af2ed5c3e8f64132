"""Fabric's checkpoint ``state`` ↔ the checkpoint layout the Trainer writes, so that one format serves
both front doors (a Trainer checkpoint loads in Fabric, and the other way round).

Fabric saves a dict the user names freely — ``{"model": model, "optimizer": optimizer, "step": 5}``;
the Trainer saves ``{"state_dict": ..., "optimizer_states": [...], "epoch": ..., ...}``. A sharded
directory stores the one module's weights and its optimizers' states by position (``sharded.py``),
and everything else as it is. So the module set up with the strategy goes where the Trainer puts
``state_dict``, its optimizers (in the order the state lists them) where it puts
``optimizer_states``, and the names Fabric used are recorded under ``FABRIC_NAMES``; loading maps
them back by those names, or for a Trainer checkpoint by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoint.directory import OPTIMIZERS_KEY as OPTIMIZER_VALUES_KEY
from lightning_zero.checkpoint.layout import FABRIC_NAMES, LIGHTNING_VERSION_KEY, MODULE_KEY, OPTIMIZERS_KEY

INTERNAL_KEYS = (MODULE_KEY, OPTIMIZERS_KEY, FABRIC_NAMES, OPTIMIZER_VALUES_KEY, LIGHTNING_VERSION_KEY)
"""Entries of a loaded checkpoint that describe the module and optimizers, not the user's own."""


@dataclass
class SplitState:
    """A Fabric ``state`` dict split into what the engine saves and what is saved as it is."""

    module_key: Optional[str]
    module: Optional[nn.Module]
    optimizer_keys: list[str]
    optimizers: list[Optimizer]
    others: dict[str, Any]


def split_state(state: Mapping[str, Any], is_ours: Any, owner_of: Any) -> SplitState:
    """``is_ours(module)``: whether the strategy set ``module`` up; ``owner_of(optimizer)``: the module
    whose parameters an optimizer steps (None for an optimizer not set up with the strategy)."""
    modules = [(key, obj) for key, obj in state.items() if isinstance(obj, nn.Module) and is_ours(obj)]
    if len(modules) > 1:
        raise ValueError(
            f"The checkpoint state holds {len(modules)} modules set up with lightning-zero"
            f" ({', '.join(repr(k) for k, _ in modules)}); a lightning-zero checkpoint holds one. Save"
            " each module (with its optimizers) to its own path."
        )
    module_key, module = modules[0] if modules else (None, None)
    optimizer_keys, optimizers = [], []
    for key, obj in state.items():
        if isinstance(obj, Optimizer) and owner_of(obj) is not None:
            if owner_of(obj) is not module:
                raise ValueError(
                    f"The optimizer under {key!r} steps a module set up with lightning-zero that is not"
                    " in this checkpoint's state. Save the optimizer together with its module."
                )
            optimizer_keys.append(key)
            optimizers.append(obj)
    taken = {module_key, *optimizer_keys}
    others = {key: obj for key, obj in state.items() if key not in taken}
    return SplitState(module_key, module, optimizer_keys, optimizers, others)


def plain_values(others: Mapping[str, Any]) -> dict[str, Any]:
    """What Fabric itself saves for the entries the engine does not: ``state_dict()`` of stateful
    objects (a scheduler, a plain module), the value of the rest."""
    return {key: obj.state_dict() if isinstance(obj, _Stateful) else obj for key, obj in others.items()}


def restore_plain_values(state: dict[str, Any], others: Mapping[str, Any], checkpoint: dict[str, Any], strict: bool) -> None:
    """Fabric's own rule for the entries the engine did not load: stateful objects load their
    ``state_dict``, other values are replaced; each is taken out of ``checkpoint``."""
    missing = [key for key in others if key not in checkpoint]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded"
            f" checkpoint (it holds {sorted(k for k in checkpoint if k not in INTERNAL_KEYS)})."
            " To disable strict loading, set `strict=False`."
        )
    for key, obj in others.items():
        if key not in checkpoint:
            continue
        if isinstance(obj, _Stateful):
            obj.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)


def remainder(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What ``fabric.load`` returns: the checkpoint's entries nobody restored."""
    return {key: value for key, value in checkpoint.items() if key not in INTERNAL_KEYS}
