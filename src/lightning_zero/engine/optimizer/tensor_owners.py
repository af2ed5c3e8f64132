"""Which rank steps each parameter of a whole-tensor optimizer (see [Note: step granularity] in
``optimizer_kinds.py``).

Each parameter gets one owner rank, the rank that holds its full optimizer state and steps it.
Owners are balanced by size, largest parameter first, each to the rank with the fewest elements so
far (the greedy rule of torch's ``ZeroRedundancyOptimizer``), so each rank holds about 1/N of the
state plus at most one parameter's worth more. Ties go to the lower rank: every rank computes the
same plan from the same sizes, with no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class OwnerPlan:
    """``owners[i]``: the rank that steps parameter i (in the optimizer's ``state_dict`` order)."""

    owners: tuple[int, ...]
    world_size: int

    def owned_by(self, rank: int) -> list[int]:
        """The indices of the parameters ``rank`` steps, in order."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def elements_per_rank(self, numels: Sequence[int]) -> list[int]:
        """How many parameter elements each rank steps (its share of the state, in elements per slot)."""
        load = [0] * self.world_size
        for owner, numel in zip(self.owners, numels):
            load[owner] += numel
        return load


def plan_owners(numels: Sequence[int], world_size: int) -> OwnerPlan:
    """Owners for parameters of ``numels`` elements, balanced by size (see the module docstring)."""
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return OwnerPlan(tuple(owners), world_size)
