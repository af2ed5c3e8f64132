"""Precision plugins for sharded gradients.

Lightning's precision plugins clip gradients on ``optimizer.param_groups`` — under ZeRO, this
rank's gradient *shards*. Clipping by value is element-wise and needs nothing more; clipping by
norm needs the norm over all shards, so the squared local norm is all-reduced first. The strategy
swaps Lightning's plugins for these subclasses (see ``ZeroStrategy.precision_plugin``), so users
pass ``Trainer(precision=...)`` as usual.
"""

from __future__ import annotations

from typing import Union

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_zero.engine import collectives


def global_grad_norm(parameters: list[torch.Tensor], group: collectives.ProcessGroup = None) -> torch.Tensor:
    """The 2-norm of all gradients across ranks, when each rank holds a disjoint shard of them
    (every element on exactly one rank); equal to ``clip_grad_norm_``'s norm over full gradients."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if grads:
        local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]))
        squared = (local * local).reshape(1)
    else:
        squared = torch.zeros(1, device=parameters[0].device if parameters else "cpu")
    return collectives.all_reduce(squared, group, op="sum").sqrt().reshape(())


class _ShardedNormClipping:
    """Mixin: ``clip_grad_by_norm`` over the global norm of the sharded gradients."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        parameters = list(self.main_params(optimizer))  # type: ignore[attr-defined]
        total_norm = global_grad_norm(parameters)
        # the same formula as torch.nn.utils.clip_grad_norm_ (non-finite norms propagate as there)
        clip_coef = torch.clamp(clip_val / (total_norm + 1e-6), max=1.0)
        for p in parameters:
            if p.grad is not None:
                p.grad.detach().mul_(clip_coef.to(p.grad.dtype))


class ZeroPrecision(_ShardedNormClipping, Precision):
    """``32-true`` (and ``64-true``) with sharded gradients."""


class ZeroMixedPrecision(_ShardedNormClipping, MixedPrecision):
    """``bf16-mixed`` with sharded gradients."""


class ZeroHalfPrecision(_ShardedNormClipping, HalfPrecision):
    """``bf16-true`` / ``16-true`` with sharded gradients; optimizer shards keep fp32 masters."""


def to_zero_precision(plugin: Precision) -> Precision:
    """Lightning's plugin for ``Trainer(precision=...)`` → ours; ours and unknown ones pass through."""
    if isinstance(plugin, _ShardedNormClipping):
        return plugin
    if type(plugin) is MixedPrecision:
        return ZeroMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    if type(plugin) is HalfPrecision:
        return ZeroHalfPrecision(plugin.precision)
    if type(plugin) is Precision:
        converted = ZeroPrecision()
        converted.precision = plugin.precision
        return converted
    return plugin


def check_precision_supported(plugin: Precision) -> None:
    """Refuse, before training, the combinations that would train incorrectly."""
    if getattr(plugin, "scaler", None) is not None:
        raise ValueError(
            f"precision={plugin.precision!r} uses a GradScaler, whose inf/NaN check would run on each"
            " rank's gradient shard separately and let the ranks diverge. lightning-zero does not"
            " support loss scaling yet. HINT: use precision='bf16-mixed' (no loss scaling needed)."
        )
    if not isinstance(plugin, _ShardedNormClipping):
        raise ValueError(
            f"{type(plugin).__name__} is not a lightning-zero precision plugin, so it would clip"
            " gradients by the norm of this rank's shard only. Pass `Trainer(precision=...)` and let"
            " the strategy choose its plugin, or subclass lightning_zero.precision.ZeroPrecision."
        )
