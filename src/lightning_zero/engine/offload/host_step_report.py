"""What an offloaded optimizer's steps did: taken during backward and kept, redone, or taken after
backward, and why; the last step's timing (see [Note: the host step during backward] in
``step_ahead.py``). ``ZeroEngine.host_step_report()`` returns it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class HostStepTiming:
    """When the host stepped in the last optimizer step (``time.perf_counter()`` seconds)."""

    mode: str
    """"ahead" (stepped during backward and kept), "redone" (stepped ahead, rolled back and stepped
    again after backward) or "after_backward"."""
    buckets: tuple[tuple[int, float, float], ...]
    """(bucket index, start, end) of each bucket stepped ahead, in the order they stepped."""
    backward_end: Optional[float]
    """When backward ended (``finish_backward`` began); None if no backward was seen."""
    host_step_s: float
    """Seconds the host spent stepping: the buckets stepped ahead, plus a step after backward."""
    verdict_s: float = 0.0
    """Seconds the verdict's comparisons took on the main thread, once the worker was done (the
    content check included, where it ran)."""

    @property
    def before_backward_end_s(self) -> float:
        """Seconds of the host step that ran before backward ended."""
        end = self.backward_end
        if end is None or self.mode != "ahead":
            return 0.0
        return sum(max(0.0, min(stop, end) - start) for _, start, stop in self.buckets)

    @property
    def overlap(self) -> float:
        """The share of the host step that ran before backward ended (0 to 1)."""
        return self.before_backward_end_s / self.host_step_s if self.host_step_s > 0 else 0.0


@dataclass(frozen=True)
class HostStepReport:
    """How an offloaded optimizer's steps ran, counted since the engine was built."""

    ahead: int = 0
    """Steps taken during backward and kept."""
    redone: int = 0
    """Steps taken during backward, then rolled back and taken again after it (the gradients or
    hyperparameters changed after backward: clipping that applied, a hook's edit)."""
    after_backward: int = 0
    """Steps taken after backward only."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Why steps were redone or taken after backward, counted."""
    rollback_bytes: int = 0
    """Host bytes of the rollback copies kept now."""
    last: Optional[HostStepTiming] = None
    content_checks: int = 0
    """Verdicts that compared the gradients' contents (user code may have run between backward and
    the step, so edits no version counter sees were looked for: see [Note: gradient digests] in
    ``grad_digest.py``)."""
    switched_off: str = ""
    """Why stepping during backward is off for the rest of the run, on every rank ("" where it is
    not): the host step, timed after backward in the run's first steps, is too short to hide
    anything (see ``offload/switch_off.py``). Those steps count as taken after backward."""
