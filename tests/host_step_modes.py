"""Which way the host step went in the last step, told by two of the engine's ``host_step_report()``s
(tests/test_host_step_edits.py, test_host_step_verdict.py, test_host_step_switch_off.py), and
whether two recorded runs stepped to the same weights."""

from __future__ import annotations

from typing import Any, Optional

import torch

MODES = ("ahead", "redone", "after_backward")


def mode_between(before: Any, after: Any) -> Optional[str]:
    """The mode whose count grew from ``before`` to ``after`` (None before any report, or where none grew)."""
    if after is None:
        return None
    counts = lambda r: (0, 0, 0) if r is None else (r.ahead, r.redone, r.after_backward)  # noqa: E731
    taken = [mode for mode, a, b in zip(MODES, counts(before), counts(after)) if b > a]
    return taken[0] if taken else None


def same_history(a: dict, b: dict) -> bool:
    """Whether two runs' ``history`` (the weights after each step) are bitwise equal, step by step."""
    return len(a["history"]) == len(b["history"]) and all(
        torch.equal(x, y) for xs, ys in zip(a["history"], b["history"]) for x, y in zip(xs, ys)
    )


class StepRecorder:
    """What a test of the host step keeps of a run: the weights after each step (gathered), how each
    step was taken (``mode_between`` consecutive reports) and the last report."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.history: list[list[torch.Tensor]] = []
        self.modes: list[Optional[str]] = []
        self.report = engine.host_step_report()

    def after_step(self, net: torch.nn.Module) -> None:
        with self._engine.gathered():
            self.history.append([p.detach().clone() for p in net.parameters()])
        report = self._engine.host_step_report()
        self.modes.append(mode_between(self.report, report))
        self.report = report

    def results(self) -> dict:
        return {"history": self.history, "modes": self.modes, "report": self.report}
