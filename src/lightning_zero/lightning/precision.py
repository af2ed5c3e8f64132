"""Precision plugins for sharded gradients.

Lightning's precision plugins look at ``optimizer.param_groups`` — under ZeRO, this rank's
gradient *shards*. Two decisions there must be global rather than per shard:

- clipping by norm needs the norm over all shards, so the squared local norm is all-reduced
  first (clipping by value is element-wise and needs nothing);
- loss scaling (``16-mixed``) must skip a step when *any* rank's shard overflowed, or the ranks
  diverge: :class:`ZeroGradScaler` all-reduces the found-inf flag.

The strategy swaps Lightning's plugins for these subclasses (see ``ZeroStrategy.precision_plugin``),
so users pass ``Trainer(precision=...)`` as usual.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_zero.engine import collectives
from lightning_zero.engine.norms import global_grad_norm, group_by_dtype_and_device


class ZeroGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose inf/NaN verdict is taken across all ranks (each sees only its shard),
    so every rank skips the same steps and the scales never diverge."""

    def __init__(self, *args: Any, group: collectives.ProcessGroup = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler) -> "ZeroGradScaler":
        """The same settings and current state as ``scaler``."""
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


class _ShardedNormClipping:
    """Mixin: ``clip_grad_by_norm`` over the global norm of the sharded gradients."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        parameters = list(self.main_params(optimizer))  # type: ignore[attr-defined]
        total_norm = global_grad_norm(parameters)  # see engine/norms.py
        # the same formula as torch.nn.utils.clip_grad_norm_ (non-finite norms propagate as there)
        clip_coef = torch.clamp(clip_val / (total_norm + 1e-6), max=1.0)
        grads = [p.grad.detach() for p in parameters if p.grad is not None]
        for same_kind in group_by_dtype_and_device(grads):  # one multiply kernel per dtype and device
            torch._foreach_mul_(same_kind, clip_coef.to(same_kind[0].device, same_kind[0].dtype))


class ZeroPrecision(_ShardedNormClipping, Precision):
    """``32-true`` (and ``64-true``) with sharded gradients."""


class ZeroMixedPrecision(_ShardedNormClipping, MixedPrecision):
    """``bf16-mixed``, and ``16-mixed`` with a :class:`ZeroGradScaler`, for sharded gradients."""


class ZeroHalfPrecision(_ShardedNormClipping, HalfPrecision):
    """``bf16-true`` / ``16-true`` with sharded gradients; optimizer shards keep fp32 masters."""


def to_zero_precision(plugin: Precision) -> Precision:
    """Lightning's plugin for ``Trainer(precision=...)`` → ours; ours and unknown ones pass through."""
    if isinstance(plugin, _ShardedNormClipping):
        return plugin
    if type(plugin) is MixedPrecision:
        scaler = None if plugin.scaler is None else ZeroGradScaler.like(plugin.scaler)
        return ZeroMixedPrecision(plugin.precision, plugin.device, scaler)
    if type(plugin) is HalfPrecision:
        return ZeroHalfPrecision(plugin.precision)
    if type(plugin) is Precision:
        converted = ZeroPrecision()
        converted.precision = plugin.precision
        return converted
    return plugin


def check_precision_supported(plugin: Precision) -> None:
    """Refuse, before training, the combinations that would train incorrectly."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, ZeroGradScaler):
        raise ValueError(
            f"precision={plugin.precision!r} uses a {type(scaler).__name__}, whose inf/NaN check would"
            " run on each rank's gradient shard separately and let the ranks diverge. HINT: pass"
            " `Trainer(precision='16-mixed')` and let the strategy choose its plugin, or give your"
            " plugin a lightning_zero.lightning.ZeroGradScaler."
        )
    if not isinstance(plugin, _ShardedNormClipping):
        raise ValueError(
            f"{type(plugin).__name__} is not a lightning-zero precision plugin, so it would clip"
            " gradients by the norm of this rank's shard only. Pass `Trainer(precision=...)` and let"
            " the strategy choose its plugin, or subclass lightning_zero.lightning.ZeroPrecision."
        )
