"""Whether the Trainer's offloaded optimizer steps may be taken during backward, and whether they
need rollback copies (see [Note: the host step during backward] in ``engine/offload/step_ahead.py``).

The engine takes a step ahead only where the step after backward would read the same gradients and
hyperparameters, and checks that at ``optimizer.step()``; what the Trainer's configuration tells
decides the rest:

- **after backward**: manual optimization (the Trainer cannot tell which backward a step follows)
  and clipping by value (it edits every gradient it clamps, which it cannot tell before);
- **ahead, with rollback copies**: clipping by norm (a step where it applies is redone), loss
  scaling (``16-mixed``: each bucket is unscaled as it arrives; a step skipped for inf/NaN is
  undone), or a hook
  between backward and the step that may edit gradients or hyperparameters: the LightningModule's
  ``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping`` or
  ``optimizer_step``, or a callback's ``on_after_backward`` / ``on_before_optimizer_step``;
- **ahead, without copies**: nothing between backward and the step can change it (the engine still
  checks, and raises if something did).
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_zero.engine import ZeroEngine

MODULE_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step")
"""LightningModule hooks that run between backward and the optimizer step (or around it)."""
CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def plan_host_step(trainer: Trainer, engine: ZeroEngine) -> None:
    """Tell ``engine`` how this run's offloaded steps are taken (``ZeroEngine.plan_host_step``)."""
    module = trainer.lightning_module
    reason = _why_after_backward(trainer, module)
    if reason:
        engine.plan_host_step(ahead=False, keep_rollback=False, reason=reason)
        return
    hooks = [f"LightningModule.{name}" for name in MODULE_HOOKS if is_overridden(name, module, LightningModule)]
    for callback in trainer.callbacks:
        hooks += [f"{type(callback).__name__}.{name}" for name in CALLBACK_HOOKS if is_overridden(name, callback, Callback)]
    scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
    loss_scale = (lambda: scaler._scale) if scaler is not None and scaler.is_enabled() else None
    engine.plan_host_step(ahead=True, keep_rollback=bool(trainer.gradient_clip_val) or bool(hooks), loss_scale=loss_scale)


def _why_after_backward(trainer: Trainer, module: LightningModule) -> str:
    if not module.automatic_optimization:
        return "manual optimization"
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
        return "clipping by value"
    return ""
