"""An offload-overlap run's figures (`--offload-overlap`, `offload_overlap.py`): what each rank timed,
each variant's row, the targets. Written down like the benchmark's (`report.write_all`), as `bench.json`
and `offload_overlap_report.py`'s tables."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_zero.bench.host_bandwidth import HostBandwidth, adamw_step_bytes
from lightning_zero.bench.results import OK, RunReport

SLEEP_PLACES = ("backward", "forward")
"""Where block 0 sleeps: in its backward (after the later blocks' gradients, so a host step running
during backward can hide behind it), or in its forward (before backward starts: nothing to hide behind)."""
CLIPPING: dict[str, Optional[float]] = {"off": None, "on": 1e6, "fires": 1e-6}
"""max_norm of the global-norm clipping between backward and the optimizer step, by name: none; one
no gradient norm reaches (the coefficient is exactly 1, as a step speculated before the norm is known
assumes); one every norm exceeds (the coefficient is below 1 at every step: a speculative step is redone)."""
HOOKS: dict[str, bool] = {"hook": True, "hook_unchecked": False}
"""Settings with a callback-like edit point between backward and the step (user code ran there, no
clipping): whether the verdict compares the gradients' contents, as it does wherever user code runs
(see [Note: gradient digests] in ``engine/offload/grad_digest.py``), or only their version counters, as
for a Trainer without hooks. The content check's cost is the difference between the two."""
SETTINGS = (*CLIPPING, *HOOKS)
"""What runs between backward and the step, by name: a `CLIPPING` setting or a `HOOKS` one."""
CLIPPING_WORDS = {
    "off": "off", "on": "on, not firing", "fires": "on, firing",
    "hook": "off, a hook (content check)", "hook_unchecked": "off, a hook (no content check)",
}  # fmt: skip
RATIO_TARGET = 0.35
"""Issue 53: with `overlap_host_step`, the time exposed after backward with the sleep in backward at
most 0.35x the same with the sleep in forward, with clipping on and off."""


@dataclass(frozen=True)
class ConditionTimes:
    """One rank's timed steps of one condition."""

    overlap_host_step: bool
    """The engine's `ZeroConfig.overlap_host_step`."""
    sleep_in: str
    """One of `SLEEP_PLACES`."""
    clipping: str
    """A `SETTINGS` name: the clipping, or a hook, between backward and the step."""
    exposed_s: tuple[float, ...]
    """Per step: from `loss.backward()` returning to the end of `engine.after_optimizer_step`
    (finish_backward, end_step, the clipping, optimizer.step, after_optimizer_step)."""
    optimizer_step_s: tuple[float, ...]
    """Per step: `optimizer.step()` alone (with overlap off, the whole host step runs inside it)."""
    host_step_s: tuple[float, ...] = ()
    """Per step: the host's time stepping, as the engine reports it (`host_step_report().last`)."""
    host_step_before_backward_end_s: tuple[float, ...] = ()
    """Per step: of that, what ran before backward ended."""
    verdict_s: tuple[float, ...] = ()
    """Per step: the verdict's comparisons at `optimizer.step()` (`host_step_report().last.verdict_s`),
    the content check included where it ran."""


@dataclass(frozen=True)
class OverlapRankMeasurement:
    """What one rank measured for one variant."""

    rank: int
    bandwidth: HostBandwidth
    """The memory probe, run on every rank at once with the rank's threads, before and after the steps:
    the better of the two."""
    stepped_numel: int
    """Elements of the chunks this rank's optimizer steps (its shards, padding included)."""
    hideable_numel: int
    """Of those, the elements in buckets complete before block 0's backward: what a host step during
    backward can step while block 0 sleeps (`offload_overlap._hideable_numel`)."""
    sleep_ms: float
    """The sleep every rank used (agreed: the largest any rank asked for)."""
    times: tuple[ConditionTimes, ...]
    """Every condition, both engines (overlap off first)."""
    final_loss: float
    """The last step's loss: the model trained."""


