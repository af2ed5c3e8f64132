"""One checkpoint, two front doors: Fabric's layout ↔ the Trainer's.

The Trainer saves ``{"state_dict": ..., "optimizer_states": [...], "epoch": ..., ...}``; Fabric saves
whatever dict the user names, ``{"model": model, "optimizer": optimizer, "step": 5}``. A checkpoint
saved by the Fabric strategy records which of its keys held the module and the optimizers under
``FABRIC_NAMES`` (in a sharded directory the weights and optimizer states are stored by position,
as the Trainer's are, so only the names differ), and each side maps the other's layout onto its own.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

FABRIC_NAMES = "lightning_zero_fabric_names"
"""Where a checkpoint saved by Fabric records the keys of its module and optimizers."""

MODULE_KEY, OPTIMIZERS_KEY = "state_dict", "optimizer_states"
"""The Trainer's keys for the weights and the optimizer states."""

LIGHTNING_VERSION_KEY = "pytorch-lightning_version"
"""The key the Trainer reads to migrate old checkpoints; Fabric's saves carry it too."""


def fabric_names(checkpoint: dict[str, Any]) -> tuple[Optional[str], list[str]]:
    """The keys the module and optimizers were saved under by Fabric (None, [] for the Trainer's)."""
    names = checkpoint.get(FABRIC_NAMES) or {}
    return names.get("module"), list(names.get("optimizers", []))


def as_trainer_checkpoint(checkpoint: dict[str, Any], has_schedulers: bool) -> dict[str, Any]:
    """A checkpoint saved by Fabric, in the layout the Trainer restores from (others unchanged):
    weights under ``state_dict``, optimizer states under ``optimizer_states``, and the entries the
    Trainer requires. Fabric saves no Trainer loop state, so a run resumed from one starts its loops
    at zero; LR schedulers start afresh (with a warning when the Trainer has some)."""
    if FABRIC_NAMES not in checkpoint:
        return checkpoint
    module_key, optimizer_keys = fabric_names(checkpoint)
    converted = dict(checkpoint)
    if module_key is not None and module_key in converted:  # a file (a directory's weights are loaded already)
        converted[MODULE_KEY] = converted.pop(module_key)
    if optimizer_keys and all(key in converted for key in optimizer_keys):
        converted[OPTIMIZERS_KEY] = [converted.pop(key) for key in optimizer_keys]
    converted.setdefault(LIGHTNING_VERSION_KEY, "2.0.0")
    if "lr_schedulers" not in converted:
        if has_schedulers:
            warnings.warn(
                "This checkpoint was saved by Fabric, which keeps no LR-scheduler state where the Trainer"
                " looks for it: the schedulers start from their initial state.",
                stacklevel=2,
            )
        converted["lr_schedulers"] = []
    return converted
