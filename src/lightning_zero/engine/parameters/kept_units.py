"""Stage 3: which all-frozen units stay gathered from their first use in a training step until its
optimizer step (``ZeroConfig.keep_frozen_units_mb``).

[Note: kept frozen units]
A unit none of whose parameters requires a gradient (a frozen base under LoRA adapters) has weights
that no optimizer step changes, yet by default it is gathered for every forward and again for every
backward that runs through it (its weights give the inputs' gradients), and freed after each use:
with K micro-batches of gradient accumulation, up to 2K all-gathers of the same bytes per optimizer
step. Kept, it is gathered once per optimizer step, at its first forward, and holds its full weights
on the device until then (its gathered bytes, a budget's worth per rank at most).

- Which: the all-frozen units of a training step, in order of first use, while their gathered bytes
  fit in what the budget has left; a unit that does not fit is freed after each use as before, and a
  later, smaller one may still fit. Every rank runs the same units in the same order (the unit tags
  check that) and a unit's gathered bytes are the same on every rank, so every rank keeps the same
  units and skips the same all-gathers: the ranks' collectives still match.
- Until when: the end of the step's last micro-batch (``end_step`` with ``sync_gradients``, right
  before the optimizer step), ``after_optimizer_step`` for a loop that steps without it, the start
  of an evaluation step (evaluation frees units after each use, as without the option), and the end
  of training (``end_training``, ``close``). A micro-batch that only accumulates ends with them
  still gathered. The weights are the ones the gather gave: bitwise what regathering would give,
  since nothing but an optimizer step or a write between steps changes a chunk.
- Not kept: the root unit (gathered for the whole step anyway), units with any trainable parameter
  (an optimizer step changes them), and anything in an evaluation step.
"""

from __future__ import annotations

import math
from typing import Sequence

from lightning_zero.engine.parameters.unit import Unit, UnitState


class KeptFrozenUnits:
    """The all-frozen units kept gathered until the optimizer step, within ``budget_bytes`` per rank
    (see [Note: kept frozen units])."""

    def __init__(self, units: Sequence[Unit], budget_bytes: float) -> None:
        self._units = list(units)
        self.budget_bytes = budget_bytes
        self.indices: set[int] = set()
        """Indices of the units kept in this step (looked up at every unit's free)."""
        self._considered: set[int] = set()
        self._spent = 0
        self.keeping = False
        """Whether units used now may be kept (a training step, with a budget)."""

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def begin(self, training: bool) -> None:
        """At the start of a step: an evaluation step frees what training micro-batches kept."""
        if not training:
            self.release()
        self.keeping = training and self.enabled

    def used(self, unit: Unit) -> None:
        """``unit`` was gathered for a forward: keep it if it is all-frozen and still fits."""
        if not self.keeping or unit.index in self._considered or unit.index == 0:
            return
        self._considered.add(unit.index)
        if any(p.param.requires_grad for p in unit.params):
            return
        size = gathered_bytes(unit)
        if self._spent + size <= self.budget_bytes or math.isinf(self.budget_bytes):
            self.indices.add(unit.index)
            self._spent += size

    def release(self) -> None:
        """Free every kept unit (the step's gathers are over: before its optimizer step)."""
        for index in self.indices:
            self._units[index].reshard()
        self.indices.clear()
        self._considered.clear()
        self._spent = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of full weights the kept units hold now."""
        return sum(gathered_bytes(self._units[i]) for i in self.indices if self._units[i].state is UnitState.UNSHARDED)


def gathered_bytes(unit: Unit) -> int:
    """Bytes of ``unit``'s full weights while gathered (every rank alike)."""
    return sum(bucket.gathered.nbytes for bucket in unit.buckets)