@dataclass(frozen=True)
class OverlapLine:
    """One engine and clipping setting of a variant: the two sleeps side by side, slowest rank."""

    overlap_host_step: bool
    clipping: str
    exposed_backward_ms: float
    """Median exposed time with the sleep in block 0's backward."""
    exposed_forward_ms: float
    """Median exposed time with the sleep in block 0's forward."""
    optimizer_step_backward_ms: float
    """Median `optimizer.step()` time with the sleep in backward (what is left of the host step there)."""
    optimizer_step_forward_ms: float
    """Median `optimizer.step()` time with the sleep in forward."""
    before_backward_end_ms: float = 0.0
    """With the sleep in backward: median ms of the host step that ran before backward ended (slowest rank)."""
    host_step_ms: float = 0.0
    """With the sleep in backward: median ms of the host step in all (slowest rank)."""
    verdict_ms: float = 0.0
    """With the sleep in backward: median ms of the verdict's comparisons (slowest rank)."""

    @property
    def overlap(self) -> float:
        """The share of the host step that ran before backward ended, with the sleep in backward."""
        return self.before_backward_end_ms / self.host_step_ms if self.host_step_ms > 0 else 0.0

    @property
    def ratio(self) -> float:
        """Exposed with the sleep in backward over exposed with it in forward (issue 53: ≤ 0.35 with overlap)."""
        return self.exposed_backward_ms / self.exposed_forward_ms if self.exposed_forward_ms > 0 else float("nan")


@dataclass(frozen=True)
class HostStep:
    """The whole host step (overlap off, clipping off, sleep in forward: all of it in `optimizer.step()`)
    against the memory's bandwidth, for the node (all ranks step at once)."""

    ms: float
    """Median `optimizer.step()` of the slowest rank."""
    bytes: int
    """AdamW's bytes per step over every rank's chunks (`adamw_step_bytes`: 28 B per fp32 element)."""
    bytes_per_s: float
    """`bytes` over `ms`: what the host step achieved."""
    bandwidth_bytes_per_s: float
    """The probe's bytes/s summed over the ranks (they probed at once)."""
    hideable: float
    """The share of the host step's elements (all ranks) in buckets complete before block 0's backward:
    1 - this is about the least backward / forward can be with overlap (more where work that does not
    overlap follows the step: stage 2's parameter write-back, the clipping's norm)."""

    @property
    def of_bandwidth(self) -> float:
        return self.bytes_per_s / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class OverlapRow:
    """One variant's overlap measurement."""

    name: str
    stage: int
    description: str
    status: str
    """`OK`, or `UNAVAILABLE` / `FAILED` (then `reason` says why and the figures are empty)."""
    reason: Optional[str]
    sleep_ms: Optional[float]
    """The sleep used (given, or sized from the warm-up's host step)."""
    host_step: Optional[HostStep]
    lines: tuple[OverlapLine, ...]
    """overlap off (the baseline: both sleeps give about the same), then on; each clipping setting."""
    ranks: tuple[OverlapRankMeasurement, ...]
    """Every rank's own timings."""
    notes: tuple[str, ...] = ()
    """Targets met or missed."""


@dataclass(frozen=True)
class OverlapResult(RunReport[OverlapRow]):
    """An `--offload-overlap` run: a row per variant (`offload_overlap.py`)."""


def summarize(name: str, stage: int, description: str, ranks: Sequence[OverlapRankMeasurement]) -> OverlapRow:
    """A variant's row from its ranks: per condition the slowest rank's median, the host step against
    the probe, and the targets."""
    lines = tuple(
        _line(ranks, overlap, clipping) for overlap in (False, True) for clipping in SETTINGS
        if _times(ranks[0], overlap, "forward", clipping) is not None
    )  # fmt: skip
    whole = _slowest(ranks, False, "forward", "off", "optimizer_step_s")
    host_bytes = sum(adamw_step_bytes(rank.stepped_numel) for rank in ranks)
    host_step = HostStep(
        ms=whole * 1e3,
        bytes=host_bytes,
        bytes_per_s=host_bytes / whole if whole > 0 else float("nan"),
        bandwidth_bytes_per_s=sum(rank.bandwidth.bytes_per_s for rank in ranks),
        hideable=sum(rank.hideable_numel for rank in ranks) / max(1, sum(rank.stepped_numel for rank in ranks)),
    )
    sleep_ms = ranks[0].sleep_ms
    return OverlapRow(
        name, stage, description, OK, None, sleep_ms, host_step, lines, tuple(ranks), _notes(lines, host_step, sleep_ms)
    )


