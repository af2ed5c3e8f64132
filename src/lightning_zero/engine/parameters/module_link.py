"""Which engine holds a module's parameters sharded, found from the module itself.

The link holds any object: ``engine.linked_engine`` gives it its type, so this module needs no
import of the engine.

[Note: after fit]
ZeRO-3 exists so that no rank ever holds the whole model, so a stage-3 module stays sharded at rest
when ``fit`` (or ``validate``/``test``/``predict``) ends, as under FSDP: its weights are then the
chunks its engine holds. The engine drops what only a running step needs (gradients, communication
buffers, its hooks) and keeps the parameter chunks and the optimizers' state (``save_checkpoint``
after ``fit`` writes it). The module keeps a link to that engine, so the engine lives exactly as
long as the module; the next run on the module (the same Trainer validating, or a new Trainer with
the same configuration) resumes the engine instead of building one, and a differently configured
engine first has it release the full parameters (every rank then holds the whole model, as
stages 1-2 need anyway). Full weights appear only where asked for: ``summon_full_params()``
(optionally on rank 0 only, or in host memory), a ``state_dict_type="full"`` save, the spawn
launcher's hand-back to the calling process (rank 0 only).

The link is neither copied nor pickled with the module (left out of its state, see [Note: engine
entries are not copied] in ``module_hooks.py``; failing that, it unpickles as None), so loading needs
no lightning-zero: a copy made inside ``summon_full_params``, or ``torch.save(model)`` at rest or inside
``fit`` (see [Note: reads at rest] in ``shards/at_rest.py``), is a plain module with full weights.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_zero.engine.parameters.module_hooks import keep_in_copies, leave_out_of_copies

_ATTRIBUTE = "_lightning_zero_engine"


class _Link:
    """Holds the engine; copies and pickles of the module get an empty link."""

    def __init__(self, engine: Optional[object]) -> None:
        self.engine = engine

    def __reduce__(self) -> Any:
        return (type(None), ())  # unpickled as None: loading the module needs no lightning-zero

    def __deepcopy__(self, memo: dict) -> "_Link":
        return _Link(None)


def link(module: nn.Module, engine: object) -> None:
    """``engine`` holds ``module``'s parameters sharded from now on."""
    object.__setattr__(module, _ATTRIBUTE, _Link(engine))
    leave_out_of_copies(module, _ATTRIBUTE)


def unlink(module: nn.Module, engine: object) -> None:
    """``engine`` no longer holds ``module`` (it released or dropped the parameters)."""
    if linked(module) is engine:
        object.__delattr__(module, _ATTRIBUTE)
        keep_in_copies(module, _ATTRIBUTE)


def linked(module: nn.Module) -> Optional[object]:
    """The engine holding ``module``'s parameters sharded, if one does."""
    held = module.__dict__.get(_ATTRIBUTE)
    return held.engine if isinstance(held, _Link) else None
