"""Refusing a parameter object replaced after sharding, at the assignment that replaces it.

The engine knows each parameter by its object: its hooks, buckets and optimizer slots hold that
``nn.Parameter``. ``module.weight = nn.Parameter(...)`` after setup puts a new object in the
module that nothing reduces or steps, and training goes on with silently wrong (and, when one rank
did it, diverging) weights. torch calls a global hook whenever a module registers a parameter,
which is what such an assignment does, so the guard sees it where it happens and raises there,
naming the parameter; the cost is nothing per step. (Assigning ``param.data`` keeps the object:
``ShardedParam`` checks that at stages 1-2 and ``show_unsharded`` at stage 3.)
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils.hooks import RemovableHandle

from lightning_zero.engine.shards.sharded_param import ShardedParam


class ParameterReplacementGuard:
    """While open, replacing one of ``params`` in any module that holds it raises ``RuntimeError``."""

    def __init__(self, module: nn.Module, params: Sequence[ShardedParam]) -> None:
        sharded = {id(p.param): p for p in params}
        # keyed by the owning modules themselves, weakly: an id would be reused once a module is
        # freed, and the guard of an engine nobody closed would then refuse a new model's parameters
        self._held: weakref.WeakKeyDictionary[nn.Module, dict[str, ShardedParam]] = weakref.WeakKeyDictionary()
        for owner in module.modules():
            mine = {local: sharded[id(v)] for local, v in owner._parameters.items() if v is not None and id(v) in sharded}
            if mine:
                self._held[owner] = mine
        self._handle: Optional[RemovableHandle] = register_module_parameter_registration_hook(self._on_register)

    def _on_register(self, owner: nn.Module, local: str, value: Optional[nn.Parameter]) -> None:
        held = self._held.get(owner, {}).get(local)
        if held is None or value is held.param:
            return
        raise RuntimeError(
            f"Parameter {held.name!r} was replaced by a new object after lightning-zero sharded it;"
            " the new object would never be reduced or stepped (and replicas would silently"
            " disagree). HINT: change its values instead of the object, e.g.\n"
            f"    with torch.no_grad(): self.{held.name}.copy_(new_value)  # in the LightningModule\n"
            "at stage 3 inside `strategy.summon_full_params(writeback=True)`, or build the model you"
            " want before `trainer.fit` (or in `configure_model`)."
        )

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
