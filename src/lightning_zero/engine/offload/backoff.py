"""When the host step stops stepping during backward for a while: "backing off" in [Note: the host
step during backward] (``step_ahead.py``).

A redone step costs its host step twice, plus the rollback copies, and a kept step whose verdict
compared contents may expose more than stepping after backward would have. After either, the next
steps are taken after backward: 1, then 2, 4, ... up to ``MAX_BACKOFF`` while it keeps happening;
a step taken ahead and kept (and worth it) ends the back-off.
"""

from __future__ import annotations

import os

from lightning_zero.engine.offload.host_step_report import HostStepTiming

MAX_BACKOFF = 64
"""The most steps taken after backward in a row after redone (or costly) steps."""
BACKOFF_REASON = "a recent step taken during backward was redone (clipping applied, or an edit)"
COSTLY_REASON = "stepping during backward exposed more than stepping after it would (the verdict's content check)"
JUDGED_FROM_ENV = "LIGHTNING_ZERO_JUDGE_HOST_STEPS_FROM_S"
"""Overrides ``WORTH_JUDGING_S`` (seconds; ``inf``: never judge, so stepping ahead never backs off
for cost, which makes the modes independent of timing: the test suite sets it)."""
WORTH_JUDGING_S = float(os.environ.get(JUDGED_FROM_ENV, "0.02"))
"""Host steps shorter than this are never judged by what stepping ahead hid (timings of a few
milliseconds say more about the machine's load than about the step)."""


class BackOff:
    """How many of the next steps to take after backward, and why."""

    def __init__(self) -> None:
        self.length = 0
        """Steps to take after backward after the next redo or costly step (0: none lately)."""
        self.left = 0
        """Steps still to take after backward before stepping ahead again."""
        self.reason = BACKOFF_REASON

    def why_not(self) -> str:
        """Why the next backward must not step ahead ("" where it may)."""
        return self.reason if self.left else ""

    def after_step(self, mode: str, paid: bool, was_backing_off: bool) -> None:
        """After a step taken in ``mode`` ("ahead", "redone", "after_backward"); ``paid``: a step
        kept ahead hid more than it cost (``paid_off()``); ``was_backing_off``: this step was taken after
        backward because of the back-off."""
        if mode == "redone" or not paid:
            self.length = min(MAX_BACKOFF, max(1, 2 * self.length))
            self.left = self.length
            self.reason = BACKOFF_REASON if mode == "redone" else COSTLY_REASON
        elif mode == "ahead":
            self.length = 0
        elif was_backing_off:
            self.left -= 1

    def stop(self) -> None:
        """Step ahead from the next step on, whatever happened lately."""
        self.length = self.left = 0


def paid_off(timing: HostStepTiming) -> bool:
    """Whether a step kept ahead exposed less than stepping after backward would have: the worker's
    part after backward ended plus the verdict, against the host step itself. Judged only where the
    verdict compared contents (its one cost that grows with the model: a pass over every gradient on
    the critical path) and the step is long enough for timings to mean something."""
    if timing.backward_end is None or not timing.buckets or timing.host_step_s < WORTH_JUDGING_S:
        return True
    if timing.verdict_s < 0.1 * timing.host_step_s:  # no content check (or a cheap one): it pays
        return True
    tail = max(0.0, max(end for _, _, end in timing.buckets) - timing.backward_end)
    return tail + timing.verdict_s < timing.host_step_s
