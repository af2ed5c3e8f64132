"""``ZeroStepHooks``, ``ZeroStrategy``'s base class: the hooks Lightning calls in each training,
evaluation and optimizer step, which tell the engine where its steps begin and end:

- ``training_step``: rank 0's buffers broadcast (as DDP does), then the engine's step begins;
- ``backward`` is Lightning's: the precision plugin reduces the gradients before ``on_after_backward``
  sees them (see [Note: the engine's part of a backward] in ``precision.py``);
- ``block_backward_sync``: micro-batches accumulate without reducing;
- ``optimizer_step``: after the step, the updated shards are all-gathered into the parameters;
- the validation, test and predict steps: inside the engine's evaluation steps.

Of ``ZeroStrategy`` they read only ``_engine``, the engine it sets up for the current run
(``sharded_setup.py``); without one they are ``DDPStrategy``'s. ``grad_norms`` is the arithmetic
of ``ZeroStrategy.grad_norm``, read in ``on_before_optimizer_step``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Union

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.comm import collectives
from lightning_zero.lightning.checkpointing import unwrap_optimizer
from lightning_zero.lightning.precision import check_backward_finished


class ZeroStepHooks(DDPStrategy):
    """``DDPStrategy``'s step hooks, driving ``_engine`` when there is one."""

    _engine: Optional[ZeroEngine]
    """The engine sharding the current run (set by ``ZeroStrategy``; None without one)."""

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.model is not None:
            # DDP re-broadcasts rank 0's buffers (e.g. BatchNorm statistics) before each forward
            collectives.broadcast_tensors_(list(self.model.buffers()), src=0, group=None)
        if self._engine is not None:
            self._engine.begin_step()
        return super().training_step(*args, **kwargs)

    @override
    def post_training_step(self) -> None:
        # manual optimization ran its backward passes inside training_step
        if self._engine is not None and not self.lightning_module.automatic_optimization:
            self._engine.end_step()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().predict_step, *args, **kwargs)

    def _evaluation_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            return step(*args, **kwargs)
        self._engine.begin_evaluation_step()
        try:
            return step(*args, **kwargs)
        finally:
            self._engine.end_step()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-batches that accumulate without stepping (``accumulate_grad_batches``)."""
        engine = self._engine
        if engine is None:
            yield None
            return
        engine.sync_gradients = False
        try:
            yield None
        finally:
            engine.sync_gradients = True

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        pass  # no DDP reducer to prepare; the engine's part runs in the precision plugin's `pre_backward`

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        # the precision plugin finished the backward before `on_after_backward`, unless a subclass
        # of it skipped ours
        check_backward_finished(self.precision_plugin)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._engine is not None:
            self._engine.after_optimizer_step(unwrap_optimizer(optimizer))
        return output


def grad_norms(engine: ZeroEngine, norm_type: float) -> dict[str, torch.Tensor]:
    """The norm of each parameter's full gradient and their total, keyed as
    ``lightning.pytorch.utilities.grad_norm`` keys them (see ``ZeroStrategy.grad_norm``)."""
    norms = engine.grad_norms(norm_type)
    total = norms.pop("total", None)
    out = {f"grad_{norm_type}_norm/{name}": value for name, value in norms.items()}
    if total is not None:
        out[f"grad_{norm_type}_norm_total"] = total
    return out
