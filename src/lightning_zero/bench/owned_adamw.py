"""`OwnedAdamW`: torch's AdamW arithmetic in a class lightning-zero does not know, so the engine steps
it on the ownership path (each parameter whole on an owner rank, see docs/optimizers.md) — the
benchmark's `zero2_whole` and `zero3_whole` rows.

Why not a subclass of AdamW: the engine decides how an optimizer steps by the most derived class it
knows (`engine/optimizer/optimizer_kinds.py`, `step_granularity`), so a subclass is element-wise and
takes the chunk path. A class that only borrows AdamW's step, without deriving from it, is unknown,
and unknown classes take the ownership path (always right). Its updates are AdamW's, element for
element, so the row trains the chunk path's model and the difference between the rows is the
ownership path's cost alone: the two all-to-alls in and the one out, and the owners' full-shape
state. `tests/test_bench.py` checks both claims.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer


class OwnedAdamW(Optimizer):
    """AdamW (`torch.optim.AdamW`, decoupled weight decay) that lightning-zero steps whole on owner
    ranks: the same defaults, state and update; `fused` and `foreach` as AdamW takes them."""

    # AdamW's own step and state creation; they read `param_groups`, `state` and `defaults` only
    _init_group = torch.optim.AdamW._init_group
    step = torch.optim.AdamW.step

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
    ) -> None:
        # AdamW's param-group defaults, so its step reads what it expects (its checks of the values
        # run in the reference AdamW the test builds beside this one)
        defaults: dict[str, Any] = {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": False, "maximize": False,
            "foreach": foreach, "capturable": False, "differentiable": False, "fused": fused,
            "decoupled_weight_decay": True,
        }  # fmt: skip
        super().__init__(params, defaults)
        if fused:
            self._step_supports_amp_scaling = True
