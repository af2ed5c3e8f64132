"""Lightning callbacks that edit the module's parameters between steps, under ZeRO: their hooks that
read or write them run with the full parameters in place.

``ModelPruning`` re-parametrizes modules and rewrites weights between steps. At stage 3 the
module's parameters then exist only as this rank's chunks, so the strategy runs exactly those hooks
inside ``summon_full_params`` (with ``writeback`` where the hook writes the parameters), and the
run ends with DDP's weights. At stages 1-2 the parameters are whole anyway; the writeback still
refreshes the fp32 master copies (``bf16-true``). Cost at stage 3: each such hook gathers the whole
model on every rank for its duration.

The weight-averaging callbacks (``StochasticWeightAveraging``, ``WeightAveraging``) are not
gathered: their average is kept as shards (``sharded_averaging.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelPruning

READS, WRITES = False, True
"""Whether a hook's edits of the parameters must be written back into the shards."""

PARAMETER_HOOKS: list[tuple[type, dict[str, bool]]] = [
    (
        ModelPruning,
        {"on_train_epoch_end": WRITES, "on_validation_epoch_end": WRITES, "on_train_end": WRITES, "on_save_checkpoint": READS},
    ),
]
"""Each callback class, and its hooks that touch the module's parameters."""


def gather_around_parameter_hooks(trainer: "pl.Trainer", strategy: Any) -> None:
    """Make the parameter-touching hooks of the Trainer's callbacks in ``PARAMETER_HOOKS`` run inside
    ``strategy.summon_full_params(writeback)``. Idempotent: setup runs again for ``validate``."""
    for callback in trainer.callbacks:
        for cls, hooks in PARAMETER_HOOKS:
            if isinstance(callback, cls) and not getattr(callback, "_lightning_zero_gathered", False):
                for name, writeback in hooks.items():
                    setattr(callback, name, GatheredHook(getattr(callback, name), strategy, writeback))
                callback._lightning_zero_gathered = True  # type: ignore[attr-defined]


class GatheredHook:
    """``hook`` run inside ``strategy.summon_full_params(writeback)``; a class rather than a closure so
    that a Trainer holding the callback still pickles."""

    def __init__(self, hook: Callable[..., Any], strategy: Any, writeback: bool) -> None:
        self.hook, self.strategy, self.writeback = hook, strategy, writeback
        functools.update_wrapper(self, hook)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.strategy.summon_full_params(writeback=self.writeback):
            return self.hook(*args, **kwargs)


__all__ = ["PARAMETER_HOOKS", "gather_around_parameter_hooks"]
