"""Where a rank's evaluation loop ends: the callback that lets ranks run uneven evaluation inputs
at stage 3 (see ``engine/comm/evaluation_join.py``).

The strategy puts it first among the Trainer's callbacks: at the end of a validation, test or
predict loop it runs before any other callback, and so before their collectives (e.g.
``ModelCheckpoint``'s agreement on whether to save), while a peer may still be running steps.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class FinishEvaluation(Callback):
    """Calls the engine's ``finish_evaluation`` at the end of every evaluation loop."""

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer)

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer)

    @staticmethod
    def _finish(trainer: Trainer) -> None:
        engine: Any = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.finish_evaluation()


def run_first(trainer: Trainer) -> None:
    """Make ``FinishEvaluation`` the Trainer's first callback (once, whatever the number of setups)."""
    trainer.callbacks[:] = [FinishEvaluation()] + [c for c in trainer.callbacks if not isinstance(c, FinishEvaluation)]