def _times(rank: OverlapRankMeasurement, overlap: bool, sleep_in: str, clipping: str) -> Optional[ConditionTimes]:
    wanted = (overlap, sleep_in, clipping)
    return next((t for t in rank.times if (t.overlap_host_step, t.sleep_in, t.clipping) == wanted), None)


def _slowest(ranks: Sequence[OverlapRankMeasurement], overlap: bool, sleep_in: str, clipping: str, field: str) -> float:
    """The largest over ranks of each rank's median `field` (seconds) in one condition."""
    return max(statistics.median(getattr(_times(rank, overlap, sleep_in, clipping), field) or (0.0,)) for rank in ranks)


def _line(ranks: Sequence[OverlapRankMeasurement], overlap: bool, clipping: str) -> OverlapLine:
    def ms(sleep_in: str, field: str) -> float:
        return _slowest(ranks, overlap, sleep_in, clipping, field) * 1e3

    return OverlapLine(
        overlap_host_step=overlap,
        clipping=clipping,
        exposed_backward_ms=ms("backward", "exposed_s"),
        exposed_forward_ms=ms("forward", "exposed_s"),
        optimizer_step_backward_ms=ms("backward", "optimizer_step_s"),
        optimizer_step_forward_ms=ms("forward", "optimizer_step_s"),
        before_backward_end_ms=ms("backward", "host_step_before_backward_end_s"),
        host_step_ms=ms("backward", "host_step_s"),
        verdict_ms=ms("backward", "verdict_s"),
    )


def _notes(lines: Sequence[OverlapLine], host_step: HostStep, sleep_ms: float) -> tuple[str, ...]:
    notes = []
    for line in lines:
        if not line.overlap_host_step:
            continue
        verdict = "met" if line.ratio <= RATIO_TARGET else "MISSED"
        notes.append(
            f"target {verdict}: with overlap_host_step, clipping {CLIPPING_WORDS[line.clipping]}, exposed after"
            f" backward with the sleep in backward ≤ {RATIO_TARGET:g}x with it in forward:"
            f" {line.exposed_backward_ms:,.1f} vs {line.exposed_forward_ms:,.1f} ms ({line.ratio:.2f}x)"
        )
    after = {line.clipping: line for line in lines if not line.overlap_host_step}
    for line in lines:
        baseline = after.get(line.clipping)
        if line.overlap_host_step and baseline is not None and baseline.exposed_backward_ms > 0:
            notes.append(
                f"clipping {CLIPPING_WORDS[line.clipping]}: exposed after backward with the sleep in backward, host step"
                f" during backward against after it: {line.exposed_backward_ms:,.1f} vs {baseline.exposed_backward_ms:,.1f} ms"
                f" ({line.exposed_backward_ms / baseline.exposed_backward_ms:.2f}x); the share of the host step before"
                f" backward's end: {line.overlap:.0%}"
            )
    checked = next((line for line in lines if line.overlap_host_step and line.clipping == "hook"), None)
    unchecked = next((line for line in lines if line.overlap_host_step and line.clipping == "hook_unchecked"), None)
    if checked is not None and unchecked is not None:
        added = checked.exposed_backward_ms - unchecked.exposed_backward_ms
        notes.append(
            f"the content check (user code between backward and the step): exposed after backward with the sleep in"
            f" backward {checked.exposed_backward_ms:,.1f} ms with it, {unchecked.exposed_backward_ms:,.1f} ms without"
            f" ({added:+,.1f} ms, {added / host_step.ms:+.0%} of the host step); the verdict itself"
            f" {checked.verdict_ms:,.2f} vs {unchecked.verdict_ms:,.2f} ms"
        )
    if sleep_ms < host_step.ms:
        notes.append(
            f"the sleep ({sleep_ms:,.1f} ms) is shorter than the host step ({host_step.ms:,.1f} ms): not all of it"
            " can hide behind backward here; give a longer --sleep-ms"
        )
    return tuple(notes)
