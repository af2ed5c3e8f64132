"""Precision plugins for sharded gradients.

Lightning's precision plugins look at ``optimizer.param_groups`` — under ZeRO, this rank's
gradient *shards*. Two decisions there must be global rather than per shard:

- clipping by norm needs the norm over all shards, so the squared local norm is all-reduced
  first (clipping by value is element-wise and needs nothing);
- loss scaling (``16-mixed``) must skip a step when *any* rank's shard overflowed, or the ranks
  diverge: :class:`ZeroGradScaler` all-reduces the found-inf flag.

They also run the engine's part of each backward (see [Note: the engine's part of a backward]), and
the strategy swaps Lightning's plugins for these subclasses (see ``ZeroStrategy.precision_plugin``),
so users pass ``Trainer(precision=...)`` as usual.

[Note: the engine's part of a backward]
Lightning's ``Strategy.backward`` runs, in order: the strategy's ``pre_backward``, the plugin's
``pre_backward`` (which calls ``on_before_backward``), the plugin's ``backward``, the plugin's
``post_backward`` (which calls ``on_after_backward``), the strategy's ``post_backward``. The engine
has two things to do around the backward itself, and each has a place in that order:

- ``before_backward``: ``param.grad`` stops showing the last backward's reduced gradients, so that
  autograd accumulates into what it should. ``on_before_backward`` must still see them (as under
  DDP, where they are there until ``zero_grad``), so this runs after it: in the plugin's
  ``pre_backward``, not the strategy's, which runs before it;
- ``finish_backward`` (the gradients reduced; stage 3 frees the root unit with ``end_step`` when the
  step has no further backward): ``on_after_backward`` must see the reduced gradients, as under DDP,
  so this runs before it: in the plugin's ``post_backward``, not the strategy's, which runs after it.

So the strategy keeps Lightning's ``backward`` (what a patch of ``Strategy.backward`` sees, as
Lightning's own tests patch it to count backwards), and its ``pre_backward``/``post_backward`` have
nothing to do. Every plugin the strategy trains with is one of these (``check_precision_supported``).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_zero.compat.lightning_api import without_weight_cache
from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.comm.collectives import ProcessGroup
from lightning_zero.engine.gradients.grad_scaler import ZeroGradScaler
from lightning_zero.engine.gradients.norms import clip_grads_by_global_norm_


def _engine_of(module: Any) -> Optional[ZeroEngine]:
    """The engine of the Trainer ``module`` is attached to (None: none, or not a ``ZeroStrategy``'s)."""
    return getattr(getattr(getattr(module, "_trainer", None), "strategy", None), "engine", None)


class _ShardedNormClipping:
    """Mixin: ``clip_grad_by_norm`` over the global norm of the sharded gradients, and the engine's
    part of each backward (see [Note: the engine's part of a backward])."""

    norm_group: ProcessGroup = None
    """The ranks whose shards together make each gradient whole (the strategy sets it: with hybrid
    sharding, the shard group; else all ranks)."""
    norm_device: torch.device = torch.device("cpu")
    """Where the norm is reduced: the compute device (the strategy sets it; offloaded gradients are
    on the host, and NCCL reduces device tensors only)."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        parameters = list(self.main_params(optimizer))  # type: ignore[attr-defined]
        clip_grads_by_global_norm_(parameters, clip_val, self.norm_device, group=self.norm_group)

    backward_unfinished: bool = False
    """Between the engine's ``before_backward`` and ``finish_backward``: the strategy's
    ``post_backward`` checks it (see ``check_backward_finished``)."""

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        tensor = super().pre_backward(tensor, module)  # type: ignore[misc]  # `on_before_backward` still sees `.grad`
        engine = _engine_of(module)
        if engine is not None:
            engine.before_backward()
            self.backward_unfinished = True
        return tensor

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        engine = _engine_of(module)
        if engine is not None:  # `on_after_backward` sees the reduced gradients, as under DDP
            engine.finish_backward()
            self.backward_unfinished = False
            if module.automatic_optimization:  # manual optimization: after `training_step` (step_hooks.py)
                engine.end_step()
        return super().post_backward(tensor, module)  # type: ignore[misc]

    def _clip_gradients(self, model: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning runs this right after `on_before_optimizer_step`, inside the optimizer's closure:
        # gradients assigned to `param.grad` there reach the shards before they are clipped and
        # stepped (see engine/gradients/grad_window.py)
        engine = _engine_of(model)
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


def check_backward_finished(plugin: Precision) -> None:
    """After a backward (the strategy's ``post_backward``): raise where a subclass of ours overrode
    ``post_backward`` without calling ours, which would leave the gradients unreduced."""
    if getattr(plugin, "backward_unfinished", False):
        plugin.backward_unfinished = False  # type: ignore[attr-defined]
        raise RuntimeError(
            f"{type(plugin).__name__}.post_backward did not call lightning-zero's, so this backward's gradients"
            " were never reduced across ranks. HINT: call `super().post_backward(tensor, module)` in it (and"
            " `super().pre_backward(tensor, module)` in `pre_backward`)."
        )


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
