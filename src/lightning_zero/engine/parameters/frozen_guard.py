"""Refusing a parameter unfrozen after setup, at the next step.

Which parameters train is decided once, when the engine sets the module up: a frozen one
(``requires_grad=False``) gets no gradient bucket and no optimizer chunk (at stages 1-2 it is not
sharded at all), and a half-precision one keeps no fp32 master (see [Note: frozen chunks] in
``shards/sharded_param.py``). ``p.requires_grad_(True)`` later (Lightning's ``BackboneFinetuning``,
a hand-written unfreeze) changes none of that: autograd would compute the parameter's gradient, no
bucket would reduce it, no optimizer would step it, and training would go on without it, silently.
torch has no hook on the flag, so the engine reads the frozen parameters' flags at the start of
each step (one pass in C over them; nothing where no parameter is frozen) and raises, naming them.
A Trainer's next ``fit`` after such a change builds a new engine rather than go on with the one
the last run kept (``lightning/sharded_setup.py``).
"""

from __future__ import annotations

from operator import attrgetter

from torch import nn

_REQUIRES_GRAD = attrgetter("requires_grad")


class FrozenAtSetup:
    """The parameters of ``module`` frozen when the engine set it up; ``check`` refuses any of them
    that requires a gradient now."""

    def __init__(self, module: nn.Module) -> None:
        frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
        self._names = [name for name, _ in frozen]
        self._params = [p for _, p in frozen]

    def unfrozen(self) -> bool:
        """Whether a parameter frozen at setup requires a gradient now."""
        return any(map(_REQUIRES_GRAD, self._params))

    def check(self) -> None:
        if not self.unfrozen():
            return
        unfrozen = [name for name, p in zip(self._names, self._params) if p.requires_grad]
        listed = ", ".join(repr(name) for name in unfrozen[:5]) + (f" and {len(unfrozen) - 5} more" if len(unfrozen) > 5 else "")
        raise RuntimeError(
            f"{len(unfrozen)} parameter(s) frozen (requires_grad=False) when lightning-zero set the model up"
            f" require gradients now: {listed}. Which parameters train is fixed at setup (their gradient"
            " buckets, optimizer chunks and master copies are made then), so they would not be trained."
            " HINT: set `requires_grad` as the whole run needs it before `fit` (or `fabric.setup`); to"
            " unfreeze in phases (as Lightning's `BackboneFinetuning` does), end the run after a phase and"
            " start a new `fit` with the new flags (a `Trainer` sets the engine up again for it)."
        )
