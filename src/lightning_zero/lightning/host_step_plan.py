"""Whether the Trainer's offloaded optimizer steps may be taken during backward, whether they need
rollback copies, and whether the verdict compares the gradients' contents (see [Note: the host step
during backward] in ``engine/offload/step_ahead.py``).

The engine takes a step ahead only where the step after backward would read the same gradients and
hyperparameters, and checks that at ``optimizer.step()``; what the Trainer's configuration tells
decides the rest:

- **after backward**: manual optimization (the Trainer cannot tell which backward a step follows)
  and clipping by value (it edits every gradient it clamps, which it cannot tell before);
- **ahead, with rollback copies**: clipping by norm (a step where it applies is redone), loss
  scaling (``16-mixed``: each bucket is unscaled as it arrives; a step skipped for inf/NaN is
  undone), or user code between backward and the step that may edit gradients or hyperparameters:
  the LightningModule's ``backward``, ``on_after_backward``, ``on_before_optimizer_step``,
  ``configure_gradient_clipping`` or ``optimizer_step``, a callback's ``on_after_backward`` /
  ``on_before_optimizer_step``, a precision plugin or strategy subclassed with its own methods.
  Where there is user code, the verdict also compares the gradients' contents, since an edit
  through ``.data`` or a NumPy view moves no version counter (see [Note: gradient digests] in
  ``engine/offload/grad_digest.py``); the Trainer's own clipping moves them, so it needs no content check;
- **ahead, without copies**: nothing between backward and the step can change it (the engine still
  checks versions and hyperparameters, and raises if something changed).
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.host_step_overlap import ScaleOf

MODULE_HOOKS = ("backward", "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step")
"""LightningModule hooks that run between backward and the optimizer step (or around it)."""
CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step")
PLUGIN_METHODS = (
    "backward", "pre_backward", "post_backward", "optimizer_step", "clip_gradients", "clip_grad_by_norm", "clip_grad_by_value",
)  # fmt: skip
"""Precision plugin methods that run between backward and the step (ours or a user's subclass)."""
STRATEGY_METHODS = ("backward", "pre_backward", "post_backward", "optimizer_step")


def plan_host_step(trainer: Trainer, engine: ZeroEngine) -> None:
    """Tell ``engine`` how this run's offloaded steps are taken (``ZeroEngine.plan_host_step``)."""
    module = trainer.lightning_module
    reason = _why_after_backward(trainer, module)
    if reason:
        engine.plan_host_step(ahead=False, keep_rollback=False, reason=reason)
        return
    hooks = user_code_between_backward_and_step(trainer)
    scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
    loss_scale = ScaleOf(scaler) if scaler is not None and scaler.is_enabled() else None
    engine.plan_host_step(
        ahead=True, keep_rollback=bool(trainer.gradient_clip_val) or bool(hooks), loss_scale=loss_scale, check_contents=bool(hooks)
    )


def user_code_between_backward_and_step(trainer: Trainer) -> list[str]:
    """The user's methods that run between a backward and its optimizer step, by name (empty: only
    Lightning's and lightning-zero's code runs there)."""
    module = trainer.lightning_module
    hooks = [f"LightningModule.{name}" for name in MODULE_HOOKS if is_overridden(name, module, LightningModule)]
    for callback in trainer.callbacks:
        hooks += [f"{type(callback).__name__}.{name}" for name in CALLBACK_HOOKS if is_overridden(name, callback, Callback)]
    for subclassed, methods in ((trainer.strategy.precision_plugin, PLUGIN_METHODS), (trainer.strategy, STRATEGY_METHODS)):
        ours = _our_class(subclassed)
        if ours is not None and type(subclassed) is not ours:
            hooks += [f"{type(subclassed).__name__}.{name}" for name in methods if is_overridden(name, subclassed, ours)]
    return hooks


def _our_class(instance: object) -> Optional[type]:
    """The lightning-zero class ``instance`` is of, or subclasses (None: none)."""
    return next((c for c in type(instance).__mro__ if c.__module__.startswith("lightning_zero.")), None)


def _why_after_backward(trainer: Trainer, module: LightningModule) -> str:
    if not module.automatic_optimization:
        return "manual optimization"
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
        return "clipping by value"
    return ""
