"""Lightning 2.5 against 2.6: the three places where the adapters meet Lightning differently.

- Fabric's ``setup_module_and_optimizers`` takes and returns the scheduler from Lightning 2.6.0
  (``(module, optimizers, scheduler)``); 2.5 passes two arguments and unpacks two values.
- ``weights_only`` (torch.load's flag) reaches ``Strategy.load_checkpoint`` and
  ``CheckpointIO.load_checkpoint`` from Lightning 2.6; a 2.5 Lightning, or a user's own
  ``CheckpointIO`` written for it, takes no such argument.
  Neither does ``Trainer.fit`` / ``validate`` take it before 2.6, so there a sharded directory's
  pickles are read with torch's default and a user cannot ask for ``weights_only=False``.
- ``MixedPrecision`` autocasts with torch's weight cache off from Lightning 2.6 (``cache_enabled=False``);
  2.5 leaves it on, so inside one ``training_step`` a parameter that requires grad is cast once and
  its cached copy is used again after an optimizer step updated it. Under DDP,
  ``toggle_optimizer`` turns ``requires_grad`` off on the parameters another optimizer stepped
  (the cache skips them); ours toggles the shards the optimizers hold, so the module's parameters
  keep ``requires_grad`` and a manual loop with two optimizers would read stale weights.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch


@functools.lru_cache(maxsize=None)
def _takes(function: Callable[..., Any], parameter: str) -> bool:
    return parameter in inspect.signature(function).parameters


@functools.lru_cache(maxsize=None)
def fabric_setup_takes_scheduler() -> bool:
    """Whether Fabric hands ``setup_module_and_optimizers`` the scheduler and unpacks three values.
    Asked on first use: importing Lightning here would import the adapters (``registration``),
    which import this module."""
    from lightning.fabric.strategies import Strategy

    return _takes(Strategy.setup_module_and_optimizers, "scheduler")


def fabric_setup_result(module: Any, optimizers: list[Any], scheduler: Optional[Any]) -> tuple[Any, ...]:
    """What ``setup_module_and_optimizers`` returns to the installed Fabric."""
    return (module, optimizers, scheduler) if fabric_setup_takes_scheduler() else (module, optimizers)


@functools.lru_cache(maxsize=None)
def trainer_takes_weights_only() -> bool:
    """Whether ``Trainer.fit`` takes ``weights_only`` (Lightning 2.6). Asked on first use, as above."""
    from lightning.pytorch import Trainer

    return _takes(Trainer.fit, "weights_only")


def load_passing_weights_only(load: Callable[..., Any], path: Any, weights_only: Optional[bool], *args: Any) -> Any:
    """``load(path, *args, weights_only=weights_only)`` where ``load`` takes the flag, else ``load(path,
    *args)`` (Lightning 2.5; a flag the caller cannot have been given)."""
    target = getattr(load, "__func__", load)  # a bound method's function: one cache entry per class
    if _takes(target, "weights_only"):
        return load(path, *args, weights_only=weights_only)
    return load(path, *args)


def without_weight_cache(autocast: torch.autocast) -> torch.autocast:
    """``autocast`` with torch's cache of cast weights off: itself where the plugin turned it off
    (Lightning 2.6), else the same autocast without the cache (Lightning 2.5)."""
    if not autocast._cache_enabled:
        return autocast
    return torch.autocast(autocast.device, dtype=autocast.fast_dtype, enabled=autocast._enabled, cache_enabled=False)
