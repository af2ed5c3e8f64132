"""``ZeroGradScaler``: loss scaling (``16-mixed``) whose skip decision is taken across the ranks.

Each rank unscales only its gradient shard, so a plain ``GradScaler`` finds inf/NaN per shard and
the ranks would skip different steps and let their scales diverge. Both adapters (the Trainer's
precision plugins and the Fabric strategy) put this scaler in place of Lightning's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from lightning_zero.engine.comm import collectives


class ZeroGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose inf/NaN verdict is taken across all ranks (each sees only its shard),
    so every rank skips the same steps and the scales never diverge."""

    def __init__(self, *args: Any, group: collectives.ProcessGroup = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler) -> "ZeroGradScaler":
        """The same settings and current state as ``scaler``."""
        if not scaler.is_enabled():  # e.g. a CUDA scaler built where CUDA is missing: it keeps no settings
            return cls(scaler._device, enabled=False)
        converted = cls(
            scaler._device,
            init_scale=scaler._init_scale,
            growth_factor=scaler._growth_factor,
            backoff_factor=scaler._backoff_factor,
            growth_interval=scaler._growth_interval,
            enabled=scaler._enabled,
        )
        if scaler._scale is not None:
            converted.load_state_dict(scaler.state_dict())
        return converted

    def _unscale_grads_(self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool) -> dict:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # one flag, reduced once: a rank whose shard has no gradient on some device must still
        # take part, so the collective count may not depend on the dict's length
        flag = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
        for value in per_device.values():
            flag += value.to(flag.device)
        collectives.all_reduce(flag, self.group, op="max")
        return {device: flag.to(device) for device in per_device} or {flag.device: flag}
