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

from lightning_zero.compat.lightning_api import without_weight_cache
from lightning_zero.engine.comm.collectives import ProcessGroup
from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler
from lightning_zero.engine.gradients.norms import clip_grads_by_global_norm_


class _ShardedNormClipping:
    """Mixin: ``clip_grad_by_norm`` over the global norm of the sharded gradients."""

    norm_group: ProcessGroup = None
    """The ranks whose shards together make each gradient whole (the strategy sets it: with hybrid
    sharding, the shard group; else all ranks)."""
    norm_device: torch.device = torch.device("cpu")
    """Where the norm is reduced: the compute device (the strategy sets it; offloaded gradients are
    on the host, and NCCL reduces device tensors only)."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        parameters = list(self.main_params(optimizer))  # type: ignore[attr-defined]
        clip_grads_by_global_norm_(parameters, clip_val, self.norm_device, group=self.norm_group)

    def _clip_gradients(self, model: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning runs this right after `on_before_optimizer_step`, inside the optimizer's closure:
        # gradients assigned to `param.grad` there reach the shards before they are clipped and
        # stepped (see engine/gradients/grad_window.py)
        engine = getattr(getattr(getattr(model, "_trainer", None), "strategy", None), "engine", None)
        if engine is not None:
            engine.gradients.take_assignments()
        super()._clip_gradients(model, *args, **kwargs)  # type: ignore[misc]


def set_norm_group(plugin: Precision, group: ProcessGroup, device: torch.device) -> None:
    """Over which ranks and on which device ``plugin`` sums the gradient norm when clipping (see
    ``_ShardedNormClipping``)."""
    if isinstance(plugin, _ShardedNormClipping):
        plugin.norm_group, plugin.norm_device = group, device


class ZeroPrecision(_ShardedNormClipping, Precision):
    """``32-true`` (and ``64-true``) with sharded gradients."""


class ZeroMixedPrecision(_ShardedNormClipping, MixedPrecision):
    """``bf16-mixed``, and ``16-mixed`` with a :class:`ZeroGradScaler`, for sharded gradients."""

    def autocast_context_manager(self) -> torch.autocast:
        # never torch's cache of cast weights: see compat/lightning_api.py (Lightning 2.5 keeps it)
        return without_weight_cache(super().autocast_context_manager())


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
