"""An optimizer's ``step`` replaced on the instance, the way the engine's offload tiers take over
the step (the NVMe stream, the host step during backward) without touching the user's class.

The replacement is set on the instance because LR schedulers wrap ``optimizer.step`` there too (and
look for ``_wrapped_by_lr_sched``); it runs torch's step hooks around ``body`` once per step, as the
class's own ``step`` would, and marks the optimizer stepped for the schedulers' warning.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer

Closure = Optional[Callable[[], Any]]


def unhooked_step(optimizer: Optimizer) -> Callable[..., Any]:
    """The optimizer class's ``step`` without torch's hook wrapper (the replacement runs the hooks once)."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def instance_step(optimizer: Optimizer, body: Callable[[Optimizer, dict[str, Any]], None]) -> Callable[..., Any]:
    """A ``step(closure=None, **kwargs)`` for ``optimizer``'s instance: runs the closure (with grad
    enabled, as torch's optimizers do), then ``body(optimizer, kwargs)``, inside torch's step hooks;
    returns the closure's loss."""

    def hooked_body(opt: Optimizer, closure: Closure = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        body(opt, kwargs)
        return loss

    hooked = types.MethodType(Optimizer.profile_hook_step(hooked_body), optimizer)

    def step(closure: Closure = None, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return hooked(closure, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step
