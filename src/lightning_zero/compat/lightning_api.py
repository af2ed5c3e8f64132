"""Lightning 2.5 against 2.6: the two places where the adapters call Lightning differently.

- Fabric's ``setup_module_and_optimizers`` takes and returns the scheduler from Lightning 2.6.0
  (``(module, optimizers, scheduler)``); 2.5 passes two arguments and unpacks two values.
- ``weights_only`` (torch.load's flag) reaches ``Strategy.load_checkpoint`` and
  ``CheckpointIO.load_checkpoint`` from Lightning 2.6; a 2.5 Lightning, or a user's own
  ``CheckpointIO`` written for it, takes no such argument.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional


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


def load_passing_weights_only(load: Callable[..., Any], path: Any, weights_only: Optional[bool], *args: Any) -> Any:
    """``load(path, *args, weights_only=weights_only)`` where ``load`` takes the flag, else ``load(path,
    *args)`` (Lightning 2.5; a flag the caller cannot have been given)."""
    target = getattr(load, "__func__", load)  # a bound method's function: one cache entry per class
    if _takes(target, "weights_only"):
        return load(path, *args, weights_only=weights_only)
    return load(path, *args)
