"""Whether stepping during backward can hide anything at all: "switching off" in [Note: the host step
during backward] (``step_ahead.py``).

Stepping ahead costs something every step whatever it hides: a handoff per wake of the worker, the
rollback copies, the verdict's comparisons, and the worker's own Python (the optimizer's update,
the records of what it read), which holds the interpreter the thread running backward needs. A host
step of a few milliseconds hides less than that: at the benchmark's launch-bound shape (a tiny model,
the step is host time) the host step after backward takes ~5 ms, and stepping it during backward
made the whole step ~15 ms slower, not faster. The per-step judge in ``backoff.py`` does not see
this: it counts only what is exposed after backward (the verdict, the worker's tail), against the
host step's wall time on the worker, which the contention itself stretches (25-40 ms there).

So the run's first ``TRIAL_STEPS`` steps are taken after backward, and the host step's time in each
is measured there, where nothing runs beside it: the smaller of its wall time and the process's CPU
time (a loaded machine stretches the first, a multi-threaded kernel the second). The median of the
trial's steps after its first (which creates the optimizer state), the largest over the ranks (one
all-reduce, once per run, at the same ``optimizer.step()`` on every rank), decides: below
``WORTH_HIDING_S`` stepping ahead is switched off for the rest of the run on every rank, and
``HostStepReport.switched_off`` says why (with a warning on rank zero); at or above it, every later
step is taken ahead as before. Either way the numerics are those of stepping after backward, bitwise.
Like the back-off for cost, this is a judgement of timings: where ``backoff.WORTH_JUDGING_S`` is
infinite (the test suite) no trial runs and nothing is switched off, so the modes never depend on the
machine's load.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from typing import Callable, Optional

from lightning_zero.engine.offload import backoff

TRIAL_STEPS = 4
"""The run's first steps, taken after backward to time the host step."""
WORTH_HIDING_FROM_ENV = "LIGHTNING_ZERO_HIDE_HOST_STEPS_FROM_S"
WORTH_HIDING_S = float(os.environ.get(WORTH_HIDING_FROM_ENV, "0.01"))
"""Host steps shorter than this (seconds, after backward) are not worth stepping during backward:
twice the launch-bound shape's (~5 ms), where stepping ahead costs three times what it could hide."""
TRIAL_REASON = "timing the host step after backward (the run's first steps)"
SWITCHED_OFF_REASON = "switched off: the host step is too short to hide (`HostStepReport.switched_off`)"
"""Counted for every step taken after backward once switched off (``reason`` says more)."""

Agree = Callable[[float], float]
"""The largest of the ranks' values (an all-reduce over the engine's groups)."""


class SwitchOff:
    """The trial of the run's first steps and its verdict (see the module doc)."""

    def __init__(self, agree: Optional[Agree]) -> None:
        self._agree = agree
        self._steps = 0
        self._timed: list[float] = []
        self.reason = ""
        """Why stepping ahead is off for the rest of the run ("" while it is not)."""
        self._start = (0.0, 0.0)

    @property
    def judging(self) -> bool:
        return self._agree is not None and math.isfinite(backoff.WORTH_JUDGING_S)

    def why_not(self) -> str:
        """Why the next backward must not step ahead ("" where it may)."""
        if self.reason:
            return SWITCHED_OFF_REASON
        return TRIAL_REASON if self.judging and self._steps < TRIAL_STEPS else ""

    def host_step_starts(self) -> None:
        """The host step after backward begins (the optimizer's update, on this thread)."""
        self._start = (time.perf_counter(), time.process_time())

    def host_step_ended(self) -> None:
        """The host step after backward ended: timed, where it is a trial step after the first."""
        wall, cpu = time.perf_counter() - self._start[0], time.process_time() - self._start[1]
        if 0 < self._steps < TRIAL_STEPS:
            self._timed.append(min(wall, cpu))

    def after_step(self) -> bool:
        """After every ``optimizer.step()`` (every rank calls it as often): at the trial's last step
        the ranks agree (one all-reduce). True where stepping ahead was switched off just now."""
        self._steps += 1
        if self._steps != TRIAL_STEPS or not self.judging or self.reason:
            return False
        mine = statistics.median(self._timed) if self._timed else math.inf  # nothing timed here: no say
        assert self._agree is not None
        agreed = self._agree(mine)
        if agreed >= WORTH_HIDING_S:
            return False
        self.reason = (
            f"the host step ({agreed * 1e3:.1f} ms after backward, the most of any rank) is too short to hide:"
            " stepping it during backward would cost more (the worker's handoffs and Python beside backward's),"
            f" so it is taken after backward for the rest of the run (threshold {WORTH_HIDING_S * 1e3:g} ms,"
            f" {WORTH_HIDING_FROM_ENV})"
        )
        return True

    def warn(self) -> None:
        """The rank-zero warning that stepping ahead was switched off, and why."""
        warnings.warn(f"lightning-zero: {self.reason}.", stacklevel=2)
