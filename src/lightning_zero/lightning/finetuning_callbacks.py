"""Lightning's ``BaseFinetuning`` callbacks (``BackboneFinetuning`` and subclasses), refused at setup.

They freeze modules before training and unfreeze them during ``fit``, adding the parameters to the
optimizer as new param groups. Under this strategy which parameters train is fixed when the engine
sets the module up (``engine/parameters/frozen_guard.py``), and the optimizer's param groups hold
this rank's chunks, not the module's parameters, which the callback maps by name: it would fail at
its first epoch with a bare ``KeyError``. So ``fit`` refuses it at setup, on every rank, naming it.
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.trainer.states import TrainerFn


def refuse_finetuning_callbacks(trainer: Trainer) -> None:
    """Raise ``ValueError`` where ``trainer`` fits with a ``BaseFinetuning`` callback."""
    found = [type(callback).__name__ for callback in trainer.callbacks if isinstance(callback, BaseFinetuning)]
    if found and trainer.state.fn == TrainerFn.FITTING:
        raise ValueError(
            f"{', '.join(found)} unfreezes parameters during `fit`, which lightning-zero does not support:"
            " which parameters train is fixed when the strategy sets the model up. HINT: freeze what stays"
            " frozen before `fit` (`requires_grad_(False)`) and leave the callback out; to unfreeze in"
            " phases, run one `fit` per phase with the flags set before it."
        )
