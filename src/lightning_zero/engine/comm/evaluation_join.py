"""Evaluation with uneven inputs at stage 3: a rank out of batches shadows its peers' gathers, the
way torch's ``Join`` context lets DDP and ``ZeroRedundancyOptimizer`` run uneven inputs.

Under DDP an evaluation step communicates nothing, so ranks may run different numbers of them (a
loader without ``DistributedSampler``, an iterable dataset). At stage 3 every evaluation step
all-gathers its units, and a rank that stopped early would leave its peers waiting forever. So:

- every evaluation step starts with a one-element all-reduce of 1 ("I run a step");
- a rank at the end of its evaluation loop all-reduces 0 instead, and while the sum says that a
  peer runs a step, it issues that step's gathers itself (those of its own last step, in order:
  the unit tags check that they are the ones the peer issues) and asks again;
- once every rank sends 0, all leave together.

The all-reduces share the gathers' process group, so each one is matched with exactly one step.
Cost: one one-element all-reduce per evaluation step and no host sync (only a rank that has run
out of batches reads the sums).
"""

from __future__ import annotations

from typing import Callable

import torch

from lightning_zero.engine.comm import collectives


class EvaluationJoin:
    def __init__(self, group: collectives.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device

    def announce_step(self) -> None:
        """Before each evaluation step's first gather."""
        collectives.all_reduce(torch.ones(1, device=self.device), self.group)

    def shadow_until_all_done(self, replay_step: Callable[[], None]) -> int:
        """At the end of this rank's evaluation loop: replay a step for each step a peer still
        runs; returns how many were replayed."""
        replayed = 0
        while True:
            running = collectives.all_reduce(torch.zeros(1, device=self.device), self.group)
            if running.item() == 0:
                return replayed
            replay_step()
            replayed += 1
