"""Lightning's model summary with true parameter counts under ZeRO-3.

At stage 3 a parameter at rest is an empty placeholder, so Lightning's summary (which sums
``p.numel()``) would report 0 parameters — what DeepSpeed users saw (Lightning issue #18514). This
summary counts each parameter's full size, adds a "Params per Device" column (the chunk this rank
keeps), and gathers the model for the optional ``example_input_array`` forward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary, get_human_readable_count

from lightning_zero.engine import ZeroEngine


class ZeroModelSummary(ModelSummary):
    """``ModelSummary`` counting full (unsharded) sizes, plus what each device keeps."""

    def __init__(self, model: LightningModule, engine: ZeroEngine, max_depth: int = 1) -> None:
        self._engine = engine
        self._full_numel = {id(p.param): p.layout.numel for p in engine.params}
        self._local_numel = {id(p.param): p.owned_numel for p in engine.params}
        super().__init__(model, max_depth=max_depth)

    def _count(self, module: Any, table: dict[int, int], trainable_only: bool = False) -> int:
        return sum(table.get(id(p), p.numel()) for p in module.parameters() if p.requires_grad or not trainable_only)

    @property
    def param_nums(self) -> list[int]:
        return [self._count(layer._module, self._full_numel) for layer in self._layer_summary.values()]

    @property
    def total_parameters(self) -> int:
        return self._count(self._model, self._full_numel)

    @property
    def trainable_parameters(self) -> int:
        return self._count(self._model, self._full_numel, trainable_only=True)

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        per_device = [self._count(layer._module, self._local_numel) for layer in self._layer_summary.values()]
        column = [get_human_readable_count(n) for n in per_device]
        if len(arrays[0][1]) > len(column):  # Lightning appended a row for parameters outside layers
            column.append("-")
        position = [name for name, _ in arrays].index("Params") + 1
        arrays.insert(position, ("Params per Device", column))
        return arrays

    def _forward_example_input(self) -> None:
        self._engine.begin_step()
        try:
            super()._forward_example_input()
        finally:
            self._engine.end_step()


def use_true_sizes_in_model_summary(trainer: Trainer, engine: ZeroEngine) -> None:
    """Make the Trainer's model-summary callbacks (plain or rich) build a :class:`ZeroModelSummary`."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummaryCallback):
            callback._summary = partial(_zero_summary, callback, engine)  # type: ignore[method-assign]


def _zero_summary(callback: ModelSummaryCallback, engine: ZeroEngine, trainer: Trainer, pl_module: LightningModule) -> ModelSummary:
    return ZeroModelSummary(pl_module, engine, max_depth=callback._max_depth)
