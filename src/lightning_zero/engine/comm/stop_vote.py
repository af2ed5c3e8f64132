"""Requests to stop training that reach each rank at its own moment, agreed on by all ranks at one step.

[Note: stop votes]
A preemption signal (a scheduler's SIGTERM, SLURM's requeue signal) reaches every rank of a job, but
each at its own point of the step: one rank in its forward, another inside a collective. Acting on
it there — saving a checkpoint, which is a collective — pairs one rank's save with another rank's
gradient reduction, and the job hangs or dies. So a request only sets a flag on the rank that
received it (safe in a signal handler: no tensor, no collective), and the ranks vote:

- every gradient reduce-scatter carries each rank's flags as ``StopVote.WIDTH`` extra columns after
  its used-parameter flags (see [Note: used flags] in ``bucket.py``), summed by the same collective;
- the sums are read with the used flags in the backward's one host read (see [Note: deferred
  verdicts] in ``host_reads.py``), and ``count`` keeps every reason whose sum is positive.

Every rank sees the same sums after the same collective, so every rank learns at the same backward
that some rank asked to stop, and why, with no collective or host sync of its own: a request made
before a bucket's reduce-scatter is packed is counted in that backward, one made later in the next.
Stopping is the caller's business; it must wait for a step boundary, since a checkpoint holds no
half-accumulated gradients (``ZeroEngine.holds_unstepped_gradients``). A world of one rank counts
its own flags.
"""

from __future__ import annotations

import enum
from typing import Sequence


class StopReason(enum.IntEnum):
    """Why a rank asks to stop; each is one column of the vote."""

    EXIT = 0
    """Stop after the step (e.g. SIGTERM: the job is ending)."""
    REQUEUE = 1
    """Stop after the step, and have the job requeued (e.g. SLURM's requeue signal)."""


class StopVote:
    """This rank's stop requests and what the ranks agreed on (see [Note: stop votes])."""

    WIDTH = len(StopReason)
    """Columns a gradient reduction carries for the vote."""

    def __init__(self) -> None:
        self._requested = [False] * self.WIDTH
        self._agreed: set[StopReason] = set()

    def request(self, reason: StopReason) -> None:
        """Ask the ranks to stop; safe in a signal handler (sets a flag, nothing else)."""
        self._requested[reason] = True

    def ballot(self) -> tuple[bool, ...]:
        """This rank's flags now, one per reason, for the next reduction to carry."""
        return tuple(self._requested)

    def count(self, sums: Sequence[float]) -> None:
        """A reduction's summed flags (any positive scale): keep the reasons some rank voted for."""
        if any(sums):  # usually none voted: one C-level test per reduction, no iteration of the enum
            self._agreed.update(reason for reason, total in zip(StopReason, sums) if total > 0)

    @property
    def agreed(self) -> frozenset[StopReason]:
        """The reasons some rank asked to stop for, as of the last reduction read: the same on every
        rank between two reductions. Empty: go on."""
        return frozenset(self._agreed)

    def reset(self) -> None:
        """A new run: no request, nothing agreed."""
        self._requested = [False] * self.WIDTH
        self._agreed.clear()
